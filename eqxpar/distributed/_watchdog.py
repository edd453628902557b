"""A progress watchdog: when no training step finishes in time, print every stack and end the job.

Fail-fast (`_failfast.py`) ends a job when a process *fails*. A process can also stop
taking part without failing: a deadlock in a data loader, a rank that skipped a collective
and waits in another one, a network that drops packets without closing connections. Every
process then waits, silently, for ever. [`eqxpar.distributed.Watchdog`][] turns that into
an error: the training loop reports each finished step (`step_finished`), and when none is
reported for `timeout_s`, the process

1. prints which step finished last and when, and where its main thread waits (the innermost
   Python frame: the call that blocks);
2. dumps the Python stack of every thread (`faulthandler.dump_traceback`);
3. in a multi-process run, records the stall as the job's failure in the coordination
   service: every other process, whose fail-fast watchdog reads it, dumps its own stacks
   too and ends (status 75), so the output shows where *every* rank waits;
4. ends with status 1.

A `Checkpointer` made with `watchdog_s` (every recipe's, from `--watchdog-s`) runs one and
counts its `maybe_save` calls as finished steps.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import jax

from ._calls import flush
from ._failfast import end_job
from ._stacks import STALL_MARK, dump_stacks

__all__ = ["Watchdog"]


class Watchdog:
    """Ends the job, with every rank's stack printed, when no step finishes within `timeout_s`.

    ```python
    watchdog = eqxpar.distributed.Watchdog(600)  # after eqxpar.distributed.initialize()
    for step in range(steps):
        state = train_step(state, batch(step))
        watchdog.step_finished(step + 1)
    watchdog.close()
    ```

    The clock starts when it is created, so the first step's compilation counts: give
    `timeout_s` room for it. It stops by itself once the function that created it or last
    reported a step (outside eqxpar: the training loop's) has returned or raised, so a loop
    that ends with an exception, or without `close`, does not fire it later. Steps that
    synchronise the processes (any step with a collective) make every process stall
    together when one does, so every process's watchdog sees it; the first to fire records
    it and the others follow (see `eqxpar/distributed/_watchdog.py`).

    **Arguments:**

    - `timeout_s`: the longest a step may take (seconds, positive).

    **Raises:**

    - `ValueError` if `timeout_s` is not positive.
    """

    def __init__(self, timeout_s: float):
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"Watchdog: timeout_s must be a positive number of seconds, got {timeout_s!r}.")
        self.timeout_s = float(timeout_s)
        self.last_step: int | None = None
        self.last_time = self.started = time.monotonic()
        self._mark_caller()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="eqxpar-progress-watchdog", daemon=True)
        self._thread.start()

    def step_finished(self, step: int | None = None) -> None:
        """Report that a training step finished (`step`: its number, for the message)."""
        self.last_step, self.last_time = step, time.monotonic()
        self._mark_caller()

    def _mark_caller(self) -> None:
        """Remember the training loop: the first caller outside eqxpar, and its thread."""
        frame = sys._getframe(2)
        while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] == "eqxpar":
            frame = frame.f_back
        self._loop = None if frame is None else frame.f_code
        self._loop_thread = threading.get_ident()

    def _loop_running(self) -> bool:
        """Whether the training loop's function is still on its thread's stack."""
        frame = sys._current_frames().get(self._loop_thread)
        while frame is not None:
            if frame.f_code is self._loop:
                return True
            frame = frame.f_back
        return self._loop is None

    def close(self) -> None:
        """Stop watching (at the end of training, before the slow parts after it)."""
        self._closed.set()

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _watch(self) -> None:
        while not self._closed.wait(min(1.0, self.timeout_s / 4)):
            if time.monotonic() - self.last_time > self.timeout_s:
                if self._loop_running():  # else: the loop ended (an exception), not stuck
                    self._fire()
                return

    def _fire(self) -> None:
        ago = time.monotonic() - self.last_time
        last = (
            f"the last, step {self.last_step}, finished {ago:.0f} s ago"
            if self.last_step is not None
            else f"none since the watchdog started {ago:.0f} s ago"
        )
        index, count = jax.process_index(), jax.process_count()
        tag = f"eqxpar: process {index} of {count}"
        reason = f"process {index} {STALL_MARK}: no training step finished in {self.timeout_s:g} s ({last})"
        sys.stderr.write(
            f"{tag}: watchdog: no training step finished in {self.timeout_s:g} s ({last}). It, or a "
            f"process it waits for in a collective, is stuck; the stacks follow, then the job ends.\n"
        )
        dump_stacks(tag)
        end_job(  # returns only when fail-fast is not installed (a single process)
            reason,
            f"{tag} failed: {reason}. Ending the whole job: the other processes print their stacks and stop too.",
            1,
            wait_all=True,
        )
        sys.stderr.write(
            f"{tag}: watchdog: ending the process with status 1. If steps are "
            f"legitimately this slow, raise the timeout (--watchdog-s).\n"
        )
        flush()
        os._exit(1)
