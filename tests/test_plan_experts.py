"""The planner with experts: `eqxpar.plan.plan(..., moe=MoEOptions(...))` for a small MoE GPT
(2 blocks of width 32, 4 experts, top-2, 8 sequences of 16 tokens, float32, AdamW) on 8
simulated devices. Every layout it enumerates, built with its own mesh and step
(`expert_axis="expert"`) and compiled: the predicted collective bytes per (kind, axes)
equal the compiled program's exactly (the all-to-alls over `expert`, the experts'
gradients summed over the batch axes but `expert`, the routing weights' gradient over
`model`), parameters + optimizer state equal the compiled shardings exactly, and one more
block saves exactly the predicted bytes under `block` and `save_matmuls`. The candidates
follow the library's checks (experts over `expert`, the batch over `data x fsdp x
expert`; no context axis, sequence parallelism or pipeline with `moe=`); the expert
all-to-alls are priced over the link the expert axis crosses; bad input is a ValueError.

The default run compiles one layout that uses every axis an MoE plan can (FSDP, experts,
the model axis, remat) and traces one pair for the per-block bytes, with shared experts;
`HYPOTHESIS_PROFILE=thorough` compiles every candidate, with and without shared experts.
"""

import functools
import math

import jax.numpy as jnp
import pytest
from _budget import case
from test_plan import SMALL, cpu_cluster, saved_bytes, small_plans

import eqxpar.plan
from eqxpar.models import GPTConfig, MoEOptions
from eqxpar.plan import RING_FACTORS
from eqxpar.plan._predict_time import step_time

MOE = MoEOptions(num_experts=4, top_k=2)
SHARED = MoEOptions(num_experts=4, top_k=2, shared_experts=1)


@functools.cache
def all_plans(moe: MoEOptions = MOE, layers: int = SMALL.layers) -> dict[str, eqxpar.plan.Plan]:
    config = GPTConfig(context=SMALL.context, dim=SMALL.dim, heads=SMALL.heads, layers=layers)
    return {str(p.layout): p for p in small_plans(config, moe=moe)}


def _cases(moe, names, default):
    kind = "shared" if moe.shared_experts else "routed"
    return [case(moe, n, default=(moe, n) in default, id=f"{kind}-{n}") for n in names]


DEFAULT = {(SHARED, "fsdp=2,expert=2,model=2 remat=block")}
EVERY = [c for moe in (MOE, SHARED) for c in _cases(moe, sorted(all_plans(moe)), DEFAULT)]


def test_the_candidates_follow_the_librarys_checks():
    plans = all_plans()
    layouts = [p.layout for p in plans.values()]
    assert len(plans) == 57  # 19 meshes x 3 remats
    assert {lay.expert for lay in layouts} == {1, 2, 4}  # 4 experts do not split 8 ways
    assert {lay.remat for lay in layouts} == set(eqxpar.plan.REMATS)
    for lay in layouts:
        assert (lay.stage, lay.context, lay.sequence_parallel, lay.attention) == (1, 1, False, "dot_product")
        assert 8 % lay.batch_shards == 0 and lay.batch_axes == ("data", "fsdp", "expert")
        assert list(lay.sizes) == ["stage", "data", "fsdp", "expert", "context", "model"]
    # model=8 splits the experts' hidden units, not the 4 experts (the stacked MoE layer
    # once checked its experts against the model axis too, and model=8 was no candidate).
    assert "model=8 remat=none" in plans and "expert=4,model=2 remat=none" in plans
    # Without moe= nothing changes: no expert axis anywhere.
    assert all(p.layout.expert is None and "expert" not in p.layout.sizes for p in small_plans())


@pytest.mark.parametrize("moe, name", EVERY)
def test_predictions_equal_the_compiled_step(moe, name):
    (v,) = eqxpar.plan.validate([all_plans(moe)[name]])
    for row in v.comm.rows:
        assert row.compiled == row.theory == row.lowered, (name, row, str(v.comm))
    assert v.comm_exact
    assert v.state_exact, (v.plan.memory, v.memory)
    saved = v.saved_ratio
    assert saved is not None
    if v.plan.layout.remat == "none":  # the theory's least count plus an estimate of the routed arrays
        assert saved > 0.9, str(v)
    else:  # exact per block (below); the terms outside the blocks are the least the backward reads
        assert saved >= 1, str(v)
    # The peak: the temporaries are an estimate (see docs/concepts/planner.md).
    assert 0.5 < v.peak_ratio < 3.0, str(v)


# One more block's bytes: under thorough only (the default's compiled-step test and
# tests/test_moe_activation_memory.py cover the same theory).
DEFAULT_BLOCKS: set = set()
EXACT_BLOCKS = [
    c
    for moe in (MOE, SHARED)
    for c in _cases(moe, sorted(n for n in all_plans(moe) if "=none" not in n), DEFAULT_BLOCKS)
]


@pytest.mark.parametrize("moe, name", EXACT_BLOCKS)
def test_one_more_block_saves_exactly_the_predicted_bytes(moe, name):
    """Traced only: the saved bytes at 2 and 3 MoE blocks differ by the predicted per-block
    bytes (under FSDP the block's gathered weights included: experts, router, shared MLP)."""
    two, three = all_plans(moe, 2)[name], all_plans(moe, 3)[name]
    assert two.memory.saved_per_block == three.memory.saved_per_block > 0
    assert saved_bytes(three) - saved_bytes(two) == three.memory.saved_per_block


def test_all_to_alls_are_priced_over_the_link_the_expert_axis_crosses():
    """On 2 hosts of 4: `expert=4` alone stays in a host; inside `model=2` it spans 8
    devices and crosses hosts. Seconds: the ring factor of an all-to-all over the link."""
    machine = cpu_cluster(devices=4, hosts=2)
    plans = {str(p.layout): p for p in small_plans(machine=machine, moe=MOE)}
    for name, link in (("data=2,expert=4 remat=none", machine.intra), ("expert=4,model=2 remat=none", machine.inter)):
        p = plans[name]
        nbytes = p.comm.bytes("all-to-all")
        assert machine.link(("expert",), p.layout.sizes) == link
        expected = RING_FACTORS["all-to-all"](4) * nbytes / link.bandwidth + 3 * link.latency
        _, classes = step_time(p.comm, p.flops, p.layout, machine, p.dtype)
        (seconds,) = [s for s, kind, axes, _, _ in classes if (kind, axes) == ("all-to-all", ("expert",))]
        assert math.isclose(seconds, expected), (name, seconds, expected)
    # In bfloat16 the tokens cross in the compute dtype: half the bytes.
    bf16 = {str(p.layout): p for p in small_plans(dtype=jnp.bfloat16, moe=MOE, axes=("data", "expert"))}
    half = bf16["data=2,expert=4 remat=none"]
    assert half.comm_in_dtype().bytes("all-to-all") * 2 == half.comm.bytes("all-to-all") > 0


def test_experts_that_divide_no_axis_give_only_expert_one():
    three = {str(p.layout): p.layout for p in small_plans(moe=MoEOptions(num_experts=3, top_k=2))}
    assert three and {lay.expert for lay in three.values()} == {1}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"moe": MoEOptions(4, 2, every=2)}, r"cannot be planned: stack_blocks: .*moe.every=2"),
        ({"moe": MoEOptions(4, 2, every=3)}, r"moe.every=3 is more than num_layers=2"),
        ({"moe": {"num_experts": 4}}, r"plan: GPT: moe must be an eqxpar.models.MoEOptions"),
        ({"axes": ("data", "expert")}, r"axes must be a non-empty subset of \('stage', 'data', 'fsdp', 'context'"),
        ({"moe": MOE, "axes": ("data", "pipeline")}, r"subset of \('stage', 'data', 'fsdp', 'expert'"),
        ({"moe": MOE, "pipeline": True}, r"pipelines of a GPT with moe= are not planned"),
        ({"moe": MOE, "axes": ("stage", "data")}, r"pipelines of a GPT with moe= are not planned"),
        ({"moe": MOE, "pipeline": "yes"}, r"pipeline must be True, False or None"),
        ({"moe": MOE, "axes": ("data", "context")}, r"takes neither context nor sequence parallelism"),
        ({"moe": MOE, "sequence_parallel": (True,)}, r"takes neither context nor sequence parallelism"),
        ({"moe": MoEOptions(4, 2, capacity_factor=None)}, r"dropless routing .* is not planned"),
        ({"moe": MoEOptions(4, 2, expert_axis="data")}, r"moe.expert_axis='data'.*expert_axis='expert'"),
    ],
)
def test_bad_input_is_a_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        small_plans(**kwargs)


def test_a_batch_that_no_expert_layout_divides_names_one_that_would():
    # Without a model axis every layout splits the batch 8 ways (8 = 2 x 4 at most over expert).
    with pytest.raises(ValueError, match=r"batch must split over data x fsdp x expert .* layout divides is 8"):
        small_plans(batch=3, moe=MOE, axes=("data", "fsdp", "expert"))
