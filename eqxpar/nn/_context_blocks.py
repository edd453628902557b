"""What ring and all-gather attention share (see `eqxpar/nn/_ring_attention.py`): the
checks of their inputs and of their axis, their float32 logits and the causal mask between
original positions."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["attention_logits", "causal_visible", "check_qkv", "check_bound"]


def attention_logits(q, k, scale):
    """`(*batch, heads, q, k)` float32 logits from `q` `(*batch, q, heads, d)`, `k` `(*batch, k, heads, d)`."""
    return jnp.einsum("...qhd,...khd->...hqk", q.astype(jnp.float32) * scale, k.astype(jnp.float32))


def causal_visible(q_pos, k_pos, causal: bool):
    if not causal:
        return None
    return q_pos[:, None] >= k_pos[None, :]


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
