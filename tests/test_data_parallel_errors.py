"""data_parallel_step and shard_batch: bad input is a ValueError raised before compiling."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqxpar
from eqxpar.train import data_parallel_step, shard_batch

OPTIMIZER = optax.sgd(0.1)


def mean_loss(model, batch, key):
    x, y = batch
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def setup(mesh):
    model = eqx.nn.Linear(3, 2, key=jax.random.key(0))
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_inexact_array))
    return eqxpar.shard((model, opt_state), mesh)


def batch_of(size):
    return np.ones((size, 3), np.float32), np.zeros((size, 2), np.float32)


def test_mesh_without_the_data_axis():
    mesh = eqxpar.make_mesh(model=4)
    with pytest.raises(ValueError, match=r"no axis named 'data'.*axes are \('model',\)"):
        data_parallel_step(mean_loss, OPTIMIZER, mesh)
    with pytest.raises(ValueError, match="no axis named 'batch'"):
        data_parallel_step(mean_loss, OPTIMIZER, eqxpar.make_mesh(data=4), batch_axis="batch")
    with pytest.raises(ValueError, match="no axis named 'data'"):
        shard_batch(batch_of(8), mesh)


def test_bad_grad_accum():
    with pytest.raises(ValueError, match="grad_accum must be a positive integer"):
        data_parallel_step(mean_loss, OPTIMIZER, eqxpar.make_mesh(data=2), grad_accum=0)


@pytest.mark.parametrize(
    "n_data, grad_accum, size, message",
    [
        (4, 1, 6, r"global batch size 6 is not divisible by the 4 shards .* times grad_accum=1 \(= 4\)"),
        (2, 2, 6, r"global batch size 6 is not divisible by the 2 shards .* times grad_accum=2 \(= 4\)"),
    ],
)
def test_batch_not_divisible_is_caught_before_tracing_the_loss(n_data, grad_accum, size, message):
    traced = []

    def loss(model, batch, key):
        traced.append(1)
        return mean_loss(model, batch, key)

    mesh = eqxpar.make_mesh(data=n_data)
    step = data_parallel_step(loss, OPTIMIZER, mesh, grad_accum=grad_accum)
    model, opt_state = setup(mesh)
    with pytest.raises(ValueError, match=message):
        step(model, opt_state, batch_of(size))
    assert not traced


def test_batch_arrays_of_different_sizes():
    mesh = eqxpar.make_mesh(data=2)
    step = data_parallel_step(mean_loss, OPTIMIZER, mesh)
    model, opt_state = setup(mesh)
    x, y = batch_of(8)
    with pytest.raises(ValueError, match="different leading"):
        step(model, opt_state, (x, y[:4]))
    with pytest.raises(ValueError, match="not divisible by the 4 shards"):
        shard_batch(batch_of(6), eqxpar.make_mesh(data=4))


def test_non_scalar_loss():
    mesh = eqxpar.make_mesh(data=2)
    per_example = lambda model, batch, key: jnp.sum((jax.vmap(model)(batch[0]) - batch[1]) ** 2, axis=-1)  # noqa: E731
    step = data_parallel_step(per_example, OPTIMIZER, mesh)
    model, opt_state = setup(mesh)
    with pytest.raises(ValueError, match=r"must return a scalar .* shape \(4,\).*\.mean\(\)"):
        step(model, opt_state, batch_of(8))


def test_stateful_loss_must_return_a_pair():
    mesh = eqxpar.make_mesh(data=2)
    step = data_parallel_step(lambda m, s, b, k: mean_loss(m, b, k), OPTIMIZER, mesh, has_state=True)
    model, opt_state = setup(mesh)
    with pytest.raises(ValueError, match=r"must return a pair \(loss, state\)"):
        step(model, None, opt_state, batch_of(8))


def test_batch_norm_without_the_data_axis():
    """Statistics over one device's shard would make the replicas' running statistics differ."""
    mesh = eqxpar.make_mesh(data=2)
    norm, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, axis_name="batch", mode="batch")

    def loss(norm, state, batch, key):
        out, state = jax.vmap(norm, in_axes=(0, None), out_axes=(0, None), axis_name="batch")(batch[0], state)
        return jnp.mean(out**2), state

    step = data_parallel_step(loss, OPTIMIZER, mesh, has_state=True)
    opt_state = OPTIMIZER.init(eqx.filter(norm, eqx.is_inexact_array))
    with pytest.raises(ValueError, match=r"BatchNorm at model has axis_name='batch'.*axis_name=\('batch', 'data'\)"):
        step(norm, state, opt_state, batch_of(8))


def test_wrong_number_of_arguments():
    mesh = eqxpar.make_mesh(data=2)
    step = data_parallel_step(mean_loss, OPTIMIZER, mesh)
    model, opt_state = setup(mesh)
    with pytest.raises(ValueError, match=r"called as step\(model, opt_state, batch, key\); batch missing"):
        step(model, opt_state)


def _compiles(fn):
    """Run fn, returning how many XLA compiles it caused (to show errors come before any)."""
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logger = logging.getLogger("jax._src.dispatch")
    logger.addHandler(handler)
    try:
        with jax.log_compiles(True):
            fn()
    finally:
        logger.removeHandler(handler)
    return sum("Finished XLA compilation" in m or "Compiling" in m for m in records)


@pytest.mark.parametrize("builder", ["data_parallel_step", "hybrid_step", "fsdp_step"])
def test_call_mistakes_are_named_before_anything_runs(builder):
    """Swapped model and opt_state, an integer seed as the key, a model donated to an
    earlier call: each a ValueError naming the fix, from every builder, with no compile."""
    axis = "fsdp" if builder == "fsdp_step" else "data"
    mesh = eqxpar.make_mesh(**{axis: 2}, model=1) if builder == "hybrid_step" else eqxpar.make_mesh(**{axis: 2})
    step = getattr(eqxpar.train, builder)(mean_loss, OPTIMIZER, mesh, batch_axis=axis)
    model, opt_state = step.init(eqx.nn.Linear(4, 2, key=jax.random.key(0)))
    batch = shard_batch((np.ones((4, 4), np.float32), np.zeros((4, 2), np.float32)), mesh, batch_axis=axis)

    def expect(match, *args, **kwargs):
        with pytest.raises(ValueError, match=match):
            step(*args, **kwargs)

    assert _compiles(lambda: expect(r"model and opt_state look swapped", opt_state, model, batch)) == 0
    assert (
        _compiles(lambda: expect(r"key must be a PRNG key.*jax\.random\.key\(0\)", model, opt_state, batch, key=0)) == 0
    )
    out = []
    # The counter does see compiles: the first good call compiles the step.
    assert _compiles(lambda: out.extend(step(model, opt_state, batch, key=jax.random.key(0)))) > 0
    new_model, new_opt_state, _ = out
    expect(
        rf"{builder}: model leaf \.weight was donated to an earlier call.*keep the ones it returns",
        model,
        opt_state,
        batch,
    )
    # The returned ones work, positionally or with key=.
    step(new_model, new_opt_state, batch, jax.random.key(1))


def test_loss_without_a_key_parameter():
    def no_key(model, batch):
        return mean_loss(model, batch, None)

    with pytest.raises(
        ValueError, match=r"loss_fn\(model, batch\) cannot be called as loss_fn\(model, batch, key\).*key=None"
    ):
        data_parallel_step(no_key, OPTIMIZER, eqxpar.make_mesh(data=2))
    with pytest.raises(ValueError, match=r"optimizer must be an optax GradientTransformation"):
        data_parallel_step(mean_loss, optax.sgd, eqxpar.make_mesh(data=2))


def test_shard_leaves_the_input_usable_after_a_donating_step():
    mesh = eqxpar.make_mesh(data=2)
    step = data_parallel_step(mean_loss, OPTIMIZER, mesh)
    original = eqx.nn.Linear(3, 2, key=jax.random.key(0))
    model, opt_state = step.init(original)
    step(model, opt_state, shard_batch(batch_of(4), mesh))
    assert not original.weight.is_deleted()
