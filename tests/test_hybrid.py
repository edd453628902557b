"""Hybrid data x tensor parallelism: the same training run as one device, over drawn meshes."""

import functools

import equinox as eqx
import jax
import numpy as np
import pytest
from _gpt_reference import CONTEXT, loss_fn, reference_run, sgd_momentum, tiny_gpt, token_batch
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import eqxpar
import eqxpar.nn
from eqxpar.inspect import CommReport
from eqxpar.testing import assert_trees_close, mesh_sizes
from eqxpar.train import hybrid_step, optimizer_specs

OPTIMIZER = sgd_momentum()


@functools.cache
def cached_step(sizes: tuple):
    """One step (and its compilation) per mesh, shared by the examples."""
    mesh = eqxpar.make_mesh(**dict(sizes))
    specs = eqxpar.nn.partition_specs(tiny_gpt(0), mesh)
    return specs, hybrid_step(loss_fn, OPTIMIZER, mesh, param_specs=specs)


def hybrid_run(model, batches, sizes):
    specs, step = cached_step(tuple(sizes.items()))
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_inexact_array))
    opt_state = eqxpar.shard(opt_state, step.mesh, optimizer_specs(OPTIMIZER, opt_state, model, specs))
    model = eqxpar.shard(model, step.mesh, specs)
    losses = []
    for batch in batches:
        model, opt_state, metrics = step(model, opt_state, eqxpar.shard(batch, step.mesh, P("data")))
        losses.append(float(metrics["loss"]))
    return model, opt_state, losses, step


@given(sizes=mesh_sizes(("data", "model")), seed=st.integers(0, 2**16), steps=st.integers(1, 3))
def test_hybrid_matches_one_device(sizes, seed, steps):
    batches = [token_batch(8, seed + i) for i in range(steps)]
    # A fresh model for each run: the step donates (deletes) the arrays it is given.
    want, want_losses = reference_run(tiny_gpt(seed), batches, OPTIMIZER)
    got, _, losses, _ = hybrid_run(tiny_gpt(seed), batches, sizes)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_trees_close(got, want, what="parameters after hybrid steps")


def test_one_gradient_all_reduce_over_data_and_two_per_block_over_model():
    sizes = {"data": 2, "model": 4}
    batch = token_batch(8, 0)
    _, opt_state, _, step = hybrid_run(tiny_gpt(0), [batch], sizes)
    specs, _ = cached_step(tuple(sizes.items()))
    placed = eqxpar.shard(tiny_gpt(0), step.mesh, specs)
    report = CommReport.of(step.lower(placed, opt_state, eqxpar.shard(batch, step.mesh, P("data"))))
    over_data = [c for c in report.collectives("all-reduce") if c.group_size == 2]
    over_model = [c for c in report.collectives("all-reduce") if c.group_size == 4]
    # Data axis: the loss and every gradient, in one combined all-reduce of exactly this
    # device's parameter bytes (its model block) plus the 4-byte loss.
    block_bytes = eqxpar.sharding_report(placed).bytes_per_device
    assert len(over_data) == 1 and over_data[0].bytes == block_bytes + 4
    # Model axis: activations of batch x seq x dim, all-reduced once forward and once
    # backward in each block's attention and MLP, plus the vocab-parallel embedding's lookup
    # (forward) and the head's input gradient (backward); and two small all-reduces of
    # per-token statistics for the vocab-parallel loss (the max, then the sum of
    # exponentials with the target logit); and one 4-byte all-reduce of the squared norm of
    # the model-split gradients, for metrics["grad_norm"]. Nothing else.
    per_device_batch, dim, blocks = 4, 32, len(tiny_gpt(0).blocks)
    activation_bytes = per_device_batch * CONTEXT * dim * 4
    activations = [c for c in over_model if c.bytes == activation_bytes]
    grad_norm = [c for c in over_model if c.bytes == 4]
    per_token = [c for c in over_model if c.bytes not in (activation_bytes, 4)]
    assert len(activations) == 4 * blocks + 2
    assert len(grad_norm) == 1
    assert len(per_token) == 2
    assert all(c.bytes <= 2 * per_device_batch * CONTEXT * 4 for c in per_token)
    assert len(report.collectives()) == len(over_data) + len(over_model)


def test_hybrid_needs_both_axes():
    with pytest.raises(ValueError, match="no model axis 'model'"):
        hybrid_step(loss_fn, OPTIMIZER, eqxpar.make_mesh(data=8), param_specs=P())
    with pytest.raises(ValueError, match="no axis named 'data'"):
        hybrid_step(loss_fn, OPTIMIZER, eqxpar.make_mesh(model=8), param_specs=P())


def test_param_specs_may_not_split_over_the_data_axis():
    sizes = {"data": 2, "model": 4}
    mesh = eqxpar.make_mesh(**sizes)
    model = tiny_gpt(0)
    bad = jax.tree.map(lambda _: P(), model)
    bad = eqx.tree_at(lambda m: m.position_embedding.weight, bad, P("data"))
    step = hybrid_step(loss_fn, OPTIMIZER, mesh, param_specs=bad)
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_inexact_array))
    with pytest.raises(ValueError, match="splits a parameter over the batch axis.*fsdp_step"):
        step(model, opt_state, token_batch(8, 0))
