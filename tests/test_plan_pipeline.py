"""Pipelines in the planner: a `stage` axis with its schedule, micro-batches and virtual
stages. Pipeline candidates obey `pipeline_step`'s rules and compose only as the step
does (data, FSDP and model around the stage; no context or sequence parallelism); the
bubble in the step time is the schedule's; and built with their own mesh and step and
compiled on 8 simulated devices, their predicted collective bytes per (kind, axes) equal
the compiled program's exactly and parameters + optimizer state equal the compiled
shardings exactly.

The default run compiles none here (the pipeline recipe's `--layout auto` test compiles
a 1F1B plan and checks its bytes exactly); `HYPOTHESIS_PROFILE=thorough` compiles
every pipeline candidate of a 4-block GPT, and one of an 8-block GPT on 4 stages
(circular with fewer chunks than stages: XLA's interleave adds collective-permutes)."""

import dataclasses
import functools

import jax.numpy as jnp
import pytest
from _budget import case
from hypothesis import given
from hypothesis import strategies as st
from test_plan import PAD, VOCAB, cpu_cluster, small_plans

import eqxpar.plan
from eqxpar.models import GPTConfig
from eqxpar.plan import _pipeline
from eqxpar.plan._abstract import abstract_gpt
from eqxpar.plan._predict_time import flops_per_token
from eqxpar.train import bubble_theory, make_schedule, stage_boundary_bytes

BATCH = 8
FOUR = GPTConfig(context=16, dim=32, heads=8, layers=4)
EIGHT = GPTConfig(context=16, dim=32, heads=8, layers=8)


@functools.cache
def pipeline_plans(config: GPTConfig = FOUR, batch: int = BATCH) -> dict[str, eqxpar.plan.Plan]:
    return {str(p.layout): p for p in small_plans(config, batch=batch) if p.layout.stage > 1}


def test_pipeline_candidates_and_their_rules():
    plans = pipeline_plans()
    names = set(plans)
    for name in (
        "stage=2,data=4 remat=none gpipe M=2",
        "stage=2,data=2,model=2 remat=block 1f1b M=4",
        "stage=2,data=2,model=2 remat=none circular r=2 M=2",
        "stage=4,data=2 remat=block 1f1b M=4",
        "stage=4,model=2 remat=none gpipe M=8",
    ):
        assert name in names, sorted(names)
    for p in plans.values():
        lay = p.layout
        make_schedule(lay.schedule, lay.stage, lay.microbatches, lay.virtual_stages)  # the step's schedule accepts it
        # Only what pipeline_step runs: no context axis, no SP (FSDP inside the stages:
        # tests/test_plan_pipeline_fsdp.py).
        assert lay.context == 1 and not lay.sequence_parallel and lay.attention == "dot_product"
        assert (
            BATCH % (lay.data * lay.fsdp * lay.microbatches) == 0
            and FOUR.layers % (lay.stage * lay.virtual_stages) == 0
        )
        assert lay.schedule != "1f1b" or lay.remat == "block"  # 1F1B always recomputes the stage
        # The bubble in the step time is the schedule's.
        t = p.time
        want = bubble_theory(lay.schedule, lay.stage, lay.microbatches, lay.virtual_stages)
        assert t.bubble / (t.compute + t.bubble) == pytest.approx(want, rel=1e-12)
        assert t.overlap <= t.expected <= t.no_overlap
        assert "bubble" in p.reason
    # More micro-batches: a smaller bubble, the same compute.
    a, b = plans["stage=2,data=4 remat=none gpipe M=2"], plans["stage=4,data=2 remat=none gpipe M=4"]
    assert a.time.bubble / a.time.compute == pytest.approx(1 / 2) and b.time.bubble / b.time.compute == 3 / 4


def test_stage_boundary_bytes_are_the_schedules_ticks():
    """The library's function (the recipe's theory): one activation per forward tick and
    one gradient per backward tick, on every device, idle ticks too."""
    for name, P, M, r, ticks in (("gpipe", 4, 8, 1, 2 * 11), ("1f1b", 4, 8, 1, 2 * 11), ("circular", 2, 4, 2, 2 * 9)):
        assert stage_boundary_bytes(make_schedule(name, P, M, r), 100) == 100 * ticks
    assert stage_boundary_bytes(make_schedule("gpipe", 1, 4), 100) == 0
    # The planner's term is the library's, with the rows, sequence and width of the plan.
    p = pipeline_plans()["stage=2,data=4 remat=none gpipe M=2"]
    stream = BATCH // (4 * 2) * FOUR.context * FOUR.dim * 4
    assert p.comm.bytes("collective-permute", axes=("stage",)) == stage_boundary_bytes(
        make_schedule("gpipe", 2, 2), stream
    )


def test_parameters_and_optimizer_state_per_stage():
    """A stage holds its 1/P of the blocks, and every stage the embeddings and head: the
    blocks' bytes halve from 2 to 4 stages, the rest stays."""
    plans = pipeline_plans()
    two, four = plans["stage=2,data=4 remat=none gpipe M=2"], plans["stage=4,data=2 remat=none gpipe M=4"]
    outside = (VOCAB + PAD - VOCAB % PAD) * FOUR.dim * 2 + FOUR.context * FOUR.dim + 2 * FOUR.dim
    outside *= 4  # float32: token embedding and head (padded vocabulary), positions, final norm
    blocks_two, blocks_four = two.memory.parameters - outside, four.memory.parameters - outside
    assert blocks_two == 2 * blocks_four > 0
    assert two.memory.optimizer_state == 2 * two.memory.parameters + 4  # AdamW: two moments and a count


def test_the_planner_refuses_what_the_step_refuses():
    # 3 blocks split over no stage count of 8 devices: no pipeline at all.
    three = GPTConfig(context=16, dim=32, heads=8, layers=3)
    assert not pipeline_plans(three)
    # One row per data shard: no room for 2 micro-batches, so data=8 has no pipeline partner.
    assert all(p.layout.data * p.layout.microbatches <= 4 for p in pipeline_plans(FOUR, 4).values())
    with pytest.raises(ValueError, match="smallest batch above it"):
        eqxpar.plan.plan(
            three, batch=3, cluster=cpu_cluster(), dtype=jnp.float32, vocab_size=VOCAB, axes=("stage", "data")
        )


# No compile by default (make test time: ~13 s of CPU each): the pipeline recipe's
# --layout auto test (tests/test_plan_pipeline_recipe.py) compiles a 1F1B plan with data
# and model axes and checks its collective bytes exactly; every candidate here, per
# (kind, axes), under thorough.
DEFAULT: tuple[str, ...] = ()


def _cases():
    names = sorted(n for n, p in pipeline_plans().items() if p.layout.fsdp == 1)  # fsdp: test_plan_pipeline_fsdp.py
    cases = [case(n, FOUR, default=n in DEFAULT) for n in names]
    cases.append(case("stage=4,data=2 remat=none circular r=2 M=4", EIGHT, default=False))
    return cases


@pytest.mark.parametrize("name, config", _cases())
def test_pipeline_predictions_equal_the_compiled_step(name, config):
    (v,) = eqxpar.plan.validate([pipeline_plans(config)[name]])
    for row in v.comm.rows:
        assert row.compiled == row.theory, (name, row, str(v.comm))
    assert v.comm_exact and v.plan.comm.bytes() > 0
    assert v.state_exact, (v.plan.memory, v.memory)
    assert v.memory.saved_activations is None  # the pipeline step has no one backward pass to measure
    # The peak: the temporaries and in-flight activations are estimates; on this toy the
    # CPU compiler's fixed costs dominate. Stated bound (docs/concepts/planner.md).
    assert 0.5 < v.peak_ratio < 3.0, str(v)
    assert name in eqxpar.plan.validation_table([v])


@given(
    schedule=st.sampled_from(["gpipe", "1f1b", "circular"]),
    stages=st.integers(2, 8),
    groups=st.integers(1, 6),
    virtual=st.sampled_from([1, 2, 4]),
)
def test_the_planners_closed_forms_are_the_schedules_tables(schedule, stages, groups, virtual):
    """The planner counts ticks in closed form (the tables cost ticks x stages to build):
    the same forward and backward ticks, stage-boundary bytes and 1F1B in-flight count as
    `make_schedule`'s tables and `stage_boundary_bytes`."""
    r = virtual if schedule == "circular" else 1
    M = stages * groups if schedule == "circular" else groups
    table = make_schedule(schedule, stages, M, r)
    layout = eqxpar.plan.Layout(1, 1, 1, 1, "block", False, "dot_product", stages, schedule, M, r)
    forward, backward = _pipeline.ticks(layout)
    assert forward == sum(n for kind, _, n in table.phases if kind in ("forward", "both"))
    assert backward == sum(n for kind, _, n in table.phases if kind in ("backward", "both"))
    assert stage_boundary_bytes(table, 3) == 3 * (forward + backward)
    if schedule == "1f1b":
        assert _pipeline.in_flight(layout) == table.max_in_flight()


def test_every_chunk_tick_runs_the_head():
    """`stage_pass` runs the embedding, head and loss on every chunk a device passes (masked
    where it is not the first or last): with `r` chunks per device that is `r` times per
    micro-batch, so a circular plan costs `3 (r - 1)` head forwards per token more than
    GPipe with the same stages and micro-batches; the blocks' share is the same."""
    gpt = abstract_gpt(
        FOUR, VOCAB, remat="none", sequence_parallel=False, attention_impl="dot_product", pad_vocab_to_multiple_of=PAD
    )
    _, _, _, head_forward = flops_per_token(gpt, FOUR.context)
    tokens = BATCH // 2 * FOUR.context  # data=2
    gpipe = eqxpar.plan.Layout(2, 1, 1, 1, "none", False, "dot_product", 2, "gpipe", 2, 1)
    for r in (2, 4):
        circular = dataclasses.replace(gpipe, schedule="circular", virtual_stages=r)
        extra = _pipeline.pipeline_flops(gpt, circular, BATCH, FOUR.context) - _pipeline.pipeline_flops(
            gpt, gpipe, BATCH, FOUR.context
        )
        assert extra == pytest.approx(3 * (r - 1) * head_forward * tokens, rel=1e-12)
