"""The fail-fast layer's bounded calls (eqxpar/distributed/_calls.py): a call that answers
returns its result, one that blocks returns a timeout, and at interpreter shutdown, where
Python 3.12 and later start no new thread (every multi-process run ends there, in the
`atexit` hooks), calls go to the spare thread started beforehand instead of failing."""

import threading
import time

from eqxpar.distributed import _calls


def test_a_call_that_answers_and_one_that_blocks():
    assert _calls.bounded(lambda: 7, 1.0) == (True, 7)
    ok, error = _calls.bounded(lambda: 1 / 0, 1.0)
    assert not ok and isinstance(error, ZeroDivisionError)
    start = time.perf_counter()
    ok, error = _calls.bounded(lambda: time.sleep(5), 0.2)
    assert not ok and isinstance(error, TimeoutError) and time.perf_counter() - start < 2


def test_at_shutdown_the_spare_thread_makes_the_call(monkeypatch):
    _calls.start_spare()
    spare = _calls._spare[0]

    def no_new_thread(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", no_new_thread)
    callers = []
    assert _calls.bounded(lambda: callers.append(threading.current_thread().name) or 5, 1.0) == (True, 5)
    assert callers == ["eqxpar-failfast-spare"]
    ok, error = _calls.bounded(lambda: time.sleep(0.5), 0.1)  # blocks the spare a while
    assert not ok and isinstance(error, TimeoutError)
    assert _calls._spare == [spare]  # one spare, however often it is asked for
    _calls.start_spare()
    assert _calls._spare == [spare]


def test_without_a_spare_a_call_at_shutdown_fails_without_blocking(monkeypatch):
    monkeypatch.setattr(_calls, "_spare", [])

    def no_new_thread(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", no_new_thread)
    ok, error = _calls.bounded(lambda: 1, 5.0)
    assert not ok and "no thread" in str(error)
