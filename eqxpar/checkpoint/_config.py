"""The checks a `Checkpointer` makes when it is created, before JAX starts: the folder, the
run config saved with every checkpoint against a resuming run's, and a recipe's flags; and
the numbers its constructor and calls take."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Callable, Collection, Mapping
from typing import Any, NamedTuple, overload

import numpy as np

from .._optional import require
from . import _folder

__all__ = [
    "as_json",
    "compare",
    "check_folder",
    "check_counts",
    "check_int",
    "recipe_settings",
    "Spelling",
    "LIBRARY",
    "FLAGS",
    "RECIPE_FREE_FIELDS",
]

# The recipe flags that may change when a run resumes without making it another run: how
# long to train, where to write and log, how to checkpoint, and the layout (a checkpoint
# restores onto any mesh).
RECIPE_FREE_FIELDS = (
    "steps",
    "metrics_out",
    "devices",
    "mesh",
    "checkpoint_dir",
    "checkpoint_every",
    "resume",
    "watchdog_s",
    "log_dir",
    "log_every",
    "eval_every",
)


class Spelling(NamedTuple):
    """How messages name the settings: as arguments, or as a recipe's flags."""

    directory: str
    resume: str
    setting: Callable[[str, Any], str]  # a field and its value: `dim=64`, `--dim 64`


LIBRARY = Spelling("directory", "resume=True", lambda name, value: f"{name}={value!r}")
FLAGS = Spelling("--checkpoint-dir", "--resume", lambda name, value: f"--{name.replace('_', '-')} {value!r}")


def as_json(config: Any) -> dict[str, Any]:
    """A config (a dataclass instance or a mapping with string keys) as a JSON object, the
    way it comes back from the file (tuples as lists).

    **Raises:**

    - `ValueError` if it is neither, or holds values JSON cannot represent.
    """
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    if not isinstance(config, Mapping):
        raise ValueError(
            f"Checkpointer: config must be a dataclass instance or a mapping, got {type(config).__name__}."
        )
    try:
        return json.loads(json.dumps(dict(config), allow_nan=False))
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"Checkpointer: config must hold JSON values (strings, numbers, booleans, None, "
            f"lists, dicts), since it is saved with every checkpoint; {e}."
        ) from None


def compare(
    saved: Mapping[str, Any],
    current: Mapping[str, Any],
    *,
    step: int,
    where: str,
    shape_fields: Collection[str],
    free_fields: Collection[str],
    spell: Callable[[str, Any], str],
) -> None:
    """Check a resuming run's config against the one saved at `step`.

    Fields in `shape_fields` set array shapes: a difference is an error. Fields in
    `free_fields` may change freely; any other difference is a warning (the run will not
    continue the saved one exactly). Fields only one side has are not compared. `spell`
    writes a field and its value for a message (`--dim 64`, or `dim=64`).

    **Raises:**

    - `ValueError` naming every differing shape field with both values.
    """

    def differs(name: str) -> bool:
        return name in saved and name in current and saved[name] != current[name]

    shapes = [name for name in shape_fields if differs(name)]
    if shapes:
        raise ValueError(
            f"{where}: the checkpoint at step {step} was saved with "
            f"{', '.join(spell(n, saved[n]) for n in shapes)}, and this run has "
            f"{', '.join(spell(n, current[n]) for n in shapes)}: these set the shapes of the "
            f"saved arrays, so the checkpoint cannot be restored. Resume with the saved "
            f"values, or start the new run in another (empty) folder."
        )
    changed = [
        f"{spell(name, current[name])} (saved: {saved[name]!r})"
        for name in current
        if name not in free_fields and name not in shape_fields and differs(name)
    ]
    if changed:
        warnings.warn(
            f"resuming from step {step} with settings that differ from the run that saved it: "
            f"{', '.join(changed)}. The resumed run will not continue that run exactly.",
            stacklevel=4,
        )


def check_folder(
    directory: str,
    *,
    resume: bool,
    config: dict[str, Any] | None,
    shape_fields: Collection[str],
    free_fields: Collection[str],
    spelling: Spelling,
) -> None:
    """The checks of a new `Checkpointer`'s folder: plain file reads, no JAX.

    Warns about folders that look like steps but are not eqxpar's.

    **Raises:**

    - `ValueError` if `directory` is a file, holds checkpoints and `resume` is false, or its
      newest config differs from `config` in `shape_fields`.
    - `ImportError` if orbax-checkpoint is missing.
    """
    # A one-line install hint (eqxpar.recipe.flag_errors prints it as one line), also when the
    # whole `orbax` package is missing; nothing is imported yet.
    purpose = "--checkpoint-dir" if spelling is FLAGS else "eqxpar.checkpoint.Checkpointer"
    require("orbax.checkpoint", package="orbax-checkpoint", extra="checkpoint", purpose=purpose, load=False)
    if os.path.isfile(directory):
        raise ValueError(f"Checkpointer: {directory} is a file; give a folder to hold the checkpoints.")
    contents = _folder.scan(directory)
    if contents.foreign:
        warnings.warn(
            f"eqxpar.checkpoint: {', '.join(contents.foreign)} in the checkpoint folder "
            f"{'are' if len(contents.foreign) > 1 else 'is'} not eqxpar's (no "
            f"{_folder.META}/{_folder.JSON_FILE} inside): left alone, never read, changed or "
            f"deleted.",
            stacklevel=4,
        )
    if contents.steps and not resume:
        raise ValueError(
            f"{spelling.directory} {directory} already holds checkpoints (steps "
            f"{contents.steps}); nothing was overwritten. Pass {spelling.resume} to continue "
            f"from the newest, or give an empty (or new) {spelling.directory} to start a new run."
        )
    saved = _folder.newest_config(directory, contents.steps) if config else None
    if saved is not None and config is not None:  # (saved is None without a config)
        compare(
            saved[1],
            config,
            step=saved[0],
            where=f"{spelling.directory} {directory}",
            shape_fields=shape_fields,
            free_fields=free_fields,
            spell=spelling.setting,
        )


def recipe_settings(cfg: Any) -> dict[str, Any]:
    """The `Checkpointer` arguments a recipe's flags give (see `Checkpointer.from_config`).

    **Raises:**

    - `ValueError` if `cfg` lacks the checkpoint flags or `steps`, `--resume` comes without
      `--checkpoint-dir`, or `--checkpoint-every` is not positive.
    """
    missing = [f for f in ("checkpoint_dir", "checkpoint_every", "resume", "steps") if not hasattr(cfg, f)]
    # is_dataclass(type(cfg)): an instance (a class is no config); and it keeps cfg's type for
    # the checker, which is_dataclass(cfg) would narrow to a bare DataclassInstance.
    if missing or not dataclasses.is_dataclass(type(cfg)):
        raise ValueError(
            f"Checkpointer.from_config needs a dataclass config with the fields of "
            f"eqxpar.recipe.CheckpointFlags and `steps`; missing: {missing or 'not a dataclass'}. "
            f"Derive the Config from CheckpointFlags."
        )
    if cfg.resume and not cfg.checkpoint_dir:
        raise ValueError("--resume needs --checkpoint-dir DIR: the folder to resume from.")
    watchdog = getattr(cfg, "watchdog_s", None)
    if watchdog is not None and (isinstance(watchdog, bool) or not isinstance(watchdog, (int, float)) or watchdog < 0):
        raise ValueError(f"--watchdog-s must be a number of seconds (0: no watchdog), got {watchdog}.")
    every = cfg.checkpoint_every
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(f"--checkpoint-every must be a positive number of steps, got {every}.")
    return {
        "directory": cfg.checkpoint_dir,
        "save_every": every,
        "resume": bool(cfg.resume),
        "config": cfg,
        "free_fields": [f for f in RECIPE_FREE_FIELDS if hasattr(cfg, f)],
        "watchdog_s": watchdog or None,
    }


def check_counts(keep: Any, save_every: Any) -> None:
    """`Checkpointer`'s `keep` (or None) and `save_every`: positive integers."""
    for name, value in (("keep", keep), ("save_every", save_every)):
        if (value is not None or name != "keep") and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise ValueError(
                f"Checkpointer: {name} must be a positive integer"
                f"{' or None (keep all)' if name == 'keep' else ''}, got {value!r}."
            )


@overload
def check_int(value: Any, what: str) -> int: ...
@overload
def check_int(value: Any, what: str, *, none: bool) -> int | None: ...
def check_int(value: Any, what: str, *, none: bool = False) -> int | None:
    """`value` as an `int` if it is a non-negative integer (or None, with `none`); else a
    `ValueError` naming `what`."""
    if value is None and none:
        return None
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{what} must be a non-negative integer{' or None' if none else ''}, got {value!r}.")
    return int(value)
