"""The GPT's options change how it computes, never what: scanned blocks equal the Python
loop (loss and gradients, dropout included), every remat choice gives the same gradients,
the fused attention equals the reference one, the padded vocabulary equals the unpadded one
on the real rows (and gives the pad rows nothing), the batched call equals the per-sequence
one, and the HLO names the layer behind every collective."""

import functools
import re

import equinox as eqx
import jax
import numpy as np
import pytest
from _budget import PINS_ONLY
from hypothesis import example, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar import nn
from eqxpar.models import GPT, next_token_loss, stack_blocks, unstack_blocks
from eqxpar.testing import assert_trees_close, mesh_sizes

CONTEXT = 8
model_sizes = mesh_sizes(("model",)).map(lambda s: s["model"])
# Each example compiles whole GPT training steps: a third of the profile's examples (2 by
# default, 20 under HYPOTHESIS_PROFILE=thorough) besides the explicit ones.
few = settings(max_examples=max(2, settings.default.max_examples // 3))


def _gpt(seed, *, vocab=16, dropout=0.0, **options):
    return GPT(
        vocab,
        CONTEXT,
        dim=16,
        num_heads=8,
        num_layers=2,
        mlp_ratio=2,
        dropout_p=dropout,
        key=jax.random.key(seed),
        **options,
    )


def _tokens(seed, vocab=16, batch=3):
    return np.random.default_rng(seed).integers(0, vocab, (batch, CONTEXT + 1)).astype(np.int32)


@functools.cache
def _loss_and_grads(n, specs):
    mesh = eqxpar.make_mesh(model=n)

    def local(model, tokens, key_data):
        key = None if key_data is None else jax.random.wrap_key_data(key_data)
        return eqx.filter_value_and_grad(next_token_loss)(model, tokens, key=key)

    return mesh, eqx.filter_jit(
        eqxpar.filter_shard_map(local, mesh=mesh, in_specs=(specs, P(), P()), out_specs=(P(), specs))
    )


def _run(model, n, tokens, key_data=None):
    specs = nn.partition_specs(model)
    mesh, fn = _loss_and_grads(n, specs)
    nn.partition_specs(model, mesh)  # the size checks
    return fn(eqxpar.shard(model, mesh, specs), tokens, key_data)


@given(
    n=model_sizes,
    seed=st.integers(0, 2**16),
    dropout=st.sampled_from([0.0, 0.0, 0.3]),
    remat=st.sampled_from(["none", "block", "save_matmuls"]),
)
@PINS_ONLY  # the two pins; draws under HYPOTHESIS_PROFILE=thorough (make test time)
@example(n=8, seed=0, dropout=0.3, remat="block")
@example(n=2, seed=1, dropout=0.0, remat="save_matmuls")
def test_scanned_blocks_equal_the_python_loop(n, seed, dropout, remat):
    """Same loss and gradients (unstacked back) with the blocks stacked and scanned, under
    every remat choice: the scan gives block i the loop's key i, and remat only recomputes."""
    loop = _gpt(seed, dropout=dropout)
    scanned = stack_blocks(_gpt(seed, dropout=dropout, remat=remat))
    assert scanned.scan_layers and not loop.scan_layers
    tokens, key_data = _tokens(seed), jax.random.key_data(jax.random.key(seed + 1))
    loss, grads = _run(scanned, n, tokens, key_data)
    want_loss, want_grads = _run(loop, n, tokens, key_data)
    assert_trees_close(loss, want_loss, what=f"scanned loss (model={n}, remat={remat})")
    # Leaf by leaf (the two models differ in a static field, remat, so not in structure).
    assert_trees_close(
        jax.tree.leaves(unstack_blocks(grads)),
        jax.tree.leaves(want_grads),
        what=f"scanned gradients (model={n}, remat={remat})",
    )


def test_scan_layers_flag_builds_the_stacked_form_of_the_same_weights():
    scanned = _gpt(3, scan_layers=True)
    assert isinstance(scanned.blocks, nn.StackedLayers) and len(scanned.blocks) == 2
    assert_trees_close(
        eqx.filter(unstack_blocks(scanned), eqx.is_array),
        eqx.filter(_gpt(3), eqx.is_array),
        rtol=0,
        atol=0,
        what="scan_layers=True vs stack_blocks",
    )
    specs = nn.partition_specs(scanned, eqxpar.make_mesh(model=4))
    assert specs.blocks.layers.attention.query_proj.weight == P(None, "model", None)
    assert specs.blocks.layers.mlp.output.weight == P(None, None, "model")
    assert specs.blocks.layers.attention_norm.weight == P(None)
    # Round trip, including the stacked form of an abstract (shape-only) model.
    abstract = eqx.filter_eval_shape(_gpt, 0)
    assert jax.tree.structure(unstack_blocks(stack_blocks(abstract))) == jax.tree.structure(abstract)


@given(n=model_sizes, seed=st.integers(0, 2**16))
@few
@example(n=8, seed=0)
def test_fused_attention_equals_reference(n, seed):
    fused, reference = _gpt(seed), _gpt(seed, attention_impl="reference")
    assert fused.blocks[0].attention.attention_impl == "dot_product"
    tokens = _tokens(seed)
    assert_trees_close(
        jax.tree.leaves(_run(fused, n, tokens)),
        jax.tree.leaves(_run(reference, n, tokens)),
        what=f"dot_product vs reference loss and gradients (model={n})",
    )


@given(vocab=st.sampled_from([13, 13, 13, 5]), n=st.sampled_from([2, 8]), seed=st.integers(0, 2**16))
@few
@example(vocab=13, n=8, seed=0)
def test_padded_vocabulary_equals_the_unpadded_one(vocab, n, seed):
    """Padded (default, to 128) on model=n against unpadded on one device: the same loss, the
    same gradients on the real rows, zero gradients on the pad rows."""
    padded, plain = _gpt(seed, vocab=vocab), _gpt(seed, vocab=vocab, pad_vocab_to_multiple_of=1)
    assert padded.padded_vocab_size == 128 and plain.padded_vocab_size == vocab
    tokens = _tokens(seed, vocab)
    loss, grads = _run(padded, n, tokens)
    want_loss, want_grads = _run(plain, 1, tokens)
    assert_trees_close(loss, want_loss, what=f"padded loss (vocab={vocab}, model={n})")
    rows = lambda g: (g.token_embedding.weight, g.head.weight)  # noqa: E731
    for got, want in zip(rows(grads), rows(want_grads)):
        assert_trees_close(got[:vocab], want, what="real rows' gradients")
        np.testing.assert_array_equal(np.asarray(got[vocab:]), 0)
    same = lambda g: jax.tree.leaves(eqx.tree_at(rows, g, replace=(0, 0)))  # noqa: E731
    assert_trees_close(same(grads), same(want_grads), what="other gradients")


def test_padding_never_reaches_logits_users_see():
    model, mesh = _gpt(0, vocab=13), eqxpar.make_mesh(model=4)
    specs = nn.partition_specs(model, mesh)
    tokens = _tokens(0, 13)[:, :-1]
    padded = eqx.filter_jit(
        eqxpar.filter_shard_map(lambda m, t: m(t), mesh=mesh, in_specs=(specs, P()), out_specs=P(None, None, "model"))
    )(model, tokens)
    assert padded.shape == (3, CONTEXT, 128) and np.all(np.isneginf(padded[..., 13:]))
    whole = eqxpar.models.whole_logits(model, mesh, specs)(tokens)
    np.testing.assert_array_equal(whole, padded[..., :13])
    sampled = eqxpar.models.generate(
        eqxpar.models.whole_logits(model, mesh, specs),
        np.array([1]),
        6,
        context_length=CONTEXT,
        key=jax.random.key(0),
        temperature=100.0,  # nearly uniform: pads would show up if sampled
    )
    assert sampled.max() < 13


def test_a_vocabulary_that_does_not_split_names_the_argument():
    model = eqx.filter_eval_shape(GPT, 104, 8, dim=24, num_heads=3, num_layers=1, mlp_ratio=2, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"vocab_size=104, padded to 128.*pad_vocab_to_multiple_of=384"):
        nn.partition_specs(model, eqxpar.make_mesh(model=3))
    fixed = eqx.filter_eval_shape(
        GPT, 104, 8, dim=24, num_heads=3, num_layers=1, mlp_ratio=2, pad_vocab_to_multiple_of=384, key=jax.random.key(0)
    )
    nn.partition_specs(fixed, eqxpar.make_mesh(model=3))
    with pytest.raises(ValueError, match="remat must be one of"):
        _gpt(0, remat="all")


def test_batched_call_equals_per_sequence_call():
    model, mesh = _gpt(1, vocab=13), eqxpar.make_mesh(model=4)
    specs = nn.partition_specs(model, mesh)
    tokens = _tokens(1, 13)[:, :-1]

    def both(m, t):
        return m(t), jax.vmap(m)(t)

    batched, per_sequence = eqx.filter_jit(
        eqxpar.filter_shard_map(both, mesh=mesh, in_specs=(specs, P()), out_specs=P(None, None, "model"))
    )(model, tokens)
    real = (slice(None), slice(None), slice(0, 13))
    assert_trees_close(batched[real], per_sequence[real], what="GPT(batch) vs vmap(GPT)(batch)")


def test_hlo_names_the_layer_behind_each_collective():
    """Every all-reduce of a training step's compiled HLO says which block and layer issued
    it (jax.named_scope), forward and backward."""
    model, mesh = _gpt(0), eqxpar.make_mesh(model=2)
    specs = nn.partition_specs(model, mesh)
    fn = eqx.filter_jit(
        eqxpar.filter_shard_map(
            eqx.filter_value_and_grad(next_token_loss), mesh=mesh, in_specs=(specs, P()), out_specs=(P(), specs)
        )
    )
    hlo = fn.lower(model, _tokens(0)).compile().compiled.as_text()
    names = [
        re.search(r'op_name="([^"]+)"', line).group(1)
        for line in hlo.splitlines()
        if re.search(r"= \S+ all-reduce(-start)?\(", line)
    ]
    assert len(names) == 4 * 2 + 4, names  # 2 blocks x (attention, MLP) x 2, embedding, head, loss x 2
    for block in ("block_0", "block_1"):
        for layer in ("attention/ParallelMultiheadAttention", "mlp/ParallelMLP"):
            # Forward (the row layer's psum) and backward (the input gradient's psum).
            assert sum(f"{block}/{layer}" in n for n in names) == 2, (block, layer, names)
    for where in ("embedding/VocabParallelEmbedding", "head/ColumnParallelLinear", "vocab_parallel_cross_entropy"):
        assert any(where in n for n in names), (where, names)
