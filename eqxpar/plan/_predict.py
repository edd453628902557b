"""What a layout costs, from eqxpar's exact theories: collective bytes per (kind, axes),
bytes per device (parameters, optimizer state, saved activations, temporaries) and FLOPs,
put into a roofline step time.

This module holds what every side of the prediction reads: the layout's parameter and
optimizer-state specs and the bytes of one device's blocks. The collectives and their
pricing per (kind, axes) class are in `_predict_comm.py`, the bytes per device in
`_predict_memory.py`, the FLOPs and the roofline step time in `_predict_time.py`."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from ..nn import partition_specs
from ..train import fsdp_specs, optimizer_specs
from ._candidates import Layout
from ._family import PlanModel


def clear_caches() -> None:
    """Forget the specs, optimizer layouts and leaf tables kept by object id (one plan
    call's worth: `eqxpar.plan.plan` clears them when it starts)."""
    for cache in (_SPECS, _OPTIMIZER, _LEAVES):
        cache.clear()


def layout_specs(gpt: PlanModel, mesh: Mesh, layout: Layout) -> Any:
    """The parameters' specs the layout's step uses: the GPT's tensor-parallel specs, and
    with `fsdp > 1` [`eqxpar.train.fsdp_specs`][] over `fsdp` on top (as `fsdp_step`'s default).
    Cached per GPT and (fsdp, model) sizes: nothing else changes them."""
    return _specs(gpt, layout.fsdp, layout.model, mesh)


_SPECS: dict[tuple, Any] = {}


def _specs(gpt: PlanModel, fsdp: int, model: int, mesh: Mesh) -> Any:
    key = (id(gpt), fsdp, model)
    if key not in _SPECS:
        specs = partition_specs(gpt)
        if fsdp > 1:
            specs = fsdp_specs(gpt, mesh, batch_axis="fsdp", param_specs=specs)
        _SPECS[key] = (gpt, specs)  # the GPT kept alive with its id
    return _SPECS[key][1]


def block_bytes(
    tree: Any,
    specs: Any,
    sizes: dict[str, int],
    *,
    split_only: bool = False,
    dtype: Any = None,
    floating_only: bool = True,
    over: str | None = None,
) -> int:
    """Bytes of one device's blocks of `tree`'s floating-point arrays (every array with
    `floating_only=False`: an optimizer's step counts too) laid out by `specs` (with
    `split_only`, only those split over `fsdp`; with `over`, only those split over that
    axis; with `dtype`, as if in that dtype)."""
    total = 0
    for shape, itemsize, dims in _leaf_table(tree, specs, floating_only):
        if split_only and not any("fsdp" in axes for axes in dims):
            continue
        if over is not None and not any(over in axes for axes in dims):
            continue
        total += _block_elements(shape, dims, sizes) * (np.dtype(dtype).itemsize if dtype is not None else itemsize)
    return total


def leaf_blocks(tree: Any, specs: Any, sizes: dict[str, int]) -> list[tuple[frozenset[str], int]]:
    """For each floating-point leaf of `tree` laid out by `specs`: the mesh axes that split
    it, and the bytes of one device's block."""
    return [
        (frozenset(a for axes in dims for a in axes), _block_elements(shape, dims, sizes) * itemsize)
        for shape, itemsize, dims in _leaf_table(tree, specs, True)
    ]


def _block_elements(shape: tuple[int, ...], dims: list[tuple[str, ...]], sizes: dict[str, int]) -> int:
    return math.prod(size // math.prod(sizes[a] for a in axes) for size, axes in zip(shape, dims))


_LEAVES: dict[tuple[int, int, bool], Any] = {}


def _leaf_table(tree: Any, specs: Any, floating_only: bool) -> list[tuple[tuple[int, ...], int, list[tuple[str, ...]]]]:
    """(shape, itemsize, the axes splitting each dimension) of every floating-point leaf
    (every array leaf without `floating_only`), once per (tree, specs) pair."""
    key = (id(tree), id(specs), floating_only)
    if key not in _LEAVES:
        table = []
        spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        for leaf, spec in zip(jax.tree.leaves(tree), spec_leaves, strict=True):
            if not hasattr(leaf, "dtype") or (floating_only and not np.issubdtype(leaf.dtype, np.inexact)):
                continue
            entries = tuple(spec) + (None,) * (len(leaf.shape) - len(spec))
            dims = [() if e is None else ((e,) if isinstance(e, str) else tuple(e)) for e in entries]
            table.append((tuple(leaf.shape), np.dtype(leaf.dtype).itemsize, dims))
        _LEAVES[key] = (tree, specs, table)  # the tree and specs kept alive with their ids
    return _LEAVES[key][2]


_OPTIMIZER: dict[tuple, Any] = {}


def optimizer_layout(gpt: PlanModel, optimizer: Any, specs: Any) -> tuple[Any, Any]:
    """The optimizer state's shapes (once per GPT and optimizer) and specs
    (`eqxpar.train.optimizer_specs`, once per parameter specs too: they are cached)."""
    shapes_key = (id(gpt), id(optimizer))
    if shapes_key not in _OPTIMIZER:
        _OPTIMIZER[shapes_key] = (gpt, optimizer, jax.eval_shape(optimizer.init, _floating(gpt)))
    shapes = _OPTIMIZER[shapes_key][2]
    key = (id(gpt), id(optimizer), id(specs))
    if key not in _OPTIMIZER:
        _OPTIMIZER[key] = (gpt, optimizer, specs, optimizer_specs(optimizer, shapes, gpt, specs))
    return shapes, _OPTIMIZER[key][-1]


def _floating(gpt: PlanModel) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(gpt)
    return jax.tree_util.tree_unflatten(
        treedef,
        [
            jax.ShapeDtypeStruct(x.shape, x.dtype)
            if hasattr(x, "dtype") and np.issubdtype(x.dtype, np.inexact)
            else None
            for x in leaves
        ],
    )
