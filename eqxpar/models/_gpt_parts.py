"""The GPT's parts before and after its blocks (the token and position embeddings, the final
norm and head, the cross-entropy), shared by the GPT's own call and its pipeline cut
([`eqxpar.models.gpt_stages`][]), so the two compute one thing."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from .._promotion import at_least_float32
from ..nn import layer_norm, vocab_parallel_cross_entropy
from ._block import sequence_dropout

if TYPE_CHECKING:
    from ._gpt import GPT

__all__ = ["embed_tokens", "head_logits", "mean_cross_entropy"]


def embed_tokens(model: GPT, tokens, *, key, inference, rows=None, length=None, positions=None):
    """Token plus position embeddings, then dropout: the residual stream the blocks take.

    `rows`, `length`: this device's global positions of a sequence split over devices and
    the whole length (`None`: `tokens` holds whole sequences). `positions`: packed
    documents' positions, shaped like `tokens` (`None`: the global positions).
    """
    length = tokens.shape[-1] if length is None else length
    if length > model.context_length:  # the GPT's own call checks in _rows; gpt_stages' first here
        raise ValueError(
            f"GPT: {length} tokens per sequence exceed context_length={model.context_length} (the "
            f"position embedding's rows). Pass sequences of at most {model.context_length} tokens "
            f"(a training batch of (batch, seq + 1) token ids: seq + 1 <= {model.context_length + 1}), "
            f"or build the GPT with context_length >= {length}."
        )
    sequence_dim = -1 if model.sequence_parallel else None
    x = model.token_embedding(tokens, sequence_dim=sequence_dim)
    # A gather, not a broadcast over the batch (whose backward, a sum over the batch, made XLA:GPU
    # lay the residual stream out batch-minor: docs/benchmarks.md), from a table in at least
    # float32, so that its backward scatter-add adds up the batch's rows in float32.
    if positions is None:
        ids = jnp.broadcast_to(jnp.arange(length) if rows is None else rows, x.shape[:-1])
    elif model.sequence_parallel:  # this device's block of them, as the lookup's reduce-scatter left it
        block = x.shape[-2]
        ids = jax.lax.dynamic_slice_in_dim(positions, jax.lax.axis_index(model.axis_name) * block, block, -1)
    else:
        ids = positions
    table = model.position_embedding.weight
    x = x + jnp.take(table.astype(at_least_float32(table.dtype)), ids, axis=0, mode="clip").astype(x.dtype)
    # The same key on every device; a split sequence takes its rows of the whole mask.
    return sequence_dropout(model.dropout, x, rows, length, key=key, inference=inference)


def head_logits(model: GPT, x):
    """The final norm and head on the residual stream: this device's block of the padded
    vocabulary's logits, `-inf` at padding ids."""
    sequence_dim = -2 if model.sequence_parallel else None
    logits = model.head(layer_norm(model.final_norm, x), sequence_dim=sequence_dim)
    if model.padded_vocab_size == model.vocab_size:
        return logits
    block = logits.shape[-1]
    ids = jax.lax.axis_index(model.axis_name) * block + jnp.arange(block)
    return jnp.where(ids < model.vocab_size, logits, -jnp.inf)


def mean_cross_entropy(model: GPT, logits, targets, weights=None):
    """The mean next-token cross-entropy of `logits` (this device's vocabulary block), each
    position's term times its weight (`None`: 1) when given."""
    losses = vocab_parallel_cross_entropy(logits, targets, model.axis_name, model.vocab_size)
    return jnp.mean(losses if weights is None else losses * weights)
