"""`recipes/long_context.py --layout auto`: the planner chooses the data x context x model
mesh, the context-parallel attention (ring or all-gather), sequence parallelism and remat
for the devices present, prints its table, and the run trains to the losses of a plain
one-device Equinox + optax loop (no context parallelism, no planner); its predicted
collective bytes equal the compiled step's; `--mesh` with it is refused in one line.

Under `thorough`: `--devices 1` (a plan with no context axis runs whole sequences, with
`dot_product` attention), and other plans forced first (the other attention, sequence
parallelism, remat, a plan with context=1 on 8 devices), each exact against the compiled
step and equal to the one-device loss."""

import functools
import json
import os
import subprocess
import sys

import jax
import pytest
from _recipes import RECIPES, load_recipe, run_recipe
from _reference import assert_reference_losses, recipe_text, text_reference_losses

import eqxpar.recipe._layout as layout_module
from eqxpar.models import GPT

STEPS, BATCH, SEQ, DIM, HEADS, LAYERS, SEED, LR = 2, 2, 256, 16, 2, 1, 0, 3e-3


def flags(heads: int = HEADS, layers: int = LAYERS) -> tuple[str, ...]:
    return (
        *("--steps", str(STEPS), "--batch-size", str(BATCH), "--seq-len", str(SEQ)),
        *("--dim", str(DIM), "--heads", str(heads), "--layers", str(layers)),
    )


FLAGS = flags()
KEYS = ("first_loss", "final_loss", "val_loss")  # long_context reports no mean of ten


@functools.cache
def reference_losses(heads: int = HEADS, layers: int = LAYERS) -> dict[str, float]:
    """The recipe's run written out plainly on one device: its weights (the first of two
    keys split from the seed), its batches (the packed rows of the text pipeline, per seed and
    step), AdamW, and the held-out rows' loss."""
    vocab = recipe_text(SEQ).vocab_size
    model = GPT(vocab, SEQ, DIM, heads, layers, key=jax.random.split(jax.random.key(SEED))[0])
    return text_reference_losses(model, seq=SEQ, batch=BATCH, steps=STEPS, seed=SEED, lr=LR)


def test_layout_auto_plans_cp_attention_and_sp_exactly_and_equals_one_device(tmp_path, capsys):
    recipe = load_recipe("long_context")
    with pytest.raises(SystemExit) as stop:  # the planner chooses the mesh: the two together are refused
        recipe.main(["--layout", "auto", "--mesh", "data=2,context=2,model=2", *FLAGS])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--layout auto chooses the mesh itself: drop --mesh data=2,context=2,model=2" in err

    metrics = run_recipe("long_context", tmp_path, "--layout", "auto", *FLAGS)
    out = capsys.readouterr().out
    assert "--layout auto: 5 fastest of the data x context x model layouts on 8 simulated CPU devices (4 GB" in out
    start = out.index("\nlayout ")
    table = out[start : out.index("\n\n", start + 1)]
    peak = f"peak per device predicted {metrics['predicted_peak_bytes']:,} bytes"
    peak += f", compiled {metrics['compiled_peak_bytes']:,}"
    assert f"\nlayout {metrics['layout']}: {peak}" in out  # printed after the compile, before training
    rows = table.strip().splitlines()[2:]  # under the header and its rule
    assert len(rows) == 5 and rows[0].startswith(metrics["layout"] + " ")  # the first plan is the one that ran
    # The table offers both attentions and sequence parallelism; the run takes the first's.
    assert (
        any(" ring " in r for r in rows) and any(" all_gather " in r for r in rows) and any(" sp " in r for r in rows)
    )
    sizes = dict(item.split("=") for item in metrics["mesh"].split(","))
    used = ",".join(f"{a}={n}" for a, n in sizes.items() if n != "1")
    sp = " sp" if metrics["sequence_parallel"] else ""
    assert sizes["context"] != "1" and metrics["attention"] in ("ring", "all_gather")
    assert metrics["layout"] == f"{used} remat={metrics['remat']}{sp} {metrics['attention']}"
    # Exact: the compiled step moves what the plan predicted (and what the recipe's own
    # theory, axis by axis, says).
    assert metrics["predicted_comm_bytes"] == metrics["compiled_comm_bytes"] > 0
    assert metrics["comm_bytes_measured"] == metrics["comm_bytes_theory"]
    assert 0.5 < metrics["compiled_peak_bytes"] / metrics["predicted_peak_bytes"] < 3
    assert_reference_losses(metrics, reference_losses(), KEYS)


@pytest.mark.thorough  # a fresh interpreter and compile; the 8-device run takes the same path
def test_layout_auto_on_one_device_runs_whole_sequences(tmp_path):
    out = tmp_path / "metrics.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    args = [sys.executable, str(RECIPES / "long_context.py"), "--layout", "auto", "--devices", "1", *FLAGS]
    run = subprocess.run([*args, "--metrics-out", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "one device remat=none" in run.stdout.split("mesh {")[0]
    metrics = json.loads(out.read_text())
    assert metrics["mesh"] == "data=1,context=1,model=1" and metrics["layout"] == "one device remat=none"
    assert metrics["attention"] == "dot_product"  # as the planner prices a layout without a context axis
    assert metrics["predicted_comm_bytes"] == metrics["compiled_comm_bytes"] == 0
    assert_reference_losses(metrics, reference_losses(), KEYS)


# Plans the planner does not put first for these flags, forced first: the other attention
# with sequence parallelism and each remat, context alone, and (with 4 heads, so that
# model=4 divides them) data x model: context=1 on 8 devices, whole sequences with
# dot_product attention. Two blocks, as the planner's own validation compiles: with one,
# XLA unrolls the one-step scan and merges save_matmuls' recomputed attention-output
# reduce-scatter with the forward pass's (8,192 bytes fewer than predicted here).
FORCED = [
    ("data=2,context=2,model=2 remat=save_matmuls sp all_gather", HEADS),
    ("context=4,model=2 remat=block sp ring", HEADS),
    ("context=8 remat=block all_gather", HEADS),
    ("data=2,model=4 remat=block sp", 4),
]


@pytest.mark.thorough  # four more runs of the recipe (~10 s of CPU each)
@pytest.mark.parametrize("wanted, heads", FORCED)
def test_a_forced_plan_is_exact_and_equals_one_device(tmp_path, monkeypatch, wanted, heads):
    real = layout_module.plan

    def wanted_first(*args, **kwargs):
        plans = real(*args, **kwargs)
        assert any(str(p.layout) == wanted for p in plans), wanted
        return sorted(plans, key=lambda p: str(p.layout) != wanted)

    monkeypatch.setattr(layout_module, "plan", wanted_first)
    metrics = run_recipe("long_context", tmp_path, "--layout", "auto", *flags(heads, layers=2))
    assert metrics["layout"] == wanted and metrics["scan_layers"] is True  # the planner's GPT
    assert metrics["attention"] == (wanted.split()[-1] if "context=" in wanted else "dot_product")
    assert metrics["predicted_comm_bytes"] == metrics["compiled_comm_bytes"] > 0
    assert metrics["comm_bytes_measured"] == metrics["comm_bytes_theory"]
    assert_reference_losses(metrics, reference_losses(heads, layers=2), KEYS)
