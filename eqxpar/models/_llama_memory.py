"""What a Llama step keeps for its backward pass, per device: the Llama's activation theory.

The GPT's counterpart is `_memory.py`. Counts per device and micro-batch, with `b` examples
per device (the batch over the batch axes), `S` positions per sequence, `C` context shards
(`S_c = S / C` positions per device), `N` devices on the model axis, `T = b S_c` tokens in
the tensor-parallel regions and `T_r` in the residual stream (`T / N` with sequence
parallelism, `T` without), width `d`, `H` query and `K` key/value heads of `d_h` channels,
MLP width `h`, vocabulary `V`, `e` bytes per value of the compute dtype:

- `remat="block"`: each block keeps its input, `T_r d e`: the rest is recomputed.
- `remat="save_matmuls"`: each block keeps its input and the matmul outputs its backward
  pass reads or needs to recompute the rest: q (`T H d_h / N`), k and v (`T K d_h / N`
  each: grouped-query attention keeps the key/value heads, not their repeats), the output
  projection's partial sums (`T d`) and the SwiGLU's gate and up projections (`T h / N`
  each), all `e` bytes a value. The down projection's output is only added to the residual
  stream, which needs it nowhere; RMSNorms, rotary embeddings, attention and the SwiGLU's
  product are recomputed.
- With a `dtype` other than the parameters' (a step with
  `eqxpar.train.Precision(compute_dtype=dtype)`), each block also keeps its weights as the
  step cast them, this device's shard: `(d (H + 2 K) d_h + H d_h d + 3 d h) / N + 2 d`
  values of `e` bytes (under every remat choice: they are the block's inputs).
- `remat="none"`: the least the backward pass reads: per RMSNorm its normalised input
  (`T_r d e`) and inverse root mean square (`T_r` float32), each linear layer's input
  (attention's and the MLP's normalised, gathered input, `T d e` each; the attention
  output, `T H d_h e / N`), q and k after the rotation and v (`T (H + 2 K) d_h e / N`), the
  attention probabilities (`b H S_c S / N` values, float32 under context parallelism; ring
  attention keeps its log-sum-exp, `b H S_c / N` float32, instead; all-gather attention
  also the gathered keys and values, repeated to the query heads, `2 b S H d_h e / N`), the
  SwiGLU's gate, up and their product (`3 T h e / N`). Autodiff keeps more (the float32
  copies of the norms' inputs, the softmax's intermediate values and masks, the SiLU's
  sigmoid), so this is a lower bound.

Outside the blocks (the least the backward pass reads): the rotary angles every block
reads (`cos` and `sin`, `2 S_c d_h e`, once for all blocks), the final RMSNorm (`T_r (d e
+ 4)`), the head's input (`T d e`), the cross-entropy's softmax over this device's
vocabulary block (`T V e / N`) and, with a cast, the head's weight (`V d e / N`; the
embedding's with tied embeddings).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from .._specs import AxisNames
from ..inspect import ActivationTerm, ActivationTheory
from ..nn import StackedLayers
from ._llama import Llama
from ._memory import cast_values, check_activation_step
from ._step_sizes import step_sizes


def llama_activation_theory(
    model: Any,
    mesh: Mesh,
    batch_size: int,
    seq_len: int,
    *,
    batch_axis: AxisNames | None = None,
    context_axis: str | None = None,
    dtype: Any = None,
) -> ActivationTheory:
    """The bytes one device keeps from a Llama step's forward pass for its backward pass.

    Counts one micro-batch of a tensor-parallel (and context- and sequence-parallel)
    [`eqxpar.models.Llama`][] under its own `remat` choice (see the module docs for the
    terms): the Llama's counterpart of [`eqxpar.models.gpt_activation_theory`][]. For
    `remat="block"` and `"save_matmuls"` the per-block terms are what the remat policy
    saves, which is what JAX's autodiff keeps: they equal, byte for byte, the difference
    that one more layer makes to [`eqxpar.train.TrainStep.saved_activation_bytes`][] (for
    the XLA attention; a fused kernel such as cuDNN's keeps its own), with grouped-query
    attention, tied embeddings and bfloat16 compute. For `remat="none"` they are the least
    the backward pass reads, a lower bound.

    **Arguments:**

    - `model`: the Llama (global form), without `moe=`.
    - `mesh`: the step's mesh, with the Llama's model axis.
    - `batch_size`: the global batch size (sequences per micro-batch).
    - `seq_len`: positions per sequence the model reads.
    - `batch_axis`: the axis (or axes) the batch is split over, if any.
    - `context_axis`: the axis every sequence is split over (context parallelism): needed
      exactly when the Llama's `attention_impl` is `"ring"` or `"all_gather"`.
    - `dtype`: the dtype the model computes in (default: its parameters' dtype; pass
      `jnp.bfloat16` for a step with `eqxpar.train.Precision(compute_dtype=jnp.bfloat16)`:
      each block then also keeps its weights cast to it).

    **Returns:**

    An [`eqxpar.inspect.ActivationTheory`][].

    **Raises:**

    - `ValueError` if `model` is not a Llama or has `moe=` (not modelled yet), the mesh
      lacks an axis, sizes do not split, the context axis does not match the attention, or
      for `remat="offload"` (its saved arrays live in host memory, which this does not
      model).
    """
    who = "llama_activation_theory"
    sizes = step_sizes(
        who, model, mesh, batch_size, seq_len, batch_axis=batch_axis, context_axis=context_axis, family=Llama
    )
    context = check_activation_step(who, model, sizes, context_axis)
    if model.moe is not None:
        raise ValueError(
            f"{who}: a Llama with moe= is not modelled yet (its experts' arrays are not counted); "
            f"measure it with eqxpar.train.TrainStep.saved_activation_bytes."
        )
    config, layers = model.config, model.num_layers
    n, b, s_c = sizes.model_size, sizes.local_batch, sizes.local_seq
    compute = np.dtype(dtype or model.embed_tokens.weight.dtype)
    e, f32 = compute.itemsize, np.dtype(jnp.float32).itemsize
    t = sizes.tokens  # tokens in the tensor-parallel regions
    t_r = t // n if model.sequence_parallel else t  # tokens of the residual stream
    dim, d_h, hidden = config.dim, config.channels, config.hidden_dim // n
    heads, kv_heads = config.num_heads // n, config.kv_heads // n  # per device
    q, kv = heads * d_h, kv_heads * d_h  # per device and token
    # Context-parallel attention computes its scores and products in float32.
    a_e = f32 if context else e

    # The step casts each parameter whose dtype is not the compute dtype: the cast copies a
    # block's (and the head's) backward pass reads are kept with it.
    block = model.layers.layers if isinstance(model.layers, StackedLayers) else model.layers[0]
    linear_values = cast_values(
        dtype, (dim * (q + 2 * kv) + q * dim + 3 * dim * hidden, block.self_attn.q_proj.weight.dtype)
    )
    norm_values = cast_values(dtype, (2 * dim, block.input_layernorm.weight.dtype))

    def per_block(what: str, nbytes: int) -> ActivationTerm:
        return ActivationTerm(what, int(nbytes), layers, in_blocks=True)

    block_input = per_block("block input (residual stream)", t_r * dim * e)
    weights = per_block(
        f"the block's weights cast to {compute.name} (this device's shard)", (linear_values + norm_values) * e
    )
    if model.remat == "block":
        blocks = (block_input, weights)
    elif model.remat == "save_matmuls":
        blocks = (
            block_input,
            weights,
            per_block("q (column-parallel output)", t * q * e),
            per_block("k, v (column-parallel outputs, the key/value heads)", 2 * t * kv * e),
            per_block("output projection (partial sums, before the model-axis sum)", t * dim * e),
            per_block("SwiGLU gate and up projections (column-parallel outputs)", 2 * t * hidden * e),
        )
    else:
        if model.attention_impl == "ring":
            kept_attention = per_block("ring attention log-sum-exp", b * heads * s_c * f32)
        else:
            kept_attention = per_block("attention probabilities", b * heads * s_c * seq_len * a_e)
        gathered = 0
        if model.attention_impl == "all_gather":  # the whole sequence's keys and values, repeated to the heads
            gathered = 2 * b * seq_len * q * e
        blocks = (
            weights,
            per_block("2 RMSNorms: normalised input and 1/root mean square", 2 * t_r * (dim * e + f32)),
            per_block("attention and MLP inputs (normalised, gathered)", 2 * t * dim * e),
            per_block("q and k after the rotation, v", t * (q + 2 * kv) * e),
            kept_attention,
            per_block("keys and values gathered over the context axis", gathered),
            per_block("attention output (output projection input)", t * q * e),
            per_block("SwiGLU gate, up and their product (down projection input)", 3 * t * hidden * e),
        )
    # The head's weight: lm_head's, or with tied embeddings the token table (read directly:
    # `model.head()` builds a layer, which the planner would pay for in every call).
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    head_values = cast_values(dtype, (config.vocab_size // n * dim, head.weight.dtype))
    outside = (
        ActivationTerm("rotary angles cos and sin (read by every block)", 2 * s_c * d_h * e),
        ActivationTerm("final RMSNorm: normalised input and 1/root mean square", t_r * (dim * e + f32)),
        ActivationTerm("head input (normalised, gathered)", t * dim * e),
        ActivationTerm("cross-entropy: softmax over this device's vocabulary block", t * (config.vocab_size // n) * e),
        ActivationTerm(f"the head's weight cast to {compute.name}", head_values * e),
    )
    terms = tuple(term for term in blocks + outside if term.total)
    return ActivationTheory(terms, layers, model.remat, exact_blocks=model.remat != "none")
