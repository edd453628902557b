"""Layers written in plain Equinox as users and other libraries write them, shared by the
`parallelize` tests (issue 20): an RMSNorm of its own, rotary embeddings, attention with
separate q/k/v/o Linears and grouped key/value heads, a SwiGLU MLP, and attention with one
fused q/k/v Linear together with the parallel form its user registers for it."""

from __future__ import annotations

import contextlib
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqxpar.nn
from eqxpar.nn import ColumnParallelLinear, RowParallelLinear, TensorParallelLayer

VOCAB, DIM, HEADS, HEAD_DIM, HIDDEN, SEQ = 32, 32, 4, 8, 48, 8


def rope(x):
    """Rotary embedding, half-rotation form, on `(seq, heads, head_dim)`."""
    seq, _, dim = x.shape
    freq = 1.0 / (10000.0 ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    angle = np.arange(seq, dtype=np.float32)[:, None] * freq[None, :]  # (seq, dim/2)
    cos, sin = jnp.asarray(np.cos(angle))[:, None, :], jnp.asarray(np.sin(angle))[:, None, :]
    a, b = x[..., : dim // 2], x[..., dim // 2 :]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


class RMSNorm(eqx.Module):
    weight: jax.Array

    def __init__(self, dim):
        self.weight = jnp.ones((dim,), jnp.float32)

    def __call__(self, x):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * self.weight


class Attention(eqx.Module):
    """Causal attention with RoPE, separate q/k/v/o Linears and `kv_heads` key/value heads,
    each repeated for its group of query heads."""

    q: eqx.nn.Linear
    k: eqx.nn.Linear
    v: eqx.nn.Linear
    o: eqx.nn.Linear
    heads: int = eqx.field(static=True)
    kv_heads: int = eqx.field(static=True)

    def __init__(self, kv_heads, *, key):
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.q = eqx.nn.Linear(DIM, HEADS * HEAD_DIM, use_bias=False, key=kq)
        self.k = eqx.nn.Linear(DIM, kv_heads * HEAD_DIM, use_bias=False, key=kk)
        self.v = eqx.nn.Linear(DIM, kv_heads * HEAD_DIM, use_bias=False, key=kv)
        self.o = eqx.nn.Linear(HEADS * HEAD_DIM, DIM, use_bias=False, key=ko)
        self.heads, self.kv_heads = HEADS, kv_heads

    def __call__(self, x):
        seq = x.shape[0]
        # Heads by -1: under tensor parallelism each device holds heads / model of them.
        q = rope(jax.vmap(self.q)(x).reshape(seq, -1, HEAD_DIM))
        k = rope(jax.vmap(self.k)(x).reshape(seq, -1, HEAD_DIM))
        v = jax.vmap(self.v)(x).reshape(seq, -1, HEAD_DIM)
        group = self.heads // self.kv_heads
        k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
        logits = jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(HEAD_DIM)
        causal = jnp.tril(jnp.ones((seq, seq), bool))[None]
        weights = jax.nn.softmax(jnp.where(causal, logits, -1e30), axis=-1)
        out = jnp.einsum("hqk,khd->qhd", weights, v).reshape(seq, -1)
        return jax.vmap(self.o)(out)


class SwiGLU(eqx.Module):
    gate: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, *, key):
        kg, ku, kd = jax.random.split(key, 3)
        self.gate = eqx.nn.Linear(DIM, HIDDEN, use_bias=False, key=kg)
        self.up = eqx.nn.Linear(DIM, HIDDEN, use_bias=False, key=ku)
        self.down = eqx.nn.Linear(HIDDEN, DIM, use_bias=False, key=kd)

    def __call__(self, x):
        return jax.vmap(self.down)(jax.nn.silu(jax.vmap(self.gate)(x)) * jax.vmap(self.up)(x))


class FusedAttention(eqx.Module):
    """Causal attention with one fused q/k/v Linear (another library's layer)."""

    qkv: eqx.nn.Linear
    out: eqx.nn.Linear
    num_heads: int = eqx.field(static=True)

    def __init__(self, *, key):
        k1, k2 = jax.random.split(key)
        self.qkv = eqx.nn.Linear(DIM, 3 * DIM, key=k1)
        self.out = eqx.nn.Linear(DIM, DIM, key=k2)
        self.num_heads = HEADS

    def __call__(self, x):
        q, k, v = jnp.split(jax.vmap(self.qkv)(x), 3, axis=-1)
        return jax.vmap(self.out)(attend(q, k, v))


def attend(q, k, v):
    """Causal attention over however many heads of HEAD_DIM the projections hold."""
    seq = q.shape[0]
    q, k, v = (t.reshape(seq, -1, HEAD_DIM) for t in (q, k, v))
    logits = jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(HEAD_DIM)
    logits = jnp.where(jnp.tril(jnp.ones((seq, seq), bool))[None], logits, -1e30)
    return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(logits, axis=-1), v).reshape(seq, -1)


def _linear(weight, bias):
    template = eqx.filter_eval_shape(eqx.nn.Linear, weight.shape[1], weight.shape[0], key=jax.random.key(0))
    return eqx.tree_at(lambda l: (l.weight, l.bias), template, (weight, bias))


class ParallelFusedAttention(TensorParallelLayer):
    """Its parallel form, written by the layer's user: q, k and v each split by heads."""

    q: ColumnParallelLinear
    k: ColumnParallelLinear
    v: ColumnParallelLinear
    out: RowParallelLinear
    num_heads: int = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)

    def __init__(self, dense: FusedAttention, axis_name: str):
        weights, biases = jnp.split(dense.qkv.weight, 3), jnp.split(dense.qkv.bias, 3)
        q, k, v = (ColumnParallelLinear.from_dense(_linear(w, b), axis_name=axis_name) for w, b in zip(weights, biases))
        self.q, self.k, self.v = q, k, v
        self.out = RowParallelLinear.from_dense(dense.out, axis_name=axis_name)
        self.num_heads, self.axis_name = dense.num_heads, axis_name

    def to_dense(self):
        dense = eqx.filter_eval_shape(FusedAttention, key=jax.random.key(0))
        qkv = [self.q.to_dense(), self.k.to_dense(), self.v.to_dense()]
        weight = jnp.concatenate([layer.weight for layer in qkv])
        bias = jnp.concatenate([layer.bias for layer in qkv])
        dense = eqx.tree_at(lambda d: (d.qkv.weight, d.qkv.bias), dense, (weight, bias))
        return eqx.tree_at(lambda d: (d.out.weight, d.out.bias), dense, (self.out.weight, self.out.bias))

    def check_axis_size(self, size, where=""):
        if self.num_heads % size:
            raise self._split_error(where, "num_heads", self.num_heads, size)

    def __call__(self, x):
        # This device's heads end to end; the row layer's psum adds the heads' outputs.
        return self.out(attend(self.q(x), self.k(x), self.v(x)))


@contextlib.contextmanager
def fused_attention_registered():
    """`FusedAttention` registered as the style "fused_attention" (split by `num_heads`) for
    the `with` block, unregistered after it."""
    eqxpar.nn.register_style("fused_attention", FusedAttention, ParallelFusedAttention, split="num_heads")
    try:
        yield
    finally:
        eqxpar.nn.unregister_style("fused_attention")
