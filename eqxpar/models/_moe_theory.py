"""The matmul parameters of the MoE blocks (the `N` of `6 N`), for
[`eqxpar.models.gpt_matmul_params`][] and [`eqxpar.models.llama_matmul_params`][].

An MoE block's MLP part multiplies each token by its router (`dim x num_experts`), by the
`top_k` experts it chose (`3 x dim x expert_hidden` each: SwiGLU's gate, up and down), and
by the shared experts' MLP, if any (`MoEOptions.shared_experts`), which every token goes
through. Model FLOPs count those **active** parameters; `all_experts=True` counts every
expert instead (what the block holds).
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax

from ..nn import MixtureOfExperts
from ._llama_config import LlamaConfig
from ._moe_block import MoEOptions

__all__ = ["moe_block_matmul_params", "llama_mlp_params"]


def _weights(module: Any) -> int:
    """The elements of a module's matrices (its leaves of two or more dimensions: not
    biases); 0 for None."""
    leaves = jax.tree.leaves(eqx.filter(module, eqx.is_array))
    return sum(leaf.size for leaf in leaves if leaf.ndim >= 2)


def moe_block_matmul_params(moe: MixtureOfExperts, shared: Any, *, all_experts: bool = False) -> int:
    """The matmul parameters of an MoE block's MLP part (global form).

    **Arguments:**

    - `moe`: the block's [`eqxpar.nn.MixtureOfExperts`][].
    - `shared`: its shared experts' MLP (a [`eqxpar.nn.ParallelMLP`][] or
      [`eqxpar.models.LlamaMLP`][]), or None.
    - `all_experts`: count every expert; default only the `top_k` a token runs through.

    **Returns:**

    The router's weights, the experts' (all, or `top_k` of them) and the shared MLP's
    weight matrices (not its biases).
    """
    experts = moe.gate.size + moe.up.size + moe.down.size
    if not all_experts:
        experts = experts // moe.num_experts * moe.top_k
    return moe.router.weight.size + experts + _weights(shared)


def llama_mlp_params(config: LlamaConfig, moe: MoEOptions | None, *, all_experts: bool = False) -> int:
    """The matmul parameters of a Llama's MLPs over all its layers: `3 x dim x hidden_dim`
    per dense layer; per MoE layer (`moe.is_moe_block`) the router's `dim x num_experts`,
    `3 x dim x expert_hidden` per expert (`top_k` of them, or all with `all_experts`) and
    `3 x dim x shared_experts x expert_hidden` for the shared experts."""
    dim, layers = config.dim, config.num_layers
    dense = 3 * dim * config.hidden_dim
    if moe is None:
        return layers * dense
    expert = 3 * dim * (moe.expert_hidden or config.hidden_dim)
    routed = moe.num_experts if all_experts else moe.top_k
    sparse = dim * moe.num_experts + (routed + moe.shared_experts) * expert
    return sum(sparse if moe.is_moe_block(i) else dense for i in range(layers))
