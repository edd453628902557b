"""Megatron sequence parallelism on the tensor-parallel linear layers (`sequence_dim=`):
the input split along the sequence over `model`, all-gathered into the column layer, the
row layer's all-reduce a reduce-scatter. Exact parity with the plain TP path (outputs and
gradients), and the same bytes over each link as the all-reduces it replaces."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar.nn import ColumnParallelLinear, RowParallelLinear, partition_specs

B, S, D = 2, 16, 8


def mlp_pair(seed):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return (ColumnParallelLinear(D, 4 * D, key=k1), RowParallelLinear(D * 4, D, key=k2))


def run(layers, x, w, mesh, sp):
    specs = partition_specs(layers, mesh)
    seq = P(None, "model") if sp else P()
    dim = -2 if sp else None

    def local(layers, x, w):
        def loss(layers, x):
            col, row = layers
            y = row(jax.nn.gelu(col(x, sequence_dim=dim)), sequence_dim=dim)
            return jnp.sum(y * w), y

        (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(layers, x)
        return y, grads

    fn = eqxpar.filter_shard_map(local, mesh=mesh, in_specs=(specs, seq, seq), out_specs=(seq, (specs, seq)))
    return jax.jit(fn).lower(layers, x, w), jax.jit(fn)(layers, x, w)


@given(model=st.sampled_from([2, 4, 8]), seed=st.integers(0, 2**16))
def test_sequence_parallel_equals_tensor_parallel(model, seed):
    mesh = eqxpar.make_mesh(model=model)
    layers = mlp_pair(seed)
    x = jax.random.normal(jax.random.key(seed + 1), (B, S, D))
    w = jax.random.normal(jax.random.key(seed + 2), (B, S, D))
    _, (y_tp, g_tp) = run(layers, x, w, mesh, sp=False)
    _, (y_sp, g_sp) = run(layers, x, w, mesh, sp=True)
    for a, b in zip(jax.tree.leaves((y_sp, g_sp)), jax.tree.leaves((y_tp, g_tp))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model", [2, 4])
def test_sequence_parallel_bytes_equal_the_all_reduces_per_link(model):
    """TP: one all-reduce of (B, S, D) forward, one backward. SP: an all-gather and a
    reduce-scatter each way. Over each link a ring all-reduce sends 2 (N-1)/N of its array,
    an all-gather or reduce-scatter (N-1)/N: the same bytes."""
    mesh = eqxpar.make_mesh(model=model)
    layers = mlp_pair(0)
    x = w = jnp.ones((B, S, D))
    act = B * S * D * 4
    tp = eqxpar.inspect.CommReport.of(run(layers, x, w, mesh, sp=False)[0], mesh=mesh)
    sp = eqxpar.inspect.CommReport.of(run(layers, x, w, mesh, sp=True)[0], mesh=mesh)
    assert tp.bytes("all-reduce") == 2 * act
    # The row layer's bias is added to sequence blocks: its gradient (D floats) is summed
    # over the model axis, as every replicated parameter inside an SP region is.
    assert sp.bytes("all-reduce") == D * 4
    assert sp.bytes("all-gather") == 2 * act and sp.bytes("reduce-scatter") == 2 * act
    n = model

    def link(ar, ag, rs):
        return 2 * (n - 1) / n * ar + (n - 1) / n * (ag + rs)

    assert link(0, sp.bytes("all-gather"), sp.bytes("reduce-scatter")) == link(tp.bytes("all-reduce"), 0, 0)
