"""The seed recipes: each runs and reports a match; their parallel code equals one device.

The property tests call the recipes' own functions (loaded from `recipes/*.py`), so what is
tested is what a user runs.
"""

import jax
import pytest
from _recipes import load_recipe, run_recipe
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar.testing import assert_trees_close, mesh_sizes, on_one_device

# The seed recipes are plain JAX written as a tutorial writes it (`x @ w + b` with a (n,) bias),
# not eqxpar's library code, which the strict settings in conftest.py are for.
pytestmark = pytest.mark.allow_rank_promotion

# Loaded once: the recipes' jitted functions then keep their compile caches across examples.
three_ways = load_recipe("three_ways")
pmap_recipe = load_recipe("pmap_data_parallel")


# ---- The recipes run and say they matched --------------------------------------------------
def test_sharding_basics_recipe(tmp_path):
    m = run_recipe("sharding_basics", tmp_path)
    assert m["all_checks_pass"], m["checks"]
    assert m["block_shape"] == [2, 2]
    # The sum over the rows lives on both devices of each column of the 2x4 mesh.
    assert m["contract_replicas_per_block"] == 2
    assert m["shard_map_local_shape"] == [4]
    assert m["psum_total"] == m["expected_total"] == sum(range(32))
    assert sum(m["per_block_sums"]) == m["psum_total"] and len(m["per_block_sums"]) == 8


def test_three_ways_recipe_reproduces_the_tutorial(tmp_path, capsys):
    m = run_recipe("three_ways", tmp_path)
    assert m["ways_match_single_device"]
    assert m["matches_tutorial"] is True
    assert m["max_abs_error_vs_tutorial"] <= three_ways.TUTORIAL_ATOL
    printed = capsys.readouterr().out
    for name in ("single device", "jit", "constraint", "shard_map", "tutorial"):
        assert f"{name}: [" in printed


def test_three_ways_recipe_on_fewer_devices_and_another_seed(tmp_path):
    m = run_recipe("three_ways", tmp_path, "--mesh", "x=4", "--seed", "5")
    assert m["mesh"] == {"x": 4}
    assert m["ways_match_single_device"]
    assert m["matches_tutorial"] is None  # the tutorial printed seed 0 only


def test_pmap_recipe(tmp_path):
    m = run_recipe("pmap_data_parallel", tmp_path, "--mesh", "data=4", "--per-device-batch", "4")
    assert m["all_match"], m["matches_single_device"]
    assert m["pmap_output_shape"] == [4, 4, 10]
    assert m["shard_map_output_shape"] == [16, 10]
    assert m["shard_map_output_spec"] == "P('data',)"


# ---- Three ways == one device --------------------------------------------------------------
@given(
    sizes=mesh_sizes(("x",)),
    features=st.sampled_from([8, 32]),  # divisible by every drawn device count (1, 2, 4, 8)
    outputs=st.sampled_from([1, 4]),
    seed=st.integers(0, 2**16),
)
def test_three_ways_equal_single_device_layer(sizes, features, outputs, seed):
    mesh = eqxpar.make_mesh(**sizes)
    x, weights, bias = three_ways.make_inputs(seed, features, outputs)
    expected = on_one_device(three_ways.layer, x, weights, bias)
    for name, way in three_ways.WAYS.items():
        assert_trees_close(way(mesh, x, weights, bias), expected, what=f"way {name!r}")


def test_shard_map_way_without_psum_is_caught():
    """Each device's partial product alone (the psum left out) fails the parity check."""
    mesh = eqxpar.make_mesh(x=4)
    x, weights, bias = three_ways.make_inputs(0)
    no_psum = jax.shard_map(
        lambda xb, wb, b: jax.nn.sigmoid(xb @ wb + b),
        mesh=mesh,
        in_specs=(P("x"), P("x", None), P()),
        out_specs=P(),
        check_vma=False,  # with the check on, JAX refuses the varying output itself
    )
    with pytest.raises(AssertionError, match="differ"):
        assert_trees_close(no_psum(x, weights, bias), on_one_device(three_ways.layer, x, weights, bias))


def test_doubled_psum_is_caught():
    """Summing twice multiplies the product by the device count: the parity check sees it."""
    mesh = eqxpar.make_mesh(x=4)
    x, weights, bias = three_ways.make_inputs(0)

    def twice(xb, wb, b):
        return three_ways.layer_per_device(xb, jax.lax.psum(wb, "x"), b, "x")

    doubled = jax.shard_map(twice, mesh=mesh, in_specs=(P("x"), P("x", None), P()), out_specs=P())
    with pytest.raises(AssertionError, match="differ"):
        assert_trees_close(doubled(x, weights, bias), on_one_device(three_ways.layer, x, weights, bias))


# ---- pmap == shard_map == one device -------------------------------------------------------
@given(
    sizes=mesh_sizes(("data",)),
    per_device=st.sampled_from([1, 3]),
    shape=st.sampled_from([(5, 3), (64, 10)]),
    seed=st.integers(0, 2**16),
)
def test_pmap_and_shard_map_equal_single_device(sizes, per_device, shape, seed):
    mesh = eqxpar.make_mesh(**sizes)
    devices = list(mesh.devices.flat)
    features, classes = shape
    pkey, xkey = jax.random.split(jax.random.key(seed))
    params = pmap_recipe.init_params(pkey, features, classes)
    batch = jax.random.normal(xkey, (mesh.size * per_device, features))

    expected = on_one_device(pmap_recipe.predict, params, batch)
    stacked, flat = pmap_recipe.pmap_predict(devices, params, batch)
    assert stacked.shape == (mesh.size, per_device, classes)
    assert_trees_close(flat, expected, what="pmap")
    assert_trees_close(pmap_recipe.shard_map_predict(mesh, params, batch), expected, what="shard_map")

    expected_mean = on_one_device(pmap_recipe.batch_mean_logits, params, batch)
    assert_trees_close(pmap_recipe.pmap_mean_logits(devices, params, batch), expected_mean, what="pmap pmean")
    assert_trees_close(pmap_recipe.shard_map_mean_logits(mesh, params, batch), expected_mean, what="shard_map pmean")


def test_mean_without_pmean_is_caught():
    """Each device's own batch mean (the pmean left out) fails the parity check."""
    mesh = eqxpar.make_mesh(data=4)
    params = pmap_recipe.init_params(jax.random.key(0), 5, 3)
    batch = jax.random.normal(jax.random.key(1), (8, 5))
    local_only = eqxpar.filter_shard_map(
        pmap_recipe.batch_mean_logits,
        mesh=mesh,
        in_specs=(P(), P("data")),
        out_specs=P(),
        check_vma=False,  # with the check on, JAX refuses the varying output itself
    )
    expected = on_one_device(pmap_recipe.batch_mean_logits, params, batch)
    with pytest.raises(AssertionError, match="differ"):
        assert_trees_close(local_only(params, batch), expected)
