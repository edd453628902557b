"""The GPT and mesh a plan reasons about, without memory or devices.

The planner calls eqxpar's own theories and spec functions, which read shapes and dtypes
from a model and axis sizes from a `jax.sharding.Mesh`. Here the model is built with
`equinox.filter_eval_shape` (nothing allocated, so a 70B config fits a laptop) and each
array leaf becomes a zero-stride NumPy view (`np.broadcast_to` of one element): a real
`np.ndarray` of the full shape and dtype, which `eqx.is_inexact_array` accepts, holding
one element. The mesh has the plan's axis sizes over copies of one device: the theories
read only its `shape`; it never runs anything.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh

from ..models import GPT, GPTConfig
from ..nn import StackedLayers

# The mesh axes a plan may use, outermost first (the innermost, `model`, varies fastest
# over device ids, so it stays inside a host longest; `stage`, outermost, crosses hosts
# first: only stage outputs and their gradients cross it).
AXES = ("stage", "data", "fsdp", "context", "model")
"""The mesh axes a plan uses, in mesh order (outermost first)."""


def abstract_gpt(
    config: GPTConfig,
    vocab_size: int,
    *,
    remat: str,
    sequence_parallel: bool,
    attention_impl: str,
    pad_vocab_to_multiple_of: int,
) -> GPT:
    """The GPT of `config` with zero-memory leaves (see the module docs)."""
    return _abstract_gpt(
        config.context,
        config.dim,
        config.heads,
        config.layers,
        vocab_size,
        remat,
        sequence_parallel,
        attention_impl,
        pad_vocab_to_multiple_of,
    )


@functools.lru_cache(maxsize=64)
def _abstract_gpt(context, dim, heads, layers, vocab, remat, sequence_parallel, attention_impl, pad) -> GPT:
    # One block is built and then stacked `layers` times (cheaper than building the
    # stack: the GPT's constructor makes and converts every block).
    one = eqx.filter_eval_shape(
        GPT,
        vocab,
        context,
        dim,
        heads,
        1,
        attention_dropout_p=0.0,
        pad_vocab_to_multiple_of=pad,
        attention_impl=attention_impl,
        scan_layers=True,
        remat=remat,
        sequence_parallel=sequence_parallel,
        key=jax.random.key(0),
    )
    block = one.blocks.unstack()[0]
    blocks = eqx.filter_eval_shape(lambda b: StackedLayers([b] * layers, axis_name=one.axis_name), block)
    shapes = eqx.tree_at(lambda m: m.blocks, one, blocks)
    return jax.tree.map(_zero_memory, shapes, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))


def _zero_memory(leaf: Any) -> Any:
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return np.broadcast_to(np.zeros((), leaf.dtype), leaf.shape)
    return leaf


def abstract_mesh(sizes: dict[str, int]) -> Mesh:
    """A mesh with the axes of `sizes` (all of `AXES`, in that order) over copies of one
    device: for the theories, which read only axis sizes."""
    return _abstract_mesh(tuple(sizes.get(a, 1) for a in AXES))


@functools.lru_cache(maxsize=4096)
def _abstract_mesh(shape: tuple[int, ...]) -> Mesh:
    devices = np.empty(shape, dtype=object)
    devices.fill(jax.devices()[0])
    return Mesh(devices, AXES)


def tree_bytes(tree: Any) -> int:
    """Bytes of every array leaf of `tree` (whole arrays, not per device)."""
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))
