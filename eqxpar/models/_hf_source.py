"""Where each array of an eqxpar model lives in a Hugging Face checkpoint: one `Source` per
array leaf, read by `load_hf` (each device's block only) and inverted by `save_hf`.

A Llama's arrays are Hugging Face's tensors as they are. A GPT-2's are not: its `Conv1D`
weights are stored transposed (`[in, out]`), its query, key and value weights are columns
of one fused `c_attn` tensor, and its vocabulary is padded. A `Source` says all of that, so
both directions read one mapping.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["Source", "read_block", "assemble"]


@dataclasses.dataclass(frozen=True)
class Source:
    """One array leaf's place in the checkpoint.

    - `names`: the tensor, or (`stacked`) one tensor per layer, stacked on the leaf's axis 0.
    - `shape`: each tensor's shape in the file.
    - `transpose`: the file holds the (per-layer) 2-D array transposed (GPT-2's `Conv1D`).
    - `offset`: the leaf's rows start at this row of the (transposed) tensor (a fused
      tensor's columns: GPT-2's `c_attn` holds query, key and value one after the other).
    - `rows`: how many of the leaf's rows the file holds; the rest are zeros (a padded
      vocabulary). `None`: all of them.
    """

    names: tuple[str, ...]
    shape: tuple[int, ...]
    stacked: bool = False
    transpose: bool = False
    offset: int = 0
    rows: int | None = None


def _bounds(index: slice, size: int) -> tuple[int, int]:
    start, stop, step = index.indices(size)
    if step != 1:
        raise ValueError(f"load_hf: a block with step {step} was asked for; only contiguous blocks are read.")
    return start, max(start, stop)


def read_block(
    source: Source, index: tuple[slice, ...], leaf_shape: Sequence[int], get_slice: Callable[[str], Any]
) -> np.ndarray:
    """The block `index` of the leaf `source` describes, read from the file as a slice (never
    the whole tensor): `get_slice(name)` is the safetensors slice of a tensor."""
    layers: Sequence[int] = [0]
    if source.stacked:
        layers = range(len(source.names))[index[0]]
        index, leaf_shape = index[1:], leaf_shape[1:]
    start, stop = _bounds(index[0], leaf_shape[0])
    real = stop if source.rows is None else max(start, min(stop, source.rows))
    rest = tuple(slice(*_bounds(s, n)) for s, n in zip(index[1:], leaf_shape[1:]))
    rows = slice(source.offset + start, source.offset + real)
    parts = []
    for layer in layers:
        name = source.names[layer]
        if real == start:  # only padding rows: nothing to read
            block = None
        elif source.transpose:
            block = np.asarray(get_slice(name)[(*rest, rows)]).T
        else:
            block = np.asarray(get_slice(name)[(rows, *rest)])
        if real < stop:  # padding rows below the file's rows
            shape = (stop - start, *(s.stop - s.start for s in rest))
            dtype = np.float32 if block is None else block.dtype
            padded = np.zeros(shape, dtype)
            if block is not None:
                padded[: real - start] = block
            block = padded
        parts.append(block)
    return np.stack(parts) if source.stacked else parts[0]


def assemble(contributions: Sequence[tuple[Source, np.ndarray | None]], dtype: Any) -> np.ndarray:
    """A file tensor rebuilt from the leaves that `Source`s place in it (the inverse of
    `read_block`): each contribution is a source and its leaf's array for this tensor (one
    layer of a stack), or `None` for an array the model does not have (zeros)."""
    shape = contributions[0][0].shape
    out = np.zeros(shape, dtype)
    view = out.T if contributions[0][0].transpose else out
    for source, array in contributions:
        if array is None:
            continue
        rows = array.shape[0] if source.rows is None else source.rows
        view[source.offset : source.offset + rows] = array[:rows]
    return np.ascontiguousarray(out)
