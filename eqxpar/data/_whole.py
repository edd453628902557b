"""Strategies 1 and 2: load the whole batch everywhere, or one loader per device."""

from __future__ import annotations

import grain
import jax
import numpy as np
from jax.sharding import Mesh
from jaxtyping import Array, PyTree

from ._arrays import global_shapes
from ._layout import DataAxes, batch_sharding
from ._order import record_blocks, start_load
from ._source import DataSource


def load_global_then_slice(
    source: DataSource,
    step: int,
    *,
    global_batch_size: int,
    mesh: Mesh,
    batch_axis: DataAxes = "data",
    seed: int = 0,
    shuffle: bool = True,
) -> PyTree[Array]:
    """Strategy 1: every process loads the whole global batch and keeps its devices' shards.

    The simplest loader and correct for any mesh and device order, but each process reads
    `global_batch_size` records where it needs only its share: fine for small data.

    **Arguments:**

    - `source`: the records.
    - `step`: which global batch.
    - `global_batch_size`: rows per global batch.
    - `mesh`, `batch_axis`: the target layout.
    - `seed`, `shuffle`: the record order.

    **Returns:**

    Global batch `step` with sharding `batch_sharding(mesh, batch_axis)`.

    **Warns:**

    - `UserWarning` if `source` holds fewer records than one global batch.
    """
    start_load(source, step, mesh, batch_axis, global_batch_size, seed)
    whole = record_blocks(source, seed, shuffle, global_batch_size)[int(step)]
    sharding = batch_sharding(mesh, batch_axis)

    def place(leaf):
        leaf = np.asarray(leaf)
        return jax.make_array_from_callback(leaf.shape, sharding, lambda index: leaf[index])

    return jax.tree.map(place, whole)


def load_per_device(
    source: DataSource,
    step: int,
    *,
    global_batch_size: int,
    mesh: Mesh,
    batch_axis: DataAxes = "data",
    seed: int = 0,
    shuffle: bool = True,
) -> PyTree[Array]:
    """Strategy 2: one loader per local device, each loading exactly its device's shard.

    Every device gets its own grain pipeline over its own data shard (grain `ShardOptions`
    with one shard per data-shard index). Precise, and correct for any device order, but a
    process runs as many loaders as it has devices, and devices that are replicas of each
    other (same data shard, different `model` coordinate) each read the same rows.

    **Arguments:**

    - `source`: the records.
    - `step`: which global batch.
    - `global_batch_size`: rows per global batch.
    - `mesh`, `batch_axis`: the target layout.
    - `seed`, `shuffle`: the record order.

    **Returns:**

    Global batch `step` with sharding `batch_sharding(mesh, batch_axis)`.

    **Warns:**

    - `UserWarning` if `source` holds fewer records than one global batch.
    """
    layout = start_load(source, step, mesh, batch_axis, global_batch_size, seed)
    blocks = record_blocks(source, seed, shuffle, layout.shard_size)
    sharding = batch_sharding(mesh, batch_axis)
    per_device = []
    for device in sharding.addressable_devices_indices_map((global_batch_size,)):
        shard = grain.sharding.ShardOptions(shard_index=layout.device_shard[device], shard_count=layout.num_shards)
        loader = blocks.slice(slice(shard.shard_index, None, shard.shard_count))
        per_device.append(jax.device_put(loader[int(step)], device))
    treedef = jax.tree.structure(per_device[0])
    flat = [treedef.flatten_up_to(arrays) for arrays in per_device]
    leaves = []
    for i, first in enumerate(flat[0]):
        (shape,) = jax.tree.leaves(
            global_shapes([first], layout.shard_size, global_batch_size), is_leaf=lambda x: isinstance(x, tuple)
        )
        leaves.append(jax.make_array_from_single_device_arrays(shape, sharding, [arrays[i] for arrays in flat]))
    return jax.tree.unflatten(treedef, leaves)
