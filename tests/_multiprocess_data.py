"""Run by tests/test_data_loading.py under `python -m eqxpar.launch --nproc 2 --devices-per-proc 4`.

Every process builds the same global batches with each of the four loading strategies, for
a pure data-parallel mesh and for data x model meshes, and the bad cases the tests expect
to fail. Process 0 writes the gathered global batches (`batches.npz`); every process writes
what it read and which errors it saw (`rank{i}.json`). The test compares them with the
dataset element by element, in the pytest process.

Usage: python tests/_multiprocess_data.py OUT_DIR
"""

import json
import os
import sys

import eqxpar.distributed

info = eqxpar.distributed.initialize(timeout_s=60)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import eqxpar  # noqa: E402
from eqxpar import data  # noqa: E402

NUM_RECORDS = 29  # not a multiple of the batch: batches cross epoch boundaries
BATCH = 16
SEED = 7
STEPS = (0, 3)
STRATEGIES = {
    "global_then_slice": data.load_global_then_slice,
    "per_device": data.load_per_device,
    "per_process": data.load_per_process,
    "then_reshard": data.load_then_reshard,
}
# name -> (mesh axis sizes, data axes). "model_across" puts the two model replicas in
# different processes (model is the first, slowest axis), so both processes need all rows.
LAYOUTS = {
    "data8": ({"data": 8}, "data"),
    "data2_model4": ({"data": 2, "model": 4}, "data"),
    "model_across": ({"model": 2, "data": 4}, "data"),
    "replicated": ({"data": 2, "model": 4}, ()),
}


class CountingRecords(data.ArrayRecords):
    """ArrayRecords that counts how many records this process read."""

    reads = 0

    def __getitem__(self, index):
        CountingRecords.reads += 1
        return super().__getitem__(index)


# Record i is (features [i, -i], label i): every row says which record it is.
ids = np.arange(NUM_RECORDS, dtype=np.int32)
source = CountingRecords((np.stack([ids, -ids], axis=1).astype(np.float32), ids))

out_dir = sys.argv[1]
batches = {}
reads = {}
errors = {}
for layout_name, (sizes, axes) in LAYOUTS.items():
    mesh = eqxpar.make_mesh(**sizes)
    for name, load in STRATEGIES.items():
        for step in STEPS:
            CountingRecords.reads = 0
            batch = load(source, step, global_batch_size=BATCH, mesh=mesh, batch_axis=axes, seed=SEED)
            reads[f"{layout_name}/{name}/{step}"] = CountingRecords.reads
            assert all(leaf.sharding == data.batch_sharding(mesh, axes) for leaf in batch)
            assert all(not leaf.is_fully_addressable for leaf in batch)
            data.check_batch_consistency(batch, mesh, axes)
            features, labels = eqxpar.gather(batch)
            batches[f"{layout_name}/{name}/{step}/features"] = features
            batches[f"{layout_name}/{name}/{step}/labels"] = labels


def expect_error(key, fn):
    try:
        fn()
    except ValueError as e:
        errors[key] = str(e)
    else:
        errors[key] = None


# Deliberately wrong loaders; check_batch_consistency must catch each.
mesh = eqxpar.make_mesh(data=8)
sharding = data.batch_sharding(mesh, "data")
first_rows = source.arrays[0][: BATCH // 2], source.arrays[1][: BATCH // 2]
# 1. every process loads the same rows (forgot to shard by process): duplicate data shards.
same_rows = jax.tree.map(
    lambda x: jax.make_array_from_process_local_data(sharding, x, (BATCH, *x.shape[1:])), first_rows
)
expect_error("duplicate_shards", lambda: data.check_batch_consistency(same_rows, mesh, "data"))
# 2. a mesh whose model replicas span the processes, loaded by plain per-process sharding:
#    the two processes hold the same data shards but load different rows.
across = eqxpar.make_mesh(model=2, data=4)
mine = data.global_batch_records(NUM_RECORDS, BATCH, 0, seed=SEED + jax.process_index())
wrong = jax.tree.map(
    lambda x: jax.make_array_from_process_local_data(
        data.batch_sharding(across, "data"), x[mine], (BATCH, *x.shape[1:])
    ),
    source.arrays,
)
expect_error("replicas_differ", lambda: data.check_batch_consistency(wrong, across, "data"))

# Bad input, caught before loading.
expect_error("batch_not_divisible", lambda: data.load_per_process(source, 0, global_batch_size=12, mesh=mesh))
full = eqxpar.make_mesh(model=8)
expect_error(
    "not_divisible_by_processes",
    lambda: data.load_then_reshard(source, 0, global_batch_size=3, mesh=full, batch_axis=()),
)
# Devices interleaved across processes along the data axis: process 0 holds shards 0, 2, 4, 6.
devices = sorted(jax.devices(), key=lambda d: (d.id % 2048, d.process_index))
interleaved = Mesh(np.array(devices), ("data",))
expect_error("non_contiguous", lambda: data.process_dataset(source, global_batch_size=BATCH, mesh=interleaved))
# ...which the per-device loader handles.
ok = data.load_per_device(source, 0, global_batch_size=BATCH, mesh=interleaved, seed=SEED)
data.check_batch_consistency(ok, interleaved, "data")
batches["interleaved/per_device/0/labels"] = eqxpar.gather(ok)[1]

if jax.process_index() == 0:
    np.savez(os.path.join(out_dir, "batches.npz"), **batches)
with open(os.path.join(out_dir, f"rank{jax.process_index()}.json"), "w") as f:
    json.dump({"reads": reads, "errors": errors, "process_count": jax.process_count()}, f)
print("done", info)
