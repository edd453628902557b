"""Ctrl-C that works while the main thread is blocked (point 3 of `_failfast.py`).

A SIGINT becomes a `KeyboardInterrupt` only when the main thread runs Python, never while it
is blocked in a collective. Python's C-level handler still writes the signal number to its
wakeup fd: a thread reading that fd notices the Ctrl-C anyway, says so after 3 s, and a
second Ctrl-C ends the job (through the `on_second` the fail-fast state passes).
"""

from __future__ import annotations

import signal
import socket
import threading
from collections.abc import Callable

__all__ = ["start_interrupt_watch", "watch_interrupts"]


def start_interrupt_watch(
    say: Callable[[str], None], tag: str, on_second: Callable[[], None]
) -> tuple[socket.socket, socket.socket] | None:
    """Take Python's signal wakeup fd and start the thread that reads it; return the socket
    pair (to be kept alive), or None when something else (asyncio, ...) uses the wakeup fd.
    Call from the main thread only."""
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    try:
        previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    except (ValueError, OSError):
        previous = None
    if previous == -1:  # nobody else (asyncio, ...) uses the wakeup fd
        threading.Thread(
            target=watch_interrupts, args=(reader, say, tag, on_second), name="eqxpar-interrupt-watch", daemon=True
        ).start()
        return reader, writer
    if previous is not None:
        signal.set_wakeup_fd(previous)
    reader.close()
    writer.close()
    return None


def watch_interrupts(
    wakeup: socket.socket, say: Callable[[str], None], tag: str, on_second: Callable[[], None]
) -> None:
    """SIGINT reaches Python code only when the main thread runs Python, never while it is
    blocked in a collective. Python's C-level handler still writes the signal number to
    the wakeup socket: after a first Ctrl-C that changed nothing, a second one ends the job."""
    interrupts = 0
    hinted = False
    while True:
        try:
            data = wakeup.recv(64)
        except TimeoutError:
            if interrupts == 1 and not hinted:
                hinted = True
                say(
                    f"{tag} received SIGINT but its main thread has not stopped (it is "
                    f"probably blocked in a collective): press Ctrl-C again to end the job."
                )
            continue
        except OSError:
            return
        if not data:
            return
        if signal.SIGINT in data:
            interrupts += 1
            wakeup.settimeout(3.0)
            if interrupts >= 2:
                on_second()
