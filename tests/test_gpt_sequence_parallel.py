"""Megatron sequence parallelism through the GPT (`GPT(sequence_parallel=True)`).

- Over drawn data x context x model meshes, both context-parallel modes (and none), with
  and without residual dropout, scanned or not: the loss, gradient norm and parameters
  after K steps equal the one-device GPT's.
- The compiled step's collectives equal the theory byte for byte: the all-reduces of the
  tensor-parallel path become all-gathers and reduce-scatters of the same arrays.
- A sequence that does not split over the model axis is a ValueError before any compile.
"""

import functools

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
from eqxpar.inspect import CommReport, context_parallel_theory, data_parallel_theory
from eqxpar.models import GPT, gpt_tensor_parallel_theory, next_token_loss
from eqxpar.nn import layout_order, vocab_parallel_cross_entropy

VOCAB, SEQ, DIM, HEADS, BATCH, STEPS = 7, 16, 8, 4, 4, 2
CONTEXT_MODES = ("ring", "all_gather")


def gpt(attention_impl, *, sequence_parallel, dropout_p=0.0, scan_layers=False, layers=2, remat="none"):
    # Context-parallel attention takes no attention dropout: the residual and embedding
    # dropouts are what this draws (the one-device reference has the same settings).
    return GPT(
        VOCAB,
        SEQ,
        DIM,
        HEADS,
        layers,
        dropout_p=dropout_p,
        attention_dropout_p=0.0,
        pad_vocab_to_multiple_of=8,
        attention_impl=attention_impl,
        sequence_parallel=sequence_parallel,
        scan_layers=scan_layers,
        remat=remat,
        key=jax.random.key(3),
    )


def split_loss(model, batch, key=None):
    """The loss over this device's positions (context parallelism: its part of each sequence)."""
    inputs, targets = batch
    return jnp.mean(vocab_parallel_cross_entropy(model(inputs, key=key), targets, model.axis_name, model.vocab_size))


def whole_loss(model, tokens, key=None):
    return next_token_loss(model, tokens, key=key)


def build(shape, attention_impl, model, optimizer):
    """(step, placed model and state, batch function) for a mesh with or without a context axis."""
    mesh = eqxpar.make_mesh(**shape)
    context = shape.get("context", 1) > 1 or attention_impl in CONTEXT_MODES
    if context:
        step = eqxpar.train.hybrid_step(split_loss, optimizer, mesh, batch_axis="data", context_axis="context")
        order = layout_order(SEQ, shape["context"], "zigzag")

        def place(t):
            return eqxpar.shard((t[:, :-1][:, order], t[:, 1:][:, order]), mesh, P("data", "context"))
    else:
        step = eqxpar.train.hybrid_step(whole_loss, optimizer, mesh, batch_axis="data")

        def place(t):
            return t

    return mesh, step, place


@functools.cache
def cached_build(shape_items, attention_impl):
    """One step per mesh and attention, shared by the examples (the one-device reference's
    above all): a step compiles once per model structure, not once per example."""
    return build(dict(shape_items), attention_impl, None, optax.adamw(1e-2))


def run(shape, attention_impl, model, tokens, key):
    _, step, place = cached_build(tuple(shape.items()), attention_impl)
    model, opt_state = step.init(model)
    history = []
    for i, t in enumerate(tokens):
        model, opt_state, metrics = step(
            model, opt_state, place(t), key=None if key is None else jax.random.fold_in(key, i)
        )
        history.append((float(metrics["loss"]), float(metrics["grad_norm"])))
    return model, history


MESHES = [
    {"data": 1, "model": 2},
    {"data": 2, "model": 4},
    {"data": 1, "model": 8},
    {"data": 1, "context": 2, "model": 2},
    {"data": 2, "context": 2, "model": 2},
    {"data": 1, "context": 4, "model": 2},
    {"data": 1, "context": 2, "model": 4},
]


@PINS_ONLY  # the pins below; draws under HYPOTHESIS_PROFILE=thorough (make test time)
# Pinned: dropout with the sequence split over context (ring, all-gather) and over model
# (sequence parallelism): every shard must drop what one device drops on the whole sequence.
@example(
    shape={"data": 1, "context": 2, "model": 2},
    mode="ring",
    dense_attention="reference",
    dropout=True,
    scan_layers=False,
    seed=0,
)
@example(
    shape={"data": 1, "context": 2, "model": 2},
    mode="all_gather",
    dense_attention="reference",
    dropout=True,
    scan_layers=True,
    seed=1,
)
@given(
    shape=st.sampled_from(MESHES),
    mode=st.sampled_from(CONTEXT_MODES),
    dense_attention=st.sampled_from(["dot_product", "reference"]),
    dropout=st.booleans(),
    scan_layers=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_sequence_parallel_gpt_equals_one_device(shape, mode, dense_attention, dropout, scan_layers, seed):
    if shape["model"] > HEADS:
        shape = {**shape, "model": HEADS}
    # Dropout keys differ between data shards by design (each shard its own key), so
    # dropout is drawn only where one device can reproduce it: a single data shard.
    dropout_p = 0.25 if dropout and shape["data"] == 1 else 0.0
    key = jax.random.key(seed) if dropout_p else None
    attention_impl = mode if "context" in shape else dense_attention
    tokens = jax.random.randint(jax.random.key(seed), (STEPS, BATCH, SEQ + 1), 0, VOCAB)

    reference = gpt("reference", sequence_parallel=False, dropout_p=dropout_p)
    ref_model, want = run({"data": 1, "model": 1}, "reference", reference, tokens, key)
    model = gpt(attention_impl, sequence_parallel=True, dropout_p=dropout_p, scan_layers=scan_layers)
    got_model, got = run(shape, attention_impl, model, tokens, key)

    # float32: the sums run in another order (reduce-scatters over the model axis, the
    # context shards' partial sums), a few ulps per step; AdamW's first steps are
    # lr-sized, hence the absolute tolerance on the parameters.
    np.testing.assert_allclose([l for l, _ in got], [l for l, _ in want], rtol=2e-5)
    np.testing.assert_allclose([n for _, n in got], [n for _, n in want], rtol=1e-4)
    if scan_layers:
        got_model = eqxpar.models.unstack_blocks(got_model)

    def arrays(m):
        return jax.tree.leaves(eqx.filter(m, eqx.is_array))

    for a, b in zip(arrays(got_model), arrays(ref_model), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=3e-5)


def _model_traffic(shape, attention_impl, remat):
    model = gpt(attention_impl, sequence_parallel=True, remat=remat)
    mesh, step, place = build(shape, attention_impl, model, optax.sgd(0.1))
    placed, opt_state = step.init(model)
    tokens = jax.random.randint(jax.random.key(0), (BATCH, SEQ + 1), 0, VOCAB)
    report = CommReport.of(step.lower(placed, opt_state, place(tokens)), mesh=mesh)
    context = "context" if "context" in shape else None
    batch_axis = ("data", "context") if context else "data"
    theory = data_parallel_theory(model, mesh, eqxpar.nn.partition_specs(model, mesh), batch_axis=batch_axis)
    theory += gpt_tensor_parallel_theory(
        model, mesh, BATCH, SEQ, batch_axis="data", context_axis=context, remat=remat != "none"
    )
    if context:
        theory += context_parallel_theory(
            mesh,
            batch=BATCH,
            seq_len=SEQ,
            num_heads=HEADS,
            head_dim=DIM // HEADS,
            num_layers=2,
            mode=attention_impl,
            model_axis="model",
            remat=remat != "none",
        )
    return report, theory


@pytest.mark.parametrize(
    "shape, attention_impl, remat",
    [
        # The default run: every theory term (SP, CP both modes, remat) in two compiles.
        ({"data": 2, "context": 2, "model": 2}, "all_gather", "none"),
        ({"data": 1, "context": 2, "model": 2}, "ring", "block"),
        pytest.param({"data": 2, "model": 2}, "dot_product", "none", marks=pytest.mark.thorough),
        pytest.param({"data": 1, "model": 4}, "reference", "block", marks=pytest.mark.thorough),
        pytest.param({"data": 1, "context": 4, "model": 2}, "all_gather", "block", marks=pytest.mark.thorough),
    ],
)
def test_sequence_parallel_bytes_equal_the_theory(shape, attention_impl, remat):
    report, theory = _model_traffic(shape, attention_impl, remat)
    comparison = report.versus(theory)
    for row in comparison.rows:
        for stage in ("lowered", "compiled"):
            assert getattr(row, stage) == row.theory, (row, stage, str(comparison))
    model_kinds = {kind for kind, axes in report.traffic() if axes == ("model",)}
    assert model_kinds == {"all-gather", "reduce-scatter", "all-reduce"}
    if remat == "none":
        # Each all-gather's transpose is a reduce-scatter of the same array and vice versa.
        assert report.bytes("all-gather", axes="model") == report.bytes("reduce-scatter", axes="model") > 0


def test_sequence_parallel_moves_what_tensor_parallelism_all_reduces():
    """Without remat the gathered and scattered arrays are the activation all-reduces of
    the same step with `sequence_parallel=False`, array for array."""
    shape = {"data": 2, "model": 2}
    mesh = eqxpar.make_mesh(**shape)
    tokens = jax.random.randint(jax.random.key(0), (BATCH, SEQ + 1), 0, VOCAB)
    sizes = {}
    for sp in (False, True):
        model = gpt("dot_product", sequence_parallel=sp)
        step = eqxpar.train.hybrid_step(whole_loss, optax.sgd(0.1), mesh, batch_axis="data")
        placed, opt_state = step.init(model)
        report = CommReport.of(step.lower(placed, opt_state, tokens), mesh=mesh)
        activation = BATCH // 2 * SEQ * DIM * 4
        sizes[sp] = {
            kind: sum(c.bytes for c in report.collectives(kind, axes="model") if c.bytes == activation)
            for kind in ("all-reduce", "all-gather", "reduce-scatter")
        }
    assert sizes[False]["all-gather"] == sizes[False]["reduce-scatter"] == 0
    assert sizes[True]["all-reduce"] == 0
    assert sizes[True]["all-gather"] == sizes[True]["reduce-scatter"] == sizes[False]["all-reduce"] > 0


def test_sequence_that_does_not_split_over_the_model_axis_is_a_value_error():
    mesh = eqxpar.make_mesh(data=1, model=4)
    step = eqxpar.train.hybrid_step(whole_loss, optax.sgd(0.1), mesh, batch_axis="data")
    model, opt_state = step.init(gpt("dot_product", sequence_parallel=True))
    tokens = jnp.zeros((BATCH, 7), jnp.int32)  # 6 positions over 4 devices
    with pytest.raises(ValueError, match=r"sequence_parallel=True splits the 6 positions .* multiple of 4"):
        step(model, opt_state, tokens)
