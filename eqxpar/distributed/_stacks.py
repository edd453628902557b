"""Where a process waits: its stacks, printed when it made no progress.

The progress watchdog (`_watchdog.py`) prints them when its own process stalls, and
fail-fast's watcher (`_failfast.py`) when another process recorded a stall (a failure that
contains `STALL_MARK`), so the output shows where *every* rank waits. Both import this
module, which imports neither.
"""

from __future__ import annotations

import faulthandler
import sys
import threading
import traceback

from ._calls import flush

__all__ = ["STALL_MARK", "dump_stacks"]

STALL_MARK = "made no progress"
"""Part of the failure a stalled process records: other processes dump their stacks on it."""


_dumped = threading.Event()
# Held while a dump is written. Two threads may dump at once: this process's watchdog fires
# while the fail-fast watcher learns that another process stalled too. The second waits for
# the first dump to be complete before it returns (and its caller ends the process), or the
# first dump would be cut off by that exit (seen under load: a rank's own stall line, then
# nothing but its exit).
_dumping = threading.Lock()


def dump_stacks(tag: str) -> None:
    """Print where the main thread waits, then every thread's Python stack, to stderr (once;
    a second call returns when the first call's dump is written, or after 10 s)."""
    acquired = _dumping.acquire(timeout=10.0)
    try:
        if _dumped.is_set():
            return
        _dumped.set()
        _write_stacks(tag)
    finally:
        if acquired:
            _dumping.release()


def _write_stacks(tag: str) -> None:
    flush()
    frames = sys._current_frames()
    main_id = threading.main_thread().ident
    main = None if main_id is None else frames.get(main_id)
    if main is not None:
        innermost = traceback.extract_stack(main)[-1]
        line = f": {innermost.line.strip()}" if innermost.line else ""
        where = f"{innermost.name} ({innermost.filename}:{innermost.lineno}){line}"
        sys.stderr.write(f"{tag}: its main thread waits in {where}\n")
    sys.stderr.write(f"{tag}: the Python stack of every thread (most recent call first):\n")
    flush()
    try:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    except (ValueError, OSError, AttributeError):  # no usable file descriptor: format it ourselves
        for ident, frame in frames.items():
            sys.stderr.write(f"Thread {ident:#x}:\n" + "".join(traceback.format_stack(frame)))
    flush()
