"""recipes/llama.py as a user runs it: the default mesh and one device (`--devices 1`, its
own process) train to the same losses; the loss goes down; the exported Hugging Face folder
fine-tunes under another mesh from exactly the model that was exported."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from _recipes import RECIPES, run_recipe

SMALL = ("--steps", "6", "--batch-size", "8", "--context", "16")


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llama")
    return tmp, run_recipe("llama", tmp, *SMALL, "--export-hf", str(tmp / "exported"))


def test_default_mesh_and_one_device_train_the_same(default_run):
    tmp, metrics = default_run
    assert metrics["mesh"] == "data=2,model=4" and len(metrics["losses"]) == 6
    out = tmp / "one_device.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    args = [sys.executable, str(RECIPES / "llama.py"), *SMALL, "--devices", "1", "--metrics-out", str(out)]
    args += ["--export-hf", str(tmp / "one_device_export")]  # in a fresh process: save_hf's imports too
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    one = json.loads(out.read_text())
    assert one["mesh"] == "data=1,model=1"
    # Same weights (init_sharded draws the one-device values), same batches: only the order
    # of float sums differs (psums over data and model), a few ulps per step.
    gap = np.max(np.abs(np.array(metrics["losses"]) - one["losses"]) / np.array(one["losses"]))
    print(f"default mesh vs one device: largest relative loss difference {gap:.1e}")
    np.testing.assert_allclose(metrics["losses"], one["losses"], rtol=1e-5)
    np.testing.assert_allclose(metrics["val_loss"], one["val_loss"], rtol=1e-5)
    assert metrics["start_param_digest"] == one["start_param_digest"]
    # The loss goes down from uniform guessing over the 512 BPE tokens (ln 512 = 6.24) in 6 steps.
    assert metrics["final_loss"] < metrics["first_loss"] - 0.3
    assert metrics["val_loss"] < metrics["start_val_loss"] - 0.3
    assert sorted(os.listdir(tmp / "one_device_export")) == ["config.json", "model.safetensors", "tokenizer.json"]


def test_fine_tune_from_the_export_starts_from_the_exported_model(default_run, tmp_path):
    tmp, trained = default_run
    runs = {}
    # data=3: the 64 held-out rows do not split over 3 batch shards; they stay whole on each.
    for mesh in ("data=1,model=1", "fsdp=4,model=2", "data=3,model=2"):
        flags = ("--steps", "2", "--batch-size", "12", "--context", "16", "--mesh", mesh)
        runs[mesh] = metrics = run_recipe("llama", tmp_path, *flags, "--from-hf", str(tmp / "exported"))
        assert metrics["mesh"] == mesh and metrics["from_hf"] == str(tmp / "exported")
        # The very weights that were exported (the digest of the gathered float32 weights) ...
        assert metrics["start_param_digest"] == trained["param_digest"]
        # ... so the same held-out loss, under another mesh up to float rounding.
        np.testing.assert_allclose(metrics["start_val_loss"], trained["val_loss"], rtol=1e-6)
        # Fine-tuning continues from there, not from a fresh model.
        assert metrics["first_loss"] < trained["first_loss"] - 0.5
    # Loaded into FSDP x TP and hybrid shards, the fine-tuning steps equal one device's.
    one = runs["data=1,model=1"]["losses"]
    for mesh in ("fsdp=4,model=2", "data=3,model=2"):
        np.testing.assert_allclose(runs[mesh]["losses"], one, rtol=1e-5, err_msg=mesh)


def test_export_refuses_a_folder_with_a_checkpoint(default_run, capsys):
    tmp, _ = default_run
    with pytest.raises(SystemExit) as stop:
        run_recipe("llama", tmp, *SMALL, "--export-hf", str(tmp / "exported"))
    assert stop.value.code == 2
    assert "already holds ['config.json', 'model.safetensors']: give a new folder" in capsys.readouterr().err


# Heavy (20-45 s): every other training recipe's bitwise resume runs by default (test_recipe_resume_all).
@pytest.mark.thorough
def test_a_resumed_run_continues_exactly(default_run, tmp_path):
    _, uninterrupted = default_run
    ckpt = ("--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2")
    flags = [f for f in SMALL if f not in ("--steps", "6")]
    run_recipe("llama", tmp_path, *flags, "--steps", "4", *ckpt)
    resumed = run_recipe("llama", tmp_path, *flags, "--steps", "6", *ckpt, "--resume")
    assert resumed["resumed_from_step"] == 4
    assert resumed["losses"] == uninterrupted["losses"]  # the saved history, then the same steps
    assert resumed["param_digest"] == uninterrupted["param_digest"]


def test_context_and_sequence_parallel_mesh_trains_as_the_default_one(default_run, tmp_path, capsys):
    """data=2,context=2,model=2 with --sequence-parallel: every sequence split over context
    (ring attention, zigzag layout, RoPE at global positions) and the positions over model
    between the tensor-parallel layers; the first steps' losses are the default mesh's
    (which the test above holds equal to one device's)."""
    _, default = default_run
    flags = [f for f in SMALL if f not in ("--steps", "6")]
    mesh = "data=2,context=2,model=2"
    # Scanned layers (one compiled block): the same weights as the default run's loop.
    metrics = run_recipe(
        "llama", tmp_path, *flags, "--steps", "2", "--mesh", mesh, "--sequence-parallel", "--scan-layers"
    )
    assert metrics["mesh"] == mesh
    np.testing.assert_allclose(metrics["losses"], default["losses"][:2], rtol=1e-5)
    # A sequence the zigzag layout cannot cut: one line, exit 2, before anything compiles.
    with pytest.raises(SystemExit) as stop:
        run_recipe("llama", tmp_path, *flags, "--context", "10", "--mesh", "data=2,context=2,model=2")
    assert stop.value.code == 2
    assert "context=2 splits each sequence into 4 zigzag chunks" in capsys.readouterr().err
