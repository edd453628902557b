"""The reference the context-parallel tests compare against: plain softmax attention."""

import math

import jax
import jax.numpy as jnp


def dense_attention(q, k, v, causal):
    """Plain softmax attention on the whole sequence, original order: (*b, S, h, d)."""
    logits = jnp.einsum("...qhd,...khd->...hqk", q / math.sqrt(q.shape[-1]), k)
    if causal:
        s = q.shape[-3]
        logits = jnp.where(jnp.tril(jnp.ones((s, s), bool)), logits, -jnp.inf)
    return jnp.einsum("...hqk,...khd->...qhd", jax.nn.softmax(logits, axis=-1), v)
