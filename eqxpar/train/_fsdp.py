"""Where each parameter lives under FSDP (ZeRO-3): one dimension of every array split over
the batch axis as well."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import PyTree

from .._specs import broadcast_specs, check_axes, entry_axes, pad_spec, validate_spec
from ..nn import StackedLayers


def fsdp_specs(
    model: PyTree,
    mesh: Mesh,
    *,
    batch_axis: str = "fsdp",
    param_specs: PyTree = PartitionSpec(),
    min_size: int = 0,
) -> PyTree[PartitionSpec]:
    """Where each parameter lives under FSDP: one dimension of every array split over `batch_axis`.

    For each floating-point array the first dimension that `param_specs` does not already
    split and whose size `batch_axis` divides is split over `batch_axis`; failing that, a
    dimension `param_specs` splits is split further (`P(("model", "fsdp"))`) where the
    sizes allow. Arrays with neither (odd sizes, scalars), and arrays of fewer than
    `min_size` elements, stay whole on every device of that axis; their gradients are
    summed with one combined all-reduce.

    **Arguments:**

    - `model`: the model in its global form (full-size arrays), or its abstract form
      (`eqx.filter_eval_shape`: a `jax.ShapeDtypeStruct` per array; only shapes are read),
      e.g. for [`eqxpar.init_sharded`][].
    - `mesh`: the mesh; it must have `batch_axis`.
    - `batch_axis`: the axis parameters, optimizer state and batch are split over.
    - `param_specs`: specs the parameters already have over other axes (e.g.
      `eqxpar.nn.partition_specs(model, mesh)` for tensor parallelism); default replicated.
    - `min_size`: arrays with fewer elements than this stay whole (e.g. `2**14`: biases
      and norm scales). Each split array costs one all-gather and one reduce-scatter per
      step, whatever its size; the whole ones share one all-reduce. Default 0: split
      every array that divides.

    **Returns:**

    A tree with the structure of `model` and one `PartitionSpec` per leaf (`P()` for
    non-array leaves), for [`eqxpar.shard`][] and [`eqxpar.train.fsdp_step`][].

    **Raises:**

    - `ValueError` if the mesh lacks `batch_axis`, `param_specs` does not fit the model, or
      `min_size` is negative.
    """
    if not isinstance(batch_axis, str):
        raise ValueError(
            f"fsdp_specs: batch_axis must be one mesh axis name, got {batch_axis!r}. For hybrid "
            f"sharding (copies over 'data', slices over 'fsdp') give fsdp_specs the axis to slice "
            f"over and fsdp_step the tuple: fsdp_step(..., batch_axis=('data', 'fsdp'))."
        )
    if not isinstance(min_size, int) or min_size < 0:
        raise ValueError(f"fsdp_specs: min_size must be a non-negative int (elements), got {min_size!r}.")
    n = check_axes(
        mesh, batch_axis, who="fsdp_specs", arg="batch_axis", role="to split the parameters and the batch over"
    )
    leaves, treedef = jax.tree_util.tree_flatten(model)
    base = broadcast_specs(param_specs, model, what="param_specs")
    out = []
    for leaf, spec, stacked in zip(leaves, base, _in_stack(model)):
        if not _is_float_array(leaf):
            out.append(PartitionSpec())
            continue
        validate_spec(spec, tuple(leaf.shape), mesh, where="param_specs")
        entries = pad_spec(spec, leaf.ndim)
        if any(batch_axis in entry_axes(e) for e in entries):
            raise ValueError(f"fsdp_specs: param_specs already split a leaf over {batch_axis!r}: {spec}.")
        # A stacked array's size per layer: the scan gathers one layer at a time.
        per_layer = leaf.size // leaf.shape[0] if stacked and leaf.ndim else leaf.size
        if per_layer >= min_size:
            entries = _add_fsdp(entries, leaf.shape, mesh, batch_axis, n, first=1 if stacked else 0)
        while entries and entries[-1] is None:
            entries.pop()
        out.append(PartitionSpec(*entries))
    return jax.tree_util.tree_unflatten(treedef, out)


def _is_float_array(leaf) -> bool:
    """A floating-point array, or the abstract shape of one."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jnp.issubdtype(leaf.dtype, jnp.inexact)
    return eqx.is_inexact_array(leaf)


def _in_stack(model: PyTree) -> list[bool]:
    """Per leaf: whether it belongs to an `eqxpar.nn.StackedLayers` (leading layer axis)."""
    is_stack = lambda x: isinstance(x, StackedLayers)  # noqa: E731
    flags = []
    for node in jax.tree.leaves(model, is_leaf=is_stack):
        flags.extend([True] * len(jax.tree.leaves(node)) if is_stack(node) else [False])
    return flags


def _add_fsdp(entries: list, shape, mesh: Mesh, axis: str, n: int, first: int = 0) -> list:
    # First choice: a dimension no other axis splits. Second: one another axis splits,
    # split further (`("model", "fsdp")`: each model block cut into n pieces, so an
    # all_gather over `fsdp` rebuilds exactly the model block). Stacked layers' arrays
    # never split their layer axis (`first=1`): the scan then gathers one layer at a time.
    for dim, size in enumerate(shape):
        if dim >= first and entries[dim] is None and size % n == 0:
            return entries[:dim] + [axis] + entries[dim + 1 :]
    for dim, size in enumerate(shape):
        entry = entries[dim]
        if entry is None or dim < first:
            continue
        axes = entry if isinstance(entry, tuple) else (entry,)
        parts = 1
        for a in axes:
            parts *= mesh.shape[a]
        if size % (parts * n) == 0:
            return entries[:dim] + [(*axes, axis)] + entries[dim + 1 :]
    return entries
