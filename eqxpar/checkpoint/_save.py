"""Writing checkpoints with orbax: the folder's `CheckpointManager`, one checkpoint's items,
and the removal of the checkpoints a restore skipped as unreadable (for `Checkpointer`)."""

from __future__ import annotations

import warnings
from typing import Any

import jax

from . import _folder
from ._folder import CONFIG, DATA, FORMAT, META, STATE

__all__ = ["open_manager", "write", "drop_unreadable"]


def open_manager(directory: str, keep: int | None, async_save: bool) -> Any:
    """orbax's CheckpointManager for `directory`, keeping the newest `keep` of eqxpar's
    checkpoints; process 0 first removes eqxpar's interrupted saves."""
    # orbax is an optional extra: it (and ._orbax) loads on first use, not at import.
    import orbax.checkpoint as ocp

    from ._orbax import OwnSteps

    options = ocp.CheckpointManagerOptions(
        preservation_policy=None if keep is None else ocp.checkpoint_managers.LatestN(n=keep),
        enable_async_checkpointing=async_save,
        create=True,
        step_name_format=OwnSteps(),  # retention and deletion see eqxpar's folders only
        cleanup_tmp_directories=False,  # done below, for eqxpar's temporary folders only
    )
    if jax.process_index() == 0:
        _folder.remove_unfinished(directory)
    return ocp.CheckpointManager(directory, options=options)


def write(manager: Any, step: int, arrays: Any, described: Any, data_text: Any, config: Any) -> None:
    """Save checkpoint `step`: the arrays, eqxpar's marker file with the leaves `described`,
    each process's data state and (when not None) the run's config."""
    # orbax is an optional extra: it (and ._orbax) loads on first use, not at import.
    import orbax.checkpoint as ocp

    from ._orbax import JsonFileSave, PerProcessJsonSave

    meta = {"format": FORMAT, "step": step, "process_count": jax.process_count(), "leaves": described}
    items = {
        STATE: ocp.args.StandardSave(arrays),
        META: JsonFileSave(meta),
        DATA: PerProcessJsonSave(data_text),
    }
    if config is not None:
        items[CONFIG] = JsonFileSave(config)
    manager.save(step, args=ocp.args.Composite(**items), force=True)  # decided by the caller


def drop_unreadable(manager: Any, directory: str, unreadable: list[int]) -> None:
    """Delete the checkpoints at `unreadable` steps (skipped at restore), with a warning
    pointing at the caller's caller (`Checkpointer.maybe_save`'s)."""
    for step in unreadable:
        if step in manager.all_steps():
            warnings.warn(
                f"eqxpar.checkpoint: deleting the unreadable checkpoint "
                f"{_folder.step_dir(directory, step)} (skipped at restore) before "
                f"saving.",
                stacklevel=3,
            )
            manager.delete(step)
