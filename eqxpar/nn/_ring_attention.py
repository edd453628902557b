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

This module holds `ring_attention`; the layouts are in `_context_layout.py`,
`all_gather_attention` in `_all_gather_attention.py`, what both share in `_context_blocks.py`.
"""

from __future__ import annotations

import math
from functools import partial

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
from ._context_layout import Layout, check_layout, context_positions

__all__ = ["ring_attention"]


def _ring_perm(size: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % size) for i in range(size)]


def ring_attention(
    q: Float[Array, "*batch seq heads qk"],
    k: Float[Array, "*batch seq heads qk"],
    v: Float[Array, "*batch seq heads vo"],
    *,
    axis_name: str,
    causal: bool,
    layout: Layout = "zigzag",
    segment_ids: Int[Array, "*batch seq"] | None = None,
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
    - `segment_ids`: packed documents: the document ids of every device's block of each
      sequence, `(*batch, C L)`: device `j`'s block (in `layout`) at `[j L, (j + 1) L)`, as
      [`eqxpar.nn.context_segment_ids`][] gathers them once per step; a query sees only keys
      of its own document. No ids travel around the ring. `None`: one document per sequence.

    **Returns:**

    This device's block of the attention output, `(*batch, L, heads, vo)`, in `q`'s dtype
    (computed in float32).

    **Raises:**

    - `ValueError` for shapes that do not fit or an unknown layout.
    """
    check_layout(layout, "ring_attention")
    check_qkv(q, k, v, "ring_attention")
    check_bound(axis_name, "ring_attention")
    check_segment_ids(segment_ids, q, axis_name, "ring_attention")
    return _ring(q, k, v, segment_ids, axis_name, bool(causal), layout)


def _fold(state, q, k, v, scale, visible):
    """Fold one key/value block into the online softmax `(m, total, out)` of `q`'s rows."""
    m, total, out = state
    logits = attention_logits(q, k, scale)
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


def _ring_forward_pass(q, k, v, segments, axis_name, causal, layout):
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
    # Packed documents: every fold also hides the keys of other documents. The ids of every
    # block are here already (`segments`, gathered once per step by the model): none travel.
    q_seg = _block(segments, index, local)
    for step in range(size):
        with jax.named_scope(f"ring_step_{step}"):
            source = (index - step) % size
            earlier = source < index
            k_seg = _block(segments, source, local)
            if not _skip_masked(step, causal):
                visible = both_visible(
                    causal_visible(q_pos, _positions_of(source, local, size, layout), causal),
                    segment_visible(q_seg, k_seg),
                )
                state = _fold(state, q, k, v, scale, visible)
            elif layout == "contiguous":
                # An earlier device's block is wholly visible, a later one's wholly hidden.
                state = jax.lax.cond(
                    earlier,
                    lambda st, k, v, ks: _fold(st, q, k, v, scale, segment_visible(q_seg, ks)),
                    lambda st, k, v, ks: st,
                    state,
                    k,
                    v,
                    k_seg,
                )
            else:
                # Zigzag: an earlier device's first chunk is visible to all our rows (its
                # second chunk to none); a later device's whole block is visible to our
                # second chunk only. Half a block of work either way, on every device.
                state = jax.lax.cond(
                    earlier,
                    lambda st, k, v, ks: _fold(
                        st, q, k[..., :half, :, :], v[..., :half, :, :], scale, _segments(q_seg, ks, None, half)
                    ),
                    lambda st, k, v, ks: _with_late_rows(
                        st,
                        _fold(_late_rows(st, half), q[..., half:, :, :], k, v, scale, _segments(q_seg, ks, half, None)),
                        half,
                    ),
                    state,
                    k,
                    v,
                    k_seg,
                )
            if step < size - 1:
                k, v = jax.lax.ppermute((k, v), axis_name, perm)
    m, total, out = state
    out = out / jnp.swapaxes(total, -1, -2)[..., None]
    lse = m + jnp.log(total)
    return out.astype(q.dtype), lse


def _block(segments, device, local: int):
    """Device `device`'s block of the gathered segment ids (None without them)."""
    if segments is None:
        return None
    return jax.lax.dynamic_slice_in_dim(segments, device * local, local, axis=segments.ndim - 1)


def _segments(segments, k_seg, q_from, k_to):
    """The segment mask of query rows `q_from:` against key rows `:k_to` (None: all)."""
    if segments is None:
        return None
    return segment_visible(segments[..., slice(q_from, None)], k_seg[..., slice(None, k_to)])


def _positions_of(source, local: int, size: int, layout: str):
    """The original positions of the block that started on device `source` (traced index)."""
    if layout == "contiguous":
        return source * local + jnp.arange(local, dtype=jnp.int32)
    half = local // 2
    t = jnp.arange(half, dtype=jnp.int32)
    return jnp.concatenate([source * half + t, (2 * size - 1 - source) * half + t])


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _ring(q, k, v, segments, axis_name, causal, layout):
    return _ring_forward_pass(q, k, v, segments, axis_name, causal, layout)[0]


def _ring_fwd(q, k, v, segments, axis_name, causal, layout):
    out, lse = _ring_forward_pass(q, k, v, segments, axis_name, causal, layout)
    return out, (q, k, v, segments, out, lse)


def _ring_bwd(axis_name, causal, layout, residuals, d_out):
    q, k, v, segments, out, lse = residuals
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
        p = jnp.exp(attention_logits(q_rows, k, scale) - lse_r[..., None])
        if visible is not None:
            p = jnp.where(visible, p, 0.0)
        ds = p * (jnp.einsum("...qhd,...khd->...hqk", d_o, v.astype(jnp.float32)) - delta_r[..., None])
        dq = add_rows(dq, rows, scale * jnp.einsum("...hqk,...khd->...qhd", ds, k.astype(jnp.float32)))
        dk = add_rows(dk, keys, scale * jnp.einsum("...hqk,...qhd->...khd", ds, q_rows.astype(jnp.float32)))
        dv = add_rows(dv, keys, jnp.einsum("...hqk,...qhd->...khd", p, d_o))
        return dq, dk, dv

    def add_rows(total, rows, update):
        # A whole block is a plain add: jaxlib 0.11.2's CPU compiler crashes (segfault) on
        # a scatter-add over every row inside shard_map.
        return total + update if rows == slice(None) else total.at[..., rows, :, :].add(update)

    every, first, second = slice(None), slice(None, half), slice(half, None)
    q_seg = _block(segments, index, local)
    for step in range(size):
        with jax.named_scope(f"ring_step_{step}_backward"):
            source = (index + step) % size
            earlier = source < index
            k_seg = _block(segments, source, local)
            acc = (dq, dk, dv)
            if not _skip_masked(step, causal):
                visible = both_visible(
                    causal_visible(q_pos, _positions_of(source, local, size, layout), causal),
                    segment_visible(q_seg, k_seg),
                )
                acc = grads(acc, q, k, v, every, every, visible)
            elif layout == "contiguous":
                acc = jax.lax.cond(
                    earlier,
                    lambda a, k, v, ks: grads(a, q, k, v, every, every, segment_visible(q_seg, ks)),
                    lambda a, k, v, ks: a,
                    acc,
                    k,
                    v,
                    k_seg,
                )
            else:
                acc = jax.lax.cond(
                    earlier,
                    lambda a, k, v, ks: grads(
                        a,
                        q,
                        k[..., first, :, :],
                        v[..., first, :, :],
                        every,
                        first,
                        _segments(q_seg, ks, None, half),
                    ),
                    lambda a, k, v, ks: grads(
                        a, q[..., second, :, :], k, v, second, every, _segments(q_seg, ks, half, None)
                    ),
                    acc,
                    k,
                    v,
                    k_seg,
                )
            dq, dk, dv = acc
            if step < size - 1:
                k, v = jax.lax.ppermute((k, v), axis_name, perm)
            # The block's gradient travels with it; the last hop takes it home.
            if size > 1:
                dk, dv = jax.lax.ppermute((dk, dv), axis_name, perm)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_ring.defvjp(_ring_fwd, _ring_bwd)
