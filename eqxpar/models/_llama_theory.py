"""What a tensor-parallel Llama step must communicate over its model axis (its theory,
beside the model because it knows its layers)."""

from __future__ import annotations

from typing import Any

import numpy as np
from jax.sharding import Mesh

from .._specs import AxisNames, check_axes
from ..inspect import CommTheory, report_axes
from ._communication import megatron_all_reduces
from ._llama import Llama

__all__ = ["llama_tensor_parallel_theory"]


def llama_tensor_parallel_theory(
    model: Any,
    mesh: Mesh,
    batch_size: int,
    seq_len: int,
    *,
    batch_axis: AxisNames | None = None,
    remat: bool = False,
) -> CommTheory:
    """The least communication of a tensor-parallel [`eqxpar.models.Llama`][] step.

    With `tokens = (batch_size / batch shards) x seq_len` tokens per model replica, `dim`
    the residual width and `L` layers, all-reduces over the model axis of:

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

    With `remat` (layers recomputed in the backward pass, as
    `eqxpar.train.fsdp_step(..., remat=True)` does), `L x tokens x dim` more: each layer's
    attention output is needed again to recompute the MLP's input. The norms are
    replicated and need no communication. Values are in the embedding's dtype.

    **Arguments:**

    - `model`: the Llama (global form).
    - `mesh`: the step's mesh, with the Llama's model axis.
    - `batch_size`: sequences per step (the global batch).
    - `seq_len`: tokens per sequence the model reads (for
      [`eqxpar.models.llama_loss`][], the batch's width minus one).
    - `batch_axis`: the axis (or axes) the batch is split over, if any.
    - `remat`: whether the layers are recomputed in the backward pass.

    **Returns:**

    A [`eqxpar.inspect.CommTheory`][] over the model axis (empty when it has size 1).

    **Raises:**

    - `ValueError` if `model` is not a Llama, the mesh lacks its axes, or `batch_size` or
      `seq_len` do not fit.
    """
    who = "llama_tensor_parallel_theory"
    if not isinstance(model, Llama):
        raise ValueError(f"{who}: model must be an eqxpar.models.Llama, got {type(model).__name__}.")
    check_axes(mesh, model.axis_name, who=who, arg="the Llama's axis_name", role="to split the layers over")
    replicas = (
        1
        if batch_axis is None
        else check_axes(mesh, batch_axis, who=who, arg="batch_axis", role="to split the batch over")
    )
    if not (isinstance(batch_size, int) and batch_size > 0 and batch_size % replicas == 0):
        raise ValueError(
            f"{who}: batch_size must be a positive multiple of the {replicas} batch shards, got {batch_size!r}."
        )
    max_seq_len = model.config.max_seq_len
    if not (isinstance(seq_len, int) and 0 < seq_len <= max_seq_len):
        raise ValueError(f"{who}: seq_len must be in 1..{max_seq_len} (the Llama's max_seq_len), got {seq_len!r}.")
    axes = report_axes(model.axis_name, mesh, who)
    itemsize = np.dtype(model.embed_tokens.weight.dtype).itemsize
    tokens = batch_size // replicas * seq_len
    stream = tokens * model.config.dim * itemsize
    layers = model.num_layers
    return megatron_all_reduces(
        axes, layers, stream, tokens * itemsize, remat, unit="layers", outputs="(o_proj, down_proj)"
    )
