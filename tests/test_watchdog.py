"""The progress watchdog: a rank that stops taking part without failing ends the job, stacks shown.

Real processes (2 ranks under `python -m eqxpar.launch`, gloo on 127.0.0.1, no mocks) run
tests/_failing_rank.py in mode `hang`: after step 3 rank 1 sleeps instead of joining the next
collective, so rank 0 waits in it for ever and nothing fails. Every rank runs
`eqxpar.distributed.Watchdog(10)`: within its 10 s + 30 s the job must end non-zero, with
every rank's Python stack in the output (rank 1's showing the sleep it is stuck in).
"""

import os
import subprocess
import sys
import time

import pytest
from _launch import launch_command

from eqxpar.distributed import EXIT_PEER_FAILED, Watchdog

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "_failing_rank.py")
TIMEOUT_S = 10
pytestmark = pytest.mark.slow


def test_a_stalled_rank_ends_the_job_with_every_stack_printed():
    proc = subprocess.Popen(
        launch_command(2, 1, SCRIPT, "hang", "1"),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen, stalled_at = [], None
    try:
        for line in proc.stdout:  # start-up may take minutes on a loaded machine: not timed
            seen.append(line)
            if "[rank 1] stalling" in line:
                stalled_at = time.monotonic()
                break
        assert stalled_at is not None, "".join(seen)
        rest, _ = proc.communicate(timeout=TIMEOUT_S + 90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    ended = time.monotonic() - stalled_at
    out = "".join(seen) + rest
    assert proc.returncode not in (0, EXIT_PEER_FAILED), out
    assert f"watchdog: no training step finished in {TIMEOUT_S} s" in out, out
    for rank in (0, 1):
        mine = "\n".join(line for line in out.splitlines() if line.startswith(f"[rank {rank}] "))
        assert f"eqxpar: process {rank} of 2: the Python stack of every thread" in mine, out
        assert "(most recent call first)" in mine and 'File "' in mine, out
    # Where each waits: rank 1 in its sleep, rank 0 in the collective rank 1 never joined.
    assert "[rank 1] eqxpar: process 1 of 2: its main thread waits in <module>" in out, out
    assert "time.sleep(3600)" in out, out
    assert "sync_global_devices" in "\n".join(line for line in out.splitlines() if line.startswith("[rank 0] ")), out
    assert ended < TIMEOUT_S + 30, out
    print(f"stalled rank 1: the watchdog ({TIMEOUT_S} s) ended the job in {ended:.1f} s, status {proc.returncode}")


def test_the_watchdog_refuses_a_timeout_that_is_not_positive():
    for bad in (0, -1, True, "60"):
        with pytest.raises(ValueError, match="Watchdog: timeout_s must be a positive number of seconds"):
            Watchdog(bad)


def run_script(tmp_path, source, timeout=120):
    script = tmp_path / "script.py"
    script.write_text(source)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EQXPAR_", "SLURM_"))}
    env["JAX_PLATFORMS"] = "cpu"
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    return done, time.monotonic() - start


def test_one_process_that_stops_making_progress_prints_its_stack_and_exits_1(tmp_path):
    done, seconds = run_script(
        tmp_path,
        (
            "import time\n"
            "import eqxpar.distributed\n"
            "watchdog = eqxpar.distributed.Watchdog(2)\n"
            "for step in range(3):\n"
            "    watchdog.step_finished(step)\n"
            "print('stuck', flush=True)\n"
            "time.sleep(600)\n"
        ),
    )
    assert done.returncode == 1, done.stderr
    assert "stuck" in done.stdout and seconds < 60, (seconds, done.stderr)
    err = done.stderr
    assert "eqxpar: process 0 of 1: watchdog: no training step finished in 2 s (the last, step 2" in err, err
    assert "its main thread waits in <module>" in err and "time.sleep(600)" in err, err
    assert "(most recent call first)" in err and "raise the timeout (--watchdog-s)" in err, err


def test_a_loop_that_raised_does_not_fire_the_watchdog_later(tmp_path):
    done, seconds = run_script(
        tmp_path,
        (
            "import time\n"
            "import eqxpar.distributed\n"
            "def train():\n"
            "    watchdog = eqxpar.distributed.Watchdog(1)\n"
            "    for step in range(3):\n"
            "        watchdog.step_finished(step)\n"
            "    raise RuntimeError('out of data')\n"
            "try:\n"
            "    train()\n"
            "except RuntimeError:\n"
            "    pass\n"
            "time.sleep(4)  # four timeouts, outside the loop that ended\n"
            "print('still here', flush=True)\n"
        ),
    )
    assert done.returncode == 0 and "still here" in done.stdout, done.stderr
    assert "watchdog" not in done.stderr, done.stderr
