"""Placing PyTrees (Equinox Modules included) on a mesh by a tree of PartitionSpecs."""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from ._specs import broadcast_specs, path_str, validate_spec

__all__ = [
    "shard",
    "gather",
    "sharding_report",
    "ShardingReport",
]


def _validated_shardings(tree: PyTree, mesh: Mesh, specs: PyTree, what: str):
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    flat_specs = broadcast_specs(specs, tree, what=what)
    shardings = []
    for (path, leaf), spec in zip(leaves_with_path, flat_specs):
        if eqx.is_array(leaf):
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
