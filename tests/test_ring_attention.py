"""Ring and all-gather attention over a context axis equal plain softmax attention on the
whole sequence: forward and gradients, causal or not, zigzag or contiguous, context 2/4/8.
A ring with a step dropped or doubled does not."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _budget import examples
from _dense_attention import dense_attention
from hypothesis import example, given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar.nn import (
    all_gather_attention,
    context_positions,
    layout_order,
    ring_attention,
    zigzag_inverse,
    zigzag_order,
)


def context_attention(fn, mesh, layout, causal):
    """`fn` on the sequence laid out and split over `context`, returned in original order."""
    size = mesh.shape["context"]

    def run(q, k, v):
        order = layout_order(q.shape[-3], size, layout)
        q, k, v = (x[..., order, :, :] for x in (q, k, v))
        spec = P(None, "context")
        out = jax.shard_map(
            lambda q, k, v: fn(q, k, v, axis_name="context", causal=causal, layout=layout),
            mesh=mesh,
            in_specs=(spec, spec, spec),
            out_specs=spec,
        )(q, k, v)
        return out[..., np.argsort(order), :, :]

    return run


def qkv(seed, batch, seq, heads, dim):
    keys = jax.random.split(jax.random.key(seed), 3)
    return tuple(jax.random.normal(kk, (batch, seq, heads, dim), jnp.float32) for kk in keys)


def assert_close(a, b, rtol=2e-5, atol=2e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


@examples(1)  # more under HYPOTHESIS_PROFILE=thorough
# Pinned: causal ring attention in both layouts, whose masked ring steps take their own
# branch per layout (the default profile's two drawn examples need not reach them).
@example(context=2, layout="contiguous", causal=True, mode="ring", seed=0)
@example(context=2, layout="zigzag", causal=True, mode="ring", seed=1)
@given(
    context=st.sampled_from([2, 4, 8]),
    layout=st.sampled_from(["zigzag", "contiguous"]),
    causal=st.booleans(),
    mode=st.sampled_from(["ring", "all_gather"]),
    seed=st.integers(0, 2**16),
)
def test_forward_and_gradients_equal_dense(context, layout, causal, mode, seed):
    mesh = eqxpar.make_mesh(context=context)
    fn = ring_attention if mode == "ring" else all_gather_attention
    q, k, v = qkv(seed, 2, 2 * context * 2, 2, 4)
    parallel = context_attention(fn, mesh, layout, causal)
    assert_close(jax.jit(parallel)(q, k, v), dense_attention(q, k, v, causal))
    # A cotangent that weighs every output differently.
    w = jax.random.normal(jax.random.key(seed + 1), q.shape[:-1] + (v.shape[-1],))
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(parallel(*a) * w), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(lambda *a: jnp.sum(dense_attention(*a, causal) * w), argnums=(0, 1, 2))(q, k, v)
    for g, h in zip(grads, want):
        assert_close(g, h)


def test_zigzag_order_pairs_early_and_late_chunks():
    order = zigzag_order(16, 4)  # 8 chunks of 2
    assert order.tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
    assert (order[zigzag_inverse(16, 4)] == np.arange(16)).all()
    # Every device gets the same number of visible (query, key) pairs under a causal mask.
    pos = order.reshape(4, 4)
    work = [(p[:, None] >= order[None, :]).sum() for p in pos]
    assert len(set(work)) == 1
    contiguous = layout_order(16, 4, "contiguous").reshape(4, 4)
    assert len({(p[:, None] >= np.arange(16)[None, :]).sum() for p in contiguous}) == 4


def test_context_positions_follow_layout():
    mesh = eqxpar.make_mesh(context=4)
    for layout in ("zigzag", "contiguous"):
        got = jax.shard_map(
            lambda layout=layout: context_positions(4, "context", layout)[None],
            mesh=mesh,
            in_specs=(),
            out_specs=P("context"),
        )()
        assert np.asarray(got).reshape(-1).tolist() == layout_order(16, 4, layout).tolist()


@pytest.mark.parametrize(
    "bad", [lambda: layout_order(10, 4), lambda: layout_order(8, 2, "stripes"), lambda: zigzag_order(6, 2)]
)
def test_bad_layouts_are_named(bad):
    with pytest.raises(ValueError, match="layout|chunks"):
        bad()


def _ring_with(monkeypatch, hops):
    """Run ring_attention with ppermute replaced by `hops` rotations per call."""
    real = jax.lax.ppermute

    def wrong(x, axis_name, perm):
        for _ in range(hops):
            x = real(x, axis_name, perm)
        return x

    monkeypatch.setattr(jax.lax, "ppermute", wrong)


@pytest.mark.parametrize("hops", [0, 2])
def test_dropped_or_doubled_ring_step_fails(monkeypatch, hops):
    """Skip or double every ring hop (forward, and the backward's K/V and gradient hops):
    the output and the K/V gradients no longer match."""
    mesh = eqxpar.make_mesh(context=4)
    q, k, v = qkv(0, 1, 16, 2, 4)
    parallel = context_attention(ring_attention, mesh, "zigzag", True)
    want = dense_attention(q, k, v, True), jax.grad(lambda k: jnp.sum(dense_attention(q, k, v, True) ** 2))(k)

    def both():  # a fresh function each time, so jax.jit traces again
        return jax.jit(lambda q, k, v: (parallel(q, k, v), jax.grad(lambda k: jnp.sum(parallel(q, k, v) ** 2))(k)))(
            q, k, v
        )

    out, grad = both()
    assert_close(out, want[0])
    assert_close(grad, want[1])
    _ring_with(monkeypatch, hops)
    out, grad = both()
    with pytest.raises(AssertionError):
        assert_close(out, want[0])
    with pytest.raises(AssertionError):
        assert_close(grad, want[1])
