"""Distributed data loading: build one global batch (a `jax.Array`) from many processes.

A global batch of `B` rows is split along its first dimension over the mesh's *data axes*:
with data axes of total size `G`, data shard `k` holds rows `k*B/G .. (k+1)*B/G` of the
batch, and every device whose data-axis coordinates are `k` holds a copy (the other mesh axes,
e.g. `model`, replicate it). Each process must therefore supply exactly the rows its own
devices hold: devices in the same model replica get identical rows, different replicas
different rows.

Which rows make up global batch `step` is a fixed function of `(seed, step)`: the records
in a [grain](https://github.com/google/grain) shuffle of the source (re-shuffled every
epoch), taken `B` at a time. Every loader below produces that same global batch, with the
sharding `NamedSharding(mesh, P(batch_axis))`, so they are interchangeable and a run resumed
from a checkpoint at step `s` sees exactly the batches it would have seen.

The four ways to build it (the trade-offs are in the docs' *Distributed data loading* page):

1. [`eqxpar.data.load_global_then_slice`][]: every process loads the whole global batch and
   keeps the shards of its own devices. Simplest; loads `num_processes` times too much.
2. [`eqxpar.data.load_per_device`][]: one loader per device, each loading exactly its
   device's shard. Precise, but many loaders, and replicas load the same rows again.
3. [`eqxpar.data.load_per_process`][]: one loader per process loading exactly the rows its
   devices need (built on [`eqxpar.data.process_dataset`][]). The efficient default.
4. [`eqxpar.data.load_then_reshard`][]: each process loads an even, contiguous share of the
   batch (grain's `ShardByJaxProcess`), and the computation moves rows to where the mesh
   wants them with `with_sharding_constraint` ([`eqxpar.data.constrain_batch`][]). Simple
   loading; pays in communication.

[`eqxpar.data.check_batch_consistency`][] catches batches whose shards do not match the
sharding (the silent failure: wrong rows, no error). A data source with fewer records than
one global batch is accepted with a `UserWarning`: its records repeat within every batch.
"""

from .._optional import missing

try:  # grain is an optional extra: without it, the install line instead of `No module named 'grain'`
    import grain  # noqa: F401
except ImportError as error:
    raise missing("grain", "data", "eqxpar.data (distributed data loading)") from error

from ._check import check_batch_consistency
from ._layout import BatchLayout, batch_layout, batch_sharding, batch_spec
from ._order import global_batch_records
from ._per_process import assemble_global_batch, load_per_process, process_dataset
from ._reshard import constrain_batch, load_then_reshard
from ._source import ArrayRecords, DataSource
from ._whole import load_global_then_slice, load_per_device

__all__ = [
    "DataSource",
    "ArrayRecords",
    "BatchLayout",
    "batch_spec",
    "batch_sharding",
    "batch_layout",
    "global_batch_records",
    "process_dataset",
    "assemble_global_batch",
    "load_global_then_slice",
    "load_per_device",
    "load_per_process",
    "load_then_reshard",
    "constrain_batch",
    "check_batch_consistency",
]
