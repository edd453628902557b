"""The Llama cut into the three parts a pipeline runs: [`eqxpar.models.llama_stages`][]."""

from __future__ import annotations

import jax.numpy as jnp

from ..nn import StackedLayers
from ..train import Stages
from ._llama import Llama
from ._llama_parts import CONTEXT_IMPLS, attention_positions, embed, head_logits, mean_cross_entropy
from ._packed import next_token_batch

__all__ = ["llama_stages"]


def llama_stages() -> Stages:
    """The [`eqxpar.train.Stages`][] of an [`eqxpar.models.Llama`][] built with
    `scan_layers=True`, whose batch is `(batch, seq + 1)` token ids: the token embedding
    first, the decoder layers stacked, the final norm, head and next-token cross-entropy
    last (the Llama's own parts, as [`eqxpar.models.llama_loss`][] runs them, so the
    pipeline computes exactly the Llama's loss). Every layer computes the rotary angles of
    positions `0 .. seq-1` itself (the pipeline passes only the residual stream between
    stages). Tensor parallelism over the model axis works inside the stages.

    **Returns:**

    The `Stages`, for [`eqxpar.train.pipeline_step`][].

    **Raises:**

    (When the pipeline step first sees the model, before anything compiles.)

    - `ValueError` for a model that is not a Llama, a Llama with unstacked layers (build it
      with `scan_layers=True`), with `moe=`, with context-parallel attention (the
      pipeline keeps whole sequences on each device), or with `sequence_parallel=True`
      (not inside pipeline stages yet).
    """

    # Packed documents (a dict batch, see next_token_batch): the residual stream travels
    # between stages with the inputs' segment ids and positions, `(x, segment_ids,
    # positions)`, so that every layer's attention stays inside each document and rotates
    # each token by its position in it.
    def first(model, tokens, key):
        batch = next_token_batch(tokens)
        attention_positions(model, batch["inputs"].shape[-1])  # the length check, before any layer
        x = embed(model, batch["inputs"])
        return x if batch["segment_ids"] is None else (x, batch["segment_ids"], batch["positions"])

    def layer(block, x, key):
        if isinstance(x, tuple):
            h, segments, positions = x
            cos, sin = block.self_attn.rotary_angles(positions, h.dtype)
            return block(h, cos=cos, sin=sin, segment_ids=segments), segments, positions
        cos, sin = block.self_attn.rotary_angles(jnp.arange(x.shape[-2]), x.dtype)
        return block(x, cos=cos, sin=sin)

    def last(model, x, tokens, key):
        batch = next_token_batch(tokens)
        logits = head_logits(model, x[0] if isinstance(x, tuple) else x)
        return mean_cross_entropy(model, logits, batch["targets"], batch["loss_weights"])

    def layers(model):
        if not isinstance(model, Llama):
            raise ValueError(f"llama_stages: the model must be an eqxpar.models.Llama, got {type(model).__name__}.")
        if model.moe is not None:
            raise ValueError(
                "llama_stages: a Llama with moe= cannot be pipelined (its layers return routing statistics and "
                "auxiliary losses that the pipeline does not carry, and MoE layers cannot be stacked); train it "
                "with data, expert and model axes (eqxpar.train.hybrid_step(..., expert_axis=...))."
            )
        if model.attention_impl in CONTEXT_IMPLS:
            raise ValueError(
                f"llama_stages: the Llama has attention_impl={model.attention_impl!r} (context parallelism), but "
                f"the pipeline keeps whole sequences on each device; build it with attention_impl='dot_product' "
                f"(tensor and sequence parallelism over the model axis still split the work inside the stages)."
            )
        if model.sequence_parallel:
            raise ValueError(
                "llama_stages: a Llama with sequence_parallel=True cannot be pipelined yet (the pipeline carries "
                "whole sequences between stages); build it with sequence_parallel=False (tensor parallelism over "
                "the model axis still splits the layers inside the stages)."
            )
        if not isinstance(model.layers, StackedLayers):  # not model.scan_layers
            raise ValueError(
                "llama_stages: the Llama's layers must be stacked to split them over stages: build it with "
                "scan_layers=True."
            )
        return model.layers.layers

    return Stages(first=first, layers=layers, layer=layer, last=last)
