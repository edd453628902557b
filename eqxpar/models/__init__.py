"""A small GPT-style language model built from [`eqxpar.nn`][] layers.

[`eqxpar.models.GPT`][] is a decoder-only transformer whose big layers are tensor-parallel
over a model axis: the token embedding ([`eqxpar.nn.VocabParallelEmbedding`][]), each
block's attention ([`eqxpar.nn.ParallelMultiheadAttention`][]) and MLP
([`eqxpar.nn.ParallelMLP`][]), and the output head (a
[`eqxpar.nn.ColumnParallelLinear`][] over the vocabulary, whose logits stay split and go
straight into [`eqxpar.nn.vocab_parallel_cross_entropy`][]). Layer norms and the position
embedding are small and replicated.

It runs inside `shard_map` over its model axis; a mesh with `model=1` runs it densely. It
takes one sequence `(seq,)` or a whole batch `(*batch, seq)` (computed as whole arrays,
see [`eqxpar.models.next_token_loss`][]), so a data axis can be added around it. With
`sequence_parallel=True` its residual stream is split along the sequence over the model
axis as well (Megatron sequence parallelism); with `attention_impl="ring"` or
`"all_gather"` every sequence is split over a `context` axis (context parallelism).
[`eqxpar.models.gpt_stages`][] cuts it into the parts [`eqxpar.train.pipeline_step`][]
runs (the model states how it is pipelined; `eqxpar.train` names no model). With
`moe=`[`eqxpar.models.MoEOptions`][] every n-th block has a mixture of experts
([`eqxpar.nn.MixtureOfExperts`][]) in place of its MLP, split over an `expert` axis (train
it with `expert_axis="expert"` in the step builder).

[`eqxpar.models.Llama`][] is a Llama-style family built from the same layers (RMSNorm,
rotary embeddings, grouped-query attention, SwiGLU, optional tied embeddings), its fields
named as Hugging Face's `LlamaForCausalLM`, with shapes from a CPU demo to Llama-3-8B's
([`eqxpar.models.llama_config`][]); train it with [`eqxpar.models.llama_loss`][].
It runs under every strategy the GPT does: tensor, sequence
(`sequence_parallel=True`) and context parallelism (`attention_impl="ring"` or
`"all_gather"`), FSDP, and a pipeline ([`eqxpar.models.llama_stages`][]).
[`eqxpar.models.load_hf`][] loads a Hugging Face Llama checkpoint straight into its shards
on a mesh and [`eqxpar.models.save_hf`][] writes one back.
"""

from ._block import REMAT_CHOICES, TransformerBlock, remat_wrapper, sequence_dropout
from ._communication import gpt_tensor_parallel_theory
from ._configs import GPT_CONFIGS, GPTConfig, gpt_config
from ._flops import gpt_flops_per_token, gpt_matmul_params
from ._generate import generate, whole_logits
from ._gpt import GPT, next_token_loss
from ._hf import load_hf
from ._hf_save import save_hf
from ._llama import Llama, llama_flops_per_token, llama_loss, llama_matmul_params
from ._llama_config import LLAMA_CONFIGS, LlamaConfig, LlamaRopeScaling, llama_config
from ._llama_layers import LlamaAttention, LlamaBlock, LlamaMLP, RMSNorm, apply_rotary, rope_frequencies
from ._llama_memory import llama_activation_theory
from ._llama_stages import llama_stages
from ._llama_theory import llama_context_parallel_theory, llama_tensor_parallel_theory
from ._memory import gpt_activation_theory
from ._moe_block import MoEBlock, MoEOptions, moe_aux_loss
from ._moe_llama import LlamaMoEBlock
from ._packed import NEXT_TOKEN_KEYS, next_token_batch
from ._stacking import stack_blocks, unstack_blocks
from ._stages import gpt_stages

__all__ = [
    "next_token_batch",
    "NEXT_TOKEN_KEYS",
    "TransformerBlock",
    "sequence_dropout",
    "remat_wrapper",
    "REMAT_CHOICES",
    "GPT",
    "next_token_loss",
    "generate",
    "whole_logits",
    "stack_blocks",
    "unstack_blocks",
    "gpt_tensor_parallel_theory",
    "gpt_activation_theory",
    "gpt_flops_per_token",
    "gpt_matmul_params",
    "GPTConfig",
    "GPT_CONFIGS",
    "gpt_config",
    "gpt_stages",
    "MoEOptions",
    "MoEBlock",
    "moe_aux_loss",
    "LlamaMoEBlock",
    "Llama",
    "LlamaConfig",
    "LlamaRopeScaling",
    "LLAMA_CONFIGS",
    "llama_config",
    "llama_loss",
    "llama_matmul_params",
    "llama_flops_per_token",
    "LlamaBlock",
    "LlamaAttention",
    "LlamaMLP",
    "RMSNorm",
    "rope_frequencies",
    "apply_rotary",
    "llama_tensor_parallel_theory",
    "llama_context_parallel_theory",
    "llama_activation_theory",
    "llama_stages",
    "load_hf",
    "save_hf",
]
