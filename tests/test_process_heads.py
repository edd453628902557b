"""eqx.nn.MultiheadAttention's process_heads (how rotary embeddings are added) under the
"attention" style: each device applies it to its own heads, and the parallel model trains
as the dense one does (issue 20: it was refused with a raw TypeError)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import eqxpar
import eqxpar.nn
from eqxpar.testing import check_parallel_parity

DIM, HEADS, VOCAB = 8, 4, 16


class RopeLM(eqx.Module):
    embedding: eqx.nn.Embedding
    attention: eqx.nn.MultiheadAttention
    rope: eqx.nn.RotaryPositionalEmbedding
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embedding = eqx.nn.Embedding(VOCAB, DIM, key=k1)
        self.attention = eqx.nn.MultiheadAttention(HEADS, DIM, key=k2)
        self.rope = eqx.nn.RotaryPositionalEmbedding(DIM // HEADS)
        self.head = eqx.nn.Linear(DIM, VOCAB, key=k3)

    def __call__(self, tokens):
        def process_heads(q, k, v):  # (seq, heads, size): rotate each head's queries and keys
            rotate = jax.vmap(self.rope, in_axes=1, out_axes=1)
            return rotate(q), rotate(k), v

        x = jax.vmap(self.embedding)(tokens)
        mask = jnp.tril(jnp.ones((len(tokens), len(tokens)), bool))
        x = x + self.attention(x, x, x, mask=mask, process_heads=process_heads)
        return jax.vmap(self.head)(x)


def loss_fn(model, tokens, key=None):
    logits = jax.vmap(model)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def test_rotary_embeddings_through_process_heads_train_as_the_dense_model():
    mesh = eqxpar.make_mesh(data=2, model=4)
    model = RopeLM(jax.random.key(0))
    parallel, plan = eqxpar.nn.parallelize(model, mesh=mesh, return_plan=True)
    assert plan["attention"] == "attention"
    tokens = jax.random.randint(jax.random.key(1), (4, 7), 0, VOCAB)
    report = check_parallel_parity(model, parallel, loss_fn, optax.sgd(0.1), mesh, tokens)
    assert all(used <= 1 for used, _ in report.worst.values()), report
