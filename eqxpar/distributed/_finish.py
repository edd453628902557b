"""A watched finish (point 4 of `_failfast.py`): a process that reached the end of its
script marks itself finished in the coordination service and waits, the fail-fast watchdog
still running, until every process has; one that never does is named."""

from __future__ import annotations

import time
from typing import Any

from ._calls import bounded

__all__ = ["FINISHED_DIR", "wait_for_all_finished"]

FINISHED_DIR = "eqxpar/finished/"  # each process that reached the end of its script


def wait_for_all_finished(
    client: Any, pid: int, count: int, lost_after_s: float, finish_timeout_s: float
) -> str | None:
    """Mark process `pid` finished and wait until all `count` processes are. Returns None
    when they all are (or the coordination service is gone: the rest is left to JAX), else,
    after `finish_timeout_s`, the failure to record: which processes never finished."""
    ok, _ = bounded(lambda: client.key_value_set(f"{FINISHED_DIR}{pid}", "1"), 5.0)
    if not ok:
        return None  # no coordination service: leave the rest to JAX
    start = time.monotonic()
    last_answer = start
    done: set[int] = set()
    while True:
        ok, entries = bounded(lambda: client.key_value_dir_get(FINISHED_DIR), 5.0)
        now = time.monotonic()
        if ok:
            last_answer = now
            done = {int(key.rsplit("/", 1)[-1]) for key, _ in entries}
            if len(done) >= count:
                return None
        elif now - last_answer > lost_after_s:
            return None  # the coordination service is gone: leave the rest to JAX
        if now - start > finish_timeout_s:
            break
        time.sleep(0.2)
    missing = ", ".join(str(p) for p in range(count) if p not in done)
    return (
        f"process {pid} finished its script {finish_timeout_s:g} s ago but "
        f"process(es) {missing} did not: they probably wait in a collective that process "
        f"{pid} skipped (every process must run the same collectives; a process that "
        f"runs out of data should raise, not exit), or they hang"
    )
