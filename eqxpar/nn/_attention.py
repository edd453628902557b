"""ParallelMultiheadAttention: attention heads split over the model axis."""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from ._base import TensorParallelLayer, skeleton, to_varying
from ._linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["ParallelMultiheadAttention"]


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
    axis_name: str = eqx.field(static=True)

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
        axis_name: str = "model",
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `num_heads` ... `dtype`: as in `eqx.nn.MultiheadAttention`; the weights are
          initialised exactly as `eqx.nn.MultiheadAttention(..., key=key)` would be.
        - `causal`: when `True`, query `i` attends only to keys `j <= i` (for a longer key
          sequence, `j <= i + kv_seq - q_seq`), combined with any `mask` passed in.
        - `axis_name`: the mesh axis the heads are split over.
        - `key`: the initialisation key.
        """
        dense = eqx.nn.MultiheadAttention(
            num_heads, query_size, key_size, value_size, output_size, qk_size, vo_size,
            use_query_bias, use_key_bias, use_value_bias, use_output_bias, dropout_p,
            inference, dtype, key=key,
        )
        self.query_proj = ColumnParallelLinear.from_dense(dense.query_proj, axis_name=axis_name)
        self.key_proj = ColumnParallelLinear.from_dense(dense.key_proj, axis_name=axis_name)
        self.value_proj = ColumnParallelLinear.from_dense(dense.value_proj, axis_name=axis_name)
        self.output_proj = RowParallelLinear.from_dense(
            dense.output_proj, input_is_split=True, axis_name=axis_name
        )
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
        self.axis_name = axis_name

    @classmethod
    def from_dense(
        cls, attention: eqx.nn.MultiheadAttention, *, causal: bool = False, axis_name: str = "model"
    ) -> "ParallelMultiheadAttention":
        """The tensor-parallel form (global) of a dense `eqx.nn.MultiheadAttention`.

        **Arguments:**

        - `attention`: the dense layer.
        - `causal`, `axis_name`: as in the constructor.

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
            cls, a.num_heads, a.query_size, a.key_size, a.value_size, a.output_size, a.qk_size,
            a.vo_size, a.use_query_bias, a.use_key_bias, a.use_value_bias, a.use_output_bias,
            a.dropout.p, a.dropout.inference, a.query_proj.weight.dtype,
            causal=causal, axis_name=axis_name,
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
            eqx.nn.MultiheadAttention, self.num_heads, self.query_size, self.key_size,
            self.value_size, self.output_size, self.qk_size, self.vo_size, self.use_query_bias,
            self.use_key_bias, self.use_value_bias, self.use_output_bias, self.dropout.p,
            self.dropout.inference, self.query_proj.weight.dtype, key=jax.random.key(0),
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
        query: Float[Array, "q_seq q_size"],
        key_: Float[Array, "kv_seq k_size"] | None = None,
        value: Float[Array, "kv_seq v_size"] | None = None,
        mask: Bool[Array, "q_seq kv_seq"] | Bool[Array, "num_heads q_seq kv_seq"] | None = None,
        *,
        key: PRNGKeyArray | None = None,
        inference: bool | None = None,
    ) -> Float[Array, "q_seq o_size"]:
        """Apply attention on one device (inside `shard_map`).

        **Arguments:**

        - `query`: shape `(q_seq, query_size)`, the same on every device.
        - `key_`, `value`: shapes `(kv_seq, key_size)` and `(kv_seq, value_size)`. Default:
          `query` (self-attention).
        - `mask`: as in `eqx.nn.MultiheadAttention`: `(q_seq, kv_seq)` or, per head,
          `(num_heads, q_seq, kv_seq)` (all heads: each device takes its own); `False`
          hides a position.
        - `key`: the dropout key, the same on every device.
        - `inference`: as in `eqx.nn.Dropout`.

        **Returns:**

        Shape `(q_seq, output_size)`, the same on every device.
        """
        size = self._model_axis_size()
        heads = self.num_heads // size  # this device's heads: [first, first + heads)
        first = jax.lax.axis_index(self.axis_name) * heads
        key_ = query if key_ is None else key_
        value = key_ if value is None else value
        q_seq, kv_seq = query.shape[0], key_.shape[0]
        if value.shape[0] != kv_seq:
            raise ValueError("ParallelMultiheadAttention: key and value must have the same length.")

        # Mark the inputs as varying once: self-attention's three projections then read one
        # varying array, and their input gradients meet in a single backward all-reduce.
        q_in = to_varying(query, self.axis_name)
        k_in = q_in if key_ is query else to_varying(key_, self.axis_name)
        v_in = k_in if value is key_ else (q_in if value is query else to_varying(value, self.axis_name))
        q = jax.vmap(self.query_proj)(q_in).reshape(q_seq, heads, self.qk_size)
        k = jax.vmap(self.key_proj)(k_in).reshape(kv_seq, heads, self.qk_size)
        v = jax.vmap(self.value_proj)(v_in).reshape(kv_seq, heads, self.vo_size)

        if self.causal:
            causal = jnp.tril(jnp.ones((q_seq, kv_seq), bool), k=kv_seq - q_seq)
            mask = causal if mask is None else mask & causal
        if mask is not None and mask.ndim == 3:
            mask = jax.lax.dynamic_slice_in_dim(mask, first, heads, axis=0)  # our heads' masks
        mask_axis = 0 if mask is not None and mask.ndim == 3 else None
        # eqx.nn.MultiheadAttention gives head h the key split(key, num_heads)[h]; take ours.
        keys = None
        if key is not None:
            keys = jax.lax.dynamic_slice_in_dim(jax.random.split(key, self.num_heads), first, heads)

        def one_head(q, k, v, mask, key):
            return _attention(q, k, v, mask, self.dropout, key, inference)

        out = jax.vmap(one_head, in_axes=(1, 1, 1, mask_axis, None if keys is None else 0), out_axes=1)(
            q, k, v, mask, keys
        )
        # Row-parallel output projection: partial products of our heads, then the psum.
        return jax.vmap(self.output_proj)(out.reshape(q_seq, heads * self.vo_size))


def _attention(q, k, v, mask, dropout: eqx.nn.Dropout, key, inference):
    """Scaled dot-product attention for one head, as `eqx.nn.MultiheadAttention` computes it."""
    logits = (q / math.sqrt(q.shape[-1])) @ k.T
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
    dtype = jnp.promote_types(logits.dtype, jnp.float32)
    weights = jax.nn.softmax(logits.astype(dtype), axis=-1).astype(logits.dtype)
    weights = dropout(weights, key=key, inference=inference)
    return weights @ v
