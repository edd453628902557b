"""SIGTERM (a preemption notice) mid-run: the current step is saved, the run stops, resumes bitwise.

Real processes (no mocks): `recipes/multihost.py` with `--checkpoint-dir`, run as one process
and as a 2-process `python -m eqxpar.launch` job (gloo on 127.0.0.1), and `hybrid_gpt` as one
process. Once its first regular
checkpoint is on disk the run gets SIGTERM (the launcher gets it, and passes it on to its
ranks). Every process saves the same step (JAX's preemption sync point agrees on it across
processes), process 0 prints where to resume, and the job exits with status 143. The run
restarted with `--resume` ends bit for bit where an uninterrupted run ends.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from _launch import launch_command

from eqxpar.checkpoint import EXIT_PREEMPTED

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Long enough that the notice lands mid-run; regular checkpoints every few steps slow the
# interrupted run down, and the resumed one saves only at the end.
RECIPES = {
    "multihost": (("--steps", "200", "--batch-size", "32", "--width", "16", "--learning-rate", "0.1"), 10),
    # A GPT recipe: its checkpoints also hold the loss history (data_state) and a PRNG key.
    "hybrid_gpt": (
        (
            "--steps",
            "60",
            "--batch-size",
            "8",
            "--context",
            "16",
            "--layers",
            "1",
            "--dim",
            "32",
            "--sample-chars",
            "0",
        ),
        3,
    ),
}
HINT = re.compile(
    r"eqxpar\.checkpoint: preempted \(SIGTERM\): saved checkpoint (\S+) at step (\d+) and "
    r"stopped \(exit status 143\)\. To continue from it, run again with the same flags and --resume\."
)
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]


def command(recipe, nproc, *flags):
    script = os.path.join(ROOT, "recipes", f"{recipe}.py")
    recipe_flags = RECIPES[recipe][0]
    if nproc == 1:
        return [sys.executable, script, *recipe_flags, *flags]
    return launch_command(nproc, 1, script, *recipe_flags, *flags)


def run(recipe, nproc, *flags, timeout=300):
    done = subprocess.run(command(recipe, nproc, *flags), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


def steps_on_disk(directory):
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit()) if os.path.isdir(directory) else []


def preempt(recipe, nproc, directory, metrics):
    """Start the run; SIGTERM it once its first checkpoint is complete; (status, output, seconds)."""
    every = RECIPES[recipe][1]
    proc = subprocess.Popen(
        command(
            recipe,
            nproc,
            "--checkpoint-dir",
            str(directory),
            "--checkpoint-every",
            str(every),
            "--metrics-out",
            str(metrics),
        ),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300  # start-up and compiling: minutes on a loaded machine
        while every not in steps_on_disk(directory):  # a file on disk, the signal to act on
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "no first checkpoint in time"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        out, _ = proc.communicate(timeout=120)
        return proc.returncode, out, time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# Heavy variants (make test time, 34 s for two processes): every one runs under thorough.
# By default the path (SIGTERM, save the current step, exit 143, resume bitwise) runs in the
# pipeline recipe's SIGTERM test in tests/test_recipe_resume_all.py, and two processes
# resume the multihost recipe in tests/test_checkpoint_multiprocess.py.
@pytest.mark.parametrize(
    "recipe, nproc",
    [
        pytest.param("multihost", 1, marks=pytest.mark.thorough),
        pytest.param("multihost", 2, marks=pytest.mark.thorough),
        pytest.param("hybrid_gpt", 1, marks=pytest.mark.thorough),
    ],
)
def test_sigterm_saves_the_current_step_and_the_resumed_run_ends_bitwise(tmp_path, recipe, nproc):
    directory = tmp_path / "ckpt"
    steps = int(RECIPES[recipe][0][1])
    status, out, seconds = preempt(recipe, nproc, directory, tmp_path / "interrupted.json")
    assert status == EXIT_PREEMPTED, out[-3000:]
    hints = HINT.findall(out)
    assert len(hints) == 1, out[-3000:]  # process 0 says it, once
    path, step = hints[0][0], int(hints[0][1])
    assert path == str(directory / str(step)), hints
    assert RECIPES[recipe][1] < step < steps and steps_on_disk(directory)[-1] == step, (step, steps_on_disk(directory))
    assert not (tmp_path / "interrupted.json").exists()  # it stopped: no final metrics
    if nproc == 2:
        assert "eqxpar.launch: received SIGTERM; passing it on" in out, out[-3000:]
        # Both ranks stopped at the same step (one save, by both), none was killed.
        assert "killed" not in out and "failed" not in out, out[-3000:]

    resumed_metrics = tmp_path / "resumed.json"
    resumed_out = run(
        recipe,
        nproc,
        "--checkpoint-dir",
        str(directory),
        "--checkpoint-every",
        "1000",
        "--resume",
        "--metrics-out",
        str(resumed_metrics),
    )
    assert f"resumed from step {step} " in resumed_out, resumed_out[-3000:]
    straight_metrics = tmp_path / "straight.json"
    run(recipe, nproc, "--metrics-out", str(straight_metrics))
    resumed, straight = json.loads(resumed_metrics.read_text()), json.loads(straight_metrics.read_text())
    assert resumed["resumed_from_step"] == step
    names = (
        ("param_digest", "final_loss", "test_accuracy")
        if recipe == "multihost"
        else ("param_digest", "final_loss", "first_loss", "final_loss_mean10", "val_loss")
    )
    for name in names:
        assert resumed[name] == straight[name], name
    print(
        f"{recipe}, {nproc} process(es): SIGTERM -> checkpoint {step} saved, exit {status} in {seconds:.1f} s; "
        f"resumed bitwise"
    )
