"""Training recipes killed with SIGKILL and resumed end bit for bit like runs never interrupted.

A recipe runs as a real subprocess with `--checkpoint-dir --checkpoint-every`; once its second
checkpoint exists on disk it gets SIGKILL; the run resumed with `--resume` (in this process)
must end with the final loss and the parameter digest (SHA-256 of the gathered parameters)
of an uninterrupted run. Also: `--resume` on an empty folder starts fresh, an unreadable
newest checkpoint is skipped with a warning, and bad checkpoint flags, a folder with
checkpoints but no `--resume`, and `--resume` into another model size are refused before
anything is built.
"""

import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _recipes import run_recipe

import eqxpar
import eqxpar.recipe
from eqxpar.checkpoint import Checkpointer
from eqxpar.recipe import CheckpointFlags, parameter_digest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Orbax failing to read the deliberately damaged checkpoint leaves tensorstore callbacks that
# later find its event loop closed: noise, reported as an "unraisable exception".
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

# Small and quick; checkpoints every 5 steps, so the second one is at step 10 and the run
# still has 30 steps (and 6 saves) to go when it is killed.
DP_FLAGS = ("--steps", "40", "--batch-size", "32", "--width", "16", "--learning-rate", "0.2")
DP_EVERY = "5"


def refusal(recipe, tmp_path, capsys, monkeypatch, *flags):
    """Run a recipe that must be refused before it builds anything (its mesh, so its model
    and steps): the message of its `error:` exit (status 2), or of its ValueError."""

    def too_late(*args, **kwargs):
        raise AssertionError("the recipe built its mesh before refusing its flags")

    monkeypatch.setattr(eqxpar, "make_mesh", too_late)
    capsys.readouterr()
    try:
        run_recipe(recipe, tmp_path, *flags)
    except ValueError as e:
        return str(e)
    except SystemExit as e:
        assert e.code == 2, e.code
        return capsys.readouterr().err
    raise AssertionError(f"{recipe} {flags} was not refused")


def checkpoint_steps(directory):
    """The complete checkpoints in `directory` (a folder is renamed to its step when complete)."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


def kill_after_second_checkpoint(recipe, directory, flags, every, timeout=120):
    """Run `recipes/RECIPE.py` as a subprocess; SIGKILL it as soon as its second checkpoint
    (step 2 * every) is complete. Returns the steps of the checkpoints it left."""
    metrics = os.path.join(directory, "killed_metrics.json")
    child = subprocess.Popen(
        [
            sys.executable,
            os.path.join("recipes", f"{recipe}.py"),
            *flags,
            "--checkpoint-dir",
            str(directory),
            "--checkpoint-every",
            every,
            "--metrics-out",
            metrics,
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + timeout
        while not any(s >= 2 * int(every) for s in checkpoint_steps(directory)):
            assert child.poll() is None, f"the run ended before its second checkpoint: {child.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "no second checkpoint in time"
            time.sleep(0.01)
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stderr.close()
    assert not os.path.exists(metrics), "the run finished before it was killed"
    return checkpoint_steps(directory)


@pytest.fixture(scope="module")
def dp_uninterrupted(tmp_path_factory):
    return run_recipe("data_parallel", tmp_path_factory.mktemp("dp_straight"), *DP_FLAGS)


# A heavy variant (make test time): the same SIGKILL-then-resume path as the hybrid GPT's below.
@pytest.mark.slow
@pytest.mark.thorough
def test_killed_data_parallel_run_resumes_bitwise(tmp_path, capsys, dp_uninterrupted):
    directory = tmp_path / "ckpt"
    left = kill_after_second_checkpoint("data_parallel", directory, DP_FLAGS, DP_EVERY)
    newest = left[-1]
    assert 10 <= newest < 40 and newest % 5 == 0, left
    capsys.readouterr()
    resumed = run_recipe(
        "data_parallel",
        tmp_path,
        *DP_FLAGS,
        "--checkpoint-dir",
        str(directory),
        "--checkpoint-every",
        DP_EVERY,
        "--resume",
    )
    assert f"resumed from step {newest} " in capsys.readouterr().out
    assert resumed["resumed_from_step"] == newest
    assert resumed["final_loss"] == dp_uninterrupted["final_loss"]
    assert resumed["param_digest"] == dp_uninterrupted["param_digest"]
    assert resumed["test_accuracy"] == dp_uninterrupted["test_accuracy"]
    assert checkpoint_steps(directory)[-1] == 40  # the last step is always saved


# The hybrid recipe's GPT, small: one block, width 32; checkpoints every 3 steps.
HYBRID_FLAGS = (
    "--steps",
    "21",
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
)
HYBRID_EVERY = "3"


@pytest.mark.slow
def test_killed_hybrid_gpt_run_resumes_bitwise(tmp_path, capsys):
    directory = tmp_path / "ckpt"
    left = kill_after_second_checkpoint("hybrid_gpt", directory, HYBRID_FLAGS, HYBRID_EVERY)
    newest = left[-1]
    assert 6 <= newest < 21, left
    straight = run_recipe("hybrid_gpt", tmp_path, *HYBRID_FLAGS)
    capsys.readouterr()
    resumed = run_recipe(
        "hybrid_gpt",
        tmp_path,
        *HYBRID_FLAGS,
        "--checkpoint-dir",
        str(directory),
        "--checkpoint-every",
        HYBRID_EVERY,
        "--resume",
    )
    assert f"resumed from step {newest} " in capsys.readouterr().out
    assert resumed["resumed_from_step"] == newest and straight["resumed_from_step"] == 0
    # Bit for bit: parameters, the last loss, the loss history (saved with the checkpoint)
    # and the held-out loss.
    for name in ("param_digest", "final_loss", "first_loss", "final_loss_mean10", "val_loss"):
        assert resumed[name] == straight[name], name


@pytest.mark.slow
def test_resume_on_an_empty_folder_starts_fresh_and_repeats_bitwise(tmp_path, capsys, dp_uninterrupted):
    directory = tmp_path / "empty"
    fresh = run_recipe("data_parallel", tmp_path, *DP_FLAGS, "--checkpoint-dir", str(directory), "--resume")
    assert f"no checkpoint in {directory}: starting fresh" in capsys.readouterr().out
    assert fresh["resumed_from_step"] == 0 and checkpoint_steps(directory) == [40]
    # The same seed and flags: the same bits (saving checkpoints changes nothing).
    assert fresh["final_loss"] == dp_uninterrupted["final_loss"]
    assert fresh["param_digest"] == dp_uninterrupted["param_digest"]
    # The digest tells runs apart: another seed trains other parameters.
    other = run_recipe("data_parallel", tmp_path, *DP_FLAGS, "--seed", "1", "--steps", "1")
    assert other["param_digest"] != fresh["param_digest"]


def truncate_arrays(step_dir):
    """Cut every array data file of a checkpoint in half (a copy that stopped short)."""
    for root, _, files in os.walk(os.path.join(step_dir, "state")):
        for name in files:
            path = os.path.join(root, name)
            if os.sep + "d" + os.sep in path:
                data = open(path, "rb").read()
                open(path, "wb").write(data[: len(data) // 2])


@pytest.mark.slow
def test_truncated_newest_checkpoint_is_skipped_with_a_warning(tmp_path, capsys, dp_uninterrupted):
    directory = tmp_path / "ckpt"
    flags = (*DP_FLAGS, "--checkpoint-dir", str(directory), "--checkpoint-every", "10")
    run_recipe("data_parallel", tmp_path, *flags[:1], "20", *flags[2:])  # checkpoints 10 and 20
    assert checkpoint_steps(directory) == [10, 20]
    truncate_arrays(directory / "20")

    # Without --resume a folder with checkpoints is refused; nothing is overwritten.
    with pytest.MonkeyPatch.context() as monkeypatch:
        message = refusal("data_parallel", tmp_path, capsys, monkeypatch, *flags)
    assert re.search(r"already holds checkpoints \(steps \[10, 20\]\).*Pass --resume", message), message
    capsys.readouterr()
    with pytest.warns(UserWarning) as record:
        resumed = run_recipe("data_parallel", tmp_path, *flags, "--resume")
    messages = "\n".join(str(w.message) for w in record)
    assert re.search(r"skipping checkpoint .*20: it cannot be read", messages), messages
    assert re.search(r"deleting the unreadable checkpoint .*20 \(skipped at restore\)", messages), messages
    assert "resumed from step 10 " in capsys.readouterr().out
    assert resumed["resumed_from_step"] == 10
    assert resumed["param_digest"] == dp_uninterrupted["param_digest"]
    assert resumed["final_loss"] == dp_uninterrupted["final_loss"]
    # The unreadable checkpoint was replaced by the resumed run's own step 20.
    assert checkpoint_steps(directory) == [20, 30, 40]


@pytest.mark.slow
def test_resume_with_other_flags_warns_and_with_another_model_size_is_refused(tmp_path, capsys, monkeypatch):
    directory = tmp_path / "ckpt"
    flags = ("--steps", "2", "--batch-size", "32", "--width", "16", "--checkpoint-dir", str(directory))
    run_recipe("data_parallel", tmp_path, *flags)
    with pytest.warns(UserWarning, match=r"--learning-rate 0\.5 \(saved: 0\.05\)") as record:
        run_recipe("data_parallel", tmp_path, *flags, "--steps", "3", "--learning-rate", "0.5", "--resume")
    # --steps may change (training longer is what resuming is for): not warned about.
    assert "--steps" not in str(record[0].message)
    # Another --width changes the arrays' shapes: refused before the mesh is made, let alone
    # the model built or a step compiled, naming the flag with both values.
    message = refusal("data_parallel", tmp_path, capsys, monkeypatch, *flags, "--width", "32", "--resume")
    assert re.search(r"saved with --width 16, and this run has --width 32", message), message
    assert checkpoint_steps(directory) == [2, 3]


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--resume",), "--resume needs --checkpoint-dir"),
        (("--checkpoint-dir", "somewhere", "--checkpoint-every", "0"), "--checkpoint-every must be a positive"),
    ],
)
def test_bad_checkpoint_flags(tmp_path, capsys, monkeypatch, flags, message):
    assert message in refusal("data_parallel", tmp_path, capsys, monkeypatch, *flags)
    assert not os.path.exists("somewhere")  # refused before anything was created


def test_from_config_needs_the_flags():
    @dataclasses.dataclass
    class NoFlags:
        steps: int = 3

    with pytest.raises(ValueError, match="Derive the Config from CheckpointFlags"):
        Checkpointer.from_config(NoFlags())
    # Without --checkpoint-dir nothing is saved and training starts at step 0.
    ckpt = Checkpointer.from_config(dataclasses.make_dataclass("C", [("steps", int, 3)], bases=(CheckpointFlags,))())
    state = {"w": jnp.ones(2)}
    assert ckpt.restore(state) == (state, 0, None)
    assert ckpt.maybe_save(3, state, force=True) is False
    ckpt.close()


def test_parameter_digest_sees_values_not_layouts():
    mesh = eqxpar.make_mesh(data=2, model=4)
    tree = {"w": jnp.arange(32.0).reshape(8, 4), "k": jax.random.key(0), "f": jax.nn.relu}
    split = eqxpar.shard(
        tree, mesh, {"w": jax.sharding.PartitionSpec("model"), "k": jax.sharding.PartitionSpec(), "f": None}
    )
    assert parameter_digest(split) == parameter_digest(tree)
    # One flipped bit, a sign of zero, a dtype, a key: each changes it.
    flipped = np.asarray(tree["w"]).copy()
    flipped.view(np.uint32)[3, 1] ^= 1
    changed = [
        {**tree, "w": flipped},
        {**tree, "w": tree["w"].at[0, 0].set(-0.0)},
        {**tree, "w": tree["w"].astype(jnp.bfloat16)},
        {**tree, "k": jax.random.key(1)},
    ]
    assert len({parameter_digest(t) for t in changed} | {parameter_digest(tree)}) == 5


def test_uncommitted_arrays_restore_uncommitted(tmp_path):
    """An optimizer state made by a jit of uncommitted inputs is uncommitted: jit may move
    it. Restored committed to one device, a compiled step over 8 devices would refuse it
    (the tensor-parallel recipe's resume hit exactly that)."""
    params = {"w": jnp.ones((8, 4))}
    opt_state = jax.jit(optax.adam(1e-2).init)(params)
    key = jax.random.split(jax.random.key(0))[0]
    assert not any(x.committed for x in jax.tree.leaves((opt_state, key)))
    with Checkpointer(tmp_path) as ckpt:
        ckpt.maybe_save(1, (opt_state, key))
        restored, restored_key = ckpt.restore((opt_state, key)).state
    assert not any(x.committed for x in jax.tree.leaves((restored, restored_key)))
    assert restored_key.dtype == key.dtype
    np.testing.assert_array_equal(jax.random.key_data(restored_key), jax.random.key_data(key))
    mesh = eqxpar.make_mesh(model=8)
    w = eqxpar.shard(jnp.ones((8, 4)), mesh, jax.sharding.PartitionSpec("model"))
    step = jax.jit(lambda w, s: w + s[0].count.astype(w.dtype)).lower(w, restored).compile()
    step(w, restored)  # accepted next to arrays on 8 devices


GPT_FLAGS = ("--layers", "1", "--dim", "32", "--context", "16", "--batch-size", "8", "--steps", "6")


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe, flags",
    [
        ("tensor_parallel", ("--dropout", "0.1", "--sample-chars", "0")),  # dropout: the keys must match too
        ("fsdp", ("--mesh", "fsdp=2,model=4")),  # a state split over both axes
    ],
)
def test_gpt_recipes_resume_bitwise(tmp_path, capsys, recipe, flags):
    """A straight 6-step run with checkpoints at 2, 4 and 6; then, as if it had died after
    step 5, its checkpoint 6 removed and the run resumed from 4 (in this process: compiles
    are these recipes' cost, and the kill itself is tested above)."""
    flags = (*GPT_FLAGS, *flags, "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2")
    straight = run_recipe(recipe, tmp_path, *flags)
    shutil.rmtree(tmp_path / "ckpt" / "6")
    capsys.readouterr()
    resumed = run_recipe(recipe, tmp_path, *flags, "--resume")
    assert "resumed from step 4 " in capsys.readouterr().out
    assert resumed["resumed_from_step"] == 4
    # The loss history comes back with the checkpoint: the first loss and the mean of the
    # last 10 too.
    for name in ("first_loss", "final_loss", "final_loss_mean10", "param_digest"):
        assert resumed[name] == straight[name], name
