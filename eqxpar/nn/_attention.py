"""ParallelMultiheadAttention: attention heads split over the model axis."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ._all_gather_attention import all_gather_attention
from ._attention_inputs import check_segment_shape, check_shapes, local_mask, segment_mask
from ._attention_kernels import fused_attention, reference_attention
from ._base import TensorParallelLayer, gather_sequence, skeleton, to_varying
from ._context_layout import LAYOUTS, Layout
from ._linear import ColumnParallelLinear, RowParallelLinear
from ._ring_attention import ring_attention

__all__ = ["ParallelMultiheadAttention", "ATTENTION_IMPLS"]

ATTENTION_IMPLS = ("reference", "dot_product", "ring", "all_gather")
"""The `attention_impl`s [`eqxpar.nn.ParallelMultiheadAttention`][] (and so the GPT) takes:
`"reference"` (the explicit softmax of `eqx.nn.MultiheadAttention`), `"dot_product"`
(`jax.nn.dot_product_attention`), and with the sequence split over a context axis
(context parallelism) `"ring"` and `"all_gather"`."""


class ParallelMultiheadAttention(TensorParallelLayer):
    """Multi-head attention with its heads split over the model axis (Megatron-style).

    The same function, parameters and initialisation as `eqx.nn.MultiheadAttention`; with
    `N` devices on the model axis each device owns `num_heads / N` whole heads:

    - `query_proj`, `key_proj`, `value_proj`: [`eqxpar.nn.ColumnParallelLinear`][] layers:
      a device computes only its heads' queries, keys and values;
    - each device runs attention for its heads, with no communication (heads are
      independent);
    - `output_proj`: a [`eqxpar.nn.RowParallelLinear`][]: each device projects its heads'
      outputs with its columns of the output weight, and one `psum` adds them up.

    One all-reduce forward (of `q_seq x output_size` per example) and one backward (the
    input gradient: when query, key and value are the same array, their three gradients
    are added locally first and share that one all-reduce).

    Dropout on the attention weights uses the same per-head keys as
    `eqx.nn.MultiheadAttention` (`jax.random.split(key, num_heads)`, each device taking its
    heads' keys), so it matches the dense layer exactly, at every model axis size.
    """

    query_proj: ColumnParallelLinear
    key_proj: ColumnParallelLinear
    value_proj: ColumnParallelLinear
    output_proj: RowParallelLinear
    dropout: eqx.nn.Dropout
    num_heads: int = eqx.field(static=True)
    query_size: int = eqx.field(static=True)
    key_size: int = eqx.field(static=True)
    value_size: int = eqx.field(static=True)
    output_size: int = eqx.field(static=True)
    qk_size: int = eqx.field(static=True)
    vo_size: int = eqx.field(static=True)
    use_query_bias: bool = eqx.field(static=True)
    use_key_bias: bool = eqx.field(static=True)
    use_value_bias: bool = eqx.field(static=True)
    use_output_bias: bool = eqx.field(static=True)
    causal: bool = eqx.field(static=True)
    attention_impl: str = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)
    context_axis: str = eqx.field(static=True)
    context_layout: Layout = eqx.field(static=True)

    def __init__(
        self,
        num_heads: int,
        query_size: int,
        key_size: int | None = None,
        value_size: int | None = None,
        output_size: int | None = None,
        qk_size: int | None = None,
        vo_size: int | None = None,
        use_query_bias: bool = False,
        use_key_bias: bool = False,
        use_value_bias: bool = False,
        use_output_bias: bool = False,
        dropout_p: float = 0.0,
        inference: bool = False,
        dtype=None,
        *,
        causal: bool = False,
        attention_impl: Literal["reference", "dot_product", "ring", "all_gather"] = "reference",
        axis_name: str = "model",
        context_axis: str = "context",
        context_layout: Literal["zigzag", "contiguous"] = "zigzag",
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `num_heads` ... `dtype`: as in `eqx.nn.MultiheadAttention`; the weights are
          initialised exactly as `eqx.nn.MultiheadAttention(..., key=key)` would be.
        - `causal`: when `True`, query `i` attends only to keys `j <= i` (for a longer key
          sequence, `j <= i + kv_seq - q_seq`), combined with any `mask` passed in.
        - `attention_impl`: `"reference"` (default: the explicit softmax of
          `eqx.nn.MultiheadAttention`) or `"dot_product"` (`jax.nn.dot_product_attention`:
          cuDNN's fused kernel on GPUs that have it, XLA elsewhere). Active attention
          dropout always takes the reference path (the fused kernel has no dropout), and so
          does `qk_size != vo_size`. `"ring"` or `"all_gather"`: context parallelism, the
          sequence split over `context_axis` in `context_layout`
          (`eqxpar.nn.ring_attention`, `eqxpar.nn.all_gather_attention`; no `mask`
          and no attention dropout; `causal` follows the original positions).
        - `axis_name`: the mesh axis the heads are split over.
        - `context_axis`, `context_layout`: the context axis and the layout of the
          sequence over it (used by `"ring"` and `"all_gather"` only).
        - `key`: the initialisation key.

        **Raises:**

        - `ValueError` for an unknown `attention_impl` or `context_layout`.
        """
        if attention_impl not in ATTENTION_IMPLS:
            raise ValueError(
                f"ParallelMultiheadAttention: attention_impl must be one of {ATTENTION_IMPLS}, got {attention_impl!r}."
            )
        if context_layout not in LAYOUTS:
            raise ValueError(
                f"ParallelMultiheadAttention: context_layout must be one of {LAYOUTS}, got {context_layout!r}."
            )
        dense = eqx.nn.MultiheadAttention(
            num_heads,
            query_size,
            key_size,
            value_size,
            output_size,
            qk_size,
            vo_size,
            use_query_bias,
            use_key_bias,
            use_value_bias,
            use_output_bias,
            dropout_p,
            inference,
            dtype,
            key=key,
        )
        self.query_proj = ColumnParallelLinear.from_dense(dense.query_proj, axis_name=axis_name)
        self.key_proj = ColumnParallelLinear.from_dense(dense.key_proj, axis_name=axis_name)
        self.value_proj = ColumnParallelLinear.from_dense(dense.value_proj, axis_name=axis_name)
        self.output_proj = RowParallelLinear.from_dense(dense.output_proj, input_is_split=True, axis_name=axis_name)
        self.dropout = dense.dropout
        self.num_heads = dense.num_heads
        self.query_size = dense.query_size
        self.key_size = dense.key_size
        self.value_size = dense.value_size
        self.output_size = dense.output_size
        self.qk_size = dense.qk_size
        self.vo_size = dense.vo_size
        self.use_query_bias = use_query_bias
        self.use_key_bias = use_key_bias
        self.use_value_bias = use_value_bias
        self.use_output_bias = use_output_bias
        self.causal = causal
        self.attention_impl = attention_impl
        self.axis_name = axis_name
        self.context_axis = context_axis
        self.context_layout = context_layout

    @classmethod
    def from_dense(
        cls,
        attention: eqx.nn.MultiheadAttention,
        *,
        causal: bool = False,
        attention_impl: Literal["reference", "dot_product"] = "reference",
        axis_name: str = "model",
    ) -> ParallelMultiheadAttention:
        """The tensor-parallel form (global) of a dense `eqx.nn.MultiheadAttention`.

        **Arguments:**

        - `attention`: the dense layer.
        - `causal`, `attention_impl`, `axis_name`: as in the constructor.

        **Returns:**

        A `ParallelMultiheadAttention` in global form sharing `attention`'s arrays.
        """
        if not isinstance(attention, eqx.nn.MultiheadAttention):
            raise ValueError(
                f"ParallelMultiheadAttention.from_dense needs an eqx.nn.MultiheadAttention, got "
                f"{type(attention).__name__}."
            )
        a = attention
        layer = skeleton(
            cls,
            a.num_heads,
            a.query_size,
            a.key_size,
            a.value_size,
            a.output_size,
            a.qk_size,
            a.vo_size,
            a.use_query_bias,
            a.use_key_bias,
            a.use_value_bias,
            a.use_output_bias,
            a.dropout.p,
            a.dropout.inference,
            a.query_proj.weight.dtype,
            causal=causal,
            attention_impl=attention_impl,
            axis_name=axis_name,
        )
        return eqx.tree_at(
            lambda l: (l.query_proj, l.key_proj, l.value_proj, l.output_proj),
            layer,
            (
                ColumnParallelLinear.from_dense(a.query_proj, axis_name=axis_name),
                ColumnParallelLinear.from_dense(a.key_proj, axis_name=axis_name),
                ColumnParallelLinear.from_dense(a.value_proj, axis_name=axis_name),
                RowParallelLinear.from_dense(a.output_proj, input_is_split=True, axis_name=axis_name),
            ),
        )

    def to_dense(self) -> eqx.nn.MultiheadAttention:
        """The dense `eqx.nn.MultiheadAttention` with this layer's (global) weights.

        The causal mask is not part of the dense layer: pass it as its `mask` argument.
        """
        dense = eqx.filter_eval_shape(
            eqx.nn.MultiheadAttention,
            self.num_heads,
            self.query_size,
            self.key_size,
            self.value_size,
            self.output_size,
            self.qk_size,
            self.vo_size,
            self.use_query_bias,
            self.use_key_bias,
            self.use_value_bias,
            self.use_output_bias,
            self.dropout.p,
            self.dropout.inference,
            self.query_proj.weight.dtype,
            key=jax.random.key(0),
        )
        return eqx.tree_at(
            lambda d: (d.query_proj, d.key_proj, d.value_proj, d.output_proj),
            dense,
            (
                self.query_proj.to_dense(),
                self.key_proj.to_dense(),
                self.value_proj.to_dense(),
                self.output_proj.to_dense(),
            ),
        )

    def check_axis_size(self, size: int, where: str = "") -> None:
        """`ValueError` unless `num_heads` is divisible by `size` (heads are not cut)."""
        if self.num_heads % size:
            raise self._split_error(where, "num_heads", self.num_heads, size)

    def __call__(
        self,
        query: Float[Array, "*batch q_seq q_size"],
        key_: Float[Array, "*batch kv_seq k_size"] | None = None,
        value: Float[Array, "*batch kv_seq v_size"] | None = None,
        mask: Bool[Array, "*batch q_seq kv_seq"] | Bool[Array, "*batch num_heads q_seq kv_seq"] | None = None,
        *,
        segment_ids: Int[Array, "*batch seq"] | None = None,
        key: PRNGKeyArray | None = None,
        inference: bool | None = None,
        sequence_dim: int | None = None,
        process_heads: Callable[[Array, Array, Array], tuple[Array, Array, Array]] | None = None,
    ) -> Float[Array, "*batch q_seq o_size"]:
        """Apply attention on one device (inside `shard_map`).

        **Arguments:**

        - `query`: shape `(q_seq, query_size)` for one example (as in
          `eqx.nn.MultiheadAttention`) or `(*batch, q_seq, query_size)`, the same on every
          device.
        - `key_`, `value`: shapes `(*batch, kv_seq, key_size)` and `(*batch, kv_seq,
          value_size)`. Default: `query` (self-attention).
        - `mask`: `False` hides a position. `(q_seq, kv_seq)` for every head (and example),
          `(*batch, q_seq, kv_seq)` per example, or with a head axis before the last two,
          `(*batch, num_heads, q_seq, kv_seq)` (all heads: each device takes its own).
        - `segment_ids`: packed documents in self-attention: `(*batch, seq)` integers, one
          id per document of each row; a query attends only to keys with its own id
          (combined with `causal` and `mask`). With `sequence_dim`, they cover the whole
          sequences (as `mask` does); with `"ring"`/`"all_gather"`, every device's block in
          the context layout, `(*batch, C x seq)`, as [`eqxpar.nn.context_segment_ids`][]
          gathers them once per step. Every implementation takes them (`"dot_product"` as a mask:
          XLA's attention, since cuDNN's fused kernel through `jax.nn.dot_product_attention`
          takes no document ids).
        - `key`: the dropout key, the same on every device.
        - `inference`: as in `eqx.nn.Dropout`.
        - `sequence_dim`: Megatron sequence parallelism: the inputs are this device's
          blocks of their sequences along this dimension (`-2`: the sequence dimension),
          all-gathered once on the way in, and the output is reduce-scattered back to this
          device's block of the queries. `mask` covers the whole sequences. Default None.
        - `process_heads`: as in `eqx.nn.MultiheadAttention` (e.g. rotary embeddings), given
          this device's heads (`(seq, heads, size)` per example): it must treat every head
          alike, as rotary embeddings do. Not with `"ring"`/`"all_gather"` attention.

        **Returns:**

        Shape `(*batch, q_seq, output_size)`, the same on every device (with
        `sequence_dim`, this device's block of the `q_seq` queries).
        """
        with jax.named_scope(type(self).__name__):
            size = self._model_axis_size()
            heads = self.num_heads // size  # this device's heads: [first, first + heads)
            first = jax.lax.axis_index(self.axis_name) * heads
            key_ = query if key_ is None else key_
            value = key_ if value is None else value
            if sequence_dim is not None:
                if sequence_dim % query.ndim != query.ndim - 2:
                    raise ValueError(
                        f"{type(self).__name__}: sequence_dim must be the sequence dimension, -2, got {sequence_dim}."
                    )
                # Gather each distinct input once: self-attention's three projections read one array.
                gathered = {id(a): gather_sequence(a, self.axis_name, -2) for a in (query, key_, value)}
                query, key_, value = (gathered[id(a)] for a in (query, key_, value))
            lead, q_seq, kv_seq = query.shape[:-2], query.shape[-2], key_.shape[-2]
            check_shapes(query, key_, value)

            # Mark the inputs as varying once: self-attention's three projections then read
            # one varying array, and their input gradients meet in one backward all-reduce.
            q_in = to_varying(query, self.axis_name)
            k_in = q_in if key_ is query else to_varying(key_, self.axis_name)
            v_in = k_in if value is key_ else (q_in if value is query else to_varying(value, self.axis_name))
            q = self.query_proj(q_in).reshape(*lead, q_seq, heads, self.qk_size)
            k = self.key_proj(k_in).reshape(*lead, kv_seq, heads, self.qk_size)
            v = self.value_proj(v_in).reshape(*lead, kv_seq, heads, self.vo_size)
            if process_heads is not None:
                q, k, v = self._process_heads(process_heads, q, k, v, len(lead))

            mask = local_mask(mask, len(lead), first, heads, self.num_heads)
            if segment_ids is not None and self.attention_impl not in ("ring", "all_gather"):
                check_segment_shape(segment_ids, lead, q_seq, kv_seq)
                documents = segment_mask(segment_ids)
                assert documents is not None  # segment_ids is not None
                mask = documents if mask is None else jnp.logical_and(mask, documents)
            dropout_off = inference if inference is not None else self.dropout.inference
            dropout_off = dropout_off or (isinstance(self.dropout.p, (int, float)) and self.dropout.p == 0)
            if self.attention_impl in ("ring", "all_gather"):
                out = self._context_attention(q, k, v, mask, dropout_off, segment_ids)
            elif self.attention_impl == "dot_product" and dropout_off and self.qk_size == self.vo_size:
                out = fused_attention(q, k, v, mask, causal=self.causal)
            else:
                if self.causal:
                    causal = jnp.tril(jnp.ones((q_seq, kv_seq), bool), k=kv_seq - q_seq)
                    mask = causal if mask is None else mask & causal.reshape((1,) * (mask.ndim - 2) + causal.shape)
                # eqx.nn.MultiheadAttention gives head h the key split(key, num_heads)[h].
                keys = None
                if key is not None:
                    keys = jax.lax.dynamic_slice_in_dim(jax.random.split(key, self.num_heads), first, heads)
                out = reference_attention(q, k, v, mask, self.dropout, keys, inference)
            # Row-parallel output projection: partial products of our heads, then the psum.
            return self.output_proj(out.reshape(*lead, q_seq, heads * self.vo_size), sequence_dim=sequence_dim)

    def _process_heads(self, process_heads: Callable, q, k, v, batch_dims: int):
        """`process_heads` on this device's heads of each example, as the dense layer calls it."""
        if self.attention_impl in ("ring", "all_gather"):
            raise ValueError(
                f"ParallelMultiheadAttention: process_heads (e.g. rotary embeddings) needs whole "
                f"sequences, but attention_impl={self.attention_impl!r} gives each device a block "
                f"of positions; use attention_impl='dot_product' or 'reference'."
            )
        for _ in range(batch_dims):
            process_heads = jax.vmap(process_heads)
        out = process_heads(q, k, v)
        if tuple(x.shape for x in out) != (q.shape, k.shape, v.shape):
            raise ValueError("ParallelMultiheadAttention: process_heads must not change the shape of the heads.")
        return out

    def _context_attention(self, q, k, v, mask, dropout_off: bool, segment_ids):
        """Attention over a sequence split across the context axis (see `attention_impl`)."""
        if mask is not None or not dropout_off:
            raise ValueError(
                f"ParallelMultiheadAttention: attention_impl={self.attention_impl!r} (context "
                f"parallelism) takes no mask and no attention dropout; use causal=True for a "
                f"causal mask, and dropout_p=0 or inference=True."
            )
        attend = ring_attention if self.attention_impl == "ring" else all_gather_attention
        return attend(
            q,
            k,
            v,
            axis_name=self.context_axis,
            causal=self.causal,
            layout=self.context_layout,
            segment_ids=segment_ids,
        )
