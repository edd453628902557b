"""Every layout the planner enumerates for a small GPT on 8 simulated devices, built with
its own mesh and step and compiled: the predicted collective bytes per (kind, axes) equal
the compiled program's exactly, parameters + optimizer state equal the compiled shardings
exactly, and the saved activations are the theory's: one more block adds exactly the
predicted bytes for `block` and `save_matmuls` (with FSDP, the block's gathered weights
too), and the total is at least the prediction (its terms outside the blocks are the least
the backward pass reads).

The default run compiles three layouts that between them use every axis, FSDP with data
(hybrid sharding), both context-parallel attentions, sequence parallelism and every remat;
`HYPOTHESIS_PROFILE=thorough` compiles all of them."""

import functools

import jax.numpy as jnp
import pytest
from _budget import case
from test_plan import PAD, SMALL, VOCAB, cpu_cluster, saved_bytes, small_plans

import eqxpar.plan
from eqxpar.models import GPTConfig

BATCH = 8


@functools.cache
def all_plans(layers: int = SMALL.layers) -> dict[str, eqxpar.plan.Plan]:
    config = GPTConfig(context=SMALL.context, dim=SMALL.dim, heads=SMALL.heads, layers=layers)
    plans = eqxpar.plan.plan(
        config,
        batch=BATCH,
        cluster=cpu_cluster(),
        dtype=jnp.float32,
        optimizer="adamw",
        vocab_size=VOCAB,
        pad_vocab_to_multiple_of=PAD,
        top=None,
        pipeline=False,  # pipelines: tests/test_plan_pipeline.py and test_plan_pipeline_fsdp.py
    )
    return {str(p.layout): p for p in plans}


# Two compiles by default (the third, save_matmuls + SP + all-gather, took 40-67 s: it runs
# under thorough with every other candidate, so make test stays near 15 minutes).
DEFAULT = (
    "data=2,fsdp=2,model=2 remat=none",
    "fsdp=2,context=2,model=2 remat=block ring",
)
EVERY = sorted(all_plans())


def _cases(names, default):
    return [case(n, default=n in default) for n in names]


@pytest.mark.parametrize("name", _cases(EVERY, DEFAULT))
def test_predictions_equal_the_compiled_step(name):
    check_compiled(name, all_plans()[name])


def check_compiled(name: str, plan: eqxpar.plan.Plan) -> None:
    """Compile `plan` (`eqxpar.plan.validate`): collectives per (kind, axes) and state bytes
    exact, saved activations at least the theory's, the peak within the stated bound."""
    (v,) = eqxpar.plan.validate([plan])
    for row in v.comm.rows:
        assert row.compiled == row.theory == row.lowered, (name, row, str(v.comm))
    assert v.comm_exact
    assert v.state_exact, (v.plan.memory, v.memory)
    assert v.memory.saved_activations >= v.plan.memory.saved_activations
    # The peak: the temporaries are an estimate calibrated on GPU steps of real sizes; on
    # this toy the CPU compiler's fixed costs dominate. Stated bound (docs/concepts/planner.md).
    assert 0.5 < v.peak_ratio < 3.0, str(v)
    assert name in eqxpar.plan.validation_table([v])


def check_bfloat16_prices(plan: eqxpar.plan.Plan) -> None:
    """Compile a bfloat16 `plan`: its `comm_in_dtype()` equals the lowered program per
    (kind, axes), each collective in the dtype it travels in (the CPU compiler then carries
    bfloat16 collectives in float32, so the compiled program equals `plan.comm`, the
    float32 theory); state bytes exact; gradient sums over the batch axes in float32."""
    (v,) = eqxpar.plan.validate([plan])
    priced = plan.comm_in_dtype().traffic()
    assert {(row.kind, row.axes) for row in v.comm.rows} == set(priced)
    for row in v.comm.rows:
        assert row.lowered == priced[(row.kind, row.axes)], (row, str(v.comm))
        assert row.compiled == row.theory, (row, str(v.comm))
    assert v.state_exact, (plan.memory, v.memory)
    gradients = ("all-reduce", ("data", "context"))
    assert priced[gradients] == plan.comm.traffic()[gradients] > 0


def test_bfloat16_plans_price_what_the_step_sends_in_each_dtype():
    """The GPT under data x context x model with sequence parallelism and ring attention,
    in bfloat16: activations over model and context in bfloat16; the gradients, the
    cross-entropy statistics, ring attention's key/value gradients and, under sequence
    parallelism, the layer norms' and position rows' gradients in float32 (the MLP output
    biases' in bfloat16)."""
    plans = small_plans(SMALL, batch=BATCH, dtype=jnp.bfloat16, axes=("data", "context", "model"), remats=("block",))
    (p,) = [p for p in plans if str(p.layout) == "data=2,context=2,model=2 remat=block sp ring"]
    check_bfloat16_prices(p)


EXACT_BLOCKS = [n for n in EVERY if " remat=none" not in n]
DEFAULT_BLOCKS = (
    "data=2,model=4 remat=block",
    "context=2,model=4 remat=save_matmuls sp ring",
    "fsdp=2,model=4 remat=block",
    "data=8 remat=save_matmuls",
)


@pytest.mark.parametrize("name", _cases(EXACT_BLOCKS, DEFAULT_BLOCKS))
def test_one_more_block_saves_exactly_the_predicted_bytes(name):
    """Traced only (no compile): the saved bytes of the same layout at 2 and 3 blocks differ
    by the predicted per-block bytes (under FSDP the block's gathered weights included)."""
    two, three = all_plans(2)[name], all_plans(3)[name]
    assert two.memory.saved_per_block == three.memory.saved_per_block > 0
    assert saved_bytes(three) - saved_bytes(two) == three.memory.saved_per_block


def test_validate_refuses_a_plan_for_more_devices():
    plans = eqxpar.plan.plan(
        SMALL,
        batch=BATCH,
        cluster=cpu_cluster(devices=8, hosts=2),
        dtype=jnp.float32,
        vocab_size=VOCAB,
        pad_vocab_to_multiple_of=PAD,
        top=1,
    )
    with pytest.raises(ValueError, match="needs 16 devices, 8 are given"):
        eqxpar.plan.validate(plans)
    with pytest.raises(ValueError, match="expected eqxpar.plan.Plan"):
        eqxpar.plan.validate(["data=8"])
