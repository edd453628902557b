"""The two ways a failing process stays quick (see `_failfast.py`): calls to the
coordination service bounded in time, and output flushed before an `os._exit`."""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["bounded", "flush", "start_spare"]


def bounded(fn: Callable[[], Any], timeout_s: float) -> tuple[bool, Any]:
    """Run `fn` on a helper thread; (finished, result or exception) within `timeout_s`.

    A call to a coordination service that has died may block; a failing process must not.
    At interpreter shutdown (the `atexit` hooks), where Python 3.12 and later start no new
    threads, the call goes to the spare thread `start_spare` started beforehand.
    """
    result: list[tuple[bool, Any]] = []
    done = threading.Event()

    def run():
        try:
            result.append((True, fn()))
        except BaseException as e:  # reported to the caller
            result.append((False, e))
        done.set()

    try:
        threading.Thread(target=run, name="eqxpar-failfast-call", daemon=True).start()
    except RuntimeError:  # "can't create new thread at interpreter shutdown"
        if not _spare:
            return False, RuntimeError("no thread to make the call on at interpreter shutdown")
        _spare[0].put(run)
    done.wait(timeout_s)
    if not result:
        return False, TimeoutError(f"no answer within {timeout_s:g} s")
    ok, value = result[0]
    return ok, value


_spare: list[queue.SimpleQueue] = []


def start_spare() -> None:
    """Start the daemon thread that makes `bounded` calls once no new thread can start (one
    per process; calls queue behind a blocked one and time out as it would)."""
    if _spare:
        return
    calls: queue.SimpleQueue = queue.SimpleQueue()

    def serve():
        while True:
            calls.get()()

    threading.Thread(target=serve, name="eqxpar-failfast-spare", daemon=True).start()
    _spare.append(calls)


def flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed stream must not stop the exit
            pass
