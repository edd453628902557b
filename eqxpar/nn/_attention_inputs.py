"""The inputs of `ParallelMultiheadAttention` (`_attention.py`): their shapes checked, and
the mask laid out with this device's heads."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["check_shapes", "local_mask"]


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
