"""Mixed precision (`eqxpar.train.Precision`) under every strategy.

- The default policy is no policy: float32 results are bit for bit those of a step built
  without `precision=`.
- bfloat16 compute really computes in bfloat16 (the compiled step's matmuls say so), and its
  loss curve stays within a stated tolerance of float32's over 100 steps; so do the
  300-step recipe runs drawn on the hybrid_gpt docs page (docs/data/losses/precision/).
- `reduce_dtype=bfloat16` halves the gradient bytes crossing devices (read from the compiled
  program), and float32 reduction is the default.
"""

import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _gpt_reference import loss_fn, tiny_gpt, token_batch

import eqxpar
from eqxpar.inspect import CommReport
from eqxpar.train import Precision, data_parallel_step, fsdp_step, hybrid_step, shard_batch

BF16 = Precision(compute_dtype=jnp.bfloat16)


@functools.cache
def mesh(**sizes):
    return eqxpar.make_mesh(**sizes)


def run(step, steps, axis="data"):
    model, opt_state = step.init(tiny_gpt(0))
    losses = []
    for i in range(steps):
        model, opt_state, metrics = step(model, opt_state, shard_batch(token_batch(8, i), step.mesh, batch_axis=axis))
        losses.append(float(metrics["loss"]))
    return model, np.array(losses)


# The FSDP step casts on the gathered weights as well: the default run's case; hybrid under thorough.
@pytest.mark.parametrize(
    "builder, axes",
    [
        pytest.param(hybrid_step, {"data": 2, "model": 4}, marks=pytest.mark.thorough),
        (fsdp_step, {"fsdp": 4, "model": 2}),
    ],
)
def test_float32_policy_is_bitwise_the_default(builder, axes):
    axis = next(iter(axes))
    m = mesh(**axes)
    explicit = Precision(compute_dtype=jnp.float32, reduce_dtype=jnp.float32)
    a_model, a = run(builder(loss_fn, optax.adamw(3e-3), m, batch_axis=axis), 3, axis)
    b_model, b = run(builder(loss_fn, optax.adamw(3e-3), m, batch_axis=axis, precision=explicit), 3, axis)
    np.testing.assert_array_equal(a, b)
    for x, y in zip(jax.tree.leaves(eqxpar.gather(a_model)), jax.tree.leaves(eqxpar.gather(b_model))):
        np.testing.assert_array_equal(x, y)


@pytest.mark.standard_promotion  # jax.nn.dot_product_attention in bfloat16 (tests/conftest.py)
def test_bfloat16_compute_tracks_float32_over_100_steps():
    """bfloat16 has an 8-bit mantissa (0.4% relative); losses of 2.5-5 are resolved to about
    0.01-0.02. Measured on this GPT: per-step difference at most 0.010 over 200 steps,
    last-50-step means 5e-5 apart. Stated tolerance: 0.05 per step, 1% on the mean of the
    last 20 steps."""
    m = mesh(data=2, model=4)
    _, fp32 = run(hybrid_step(loss_fn, optax.adamw(3e-3), m), 100)
    step = hybrid_step(loss_fn, optax.adamw(3e-3), m, precision=BF16)
    model, bf16 = run(step, 100)
    assert fp32[-1] < fp32[0] - 1.0  # it trains
    assert np.max(np.abs(bf16 - fp32)) < 0.05
    np.testing.assert_allclose(bf16[-20:].mean(), fp32[-20:].mean(), rtol=0.01)
    # Master weights stay float32; the matmuls ran in bfloat16.
    assert {
        x.dtype for x in jax.tree.leaves(model) if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)
    } == {jnp.dtype("float32")}
    placed, opt_state = step.init(tiny_gpt(0))
    hlo = step.lower(placed, opt_state, shard_batch(token_batch(8, 0), m)).as_text()
    assert "bf16" in hlo and "dot_general" in hlo
    assert any("bf16" in line for line in hlo.splitlines() if "dot_general" in line)


RECORDED = pathlib.Path(__file__).resolve().parents[1] / "docs" / "data" / "losses" / "precision"


def test_recorded_recipe_curves_stay_within_the_stated_tolerance():
    """The float32 and bfloat16 runs of recipes/hybrid_gpt.py on the docs page (300 steps,
    same seed; `make figures` records them): same command but --dtype, and per step the
    losses within 1% of each other (2.5x bfloat16's epsilon 2^-8: the loss is a mean over
    2,048 tokens, whose rounding errors mostly cancel). Recorded: 0.05% at most, 0.02% at
    the last step."""
    runs = {}
    for path in RECORDED.glob("*.json"):
        run = json.loads(path.read_text())
        runs[run["final_metrics"]["dtype"]] = run
    fp32, bf16 = runs["float32"], runs["bfloat16"]
    assert bf16["command"] == fp32["command"].replace("--dtype float32", "--dtype bfloat16")
    assert fp32["steps"] == bf16["steps"] == list(range(len(fp32["steps"]))) and len(fp32["steps"]) >= 300
    assert fp32["source"] == bf16["source"] == "metrics['loss'] of every step"
    a, b = np.array(fp32["loss"]), np.array(bf16["loss"])
    assert a[-10:].mean() < a[0] - 2.0  # it trained
    assert not np.array_equal(a, b)  # bfloat16 really ran
    assert np.max(np.abs(b - a) / a) < 0.01


@pytest.mark.standard_promotion  # bfloat16 compute: jax.nn.dot_product_attention (tests/conftest.py)
@pytest.mark.parametrize(
    "builder, axes, kind",
    [
        (data_parallel_step, {"data": 8, "model": 1}, "all-reduce"),
        pytest.param(fsdp_step, {"fsdp": 8, "model": 1}, "all-gather", marks=pytest.mark.thorough),
    ],
)
def test_bfloat16_reduction_halves_the_gradient_bytes(builder, axes, kind):
    axis = next(iter(axes))
    m = mesh(**axes)
    batch = shard_batch(token_batch(8, 0), m, batch_axis=axis)

    def bytes_for(precision):
        step = builder(loss_fn, optax.sgd(0.1), m, batch_axis=axis, precision=precision)
        model, opt_state = step.init(tiny_gpt(0))
        report = CommReport.of(step.lower(model, opt_state, batch))
        # The lowered program: what the step asks for. (XLA:CPU then runs a bfloat16
        # all-reduce in float32; GPUs reduce bfloat16 natively.)
        # Scalars (the loss, the norm's partial sums) stay float32: leave them out.
        return sum(
            c.bytes for c in report.collectives(kind, stage="lowered") if c.group_size == 8 and c.shapes != ((),)
        )

    full = bytes_for(BF16)  # compute in bfloat16, reduce in float32: the default
    half = bytes_for(Precision(compute_dtype=jnp.bfloat16, reduce_dtype=jnp.bfloat16))
    assert full >= 4 * 33_920  # every float32 parameter's gradient (or gathered weight)
    assert 2 * half == full


def test_bad_precision_is_a_clear_error():
    with pytest.raises(ValueError, match="compute_dtype must be a floating-point dtype"):
        Precision(compute_dtype=jnp.int8)
    with pytest.raises(ValueError, match="precision must be an eqxpar.train.Precision"):
        hybrid_step(loss_fn, optax.sgd(0.1), mesh(data=2, model=4), precision="bf16")
