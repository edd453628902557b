"""filter_shard_map: parity with one device over drawn meshes, Modules in and out, errors."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar.testing import assert_trees_close, mesh_sizes, on_one_device


def _batched(model, x):
    return jax.vmap(model)(x)


@given(
    sizes=mesh_sizes(("data",)) | mesh_sizes(("data", "model")),
    per_device=st.sampled_from([1, 3]),
    features=st.sampled_from([(5, 3), (16, 8)]),
    split_all_axes=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_mlp_over_sharded_batch_equals_one_device(sizes, per_device, features, split_all_axes, seed):
    mesh = eqxpar.make_mesh(**sizes)
    axes = tuple(sizes) if split_all_axes else ("data",)
    n_split = int(np.prod([sizes[a] for a in axes]))
    in_size, out_size = features
    mkey, xkey = jax.random.split(jax.random.key(seed))
    model = eqx.nn.MLP(in_size, out_size, width_size=8, depth=2, activation=jax.nn.gelu, key=mkey)
    x = jax.random.normal(xkey, (n_split * per_device, in_size))

    batch_spec = P(axes)
    parallel = eqx.filter_jit(
        eqxpar.filter_shard_map(_batched, mesh=mesh, in_specs=(P(), batch_spec), out_specs=batch_spec)
    )
    got = parallel(eqxpar.shard(model, mesh), eqxpar.shard(x, mesh, batch_spec))
    assert got.sharding.is_equivalent_to(NamedSharding(mesh, batch_spec), got.ndim)
    assert_trees_close(got, on_one_device(_batched, model, x), what="MLP output")


def test_per_leaf_spec_tree_and_explicit_psum_equal_dense_linear():
    """A Linear whose weight is split over its input features, summed with psum."""
    mesh = eqxpar.make_mesh(model=4)
    lin = eqx.nn.Linear(8, 3, key=jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (8,))
    specs = eqx.tree_at(lambda m: (m.weight, m.bias), lin, (P(None, "model"), P()))

    def local(lin, x):
        return jax.lax.psum(lin.weight @ x, "model") + lin.bias

    f = eqxpar.filter_shard_map(local, mesh=mesh, in_specs=(specs, P("model")), out_specs=P())
    assert_trees_close(f(eqxpar.shard(lin, mesh, specs), x), lin(x))


def test_missing_psum_is_caught_by_parity():
    """The parity check fails when the collective is left out (so it can fail at all)."""
    mesh = eqxpar.make_mesh(model=4)
    lin = eqx.nn.Linear(8, 3, use_bias=False, key=jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (8,))
    specs = eqx.tree_at(lambda m: m.weight, lin, P(None, "model"))
    f = eqxpar.filter_shard_map(
        lambda lin, x: lin.weight @ x, mesh=mesh, in_specs=(specs, P("model")), out_specs=P(), check_vma=False
    )
    with pytest.raises(AssertionError, match="differ"):
        assert_trees_close(f(lin, x), lin(x))


def test_module_outputs_keep_non_array_leaves():
    mesh = eqxpar.make_mesh(data=2)
    model = eqx.nn.MLP(3, 2, 4, 1, activation=jax.nn.tanh, key=jax.random.key(0))

    def scale(m):
        return jax.tree.map(lambda w: w * 2 if eqx.is_array(w) else w, m)

    out = eqxpar.filter_shard_map(scale, mesh=mesh, in_specs=(P(),), out_specs=P())(model)
    assert out.activation is jax.nn.tanh
    assert_trees_close(out, scale(model))


def test_python_scalars_are_closed_over():
    mesh = eqxpar.make_mesh(data=4)
    f = eqxpar.filter_shard_map(lambda x, k: x * k, mesh=mesh, in_specs=(P("data"), None), out_specs=P("data"))
    np.testing.assert_array_equal(np.asarray(f(jnp.arange(8.0), 3)), np.arange(8.0) * 3)


@pytest.mark.parametrize(
    "in_specs, x_shape, message",
    [
        ((P("nope"),), (8,), "names axis 'nope', which is not in the mesh"),
        ((P("data", None, None),), (8, 2), "has 3 entries but the array has rank 2"),
        ((P("data"),), (6, 2), "dimension 0 has size 6, which is not divisible by 4"),
        (({"a": P()},), (8,), "does not match the structure"),
        ((P(), P()), (8,), "in_specs has 2 entries but the function was called with 1"),
        ((P(("data", "data")),), (8,), "uses mesh axis 'data' twice"),
    ],
)
def test_errors_are_raised_before_tracing(in_specs, x_shape, message):
    mesh = eqxpar.make_mesh(data=4)
    traced = []

    def fn(x):
        traced.append(True)
        return x

    f = eqxpar.filter_shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=P())
    with pytest.raises(ValueError, match=message):
        f(jnp.zeros(x_shape))
    assert not traced


def test_explicit_mesh_needs_placed_inputs():
    mesh = eqxpar.make_mesh(axis_type="explicit", data=8)
    f = eqxpar.filter_shard_map(lambda x: 2 * x, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    with pytest.raises(ValueError, match="Explicit axes.*eqxpar.shard"):
        f(jnp.ones((8, 2)))
    np.testing.assert_array_equal(np.asarray(f(eqxpar.shard(jnp.ones((8, 2)), mesh, P("data")))), 2 * np.ones((8, 2)))


def test_wrapping_an_equinox_transform_under_filter_jit_gives_no_warning():
    import warnings

    mesh = eqxpar.make_mesh(data=2)
    grad = eqx.filter_grad(lambda w, x: jax.lax.psum(jnp.sum(w[None] * x), "data"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f = eqx.filter_jit(eqxpar.filter_shard_map(grad, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
    np.testing.assert_allclose(np.asarray(f(jnp.ones(3), jnp.ones((2, 3)))), [2.0, 2.0, 2.0])


# --- out_specs -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "out_specs, message",
    [
        (P("nope"), r"out_specs at <root>: PartitionSpec P\('nope',\) names axis 'nope', which is not in the mesh"),
        ({"a": P(("data", "data"))}, r"out_specs at \['a'\]: PartitionSpec .* uses mesh axis 'data' twice"),
    ],
)
def test_out_specs_axes_are_checked_when_the_function_is_built(out_specs, message):
    mesh = eqxpar.make_mesh(data=4)
    with pytest.raises(ValueError, match=message):
        eqxpar.filter_shard_map(lambda x: x, mesh=mesh, in_specs=P("data"), out_specs=out_specs)


@pytest.mark.parametrize(
    "out_specs, fn, message",
    [
        # Structure: a spec tree that is not a prefix of the output.
        ((P("data"), P()), lambda x: {"a": x}, r"out_specs \(for the function's output\) does not match the structure"),
        # Rank: more entries than the output has dimensions.
        (
            P("data", None, None),
            lambda x: x,
            (
                r"out_specs for output <root>: PartitionSpec P\('data', None, None\) has 3 entries "
                r"but the output has rank 2"
            ),
        ),
        # Varying: P() promises one value for all devices, but the output differs per device.
        (
            {"sum": P(), "rows": P()},
            lambda x: {"sum": jax.lax.psum(x, "data"), "rows": x},
            (
                r"out_specs for output \['rows'\]: PartitionSpec P\(\) says the output is the same on every device "
                r"along mesh axes \('data',\).*jax.lax.psum or pmean over 'data'.*P\('data'\)"
            ),
        ),
        # Not a spec where the output is an array.
        (
            {"a": P("data"), "b": jax.nn.relu},
            lambda x: {"a": x, "b": x},
            r"out_specs for output \['b'\] is .* not a PartitionSpec",
        ),
    ],
)
def test_out_specs_are_checked_against_the_traced_outputs_before_compiling(out_specs, fn, message):
    mesh = eqxpar.make_mesh(data=4)
    f = eqxpar.filter_shard_map(fn, mesh=mesh, in_specs=P("data"), out_specs=out_specs)
    # jit(...).trace only traces: raising there means nothing was lowered or compiled.
    with pytest.raises(ValueError, match=message):
        jax.jit(f).trace(jnp.zeros((8, 2)))
    with pytest.raises(ValueError, match=message):
        eqx.filter_jit(f)(jnp.zeros((8, 2)))


def test_out_specs_none_is_replicated_and_non_array_outputs_take_any_spec():
    """None in out_specs is P(); a function (a non-array output) may sit under any spec."""
    mesh = eqxpar.make_mesh(data=4)
    x = jnp.arange(16.0).reshape(8, 2)

    def fn(x):
        return {"total": jax.lax.psum(x.sum(0), "data"), "rows": 2 * x, "act": jax.nn.relu}

    f = eqxpar.filter_shard_map(
        fn, mesh=mesh, in_specs=P("data"), out_specs={"total": None, "rows": P("data"), "act": jax.nn.relu}
    )
    out = f(eqxpar.shard(x, mesh, P("data")))
    np.testing.assert_array_equal(np.asarray(out["total"]), np.asarray(x.sum(0)))
    np.testing.assert_array_equal(np.asarray(out["rows"]), 2 * np.asarray(x))
    assert out["act"] is jax.nn.relu
    # Without the psum the total is only each device's share; the spec check says so.
    partial = eqxpar.filter_shard_map(lambda x: x.sum(0), mesh=mesh, in_specs=P("data"), out_specs=None)
    with pytest.raises(ValueError, match="varies over them"):
        partial(x)
    # check_vma=False trusts the caller: each device's share comes back, not the total.
    unchecked = eqxpar.filter_shard_map(
        lambda x: x.sum(0), mesh=mesh, in_specs=P("data"), out_specs=None, check_vma=False
    )
    assert not np.allclose(np.asarray(unchecked(x)), np.asarray(x.sum(0)))


def test_jax_errors_about_out_specs_the_checks_missed_come_back_as_value_errors(monkeypatch):
    """A JAX that hides which axes a value varies over: JAX's own check fires, reworded."""
    import eqxpar._shard_map

    monkeypatch.setattr(eqxpar._shard_map, "varying_axes", lambda leaf: frozenset())
    mesh = eqxpar.make_mesh(data=4)
    f = eqxpar.filter_shard_map(lambda x: x, mesh=mesh, in_specs=P("data"), out_specs=P())
    with pytest.raises(ValueError, match=r"^filter_shard_map: out_specs do not fit .*jax.lax.psum/pmean.*JAX reported"):
        f(jnp.zeros((8, 2)))
