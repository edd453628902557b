"""eqxpar.checkpoint: bitwise round trips, restores across meshes, keep-last-K, async saves,
unreadable and interrupted checkpoints (a real SIGKILL), and bad input."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P
from jax.sharding import SingleDeviceSharding

import eqxpar
from eqxpar.checkpoint import Checkpointer
from eqxpar.testing import mesh_sizes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# When orbax fails to read a damaged checkpoint, tensorstore callbacks still in flight later
# find orbax's event loop closed; Python reports that as an "unraisable exception" during
# whichever test runs then. Noise from the deliberate corruption tests, not a failure.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


# -- a training state with every kind of leaf ---------------------------------------------


class Net(eqx.Module):
    mlp: eqx.nn.MLP  # arrays plus activation functions (non-array leaves)
    dropout: eqx.nn.Dropout  # a Python float and a Python bool leaf
    scale: jax.Array  # bfloat16: dtypes must survive


def _state(seed: int, width: int = 8):
    """(model, SGD-momentum state, Adam state, key, keys, step): optimizer states non-zero."""
    return _make_state(jnp.asarray(seed, jnp.int32), width)


@eqx.filter_jit  # one compile per width instead of many small eager ones
def _make_state(seed, width):
    mkey, key = jax.random.split(jax.random.key(seed))
    mlp = eqx.nn.MLP(4, 2, width_size=width, depth=2, activation=jax.nn.gelu, key=mkey)
    net = Net(mlp, eqx.nn.Dropout(0.1), jnp.full((8,), 1.5 + jnp.asarray(seed).astype(jnp.float32), jnp.bfloat16))
    params = eqx.filter(net, eqx.is_array)
    sgd, adam = optax.sgd(0.1, momentum=0.9), optax.adam(1e-2)
    _, sgd_state = sgd.update(params, sgd.init(params), params)
    _, adam_state = adam.update(params, adam.init(params), params)
    return {
        "model": net,
        "sgd": sgd_state,
        "adam": adam_state,
        "key": key,  # a new-style typed key
        "keys": jax.random.split(jax.random.fold_in(key, 1), 8),
        "step": seed,
    }


def _layout(tree, mesh, axis):
    """Place `tree` on `mesh`: each array split over `axis` along its first divisible
    dimension (replicated if none, or if `axis` is None)."""

    def spec(x):
        if axis is None or not eqx.is_array(x):
            return P()
        for dim, size in enumerate(x.shape):
            if size % mesh.shape[axis] == 0:
                return P(*([None] * dim), axis)
        return P()

    return eqxpar.shard(tree, mesh, jax.tree.map(spec, tree))


def _is_key(x):
    return eqx.is_array(x) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _host(tree):
    return eqxpar.gather(jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree))


def assert_bitwise_equal(actual, expected, what="state"):
    """Same structure, same dtypes (typed keys included), same bytes: stricter than
    assert_trees_close(rtol=0, atol=0), which would let -0.0 == 0.0 and NaN payloads pass."""
    a_dtypes = [getattr(x, "dtype", None) for x in jax.tree.leaves(actual)]
    e_dtypes = [getattr(x, "dtype", None) for x in jax.tree.leaves(expected)]
    assert a_dtypes == e_dtypes, f"{what}: dtypes differ: {a_dtypes} vs {e_dtypes}"
    a_leaves, a_def = jax.tree_util.tree_flatten_with_path(_host(actual))
    e_leaves, e_def = jax.tree_util.tree_flatten_with_path(_host(expected))
    assert a_def == e_def, f"{what}: structures differ"
    for (path, a), (_, e) in zip(a_leaves, e_leaves):
        where = f"{what} at {jax.tree_util.keystr(path)}"
        if isinstance(e, np.ndarray):
            assert type(a) is np.ndarray and a.shape == e.shape, where
            assert a.tobytes() == e.tobytes(), f"{where}: bytes differ"
        else:
            assert a is e or a == e, f"{where}: {a!r} != {e!r}"


def _shardings(tree):
    return [x.sharding for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]


def _disk(directory):
    """Every file under `directory` with its size and modification time."""
    out = {}
    for root, _, files in os.walk(directory):
        for f in files:
            st_ = os.stat(os.path.join(root, f))
            out[os.path.join(root, f)] = (st_.st_size, st_.st_mtime_ns)
    return out


# -- round trip -----------------------------------------------------------------------------


@pytest.mark.parametrize("async_save", [False, True])
def test_round_trip_is_bitwise_and_takes_the_targets_layout(tmp_path, async_save):
    mesh = eqxpar.make_mesh(data=2, model=4)
    host1 = {"host": np.arange(5, dtype=np.int64) * 3, "lr": np.float32(0.25)}  # NumPy leaves
    host2 = {"host": np.arange(5, dtype=np.int64), "lr": np.float32(0.5)}
    state1 = {**_layout(_state(1), mesh, "model"), **host1}
    state2 = {**_layout(_state(2), mesh, "model"), **host2}
    copy = lambda tree: jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, tree)  # noqa: E731
    expected1, expected2 = copy(state1), copy(state2)
    with Checkpointer(tmp_path, keep=None, async_save=async_save) as ckpt:
        assert ckpt.maybe_save(1, state1, data_state={"epoch": 0, "index": [1, 2]})
        if async_save:  # the save must not need the arrays once maybe_save returned
            for x in jax.tree.leaves(state1):
                if isinstance(x, jax.Array):
                    x.delete()
        assert ckpt.maybe_save(2, state2, data_state=None)
        ckpt.wait()
        assert ckpt.steps() == [1, 2]

    # Restore into a differently initialised state on a different layout, whose
    # configuration (dropout rate, inference flag) differs too.
    like = _layout(_state(7), mesh, "data")
    like["model"] = eqx.tree_at(lambda n: n.dropout, like["model"], eqx.nn.Dropout(0.5, inference=True))
    like.update(host=np.zeros(5, np.int64), lr=np.float32(0))
    with Checkpointer(tmp_path) as ckpt:
        newest = ckpt.restore(like)
        restored, step, data_state = ckpt.restore(like, step=1)
        # Going on from the older step must not replace the newer, readable checkpoint.
        with pytest.raises(ValueError, match="already holds a checkpoint for step 2"):
            ckpt.maybe_save(2, like)
        assert ckpt.steps() == [1, 2]
    assert (step, data_state) == (1, {"epoch": 0, "index": [1, 2]})
    assert (newest.step, newest.data_state) == (2, None)
    # Configuration comes from `like`, data from the checkpoint.
    assert restored["model"].dropout.p == 0.5 and restored["model"].dropout.inference is True
    assert restored["model"].mlp.activation is jax.nn.gelu
    assert _shardings(restored) == _shardings(like)
    assert isinstance(restored["host"], np.ndarray) and isinstance(restored["lr"], np.float32)
    expected1["model"] = eqx.tree_at(lambda n: n.dropout, expected1["model"], like["model"].dropout)
    expected2["model"] = eqx.tree_at(lambda n: n.dropout, expected2["model"], like["model"].dropout)
    assert_bitwise_equal(restored, expected1, "restored step 1")
    assert_bitwise_equal(newest.state, expected2, "restored step 2")
    # The comparison can fail: the two saved states are different.
    with pytest.raises(AssertionError):
        assert_bitwise_equal(restored, expected2)


# -- restore across meshes ------------------------------------------------------------------


def _saved_on_data_parallel(directory, seed):
    """Data parallel on 8 devices: every array replicated over `data`."""
    state = _layout(_state(seed), eqxpar.make_mesh(data=8), None)
    with Checkpointer(directory) as ckpt:
        ckpt.maybe_save(3, state)
    return state


@pytest.mark.parametrize("target", ["model=4", "data=2,model=4 split", "one device", "abstract"])
def test_data_parallel_checkpoint_restores_on_other_layouts(tmp_path, target):
    saved = _saved_on_data_parallel(tmp_path, seed=4)
    fresh = _state(5)
    if target == "model=4":
        like = _layout(fresh, eqxpar.make_mesh(model=4), None)
    elif target == "one device":
        like = jax.tree.map(lambda x: jax.device_put(x, jax.devices()[0]) if eqx.is_array(x) else x, fresh)
    else:
        like = _layout(fresh, eqxpar.make_mesh(data=2, model=4), "model")
    if target == "abstract":  # shapes, dtypes and shardings only: nothing initialised
        like = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if eqx.is_array(x) else x,
            like,
        )
    with Checkpointer(tmp_path) as ckpt:
        restored = ckpt.restore(like)
    assert restored.step == 3
    want = [x.sharding for x in jax.tree.leaves(like) if isinstance(x, (jax.Array, jax.ShapeDtypeStruct))]
    assert _shardings(restored.state) == want
    if target == "one device":
        assert all(isinstance(s, SingleDeviceSharding) for s in want)
    if target == "data=2,model=4 split":  # really split, not replicated
        assert restored.state["model"].mlp.layers[0].weight.sharding.spec == P("model")
    assert_bitwise_equal(restored.state, saved, f"restored on {target}")


@given(
    saved_mesh=mesh_sizes(("data", "model")),
    saved_axis=st.sampled_from([None, "data", "model"]),
    target_mesh=mesh_sizes(("data", "model")),
    target_axis=st.sampled_from([None, "data", "model"]),
    seed=st.integers(0, 2**16),
)
def test_restore_on_any_mesh_gives_the_saved_values(
    tmp_path_factory, saved_mesh, saved_axis, target_mesh, target_axis, seed
):
    directory = tmp_path_factory.mktemp("ckpt")
    saved = _layout(_state(seed), eqxpar.make_mesh(**saved_mesh), saved_axis)
    like = _layout(_state(seed + 1), eqxpar.make_mesh(**target_mesh), target_axis)
    with Checkpointer(directory) as ckpt:
        ckpt.maybe_save(1, saved)
        restored = ckpt.restore(like).state
    assert _shardings(restored) == _shardings(like)
    # The single-device reference: the saved state gathered to the host.
    assert_bitwise_equal(
        restored, saved, f"saved on {saved_mesh}/{saved_axis}, restored on {target_mesh}/{target_axis}"
    )


# -- keep, save_every, async ----------------------------------------------------------------


def test_keeps_the_last_k_and_saves_every_n(tmp_path):
    state = _layout(_state(0), eqxpar.make_mesh(data=8), None)
    with Checkpointer(tmp_path, keep=2, save_every=3, async_save=True) as ckpt:
        saved = [s for s in range(1, 11) if ckpt.maybe_save(s, state, data_state={"step": s})]
        assert saved == [3, 6, 9]
        assert ckpt.maybe_save(10, state, data_state={"step": 10}, force=True)  # a run's last step
        ckpt.wait()
        assert ckpt.steps() == [9, 10]
    assert sorted(os.listdir(tmp_path)) == ["10", "9"]
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.restore(state).data_state == {"step": 10}


def test_a_data_state_function_is_called_only_when_a_checkpoint_is_saved(tmp_path):
    """`data_state` may be a function (the recipes' `RunLog.data_state`, which fetches the
    losses from the device): called on the steps that save, never on the others."""
    state = _layout(_state(0), eqxpar.make_mesh(data=8), None)
    calls = []

    def data_state():
        calls.append(len(calls))
        return {"calls": len(calls)}

    with Checkpointer(tmp_path, save_every=3) as ckpt:
        saved = [s for s in range(1, 8) if ckpt.maybe_save(s, state, data_state=data_state)]
    assert saved == [3, 6] and calls == [0, 1]
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.restore(state).data_state == {"calls": 2}


def test_resume_continues_bitwise_like_an_uninterrupted_run(tmp_path):
    """The in-process form of kill-and-resume: train 4 steps with checkpoints, stop, resume
    from the newest checkpoint in a new Checkpointer, train to 7: same bits as 7 straight."""
    mesh = eqxpar.make_mesh(data=8)
    optimizer = optax.adam(1e-2)

    @eqx.filter_jit
    def train_step(model, opt_state, key, step):
        batch_key = jax.random.fold_in(key, step)  # the data order is a function of the step
        x = jax.random.normal(batch_key, (16, 4))
        y = jnp.sin(x[:, :2])
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(model)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state

    def init():
        model = eqx.nn.MLP(4, 2, 16, 2, key=jax.random.key(0))
        opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
        return eqxpar.shard((model, opt_state, jax.random.key(1)), mesh)

    def run(steps, ckpt=None):
        state, start = init(), 0
        if ckpt is not None:
            state, start, _ = ckpt.restore(state)
        model, opt_state, key = state
        for step in range(start, steps):
            model, opt_state = train_step(model, opt_state, key, jnp.asarray(step))
            if ckpt is not None:
                ckpt.maybe_save(step + 1, (model, opt_state, key))
        return model, opt_state, key

    straight = run(7)
    with Checkpointer(tmp_path, save_every=2, async_save=True) as ckpt:
        run(5, ckpt)  # checkpoints at 2 and 4, then the run "dies" after step 5
    with Checkpointer(tmp_path, save_every=2) as ckpt:
        assert ckpt.steps() == [2, 4]
        resumed = run(7, ckpt)
    assert_bitwise_equal(resumed, straight, "resumed run")
    with pytest.raises(AssertionError):  # the comparison sees a single extra step
        assert_bitwise_equal(resumed[0], train_step(straight[0], straight[1], straight[2], jnp.asarray(7))[0])


# -- unreadable and interrupted checkpoints -------------------------------------------------


def _corrupt(step_dir, how):
    for root, _, files in os.walk(os.path.join(step_dir, "state")):
        for name in files:
            path = os.path.join(root, name)
            if os.sep + "d" + os.sep not in path:
                continue
            data = bytearray(open(path, "rb").read())
            if how == "truncated":
                data = data[: len(data) // 2]
            else:  # one flipped byte in every data file
                data[len(data) // 2] ^= 0xFF
            open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "flipped byte"])
def test_unreadable_newest_checkpoint_is_skipped_with_a_warning(tmp_path, how):
    mesh = eqxpar.make_mesh(data=8)
    states = {s: _layout(_state(s), mesh, "data") for s in (1, 2, 3)}
    with Checkpointer(tmp_path, keep=None) as ckpt:
        for s, state in states.items():
            ckpt.maybe_save(s, state, data_state={"s": s})
    _corrupt(tmp_path / "3", how)
    like = _layout(_state(0), mesh, None)

    with Checkpointer(tmp_path, keep=None) as ckpt:
        with pytest.raises(ValueError, match=r"checkpoint .*3 cannot be read"):
            ckpt.restore(like, step=3)
        with pytest.warns(UserWarning, match=r"skipping checkpoint .*3: it cannot be read"):
            restored = ckpt.restore(like)
        assert (restored.step, restored.data_state) == (2, {"s": 2})
        assert_bitwise_equal(restored.state, states[2])
        # The run goes on from step 2; its next save at step 3 replaces the unreadable one.
        with pytest.warns(UserWarning, match="deleting the unreadable checkpoint"):
            ckpt.maybe_save(3, states[3], data_state={"s": 3})
        assert_bitwise_equal(ckpt.restore(like).state, states[3])

    for s in (1, 2, 3):
        _corrupt(tmp_path / str(s), how)
    before = _disk(tmp_path)
    with Checkpointer(tmp_path) as ckpt:
        with pytest.warns(UserWarning), pytest.raises(ValueError, match="none of the 3 checkpoint"):
            ckpt.restore(like)
    assert _disk(tmp_path) == before  # nothing changed on disk


def test_data_states_of_another_process_count(tmp_path):
    """Saved by 2 processes, restored by 1: only possible when both saved the same position.
    (The arrays themselves restore across process counts: orbax stores logical arrays.)"""
    state = {"w": jnp.arange(4.0)}
    with Checkpointer(tmp_path) as ckpt:
        ckpt.maybe_save(1, state, data_state={"index": 64})
    data = tmp_path / "1" / "data"
    os.remove(data / "process_0-of-1.json")
    for rank in range(2):
        (data / f"process_{rank}-of-2.json").write_text(json.dumps({"index": 64}))
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.restore(state).data_state == {"index": 64}
    (data / "process_1-of-2.json").write_text(json.dumps({"index": 96}))
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(ValueError, match="saved by 2 processes with different data states"):
            ckpt.restore(state)


_KILLED_CHILD = textwrap.dedent(
    """
    import asyncio, sys, time
    import eqxpar
    eqxpar.simulate_cpu_devices(8)
    import jax
    from jax.sharding import PartitionSpec as P
    from eqxpar.checkpoint import Checkpointer
    from eqxpar.checkpoint._orbax import PerProcessJsonHandler

    directory, where = sys.argv[1], sys.argv[2]
    mesh = eqxpar.make_mesh(data=8)

    def state(seed):
        return eqxpar.shard({"w": jax.random.normal(jax.random.key(seed), (256, 256)),
                             "key": jax.random.key(seed)}, mesh, {"w": P("data"), "key": P()})

    def stall(message):
        print(message, flush=True)
        time.sleep(600)

    ckpt = Checkpointer(directory, async_save=True)
    ckpt.maybe_save(1, state(1), data_state={"step": 1})
    ckpt.wait()
    if where == "part-way":  # stop inside the save, its folder made but not filled
        PerProcessJsonHandler.save = lambda self, directory, args: stall("STALLED")
    else:  # everything written; stop just before the rename that commits the checkpoint
        from orbax.checkpoint._src.path import async_path
        rename = async_path.rename
        async def stalled_rename(src, dst):
            if dst.name == "2":
                stall("STALLED")
            return await rename(src, dst)
        async_path.rename = stalled_rename
    ckpt.maybe_save(2, state(2), data_state={"step": 2})
    ckpt.wait()
    """
)


@pytest.mark.parametrize("where", ["part-way", "before the commit"])
def test_sigkill_during_a_save_leaves_the_previous_checkpoint(tmp_path, where):
    directory = tmp_path / "ckpt"
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_CHILD, str(directory), where],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        line = ""
        while "STALLED" not in line and time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line and child.poll() is not None:
                break
        assert "STALLED" in line, f"the child never reached the save (exit code {child.poll()})"
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()

    left = sorted(os.listdir(directory))
    assert "1" in left and "2" not in left
    assert any(name.startswith("2.orbax-checkpoint-tmp") for name in left), left

    mesh = eqxpar.make_mesh(data=8)

    def state(seed):  # the child's states, computed again here
        return eqxpar.shard(
            {"w": jax.random.normal(jax.random.key(seed), (256, 256)), "key": jax.random.key(seed)},
            mesh,
            {"w": P("data"), "key": P()},
        )

    with Checkpointer(directory) as ckpt:
        assert ckpt.steps() == [1]
        restored = ckpt.restore(state(0))
        assert (restored.step, restored.data_state) == (1, {"step": 1})
        assert_bitwise_equal(restored.state, state(1))
        ckpt.maybe_save(2, state(2))  # the directory goes on working,
        assert_bitwise_equal(ckpt.restore(state(0)).state, state(2))
    assert sorted(os.listdir(directory)) == ["1", "2"]  # and the unfinished save is gone


# -- bad input --------------------------------------------------------------------------------


def test_mismatched_targets_name_the_first_differing_leaf(tmp_path):
    mesh = eqxpar.make_mesh(data=8)
    saved = _layout(_state(0), mesh, None)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.maybe_save(5, saved)
    before = _disk(tmp_path)

    wider = _layout(_state(0, width=16), mesh, None)
    no_adam = {k: v for k, v in saved.items() if k != "adam"}
    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if eqx.is_array(x) and x.dtype == jnp.float32 else x, saved)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if eqx.is_array(x) else x, saved)
    cases = [
        (
            wider,
            (
                r"leaf \['adam'\]\[0\]\.mu\.mlp\.layers\[0\]\.weight differs: "
                r"saved shape \(8, 4\) float32, target shape \(16, 4\) float32"
            ),
        ),
        (
            no_adam,
            (
                r"differ in structure at leaf 0: the checkpoint has \['adam'\]\[0\]\.count \(shape \(\) int32\) "
                r"where the target has \['key'\]"
            ),
        ),
        (
            half,
            (
                r"\['adam'\]\[0\]\.mu\.mlp\.layers\[0\]\.weight differs: "
                r"saved shape \(8, 4\) float32, target shape \(8, 4\) bfloat16"
            ),
        ),
        (abstract, r"ShapeDtypeStruct without a sharding"),
    ]
    with Checkpointer(tmp_path) as ckpt:
        for like, message in cases:
            with pytest.raises(ValueError, match=message):
                ckpt.restore(like)
        with pytest.raises(ValueError, match=r"no complete checkpoint for step 4; complete checkpoints: \[5\]"):
            ckpt.restore(saved, step=4)
        with pytest.raises(ValueError, match="already holds a checkpoint for step 5; nothing was overwritten"):
            ckpt.maybe_save(5, saved)
    assert _disk(tmp_path) == before


def test_bad_arguments_are_refused_before_anything_is_written(tmp_path):
    state = {"w": jnp.ones(4)}
    for kwargs, message in [
        ({"keep": 0}, "keep must be a positive integer or None"),
        ({"save_every": 0}, "save_every must be a positive integer"),
    ]:
        with pytest.raises(ValueError, match=message):
            Checkpointer(tmp_path, **kwargs)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file"):
        Checkpointer(tmp_path / "file")

    with Checkpointer(tmp_path / "run") as ckpt:
        with pytest.raises(ValueError, match="fresh start, but `like` is abstract"):
            ckpt.restore({"w": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=state["w"].sharding)})
        fresh = ckpt.restore(state)  # an empty folder: a fresh start
        assert fresh.state is state and fresh.step == 0 and fresh.data_state is None
        with pytest.raises(ValueError, match=r"would not come back unchanged from JSON"):
            ckpt.maybe_save(1, state, data_state={"epoch": (1, 2)})
        with pytest.raises(ValueError, match="must be a JSON value"):
            ckpt.maybe_save(1, state, data_state={"rng": np.ones(2)})
        with pytest.raises(ValueError, match="holds no arrays"):
            ckpt.maybe_save(1, {"lr": 0.1})
        with pytest.raises(ValueError, match="is a traced value"):
            jax.jit(lambda w: ckpt.maybe_save(1, {"w": w}) and w)(state["w"])
        with pytest.raises(ValueError, match="non-negative integer"):
            ckpt.maybe_save(-1, state)
        assert ckpt.steps() == []
    assert [n for n in os.listdir(tmp_path / "run") if n[0].isdigit()] == []
    with pytest.raises(ValueError, match="is closed"):
        ckpt.maybe_save(1, state)
