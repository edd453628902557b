"""The Llama's mixture-of-experts option: `Llama(config, moe=MoEOptions(...))` (Mixtral-style).

Every `moe.every`-th layer is a [`eqxpar.models.LlamaMoEBlock`][]: the Llama block with a
[`eqxpar.nn.MixtureOfExperts`][] of SwiGLU experts in place of its MLP (named
`block_sparse_moe`, as Hugging Face's Mixtral names it), each expert of
`moe.expert_hidden` (default: the config's `hidden_dim`) hidden units. Each sequence is one
routing group. Train it with `expert_axis=moe.expert_axis` in the step builder;
[`eqxpar.models.llama_loss`][] adds the routers' auxiliary losses
([`eqxpar.models.moe_aux_loss`][]).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..nn import MixtureOfExperts, MoEAux
from ._llama_config import LlamaConfig
from ._llama_layers import LlamaAttention, LlamaBlock, LlamaMLP, RMSNorm
from ._moe_block import MoEOptions

__all__ = ["LlamaMoEBlock"]


class LlamaMoEBlock(eqx.Module):
    """A pre-norm Llama block with a mixture of experts in place of the MLP:
    `h = x + self_attn(input_layernorm(x))`, then `h + block_sparse_moe(post_attention_layernorm(h))`,
    the MoE's [`eqxpar.nn.MoEAux`][] returned beside the new residual stream.

    With `moe.shared_experts > 0`, `shared_experts` (a [`eqxpar.models.LlamaMLP`][] of
    `shared_experts * expert_hidden` hidden units, DeepSeek-MoE / Qwen-MoE style) runs on
    every token of `post_attention_layernorm(h)` and its output is added to
    `block_sparse_moe`'s; otherwise `shared_experts` is None."""

    input_layernorm: RMSNorm
    self_attn: LlamaAttention
    post_attention_layernorm: RMSNorm
    block_sparse_moe: MixtureOfExperts
    shared_experts: LlamaMLP | None

    def __init__(
        self,
        config: LlamaConfig,
        moe: MoEOptions,
        *,
        init_std: float = 0.02,
        axis_name: str = "model",
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `config`: the model's [`eqxpar.models.LlamaConfig`][].
        - `moe`: the [`eqxpar.models.MoEOptions`][] (experts, top-k, capacity, expert axis).
        - `init_std`: the attention's and the shared experts' linear layers' standard
          deviation (the routed experts are drawn as [`eqxpar.nn.MixtureOfExperts`][] draws them).
        - `axis_name`: the model axis: attention heads and each expert's hidden units split over it.
        - `key`: the initialisation key (the attention and the routed experts get the same
          weights with or without shared experts).
        """
        attention_key, moe_key = jax.random.split(key)
        hidden = moe.expert_hidden or config.hidden_dim
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.self_attn = LlamaAttention(config, init_std=init_std, axis_name=axis_name, key=attention_key)
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.block_sparse_moe = MixtureOfExperts(
            config.dim,
            hidden,
            moe.num_experts,
            moe.top_k,
            score=moe.score,
            normalize_weights=moe.normalize_weights,
            capacity_factor=moe.capacity_factor,
            axis_name=moe.expert_axis,
            model_axis=axis_name,
            key=moe_key,
        )
        self.shared_experts = (
            LlamaMLP(
                dataclasses.replace(config, hidden_dim=moe.shared_experts * hidden),
                init_std=init_std,
                axis_name=axis_name,
                key=jax.random.fold_in(key, 1),
            )
            if moe.shared_experts
            else None
        )

    def __call__(
        self,
        x: Float[Array, "*batch seq dim"],
        *,
        cos: Array,
        sin: Array,
        segment_ids: Int[Array, "*batch seq"] | None = None,
        key: PRNGKeyArray | None = None,
        name: str | None = None,
    ) -> tuple[Float[Array, "*batch seq dim"], MoEAux]:
        """Apply the block on one device (inside `shard_map`); the arguments are
        [`eqxpar.models.LlamaBlock`][]'s. Returns `(new residual stream, aux)`."""
        del key
        with jax.named_scope(name or "LlamaMoEBlock"):
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, segment_ids=segment_ids)
            with jax.named_scope("moe"):
                normed = self.post_attention_layernorm(x)
                h, aux = self.block_sparse_moe(normed)
                if self.shared_experts is not None:
                    with jax.named_scope("shared_experts"):
                        h = h + self.shared_experts(normed)
            return x + h, aux


def llama_blocks(
    config: LlamaConfig,
    moe: Any,
    scan_layers: bool,
    init_std: float,
    axis_name: str,
    keys: Sequence[PRNGKeyArray],
    *,
    sequence_parallel: bool = False,
    attention_impl: str = "dot_product",
) -> tuple[LlamaBlock | LlamaMoEBlock, ...]:
    """The Llama's layers: a `LlamaMoEBlock` where `moe` says, a `LlamaBlock` elsewhere;
    a `ValueError` naming the fix for `moe=` options the Llama cannot take."""
    if moe is not None:
        if not isinstance(moe, MoEOptions):
            raise ValueError(
                f"Llama: moe must be an eqxpar.models.MoEOptions or None, got {type(moe).__name__}; pass e.g. "
                f"moe=eqxpar.models.MoEOptions(num_experts=8, top_k=2)."
            )
        if moe.every > config.num_layers:
            raise ValueError(
                f"Llama: moe.every={moe.every} is more than the config's num_layers={config.num_layers}, so no "
                f"layer would have experts; choose every <= {config.num_layers}."
            )
        if scan_layers:
            raise ValueError(
                "Llama: moe= needs scan_layers=False: MoE layers and plain layers differ, and a scan runs one "
                "layer shape. Build the Llama with scan_layers=False."
            )
        if sequence_parallel or attention_impl != "dot_product":
            raise ValueError(
                "Llama: moe= routes whole sequences (one routing group each), so it cannot run on a residual "
                "stream split along the sequence: build the Llama with sequence_parallel=False and "
                "attention_impl='dot_product', or without moe=."
            )
    return tuple(
        LlamaMoEBlock(config, moe, init_std=init_std, axis_name=axis_name, key=k)
        if moe is not None and moe.is_moe_block(i)
        else LlamaBlock(
            config,
            init_std=init_std,
            sequence_parallel=sequence_parallel,
            attention_impl=attention_impl,
            axis_name=axis_name,
            key=k,
        )
        for i, k in enumerate(keys)
    )
