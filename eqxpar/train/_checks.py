"""The checks every step builder shares; each message names the builder the user called.

This module checks the builder's own arguments and the batch; the model's layers against
the mesh are checked in `_checks_model.py`, its mixtures of experts in
`_checks_experts.py`, the optimizer against the model in `_checks_optimizer.py`."""

from __future__ import annotations

import inspect
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array, PyTree

from .._specs import AxisNames, axis_names, check_axes, path_str


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
