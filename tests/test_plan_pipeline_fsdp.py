"""FSDP inside pipeline stages in the planner: `stage x fsdp` candidates, built as
`pipeline_step` documents them (`fsdp_specs` over `fsdp` with the pipeline's specs as its
`param_specs`), priced and compiled on 8 simulated devices: their predicted collective
bytes per (kind, axes) equal the compiled program's exactly (the stage's parameters
gathered over `fsdp` once per step, their gradients reduce-scattered once per step, the
other gradients summed over the batch axes they are copied on), and parameters +
optimizer state equal the compiled shardings exactly.

The default run checks the candidates' rules; `HYPOTHESIS_PROFILE=thorough` compiles every one."""

import dataclasses

import pytest
from _budget import case
from test_plan_pipeline import BATCH, FOUR, pipeline_plans

import eqxpar.plan


def fsdp_plans() -> dict[str, eqxpar.plan.Plan]:
    return {n: p for n, p in pipeline_plans().items() if p.layout.fsdp > 1}


def test_stage_by_fsdp_candidates():
    plans = fsdp_plans()
    assert "stage=2,fsdp=4 remat=none gpipe M=2" in plans, sorted(plans)
    for p in plans.values():
        lay = p.layout
        assert BATCH % (lay.data * lay.fsdp * lay.microbatches) == 0
        # One gather of the stage's parameters and one scatter of their gradients per step.
        gathered = p.comm.bytes("all-gather", axes=("fsdp",))
        assert gathered == p.comm.bytes("reduce-scatter", axes=("fsdp",)) > 0
        # Parameters and optimizer state split over fsdp too.
        if lay.data == 1:  # the same layout with copies over data instead
            copies = pipeline_plans()[str(dataclasses.replace(lay, data=lay.fsdp, fsdp=1))]
            assert p.memory.parameters < copies.memory.parameters
            assert p.memory.optimizer_state < copies.memory.optimizer_state


# None compiles by default (the suite's 15-minute budget on 2 cores); the quickest is
# "stage=2,fsdp=4 remat=block gpipe M=2", about 5 s.
DEFAULT: tuple[str, ...] = ()


def _cases():
    names = sorted(fsdp_plans())
    return [case(n, default=n in DEFAULT) for n in names]


@pytest.mark.parametrize("name", _cases())
def test_stage_by_fsdp_predictions_equal_the_compiled_step(name):
    (v,) = eqxpar.plan.validate([fsdp_plans()[name]])
    for row in v.comm.rows:
        assert row.compiled == row.theory, (name, row, str(v.comm))
    assert v.comm_exact and v.plan.comm.bytes() > 0
    assert v.state_exact, (v.plan.memory, v.memory)
    assert 0.5 < v.peak_ratio < 3.0, str(v)
    assert FOUR.layers % v.plan.layout.stage == 0
