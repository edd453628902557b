"""`eqxpar.nn.layer_norm` and `eqxpar.nn.gelu`: the values of `eqx.nn.LayerNorm` and
`jax.nn.gelu` bit for bit, gradients equal to autodiff of the formulas, and backward
passes that keep only what their gradients read (counted from `jax.vjp`'s residuals).
Inside `shard_map`, a replicated norm applied to rows split over an axis gets its
gradient summed over that axis (as autodiff of the plain formula does)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar.nn import gelu, layer_norm


def _norm(dim, use_weight, use_bias, seed):
    norm = eqx.nn.LayerNorm(dim, use_weight=use_weight, use_bias=use_bias)
    k1, k2 = jax.random.split(jax.random.key(seed))
    if use_weight:
        norm = eqx.tree_at(lambda n: n.weight, norm, jax.random.normal(k1, (dim,)))
    if use_bias:
        norm = eqx.tree_at(lambda n: n.bias, norm, jax.random.normal(k2, (dim,)))
    return norm


def _plain(norm, x):
    """eqx.nn.LayerNorm on every row, differentiated by autodiff."""
    flat = x.reshape(-1, x.shape[-1])
    return jax.vmap(norm)(flat).reshape(x.shape)


def _residual_values(fn, *args):
    """Values `jax.vjp(fn, *args)`'s backward pass holds, other than the arguments."""
    _, backward = jax.vjp(fn, *args)
    inputs = {id(a) for a in jax.tree.leaves(args)}
    held = {id(x): x for x in jax.tree.leaves(backward) if id(x) not in inputs and jnp.ndim(x) > 0}
    return sum(x.size for x in held.values())


@given(
    lead=st.lists(st.integers(1, 4), min_size=0, max_size=2),
    dim=st.integers(2, 12),
    use_weight=st.booleans(),
    use_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_layer_norm_equals_eqx_and_autodiff(lead, dim, use_weight, use_bias, seed):
    norm = _norm(dim, use_weight, use_bias, seed)
    x = 3 * jax.random.normal(jax.random.key(seed + 1), (*lead, dim)) + 1
    np.testing.assert_array_equal(layer_norm(norm, x), _plain(norm, x))
    cotangent = jax.random.normal(jax.random.key(seed + 2), x.shape)

    def loss(f):
        return lambda n, x: jnp.sum(f(n, x) * cotangent)

    # The gradients compiled, one program each rather than op by op (half the time).
    got = eqx.filter_jit(jax.grad(loss(layer_norm), argnums=(0, 1)))(norm, x)
    want = eqx.filter_jit(jax.grad(loss(_plain), argnums=(0, 1)))(norm, x)
    # Gradients are O(1) (unit cotangents, deviation 3); atol covers float32 rounding of
    # gradients that are zero in exact arithmetic (e.g. dim = 2, where the output is +-1).
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=3), scale=st.floats(0.1, 8.0), seed=st.integers(0, 2**16))
def test_gelu_equals_jax_and_autodiff(shape, scale, seed):
    x = scale * jax.random.normal(jax.random.key(seed), shape)
    np.testing.assert_array_equal(gelu(x), jax.nn.gelu(x))
    got = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(gelu(x)))))(x)
    want = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(jax.nn.gelu(x)))))(x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_the_backward_passes_keep_only_what_they_read():
    x = jax.random.normal(jax.random.key(0), (4, 8, 16))
    norm = _norm(16, True, True, 0)
    # The normalised input and one inverse deviation per row.
    assert _residual_values(layer_norm, norm, x) == x.size + x.size // 16
    # Autodiff of the formula keeps several arrays the size of the input.
    assert _residual_values(_plain, norm, x) > 2 * x.size
    assert _residual_values(gelu, x) == 0  # only its input, an argument
    assert _residual_values(jax.nn.gelu, x) >= 3 * x.size


def test_a_replicated_norm_on_split_rows_gets_the_summed_gradient():
    """Sequence parallelism's case: rows split over `model`, the norm's weights the same on
    every device; the gradient of the weights out of shard_map is the whole batch's."""
    mesh = eqxpar.make_mesh(model=4)
    norm = _norm(16, True, True, 3)
    x = jax.random.normal(jax.random.key(4), (8, 16))
    cotangent = jax.random.normal(jax.random.key(5), x.shape)

    def per_device(norm, x, c):
        return jax.lax.psum(jnp.sum(layer_norm(norm, x) * c), "model")

    mapped = eqxpar.filter_shard_map(per_device, mesh=mesh, in_specs=(P(), P("model"), P("model")), out_specs=P())
    got = jax.grad(mapped, argnums=(0, 1))(norm, x, cotangent)
    want = jax.grad(lambda n, x: jnp.sum(_plain(n, x) * cotangent), argnums=(0, 1))(norm, x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
