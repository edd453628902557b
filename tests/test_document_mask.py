"""Packed documents: a row holding several documents, with their segment ids and positions,
trains exactly as each document alone. For the GPT and the Llama, on every attention path
(the explicit softmax, `jax.nn.dot_product_attention`, ring and all-gather context
parallelism) and under tensor and sequence parallelism, one step on a packed batch gives the
loss, gradient norm and updated parameters of a one-device step whose loss runs every
document alone (each with its own positions from 0). Document lengths are drawn so that they
straddle the context chunks (zigzag: 2C chunks of SEQ / 2C tokens)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _budget import PINS_ONLY
from hypothesis import example, given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar.models import GPT, Llama, LlamaConfig, gpt_stages, llama_loss, next_token_batch, next_token_loss
from eqxpar.nn import layout_order, vocab_parallel_cross_entropy

VOCAB, SEQ, BATCH = 16, 16, 2
LR = 0.5  # plain SGD: a gradient off by any factor moves the parameters off the reference


def gpt(impl: str, sp: bool = False, scan: bool = False) -> GPT:
    return GPT(
        VOCAB,
        SEQ,
        8,
        2,
        2,
        pad_vocab_to_multiple_of=8,
        attention_impl=impl,
        sequence_parallel=sp,
        scan_layers=scan,
        key=jax.random.key(1),
    )


def llama(impl: str, sp: bool = False, scan: bool = False) -> Llama:
    config = LlamaConfig(
        vocab_size=VOCAB, dim=16, num_layers=2, num_heads=4, num_kv_heads=2, hidden_dim=32, max_seq_len=SEQ
    )
    return Llama(
        config, attention_impl=impl, sequence_parallel=sp, scan_layers=scan, init_std=0.2, key=jax.random.key(2)
    )


def packed(lengths: list[list[int]], seed: int) -> dict[str, np.ndarray]:
    """Rows of SEQ + 1 tokens made of documents of the given lengths: tokens, segment ids
    (1, 2, ... per row) and positions restarting at every document."""
    rng = np.random.default_rng(seed)
    segments = np.stack([np.repeat(np.arange(1, len(row) + 1), row) for row in lengths]).astype(np.int32)
    positions = np.stack([np.concatenate([np.arange(n) for n in row]) for row in lengths]).astype(np.int32)
    tokens = rng.integers(0, VOCAB, segments.shape).astype(np.int32)
    return {"tokens": tokens, "segment_ids": segments, "positions": positions}


def documents_alone_loss(lengths):
    """The packed loss, computed by running every document alone: each document's summed
    next-token cross-entropy, over all BATCH x SEQ target positions."""

    def loss_fn(model, tokens, key=None):
        total = jnp.zeros((), jnp.float32)
        for r, row in enumerate(lengths):
            start = 0
            for n in row:
                doc = tokens[r, start : start + n]
                logits = model(doc[:-1])
                losses = vocab_parallel_cross_entropy(logits, doc[1:], model.axis_name, VOCAB)
                total = total + jnp.sum(losses)
                start += n
        return total / (len(lengths) * SEQ)

    return loss_fn


def step_once(model, loss_fn, mesh, batch, spec, context_axis=None):
    step = eqxpar.train.hybrid_step(loss_fn, optax.sgd(LR), mesh, batch_axis="data", context_axis=context_axis)
    model, opt_state = step.init(model)
    model, _, metrics = step(model, opt_state, eqxpar.shard(batch, mesh, spec))
    return float(metrics["loss"]), float(metrics["grad_norm"]), model


def arrays(model):
    return [np.asarray(a) for a in jax.tree.leaves(eqx.filter(model, eqx.is_array))]


def doc_lengths(draw_rows=BATCH):
    """Rows of document lengths (each >= 2, so every document has a target) summing to SEQ + 1."""

    def split(cuts):
        points = sorted({0, SEQ + 1, *cuts})
        lengths = [b - a for a, b in zip(points, points[1:])]
        return lengths if min(lengths) >= 2 else [SEQ + 1]

    row = st.lists(st.integers(2, SEQ - 1), max_size=4).map(split)
    return st.lists(row, min_size=draw_rows, max_size=draw_rows)


# Pinned: documents that straddle the zigzag chunks of 4 (context=2) and of 2 (context=4).
STRADDLE = [[3, 6, 5, 3], [7, 2, 8]]

CASES = {
    # name: (family, attention, sequence parallel, mesh, context axis)
    "gpt-reference-tp": ("gpt", "reference", False, {"data": 2, "model": 2}),
    "gpt-dot-product-sp": ("gpt", "dot_product", True, {"data": 2, "model": 2}),
    "gpt-ring": ("gpt", "ring", False, {"data": 2, "context": 2, "model": 1}),
    "gpt-all-gather-tp": ("gpt", "all_gather", False, {"data": 1, "context": 4, "model": 2}),
    "llama-dot-product-tp": ("llama", "dot_product", False, {"data": 2, "model": 2}),
    "llama-sp": ("llama", "dot_product", True, {"data": 1, "model": 2}),
    "llama-ring-tp": ("llama", "ring", False, {"data": 1, "context": 2, "model": 2}),
    "llama-all-gather": ("llama", "all_gather", False, {"data": 2, "context": 4, "model": 1}),
}


@PINS_ONLY
@given(case=st.sampled_from(sorted(CASES)), lengths=doc_lengths(), seed=st.integers(0, 2**16))
@example(case="gpt-ring", lengths=STRADDLE, seed=0)
@example(case="gpt-all-gather-tp", lengths=STRADDLE, seed=1)
@example(case="gpt-reference-tp", lengths=STRADDLE, seed=2)
@example(case="gpt-dot-product-sp", lengths=STRADDLE, seed=3)
@example(case="llama-ring-tp", lengths=STRADDLE, seed=4)
@example(case="llama-all-gather", lengths=STRADDLE, seed=5)
@example(case="llama-dot-product-tp", lengths=STRADDLE, seed=6)
@example(case="llama-sp", lengths=STRADDLE, seed=7)
def test_packed_step_equals_documents_alone(case, lengths, seed):
    family, impl, sp, shape = CASES[case]
    build = gpt if family == "gpt" else llama
    loss = next_token_loss if family == "gpt" else llama_loss
    batch = packed(lengths, seed)
    one = eqxpar.make_mesh(data=1, model=1)
    # The reference: every document alone on one device (whole-sequence attention, no mask).
    dense_impl = "dot_product" if impl in ("ring", "all_gather") else impl
    want = step_once(build(dense_impl), documents_alone_loss(lengths), one, batch["tokens"], P())

    mesh = eqxpar.make_mesh(**shape)
    context = shape.get("context")
    if context:  # shift first, then each sequence in the devices' zigzag order
        order = layout_order(SEQ, context, "zigzag")
        shifted = {k: np.asarray(v)[:, order] for k, v in next_token_batch(batch).items()}
        got = step_once(
            build(impl, sp), lambda m, b, key=None: loss(m, b), mesh, shifted, P("data", "context"), "context"
        )
    else:
        got = step_once(build(impl, sp), lambda m, b, key=None: loss(m, b), mesh, batch, P("data"))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5)
    for a, b in zip(arrays(got[2]), arrays(want[2])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_packed_logits_equal_each_document_alone(family):
    """The forward pass alone: the packed row's logits at each document's tokens are that
    document's own logits (one device), and a row without the mask differs (the test sees a
    dropped mask)."""
    model = gpt("dot_product") if family == "gpt" else llama("dot_product")
    lengths = [[5, 4, 7]]
    batch = packed(lengths, 9)
    tokens = jnp.asarray(batch["tokens"][0])
    mesh = eqxpar.make_mesh(data=1, model=1)

    def run(inputs, segment_ids=None, positions=None):
        fn = eqxpar.filter_shard_map(
            lambda m, t, s, p: m(t, segment_ids=s, positions=p),
            mesh=mesh,
            in_specs=(P(),) * 4,
            out_specs=P(None, "model"),
        )
        return np.asarray(fn(model, inputs, segment_ids, positions))

    masked = run(tokens, jnp.asarray(batch["segment_ids"][0]), jnp.asarray(batch["positions"][0]))
    plain = run(tokens)
    start = 0
    for n in lengths[0]:
        alone = run(tokens[start : start + n])
        np.testing.assert_allclose(masked[start : start + n, :VOCAB], alone[:, :VOCAB], rtol=1e-5, atol=1e-6)
        start += n
    assert not np.allclose(plain[5:9, :VOCAB], masked[5:9, :VOCAB], atol=1e-3)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_packed_equals_documents_alone(schedule):
    """The GPT's pipeline stages carry the segment ids between stages: a step over stage=2
    on a packed batch equals every document alone on one device."""
    lengths = STRADDLE
    batch = packed(lengths, 11)
    one = eqxpar.make_mesh(data=1, model=1)
    want = step_once(gpt("dot_product", scan=True), documents_alone_loss(lengths), one, batch["tokens"], P())
    mesh = eqxpar.make_mesh(stage=2, data=1, model=1)
    step = eqxpar.train.pipeline_step(
        gpt_stages(), optax.sgd(LR), mesh, microbatches=2, schedule=schedule, batch_axis="data"
    )
    model, opt_state = step.init(gpt("dot_product", scan=True))
    model, _, metrics = step(model, opt_state, eqxpar.shard(batch, mesh, P("data")))
    np.testing.assert_allclose(float(metrics["loss"]), want[0], rtol=1e-5)
    np.testing.assert_allclose(float(metrics["grad_norm"]), want[1], rtol=1e-5)
    for a, b in zip(arrays(model), arrays(want[2])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
