"""Context parallelism for attention: every example's sequence split over a mesh axis.

Inside `shard_map` over a context axis of `C` devices, each device holds `L = S / C` of the
`S` positions of every sequence: its queries, keys and values. Attention needs the keys and
values of every position, so the devices exchange them in one of two ways:

- [`ring_attention`][eqxpar.nn.ring_attention]: the key/value blocks travel around a ring
  of the `C` devices with `jax.lax.ppermute` (`C - 1` hops); each device folds one block
  at a time into its output with an online softmax (a running maximum and sum), so only
  two blocks are alive at once. Its backward pass (a `custom_vjp`) sends the blocks around
  again (the other way round), together with their gradients, which arrive home after
  `C` hops.
- [`all_gather_attention`][eqxpar.nn.all_gather_attention]: one `all_gather` of the keys
  and values, then ordinary attention over the whole sequence; autodiff's transpose of the
  gather (a `psum_scatter`) returns their gradients. The same bytes in one collective, but
  the whole sequence's keys and values are alive on every device.

**Layouts.** `"contiguous"`: device `i` holds positions `[i L, (i + 1) L)`. Under a causal
mask the last device then has `C` times the work of the first. `"zigzag"`: the sequence is
cut into `2C` chunks and device `i` holds chunks `i` and `2C - 1 - i` (one early, one
late), so every device has the same number of visible (query, key) pairs.
[`zigzag_order`][eqxpar.nn.zigzag_order] is the permutation that puts a sequence in that
layout (`x[..., zigzag_order(S, C)]`, then split contiguously), and
[`context_positions`][eqxpar.nn.context_positions] gives each device the original positions
of its tokens (for position embeddings and the causal mask).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

__all__ = [
    "LAYOUTS",
    "all_gather_attention",
    "context_positions",
    "layout_order",
    "ring_attention",
    "zigzag_inverse",
    "zigzag_order",
]

Layout = Literal["zigzag", "contiguous"]
LAYOUTS = ("zigzag", "contiguous")


def _check_layout(layout: str, who: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"{who}: layout must be one of {LAYOUTS}, got {layout!r}.")


def layout_order(seq_len: int, num_shards: int, layout: Layout = "zigzag") -> np.ndarray:
    """The order of a sequence's positions once laid out for `num_shards` context shards.

    `x[..., layout_order(S, C, layout)]` put in that order and split into `C` contiguous
    blocks gives device `i` its tokens; entry `j` is the original position of the `j`-th
    token of the layout.

    **Arguments:**

    - `seq_len`: the sequence length `S`.
    - `num_shards`: the context axis size `C`.
    - `layout`: `"zigzag"` (device `i` holds chunks `i` and `2C - 1 - i` of `2C`) or
      `"contiguous"` (the identity).

    **Returns:**

    An int NumPy array of shape `(seq_len,)`, a permutation of `range(seq_len)`.

    **Raises:**

    - `ValueError` if `seq_len` is not divisible by `C` (by `2C` for zigzag), or for an
      unknown layout.
    """
    _check_layout(layout, "layout_order")
    if not (isinstance(num_shards, int) and num_shards > 0):
        raise ValueError(f"layout_order: num_shards must be a positive integer, got {num_shards!r}.")
    chunks = 2 * num_shards if layout == "zigzag" else num_shards
    if seq_len % chunks:
        raise ValueError(
            f"layout_order: a sequence of {seq_len} positions does not split into the {chunks} "
            f"equal chunks the {layout!r} layout over {num_shards} context shards needs. Use a "
            f"sequence length that is a multiple of {chunks}."
        )
    if layout == "contiguous":
        return np.arange(seq_len)
    blocks = np.arange(seq_len).reshape(chunks, seq_len // chunks)
    return np.concatenate([np.concatenate([blocks[i], blocks[chunks - 1 - i]]) for i in range(num_shards)])


def zigzag_order(seq_len: int, num_shards: int) -> np.ndarray:
    """`layout_order(seq_len, num_shards, "zigzag")`: chunk `i` with chunk `2C - 1 - i`."""
    return layout_order(seq_len, num_shards, "zigzag")


def zigzag_inverse(seq_len: int, num_shards: int) -> np.ndarray:
    """The inverse permutation of [`eqxpar.nn.zigzag_order`][]: `y[..., zigzag_inverse(S, C)]`
    puts a sequence in zigzag layout back in its original order."""
    return np.argsort(zigzag_order(seq_len, num_shards))


def context_positions(local_len: int, axis_name: str, layout: Layout = "zigzag") -> Int[Array, " local_len"]:
    """The original positions of this device's `local_len` tokens (inside `shard_map`).

    **Arguments:**

    - `local_len`: the number of positions each device holds, `L = S / C`.
    - `axis_name`: the context axis.
    - `layout`: as in [`eqxpar.nn.layout_order`][].

    **Returns:**

    An int32 array of shape `(local_len,)`.
    """
    _check_layout(layout, "context_positions")
    index = jax.lax.axis_index(axis_name)
    size = jax.lax.axis_size(axis_name)
    if layout == "contiguous":
        return index * local_len + jnp.arange(local_len, dtype=jnp.int32)
    if local_len % 2:
        raise ValueError(
            f"context_positions: the zigzag layout needs an even number of positions per device, "
            f"got {local_len}. Use a sequence length that is a multiple of 2 x the context axis size."
        )
    half = local_len // 2
    t = jnp.arange(half, dtype=jnp.int32)
    return jnp.concatenate([index * half + t, (2 * size - 1 - index) * half + t])


def _logits(q, k, scale):
    """`(*batch, heads, q, k)` float32 logits from `q` `(*batch, q, heads, d)`, `k` `(*batch, k, heads, d)`."""
    return jnp.einsum("...qhd,...khd->...hqk", q.astype(jnp.float32) * scale, k.astype(jnp.float32))


def _visible(q_pos, k_pos, causal: bool):
    if not causal:
        return None
    return q_pos[:, None] >= k_pos[None, :]


def _ring_perm(size: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % size) for i in range(size)]


def _check_qkv(q, k, v, who: str) -> None:
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


def _check_bound(axis_name: str, who: str) -> None:
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


def ring_attention(
    q: Float[Array, "*batch seq heads qk"],
    k: Float[Array, "*batch seq heads qk"],
    v: Float[Array, "*batch seq heads vo"],
    *,
    axis_name: str,
    causal: bool,
    layout: Layout = "zigzag",
) -> Float[Array, "*batch seq heads vo"]:
    """Softmax attention over a sequence split across `axis_name`, by passing key/value
    blocks around a ring (inside `shard_map`).

    Step `s` (of `C`) attends this device's queries to the key/value block that started on
    device `i - s`, folding it into a running maximum, sum and output (the online softmax),
    then hands the block on to device `i + 1` (`C - 1` `ppermute`s in all). The backward
    pass (a `custom_vjp`) keeps only this device's `q`, `k`, `v`, output and log-sum-exp,
    sends the blocks around the ring the other way, and each block's gradient along with
    it, so after `C` hops every device holds the gradient of its own keys and values.

    **Arguments:**

    - `q`, `k`, `v`: this device's block of the sequence, `(*batch, L, heads, dim)`, in the
      given `layout`.
    - `axis_name`: the context axis (a single mesh axis).
    - `causal`: whether position `p` sees only keys at positions `<= p` (the original
      positions, whatever the layout).
    - `layout`: `"zigzag"` (default) or `"contiguous"`, as the sequence was split.

    **Returns:**

    This device's block of the attention output, `(*batch, L, heads, vo)`, in `q`'s dtype
    (computed in float32).

    **Raises:**

    - `ValueError` for shapes that do not fit or an unknown layout.
    """
    _check_layout(layout, "ring_attention")
    _check_qkv(q, k, v, "ring_attention")
    _check_bound(axis_name, "ring_attention")
    return _ring(q, k, v, axis_name, bool(causal), layout)


def _fold(state, q, k, v, scale, visible):
    """Fold one key/value block into the online softmax `(m, total, out)` of `q`'s rows."""
    m, total, out = state
    logits = _logits(q, k, scale)
    if visible is not None:
        logits = jnp.where(visible, logits, jnp.finfo(jnp.float32).min)
    m_new = jnp.maximum(m, logits.max(axis=-1))
    p = jnp.exp(logits - m_new[..., None])
    if visible is not None:
        p = jnp.where(visible, p, 0.0)
    alpha = jnp.exp(m - m_new)
    total = alpha * total + p.sum(axis=-1)
    out = jnp.swapaxes(alpha, -1, -2)[..., None] * out + jnp.einsum("...hqk,...khd->...qhd", p, v.astype(jnp.float32))
    return m_new, total, out


def _late_rows(state, half):
    m, total, out = state
    return m[..., half:], total[..., half:], out[..., half:, :, :]


def _with_late_rows(state, late, half):
    return tuple(
        jnp.concatenate([x[..., :half], y], axis=-1) if i < 2 else jnp.concatenate([x[..., :half, :, :], y], axis=-3)
        for i, (x, y) in enumerate(zip(state, late))
    )


def _skip_masked(step: int, causal: bool) -> bool:
    """Whether step `step` of the ring may skip the blocks a causal mask hides entirely:
    every step but the first (the device's own block, which needs the mask inside)."""
    return causal and step > 0


def _ring_forward_pass(q, k, v, axis_name, causal, layout):
    size = jax.lax.axis_size(axis_name)
    index = jax.lax.axis_index(axis_name)
    local = q.shape[-3]
    half = local // 2
    scale = 1.0 / math.sqrt(q.shape[-1])
    q_pos = context_positions(local, axis_name, layout)
    lead, heads = q.shape[:-3], q.shape[-2]
    state = (
        jnp.full((*lead, heads, local), jnp.finfo(jnp.float32).min, jnp.float32),
        jnp.zeros((*lead, heads, local), jnp.float32),
        jnp.zeros((*lead, local, heads, v.shape[-1]), jnp.float32),
    )
    perm = _ring_perm(size)
    for step in range(size):
        with jax.named_scope(f"ring_step_{step}"):
            source = (index - step) % size
            earlier = source < index
            if not _skip_masked(step, causal):
                visible = _visible(q_pos, _positions_of(source, local, size, layout), causal)
                state = _fold(state, q, k, v, scale, visible)
            elif layout == "contiguous":
                # An earlier device's block is wholly visible, a later one's wholly hidden.
                state = jax.lax.cond(
                    earlier, lambda st, k, v: _fold(st, q, k, v, scale, None), lambda st, k, v: st, state, k, v
                )
            else:
                # Zigzag: an earlier device's first chunk is visible to all our rows (its
                # second chunk to none); a later device's whole block is visible to our
                # second chunk only. Half a block of work either way, on every device.
                state = jax.lax.cond(
                    earlier,
                    lambda st, k, v: _fold(st, q, k[..., :half, :, :], v[..., :half, :, :], scale, None),
                    lambda st, k, v: _with_late_rows(
                        st, _fold(_late_rows(st, half), q[..., half:, :, :], k, v, scale, None), half
                    ),
                    state,
                    k,
                    v,
                )
            if step < size - 1:
                k, v = jax.lax.ppermute((k, v), axis_name, perm)
    m, total, out = state
    out = out / jnp.swapaxes(total, -1, -2)[..., None]
    lse = m + jnp.log(total)
    return out.astype(q.dtype), lse


def _positions_of(source, local: int, size: int, layout: str):
    """The original positions of the block that started on device `source` (traced index)."""
    if layout == "contiguous":
        return source * local + jnp.arange(local, dtype=jnp.int32)
    half = local // 2
    t = jnp.arange(half, dtype=jnp.int32)
    return jnp.concatenate([source * half + t, (2 * size - 1 - source) * half + t])


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _ring(q, k, v, axis_name, causal, layout):
    return _ring_forward_pass(q, k, v, axis_name, causal, layout)[0]


def _ring_fwd(q, k, v, axis_name, causal, layout):
    out, lse = _ring_forward_pass(q, k, v, axis_name, causal, layout)
    return out, (q, k, v, out, lse)


def _ring_bwd(axis_name, causal, layout, residuals, d_out):
    q, k, v, out, lse = residuals
    size = jax.lax.axis_size(axis_name)
    index = jax.lax.axis_index(axis_name)
    local = q.shape[-3]
    scale = 1.0 / math.sqrt(q.shape[-1])
    q_pos = context_positions(local, axis_name, layout)
    # The other way round: were these the forward pass's rotations again, XLA would
    # merge the two and keep every rotated block alive from the forward to the backward
    # pass (all C blocks per layer in memory) instead of sending them again.
    perm = [(j, i) for i, j in _ring_perm(size)]
    d_out = d_out.astype(jnp.float32)
    # D_i = sum_d dO_id O_id, the softmax backward's row term, (*batch, heads, q).
    delta = jnp.swapaxes(jnp.sum(d_out * out.astype(jnp.float32), axis=-1), -1, -2)
    dq = jnp.zeros(q.shape, jnp.float32)
    dk = jnp.zeros(k.shape, jnp.float32)
    dv = jnp.zeros(v.shape, jnp.float32)
    half = local // 2

    def grads(acc, q_rows, k, v, rows, keys, visible):
        """Add one block's contribution to `(dq, dk, dv)`: query rows `rows`, key rows `keys`."""
        dq, dk, dv = acc
        d_o, lse_r, delta_r = d_out[..., rows, :, :], lse[..., rows], delta[..., rows]
        p = jnp.exp(_logits(q_rows, k, scale) - lse_r[..., None])
        if visible is not None:
            p = jnp.where(visible, p, 0.0)
        ds = p * (jnp.einsum("...qhd,...khd->...hqk", d_o, v.astype(jnp.float32)) - delta_r[..., None])
        dq = dq.at[..., rows, :, :].add(scale * jnp.einsum("...hqk,...khd->...qhd", ds, k.astype(jnp.float32)))
        dk = dk.at[..., keys, :, :].add(scale * jnp.einsum("...hqk,...qhd->...khd", ds, q_rows.astype(jnp.float32)))
        dv = dv.at[..., keys, :, :].add(jnp.einsum("...hqk,...qhd->...khd", p, d_o))
        return dq, dk, dv

    every, first, second = slice(None), slice(None, half), slice(half, None)
    for step in range(size):
        with jax.named_scope(f"ring_step_{step}_backward"):
            source = (index + step) % size
            earlier = source < index
            acc = (dq, dk, dv)
            if not _skip_masked(step, causal):
                visible = _visible(q_pos, _positions_of(source, local, size, layout), causal)
                acc = grads(acc, q, k, v, every, every, visible)
            elif layout == "contiguous":
                acc = jax.lax.cond(
                    earlier, lambda a, k, v: grads(a, q, k, v, every, every, None), lambda a, k, v: a, acc, k, v
                )
            else:
                acc = jax.lax.cond(
                    earlier,
                    lambda a, k, v: grads(a, q, k[..., first, :, :], v[..., first, :, :], every, first, None),
                    lambda a, k, v: grads(a, q[..., second, :, :], k, v, second, every, None),
                    acc,
                    k,
                    v,
                )
            dq, dk, dv = acc
            if step < size - 1:
                k, v = jax.lax.ppermute((k, v), axis_name, perm)
            # The block's gradient travels with it; the last hop takes it home.
            if size > 1:
                dk, dv = jax.lax.ppermute((dk, dv), axis_name, perm)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_ring.defvjp(_ring_fwd, _ring_bwd)


def all_gather_attention(
    q: Float[Array, "*batch seq heads qk"],
    k: Float[Array, "*batch seq heads qk"],
    v: Float[Array, "*batch seq heads vo"],
    *,
    axis_name: str,
    causal: bool,
    layout: Layout = "zigzag",
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
    _check_layout(layout, "all_gather_attention")
    _check_qkv(q, k, v, "all_gather_attention")
    _check_bound(axis_name, "all_gather_attention")
    local = q.shape[-3]
    seq_axis = q.ndim - 3
    size = jax.lax.axis_size(axis_name)
    k_all, v_all = (k, v) if size == 1 else jax.lax.all_gather((k, v), axis_name, axis=seq_axis, tiled=True)
    k_pos = jnp.asarray(layout_order(local * size, size, layout), jnp.int32)
    q_pos = context_positions(local, axis_name, layout)
    logits = _logits(q, k_all, 1.0 / math.sqrt(q.shape[-1]))
    visible = _visible(q_pos, k_pos, causal)
    if visible is not None:
        logits = jnp.where(visible, logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("...hqk,...khd->...qhd", weights, v_all.astype(jnp.float32)).astype(q.dtype)
