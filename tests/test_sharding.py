"""Placing Modules on a mesh by spec trees, gathering them back, and the per-leaf report."""

import equinox as eqx
import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar.testing import assert_trees_close, mesh_sizes


def _mlp(seed, width):
    return eqx.nn.MLP(8, 4, width_size=width, depth=2, activation=jax.nn.relu, key=jax.random.key(seed))


@given(sizes=mesh_sizes(("data", "model")), seed=st.integers(0, 2**16), split=st.booleans())
def test_shard_then_gather_is_identity(sizes, seed, split):
    mesh = eqxpar.make_mesh(**sizes)
    model = _mlp(seed, width=8 * sizes["model"])
    if split:  # hidden weights split over model (rows), biases replicated
        specs = jax.tree.map(lambda w: P("model") if eqx.is_array(w) and w.ndim == 2 else P(), model)
        specs = eqx.tree_at(lambda s: s.layers[-1].weight, specs, P(None, "model"))
    else:
        specs = P()
    placed = eqxpar.shard(model, mesh, specs)
    for leaf, spec in zip(jax.tree.leaves(placed), eqxpar.broadcast_specs(specs, model)):
        if eqx.is_array(leaf):
            assert leaf.sharding == NamedSharding(mesh, spec)
    back = eqxpar.gather(placed)
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(eqx.filter(back, eqx.is_array)))
    assert back.activation is jax.nn.relu
    assert_trees_close(back, model, rtol=0, atol=0, what="gathered model")


def test_report_rows_and_bytes():
    mesh = eqxpar.make_mesh(data=2, model=4)
    lin = eqx.nn.Linear(8, 16, key=jax.random.key(0))
    placed = eqxpar.shard(lin, mesh, eqx.tree_at(lambda m: (m.weight, m.bias), lin, (P("model"), P())))
    report = eqxpar.sharding_report(placed)
    rows = {r.path: r for r in report.rows}
    assert rows[".weight"].shape == (16, 8)
    assert rows[".weight"].bytes_total == 16 * 8 * 4
    assert rows[".weight"].bytes_per_device == 16 * 8 * 4 // 4
    assert rows[".weight"].spec == str(P("model"))
    assert rows[".bias"].bytes_per_device == 16 * 4
    assert report.bytes_per_device == 16 * 8 + 64
    text = str(report)
    assert ".weight" in text and "TOTAL" in text and "P('model',)" in text


@pytest.mark.parametrize(
    "specs, message",
    [
        (P("fsdp"), "not in the mesh"),
        (P(None, None, "model"), "has 3 entries but the array has rank"),
        (P(None, "model"), "dimension 1 has size 6, which is not divisible by 4"),
        ([P(), P()], "does not match the structure"),
    ],
)
def test_shard_errors_name_leaf_and_fix(specs, message):
    mesh = eqxpar.make_mesh(model=4)
    lin = eqx.nn.Linear(6, 4, key=jax.random.key(0))
    with pytest.raises(ValueError, match=message) as info:
        eqxpar.shard(lin, mesh, specs)
    if "structure" not in message:
        assert ".weight" in str(info.value)
