"""What eqxpar adds to orbax: JSON items of its own, and a step listing that sees only its
own checkpoints. Imported on first use, since orbax is an optional extra."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from ._folder import JSON_FILE, is_own

__all__ = [
    "IncompatibleCheckpoint",
    "JsonFileSave",
    "JsonFileRestore",
    "PerProcessJsonHandler",
    "PerProcessJsonSave",
    "PerProcessJsonRestore",
    "OwnSteps",
]


class IncompatibleCheckpoint(ValueError):
    """A checkpoint that is readable but cannot go where it was asked to (bad input)."""


# -- One JSON file per item, written by process 0 (the marker and the run config) ------------


class _SmallFileHandler(ocp.CheckpointHandler):
    """A handler of small files written synchronously: nothing to finalise or close."""

    def metadata(self, directory: epath.Path) -> None:
        return None

    def finalize(self, directory: epath.Path) -> None:
        pass

    def close(self) -> None:
        pass


class JsonFileHandler(_SmallFileHandler):
    """Writes one JSON value as `<item>/eqxpar.json`, from process 0."""

    def save(self, directory: epath.Path, args: JsonFileSave) -> None:
        if jax.process_index() == 0:
            (directory / JSON_FILE).write_text(json.dumps(args.value, allow_nan=False))

    def restore(self, directory: epath.Path, args: JsonFileRestore | None = None) -> Any:
        return json.loads((directory / JSON_FILE).read_text())


@ocp.args.register_with_handler(JsonFileHandler, for_save=True)
@dataclasses.dataclass
class JsonFileSave(ocp.args.CheckpointArgs):
    value: Any


@ocp.args.register_with_handler(JsonFileHandler, for_restore=True)
@dataclasses.dataclass
class JsonFileRestore(ocp.args.CheckpointArgs):
    pass


# -- The per-process data state: one JSON file per process -----------------------------------
#
# A data pipeline that loads per process (grain with per-process sharding) has a different
# position on every process, so each process writes its own file, the way grain's own orbax
# handler does. A restore with the same process count reads its own file; with another
# process count it can only continue if all saved positions are equal (a global position).


def _process_file(index: int, count: int) -> str:
    return f"process_{index}-of-{count}.json"


class PerProcessJsonHandler(_SmallFileHandler):
    """Orbax handler that writes one JSON file per process (small; written synchronously)."""

    def save(self, directory: epath.Path, args: PerProcessJsonSave) -> None:
        path = directory / _process_file(jax.process_index(), jax.process_count())
        path.write_text(args.text)

    def restore(self, directory: epath.Path, args: PerProcessJsonRestore | None = None) -> Any:
        own = directory / _process_file(jax.process_index(), jax.process_count())
        if own.exists():
            return json.loads(own.read_text())
        saved = sorted(directory.glob("process_*-of-*.json"))
        if not saved:
            raise FileNotFoundError(f"no data-state files in {directory}")
        if f"-of-{jax.process_count()}.json" in saved[0].name:
            raise FileNotFoundError(f"{own} is missing")
        states = [json.loads(p.read_text()) for p in saved]
        if any(s != states[0] for s in states[1:]):
            raise IncompatibleCheckpoint(
                f"the checkpoint in {directory.parent} was saved by {len(saved)} processes "
                f"with different data states, and this run has {jax.process_count()} "
                f"process(es), so no process can take over another's data position. "
                f"Resume with the same number of processes, or save a data state that is the "
                f"same on every process (a global position such as the step or sample index)."
            )
        return states[0]


@ocp.args.register_with_handler(PerProcessJsonHandler, for_save=True)
@dataclasses.dataclass
class PerProcessJsonSave(ocp.args.CheckpointArgs):
    text: str


@ocp.args.register_with_handler(PerProcessJsonHandler, for_restore=True)
@dataclasses.dataclass
class PerProcessJsonRestore(ocp.args.CheckpointArgs):
    pass


# -- Which folders are steps -----------------------------------------------------------------


class OwnSteps(ocp.path.step.NameFormat):
    """Orbax's standard `<step>/` names, but only folders holding eqxpar's marker count.

    Orbax lists steps with it (and so decides what its keep-last-K retention deletes, and
    what `delete(step)` removes): any other integer-named folder is invisible to it.
    """

    def __init__(self):
        self._standard = ocp.path.step.standard_name_format()

    def build_name(self, step: int) -> str:
        return self._standard.build_name(step)

    def find_all(self, base_path: epath.PathLike) -> Iterator[ocp.path.step.Metadata]:
        return (m for m in self._standard.find_all(base_path) if is_own(os.fspath(m.path)))

    def find_step(self, base_path: epath.PathLike, step: int) -> ocp.path.step.Metadata:
        found = self._standard.find_step(base_path, step)
        if not is_own(os.fspath(found.path)):
            raise ValueError(f"{found.path} is not a checkpoint written by eqxpar")
        return found
