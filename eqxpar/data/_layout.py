"""Where the rows of a global batch live: its spec, its sharding, and each device's rows."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._specs import axis_names, validate_spec

DataAxes = str | Sequence[str] | None


def data_axes(batch_axis: DataAxes) -> tuple[str, ...]:
    """A `batch_axis` argument as a tuple of mesh axis names (`()` for a replicated batch)."""
    return () if batch_axis is None else axis_names(batch_axis)


def batch_spec(batch_axis: DataAxes = "data") -> PartitionSpec:
    """The PartitionSpec of a batch split over `batch_axis` along its first dimension.

    **Arguments:**

    - `batch_axis`: a mesh axis name, a sequence of names (the batch is split over their
      product, in that order), or `()` / `None` for a batch replicated on every device.

    **Returns:**

    `P("data")`, `P(("data", "fsdp"))`, or `P()`.
    """
    axes = data_axes(batch_axis)
    if not axes:
        return PartitionSpec()
    return PartitionSpec(axes[0] if len(axes) == 1 else axes)


def batch_sharding(mesh: Mesh, batch_axis: DataAxes = "data") -> NamedSharding:
    """`NamedSharding(mesh, batch_spec(batch_axis))`: the sharding every loader produces.

    **Arguments:**

    - `mesh`: the device mesh.
    - `batch_axis`: see [`eqxpar.data.batch_spec`][].

    **Returns:**

    The `NamedSharding` of a batch split over the data axes and replicated over the others.
    """
    return NamedSharding(mesh, batch_spec(batch_axis))


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """Which rows of a global batch each device and each process holds.

    Rows are positions `0 .. global_batch_size-1` inside the global batch. The batch is cut
    into `num_shards` data shards of `shard_size` rows; `device_shard[device]` is the shard
    a device holds and `process_shards[p]` the sorted shards the devices of process `p`
    hold together.
    """

    global_batch_size: int
    num_shards: int
    shard_size: int
    device_shard: dict[jax.Device, int]  # pyright: ignore[reportInvalidTypeForm]  # jaxlib's Device, re-exported as a plain variable
    process_shards: dict[int, tuple[int, ...]]

    def rows_of_shard(self, shard: int) -> range:
        """The batch rows in data shard `shard`."""
        return range(shard * self.shard_size, (shard + 1) * self.shard_size)

    def process_rows(self, process_index: int) -> list[int]:
        """The batch rows the devices of process `process_index` hold, in batch order."""
        return [r for k in self.process_shards.get(process_index, ()) for r in self.rows_of_shard(k)]


def batch_layout(mesh: Mesh, batch_axis: DataAxes, global_batch_size: int) -> BatchLayout:
    """Work out which rows of a `global_batch_size`-row batch every device and process holds.

    **Arguments:**

    - `mesh`: the device mesh (it may span several processes).
    - `batch_axis`: the mesh axes the batch is split over (see [`eqxpar.data.batch_spec`][]).
    - `global_batch_size`: rows in the global batch (all processes together).

    **Returns:**

    A [`eqxpar.data.BatchLayout`][].

    **Raises:**

    - `ValueError` if a data axis is not in the mesh, the batch size is not a positive
      integer, or it does not divide evenly over the data shards (and so over the processes).
    """
    if not isinstance(global_batch_size, int) or isinstance(global_batch_size, bool) or global_batch_size < 1:
        raise ValueError(f"global_batch_size must be a positive integer, got {global_batch_size!r}.")
    axes = data_axes(batch_axis)
    missing = [axis for axis in axes if axis not in mesh.shape]
    if missing:
        raise ValueError(
            f"data axis {missing[0]!r} is not in the mesh (its axes are {tuple(mesh.axis_names)}). "
            f"Pass batch_axis naming mesh axes, e.g. batch_axis={mesh.axis_names[0]!r}."
        )
    num_shards = math.prod(mesh.shape[a] for a in axes)
    processes = sorted({d.process_index for d in mesh.devices.flat})
    if global_batch_size % num_shards:
        sizes = " x ".join(f"{a}={mesh.shape[a]}" for a in axes)
        across = (
            f" across {len(processes)} processes with {mesh.devices.size // len(processes)} devices each"
            if len(processes) > 1
            else ""
        )
        raise ValueError(
            f"a global batch of {global_batch_size} rows cannot be split evenly into the "
            f"{num_shards} data shards of the mesh ({sizes}){across}. Use a global batch size "
            f"that is a multiple of {num_shards} (e.g. {num_shards * max(1, global_batch_size // num_shards)})."
        )
    spec = batch_spec(axes)
    validate_spec(spec, (global_batch_size,), mesh, where="batch")
    shard_size = global_batch_size // num_shards
    device_shard = {}
    for device, index in NamedSharding(mesh, spec).devices_indices_map((global_batch_size,)).items():
        device_shard[device] = (index[0].start or 0) // shard_size
    process_shards: dict[int, set[int]] = {}
    for device, shard in device_shard.items():
        process_shards.setdefault(device.process_index, set()).add(shard)
    return BatchLayout(
        global_batch_size=global_batch_size,
        num_shards=num_shards,
        shard_size=shard_size,
        device_shard=device_shard,
        process_shards={p: tuple(sorted(s)) for p, s in sorted(process_shards.items())},
    )
