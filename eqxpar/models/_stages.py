"""The GPT cut into the three parts a pipeline runs: [`eqxpar.models.gpt_stages`][]."""

from __future__ import annotations

from typing import Any

from ..train import Stages
from ._gpt_parts import embed_tokens, head_logits, mean_cross_entropy
from ._moe_block import MoEOptions, weighted_aux
from ._packed import next_token_batch

__all__ = ["gpt_stages"]


def gpt_stages(model: Any = None) -> Stages:
    """The [`eqxpar.train.Stages`][] of an [`eqxpar.models.GPT`][] built with
    `scan_layers=True` (or converted with [`eqxpar.models.stack_blocks`][]), whose batch
    is `(batch, seq + 1)` token ids (or packed documents, as
    [`eqxpar.models.next_token_loss`][] takes them): the embeddings (token and position, with dropout)
    first, the transformer blocks stacked, the final norm, head and next-token
    cross-entropy last (the GPT's own parts, as [`eqxpar.models.next_token_loss`][] runs
    them). Without dropout (or without a key) it computes exactly the GPT's own loss; with
    dropout, each layer's key is `fold_in(key, 1 + layer)` ([`eqxpar.train.Stages.loss`][]
    is then the one-device reference, not the GPT's own call, which splits its key
    differently).

    **Mixture of experts.** A GPT with `moe=` and `every=1` (every block an
    [`eqxpar.models.MoEBlock`][]), stacked with `stack_blocks`, is pipelined with
    `gpt_stages(model)`: the Stages have `layer_aux=True`, each block returning its term of
    [`eqxpar.models.moe_aux_loss`][] (the weighted mean load-balancing and z-losses over
    the micro-batch's sequences), which each stage adds to its share of the loss, so the
    pipeline's loss is the GPT's `next_token_loss`. Each sequence is one routing group, so
    micro-batches change no routing. The experts stay whole on every device of a stage
    (no expert axis inside the stages).

    **Arguments:**

    - `model`: the GPT, needed only for one with `moe=` (its options weight the auxiliary
      losses); the Stages then take GPTs with the same `moe` options.

    **Returns:**

    The `Stages`, for [`eqxpar.train.pipeline_step`][].

    **Raises:**

    (When the pipeline step first sees the model, before anything compiles.)

    - `ValueError` for unstacked blocks; for a GPT with `moe=` and `every > 1` (MoE blocks
      between plain ones do not stack) or with other `moe` options than the `model` given.
    """
    moe: MoEOptions | None = getattr(model, "moe", None)

    # Packed documents (a dict batch, see next_token_batch): the residual stream travels
    # between stages with the inputs' segment ids, `(x, segment_ids)`, so that every stage's
    # attention stays inside each document.
    def first(model, tokens, key):
        batch = next_token_batch(tokens)
        x = embed_tokens(model, batch["inputs"], key=key, inference=key is None, positions=batch["positions"])
        return x if batch["segment_ids"] is None else (x, batch["segment_ids"])

    def layer(block, x, key):
        if isinstance(x, tuple):
            return block(x[0], key=key, inference=key is None, segment_ids=x[1]), x[1]
        return block(x, key=key, inference=key is None)

    def moe_layer(block, x, key):
        segments = x[1] if isinstance(x, tuple) else None
        out, aux = block(x[0] if isinstance(x, tuple) else x, key=key, inference=key is None, segment_ids=segments)
        assert moe is not None  # only with moe
        return (out if segments is None else (out, segments)), weighted_aux(moe, aux)

    def last(model, x, tokens, key):
        batch = next_token_batch(tokens)
        logits = head_logits(model, x[0] if isinstance(x, tuple) else x)
        return mean_cross_entropy(model, logits, batch["targets"], batch["loss_weights"])

    _check_every(moe)

    def layers(model):
        given = getattr(model, "moe", None)
        _check_every(given)
        if given != moe:
            made = "gpt_stages()" if moe is None else f"gpt_stages(model) of a GPT with moe={moe}"
            raise ValueError(
                f"gpt_stages: these Stages were made by {made}, but the GPT has moe={given}; the auxiliary "
                f"losses are weighted by the GPT's moe options: build them with gpt_stages(model) for this model."
            )
        if model.sequence_parallel:
            raise ValueError(
                "gpt_stages: a GPT with sequence_parallel=True cannot be pipelined yet (the pipeline carries "
                "whole sequences between stages); build it with sequence_parallel=False (tensor parallelism over "
                "the model axis still splits the blocks inside the stages)."
            )
        if not model.scan_layers:
            raise ValueError(
                "gpt_stages: the GPT's blocks must be stacked to split them over stages: build it "
                "with scan_layers=True or convert it with eqxpar.models.stack_blocks(model)."
            )
        return model.blocks.layers

    if moe is None:
        return Stages(first=first, layers=layers, layer=layer, last=last)
    return Stages(first=first, layers=layers, layer=moe_layer, last=last, layer_aux=True)


def _check_every(moe: MoEOptions | None) -> None:
    if moe is not None and moe.every > 1:
        raise ValueError(
            f"gpt_stages: a GPT with moe= cannot be pipelined yet with moe.every={moe.every}: MoE blocks "
            f"between plain blocks do not stack. Build it with MoEOptions(every=1) (every block MoE) and "
            f"stack it with eqxpar.models.stack_blocks, or train it with data, expert and model axes "
            f"(eqxpar.train.hybrid_step(..., expert_axis=...))."
        )
