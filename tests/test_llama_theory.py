"""The Llama's tensor-parallel steps communicate exactly what its theory says: the
hybrid step's all-reduces over data and model, and FSDP x TP's gathers, scatters and
all-reduces, byte for byte (with grouped-query attention and tied embeddings); with
sequence parallelism, context parallelism (ring and all-gather attention) and remat
too, in the composition the planner uses (`eqxpar/plan/_predict_comm.py`'s
`comm_theory`) on its five-axis mesh."""

import dataclasses
import itertools

import pytest
from _budget import case
from jax.sharding import PartitionSpec as P
from test_llama import BATCH, OPTIMIZER, SEQ, loss_fn, tiny_llama, token_batch
from test_llama_parallel_more import tiny_llama as options_llama
from test_llama_parallel_more import token_batches

import eqxpar
import eqxpar.nn
from eqxpar.inspect import (
    CommReport,
    CommTheory,
    TheoryTerm,
    context_parallel_theory,
    data_parallel_theory,
    fsdp_theory,
)
from eqxpar.models import llama_tensor_parallel_theory
from eqxpar.models._llama_theory import llama_context_parallel_theory
from eqxpar.nn import zigzag_order
from eqxpar.train import fsdp_specs, fsdp_step, hybrid_step


@pytest.mark.parametrize("strategy, tie", [("hybrid", True), ("fsdp+tp", False)])
def test_llama_steps_communicate_exactly_the_minimum(strategy, tie):
    model = tiny_llama(0, num_kv_heads=2, tie=tie)
    if strategy == "hybrid":
        mesh, batch_axis = eqxpar.make_mesh(data=2, model=2), "data"
        specs = eqxpar.nn.partition_specs(model, mesh)
        step = hybrid_step(loss_fn, OPTIMIZER, mesh, param_specs=specs)
        theory = data_parallel_theory(model, mesh, specs)
    else:
        mesh, batch_axis = eqxpar.make_mesh(fsdp=2, model=2), "fsdp"
        specs = fsdp_specs(model, mesh, param_specs=eqxpar.nn.partition_specs(model, mesh))
        step = fsdp_step(loss_fn, OPTIMIZER, mesh, param_specs=specs, units=lambda m: m.layers)
        theory = fsdp_theory(model, mesh, specs)
    theory = theory + llama_tensor_parallel_theory(model, mesh, BATCH, SEQ, batch_axis=batch_axis)
    placed, opt_state = step.init(model)
    lowered = step.lower(placed, opt_state, eqxpar.shard(token_batch(0), mesh, P(batch_axis)))
    comparison = CommReport.of(lowered, lowered.compile()).versus(theory)
    for row in comparison.rows:
        for stage in ("lowered", "compiled"):
            assert getattr(row, stage) == row.theory, (row, stage, str(comparison))
    assert comparison.ratio(stage="compiled") == 1.0
    assert theory.bytes(axes=("model",)) > 0


# --- Sequence and context parallelism, remat: the planner's composition ----------------------

BATCH_AXES = ("data", "fsdp")
LONG_SEQ = 16  # test_llama_parallel_more's sequences (max_seq_len 16)


def step_theory(model, mesh, specs, *, fsdp: bool, remat) -> CommTheory:
    """The theory of a Llama step on a `stage, data, fsdp, context, model` mesh, composed
    as `comm_theory` composes the GPT's: `data_parallel_theory` over the batch and context
    axes, or `fsdp_theory` over `fsdp` (the loss and the whole parameters' gradients over
    every batch axis, the scattered blocks summed over the others), then the Llama's model
    and context axes."""
    sizes = dict(mesh.shape)
    context = "context" if sizes["context"] > 1 else None
    every = tuple(a for a in sizes if a in (*BATCH_AXES, "context") and sizes[a] > 1)
    if not fsdp:
        theory = data_parallel_theory(model, mesh, specs, batch_axis=(*BATCH_AXES, "context"))
    else:
        whole = fsdp_theory(model, mesh, specs, batch_axis="fsdp")
        terms = [
            dataclasses.replace(t, axes=every)
            if t.what.startswith("loss") or t.what.startswith("gradients of the parameters kept whole")
            else t
            for t in whole.terms
        ]
        others = tuple(a for a in every if a != "fsdp")
        blocks = whole.bytes("reduce-scatter") // sizes["fsdp"]
        if others and blocks:
            terms.append(TheoryTerm("all-reduce", others, blocks, "gradient blocks summed over the other batch axes"))
        theory = CommTheory(tuple(terms))
    theory += llama_tensor_parallel_theory(
        model, mesh, BATCH, LONG_SEQ, batch_axis=BATCH_AXES, context_axis=context, remat=remat
    )
    if context:
        theory += llama_context_parallel_theory(model, mesh, BATCH, LONG_SEQ, batch_axis=BATCH_AXES, remat=remat)
    return theory


def measured(model, sizes: dict, *, fsdp: bool):
    """The compiled step's report on `make_mesh(stage=1, **sizes)`, its mesh and specs."""
    mesh = eqxpar.make_mesh(stage=1, **sizes)
    context = "context" if sizes["context"] > 1 else None
    tp_specs = eqxpar.nn.partition_specs(model, mesh)
    if fsdp:
        specs = fsdp_specs(model, mesh, batch_axis="fsdp", param_specs=tp_specs)
        step = fsdp_step(loss_fn, OPTIMIZER, mesh, param_specs=specs, batch_axis=BATCH_AXES, context_axis=context)
    else:
        specs = tp_specs
        step = hybrid_step(loss_fn, OPTIMIZER, mesh, param_specs=specs, batch_axis=BATCH_AXES, context_axis=context)
    tokens = token_batches(0)[0]
    if context:
        order = zigzag_order(LONG_SEQ, sizes["context"])
        batch = eqxpar.shard((tokens[:, :-1][:, order], tokens[:, 1:][:, order]), mesh, P(BATCH_AXES, "context"))
    else:
        batch = eqxpar.shard(tokens, mesh, P(BATCH_AXES))
    placed, opt_state = step.init(model)
    lowered = step.lower(placed, opt_state, batch)
    return CommReport.of(lowered, lowered.compile()), mesh, specs


def assert_exact(report, theory, lowered_theory=None):
    """Every (kind, axes) row: the compiled program's bytes equal `theory`'s, the lowered
    program's `lowered_theory`'s (default: the same)."""
    lowered = (lowered_theory or theory).traffic()
    comparison = report.versus(theory)
    for row in comparison.rows:
        assert row.compiled == row.theory, (row, "compiled", str(comparison))
        assert row.lowered == lowered.get((row.kind, row.axes), 0), (row, "lowered", str(comparison))
    assert report.traffic(stage="lowered") == lowered


# The default run, three compiles, each placed where a dropped or doubled collective shows:
# - sequence parallelism under save_matmuls with unscanned layers, hybrid over data=2 x
#   model=2: every SP gather and scatter, the RMSNorm gradients' all-reduce, remat's gathers;
#   the lowered program re-scatters each attention output (what "block" counts), the
#   compiled one reuses the forward pass's (what "save_matmuls" counts);
# - ring attention with sequence parallelism, GQA (two key/value heads per device, sent as
#   four) and tied embeddings, remat="block", over data=2 x context=2 x model=2: the K/V
#   ring, its gradients in float32 and its recomputed forward, with SP's terms on
#   `seq / C` tokens;
# - all-gather attention under FSDP (fsdp=2 x context=2 x model=2, one key/value head per
#   device), no SP: the model axis' all-reduces on `seq / C` tokens, the K/V gather and its
#   reduce-scatter, and the planner's FSDP composition with a context axis.
def test_sequence_parallel_remat_save_matmuls_compiles_what_the_theory_says():
    model = options_llama(0, 4, False, scan=False, sequence_parallel=True, remat="save_matmuls")
    sizes = {"data": 2, "fsdp": 1, "context": 1, "model": 2}
    report, mesh, specs = measured(model, sizes, fsdp=False)
    theory = step_theory(model, mesh, specs, fsdp=False, remat="save_matmuls")
    assert_exact(report, theory, step_theory(model, mesh, specs, fsdp=False, remat="block"))
    # The planner passes model.remat != "none": right for the lowered program, and for
    # the compiled one with scanned layers.
    assert step_theory(model, mesh, specs, fsdp=False, remat=True) == step_theory(
        model, mesh, specs, fsdp=False, remat="block"
    )
    assert report.bytes("reduce-scatter", axes="model", stage="lowered") > report.bytes("reduce-scatter", axes="model")


def layout(sizes, attention, *, sp, remat, kv, tie, scan=True, fsdp=False, default=False):
    """One case of `test_llama_layouts_compile_what_the_theory_says`: the mesh's sizes
    (after `stage=1`), the Llama's options, FSDP or the hybrid step."""
    name = f"{'fsdp' if fsdp else 'hybrid'}-{attention}{'-sp' if sp else ''}-{remat}-kv{kv}{'-tie' if tie else ''}"
    name += "" if scan else "-unscanned"
    return case(sizes, fsdp, kv, tie, sp, attention, remat, scan, default=default, id=name)


DATA_CONTEXT_MODEL = {"data": 2, "fsdp": 1, "context": 2, "model": 2}
FSDP_CONTEXT_MODEL = {"data": 1, "fsdp": 2, "context": 2, "model": 2}


@pytest.mark.parametrize(
    "sizes, fsdp, kv, tie, sp, attention, remat, scan",
    [
        layout(DATA_CONTEXT_MODEL, "ring", sp=True, remat="block", kv=4, tie=True, default=True),
        layout(FSDP_CONTEXT_MODEL, "all_gather", sp=False, remat="none", kv=2, tie=False, fsdp=True, default=True),
        # The sweep: every remat x SP x attention, GQA, tied embeddings and scanning varied.
        *(
            layout(
                DATA_CONTEXT_MODEL if attention != "dot_product" else {"data": 4, "fsdp": 1, "context": 1, "model": 2},
                attention,
                sp=sp,
                remat=remat,
                kv=[2, 4, 8][i % 3],
                tie=i % 2 == 1,
                scan=i % 4 != 3,
            )
            for i, (remat, sp, attention) in enumerate(
                itertools.product(
                    ("none", "block", "save_matmuls"), (False, True), ("dot_product", "ring", "all_gather")
                )
            )
        ),
        layout(FSDP_CONTEXT_MODEL, "ring", sp=True, remat="save_matmuls", kv=4, tie=True, scan=False, fsdp=True),
        layout(
            {"data": 2, "fsdp": 2, "context": 2, "model": 1},
            "all_gather",
            sp=False,
            remat="block",
            kv=2,
            tie=False,
            fsdp=True,
        ),
        layout(
            {"data": 1, "fsdp": 1, "context": 2, "model": 4},
            "all_gather",
            sp=True,
            remat="none",
            kv=4,
            tie=True,
            scan=False,
        ),
    ],
)
def test_llama_layouts_compile_what_the_theory_says(sizes, fsdp, kv, tie, sp, attention, remat, scan):
    model = options_llama(0, kv, tie, scan=scan, sequence_parallel=sp, attention_impl=attention, remat=remat)
    report, mesh, specs = measured(model, sizes, fsdp=fsdp)
    theory = step_theory(model, mesh, specs, fsdp=fsdp, remat=remat)
    # The lowered program re-scatters what the compiled one reuses (save_matmuls, SP, unscanned).
    lowered = step_theory(model, mesh, specs, fsdp=fsdp, remat="block" if remat != "none" else "none")
    assert_exact(report, theory, lowered)
    if attention != "dot_product":
        assert theory.bytes(axes=("context",)) > 0
    if sp and mesh.shape["model"] > 1:
        assert {k for k, axes in report.traffic() if axes == ("model",)} == {
            "all-gather",
            "reduce-scatter",
            "all-reduce",
        }


# --- The theory's arithmetic and arguments -------------------------------------------------


def test_context_theory_counts_the_key_value_heads_that_travel():
    mesh = eqxpar.make_mesh(data=2, context=2, model=2)
    shape = dict(batch=8, seq_len=16, head_dim=4, num_layers=2, model_axis="model")
    for mode in ("ring", "all_gather"):
        eight = context_parallel_theory(mesh, num_heads=8, mode=mode, **shape)
        assert context_parallel_theory(mesh, num_heads=8, num_kv_heads=8, mode=mode, **shape) == eight
        grouped = context_parallel_theory(mesh, num_heads=8, num_kv_heads=2, mode=mode, **shape)
        assert grouped.terms == tuple(dataclasses.replace(t, bytes=t.bytes // 4) for t in eight.terms)
        # KV = 2 x (8 / 2 batch) x (16 / 2 context) x (2 / 2 model heads) x 4 channels, float32.
        # Ring: (C - 1) KV forward, (C - 1) KV backward, C KV of float32 gradients; all-gather:
        # C KV gathered, C KV scattered. Either way 4 KV per layer here.
        kv = 2 * 4 * 8 * 1 * 4 * 4
        assert grouped.bytes() == 2 * 4 * kv
    with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=8"):
        context_parallel_theory(mesh, num_heads=8, num_kv_heads=3, **shape)
    with pytest.raises(ValueError, match="num_kv_heads=1 does not split over 2 devices"):
        context_parallel_theory(mesh, num_heads=8, num_kv_heads=1, **shape)
    with pytest.raises(ValueError, match="num_heads=6 does not split over 4 devices"):
        context_parallel_theory(eqxpar.make_mesh(context=2, model=4), num_heads=6, batch_axis=None, **shape)


def test_theory_arguments():
    model = tiny_llama(0)
    with pytest.raises(ValueError, match="model must be an eqxpar.models.Llama"):
        llama_tensor_parallel_theory(object(), eqxpar.make_mesh(model=2), BATCH, SEQ)
    with pytest.raises(ValueError, match=r"seq_len must be in 1\.\.16"):
        llama_tensor_parallel_theory(model, eqxpar.make_mesh(model=2), BATCH, 17)
    with pytest.raises(ValueError, match="batch_size must be a positive multiple of the 4 batch shards"):
        llama_tensor_parallel_theory(model, eqxpar.make_mesh(data=4, model=2), 6, SEQ, batch_axis="data")
    mesh = eqxpar.make_mesh(context=4, model=2)
    with pytest.raises(ValueError, match="split over the 4 context shards, got 6"):
        llama_tensor_parallel_theory(model, mesh, BATCH, 6, context_axis="context")
    with pytest.raises(ValueError, match=r"remat must be True, False or one of \('none', 'block', 'save_matmuls'\)"):
        llama_tensor_parallel_theory(model, mesh, BATCH, SEQ, remat="offload")
    with pytest.raises(ValueError, match="attention_impl='dot_product', which keeps whole sequences"):
        llama_context_parallel_theory(model, mesh, BATCH, SEQ)
    # Booleans and names agree; tokens per device are (batch / shards) x (seq / context).
    ring = options_llama(0, 2, False, attention_impl="ring")
    assert llama_tensor_parallel_theory(ring, mesh, BATCH, SEQ, context_axis="context", remat=True) == (
        llama_tensor_parallel_theory(ring, mesh, BATCH, SEQ, context_axis="context", remat="block")
    )
    plain = llama_tensor_parallel_theory(ring, mesh, BATCH, SEQ, context_axis="context")
    tokens, dim = BATCH * SEQ // 4, 32
    assert plain.bytes(axes=("model",)) == (4 * 2 + 2) * tokens * dim * 4 + 3 * tokens * 4
    # Ring over C=4: 3 KV forward, 3 KV backward, 4 KV of gradients per layer, the keys and
    # values with the 4 query heads of 4 channels per device (not the 1 key/value head).
    kv = 2 * tokens * 4 * 4 * 4
    assert llama_context_parallel_theory(ring, mesh, BATCH, SEQ).bytes() == 2 * (3 + 3 + 4) * kv
