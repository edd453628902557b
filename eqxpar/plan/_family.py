"""What the planner reads from a model, for each family it lays out: the GPT
([`eqxpar.models.GPT`][]) and the Llama ([`eqxpar.models.Llama`][]). Sizes, the
parameters' dtype, the stacked blocks, the attention's shape, and the family's own
theories (tensor-parallel collectives, saved activations, FLOPs per token): the one place
that knows which model is which, so the rest of the planner prices either the same way."""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
from jax.sharding import Mesh

from .._specs import AxisNames
from ..inspect import ActivationTheory, CommTheory, context_parallel_theory
from ..models import (
    GPT,
    GPTConfig,
    Llama,
    LlamaConfig,
    gpt_activation_theory,
    gpt_flops_per_token,
    gpt_stages,
    gpt_tensor_parallel_theory,
    llama_activation_theory,
    llama_context_parallel_theory,
    llama_flops_per_token,
    llama_stages,
    llama_tensor_parallel_theory,
)
from ..nn import StackedLayers

PlanConfig = GPTConfig | LlamaConfig
"""The configs a plan lays out: a GPT's or a Llama's."""
PlanModel = GPT | Llama


GPT2_VOCAB = 50257
"""The GPT's vocabulary when `plan` is given none (GPT-2's)."""
GPT_VOCAB_PADDING = 128
"""The GPT's vocabulary padding when `plan` is given none."""


def vocabulary(config: Any, vocab_size: Any, pad: Any, moe: Any) -> tuple[int, int]:
    """`plan`'s (vocabulary, padding) for `config`: for a GPT, the given ones (GPT-2's
    50257 padded to a multiple of 128 by default); for a Llama its config's own, unpadded.
    A `ValueError` for a config of neither family, or for a Llama given another
    vocabulary, a padding (1, a plan's own value for a Llama, is none) or `moe=` (the
    planner prices MoE GPTs only)."""
    if isinstance(config, GPTConfig):
        return (GPT2_VOCAB if vocab_size is None else vocab_size, GPT_VOCAB_PADDING if pad is None else pad)
    if not isinstance(config, LlamaConfig):
        raise ValueError(
            f"plan: config must be an eqxpar.models.GPTConfig or LlamaConfig (e.g. "
            f"eqxpar.models.gpt_config('1.3b') or eqxpar.models.llama_config('llama-3-8b')), "
            f"got {type(config).__name__}."
        )
    if vocab_size is not None and vocab_size != config.vocab_size:
        raise ValueError(
            f"plan: a Llama's config holds its vocabulary (vocab_size={config.vocab_size}); got "
            f"vocab_size={vocab_size!r}: leave it out, or build the LlamaConfig with that vocabulary."
        )
    if pad not in (None, 1):
        raise ValueError(
            f"plan: pad_vocab_to_multiple_of={pad!r} is the GPT's option: a Llama's vocabulary is not padded "
            f"(the model axis must divide vocab_size={config.vocab_size}); leave it out."
        )
    if moe is not None:
        raise ValueError(
            "plan: moe= is planned for the GPT (eqxpar.models.GPTConfig) only: a Llama with experts is not "
            "priced yet. Plan the dense Llama, or an MoE GPT."
        )
    return config.vocab_size, 1


def config_layers(config: PlanConfig) -> int:
    """The config's number of blocks (layers)."""
    return config.layers if isinstance(config, GPTConfig) else config.num_layers


def config_context(config: PlanConfig) -> int:
    """The longest sequence the config's model takes."""
    return config.context if isinstance(config, GPTConfig) else config.max_seq_len


def param_dtype(model: PlanModel) -> Any:
    """The parameters' dtype (the embedding's)."""
    table = model.position_embedding if isinstance(model, GPT) else model.embed_tokens
    return table.weight.dtype


def width(model: PlanModel) -> int:
    """The residual stream's width."""
    return model.position_embedding.weight.shape[-1] if isinstance(model, GPT) else model.config.dim


def vocab_rows(model: PlanModel) -> int:
    """Rows of the head (and token embedding) the model axis splits: the GPT's padded
    vocabulary, the Llama's own."""
    return model.padded_vocab_size if isinstance(model, GPT) else model.config.vocab_size


def blocks_of(tree: Any) -> Any:
    """The stacked blocks of a model, or of its spec tree (the same class): the GPT's
    `blocks`, the Llama's `layers`."""
    return tree.blocks if isinstance(tree, GPT) else tree.layers


def without_blocks(tree: Any) -> Any:
    """The model (or its spec tree) with its blocks replaced by None: the parts a pipeline
    copies on every stage (embeddings, final norm, head)."""
    return eqx.tree_at(blocks_of, tree, None)


def stages_of(model: PlanModel | PlanConfig) -> Any:
    """How the model (of a config) is cut for [`eqxpar.train.pipeline_step`][]: its
    family's stages."""
    return gpt_stages() if isinstance(model, (GPT, GPTConfig)) else llama_stages()


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """The attention's query heads, key/value heads and channels per head."""

    heads: int
    kv_heads: int
    head_dim: int


def attention_shape(model: PlanModel) -> AttentionShape:
    """The attention's shape, read off the model's (stacked) blocks: the GPT's key/value
    heads are its query heads."""
    blocks = blocks_of(model)
    block = blocks.layers if isinstance(blocks, StackedLayers) else blocks[0]
    if isinstance(model, GPT):
        attention = block.attention
        return AttentionShape(attention.num_heads, attention.num_heads, attention.qk_size)
    attention = block.self_attn
    return AttentionShape(attention.num_heads, attention.num_kv_heads, attention.head_dim)


def tensor_parallel_theory(
    model: PlanModel,
    mesh: Mesh,
    batch: int,
    seq: int,
    *,
    batch_axis: AxisNames,
    context_axis: str | None,
    remat: str = "none",
) -> CommTheory:
    """The family's collectives over the model axis (and its checks of the sizes), `remat`
    the model's policy (`"none"`, `"block"`, `"save_matmuls"`)."""
    if isinstance(model, GPT):
        return gpt_tensor_parallel_theory(
            model, mesh, batch, seq, batch_axis=batch_axis, context_axis=context_axis, remat=remat != "none"
        )
    return llama_tensor_parallel_theory(
        model, mesh, batch, seq, batch_axis=batch_axis, context_axis=context_axis, remat=remat
    )


def context_theory(
    model: PlanModel, mesh: Mesh, batch: int, seq: int, *, batch_axis: AxisNames, remat: str, segment_ids: bool = False
) -> CommTheory:
    """The attention's traffic over the `context` axis: [`eqxpar.inspect.context_parallel_theory`][]
    with the GPT's heads and attention, or [`eqxpar.models.llama_context_parallel_theory`][]
    (the Llama's keys and values travel repeated to its query heads)."""
    if not isinstance(model, GPT):
        return llama_context_parallel_theory(
            model, mesh, batch, seq, batch_axis=batch_axis, remat=remat, segment_ids=segment_ids
        )
    shape = attention_shape(model)
    return context_parallel_theory(
        mesh,
        batch=batch,
        seq_len=seq,
        num_heads=shape.heads,
        head_dim=shape.head_dim,
        num_layers=model.num_layers,
        mode=model.attention_impl,
        context_axis="context",
        batch_axis=batch_axis,
        model_axis="model",
        dtype=param_dtype(model),
        remat=remat != "none",
        segment_ids=segment_ids,
    )


def activation_theory(
    model: PlanModel,
    mesh: Mesh,
    batch: int,
    seq: int,
    *,
    batch_axis: AxisNames,
    context_axis: str | None,
    dtype: Any = None,
) -> ActivationTheory:
    """The family's saved activations per device (and its checks of the sizes). With a
    compute dtype other than the parameters', they include the parameters' cast copies that
    autodiff keeps (each block's slice, the head's): see [`parameter_copies`][]."""
    theory = gpt_activation_theory if isinstance(model, GPT) else llama_activation_theory
    return theory(model, mesh, batch, seq, batch_axis=batch_axis, context_axis=context_axis, dtype=dtype)


PARAMETER_COPY = "cast to"
"""What the activation theories' terms for the parameters' compute-dtype copies say."""


def parameter_copies(theory: ActivationTheory) -> ActivationTheory:
    """The terms of `theory` that are the parameters' compute-dtype copies (slices of the
    one cast copy of the parameters, the same buffers, which the planner must count once)."""
    return dataclasses.replace(theory, terms=tuple(t for t in theory.terms if PARAMETER_COPY in t.what))


def without_parameter_copies(theory: ActivationTheory) -> ActivationTheory:
    """`theory` less [`parameter_copies`][]: the activations proper."""
    return dataclasses.replace(theory, terms=tuple(t for t in theory.terms if PARAMETER_COPY not in t.what))


def flops_per_token(model: PlanModel, seq: int, *, backward: bool = True) -> int:
    """Model FLOPs per token as the compiled program multiplies them (the GPT's vocabulary
    padding included)."""
    if isinstance(model, GPT):
        return gpt_flops_per_token(model, seq, backward=backward, count_padding=True)
    return llama_flops_per_token(model, seq, backward=backward)
