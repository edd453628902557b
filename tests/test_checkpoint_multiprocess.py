"""Checkpoints across process counts: saved by 1 process x 8 devices, restored by 2 processes x
4 devices (onto meshes that span both processes), and saved by 2 x 4, restored by 1 x 8; and
the multihost recipe checkpointed by 2 processes, resumed by one.

The two processes are real, started by `python -m eqxpar.launch` (tests/_checkpoint_processes.py);
every restored value is compared byte for byte with the state that was saved.
"""

import json
import os

import jax
import numpy as np
import pytest
from _checkpoint_processes import LAYOUTS, SAVED_BY_ONE, SAVED_BY_TWO, STEP, host_values, make_state
from _launch import run_job
from _recipes import run_recipe

import eqxpar
from eqxpar.checkpoint import Checkpointer
from eqxpar.testing import assert_trees_close


def as_bytes(values):
    return {k: np.asarray(v).reshape(-1).view(np.uint8) for k, v in values.items()}


@pytest.fixture(scope="module")
def two_process_job(tmp_path_factory):
    """Save in this process (1 x 8), then run the 2 x 4 job that restores it and saves its own."""
    directory = tmp_path_factory.mktemp("across_processes")
    sizes, specs = LAYOUTS["data2_model4"]
    saved = make_state(1, eqxpar.make_mesh(**sizes), specs)
    with Checkpointer(directory / SAVED_BY_ONE) as ckpt:
        ckpt.maybe_save(STEP, saved, data_state={"index": 64})
    run = run_job(2, 4, os.path.join("tests", "_checkpoint_processes.py"), str(directory))
    assert "[rank 1] done process 1 of 2: 4 local / 8 global cpu devices" in run.stdout, run.stdout[-2000:]
    ranks = [json.loads((directory / f"rank{r}.json").read_text()) for r in range(2)]
    return directory, host_values(saved), ranks


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_saved_by_one_process_restored_by_two(two_process_job, layout):
    directory, saved, ranks = two_process_job
    for rank, report in enumerate(ranks):
        got = report[layout]
        assert (got["step"], got["data_state"]) == (STEP, {"index": 64}), (rank, got)
        # Each process checked every array against the state rebuilt from the seed, ...
        assert got["equal"] == dict.fromkeys(saved, True), (rank, got)
        # ... on arrays laid out as the target asked, over devices of both processes.
        assert got["shardings_as_like"] and got["spans_processes"], (rank, got)
        assert got["key_dtype"] == "key<fry>"
    # And here, against the very state this process saved: byte for byte.
    restored = dict(np.load(directory / f"restored_{layout}.npz"))
    expected = as_bytes(saved)
    assert restored.keys() == expected.keys()
    for name in expected:
        np.testing.assert_array_equal(restored[name], expected[name], err_msg=f"{layout}: {name}")


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_saved_by_two_processes_restored_by_one(two_process_job, layout):
    directory, _, _ = two_process_job
    sizes, specs = LAYOUTS[layout]
    mesh = eqxpar.make_mesh(**sizes)
    like = make_state(100, mesh, specs)
    with Checkpointer(directory / SAVED_BY_TWO) as ckpt:
        restored = ckpt.restore(like)
    assert (restored.step, restored.data_state) == (STEP, {"index": 128})
    assert [x.sharding for x in jax.tree.leaves(restored.state)] == [x.sharding for x in jax.tree.leaves(like)]
    got, expected = as_bytes(host_values(restored.state)), as_bytes(host_values(make_state(2, mesh, specs)))
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=f"{layout}: {name}")
    # The comparison can fail: the state restored from the 1 x 8 save is another one.
    other = as_bytes(host_values(make_state(1, mesh, specs)))
    assert not np.array_equal(got["w"], other["w"])


@pytest.mark.slow
def test_multihost_recipe_resumes_with_another_process_count(tmp_path, capsys):
    """recipes/multihost.py checkpointed by 2 processes x 4 devices, resumed by this process
    (1 x 8): the run goes on from the saved step, to the losses of a run never interrupted."""
    flags = (
        "--steps",
        "4",
        "--batch-size",
        "64",
        "--learning-rate",
        "0.2",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--checkpoint-every",
        "2",
    )
    run_job(2, 4, "recipes/multihost.py", *flags, "--metrics-out", str(tmp_path / "two.json"))
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["2", "4"]
    capsys.readouterr()
    resumed = run_recipe("multihost", tmp_path, *flags, "--steps", "6", "--resume")
    assert "resumed from step 4 " in capsys.readouterr().out
    straight = run_recipe("multihost", tmp_path, *flags[:6], "--steps", "6")
    assert (resumed["resumed_from_step"], resumed["processes"], straight["resumed_from_step"]) == (4, 1, 0)
    # The same values restored; the 2-process steps summed their gradients across processes
    # in another order than one process does, so the last bits may differ (as between the
    # two in tests/test_distributed.py).
    assert_trees_close(
        np.array([resumed["final_loss"], resumed["test_accuracy"]]),
        np.array([straight["final_loss"], straight["test_accuracy"]]),
        what="resumed on 1 process vs never interrupted",
    )
    # ... and the comparison can fail: two more steps move the loss far more than rounding.
    at_step_4 = json.loads((tmp_path / "two.json").read_text())
    assert at_step_4["processes"] == 2 and abs(straight["final_loss"] - at_step_4["final_loss"]) > 1e-3
