"""What a tensor-parallel GPT step must communicate: the GPT's part of the theory.

Beside the GPT because it knows its layers (blocks, embeddings, head, cross-entropy); add
it to [`eqxpar.inspect.data_parallel_theory`][] or [`eqxpar.inspect.fsdp_theory`][] and
compare with a measured [`eqxpar.inspect.CommReport`][].
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jax.sharding import Mesh

from .._specs import AxisNames
from ..inspect import CommTheory, report_axes, sequence_parallel_theory, theory_term
from ._step_sizes import step_sizes


def gpt_tensor_parallel_theory(
    model: Any,
    mesh: Mesh,
    batch_size: int,
    seq_len: int,
    *,
    batch_axis: AxisNames | None = None,
    context_axis: str | None = None,
    remat: bool = False,
) -> CommTheory:
    """The least communication of a tensor-parallel [`eqxpar.models.GPT`][] step (Megatron).

    With `tokens = (batch_size / data shards) x seq_len` tokens per model replica, `dim`
    the residual width and `L` blocks, all-reduces over the GPT's model axis of:

    - `2 L x tokens x dim` values forward: the output of each block's attention and MLP
      (row-parallel layers add up partial sums);
    - `2 L x tokens x dim` values backward: the gradient of each attention's and MLP's
      input (column-parallel layers add up the contributions of their blocks);
    - `tokens x dim` forward for the vocab-parallel token embedding (each device looks up
      the ids in its vocabulary block) and `tokens x dim` backward for the gradient of the
      vocab-parallel head's input;
    - `3 x tokens` values for the vocab-parallel cross-entropy: the max logit, and the sum
      of exponentials with the target's logit.

    With `remat` (blocks recomputed in the backward pass, as `eqxpar.train.fsdp_step(...,
    remat=True)` does), `L x tokens x dim` more: each block's attention output is needed
    again to recompute the MLP's input; the MLP's own output is not.

    Values are the model's floating-point dtype. Layer norms, the position embedding and
    the row layers' biases are replicated over the model axis and need no communication.

    **With `sequence_parallel=True`** (Megatron sequence parallelism) every all-reduce of a
    `tokens x dim` activation above becomes an all-gather and a reduce-scatter of the same
    array (forward) and their transposes (backward): `(4 L + 2) x tokens x dim` values of
    each kind (by the bytes convention, the gathered array and the scattered operand), the
    same bytes per link as the all-reduces. The parameters that now see only some
    positions (both layer norms of every block, the final norm, the MLP's output bias, the
    rows of the position embedding a sequence reads) add an all-reduce of their gradients.
    With `remat`, each block's attention input all-gather, output reduce-scatter and MLP
    input all-gather run again.
    Counts one micro-batch: with `grad_accum`, the collectives inside the accumulation loop
    appear once in the program, with the micro-batch's sizes.

    **Arguments:**

    - `model`: the GPT (global form).
    - `mesh`: the step's mesh, with the GPT's model axis.
    - `batch_size`: the global batch size (sequences per step).
    - `seq_len`: tokens per sequence the model reads (for
      [`eqxpar.models.next_token_loss`][], the batch's width minus one).
    - `batch_axis`: the axis (or axes) the batch is split over, if any (`"data"` for the
      hybrid step, `"fsdp"` for FSDP with tensor parallelism).
    - `context_axis`: the axis every sequence is split over (context parallelism), if any:
      each device then holds `seq_len / C` positions of each sequence.
    - `remat`: whether the blocks are recomputed in the backward pass.

    **Returns:**

    A [`eqxpar.inspect.CommTheory`][] over the model axis (empty when it has size 1).

    **Raises:**

    - `ValueError` if `model` is not a GPT, the mesh lacks its axes, or `batch_size` or
      `seq_len` do not fit.
    """
    who = "gpt_tensor_parallel_theory"
    sizes = step_sizes(who, model, mesh, batch_size, seq_len, batch_axis=batch_axis, context_axis=context_axis)
    axes = report_axes(model.axis_name, mesh, who)
    itemsize = np.dtype(model.position_embedding.weight.dtype).itemsize
    tokens = sizes.tokens
    dim = model.position_embedding.weight.shape[1]
    stream = tokens * dim * itemsize
    blocks = len(model.blocks)
    if model.sequence_parallel:
        # Parameters that see only this device's positions: 2 layer norms per block and the
        # final one (weight and bias each), the MLP's output biases, the position rows of a
        # whole sequence (each device reads some of them).
        block = model.blocks.layers if model.scan_layers else model.blocks[0]
        biases = blocks * dim if block.mlp.use_bias else 0
        # The layer norms compute in float32, and the position rows are gathered from a
        # float32 table: their gradients travel in float32 whatever the compute dtype.
        float32 = (2 * (2 * blocks + 1) * dim + seq_len * dim) * itemsize
        return megatron_sequence_parallel(
            mesh,
            model.axis_name,
            blocks,
            batch_size,
            seq_len,
            dim,
            model.position_embedding.weight.dtype,
            tokens,
            batch_axis=batch_axis,
            context_axis=context_axis,
            params=biases * itemsize,
            params_what="MLP output biases",
            float32_params=float32,
            float32_params_what="layer norms and position rows",
            remat=remat,
        )
    return megatron_all_reduces(
        axes, blocks, stream, tokens * itemsize, remat, unit="blocks", outputs="(attention, MLP)"
    )


def megatron_all_reduces(
    axes: tuple[str, ...], count: int, stream: int, per_token: int, remat: bool, *, unit: str, outputs: str
) -> CommTheory:
    """The all-reduces over the model axis of a transformer split the Megatron way without
    sequence parallelism: two per layer each way (`count` layers, called `unit`; the forward
    pass's are of the `outputs` named), the vocabulary-parallel embedding lookup and head,
    the cross-entropy's three per-token statistics (`per_token` bytes each), and under remat
    the attention outputs again. `stream`: the bytes of one residual-stream activation on
    this device."""
    return CommTheory(
        theory_term("all-reduce", axes, 2 * count * stream, f"{count} {unit} x {outputs} outputs, forward")
        + theory_term(
            "all-reduce", axes, 2 * count * stream, f"{count} {unit} x (attention, MLP) input gradients, backward"
        )
        + theory_term("all-reduce", axes, stream, "token embedding lookup, forward")
        + theory_term("all-reduce", axes, stream, "head input gradient, backward")
        + theory_term("all-reduce", axes, 3 * per_token, "cross-entropy: max, sum of exponentials, target logit")
        + (theory_term("all-reduce", axes, count * stream, "attention outputs recomputed (remat)") if remat else ())
    )


def megatron_sequence_parallel(
    mesh: Mesh,
    model_axis: str,
    count: int,
    batch_size: int,
    seq_len: int,
    dim: int,
    dtype: Any,
    tokens: int,
    *,
    batch_axis: AxisNames | None,
    context_axis: str | None,
    params: int,
    params_what: str,
    remat: bool,
    float32_params: int = 0,
    float32_params_what: str = "",
    rescattered: bool = True,
) -> CommTheory:
    """The collectives over the model axis of a transformer split the Megatron way with
    sequence parallelism, for the GPT and the Llama alike (`count` layers, residual width
    `dim`, activations in `dtype`, `tokens` per device in the tensor-parallel regions, a
    global batch of `batch_size` sequences of `seq_len`): the layers' residual traffic
    (`eqxpar.inspect.sequence_parallel_theory`), the embedding's reduce-scatter and the
    head's all-gather with their transposes, the all-reduce of the `params` bytes of
    gradients of the parameters that see only this device's positions (`params_what`;
    those whose gradients travel in float32 whatever the compute dtype as their own term,
    `float32_params` bytes of `float32_params_what`), the cross-entropy's three per-token
    statistics, and under `remat` each layer's attention and MLP input all-gathers again,
    with its attention output reduce-scatter unless `rescattered` is False (the compiled
    program then reuses the forward pass's)."""
    blocks = sequence_parallel_theory(
        mesh,
        batch=batch_size,
        seq_len=seq_len,
        dim=dim,
        num_layers=count,
        batch_axis=batch_axis,
        context_axis=context_axis,
        model_axis=model_axis,
        dtype=dtype,
    )
    axes = report_axes(model_axis, mesh, "megatron_sequence_parallel")
    itemsize = np.dtype(dtype).itemsize
    stream = tokens * dim * itemsize
    terms = (
        blocks.terms
        + theory_term(
            "all-gather", axes, 2 * stream, "SP: the head's input (fwd), the embedding's output gradient (bwd)"
        )
        + theory_term(
            "reduce-scatter", axes, 2 * stream, "SP: the embedding's output (fwd), the head's input gradient (bwd)"
        )
        + theory_term("all-reduce", axes, params, f"SP: gradients of {params_what}")
        + theory_term("all-reduce", axes, float32_params, f"SP: gradients of {float32_params_what} (float32)")
        + theory_term(
            "all-reduce", axes, 3 * tokens * itemsize, "cross-entropy: max, sum of exponentials, target logit"
        )
    )
    if remat:
        terms += theory_term(
            "all-gather", axes, 2 * count * stream, "SP: attention and MLP input gathers recomputed (remat)"
        )
        if rescattered:
            terms += theory_term(
                "reduce-scatter", axes, count * stream, "SP: attention output scatters recomputed (remat)"
            )
    return CommTheory(terms)
