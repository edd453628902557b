"""Model FLOPs of the GPT: its matmul parameters put into the transformer formula."""

from __future__ import annotations

from ..inspect import transformer_flops_per_token
from ._moe_block import MoEBlock
from ._moe_theory import moe_block_matmul_params

__all__ = ["gpt_matmul_params", "gpt_flops_per_token"]


def gpt_matmul_params(model, *, count_padding: bool = False, all_experts: bool = False) -> int:
    """The GPT's parameters that multiply activations (the `N` of `6 N`).

    Every block's query, key, value and output projections and both MLP matrices, and the
    output head; not the token or position embeddings (lookups), layer norms or biases.
    An [`eqxpar.models.MoEBlock`][] counts its router, the `top_k` experts each token
    runs through and its shared experts' two matrices (`MoEOptions.shared_experts`).

    **Arguments:**

    - `model`: a [`eqxpar.models.GPT`][] in global form (full-size arrays; blocks as a
      tuple or stacked).
    - `count_padding`: count the head's padding rows (`padded_vocab_size` instead of
      `vocab_size`): what the compiled program multiplies, not useful work.
    - `all_experts`: count every expert of the MoE blocks (the parameters they hold), not
      only the `top_k` a token runs through (the model FLOPs' count).

    **Returns:**

    The number of matmul parameters.
    """
    blocks = model.blocks.unstack() if model.scan_layers else model.blocks
    n = 0
    for block in blocks:
        attention = block.attention
        linears = [attention.query_proj, attention.key_proj, attention.value_proj, attention.output_proj]
        if isinstance(block, MoEBlock):
            n += moe_block_matmul_params(block.moe, block.shared_experts, all_experts=all_experts)
        else:
            linears += [block.mlp.hidden, block.mlp.output]
        n += sum(linear.weight.size for linear in linears)
    rows = model.padded_vocab_size if count_padding else model.vocab_size
    return n + rows * model.head.weight.shape[-1]


def gpt_flops_per_token(
    model, seq_len: int | None = None, *, backward: bool = True, count_padding: bool = False
) -> int:
    """Model FLOPs per trained token of a GPT: `6 N + 12 L T d`
    ([`eqxpar.inspect.transformer_flops_per_token`][] with the GPT's sizes; with `moe=`,
    `N` counts the experts a token runs through: see [`eqxpar.models.gpt_matmul_params`][]).

    **Arguments:**

    - `model`: a [`eqxpar.models.GPT`][] in global form.
    - `seq_len`: tokens per sequence `T` (default: `context_length`).
    - `backward`: training FLOPs (forward + backward); `False` for the forward only.
    - `count_padding`: as in [`eqxpar.models.gpt_matmul_params`][].

    **Returns:**

    FLOPs per token.

    **Raises:**

    - `ValueError` if `seq_len` exceeds the model's context.
    """
    seq_len = model.context_length if seq_len is None else seq_len
    if not isinstance(seq_len, int) or not 0 < seq_len <= model.context_length:
        raise ValueError(
            f"gpt_flops_per_token: seq_len must be an integer in 1..{model.context_length} (the context), "
            f"got {seq_len!r}."
        )
    blocks = model.blocks.unstack() if model.scan_layers else model.blocks
    attention = blocks[0].attention
    width = attention.num_heads * attention.qk_size
    return transformer_flops_per_token(
        gpt_matmul_params(model, count_padding=count_padding), model.num_layers, width, seq_len, backward=backward
    )
