"""The batched path: every tensor-parallel layer called on whole `(*batch, ..., features)`
arrays (no `vmap`) equals the dense Equinox layer mapped over the same leading dimensions,
outputs and all gradients, and communicates exactly what the per-example path does (one
all-reduce of the whole batch, not one per example)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import example, given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P
from test_nn_parity import _dense, _normal, assert_parallel_equals_dense, model_sizes

import eqxpar
from eqxpar import nn
from eqxpar.inspect import communication_report

# The helper maps `call` over the inputs' first axis; each call then gets a second batch
# axis (of size 3), which the parallel layer takes whole and the dense one maps over.
INNER = 3


def _map_dense(fn):
    return lambda layer, *xs: jax.vmap(lambda *x: fn(layer, *x))(*xs)


@given(n=model_sizes, use_bias=st.booleans(), gather_output=st.booleans(), seed=st.integers(0, 2**16))
@example(n=8, use_bias=True, gather_output=False, seed=0)
def test_linear_layers_on_batches(n, use_bias, gather_output, seed):
    rng = np.random.default_rng(seed)
    dense = _dense(eqx.nn.Linear, 5, 2 * n, use_bias, rng=rng)
    column = nn.ColumnParallelLinear.from_dense(dense, gather_output=gather_output)
    x = _normal(rng, 2, INNER, 5)
    out_spec = P() if gather_output else P(None, None, "model")
    assert_parallel_equals_dense(
        column,
        dense,
        [x],
        n,
        call=lambda layer, x: layer(x),
        dense_call=_map_dense(lambda l, x: l(x)),
        out_spec=out_spec,
    )
    dense = _dense(eqx.nn.Linear, 2 * n, 5, use_bias, rng=rng)
    row = nn.RowParallelLinear.from_dense(dense, input_is_split=False)
    x = _normal(rng, 2, INNER, 2 * n)
    assert_parallel_equals_dense(
        row, dense, [x], n, call=lambda layer, x: layer(x), dense_call=_map_dense(lambda l, x: l(x))
    )


@given(n=model_sizes, activation=st.sampled_from([jax.nn.relu, jax.nn.gelu]), seed=st.integers(0, 2**16))
@example(n=4, activation=jax.nn.gelu, seed=1)
def test_mlp_on_batches(n, activation, seed):
    rng = np.random.default_rng(seed)
    dense = _dense(eqx.nn.MLP, 4, 3, 2 * n, 1, activation, jax.nn.sigmoid, rng=rng)
    x = _normal(rng, 2, INNER, 4)
    assert_parallel_equals_dense(
        nn.from_dense(dense), dense, [x], n, call=lambda layer, x: layer(x), dense_call=_map_dense(lambda l, x: l(x))
    )


@given(
    n=model_sizes,
    mask=st.sampled_from(["none", "causal", "per-head"]),
    impl=st.sampled_from(["reference", "dot_product"]),
    seed=st.integers(0, 2**16),
)
@example(n=8, mask="per-head", impl="dot_product", seed=0)
@example(n=2, mask="causal", impl="dot_product", seed=1)
def test_attention_on_batches(n, mask, impl, seed):
    """Both implementations, with a per-head mask given per example (a 4-D mask)."""
    rng = np.random.default_rng(seed)
    heads, seq, size = 2 * n, 4, 6
    dense = _dense(eqx.nn.MultiheadAttention, heads, size, qk_size=3, vo_size=3, rng=rng)
    tp = nn.ParallelMultiheadAttention.from_dense(dense, causal=mask == "causal", attention_impl=impl)
    x = _normal(rng, 2, INNER, seq, size)
    if mask == "per-head":
        masks = (rng.random((2, INNER, heads, seq, seq)) < 0.6) | np.eye(seq, dtype=bool)
        assert_parallel_equals_dense(
            tp,
            dense,
            [x, masks],
            n,
            call=lambda layer, x, m: layer(x, mask=m),
            dense_call=_map_dense(lambda l, x, m: l(x, x, x, m)),
        )
    else:
        causal = np.tril(np.ones((seq, seq), bool)) if mask == "causal" else None
        assert_parallel_equals_dense(
            tp, dense, [x], n, call=lambda layer, x: layer(x), dense_call=_map_dense(lambda l, x: l(x, x, x, causal))
        )


@given(n=model_sizes, seed=st.integers(0, 2**16))
@example(n=8, seed=0)
def test_embedding_on_batches(n, seed):
    rng = np.random.default_rng(seed)
    dense = _dense(eqx.nn.Embedding, 3 * n, 5, rng=rng)
    ids = rng.integers(0, 3 * n, (2, INNER, 7)).astype(np.int32)
    assert_parallel_equals_dense(
        nn.from_dense(dense),
        dense,
        [ids],
        n,
        call=lambda layer, i: layer(i),
        dense_call=_map_dense(lambda l, i: jax.vmap(l)(i)),
    )


def _collectives(layer, x, n, batched):
    mesh = eqxpar.make_mesh(model=n)
    specs = nn.partition_specs(layer, mesh)
    call = (lambda l, x: l(x)) if batched else (lambda l, x: jax.vmap(jax.vmap(l))(x))
    forward = eqxpar.filter_shard_map(call, mesh=mesh, in_specs=(specs, P()), out_specs=P())
    grads = eqx.filter_grad(lambda lx: jnp.sum(forward(*lx) ** 2))
    report = communication_report(grads, (eqxpar.shard(layer, mesh, specs), x))
    return sorted((c.kind, c.elements) for c in report.collectives(stage="compiled"))


def test_batched_path_communicates_like_the_per_example_path():
    """Forward and backward: one all-reduce of the whole batch each way, as with vmap."""
    n, key = 4, jax.random.key(0)
    mlp = nn.ParallelMLP(6, 6, 16, key=key)
    x = jnp.ones((2, 5, 6))
    assert _collectives(mlp, x, n, True) == _collectives(mlp, x, n, False) == [("all-reduce", 60)] * 2
    attention = nn.ParallelMultiheadAttention(4, 6, causal=True, attention_impl="dot_product", key=key)
    x = jnp.ones((2, 3, 5, 6))
    per_example = _collectives(attention, x, n, False)
    assert _collectives(attention, x, n, True) == per_example == [("all-reduce", 180)] * 2


def test_mlp_activation_runs_on_the_hidden_block_as_it_is():
    """The activation (one `vmap` per dimension) sees the hidden block's own shape, never a
    flattened copy: on XLA:CPU a flat activation, fused into the weight gradient's
    transpose in the backward pass, made the GPT's MLP backward twice as slow
    (docs/benchmarks.md, 'Closing the one-device and FSDP gap')."""
    mlp = nn.ParallelMLP(4, 4, 8, activation=nn.gelu, key=jax.random.key(0))
    x = jnp.ones((2, 3, 4))

    mesh = eqxpar.make_mesh(model=1)

    def input_gradient(mlp, x):
        return jax.grad(lambda x: jnp.sum(mlp(x)))(x)

    specs = nn.partition_specs(mlp, mesh)
    grad = eqxpar.filter_shard_map(input_gradient, mesh=mesh, in_specs=(specs, P()), out_specs=P())
    placed = eqxpar.shard(mlp, mesh, specs)
    jaxpr = jax.make_jaxpr(lambda x: grad(placed, x))(x)
    shapes = set()

    def visit(jaxpr):  # every equation's output shapes, inside custom_vjp and pjit bodies too
        for eqn in jaxpr.eqns:
            shapes.update(tuple(v.aval.shape) for v in eqn.outvars)
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns"):
                    visit(inner)

    visit(jaxpr.jaxpr)
    assert (2, 3, 8) in shapes and (2 * 3 * 8,) not in shapes, sorted(shapes)
