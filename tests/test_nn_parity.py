"""Every tensor-parallel layer equals its dense Equinox layer: outputs, and gradients with
respect to the inputs and to every weight (gathered back to the dense layout), over drawn
model-axis sizes (1, 2, 4, 8), dimensions and seeds. Also: same seed, same weights; and
dense -> parallel -> mesh -> dense is the identity."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar import nn
from eqxpar.nn._base import local_block
from eqxpar.testing import assert_trees_close, mesh_sizes, on_one_device

model_sizes = mesh_sizes(("model",)).map(lambda s: s["model"])


def _outputs_and_grads(forward, layer, inputs, cotangent):
    """`forward(layer, *inputs)`, and the gradients of `sum(out * cotangent)` with respect to
    the layer and the floating-point inputs (a vector-Jacobian product with a random vector)."""

    def loss(layer_and_inputs):
        layer, inputs = layer_and_inputs
        out = forward(layer, *inputs)
        return jnp.sum(out * cotangent), out

    (_, out), grads = eqx.filter_value_and_grad(loss, has_aux=True)((layer, inputs))
    return out, grads


def assert_parallel_equals_dense(tp_layer, dense_layer, inputs, n, *, call, dense_call=None, out_spec=P()):
    """Run `call(layer, *example)` over the batch `inputs` with the layer split over `n`
    devices, and `dense_call` (default: `call`) with the dense layer on one device; compare
    outputs and all gradients."""
    mesh = eqxpar.make_mesh(model=n)
    specs = nn.partition_specs(tp_layer, mesh)
    dense_call = call if dense_call is None else dense_call

    def batched(layer, *inputs):
        return jax.vmap(lambda *example: call(layer, *example))(*inputs)

    def dense_batched(layer, *inputs):
        return jax.vmap(lambda *example: dense_call(layer, *example))(*inputs)

    parallel = eqxpar.filter_shard_map(batched, mesh=mesh, in_specs=(specs, *(P() for _ in inputs)), out_specs=out_spec)
    out_shape = eqx.filter_eval_shape(dense_batched, dense_layer, *inputs)
    cotangent = np.random.default_rng(99).normal(size=out_shape.shape).astype(out_shape.dtype)
    out, (layer_grads, input_grads) = eqx.filter_jit(_outputs_and_grads)(
        parallel, eqxpar.shard(tp_layer, mesh, specs), tuple(inputs), cotangent
    )
    ref_out, (ref_layer_grads, ref_input_grads) = on_one_device(
        lambda layer, inputs, cot: _outputs_and_grads(dense_batched, layer, inputs, cot),
        dense_layer,
        tuple(inputs),
        cotangent,
    )
    assert_trees_close(out, ref_out, what=f"{type(tp_layer).__name__} output (model={n})")
    assert_trees_close(
        eqx.filter(nn.to_dense(layer_grads), eqx.is_array),
        eqx.filter(ref_layer_grads, eqx.is_array),
        what=f"{type(tp_layer).__name__} weight gradients (model={n})",
    )
    if any(jnp.issubdtype(x.dtype, jnp.floating) for x in inputs):
        assert_trees_close(input_grads, ref_input_grads, what=f"{type(tp_layer).__name__} input gradients (model={n})")


def _normal(rng, *shape):
    return rng.normal(size=shape).astype(np.float32)


def _dense(cls, *args, rng, **kwargs):
    """A dense Equinox layer with random weights drawn by NumPy, scaled like Equinox's
    (1/sqrt(fan-in)). Equinox's own initialisation is checked separately below; running it
    eagerly would compile a dozen small programs per example."""
    shapes = eqx.filter_eval_shape(cls, *args, **kwargs, key=jax.random.key(0))
    return jax.tree.map(
        lambda s: (
            (_normal(rng, *s.shape) / np.sqrt(s.shape[-1])).astype(s.dtype)
            if isinstance(s, jax.ShapeDtypeStruct)
            else s
        ),
        shapes,
    )


@given(
    n=model_sizes,
    in_features=st.sampled_from([3, 8]),
    per_device=st.sampled_from([1, 3]),
    use_bias=st.booleans(),
    gather_output=st.booleans(),
    batch=st.sampled_from([1, 4]),
    seed=st.integers(0, 2**16),
)
@example(n=4, in_features=8, per_device=3, use_bias=True, gather_output=False, batch=4, seed=1)
@example(n=8, in_features=3, per_device=1, use_bias=True, gather_output=True, batch=1, seed=2)
def test_column_parallel_linear_equals_dense(n, in_features, per_device, use_bias, gather_output, batch, seed):
    rng = np.random.default_rng(seed)
    dense = _dense(eqx.nn.Linear, in_features, n * per_device, use_bias, rng=rng)
    tp = nn.ColumnParallelLinear.from_dense(dense, gather_output=gather_output)
    x = _normal(rng, batch, in_features)
    out_spec = P() if gather_output else P(None, "model")  # un-gathered blocks sit side by side
    assert_parallel_equals_dense(tp, dense, [x], n, call=lambda layer, x: layer(x), out_spec=out_spec)


@given(
    n=model_sizes,
    out_features=st.sampled_from([3, 8]),
    per_device=st.sampled_from([1, 3]),
    use_bias=st.booleans(),
    batch=st.sampled_from([1, 4]),
    seed=st.integers(0, 2**16),
)
@example(n=4, out_features=3, per_device=3, use_bias=True, batch=4, seed=1)
@example(n=8, out_features=8, per_device=1, use_bias=True, batch=1, seed=2)
def test_row_parallel_linear_equals_dense(n, out_features, per_device, use_bias, batch, seed):
    """`input_is_split=False`: the layer takes its own block of a replicated input; its
    input gradient needs the blocks' gradients combined (the backward psum)."""
    rng = np.random.default_rng(seed)
    dense = _dense(eqx.nn.Linear, n * per_device, out_features, use_bias, rng=rng)
    tp = nn.RowParallelLinear.from_dense(dense, input_is_split=False)
    x = _normal(rng, batch, n * per_device)
    assert_parallel_equals_dense(tp, dense, [x], n, call=lambda layer, x: layer(x))


@given(
    n=model_sizes,
    sizes=st.sampled_from([(4, 3), (8, 8)]),
    per_device=st.sampled_from([1, 4]),
    use_bias=st.booleans(),
    use_final_bias=st.booleans(),
    activation=st.sampled_from([jax.nn.relu, jax.nn.gelu, jnp.tanh]),
    seed=st.integers(0, 2**16),
)
@example(n=4, sizes=(8, 8), per_device=1, use_bias=True, use_final_bias=True, activation=jax.nn.gelu, seed=1)
@example(n=8, sizes=(4, 3), per_device=4, use_bias=True, use_final_bias=False, activation=jax.nn.relu, seed=2)
def test_parallel_mlp_equals_dense(n, sizes, per_device, use_bias, use_final_bias, activation, seed):
    in_size, out_size = sizes
    rng = np.random.default_rng(seed)
    dense = _dense(
        eqx.nn.MLP, in_size, out_size, n * per_device, 1, activation, jax.nn.sigmoid, use_bias, use_final_bias, rng=rng
    )
    x = _normal(rng, 3, in_size)
    assert_parallel_equals_dense(nn.from_dense(dense), dense, [x], n, call=lambda layer, x: layer(x))


@given(
    n=model_sizes,
    heads_per_device=st.sampled_from([1, 2]),
    qk_vo=st.sampled_from([(2, 3), (4, 4)]),
    self_attention=st.booleans(),
    mask=st.sampled_from(["none", "causal", "per-head"]),
    biases=st.booleans(),
    # One example in three with dropout: its random bits (threefry) triple the compile time.
    dropout=st.sampled_from([False, False, True]),
    seed=st.integers(0, 2**16),
)
@example(n=4, heads_per_device=2, qk_vo=(2, 3), self_attention=True, mask="causal", biases=True, dropout=False, seed=1)
@example(
    n=8, heads_per_device=1, qk_vo=(4, 4), self_attention=False, mask="per-head", biases=False, dropout=True, seed=2
)
def test_parallel_attention_equals_dense(n, heads_per_device, qk_vo, self_attention, mask, biases, dropout, seed):
    """With dropout too: each device uses its heads' keys from `split(key, num_heads)`, as
    eqx.nn.MultiheadAttention does, so even the dropped weights match at every model size."""
    rng = np.random.default_rng(seed)
    heads, (qk_size, vo_size) = n * heads_per_device, qk_vo
    query_size, kv_size, q_seq = 6, (6 if self_attention else 5), 4
    kv_seq = q_seq if self_attention else 7
    dense = _dense(
        eqx.nn.MultiheadAttention,
        heads,
        query_size,
        kv_size,
        kv_size,
        5,
        qk_size,
        vo_size,
        use_query_bias=biases,
        use_key_bias=biases,
        use_value_bias=biases,
        use_output_bias=biases,
        dropout_p=0.4 if dropout else 0.0,
        rng=rng,
    )
    tp = nn.ParallelMultiheadAttention.from_dense(dense, causal=mask == "causal")
    # The parallel layer applies its causal flag itself; the dense one gets the same mask.
    # A per-head mask goes to both: each device must pick its own heads' slices.
    dense_mask = {
        "none": None,
        "causal": np.tril(np.ones((q_seq, kv_seq), bool), k=kv_seq - q_seq),
        "per-head": (rng.random((heads, q_seq, kv_seq)) < 0.6) | np.eye(q_seq, kv_seq, dtype=bool),
    }[mask]
    tp_mask = dense_mask if mask == "per-head" else None
    query = _normal(rng, 2, q_seq, query_size)
    # One dropout key per example, passed as raw key data (an integer array, so no gradient).
    keys = jax.random.key_data(jax.random.split(jax.random.key(seed + 1), 2))
    key = jax.random.wrap_key_data
    if self_attention:
        # One input for query, key and value: the parallel layer shares one backward psum.
        assert_parallel_equals_dense(
            tp,
            dense,
            [query, keys],
            n,
            call=lambda layer, x, k: layer(x, mask=tp_mask, key=key(k)),
            dense_call=lambda layer, x, k: layer(x, x, x, dense_mask, key=key(k)),
        )
    else:
        kv = _normal(rng, 2, kv_seq, kv_size)
        assert_parallel_equals_dense(
            tp,
            dense,
            [query, kv, keys],
            n,
            call=lambda layer, q, kv, k: layer(q, kv, kv, tp_mask, key=key(k)),
            dense_call=lambda layer, q, kv, k: layer(q, kv, kv, dense_mask, key=key(k)),
        )


@given(n=model_sizes, per_device=st.sampled_from([1, 5]), size=st.sampled_from([3, 8]), seed=st.integers(0, 2**16))
@example(n=4, per_device=5, size=3, seed=1)
@example(n=8, per_device=1, size=8, seed=2)
def test_vocab_parallel_embedding_equals_dense(n, per_device, size, seed):
    vocab, rng = n * per_device, np.random.default_rng(seed)
    dense = _dense(eqx.nn.Embedding, vocab, size, rng=rng)
    # Every row, including the first and last of each device's block, plus random repeats.
    ids = np.concatenate([np.arange(vocab), rng.integers(0, vocab, 7)]).astype(np.int32)
    assert_parallel_equals_dense(nn.from_dense(dense), dense, [ids], n, call=lambda layer, i: layer(i))


class _BiasBeforePsum(nn.RowParallelLinear):
    """A broken row layer: the bias goes into every device's partial sum."""

    def __call__(self, x, *, key=None):
        x = local_block(x, self.axis_name)
        return jax.lax.psum(self.weight @ x + self.bias, self.axis_name)


def test_bias_before_psum_is_caught_by_parity():
    """The parity check can fail: a bias added before the psum is counted N times."""
    dense = eqx.nn.Linear(8, 3, key=jax.random.key(0))
    broken = _BiasBeforePsum.from_dense(dense, input_is_split=False)
    x = _normal(np.random.default_rng(1), 2, 8)
    with pytest.raises(AssertionError, match="output"):
        assert_parallel_equals_dense(broken, dense, [x], 4, call=lambda layer, x: layer(x))


# ----------------------------------------------------------------------------------------
# Same seed, same weights; conversions and placement are lossless.

_DENSE_AND_PARALLEL = [
    (lambda k: eqx.nn.Linear(8, 16, key=k), lambda k: nn.ColumnParallelLinear(8, 16, key=k)),
    (
        lambda k: eqx.nn.Linear(16, 8, use_bias=False, key=k),
        lambda k: nn.RowParallelLinear(16, 8, use_bias=False, key=k),
    ),
    (lambda k: eqx.nn.MLP(6, 4, 16, 1, key=k), lambda k: nn.ParallelMLP(6, 4, 16, key=k)),
    (
        lambda k: eqx.nn.MultiheadAttention(8, 16, use_query_bias=True, use_output_bias=True, key=k),
        lambda k: nn.ParallelMultiheadAttention(8, 16, use_query_bias=True, use_output_bias=True, key=k),
    ),
    (lambda k: eqx.nn.Embedding(24, 5, key=k), lambda k: nn.VocabParallelEmbedding(24, 5, key=k)),
]


def _arrays(tree):
    return eqx.filter(tree, eqx.is_array)


def test_parallel_layers_from_a_seed_equal_the_dense_layers_from_that_seed():
    for make_dense, make_parallel in _DENSE_AND_PARALLEL:
        key = jax.random.key(7)
        parallel, dense = make_parallel(key), make_dense(key)
        assert_trees_close(_arrays(nn.to_dense(parallel)), _arrays(dense), rtol=0, atol=0, what=type(parallel).__name__)


@given(n=model_sizes, which=st.integers(0, len(_DENSE_AND_PARALLEL) - 1), seed=st.integers(0, 2**16))
@example(n=8, which=3, seed=0)
def test_split_then_gather_is_identity(n, which, seed):
    make_dense, make_parallel = _DENSE_AND_PARALLEL[which]
    dense = make_dense(jax.random.key(seed))
    # A Linear splits as the parallel layer it is paired with.
    kind = {}
    if isinstance(dense, eqx.nn.Linear):
        parallel_cls = type(eqx.filter_eval_shape(make_parallel, jax.random.key(0)))
        kind = {"linear": "column" if parallel_cls is nn.ColumnParallelLinear else "row"}
    tp = nn.from_dense(dense, **kind)
    mesh = eqxpar.make_mesh(model=n)
    specs = nn.partition_specs(tp, mesh)
    placed = eqxpar.shard(tp, mesh, specs)
    # Each device holds 1/n of every split weight along the split dimension.
    for spec, leaf in zip(jax.tree.leaves(specs), jax.tree.leaves(placed)):
        if not eqx.is_array(leaf):
            continue
        split = [d for d, entry in enumerate(spec) if entry == "model"]
        want = tuple(s // n if d in split else s for d, s in enumerate(leaf.shape))
        assert leaf.addressable_shards[0].data.shape == want
    back = nn.to_dense(eqxpar.gather(placed))
    assert_trees_close(_arrays(back), _arrays(dense), rtol=0, atol=0, what="dense -> parallel -> mesh -> dense")
    assert_trees_close(_arrays(nn.from_dense(back, **kind)), _arrays(tp), rtol=0, atol=0, what="round trip")


def test_specs_split_the_documented_dimensions():
    mlp = nn.ParallelMLP(4, 4, 8, key=jax.random.key(0))
    specs = mlp.specs()
    assert specs.hidden.weight == P("model", None) and specs.hidden.bias == P("model")
    assert specs.output.weight == P(None, "model") and specs.output.bias == P()
    emb = nn.VocabParallelEmbedding(8, 3, axis_name="tp", key=jax.random.key(0))
    assert emb.specs().weight == P("tp", None)
    # Inside any PyTree: tensor-parallel layers give their specs, other arrays replicate.
    tree_specs = nn.partition_specs({"mlp": mlp, "w": jnp.ones(3)})
    assert tree_specs["w"] == P() and tree_specs["mlp"].output.weight == P(None, "model")
