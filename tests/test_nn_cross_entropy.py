"""vocab_parallel_cross_entropy equals optax's cross-entropy on the whole logits (values and
gradients), extreme logits included, and never gathers the logits onto one device."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar.inspect import communication_report
from eqxpar.nn import vocab_parallel_cross_entropy
from eqxpar.testing import F32_RTOL, assert_trees_close, mesh_sizes, on_one_device

model_sizes = mesh_sizes(("model",)).map(lambda s: s["model"])


def _loss_and_grad(loss_fn, logits, labels):
    """((sum of losses, its gradient), per-example losses)."""
    return jax.value_and_grad(lambda l: jnp.sum(loss_fn(l, labels)))(logits), loss_fn(logits, labels)


def _parallel(n, batch_ndim):
    mesh = eqxpar.make_mesh(model=n)
    logits_spec = P(*([None] * batch_ndim), "model")  # each device: its block of the vocabulary
    return eqxpar.filter_shard_map(
        lambda logits, labels: vocab_parallel_cross_entropy(logits, labels, "model"),
        mesh=mesh,
        in_specs=(logits_spec, P()),
        out_specs=P(),
    )


def _logits(rng, shape, kind):
    if kind == "normal":
        return rng.normal(size=shape).astype(np.float32)
    if kind == "extreme":  # every logit is -1e4, 0 or +1e4, plus a little noise
        return (rng.choice([-1e4, 0.0, 1e4], size=shape) + rng.normal(size=shape)).astype(np.float32)
    # "spread": magnitudes from 1e-3 to 1e4 with either sign
    return (rng.choice([-1, 1], size=shape) * 10.0 ** rng.uniform(-3, 4, size=shape)).astype(np.float32)


@given(
    n=model_sizes,
    per_device=st.sampled_from([1, 6]),
    batch_shape=st.sampled_from([(5,), (2, 3)]),
    kind=st.sampled_from(["normal", "extreme", "spread"]),
    seed=st.integers(0, 2**16),
)
@example(n=4, per_device=6, batch_shape=(5,), kind="extreme", seed=0)
@example(n=8, per_device=1, batch_shape=(2, 3), kind="spread", seed=1)
def test_equals_optax_on_whole_logits(n, per_device, batch_shape, kind, seed):
    rng = np.random.default_rng(seed)
    vocab = n * per_device
    logits = _logits(rng, (*batch_shape, vocab), kind)
    labels = rng.integers(0, vocab, batch_shape).astype(np.int32)
    labels.flat[0] = vocab - 1  # the last row of the last device's block
    parallel = _parallel(n, len(batch_shape))
    (_, got_grad), got = eqx.filter_jit(_loss_and_grad)(parallel, logits, labels)
    (_, want_grad), want = on_one_device(
        lambda lo, la: _loss_and_grad(optax.softmax_cross_entropy_with_integer_labels, lo, la), logits, labels
    )
    assert np.all(np.isfinite(np.asarray(got)))
    assert_trees_close(got_grad, want_grad, what=f"cross-entropy gradient ({kind} logits, model={n})")
    # optax computes (max + log-sum) - label_logit: adding the max back rounds to float32's
    # spacing at |max| (1e-3 for logits near 1e4), so against optax the values agree to
    # that spacing. Against the exact value (float64) the parallel loss, which subtracts
    # the max from the label logit instead, is accurate to the usual float32 tolerance.
    spacing = np.spacing(np.abs(logits).max(axis=-1).astype(np.float32)).astype(np.float64)
    got64, want64 = np.asarray(got, np.float64), np.asarray(want, np.float64)
    worst = np.max(np.abs(got64 - want64) - (2 * spacing + F32_RTOL * np.abs(want64)))
    assert worst <= 0, f"cross-entropy vs optax ({kind} logits, model={n}): off by {worst:.3g} beyond tolerance"
    assert_trees_close(got, _exact_loss(logits, labels), what=f"cross-entropy vs float64 ({kind} logits, model={n})")


def _exact_loss(logits, labels):
    x = logits.astype(np.float64)
    top = x.max(axis=-1, keepdims=True)
    lse = top[..., 0] + np.log(np.exp(x - top).sum(axis=-1))
    return (lse - np.take_along_axis(x, labels[..., None], axis=-1)[..., 0]).astype(np.float32)


def _assert_no_whole_logits(report, batch_elements):
    """No collective moves more than a few numbers per example (whole logits would be
    batch x vocab), and nothing is gathered."""
    assert report.count("all-gather") == 0 and report.count("all-to-all") == 0, str(report)
    for c in report.collectives():
        assert c.elements <= 2 * batch_elements, f"{c.describe()} moves more than per-example scalars"


@pytest.mark.parametrize("n", [2, 8])
def test_communicates_per_example_scalars_only(n):
    batch, vocab = 6, 8 * 16
    logits = jnp.zeros((batch, vocab))
    labels = jnp.zeros((batch,), jnp.int32)
    parallel = _parallel(n, 1)
    report = communication_report(jax.grad(lambda l: jnp.sum(parallel(l, labels))), logits)
    _assert_no_whole_logits(report, batch)
    # A pmax (global max) and one psum (sum of exponentials, label logit) forward; the
    # backward needs nothing more.
    assert report.count("all-reduce") == 2, str(report)
    assert report.count("all-reduce", stage="lowered") == 2


def test_gathering_the_logits_is_caught():
    """The check above fails for the naive version that all-gathers the logits."""
    mesh = eqxpar.make_mesh(model=4)
    naive = eqxpar.filter_shard_map(
        lambda l, y: optax.softmax_cross_entropy_with_integer_labels(
            jax.lax.all_gather(l, "model", axis=1, tiled=True, to="invarying"), y
        ),
        mesh=mesh,
        in_specs=(P(None, "model"), P()),
        out_specs=P(),
    )
    labels = jnp.zeros((6,), jnp.int32)
    report = communication_report(jax.grad(lambda l: jnp.sum(naive(l, labels))), jnp.zeros((6, 64)))
    with pytest.raises(AssertionError):
        _assert_no_whole_logits(report, 6)
