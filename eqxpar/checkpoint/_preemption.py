"""Preemption: on SIGTERM, save the current step and stop, at the same step in every process.

A cluster scheduler that needs a job's machines back (a preemptible VM, a SLURM job past
its time or preempted by a higher-priority one, Kubernetes evicting a pod) sends SIGTERM
and kills the job a grace period later (30 s is common). A `Checkpointer` made with
`save_on_preemption=True` (every recipe's, through `from_config`) uses that time:

- **one process**: a Python SIGTERM handler only sets a flag; the next
  `maybe_save(step, ...)` sees it, saves checkpoint `step` and stops;
- **several processes**: JAX's preemption notifier (started by
  `jax.distributed.initialize`) already catches SIGTERM, in whichever processes receive it,
  and tells the coordination service, which agrees on one step for all
  (`jax.experimental.multihost_utils.reached_preemption_sync_point`): every process saves
  that same step and stops, even when only one host received the notice.

Stopping means: the checkpoint is written completely, the `Checkpointer` is closed, process
0 prints where to resume, and the process exits with status `EXIT_PREEMPTED` (143, 128 +
SIGTERM) by raising [`eqxpar.checkpoint.Preempted`][] (a `SystemExit`: uncaught, it ends the
script with that status; a script that wants to do more first can catch it).
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import jax

from .._compat import distributed_client
from ..distributed import Watchdog
from ..distributed._failfast import EXIT_PREEMPTED

__all__ = [
    "Preempted",
    "EXIT_PREEMPTED",
    "watch_preemption",
    "unwatch_preemption",
    "preempted",
    "stop_after_save",
    "StepWatch",
]

_flag = threading.Event()  # a SIGTERM arrived (one-process runs)
_watching: list[Any] = []  # one entry per watcher; the first holds SIGTERM's previous handler


class Preempted(SystemExit):
    """Raised by `Checkpointer.maybe_save` after it saved a checkpoint on a preemption notice.

    A `SystemExit` with status `EXIT_PREEMPTED` (143): uncaught, the script ends with that
    status. `step` is the step saved and `path` its checkpoint folder.
    """

    def __init__(self, step: int, path: str):
        super().__init__(EXIT_PREEMPTED)
        self.step, self.path = step, path


def _on_sigterm(signum, frame) -> None:
    _flag.set()


def watch_preemption() -> None:
    """Start noticing preemption (SIGTERM), until as many `unwatch_preemption` calls.

    In a multi-process run nothing is installed: JAX's preemption notifier catches SIGTERM.
    In a single process a Python handler that only sets a flag replaces SIGTERM's default
    (ending the process at once) — only from the main thread, where Python allows it.
    """
    if not _watching:
        _flag.clear()
        previous = None
        if distributed_client() is None and threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, _on_sigterm)
        _watching.append(previous)
    else:
        _watching.append(None)


def unwatch_preemption() -> None:
    """Undo one `watch_preemption`; the last one puts SIGTERM's previous handler back."""
    if not _watching:
        return
    previous = _watching.pop(0) if len(_watching) == 1 else _watching.pop()
    if not _watching and previous is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, previous)


def preempted(step: int) -> bool:
    """Whether to save checkpoint `step` and stop now. Every process must call it after every
    training step, with the same increasing step numbers, in a multi-process run (JAX's
    sync point compares them); it is cheap (no collective)."""
    if distributed_client() is not None:
        from jax.experimental import multihost_utils

        try:
            return bool(multihost_utils.reached_preemption_sync_point(step))
        except RuntimeError:  # JAX's preemption service is off (jax_enable_preemption_service)
            return _flag.is_set()
    return _flag.is_set()


def stop_after_save(step: int, path: str, resume_hint: str, say: Any) -> Preempted:
    """The line saying where to resume (process 0), and the exception that stops the run."""
    if jax.process_index() == 0:
        say(
            f"eqxpar.checkpoint: preempted (SIGTERM): saved checkpoint {path} at step {step} "
            f"and stopped (exit status {EXIT_PREEMPTED}). To continue from it, run again "
            f"with {resume_hint}."
        )
    return Preempted(step, path)


class StepWatch:
    """What `Checkpointer.maybe_save` does first at every step: report the step to the
    progress watchdog (`watchdog_s`, see `eqxpar/distributed/_watchdog.py`) and ask whether a
    preemption notice says to save it and stop (`preemption`)."""

    def __init__(self, preemption: bool, watchdog_s: float | None):
        self.preemption = preemption
        self.watchdog = None if watchdog_s is None else Watchdog(watchdog_s)
        if preemption:
            watch_preemption()

    def step(self, step: int) -> bool:
        """Whether to save `step` and stop (every process, every step)."""
        if self.watchdog is not None:
            self.watchdog.step_finished(step)
        return self.preemption and preempted(step)

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
        if self.preemption:  # SIGTERM's previous handler back, once no one watches
            unwatch_preemption()
            self.preemption = False
