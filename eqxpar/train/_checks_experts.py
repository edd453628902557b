"""Mixture-of-experts layers against the step's expert axis and the mesh, checked before
anything traces (see `_checks.py`)."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh
from jaxtyping import PyTree

from .._specs import axis_names
from ..nn import MixtureOfExperts, TensorParallelLayer
from ._checks_model import mesh_axes_text, model_nodes


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


def moe_layers(model: PyTree):
    """Every `MixtureOfExperts` in the model, with its path."""
    for path, node in model_nodes(model):
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
    for where, layer in moe_layers(model):
        at = f"the MixtureOfExperts at model{where}"
        axis = layer.axis_name
        if axis not in mesh.shape:
            raise ValueError(
                f"{who}: {at} splits its experts over the mesh axis {axis!r}, but the mesh has no "
                f"{axis!r} axis (its axes: {mesh_axes_text(mesh)}). Add it to the mesh, e.g. "
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
