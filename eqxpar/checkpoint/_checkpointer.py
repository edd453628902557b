"""`Checkpointer`: one folder of checkpoints, saved every N steps, restored onto any layout."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import jax
from jaxtyping import PyTree

from . import _folder
from ._config import FLAGS, LIBRARY, as_json, check_counts, check_folder, check_int, recipe_settings
from ._leaves import json_text, saved_arrays
from ._preemption import StepWatch, stop_after_save
from ._restore import Restored, candidates, read_newest, target
from ._save import drop_unreadable, open_manager, write

__all__ = ["Checkpointer"]


class Checkpointer:
    """Saves and restores a training state in one folder: one checkpoint per step.

    ```python
    ckpt = eqxpar.checkpoint.Checkpointer("runs/gpt", keep=3, save_every=100)
    state, start, data_state = ckpt.restore(init_state)  # fresh start: (init_state, 0, None)
    for step in range(start, steps):
        state = train_step(state, batch(step))
        ckpt.maybe_save(step + 1, state, force=step + 1 == steps)
    ckpt.close()
    ```

    Every process of a multi-process run creates the same `Checkpointer` and makes the same
    calls in the same order (the calls synchronise the processes); the folder must be one
    that all processes see (a shared file system).

    **Checking the folder at once.** The constructor only reads the folder (it does not
    start JAX), so a script can create its `Checkpointer` first and have a wrong folder
    refused before it builds or compiles anything: checkpoints in it without `resume` are
    a `ValueError`, and with `config` and `shape_fields` so is a newest checkpoint saved
    with other values of the fields that set array shapes.

    **The folder is shared.** A checkpoint is a folder `<step>/` holding eqxpar's marker
    file `meta/eqxpar.json`. Nothing else in the directory is read, changed or deleted:
    other folders with integer names are reported in a warning and left alone (retention,
    the clean-up of interrupted saves and the removal of unreadable checkpoints see only
    eqxpar's own).

    **Saving** ([`maybe_save`][eqxpar.checkpoint.Checkpointer.maybe_save]): every
    `save_every` steps the state is written to `directory/<step>/`, first under a temporary
    name that is renamed when complete, so a run killed half-way through a save leaves the
    previous checkpoints untouched (the unfinished folder is removed the next time a
    `Checkpointer` saves or restores there). Only the newest `keep` checkpoints are kept.

    **Asynchronous saving** (`async_save=True`): `maybe_save` returns as soon as the arrays
    have been copied off the devices; the files are written in a background thread, and
    the arrays may be donated or deleted at once. The next save (and `wait`, `restore`,
    `close`) waits for the previous one to finish. The price is host memory for one copy
    of the state, and a run that dies during the write loses that checkpoint.

    **Restoring** ([`restore`][eqxpar.checkpoint.Checkpointer.restore]) reads the newest
    complete checkpoint into the layout of a `like` tree, whatever layout it was saved from.

    **Arguments:**

    - `directory`: the checkpoint folder (created at the first save or restore). `None`
      turns checkpointing off: `restore` returns `like` at step 0 and `maybe_save` saves
      nothing (for a script whose folder is an optional flag).
    - `keep`: how many of the newest checkpoints to keep; `None` keeps all.
    - `save_every`: `maybe_save` saves at steps that are multiples of this.
    - `async_save`: write checkpoints in the background (see above).
    - `resume`: whether this run continues the checkpoints in the folder. With `False` a
      folder that already holds checkpoints is refused (nothing is overwritten).
    - `config`: the run's settings (a dataclass or a JSON mapping), saved with every
      checkpoint as its own item and compared with the newest saved one when resuming:
      fields that differ give a warning (the run will not continue the saved one exactly).
    - `shape_fields`: fields of `config` that set array shapes (widths, depths, vocabulary
      size): resuming with other values is a `ValueError` here, before anything is built.
    - `free_fields`: fields of `config` that may change when resuming (`steps`, paths).
    - `verbose`: print (process 0) where `restore` resumed from, or that it starts fresh.
    - `save_on_preemption`: on SIGTERM (a scheduler's preemption notice), the next
      `maybe_save` saves its step whatever `save_every` says, at the same step in every
      process, prints (process 0) where to resume, and raises
      [`eqxpar.checkpoint.Preempted`][] (a `SystemExit`, status 143). Call `maybe_save`
      after every step. One process: replaces SIGTERM's default action until `close` (see
      `eqxpar/checkpoint/_preemption.py`). `from_config` turns it on.
    - `watchdog_s`: run a [`eqxpar.distributed.Watchdog`][] that counts `maybe_save` calls
      as finished steps: with none for this long, every process prints its stacks and the
      job ends. `None` (default): none; `from_config` takes `--watchdog-s`.

    **Raises:**

    - `ValueError` if `keep` or `save_every` is not a positive integer, `directory` is a
      file, the folder holds checkpoints and `resume` is `False`, `config` is not JSON,
      `shape_fields` names a field `config` lacks, or the newest checkpoint was saved with
      other values of `shape_fields`.
    - `ImportError` if orbax-checkpoint is not installed (`pip install eqxpar[checkpoint]`).
    """

    def __init__(
        self,
        directory: str | os.PathLike | None,
        *,
        keep: int | None = 3,
        save_every: int = 1,
        async_save: bool = False,
        resume: bool = True,
        config: Any = None,
        shape_fields: Sequence[str] = (),
        free_fields: Sequence[str] = (),
        verbose: bool = False,
        save_on_preemption: bool = False,
        watchdog_s: float | None = None,
    ):
        check_counts(keep, save_every)
        self.keep, self.save_every = keep, save_every
        self.async_save, self.resume, self.verbose = bool(async_save), bool(resume), verbose
        self.directory = None if directory is None else os.path.abspath(os.fspath(directory))
        self._config = None if config is None else as_json(config)
        self._shape_fields, self._free_fields = tuple(shape_fields), tuple(free_fields)
        unknown = [f for f in (*self._shape_fields, *self._free_fields) if f not in (self._config or {})]
        if unknown:
            raise ValueError(
                f"Checkpointer: shape_fields/free_fields name {unknown}, which the config "
                f"does not have{'' if config is not None else ' (no config was given)'}."
            )
        if not hasattr(self, "_spelling"):  # from_config has set the flags' spelling already
            self._spelling = LIBRARY
        self._manager = None  # orbax's CheckpointManager, opened at the first save or restore
        self._unreadable: list[int] = []  # steps restore skipped; removed before the next save
        self._closed = False
        if self.directory is not None:
            check_folder(
                self.directory,
                resume=self.resume,
                config=self._config,
                shape_fields=self._shape_fields,
                free_fields=self._free_fields,
                spelling=self._spelling,
            )
        # Last, once nothing can raise: it may start a thread and take over SIGTERM.
        self._watch = StepWatch(bool(save_on_preemption) and self.enabled, watchdog_s)

    @classmethod
    def from_config(cls, cfg: Any, *, shape_fields: Sequence[str] = (), keep: int | None = 3) -> Checkpointer:
        """The `Checkpointer` of a recipe, from its flags: create it first thing in `main`.

        `cfg` is the recipe's config dataclass, derived from
        [`eqxpar.recipe.CheckpointFlags`][] (`--checkpoint-dir`, `--checkpoint-every`,
        `--resume`) and with a `steps` field. The folder is `--checkpoint-dir` (none: no
        checkpoints), saved every `--checkpoint-every` steps and on SIGTERM
        (`save_on_preemption`), resumed with `--resume`; the whole config is saved with
        each checkpoint. Resuming with other values of
        `shape_fields` is refused; other changed flags give a warning, except those in
        `RECIPE_FREE_FIELDS` (`--steps`, `--mesh`, `--devices`, `--metrics-out` and the
        checkpoint flags). It prints where a restore resumed from. Saves are synchronous,
        so a checkpoint folder that exists is complete.

        **Arguments:**

        - `cfg`: the recipe's parsed config.
        - `shape_fields`: the config fields that set array shapes (e.g. `("dim", "layers")`).
        - `keep`: how many of the newest checkpoints to keep.

        **Returns:**

        The `Checkpointer` (with checkpointing off when `--checkpoint-dir` is not given).

        **Raises:**

        - `ValueError` (before anything touches JAX): `--resume` without
          `--checkpoint-dir`, `--checkpoint-every` not positive, `cfg` without the flags,
          a folder with checkpoints but no `--resume`, or `--resume` onto checkpoints
          saved with other `shape_fields` values.
        """
        self = cls.__new__(cls)
        self._spelling = FLAGS
        cls.__init__(
            self, **recipe_settings(cfg), keep=keep, shape_fields=shape_fields, verbose=True, save_on_preemption=True
        )
        return self

    # -- the folder ---------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        """Whether checkpoints are saved at all (a `directory` was given)."""
        return self.directory is not None

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints in the folder, oldest first.

        **Returns:**

        A sorted list of step numbers (empty without a `directory`). A save still being
        written in the background is not listed until it completes.
        """
        return _folder.scan(self._directory()).steps if self.enabled else []

    def _directory(self) -> str:
        """The folder of an enabled Checkpointer (every caller checked `enabled`)."""
        assert self.directory is not None
        return self.directory

    def _open(self):
        """orbax's CheckpointManager for the folder, created at the first use (JAX runs by
        then); the first opening removes eqxpar's interrupted saves."""
        self._check_open()
        if self._manager is None:
            self._manager = open_manager(self._directory(), self.keep, self.async_save)
        return self._manager

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"Checkpointer for {self.directory} is closed; make a new one.")

    def _say(self, message: str) -> None:
        if self.verbose and jax.process_index() == 0:
            print(message, flush=True)

    # -- saving -------------------------------------------------------------------------------

    def maybe_save(self, step: int, state: PyTree, *, data_state: Any = None, force: bool = False) -> bool:
        """Save `state` as checkpoint `step` if `step` is a multiple of `save_every`.

        Call it after every training step with the number of steps completed so far (so
        that the checkpoint at step `n` holds the state after `n` updates, and a resumed
        run continues with step `n`'s batch).

        **Arguments:**

        - `step`: the number of training steps completed (non-negative).
        - `state`: the PyTree to save (model, optimizer state, PRNG key, ...): the one the
          train step returned (its inputs were donated). Arrays may be sharded over any
          mesh; typed PRNG keys are fine.
        - `data_state`: a JSON value describing the data position (e.g. `{"epoch": 2,
          "index": 1024}`, or a grain iterator's `get_state()`), saved per process, or a
          function returning one, called only when a checkpoint is saved (e.g. to fetch
          metrics from the device). It must survive a JSON round trip unchanged.
        - `force`: save whatever `step` is (e.g. at the last step of a run).

        **Returns:**

        `True` if a checkpoint was saved (or, with `async_save`, started); always `False`
        without a `directory`. After a preemption notice (`save_on_preemption`) it saves
        and raises [`eqxpar.checkpoint.Preempted`][] instead.

        **Raises:**

        - `ValueError`, before anything is written, if a checkpoint for `step` already
          exists (nothing is overwritten) or a folder eqxpar did not write has its name,
          `step` is negative, `data_state` is not JSON, or `state` holds no arrays, a
          traced value (call it outside `jit`) or a deleted array (donated to the train
          step: save the state the step returned), naming the leaf.
        """
        self._check_open()
        step = check_int(step, "maybe_save: step")
        stop = self._watch.step(step)  # every process, every step
        if not self.enabled or (not force and not stop and step % self.save_every):
            return False
        data_text = json_text(data_state() if callable(data_state) else data_state)
        arrays, described = saved_arrays(state)
        manager = self._open()
        drop_unreadable(manager, self._directory(), self._unreadable)
        self._unreadable = []
        _folder.check_free(self._directory(), step)
        write(manager, step, arrays, described, data_text, self._config)  # forced: decided above
        if stop:  # a preemption notice: the checkpoint complete on disk, then stop
            self.close()
            hint = (
                "the same flags and --resume"
                if self._spelling is FLAGS
                else f"a Checkpointer({self.directory!r}, resume=True) and its restore()"
            )
            raise stop_after_save(
                step, _folder.step_dir(self._directory(), step), hint, lambda line: print(line, flush=True)
            )
        return True

    def wait(self) -> None:
        """Block until a save running in the background has been written completely.

        **Returns:**

        Nothing. Raises the error of a background save that failed.
        """
        self._check_open()
        if self._manager is not None:
            self._manager.wait_until_finished()

    # -- restoring ----------------------------------------------------------------------------

    def restore(self, like: PyTree, *, step: int | None = None) -> Restored:
        """Restore a checkpoint into the structure and layout of `like`.

        Each array comes back with the sharding of the corresponding leaf of `like`, so a
        state saved under one mesh restores onto another (data parallel on 8 devices to
        tensor parallel, to a 2-D mesh, to one device): orbax reads, on each process, just
        the pieces its devices need. Values and dtypes come back bit for bit. Non-array
        leaves (functions, Python numbers) are taken from `like`. An array of `like` that
        was never placed explicitly (uncommitted: made by `jnp.zeros`, or by a `jit` of
        such arrays, e.g. an optimizer's `init`) comes back uncommitted on the default
        device, so that `jit` may move it next to arrays on a mesh as it would the original.

        With `step=None` (resuming) it takes the newest complete checkpoint. A newest
        checkpoint that cannot be read (truncated or corrupted files) is skipped with a
        warning and the one before it is used; the skipped one is deleted before the next
        save. When the folder holds no checkpoint (or there is no `directory`), it returns
        `like` unchanged with step 0: a fresh start.

        **Arguments:**

        - `like`: a PyTree with the structure of the saved state: either the freshly
          initialised state already placed on the target mesh, or the same tree with
          `jax.ShapeDtypeStruct(shape, dtype, sharding=...)` leaves for its arrays (e.g.
          from `eqx.filter_eval_shape`, with shardings added), which avoids initialising.
          NumPy leaves restore as NumPy arrays.
        - `step`: restore exactly this step instead of the newest.

        **Returns:**

        A [`eqxpar.checkpoint.Restored`][] `(state, step, data_state)`.

        **Raises:**

        - `ValueError` if `like` does not match the saved state (naming the first leaf
          whose path, shape or dtype differs, with both), if an abstract leaf of `like` has
          no sharding or one whose mesh does not divide its shape (naming the leaf, the
          dimension and the mesh sizes that would), if `step` is given but there is no
          complete, readable checkpoint for it, if there are checkpoints but none can be
          read, or on a fresh start with an abstract `like`. Nothing on disk is changed.
        """
        self._check_open()
        step = check_int(step, "restore: step", none=True)
        if not self.enabled:
            return Restored(like, 0, None)
        wanted = target(like)
        manager = self._open()
        manager.wait_until_finished()
        manager.reload()
        tried = candidates(list(manager.all_steps()), step, self._directory(), wanted)
        if not tried:
            if self.resume:
                self._say(f"no checkpoint in {self.directory}: starting fresh")
            return Restored(like, 0, None)
        restored, self._unreadable = read_newest(manager, self._directory(), tried, wanted, exact=step is not None)
        where = _folder.step_dir(self._directory(), restored.step)
        self._say(f"resumed from step {restored.step} (checkpoint {where})")
        return restored

    # -- closing ------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for a background save to finish, then release orbax's threads.

        Call it at the end of training (or use the `Checkpointer` in a `with` block); a
        process that exits without it may lose a checkpoint still being written.

        **Returns:**

        Nothing.
        """
        if not self._closed:
            if self._manager is not None:
                self._manager.wait_until_finished()
                self._manager.close()
            self._closed = True
            self._watch.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Checkpointer({self.directory!r}, keep={self.keep}, save_every={self.save_every}, "
            f"async_save={self.async_save}, resume={self.resume})"
        )
