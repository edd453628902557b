"""The GPT's transformer block, its layer norm over any leading dimensions, and the
rematerialisation choices (see the package docs)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ..nn import MATMUL_NAME, ParallelMLP, ParallelMultiheadAttention, gelu, layer_norm

__all__ = ["TransformerBlock", "norm_and_attention", "remat_wrapper", "sequence_dropout", "split_keys", "REMAT_CHOICES"]

Remat = Literal["none", "block", "save_matmuls", "offload"]
REMAT_CHOICES = ("none", "block", "save_matmuls", "offload")


def split_keys(key: PRNGKeyArray | None, n: int):
    """`n` keys from `key` (a tuple of `None`s without a key)."""
    return (None,) * n if key is None else tuple(jax.random.split(key, n))


def sequence_dropout(
    dropout: eqx.nn.Dropout,
    x: Float[Array, "*batch seq dim"],
    rows: Int[Array, " seq"] | None,
    length: int | None,
    *,
    key: PRNGKeyArray | None,
    inference: bool | None,
) -> Float[Array, "*batch seq dim"]:
    """`dropout` on this device's rows of a sequence split over devices, with the mask the
    whole sequence would get on one device.

    `x` holds rows `rows` (global positions, along dimension -2) of a sequence of `length`
    positions: the mask is drawn for the whole `(*batch, length, dim)` array with `key`, as
    `eqx.nn.Dropout` would on one device, and this device takes its rows. Every layout of
    the sequence (context parallelism's zigzag, sequence parallelism's blocks) therefore
    drops the same values as one device. The cost is drawing the whole mask (random bits,
    no gradient) on every device.

    **Arguments:**

    - `dropout`: the `eqx.nn.Dropout`.
    - `x`: this device's rows, shape `(*batch, len(rows), dim)`.
    - `rows`, `length`: their global positions and the whole length; `None` when `x` holds
      the whole sequence (plain `dropout`).
    - `key`, `inference`: as in `eqx.nn.Dropout`.

    **Returns:**

    `x` with dropout applied, same shape.
    """
    off = dropout.inference if inference is None else inference
    if rows is None or off or (isinstance(dropout.p, (int, float)) and dropout.p == 0):
        return dropout(x, key=key, inference=inference)
    if key is None:
        raise RuntimeError("Dropout requires a key when running in non-deterministic mode.")
    assert length is not None  # given with rows
    q = 1 - jax.lax.stop_gradient(dropout.p)
    mask = jax.random.bernoulli(key, q, (*x.shape[:-2], length, x.shape[-1]))
    mask = jnp.take(mask, rows, axis=-2)
    return jnp.where(mask, x / q, 0)


def remat_wrapper(remat: Remat) -> Callable[[Callable], Callable] | None:
    """The wrapper that recomputes a block's activations in the backward pass, or `None`.

    - `"none"`: keep every activation (fastest, most memory);
    - `"block"`: keep only each block's input and recompute the rest
      (`jax.checkpoint_policies.nothing_saveable`; the block's forward collectives run again);
    - `"save_matmuls"`: keep the linear layers' matmul outputs (q, k, v, the output
      projection, the MLP's layers: every product named `eqxpar.nn.MATMUL_NAME`),
      recompute the elementwise work and attention, whose scores grow with the square of
      the sequence (Megatron's selective recomputation;
      `jax.checkpoint_policies.save_only_these_names(MATMUL_NAME)`);
    - `"offload"`: keep the same matmul outputs, but in host memory: moved to
      `"pinned_host"` in the forward pass and back in the backward pass
      (`jax.checkpoint_policies.save_and_offload_only_these_names`), which frees device
      memory for the price of the transfers. Only on backends that move arrays between
      memories inside a program: GPUs and TPUs. (JAX's CPU backend lists a
      `"pinned_host"` memory, but compiles the moves away.)

    The policies pick the products by name, not by shape, so a custom gradient rule or a
    fused kernel for the linear layers (which a policy looking for `dot_general`s would no
    longer see) keeps them saved.

    **Raises:**

    - `ValueError` for `"offload"` when the default backend (`jax.devices()[0]`) cannot
      offload, naming it and the other choices; and for an unknown `remat`.
    """
    if remat == "none":
        return None
    if remat == "offload":
        device = jax.devices()[0]
        kinds = {memory.kind for memory in device.addressable_memories()}
        if device.platform not in ("gpu", "tpu") or "pinned_host" not in kinds:
            others = ", ".join(repr(choice) for choice in REMAT_CHOICES if choice != "offload")
            raise ValueError(
                f"remat='offload' keeps saved activations in host memory, which needs a GPU or "
                f"TPU backend; the backend here is {device.platform!r} (JAX {jax.__version__}), "
                f"which does not move arrays to the host inside a program. Use one of {others} "
                f"('save_matmuls' keeps the same activations on the device)."
            )
    elif remat not in REMAT_CHOICES:
        raise ValueError(f"remat must be one of {', '.join(map(repr, REMAT_CHOICES))}, got {remat!r}.")
    return functools.partial(eqx.filter_checkpoint, policy=remat_policy(remat))


def remat_policy(remat: Remat) -> Callable:
    """The `jax.checkpoint` policy of a `remat` choice other than `"none"` (see
    `remat_wrapper`; this one does not check the backend)."""
    if remat == "block":
        return jax.checkpoint_policies.nothing_saveable
    if remat == "save_matmuls":
        return jax.checkpoint_policies.save_only_these_names(MATMUL_NAME)
    if remat == "offload":
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=[MATMUL_NAME],
            offload_src="device",
            offload_dst="pinned_host",
        )
    raise ValueError(f"remat_policy: no policy for remat={remat!r}; choose one of {REMAT_CHOICES[1:]}.")


def norm_and_attention(
    dim: int,
    num_heads: int,
    dropout_p: float,
    attention_dropout_p: float | None,
    attention_impl: str,
    axis_name: str,
    key: PRNGKeyArray,
) -> tuple[eqx.nn.LayerNorm, ParallelMultiheadAttention]:
    """The first half of a GPT block, dense ([`eqxpar.models.TransformerBlock`][]) or MoE
    ([`eqxpar.models.MoEBlock`][]): its attention's layer norm and causal self-attention
    (weights from `key`; dropout on the attention weights `attention_dropout_p`, or
    `dropout_p` when that is None)."""
    attention = ParallelMultiheadAttention(
        num_heads,
        dim,
        dropout_p=dropout_p if attention_dropout_p is None else attention_dropout_p,
        causal=True,
        attention_impl=attention_impl,  # pyright: ignore[reportArgumentType]  # checked by the attention
        axis_name=axis_name,
        key=key,
    )
    return eqx.nn.LayerNorm(dim), attention


class TransformerBlock(eqx.Module):
    """A pre-norm transformer block: `x + attention(norm(x))`, then `x + mlp(norm(x))`.

    Communication per call: one all-reduce in the attention and one in the MLP (and one
    each in the backward pass). The residual stream `x` is replicated over the model axis,
    so the residual dropout uses the same key on every device: every device drops the same
    positions and `x` stays the same everywhere.

    With `sequence_parallel=True` (Megatron sequence parallelism) the residual stream is
    split along the sequence over the model axis instead: the layer norms and dropouts run
    on this device's block of positions, each tensor-parallel region all-gathers its
    normalised input and reduce-scatters its output (the same bytes as the all-reduces it
    replaces, and `1 / N` of the residual activations per device).
    """

    attention_norm: eqx.nn.LayerNorm
    attention: ParallelMultiheadAttention
    mlp_norm: eqx.nn.LayerNorm
    mlp: ParallelMLP
    dropout: eqx.nn.Dropout
    sequence_parallel: bool = eqx.field(static=True)

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: int = 4,
        dropout_p: float = 0.0,
        *,
        attention_impl: Literal["dot_product", "reference", "ring", "all_gather"] = "dot_product",
        attention_dropout_p: float | None = None,
        sequence_parallel: bool = False,
        axis_name: str = "model",
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `dim`: the width of the residual stream.
        - `num_heads`: attention heads (`dim / num_heads` channels each).
        - `mlp_ratio`: the MLP's hidden width is `mlp_ratio * dim`.
        - `dropout_p`: dropout on both residual branches (and the attention weights, unless
          `attention_dropout_p` says otherwise).
        - `attention_impl`: `"dot_product"` (`jax.nn.dot_product_attention`, fused where the
          platform has a kernel) or `"reference"` (explicit softmax); see
          [`eqxpar.nn.ParallelMultiheadAttention`][].
        - `attention_dropout_p`: dropout on the attention weights (default: `dropout_p`;
          context-parallel attention takes none).
        - `sequence_parallel`: split the residual stream along the sequence over the model
          axis (see above).
        - `axis_name`: the model axis.
        - `key`: the initialisation key.
        """
        attention_key, mlp_key = jax.random.split(key)
        self.attention_norm, self.attention = norm_and_attention(
            dim, num_heads, dropout_p, attention_dropout_p, attention_impl, axis_name, attention_key
        )
        self.mlp_norm = eqx.nn.LayerNorm(dim)
        self.mlp = ParallelMLP(dim, dim, mlp_ratio * dim, activation=gelu, axis_name=axis_name, key=mlp_key)
        self.dropout = eqx.nn.Dropout(dropout_p)
        self.sequence_parallel = sequence_parallel

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
    ) -> Float[Array, "*batch seq dim"]:
        """Apply the block on one device (inside `shard_map`).

        **Arguments:**

        - `x`: the residual stream, `(seq, dim)` or `(*batch, seq, dim)`, the same on every
          device of the model axis (with `sequence_parallel`, this device's block of the
          sequence).
        - `key`: the dropout key, the same on every device of the model axis.
        - `inference`: `True` turns dropout off.
        - `name`: the `jax.named_scope` of the block's operations in the HLO metadata
          (default `"TransformerBlock"`; the GPT names its blocks `block_0`, `block_1`, ...).
        - `rows`, `length`: when `x` holds only some positions of the sequence (context or
          sequence parallelism), their global positions and the sequence's whole length,
          so that the residual dropout drops what it would on one device (see
          [`eqxpar.models.sequence_dropout`][]). Default: `x` is the whole sequence.
        - `segment_ids`: packed documents: `(*batch, seq)` document ids of the tokens
          attention sees (whole sequences on every device of the model axis; under context
          parallelism this device's block), so that a token attends only within its
          document; `None`: one document per sequence.

        **Returns:**

        The new residual stream, the shape of `x`.
        """
        with jax.named_scope(name or "TransformerBlock"):
            attention_key, residual_key1, residual_key2 = split_keys(key, 3)
            sequence_dim = -2 if self.sequence_parallel else None
            with jax.named_scope("attention"):
                h = self.attention(
                    layer_norm(self.attention_norm, x),
                    segment_ids=segment_ids,
                    key=attention_key,
                    inference=inference,
                    sequence_dim=sequence_dim,
                )
                x = x + sequence_dropout(self.dropout, h, rows, length, key=residual_key1, inference=inference)
            with jax.named_scope("mlp"):
                h = self.mlp(layer_norm(self.mlp_norm, x), sequence_dim=sequence_dim)
                return x + sequence_dropout(self.dropout, h, rows, length, key=residual_key2, inference=inference)
