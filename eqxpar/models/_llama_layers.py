"""The Llama's parts: RMSNorm, rotary embeddings (with Llama 3's frequency scaling),
grouped-query attention and the SwiGLU MLP split over the model axis, and the block."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._shard_map import varying_axes
from ..nn import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelLayer,
    all_gather_attention,
    fused_attention,
    gather_sequence,
    ring_attention,
    segment_mask,
)
from ._llama_config import LlamaConfig, LlamaRopeScaling
from ._llama_rope import apply_rotary, rope_angles, rope_frequencies

__all__ = ["RMSNorm", "LlamaAttention", "LlamaMLP", "LlamaBlock", "rope_frequencies", "apply_rotary"]

# The Llama's attention choices: whole sequences on each device, or context parallelism
# (every sequence split over the `context` mesh axis in zigzag layout) by a ring of
# key/value blocks or one all-gather of them (eqxpar.nn.ring_attention / all_gather_attention).
LLAMA_ATTENTION_IMPLS = ("dot_product", "ring", "all_gather")
CONTEXT_IMPLS = ("ring", "all_gather")


def normal_linear(cls, in_features: int, out_features: int, std: float, axis_name: str, key: PRNGKeyArray):
    """A bias-free `cls` (column or row parallel) in global form, weights drawn from
    `normal(0, std)` as Hugging Face initialises Llama's linear layers."""
    layer = eqx.filter_eval_shape(cls, in_features, out_features, False, axis_name=axis_name, key=key)
    return eqx.tree_at(lambda l: l.weight, layer, std * jax.random.normal(key, (out_features, in_features)))


def _varying(x: Array, axis_name: str) -> Array:
    """`x` marked as varying over the model axis once, so the projections that read it share
    one backward all-reduce of its gradient (each column layer's own mark is then a no-op)."""
    return x if axis_name in varying_axes(x) else jax.lax.pcast(x, axis_name, to="varying")


class RMSNorm(eqx.Module):
    """Root-mean-square layer norm: `weight * x / sqrt(mean(x**2) + eps)` over the last
    axis, the statistics in float32 whatever `x`'s dtype (as Hugging Face's `LlamaRMSNorm`:
    normalise in float32, cast back, then scale)."""

    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, eps: float = 1e-5):
        """**Arguments:**

        - `dim`: the normalised (last) axis' size.
        - `eps`: added to the mean square.
        """
        self.weight = jnp.ones((dim,), jnp.float32)
        self.eps = eps

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        """**Arguments:**

        - `x`: shape `(*batch, dim)`.

        **Returns:**

        The normalised `x`, same shape and dtype.
        """
        with jax.named_scope("RMSNorm"):
            if x.shape[-1:] != self.weight.shape:
                raise ValueError(f"RMSNorm: the norm's shape is {self.weight.shape}, but x has shape {x.shape}.")
            x32 = x.astype(jnp.float32)
            mean_square = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
            normed = (x32 * jax.lax.rsqrt(mean_square + jnp.float32(self.eps))).astype(x.dtype)
            # An explicit reshape, not a broadcast: inside shard_map the replicated weight's
            # varying-axes cast then applies at its own size (as eqxpar's layer norms do).
            return normed * self.weight.astype(x.dtype).reshape((1,) * (x.ndim - 1) + self.weight.shape)


class LlamaAttention(TensorParallelLayer):
    """Causal grouped-query self-attention with rotary embeddings, its heads split over
    the model axis.

    `q_proj` (`num_heads * head_dim` outputs), `k_proj` and `v_proj` (`num_kv_heads *
    head_dim` each) are [`eqxpar.nn.ColumnParallelLinear`][]s and `o_proj` a
    [`eqxpar.nn.RowParallelLinear`][], all without bias. With `N` devices on the model
    axis each device holds `num_heads / N` query heads and the `num_kv_heads / N`
    key/value heads they read: query head `h` reads key/value head `h // (num_heads /
    num_kv_heads)` (Hugging Face's `repeat_kv` order), and a device's query heads read
    exactly its own key/value heads. So `N` must divide `num_kv_heads` (and `num_heads`).
    One all-reduce forward (in `o_proj`) and one backward (the input's gradient, shared by
    the three projections).

    With `sequence_parallel=True` its input and output are this device's block of the
    sequence: one all-gather over the model axis on the way in, a reduce-scatter in
    `o_proj` on the way out (in place of the all-reduces). With `attention_impl="ring"` or
    `"all_gather"` every sequence is split over `context_axis` in zigzag layout
    ([`eqxpar.nn.ring_attention`][], [`eqxpar.nn.all_gather_attention`][]): the rotary
    angles must then be those of the tokens' global positions (the
    [`eqxpar.models.Llama`][] passes them), and each device's key/value heads are repeated
    to its query heads before they travel (`num_heads / num_kv_heads` times the bytes of
    grouped keys and values on the context axis).
    """

    q_proj: ColumnParallelLinear
    k_proj: ColumnParallelLinear
    v_proj: ColumnParallelLinear
    o_proj: RowParallelLinear
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)
    rope_theta: float = eqx.field(static=True)
    rope_scaling: LlamaRopeScaling | None = eqx.field(static=True)
    sequence_parallel: bool = eqx.field(static=True)
    attention_impl: str = eqx.field(static=True)
    context_axis: str = eqx.field(static=True)

    def __init__(
        self,
        config: LlamaConfig,
        *,
        init_std: float = 0.02,
        sequence_parallel: bool = False,
        attention_impl: str = "dot_product",
        context_axis: str = "context",
        axis_name: str = "model",
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `config`: the model's [`eqxpar.models.LlamaConfig`][].
        - `init_std`: the weights' standard deviation (normal, mean 0).
        - `sequence_parallel`: the input and output are split along the sequence over the
          model axis (see above).
        - `attention_impl`: `"dot_product"` (whole sequences), or `"ring"` / `"all_gather"`
          for context parallelism over `context_axis`.
        - `context_axis`: the mesh axis the sequences are split over (context parallelism).
        - `axis_name`: the model axis.
        - `key`: the initialisation key.

        **Raises:**

        - `ValueError` for an unknown `attention_impl`.
        """
        if attention_impl not in LLAMA_ATTENTION_IMPLS:
            raise ValueError(
                f"LlamaAttention: attention_impl must be one of {LLAMA_ATTENTION_IMPLS}, got {attention_impl!r}."
            )
        q_key, k_key, v_key, o_key = jax.random.split(key, 4)
        dim, heads, kv, channels = config.dim, config.num_heads, config.kv_heads, config.channels
        self.q_proj = normal_linear(ColumnParallelLinear, dim, heads * channels, init_std, axis_name, q_key)
        self.k_proj = normal_linear(ColumnParallelLinear, dim, kv * channels, init_std, axis_name, k_key)
        self.v_proj = normal_linear(ColumnParallelLinear, dim, kv * channels, init_std, axis_name, v_key)
        self.o_proj = normal_linear(RowParallelLinear, heads * channels, dim, init_std, axis_name, o_key)
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv, channels
        self.rope_theta, self.rope_scaling = config.rope_theta, config.scaling
        self.axis_name = axis_name
        self.sequence_parallel = bool(sequence_parallel)
        self.attention_impl = attention_impl
        self.context_axis = context_axis

    def rotary_angles(self, positions: Array, dtype) -> tuple[Array, Array]:
        """The rotary `cos`, `sin` (`(seq, head_dim)`) of the tokens at global `positions`
        (`(seq,)` integers), as `__call__` takes them."""
        return rope_angles(positions, rope_frequencies(self.head_dim, self.rope_theta, self.rope_scaling), dtype)

    def check_axis_size(self, size: int, where: str = "") -> None:
        """`ValueError` unless `size` divides both `num_kv_heads` and `num_heads`."""
        if self.num_kv_heads % size or self.num_heads % size:
            divisors = [n for n in range(1, self.num_kv_heads + 1) if self.num_kv_heads % n == 0]
            raise ValueError(
                f"{self._name(where)}: the model axis {self.axis_name!r} has {size} devices, which do not divide "
                f"num_kv_heads={self.num_kv_heads} (num_heads={self.num_heads}): every device needs whole key/value "
                f"heads and the query heads that read them. Use a model axis size that divides num_kv_heads "
                f"(one of {divisors}; put the other devices on a data or fsdp axis), or a config with "
                f"num_kv_heads (and num_heads) a multiple of {size}."
            )
        TensorParallelLayer.check_axis_size(self, size, where)

    def __call__(
        self,
        x: Float[Array, "*batch seq dim"],
        cos: Array,
        sin: Array,
        *,
        segment_ids: Int[Array, "*batch seq"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "*batch seq dim"]:
        """Attention on one device (inside `shard_map`).

        **Arguments:**

        - `x`: the normalised residual stream, `(*batch, seq, dim)`, the same on every
          device of the model axis (with `sequence_parallel`, this device's block of it).
        - `cos`, `sin`: the rotary angles of the positions attention sees, `(seq, head_dim)`
          (with `sequence_parallel`: of the whole gathered sequence; under context
          parallelism: of this device's tokens' global positions); or per example,
          `(*batch, seq, head_dim)` (packed documents' positions).
        - `segment_ids`: packed documents: `(*batch, seq)` document ids of the tokens
          attention sees (whole sequences on every device of the model axis; under context
          parallelism this device's block), so that a token attends only within its
          document; `None`: one document per sequence.
        - `key`: ignored (no dropout).

        **Returns:**

        The shape of `x`, the same on every device (with `sequence_parallel`, this
        device's block of the sequence).
        """
        del key
        with jax.named_scope(type(self).__name__):
            size = self._model_axis_size()
            heads, kv_heads = self.num_heads // size, self.num_kv_heads // size
            if self.sequence_parallel:  # Megatron SP: gather the sequence once for q, k and v
                x = gather_sequence(x, self.axis_name, -2)
            lead, seq = x.shape[:-2], x.shape[-2]
            x = _varying(x, self.axis_name)
            q = self.q_proj(x).reshape(*lead, seq, heads, self.head_dim)
            k = self.k_proj(x).reshape(*lead, seq, kv_heads, self.head_dim)
            v = self.v_proj(x).reshape(*lead, seq, kv_heads, self.head_dim)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            if self.attention_impl in CONTEXT_IMPLS:
                # Hugging Face's repeat_kv order (query head h reads key/value head h //
                # group), then attention over the sequence split across the context axis.
                group = heads // kv_heads
                k, v = jnp.repeat(k, group, axis=-2), jnp.repeat(v, group, axis=-2)
                attend = ring_attention if self.attention_impl == "ring" else all_gather_attention
                out = attend(
                    q, k, v, axis_name=self.context_axis, causal=True, layout="zigzag", segment_ids=segment_ids
                )
            else:
                # Grouped-query attention: query head h reads key/value head h // (heads /
                # kv_heads), as Hugging Face's repeat_kv (cuDNN's fused kernel on a GPU).
                out = fused_attention(q, k, v, segment_mask(segment_ids), causal=True)
            # Row-parallel output projection: this device's heads' partial products, one psum
            # (a reduce-scatter back to this device's block of the sequence with SP).
            sequence_dim = -2 if self.sequence_parallel else None
            return self.o_proj(out.reshape(*lead, seq, heads * self.head_dim), sequence_dim=sequence_dim)


class LlamaMLP(TensorParallelLayer):
    """The SwiGLU MLP, `down_proj(silu(gate_proj(x)) * up_proj(x))`, its hidden units
    split over the model axis: `gate_proj` and `up_proj` are
    [`eqxpar.nn.ColumnParallelLinear`][]s, `down_proj` a
    [`eqxpar.nn.RowParallelLinear`][] (all without bias). One all-reduce forward (in
    `down_proj`) and one backward (the input's gradient, shared by `gate_proj` and
    `up_proj`); with `sequence_parallel=True` an all-gather of the input (once, for both
    column layers) and a reduce-scatter in `down_proj` instead."""

    gate_proj: ColumnParallelLinear
    up_proj: ColumnParallelLinear
    down_proj: RowParallelLinear
    axis_name: str = eqx.field(static=True)
    sequence_parallel: bool = eqx.field(static=True)

    def __init__(
        self,
        config: LlamaConfig,
        *,
        init_std: float = 0.02,
        sequence_parallel: bool = False,
        axis_name: str = "model",
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `config`: the model's [`eqxpar.models.LlamaConfig`][] (`dim`, `hidden_dim`).
        - `init_std`: the weights' standard deviation (normal, mean 0).
        - `sequence_parallel`: the input and output are this device's block of the
          sequence (dimension -2) over the model axis.
        - `axis_name`: the model axis.
        - `key`: the initialisation key.
        """
        gate_key, up_key, down_key = jax.random.split(key, 3)
        dim, hidden = config.dim, config.hidden_dim
        self.gate_proj = normal_linear(ColumnParallelLinear, dim, hidden, init_std, axis_name, gate_key)
        self.up_proj = normal_linear(ColumnParallelLinear, dim, hidden, init_std, axis_name, up_key)
        self.down_proj = normal_linear(RowParallelLinear, hidden, dim, init_std, axis_name, down_key)
        self.axis_name = axis_name
        self.sequence_parallel = bool(sequence_parallel)

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        """**Arguments:**

        - `x`: `(*batch, dim)`, the same on every device of the model axis (with
          `sequence_parallel`, `(*batch, seq / N, dim)`: this device's block).

        **Returns:**

        The shape of `x`, the same on every device (with `sequence_parallel`, this
        device's block).
        """
        with jax.named_scope(type(self).__name__):
            sequence_dim = -2 if self.sequence_parallel else None
            if sequence_dim is not None:
                x = gather_sequence(x, self.axis_name, sequence_dim)
            x = _varying(x, self.axis_name)
            h = jax.nn.silu(self.gate_proj(x)) * self.up_proj(x)
            return self.down_proj(h, sequence_dim=sequence_dim)


class LlamaBlock(eqx.Module):
    """A pre-norm Llama block: `h = x + self_attn(input_layernorm(x))`, then
    `h + mlp(post_attention_layernorm(h))` (Hugging Face's `LlamaDecoderLayer` names).
    With `sequence_parallel=True` the residual stream and both norms work on this
    device's block of the sequence (Megatron sequence parallelism)."""

    input_layernorm: RMSNorm
    self_attn: LlamaAttention
    post_attention_layernorm: RMSNorm
    mlp: LlamaMLP

    def __init__(
        self,
        config: LlamaConfig,
        *,
        init_std: float = 0.02,
        sequence_parallel: bool = False,
        attention_impl: str = "dot_product",
        axis_name: str = "model",
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `config`: the model's [`eqxpar.models.LlamaConfig`][].
        - `init_std`: the linear layers' standard deviation.
        - `sequence_parallel`, `attention_impl`: as in [`eqxpar.models.LlamaAttention`][]
          (the MLP takes `sequence_parallel` too).
        - `axis_name`: the model axis.
        - `key`: the initialisation key (the same weights whatever the other options).
        """
        attention_key, mlp_key = jax.random.split(key)
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.self_attn = LlamaAttention(
            config,
            init_std=init_std,
            sequence_parallel=sequence_parallel,
            attention_impl=attention_impl,
            axis_name=axis_name,
            key=attention_key,
        )
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = LlamaMLP(
            config, init_std=init_std, sequence_parallel=sequence_parallel, axis_name=axis_name, key=mlp_key
        )

    def __call__(
        self,
        x: Float[Array, "*batch seq dim"],
        *,
        cos: Array,
        sin: Array,
        segment_ids: Int[Array, "*batch seq"] | None = None,
        key: PRNGKeyArray | None = None,
        name: str | None = None,
    ) -> Float[Array, "*batch seq dim"]:
        """Apply the block on one device (inside `shard_map`).

        **Arguments:**

        - `x`: the residual stream, `(*batch, seq, dim)`, the same on every device of the
          model axis (with `sequence_parallel`, this device's block of the sequence).
        - `cos`, `sin`: the rotary angles of the positions attention sees, `(seq,
          head_dim)` or per example `(*batch, seq, head_dim)` (see
          [`eqxpar.models.LlamaAttention`][]).
        - `segment_ids`: packed documents: `(*batch, seq)` document ids of the tokens
          attention sees (whole sequences on every device of the model axis; under context
          parallelism this device's block), so that a token attends only within its
          document; `None`: one document per sequence.
        - `key`: ignored (no dropout).
        - `name`: the `jax.named_scope` (default `"LlamaBlock"`).

        **Returns:**

        The new residual stream, the shape of `x`.
        """
        del key
        with jax.named_scope(name or "LlamaBlock"):
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, segment_ids=segment_ids)
            return x + self.mlp(self.post_attention_layernorm(x))
