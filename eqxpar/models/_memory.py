"""What a GPT step keeps for its backward pass, per device: the GPT's activation theory.

Beside the GPT because it knows its layers. Counts per device and micro-batch, with `b`
examples per device (the batch over the batch axes), `S` positions per sequence, `C`
context shards (`S_c = S / C` positions per device), `N` devices on the model axis,
`T = b S_c` tokens in the tensor-parallel regions and `T_r` in the residual stream (`T / N`
with sequence parallelism, `T` without), width `d`, `H` heads of `d_h`, MLP width `h`:

- `remat="block"`: each block keeps its input, `T_r d` values: the rest is recomputed.
- `remat="save_matmuls"`: each block keeps its input and the linear layers' matmul
  outputs that its backward pass reads or needs to recompute the rest: q, k, v
  (`3 T H d_h / N`), the output projection's partial sums (`T d`) and the MLP's hidden
  layer (`T h / N`). Attention (its `S_c x S` scores per head), layer norms and the
  activation are recomputed.
- `remat="none"`: the least the backward pass reads: per layer norm its normalised input
  and inverse deviation, each linear layer's input, q, k, v, the attention probabilities
  (ring attention: its output and log-sum-exp; all-gather attention: also the gathered
  keys and values), the MLP's hidden layer before and after
  the activation, dropout masks. Autodiff keeps more (the softmax's intermediate values
  and masks), so this is a lower bound.

Outside the blocks: the final norm, the head's input and the cross-entropy's softmax over
this device's vocabulary block (the least the backward pass reads).

A GPT with `moe=`: the batch is split over the expert axis too, so `b` counts the examples
per device over `data x expert`. An MoE block's attention half keeps the terms above; its
MLP terms are the shared experts' (`MoEOptions.shared_experts`, a dense MLP; none without
them): the routed experts' einsums carry no remat name, so `"block"` and `"save_matmuls"`
recompute them. Each MoE block's term of the loss (a weight times a mean over the routing
groups, per auxiliary loss) keeps two float32 constants, four with a z-loss. Under
`remat="none"` the routed experts' own arrays (router probabilities, dispatched tokens,
expert hidden layers) are not counted: a lower bound. With `every > 1` the blocks are of
two kinds: each MLP term counts the blocks of its kind (`num_layers // every` MoE blocks,
the rest plain), each attention term all of them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from .._specs import AxisNames
from ..inspect import ActivationTerm, ActivationTheory
from ..nn import StackedLayers
from ._moe_block import MoEBlock
from ._step_sizes import StepSizes, step_sizes

_CONTEXT_IMPLS = ("ring", "all_gather")


def gpt_activation_theory(
    model: Any,
    mesh: Mesh,
    batch_size: int,
    seq_len: int,
    *,
    batch_axis: AxisNames | None = None,
    context_axis: str | None = None,
    dtype: Any = None,
) -> ActivationTheory:
    """The bytes one device keeps from a GPT step's forward pass for its backward pass.

    Counts one micro-batch of a tensor-parallel (and context- and sequence-parallel)
    [`eqxpar.models.GPT`][] under its own `remat` choice (see the module docs for the
    terms). For `remat="block"` and `"save_matmuls"` the per-block terms are what the remat
    policy saves, which is what JAX's autodiff keeps: they equal, byte for byte, the
    difference that one more block makes to
    [`eqxpar.train.TrainStep.saved_activation_bytes`][] (for the XLA attention; a fused
    kernel such as cuDNN's keeps its own). For `remat="none"` they are the least the
    backward pass reads, a lower bound.

    **Arguments:**

    - `model`: the GPT (global form).
    - `mesh`: the step's mesh, with the GPT's model axis.
    - `batch_size`: the global batch size (sequences per micro-batch).
    - `seq_len`: positions per sequence the model reads.
    - `batch_axis`: the axis (or axes) the batch is split over, if any (with `moe=`, the
      expert axis too: `("data", "expert")`).
    - `context_axis`: the axis every sequence is split over (context parallelism): needed
      exactly when the GPT's `attention_impl` is `"ring"` or `"all_gather"`.
    - `dtype`: the dtype the model computes in (default: its parameters' dtype; pass
      `jnp.bfloat16` for a step with bfloat16 compute).

    **Returns:**

    An [`eqxpar.inspect.ActivationTheory`][].

    **Raises:**

    - `ValueError` if `model` is not a GPT, the mesh lacks an axis, sizes do not split, the
      context axis does not match the attention, or for `remat="offload"` (its saved
      arrays live in host memory, which this does not model).
    """
    who = "gpt_activation_theory"
    sizes = step_sizes(who, model, mesh, batch_size, seq_len, batch_axis=batch_axis, context_axis=context_axis)
    context = check_activation_step(who, model, sizes, context_axis)
    n, b, s_c = sizes.model_size, sizes.local_batch, sizes.local_seq

    moe = getattr(model, "moe", None)
    layers = model.num_layers
    # Stacked (scan_layers, or an MoE GPT after stack_blocks): one block with a layer axis.
    blocks_seen = (model.blocks.layers,) if isinstance(model.blocks, StackedLayers) else tuple(model.blocks)
    moe_blocks = sum(moe.is_moe_block(i) for i in range(layers)) if moe is not None else 0
    attention = blocks_seen[0].attention
    e = np.dtype(dtype or model.position_embedding.weight.dtype).itemsize
    f32 = np.dtype(jnp.float32).itemsize
    t = sizes.tokens  # tokens in the tensor-parallel regions
    t_r = t // n if model.sequence_parallel else t  # tokens of the residual stream
    dim = model.position_embedding.weight.shape[-1]
    heads = attention.num_heads // n
    qk, vo = heads * attention.qk_size, heads * attention.vo_size  # per device, per token
    # Hidden units per device of a plain block's MLP, and of an MoE block's dense MLP: its
    # shared experts' (none: 0); its routed experts are einsums no remat policy names,
    # recomputed under "block" and "save_matmuls".
    plain = next((b.mlp for b in blocks_seen if not isinstance(b, MoEBlock)), None)
    shared = next((b.shared_experts for b in blocks_seen if isinstance(b, MoEBlock)), None)
    hidden = 0 if plain is None else plain.hidden.weight.shape[-2] // n
    shared_hidden = 0 if shared is None else shared.hidden.weight.shape[-2] // n
    residual_dropout = _active(model.dropout.p)
    # Context-parallel attention computes its scores and products in float32.
    a_e = f32 if context else e

    def per_block(what: str, nbytes: int, count: int = layers) -> ActivationTerm:
        return ActivationTerm(what, int(nbytes), count, in_blocks=True)

    def mlp_hidden(what: str, values_per_unit: int) -> tuple[ActivationTerm, ...]:
        """The hidden-layer term of the plain blocks' MLPs and of the MoE blocks' shared experts."""
        return (
            per_block(what, values_per_unit * hidden, layers - moe_blocks),
            per_block(f"shared experts' {what}", values_per_unit * shared_hidden, moe_blocks),
        )

    block_input = per_block("block input (residual stream)", t_r * dim * e)
    # A recomputed block draws its dropout masks again from its key (JAX's default key type).
    any_dropout = residual_dropout or (_active(attention.dropout.p) and not context)
    key_bytes = jax.eval_shape(lambda: jax.random.key(0)).dtype.itemsize if any_dropout else 0
    block_key = per_block("the block's dropout key (masks are drawn again)", key_bytes)
    # Each MoE block's term of the loss (`weighted_aux`: a weight times a mean over the
    # routing groups, per auxiliary loss) keeps its two float32 constants for the backward.
    aux_terms = 0 if moe is None else 2 if moe.z_loss_weight else 1
    block_aux = per_block(
        "MoE auxiliary-loss weight and mean divisor per loss term (float32)", aux_terms * 2 * f32, moe_blocks
    )
    if model.remat == "block":
        blocks = (block_input, block_key, block_aux)
    elif model.remat == "save_matmuls":
        blocks = (
            block_input,
            block_key,
            per_block("q, k, v (column-parallel outputs)", t * (2 * qk + vo) * e),
            per_block("output projection (partial sums, before the model-axis sum)", t * dim * e),
            *mlp_hidden("MLP hidden layer (column-parallel output)", t * e),
            block_aux,
        )
    else:
        if model.attention_impl == "ring":
            kept_attention = per_block("ring attention log-sum-exp", b * heads * s_c * f32)
        else:
            kept_attention = per_block("attention probabilities", b * heads * s_c * seq_len * a_e)
        attention_dropout = _active(attention.dropout.p) and not context
        gathered = 0
        if model.attention_impl == "all_gather":  # the whole sequence's keys and values
            gathered = b * seq_len * (qk + vo) * e
        blocks = (
            per_block("2 layer norms: normalised input and 1/deviation", 2 * t_r * (dim * e + f32)),
            per_block("attention and MLP inputs (normalised, gathered)", 2 * t * dim * e),
            per_block("q, k, v", t * (2 * qk + vo) * e),
            kept_attention,
            per_block("keys and values gathered over the context axis", gathered),
            per_block("attention output (output projection input)", t * vo * e),
            *mlp_hidden("MLP hidden layer, before and after the activation", 2 * t * e),
            block_aux,
            per_block("residual dropout masks", 2 * t_r * dim if residual_dropout else 0),
            per_block("attention dropout mask", b * heads * s_c * seq_len if attention_dropout else 0),
        )
    outside = (
        ActivationTerm("embedding dropout mask", t_r * dim if residual_dropout else 0),
        ActivationTerm("final layer norm: normalised input and 1/deviation", t_r * (dim * e + f32)),
        ActivationTerm("head input (normalised, gathered)", t * dim * e),
        ActivationTerm(
            "cross-entropy: softmax over this device's vocabulary block", t * (model.padded_vocab_size // n) * e
        ),
    )
    terms = tuple(term for term in blocks + outside if term.total)
    return ActivationTheory(terms, layers, model.remat, exact_blocks=model.remat != "none")


def check_activation_step(who: str, model: Any, sizes: StepSizes, context_axis: str | None) -> bool:
    """The refusals an activation theory shares (a GPT's or a Llama's): `ValueError` naming
    `who` for remat `"offload"`, a context axis that does not match the model's attention, or
    sequence parallelism whose model axis does not split the local sequence. Returns whether
    the attention splits the sequence over a context axis."""
    if model.remat not in ("none", "block", "save_matmuls"):
        raise ValueError(
            f"{who}: remat={model.remat!r} keeps its saved arrays in host memory, which this "
            f"theory does not count; it models remat 'none', 'block' and 'save_matmuls'."
        )
    context = model.attention_impl in _CONTEXT_IMPLS
    if context != (context_axis is not None):
        raise ValueError(
            f"{who}: the {type(model).__name__}'s attention_impl={model.attention_impl!r} "
            + (
                "splits the sequence over a context axis: pass context_axis."
                if context
                else "does not split the sequence: pass context_axis=None (or use ring/all_gather attention)."
            )
        )
    n, s_c = sizes.model_size, sizes.local_seq
    if model.sequence_parallel and s_c % n:
        raise ValueError(f"{who}: sequence_parallel splits {s_c} positions over model={n}, which does not divide them.")
    return context


def _active(p: Any) -> bool:
    return not (isinstance(p, (int, float)) and p == 0)
