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
- With a `dtype` other than the parameters' (a step with
  `eqxpar.train.Precision(compute_dtype=dtype)`), each block also keeps the weights it
  reads as the step cast them, this device's shard, `e` bytes a value (`e` of the compute
  dtype), under every remat choice: they are the block's inputs. Under `"block"` and
  `"save_matmuls"` that is every array the recomputation reads, all but the MLP's output
  bias (which only shifts the block's output): the linear weights (`(4 H d_h d + 2 d h) /
  N`), the query, key and value biases (`3 H d_h / N`, where the attention has them), the
  attention's output bias (`d`, likewise: it shifts the residual stream the MLP's norm
  reads), the MLP's hidden bias (`h / N`) and both layer norms' weights and biases
  (`4 d`). Under `"none"`, the least the backward pass reads: the linear weights and the
  layer norms' weights (`2 d`). Under FSDP these are the weights gathered over the FSDP
  axis: the step keeps their cast copies, not the gathered ones.

Outside the blocks: the final norm, the head's input and the cross-entropy's softmax over
this device's vocabulary block (the least the backward pass reads) and, with a cast, the
final norm's weight and the head's (`d + V d / N`, `V` the padded vocabulary).

A GPT with `moe=`: the batch is split over the expert axis too, so `b` counts the examples
per device over `data x expert`. An MoE block's attention half keeps the terms above; its
MLP terms are the shared experts' (`MoEOptions.shared_experts`, a dense MLP; none without
them): the routed experts' einsums carry no remat name, so `"block"` and `"save_matmuls"`
recompute them. Each MoE block's term of the loss (a weight times a mean over the routing
groups, per auxiliary loss) keeps two float32 constants, four with a z-loss. Under
`remat="none"` the routed experts' own arrays (router probabilities, dispatched tokens,
expert hidden layers) are not counted: a lower bound. With `every > 1` the blocks are of
two kinds: each MLP term counts the blocks of its kind (`num_layers // every` MoE blocks,
the rest plain), each attention term all of them. With a cast an MoE block's weights are
its attention's and norms' (as above), its shared experts' (as the MLP's), its router's
(`X d` for `X` experts, replicated) and its routed experts' (`3 (X / E) d h_e / N`, `E`
devices on the expert axis, `h_e` each expert's hidden units), under every remat choice.
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
      `jnp.bfloat16` for a step with `eqxpar.train.Precision(compute_dtype=jnp.bfloat16)`:
      each block then also keeps the weights it reads cast to it).

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
    # A step computing in another dtype casts the parameters: the copies a block's backward
    # pass reads (its recomputation's inputs under remat) are kept with it.
    weights = _cast_block_weights(model, mesh, blocks_seen, dtype, n, recomputed=model.remat != "none")
    if model.remat == "block":
        blocks = (block_input, block_key, *weights, block_aux)
    elif model.remat == "save_matmuls":
        blocks = (
            block_input,
            block_key,
            *weights,
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
            *weights,
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
        ActivationTerm(
            f"the final norm's and head's weights cast to {np.dtype(dtype or jnp.float32).name}",
            cast_values(dtype, _values(model.final_norm.weight), _values(model.head.weight, n)) * e,
        ),
    )
    terms = tuple(term for term in blocks + outside if term.total)
    return ActivationTheory(terms, layers, model.remat, exact_blocks=model.remat != "none")


def cast_values(dtype: Any, *groups: tuple[int, Any]) -> int:
    """Of parameter groups `(values, their dtype)`, the values a step with
    `Precision(compute_dtype=dtype)` casts, whose copies it keeps where the backward pass
    reads them: those of each group whose dtype is not `dtype` (none for `dtype=None`, a
    step computing in the parameters' own dtypes). Shared by the GPT's and the Llama's
    theories."""
    if dtype is None:
        return 0
    return sum(values for values, of in groups if np.dtype(of) != np.dtype(dtype))


def _values(array: Any, ways: int = 1, layers: int = 1) -> tuple[int, Any]:
    """`(values, dtype)` of this device's block of one layer's `array` (split `ways` ways;
    stacked over `layers` layers); no values for a missing one (`None`)."""
    if array is None:
        return 0, np.float32
    return array.size // layers // ways, array.dtype


def _cast_block_weights(
    model: Any, mesh: Mesh, blocks_seen: tuple[Any, ...], dtype: Any, n: int, *, recomputed: bool
) -> tuple[ActivationTerm, ...]:
    """The terms of the cast weights a plain block and an MoE block keep (see the module
    docs): under remat (`recomputed`) every array the block's recomputation reads, all but
    the MLP's (or shared experts') output bias; without it the linear weights and the layer
    norms' weights, which the backward pass reads."""
    layers = model.num_layers
    stacked = layers if isinstance(model.blocks, StackedLayers) else 1

    def values(array: Any, ways: int = 1) -> tuple[int, Any]:
        return _values(array, ways, stacked)

    def read(*arrays: tuple[int, Any], biases: tuple[tuple[int, Any], ...] = ()) -> int:
        return cast_values(dtype, *arrays, *(biases if recomputed else ()))

    def mlp(m: Any) -> int:
        if m is None:
            return 0
        return read(values(m.hidden.weight, n), values(m.output.weight, n), biases=(values(m.hidden.bias, n),))

    def attention_and_norms(block: Any) -> int:
        a, norms = block.attention, (block.attention_norm, block.mlp_norm)
        projections = (a.query_proj, a.key_proj, a.value_proj)
        return read(
            *(values(p.weight, n) for p in (*projections, a.output_proj)),
            *(values(norm.weight) for norm in norms),
            biases=(
                *(values(p.bias, n) for p in projections),
                values(a.output_proj.bias),
                *(values(norm.bias) for norm in norms),
            ),
        )

    moe = getattr(model, "moe", None)
    moe_blocks = sum(moe.is_moe_block(i) for i in range(layers)) if moe is not None else 0
    plain = next((b for b in blocks_seen if not isinstance(b, MoEBlock)), None)
    routed = next((b for b in blocks_seen if isinstance(b, MoEBlock)), None)
    compute = np.dtype(dtype or np.float32)  # without dtype nothing is cast: every term is 0
    e, name = compute.itemsize, compute.name
    terms = []
    if plain is not None:
        terms.append(
            ActivationTerm(
                f"the block's weights cast to {name} (this device's shard)",
                (attention_and_norms(plain) + mlp(plain.mlp)) * e,
                layers - moe_blocks,
                in_blocks=True,
            )
        )
    if routed is not None:
        experts = routed.moe
        ways = mesh.shape.get(experts.axis_name, 1) * n  # experts over the expert axis, hidden units over model
        kept = read(
            values(experts.router.weight),
            *(values(w, ways) for w in (experts.gate, experts.up, experts.down)),
            biases=(values(experts.router.bias),),
        )
        terms.append(
            ActivationTerm(
                f"an MoE block's weights cast to {name} (router, experts, shared experts; this device's shard)",
                (attention_and_norms(routed) + mlp(routed.shared_experts) + kept) * e,
                moe_blocks,
                in_blocks=True,
            )
        )
    return tuple(terms)


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
