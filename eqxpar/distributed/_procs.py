"""The launcher's ranks as processes (`_launch.py`): killed by the kernel when the
launcher dies, and stopped (SIGTERM, then SIGKILL) when the job ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

__all__ = ["die_with_launcher_preexec", "signal_running", "stop"]


def die_with_launcher_preexec() -> Callable[[], None] | None:
    """A `preexec_fn` that makes the kernel SIGKILL a rank when the launcher dies (Linux
    `prctl(PR_SET_PDEATHSIG)`), so that a launcher killed by SIGKILL, which cannot stop
    its ranks itself, leaves none running; `None` elsewhere. The C function is looked up
    here, in the launcher: the child only calls it between fork and exec."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def arm() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)

    return arm


def signal_running(procs: list[subprocess.Popen], sig: int) -> None:
    """Send `sig` to the process group of every process still running."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass


def stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM every still-running process group, then SIGKILL what is left after `grace_s`."""
    signal_running(procs, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    signal_running(procs, signal.SIGKILL)
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover - unkillable process
            pass
