"""The GPT: a decoder-only transformer built from tensor-parallel layers (see the package docs)."""

from __future__ import annotations

import math
import numbers
from typing import Literal, cast, overload

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..nn import (
    ATTENTION_IMPLS,
    ColumnParallelLinear,
    StackedLayers,
    TensorParallelLayer,
    VocabParallelEmbedding,
    context_positions,
    context_segment_ids,
)
from ._block import REMAT_CHOICES, Remat, TransformerBlock, remat_wrapper, split_keys
from ._gpt_parts import embed_tokens, head_logits, mean_cross_entropy
from ._moe_block import (
    MoEBlock,
    MoEOptions,
    check_model_axis_size,
    check_moe,
    gpt_blocks,
    moe_aux_loss,
    run_blocks,
    run_stacked_blocks,
)
from ._packed import next_token_batch

__all__ = ["GPT", "next_token_loss"]


# The mesh axis a context-parallel GPT splits its sequences over (attention_impl "ring"/"all_gather").
CONTEXT_AXIS = "context"


def _padded(vocab_size: int, multiple: int) -> int:
    return -(-vocab_size // multiple) * multiple


class GPT(TensorParallelLayer):
    """A decoder-only transformer language model with tensor-parallel layers.

    `GPT(...)` returns the global form (full-size arrays); place it with
    `eqxpar.shard(model, mesh, eqxpar.nn.partition_specs(model, mesh))` and call it inside
    `eqxpar.filter_shard_map` over a mesh with the model axis. The same seed gives the same
    weights for any model axis size, any vocabulary padding and either block layout.

    **Vocabulary padding.** The vocabulary is split over the model axis, so the embedding
    and head have `padded_vocab_size` rows: `vocab_size` rounded up to a multiple of
    `pad_vocab_to_multiple_of` (default 128, as Megatron-LM's
    `--make-vocab-size-divisible-by`), which splits over any power-of-two model axis up to
    128. The extra rows start at zero, are never looked up, and their logits are `-inf`:
    they take no part in the softmax, the loss or sampling, and get zero gradients.

    **Blocks.** `scan_layers=False` keeps `blocks` as a tuple of
    [`eqxpar.models.TransformerBlock`][]s run in a Python loop (named `block_0`,
    `block_1`, ... in the HLO metadata); `scan_layers=True` stores them stacked, as one
    [`eqxpar.nn.StackedLayers`][], run with `jax.lax.scan`: one compiled block whatever
    the depth. [`eqxpar.models.stack_blocks`][] and [`eqxpar.models.unstack_blocks`][]
    convert a model (or checkpoint) between the two.

    **Sequence parallelism.** `sequence_parallel=True` (Megatron-LM's
    `--sequence-parallel`) splits the residual stream along the sequence over the model
    axis between the tensor-parallel regions: the token embedding reduce-scatters its
    lookup, every block's layer norms and residual dropouts run on `seq / N` positions, each
    attention and MLP all-gathers its normalised input and reduce-scatters its output, and
    the head all-gathers the final norm's output. The same weights, the same results
    (dropout included) and the same bytes on the wire as without it; `1 / N` of the
    residual activations per device. The sequence (per context shard) must be divisible
    by the model axis size.
    """

    token_embedding: VocabParallelEmbedding
    position_embedding: eqx.nn.Embedding
    blocks: tuple[TransformerBlock | MoEBlock, ...] | StackedLayers
    final_norm: eqx.nn.LayerNorm
    head: ColumnParallelLinear
    dropout: eqx.nn.Dropout
    vocab_size: int = eqx.field(static=True)
    context_length: int = eqx.field(static=True)
    pad_vocab_to_multiple_of: int = eqx.field(static=True)
    remat: Remat = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)
    attention_impl: str = eqx.field(static=True)
    sequence_parallel: bool = eqx.field(static=True)
    moe: MoEOptions | None = eqx.field(static=True)

    def __init__(
        self,
        vocab_size: int,
        context_length: int,
        dim: int = 64,
        num_heads: int = 8,
        num_layers: int = 2,
        mlp_ratio: int = 4,
        dropout_p: float = 0.0,
        *,
        attention_dropout_p: float | None = None,
        pad_vocab_to_multiple_of: int = 128,
        attention_impl: Literal["dot_product", "reference", "ring", "all_gather"] = "dot_product",
        scan_layers: bool = False,
        remat: Remat = "none",
        sequence_parallel: bool = False,
        moe: MoEOptions | None = None,
        axis_name: str = "model",
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `vocab_size`: the number of token ids.
        - `context_length`: the longest sequence (the position embedding's size).
        - `dim`, `num_heads`, `num_layers`, `mlp_ratio`: the transformer's shape;
          `num_heads` and `mlp_ratio * dim` must be divisible by the model axis size.
        - `dropout_p`: dropout on the embeddings, residual branches and (by default)
          attention weights.
        - `attention_dropout_p`: dropout on the attention weights, if not `dropout_p`
          (context-parallel attention takes none: set it to 0 there).
        - `pad_vocab_to_multiple_of`: the vocabulary is padded to a multiple of this, which
          the model axis size must divide (e.g. `math.lcm(128, 3)` for `model=3`).
        - `attention_impl`: `"dot_product"` (default: `jax.nn.dot_product_attention`, cuDNN
          on GPUs that have it, XLA elsewhere) or `"reference"` (explicit softmax, as
          `eqx.nn.MultiheadAttention`); `"ring"` or `"all_gather"` for context parallelism:
          every sequence split over a mesh axis named `"context"` in zigzag layout
          (`eqxpar.nn.zigzag_order`), the position embedding following the layout
          (`eqxpar.nn.context_positions`), attention by
          `eqxpar.nn.ring_attention` or `eqxpar.nn.all_gather_attention`. Train
          it with `context_axis="context"` in the step builder.
        - `scan_layers`: store the blocks stacked and run them with `jax.lax.scan`.
        - `remat`: what the backward pass recomputes: `"none"`, `"block"` (everything but
          each block's input) or `"save_matmuls"` (all but the linear layers' matmul
          outputs: attention is recomputed).
        - `sequence_parallel`: split the residual stream along the sequence over the model
          axis (see above); composes with context parallelism.
        - `moe`: an [`eqxpar.models.MoEOptions`][] to put a mixture of experts in place of
          the MLP of every `moe.every`-th block (an [`eqxpar.models.MoEBlock`][]), or None.
          Needs `scan_layers=False` and whole sequences on each device; train it with
          `expert_axis=moe.expert_axis` in the step builder.
        - `axis_name`: the model axis every tensor-parallel layer is split over.
        - `key`: the initialisation key.

        **Raises:**

        - `ValueError` for a non-positive size or padding multiple, an unknown
          `remat` / `attention_impl`, or `moe=` with a layout it cannot run on.
        """
        for name, value in (
            ("vocab_size", vocab_size),
            ("pad_vocab_to_multiple_of", pad_vocab_to_multiple_of),
            ("num_layers", num_layers),
            ("context_length", context_length),
        ):
            if not (isinstance(value, int) and value > 0):
                raise ValueError(f"GPT: {name} must be a positive integer, got {value!r}.")
        if remat not in REMAT_CHOICES:
            raise ValueError(f"GPT: remat must be one of {REMAT_CHOICES}, got {remat!r}.")
        # Every argument checked before the weights are drawn (which compiles).
        if attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"GPT: attention_impl must be one of {ATTENTION_IMPLS}, got {attention_impl!r}.")
        for name, value in (("dim", dim), ("num_heads", num_heads), ("mlp_ratio", mlp_ratio)):
            if not (isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0):
                raise ValueError(f"GPT: {name} must be a positive integer, got {value!r}.")
        for name, value in (("dropout_p", dropout_p), ("attention_dropout_p", attention_dropout_p)):
            if value is not None and not (isinstance(value, numbers.Real) and 0 <= value < 1):
                raise ValueError(f"GPT: {name} must be a probability in [0, 1), got {value!r}.")
        for name, value in (("scan_layers", scan_layers), ("sequence_parallel", sequence_parallel)):
            if isinstance(value, str) or value not in (True, False):
                raise ValueError(f"GPT: {name} must be True or False, got {value!r}.")
        if not isinstance(axis_name, str):
            raise ValueError(f"GPT: axis_name must be a mesh axis name (a str), got {axis_name!r}.")
        check_moe(moe, num_layers, scan_layers, sequence_parallel, attention_impl)
        padded = _padded(vocab_size, pad_vocab_to_multiple_of)
        token_key, position_key, head_key, *block_keys = jax.random.split(key, 3 + num_layers)
        # The real rows are drawn at the real size (the same weights for any padding); the
        # padding rows are zeros.
        table = eqx.nn.Embedding(vocab_size, dim, key=token_key).weight
        self.token_embedding = VocabParallelEmbedding.from_dense(
            eqx.nn.Embedding(weight=jnp.pad(table, ((0, padded - vocab_size), (0, 0)))), axis_name=axis_name
        )
        self.position_embedding = eqx.nn.Embedding(context_length, dim, key=position_key)
        shape = (dim, num_heads, mlp_ratio, dropout_p)
        blocks = gpt_blocks(shape, moe, block_keys, attention_impl, attention_dropout_p, axis_name, sequence_parallel)
        self.blocks = StackedLayers(blocks, axis_name=axis_name) if scan_layers else blocks
        self.final_norm = eqx.nn.LayerNorm(dim)
        head = eqx.nn.Linear(dim, vocab_size, use_bias=False, key=head_key)
        padded_head = eqx.filter_eval_shape(eqx.nn.Linear, dim, padded, use_bias=False, key=head_key)
        padded_head = eqx.tree_at(
            lambda l: l.weight, padded_head, jnp.pad(head.weight, ((0, padded - vocab_size), (0, 0)))
        )
        self.head = ColumnParallelLinear.from_dense(padded_head, axis_name=axis_name)
        self.dropout = eqx.nn.Dropout(dropout_p)
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.pad_vocab_to_multiple_of = pad_vocab_to_multiple_of
        self.remat = remat
        self.axis_name = axis_name
        self.attention_impl = attention_impl
        self.sequence_parallel = bool(sequence_parallel)
        self.moe = moe

    @property
    def padded_vocab_size(self) -> int:
        """The embedding's and head's number of rows (`vocab_size` rounded up)."""
        return self.token_embedding.num_embeddings

    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    @property
    def scan_layers(self) -> bool:
        return isinstance(self.blocks, StackedLayers)

    def check_axis_size(self, size: int, where: str = "") -> None:
        """`ValueError` unless the padded vocabulary, the heads and the MLP split `size` ways."""
        if self.padded_vocab_size % size:
            raise ValueError(
                f"GPT: the vocabulary (vocab_size={self.vocab_size}, padded to "
                f"{self.padded_vocab_size} by pad_vocab_to_multiple_of="
                f"{self.pad_vocab_to_multiple_of}) does not split over the {size} devices of the "
                f"model axis {self.axis_name!r}. Build the GPT with pad_vocab_to_multiple_of a "
                f"multiple of {size}, e.g. pad_vocab_to_multiple_of="
                f"{math.lcm(self.pad_vocab_to_multiple_of, size)}."
            )
        check_model_axis_size(self, size, "" if where == "<root>" else where)

    def to_dense(self) -> GPT:
        """The GPT itself: its global form is its own dense model (it runs on one device over
        a mesh whose model axis has size 1), as the Llama's is. So [`eqxpar.nn.to_dense`][]
        leaves it whole, and [`eqxpar.testing.check_parallel_parity`][] takes the same GPT as
        the dense and the parallel model. (Its layers made dense one by one would not run:
        the GPT calls them as its parallel layers.)"""
        return self

    @overload
    def __call__(
        self,
        tokens: Int[Array, "*batch seq"],
        *,
        segment_ids: Int[Array, "*batch seq"] | None = None,
        positions: Int[Array, "*batch seq"] | None = None,
        key: PRNGKeyArray | None = None,
        inference: bool | None = None,
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
        inference: bool | None = None,
        return_aux: Literal[True],
    ) -> tuple[Float[Array, "*batch seq vocab_block"], tuple]: ...

    def __call__(
        self,
        tokens: Int[Array, "*batch seq"],
        *,
        segment_ids: Int[Array, "*batch seq"] | None = None,
        positions: Int[Array, "*batch seq"] | None = None,
        key: PRNGKeyArray | None = None,
        inference: bool | None = None,
        return_aux: bool = False,
    ) -> Float[Array, "*batch seq vocab_block"] | tuple[Float[Array, "*batch seq vocab_block"], tuple]:
        """Next-token logits on one device (inside `shard_map`).

        **Arguments:**

        - `tokens`: token ids, shape `(seq,)` for one sequence or `(*batch, seq)` for a
          batch (computed as whole arrays, no `vmap`), with `seq <= context_length`, the
          same on every device of the model axis.
        - `segment_ids`: packed documents: `(*batch, seq)` ids of each token's document (like
          `tokens`: under context parallelism this device's block, in zigzag layout); a
          token attends only to earlier tokens of its own document. `None`: one document.
        - `positions`: each token's position in its document, `(*batch, seq)` like `tokens`,
          for the position embedding (each below `context_length`). `None`: `0 .. seq - 1`
          (the global positions under context parallelism).
        - `key`: the dropout key, the same on every device of the model axis.
        - `inference`: `True` turns dropout off.
        - `return_aux`: also return the MoE blocks' [`eqxpar.nn.MoEAux`][]s.

        **Returns:**

        (With `return_aux`: a pair of this and a tuple of one `MoEAux` per MoE block, in
        order; empty without `moe=`.) This device's block of the (padded) vocabulary's logits, shape
        `(*batch, seq, padded_vocab_size / N)`, `-inf` at padding ids: pass it to
        `vocab_parallel_cross_entropy`, or return it from `shard_map` with the model axis
        on its last dimension to assemble the whole logits.
        """
        with jax.named_scope("GPT"):
            if tokens.ndim < 1:
                raise ValueError(f"GPT: tokens must be (seq,) or (*batch, seq), got shape {tokens.shape}.")
            embed_key, *block_keys = split_keys(key, 1 + self.num_layers)
            rows, length = self._rows(tokens.shape[-1])
            if self.attention_impl in ("ring", "all_gather"):  # every block's ids, gathered once per step
                segment_ids = context_segment_ids(segment_ids, CONTEXT_AXIS)
            with jax.named_scope("embedding"):
                x = embed_tokens(
                    self, tokens, key=embed_key, inference=inference, rows=rows, length=length, positions=positions
                )
            wrap = remat_wrapper(self.remat)
            if isinstance(self.blocks, StackedLayers):  # self.scan_layers
                keys = None if key is None else jnp.stack(cast(list[Array], block_keys))
                x, auxes = run_stacked_blocks(
                    self.blocks, x, keys, wrap, inference=inference, rows=rows, length=length, segment_ids=segment_ids
                )
            else:

                def apply_block(block, x, key, inference, name, rows, length):
                    return block(
                        x, key=key, inference=inference, name=name, rows=rows, length=length, segment_ids=segment_ids
                    )

                apply = apply_block if wrap is None else wrap(apply_block)
                x, auxes = run_blocks(self.blocks, x, block_keys, apply, inference, rows, length)
            with jax.named_scope("head"):
                logits = head_logits(self, x)
            return (logits, auxes) if return_aux else logits

    def _bound_size(self, axis: str, why: str) -> int:
        """The size of mesh axis `axis`, or a ValueError naming it when it is not bound (the
        model called outside shard_map, or over a mesh without it): not JAX's NameError."""
        try:
            return jax.lax.axis_size(axis)
        except NameError:
            step = f" (train it with context_axis={axis!r} in the step builder)" if axis == CONTEXT_AXIS else ""
            raise ValueError(
                f"GPT: {why} splits every sequence over the mesh axis {axis!r}, which is not bound "
                f"here (the model was called outside shard_map, or inside one over a mesh without "
                f"that axis): call it inside eqxpar.filter_shard_map over a mesh with a {axis!r} "
                f"axis{step}."
            ) from None

    def _rows(self, seq: int) -> tuple[Array | None, int]:
        """The global positions of this device's rows of the residual stream (`None`: all
        of them, in order) and the whole sequence's length, for `seq` tokens per device."""
        context = self.attention_impl in ("ring", "all_gather")  # `seq` is this device's part
        length = seq * self._bound_size(CONTEXT_AXIS, f"attention_impl={self.attention_impl!r}") if context else seq
        if length > self.context_length:
            raise ValueError(
                f"GPT: {length} tokens per sequence ({seq} per context shard) exceed "
                f"context_length={self.context_length}."
            )
        rows = context_positions(seq, CONTEXT_AXIS, "zigzag") if context else None
        if self.sequence_parallel:
            n = self._bound_size(self.axis_name, "sequence_parallel=True")
            if seq % n:
                raise ValueError(
                    f"GPT: sequence_parallel=True splits the {seq} positions per device over the "
                    f"{n} devices of the model axis {self.axis_name!r}, which do not divide them. "
                    f"Use a sequence length (per context shard) that is a multiple of {n}, or "
                    f"sequence_parallel=False."
                )
            rows = jnp.arange(seq) if rows is None else rows
            rows = jax.lax.dynamic_slice_in_dim(rows, jax.lax.axis_index(self.axis_name) * (seq // n), seq // n)
        return rows, length


def next_token_loss(
    model: GPT,
    tokens: Int[Array, "batch seq_plus_one"] | dict[str, Array] | tuple[Array, Array],
    *,
    key: PRNGKeyArray | None = None,
) -> Float[Array, ""]:
    """Mean next-token cross-entropy over a batch, inside `shard_map` over the model axis.

    Predicts `tokens[:, 1:]` from `tokens[:, :-1]`, the whole batch at once (one call of
    the model on `(batch, seq)`, no `vmap`); with a data axis as well, each device averages
    its own examples and the train step takes the `pmean` over the data axis itself. A GPT
    with `moe=` adds its routers' auxiliary losses ([`eqxpar.models.moe_aux_loss`][]).

    **Arguments:**

    - `model`: a [`eqxpar.models.GPT`][] (each device's blocks).
    - `tokens`: `(batch, seq + 1)` token ids, the same on every device of the model axis;
      or packed documents, any batch [`eqxpar.models.next_token_batch`][] takes (a batch of
      [`eqxpar.data.text.PackedRows`][] records, or one already shifted for a context
      axis): attention then stays inside each document, the position embedding restarts at
      each document, and a target that starts another document weighs 0.
    - `key`: the dropout key, or `None` without dropout.

    **Returns:**

    The mean loss over this device's batch, a scalar, the same on every device of the
    model axis. With packed documents the mean is over every target position, a position
    whose target starts another document counting 0: the same quantity on every mesh, as
    the step averages the devices' means.
    """
    batch = next_token_batch(tokens)
    logits, auxes = model(
        batch["inputs"], segment_ids=batch["segment_ids"], positions=batch["positions"], key=key, return_aux=True
    )
    with jax.named_scope("loss"):
        loss = mean_cross_entropy(model, logits, batch["targets"], batch["loss_weights"])
        return loss + moe_aux_loss(model, auxes) if auxes else loss
