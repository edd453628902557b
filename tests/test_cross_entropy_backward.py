"""vocab_parallel_cross_entropy's custom backward: the logits' gradient equals the one of
optax's cross-entropy on the whole logits (bfloat16 logits: to one bfloat16 rounding), with
a cotangent that is not all ones, padding ids and labels on every block; and the compiled
backward writes no float32 array of the logits' size for bfloat16 logits. Caught by these
tests: tools/mutants.toml's ce-backward-one-hot-block-offset and ce-backward-padding-unmasked."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar.nn import vocab_parallel_cross_entropy
from eqxpar.testing import F32_RTOL, mesh_sizes

model_sizes = mesh_sizes(("model",)).map(lambda s: s["model"])
BATCH = (4, 3)


def _weighted_loss(mesh, logits_spec, labels_spec, vocab_size, check_vma=True):
    """sum(weights * losses) in shard_map (summed over the batch axes, those other than
    `model`): its cotangent per example is `weights`."""
    batch_axes = tuple(a for a in mesh.axis_names if a != "model")

    def per_device(logits, labels, weights):
        local = jnp.sum(weights * vocab_parallel_cross_entropy(logits, labels, "model", vocab_size))
        return jax.lax.psum(local, batch_axes) if batch_axes else local

    return eqxpar.filter_shard_map(
        per_device, mesh=mesh, in_specs=(logits_spec, labels_spec, labels_spec), out_specs=P(), check_vma=check_vma
    )


def _dense_reference(logits, labels, weights, vocab):
    """optax on the real vocabulary of the whole logits in float32, on one device (the
    gradient is zero at the padding ids, which the slice leaves out)."""

    def loss(l):
        return jnp.sum(weights * optax.softmax_cross_entropy_with_integer_labels(l[..., :vocab], labels))

    with jax.default_device(jax.devices()[0]):
        return jax.value_and_grad(loss)(jnp.asarray(logits, jnp.float32))


def _draw(seed, shape, vocab):
    rng = np.random.default_rng(seed)
    logits = 3 * rng.normal(size=shape).astype(np.float32)
    logits[..., vocab:] += 4.0  # finite padding logits that would matter if counted
    labels = rng.integers(0, vocab, shape[:-1]).astype(np.int32)
    labels.flat[0] = vocab - 1  # the last real id
    labels.flat[1] = shape[-1] // 2  # the first id of the second half of the vocabulary
    weights = rng.uniform(0.5, 2.0, shape[:-1]).astype(np.float32)
    return logits, labels, weights


@given(
    n=model_sizes,
    block=st.sampled_from([4, 6]),
    pad=st.sampled_from([0, 1, 3]),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    seed=st.integers(0, 2**16),
)
@example(n=1, block=6, pad=0, dtype="float32", seed=0)
@example(n=2, block=6, pad=3, dtype="float32", seed=1)
@example(n=2, block=4, pad=1, dtype="bfloat16", seed=2)
def test_gradient_equals_optax_on_whole_logits(n, block, pad, dtype, seed):
    padded = n * block
    vocab = padded - pad
    logits, labels, weights = _draw(seed, (*BATCH, padded), vocab)
    logits = jnp.asarray(logits).astype(dtype)  # bfloat16: the reference reads the same values
    loss = _weighted_loss(eqxpar.make_mesh(model=n), P(None, None, "model"), P(), None if pad == 0 else vocab)
    got_loss, got = jax.jit(jax.value_and_grad(loss))(logits, labels, weights)
    want_loss, want = _dense_reference(logits, labels, weights, vocab)
    assert got.dtype == logits.dtype, got.dtype
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=F32_RTOL)
    assert np.all(got[..., vocab:] == 0), "non-zero gradient at padding ids"
    # float32: the reference's own rounding; bfloat16: one rounding of the float32 value
    # (half a unit in the last place, 2**-8 of the value at most) on top of it.
    rtol = F32_RTOL if dtype == "float32" else 2.0**-8 + F32_RTOL
    np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-7, err_msg=f"logits' gradient, model={n}, pad={pad}")


@pytest.mark.parametrize("data, logits_spec", [(1, P()), (2, P("data"))])
def test_logits_not_split_over_the_model_axis(data, logits_spec):
    """On a model axis of size 1 with replicated logits (the dense side of a parity check),
    the custom backward still matches the logits' varying axes."""
    vocab = 7
    logits, labels, weights = _draw(3, (*BATCH, vocab), vocab)
    mesh = eqxpar.make_mesh(data=data, model=1)
    loss = _weighted_loss(mesh, P(*logits_spec, None, None), logits_spec, None)
    got_loss, got = jax.jit(jax.value_and_grad(loss))(logits, labels, weights)
    want_loss, want = _dense_reference(logits, labels, weights, vocab)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=F32_RTOL)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=F32_RTOL, atol=1e-7)


def test_without_vma_checks():
    """Under shard_map's check_vma=False nothing is typed varying and the psum's transpose is
    a psum: the loss's cotangent reaches the custom backward divided over the devices, and
    must come out whole."""
    n, vocab = 4, 14
    logits, labels, weights = _draw(4, (*BATCH, 16), vocab)
    loss = _weighted_loss(eqxpar.make_mesh(model=n), P(None, None, "model"), P(), vocab, check_vma=False)
    got_loss, got = jax.jit(jax.value_and_grad(loss))(logits, labels, weights)
    want_loss, want = _dense_reference(logits, labels, weights, vocab)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=F32_RTOL)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=F32_RTOL, atol=1e-7)


def _materialised(hlo: str, dtype: str, shape: tuple[int, ...]) -> int:
    """How many arrays of `dtype[shape]` the compiled program writes to memory: results of
    instructions outside fused computations (inside a fusion, values stay in registers)."""
    fused = set(re.findall(r"calls=%?([\w.\-]+)", hlo))
    pattern = re.compile(rf"\b{dtype}\[{','.join(map(str, shape))}\]")
    count, inside = 0, False
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if header:
            inside = header.group(1) in fused
        elif not inside and " = " in line:
            result_type = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = (\(.*?\)|\S+) ", line)
            count += bool(result_type and pattern.search(result_type.group(1)))
    return count


@pytest.mark.parametrize("n", [1, 2])
def test_backward_writes_no_float32_logits(n):
    """For bfloat16 logits, differentiating adds no float32 array of the logits' block shape
    to the compiled program: the gradient is computed in one fusion and written in bfloat16
    (before, autodiff wrote softmax and softmax - one_hot in float32, then a bfloat16 copy)."""
    block, vocab = 32, 32 * n - 3
    logits = jnp.zeros((*BATCH, block * n), jnp.bfloat16)
    labels = jnp.zeros(BATCH, jnp.int32)
    weights = jnp.ones(BATCH, jnp.float32)
    loss = _weighted_loss(eqxpar.make_mesh(model=n), P(None, None, "model"), P(), vocab)
    forward = jax.jit(loss).lower(logits, labels, weights).compile().as_text()
    backward = jax.jit(jax.grad(loss)).lower(logits, labels, weights).compile().as_text()
    assert _materialised(backward, "bf16", (*BATCH, block)) >= 1, "the parser found no bfloat16 gradient"
    in_forward = _materialised(forward, "f32", (*BATCH, block))
    in_both = _materialised(backward, "f32", (*BATCH, block))
    assert in_both == in_forward, f"float32 arrays of the logits' shape: {in_forward} forward, {in_both} with backward"
