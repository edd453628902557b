"""Scanned GPT blocks under the hybrid and FSDP steps; under FSDP, one layer gathered at a time.

The stacked arrays keep their layer axis whole (fsdp_specs splits another dimension), so
the scan body gathers one layer's slice: the compiled program's all-gathers have per-layer
shapes (no leading layer axis), and the step equals one device's (loss, gradient norm and
parameters after two SGD-momentum steps; scale-sensitive, so a doubled or dropped
reduce-scatter fails).
"""

import functools

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from _gpt_reference import CONTEXT, TEXT, token_batch
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar.inspect import CommReport
from eqxpar.models import GPT, next_token_loss
from eqxpar.testing import assert_trees_close
from eqxpar.train import fsdp_specs, fsdp_step, hybrid_step, shard_batch

LAYERS = 3


def scanned_gpt(seed):
    return GPT(
        TEXT.vocab_size, CONTEXT, dim=32, num_heads=4, num_layers=LAYERS, scan_layers=True, key=jax.random.key(seed)
    )


@functools.cache
def reference_value_and_grad():
    """One device: the scanned GPT's loss and gradient, no eqxpar step involved."""
    one = eqxpar.make_mesh(model=1)
    one_specs = eqxpar.nn.partition_specs(scanned_gpt(0), one)
    return eqx.filter_jit(
        eqxpar.filter_shard_map(
            eqx.filter_value_and_grad(lambda m, b: next_token_loss(m, b)),
            mesh=one,
            in_specs=(one_specs, P()),
            out_specs=(P(), one_specs),
        )
    )


def loss_fn(model, tokens, key):
    return next_token_loss(model, tokens, key=key)


@pytest.mark.parametrize("sizes, remat", [({"fsdp": 4, "model": 2}, False), ({"fsdp": 8, "model": 1}, True)])
def test_scanned_gpt_under_fsdp_gathers_per_layer_and_equals_one_device(sizes, remat):
    mesh = eqxpar.make_mesh(**sizes)
    opt = optax.sgd(0.1, momentum=0.9)
    step = fsdp_step(loss_fn, opt, mesh, units=lambda m: m.blocks, remat=remat)
    specs = fsdp_specs(scanned_gpt(0), mesh, param_specs=eqxpar.nn.partition_specs(scanned_gpt(0)))
    stacked = jax.tree.leaves(specs.blocks, is_leaf=lambda x: isinstance(x, P))
    assert stacked and all(len(s) == 0 or s[0] is None for s in stacked)  # layer axis never split

    value_and_grad = reference_value_and_grad()
    want, ref_state = scanned_gpt(1), opt.init(eqx.filter(scanned_gpt(1), eqx.is_inexact_array))
    model, opt_state = step.init(scanned_gpt(1))
    for i in range(2):
        batch = token_batch(8, 30 + i)
        loss, grads = value_and_grad(want, batch)
        updates, ref_state = opt.update(eqx.filter(grads, eqx.is_inexact_array), ref_state)
        want = eqx.apply_updates(want, updates)
        model, opt_state, metrics = step(model, opt_state, shard_batch(batch, mesh, batch_axis="fsdp"))
        np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-5)
        np.testing.assert_allclose(
            float(metrics["grad_norm"]), float(optax.global_norm(eqx.filter(grads, eqx.is_inexact_array))), rtol=1e-5
        )
    assert_trees_close(model, want, rtol=1e-5, atol=1e-6, what="parameters")

    report = CommReport.of(step.lower(model, opt_state, shard_batch(token_batch(8, 0), mesh, batch_axis="fsdp")))
    gathered = [shape for c in report.collectives("all-gather", stage="lowered") for shape in c.shapes]
    block_shapes = {
        tuple(x.shape[1:]) for x in jax.tree.leaves(eqx.filter(scanned_gpt(0).blocks, eqx.is_inexact_array))
    }
    stacked_shapes = {tuple(x.shape) for x in jax.tree.leaves(eqx.filter(scanned_gpt(0).blocks, eqx.is_inexact_array))}
    # Gathers of the blocks' weights happen per layer (slices without the layer axis).
    assert not any(len(s) and s[0] == LAYERS and tuple(s) in stacked_shapes for s in gathered)
    assert any(len(s) + 1 in {len(b) + 1 for b in block_shapes} for s in gathered)


def test_scanned_gpt_under_the_hybrid_step_equals_one_device():
    """Scanned blocks, tensor-parallel inside the scan body, batch over data: two SGD-momentum
    steps equal one device's."""
    mesh = eqxpar.make_mesh(data=2, model=4)
    opt = optax.sgd(0.1, momentum=0.9)
    step = hybrid_step(loss_fn, opt, mesh)
    value_and_grad = reference_value_and_grad()
    want, ref_state = scanned_gpt(2), opt.init(eqx.filter(scanned_gpt(2), eqx.is_inexact_array))
    model, opt_state = step.init(scanned_gpt(2))
    for i in range(2):
        batch = token_batch(8, 40 + i)
        loss, grads = value_and_grad(want, batch)
        updates, ref_state = opt.update(eqx.filter(grads, eqx.is_inexact_array), ref_state)
        want = eqx.apply_updates(want, updates)
        model, opt_state, metrics = step(model, opt_state, shard_batch(batch, mesh))
        np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-5)
    assert_trees_close(model, want, rtol=1e-5, atol=1e-6, what="parameters")
