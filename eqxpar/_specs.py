"""The one vocabulary for mesh axes and PartitionSpecs: every module asks here.

- An *axis argument* (`batch_axis`, `axis_name`) is a mesh axis name or a tuple of them:
  [`axis_names`][] normalises it, [`check_axes`][] checks it against a mesh.
- A spec's axes: [`entry_axes`][] for one entry, [`spec_axes`][] for a whole spec;
  [`pad_spec`][] gives one entry per dimension.
- Trees of specs: [`broadcast_specs`][] (a prefix tree to one spec per leaf),
  [`validate_spec`][] (one spec against one shape and a mesh), [`full_specs`][] (both).
- [`path_str`][] formats a leaf's path for error messages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import PyTree

AxisNames = str | Sequence[str]


def is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec) or x is None


def path_str(path) -> str:
    return jax.tree_util.keystr(path) or "<root>"


def broadcast_specs(specs: PyTree, tree: PyTree, *, what: str = "specs") -> list[PartitionSpec]:
    """One PartitionSpec per leaf of `tree`, from a prefix tree of specs.

    `specs` may be a single spec for the whole tree (`P()` replicates everything), a tree
    with the same structure as `tree` (a spec per leaf), or anything in between: each spec
    covers the subtree at its position. `None` in `specs` means replicated (`P()`).

    **Arguments:**

    - `specs`: a prefix tree of `PartitionSpec`s (or `None`).
    - `tree`: the PyTree the specs describe.
    - `what`: a name for `specs` used in error messages (e.g. `"in_specs"`).

    **Returns:**

    A list with one `PartitionSpec` per leaf of `tree`, in `jax.tree.leaves` order.

    **Raises:**

    - `ValueError` if `specs` is not a prefix of `tree`'s structure, naming the first place
      where they differ.
    """
    flat: list = []

    def collect(spec, subtree):
        flat.extend([spec] * len(jax.tree.leaves(subtree)))

    try:
        jax.tree.map(collect, specs, tree, is_leaf=is_spec)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"{what} does not match the structure of the PyTree it describes. Give one "
            f"PartitionSpec for the whole tree (e.g. P()), one per leaf (e.g. "
            f"jax.tree.map(lambda _: P(), tree)), or a prefix of the tree's structure. "
            f"JAX reported: {e}"
        ) from None
    return [PartitionSpec() if s is None else s for s in flat]


def entry_axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, (tuple, list)):
        return tuple(entry)
    return (entry,)


def validate_spec(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh, *, where: str) -> None:
    """Check that `spec` can split an array of `shape` over `mesh`.

    **Arguments:**

    - `spec`: the PartitionSpec for one array.
    - `shape`: the array's global shape.
    - `mesh`: the mesh whose axis names and sizes the spec refers to.
    - `where`: a description of the array for error messages (e.g. a leaf path).

    **Returns:**

    Nothing; raises if the spec does not fit.

    **Raises:**

    - `ValueError` for an axis name not in the mesh, a mesh axis used twice, a spec with
      more entries than the array has dimensions, or a dimension that the product of its
      axis sizes does not divide.
    """
    if len(spec) > len(shape):
        raise ValueError(
            f"{where}: PartitionSpec {spec} has {len(spec)} entries but the array has rank "
            f"{len(shape)} (shape {shape}). Give at most one entry per dimension."
        )
    seen: set[str] = set()
    for dim, entry in enumerate(spec):
        axes = entry_axes(entry)
        for axis in axes:
            if axis not in mesh.shape:
                raise ValueError(
                    f"{where}: PartitionSpec {spec} names axis {axis!r}, which is not in the "
                    f"mesh (its axes are {tuple(mesh.axis_names)}). Use one of those names "
                    f"or build the mesh with that axis."
                )
            if axis in seen:
                raise ValueError(
                    f"{where}: PartitionSpec {spec} uses mesh axis {axis!r} twice; each mesh "
                    f"axis can split at most one dimension."
                )
            seen.add(axis)
        parts = math.prod(mesh.shape[a] for a in axes)
        if shape[dim] % parts:
            sizes = " x ".join(f"{a}={mesh.shape[a]}" for a in axes)
            raise ValueError(
                f"{where}: dimension {dim} has size {shape[dim]}, which is not divisible by "
                f"{parts} ({sizes}) as PartitionSpec {spec} asks. Choose a size that is a "
                f"multiple of {parts}, or split that dimension over fewer devices."
            )


def spec_axes(spec: PartitionSpec) -> tuple[str, ...]:
    """Every mesh axis a spec uses, in order."""
    return tuple(a for entry in spec for a in entry_axes(entry))


def pad_spec(spec: PartitionSpec, ndim: int) -> list:
    """The spec's entries, one per dimension of a rank-`ndim` array (`None` for the rest)."""
    return list(spec) + [None] * (ndim - len(spec))


def axis_names(axes: AxisNames) -> tuple[str, ...]:
    """An axis argument (a name or a sequence of names) as a tuple of names."""
    return (axes,) if isinstance(axes, str) else tuple(axes)


def check_axes(mesh: Any, axes: Any, *, who: str, arg: str, role: str) -> int:
    """Check an axis argument against a mesh; return the product of the axes' sizes.

    **Arguments:**

    - `mesh`: what the user passed as the mesh.
    - `axes`: the axis argument (a name or a tuple of names).
    - `who`: the public function the user called, for the message (e.g. `"fsdp_step"`).
    - `arg`: the argument's name (e.g. `"batch_axis"`).
    - `role`: what the axis is for, in words (e.g. `"to split the batch over"`).

    **Raises:**

    - `ValueError` naming `who` and `arg` if `mesh` is not a Mesh, the argument is not a name
      or a tuple of names, names an axis twice, or names an axis the mesh lacks.
    """
    if not isinstance(mesh, Mesh):
        raise ValueError(
            f"{who}: mesh must be a jax.sharding.Mesh (e.g. eqxpar.make_mesh(data=8)), got {type(mesh).__name__}."
        )
    names = (
        ()
        if isinstance(axes, (bytes, type(None)))
        else axis_names(axes)
        if isinstance(axes, (str, tuple, list))
        else ()
    )
    if not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{who}: {arg} must be a mesh axis name or a tuple of names, got {axes!r}.")
    if len(set(names)) != len(names):
        raise ValueError(f"{who}: {arg}={axes!r} names an axis twice.")
    for name in names:
        if name not in mesh.shape:
            raise ValueError(
                f"{who}: the mesh has no axis named {name!r} {role} (its axes are "
                f"{tuple(mesh.axis_names)}). Build the mesh with that axis, e.g. "
                f"eqxpar.make_mesh({name}={mesh.size}), or pass {arg}=<one of {tuple(mesh.axis_names)}>."
            )
    return math.prod(mesh.shape[n] for n in names)


def full_specs(specs: PyTree, tree: PyTree, mesh: Mesh, *, what: str) -> PyTree[PartitionSpec]:
    """One validated spec per leaf of `tree`, as a tree with `tree`'s structure.

    **Arguments:**

    - `specs`: a prefix tree of specs for `tree` (see [`broadcast_specs`][]).
    - `tree`: the PyTree they describe (global shapes).
    - `mesh`: the mesh the specs refer to.
    - `what`: the argument's name, for messages (e.g. `"param_specs"`).

    **Returns:**

    A tree with the structure of `tree` and a `PartitionSpec` at every leaf.

    **Raises:**

    - `ValueError` as [`broadcast_specs`][] and [`validate_spec`][] do, naming the leaf.
    """
    flat = broadcast_specs(specs, tree, what=what)
    for (path, leaf), spec in zip(jax.tree_util.tree_flatten_with_path(tree)[0], flat):
        if eqx.is_array(leaf):
            validate_spec(spec, tuple(leaf.shape), mesh, where=f"{what} at {path_str(path)}")
    return jax.tree_util.tree_unflatten(jax.tree.structure(tree), flat)
