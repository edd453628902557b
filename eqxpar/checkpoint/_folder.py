"""The checkpoint folder on disk, read with plain file operations (no JAX, no orbax).

A checkpoint eqxpar wrote is a folder `<step>/` (an integer name) holding the file
`meta/eqxpar.json`, the marker: only folders with it count as checkpoints, so that nothing
else in the directory (a user's `3/results.csv`, a `2024/` folder) is ever taken for one,
deleted or changed. Everything here works before JAX starts, so that a recipe can check its
folder before it builds or compiles anything.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, NamedTuple

# Written into every checkpoint's marker; restore refuses a marker of another format.
FORMAT = "eqxpar.checkpoint/2"
# The items (sub-folders) of one checkpoint.
STATE, META, CONFIG, DATA = "state", "meta", "config", "data"
# The one file of the `meta` and `config` items; `meta/eqxpar.json` is the marker.
JSON_FILE = "eqxpar.json"

_STEP_NAME = re.compile(r"(0|[1-9][0-9]*)")
# Orbax writes a checkpoint as `<step>.orbax-checkpoint-tmp-<timestamp>/` and renames it
# when complete; a folder so named is a save that was interrupted.
_UNFINISHED_NAME = re.compile(r"(0|[1-9][0-9]*)\.orbax-checkpoint-tmp(-[0-9]+)?")


def step_dir(directory: str, step: int) -> str:
    return os.path.join(directory, str(step))


def marker(path: str) -> str:
    """The file that makes the folder `path` a checkpoint of eqxpar's."""
    return os.path.join(path, META, JSON_FILE)


def is_own(path: str) -> bool:
    """Whether the folder `path` is a complete checkpoint eqxpar wrote."""
    return os.path.isfile(marker(path))


class Contents(NamedTuple):
    """What a checkpoint directory holds.

    - `steps`: the steps of eqxpar's complete checkpoints, oldest first.
    - `foreign`: folders with step-like (integer) names that eqxpar did not write.
    - `unfinished`: eqxpar's interrupted saves (orbax temporary folders).
    """

    steps: list[int]
    foreign: list[str]
    unfinished: list[str]


def scan(directory: str) -> Contents:
    """List a checkpoint directory (an absent one is empty).

    **Arguments:**

    - `directory`: the checkpoint folder.

    **Returns:**

    Its [`Contents`][].
    """
    steps, foreign, unfinished = [], [], []
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return Contents([], [], [])
    for name in names:
        path = os.path.join(directory, name)
        if not os.path.isdir(path):
            continue
        if _UNFINISHED_NAME.fullmatch(name):
            unfinished.append(path)
        elif _STEP_NAME.fullmatch(name):
            if is_own(path):
                steps.append(int(name))
            else:
                foreign.append(path)
    return Contents(sorted(steps), foreign, unfinished)


def remove_unfinished(directory: str) -> None:
    """Delete the folders of eqxpar's interrupted saves (and nothing else)."""
    for path in scan(directory).unfinished:
        shutil.rmtree(path, ignore_errors=True)


def read_json(path: str) -> Any:
    """The JSON value in the file `path`, or `None` if it is missing or unreadable."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def newest_config(directory: str, steps: list[int]) -> tuple[int, dict[str, Any]] | None:
    """The run config saved with the newest checkpoint that has a readable one.

    **Arguments:**

    - `directory`: the checkpoint folder.
    - `steps`: its checkpoints' steps.

    **Returns:**

    `(step, config)`, or `None` when no checkpoint holds a config.
    """
    for step in sorted(steps, reverse=True):
        config = read_json(os.path.join(step_dir(directory, step), CONFIG, JSON_FILE))
        if isinstance(config, dict):
            return step, config
    return None


def check_free(directory: str, step: int) -> None:
    """Refuse to save checkpoint `step` over one of ours or over a folder eqxpar did not write."""
    path = step_dir(directory, step)
    if is_own(path):
        raise ValueError(
            f"maybe_save: {directory} already holds a checkpoint for step {step}; "
            f"nothing was overwritten. This happens when a run restarts from an older "
            f"checkpoint than the newest: resume from the newest (restore without "
            f"step=), delete {path}, or use another directory."
        )
    if os.path.lexists(path):
        raise ValueError(
            f"maybe_save: {path}, where checkpoint {step} goes, is in the way: eqxpar did "
            f"not write it (no {META}/{JSON_FILE} inside), so it neither "
            f"overwrites nor deletes it. Nothing was written; move it, or keep "
            f"checkpoints in a folder of their own."
        )
