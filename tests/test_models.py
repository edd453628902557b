"""The GPT of eqxpar.models: the same loss and gradients at every model axis size (dropout
included), its loss equals optax's on the whole logits, sampling, and the recipe that trains
it tensor-parallel."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _recipes import run_recipe
from hypothesis import example, given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar import nn
from eqxpar.models import GPT, generate, next_token_loss
from eqxpar.models._gpt_parts import embed_tokens
from eqxpar.testing import assert_trees_close, mesh_sizes

VOCAB, CONTEXT = 16, 8
model_sizes = mesh_sizes(("model",)).map(lambda s: s["model"])


def _gpt(seed, dropout):
    # 8 heads, MLP width 32 and vocabulary 16 all split over up to 8 devices.
    return GPT(
        VOCAB, CONTEXT, dim=16, num_heads=8, num_layers=1, mlp_ratio=2, dropout_p=dropout, key=jax.random.key(seed)
    )


@functools.cache
def _loss_and_grads(n, specs):
    """The compiled loss-and-gradient function at model size n (cached so examples that
    share a size share a compile)."""
    mesh = eqxpar.make_mesh(model=n)

    def local(model, tokens, key_data):
        key = jax.random.wrap_key_data(key_data)
        return eqx.filter_value_and_grad(next_token_loss)(model, tokens, key=key)

    return mesh, eqx.filter_jit(
        eqxpar.filter_shard_map(local, mesh=mesh, in_specs=(specs, P(), P()), out_specs=(P(), specs))
    )


def _run(model, n, tokens, key_data):
    specs = nn.partition_specs(model)
    mesh, fn = _loss_and_grads(n, specs)
    nn.partition_specs(model, mesh)  # the size checks
    return fn(eqxpar.shard(model, mesh, specs), tokens, key_data)


# One example in three with dropout: its random bits (threefry) double the compile time.
@given(n=model_sizes, seed=st.integers(0, 2**16), dropout=st.sampled_from([0.0, 0.0, 0.3]))
@example(n=8, seed=0, dropout=0.3)
@example(n=4, seed=1, dropout=0.0)
def test_gpt_loss_and_gradients_equal_at_every_model_size(n, seed, dropout):
    """Model size 1 is the dense run. Dropout included: attention dropout uses per-head keys
    and the residual stream (replicated) the same key on every device, so the masks do not
    depend on how the model is split."""
    model = _gpt(seed, dropout)
    tokens = np.random.default_rng(seed).integers(0, VOCAB, (3, CONTEXT + 1)).astype(np.int32)
    key_data = jax.random.key_data(jax.random.key(seed + 1))
    got = _run(model, n, tokens, key_data)
    want = _run(model, 1, tokens, key_data)
    assert_trees_close(got, want, what=f"GPT loss and gradients (model={n} vs 1)")


def test_next_token_loss_equals_optax_on_whole_logits():
    n = 4
    model = _gpt(0, 0.0)
    mesh = eqxpar.make_mesh(model=n)
    specs = nn.partition_specs(model, mesh)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, CONTEXT + 1)).astype(np.int32)
    # The real vocabulary's logits (the GPT pads its vocabulary; whole_logits drops the pad).
    whole_logits = eqxpar.models.whole_logits(model, mesh, specs)(tokens[:, :-1])
    assert whole_logits.shape == (2, CONTEXT, VOCAB)
    loss = eqx.filter_jit(eqxpar.filter_shard_map(next_token_loss, mesh=mesh, in_specs=(specs, P()), out_specs=P()))(
        model, tokens
    )
    want = optax.softmax_cross_entropy_with_integer_labels(whole_logits, tokens[:, 1:]).mean()
    assert_trees_close(loss, want, what="next_token_loss")


def test_generate_reads_the_last_real_position():
    """With a stand-in model that predicts `token + 1`, sampling must count up, also once
    the text is longer than the context window."""
    vocab, context = 10, 4

    def count_up(window):
        return 50.0 * jax.nn.one_hot((window + 1) % vocab, vocab)

    out = generate(count_up, np.array([3]), 9, context_length=context, key=jax.random.key(0))
    np.testing.assert_array_equal(out, np.arange(3, 13) % vocab)
    with pytest.raises(ValueError, match="at least one token"):
        generate(count_up, np.array([], np.int32), 2, context_length=context, key=jax.random.key(0))


SMALL = ("--steps", "20", "--layers", "1", "--dim", "32", "--context", "16", "--batch-size", "4")


@pytest.mark.slow
def test_recipe_same_losses_for_model_1_and_8_and_loss_goes_down(tmp_path):
    dense = run_recipe("tensor_parallel", tmp_path, *SMALL, "--mesh", "model=1", "--sample-chars", "0")
    split = run_recipe("tensor_parallel", tmp_path, *SMALL, "--mesh", "model=8", "--sample-chars", "8")
    for name in ("first_loss", "final_loss", "val_loss"):
        # Twenty Adam steps on float32 gradients summed in a different order: the runs drift
        # apart by rounding only (a missing or doubled collective is off by far more).
        np.testing.assert_allclose(split[name], dense[name], rtol=1e-4, err_msg=name)
    assert split["final_loss"] < split["first_loss"] - 0.5, split
    assert split["param_bytes_per_device"] < split["param_bytes_total"] / 4
    # Per step: 2 all-reduces per block (forward) + 2 (backward), the embedding's, the
    # head's input gradient, and the loss's pmax and psum.
    assert split["all_reduces_per_step"] == 4 * 1 + 4
    assert split["sample"].startswith("def ") and len(split["sample"]) > len("def ")  # 8 BPE tokens after it


@pytest.mark.parametrize("rows", [None, (5, 0, 3, 1)])
def test_position_embedding_gradient_sums_each_position_over_the_batch(rows):
    """The residual stream reads the position embedding by a gather (its backward a
    scatter-add, so that no reduction over the batch sets the stream's layout on a GPU):
    row p of the gradient is the sum over sequences of the stream's gradient where the
    position is p, and rows no sequence reads get zero. `rows`: a split sequence's positions."""
    model = _gpt(0, 0.0)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (3, 4)).astype(np.int32)
    upstream = np.random.default_rng(1).standard_normal((3, 4, 16)).astype(np.float32)
    mesh = eqxpar.make_mesh(model=1)
    specs = nn.partition_specs(model, mesh)
    positions = None if rows is None else np.asarray(rows)
    length = None if rows is None else CONTEXT

    def weighted_sum(model, tokens, upstream):
        x = embed_tokens(model, tokens, key=None, inference=True, rows=positions, length=length)
        return (x * upstream).sum()

    grads = eqx.filter_jit(
        eqxpar.filter_shard_map(eqx.filter_grad(weighted_sum), mesh=mesh, in_specs=(specs, P(), P()), out_specs=specs)
    )(model, tokens, upstream)
    want = np.zeros((CONTEXT, 16), np.float32)
    for i, p in enumerate(range(4) if rows is None else rows):
        want[p] += upstream[:, i].sum(0)
    np.testing.assert_allclose(grads.position_embedding.weight, want, rtol=1e-6, atol=1e-6)


def test_position_gradient_is_a_float32_scatter_add_under_bfloat16():
    """Under bfloat16 compute the position table's gradient adds up the batch's rows with a
    scatter-add (the gather's backward, not a sum over the batch: that sum set the residual
    stream's layout on a GPU) into a float32 table, rounded to bfloat16 once: within one
    bfloat16 rounding of the exact sum, where adding 256 rows in bfloat16 is off by about 2%."""
    model = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, _gpt(0, 0.0))
    batch, length = 256, 4
    tokens = np.random.default_rng(0).integers(0, VOCAB, (batch, length)).astype(np.int32)
    upstream = jnp.asarray(np.random.default_rng(1).standard_normal((batch, length, 16)), jnp.bfloat16)
    mesh = eqxpar.make_mesh(model=1)
    specs = nn.partition_specs(model, mesh)

    def weighted_sum(model, tokens, upstream):
        x = embed_tokens(model, tokens, key=None, inference=True)
        return (x * upstream).astype(jnp.float32).sum()

    grad = eqxpar.filter_shard_map(
        eqx.filter_grad(weighted_sum), mesh=mesh, in_specs=(specs, P(), P()), out_specs=specs
    )
    program = str(eqx.filter_make_jaxpr(grad)(model, tokens, upstream)[0])
    assert f"f32[{CONTEXT},16] = scatter-add" in program, program
    got = np.asarray(eqx.filter_jit(grad)(model, tokens, upstream).position_embedding.weight, np.float32)
    exact = np.asarray(upstream, np.float64).sum(0)
    np.testing.assert_allclose(got[:length], exact, rtol=2**-8, atol=1e-6)
    assert not got[length:].any()
