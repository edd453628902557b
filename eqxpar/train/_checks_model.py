"""The model's layers against the mesh and the step, checked before anything traces: batch
norms over the batch axes, FSDP units, the axes tensor-parallel and context-parallel layers
name (see `_checks.py`)."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
from jax.sharding import Mesh
from jaxtyping import PyTree

from .._specs import axis_names
from ..nn import StackedLayers, TensorParallelLayer, stacked_weight


def _reduced_axes(node: Any) -> tuple[str, ...] | None:
    """The axis names a layer reduces over, if it is one that names them: an `axis_name`
    field holding a name or a tuple of names (None for any other node)."""
    if not isinstance(node, eqx.Module) or isinstance(node, TensorParallelLayer):
        return None
    names = getattr(node, "axis_name", None)
    if isinstance(names, str):
        return (names,)
    if isinstance(names, (tuple, list)) and names and all(isinstance(n, str) for n in names):
        return tuple(names)
    return None


def model_nodes(tree: Any, path: tuple = ()) -> Any:
    """Every node of `tree` with its key path, not looking inside tensor-parallel layers."""
    yield path, tree
    if isinstance(tree, TensorParallelLayer):
        return
    kids = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)[0]
    if len(kids) == 1 and kids[0][1] is tree:
        return
    for key, child in kids:
        yield from model_nodes(child, path + key)


def _holds_state(node: Any) -> bool:
    is_index = lambda x: isinstance(x, eqx.nn.StateIndex)  # noqa: E731
    return any(is_index(x) for x in jax.tree.leaves(node, is_leaf=is_index))


def check_batch_norms(model: PyTree, batch_axis: Any, who: str, mesh_axes: tuple[str, ...] = ()) -> None:
    """Every layer that takes statistics over the batch must take them over the batch axes
    too, or each device normalises by its own shard's statistics (gradients off, 130x in
    issue 20's case) and its running statistics diverge from the other devices'.

    Such a layer is found by what it does, not by its class (`eqx.nn.BatchNorm` and any
    user's or library's batch norm alike): an Equinox Module (not a tensor-parallel layer)
    with an `axis_name` field naming the axes it reduces over, that either keeps state
    (holds an `eqx.nn.StateIndex`: running statistics) or names an axis that is not on the
    mesh (only the loss's own `vmap` binds such an axis, so the layer reduces over the
    examples of the batch). Layers that name only mesh axes and keep no state (a
    tensor-parallel layer of one's own over `model`) reduce over something else and pass.
    """
    batch = axis_names(batch_axis)
    for path, layer in model_nodes(model):
        names = _reduced_axes(layer)
        if names is None or not (_holds_state(layer) or any(n not in mesh_axes for n in names)):
            continue
        missing = [a for a in batch if a not in names]
        if missing:
            kind = type(layer).__name__
            raise ValueError(
                f"{who}: the {kind} at model{jax.tree_util.keystr(path)} has "
                f"axis_name={layer.axis_name!r}, which lacks the batch axis {missing[0]!r}: it "
                f"reduces over the examples of the batch (it keeps running statistics or reduces "
                f"over a vmap axis), so its statistics would cover one device's shard only, the "
                f"gradients would be wrong and the running statistics would differ between "
                f"devices. Give it both the vmap axis and the batch axis, e.g. "
                f"{kind}(..., axis_name=({names[0]!r}, {missing[0]!r}))."
            )


def check_units(model: PyTree, units: Any, who: str) -> None:
    """Each FSDP unit is gathered when it is called; layers stacked with `eqx.filter_vmap`
    (a layer axis in front of every array, run with `lax.scan`) are never called as a
    whole, and gathering them on call failed with "axis 1 is out of bounds"."""
    picked = units(model)
    for i, node in enumerate(picked if isinstance(picked, (tuple, list)) else (picked,)):

        def where(node=node, i=i) -> str:  # only on the way to an error: it walks the model
            return next((jax.tree_util.keystr(p) for p, n in model_nodes(model) if n is node), f"units(model)[{i}]")

        if (layers := _beside_a_stack(model, node)) is not None:
            raise ValueError(
                f"{who}: units names model{where()}, a {type(node).__name__} of your own inside layers "
                f"stacked with eqx.filter_vmap (every array with a leading axis of {layers} layers, "
                f"like the eqxpar.nn layers beside it): only eqxpar's stacked layers gather one "
                f"layer at a time inside the model's scan. Leave it out of units: it is then "
                f"gathered whole once per step, with the other parameters outside units."
            )
        found = None if isinstance(node, StackedLayers) else stacked_weight(node)
        if found is None:
            continue
        raise ValueError(
            f"{who}: units names model{where()}, layers stacked with eqx.filter_vmap: its "
            f"{found[0]} has shape {found[1]}, with a layer axis in front. A unit is gathered "
            f"when it is called, and a lax.scan over the stack never calls it whole. Name the "
            f"layers one by one (keep them in a list: units=lambda m: tuple(m.blocks)), stack "
            f"them with eqxpar.nn.StackedLayers (whose scan gathers one layer at a time), or "
            f"leave units out (the stack is then gathered whole)."
        )


def _beside_a_stack(model: PyTree, node: Any) -> int | None:
    """The layer count when `node`, not one of eqxpar's layers, sits in a module next to
    eqxpar's stacked layers of that many layers (a filter_vmap stack made tensor-parallel
    by `parallelize`) and every array of it leads with that count; else None."""
    if isinstance(node, TensorParallelLayer) or not isinstance(node, eqx.Module):
        return None
    if any(isinstance(x, StackedLayers) for x in jax.tree.leaves(node, is_leaf=lambda x: isinstance(x, StackedLayers))):
        return None  # it holds the stack itself (its own message, below)
    leading = {x.shape[0] if x.ndim else -1 for x in jax.tree.leaves(eqx.filter(node, eqx.is_array))}
    for _, parent in model_nodes(model):
        kids = jax.tree_util.tree_leaves(parent, is_leaf=lambda x, p=parent: x is not p and isinstance(x, eqx.Module))
        if not any(kid is node for kid in kids):
            continue
        stacks = jax.tree_util.tree_leaves(parent, is_leaf=lambda x: isinstance(x, StackedLayers))
        sizes = {s.num_layers for s in stacks if isinstance(s, StackedLayers)}
        if len(sizes) == 1 and leading == sizes:
            return sizes.pop()
    return None


def mesh_axes_text(mesh: Mesh) -> str:
    return ", ".join(f"{name}={size}" for name, size in mesh.shape.items()) or "none"


def check_model_axes(
    model: PyTree, mesh: Mesh, who: str, context_axis: str | None, *, splits_sequences: bool = True
) -> None:
    """The mesh axes the model's layers name must exist, before anything traces: each
    tensor-parallel layer's model axis must be on the mesh, a context-parallel attention
    (`attention_impl` `"ring"` or `"all_gather"`) needs the step to split every sequence over
    its context axis (`context_axis=`), and a step that splits sequences needs every
    attention that says how it attends to be context-parallel (any other sees only its
    device's part of each sequence, and would train silently wrong). Else, inside the
    step, JAX's `NameError: unbound axis name` (or an out_specs error) with no word of
    which layer or which fix, or no error at all."""

    def layers(node, where):
        yield where, node
        for path, sub in jax.tree_util.tree_flatten_with_path(
            node, is_leaf=lambda n: n is not node and isinstance(n, TensorParallelLayer)
        )[0]:
            if isinstance(sub, TensorParallelLayer):
                yield from layers(sub, where + jax.tree_util.keystr(path))

    top = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda n: isinstance(n, TensorParallelLayer))[0]
    names = tuple(mesh.axis_names)
    for path, layer in top:
        if not isinstance(layer, TensorParallelLayer):
            continue
        for where, node in layers(layer, jax.tree_util.keystr(path)):
            at = f"the {type(node).__name__} at model{where}" if where else f"the model ({type(node).__name__})"
            axis = node.axis_name
            if isinstance(axis, str) and axis not in names:
                raise ValueError(
                    f"{who}: {at} is split over the model axis {axis!r}, but the mesh has no "
                    f"{axis!r} axis (its axes: {mesh_axes_text(mesh)}). Add the axis to the mesh, "
                    f"e.g. eqxpar.make_mesh(data=..., {axis}=1) (size 1 runs the layer densely; "
                    f"larger splits it: train with eqxpar.train.hybrid_step or fsdp_step), or build "
                    f"the model with axis_name= one of the mesh's axes."
                )
            impl = getattr(node, "attention_impl", None)
            ring = getattr(node, "context_axis", None)
            if context_axis is not None and isinstance(impl, str) and impl not in ("ring", "all_gather"):
                raise ValueError(
                    f"{who}: {at} has attention_impl={impl!r}, which attends within each device's "
                    f"part of a sequence only, but the step splits every sequence over "
                    f"context_axis={context_axis!r}: no token would see the other parts. Build the "
                    f"model with attention_impl='ring' (or 'all_gather') to attend across the "
                    f"context axis, or the step without context_axis."
                )
            if impl not in ("ring", "all_gather") or not isinstance(ring, str) or ring == context_axis:
                continue
            why = (
                f"{who}: {at} has attention_impl={impl!r}, which attends over sequences split "
                f"over the mesh axis {ring!r} (context parallelism), "
            )
            if context_axis is not None:
                raise ValueError(
                    f"{why}but the step splits them over context_axis={context_axis!r}. Build the "
                    f"step with context_axis={ring!r}, or the attention with context_axis={context_axis!r}."
                )
            if not splits_sequences:
                raise ValueError(
                    f"{why}but {who} keeps whole sequences on each device (it has no context_axis). "
                    f"Build the model with attention_impl='dot_product' (or 'reference') to train it here."
                )
            on_mesh = (
                ""
                if ring in names
                else f" on a mesh with that axis (the mesh's axes: {mesh_axes_text(mesh)}; e.g. "
                f"eqxpar.make_mesh(data=..., {ring}=2, ...))"
            )
            raise ValueError(
                f"{why}but the step splits no sequences. Build the step with context_axis={ring!r}"
                f"{on_mesh}, or the model with attention_impl='dot_product' to keep whole "
                f"sequences on each device."
            )
