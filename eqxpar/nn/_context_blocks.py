"""What ring and all-gather attention share (see `eqxpar/nn/_ring_attention.py`): the
checks of their inputs and of their axis, their float32 logits, and which keys a query sees:
the causal mask between original positions and, for packed documents, the mask of equal
segment ids."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = [
    "attention_logits",
    "causal_visible",
    "segment_visible",
    "both_visible",
    "check_qkv",
    "check_bound",
    "check_segment_ids",
]


def attention_logits(q, k, scale):
    """`(*batch, heads, q, k)` float32 logits from `q` `(*batch, q, heads, d)`, `k` `(*batch, k, heads, d)`."""
    return jnp.einsum("...qhd,...khd->...hqk", q.astype(jnp.float32) * scale, k.astype(jnp.float32))


def causal_visible(q_pos, k_pos, causal: bool):
    if not causal:
        return None
    return q_pos[:, None] >= k_pos[None, :]


def segment_visible(q_segments, k_segments):
    """`(*batch, 1, q, k)`: True where query and key belong to the same document (equal
    segment ids), broadcast over the heads; `None` without segment ids."""
    if q_segments is None:
        return None
    return (q_segments[..., :, None] == k_segments[..., None, :])[..., None, :, :]


def both_visible(causal, segments):
    """The keys both masks let a query see (either may be `None`: no mask)."""
    if causal is None or segments is None:
        return segments if causal is None else causal
    return causal.reshape((1,) * (segments.ndim - causal.ndim) + causal.shape) & segments


def check_segment_ids(segment_ids, q, axis_name: str, who: str) -> None:
    """`segment_ids` (or `None`) must be the integers of every device's block, `(*batch, C L)`."""
    if segment_ids is None:
        return
    whole = (*q.shape[:-3], q.shape[-3] * jax.lax.axis_size(axis_name))
    if segment_ids.shape != whole or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(
            f"{who}: segment_ids must be integers of shape (*batch, C x L) = {whole}: every device's block of the "
            f"ids along {axis_name!r}, as eqxpar.nn.context_segment_ids gathers them; got {segment_ids.dtype} "
            f"{segment_ids.shape}."
        )


def context_segment_ids(segment_ids, axis_name: str):
    """The document ids every context-parallel attention of a step reads: this device's block
    `(*batch, L)` of each sequence's ids gathered over `axis_name` into `(*batch, C L)` (device
    `j`'s block at `[j L, (j + 1) L)`), once per step, so that no layer sends them again.

    **Arguments:**

    - `segment_ids`: this device's block, in the context layout, or `None`.
    - `axis_name`: the context axis.

    **Returns:**

    The gathered ids (`None` for `None`), for [`eqxpar.nn.ring_attention`][] and
    [`eqxpar.nn.all_gather_attention`][]'s `segment_ids`.
    """
    if segment_ids is None:
        return None
    return jax.lax.all_gather(segment_ids, axis_name, axis=segment_ids.ndim - 1, tiled=True)


def check_qkv(q, k, v, who: str) -> None:
    if q.ndim < 3 or k.ndim != q.ndim or v.ndim != q.ndim:
        raise ValueError(
            f"{who}: q, k and v must be (*batch, seq, heads, dim) with the same rank, got shapes "
            f"{q.shape}, {k.shape}, {v.shape}."
        )
    if (
        k.shape[:-1] != v.shape[:-1]
        or q.shape[:-3] != k.shape[:-3]
        or q.shape[-2] != k.shape[-2]
        or q.shape[-1] != k.shape[-1]
    ):
        raise ValueError(
            f"{who}: q {q.shape}, k {k.shape} and v {v.shape} do not fit together: they need the same "
            f"batch dimensions, heads and sequence block, and q and k the same head size."
        )


def check_bound(axis_name: str, who: str) -> None:
    """`axis_name` must be bound (inside `shard_map` over a mesh with that axis): else a
    ValueError saying so, instead of JAX's `NameError: unbound axis name` from deep inside."""
    try:
        jax.lax.axis_size(axis_name)
    except NameError:
        raise ValueError(
            f"{who}: no mesh axis {axis_name!r} is bound here: it was called outside shard_map, or "
            f"inside one over a mesh without a {axis_name!r} axis. It attends over a sequence split "
            f"across that axis: call it inside eqxpar.filter_shard_map (or jax.shard_map) over a mesh "
            f"with a {axis_name!r} axis (e.g. eqxpar.make_mesh({axis_name}=8)), passing each device's "
            f"block of the sequence, or pass axis_name= the mesh's context axis. For whole sequences "
            f"on one device use jax.nn.dot_product_attention."
        ) from None
