"""eqxpar.checkpoint and the rest of its folder: folders eqxpar did not write survive every
operation byte for byte; a new Checkpointer checks the folder (and the saved run config)
before JAX starts; donated states and meshes that do not divide are refused clearly."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar.checkpoint import Checkpointer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Orbax failing to read the deliberately damaged checkpoint leaves tensorstore callbacks that
# later find its event loop closed: noise, reported as an "unraisable exception".
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _state(seed, mesh):
    w = jax.random.normal(jax.random.key(seed), (16, 6))
    return eqxpar.shard(
        {"w": w, "b": jnp.arange(6.0) + seed, "key": jax.random.key(seed)}, mesh, {"w": P("data"), "b": P(), "key": P()}
    )


def _files(directory, names):
    """Every file under the folders `names` of `directory`: its bytes and modification time."""
    out = {}
    for name in names:
        top = os.path.join(directory, name)
        walked = os.walk(top) if os.path.isdir(top) else [(directory, [], [name])]
        for root, _, files in walked:
            for f in files:
                path = os.path.join(root, f)
                out[path] = (open(path, "rb").read(), os.stat(path).st_mtime_ns)
    return out


def _foreign(directory):
    """A user's results beside the checkpoints: integer-named folders, as orbax names steps."""
    for name, text in [
        ("3/results.csv", "step,loss\n3,0.5\n"),
        ("2024/results.csv", "year\n2024\n"),
        ("8/deep/notes.txt", "not a checkpoint"),
        ("8/meta/other.json", "{}"),
    ]:
        path = os.path.join(directory, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    open(os.path.join(directory, "README"), "w").write("runs of May")
    return ["3", "2024", "8"]


def _corrupt(step_dir):
    for root, _, files in os.walk(os.path.join(step_dir, "state")):
        for name in files:
            path = os.path.join(root, name)
            if os.sep + "d" + os.sep in path:
                data = open(path, "rb").read()
                open(path, "wb").write(data[: len(data) // 2])


def test_folders_eqxpar_did_not_write_survive_save_retention_restore_and_resume(tmp_path):
    mesh = eqxpar.make_mesh(data=8)
    names = _foreign(tmp_path)
    before = _files(tmp_path, [*names, "README"])
    assert len(before) == 5

    # Saves every 2 steps keeping 2: step 2 is deleted by retention, 8 collides with a user's
    # folder (refused before anything is written), 3 is never a save step.
    with pytest.warns(UserWarning, match=r"2024, .*3, .*8 in the checkpoint folder are not eqxpar's"):
        ckpt = Checkpointer(tmp_path, keep=2, save_every=2)
    with ckpt:
        for step in range(1, 7):
            ckpt.maybe_save(step, _state(step, mesh), data_state={"step": step})
        assert ckpt.steps() == [4, 6]
        with pytest.raises(ValueError, match=r"8, where checkpoint 8 goes, is in the way: eqxpar did not write it"):
            ckpt.maybe_save(8, _state(8, mesh))
        ckpt.maybe_save(10, _state(10, mesh), data_state={"step": 10})
        assert ckpt.steps() == [6, 10]
    # Resume: the newest of eqxpar's checkpoints (never the user's 2024/), then a damaged
    # newest one is skipped and removed before the next save, and retention goes on.
    _corrupt(tmp_path / "10")
    with pytest.warns(UserWarning, match="not eqxpar's"):
        ckpt = Checkpointer(tmp_path, keep=2, save_every=2, resume=True)
    with ckpt:
        with pytest.warns(UserWarning, match=r"skipping checkpoint .*10: it cannot be read"):
            restored = ckpt.restore(_state(0, mesh))
        assert (restored.step, restored.data_state) == (6, {"step": 6})
        np.testing.assert_array_equal(np.asarray(restored.state["w"]), np.asarray(_state(6, mesh)["w"]))
        with pytest.warns(UserWarning, match="deleting the unreadable checkpoint"):
            ckpt.maybe_save(10, _state(10, mesh))
        ckpt.maybe_save(12, _state(12, mesh))
        assert ckpt.steps() == [10, 12]
    assert sorted(os.listdir(tmp_path)) == ["10", "12", "2024", "3", "8", "README"]
    assert _files(tmp_path, [*names, "README"]) == before  # byte for byte, never rewritten


def test_donated_state_is_refused_before_anything_is_written(tmp_path):
    mesh = eqxpar.make_mesh(data=8)
    state = _state(1, mesh)
    step = jax.jit(lambda s: jax.tree.map(lambda x: x if x.dtype == state["key"].dtype else x + 1, s), donate_argnums=0)
    new_state = step(state)
    assert state["w"].is_deleted()
    with Checkpointer(tmp_path / "run") as ckpt:
        with pytest.raises(ValueError, match=r"the array at \['b'\] has been deleted.*A train step donates its inputs"):
            ckpt.maybe_save(1, state)
        assert not os.path.exists(tmp_path / "run")  # nothing written, not even the folder
        assert ckpt.maybe_save(1, new_state)  # the state the step returned is what to save


def test_a_mesh_that_does_not_divide_names_the_leaf_and_the_sizes_that_would(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.maybe_save(1, _state(1, eqxpar.make_mesh(data=8)))
    listed = sorted(os.walk(tmp_path))
    like = {
        "b": jax.ShapeDtypeStruct(
            (6,), jnp.float32, sharding=NamedSharding(eqxpar.make_mesh(data=2, model=4), P("model"))
        ),
        "key": jax.random.key(0),
        "w": jax.ShapeDtypeStruct((16, 6), jnp.float32, sharding=NamedSharding(eqxpar.make_mesh(data=8), P("data"))),
    }
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(
            ValueError,
            match=r"does not divide the leaf at \['b'\]: its dimension 0 has size 6, split over model=4 \(4 parts\)"
            r"\. The checkpoint is fine; restore onto a mesh whose model size divides 6 \(one of \[1, 2, 3, 6\]\)",
        ):
            ckpt.restore(like)
        two_axes = NamedSharding(eqxpar.make_mesh(data=2, model=4), P(None, ("data", "model")))
        with pytest.raises(ValueError, match=r"dimension 1 has size 6, split over data=2 x model=4 \(8 parts\)"):
            ckpt.restore(
                {
                    **like,
                    "b": like["b"].update(sharding=NamedSharding(two_axes.mesh, P())),
                    "w": like["w"].update(sharding=two_axes),
                }
            )
        # With a mesh that divides, the same checkpoint restores.
        like["b"] = like["b"].update(sharding=NamedSharding(eqxpar.make_mesh(data=2, model=4), P(None)))
        assert ckpt.restore(like).step == 1
    assert sorted(os.walk(tmp_path)) == listed


def test_the_run_config_is_its_own_item_and_is_checked_when_resuming(tmp_path):
    state = {"w": jnp.ones(4)}
    config = {"dim": 4, "lr": 0.1, "steps": 10}
    with Checkpointer(tmp_path, config=config) as ckpt:
        ckpt.maybe_save(1, state, data_state={"losses": [1.5]})
        assert ckpt.restore(state).data_state == {"losses": [1.5]}  # the data only
    assert json.loads((tmp_path / "1" / "config" / "eqxpar.json").read_text()) == config

    with pytest.raises(ValueError, match=r"checkpoint at step 1 was saved with dim=4, and this run has dim=8"):
        Checkpointer(tmp_path, config={**config, "dim": 8}, shape_fields=("dim",))
    with pytest.warns(UserWarning, match=r"settings that differ .*: lr=0\.2 \(saved: 0\.1\)"):
        Checkpointer(tmp_path, config={**config, "lr": 0.2, "steps": 20}, shape_fields=("dim",), free_fields=("steps",))
    with pytest.raises(
        ValueError,
        match=r"directory .* already holds checkpoints \(steps \[1\]\); nothing was overwritten\. Pass resume=True",
    ):
        Checkpointer(tmp_path, resume=False)
    with pytest.raises(ValueError, match=r"shape_fields/free_fields name \['width'\], which the config does not have"):
        Checkpointer(tmp_path, config=config, shape_fields=("width",))


_BEFORE_JAX = textwrap.dedent(
    """
    import sys
    from eqxpar._compat import backends_started
    from eqxpar.checkpoint import Checkpointer
    for kwargs in ({"resume": False}, {"config": {"dim": 8}, "shape_fields": ("dim",)}):
        try:
            Checkpointer(sys.argv[1], **kwargs)
        except ValueError as e:
            print("refused:", str(e).splitlines()[0])
    print("backends started:", backends_started())
    """
)


def test_the_folder_is_checked_before_jax_starts(tmp_path):
    with Checkpointer(tmp_path, config={"dim": 4}) as ckpt:
        ckpt.maybe_save(1, {"w": jnp.ones(2)})
    out = subprocess.run(
        [sys.executable, "-c", _BEFORE_JAX, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("refused: directory ") and "already holds checkpoints" in lines[0], lines
    assert lines[1].startswith("refused: directory ") and "was saved with dim=4" in lines[1], lines
    assert lines[2] == "backends started: False", lines


def test_no_directory_means_no_checkpoints(tmp_path):
    ckpt = Checkpointer(None, config={"dim": 4})
    state = {"w": jnp.ones(2)}
    assert ckpt.restore(state) == (state, 0, None)
    assert ckpt.maybe_save(5, state, force=True) is False and ckpt.steps() == []
    ckpt.close()
