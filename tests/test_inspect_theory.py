"""Communication against theory and memory per device, read from real programs.

The theory functions say what each strategy must communicate (per collective kind and
mesh axes, bytes per device); the reports read what the lowered and compiled programs do.
They must agree exactly for the eqxpar steps, and the comparison must notice a collective
that is doubled, missing or on the wrong axis.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from _gpt_reference import CONTEXT, loss_fn, sgd_momentum, tiny_gpt, token_batch
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import eqxpar
import eqxpar.nn
from eqxpar.inspect import (
    COLLECTIVE_KINDS,
    CommReport,
    CommTheory,
    MemoryReport,
    collectives_in_hlo,
    collectives_in_lowered,
    communication_report,
    data_parallel_theory,
    fsdp_theory,
    memory_report,
    report_axes,
    theory_term,
)
from eqxpar.models import gpt_tensor_parallel_theory
from eqxpar.testing import mesh_sizes
from eqxpar.train import data_parallel_step, fsdp_specs, fsdp_step, hybrid_step, optimizer_specs

OPTIMIZER = sgd_momentum()
BATCH = 8


def _placed(mesh, specs, batch_axis):
    model = tiny_gpt(0)
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_inexact_array))
    opt_state = eqxpar.shard(opt_state, mesh, optimizer_specs(OPTIMIZER, opt_state, model, specs))
    return eqxpar.shard(model, mesh, specs), opt_state, eqxpar.shard(token_batch(BATCH, 0), mesh, P(batch_axis))


def _blocks_but_last_bias(gpt):
    # What a recomputed block needs again: everything but the MLP's output bias, which is
    # added last (nothing in the block's backward pass reads its result).
    return [(b.attention_norm, b.attention, b.mlp_norm, b.mlp.hidden, b.mlp.output.weight) for b in gpt.blocks]


@functools.cache
def gpt_case(strategy: str):
    """(mesh, specs, theory, lowered, compiled or None, placed args) for the tiny GPT; one
    compilation per strategy, shared by the tests."""
    model = tiny_gpt(0)
    if strategy == "hybrid":
        mesh = eqxpar.make_mesh(data=2, model=4)
        specs = eqxpar.nn.partition_specs(model, mesh)
        step, batch_axis = hybrid_step(loss_fn, OPTIMIZER, mesh, param_specs=specs), "data"
        theory = data_parallel_theory(model, mesh, specs) + gpt_tensor_parallel_theory(
            model, mesh, BATCH, CONTEXT, batch_axis="data"
        )
    else:
        remat = strategy == "fsdp+tp remat"
        mesh = eqxpar.make_mesh(fsdp=2, model=4)
        specs = fsdp_specs(model, mesh, param_specs=eqxpar.nn.partition_specs(model, mesh))
        step = fsdp_step(loss_fn, OPTIMIZER, mesh, param_specs=specs, units=lambda m: m.blocks, remat=remat)
        batch_axis = "fsdp"
        theory = fsdp_theory(
            model, mesh, specs, regathered=_blocks_but_last_bias if remat else None
        ) + gpt_tensor_parallel_theory(model, mesh, BATCH, CONTEXT, batch_axis="fsdp", remat=remat)
    args = _placed(mesh, specs, batch_axis)
    lowered = step.lower(*args)
    compiled = None if strategy == "fsdp+tp remat" else lowered.compile()
    return mesh, specs, theory, lowered, compiled, args


def _assert_exact(comparison, stages=("lowered", "compiled")):
    for row in comparison.rows:
        for stage in stages:
            assert getattr(row, stage) == row.theory, (row, stage, str(comparison))
    if comparison.theory.bytes():
        for stage in stages:
            assert comparison.ratio(stage=stage) == 1.0


@pytest.mark.parametrize("strategy", ["hybrid", "fsdp+tp"])
def test_gpt_steps_communicate_exactly_the_minimum(strategy):
    mesh, _, theory, lowered, compiled, _ = gpt_case(strategy)
    report = CommReport.of(lowered, compiled)
    assert report.mesh is not None and dict(report.mesh.shape) == dict(mesh.shape)  # read off the inputs
    comparison = report.versus(theory)
    _assert_exact(comparison)
    kinds = {(r.kind, r.axes) for r in comparison.rows}
    if strategy == "hybrid":
        assert kinds == {("all-reduce", ("data",)), ("all-reduce", ("model",))}
        # Per axis, through the report's own filter too.
        assert report.bytes(axes="data") == theory.bytes(axes=("data",)) > 0
        assert report.bytes("all-reduce", axes="model", stage="lowered") == theory.bytes(axes=("model",)) > 0
    else:
        assert {k for k, _ in kinds} == {"all-gather", "reduce-scatter", "all-reduce"}
        # Reduce-scatters count the full gradient: what the all-gathers gathered.
        assert report.bytes("reduce-scatter") == report.bytes("all-gather") == theory.bytes("all-gather")
    text = str(comparison)
    assert "TOTAL" in text and "1.000" in text and "theory:" in text


def test_remat_regathers_what_the_backward_pass_reads():
    _, _, theory, lowered, _, _ = gpt_case("fsdp+tp remat")
    mesh, specs, *_ = gpt_case("fsdp+tp")
    # Lowered only (no compile): what the code asks for.
    report = CommReport(compiled=(), lowered=collectives_in_lowered(lowered), mesh=mesh)
    _assert_exact(report.versus(theory), stages=("lowered",))
    # The comparison sees the re-gather: against the theory without it, the all-gathers
    # come out above the minimum, and the recomputed attention all-reduces on top.
    plain = fsdp_theory(tiny_gpt(0), mesh, specs) + gpt_tensor_parallel_theory(
        tiny_gpt(0), mesh, BATCH, CONTEXT, batch_axis="fsdp"
    )
    comparison = report.versus(plain)
    assert comparison.ratio("all-gather", stage="lowered") > 1.5
    assert comparison.ratio("all-reduce", stage="lowered", axes="model") > 1.1
    assert comparison.ratio("reduce-scatter", stage="lowered") == 1.0


def _linear_grads(mesh, reductions: int, axis: str = "data"):
    """A data-parallel gradient of an eqx.nn.Linear with `reductions` psums of (loss, grads)."""

    def per_device(model, x):  # check_vma off: the gradient is this device's own, unreduced
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
        for _ in range(reductions):
            loss, grads = jax.lax.psum((loss, grads), axis)
        return loss, grads

    return eqxpar.filter_shard_map(
        per_device, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()), check_vma=False
    )


@pytest.mark.parametrize(
    "reductions, axis, want", [(1, "data", 1.0), (2, "data", 2.0), (0, "data", 0.0), (1, "model", None)]
)
def test_a_doubled_missing_or_misplaced_reduction_is_caught(reductions, axis, want):
    mesh = eqxpar.make_mesh(data=4, model=2)
    linear = eqx.nn.Linear(16, 8, key=jax.random.key(0))
    x = eqxpar.shard(jnp.ones((8, 16)), mesh, P("data"))
    report = communication_report(_linear_grads(mesh, reductions, axis), eqxpar.shard(linear, mesh), x)
    comparison = report.versus(data_parallel_theory(linear, mesh))
    if want is None:  # reduced over the wrong axis: nothing over data, something over model
        assert comparison.ratio(axes="data") == 0.0
        assert comparison.ratio(axes="model") == float("inf")
    else:
        for stage in ("lowered", "compiled"):
            assert comparison.ratio(stage=stage) == want


@given(
    sizes=mesh_sizes(("data",)),
    strategy=st.sampled_from(["data parallel", "fsdp"]),
    width=st.sampled_from([8, 24]),
)
def test_theory_matches_small_steps_over_meshes(sizes, strategy, width):
    mesh = eqxpar.make_mesh(**sizes)
    # in 4, out 3: with 8 devices some arrays cannot be split (FSDP all-reduces their
    # gradients instead of reduce-scattering).
    model = eqx.nn.MLP(4, 3, width, 1, key=jax.random.key(0))
    step, specs, theory = _small_step(tuple(sizes.items()), strategy, width)
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_inexact_array))
    opt_state = eqxpar.shard(opt_state, mesh, optimizer_specs(OPTIMIZER, opt_state, model, specs))
    batch = eqxpar.shard((jnp.ones((8, 4)), jnp.zeros((8,), jnp.int32)), mesh, P("data"))
    lowered = step.lower(eqxpar.shard(model, mesh, specs), opt_state, batch)
    comparison = CommReport.of(lowered).versus(theory)
    _assert_exact(comparison)
    if sizes["data"] > 1:
        assert theory.bytes() > 0
    else:
        assert comparison.rows == ()  # one device: nothing to move, nothing moved


def _mlp_loss(model, batch, key):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(jax.vmap(model)(x), y).mean()


@functools.cache
def _small_step(sizes: tuple, strategy: str, width: int):
    mesh = eqxpar.make_mesh(**dict(sizes))
    model = eqx.nn.MLP(4, 3, width, 1, key=jax.random.key(0))
    if strategy == "data parallel":
        return data_parallel_step(_mlp_loss, OPTIMIZER, mesh), P(), data_parallel_theory(model, mesh)
    specs = fsdp_specs(model, mesh, batch_axis="data")
    step = fsdp_step(_mlp_loss, OPTIMIZER, mesh, param_specs=specs, batch_axis="data")
    return step, specs, fsdp_theory(model, mesh, specs, batch_axis="data")


def test_axes_are_told_apart_by_the_groups_not_their_size():
    mesh = eqxpar.make_mesh(data=2, model=2, extra=2)
    f = eqxpar.filter_shard_map(
        lambda x: (jax.lax.psum(x, "data"), jax.lax.psum(x, "model"), jax.lax.psum(x, ("data", "extra"))),
        mesh=mesh,
        in_specs=(P(("data", "model", "extra")),),
        out_specs=(P(("model", "extra")), P(("data", "extra")), P("model")),
    )
    report = communication_report(f, jnp.ones((8, 3)))
    for stage in ("lowered", "compiled"):
        found = sorted(c.axes(mesh) for c in report.collectives(stage=stage))
        assert found == [("data",), ("data", "extra"), ("model",)], (stage, found)
        assert report.count(axes="data", stage=stage) == 1 and report.count(axes=("extra", "data"), stage=stage) == 1


def test_collectives_over_one_device_move_nothing():
    mesh = eqxpar.make_mesh(data=8, model=1)
    f = eqxpar.filter_shard_map(
        lambda x: jax.lax.psum(x, "model"), mesh=mesh, in_specs=(P("data"),), out_specs=P("data")
    )
    report = communication_report(f, jnp.ones((8, 3)))
    assert all(c.axes(mesh) == () for c in report.collectives(stage="lowered"))
    assert report.traffic(stage="lowered") == {} and report.traffic() == {}
    assert gpt_tensor_parallel_theory(tiny_gpt(0), mesh, 8, CONTEXT, batch_axis="data").terms == ()


def test_hlo_replica_group_forms():
    hlo = "\n".join(
        [
            "  %a = f32[8]{0} all-reduce(f32[8]{0} %p), replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add",
            "  %b = f32[8]{0} all-reduce(f32[8]{0} %p), replica_groups=[2,4]<=[8], to_apply=%add",
            "  %c = f32[2]{0} reduce-scatter(f32[8]{0} %p), replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}",
            "  %d = f32[2]{0} reduce-scatter(f32[8]{0} %p), replica_groups={}, dimensions={0}",
        ]
    )
    a, b, c, d = collectives_in_hlo(hlo)
    assert a.replica_groups == ((0, 4), (1, 5), (2, 6), (3, 7)) and a.group_size == 2
    assert b.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    mesh = eqxpar.make_mesh(data=2, model=4)
    assert a.axes(mesh) == ("data",) and b.axes(mesh) == ("model",) and d.axes(mesh) == ("data", "model")
    assert c.bytes == 4 * 8 and c.result_bytes == 4 * 2  # the operand, not the kept slice
    assert d.bytes == d.result_bytes  # group unknown without a mesh: the result is all we know


def test_memory_report_from_the_input_shardings_and_xla():
    reports = {}
    for strategy in ("hybrid", "fsdp+tp"):
        mesh, specs, _, _, compiled, args = gpt_case(strategy)
        report = MemoryReport.of(compiled, *args)
        model, opt_state, batch = args
        whole = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(tiny_gpt(0), eqx.is_array)))
        assert report.parameters == eqxpar.sharding_report(model).bytes_per_device
        assert report.parameters_whole == whole
        # SGD with momentum: one buffer per parameter, split as the parameter is.
        assert report.optimizer_state == report.parameters and report.optimizer_state_whole == whole
        assert report.other_inputs == batch.nbytes // 2  # the batch is split over 2 replicas
        # XLA's count of the inputs is exactly what the shardings say one device holds.
        assert report.arguments == report.parameters + report.optimizer_state + report.other_inputs
        assert report.temporaries > 0 and report.aliased == report.state  # donated model and state
        reports[strategy] = report
    # FSDP x TP stores less per device than the hybrid step's model replicas.
    assert reports["fsdp+tp"].state < reports["hybrid"].state < reports["hybrid"].state_whole
    table = reports["fsdp+tp"].versus(reports["hybrid"])
    assert f"{reports['fsdp+tp'].state / reports['hybrid'].state:.3f}" in table
    assert "temporaries" in str(reports["hybrid"])


def test_memory_report_compiles_a_step_for_its_arguments():
    mesh = eqxpar.make_mesh(data=8)
    model = eqx.nn.MLP(4, 3, 8, 1, key=jax.random.key(0))
    step, _, _ = _small_step((("data", 8),), "data parallel", 8)
    opt_state = eqxpar.shard(OPTIMIZER.init(eqx.filter(model, eqx.is_inexact_array)), mesh)
    x, y = eqxpar.shard((jnp.ones((16, 4)), jnp.zeros((16,), jnp.int32)), mesh, P("data"))
    report = memory_report(step, eqxpar.shard(model, mesh), opt_state, (x, y))
    assert report.parameters == report.parameters_whole  # replicated
    assert report.other_inputs * 8 == report.other_inputs_whole == x.nbytes + y.nbytes
    assert report.arguments == report.parameters + report.optimizer_state + report.other_inputs
    # Any function, wrapped in eqx.filter_jit: no optimizer state.
    plain = memory_report(lambda m, s, x: jax.vmap(m)(x), model, None, jnp.ones((4, 4)))
    assert plain.optimizer_state == 0 and plain.parameters == plain.parameters_whole > 0


def test_errors():
    model = tiny_gpt(0)
    mesh = eqxpar.make_mesh(data=2, model=4)
    with pytest.raises(ValueError, match="no data axis 'batch'"):
        data_parallel_theory(model, mesh, batch_axis="batch")
    with pytest.raises(ValueError, match="must be an eqxpar.models.GPT"):
        gpt_tensor_parallel_theory(eqx.nn.Linear(2, 2, key=jax.random.key(0)), mesh, 8, 4)
    with pytest.raises(ValueError, match="positive multiple of the 2 batch shards"):
        gpt_tensor_parallel_theory(model, mesh, 7, CONTEXT, batch_axis="data")
    with pytest.raises(ValueError, match="seq_len must be in 1..16"):
        gpt_tensor_parallel_theory(model, mesh, 8, CONTEXT + 1)
    with pytest.raises(ValueError, match="no fsdp axis 'fsdp'"):
        fsdp_theory(model, mesh, P())
    with pytest.raises(ValueError, match="regathered must pick nodes"):
        fsdp_theory(model, eqxpar.make_mesh(fsdp=8), P("fsdp"), regathered=lambda m: m.no_such_field)
    with pytest.raises(ValueError, match="needs the mesh"):
        CommReport(compiled=(), lowered=()).versus(CommTheory())
    with pytest.raises(ValueError, match="expected a CommTheory"):
        CommReport(compiled=(), lowered=(), mesh=mesh).versus({"all-reduce": 4})
    with pytest.raises(ValueError, match="unknown collective kind"):
        CommTheory().bytes("allreduce")
    with pytest.raises(ValueError, match="no axis 'batch'"):
        CommReport(compiled=(), lowered=(), mesh=mesh).bytes(axes="batch")
    assert set(COLLECTIVE_KINDS) >= {t.kind for t in gpt_case("hybrid")[2].terms}


def test_a_theory_built_from_its_public_parts():
    # A model's own theory: axes keyed as a report keys them, terms that move nothing dropped.
    mesh = eqxpar.make_mesh(data=1, fsdp=2, model=4)
    assert report_axes(("model", "data", "fsdp"), mesh) == ("fsdp", "model")
    assert report_axes("data", mesh) == ()
    axes = report_axes("model", mesh)
    theory = CommTheory(
        theory_term("all-reduce", axes, 64, "outputs, forward")
        + theory_term("all-reduce", report_axes("data", mesh), 64, "over one device: nothing")
        + theory_term("all-gather", axes, 0, "no bytes: nothing")
    )
    assert theory.traffic() == {("all-reduce", ("model",)): 64}
    with pytest.raises(ValueError, match="my_theory: the mesh has no axis 'batch'"):
        report_axes("batch", mesh, "my_theory")
    with pytest.raises(ValueError, match="unknown collective kind 'allreduce'"):
        theory_term("allreduce", axes, 4, "a typo")


def test_a_function_called_twice_counts_twice():
    # JAX lowers an inner jit once, as a private function called from both places.
    mesh = eqxpar.make_mesh(data=4)
    inner = jax.jit(lambda x: jax.lax.psum(x, "data"))
    f = eqxpar.filter_shard_map(lambda x: inner(x) + inner(x * 2), mesh=mesh, in_specs=(P("data"),), out_specs=P())
    report = communication_report(f, jnp.ones((8,)))
    assert report.count(stage="lowered") == 2 and report.bytes(stage="lowered") == 2 * 2 * 4
    assert report.bytes() == 2 * 2 * 4  # compiled: possibly combined into one, the same bytes
