"""eqxpar.data: the four loading strategies give exactly the expected global batch.

In this process (8 simulated devices) over drawn meshes, data axes, steps and seeds; and in
two real processes of four devices each, started by the launcher, for a pure data-parallel
mesh and data x model meshes (one with model replicas spanning the processes). The
expected batch is always rebuilt from the records themselves: record i carries i.
"""

import json
import os

import grain
import jax
import numpy as np
import pytest
from _launch import run_job
from hypothesis import given
from hypothesis import strategies as st

import eqxpar
from eqxpar import data
from eqxpar.testing import mesh_sizes

STRATEGIES = {
    "global_then_slice": data.load_global_then_slice,
    "per_device": data.load_per_device,
    "per_process": data.load_per_process,
    "then_reshard": data.load_then_reshard,
}


class CountingRecords(data.ArrayRecords):
    """ArrayRecords that counts the records read (to check who loads what)."""

    reads = 0

    def __getitem__(self, index):
        CountingRecords.reads += 1
        return super().__getitem__(index)


def records(n):
    """Record i = (features [i, -i, 2i], label i): every row names its record."""
    ids = np.arange(n, dtype=np.int32)
    return CountingRecords((np.stack([ids, -ids, 2 * ids], axis=1).astype(np.float32), ids))


def expected_batch(n, batch_size, step, seed, shuffle=True):
    ids = data.global_batch_records(n, batch_size, step, seed=seed, shuffle=shuffle)
    return np.stack([ids, -ids, 2 * ids], axis=1).astype(np.float32), ids.astype(np.int32)


# --- The definition of a global batch --------------------------------------------------------


def test_global_batches_walk_the_data_epoch_by_epoch():
    n, b = 24, 8
    # Without shuffling: records in source order, wrapping around.
    assert data.global_batch_records(n, b, 4, shuffle=False).tolist() == [8, 9, 10, 11, 12, 13, 14, 15]
    assert data.global_batch_records(5, 4, 1, shuffle=False).tolist() == [4, 0, 1, 2]
    # With shuffling: every epoch (3 batches here) is a permutation, a different one each
    # epoch and each seed, and the same again for the same (seed, step).
    epoch0 = np.concatenate([data.global_batch_records(n, b, s, seed=3) for s in range(3)])
    epoch1 = np.concatenate([data.global_batch_records(n, b, s, seed=3) for s in range(3, 6)])
    assert sorted(epoch0.tolist()) == list(range(n)) == sorted(epoch1.tolist())
    assert epoch0.tolist() != epoch1.tolist()
    assert epoch0.tolist() != np.concatenate([data.global_batch_records(n, b, s, seed=4) for s in range(3)]).tolist()
    assert data.global_batch_records(n, b, 4, seed=3).tolist() == epoch1[b : 2 * b].tolist()
    # It is grain's shuffle: the record stream is MapDataset.shuffle(seed).repeat().
    stream = grain.MapDataset.range(n).shuffle(seed=3).repeat()
    assert data.global_batch_records(n, b, 7, seed=3).tolist() == [stream[i] for i in range(7 * b, 8 * b)]


# --- Every strategy, in one process over drawn meshes -----------------------------------------

AXES = {"data": "data", "data+model": ("data", "model"), "replicated": ()}


@given(
    sizes=mesh_sizes(("data", "model")),
    axes=st.sampled_from(sorted(AXES)),
    step=st.sampled_from([0, 5]),
    seed=st.integers(0, 2**32 - 1),
    shuffle=st.booleans(),
)
def test_each_strategy_yields_the_expected_batch(sizes, axes, step, seed, shuffle):
    mesh = eqxpar.make_mesh(**sizes)
    batch_axis = AXES[axes]
    n, batch_size = 37, 16  # 37 records: batches cross epoch boundaries
    source = records(n)
    want = expected_batch(n, batch_size, step, seed, shuffle)
    for name, load in STRATEGIES.items():
        batch = load(
            source, step, global_batch_size=batch_size, mesh=mesh, batch_axis=batch_axis, seed=seed, shuffle=shuffle
        )
        for leaf in batch:
            assert leaf.sharding == data.batch_sharding(mesh, batch_axis), name
        got = eqxpar.gather(batch)
        np.testing.assert_array_equal(got[0], want[0], err_msg=name)
        np.testing.assert_array_equal(got[1], want[1], err_msg=name)
        # Each device holds exactly its rows (not just the right global value).
        for shard in batch[1].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), want[1][shard.index], err_msg=name)
        data.check_batch_consistency(batch, mesh, batch_axis)


def test_who_reads_how_many_records():
    """Per process loads its rows once; per device reads again for every replica."""
    mesh = eqxpar.make_mesh(data=2, model=4)
    source = records(40)
    counts = {}
    for name, load in STRATEGIES.items():
        CountingRecords.reads = 0
        load(source, 1, global_batch_size=16, mesh=mesh, batch_axis="data")
        counts[name] = CountingRecords.reads
    # One process holds the whole batch: 16 rows; per device, 8 devices x 8 rows.
    assert counts == {"global_then_slice": 16, "per_device": 64, "per_process": 16, "then_reshard": 16}


def test_process_dataset_iterates_and_resumes_from_its_state():
    mesh = eqxpar.make_mesh(data=4)
    source = records(30)
    ds = data.process_dataset(source, global_batch_size=8, mesh=mesh, seed=11)
    iterator = ds[2:].to_iter_dataset().__iter__()
    first = next(iterator)
    state = iterator.get_state()
    second, third = next(iterator), next(iterator)
    np.testing.assert_array_equal(first[1], data.global_batch_records(30, 8, 2, seed=11))
    np.testing.assert_array_equal(third[1], data.global_batch_records(30, 8, 4, seed=11))
    iterator.set_state(state)  # a checkpoint restored: the same batches again
    np.testing.assert_array_equal(next(iterator)[1], second[1])
    global_batch = data.assemble_global_batch(third, mesh, "data", 8)
    np.testing.assert_array_equal(eqxpar.gather(global_batch)[1], third[1])


def test_constrain_batch_reshards_inside_jit():
    mesh = eqxpar.make_mesh(data=2, model=4)
    x = jax.device_put(np.arange(16.0).reshape(8, 2), data.batch_sharding(mesh, ("data", "model")))
    y = jax.jit(lambda b: data.constrain_batch(b, mesh, "data") * 1.0)(x)
    assert y.sharding == data.batch_sharding(mesh, "data")
    np.testing.assert_array_equal(np.asarray(y), np.arange(16.0).reshape(8, 2))


# --- The consistency check fires on wrong loaders --------------------------------------------


def per_device_batch(mesh, rows_for_device):
    """A batch built device by device from `rows_for_device(device, index) -> rows`."""
    sharding = data.batch_sharding(mesh, "data")
    values = np.arange(16, dtype=np.float32)
    arrays = [
        jax.device_put(rows_for_device(device, index, values), device)
        for device, index in sharding.addressable_devices_indices_map((16,)).items()
    ]
    return jax.make_array_from_single_device_arrays((16,), sharding, arrays)


def test_consistency_check_catches_replicas_that_differ():
    mesh = eqxpar.make_mesh(data=2, model=4)
    right = per_device_batch(mesh, lambda d, index, v: v[index])
    data.check_batch_consistency(right, mesh, "data")
    # A per-device loader that offsets rows by the device's model coordinate.
    model_of = {d: m for (_, m), d in np.ndenumerate(mesh.devices)}
    wrong = per_device_batch(mesh, lambda d, index, v: np.roll(v, model_of[d])[index])
    with pytest.raises(ValueError, match=r"rows 0:8 should be identical on devices \[0, 1, 2, 3\]"):
        data.check_batch_consistency(wrong, mesh, "data")


def test_consistency_check_catches_shards_that_repeat():
    mesh = eqxpar.make_mesh(data=4)
    same = per_device_batch(mesh, lambda d, index, v: v[:4])  # every device loads rows 0..3
    with pytest.raises(ValueError, match="rows 0:4 and rows 4:8 are different data shards but hold identical"):
        data.check_batch_consistency(same, mesh, "data")
    data.check_batch_consistency(same, mesh, "data", check_distinct=False)


def test_consistency_check_catches_the_wrong_layout():
    mesh = eqxpar.make_mesh(data=2, model=4)
    batch = data.load_per_process(records(20), 0, global_batch_size=8, mesh=mesh, batch_axis=("data", "model"))
    with pytest.raises(ValueError, match="should have NamedSharding"):
        data.check_batch_consistency(batch, mesh, "data")


# --- Bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"global_batch_size": 12}, "12 rows cannot be split evenly into the 8 data shards"),
        ({"global_batch_size": 0}, "global_batch_size must be a positive integer"),
        ({"batch_axis": "batch"}, "data axis 'batch' is not in the mesh"),
        ({"seed": -1}, r"seed must be an integer in \[0, 2\*\*32\)"),
        ({"step": -2}, "step must be a non-negative integer"),
    ],
)
@pytest.mark.parametrize("load", list(STRATEGIES.values()), ids=list(STRATEGIES))
def test_bad_input_is_a_clear_error(load, kwargs, message):
    mesh = eqxpar.make_mesh(data=8)
    args = {"global_batch_size": 16, "batch_axis": "data", "seed": 0, "step": 0, **kwargs}
    step = args.pop("step")
    with pytest.raises(ValueError, match=message):
        load(records(20), step, mesh=mesh, **args)


@pytest.mark.parametrize("load", list(STRATEGIES.values()), ids=list(STRATEGIES))
def test_source_smaller_than_a_batch_warns_before_loading(load):
    """5 records, batches of 8: every batch repeats records; the warning says so and the fix."""
    mesh = eqxpar.make_mesh(data=8)
    source = records(5)
    CountingRecords.reads = 0
    message = (
        r"has 5 records, fewer than the global batch size of 8 rows, so records repeat.*at most 5 rows, or more data"
    )
    with pytest.warns(UserWarning, match=message) as caught:
        batch = load(source, 1, global_batch_size=8, mesh=mesh, seed=3)
    assert len(caught) == 1 and caught[0].filename == __file__  # points at the caller's line
    # It is a warning, not an error: the batch is still the defined one, repeats included
    # (8 rows of 1 row per device: per_device also loads one-row shards).
    with pytest.warns(UserWarning, match="has 5 records"):
        want = data.global_batch_records(5, 8, 1, seed=3)
    np.testing.assert_array_equal(eqxpar.gather(batch)[1], want)
    assert len(set(want.tolist())) == 5


def test_source_smaller_than_a_batch_warns_when_the_dataset_is_built():
    mesh = eqxpar.make_mesh(data=4)
    source = records(6)
    CountingRecords.reads = 0
    with pytest.warns(UserWarning, match="has 6 records, fewer than the global batch size of 8"):
        ds = data.process_dataset(source, global_batch_size=8, mesh=mesh)
    assert CountingRecords.reads == 0  # warned at construction, before reading a record
    with pytest.warns(UserWarning, match="has 6 records"):
        data.global_batch_records(6, 8, 0)
    # A source of exactly one batch (or more) is silent.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        data.process_dataset(records(8), global_batch_size=8, mesh=mesh)[0]
        data.load_per_device(records(8), 0, global_batch_size=8, mesh=mesh)
    assert len(ds[0][1]) == 8


def test_array_records_rejects_ragged_arrays():
    with pytest.raises(ValueError, match="same leading"):
        data.ArrayRecords((np.zeros((3, 2)), np.zeros(4)))


# --- Two real processes, four devices each ----------------------------------------------------


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("multiprocess_data")
    run = run_job(2, 4, os.path.join("tests", "_multiprocess_data.py"), str(out))
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return dict(np.load(out / "batches.npz")), ranks, run.stdout


@pytest.mark.slow
def test_two_processes_build_the_expected_global_batches(two_process_run):
    batches, ranks, stdout = two_process_run
    assert "[rank 0] done process 0 of 2: 4 local / 8 global cpu devices" in stdout
    assert "[rank 1] done process 1 of 2" in stdout
    layouts = ("data8", "data2_model4", "model_across", "replicated")
    for layout in layouts:
        for name in STRATEGIES:
            for step in (0, 3):
                features, labels = expected_batch(29, 16, step, seed=7)
                key = f"{layout}/{name}/{step}"
                np.testing.assert_array_equal(batches[f"{key}/labels"], labels, err_msg=key)
                np.testing.assert_array_equal(batches[f"{key}/features"], features[:, :2], err_msg=key)
    np.testing.assert_array_equal(batches["interleaved/per_device/0/labels"], expected_batch(29, 16, 0, seed=7)[1])
    # Who read what: per process, each process reads exactly its devices' rows.
    for rank in ranks:
        reads = rank["reads"]
        assert reads["data8/per_process/0"] == 8  # half the batch each
        assert reads["data2_model4/per_process/0"] == 8  # its data shard, once for 4 replicas
        assert reads["data2_model4/per_device/0"] == 32  # 4 replicas x 8 rows
        assert reads["model_across/per_process/0"] == 16  # both data shards live on each process
        assert reads["replicated/per_process/0"] == 16
        assert reads["data8/global_then_slice/0"] == 16  # the whole batch, everywhere
        assert reads["model_across/then_reshard/0"] == 8  # half, then moved by the reshard


@pytest.mark.slow
def test_two_processes_catch_wrong_loaders_and_bad_batches(two_process_run):
    _, ranks, _ = two_process_run
    for rank in ranks:
        errors = rank["errors"]
        assert "rows 0:2 and rows 8:10 are different data shards but hold identical" in errors["duplicate_shards"]
        assert "should be identical on devices [0, 2048]" in errors["replicas_differ"]
        assert "(process 1)" in errors["replicas_differ"]
        assert "across 2 processes with 4 devices each" in errors["batch_not_divisible"]
        assert "3 rows cannot be split evenly over 2 processes" in errors["not_divisible_by_processes"]
    assert "process 0 holds data shards [0, 2, 4, 6]" in ranks[0]["errors"]["non_contiguous"]
    assert "process 1 holds data shards [1, 3, 5, 7]" in ranks[1]["errors"]["non_contiguous"]


# --- The recipe, in this process and as two processes ------------------------------------------


def test_data_loading_recipe_in_one_process(tmp_path):
    from _recipes import run_recipe

    metrics = run_recipe("data_loading", tmp_path, "--steps", "2", "--batch-size", "32")
    reads = {name: r["reads_per_process"] for name, r in metrics["strategies"].items()}
    # mesh data=2,model=4: per device reads each 16-row shard once per replica (4x).
    assert reads == {
        "1 global, then slice": [32],
        "2 per device": [128],
        "3 per process": [32],
        "4 load, then reshard": [32],
    }
    assert metrics["rows_needed_per_process"] == [32] and metrics["all_equal"]


@pytest.mark.slow
def test_data_loading_recipe_as_two_processes(tmp_path):
    out = tmp_path / "metrics.json"
    flags = ("--mesh", "model=2,data=4", "--steps", "2", "--batch-size", "32", "--metrics-out", str(out))
    run = run_job(2, 4, "recipes/data_loading.py", *flags)
    metrics = json.loads(out.read_text())
    reads = {name: r["reads_per_process"] for name, r in metrics["strategies"].items()}
    # model=2 spans the processes: each process holds all 4 data shards, so it needs all 32
    # rows; the reshard strategy reads half and receives the rest from the other process.
    assert metrics["rows_needed_per_process"] == [32, 32]
    assert reads["3 per process"] == [32, 32] and reads["4 load, then reshard"] == [16, 16]
    assert "[rank 1] process 1 device 2048 {'model': 1, 'data': 0}: batch rows  0..7" in run.stdout
    assert "[rank 0] all four strategies built the same global batch" in run.stdout
