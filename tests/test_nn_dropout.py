"""Dropout inside tensor-parallel layers where activations are split: the MLP's hidden units
get a different mask on every device.

(Attention dropout equals eqx.nn.MultiheadAttention's exactly: see the attention parity test
in test_nn_parity.py. Replicated activations (the residual stream) get the same mask on
every device: see test_models.py, where a GPT with dropout matches across model sizes.)"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar import nn
from eqxpar.testing import assert_trees_close, on_one_device

# Dropout keys use the "rbg" generator: these properties hold for any generator, and XLA
# compiles rbg's random bits several times faster than threefry's.
IMPL = "rbg"


def _hidden_masks(mlp, x, key, n):
    """Which hidden units each device dropped, read off the hidden layer's weight gradient:
    a dropped unit's row gets no gradient. Returns shape (n, width / n)."""
    mesh = eqxpar.make_mesh(model=n)
    specs = nn.partition_specs(mlp, mesh)
    forward = eqxpar.filter_shard_map(
        lambda mlp, x, key_data: mlp(x, key=jax.random.wrap_key_data(key_data, impl=IMPL)),
        mesh=mesh,
        in_specs=(specs, P(), P()),
        out_specs=P(),
    )
    grads = eqx.filter_jit(eqx.filter_grad(lambda mlp: jnp.sum(forward(mlp, x, jax.random.key_data(key)))))(mlp)
    kept = np.any(np.asarray(grads.hidden.weight) != 0, axis=1)
    return kept.reshape(n, -1)


def test_mlp_hidden_dropout_draws_a_mask_per_device():
    n, per_device = 4, 32
    mlp = nn.ParallelMLP(6, 3, n * per_device, activation=jax.nn.sigmoid, dropout_p=0.5, key=jax.random.key(0))
    x = jnp.linspace(0.5, 1.5, 6)
    masks = _hidden_masks(mlp, x, jax.random.key(1, impl=IMPL), n)
    # Each device drops about half of its units...
    assert np.all((masks.mean(axis=1) > 0.15) & (masks.mean(axis=1) < 0.85)), masks.mean(axis=1)
    # ...and the devices' masks differ (identical keys would give identical masks: the
    # chance of two independent 32-unit masks agreeing is 2**-32).
    assert len({tuple(m) for m in masks}) == n, "devices drew the same dropout mask"
    # The same key gives the same masks; another key, others.
    np.testing.assert_array_equal(masks, _hidden_masks(mlp, x, jax.random.key(1, impl=IMPL), n))
    assert not np.array_equal(masks, _hidden_masks(mlp, x, jax.random.key(2, impl=IMPL), n))


def test_mlp_dropout_off_in_inference_mode():
    n = 2
    mlp = nn.ParallelMLP(6, 3, 8, dropout_p=0.9, key=jax.random.key(0))
    x = jnp.linspace(0.5, 1.5, 6)
    mesh = eqxpar.make_mesh(model=n)
    specs = nn.partition_specs(mlp, mesh)
    run = eqxpar.filter_shard_map(
        lambda mlp, x, k: (
            mlp(x, key=jax.random.wrap_key_data(k, impl=IMPL), inference=True),
            mlp(x, key=None, inference=True),
        ),
        mesh=mesh,
        in_specs=(specs, P(), P()),
        out_specs=P(),
    )
    with_key, without = run(mlp, x, jax.random.key_data(jax.random.key(3, impl=IMPL)))
    assert_trees_close(with_key, without, rtol=0, atol=0)
    assert_trees_close(without, on_one_device(nn.to_dense(mlp), x), what="inference-mode MLP")
