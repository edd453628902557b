"""The Llama's parts before and after its layers (the embedding, the rotary angles of the
positions attention sees, the final norm and head), shared by its own call and its pipeline
cut ([`eqxpar.models.llama_stages`][]), so the two compute one thing."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jaxtyping import Array

from ..nn import context_positions, vocab_parallel_cross_entropy
from ._gpt import CONTEXT_AXIS
from ._llama_layers import CONTEXT_IMPLS, LlamaAttention

if TYPE_CHECKING:
    from ._llama import Llama

__all__ = ["CONTEXT_IMPLS", "attention_positions", "rotary_angles", "embed", "head_logits", "mean_cross_entropy"]


def _bound_size(axis: str, why: str) -> int:
    """The size of mesh axis `axis`, or a ValueError naming it when it is not bound."""
    try:
        return jax.lax.axis_size(axis)
    except NameError:
        step = f" (train it with context_axis={axis!r} in the step builder)" if axis == CONTEXT_AXIS else ""
        raise ValueError(
            f"Llama: {why} splits every sequence over the mesh axis {axis!r}, which is not bound here (the "
            f"model was called outside shard_map, or inside one over a mesh without that axis): call it inside "
            f"eqxpar.filter_shard_map over a mesh with a {axis!r} axis{step}."
        ) from None


def attention_positions(model: Llama, seq: int) -> Array:
    """The global positions of the tokens each attention sees, for `seq` tokens per
    sequence on this device: `0 .. seq-1`, or under context parallelism this device's
    positions in the zigzag layout (never `0 .. seq-1` there: RoPE must rotate each token
    by its true position). With `sequence_parallel` the attention gathers the model axis'
    blocks first, so these are the positions of all `seq` tokens still. Checks the length
    against `max_seq_len` and that the model axis splits the sequence."""
    context = model.attention_impl in CONTEXT_IMPLS
    n_context = _bound_size(CONTEXT_AXIS, f"attention_impl={model.attention_impl!r}") if context else 1
    length = seq * n_context
    if length > model.config.max_seq_len:
        where = f" ({seq} per context shard)" if context else ""
        raise ValueError(
            f"Llama: {length} tokens per sequence{where} exceed max_seq_len={model.config.max_seq_len}. Pass "
            f"shorter sequences (a training batch of (batch, seq + 1) ids: seq <= {model.config.max_seq_len}), or "
            f"build the config with a larger max_seq_len."
        )
    if model.sequence_parallel:
        n = _bound_size(model.axis_name, "sequence_parallel=True")
        if seq % n:
            raise ValueError(
                f"Llama: sequence_parallel=True splits the {seq} tokens per sequence on each device over the {n} "
                f"devices of the model axis {model.axis_name!r}, which do not divide them. Use a sequence length "
                f"(per context shard) that is a multiple of {n}, or sequence_parallel=False."
            )
    return context_positions(seq, CONTEXT_AXIS, "zigzag") if context else jnp.arange(seq)


def rotary_angles(model: Llama, seq: int, dtype, positions: Array | None = None) -> tuple[Array, Array]:
    """The rotary `cos`, `sin` every layer takes, `(seq, head_dim)`, for `seq` tokens per
    sequence on this device (see `attention_positions`; with packed documents' `positions`,
    `(*batch, seq)`, at those: `(*batch, seq, head_dim)`): those of
    [`eqxpar.models.LlamaAttention.rotary_angles`][] at these positions. Every layer's
    attention has the config's rotary settings; the first one's is read, found through
    whatever holds the layers (a stack, a train step's FSDP gathers)."""
    attention = next(a for a in jax.tree.leaves(model.layers, is_leaf=_is_attention) if _is_attention(a))
    default = attention_positions(model, seq)  # the length and split checks, whatever the positions
    return attention.rotary_angles(default if positions is None else positions, dtype)


def _is_attention(node) -> bool:
    return isinstance(node, LlamaAttention)


def embed(model: Llama, tokens: Array) -> Array:
    """The token embeddings, `(*batch, seq, dim)` (with `sequence_parallel`, reduce-scattered
    to this device's `seq / N` positions)."""
    return model.embed_tokens(tokens, sequence_dim=-1 if model.sequence_parallel else None)


def head_logits(model: Llama, x: Array) -> Array:
    """The final norm and head on the residual stream: this device's vocabulary block of
    the logits of every position (with `sequence_parallel`, the norm's output gathered
    over the model axis first)."""
    return model.head()(model.norm(x), sequence_dim=-2 if model.sequence_parallel else None)


def mean_cross_entropy(model: Llama, logits: Array, targets: Array, weights: Array | None = None) -> Array:
    """The mean next-token cross-entropy of `logits` (this device's vocabulary block), each
    position's term times its weight (`None`: 1) when given."""
    losses = vocab_parallel_cross_entropy(logits, targets, model.axis_name)
    return jnp.mean(losses if weights is None else losses * weights)
