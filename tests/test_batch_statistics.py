"""Batch norms of one's own: a layer that reduces over the examples of the batch (here a
user's BatchNorm, not eqx.nn.BatchNorm) is found by what it does, so one left on the vmap
axis alone is refused before anything compiles, and one given the batch axis too trains as
on one device (issue 20: left on its default axis it trained with gradients 130x off)."""

import logging

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import eqxpar
from eqxpar.testing import assert_trees_close
from eqxpar.train import data_parallel_step, shard_batch

OPTIMIZER = optax.sgd(0.1)


class MyBatchNorm(eqx.Module):
    """A third-party batch norm: statistics over a named axis, running mean in the state."""

    scale: jax.Array
    index: eqx.nn.StateIndex
    axis_name: str | tuple = eqx.field(static=True)

    def __init__(self, size, axis_name="batch"):
        self.scale = jnp.ones(size)
        self.index = eqx.nn.StateIndex(jnp.zeros(size))
        self.axis_name = axis_name

    def __call__(self, x, state):
        mean = jax.lax.pmean(x, self.axis_name)
        var = jax.lax.pmean(jnp.square(x - mean), self.axis_name)
        state = state.set(self.index, 0.9 * state.get(self.index) + 0.1 * mean)
        return self.scale * (x - mean) * jax.lax.rsqrt(var + 1e-5), state


class Net(eqx.Module):
    linear: eqx.nn.Linear
    norm: MyBatchNorm

    def __init__(self, axis_name, key):
        self.linear = eqx.nn.Linear(3, 4, key=key)
        self.norm = MyBatchNorm(4, axis_name)

    def __call__(self, x, state):
        return self.norm(self.linear(x), state)


def loss_fn(model, state, batch, key=None):
    out, state = jax.vmap(model, in_axes=(0, None), out_axes=(0, None), axis_name="batch")(batch, state)
    return jnp.mean(jnp.square(out[:, 0] - batch[:, 0])), state


def batch_of(n):
    return jax.random.normal(jax.random.key(1), (n, 3))


def test_own_batch_norm_without_the_batch_axis_is_refused(caplog):
    mesh = eqxpar.make_mesh(data=2)
    model, state = eqx.nn.make_with_state(Net)("batch", jax.random.key(0))
    step = data_parallel_step(loss_fn, OPTIMIZER, mesh, has_state=True)
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_inexact_array))
    batch = shard_batch(batch_of(8), mesh)
    caplog.set_level(logging.WARNING)
    with jax.log_compiles(True), pytest.raises(ValueError) as error:
        step(model, state, opt_state, batch)
    text = str(error.value)
    assert "MyBatchNorm at model.norm has axis_name='batch'" in text, text
    assert "MyBatchNorm(..., axis_name=('batch', 'data'))" in text, text
    assert not [r for r in caplog.records if r.getMessage().startswith("Compiling")]


def test_own_batch_norm_over_the_batch_axis_trains_as_on_one_device():
    mesh = eqxpar.make_mesh(data=2)
    model, state = eqx.nn.make_with_state(Net)(("batch", "data"), jax.random.key(0))
    dense, dense_state = eqx.nn.make_with_state(Net)("batch", jax.random.key(0))
    batch = batch_of(8)
    (loss, new_state), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(dense, dense_state, batch)
    expected = eqx.apply_updates(dense, OPTIMIZER.update(grads, OPTIMIZER.init(grads))[0])

    step = data_parallel_step(loss_fn, OPTIMIZER, mesh, has_state=True)
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_inexact_array))
    model, state, opt_state, metrics = step(model, state, opt_state, shard_batch(batch, mesh))
    assert_trees_close(metrics["loss"], loss, what="loss")
    leaves = lambda m: jax.tree.leaves(eqx.filter(m, eqx.is_array))  # noqa: E731 - axis_name differs
    assert_trees_close(leaves(model), leaves(expected), what="parameters")
    assert_trees_close(state, new_state, what="running statistics")
