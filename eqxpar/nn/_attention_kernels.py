"""The two ways attention is computed once the heads are local: the explicit softmax that
`eqx.nn.MultiheadAttention` uses (with per-head dropout), and `jax.nn.dot_product_attention`
(cuDNN's fused flash-attention kernel on NVIDIA GPUs where it applies, XLA elsewhere)."""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp

from .._promotion import at_least_float32

# cuDNN's fused attention takes half-precision inputs and head sizes that are multiples of 8
# up to 128 (jax.nn.dot_product_attention checks the rest and raises if it cannot).
_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
_CUDNN_MAX_HEAD_DIM = 128


def reference_attention(q, k, v, mask, dropout: eqx.nn.Dropout, keys, inference):
    """Scaled dot-product attention as `eqx.nn.MultiheadAttention` computes it, for all local
    heads at once: `q` `(*batch, q_seq, heads, qk)`, `k`/`v` `(*batch, kv_seq, heads, *)`,
    `mask` broadcastable to `(*batch, heads, q_seq, kv_seq)`, `keys` one dropout key per
    head (or `None`). Returns `(*batch, q_seq, heads, vo)`."""
    logits = jnp.einsum("...qhd,...khd->...hqk", q / math.sqrt(q.shape[-1]), k)
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
    dtype = at_least_float32(logits.dtype)
    weights = jax.nn.softmax(logits.astype(dtype), axis=-1).astype(logits.dtype)
    head_axis = weights.ndim - 3
    if keys is None:
        weights = dropout(weights, key=None, inference=inference)
    else:  # each head its own key, as the dense layer does
        weights = jax.vmap(
            lambda w, k: dropout(w, key=k, inference=inference), in_axes=(head_axis, 0), out_axes=head_axis
        )(weights, keys)
    return jnp.einsum("...hqk,...khd->...qhd", weights, v)


def cudnn_applies(q, k, v, mask) -> bool:
    """Whether cuDNN's fused kernel can take this attention: a GPU backend, bf16/fp16
    inputs of one dtype, equal query/key and value head sizes that are multiples of 8 up
    to 128, and no explicit mask (causality is the kernel's own flag)."""
    head_dims = {q.shape[-1], k.shape[-1], v.shape[-1]}
    return (
        jax.default_backend() == "gpu"
        and mask is None
        and len({q.dtype, k.dtype, v.dtype}) == 1
        and q.dtype in _CUDNN_DTYPES
        and len(head_dims) == 1
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= _CUDNN_MAX_HEAD_DIM
    )


def fused_attention(q, k, v, mask=None, *, causal: bool):
    """Scaled dot-product attention without dropout, by `jax.nn.dot_product_attention`:
    cuDNN's fused (flash) kernel on a GPU where it applies (JAX's own default would pick
    XLA's unfused softmax even there), XLA otherwise, or if cuDNN refuses the shapes.

    **Arguments:**

    - `q`: `(*batch, q_seq, heads, head_dim)`.
    - `k`, `v`: `(*batch, kv_seq, kv_heads, head_dim)`; `kv_heads` may divide `heads`
      (grouped-query attention: query head `h` reads key/value head
      `h // (heads // kv_heads)`, as Hugging Face's `repeat_kv`).
    - `mask`: `None`, or broadcastable to `(*batch, heads, q_seq, kv_seq)` (True: attend).
    - `causal`: each query attends to keys at its own position and before, the last query
      aligned with the last key.

    **Returns:**

    `(*batch, q_seq, heads, head_dim)`.
    """
    lead, (q_seq, heads, dim), kv_seq = q.shape[:-3], q.shape[-3:], k.shape[-3]
    batch = math.prod(lead)
    q4, k4, v4 = (t.reshape(batch, *t.shape[-3:]) for t in (q, k, v))
    if causal and q_seq != kv_seq:  # the kernel aligns its causal mask top-left; ours ends bottom-right
        causal_mask = jnp.tril(jnp.ones((q_seq, kv_seq), bool), k=kv_seq - q_seq)
        mask = causal_mask if mask is None else mask & causal_mask
        causal = False
    if mask is not None:
        mask = jnp.broadcast_to(mask, (*lead, mask.shape[-3], q_seq, kv_seq))
        mask = mask.reshape(batch, mask.shape[-3], q_seq, kv_seq)
    scale = 1 / math.sqrt(dim)
    out = None
    if cudnn_applies(q4, k4, v4, mask):
        try:
            out = jax.nn.dot_product_attention(q4, k4, v4, scale=scale, is_causal=causal, implementation="cudnn")
        except (NotImplementedError, ValueError, RuntimeError):  # this cuDNN or layout: XLA's path below
            out = None
    if out is None:
        out = jax.nn.dot_product_attention(q4, k4, v4, mask=mask, scale=scale, is_causal=causal)
    return out.reshape(*lead, q_seq, heads, v.shape[-1])
