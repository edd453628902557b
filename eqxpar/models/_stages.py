"""The GPT cut into the three parts a pipeline runs: [`eqxpar.models.gpt_stages`][]."""

from __future__ import annotations

from ..train import Stages
from ._gpt import embed_tokens, head_logits, mean_cross_entropy

__all__ = ["gpt_stages"]


def gpt_stages() -> Stages:
    """The [`eqxpar.train.Stages`][] of an [`eqxpar.models.GPT`][] built with
    `scan_layers=True` (or converted with [`eqxpar.models.stack_blocks`][]), whose batch
    is `(batch, seq + 1)` token ids: the embeddings (token and position, with dropout)
    first, the transformer blocks stacked, the final norm, head and next-token
    cross-entropy last (the GPT's own parts, as [`eqxpar.models.next_token_loss`][] runs
    them). Without dropout (or without a key) it computes exactly the GPT's own loss; with
    dropout, each layer's key is `fold_in(key, 1 + layer)` ([`eqxpar.train.Stages.loss`][]
    is then the one-device reference, not the GPT's own call, which splits its key
    differently).

    **Returns:**

    The `Stages`, for [`eqxpar.train.pipeline_step`][].
    """

    def first(model, tokens, key):
        return embed_tokens(model, tokens[..., :-1], key=key, inference=key is None)

    def layer(block, x, key):
        return block(x, key=key, inference=key is None)

    def last(model, x, tokens, key):
        return mean_cross_entropy(model, head_logits(model, x), tokens[..., 1:])

    def layers(model):
        if getattr(model, "moe", None) is not None:
            raise ValueError(
                "gpt_stages: a GPT with moe= cannot be pipelined yet (its blocks return routing "
                "statistics and auxiliary losses that the pipeline does not carry); train it with "
                "data, expert and model axes (eqxpar.train.hybrid_step(..., expert_axis=...))."
            )
        if not model.scan_layers:
            raise ValueError(
                "gpt_stages: the GPT's blocks must be stacked to split them over stages: build it "
                "with scan_layers=True or convert it with eqxpar.models.stack_blocks(model)."
            )
        return model.blocks.layers

    return Stages(first=first, layers=layers, layer=layer, last=last)
