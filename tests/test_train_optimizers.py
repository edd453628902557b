"""Whole-gradient optimizers under every strategy, and FSDP with grad_accum and state.

The optimizer runs on the global gradient in every step builder, so transformations that
look at the whole gradient at once give the single-device result: global-norm clipping
with AdamW, `optax.MultiSteps`, masked weight decay. `metrics["grad_norm"]` is the
single-device global norm (a dropped or doubled reduction of any gradient, or of the norm's
partial sums, changes it). Reference: plain Equinox + optax on one device, no eqxpar step.
"""

import functools

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from _budget import examples
from _gpt_reference import loss_fn, reference_value_and_grad, tiny_gpt, token_batch
from hypothesis import given
from hypothesis import strategies as st

import eqxpar
from eqxpar.testing import assert_trees_close, mesh_sizes
from eqxpar.train import data_parallel_step, fsdp_step, hybrid_step, shard_batch

# Clipping must bite: the tiny GPT's first gradients have norms around 1-3. AdamW's eps is
# 1e-3, not 1e-8: with a tiny eps Adam's first update is lr * sign(g) for entries whose
# gradient is ~1e-9, so a last-bit difference in the order the shards' gradients are summed
# flips a whole lr-sized step (seen: 1 entry in 1024 off by 8e-5). With eps 1e-3 the update
# is a smooth function of the gradient and the float32 parity tolerance holds.
OPTIMIZERS = {
    "clip+adamw": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, eps=1e-3, weight_decay=0.1)),
    "multisteps": lambda: optax.MultiSteps(optax.sgd(0.1, momentum=0.9), every_k_schedule=2),
    "masked-decay": lambda: optax.chain(
        optax.add_decayed_weights(0.05, mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)),
        optax.clip_by_global_norm(0.5),
        optax.sgd(0.1),
    ),
}
STRATEGIES = ("data_parallel", "hybrid", "fsdp", "fsdp+tp")


def strategy_mesh(strategy):
    if strategy == "data_parallel":
        return st.sampled_from([1, 2, 8]).map(lambda n: {"data": n, "model": 1})
    if strategy == "hybrid":
        return mesh_sizes(("data", "model"), device_counts=(1, 8))
    if strategy == "fsdp":
        return st.sampled_from([2, 8]).map(lambda n: {"fsdp": n, "model": 1})
    return st.sampled_from([(2, 4), (4, 2)]).map(lambda s: {"fsdp": s[0], "model": s[1]})


@functools.cache
def cached_step(strategy, sizes, optimizer):
    mesh = eqxpar.make_mesh(**dict(sizes))
    opt = OPTIMIZERS[optimizer]()
    if strategy == "data_parallel":
        return data_parallel_step(loss_fn, opt, mesh), "data"
    if strategy == "hybrid":
        return hybrid_step(loss_fn, opt, mesh), "data"
    return fsdp_step(loss_fn, opt, mesh), "fsdp"


def reference_run(model, batches, optimizer):
    """One device: per step the loss, the global gradient norm, and the updated model."""
    opt = OPTIMIZERS[optimizer]()
    opt_state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    losses, norms = [], []
    for batch in batches:
        loss, grads = reference_value_and_grad()(model, batch)
        grads = eqx.filter(grads, eqx.is_inexact_array)
        updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        model = eqx.apply_updates(model, updates)
        losses.append(float(loss))
        norms.append(float(optax.global_norm(grads)))
    return model, losses, norms


@examples(1)  # more under HYPOTHESIS_PROFILE=thorough
@given(
    data=st.data(),
    strategy=st.sampled_from(STRATEGIES),
    optimizer=st.sampled_from(sorted(OPTIMIZERS)),
    seed=st.integers(0, 2**16),
)
def test_whole_gradient_optimizers_equal_one_device(data, strategy, optimizer, seed):
    sizes = data.draw(strategy_mesh(strategy), label="mesh")
    step, batch_axis = cached_step(strategy, tuple(sizes.items()), optimizer)
    batches = [token_batch(8, seed + i) for i in range(3)]
    want_model, want_losses, want_norms = reference_run(tiny_gpt(seed), batches, optimizer)

    model, opt_state = step.init(tiny_gpt(seed))
    for i, batch in enumerate(batches):
        model, opt_state, metrics = step(model, opt_state, shard_batch(batch, step.mesh, batch_axis=batch_axis))
        np.testing.assert_allclose(float(metrics["loss"]), want_losses[i], rtol=1e-5, err_msg=f"loss, step {i}")
        np.testing.assert_allclose(
            float(metrics["grad_norm"]), want_norms[i], rtol=1e-5, err_msg=f"grad_norm, step {i}"
        )
    assert_trees_close(model, want_model, rtol=1e-5, atol=1e-6, what=f"{strategy} {sizes} {optimizer}: parameters")


def test_clipping_is_applied_with_the_global_norm_under_tensor_parallelism():
    """The old failure: clip_by_global_norm under hybrid_step on a 1x1 mesh raised JAX's
    check_vma error. Now it runs, and it clips by the norm of the whole gradient: the update
    of SGD(1.0) after clipping to 1e-3 has exactly that norm."""
    mesh = eqxpar.make_mesh(data=2, model=4)
    opt = optax.chain(optax.clip_by_global_norm(1e-3), optax.sgd(1.0))
    step = hybrid_step(loss_fn, opt, mesh)
    before = tiny_gpt(0)
    model, opt_state = step.init(before)
    model, _, metrics = step(model, opt_state, shard_batch(token_batch(8, 0), mesh))
    delta = jax.tree.map(
        lambda a, b: a - b,
        eqx.filter(eqxpar.gather(model), eqx.is_inexact_array),
        eqx.filter(before, eqx.is_inexact_array),
    )
    assert float(metrics["grad_norm"]) > 1e-2
    np.testing.assert_allclose(float(optax.global_norm(delta)), 1e-3, rtol=1e-3)


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_fsdp_grad_accum_equals_one_device(grad_accum):
    """FSDP with gradient accumulation: every micro-batch's gather and reduce-scatter add up
    to the single-device gradient of the whole batch (SGD with momentum: scale-sensitive)."""
    opt = optax.sgd(0.1, momentum=0.9)
    mesh = eqxpar.make_mesh(fsdp=4, model=2)
    step = fsdp_step(loss_fn, opt, mesh, grad_accum=grad_accum, units=lambda m: m.blocks)
    batches = [token_batch(16, 10 + i) for i in range(2)]
    value_and_grad = reference_value_and_grad()
    want = tiny_gpt(3)
    ref_state = opt.init(eqx.filter(want, eqx.is_inexact_array))
    model, opt_state = step.init(tiny_gpt(3))
    for batch in batches:
        loss, grads = value_and_grad(want, batch)
        updates, ref_state = opt.update(eqx.filter(grads, eqx.is_inexact_array), ref_state)
        want = eqx.apply_updates(want, updates)
        model, opt_state, metrics = step(model, opt_state, shard_batch(batch, mesh, batch_axis="fsdp"))
        np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-5)
        np.testing.assert_allclose(float(metrics["grad_norm"]), float(optax.global_norm(grads)), rtol=1e-5)
    assert_trees_close(model, want, rtol=1e-5, atol=1e-6, what="parameters")


def test_hybrid_sharding_copies_over_data_and_splits_over_fsdp():
    """batch_axis=("data", "fsdp"): parameters sliced over fsdp, copied over data."""
    opt = optax.sgd(0.1, momentum=0.9)
    mesh = eqxpar.make_mesh(data=2, fsdp=4, model=1)
    step = fsdp_step(loss_fn, opt, mesh, batch_axis=("data", "fsdp"))
    model, opt_state = step.init(tiny_gpt(5))
    weight = model.blocks[0].mlp.hidden.weight
    assert weight.sharding.shard_shape(weight.shape)[1] == weight.shape[1] // 4
    batch = token_batch(8, 7)
    want, grads = reference_value_and_grad()(tiny_gpt(5), batch)
    got, _, metrics = step(model, opt_state, shard_batch(batch, mesh, batch_axis=("data", "fsdp")))
    np.testing.assert_allclose(float(metrics["loss"]), float(want), rtol=1e-5)
    # A gradient reduced twice over data leaves the loss alone: the norm and the update show it.
    grads = eqx.filter(grads, eqx.is_inexact_array)
    np.testing.assert_allclose(float(metrics["grad_norm"]), float(optax.tree.norm(grads)), rtol=1e-5)
    updates, _ = opt.update(grads, opt.init(eqx.filter(tiny_gpt(5), eqx.is_inexact_array)))
    assert_trees_close(got, eqx.apply_updates(tiny_gpt(5), updates), rtol=1e-5, atol=1e-6, what="parameters")


def test_fsdp_with_state_equals_one_device():
    """has_state under FSDP: a BatchNorm over the vmap axis and the fsdp axis, parameters
    split over fsdp, equals the single-device BatchNorm model (outputs, statistics, params)."""
    from test_data_parallel_state import OPTIMIZER, BatchNormNet, make_batch, reference_step, single_device
    from test_data_parallel_state import loss_fn as bn_loss

    from eqxpar.testing import on_one_device

    mesh = eqxpar.make_mesh(fsdp=8)
    step = fsdp_step(bn_loss, OPTIMIZER, mesh, has_state=True, grad_accum=2)
    model, state = eqx.nn.make_with_state(BatchNormNet)(jax.random.key(1), ("batch", "fsdp"))
    ref = jax.tree.map(lambda a: np.array(a) if eqx.is_array(a) else a, (single_device(model), state))
    ref_model, ref_state = ref
    ref_opt_state = OPTIMIZER.init(eqx.filter(ref_model, eqx.is_inexact_array))
    model, state, opt_state = step.init(model, state)
    assert model.lin1.weight.sharding.shard_shape(model.lin1.weight.shape)[0] == 1
    for i in range(2):
        batch = make_batch(20 + i, 16)
        ref_model, ref_state, ref_opt_state, ref_loss = on_one_device(
            reference_step, ref_model, ref_state, ref_opt_state, batch, 2
        )
        model, state, opt_state, metrics = step(model, state, opt_state, shard_batch(batch, mesh, batch_axis="fsdp"))
        assert_trees_close(metrics["loss"], ref_loss, what=f"loss at step {i}")
        # The reference optimizer keeps its last gradient first (check_vma is off with state).
        assert_trees_close(metrics["grad_norm"], optax.tree.norm(ref_opt_state[0]), what=f"grad_norm at step {i}")
        assert_trees_close(state, ref_state, what=f"running statistics after step {i}")
        assert_trees_close(single_device(model), ref_model, what=f"parameters after step {i}")


def test_every_builder_has_the_same_signature_shape():
    import inspect

    shapes = set()
    for builder in (data_parallel_step, hybrid_step, fsdp_step):
        params = inspect.signature(builder).parameters
        positional = tuple(n for n, p in params.items() if p.kind == p.POSITIONAL_OR_KEYWORD)
        keyword = {n for n, p in params.items() if p.kind == p.KEYWORD_ONLY}
        assert {"param_specs", "batch_axis", "grad_accum", "has_state"} <= keyword, builder.__name__
        shapes.add(positional)
    assert shapes == {("loss_fn", "optimizer", "mesh")}
