"""What a tensor-parallel Llama step must communicate over its model axis, and what its
context-parallel attention sends over the context axis (its theory, beside the model
because it knows its layers)."""

from __future__ import annotations

from typing import Any

import numpy as np
from jax.sharding import Mesh

from .._specs import AxisNames
from ..inspect import CommTheory, context_parallel_theory, report_axes
from ._communication import megatron_all_reduces, megatron_sequence_parallel
from ._llama import Llama
from ._llama_parts import CONTEXT_IMPLS
from ._step_sizes import step_sizes

__all__ = ["llama_tensor_parallel_theory", "llama_context_parallel_theory"]

LLAMA_THEORY_REMATS = ("none", "block", "save_matmuls")
"""The remat policies the Llama's theories take by name (besides `False` and `True`)."""


def llama_tensor_parallel_theory(
    model: Any,
    mesh: Mesh,
    batch_size: int,
    seq_len: int,
    *,
    batch_axis: AxisNames | None = None,
    context_axis: str | None = None,
    remat: bool | str = False,
) -> CommTheory:
    """The least communication of a tensor-parallel [`eqxpar.models.Llama`][] step over its
    model axis.

    With `tokens = (batch_size / batch shards) x (seq_len / context shards)` tokens per
    device, `dim` the residual width and `L` layers, all-reduces over the model axis of:

    - `2 L x tokens x dim` values forward: each layer's `o_proj` and `down_proj` outputs
      (row-parallel layers add up partial sums);
    - `2 L x tokens x dim` values backward: the gradient of each layer's attention and MLP
      input (`q_proj`, `k_proj` and `v_proj` read one input and share one all-reduce, as
      do `gate_proj` and `up_proj`), whatever the number of key/value heads;
    - `tokens x dim` forward for the vocab-parallel embedding lookup and `tokens x dim`
      backward for the head's input gradient (with tied embeddings too: the shared table's
      two gradients are added on each device, with no communication);
    - `3 x tokens` values for the vocab-parallel cross-entropy: the max logit, and the sum
      of exponentials with the target's logit.

    With `remat`, `L x tokens x dim` more: each layer's attention output is needed again to
    recompute the MLP's input. The norms are replicated and need no communication. Values
    are in the embedding's dtype.

    **With `sequence_parallel=True`** every all-reduce of a `tokens x dim` activation above
    becomes an all-gather and a reduce-scatter of the same array (forward) and their
    transposes (backward): `(4 L + 2) x tokens x dim` values of each kind (the layers' part
    from [`eqxpar.inspect.sequence_parallel_theory`][]; by the bytes convention, the
    gathered array and the scattered operand), the same bytes per link as the all-reduces.
    The RMSNorm weights now see only this device's positions: an all-reduce of their
    gradients, `(2 L + 1) x dim` values in the norms' dtype (float32). The cross-entropy's
    `3 x tokens` values stay. With `remat`, `2 L x tokens x dim` more gathered (each
    layer's attention and MLP input) and `L x tokens x dim` more scattered (each layer's
    attention output), except under `"save_matmuls"` with unscanned layers: the recomputed
    reduce-scatter's operand is the saved `o_proj` product, and the compiled program
    (which this counts) reuses the forward pass's result; the lowered program still has
    the `L x tokens x dim`.

    Add `llama_context_parallel_theory` (this module) for the context axis, and
    [`eqxpar.inspect.data_parallel_theory`][] or [`eqxpar.inspect.fsdp_theory`][] for the
    batch axes.

    **Arguments:**

    - `model`: the Llama (global form).
    - `mesh`: the step's mesh, with the Llama's model axis.
    - `batch_size`: sequences per step (the global batch).
    - `seq_len`: tokens per sequence the model reads (for
      [`eqxpar.models.llama_loss`][], the batch's width minus one), all context shards
      together.
    - `batch_axis`: the axis (or axes) the batch is split over, if any.
    - `context_axis`: the axis every sequence is split over (context parallelism), if any.
    - `remat`: what the backward pass recomputes: `False` or `"none"`; `True` or `"block"`
      (the layers' whole forward pass, e.g. `Llama(remat="block")`, or
      `eqxpar.train.fsdp_step(..., remat=True)`); `"save_matmuls"` (over the model axis the
      same as `"block"`, but for the reduce-scatters above). `model.remat != "none"` is
      right for scanned layers.

    **Returns:**

    A [`eqxpar.inspect.CommTheory`][] over the model axis (empty when it has size 1).

    **Raises:**

    - `ValueError` if `model` is not a Llama, the mesh lacks its axes, `batch_size` or
      `seq_len` do not split over the batch and context shards, or `remat` is not one of
      the above.
    """
    who = "llama_tensor_parallel_theory"
    sizes = step_sizes(
        who, model, mesh, batch_size, seq_len, batch_axis=batch_axis, context_axis=context_axis, family=Llama
    )
    policy = _remat_policy(remat, who)
    dtype = model.embed_tokens.weight.dtype
    itemsize = np.dtype(dtype).itemsize
    tokens, dim, layers = sizes.tokens, model.config.dim, model.num_layers
    if model.sequence_parallel:
        norms = (2 * layers + 1) * dim * np.dtype(model.norm.weight.dtype).itemsize
        return megatron_sequence_parallel(
            mesh,
            model.axis_name,
            layers,
            batch_size,
            seq_len,
            dim,
            dtype,
            tokens,
            batch_axis=batch_axis,
            context_axis=context_axis,
            params=norms,
            params_what="the RMSNorm weights",
            remat=policy != "none",
            rescattered=not (policy == "save_matmuls" and not model.scan_layers),
        )
    axes = report_axes(model.axis_name, mesh, who)
    return megatron_all_reduces(
        axes,
        layers,
        tokens * dim * itemsize,
        tokens * itemsize,
        policy != "none",
        unit="layers",
        outputs="(o_proj, down_proj)",
    )


def llama_context_parallel_theory(
    model: Any,
    mesh: Mesh,
    batch_size: int,
    seq_len: int,
    *,
    batch_axis: AxisNames | None = None,
    context_axis: str = "context",
    remat: bool | str = False,
    segment_ids: bool = False,
) -> CommTheory:
    """What a context-parallel [`eqxpar.models.Llama`][] step's attention sends over the
    context axis: [`eqxpar.inspect.context_parallel_theory`][] with the Llama's shapes.

    The Llama repeats each device's `num_kv_heads / N` key/value heads to its `num_heads /
    N` query heads before they travel (see [`eqxpar.models.LlamaAttention`][]), so the
    keys and values on the wire have `num_heads` heads of `head_dim` channels, whatever
    `num_kv_heads`. With `C` context shards and `KV = 2 x tokens x (num_heads / N) x
    head_dim` per layer and device (`tokens` as in
    [`eqxpar.models.llama_tensor_parallel_theory`][]), in the embedding's dtype:

    - `attention_impl="ring"`: `L (C - 1) KV` collective-permuted forward, the same again
      backward, and the gradients `L C KV` in float32 (the ring accumulates them in
      float32, whatever the keys' dtype);
    - `attention_impl="all_gather"`: an all-gather of `L C KV` forward and a reduce-scatter
      of their gradients (`L C KV`, the keys' dtype) backward.

    With `remat` (`"block"` and `"save_matmuls"` alike: the attention is recomputed either
    way), the forward's `L (C - 1) KV` (ring) or `L C KV` (all-gather) once more.

    **Arguments:**

    - `model`, `mesh`, `batch_size`, `seq_len`, `batch_axis`, `remat`: as in
      [`eqxpar.models.llama_tensor_parallel_theory`][].
    - `context_axis`: the axis every sequence is split over (the Llama's `"context"`).
    - `segment_ids`: packed documents: their ids' one all-gather per step (see
      [`eqxpar.inspect.context_parallel_theory`][]).

    **Returns:**

    A [`eqxpar.inspect.CommTheory`][] over the context axis.

    **Raises:**

    - `ValueError` as `llama_tensor_parallel_theory`, and for a Llama whose
      `attention_impl` is not `"ring"` or `"all_gather"`.
    """
    who = "llama_context_parallel_theory"
    step_sizes(who, model, mesh, batch_size, seq_len, batch_axis=batch_axis, context_axis=context_axis, family=Llama)
    policy = _remat_policy(remat, who)
    if model.attention_impl not in CONTEXT_IMPLS:
        raise ValueError(
            f"{who}: the Llama has attention_impl={model.attention_impl!r}, which keeps whole sequences; context "
            f"parallelism needs one of {CONTEXT_IMPLS}."
        )
    config = model.config
    attention_again = policy != "none"  # "block" and "save_matmuls" alike recompute the attention
    return context_parallel_theory(
        mesh,
        batch=batch_size,
        seq_len=seq_len,
        num_heads=config.num_heads,
        num_kv_heads=config.num_heads,  # repeated to the query heads before they travel
        head_dim=config.channels,
        num_layers=model.num_layers,
        mode=model.attention_impl,
        context_axis=context_axis,
        batch_axis=batch_axis,
        model_axis=model.axis_name,
        dtype=model.embed_tokens.weight.dtype,
        remat=attention_again,
        segment_ids=segment_ids,
    )


def _remat_policy(remat: Any, who: str) -> str:
    """`"none"`, `"block"` or `"save_matmuls"` for a theory's `remat` argument."""
    if isinstance(remat, (bool, np.bool_)):
        return "block" if remat else "none"
    if isinstance(remat, str) and remat in LLAMA_THEORY_REMATS:
        return remat
    raise ValueError(
        f"{who}: remat must be True, False or one of {LLAMA_THEORY_REMATS} (the compiled programs these are "
        f"checked against), got {remat!r}."
    )
