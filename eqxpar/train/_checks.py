"""The checks every step builder shares; each message names the builder the user called."""

from __future__ import annotations

import inspect
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array, PyTree

from .._specs import AxisNames, axis_names, check_axes, path_str
from ..nn import MixtureOfExperts, StackedLayers, TensorParallelLayer
from ..nn._plan import stacked_weight


def check_builder(
    who: str, loss_fn: Any, optimizer: Any, mesh: Any, batch_axis: Any, grad_accum: Any, has_state: Any
) -> int:
    """Check a builder's common arguments at once; return the number of batch shards."""
    n_batch = check_axes(mesh, batch_axis, who=who, arg="batch_axis", role="to split the batch over")
    if not isinstance(grad_accum, int) or isinstance(grad_accum, bool) or grad_accum < 1:
        raise ValueError(f"{who}: grad_accum must be a positive integer, got {grad_accum!r}.")
    if not isinstance(has_state, bool):
        raise ValueError(f"{who}: has_state must be True or False, got {has_state!r}.")
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise ValueError(
            f"{who}: optimizer must be an optax GradientTransformation (with init and update), "
            f"got {type(optimizer).__name__}. Pass e.g. optax.adamw(3e-4)."
        )
    check_loss_signature(who, loss_fn, has_state)
    return n_batch


def check_loss_signature(who: str, loss_fn: Any, has_state: bool) -> None:
    """`loss_fn` must take (model, batch, key), or (model, state, batch, key) with state."""
    if not callable(loss_fn):
        raise ValueError(f"{who}: loss_fn must be callable, got {type(loss_fn).__name__}.")
    params = "(model, state, batch, key)" if has_state else "(model, batch, key)"
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # builtins and some C callables have none
        return
    try:
        signature.bind(*([None] * (4 if has_state else 3)))
    except TypeError:
        raise ValueError(
            f"{who}: loss_fn{signature} cannot be called as loss_fn{params}; the step passes "
            f"{'the state and ' if has_state else ''}this device's PRNG key (None when the step is "
            f"called without one). Add the parameter, e.g. def loss_fn{params[:-4]}key=None): ..."
        ) from None


def global_batch_size(batch: PyTree, who: str) -> int:
    """The common leading dimension of the batch's arrays, or a ValueError."""
    sizes = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        if not eqx.is_array(leaf):
            continue
        if leaf.ndim == 0:
            raise ValueError(
                f"{who}: batch leaf {path_str(path)} is a scalar; every array in the batch "
                f"needs a leading batch dimension to split over the batch axis."
            )
        sizes[path_str(path)] = leaf.shape[0]
    if not sizes:
        raise ValueError(f"{who}: the batch holds no arrays.")
    if len(set(sizes.values())) > 1:
        raise ValueError(
            f"{who}: the batch's arrays have different leading (batch) sizes {sizes}; they "
            f"must all have the same global batch size."
        )
    return next(iter(sizes.values()))


def check_batch_divides(
    batch: PyTree, who: str, n_batch: int, grad_accum: int, batch_axis: Any, accum_name: str = "grad_accum"
) -> None:
    """The global batch splits into the batch shards times the micro-batches (`accum_name`:
    the builder's own word for them, `grad_accum` or the pipeline's `microbatches`)."""
    size = global_batch_size(batch, who)
    if size % (n_batch * grad_accum):
        raise ValueError(
            f"{who}: the global batch size {size} is not divisible by the {n_batch} shards "
            f"of batch axis {batch_axis!r} times {accum_name}={grad_accum} (= "
            f"{n_batch * grad_accum}). Use a batch size that is a multiple of {n_batch * grad_accum}."
        )


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


def _modules(tree: Any, path: tuple = ()) -> Any:
    """Every node of `tree` with its key path, not looking inside tensor-parallel layers."""
    yield path, tree
    if isinstance(tree, TensorParallelLayer):
        return
    kids = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is not tree)[0]
    if len(kids) == 1 and kids[0][1] is tree:
        return
    for key, child in kids:
        yield from _modules(child, path + key)


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
    for path, layer in _modules(model):
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
        found = None if isinstance(node, StackedLayers) else stacked_weight(node)
        if found is None:
            continue
        where = next((jax.tree_util.keystr(p) for p, n in _modules(model) if n is node), f"units(model)[{i}]")
        raise ValueError(
            f"{who}: units names model{where}, layers stacked with eqx.filter_vmap: its "
            f"{found[0]} has shape {found[1]}, with a layer axis in front. A unit is gathered "
            f"when it is called, and a lax.scan over the stack never calls it whole. Name the "
            f"layers one by one (keep them in a list: units=lambda m: tuple(m.blocks)), stack "
            f"them with eqxpar.nn.StackedLayers (whose scan gathers one layer at a time), or "
            f"leave units out (the stack is then gathered whole)."
        )


def checked_loss(value: Any, has_state: bool, who: str) -> tuple[Array, Any]:
    """`(loss, state)` from what the user's loss returned; ValueError if it is not a scalar."""
    state = None
    if has_state:
        if not (isinstance(value, tuple) and len(value) == 2):
            raise ValueError(
                f"{who}(has_state=True): loss_fn must return a pair (loss, state), got {type(value).__name__}."
            )
        value, state = value
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape != () or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"{who}: loss_fn must return a scalar floating-point loss (the mean over its "
            f"shard of the batch), got {type(value).__name__} with shape {shape} and dtype "
            f"{dtype}. Reduce it, e.g. return per_example_loss.mean()."
        )
    return value, state


def context_split(who: str, mesh: Mesh, batch_axis: AxisNames, context_axis: str | None) -> tuple[int, PartitionSpec]:
    """The context axis size and the batch's spec: `P(batch_axis)`, or `P(batch_axis,
    context_axis)` with the sequence (dimension 1) split over the context axis."""
    if context_axis is None:
        return 1, PartitionSpec(batch_axis)
    if not isinstance(context_axis, str):
        raise ValueError(f"{who}: context_axis must be one mesh axis name (a str) or None, got {context_axis!r}.")
    n_context = check_axes(mesh, context_axis, who=who, arg="context_axis", role="to split the sequence over")
    if context_axis in axis_names(batch_axis):
        raise ValueError(
            f"{who}: context_axis {context_axis!r} is also in batch_axis {batch_axis!r}; the batch "
            f"(dimension 0) and the sequence (dimension 1) need different mesh axes."
        )
    return n_context, PartitionSpec(batch_axis, context_axis)


def check_sequence_divides(batch: PyTree, who: str, n_context: int, context_axis: str) -> None:
    """With a context axis: every batch array is `(batch, seq, ...)` with `seq` divisible by
    the context shards (checked while tracing, before anything compiles)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        if eqx.is_array(leaf) and (leaf.ndim < 2 or leaf.shape[1] % n_context):
            raise ValueError(
                f"{who}: batch leaf {jax.tree_util.keystr(path)} has shape {leaf.shape}; with "
                f"context_axis={context_axis!r} every batch array is (batch, seq, ...) with seq "
                f"divisible by the {n_context} context shards."
            )


def _mesh_axes_text(mesh: Mesh) -> str:
    return ", ".join(f"{name}={size}" for name, size in mesh.shape.items()) or "none"


def check_model_axes(
    model: PyTree, mesh: Mesh, who: str, context_axis: str | None, *, splits_sequences: bool = True
) -> None:
    """The mesh axes the model's layers name must exist, before anything traces: each
    tensor-parallel layer's model axis must be on the mesh, and a context-parallel attention
    (`attention_impl` `"ring"` or `"all_gather"`) needs the step to split every sequence over
    its context axis (`context_axis=`). Else, inside the step, JAX's `NameError: unbound axis
    name` (or an out_specs error) with no word of which layer or which fix."""

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
                    f"{axis!r} axis (its axes: {_mesh_axes_text(mesh)}). Add the axis to the mesh, "
                    f"e.g. eqxpar.make_mesh(data=..., {axis}=1) (size 1 runs the layer densely; "
                    f"larger splits it: train with eqxpar.train.hybrid_step or fsdp_step), or build "
                    f"the model with axis_name= one of the mesh's axes."
                )
            impl = getattr(node, "attention_impl", None)
            ring = getattr(node, "context_axis", None)
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
                else f" on a mesh with that axis (the mesh's axes: {_mesh_axes_text(mesh)}; e.g. "
                f"eqxpar.make_mesh(data=..., {ring}=2, ...))"
            )
            raise ValueError(
                f"{why}but the step splits no sequences. Build the step with context_axis={ring!r}"
                f"{on_mesh}, or the model with attention_impl='dot_product' to keep whole "
                f"sequences on each device."
            )


def _closure_masks(fn: Any, seen: set, depth: int = 0) -> list:
    """The `mask` arguments of the optax.masked transformations (optax.adamw(mask=...),
    optax.masked(...)) inside an optimizer's `init`, found through the closures."""
    if depth > 12 or id(fn) in seen:
        return []
    seen.add(id(fn))
    if hasattr(fn, "init") and hasattr(fn, "update") and not inspect.isfunction(fn):
        return _closure_masks(fn.init, seen, depth + 1)
    if isinstance(fn, (tuple, list)):
        return [m for f in fn for m in _closure_masks(f, seen, depth + 1)]
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or not cells:
        return []
    found = []
    for name, cell in zip(code.co_freevars, cells):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if name == "mask" and value is not None:
            found.append(value)
        elif callable(value) or isinstance(value, (tuple, list)):
            found.extend(_closure_masks(value, seen, depth + 1))
    return found


def _mask_mismatch(mask: PyTree, params: PyTree) -> str | None:
    """Where a mask (the params' structure, or a prefix of it) does not fit `params`."""
    mask_paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(mask)[0]]
    param_paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]

    def covered(path) -> bool:
        return any(path[: len(m)] == m for m in mask_paths)

    for path in param_paths:
        if not covered(path):
            return f"the model's parameter model{path_str(path)} has no entry in the mask"
    for m in mask_paths:
        if not any(p[: len(m)] == m for p in param_paths):
            return f"the mask has an entry at {path_str(m)}, where the model has no parameter"
    if jax.tree.structure(mask) != jax.tree.structure(params):
        try:
            jax.tree.map(lambda _m, _p: None, mask, params)
        except (ValueError, TypeError) as error:
            first = str(error).strip().splitlines()[0]
            return f"the mask's structure differs from the model's ({first} ...)"
    return None


def check_optimizer_fits(who: str, optimizer: Any, model: PyTree) -> None:
    """`optimizer.init` must accept the model's parameters, checked abstractly (nothing
    compiles): a weight-decay mask (`optax.adamw(mask=...)`, `optax.masked`) made for
    another model would otherwise fail with a bare pytree error after the model was
    placed and compiled pieces of it."""
    params = eqx.filter(model, eqx.is_inexact_array)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    try:
        jax.eval_shape(optimizer.init, abstract)
    except (ValueError, TypeError) as error:
        fix = (
            "Build the mask from the parameters the step trains, e.g. "
            "optax.adamw(lr, mask=lambda params: jax.tree.map(lambda x: x.ndim > 1, params)) "
            "(a function of the parameters always fits), or a tree made from "
            "eqx.filter(model, eqx.is_inexact_array) of this model."
        )
        for mask in _closure_masks(optimizer, set()):
            leaves = jax.tree.leaves(jax.tree.map(callable, mask))
            tree = mask(abstract) if leaves and all(leaves) else mask  # as optax.masked decides
            where = _mask_mismatch(tree, abstract)
            if where is not None:
                raise ValueError(
                    f"{who}: the optimizer's weight-decay mask does not fit the model: {where}. "
                    f"A mask must have the structure of the model's floating-point parameters "
                    f"(eqx.filter(model, eqx.is_inexact_array)) or a prefix of it. {fix}"
                ) from None
        first = str(error).strip().splitlines()[0]
        raise ValueError(
            f"{who}: optimizer.init fails on the model's parameters (eqx.filter(model, "
            f"eqx.is_inexact_array)), so the optimizer does not fit this model: "
            f"{type(error).__name__}: {first}. Any tree the optimizer was built with (a mask, "
            f"per-parameter learning rates, optax.multi_transform labels) must have the "
            f"parameters' structure. {fix}"
        ) from error


def expert_batch_axes(who: str, mesh: Any, batch_axis: Any, expert_axis: Any) -> Any:
    """The axes the step splits the batch over: `batch_axis`, and after it `expert_axis`
    (expert parallelism carries data: each device of the expert axis routes its own
    tokens). A `ValueError` naming the fix for an expert axis that is not one mesh axis
    apart from the batch axes."""
    if expert_axis is None:
        return batch_axis
    if not isinstance(expert_axis, str):
        raise ValueError(f"{who}: expert_axis must be one mesh axis name (a str) or None, got {expert_axis!r}.")
    if isinstance(mesh, Mesh) and expert_axis not in mesh.shape:
        sizes = ", ".join(f"{n}={s}" for n, s in mesh.shape.items())
        raise ValueError(
            f"{who}: expert_axis={expert_axis!r}, but the mesh has no {expert_axis!r} axis (its axes: "
            f"{sizes}). Build the mesh with it, e.g. eqxpar.make_mesh(data=2, {expert_axis}=4), or pass "
            f"expert_axis=None to train without expert parallelism."
        )
    names = axis_names(batch_axis) if isinstance(batch_axis, (str, tuple, list)) else ()
    if expert_axis in names:
        rest = tuple(n for n in names if n != expert_axis)
        raise ValueError(
            f"{who}: expert_axis={expert_axis!r} is also in batch_axis={batch_axis!r}; the step splits "
            f"the batch over the expert axis itself (after the batch axes). Pass batch_axis="
            f"{(rest[0] if len(rest) == 1 else rest)!r} and expert_axis={expert_axis!r}."
        )
    return (*names, expert_axis) if names else batch_axis


def _moe_layers(model: PyTree):
    """Every `MixtureOfExperts` in the model, with its path."""
    for path, node in _modules(model):
        if isinstance(node, MixtureOfExperts):
            yield jax.tree_util.keystr(path), node
        elif isinstance(node, TensorParallelLayer):
            found = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda n: isinstance(n, MixtureOfExperts))[0]
            for sub_path, sub in found:
                if isinstance(sub, MixtureOfExperts):
                    yield jax.tree_util.keystr(path + sub_path), sub


def check_experts(model: PyTree, mesh: Mesh, who: str, expert_axis: str | None, batch_axes: tuple[str, ...]) -> None:
    """Every mixture-of-experts layer must be split over the step's expert axis (or, without
    one, over an axis that holds no part of the batch), on the mesh, its experts divisible
    by the axis size: checked before anything traces, not an error inside the step."""
    for where, layer in _moe_layers(model):
        at = f"the MixtureOfExperts at model{where}"
        axis = layer.axis_name
        if axis not in mesh.shape:
            raise ValueError(
                f"{who}: {at} splits its experts over the mesh axis {axis!r}, but the mesh has no "
                f"{axis!r} axis (its axes: {_mesh_axes_text(mesh)}). Add it to the mesh, e.g. "
                f"eqxpar.make_mesh(data=2, {axis}=4) (size 1 keeps every expert on each device), and "
                f"build the step with expert_axis={axis!r}."
            )
        if expert_axis is not None and axis != expert_axis:
            raise ValueError(
                f"{who}: {at} splits its experts over {axis!r}, but the step's expert_axis is "
                f"{expert_axis!r}. Build the layer with axis_name={expert_axis!r}, or the step with "
                f"expert_axis={axis!r}."
            )
        if expert_axis is None and axis in batch_axes:
            raise ValueError(
                f"{who}: {at} splits its experts over {axis!r}, which is also a batch axis of the "
                f"step: the step would gather every expert onto each device. Build the step with "
                f"expert_axis={axis!r} and the batch axes without it."
            )
        try:
            layer.check_axis_size(mesh.shape[axis], f"model{where}")
        except ValueError as error:
            raise ValueError(f"{who}: {error}") from None
