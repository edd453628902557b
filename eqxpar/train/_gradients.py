"""The per-device half of every train step: the loss's share and its gradient.

One core serves every strategy. A step splits the batch over its batch axes, and each
parameter leaf is in one of two cases for each batch axis:

- *copied* over it (data parallelism, and the replicated leaves of FSDP): the device
  differentiates its own copy (`pcast(..., to="varying")`) and one explicit `psum` over
  the axis adds up the shards' gradients after the backward pass;
- *split* over it (FSDP): the device holds a slice, `all_gather`s the whole leaf for the
  forward pass, and autodiff's transpose of that gather, a `psum_scatter`, hands back the
  gradient already summed over the axis and cut to the device's slice.

Every device differentiates its share of the global-batch mean (its shard's mean divided by
the number of shards and micro-batches), so the sums above are the global gradient. The
optimizer is not applied here: the gradients leave the per-device program with their
specs and the optimizer runs on global arrays (see `_step_body.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array, PyTree

from .._specs import entry_axes, pad_spec, path_str, spec_axes
from ..nn import StackedLayers
from ._checks import checked_loss
from ._precision import Precision
from ._saved import record_saved_activations

# Per leaf: the (batch axes, dimension) pairs to all-gather, in order.
Gathers = tuple[tuple[tuple[str, ...], int], ...]


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """How one parameter leaf meets the batch axes: gathered on some, copied on the rest."""

    gathers: Gathers
    copied: tuple[str, ...]
    # Every mesh axis the leaf's gradient is split over (for the gradient norm).
    split: tuple[str, ...]


def leaf_plans(
    specs: PyTree[PartitionSpec], model: PyTree, batch_axes: Sequence[str], who: str, owned: Sequence[str] = ()
) -> list[LeafPlan | None]:
    """One plan per leaf of `model` (None for leaves that are not floating-point arrays).

    `owned`: batch axes over which a leaf split over them is *owned*, not gathered (the
    expert axis: each device keeps its experts, and the all-to-alls that bring every
    device's tokens to them already sum their gradient over the axis). A leaf split over
    an owned axis is neither gathered nor summed over it; a leaf not split over it is
    copied over it like over any batch axis."""
    plans: list[LeafPlan | None] = []
    # (Not is_spec: a model's None fields would count as specs.)
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    for (path, leaf), spec in zip(jax.tree_util.tree_flatten_with_path(model)[0], flat_specs):
        if not eqx.is_inexact_array(leaf):
            plans.append(None)
            continue
        gathers = []
        for dim, entry in enumerate(pad_spec(spec or PartitionSpec(), leaf.ndim)):
            axes = entry_axes(entry)
            ours = tuple(a for a in axes if a in batch_axes and a not in owned)
            if not ours:
                continue
            if axes[len(axes) - len(ours) :] != ours:
                raise ValueError(
                    f"{who}: param_specs at {path_str(path)} is {spec}: within dimension {dim}, "
                    f"the batch axes {ours} must come after the other axes (e.g. "
                    f"('model', 'fsdp')), so that gathering them rebuilds each block whole."
                )
            gathers.append((ours, dim))
        used = {a for axes, _ in gathers for a in axes} | (set(spec_axes(spec or PartitionSpec())) & set(owned))
        copied = tuple(a for a in batch_axes if a not in used)
        plans.append(LeafPlan(tuple(gathers), copied, spec_axes(spec or PartitionSpec())))
    return plans


def whole_leaf(leaf: Any, gathers: Gathers, precision: Precision) -> Any:
    """The leaf as the loss sees it: gathered whole from this device's slice (in the
    precision's reduce dtype) and cast to its compute dtype. Autodiff's transpose of each
    all_gather is a psum_scatter: the gradient comes back summed over the axes and cut to
    the slice. (Not a custom_vjp with the psum_scatter spelled out: jax.checkpoint could
    not recompute through one, and remat must gather again.)"""
    if not eqx.is_inexact_array(leaf):
        return leaf
    if gathers:
        leaf = precision.for_reduction(leaf)
    for axes, dim in gathers:
        leaf = jax.lax.all_gather(leaf, axes[0] if len(axes) == 1 else axes, axis=dim, tiled=True)
    return precision.for_compute(leaf)


class GatherOnCall(eqx.Module):
    """A unit of the model holding its local slices, gathering them when it is called."""

    local: Any
    gathers: tuple = eqx.field(static=True)
    precision: Precision = eqx.field(static=True)
    remat: bool = eqx.field(static=True)

    def __call__(self, *args, **kwargs):
        def run(local, args, kwargs):
            leaves, treedef = jax.tree_util.tree_flatten(local)
            whole = [whole_leaf(x, g, self.precision) for x, g in zip(leaves, self.gathers)]
            return jax.tree_util.tree_unflatten(treedef, whole)(*args, **kwargs)

        if self.remat:
            # Keep nothing of this unit for the backward pass but its inputs: the backward
            # pass runs the unit again, gathering its weights again.
            run = eqx.filter_checkpoint(run, policy=jax.checkpoint_policies.nothing_saveable)
        return run(self.local, args, kwargs)


def _gather_on_call(node: Any, gathers: tuple, precision: Precision, remat: bool) -> Any:
    """A unit that gathers its weights when called. A `StackedLayers` unit gathers one
    layer at a time inside its scan (each layer's slice of a stacked array has the same
    split, one dimension down), so only one layer's whole weights are alive at once."""
    if isinstance(node, StackedLayers) and all(dim > 0 for g in gathers for _, dim in g):
        per_layer = tuple(tuple((axes, dim - 1) for axes, dim in g) for g in gathers)
        return eqx.tree_at(lambda s: s.layers, node, GatherOnCall(node.layers, per_layer, precision, remat))
    return GatherOnCall(node, gathers, precision, remat)


def _as_tuple(nodes):
    return tuple(nodes) if isinstance(nodes, (tuple, list)) else (nodes,)


def with_gathers(
    model: PyTree, gathers: list[Gathers], precision: Precision, units: Callable | None, remat: bool
) -> PyTree:
    """The model as the loss sees it: units gather (and cast) on call, every other leaf now."""
    leaves, treedef = jax.tree_util.tree_flatten(model)
    if not any(gathers) and precision.is_identity:
        return model
    in_unit = [False] * len(leaves)
    unit_ids: list[list[int]] = []
    if units is not None:
        ids = jax.tree_util.tree_unflatten(treedef, list(range(len(leaves))))
        for sub in _as_tuple(units(ids)):
            unit_ids.append(jax.tree.leaves(sub))
            for i in unit_ids[-1]:
                in_unit[i] = True
    merged = jax.tree_util.tree_unflatten(
        treedef, [x if u else whole_leaf(x, g, precision) for x, g, u in zip(leaves, gathers, in_unit)]
    )
    if units is None:
        return merged
    wrappers = [
        _gather_on_call(node, tuple(gathers[i] for i in ids_), precision, remat)
        for node, ids_ in zip(_as_tuple(units(merged)), unit_ids)
    ]
    return eqx.tree_at(lambda m: _as_tuple(units(m)), merged, wrappers)


def micro_batches(batch: PyTree, grad_accum: int) -> PyTree:
    """Split a (local) batch into `grad_accum` micro-batches, strided: row r goes to r % A.

    Strided, not contiguous, so that micro-batch k of the global batch (rows with index
    k mod A) is the same whatever the number of batch shards: each shard's rows start at a
    multiple of A.
    """

    def split(x):
        x = x.reshape(x.shape[0] // grad_accum, grad_accum, *x.shape[1:])
        return jnp.swapaxes(x, 0, 1)

    return jax.tree.map(split, batch)


def per_device_gradients(
    who: str,
    loss_fn: Callable,
    *,
    batch_axes: tuple[str, ...],
    key_axes: tuple[str, ...],
    share: float,
    grad_accum: int,
    has_state: bool,
    units: Callable | None,
    remat: bool,
    plans: list[LeafPlan | None],
    precision: Precision,
) -> Callable:
    """`fn(model, state, batch, key) -> (loss, grads, grad_sq_norm, state)`, to run under
    shard_map: `loss` is the global-batch mean, `grads` are summed over the batch axes and
    laid out as the parameters are, `grad_sq_norm` is the squared global gradient norm.
    The key is folded with the device's index over `key_axes` (the batch axes without the
    context axis: the parts of one sequence share a key, so a model can draw the whole
    sequence's dropout mask and take its own positions)."""
    gathers = [p.gathers if p else () for p in plans]

    def loss_share(params, static, state, batch, key):
        model = with_gathers(eqx.combine(params, static), gathers, precision, units, remat)
        batch = jax.tree.map(precision.for_compute, batch)
        args = (model, state, batch, key) if has_state else (model, batch, key)
        loss, state = checked_loss(loss_fn(*args), has_state, who)
        return loss.astype(jnp.float32) * share, state

    share_value_and_grad = jax.value_and_grad(loss_share, has_aux=True)

    def per_device(model, state, batch, key):
        if key is not None:
            key = jax.random.fold_in(key, jax.lax.axis_index(key_axes))
        params, static = eqx.partition(model, eqx.is_inexact_array)
        # This device's own copy of each leaf over the batch axes it is copied on, so that
        # its gradient holds this shard's contribution only. (Differentiating the
        # replicated leaf directly would make JAX sum the gradient over those axes inside
        # the backward pass: see the data-parallel docs on check_vma.)
        leaves, treedef = jax.tree_util.tree_flatten(params)
        live = [p for p in plans if p is not None]
        leaves = [jax.lax.pcast(x, p.copied, to="varying") if p.copied else x for x, p in zip(leaves, live)]
        params = jax.tree_util.tree_unflatten(treedef, leaves)
        if grad_accum == 1:
            record_saved_activations(lambda p: loss_share(p, static, state, batch, key), params, (state, batch, key))
            (loss, state), grads = share_value_and_grad(params, static, state, batch, key)
        else:

            def micro_step(carry, inputs):
                loss_sum, grad_sum, state = carry
                k, micro_batch = inputs
                micro_key = None if key is None else jax.random.fold_in(key, k)
                record_saved_activations(
                    lambda p: loss_share(p, static, state, micro_batch, micro_key),
                    params,
                    (state, micro_batch, micro_key),
                )
                (loss, state), grads = share_value_and_grad(params, static, state, micro_batch, micro_key)
                return (loss_sum + loss.astype(jnp.float32), jax.tree.map(jnp.add, grad_sum, grads), state), None

            zero_loss = jax.lax.pcast(jnp.zeros((), jnp.float32), batch_axes, to="varying")
            zero_grads = jax.tree.map(jnp.zeros_like, params)
            (loss, grads, state), _ = jax.lax.scan(
                micro_step, (zero_loss, zero_grads, state), (jnp.arange(grad_accum), micro_batches(batch, grad_accum))
            )
        loss, grads = _sum_over_copies(loss.astype(jnp.float32), grads, live, batch_axes, precision)
        return loss, grads, _global_sq_norm(grads, live), state

    return per_device


def _sum_over_copies(
    loss: Array, grads: PyTree, plans: list[LeafPlan], batch_axes: tuple[str, ...], precision: Precision
):
    """One psum per set of axes the leaves are copied on (in the reduce dtype); the loss
    rides with the leaves copied on every batch axis (data parallelism: a single combined
    all-reduce)."""
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    dtypes = [x.dtype for x in leaves]
    leaves = [precision.for_reduction(x) if p.copied else x for x, p in zip(leaves, plans)]
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, plan in enumerate(plans):
        if plan.copied:
            groups.setdefault(plan.copied, []).append(i)
    everywhere = groups.pop(batch_axes, [])
    loss, summed = jax.lax.psum((loss, [leaves[i] for i in everywhere]), batch_axes)
    for i, x in zip(everywhere, summed):
        leaves[i] = x
    for axes, ids in groups.items():
        for i, x in zip(ids, jax.lax.psum([leaves[i] for i in ids], axes)):
            leaves[i] = x
    leaves = [x.astype(d) for x, d in zip(leaves, dtypes)]
    return loss, jax.tree_util.tree_unflatten(treedef, leaves)


def _global_sq_norm(grads: PyTree, plans: list[LeafPlan]) -> Array:
    """Squared norm of a tree of per-device blocks: one psum per set of axes that split them."""
    by_axes: dict[tuple[str, ...], Array] = {}
    for leaf, plan in zip(jax.tree.leaves(grads), plans):
        by_axes[plan.split] = by_axes.get(plan.split, 0.0) + jnp.sum(jnp.square(leaf.astype(jnp.float32)))
    total = jnp.zeros((), jnp.float32)
    for axes, sq in by_axes.items():
        total = total + (jax.lax.psum(sq, axes) if axes else sq)
    return total
