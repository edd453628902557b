"""The launcher's copies of its ranks' output (`_launch.py`): each line prefixed with
its rank, Gloo's connection chatter dropped, each rank's last lines (and the line naming its
failure) kept to repeat at the end; and how a rank's exit is described."""

from __future__ import annotations

import os
import re
import signal
import threading
from collections import deque

__all__ = ["TAIL_LINES", "FAILURE_LINE", "Tail", "is_gloo_chatter", "Output", "describe"]


# How many of a failed rank's last lines the launcher repeats at the end.
TAIL_LINES = 12
# The line eqxpar.distributed's fail-fast prints when a rank fails: it names the error.
# Repeated last, since JAX's own logs can follow it (a peer closing the coordination service).
FAILURE_LINE = re.compile(r"eqxpar: process \d+ of \d+ failed: ")


class Tail(deque):
    """A rank's last lines, and the line naming its failure, if it printed one."""

    failure: str | None = None


# Gloo prints one of these per connection it makes; they say nothing a user needs. Its
# threads write them concurrently, so pieces of several can share one line.
GLOO_PIECE = re.compile(
    r"\[Gloo\] Rank|\d* ?is connected to \d+ peer ranks\.( Expected number of connected peer ranks is : \d+)?"
)


def is_gloo_chatter(line: str) -> bool:
    rest, found = GLOO_PIECE.subn("", line)
    return found > 0 and rest.strip(" 0123456789") == ""


class Output:
    """Copies one child stream to ours, line by line, each line prefixed with the rank."""

    def __init__(self, stream, out, prefix: str, lock: threading.Lock, show_gloo: bool, tail: Tail):
        self.stream, self.out, self.prefix, self.lock = stream, out, prefix, lock
        self.show_gloo, self.tail = show_gloo, tail
        self.thread = threading.Thread(target=self._copy, daemon=True)
        self.thread.start()

    def _emit(self, line: str) -> None:
        if not line.strip() or (not self.show_gloo and is_gloo_chatter(line)):
            return
        with self.lock:
            if FAILURE_LINE.search(line):
                self.tail.failure = f"{self.prefix}{line}"
            self.tail.append(f"{self.prefix}{line}")
            self.out.write(f"{self.prefix}{line}\n")
            self.out.flush()

    def _copy(self) -> None:
        fd = self.stream.fileno()
        pending = ""
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            # Progress bars redraw with "\r": treat it as a line end so each redraw shows.
            pending += chunk.decode("utf-8", errors="replace")
            *lines, pending = re.split(r"\r\n|\r|\n", pending)
            for line in lines:
                self._emit(line)
        if pending:
            self._emit(pending)


def describe(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with status {returncode}"
