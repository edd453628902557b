"""The one way the tests start a multi-process job: `python -m eqxpar.launch` from the repository
root (real processes, gloo on 127.0.0.1, no mocks).

`launch_command` builds the command line; `run_job` runs it to the end under a hard timeout
(the launcher's own `--timeout-s` plus a margin, so a hung job fails the test instead of
hanging it) and, by default, asserts that every rank exited 0, showing the output's tail if
not.
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch_command(
    nproc: int, devices_per_proc: int, script: str, *args: str, timeout_s: int | None = None
) -> list[str]:
    """`python -m eqxpar.launch --nproc N --devices-per-proc D [--timeout-s T] script args...`;
    `script` relative to the repository root or absolute."""
    limit = [] if timeout_s is None else ["--timeout-s", str(timeout_s)]
    command = ["--nproc", str(nproc), "--devices-per-proc", str(devices_per_proc), *limit]
    return [sys.executable, "-m", "eqxpar.launch", *command, script, *args]


def run_job(
    nproc: int, devices_per_proc: int, script: str, *args: str, timeout_s: int = 150, check: bool = True
) -> subprocess.CompletedProcess:
    """Run the job to its end; with `check`, assert it exited 0."""
    run = subprocess.run(
        launch_command(nproc, devices_per_proc, script, *args, timeout_s=timeout_s),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s + 30,
    )
    if check:
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return run
