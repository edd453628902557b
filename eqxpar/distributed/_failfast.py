"""Fail fast: when one process of a multi-process job fails, every process ends, quickly.

Without this, one failing rank hangs the whole job. Python, on an uncaught exception, prints
the traceback and then runs its exit handlers; one of them is JAX's
`jax.distributed.shutdown`, which waits at a barrier for *every* process. The other
processes are meanwhile waiting in a collective for the failed one, so nobody ever moves
(up to JAX's shutdown timeout, and for ever in a collective that does not notice a dead peer,
such as NCCL's).

[`eqxpar.distributed.initialize`][] therefore installs, in every process of a multi-process
run, four things (see `install_fail_fast`):

1. **Exception hooks** (`sys.excepthook`, `threading.excepthook`). An uncaught exception, in
   the main thread or any other, prints the usual traceback between two lines naming the
   process, records the failure in the coordination service's key-value store (key
   `eqxpar/failure`, first failure wins), flushes the output and ends the process with
   `os._exit` (status 1, 130 for `KeyboardInterrupt`): JAX's shutdown barrier, the part that
   hangs, is skipped.
2. **A watchdog thread** that waits on that key. When another process records a failure,
   the watchdog prints `eqxpar: process i of n stops because process k failed: ...` and ends
   this process with status `EXIT_PEER_FAILED` (75), even
   while the main thread is blocked in a collective. If the coordination service (hosted by
   process 0) stays unreachable for `lost_after_s`, process 0 is gone: the watchdog ends this
   process too.
3. **Ctrl-C that works.** A SIGINT becomes a `KeyboardInterrupt` only when the main thread
   runs Python, never while it is blocked in a collective; a thread fed by Python's signal
   wakeup fd notices it anyway, says so after 3 s, and a second Ctrl-C ends the job.
4. **A watched finish.** A process that reaches the end of its script (or calls `sys.exit(0)`)
   does not go straight to JAX's shutdown barrier, where only JAX's heartbeat would notice a
   failure: an exit handler (run before JAX's) marks it finished and waits, the watchdog
   still running, until every process has finished. If some process has not finished after
   `finish_timeout_s`, it is almost certainly stuck in a collective this one skipped: the
   waiting process records that as the job's failure and exits with status 1. Only then
   does the watchdog stop, before JAX's shutdown.
5. **A failing exit status.** `sys.exit(status)` with a status other than 0 (and other
   than `EXIT_PREEMPTED`, the coordinated exit after a preemption checkpoint) is a failure
   like an exception: the exit handler records it (`process i exited with status N`) and
   ends the process at once with that status, so the others stop within seconds and the
   launcher reports that status. (`sys.exit` is wrapped to see the status; a bare
   `raise SystemExit(N)` is not seen, and waits as in 4.)

The progress watchdog (`_watchdog.py` in this package) records a stalled process through
`end_job`; the watchdog thread of 2. then prints each other process's stacks (`_stacks.py`)
before ending it.

A process that dies without running Python (SIGKILL, the out-of-memory killer, a lost host)
records nothing; the others then learn of it from their next collective, which fails when
the dead peer's connections close (gloo on CPU), or from the coordination service, which
declares a process dead after JAX's heartbeat timeout and terminates all the others.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from .._compat import distributed_client
from ._calls import bounded, flush, start_spare
from ._finish import wait_for_all_finished
from ._interrupt import start_interrupt_watch
from ._stacks import STALL_MARK, dump_stacks

__all__ = ["install_fail_fast", "end_job", "EXIT_PEER_FAILED", "EXIT_PREEMPTED", "FAILURE_KEY"]

EXIT_PEER_FAILED = 75
"""Exit status of a process that ended because *another* process failed (not itself the cause)."""

FAILURE_KEY = "eqxpar/failure"
"""The coordination-service key where the first failing process describes its failure."""

EXIT_PREEMPTED = 143
"""Exit status of a process that saved a checkpoint on a preemption notice (SIGTERM) and stopped;
128 + SIGTERM, as if the signal had ended it. Every process exits with it at the same step."""

_SEEN_DIR = "eqxpar/failure_seen/"  # each survivor confirms it read the failure (for process 0)
_LEAVING_DIR = "eqxpar/leaving/"  # each failing process, just before it exits (for process 0)


def _summary(exc_type: type, exc: BaseException | None) -> str:
    """`RuntimeError: out of data`: the exception's type and the first line of its message."""
    text = "".join(traceback.format_exception_only(exc_type, exc)).strip()
    first = text.splitlines()[0] if text else exc_type.__name__
    return first if len(first) <= 300 else first[:297] + "..."


class _FailFast:
    # Set by install(), around the constructor: what it replaced, and the interrupt watch's
    # socket pair (only when it could take the wakeup fd).
    previous_excepthook: Callable[..., Any]
    previous_thread_excepthook: Callable[..., Any]
    previous_exit: Callable[..., Any]
    wakeup: tuple[socket.socket, socket.socket]

    def __init__(
        self,
        client: Any,
        process_id: int,
        num_processes: int,
        address: str | None,
        poll_s: float,
        lost_after_s: float,
        finish_timeout_s: float,
    ):
        self.client, self.pid, self.count, self.address = client, process_id, num_processes, address
        self.poll_s, self.lost_after_s, self.finish_timeout_s = poll_s, lost_after_s, finish_timeout_s
        self.lock = threading.Lock()  # the first path that ends the process holds it to the end
        self.stopping = threading.Event()  # set when the interpreter exits normally
        self.tag = f"eqxpar: process {process_id} of {num_processes}"
        self.thread: threading.Thread | None = None

    def _say(self, message: str) -> None:
        flush()
        try:
            sys.stderr.write(message + "\n")
        except Exception:
            pass
        flush()

    # --- this process failed -----------------------------------------------------------------

    def _fail(self, what: str, summary: str, print_traceback: Callable[[], None], status: int) -> None:
        with self.lock:
            self._say(f"{self.tag} {what}; ending the whole job (traceback follows).")
            try:
                print_traceback()
            except Exception:
                pass
            hint = ""
            if any(word in summary.lower() for word in ("gloo", "connection", "socket", "nccl")):
                hint = (
                    " (a collective lost its connection to another process, which has "
                    "probably died: see that process's output or the scheduler's)"
                )
            # Said before the coordination service is asked anything: if a dead peer makes JAX
            # abort this process meanwhile, the failure has been named already.
            self._say(
                f"{self.tag} failed: {summary}{hint}. Exiting now instead of waiting for the "
                f"other processes at JAX's shutdown barrier; they stop too."
            )
            ok, earlier = bounded(lambda: self._record(f"process {self.pid} failed: {summary}"), 5.0)
            if ok and earlier:
                self._say(
                    f"{self.tag}: this is probably a consequence of an earlier failure: "
                    f"{earlier}. Exit status {EXIT_PEER_FAILED}."
                )
                os._exit(EXIT_PEER_FAILED)
            if self.pid == 0:  # the others read the failure from our coordination service
                self._wait_until_seen(3.0)
            self._leave(status)

    def _leave(self, status: int) -> None:
        """`os._exit(status)` of a failing process, announced first to process 0: its exit
        ends the coordination service, and a process that loses the service while on its own
        way out is aborted by JAX (SIGABRT) instead of leaving with its status."""
        flush()
        if self.pid != 0:
            bounded(lambda: self.client.key_value_set(f"{_LEAVING_DIR}{self.pid}", str(status)), 2.0)
        os._exit(status)

    def _wait_until_left(self, timeout_s: float) -> None:
        """Process 0, stopping for another's failure: wait until the failing process is on
        its way out (see `_leave`)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ok, leaving = bounded(lambda: self.client.key_value_dir_get(_LEAVING_DIR), 1.0)
            if not ok or leaving:
                return
            time.sleep(0.05)

    def _record(self, text: str) -> str | None:
        """Record our failure; return the failure recorded earlier by another process, if any."""
        try:
            self.client.key_value_set(FAILURE_KEY, text)
            return None
        except Exception as e:
            if "ALREADY_EXISTS" not in str(e):
                return None
            return self.client.key_value_try_get(FAILURE_KEY)

    def _wait_until_seen(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ok, seen = bounded(lambda: self.client.key_value_dir_get(_SEEN_DIR), 1.0)
            if not ok or len(seen) >= self.count - 1:
                return
            time.sleep(0.05)

    def excepthook(self, exc_type, exc, tb) -> None:
        status = 130 if issubclass(exc_type, KeyboardInterrupt) else 1
        self._fail(
            "has an uncaught exception",
            _summary(exc_type, exc),
            lambda: self.previous_excepthook(exc_type, exc, tb),
            status,
        )

    def thread_excepthook(self, args) -> None:
        if issubclass(args.exc_type, SystemExit):  # a thread that asked to end: not a failure
            self.previous_thread_excepthook(args)
            return
        name = args.thread.name if args.thread is not None else "?"
        self._fail(
            f"has an uncaught exception in thread {name!r}",
            _summary(args.exc_type, args.exc_value),
            lambda: self.previous_thread_excepthook(args),
            1,
        )

    # --- another process failed ----------------------------------------------------------------

    def end_job(self, reason: str, message: str, status: int, wait_all: bool = False) -> None:
        """Record `reason` as the job's failure, say `message`, end with `status` (unless an
        earlier failure was recorded: then it is the cause). `wait_all`: every process, not
        only 0, waits until the others read it (the stalled-job case: they print where
        they wait before our exit breaks their collectives and moves their main threads)."""
        with self.lock:
            ok, earlier = bounded(lambda reason=reason: self._record(reason), 5.0)
            if ok and earlier:
                self._say(f"{self.tag} stops because {earlier}. Exiting with status {EXIT_PEER_FAILED}.")
                os._exit(EXIT_PEER_FAILED)
            self._say(message)
            if self.pid == 0 or wait_all:
                self._wait_until_seen(5.0 if wait_all else 3.0)
            self._leave(status)

    def _peer_failed(self, message: str) -> None:
        with self.lock:
            if STALL_MARK in message:  # a stalled job: where this process waits matters too
                dump_stacks(self.tag)
            bounded(lambda: self.client.key_value_set(f"{_SEEN_DIR}{self.pid}", "1"), 2.0)
            self._say(f"{self.tag} stops because {message}. Exiting with status {EXIT_PEER_FAILED}.")
            if self.pid == 0:
                self._wait_until_left(5.0)
            os._exit(EXIT_PEER_FAILED)

    def watch(self) -> None:
        unreachable_since = None
        while not self.stopping.is_set():
            asked = time.monotonic()
            try:
                text = self.client.blocking_key_value_get(FAILURE_KEY, int(self.poll_s * 1000))
            except Exception as e:  # every error is examined below
                if self.stopping.is_set() or distributed_client() is not self.client:
                    return  # normal exit, or the script called jax.distributed.shutdown()
                if "DEADLINE_EXCEEDED" in str(e) or time.monotonic() - asked >= 0.9 * self.poll_s:
                    # The wait ran its full time: no failure recorded yet. Only errors that come
                    # back at once, again and again, say the service is gone; when in doubt,
                    # JAX's heartbeat timeout still ends the process.
                    unreachable_since = None
                    continue
                now = time.monotonic()
                unreachable_since = unreachable_since or now
                if now - unreachable_since >= self.lost_after_s:
                    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
                    self._peer_failed(
                        f"the coordination service at {self.address or '(auto)'}, hosted by process "
                        f"0, has been unreachable for {self.lost_after_s:g} s: process 0 has "
                        f"probably failed (see its output). Last error: {first}"
                    )
                time.sleep(min(self.poll_s, 0.5))
                continue
            self._peer_failed(text)

    # --- Ctrl-C while the main thread is blocked -------------------------------------------------

    def _interrupted(self) -> None:
        """A second Ctrl-C while the main thread is blocked (`_interrupt.py`)."""
        with self.lock:
            reason = f"process {self.pid} was interrupted (SIGINT twice)"
            self._say(f"{self.tag}: interrupted (SIGINT twice); ending the whole job.")
            bounded(lambda reason=reason: self._record(reason), 5.0)
            if self.pid == 0:
                self._wait_until_seen(3.0)
            self._leave(130)

    # --- this process reached the end of its script ---------------------------------------------

    def _finish_together(self) -> None:
        """Wait, watched, until every process finished; if one never does, end the job."""
        reason = wait_for_all_finished(self.client, self.pid, self.count, self.lost_after_s, self.finish_timeout_s)
        if reason is None:
            return
        with self.lock:
            bounded(lambda reason=reason: self._record(reason), 5.0)
            self._say(f"eqxpar: {reason}. Ending the job: exiting with status 1.")
            if self.pid == 0:
                self._wait_until_seen(3.0)
            self._leave(1)

    def exit(self, status: Any = None) -> None:
        """`sys.exit`, remembering the status for `at_exit` (no other hook sees it)."""
        if threading.current_thread() is threading.main_thread():  # a thread's only ends it
            self.exit_status = status
        self.previous_exit(status)

    def at_exit(self) -> None:
        # Every process waits here for the others (the watchdog still running) rather than
        # at JAX's shutdown barrier, where nothing would notice a failure but JAX's heartbeat.
        status = getattr(self, "exit_status", None)
        code = 0 if status is None else int(status) if isinstance(status, int) else 1
        if code not in (0, EXIT_PREEMPTED):  # sys.exit("message") exits with status 1
            detail = "" if isinstance(status, int) else f" ({str(status).strip()[:200]})"
            self.end_job(
                f"process {self.pid} exited with status {code}{detail}",
                f"{self.tag} failed: it called sys.exit({status!r}). Ending the whole job with "
                f"status {code} instead of waiting for the other processes; they stop too.",
                code,
            )
        try:
            self._finish_together()
        finally:
            # The watchdog must be out of JAX's C++ code before the interpreter finalizes: a
            # daemon thread still inside it then aborts the process ("exception not rethrown").
            self.stopping.set()
            if self.thread is not None:
                self.thread.join(self.poll_s + 2.0)


_installed: list[_FailFast] = []


def install_fail_fast(
    client: Any,
    process_id: int,
    num_processes: int,
    address: str | None = None,
    *,
    finish_timeout_s: float = 120.0,
    poll_s: float = 1.0,
    lost_after_s: float = 10.0,
) -> None:
    """Make any failure of this process end the whole job, and a peer's failure end this one.

    Installs the exception hooks, the watchdog thread, the interrupt watch (only when called
    from the main thread) and the watched finish described in this module's docstring.
    [`eqxpar.distributed.initialize`][] calls it for every multi-process run; calling it
    again does nothing.

    **Arguments:**

    - `client`: JAX's coordination-service client of this process.
    - `process_id`, `num_processes`: this process's index and the process count.
    - `address`: the coordinator's address, for messages.
    - `finish_timeout_s`: how long a process that reached the end of its script waits for
      all the others to get there too; after that it records a failure (which ends the
      others) and exits with status 1.
    - `poll_s`: how long one wait of the watchdog on the failure key lasts.
    - `lost_after_s`: how long the coordination service may stay unreachable before the
      watchdog concludes that process 0 is gone and ends this process.

    **Returns:**

    Nothing.
    """
    if _installed:
        return
    start_spare()  # the at-exit calls' thread: at shutdown Python 3.12+ starts none
    state = _FailFast(client, process_id, num_processes, address, poll_s, lost_after_s, finish_timeout_s)
    state.previous_excepthook = sys.excepthook
    state.previous_thread_excepthook = threading.excepthook
    sys.excepthook = state.excepthook
    threading.excepthook = state.thread_excepthook
    state.previous_exit = sys.exit
    sys.exit = state.exit
    # atexit runs handlers last-in first-out: this one runs before JAX's own shutdown.
    atexit.register(state.at_exit)
    state.thread = threading.Thread(target=state.watch, name="eqxpar-failure-watchdog", daemon=True)
    state.thread.start()
    if threading.current_thread() is threading.main_thread():
        wakeup = start_interrupt_watch(state._say, state.tag, state._interrupted)
        if wakeup is not None:
            state.wakeup = wakeup  # kept alive with the state
    _installed.append(state)


def end_job(reason: str, message: str, status: int, *, wait_all: bool = False) -> None:
    """End the whole job from this process: record `reason` as the job's failure, say
    `message` and exit with `status` (with `EXIT_PEER_FAILED` if another process recorded
    a failure first); `wait_all`: wait until every other process has read it, not only
    process 0. Does not return when fail-fast is installed; returns at once when it is not
    (a single process, or `fail_fast=False`)."""
    if _installed:
        _installed[0].end_job(reason, message, status, wait_all)
