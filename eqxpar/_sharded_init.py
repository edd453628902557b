"""Creating a model directly in its shards, for models whose whole copy would not fit one
device: its shapes first (`eqx.filter_eval_shape`, nothing allocated), then its constructor
compiled with the shardings as outputs, so each device draws and keeps only its block."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jax.sharding import Mesh, NamedSharding
from jaxtyping import PyTree

from ._specs import broadcast_specs, path_str, validate_spec

__all__ = ["init_sharded"]


def _is_abstract_array(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def init_sharded(
    make: Callable[[], PyTree],
    mesh: Mesh,
    specs: PyTree | Callable[[PyTree], PyTree],
    *,
    lower: bool = False,
) -> Any:
    """Build a model directly in its shards: no device ever holds the whole of it.

    `eqxpar.shard(make(), mesh, specs)` first builds the whole model on one device, then
    splits it. This compiles `make` instead, with every array's sharding as its output
    sharding: XLA partitions the initialisation itself, so each device computes and keeps
    only its block (JAX's random numbers are partitionable: the values are the ones `make()`
    gives on one device, bit for bit). Its shapes come first from
    `eqx.filter_eval_shape(make)`, so a wrong spec fails before anything is computed.

    ```python
    mesh = eqxpar.make_mesh(fsdp=8)
    model = eqxpar.init_sharded(
        lambda: eqxpar.models.Llama(eqxpar.models.llama_config("llama-3-8b"), key=jax.random.key(0)),
        mesh,
        lambda abstract: eqxpar.train.fsdp_specs(abstract, mesh),
    )
    ```

    **Arguments:**

    - `make`: a function of no arguments that builds the model (a closure over its key).
    - `mesh`: the mesh to place it on.
    - `specs`: the model's PartitionSpecs (a prefix tree, as for [`eqxpar.shard`][]), or a
      function `specs(abstract_model)` that computes them from the model's shapes
      (`abstract_model` has a `jax.ShapeDtypeStruct` for every array, e.g.
      `lambda m: eqxpar.nn.partition_specs(m, mesh)` or
      `lambda m: eqxpar.train.fsdp_specs(m, mesh)`).
    - `lower`: return the lowered initialisation (`jax.stages.Lowered`) instead of running
      it, e.g. to read its memory per device with `.compile().memory_analysis()` before
      committing to it.

    **Returns:**

    The model, its arrays placed on `mesh` as `specs` says (or, with `lower=True`, the
    lowered initialisation).

    **Raises:**

    - `ValueError` if `make` is not callable, `specs` does not fit the model's structure,
      or a spec names an axis the mesh lacks or does not divide its dimension (naming the
      array's path).
    """
    if not callable(make):
        raise ValueError(
            f"init_sharded: make must be a function of no arguments that builds the model, e.g. "
            f"lambda: MyModel(..., key=key); got {type(make).__name__}."
        )
    if not isinstance(mesh, Mesh):
        raise ValueError(f"init_sharded: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
    abstract = eqx.filter_eval_shape(make)
    if callable(specs) and not isinstance(specs, jax.sharding.PartitionSpec):
        specs = specs(abstract)
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    shardings = []
    for (path, leaf), spec in zip(leaves_with_path, broadcast_specs(specs, abstract, what="init_sharded specs")):
        if _is_abstract_array(leaf):
            validate_spec(spec, tuple(leaf.shape), mesh, where=f"init_sharded specs at {path_str(path)}")
            shardings.append(NamedSharding(mesh, spec))
        else:
            shardings.append(None)
    array_shardings = [s for s in shardings if s is not None]

    def arrays() -> list:  # the model's arrays, in the order of the abstract model's leaves
        return [leaf for leaf in jax.tree.leaves(make()) if eqx.is_array(leaf)]

    build = jax.jit(arrays, out_shardings=array_shardings)
    if lower:
        return build.lower()
    built = iter(build())
    # The non-array leaves (activation functions, ...) are the abstract model's own.
    flat = [next(built) if s is not None else leaf for s, (_, leaf) in zip(shardings, leaves_with_path)]
    return jax.tree_util.tree_unflatten(treedef, flat)
