"""FSDP and FSDP x tensor parallelism: the same training run as one device, over drawn meshes."""

import functools

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from _gpt_reference import loss_fn, reference_run, sgd_momentum, tiny_gpt, token_batch
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import eqxpar
import eqxpar.nn
from eqxpar.inspect import CommReport
from eqxpar.testing import assert_trees_close, mesh_sizes
from eqxpar.train import fsdp_specs, fsdp_step, optimizer_specs

OPTIMIZER = sgd_momentum()


@functools.cache
def cached_step(sizes: tuple, per_unit: tuple):
    """One step (and its compilation) per mesh and unit choice, shared by the examples."""
    mesh = eqxpar.make_mesh(**dict(sizes))
    specs = fsdp_specs(tiny_gpt(0), mesh, param_specs=eqxpar.nn.partition_specs(tiny_gpt(0), mesh))
    units = (lambda m: m.blocks) if per_unit[0] else None
    return specs, fsdp_step(loss_fn, OPTIMIZER, mesh, param_specs=specs, units=units, remat=per_unit[1])


def fsdp_run(model, batches, sizes, per_unit=(False, False)):
    specs, step = cached_step(tuple(sizes.items()), per_unit)
    mesh = step.mesh
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_inexact_array))
    opt_state = eqxpar.shard(opt_state, mesh, optimizer_specs(OPTIMIZER, opt_state, model, specs))
    model = eqxpar.shard(model, mesh, specs)
    losses = []
    for batch in batches:
        model, opt_state, metrics = step(model, opt_state, eqxpar.shard(batch, mesh, P("fsdp")))
        losses.append(float(metrics["loss"]))
    return model, opt_state, losses, step


@given(
    sizes=mesh_sizes(("fsdp", "model")),
    seed=st.integers(0, 2**16),
    steps=st.integers(1, 3),
    per_unit=st.sampled_from([(False, False), (True, False), (True, True)]),
)
def test_fsdp_matches_one_device(sizes, seed, steps, per_unit):
    batches = [token_batch(8, seed + i) for i in range(steps)]
    # A fresh model for each run: the step donates (deletes) the arrays it is given.
    want, want_losses = reference_run(tiny_gpt(seed), batches, OPTIMIZER)
    got, _, losses, _ = fsdp_run(tiny_gpt(seed), batches, sizes, per_unit)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_trees_close(got, want, what="parameters after FSDP steps")


def _report(remat: bool, per_unit: bool = True) -> tuple[CommReport, list]:
    batch = token_batch(8, 0)
    _, opt_state, _, step = fsdp_run(tiny_gpt(0), [batch], {"fsdp": 2, "model": 4}, (per_unit, remat))
    specs, _ = cached_step((("fsdp", 2), ("model", 4)), (per_unit, remat))
    placed = eqxpar.shard(tiny_gpt(0), step.mesh, specs)
    lowered = step.lower(placed, opt_state, eqxpar.shard(batch, step.mesh, P("fsdp")))
    split = [s for s in eqxpar.broadcast_specs(specs, tiny_gpt(0)) if "fsdp" in str(s)]
    return CommReport.of(lowered), split


def _report_specs():
    return cached_step((("fsdp", 2), ("model", 4)), (False, False))[0]


def _params(tree):
    return jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))


def test_every_parameter_is_split_over_fsdp_on_top_of_tensor_parallelism():
    model = tiny_gpt(0)
    mesh = eqxpar.make_mesh(fsdp=2, model=4)
    specs = fsdp_specs(model, mesh, param_specs=eqxpar.nn.partition_specs(model, mesh))
    report = eqxpar.sharding_report(eqxpar.shard(model, mesh, specs))
    assert all("fsdp" in row.spec for row in report.rows)
    # Each array is cut into as many pieces as the axes that split it: 8 for the TP-split
    # ones (4 model x 2 fsdp), 2 for the ones TP keeps whole (layer norms, positions).
    for row in report.rows:
        pieces = 8 if "model" in row.spec else 2
        assert row.bytes_per_device * pieces == row.bytes_total, row


def test_collectives_are_gathers_forward_and_reduce_scatters_backward():
    report, split = _report(remat=False, per_unit=False)
    assert len(split) == len(_params(tiny_gpt(0)))
    for stage in ("lowered", "compiled"):
        # One all-gather of every parameter forward, one reduce-scatter of every gradient.
        assert report.count("all-gather", stage=stage) == len(split)
        assert report.count("reduce-scatter", stage=stage) == len(split)
    # The whole gradient, once. A reduce-scatter counts its operand (eqxpar.inspect's
    # convention): each device's model block of every gradient, i.e. fsdp=2 times the
    # slices it stores; its results are exactly those stored slices.
    mesh = eqxpar.make_mesh(fsdp=2, model=4)
    stored = eqxpar.sharding_report(eqxpar.shard(tiny_gpt(0), mesh, _report_specs())).bytes_per_device
    assert report.bytes("reduce-scatter") == 2 * stored
    assert sum(c.result_bytes for c in report.collectives("reduce-scatter")) == stored


def test_remat_regathers_in_the_backward_pass_of_the_lowered_program():
    (plain, split), (remat, _) = _report(remat=False), _report(remat=True)
    block_params = len(_params(tiny_gpt(0).blocks))
    assert plain.count("all-gather", stage="lowered") == len(split)
    # The blocks' weights are gathered again for their backward pass: those the backward
    # pass needs (weights multiply; biases, only added, are not needed again).
    regathered = remat.count("all-gather", stage="lowered") - len(split)
    assert block_params // 2 < regathered <= block_params
    # Same gradient communication either way.
    assert remat.count("reduce-scatter", stage="lowered") == plain.count("reduce-scatter", stage="lowered")


def test_errors():
    mesh = eqxpar.make_mesh(data=8)
    with pytest.raises(ValueError, match="no axis named 'fsdp'"):
        fsdp_step(loss_fn, sgd_momentum(), mesh, param_specs=P())
    mesh = eqxpar.make_mesh(fsdp=8, model=1)
    with pytest.raises(ValueError, match="remat=True needs units"):
        fsdp_step(loss_fn, sgd_momentum(), mesh, param_specs=P(), remat=True)
    model = tiny_gpt(0)
    specs = fsdp_specs(model, mesh)
    step = fsdp_step(loss_fn, sgd_momentum(), mesh, param_specs=specs)
    opt = sgd_momentum()
    opt_state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    with pytest.raises(ValueError, match="global batch size 12 is not divisible by the 8"):
        step(eqxpar.shard(model, mesh, specs), opt_state, token_batch(12, 0))


def test_grad_norm_is_the_norm_of_the_whole_gradient():
    from _gpt_reference import reference_value_and_grad

    batch = token_batch(8, 3)
    _, grads = reference_value_and_grad()(tiny_gpt(3), batch)
    want = float(optax.tree.norm(eqx.filter(grads, eqx.is_inexact_array)))
    specs, step = cached_step((("fsdp", 2), ("model", 4)), (True, False))
    model = tiny_gpt(3)
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_inexact_array))
    opt_state = eqxpar.shard(opt_state, step.mesh, optimizer_specs(OPTIMIZER, opt_state, model, specs))
    _, _, metrics = step(eqxpar.shard(model, step.mesh, specs), opt_state, eqxpar.shard(batch, step.mesh, P("fsdp")))
    np.testing.assert_allclose(float(metrics["grad_norm"]), want, rtol=1e-5)
