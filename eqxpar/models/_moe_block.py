"""The GPT's mixture-of-experts option: `GPT(..., moe=MoEOptions(...))`.

Every `every`-th block (blocks `every - 1`, `2 * every - 1`, ...) has an
[`eqxpar.nn.MixtureOfExperts`][] of SwiGLU experts in place of its MLP (Switch
Transformer and GShard put one in every other block; Mixtral and DeepSeek in every
block); the others are plain [`eqxpar.models.TransformerBlock`][]s. Each sequence is one
routing group, so capacity, drops and the balancing losses depend on the sequence alone
and a split of the batch over devices changes none of them.

The experts are split over the `expert` mesh axis (`MoEOptions.expert_axis`) and their
hidden units over the GPT's model axis (tensor parallelism inside each expert). Train it
with a step built with `expert_axis="expert"`: the batch is split over that axis too, and
each device routes its own sequences (see [`eqxpar.train.data_parallel_step`][]).

[`eqxpar.models.next_token_loss`][] adds the routers' auxiliary losses to the
cross-entropy ([`eqxpar.models.moe_aux_loss`][]); `model(tokens, return_aux=True)` returns
each MoE block's [`eqxpar.nn.MoEAux`][] (tokens per expert, dropped tokens, losses).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..nn import (
    MixtureOfExperts,
    MoEAux,
    ParallelMLP,
    ParallelMultiheadAttention,
    StackedLayers,
    TensorParallelLayer,
    gelu,
    layer_norm,
)
from ._block import TransformerBlock, norm_and_attention, sequence_dropout, split_keys

__all__ = ["MoEOptions", "MoEBlock", "moe_aux_loss"]


def is_capacity_factor(value: Any) -> bool:
    """Whether `value` is an expert capacity factor: None (dropless) or a positive finite number."""
    return value is None or (
        not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0
    )


@dataclasses.dataclass(frozen=True)
class MoEOptions:
    """The mixture-of-experts options of a [`eqxpar.models.GPT`][] (`GPT(..., moe=...)`).

    **Fields:**

    - `num_experts`: experts per MoE block.
    - `top_k`: experts each token chooses, 1 to `num_experts`.
    - `every`: every how many blocks one is an MoE block (1: all of them; 2: blocks 1, 3, 5, ...).
    - `capacity_factor`: each expert's slots per sequence as a multiple of an even share
      ([`eqxpar.nn.expert_capacity`][]); None for the dropless path.
    - `aux_loss_weight`: the weight of each MoE block's load-balancing loss in
      [`eqxpar.models.next_token_loss`][] (Switch Transformer uses 1e-2).
    - `z_loss_weight`: the weight of each MoE block's router z-loss (ST-MoE uses 1e-3).
    - `expert_hidden`: each expert's SwiGLU hidden size; default `mlp_ratio * dim`.
    - `score`: the router's `"softmax"` or `"sigmoid"` scores.
    - `expert_axis`: the mesh axis the experts are split over.
    - `normalize_weights`: divide each token's `top_k` scores by their sum, so its experts'
      weights add up to one (Mixtral: softmax over all experts, then the chosen ones
      renormalised); False keeps the scores as they are (Switch, GShard).
    - `shared_experts`: how many experts' worth of **shared** MLP every token goes through
      beside its routed experts (DeepSeek-MoE, Qwen-MoE); 0 (the default) for none. With
      `n > 0` each MoE block holds one dense MLP of `n * expert_hidden` hidden units (the
      GPT's MLP kind in a [`eqxpar.models.MoEBlock`][], a SwiGLU in a
      [`eqxpar.models.LlamaMoEBlock`][]), split over the model axis like any MLP and copied
      over the expert axis; its output is added to the routed experts'.
    """

    num_experts: int = 8
    top_k: int = 2
    every: int = 1
    capacity_factor: float | None = 1.25
    aux_loss_weight: float = 1e-2
    z_loss_weight: float = 0.0
    expert_hidden: int | None = None
    score: str = "softmax"
    expert_axis: str = "expert"
    normalize_weights: bool = False
    shared_experts: int = 0

    def __post_init__(self):
        who = "GPT: moe"
        for name in ("num_experts", "top_k", "every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{who}.{name} must be a positive integer, got {value!r}.")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"{who}.top_k={self.top_k} is more than num_experts={self.num_experts}: each token "
                f"chooses top_k different experts. Choose top_k <= {self.num_experts}, or more experts."
            )
        factor = self.capacity_factor
        if not is_capacity_factor(factor):
            raise ValueError(
                f"{who}.capacity_factor={factor!r}; it must be a positive number (1.25 is usual; 1.0 is "
                f"exactly an even share), or None for the dropless path."
            )
        for name in ("aux_loss_weight", "z_loss_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{who}.{name} must be a non-negative number, got {value!r}.")
        hidden = self.expert_hidden
        if hidden is not None and (not isinstance(hidden, int) or isinstance(hidden, bool) or hidden < 1):
            raise ValueError(f"{who}.expert_hidden must be a positive integer or None, got {hidden!r}.")
        if self.score not in ("softmax", "sigmoid"):
            raise ValueError(f"{who}.score must be 'softmax' or 'sigmoid', got {self.score!r}.")
        if not isinstance(self.expert_axis, str):
            raise ValueError(f"{who}.expert_axis must be a mesh axis name (a str), got {self.expert_axis!r}.")
        if not isinstance(self.normalize_weights, bool):
            raise ValueError(f"{who}.normalize_weights must be True or False, got {self.normalize_weights!r}.")
        shared = self.shared_experts
        if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
            raise ValueError(
                f"{who}.shared_experts={shared!r}; it must be a non-negative integer: the shared MLP's width in "
                f"experts (0 for none, 1 for one expert's hidden width, as DeepSeek-MoE's 1 or 2)."
            )

    def is_moe_block(self, index: int) -> bool:
        """Whether block `index` (from 0) is an MoE block: `(index + 1) % every == 0`."""
        return (index + 1) % self.every == 0


class MoEBlock(eqx.Module):
    """A pre-norm transformer block with a mixture of experts in place of the MLP:
    `x + attention(norm(x))`, then `x + moe(norm(x))`, the MoE's
    [`eqxpar.nn.MoEAux`][] returned beside the new residual stream.

    Each sequence of the residual stream `(*batch, seq, dim)` is one routing group.
    Communication per call: the attention's all-reduce over the model axis; the MoE's two
    all-to-alls over the expert axis and (with its hidden units split) one all-reduce over
    the model axis; and the transposes of all of these backward. With
    `moe.shared_experts > 0`, `shared_experts` (a [`eqxpar.nn.ParallelMLP`][] with the
    GPT's GELU, `shared_experts * hidden` hidden units) runs on every token of `norm(x)`
    and its output is added to the routed experts' (one more all-reduce over the model
    axis); otherwise `shared_experts` is None.
    """

    attention_norm: eqx.nn.LayerNorm
    attention: ParallelMultiheadAttention
    mlp_norm: eqx.nn.LayerNorm
    moe: MixtureOfExperts
    shared_experts: ParallelMLP | None
    dropout: eqx.nn.Dropout

    def __init__(
        self,
        dim: int,
        num_heads: int,
        moe: MoEOptions,
        hidden: int,
        dropout_p: float = 0.0,
        *,
        attention_impl: str = "dot_product",
        attention_dropout_p: float | None = None,
        axis_name: str = "model",
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `dim`, `num_heads`: as in [`eqxpar.models.TransformerBlock`][].
        - `moe`: the [`eqxpar.models.MoEOptions`][].
        - `hidden`: each expert's SwiGLU hidden size.
        - `dropout_p`, `attention_impl`, `attention_dropout_p`: as in `TransformerBlock`.
        - `axis_name`: the model axis: attention heads and each expert's hidden units split over it.
        - `key`: the initialisation key (the attention and the experts get the same weights
          with or without shared experts).
        """
        attention_key, moe_key = jax.random.split(key)
        self.attention_norm, self.attention = norm_and_attention(
            dim, num_heads, dropout_p, attention_dropout_p, attention_impl, axis_name, attention_key
        )
        self.mlp_norm = eqx.nn.LayerNorm(dim)
        self.moe = MixtureOfExperts(
            dim,
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
            ParallelMLP(
                dim,
                dim,
                moe.shared_experts * hidden,
                activation=gelu,
                axis_name=axis_name,
                key=jax.random.fold_in(key, 1),
            )
            if moe.shared_experts
            else None
        )
        self.dropout = eqx.nn.Dropout(dropout_p)

    def __call__(
        self,
        x: Float[Array, "*batch seq dim"],
        *,
        key: PRNGKeyArray | None = None,
        inference: bool | None = None,
        name: str | None = None,
        rows: Int[Array, " seq"] | None = None,
        length: int | None = None,
        segment_ids: Int[Array, "*batch seq"] | None = None,
    ) -> tuple[Float[Array, "*batch seq dim"], MoEAux]:
        """Apply the block on one device (inside `shard_map`); the arguments are
        [`eqxpar.models.TransformerBlock`][]'s. Returns `(new residual stream, aux)`."""
        with jax.named_scope(name or "MoEBlock"):
            attention_key, residual_key1, residual_key2 = split_keys(key, 3)
            with jax.named_scope("attention"):
                h = self.attention(
                    layer_norm(self.attention_norm, x), segment_ids=segment_ids, key=attention_key, inference=inference
                )
                x = x + sequence_dropout(self.dropout, h, rows, length, key=residual_key1, inference=inference)
            with jax.named_scope("moe"):
                normed = layer_norm(self.mlp_norm, x)
                h, aux = self.moe(normed)
                if self.shared_experts is not None:
                    with jax.named_scope("shared_experts"):
                        h = h + self.shared_experts(normed)
                return x + sequence_dropout(self.dropout, h, rows, length, key=residual_key2, inference=inference), aux


def check_moe(moe: Any, num_layers: int, scan_layers: bool, sequence_parallel: bool, attention_impl: str) -> None:
    """The GPT's `moe=` checks: a `ValueError` naming the option and the fix."""
    if moe is None:
        return
    if not isinstance(moe, MoEOptions):
        raise ValueError(
            f"GPT: moe must be an eqxpar.models.MoEOptions or None, got {type(moe).__name__}; pass e.g. "
            f"moe=eqxpar.models.MoEOptions(num_experts=8, top_k=2)."
        )
    if moe.every > num_layers:
        raise ValueError(
            f"GPT: moe.every={moe.every} is more than num_layers={num_layers}, so no block would have "
            f"experts; choose every <= {num_layers}."
        )
    if scan_layers:
        raise ValueError(
            "GPT: moe= needs scan_layers=False when the GPT is built: MoE blocks and plain blocks differ, and "
            "a scan runs one block shape. Build the GPT with scan_layers=False; with every=1 (all blocks MoE) "
            "stack it afterwards with eqxpar.models.stack_blocks(model), e.g. for a pipeline."
        )
    if sequence_parallel or attention_impl in ("ring", "all_gather"):
        raise ValueError(
            "GPT: moe= routes whole sequences (one routing group each), so it cannot run on a residual "
            "stream split along the sequence: build the GPT with sequence_parallel=False and "
            "attention_impl='dot_product' (or 'reference')."
        )


def gpt_blocks(
    shape: tuple[int, int, int, float],
    moe: MoEOptions | None,
    keys: Sequence[PRNGKeyArray],
    attention_impl: str,
    attention_dropout_p: float | None,
    axis_name: str,
    sequence_parallel: bool = False,
) -> tuple[TransformerBlock | MoEBlock, ...]:
    """The GPT's blocks (`shape`: `(dim, num_heads, mlp_ratio, dropout_p)`): an
    [`eqxpar.models.MoEBlock`][] where `moe` says, a [`eqxpar.models.TransformerBlock`][]
    elsewhere."""
    dim, num_heads, mlp_ratio, dropout_p = shape
    options: dict[str, Any] = dict(
        attention_impl=attention_impl, attention_dropout_p=attention_dropout_p, axis_name=axis_name
    )
    blocks: list[TransformerBlock | MoEBlock] = []
    for i, k in enumerate(keys):
        if moe is not None and moe.is_moe_block(i):
            hidden = moe.expert_hidden or mlp_ratio * dim
            blocks.append(MoEBlock(dim, num_heads, moe, hidden, dropout_p, **options, key=k))
        else:
            blocks.append(
                TransformerBlock(
                    dim, num_heads, mlp_ratio, dropout_p, sequence_parallel=sequence_parallel, **options, key=k
                )
            )
    return tuple(blocks)


def run_blocks(blocks, x, keys, apply, inference, rows, length) -> tuple[Array, tuple[MoEAux, ...]]:
    """Run a tuple of blocks (`apply(block, x, key, inference, name, rows, length)`), in a
    Python loop: the new residual stream and the MoE blocks' auxes, in order (an MoE block,
    of the GPT or the Llama, returns a pair)."""
    auxes = []
    for i, (block, block_key) in enumerate(zip(blocks, keys)):
        out = apply(block, x, block_key, inference, f"block_{i}", rows, length)
        if isinstance(out, tuple):  # an MoE block: (residual stream, its aux)
            x, aux = out
            auxes.append(aux)
        else:
            x = out
    return x, tuple(auxes)


def moe_aux_loss(model: Any, auxes: Sequence[MoEAux]) -> Float[Array, ""]:
    """The routers' auxiliary loss a GPT with `moe=` adds to its cross-entropy.

    The sum over the MoE blocks of `moe.aux_loss_weight` times the block's load-balancing
    loss plus `moe.z_loss_weight` times its router z-loss, each the mean over the
    sequences (routing groups) of this device's batch: as the cross-entropy, a mean over
    the device's examples, so the train step's mean over devices is the global one.

    **Arguments:**

    - `model`: the [`eqxpar.models.GPT`][] (its `moe` options give the weights).
    - `auxes`: what `model(tokens, return_aux=True)` returned beside the logits.

    **Returns:**

    A float32 scalar (zero for a GPT without `moe=`).
    """
    moe = getattr(model, "moe", None)
    total = jnp.zeros((), jnp.float32)
    if moe is None:
        return total
    for aux in auxes:
        total = total + weighted_aux(moe, aux)
    return total


def weighted_aux(moe: MoEOptions, aux: MoEAux) -> Float[Array, ""]:
    """One MoE block's term of [`eqxpar.models.moe_aux_loss`][]: `moe.aux_loss_weight`
    times the mean load-balancing loss plus `moe.z_loss_weight` times the mean z-loss (the
    means over the routing groups), a float32 scalar."""
    term = moe.aux_loss_weight * jnp.mean(aux.load_balance_loss)
    if moe.z_loss_weight:
        term = term + moe.z_loss_weight * jnp.mean(aux.z_loss)
    return term


def run_stacked_blocks(blocks, x, keys, wrap, **kwargs) -> tuple[Array, tuple[MoEAux, ...]]:
    """Run a GPT's stacked blocks (an [`eqxpar.nn.StackedLayers`][]) with `jax.lax.scan`:
    the new residual stream and, for stacked [`eqxpar.models.MoEBlock`][]s (a GPT with
    `moe=` and `every=1`, stacked by [`eqxpar.models.stack_blocks`][]), each block's aux in
    order, as [`eqxpar.models.GPT`][]'s loop returns them (empty for plain blocks)."""
    if not isinstance(blocks.layers, MoEBlock):
        return blocks(x, keys=keys, wrap=wrap, **kwargs), ()
    dynamic, static = eqx.partition(blocks.layers, eqx.is_array)

    def apply(block, x, key):
        return block(x, key=key, **kwargs)

    if wrap is not None:
        apply = wrap(apply)

    def body(x, arrays_and_key):
        arrays, key = arrays_and_key
        return apply(eqx.combine(arrays, static), x, key)

    with jax.named_scope("StackedLayers"):
        x, stacked = jax.lax.scan(body, x, (dynamic, keys))
    return x, tuple(jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(blocks.num_layers))


def check_model_axis_size(model: TensorParallelLayer, size: int, where: str) -> None:
    """The GPT's model-axis size checks of its tensor-parallel layers; a mixture of experts
    is split over the model axis by its experts' hidden units only (its experts split
    over the expert axis, checked by the step). Stacked blocks are checked layer by layer
    here (a `StackedLayers`' own check would hand the model axis's size to the mixture of
    experts inside, whose own check is of the expert axis)."""
    for path, node in jax.tree_util.tree_flatten_with_path(
        model, is_leaf=lambda n: n is not model and isinstance(n, TensorParallelLayer)
    )[0]:
        if isinstance(node, StackedLayers):
            check_model_axis_size(node.layers, size, where + jax.tree_util.keystr(path) + ".layers")
        elif isinstance(node, MixtureOfExperts):
            if node.hidden_size % size:
                raise ValueError(
                    f"MixtureOfExperts at {where + jax.tree_util.keystr(path)}: each expert's hidden size "
                    f"{node.hidden_size} is not divisible by the size {size} of the model axis "
                    f"{node.model_axis!r}; choose MoEOptions(expert_hidden=...) a multiple of {size}."
                )
        elif isinstance(node, TensorParallelLayer):
            node.check_axis_size(size, where + jax.tree_util.keystr(path))
