"""The inputs of `ParallelMultiheadAttention` (`_attention.py`): their shapes checked, the
mask laid out with this device's heads, and packed documents' segment ids as a mask."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

__all__ = ["check_shapes", "local_mask", "check_segment_shape", "segment_mask"]


def check_shapes(query, key_, value) -> None:
    """`query`, `key_` and `value` fit together: the same batch dimensions, and as many keys as values."""
    if query.ndim < 2:
        raise ValueError(
            f"ParallelMultiheadAttention: query must be (q_seq, query_size) or (*batch, q_seq, "
            f"query_size), got shape {query.shape}."
        )
    if key_.shape[:-2] != query.shape[:-2] or value.shape[:-2] != query.shape[:-2]:
        raise ValueError(
            f"ParallelMultiheadAttention: query, key and value need the same batch dimensions, "
            f"got shapes {query.shape}, {key_.shape}, {value.shape}."
        )
    if value.shape[-2] != key_.shape[-2]:
        raise ValueError("ParallelMultiheadAttention: key and value must have the same length.")


def local_mask(mask, batch_dims: int, first, heads: int, num_heads: int):
    """The mask as `(*batch or 1s, heads or 1, q_seq, kv_seq)`, with this device's heads."""
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    if mask.ndim == batch_dims + 3:  # a head axis: take our heads
        if mask.shape[-3] != num_heads:
            raise ValueError(
                f"ParallelMultiheadAttention: a per-head mask needs {num_heads} heads on its "
                f"third-to-last axis, got shape {mask.shape}."
            )
        return jax.lax.dynamic_slice_in_dim(mask, first, heads, axis=mask.ndim - 3)
    if mask.ndim in (2, batch_dims + 2):
        return mask[..., None, :, :]
    raise ValueError(
        f"ParallelMultiheadAttention: mask of shape {mask.shape} does not fit a query with "
        f"{batch_dims} batch dimension(s): pass (q_seq, kv_seq), (*batch, q_seq, kv_seq) or "
        f"(*batch, num_heads, q_seq, kv_seq)."
    )


def check_segment_shape(segment_ids, lead: tuple[int, ...], q_seq: int, kv_seq: int) -> None:
    """Segment ids fit self-attention over `q_seq` positions: integers of shape `(*lead, q_seq)`."""
    segment_ids = jnp.asarray(segment_ids)
    if q_seq != kv_seq or segment_ids.shape != (*lead, q_seq) or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(
            f"ParallelMultiheadAttention: segment_ids must be integers of shape (*batch, seq) = {(*lead, q_seq)} "
            f"(self-attention over whole sequences: with sequence_dim, all of each sequence), got "
            f"{segment_ids.dtype} {segment_ids.shape} for {q_seq} queries and {kv_seq} keys."
        )


def segment_mask(segment_ids: Int[Array, "*batch seq"] | None) -> Bool[Array, "*batch 1 seq seq"] | None:
    """The attention mask of packed documents: True where query and key have the same segment
    id, with a head axis of 1 to broadcast over the heads; `None` for `None`.

    **Arguments:**

    - `segment_ids`: `(*batch, seq)` integers, one id per document in each row (e.g. the
      `segment_ids` of [`eqxpar.data.text.PackedRows`][]).

    **Returns:**

    `(*batch, 1, seq, seq)` booleans, or `None`; combine with a causal mask by `&`.
    """
    if segment_ids is None:
        return None
    segment_ids = jnp.asarray(segment_ids)
    return (segment_ids[..., :, None] == segment_ids[..., None, :])[..., None, :, :]
