"""The two ways a failing process stays quick (see `eqxpar/_failfast.py`): calls to the
coordination service bounded in time, and output flushed before an `os._exit`."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["bounded", "flush"]


def bounded(fn: Callable[[], Any], timeout_s: float) -> tuple[bool, Any]:
    """Run `fn` on a helper thread; (finished, result or exception) within `timeout_s`.

    A call to a coordination service that has died may block; a failing process must not.
    """
    result: list[tuple[bool, Any]] = []

    def run():
        try:
            result.append((True, fn()))
        except BaseException as e:  # reported to the caller
            result.append((False, e))

    thread = threading.Thread(target=run, name="eqxpar-failfast-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not result:
        return False, TimeoutError(f"no answer within {timeout_s:g} s")
    ok, value = result[0]
    return ok, value


def flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed stream must not stop the exit
            pass
