"""Ring attention on a ring of 4 (context=4), causal, both layouts: forward and gradients
equal dense attention. On a ring of 2 a block sent the wrong way round arrives at the same
device, so the pinned context=2 examples cannot tell the directions apart. Caught by this
test: tools/mutants.toml's ring-perm-reversed and ring-backward-perm-forward."""

import jax
import jax.numpy as jnp
import pytest
from _dense_attention import dense_attention
from test_ring_attention import assert_close, context_attention, qkv

import eqxpar
from eqxpar.nn import ring_attention


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ring_of_four_equals_dense(layout):
    mesh = eqxpar.make_mesh(context=4)
    q, k, v = qkv(3, 1, 16, 2, 4)
    parallel = context_attention(ring_attention, mesh, layout, True)
    assert_close(jax.jit(parallel)(q, k, v), dense_attention(q, k, v, True))
    w = jax.random.normal(jax.random.key(4), q.shape[:-1] + (v.shape[-1],))
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(parallel(*a) * w), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(lambda *a: jnp.sum(dense_attention(*a, True) * w), argnums=(0, 1, 2))(q, k, v)
    for g, h in zip(grads, want):
        assert_close(g, h)
