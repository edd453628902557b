"""Placing PyTrees (Equinox Modules included) on a mesh by a tree of PartitionSpecs."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from ._specs import broadcast_specs, path_str, validate_spec

__all__ = [
    "shard",
    "init_sharded",
    "gather",
    "sharding_report",
    "ShardingReport",
]


def _validated_shardings(tree: PyTree, mesh: Mesh, specs: PyTree, what: str, is_array=eqx.is_array):
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    flat_specs = broadcast_specs(specs, tree, what=what)
    shardings = []
    for (path, leaf), spec in zip(leaves_with_path, flat_specs):
        if is_array(leaf):
            validate_spec(spec, tuple(leaf.shape), mesh, where=f"{what} at {path_str(path)}")
            shardings.append(NamedSharding(mesh, spec))
        else:
            shardings.append(None)
    return leaves_with_path, treedef, shardings


def shard(tree: PyTree, mesh: Mesh, specs: PyTree = PartitionSpec()) -> PyTree:
    """Put every array of `tree` onto `mesh`, split or replicated as `specs` says.

    Works on any PyTree, an Equinox Module included: non-array leaves (activation
    functions, Python numbers, static fields) are returned unchanged. All specs are
    checked before any data moves.

    **Arguments:**

    - `tree`: the PyTree to place (a model, an optimizer state, a batch).
    - `mesh`: the device mesh.
    - `specs`: a prefix tree of `PartitionSpec`s (see [`eqxpar.broadcast_specs`][]).
      Default `P()`: replicate everything.

    **Returns:**

    A PyTree of the same structure whose arrays are `jax.Array`s with
    `NamedSharding(mesh, spec)`. In a multi-process run every process must pass the same
    global values (as SPMD code does); each places the shards of its own devices.
    The arrays are new buffers, never the input's own, so a train step that donates them
    leaves the input usable.

    **Raises:**

    - `ValueError` if the specs do not match the tree, name an axis the mesh lacks, have
      more entries than an array's rank, or split a dimension that is not divisible.
    """
    leaves_with_path, treedef, shardings = _validated_shardings(tree, mesh, specs, "specs")
    out = [_place(leaf, s) if s is not None else leaf for (_, leaf), s in zip(leaves_with_path, shardings)]
    return jax.tree.unflatten(treedef, out)


def _place(leaf, sharding: NamedSharding):
    if sharding.is_fully_addressable:
        # Never the input's own buffers: train steps donate what they are given, and a
        # donated alias would delete the caller's array too. (`may_alias=False` is not
        # enough: JAX 0.10 still reuses a one-device array's buffer for the shard on that
        # device when replicating it.)
        if isinstance(leaf, jax.Array):
            leaf = leaf.copy()
        return jax.device_put(leaf, sharding, may_alias=False)
    # The mesh spans several processes: `device_put` cannot send this process's copy to
    # other processes' devices. Every process holds the same global value (SPMD), so each
    # builds the shards its own devices need from its copy.
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        return jax.device_put(leaf, sharding)  # already global: a collective reshard
    host = np.asarray(leaf)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def gather(tree: PyTree) -> PyTree:
    """Bring every array of `tree` back to host memory as a whole NumPy array.

    The inverse of [`eqxpar.shard`][]: `gather(shard(t, mesh, specs))` equals `t` leaf by
    leaf. Works across processes too (each process receives the whole array).

    **Arguments:**

    - `tree`: a PyTree whose arrays may be sharded over any mesh.

    **Returns:**

    The same structure with each array leaf replaced by a `numpy.ndarray` holding its global
    value; non-array leaves unchanged.
    """

    def one(x):
        if not eqx.is_array(x):
            return x
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))

    return jax.tree.map(one, tree)


@dataclasses.dataclass(frozen=True)
class ShardingRow:
    """One array in a [`eqxpar.ShardingReport`][]."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: str
    bytes_total: int
    bytes_per_device: int
    devices: int


@dataclasses.dataclass(frozen=True)
class ShardingReport:
    """Where each array of a PyTree lives: one row per array leaf.

    `str(report)` is a table; `report.rows` holds the numbers.
    """

    rows: tuple[ShardingRow, ...]

    @property
    def bytes_total(self) -> int:
        """Sum of the global sizes of all arrays, in bytes."""
        return sum(r.bytes_total for r in self.rows)

    @property
    def bytes_per_device(self) -> int:
        """Bytes the largest-loaded device holds for these arrays."""
        return sum(r.bytes_per_device for r in self.rows)

    def __str__(self) -> str:
        head = ("path", "shape", "dtype", "spec", "bytes/device", "total bytes")
        body = [
            (r.path, str(r.shape), r.dtype, r.spec, f"{r.bytes_per_device:,}", f"{r.bytes_total:,}") for r in self.rows
        ]
        body.append(("TOTAL", "", "", "", f"{self.bytes_per_device:,}", f"{self.bytes_total:,}"))
        widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
        fmt = "  ".join(f"{{:{'>' if i >= 4 else '<'}{w}}}" for i, w in enumerate(widths))
        lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
        lines += [fmt.format(*row) for row in body]
        return "\n".join(lines)


def sharding_report(tree: PyTree) -> ShardingReport:
    """A per-leaf report of how a PyTree's arrays are laid out across devices.

    **Arguments:**

    - `tree`: any PyTree (a sharded model, an optimizer state, a batch).

    **Returns:**

    A [`eqxpar.ShardingReport`][]: for each array leaf its path, global shape, dtype,
    PartitionSpec (or the device for single-device arrays) and bytes per device.
    `print(report)` shows it as a table.
    """
    rows = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not eqx.is_array(leaf):
            continue
        shape = tuple(leaf.shape)
        itemsize = jnp.dtype(leaf.dtype).itemsize
        total = math.prod(shape) * itemsize
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            spec = str(sharding.spec)
            shard_shape = sharding.shard_shape(shape)
            devices = sharding.mesh.size
        elif sharding is not None:
            spec = f"on {len(sharding.device_set)} device(s)"
            shard_shape = sharding.shard_shape(shape)
            devices = len(sharding.device_set)
        else:  # NumPy arrays live on the host.
            spec, shard_shape, devices = "host", shape, 0
        rows.append(
            ShardingRow(
                path=path_str(path),
                shape=shape,
                dtype=str(jnp.dtype(leaf.dtype)),
                spec=spec,
                bytes_total=total,
                bytes_per_device=math.prod(shard_shape) * itemsize,
                devices=devices,
            )
        )
    return ShardingReport(tuple(rows))


# --- Creating a model directly in its shards, for models whose whole copy would not fit one
# device: its shapes first (`eqx.filter_eval_shape`, nothing allocated), then its constructor
# compiled with the shardings as outputs, so each device draws and keeps only its block. ---


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
    leaves_with_path, treedef, shardings = _validated_shardings(
        abstract, mesh, specs, "init_sharded specs", is_array=_is_abstract_array
    )
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
