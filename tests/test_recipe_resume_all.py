"""Checkpoints in the recipes that gained them (issue 23): long_context, pipeline_gpt, your_model.

For each, a run to N steps (saving at N/2 and N) and a run resumed (`--resume`) from its
checkpoint at N/2 (in a copy of its folder without N) end bit for bit alike: every metric
(final and first loss, held-out loss and the `--eval-every` losses after the resume,
parameter digests), and the loss history saved with the last checkpoint. And pipeline_gpt,
stopped by SIGTERM mid-run as a real process, saves its current step, exits 143, and
resumed ends as the uninterrupted run. Shapes are the smallest the recipes allow: the compiles dominate.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
from _recipes import run_recipe

from eqxpar.checkpoint import EXIT_PREEMPTED

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]

# Flags without --steps; N steps in all, N/2 before the resume.
RECIPES = {
    "long_context": (("--seq-len", "32", "--layers", "1", "--dim", "16", "--heads", "2", "--eval-every", "2"), 4),
    # Steps are cheap next to the compile; 40 of them leave SIGTERM time to land mid-run.
    "pipeline_gpt": (
        (
            "--batch-size",
            "8",
            "--microbatches",
            "2",
            "--layers",
            "4",
            "--dim",
            "16",
            "--heads",
            "2",
            "--context",
            "16",
            "--eval-every",
            "10",
        ),
        40,
    ),
    "your_model": (("--batch-size", "4", "--context", "8", "--dim", "16", "--heads", "2", "--layers", "1"), 4),
}
# Checkpoint folders: your_model saves each of its two parts in a folder of its own.
PARTS = {"your_model": ("auto_plan", "split_head")}
# What a resumed run reports differently, by design: where it resumed, and the --eval-every
# losses of its own steps only (checked against the straight run's last ones).
RESUME_KEYS = ("resumed_from_step", "split_head_resumed_from_step", "val_losses")


def run(recipe, tmp_path, steps, directory, *flags):
    return run_recipe(
        recipe, tmp_path, *RECIPES[recipe][0], "--steps", str(steps), "--checkpoint-dir", str(directory), *flags
    )


def loss_histories(recipe, directory, step):
    """The loss histories saved with checkpoint `step` (one per part)."""
    folders = [directory / part for part in PARTS.get(recipe, ("",))]
    return [json.loads((folder / str(step) / "data" / "process_0-of-1.json").read_text()) for folder in folders]


def assert_same_run(recipe, resumed, straight, directories, steps):
    assert {k: v for k, v in resumed.items() if k not in RESUME_KEYS} == {
        k: v for k, v in straight.items() if k not in RESUME_KEYS
    }
    flags = RECIPES[recipe][0]
    if "--eval-every" in flags:  # the held-out losses of the steps after the resume, bit for bit
        every = int(flags[flags.index("--eval-every") + 1])
        assert [row["step"] for row in straight["val_losses"]] == list(range(every, steps + 1, every))
        after = [row for row in straight["val_losses"] if row["step"] > resumed["resumed_from_step"]]
        assert resumed["val_losses"] == after and after
    histories = [loss_histories(recipe, d, steps) for d in directories]
    assert histories[0] == histories[1] and len(histories[0][0]["losses"]) == steps


@pytest.fixture(scope="module")
def straight_runs(tmp_path_factory):
    """Each recipe run to N uninterrupted, saving at N/2 and N; computed on first use."""
    runs = {}

    def get(recipe):
        if recipe not in runs:
            tmp = tmp_path_factory.mktemp(f"{recipe}_straight")
            steps = RECIPES[recipe][1]
            runs[recipe] = (run(recipe, tmp, steps, tmp / "ckpt", "--checkpoint-every", str(steps // 2)), tmp / "ckpt")
        return runs[recipe]

    return get


# your_model trains its dense twin and runs two parity checks per run (the slowest case by
# 2.5x): a heavy variant, so that make test stays near 15 minutes on two cores.
@pytest.mark.parametrize(
    "recipe",
    [pytest.param(r, marks=pytest.mark.thorough) if r == "your_model" else r for r in sorted(RECIPES)],
)
def test_half_run_resumed_equals_the_whole_run_bitwise(recipe, tmp_path, capsys, straight_runs):
    straight, straight_dir = straight_runs(recipe)
    assert straight["resumed_from_step"] == 0
    steps = RECIPES[recipe][1]
    # The straight run's folder as a run stopped at N/2 leaves it (a copy: one run fewer).
    directory = tmp_path / "ckpt"
    shutil.copytree(straight_dir, directory)
    for part in PARTS.get(recipe, ("",)):
        assert sorted(os.listdir(directory / part)) == sorted([str(steps // 2), str(steps)])
        shutil.rmtree(directory / part / str(steps))
    capsys.readouterr()
    resumed = run(recipe, tmp_path, steps, directory, "--checkpoint-every", "1000", "--resume")
    assert f"resumed from step {steps // 2} " in capsys.readouterr().out
    assert resumed["resumed_from_step"] == steps // 2
    if recipe == "your_model":
        assert resumed["split_head_resumed_from_step"] == steps // 2
    assert_same_run(recipe, resumed, straight, (directory, straight_dir), steps)


HINT = re.compile(r"preempted \(SIGTERM\): saved checkpoint (\S+) at step (\d+) and stopped \(exit status 143\)")


def test_sigterm_stops_pipeline_gpt_and_the_resumed_run_ends_bitwise(tmp_path, capsys, straight_runs):
    recipe, every = "pipeline_gpt", 2
    flags, steps = RECIPES[recipe]
    directory = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [
            sys.executable,
            os.path.join("recipes", f"{recipe}.py"),
            *flags,
            "--steps",
            str(steps),
            "--checkpoint-dir",
            str(directory),
            "--checkpoint-every",
            str(every),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300  # start-up and compiling: minutes on a loaded machine
        while not (directory / str(every)).is_dir():  # the first checkpoint, complete
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "no first checkpoint in time"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == EXIT_PREEMPTED, out[-3000:]
    hints = HINT.findall(out)
    assert len(hints) == 1, out[-3000:]
    step = int(hints[0][1])
    assert hints[0][0] == str(directory / str(step)) and every <= step < steps, (hints, steps)

    straight, straight_dir = straight_runs(recipe)
    capsys.readouterr()
    resumed = run(recipe, tmp_path, steps, directory, "--checkpoint-every", "1000", "--resume")
    assert f"resumed from step {step} " in capsys.readouterr().out
    assert resumed["resumed_from_step"] == step
    assert_same_run(recipe, resumed, straight, (directory, straight_dir), steps)
