"""The Llama: a decoder-only transformer with RMSNorm, rotary embeddings, grouped-query
attention and SwiGLU MLPs, built from tensor-parallel layers (Hugging Face's field names)."""

from __future__ import annotations

import numbers
from typing import Literal, overload

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..inspect import transformer_flops_per_token
from ..nn import (
    ColumnParallelLinear,
    StackedLayers,
    TensorParallelLayer,
    VocabParallelEmbedding,
    context_segment_ids,
)
from ._block import REMAT_CHOICES, Remat, remat_wrapper
from ._gpt import CONTEXT_AXIS
from ._llama_config import LlamaConfig
from ._llama_layers import LLAMA_ATTENTION_IMPLS, LlamaBlock, RMSNorm, normal_linear
from ._llama_parts import CONTEXT_IMPLS, embed, head_logits, mean_cross_entropy, rotary_angles
from ._moe_block import MoEOptions, check_model_axis_size, moe_aux_loss, run_blocks
from ._moe_llama import LlamaMoEBlock, llama_blocks
from ._moe_theory import llama_mlp_params
from ._packed import next_token_batch

__all__ = ["Llama", "llama_loss", "llama_matmul_params", "llama_flops_per_token"]


class Llama(TensorParallelLayer):
    """A Llama-style decoder-only language model with tensor-parallel layers.

    The fields carry Hugging Face's `LlamaForCausalLM` names, so a checkpoint maps onto
    them one to one: `embed_tokens` (an [`eqxpar.nn.VocabParallelEmbedding`][]),
    `layers` (each a [`eqxpar.models.LlamaBlock`][]: `input_layernorm`, `self_attn` with
    `q_proj`, `k_proj`, `v_proj`, `o_proj`, `post_attention_layernorm`, `mlp` with
    `gate_proj`, `up_proj`, `down_proj`), `norm` and `lm_head` (an
    [`eqxpar.nn.ColumnParallelLinear`][] over the vocabulary, or `None` with
    `tie_embeddings`: the head then multiplies by `embed_tokens.weight`). Rotary
    embeddings rotate channel `i` with channel `i + head_dim / 2` (Hugging Face's
    convention), so its `q_proj`/`k_proj` weights load unpermuted.

    `Llama(config, key=...)` returns the global form (full-size arrays); place it with
    `eqxpar.shard(model, mesh, eqxpar.nn.partition_specs(model, mesh))` and call it inside
    `eqxpar.filter_shard_map` over a mesh with the model axis (size 1 runs it densely), or
    train it with [`eqxpar.models.llama_loss`][] and any step of `eqxpar.train`
    (`hybrid_step`, `fsdp_step`, `data_parallel_step`). Over `N` devices of the model
    axis each device holds `num_heads / N` query heads with their `num_kv_heads / N`
    key/value heads, `hidden_dim / N` MLP units and `vocab_size / N` rows of the
    vocabulary: `N` must divide `num_kv_heads`, `num_heads`, `hidden_dim` and
    `vocab_size` ([`eqxpar.nn.partition_specs`][] with the mesh says which does not).

    **Layers.** `scan_layers=False` keeps `layers` as a tuple of blocks run in a Python
    loop (named `layer_0`, `layer_1`, ... in the HLO metadata); `scan_layers=True` stores
    them stacked, as one [`eqxpar.nn.StackedLayers`][], run with `jax.lax.scan` (one
    compiled block whatever the depth). `remat` takes the GPT's choices (see
    [`eqxpar.models.GPT`][]).

    **Sequence parallelism.** `sequence_parallel=True` (Megatron-LM's
    `--sequence-parallel`) splits the residual stream along the sequence over the model
    axis between the tensor-parallel regions: the embedding reduce-scatters its lookup,
    every RMSNorm and residual add runs on `seq / N` positions, each attention and MLP
    all-gathers its normalised input and reduce-scatters its output, and the head
    all-gathers the final norm's output. The same weights, the same results and the same
    bytes on the wire as without it; `1 / N` of the residual activations per device. The
    tokens per sequence (per context shard) must be divisible by `N`.

    **Context parallelism.** `attention_impl="ring"` or `"all_gather"` splits every
    sequence over a mesh axis named `"context"` in zigzag layout
    ([`eqxpar.nn.zigzag_order`][]): each device holds `seq / C` tokens of every sequence,
    its rotary embeddings use those tokens' global positions
    ([`eqxpar.nn.context_positions`][]; not `0 .. seq / C - 1`), and attention fetches the
    other devices' keys and values by a ring of `ppermute`s
    ([`eqxpar.nn.ring_attention`][]) or one all-gather
    ([`eqxpar.nn.all_gather_attention`][]). Train it with `context_axis="context"` in the
    step builder and batches of `(inputs, targets)` laid out as the devices hold them (see
    [`eqxpar.models.llama_loss`][]). Composes with `sequence_parallel`.
    [`eqxpar.models.llama_stages`][] cuts the Llama for a pipeline.
    """

    embed_tokens: VocabParallelEmbedding
    layers: tuple[LlamaBlock | LlamaMoEBlock, ...] | StackedLayers
    norm: RMSNorm
    lm_head: ColumnParallelLinear | None
    config: LlamaConfig = eqx.field(static=True)
    remat: Remat = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)
    moe: MoEOptions | None = eqx.field(static=True)
    sequence_parallel: bool = eqx.field(static=True)
    attention_impl: str = eqx.field(static=True)

    def __init__(
        self,
        config: LlamaConfig,
        *,
        scan_layers: bool = False,
        remat: Remat = "none",
        init_std: float = 0.02,
        moe: MoEOptions | None = None,
        sequence_parallel: bool = False,
        attention_impl: str = "dot_product",
        axis_name: str = "model",
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `config`: the shape, a [`eqxpar.models.LlamaConfig`][] (e.g.
          [`eqxpar.models.llama_config`][]`("tiny")`).
        - `scan_layers`: store the blocks stacked and run them with `jax.lax.scan`.
        - `remat`: what the backward pass recomputes: `"none"`, `"block"`,
          `"save_matmuls"` or `"offload"` (as for the GPT).
        - `init_std`: the standard deviation of the normal the embedding and every linear
          layer are drawn from (Hugging Face's `initializer_range`, 0.02); norms start at 1.
        - `moe`: an [`eqxpar.models.MoEOptions`][] to put a mixture of experts in place of
          the MLP of every `moe.every`-th layer (an [`eqxpar.models.LlamaMoEBlock`][],
          Mixtral-style), or None. Needs `scan_layers=False`; train it with
          `expert_axis=moe.expert_axis` in the step builder. [`eqxpar.models.load_hf`][]
          reads a Hugging Face Mixtral folder into this form (`every=1`, softmax scores,
          renormalised top-k) and [`eqxpar.models.save_hf`][] writes it back.
        - `sequence_parallel`: split the residual stream along the sequence over the model
          axis (see above).
        - `attention_impl`: `"dot_product"` (whole sequences on each device; cuDNN's fused
          kernel on a GPU that has it), or `"ring"` / `"all_gather"` for context
          parallelism over the `"context"` mesh axis (see above).
        - `axis_name`: the model axis every tensor-parallel layer is split over.
        - `key`: the initialisation key. The same key gives the same weights for either
          block layout and any mesh.

        **Raises:**

        - `ValueError` for a config that is not a `LlamaConfig`, an unknown `remat`, a
          non-boolean `scan_layers` or `sequence_parallel`, an unknown `attention_impl`, a
          non-positive `init_std`, a non-string `axis_name`, or `moe=` options it cannot
          take (with a split sequence among them).
        """
        if not isinstance(config, LlamaConfig):
            raise ValueError(
                f"Llama: config must be an eqxpar.models.LlamaConfig, got {type(config).__name__}; build one, "
                f"e.g. eqxpar.models.llama_config('tiny') or LlamaConfig(vocab_size=..., dim=..., ...)."
            )
        if remat not in REMAT_CHOICES:
            raise ValueError(f"Llama: remat must be one of {REMAT_CHOICES}, got {remat!r}.")
        for name, value in (("scan_layers", scan_layers), ("sequence_parallel", sequence_parallel)):
            if isinstance(value, str) or value not in (True, False):
                raise ValueError(f"Llama: {name} must be True or False, got {value!r}.")
        if attention_impl not in LLAMA_ATTENTION_IMPLS:
            raise ValueError(
                f"Llama: attention_impl must be one of {LLAMA_ATTENTION_IMPLS}, got {attention_impl!r} "
                f"('ring' or 'all_gather' split every sequence over the 'context' mesh axis)."
            )
        if not (isinstance(init_std, numbers.Real) and not isinstance(init_std, bool) and init_std > 0):
            raise ValueError(f"Llama: init_std must be a positive number, got {init_std!r}.")
        if not isinstance(axis_name, str):
            raise ValueError(f"Llama: axis_name must be a mesh axis name (a str), got {axis_name!r}.")
        embed_key, head_key, *block_keys = jax.random.split(key, 2 + config.num_layers)
        table = init_std * jax.random.normal(embed_key, (config.vocab_size, config.dim))
        embedding = eqx.filter_eval_shape(eqx.nn.Embedding, config.vocab_size, config.dim, key=embed_key)
        embedding = eqx.tree_at(lambda e: e.weight, embedding, table)
        self.embed_tokens = VocabParallelEmbedding.from_dense(embedding, axis_name=axis_name)
        blocks = llama_blocks(
            config,
            moe,
            scan_layers,
            init_std,
            axis_name,
            block_keys,
            sequence_parallel=bool(sequence_parallel),
            attention_impl=attention_impl,
        )
        self.layers = StackedLayers(blocks, axis_name=axis_name) if scan_layers else blocks
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = (
            None
            if config.tie_embeddings
            else normal_linear(ColumnParallelLinear, config.dim, config.vocab_size, init_std, axis_name, head_key)
        )
        self.config = config
        self.remat = remat
        self.axis_name = axis_name
        self.moe = moe
        self.sequence_parallel = bool(sequence_parallel)
        self.attention_impl = attention_impl

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def scan_layers(self) -> bool:
        return isinstance(self.layers, StackedLayers)

    def check_axis_size(self, size: int, where: str = "") -> None:
        """`ValueError` unless the vocabulary, the heads and the MLP split `size` ways."""
        if self.config.vocab_size % size:
            raise ValueError(
                f"Llama: vocab_size={self.config.vocab_size} is not divisible by the {size} devices of the model "
                f"axis {self.axis_name!r} (the embedding and head split the vocabulary). Use a model axis size "
                f"that divides {self.config.vocab_size}, or a config whose vocab_size is a multiple of {size} "
                f"(pad the vocabulary: extra ids are never seen)."
            )
        check_model_axis_size(self, size, "" if where == "<root>" else where)

    def to_dense(self) -> Llama:
        """The Llama itself: its global form is its own dense model (it runs on one device
        over a mesh whose model axis has size 1). So [`eqxpar.nn.to_dense`][] leaves it
        whole, and [`eqxpar.testing.check_parallel_parity`][] takes the same Llama as the
        dense and the parallel model."""
        return self

    def head(self) -> ColumnParallelLinear:
        """The output head: `lm_head`, or with tied embeddings a column-parallel layer over
        `embed_tokens.weight` (the same split: this device's rows of the vocabulary)."""
        if self.lm_head is not None:
            return self.lm_head
        config = self.config
        shape = eqx.filter_eval_shape(
            ColumnParallelLinear, config.dim, config.vocab_size, False, axis_name=self.axis_name, key=jax.random.key(0)
        )
        return eqx.tree_at(lambda l: l.weight, shape, self.embed_tokens.weight)

    @overload
    def __call__(
        self,
        tokens: Int[Array, "*batch seq"],
        *,
        segment_ids: Int[Array, "*batch seq"] | None = None,
        positions: Int[Array, "*batch seq"] | None = None,
        key: PRNGKeyArray | None = None,
        return_aux: Literal[False] = False,
    ) -> Float[Array, "*batch seq vocab_block"]: ...

    @overload
    def __call__(
        self,
        tokens: Int[Array, "*batch seq"],
        *,
        segment_ids: Int[Array, "*batch seq"] | None = None,
        positions: Int[Array, "*batch seq"] | None = None,
        key: PRNGKeyArray | None = None,
        return_aux: Literal[True],
    ) -> tuple[Float[Array, "*batch seq vocab_block"], tuple]: ...

    def __call__(
        self,
        tokens: Int[Array, "*batch seq"],
        *,
        segment_ids: Int[Array, "*batch seq"] | None = None,
        positions: Int[Array, "*batch seq"] | None = None,
        key: PRNGKeyArray | None = None,
        return_aux: bool = False,
    ) -> Float[Array, "*batch seq vocab_block"] | tuple[Float[Array, "*batch seq vocab_block"], tuple]:
        """Next-token logits on one device (inside `shard_map`).

        **Arguments:**

        - `tokens`: token ids, `(seq,)` or `(*batch, seq)` (computed as whole arrays, no
          `vmap`), `seq <= max_seq_len`, the same on every device of the model axis (under
          context parallelism: this device's `seq / C` tokens of each sequence, in zigzag
          layout).
        - `segment_ids`: packed documents: `(*batch, seq)` ids of each token's document,
          shaped and laid out like `tokens`; a token attends only within its document.
        - `positions`: each token's position in its document, like `tokens`, for the rotary
          embeddings. `None`: `0 .. seq - 1` (the global positions under context parallelism).
        - `key`: ignored (the Llama has no dropout); accepted as every train step passes one.
        - `return_aux`: also return the MoE layers' [`eqxpar.nn.MoEAux`][]s (one per MoE
          layer, in order; an empty tuple without `moe=`).

        **Returns:**

        This device's block of the logits, `(*batch, seq, vocab_size / N)` (every position
        of `tokens`, with or without sequence parallelism): pass it to
        [`eqxpar.nn.vocab_parallel_cross_entropy`][], or return it from `shard_map` with the
        model axis on its last dimension to assemble the whole logits.

        **Raises:**

        - `ValueError` for token ids without a sequence axis, a sequence longer than
          `max_seq_len`, a model axis that does not split the model (see above), a
          sequence that the model axis does not split (`sequence_parallel`), or no
          `"context"` axis bound under context parallelism.
        """
        del key
        with jax.named_scope("Llama"):
            if tokens.ndim < 1:
                raise ValueError(f"Llama: tokens must be (seq,) or (*batch, seq), got shape {tokens.shape}.")
            self._model_axis_size()  # every split checked (heads, vocabulary, MLP) before any layer runs
            single = tokens.ndim == 1
            for name, value in (("segment_ids", segment_ids), ("positions", positions)):
                if value is not None and jnp.shape(value) != tokens.shape:
                    raise ValueError(
                        f"Llama: {name} must have the shape of tokens {tokens.shape}, got {jnp.shape(value)}."
                    )
            cos, sin = rotary_angles(self, tokens.shape[-1], self.embed_tokens.weight.dtype, positions)
            if single:
                tokens, segment_ids = tokens[None], None if segment_ids is None else segment_ids[None]
            if self.attention_impl in CONTEXT_IMPLS:  # every block's ids, gathered once per step
                segment_ids = context_segment_ids(segment_ids, CONTEXT_AXIS)
            x = embed(self, tokens)
            wrap = remat_wrapper(self.remat)
            if isinstance(self.layers, StackedLayers):  # self.scan_layers
                x, auxes = self.layers(x, wrap=wrap, cos=cos, sin=sin, segment_ids=segment_ids), ()
            else:

                def apply_block(block, x, angles, inference, name, rows, length):
                    # run_blocks' calling convention (the GPT's): `angles` rides where the GPT's key does.
                    del inference, rows, length
                    cos, sin = angles
                    return block(x, cos=cos, sin=sin, segment_ids=segment_ids, name=name.replace("block_", "layer_"))

                apply = apply_block if wrap is None else wrap(apply_block)
                x, auxes = run_blocks(self.layers, x, [(cos, sin)] * len(self.layers), apply, None, None, None)
            with jax.named_scope("head"):
                logits = head_logits(self, x)
            logits = logits[0] if single else logits
            return (logits, auxes) if return_aux else logits


def llama_loss(
    model: Llama,
    tokens: Int[Array, "batch seq_plus_one"] | tuple[Int[Array, "batch seq"], Int[Array, "batch seq"]] | dict,
    *,
    key: PRNGKeyArray | None = None,
) -> Float[Array, ""]:
    """Mean next-token cross-entropy over a batch, inside `shard_map` over the model axis.

    Predicts `tokens[:, 1:]` from `tokens[:, :-1]` in one call of the model, the logits
    staying split over the vocabulary ([`eqxpar.nn.vocab_parallel_cross_entropy`][]).
    Train with `loss_fn = lambda model, batch, key: llama_loss(model, batch, key=key)`. A
    Llama with `moe=` adds its routers' auxiliary losses ([`eqxpar.models.moe_aux_loss`][]).

    Under context parallelism (`attention_impl="ring"` or `"all_gather"`) a device holds a
    part of every sequence, so the shift by one token is done before the split: pass the
    pair `(inputs, targets)` = `(tokens[:, :-1][:, order], tokens[:, 1:][:, order])` with
    `order = eqxpar.nn.zigzag_order(seq, C)`, placed with `P(batch_axis, "context")`.
    This device's mean over its positions is its share: the step's mean over the batch
    and context axes is the whole batch's mean.

    **Arguments:**

    - `model`: a [`eqxpar.models.Llama`][] (each device's blocks).
    - `tokens`: `(batch, seq + 1)` token ids, the same on every device of the model axis;
      or a pair `(inputs, targets)` of `(batch, seq)` ids (needed under context
      parallelism); or packed documents, any batch [`eqxpar.models.next_token_batch`][]
      takes (attention inside each document, rotary positions restarting at each, a
      target that starts another document weighing 0: the mean is over every position).
    - `key`: passed to the model (which has no dropout).

    **Returns:**

    The mean loss over this device's batch (and positions), a float32 scalar, the same on
    every device of the model axis.

    **Raises:**

    - `ValueError` for one array of token ids under context parallelism (it cannot shift
      a sequence split over devices).
    """
    if not isinstance(tokens, (tuple, list, dict)) or (isinstance(tokens, dict) and "tokens" in tokens):
        if model.attention_impl in CONTEXT_IMPLS:
            raise ValueError(
                f"llama_loss: the Llama has attention_impl={model.attention_impl!r} (context parallelism): each "
                f"device holds a part of every sequence, so next-token targets cannot be made by shifting its "
                f"tokens. Pass the pair (tokens[:, :-1][:, order], tokens[:, 1:][:, order]) with order = "
                f"eqxpar.nn.zigzag_order(seq, context_size), placed with P(batch_axis, 'context')."
            )
    batch = next_token_batch(tokens)
    logits, auxes = model(
        batch["inputs"], segment_ids=batch["segment_ids"], positions=batch["positions"], key=key, return_aux=True
    )
    with jax.named_scope("loss"):
        loss = mean_cross_entropy(model, logits, batch["targets"], batch["loss_weights"])
        return loss + moe_aux_loss(model, auxes) if auxes else loss


def _config_of(model: Llama | LlamaConfig, who: str) -> LlamaConfig:
    if isinstance(model, Llama):
        return model.config
    if isinstance(model, LlamaConfig):
        return model
    raise ValueError(f"{who}: expected an eqxpar.models.Llama or LlamaConfig, got {type(model).__name__}.")


def llama_matmul_params(model: Llama | LlamaConfig, *, all_experts: bool = False) -> int:
    """The Llama's parameters that multiply activations (the `N` of `6 N`).

    Every block's `q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`, `up_proj` and
    `down_proj`, and the output head (`vocab_size x dim`, counted with tied embeddings too:
    the head's matmul runs either way); not the embedding lookup or the norms. A Llama with
    `moe=` counts in its MoE layers the router, the `top_k` experts a token runs through and
    the shared experts (`MoEOptions.shared_experts`) instead of the MLP.

    **Arguments:**

    - `model`: a [`eqxpar.models.Llama`][] or just its [`eqxpar.models.LlamaConfig`][]
      (no weights needed: e.g. `llama_config("llama-3-8b")`).
    - `all_experts`: count every expert of the MoE layers, not only `top_k`.

    **Returns:**

    The number of matmul parameters.
    """
    c = _config_of(model, "llama_matmul_params")
    attention = c.dim * c.channels * (2 * c.num_heads + 2 * c.kv_heads)
    mlps = llama_mlp_params(c, model.moe if isinstance(model, Llama) else None, all_experts=all_experts)
    return c.num_layers * attention + mlps + c.vocab_size * c.dim


def llama_flops_per_token(model: Llama | LlamaConfig, seq_len: int | None = None, *, backward: bool = True) -> int:
    """Model FLOPs per trained token of a Llama: `6 N + 12 L T (num_heads x head_dim)`
    ([`eqxpar.inspect.transformer_flops_per_token`][] with the Llama's sizes; the
    attention width is the query heads', whatever the number of key/value heads; with
    `moe=`, `N` counts the experts a token runs through: see `llama_matmul_params`).

    **Arguments:**

    - `model`: a [`eqxpar.models.Llama`][] or its [`eqxpar.models.LlamaConfig`][].
    - `seq_len`: tokens per sequence `T` (default: `max_seq_len`).
    - `backward`: training FLOPs (forward + backward); `False` for the forward only.

    **Returns:**

    FLOPs per token.

    **Raises:**

    - `ValueError` if `seq_len` is not in `1..max_seq_len`.
    """
    c = _config_of(model, "llama_flops_per_token")
    seq_len = c.max_seq_len if seq_len is None else seq_len
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or not 0 < seq_len <= c.max_seq_len:
        raise ValueError(
            f"llama_flops_per_token: seq_len must be an integer in 1..{c.max_seq_len} (max_seq_len), got {seq_len!r}."
        )
    return transformer_flops_per_token(
        llama_matmul_params(model), c.num_layers, c.num_heads * c.channels, seq_len, backward=backward
    )
