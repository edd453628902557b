"""How a sequence is laid out over the devices of a context axis (see
`eqxpar/nn/_ring_attention.py`): the `"zigzag"` and `"contiguous"` layouts, the permutation
into each, and the original positions of each device's tokens."""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

__all__ = ["Layout", "LAYOUTS", "check_layout", "layout_order", "zigzag_order", "zigzag_inverse", "context_positions"]


Layout = Literal["zigzag", "contiguous"]
LAYOUTS = ("zigzag", "contiguous")


def check_layout(layout: str, who: str) -> None:
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
    check_layout(layout, "layout_order")
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
    check_layout(layout, "context_positions")
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
