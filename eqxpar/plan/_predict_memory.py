"""Bytes per device of a layout's step: parameters and optimizer state (exact), saved
activations (the GPT's activation theory) and temporaries (an estimate; see `_predict.py`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec

from ._candidates import Layout
from ._experts import routed_arrays
from ._family import (
    PlanModel,
    activation_theory,
    attention_shape,
    blocks_of,
    param_dtype,
    parameter_copies,
    vocab_rows,
    without_parameter_copies,
)
from ._predict import block_bytes, optimizer_layout


@dataclasses.dataclass(frozen=True)
class Memory:
    """Predicted bytes per device: `parameters` and `optimizer_state` (exact: the blocks
    their specs give), `saved_activations` (the GPT's activation theory: exact for
    `block`/`save_matmuls`, a lower bound for `none`; with experts and `none`, plus an
    estimate of the routed experts' arrays), `temporaries` (an estimate: see
    [`eqxpar.plan.plan`][])."""

    parameters: int
    optimizer_state: int
    saved_activations: int
    temporaries: int
    saved_per_block: int = 0
    """Of `saved_activations`, what one more block adds (exact for `block`/`save_matmuls`
    outside FSDP: see [`eqxpar.models.gpt_activation_theory`][])."""

    @property
    def state(self) -> int:
        return self.parameters + self.optimizer_state

    @property
    def peak(self) -> int:
        return self.parameters + self.optimizer_state + self.saved_activations + self.temporaries


def memory(
    gpt: PlanModel,
    mesh: Mesh,
    layout: Layout,
    specs: Any,
    optimizer: optax.GradientTransformation,
    batch: int,
    seq: int,
    dtype: Any,
    fused_attention: bool = False,
    gpt_without_remat: PlanModel | None = None,
) -> Memory:
    """Bytes per device of the layout's step (see [`eqxpar.plan.Memory`][]). With remat,
    `gpt_without_remat` is the same GPT without remat: what one of its blocks keeps is the
    working set of the block being recomputed."""
    sizes = layout.sizes
    params = block_bytes(gpt, specs, sizes)
    opt_shapes, opt_specs = optimizer_layout(gpt, optimizer, specs)
    opt = block_bytes(opt_shapes, opt_specs, sizes, floating_only=False)
    context_axis = "context" if layout.context > 1 else None
    activations = activation_theory(
        gpt, mesh, batch, seq, batch_axis=layout.batch_axes, context_axis=context_axis, dtype=dtype
    )
    # With a cast, the theory's total includes the parameters' compute-dtype copies autodiff
    # keeps (each block's slice; under FSDP the gathered weights, cast): slices of the cast
    # copy the temporaries count, so they move from there to here.
    copies = parameter_copies(activations)
    saved, per_block = activations.total, activations.per_block
    activations = without_parameter_copies(activations)  # the working set: activations proper
    if fused_attention and layout.remat == "none":
        fused = _fused_attention_change(gpt, layout, activations, batch, seq)
        per_block += fused
        saved += gpt.num_layers * fused
    if layout.remat == "none":
        # Calibrated on the H200 rows as it is: with a fused kernel too, two blocks' worth of
        # the theory's XLA attention (the probabilities included).
        working = WORKING_SET_BLOCKS * activations.per_block
    else:
        # The recomputed block: all it keeps without remat, live during its backward pass.
        # Under save_matmuls this counts the saved matmul outputs a second time, which the
        # CPU validation (0.88-1.09 of the compiled peak, docs/concepts/planner.md) allows.
        if gpt_without_remat is None:
            raise ValueError(f"memory: remat={layout.remat!r} needs gpt_without_remat=, the same GPT without remat.")
        without_remat = without_parameter_copies(
            activation_theory(
                gpt_without_remat,
                mesh,
                batch,
                seq,
                batch_axis=layout.batch_axes,
                context_axis=context_axis,
                dtype=dtype,
            )
        )
        working = without_remat.per_block
        if fused_attention:
            working += _fused_attention_change(gpt_without_remat, layout, without_remat, batch, seq)
    # With experts, an estimate of their routed path's arrays: kept by every block without
    # remat, else one block's worth while it is recomputed (counted with the temporaries).
    routed = routed_arrays(gpt, layout, batch, seq, dtype)
    if layout.remat == "none":
        per_block += routed
        saved += gpt.num_layers * routed
    weights = 0
    if layout.fsdp > 1 and layout.remat != "none" and not copies.terms:
        # Under FSDP each block's backward pass reads its gathered weights: autodiff keeps
        # them with the block's residuals (the same buffers the temporaries count as the
        # gathered parameters, so they move from there to here). With a cast it keeps
        # their cast copies instead, which the theory counts (`copies`).
        weights = _gathered_block_weights(gpt, specs, layout.sizes)
        per_block += weights
        saved += gpt.num_layers * weights
    temporaries = _temporaries(gpt, layout, specs, params, working, dtype, batch, seq)
    moved = gpt.num_layers * weights + copies.total
    return Memory(params, opt, saved, temporaries + routed - moved, per_block)


# The blocks' parameters a block's backward pass does not read (each only shifts an output
# whose gradient is the incoming one): what autodiff does not keep from the gathered weights.
UNREAD_BIASES = (
    ".attention.query_proj.bias",
    ".attention.key_proj.bias",
    ".attention.value_proj.bias",
    ".attention.output_proj.bias",
    ".mlp.output.bias",
    ".shared_experts.output.bias",  # an MoE block's shared experts (a ParallelMLP)
)


def _gathered_block_weights(gpt: PlanModel, specs: Any, sizes: dict[str, int]) -> int:
    """Bytes of one block's gathered weights (its model-axis blocks) that its backward pass
    reads: every array of the block but `UNREAD_BIASES`."""
    whole = {**sizes, "fsdp": 1}
    paths = jax.tree_util.tree_leaves_with_path(blocks_of(gpt))
    spec_leaves = jax.tree.leaves(blocks_of(specs), is_leaf=lambda x: isinstance(x, PartitionSpec))
    total = 0
    for (path, leaf), spec in zip(paths, spec_leaves, strict=True):
        name = jax.tree_util.keystr(path)
        if not hasattr(leaf, "dtype") or not np.issubdtype(leaf.dtype, np.inexact) or name.endswith(UNREAD_BIASES):
            continue
        entries = tuple(spec) + (None,) * (leaf.ndim - len(spec))
        shape = [
            size // math.prod(whole[a] for a in (() if e is None else (e,) if isinstance(e, str) else e))
            for size, e in zip(leaf.shape, entries)
        ]
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total // gpt.num_layers


# The estimate of XLA's temporaries, calibrated on measured steps (docs/concepts/planner.md):
# the gradients (one copy of this device's parameter blocks), the parameters cast to the
# compute dtype when it differs, under FSDP the gathered parameters and their gradient
# before the reduce-scatter (the model-axis blocks, in the parameters' dtype), the logits'
# gradient in the compute dtype (this device's tokens times its vocabulary block: the
# cross-entropy's one-pass backward writes it once, in the logits' dtype) and the working
# set of the block being computed: without remat WORKING_SET_BLOCKS blocks' saved
# activations, with remat what the recomputed block keeps without remat (one block:
# measured on the CPU validation toys, where two blocks' worth of block inputs fell short
# by up to 2.7x for long sequences).
WORKING_SET_BLOCKS = 2


def logits_gradient_bytes(gpt: PlanModel, layout: Layout, tokens: int, dtype: Any) -> int:
    """The logits' gradient of this device's `tokens` over its vocabulary block, in the
    compute dtype: the cross-entropy's one-pass backward writes it once, in the logits' dtype."""
    return tokens * (vocab_rows(gpt) // layout.model) * np.dtype(dtype).itemsize


def _fused_attention_change(gpt: PlanModel, layout: Layout, activations: Any, batch: int, seq: int) -> int:
    """Per block, what a fused attention kernel (cuDNN's flash attention) keeps beyond the
    theory's XLA attention: its float32 log-sum-exp per query, not the probabilities (0
    for context-parallel attention, which is not fused)."""
    if layout.attention != "dot_product":
        return 0
    heads = attention_shape(gpt).heads
    tokens = batch // layout.batch_shards * seq
    probabilities = sum(t.nbytes for t in activations.terms if t.what == "attention probabilities")
    return tokens * (heads // layout.model) * 4 - probabilities


def _temporaries(
    gpt: PlanModel, layout: Layout, specs: Any, params: int, working: int, dtype: Any, batch: int, seq: int
) -> int:
    sizes = layout.sizes
    total = params  # gradients
    if np.dtype(dtype) != np.dtype(param_dtype(gpt)):
        total += block_bytes(gpt, specs, sizes, dtype=dtype)
    if layout.fsdp > 1:
        # The gathered parameters, and their gradient whole before its reduce-scatter.
        total += 2 * block_bytes(gpt, specs, {**sizes, "fsdp": 1}) - params
    total += logits_gradient_bytes(gpt, layout, batch // layout.batch_shards * (seq // layout.context), dtype)
    total += working
    return int(total)
