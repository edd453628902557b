"""`all_gather_attention`: context-parallel attention by one `all_gather` of the keys and
values (see `eqxpar/nn/_ring_attention.py`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ._context_blocks import (
    attention_logits,
    both_visible,
    causal_visible,
    check_bound,
    check_qkv,
    check_segment_ids,
    segment_visible,
)
from ._context_layout import Layout, check_layout, context_positions, layout_order

__all__ = ["all_gather_attention"]


def all_gather_attention(
    q: Float[Array, "*batch seq heads qk"],
    k: Float[Array, "*batch seq heads qk"],
    v: Float[Array, "*batch seq heads vo"],
    *,
    axis_name: str,
    causal: bool,
    layout: Layout = "zigzag",
    segment_ids: Int[Array, "*batch seq"] | None = None,
) -> Float[Array, "*batch seq heads vo"]:
    """Softmax attention over a sequence split across `axis_name`, by gathering every
    device's keys and values once (inside `shard_map`).

    One `all_gather` of `k` and `v` over the context axis, then attention of this device's
    queries over the whole sequence; autodiff's transpose of the gather (a `psum_scatter`)
    hands each device the gradient of its own keys and values. The same bytes as
    [`eqxpar.nn.ring_attention`][], in one collective each way, with the whole sequence's
    keys and values alive on every device.

    **Arguments:** as [`eqxpar.nn.ring_attention`][].

    **Returns:** as [`eqxpar.nn.ring_attention`][].

    **Raises:** as [`eqxpar.nn.ring_attention`][].
    """
    check_layout(layout, "all_gather_attention")
    check_qkv(q, k, v, "all_gather_attention")
    check_bound(axis_name, "all_gather_attention")
    check_segment_ids(segment_ids, q, axis_name, "all_gather_attention")
    local = q.shape[-3]
    seq_axis = q.ndim - 3
    size = jax.lax.axis_size(axis_name)
    k_all, v_all = (k, v) if size == 1 else jax.lax.all_gather((k, v), axis_name, axis=seq_axis, tiled=True)
    # Packed documents: the ids of every block, gathered once per step by the model.
    k_seg, q_seg = segment_ids, None
    if segment_ids is not None:
        index = jax.lax.axis_index(axis_name)
        q_seg = jax.lax.dynamic_slice_in_dim(segment_ids, index * local, local, axis=segment_ids.ndim - 1)
    k_pos = jnp.asarray(layout_order(local * size, size, layout), jnp.int32)
    q_pos = context_positions(local, axis_name, layout)
    logits = attention_logits(q, k_all, 1.0 / math.sqrt(q.shape[-1]))
    visible = both_visible(causal_visible(q_pos, k_pos, causal), segment_visible(q_seg, k_seg))
    if visible is not None:
        logits = jnp.where(visible, logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("...hqk,...khd->...qhd", weights, v_all.astype(jnp.float32)).astype(q.dtype)
