"""The model (a GPT or a Llama) and mesh a plan reasons about, without memory or devices.

The planner calls eqxpar's own theories and spec functions, which read shapes and dtypes
from a model and axis sizes from a `jax.sharding.Mesh`. Here the model is built with
`equinox.filter_eval_shape` (nothing allocated, so a 70B config fits a laptop) and each
array leaf becomes a zero-stride NumPy view (`np.broadcast_to` of one element): a real
`np.ndarray` of the full shape and dtype, which `eqx.is_inexact_array` accepts, holding
one element. The mesh has the plan's axis sizes over copies of one device: the theories
read only its `shape`; it never runs anything.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh

from ..models import GPT, GPTConfig, Llama, LlamaConfig, MoEBlock, MoEOptions
from ..nn import MixtureOfExperts, StackedLayers

# The mesh axes a plan may use, outermost first (the innermost, `model`, varies fastest
# over device ids, so it stays inside a host longest; `stage`, outermost, crosses hosts
# first: only stage outputs and their gradients cross it).
AXES = ("stage", "data", "fsdp", "context", "model")
"""The mesh axes a plan uses, in mesh order (outermost first)."""
EXPERT_AXES = ("stage", "data", "fsdp", "expert", "context", "model")
"""The mesh axes of a plan for a mixture-of-experts GPT (`plan(..., moe=...)`), in mesh
order: `expert` (the experts split over it, the batch too) inside the batch axes, so that
its all-to-alls stay inside a host before the gradient sums over `data` and `fsdp` do."""


def abstract_gpt(
    config: GPTConfig,
    vocab_size: int,
    *,
    remat: str,
    sequence_parallel: bool,
    attention_impl: str,
    pad_vocab_to_multiple_of: int,
    moe: MoEOptions | None = None,
) -> GPT:
    """The GPT of `config` with zero-memory leaves (see the module docs), its blocks stacked;
    with `moe` (`every=1`: the planner checks it), every block an MoE block."""
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
        moe,
    )


@functools.lru_cache(maxsize=64)
def _abstract_gpt(context, dim, heads, layers, vocab, remat, sequence_parallel, attention_impl, pad, moe) -> GPT:
    # One block is built and then stacked `layers` times (cheaper than building the
    # stack: the GPT's constructor makes and converts every block). A GPT with `moe=` is
    # built with its blocks as a tuple (its constructor's rule) and stacked the same way,
    # as `eqxpar.models.stack_blocks` stacks it.
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
        scan_layers=moe is None,
        remat=remat,
        sequence_parallel=sequence_parallel,
        moe=moe,
        key=jax.random.key(0),
    )
    block = one.blocks.unstack()[0] if moe is None else one.blocks[0]
    blocks = eqx.filter_eval_shape(lambda b: StackedLayers([b] * layers, axis_name=one.axis_name), block)
    shapes = eqx.tree_at(lambda m: m.blocks, one, blocks)
    return jax.tree.map(_zero_memory, shapes, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))


def abstract_llama(config: LlamaConfig, *, remat: str, sequence_parallel: bool, attention_impl: str) -> Llama:
    """The Llama of `config` with zero-memory leaves (see the module docs), its layers stacked."""
    return _abstract_llama(config, remat, sequence_parallel, attention_impl)


@functools.lru_cache(maxsize=64)
def _abstract_llama(config, remat, sequence_parallel, attention_impl) -> Llama:
    # One layer is built and then stacked `num_layers` times, as for the GPT: building every
    # layer traces each linear layer's initialisation, 0.8 s per variant for Llama 3 8B's 32.
    # The one-layer Llama then gets the stacked layers and its config back whole (a static
    # field, which `eqx.tree_at` cannot set: set on the new object before anything reads it).
    one = eqx.filter_eval_shape(
        lambda: Llama(
            dataclasses.replace(config, num_layers=1),
            scan_layers=True,
            remat=remat,
            sequence_parallel=sequence_parallel,
            attention_impl=attention_impl,
            key=jax.random.key(0),
        )
    )
    layer = one.layers.unstack()[0]
    layers = eqx.filter_eval_shape(lambda b: StackedLayers([b] * config.num_layers, axis_name=one.axis_name), layer)
    shapes = eqx.tree_at(lambda m: m.layers, one, layers)
    object.__setattr__(shapes, "config", config)
    return jax.tree.map(_zero_memory, shapes, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))


def abstract_model(
    config: GPTConfig | LlamaConfig,
    vocab_size: int,
    *,
    remat: str,
    sequence_parallel: bool,
    attention_impl: str,
    pad_vocab_to_multiple_of: int,
    moe: MoEOptions | None = None,
) -> GPT | Llama:
    """The model of `config` (a GPT, or a Llama: its config holds its vocabulary, so
    `vocab_size`, the padding and `moe` are the GPT's only) with zero-memory leaves."""
    if isinstance(config, LlamaConfig):
        return abstract_llama(config, remat=remat, sequence_parallel=sequence_parallel, attention_impl=attention_impl)
    return abstract_gpt(
        config,
        vocab_size,
        remat=remat,
        sequence_parallel=sequence_parallel,
        attention_impl=attention_impl,
        pad_vocab_to_multiple_of=pad_vocab_to_multiple_of,
        moe=moe,
    )


def experts_of(model: GPT | Llama) -> MixtureOfExperts | None:
    """The mixture of experts of the stacked GPT's blocks (its arrays with a layer axis),
    or None for a model without experts (a Llama: the planner plans no MoE Llama)."""
    if not isinstance(model, GPT):
        return None
    gpt = model
    layers = gpt.blocks.layers if isinstance(gpt.blocks, StackedLayers) else None
    return layers.moe if isinstance(layers, MoEBlock) else None


def _zero_memory(leaf: Any) -> Any:
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return np.broadcast_to(np.zeros((), leaf.dtype), leaf.shape)
    return leaf


def abstract_mesh(sizes: dict[str, int]) -> Mesh:
    """A mesh with the axes of `sizes` (a layout's `sizes`: all of `AXES`, or of
    `EXPERT_AXES`, in that order) over copies of one device: for the theories, which read
    only axis sizes."""
    return _abstract_mesh(tuple(sizes), tuple(sizes.values()))


@functools.lru_cache(maxsize=4096)
def _abstract_mesh(names: tuple[str, ...], shape: tuple[int, ...]) -> Mesh:
    devices = np.empty(shape, dtype=object)
    devices.fill(jax.devices()[0])
    return Mesh(devices, names)


def tree_bytes(tree: Any) -> int:
    """Bytes of every array leaf of `tree` (whole arrays, not per device)."""
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))
