"""`recipes/hybrid_gpt.py --layout auto`: the planner chooses the mesh and remat for the
devices present, prints its table, and the run trains to the losses of a plain one-device
Equinox + optax loop (no eqxpar step builder, no planner); its predicted collective bytes
equal the compiled step's; bad input ends before anything compiles, naming the memory or
batch that would work."""

import dataclasses
import functools
import json
import os
import subprocess
import sys
import types

import jax
import numpy as np
import pytest
from _recipes import RECIPES, load_recipe, run_recipe
from _reference import assert_reference_losses, recipe_text, text_reference_losses

import eqxpar
import eqxpar.nn
import eqxpar.recipe
from eqxpar.inspect import MemoryReport
from eqxpar.models import GPT

STEPS, BATCH, CONTEXT, SEED, LR = 4, 8, 16, 0, 3e-3
SMALL = ("--steps", str(STEPS), "--batch-size", str(BATCH), "--context", str(CONTEXT), "--sample-chars", "0")
# The recipe's defaults for the model's shape: 2 blocks of width 64, 8 heads.
DIM, HEADS, LAYERS = 64, 8, 2


def reference_losses() -> dict[str, float]:
    """The recipe's run written out plainly on one device: its weights (the first of three
    keys split from the seed), its batches of packed rows, AdamW, the held-out metrics
    (`text_reference_losses`)."""
    vocab = recipe_text(CONTEXT).vocab_size
    model = GPT(vocab, CONTEXT, DIM, HEADS, LAYERS, key=jax.random.split(jax.random.key(SEED), 3)[0])
    return text_reference_losses(model, seq=CONTEXT, batch=BATCH, steps=STEPS, seed=SEED, lr=LR)


@pytest.fixture(scope="module")
def reference():
    return reference_losses()


def test_layout_auto_on_8_devices_prints_the_plans_and_equals_one_device(tmp_path, capsys, reference):
    metrics = run_recipe("hybrid_gpt", tmp_path, "--layout", "auto", *SMALL)
    out = capsys.readouterr().out
    assert "--layout auto: 5 fastest of the data x model layouts on 8 simulated CPU devices (4 GB each)" in out
    start = out.index("\nlayout ")
    table = out[start : out.index("\n\n", start + 1)]
    peak = f"peak per device predicted {metrics['predicted_peak_bytes']:,} bytes"
    peak += f", compiled {metrics['compiled_peak_bytes']:,}"
    assert f"\nlayout {metrics['layout']}: {peak}" in out  # printed after the compile, before training
    rows = table.strip().splitlines()[2:]  # under the header and its rule
    assert len(rows) == 5 and "step us" in table and "compute-bound" in rows[0]
    assert rows[0].startswith(metrics["layout"] + " ")  # the first plan is the one that ran
    sizes = dict(item.split("=") for item in metrics["mesh"].split(","))
    assert metrics["layout"].startswith(",".join(f"{a}={n}" for a, n in sizes.items() if n != "1"))
    assert metrics["remat"] in metrics["layout"]
    # The planner's collective bytes are exact: the compiled step moves what it predicted.
    assert metrics["compiled_comm_bytes"] > 0
    assert metrics["predicted_comm_bytes"] == metrics["compiled_comm_bytes"]
    # The peak: a temporaries estimate calibrated on GPU steps; this toy is within the
    # bound the planner's page states for CPU (0.5-3x).
    assert 0.5 < metrics["compiled_peak_bytes"] / metrics["predicted_peak_bytes"] < 3
    assert_reference_losses(metrics, reference)


@pytest.mark.thorough  # a fresh interpreter and compile (~10 s of CPU); the 8-device run takes the same path
def test_layout_auto_on_one_device(tmp_path, reference):
    # A fresh process: this one already has 8 simulated devices.
    out = tmp_path / "metrics.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    args = [sys.executable, str(RECIPES / "hybrid_gpt.py"), "--layout", "auto", "--devices", "1", *SMALL]
    run = subprocess.run([*args, "--metrics-out", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "one device remat=none" in run.stdout.split("mesh {")[0]
    metrics = json.loads(out.read_text())
    assert metrics["mesh"] == "data=1,model=1" and metrics["layout"] == "one device remat=none"
    assert metrics["predicted_comm_bytes"] == metrics["compiled_comm_bytes"] == 0
    assert_reference_losses(metrics, reference)


def recipe_error(capsys, *flags: str) -> str:
    with pytest.raises(SystemExit) as stop:
        load_recipe("hybrid_gpt").main(["--layout", "auto", *SMALL, *flags])
    assert stop.value.code == 2
    return capsys.readouterr().err


def test_a_memory_nothing_fits_names_the_memory_that_would(capsys):
    err = recipe_error(capsys, "--memory-per-device", "0.0001")
    assert "fits --memory-per-device 0.0001 (GB)" in err
    least = float(err.split("Give --memory-per-device ")[1].split()[0])
    assert 0.0001 < least < 0.01
    # That memory is enough: the planner finds a layout there, and none just below it.
    config = eqxpar.models.GPTConfig(context=CONTEXT, dim=DIM, heads=HEADS, layers=LAYERS)
    vocab = recipe_text(CONTEXT).vocab_size  # the recipe's tokenizer's
    common = dict(batch=BATCH, vocab_size=vocab, axes=("data", "model"), sequence_parallel=(False,))
    common.update(dtype=np.float32, top=None)
    fits = eqxpar.plan.plan(config, cluster=eqxpar.recipe.local_cluster(least * 1e9), **common)
    assert fits and all(p.memory.peak <= least * 1e9 for p in fits)
    with pytest.raises(ValueError, match="fits"):
        eqxpar.plan.plan(config, cluster=eqxpar.recipe.local_cluster(min(p.memory.peak for p in fits) - 1), **common)


@pytest.mark.thorough  # two recipe runs and a compile (~8 s); the stop's logic runs by default below
def test_a_plan_whose_compiled_step_does_not_fit_stops_before_training(capsys, tmp_path):
    """The planner's peak is an estimate; the compiled step's decides. At the least memory
    any layout is predicted to need, the one plan that fits is chosen, and XLA:CPU's program
    for it needs more than predicted (this toy's fixed costs): the recipe stops after the
    compile, before the first step, writing nothing, and names the memory that would do."""
    least = recipe_error(capsys, "--memory-per-device", "0.0001").split("Give --memory-per-device ")[1].split()[0]
    checkpoints, metrics = tmp_path / "ckpt", tmp_path / "metrics.json"
    flags = ("--memory-per-device", least, "--checkpoint-dir", str(checkpoints), "--metrics-out", str(metrics))
    err = recipe_error(capsys, *flags)
    assert "whose predicted peak" in err and f"fits {least} GB, but its compiled step needs" in err
    predicted = int(err.split("predicted peak (")[1].split()[0].replace(",", ""))
    compiled = int(err.split("compiled step needs ")[1].split()[0].replace(",", ""))
    assert predicted <= float(least) * 1e9 < compiled
    enough = float(err.split("give --memory-per-device ")[1].split()[0])
    assert compiled <= enough * 1e9 < compiled * 1.01
    assert f"{compiled / predicted:.2f} times the prediction" in err
    margin = float(err.split("a smaller --batch-size, --memory-per-device ")[1].split()[0])
    assert 0.99 * float(least) * predicted / compiled < margin <= float(least) * predicted / compiled
    assert not checkpoints.exists() and not metrics.exists()


@functools.cache
def first_plan_compiled():
    """The planner's first plan for the recipe's GPT on the 8 simulated devices, and a
    compiled step's report that needs 1.5 times its predicted peak (the recipes' tests
    above and test_plan_validate.py read real ones; these check the decision alone)."""
    config = eqxpar.models.GPTConfig(context=CONTEXT, dim=DIM, heads=HEADS, layers=LAYERS)
    (plan,) = eqxpar.plan.plan(
        config, batch=BATCH, cluster=eqxpar.recipe.local_cluster(), vocab_size=61, dtype=np.float32, top=1
    )
    state = plan.memory.parameters + plan.memory.optimizer_state
    report = MemoryReport(
        parameters=plan.memory.parameters,
        optimizer_state=plan.memory.optimizer_state,
        other_inputs=0,
        parameters_whole=plan.memory.parameters,
        optimizer_state_whole=plan.memory.optimizer_state,
        other_inputs_whole=0,
        arguments=state,
        outputs=state,
        aliased=state,
        temporaries=plan.memory.peak * 3 // 2 - state,
        generated_code=0,
    )
    assert report.peak == plan.memory.peak * 3 // 2
    return plan, types.SimpleNamespace(memory=report)


def test_the_compiled_peak_is_printed_beside_the_prediction(capsys):
    plan, check = first_plan_compiled()
    cfg = load_recipe("hybrid_gpt").Config(layout="auto", memory_per_device=None)
    eqxpar.recipe.check_compiled_peak(cfg, plan, check.memory)
    out = capsys.readouterr().out
    assert f"layout {plan.layout}: peak per device predicted {plan.memory.peak:,} bytes, compiled" in out
    assert f"compiled {check.memory.peak:,} ({check.memory.peak / plan.memory.peak:.2f} of the prediction" in out
    eqxpar.recipe.check_compiled_peak(cfg, None, check.memory)  # --layout mesh: nothing to check
    assert capsys.readouterr().out == ""
    with pytest.raises(ValueError, match=f"compiled step needs {check.memory.peak:,} bytes per device") as error:
        tight = check.memory.peak / 1e9 * (1 - 1e-6)
        eqxpar.recipe.check_compiled_peak(dataclasses.replace(cfg, memory_per_device=tight), plan, check.memory)
    assert "if the devices have that much" in str(error.value)  # the limit was the user's


def test_no_more_memory_is_advised_than_the_device_has(capsys, monkeypatch):
    """Without --memory-per-device the limit is the device's own memory: the stop advises
    planning with a margin or a smaller batch, not a memory the device lacks."""
    plan, check = first_plan_compiled()
    machine = eqxpar.recipe.local_cluster()
    cfg = load_recipe("hybrid_gpt").Config(layout="auto", memory_per_device=None)
    small = dataclasses.replace(machine, memory_per_device=check.memory.peak - 1)
    monkeypatch.setattr(eqxpar.recipe._layout, "local_cluster", lambda memory=None: small)
    with pytest.raises(ValueError, match="times the prediction: give a smaller --batch-size") as error:
        eqxpar.recipe.check_compiled_peak(cfg, plan, check.memory)
    assert "if the devices have that much" not in str(error.value)


def test_a_batch_no_layout_divides_names_the_batch_that_would(capsys):
    # 3 heads: model can only be 1 or 3, so on 8 devices data=8 and the batch needs 8 rows.
    err = recipe_error(capsys, "--heads", "3", "--dim", "48", "--batch-size", "4")
    assert "--layout auto with --batch-size 4" in err and "over data x model" in err
    assert "The smallest batch above it that a layout divides is 8." in err


def test_layout_auto_takes_no_mesh(capsys):
    err = recipe_error(capsys, "--mesh", "data=2,model=4")
    assert "--layout auto chooses the mesh itself: drop --mesh data=2,model=4" in err


@pytest.mark.parametrize("memory", ["0", "-1"])
def test_memory_per_device_must_be_positive(capsys, memory):
    err = recipe_error(capsys, "--memory-per-device", memory)
    assert "--memory-per-device must be positive (GB per device)" in err


def test_the_cluster_of_simulated_cpu_devices():
    machine = eqxpar.recipe.local_cluster()
    assert (machine.devices_per_host, machine.hosts, machine.memory_per_device) == (8, 1, 4e9)
    assert machine.name == "8 simulated CPU devices"
    assert eqxpar.recipe.local_cluster(2.5e9).memory_per_device == 2.5e9
    with pytest.raises(ValueError, match="memory_per_device must be positive"):
        eqxpar.recipe.local_cluster(0)
