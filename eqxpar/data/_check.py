"""Catch batches whose shards do not match their sharding (wrong rows, no error)."""

from __future__ import annotations

import hashlib

import jax
import numpy as np
from jax.sharding import Mesh
from jaxtyping import Array, PyTree

from .._specs import path_str
from ._layout import DataAxes, batch_sharding, data_axes


def _fingerprint(data: np.ndarray) -> tuple[int, int]:
    """64 bits of a hash of the shard's bytes, as two int32s (JAX moves int32 by default)."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(str((data.shape, data.dtype.str)).encode())
    digest.update(np.ascontiguousarray(data).tobytes())
    high, low = (int(x) for x in np.frombuffer(digest.digest(), dtype=np.int32))
    return high, low


def check_batch_consistency(
    batch: PyTree[Array], mesh: Mesh, batch_axis: DataAxes = "data", *, check_distinct: bool = True
) -> None:
    """Check that a global batch's shards are what its sharding promises; raise if not.

    JAX trusts the data it is given: a loader that hands two replicas different rows, or
    every data shard the same rows, produces a batch that trains without any error, on the
    wrong data. This compares fingerprints of every device's shard across all processes:

    - devices holding the same data shard (replicas, e.g. along a `model` axis) must hold
      identical values;
    - with `check_distinct`, different data shards must not be identical (the typical
      sign of every process loading the same rows).

    In a multi-process job every process must call it (it exchanges fingerprints). Use it
    in tests or on the first steps of a run; it copies every shard to the host.

    **Arguments:**

    - `batch`: a PyTree of global `jax.Array`s.
    - `mesh`, `batch_axis`: the layout the batch should have.
    - `check_distinct`: also flag data shards that are equal to each other (turn off for
      data that really repeats, e.g. constant features).

    **Returns:**

    Nothing; returns only if every check passes.

    **Raises:**

    - `ValueError` naming the leaf, the rows, the devices and processes involved, if a leaf
      is not laid out as `batch_sharding(mesh, batch_axis)`, replicas differ, or (with
      `check_distinct`) two data shards are equal.
    """
    expected = batch_sharding(mesh, batch_axis)
    axes = data_axes(batch_axis)
    others = tuple(a for a in mesh.axis_names if a not in axes)
    process_of = {d.id: d.process_index for d in mesh.devices.flat}
    per_process = max(sum(1 for d in mesh.devices.flat if d.process_index == p) for p in set(process_of.values()))
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        where = f"batch leaf {path_str(path)}"
        if not isinstance(leaf, jax.Array):
            raise ValueError(f"{where} is a {type(leaf).__name__}, not a jax.Array; load it with eqxpar.data.")
        if leaf.ndim == 0 or not leaf.sharding.is_equivalent_to(expected, leaf.ndim):
            raise ValueError(
                f"{where} has sharding {leaf.sharding}, but a batch split over data axes "
                f"{axes} should have {expected}. Build it with an eqxpar.data loader for this "
                f"mesh and batch_axis."
            )
        # One row per local shard: device id, first and last+1 batch row, fingerprint.
        rows = np.full((per_process, 5), -1, dtype=np.int32)
        for i, shard in enumerate(leaf.addressable_shards):
            index = shard.index[0]
            stop = leaf.shape[0] if index.stop is None else index.stop
            rows[i] = (shard.device.id, index.start or 0, stop, *_fingerprint(np.asarray(shard.data)))
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            rows = np.asarray(multihost_utils.process_allgather(rows)).reshape(-1, 5)
        rows = rows[rows[:, 0] >= 0]
        groups: dict[tuple[int, int], list[tuple[int, tuple[int, int]]]] = {}
        for device_id, start, stop, *fingerprint in rows.tolist():
            groups.setdefault((start, stop), []).append((device_id, tuple(fingerprint)))

        def name(device_id):
            return f"device {device_id} (process {process_of.get(device_id, '?')})"

        for (start, stop), members in sorted(groups.items()):
            reference_device, reference = members[0]
            odd = [d for d, f in members if f != reference]
            if odd:
                raise ValueError(
                    f"{where}: rows {start}:{stop} should be identical on devices "
                    f"{sorted(d for d, _ in members)}, which are replicas (the mesh axes {others} "
                    f"replicate the batch), but {', '.join(name(d) for d in odd)} hold(s) "
                    f"different values from {name(reference_device)}. The loaders gave the same "
                    f"data shard different rows: typically data sharded by process (e.g. grain's "
                    f"ShardByJaxProcess) on a mesh whose model replicas span processes. Load with "
                    f"eqxpar.data.load_per_process, which follows the mesh."
                )
        if check_distinct and len(groups) > 1:
            seen: dict[tuple[int, int], tuple[int, int]] = {}
            for (start, stop), members in sorted(groups.items()):
                fingerprint = members[0][1]
                if fingerprint in seen:
                    first = seen[fingerprint]
                    raise ValueError(
                        f"{where}: rows {first[0]}:{first[1]} and rows {start}:{stop} are different "
                        f"data shards but hold identical values. Usually every process (or device) "
                        f"loaded the same rows instead of its own part of the batch. If your data "
                        f"really repeats, pass check_distinct=False."
                    )
                seen[fingerprint] = (start, stop)
