"""`filter_shard_map`: `jax.shard_map` for PyTrees that hold more than arrays."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.core
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from ._compat import forget_traced_constants
from ._specs import broadcast_specs, is_spec, path_str, spec_axes, validate_spec

__all__ = ["filter_shard_map"]


def filter_shard_map(
    fn: Callable[..., Any] | None = None,
    *,
    mesh: Mesh,
    in_specs: PyTree,
    out_specs: PyTree,
    check_vma: bool = True,
) -> Callable[..., Any]:
    """`jax.shard_map` that accepts Equinox Modules and other mixed PyTrees.

    Array leaves of the arguments are mapped over the mesh as their spec says; every other
    leaf (activation functions, Python numbers, strings, static fields) is closed over
    unchanged, as `eqx.filter_jit` does. The same holds for the outputs: a function may
    return a Module, and its non-array leaves come back as they were.

    Inside `fn` each array is the local block of its device, and collectives
    (`jax.lax.psum`, `pmean`, `all_gather`, ...) over the mesh's axis names are explicit.
    `check_vma=True` (the default, as in `jax.shard_map`) makes JAX track which values vary
    over which axes; see the data-parallel docs for what that means for gradients.

    Usable directly or as a decorator:
    `filter_shard_map(f, mesh=m, in_specs=..., out_specs=...)` or
    `@functools.partial(filter_shard_map, mesh=m, in_specs=..., out_specs=...)`.

    **Arguments:**

    - `fn`: the per-device function. Positional arguments only.
    - `mesh`: the device mesh.
    - `in_specs`: a tuple with one entry per positional argument, each a prefix tree of
      `PartitionSpec`s for that argument (`P()` replicates it, `P("data")` splits its
      arrays' leading dimension over `data`, a Module-shaped tree gives a spec per leaf).
      `None` is the same as `P()`. Specs at non-array leaves are ignored.
    - `out_specs`: a prefix tree of `PartitionSpec`s for the output, in the same way
      (`None` is `P()`; specs at non-array leaves of the output are ignored). An output
      whose spec splits a dimension over axes is the devices' blocks joined along it; an
      axis missing from an output's spec means every device returns the same value.
    - `check_vma`: passed to `jax.shard_map`.

    **Returns:**

    A function with the same signature as `fn` that runs it on every device of `mesh` and
    assembles the global outputs.

    **Raises:**

    - `ValueError`, here, if a spec in `out_specs` names an axis the mesh lacks or uses an
      axis twice.
    - `ValueError`, when called and before anything is traced, if `in_specs` does not match
      the arguments, a spec names an axis the mesh lacks, has more entries than an array's
      rank, or splits a dimension not divisible by its axis sizes; or, on a mesh with
      Explicit axes, an input already placed with a different sharding than its spec.
    - `ValueError`, once `fn` is traced and before anything is compiled, naming the output
      leaf, if `out_specs` does not match the structure of the output, a spec has more
      entries than its output's rank, or (with `check_vma`) a spec leaves out an axis the
      output varies over.
    """
    if fn is None:
        return functools.partial(
            filter_shard_map,
            mesh=mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            check_vma=check_vma,
        )
    if not isinstance(mesh, Mesh):
        raise ValueError(f"filter_shard_map: mesh must be a jax.sharding.Mesh, got {type(mesh)}.")
    out_specs, jax_out_specs = _check_out_specs(out_specs, mesh)

    def mapped(*args, **kwargs):
        if kwargs:
            raise ValueError(
                f"filter_shard_map: pass arguments positionally (got keywords "
                f"{sorted(kwargs)}); in_specs has one entry per positional argument."
            )
        specs = in_specs
        if not isinstance(specs, tuple):
            if len(args) != 1:
                raise ValueError(
                    f"filter_shard_map: in_specs must be a tuple with one entry per "
                    f"positional argument ({len(args)} given), e.g. (P(), P('data'))."
                )
            specs = (specs,)
        if len(specs) != len(args):
            raise ValueError(
                f"filter_shard_map: in_specs has {len(specs)} entries but the function was "
                f"called with {len(args)} positional arguments; give one spec tree per "
                f"argument."
            )
        flat_specs = broadcast_specs(specs, args, what="in_specs")
        leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(args)
        explicit = any(t == AxisType.Explicit for t in mesh.axis_types)
        dyn_specs = []
        for (path, leaf), spec in zip(leaves_with_path, flat_specs):
            if not eqx.is_array(leaf):
                dyn_specs.append(None)
                continue
            where = f"in_specs for argument {path_str(path)}"
            validate_spec(spec, tuple(leaf.shape), mesh, where=where)
            if explicit:
                _check_explicit_placement(leaf, spec, mesh, where)
            dyn_specs.append(spec)
        dynamic, static = eqx.partition(args, eqx.is_array)
        dynamic_specs = jax.tree.unflatten(treedef, dyn_specs)

        static_out = []

        def per_device(dyn):
            # Tables Equinox caches while tracing here would carry this mesh into other traces.
            forget_traced_constants()
            try:
                out = fn(*eqx.combine(dyn, static))
            finally:
                forget_traced_constants()
            out_dyn, out_static = eqx.partition(out, eqx.is_array)
            _check_outputs(out_specs, out_dyn, mesh, check_vma)
            static_out.append(out_static)
            return out_dyn

        try:
            out_dyn = jax.shard_map(
                per_device,
                mesh=mesh,
                in_specs=(dynamic_specs,),
                out_specs=jax_out_specs,
                check_vma=check_vma,
            )(dynamic)
        except ValueError as e:
            # What the checks above did not foresee (e.g. a JAX version that tracks varying
            # axes differently): JAX's words, with the fix.
            if "out_specs" not in str(e) or str(e).startswith("filter_shard_map"):
                raise
            raise ValueError(
                f"filter_shard_map: out_specs do not fit what the function returns. Give one "
                f"PartitionSpec per output array (or a prefix tree of them) that names every "
                f"mesh axis the output varies over (reduce it first with jax.lax.psum/pmean "
                f"to return one value for all devices). JAX reported: {e}"
            ) from None
        return eqx.combine(out_dyn, static_out[-1])

    # Name and docstring only: copying `fn`'s attributes (functools.wraps) would hand an
    # Equinox transform's internals (e.g. of eqx.filter_grad) to eqx.filter_jit, which then
    # warns that a JAX-transformed callable is stored on it.
    mapped.__name__ = getattr(fn, "__name__", "filter_shard_map")
    mapped.__qualname__ = getattr(fn, "__qualname__", mapped.__name__)
    mapped.__doc__ = getattr(fn, "__doc__", None)
    return mapped


def _check_explicit_placement(leaf, spec: PartitionSpec, mesh: Mesh, where: str) -> None:
    """On Explicit meshes shard_map refuses mismatched inputs; say which leaf and the fix."""
    sharding = getattr(leaf, "sharding", None)
    if isinstance(leaf, jax.core.Tracer):
        sharding = getattr(getattr(leaf, "aval", None), "sharding", None)
    # An array not placed on a mesh (a NumPy array, or one on a single device) counts as
    # replicated, which is what shard_map takes it for.
    have = getattr(sharding, "spec", None) or PartitionSpec()
    want = NamedSharding(mesh, spec)
    ndim = len(leaf.shape)
    if tuple(want.spec) + (None,) * (ndim - len(want.spec)) != tuple(have) + (None,) * (ndim - len(have)):
        raise ValueError(
            f"{where}: the mesh has Explicit axes, so the input must already be laid out as "
            f"{spec}, but it is laid out as {have}. Place it first with "
            f"eqxpar.shard(x, mesh, {spec}) (or jax.device_put / jax.reshard), or build the "
            f"mesh with eqxpar.make_mesh(..., axis_type='auto')."
        )


def _check_out_specs(out_specs: PyTree, mesh: Mesh) -> tuple[PyTree, PyTree]:
    """Check `out_specs` against the mesh; return it with `None` as `P()`, and JAX's copy.

    JAX's copy also has `P()` where the user's has something other than a spec (allowed at
    non-array output leaves; `_check_outputs` refuses it at an array once traced).
    """
    out_specs = jax.tree.map(lambda s: PartitionSpec() if s is None else s, out_specs, is_leaf=is_spec)
    for path, spec in jax.tree_util.tree_flatten_with_path(out_specs, is_leaf=is_spec)[0]:
        if isinstance(spec, PartitionSpec):
            # A shape every spec divides: only the axis names and their repeats are checked.
            validate_spec(
                spec, (mesh.size,) * len(spec), mesh, where=f"filter_shard_map: out_specs at {path_str(path)}"
            )
    jax_out_specs = jax.tree.map(lambda s: s if isinstance(s, PartitionSpec) else PartitionSpec(), out_specs)
    return out_specs, jax_out_specs


def _check_outputs(out_specs: PyTree, out_dyn: PyTree, mesh: Mesh, check_vma: bool) -> None:
    """The traced outputs against `out_specs`: structure, rank and varying axes, per leaf."""
    flat = broadcast_specs(out_specs, out_dyn, what="filter_shard_map: out_specs (for the function's output)")
    for (path, leaf), spec in zip(jax.tree_util.tree_flatten_with_path(out_dyn)[0], flat):
        where = f"filter_shard_map: out_specs for output {path_str(path)}"
        if not isinstance(spec, PartitionSpec):
            raise ValueError(f"{where} is {spec!r}, not a PartitionSpec. Give P(...) (or None for P()).")
        shape = tuple(leaf.shape)
        if len(spec) > len(shape):
            raise ValueError(
                f"{where}: PartitionSpec {spec} has {len(spec)} entries but the output has "
                f"rank {len(shape)} (per-device shape {shape}). Give at most one entry per "
                f"dimension, or return an output with a dimension to join the devices' blocks along."
            )
        varying = varying_axes(leaf) if check_vma else frozenset()
        missing = [a for a in mesh.axis_names if a in varying and a not in spec_axes(spec)]
        if missing:
            axes = tuple(missing) if len(missing) > 1 else missing[0]
            raise ValueError(
                f"{where}: PartitionSpec {spec} says the output is the same on every device "
                f"along mesh axes {tuple(missing)}, but its value varies over them (it depends "
                f"on inputs split over them). Reduce it first (jax.lax.psum or pmean over "
                f"{axes!r}), or name the axes in its spec to get every device's block (e.g. "
                f"P({axes!r}) joins them along dimension 0); check_vma=False turns the check off "
                f"if the value really is the same everywhere."
            )


def varying_axes(leaf) -> frozenset:
    """The mesh axes a traced value inside `shard_map` (or the result of `eval_shape` there)
    varies over (empty outside `shard_map`, for a replicated value, or if JAX does not say)."""
    aval = leaf if isinstance(leaf, jax.ShapeDtypeStruct) else jax.typeof(leaf)
    mat = getattr(aval, "manual_axis_type", None)  # JAX 0.10+
    varying = getattr(mat, "varying", None)
    if varying is None:
        varying = getattr(aval, "vma", None)  # earlier JAX
    return frozenset(varying or ())
