"""The steps of a restore: the target's description, the checkpoints to try, and reading one."""

from __future__ import annotations

import os
import warnings
from typing import Any, NamedTuple

import jax
import numpy as np
from jaxtyping import PyTree

from .._specs import path_str
from ._folder import DATA, FORMAT, META, STATE
from ._leaves import describe, first_difference, first_line, kind, rebuild, restore_target

__all__ = ["Restored", "Target", "target", "candidates", "read_step", "read_newest", "all_processes_agree"]


class Restored(NamedTuple):
    """What [`eqxpar.checkpoint.Checkpointer.restore`][] returns.

    - `state`: the restored PyTree, with the structure, non-array leaves and shardings of
      the `like` tree it was restored into; `like` itself on a fresh start.
    - `step`: the step of the checkpoint restored; `0` on a fresh start.
    - `data_state`: the JSON value saved as `data_state` at that step; `None` on a fresh
      start (or if none was saved).
    """

    state: PyTree
    step: int
    data_state: Any


class Target(NamedTuple):
    """A restore target: `like` flattened, each leaf described, and what orbax reads."""

    leaves: list
    treedef: Any
    described: list[dict[str, Any]]
    reads: list


def target(like: PyTree) -> Target:
    """Describe `like` and check it (shardings present, meshes dividing the shapes) before
    anything is read."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
    described = [describe(path, leaf) for path, leaf in leaves]
    reads = [restore_target(path, leaf) for path, leaf in leaves if kind(leaf) != "static"]
    return Target(leaves, treedef, described, reads)


def candidates(available: list[int], step: int | None, directory: str, like: Target) -> list[int]:
    """The checkpoints to try, newest first: `[step]`, or all; `[]` means a fresh start.

    **Raises:**

    - `ValueError` if `step` is not among them, or on a fresh start with an abstract `like`.
    """
    if step is not None:
        if step not in available:
            raise ValueError(
                f"restore: {directory} holds no complete checkpoint for step {step}; "
                f"complete checkpoints: {sorted(available) or 'none'}. Resume without a "
                f"step to take the newest, or pick one of those."
            )
        return [step]
    if not available:
        abstract = [path_str(p) for p, x in like.leaves if isinstance(x, jax.ShapeDtypeStruct)]
        if abstract:
            raise ValueError(
                f"restore: {directory} holds no checkpoint, so this is a fresh start, but "
                f"`like` is abstract (ShapeDtypeStruct at {abstract[0]}) and cannot serve as "
                f"the initial state. Pass the initialised state as `like`."
            )
    return sorted(available, reverse=True)


def all_processes_agree(ok: bool) -> bool:
    """True only if `ok` holds on every process (so all processes skip the same steps)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.asarray(ok, np.int32))))


def _read(manager, step: int, items: dict[str, Any]) -> tuple[Any, BaseException | None]:
    # orbax is an optional extra: it (and ._orbax) loads on first use, not at import.
    import orbax.checkpoint as ocp

    from ._orbax import IncompatibleCheckpoint

    try:
        return manager.restore(step, args=ocp.args.Composite(**items)), None
    except IncompatibleCheckpoint:
        raise
    except Exception as error:  # any failure to read means unreadable
        return None, error


def _read_meta(manager, step: int, where: str) -> tuple[Any, BaseException | None]:
    # orbax is an optional extra: it (and ._orbax) loads on first use, not at import.
    from ._orbax import JsonFileRestore

    read, error = _read(manager, step, {META: JsonFileRestore()})
    if error is not None:
        return None, error
    meta = read[META]
    if not (
        isinstance(meta, dict)
        and meta.get("format") == FORMAT
        and meta.get("step") == step
        and isinstance(meta.get("leaves"), list)
    ):
        return None, ValueError(f"{where} has no {FORMAT} description of its state")
    return meta, None


def read_step(manager, directory: str, step: int, like: Target) -> tuple[Restored | None, BaseException | None]:
    """Read checkpoint `step` into `like`: `(restored, None)`, or `(None, error)` when it
    cannot be read on some process.

    **Raises:**

    - `ValueError` if it can be read but does not fit `like` (naming the first differing
      leaf), or its data states cannot go to this many processes.
    """
    # orbax is an optional extra: it (and ._orbax) loads on first use, not at import.
    import orbax.checkpoint as ocp

    from ._orbax import PerProcessJsonRestore

    where = f"checkpoint {os.path.join(directory, str(step))}"
    meta, error = _read_meta(manager, step, where)
    if not all_processes_agree(error is None):
        return None, error or RuntimeError("another process could not read it")
    mismatch = first_difference(meta["leaves"], like.described, where)
    if mismatch is not None:
        raise ValueError(
            f"restore: {mismatch} Restore into a tree built like the saved one (same model "
            f"config and optimizer); nothing was changed on disk."
        )
    items = {STATE: ocp.args.StandardRestore(like.reads), DATA: PerProcessJsonRestore()}
    read, error = _read(manager, step, items)
    if not all_processes_agree(error is None):
        return None, error or RuntimeError("another process could not read it")
    state = rebuild(like.leaves, like.treedef, meta["leaves"], read[STATE])
    return Restored(state, step, read[DATA]), None


def read_newest(manager, directory: str, tried: list[int], like: Target, *, exact: bool) -> tuple[Restored, list[int]]:
    """Read the first of `tried` (newest first) that every process can read; warn about
    each one skipped. Returns it and the steps skipped.

    **Raises:**

    - `ValueError` if none can be read, or (`exact`) the one asked for cannot.
    """
    failures, skipped = [], []
    for step in tried:
        restored, error = read_step(manager, directory, step, like)
        if error is None:
            assert restored is not None  # read_step gives a Restored or an error
            return restored, skipped
        where = f"checkpoint {os.path.join(directory, str(step))}"
        failures.append(f"step {step}: {type(error).__name__}: {first_line(error)}")
        if exact:
            raise ValueError(
                f"restore: {where} cannot be read ({failures[-1]}). Nothing was changed on "
                f"disk; resume without a step to fall back to the newest readable one."
            ) from error
        skipped.append(step)
        warnings.warn(
            f"eqxpar.checkpoint: skipping {where}: it cannot be read "
            f"({type(error).__name__}: {first_line(error)}); trying the previous one.",
            stacklevel=4,
        )
    raise ValueError(
        f"restore: none of the {len(tried)} checkpoint(s) in {directory} can be read "
        f"({'; '.join(failures)}). Nothing was changed on disk; start with a new directory "
        f"or restore the files."
    )
