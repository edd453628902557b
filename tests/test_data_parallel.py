"""data_parallel_step: parity with a single-device step on the global batch.

Loss, gradients, updated parameters and optimizer state are compared with the same step run
on one device over the whole global batch, for drawn meshes, batch sizes, seeds and step
counts. The optimizer is SGD with momentum: its update is proportional to the gradient, so a
gradient off by a constant factor (the check_vma pitfall: N times too large) shows up in the
parameters, where Adam's scale-invariant update would hide it.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar.testing import assert_trees_close, mesh_sizes, on_one_device
from eqxpar.train import data_parallel_step, shard_batch

IN, OUT = 5, 3


def record_grads() -> optax.GradientTransformation:
    """An optax stage that keeps the last gradient it saw in its state (to compare it)."""
    return optax.GradientTransformation(
        init=lambda params: jax.tree.map(jnp.zeros_like, params),
        update=lambda grads, state, params=None: (grads, grads),
    )


OPTIMIZER = optax.chain(record_grads(), optax.sgd(0.1, momentum=0.9))


def make_model(seed):
    return eqx.nn.MLP(IN, OUT, width_size=8, depth=2, activation=jax.nn.tanh, key=jax.random.key(seed))


def make_batch(seed, size):
    kx, ky = jax.random.split(jax.random.key(seed))
    return np.asarray(jax.random.normal(kx, (size, IN))), np.asarray(jax.random.randint(ky, (size,), 0, OUT))


def loss_fn(model, batch, key):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(jax.vmap(model)(x), y).mean()


def reference_step(model, opt_state, batch):
    """One plain single-device step on the whole batch: the definition of right."""
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, batch, None)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
    return eqx.apply_updates(model, updates), opt_state, loss


def fresh(tree):
    """A host copy: the step donates its inputs, so the reference gets its own arrays."""
    return jax.tree.map(lambda x: np.array(x) if eqx.is_array(x) else x, tree)


@functools.cache
def cached_step(sizes: tuple, grad_accum: int, batch_axis="data"):
    """One step per mesh shape and grad_accum, so hypothesis examples reuse compilations."""
    mesh = eqxpar.make_mesh(**dict(sizes))
    return data_parallel_step(loss_fn, OPTIMIZER, mesh, batch_axis=batch_axis, grad_accum=grad_accum)


def run_both(sizes, global_batch, seed, steps, grad_accum=1, batch_axis="data"):
    """Run `steps` data-parallel steps and the single-device reference; compare each step."""
    step = cached_step(tuple(sizes.items()), grad_accum, batch_axis)
    mesh = step.mesh
    model = make_model(seed)
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_inexact_array))
    ref_model, ref_opt_state = fresh((model, opt_state))
    model, opt_state = eqxpar.shard((model, opt_state), mesh)
    for i in range(steps):
        batch = make_batch(seed + 1 + i, global_batch)
        ref_model, ref_opt_state, ref_loss = on_one_device(reference_step, ref_model, ref_opt_state, batch)
        model, opt_state, metrics = step(model, opt_state, shard_batch(batch, mesh, batch_axis=batch_axis))
        assert_trees_close(metrics["loss"], ref_loss, what=f"loss at step {i}")
        assert_trees_close(opt_state[0], ref_opt_state[0], what=f"gradient at step {i}")
        assert_trees_close(model, ref_model, what=f"parameters after step {i}")
        assert_trees_close(opt_state, ref_opt_state, what=f"optimizer state after step {i}")
    return model


# Global batch sizes divisible by every device count drawn (1, 2, 4, 8): few shapes, so the
# single-device reference compiles once per size.
@given(
    sizes=mesh_sizes(("data",)) | mesh_sizes(("data", "model")),
    split_all_axes=st.booleans(),
    global_batch=st.sampled_from([8, 24]),
    seed=st.integers(0, 2**16),
    steps=st.integers(1, 3),
)
def test_step_equals_one_device_step_on_the_global_batch(sizes, split_all_axes, global_batch, seed, steps):
    # On a 2-axis mesh the batch is split over "data" (the other axis holds copies of
    # everything) or over both axes at once (batch_axis=("data", "model")).
    batch_axis = tuple(sizes) if split_all_axes and len(sizes) > 1 else "data"
    model = run_both(sizes, global_batch, seed, steps, batch_axis=batch_axis)
    leaf = model.layers[0].weight
    assert leaf.sharding.is_equivalent_to(
        NamedSharding(cached_step(tuple(sizes.items()), 1, batch_axis).mesh, P()), leaf.ndim
    )


@given(
    n_data=st.sampled_from([1, 2, 8]),
    grad_accum=st.sampled_from([2, 4]),
    seed=st.integers(0, 2**16),
    steps=st.integers(1, 2),
)
def test_grad_accumulation_equals_one_step_on_the_whole_batch(n_data, grad_accum, seed, steps):
    run_both({"data": n_data}, 32, seed, steps, grad_accum=grad_accum)


def test_local_mean_gradient_is_caught_by_parity():
    """The check_vma pitfall: a local-mean loss differentiated w.r.t. the replicated model
    gives the gradient summed over devices, N times too large; the parity check fails on it
    (and passes on data_parallel_step, see above)."""
    mesh = eqxpar.make_mesh(data=8)
    model = make_model(0)
    batch = make_batch(1, 16)

    def wrong(model, batch):
        grads = eqx.filter_grad(loss_fn)(model, batch, None)  # already summed over "data"
        return jax.lax.pmean(grads, "data")  # a no-op on an unvarying value

    def right(model, batch):
        return eqx.filter_grad(lambda m: jax.lax.pmean(loss_fn(m, batch, None), "data"))(model)

    expected = on_one_device(lambda m, b: eqx.filter_grad(loss_fn)(m, b, None), model, batch)
    specs = dict(mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    got_wrong = eqx.filter_jit(eqxpar.filter_shard_map(wrong, **specs))(model, batch)
    with pytest.raises(AssertionError, match="differ beyond"):
        assert_trees_close(got_wrong, expected, what="local-mean gradient")
    # It is exactly the device count too large.
    np.testing.assert_allclose(
        np.asarray(got_wrong.layers[0].weight), 8 * np.asarray(expected.layers[0].weight), rtol=1e-5, atol=1e-6
    )
    got_right = eqx.filter_jit(eqxpar.filter_shard_map(right, **specs))(model, batch)
    assert_trees_close(got_right, expected, what="global-mean gradient")


def test_compiles_once_and_donates_model_and_optimizer_state():
    traces = []

    def counting_loss(model, batch, key):
        traces.append(1)
        return loss_fn(model, batch, key)

    mesh = eqxpar.make_mesh(data=4)
    step = data_parallel_step(counting_loss, OPTIMIZER, mesh)
    model = eqxpar.shard(make_model(0), mesh)
    opt_state = eqxpar.shard(OPTIMIZER.init(eqx.filter(model, eqx.is_inexact_array)), mesh)
    for i in range(4):
        old_weight = model.layers[0].weight
        batch = shard_batch(make_batch(i, 8), mesh)
        model, opt_state, metrics = step(model, opt_state, batch)
        assert old_weight.is_deleted(), "the model's buffers should be donated to the step"
        assert not batch[0].is_deleted(), "the batch is not donated"
    assert len(traces) == 1, f"the step was traced {len(traces)} times for 4 calls with the same shapes"
    assert np.isfinite(float(metrics["loss"]))


def dropout_loss(model, batch, key):
    """A loss whose value depends on the key: dropout on the inputs."""
    x, y = batch
    keep = jax.random.bernoulli(key, 0.5, x.shape)
    return loss_fn(model, (jnp.where(keep, 2 * x, 0.0), y), None)


@functools.cache
def cached_dropout_step(n_data, grad_accum):
    return data_parallel_step(dropout_loss, OPTIMIZER, eqxpar.make_mesh(data=n_data), grad_accum=grad_accum)


def per_shard_keys(key, n_data, grad_accum):
    """Shard i's key fold_in(key, i); with grad_accum > 1, micro-batch j's fold_in(that, j)."""
    keys = [jax.random.fold_in(key, i) for i in range(n_data)]
    if grad_accum == 1:
        return jnp.stack(keys)[:, None]
    return jnp.stack([jnp.stack([jax.random.fold_in(k, j) for j in range(grad_accum)]) for k in keys])


def dropout_reference(model, batch, keys):
    """Single-device loss and gradient: the mean over shards i and micro-batches j of
    dropout_loss on shard i's rows j, j + A, ... with keys[i, j]."""
    n_data, grad_accum = keys.shape[:2]

    def split(a):  # (n_data * rows, ...) -> (n_data, grad_accum, rows / grad_accum, ...)
        return jnp.swapaxes(a.reshape(n_data, -1, grad_accum, *a.shape[1:]), 1, 2)

    micro = jax.tree.map(split, batch)
    per_micro = jax.vmap(jax.vmap(dropout_loss, in_axes=(None, 0, 0)), in_axes=(None, 0, 0))
    return eqx.filter_value_and_grad(lambda m: per_micro(m, micro, keys).mean())(model)


@given(n_data=st.sampled_from([2, 8]), grad_accum=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_each_shard_gets_its_own_key(n_data, grad_accum, seed):
    """The step equals the single-device mean over shards computed with the documented keys,
    and differs from using one key everywhere."""
    step = cached_dropout_step(n_data, grad_accum)
    model = make_model(seed)
    batch = make_batch(seed + 1, 16)
    key = jax.random.PRNGKey(seed + 2)  # a raw uint32 key: on_one_device gathers it to NumPy
    keys = per_shard_keys(key, n_data, grad_accum)
    ref_loss, ref_grads = on_one_device(dropout_reference, model, batch, keys)
    _, same_key_grads = on_one_device(dropout_reference, model, batch, jnp.broadcast_to(key, keys.shape))
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_inexact_array))
    _, opt_state, metrics = step(
        *eqxpar.shard(fresh((model, opt_state)), step.mesh), shard_batch(batch, step.mesh), key
    )
    assert_trees_close(metrics["loss"], ref_loss, what="loss with per-shard keys")
    assert_trees_close(opt_state[0], ref_grads, what="gradient with per-shard keys")
    with pytest.raises(AssertionError, match="differ beyond"):  # shards do not share one key
        assert_trees_close(opt_state[0], same_key_grads, what="gradient with one key everywhere")
