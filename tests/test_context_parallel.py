"""Context parallelism in the train steps: every example's sequence split over `context`
(`context_axis=`), attention by ring or all-gather, equals one device on the whole
sequence: loss, gradient norm and the parameters after K steps, over drawn meshes."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _budget import examples
from _dense_attention import dense_attention
from hypothesis import given
from hypothesis import strategies as st

import eqxpar
from eqxpar.nn import (
    all_gather_attention,
    context_positions,
    layout_order,
    ring_attention,
)

VOCAB, DIM, HEADS, SEQ, BATCH = 11, 8, 2, 16, 4


class Toy(eqx.Module):
    """One attention layer over token + position embeddings, and a head."""

    embed: jax.Array
    pos: jax.Array
    qkv: jax.Array
    out: jax.Array
    head: jax.Array

    def __init__(self, key):
        k = jax.random.split(key, 5)
        self.embed = jax.random.normal(k[0], (VOCAB, DIM))
        self.pos = 0.5 * jax.random.normal(k[1], (SEQ, DIM))
        self.qkv = jax.random.normal(k[2], (DIM, 3 * DIM)) / math.sqrt(DIM)
        self.out = jax.random.normal(k[3], (DIM, DIM)) / math.sqrt(DIM)
        self.head = jax.random.normal(k[4], (DIM, VOCAB)) / math.sqrt(DIM)

    def __call__(self, tokens, positions, attend):
        x = self.embed[tokens] + self.pos[positions][None]  # positions: (seq,), the same for every row
        q, k, v = jnp.split(x @ self.qkv, 3, axis=-1)
        q, k, v = (t.reshape(*t.shape[:-1], HEADS, DIM // HEADS) for t in (q, k, v))
        x = x + attend(q, k, v).reshape(x.shape) @ self.out
        return x @ self.head


def cross_entropy(logits, targets):
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))


def one_device_loss(causal):
    def loss_fn(model, batch, key=None):
        inputs, targets = batch
        positions = jnp.arange(inputs.shape[-1])
        return cross_entropy(model(inputs, positions, lambda q, k, v: dense_attention(q, k, v, causal)), targets)

    return loss_fn


def context_loss(mode, layout, causal):
    attention = ring_attention if mode == "ring" else all_gather_attention

    def loss_fn(model, batch, key=None):
        inputs, targets = batch  # this device's part of every sequence, in `layout` order
        positions = context_positions(inputs.shape[-1], "context", layout)

        def attend(q, k, v):
            return attention(q, k, v, axis_name="context", causal=causal, layout=layout)

        return cross_entropy(model(inputs, positions, attend), targets)

    return loss_fn


def batches(seed, steps):
    tokens = jax.random.randint(jax.random.key(seed), (steps, BATCH, SEQ + 1), 0, VOCAB)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def run_one_device(causal, data, steps_opt):
    model = Toy(jax.random.key(0))
    opt_state = steps_opt.init(eqx.filter(model, eqx.is_inexact_array))
    loss_fn = one_device_loss(causal)
    losses = []

    @jax.jit
    def step(model, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(model, batch)
        updates, opt_state = steps_opt.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, loss

    for batch in data:
        model, opt_state, loss = step(model, opt_state, batch)
        losses.append(loss)
    return model, losses


MESHES = [
    {"data": 1, "context": 2},
    {"data": 2, "context": 2},
    {"data": 1, "context": 4},
    {"data": 2, "context": 4},
    {"data": 1, "context": 8},
    {"data": 2, "context": 2, "model": 2},
    {"data": 1, "context": 4, "model": 2},
]


@examples(2)  # more under HYPOTHESIS_PROFILE=thorough
@given(
    shape=st.sampled_from(MESHES),
    mode=st.sampled_from(["ring", "all_gather"]),
    layout=st.sampled_from(["zigzag", "contiguous"]),
    causal=st.booleans(),
    builder=st.sampled_from(["data_parallel", "fsdp"]),
    seed=st.integers(0, 2**16),
)
def test_context_parallel_steps_equal_one_device(shape, mode, layout, causal, builder, seed):
    mesh = eqxpar.make_mesh(**shape)
    opt = optax.adam(1e-2)
    data = batches(seed, 3)
    want_model, want_losses = run_one_device(causal, data, opt)

    loss_fn = context_loss(mode, layout, causal)
    if builder == "fsdp":
        step = eqxpar.train.fsdp_step(loss_fn, opt, mesh, batch_axis="data", context_axis="context")
    else:
        step = eqxpar.train.data_parallel_step(loss_fn, opt, mesh, batch_axis="data", context_axis="context")
    model, opt_state = step.init(Toy(jax.random.key(0)))
    order = layout_order(SEQ, shape["context"], layout)
    for batch, want in zip(data, want_losses):
        laid_out = jax.tree.map(lambda x: x[:, order], batch)
        model, opt_state, metrics = step(model, opt_state, laid_out)
        np.testing.assert_allclose(metrics["loss"], want, rtol=2e-5)
    for got, ref in zip(jax.tree.leaves(model), jax.tree.leaves(want_model)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-4, atol=2e-5)


def test_context_share_counts_every_token():
    """A loss that returns the number of tokens it sees: the step's global loss is that
    count's mean, so the 1/(data x context) share is applied once (not twice, not never)."""
    mesh = eqxpar.make_mesh(data=2, context=4)

    def loss_fn(model, batch, key=None):
        return jnp.sum(model.embed) * 0 + jnp.float32(batch[0].size)

    step = eqxpar.train.data_parallel_step(loss_fn, optax.sgd(0.0), mesh, batch_axis="data", context_axis="context")
    model, opt_state = step.init(Toy(jax.random.key(0)))
    _, _, metrics = step(model, opt_state, batches(0, 1)[0])
    assert float(metrics["loss"]) == BATCH * SEQ / 8


def test_context_axis_mistakes_are_named():
    mesh = eqxpar.make_mesh(data=2, context=4)
    opt = optax.sgd(0.1)
    loss_fn = context_loss("ring", "zigzag", True)
    with pytest.raises(ValueError, match="context_axis"):
        eqxpar.train.data_parallel_step(loss_fn, opt, mesh, batch_axis="data", context_axis="seq")
    with pytest.raises(ValueError, match="context_axis"):
        eqxpar.train.data_parallel_step(loss_fn, opt, mesh, batch_axis=("data", "context"), context_axis="context")
    step = eqxpar.train.data_parallel_step(loss_fn, opt, mesh, batch_axis="data", context_axis="context")
    model, opt_state = step.init(Toy(jax.random.key(0)))
    bad = (jnp.zeros((BATCH, 6), jnp.int32), jnp.zeros((BATCH, 6), jnp.int32))
    with pytest.raises(ValueError, match="divisible by the 4 context shards"):
        step(model, opt_state, bad)


@pytest.mark.parametrize("mode", ["ring", "all_gather"])
def test_compiled_collective_bytes_equal_theory(mode):
    """Ring: (C-1) K/V hops forward, (C-1) back and C gradient hops, in the compiled program
    (not merged away by XLA); all-gather: one gather and one reduce-scatter."""
    mesh = eqxpar.make_mesh(data=2, context=4)
    step = eqxpar.train.data_parallel_step(
        context_loss(mode, "zigzag", True), optax.sgd(0.1), mesh, batch_axis="data", context_axis="context"
    )
    model, opt_state = step.init(Toy(jax.random.key(0)))
    report = eqxpar.inspect.CommReport.of(step.lower(model, opt_state, batches(0, 1)[0]), mesh=mesh)
    theory = eqxpar.inspect.context_parallel_theory(
        mesh, batch=BATCH, seq_len=SEQ, num_heads=HEADS, head_dim=DIM // HEADS, num_layers=1, mode=mode
    )
    kinds = ["collective-permute"] if mode == "ring" else ["all-gather", "reduce-scatter"]
    for kind in kinds:
        assert theory.bytes(kind) > 0
        assert report.bytes(kind) == theory.bytes(kind), kind
        assert report.bytes(kind, stage="lowered") == theory.bytes(kind), kind
