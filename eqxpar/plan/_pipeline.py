"""What a pipeline layout costs (`stage > 1`: [`eqxpar.train.pipeline_step`][] with
[`eqxpar.models.gpt_stages`][] or [`eqxpar.models.llama_stages`][]), from the schedule's
tables and the model's shapes.

Every device runs the same program: at every tick of the schedule each stage runs the
embedding, its chunk of blocks and the head on one micro-batch (masked where it has no
work), and sends one stage output (forward) or one activation gradient (backward) to its
neighbour. So the stage traffic, the tensor-parallel collectives and the saved
activations count the schedule's ticks, not its micro-batches.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec

from .._specs import spec_axes
from ..inspect import CommTheory, TheoryTerm
from ..nn import partition_specs
from ..train import fsdp_specs, pipeline_specs
from ._candidates import Layout, used_axes
from ._family import (
    PlanModel,
    activation_theory,
    blocks_of,
    param_dtype,
    stages_of,
    width,
    without_blocks,
    without_parameter_copies,
)
from ._predict import block_bytes, leaf_blocks, optimizer_layout
from ._predict_memory import WORKING_SET_BLOCKS, Memory, logits_gradient_bytes
from ._predict_time import flops_per_token

BATCH_AXES = ("data", "fsdp")

_SPECS: dict[tuple[int, int, int], Any] = {}
_SPLIT: dict[tuple[int, int], Any] = {}


def clear_caches() -> None:
    """Forget the pipeline specs and leaf splits kept by model id (one plan call's worth)."""
    _SPECS.clear()
    _SPLIT.clear()


def pipeline_layout_specs(gpt: PlanModel, layout: Layout, mesh: Mesh) -> Any:
    """The specs `pipeline_step` gives the model: [`eqxpar.nn.partition_specs`][] with the
    stacked blocks' layer axis split over `stage` ([`eqxpar.train.pipeline_specs`][]); with
    `fsdp > 1`, [`eqxpar.train.fsdp_specs`][] over `fsdp` on top (FSDP inside the stages).
    Cached per model, FSDP and model sizes (`fsdp_specs` may split a dimension `model` splits
    further, where the sizes allow; the stage size changes only the blocks)."""
    key = (id(gpt), layout.fsdp, layout.model)
    if key not in _SPECS:
        specs = pipeline_specs(stages_of(gpt), gpt, partition_specs(gpt), "stage")
        if layout.fsdp > 1:
            specs = fsdp_specs(gpt, mesh, batch_axis="fsdp", param_specs=specs)
        _SPECS[key] = (gpt, specs)
    return _SPECS[key][1]


def _split(gpt: PlanModel, specs: Any) -> tuple[Any, Any, Any, Any]:
    """The model's tree and specs in two: the stacked blocks, and the rest (embeddings,
    final norm, head: the parts copied on every stage)."""
    key = (id(gpt), id(specs))
    if key not in _SPLIT:
        _SPLIT[key] = (gpt, specs, (blocks_of(gpt), blocks_of(specs), without_blocks(gpt), without_blocks(specs)))
    return _SPLIT[key][-1]


def ticks(layout: Layout) -> tuple[int, int]:
    """(forward ticks, backward ticks) of the layout's schedule, in closed form (the tables
    of [`eqxpar.train.make_schedule`][] cost ticks x stages to build;
    tests/test_plan_pipeline.py checks these against them): `r M + P - 1` each way for
    GPipe and circular; for 1F1B `P - 1` warm-up forward ticks, `M` ticks of both, `P - 1`
    backward ticks."""
    P, M, r = layout.stage, layout.microbatches, layout.virtual_stages
    return (r * M + P - 1, r * M + P - 1)


def in_flight(layout: Layout) -> int:
    """The most stage inputs a 1F1B stage keeps (`Schedule.max_in_flight`): `min(M, 2P - 1)`."""
    return min(layout.microbatches, 2 * layout.stage - 1)


def pipeline_comm(gpt: PlanModel, layout: Layout, specs: Any, batch: int, seq: int) -> CommTheory:
    """The collectives of a pipeline step, per device per step:

    - `collective-permute` over `stage`: [`eqxpar.train.stage_boundary_bytes`][] of the
      schedule (from the closed-form ticks), one micro-batch's stage output each; less one for 1F1B on 2 stages, whose
      last backward phase is a single tick: XLA unrolls it and drops its gradient send,
      which nothing reads.
    - circular with `r > 1`: the blocks' interleaved layout on the way in and the
      gradients' on the way out, as XLA reshards them: an `all-to-all` over `stage` of each
      device's blocks each way, and with `r < P` also a `collective-permute` of them.
    - with `fsdp > 1` (FSDP inside the stages), once per step: an `all-gather` over `fsdp`
      of every parameter split over it (the gathered bytes), and autodiff's transpose, a
      `reduce-scatter` of their gradients (the same bytes).
    - gradients, summed once per step after the last micro-batch, each leaf over the batch
      axes it is copied on (not those it is split over: its scatter summed those): the
      blocks over those; the embeddings, final norm and head (copied on every stage) over
      those and `stage`, with the loss (4 bytes).
    - the gradient norm: one float32 scalar all-reduce per distinct set of axes the
      parameters' specs split over.
    - with `model > 1`, the model's Megatron all-reduces (as
      [`eqxpar.models.gpt_tensor_parallel_theory`][] and
      [`eqxpar.models.llama_tensor_parallel_theory`][] count them) for one micro-batch and the stage's
      `L / (r P)` blocks, once per tick: forward ticks the embedding lookup, two per block
      and the cross-entropy's three; backward ticks two per block and the head's input
      gradient; with remat (GPipe, circular) every backward tick recomputes the forward;
      1F1B's forward ticks skip the cross-entropy (their loss is not read) and its backward
      ticks recompute the forward inside their `jax.vjp`.
    """
    sizes = layout.sizes
    P, r, M = layout.stage, layout.virtual_stages, layout.microbatches
    itemsize = np.dtype(param_dtype(gpt)).itemsize
    dim = width(gpt)
    rows = batch // (layout.batch_shards * M)
    tokens = rows * seq
    stream = tokens * dim * itemsize
    terms: list[TheoryTerm] = []
    ticks_f, ticks_b = ticks(layout)
    sent = (ticks_f + ticks_b) * stream  # eqxpar.train.stage_boundary_bytes of the schedule
    if layout.schedule == "1f1b" and P == 2:
        sent -= stream
    terms.append(
        TheoryTerm(
            "collective-permute", ("stage",), sent, f"stage outputs and their gradients, {ticks_f}+{ticks_b} ticks"
        )
    )
    blocks, block_specs, others, other_specs = _split(gpt, specs)
    layer_bytes = block_bytes(blocks, block_specs, sizes)
    if r > 1:
        terms.append(TheoryTerm("all-to-all", ("stage",), 2 * layer_bytes, "circular: blocks interleaved, and back"))
        if r < P:
            terms.append(
                TheoryTerm("collective-permute", ("stage",), 2 * layer_bytes, "circular: the interleave's moves")
            )
    if layout.fsdp > 1:
        whole = block_bytes(gpt, specs, {**sizes, "fsdp": 1}, split_only=True)
        terms.append(TheoryTerm("all-gather", ("fsdp",), whole, "FSDP: the stage's parameters, gathered once per step"))
        terms.append(TheoryTerm("reduce-scatter", ("fsdp",), whole, "FSDP: their gradients, scattered once per step"))
    sums = _gradient_sums(blocks, block_specs, sizes, ())
    for axes, n in _gradient_sums(others, other_specs, sizes, ("stage",)).items():
        sums[axes] = sums.get(axes, 0) + n
    everywhere = used_axes(("stage", *BATCH_AXES), sizes)
    sums[everywhere] = sums.get(everywhere, 0) + 4  # the loss
    for axes, n in sums.items():
        terms.append(
            TheoryTerm(
                "all-reduce",
                axes,
                n,
                "gradients summed over the batch axes they are copied on (the embeddings, final norm and "
                "head over `stage` too: copied on every stage), and the loss",
            )
        )
    for axes in _norm_axes(gpt, specs, sizes):
        terms.append(TheoryTerm("all-reduce", axes, 4, "gradient norm: a float32 sum of squares"))
    if layout.model > 1:
        chunk = gpt.num_layers // (P * r)
        cross_entropy = 3 * tokens * itemsize
        forward = stream + 2 * chunk * stream + cross_entropy
        backward = 2 * chunk * stream + stream
        if layout.schedule == "1f1b":
            model_bytes = ticks_f * (forward - cross_entropy) + ticks_b * (forward + backward)
            statistics = ticks_b * cross_entropy
        else:
            model_bytes = ticks_f * forward + ticks_b * backward
            statistics = ticks_f * cross_entropy
            if layout.remat == "block":
                model_bytes += ticks_b * forward
                statistics += ticks_b * cross_entropy
        terms.append(
            TheoryTerm(
                "all-reduce", ("model",), model_bytes - statistics, f"tensor parallelism, {chunk} blocks per tick"
            )
        )
        terms.append(
            TheoryTerm(
                "all-reduce", ("model",), statistics, "cross-entropy: max, sum of exponentials, target logit per tick"
            )
        )
    return CommTheory(tuple(t for t in terms if t.axes and t.bytes))


def _gradient_sums(tree: Any, specs: Any, sizes: dict[str, int], extra: tuple[str, ...]) -> dict[tuple, int]:
    """Bytes of each device's gradients per set of axes `pipeline_step` sums them over:
    the batch axes a leaf's spec does not split (those it splits over, `fsdp`, its gather's
    transpose already scattered), and `extra`."""
    out: dict[tuple, int] = {}
    for split, n in leaf_blocks(tree, specs, sizes):
        key = used_axes((*(a for a in BATCH_AXES if a not in split), *extra), sizes)
        if key:
            out[key] = out.get(key, 0) + n
    return out


def _norm_axes(gpt: PlanModel, specs: Any, sizes: dict[str, int]) -> list[tuple[str, ...]]:
    """The axes of the gradient norm's all-reduces: one per distinct set of axes a
    floating-point parameter's spec names (those of size 1 left out: no traffic)."""
    seen: list[tuple[str, ...]] = []
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    for leaf, spec in zip(jax.tree.leaves(gpt), spec_leaves, strict=True):
        if not hasattr(leaf, "dtype") or not np.issubdtype(leaf.dtype, np.inexact):
            continue
        axes = spec_axes(spec or PartitionSpec())
        if axes not in seen:
            seen.append(axes)
    keys: list[tuple[str, ...]] = []
    for axes in seen:
        key = used_axes(axes, sizes)
        if key:
            keys.append(key)
    return keys


def pipeline_memory(
    gpt: PlanModel,
    mesh: Mesh,
    layout: Layout,
    specs: Any,
    optimizer: optax.GradientTransformation,
    batch: int,
    seq: int,
    dtype: Any,
) -> Memory:
    """Bytes per device of a pipeline step:

    - parameters and optimizer state (exact): the stage's `L / P` blocks (split over
      `model` as the model's specs say) plus the embeddings, final norm and head, which every
      stage holds (they run, masked, on every stage).
    - saved activations: without remat, GPipe and circular keep every tick's residuals
      (`r M + P - 1` ticks, idle ones too: one scan), each one micro-batch through the
      embedding, the stage's blocks and the head (the model's activation theory of one
      micro-batch); with remat only each tick's input (one stage output); 1F1B keeps
      at most `min(M, 2P - 1)` stage inputs (`Schedule.max_in_flight`).
    - temporaries (an estimate): the gradients, a compute-dtype copy of the parameters,
      one micro-batch's logits gradient (compute dtype), the working set of two blocks,
      with remat or 1F1B the recomputed tick's activations, and for `r > 1` the
      interleaved copy of the blocks and their gradients.
    """
    sizes = layout.sizes
    P, r, M = layout.stage, layout.virtual_stages, layout.microbatches
    params = block_bytes(gpt, specs, sizes)
    opt_shapes, opt_specs = optimizer_layout(gpt, optimizer, specs)
    opt = block_bytes(opt_shapes, opt_specs, sizes, floating_only=False)
    # Activations proper: the weights' cast copies count once, with the temporaries' cast
    # copy of the parameters, not once per tick (the ticks run the same weights).
    activations = without_parameter_copies(
        activation_theory(gpt, mesh, batch // M, seq, batch_axis=BATCH_AXES, context_axis=None, dtype=dtype)
    )
    chunk = gpt.num_layers // (P * r)
    outside = activations.total - gpt.num_layers * activations.per_block
    tick = chunk * activations.per_block + outside
    rows = batch // (layout.batch_shards * M)
    dim = width(gpt)
    stage_input = rows * seq * dim * np.dtype(dtype).itemsize
    kept, _ = ticks(layout)  # GPipe and circular keep every forward tick's residuals
    if layout.schedule == "1f1b":
        saved, per_block = in_flight(layout) * stage_input, 0
    elif layout.remat == "block":
        saved, per_block = kept * stage_input, 0
    else:
        saved, per_block = kept * tick, kept * activations.per_block
    temporaries = params  # the gradients
    if layout.fsdp > 1:  # the stage's parameters gathered whole, and their gradients before the scatter
        temporaries += 2 * (block_bytes(gpt, specs, {**sizes, "fsdp": 1}) - params)
    if np.dtype(dtype) != np.dtype(param_dtype(gpt)):
        temporaries += block_bytes(gpt, specs, sizes, dtype=dtype)
    temporaries += logits_gradient_bytes(gpt, layout, rows * seq, dtype)
    temporaries += WORKING_SET_BLOCKS * activations.per_block
    if layout.schedule == "1f1b" or layout.remat == "block":
        temporaries += tick
    if r > 1:
        blocks, block_specs, _, _ = _split(gpt, specs)
        temporaries += 2 * block_bytes(blocks, block_specs, sizes)
    return Memory(params, opt, int(saved), int(temporaries), int(per_block))


def pipeline_flops(gpt: PlanModel, layout: Layout, batch: int, seq: int) -> float:
    """FLOPs one device executes in its `r M` working ticks: its `1/P` of the blocks'
    training FLOPs, and the whole head's in every working tick (every stage runs it on
    each chunk it passes, masked where it is not the last: `r` times per micro-batch), over
    `model`, for its batch shard; with remat or 1F1B the forward again. (The idle ticks'
    masked work is the bubble: [`eqxpar.plan.StepTime`][].)"""
    train, forward, _, head_forward = flops_per_token(gpt, seq)
    tokens = batch // layout.batch_shards * seq
    P, r = layout.stage, layout.virtual_stages
    flops = tokens * ((train - 3 * head_forward) / P + 3 * head_forward * r)
    if layout.remat == "block" or layout.schedule == "1f1b":
        flops += tokens * ((forward - head_forward) / P + head_forward * r)
    return flops / layout.model
