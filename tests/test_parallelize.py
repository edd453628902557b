"""parallelize: a plain Equinox model, made tensor-parallel by a plan and trained with the
hybrid step, equals the dense model trained on one device (loss and updated parameters)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _budget import examples
from hypothesis import given
from hypothesis import strategies as st

import eqxpar
import eqxpar.nn
from eqxpar.testing import assert_trees_close, mesh_sizes
from eqxpar.train import hybrid_step, shard_batch

OPTIMIZER = optax.sgd(0.1, momentum=0.9)


class Block(eqx.Module):
    norm: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    mlp: eqx.nn.MLP

    def __init__(self, dim, heads, width, bias, key):
        k1, k2 = jax.random.split(key)
        self.norm = eqx.nn.LayerNorm(dim)
        self.attention = eqx.nn.MultiheadAttention(
            heads, dim, use_query_bias=bias, use_value_bias=bias, use_output_bias=bias, key=k1
        )
        self.mlp = eqx.nn.MLP(dim, dim, width, 1, activation=jax.nn.gelu, key=k2)

    def __call__(self, x, mask):
        h = jax.vmap(self.norm)(x)
        x = x + self.attention(h, h, h, mask=mask)
        return x + jax.vmap(self.mlp)(h)


class PlainLM(eqx.Module):
    """What a user writes: equinox.nn layers only, called per example."""

    embedding: eqx.nn.Embedding
    blocks: list
    head: eqx.nn.Linear

    def __init__(self, vocab, dim, heads, width, layers, bias, key):
        keys = jax.random.split(key, layers + 2)
        self.embedding = eqx.nn.Embedding(vocab, dim, key=keys[0])
        self.blocks = [Block(dim, heads, width, bias, k) for k in keys[2:]]
        self.head = eqx.nn.Linear(dim, vocab, key=keys[1])

    def __call__(self, tokens):
        x = jax.vmap(self.embedding)(tokens)
        mask = jnp.tril(jnp.ones((len(tokens), len(tokens)), bool))
        for block in self.blocks:
            x = block(x, mask)
        return jax.vmap(self.head)(x)


def loss_fn(model, tokens, key=None):
    logits = jax.vmap(model)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


# Splits everything the automatic plan splits, but the MLPs by hand (a column Linear, then
# a row one, inside eqx.nn.MLP), and the head with its output gathered: where-functions,
# wildcards and lists of nodes together.
EXPLICIT = {
    "embedding": "vocab",
    lambda m: [b.attention for b in m.blocks]: "attention",
    "blocks[*].mlp.layers[0]": "column",
    "blocks[*].mlp.layers[1]": "row",
    lambda m: m.head: "column_gathered",
}


def copy(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, tree)


@eqx.filter_jit
def dense_step(model, opt_state, tokens):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, tokens)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
    return eqx.apply_updates(model, updates), opt_state, loss


shapes = st.fixed_dictionaries(
    {
        "vocab": st.sampled_from([8, 16]),  # every model axis size up to 8 divides it
        "head_dim": st.sampled_from([2, 4]),
        "heads_per_device": st.sampled_from([1, 2]),
        "width_per_device": st.sampled_from([2, 4]),
        "layers": st.integers(1, 2),
        "bias": st.booleans(),
        "seq": st.sampled_from([4, 6]),
    }
)


# 2 drawn in the default run (test_parallelize_drawn.py pins whole model structures beside it).
@examples(2)
@given(sizes=mesh_sizes(("data", "model"), (8,)), shape=shapes, explicit=st.booleans(), seed=st.integers(0, 2**16))
def test_parallelized_model_trains_as_the_dense_model_on_one_device(sizes, shape, explicit, seed):
    mesh = eqxpar.make_mesh(**sizes)
    heads = shape["heads_per_device"] * sizes["model"]
    model = PlainLM(
        shape["vocab"],
        heads * shape["head_dim"],
        heads,
        shape["width_per_device"] * sizes["model"],
        shape["layers"],
        shape["bias"],
        jax.random.key(seed),
    )
    rng = np.random.default_rng(seed)
    batches = [
        rng.integers(0, shape["vocab"], (2 * sizes["data"], shape["seq"] + 1)).astype(np.int32) for _ in range(2)
    ]

    # Reference: the dense model, one device, eqx.filter_jit, the same optax optimizer.
    dense, opt_state = copy(model), OPTIMIZER.init(eqx.filter(model, eqx.is_inexact_array))
    dense_losses = []
    for tokens in batches:
        dense, opt_state, loss = dense_step(dense, opt_state, tokens)
        dense_losses.append(float(loss))

    parallel = eqxpar.nn.parallelize(copy(model), EXPLICIT if explicit else None, mesh=mesh)
    assert bool(eqx.tree_equal(eqxpar.nn.to_dense(parallel), model))  # the same arrays, dense again
    # Something is split whenever the model axis is real.
    n_split = sum(
        isinstance(x, eqxpar.nn.TensorParallelLayer)
        for x in jax.tree.leaves(parallel, is_leaf=lambda x: isinstance(x, eqxpar.nn.TensorParallelLayer))
    )
    # embedding + attention and MLP per block (explicit: the MLP as two Linears, and the head)
    assert n_split == (2 + 3 * shape["layers"] if explicit else 1 + 2 * shape["layers"])

    step = hybrid_step(loss_fn, OPTIMIZER, mesh, param_specs=eqxpar.nn.partition_specs(parallel, mesh))
    parallel, opt_state = step.init(parallel)
    losses = []
    for tokens in batches:
        parallel, opt_state, metrics = step(parallel, opt_state, shard_batch(tokens, mesh))
        losses.append(float(metrics["loss"]))

    np.testing.assert_allclose(losses, dense_losses, rtol=1e-5)
    assert_trees_close(
        eqx.filter(eqxpar.nn.to_dense(eqxpar.gather(parallel)), eqx.is_inexact_array),
        eqx.filter(dense, eqx.is_inexact_array),
        what="parameters after two steps",
    )
