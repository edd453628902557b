"""The GPT with context-parallel attention (`attention_impl="ring"` / `"all_gather"`) over
drawn data x context x model meshes equals the one-device GPT: loss, gradient norm and the
parameters after K steps."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _budget import examples
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar.models import GPT, next_token_loss
from eqxpar.nn import layout_order, vocab_parallel_cross_entropy

VOCAB, SEQ, DIM, HEADS, BATCH, STEPS = 7, 16, 8, 2, 4, 2


def gpt(attention_impl):
    return GPT(
        VOCAB, SEQ, DIM, HEADS, 1, pad_vocab_to_multiple_of=8, attention_impl=attention_impl, key=jax.random.key(3)
    )


def context_loss(model, batch, key=None):
    inputs, targets = batch
    return jnp.mean(vocab_parallel_cross_entropy(model(inputs), targets, model.axis_name, model.vocab_size))


def windows(seed):
    return jax.random.randint(jax.random.key(seed), (STEPS, BATCH, SEQ + 1), 0, VOCAB)


@examples(2)  # more under HYPOTHESIS_PROFILE=thorough
@given(
    shape=st.sampled_from(
        [
            {"data": 1, "context": 2, "model": 1},
            {"data": 2, "context": 2, "model": 2},
            {"data": 1, "context": 4, "model": 2},
            {"data": 1, "context": 8, "model": 1},
            {"data": 2, "context": 4, "model": 1},
        ]
    ),
    mode=st.sampled_from(["ring", "all_gather"]),
    seed=st.integers(0, 2**16),
)
def test_context_parallel_gpt_equals_one_device(shape, mode, seed):
    tokens = windows(seed)
    opt = optax.adamw(1e-2)
    one = eqxpar.make_mesh(data=1, model=1)
    ref_step = eqxpar.train.hybrid_step(lambda m, b, key=None: next_token_loss(m, b), opt, one)
    ref_model, ref_opt = ref_step.init(gpt("reference"))
    want = []
    for t in tokens:
        ref_model, ref_opt, metrics = ref_step(ref_model, ref_opt, t)
        want.append((float(metrics["loss"]), float(metrics["grad_norm"])))

    mesh = eqxpar.make_mesh(**shape)
    step = eqxpar.train.hybrid_step(context_loss, opt, mesh, batch_axis="data", context_axis="context")
    model, opt_state = step.init(gpt(mode))
    order = layout_order(SEQ, shape["context"], "zigzag")
    for t, (loss, norm) in zip(tokens, want):
        batch = eqxpar.shard((t[:, :-1][:, order], t[:, 1:][:, order]), mesh, P("data", "context"))
        model, opt_state, metrics = step(model, opt_state, batch)
        np.testing.assert_allclose(float(metrics["loss"]), loss, rtol=2e-5)
        np.testing.assert_allclose(float(metrics["grad_norm"]), norm, rtol=1e-4)

    def arrays(m):
        return jax.tree.leaves(eqx.filter(m, eqx.is_array))

    for got, ref in zip(arrays(model), arrays(ref_model)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-4, atol=3e-5)
