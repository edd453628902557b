"""The Llama's parts: RMSNorm, rotary embeddings (with Llama 3's frequency scaling),
grouped-query attention and the SwiGLU MLP split over the model axis, and the block."""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from .._shard_map import varying_axes
from ..nn import ColumnParallelLinear, RowParallelLinear, TensorParallelLayer, fused_attention
from ._llama_config import LlamaConfig, LlamaRopeScaling

__all__ = ["RMSNorm", "LlamaAttention", "LlamaMLP", "LlamaBlock", "rope_frequencies", "apply_rotary"]


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


def rope_frequencies(head_dim: int, theta: float, scaling: LlamaRopeScaling | None = None) -> np.ndarray:
    """The rotary embedding's `head_dim / 2` angular frequencies `theta**(-2i / head_dim)`,
    with Llama 3's scaling applied if given (float32, computed as Hugging Face does).

    **Arguments:**

    - `head_dim`: channels per head (even).
    - `theta`: the base (`rope_theta`).
    - `scaling`: a [`eqxpar.models.LlamaRopeScaling`][] or `None`.

    **Returns:**

    A NumPy float32 array of shape `(head_dim / 2,)`.
    """
    exponents = np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / np.power(np.float32(theta), exponents)
    if scaling is None:
        return inv_freq
    factor = np.float32(scaling.factor)
    low, high = np.float32(scaling.low_freq_factor), np.float32(scaling.high_freq_factor)
    old_context = np.float32(scaling.original_max_position_embeddings)
    wavelength = np.float32(2 * math.pi) / inv_freq
    low_freq_wavelength, high_freq_wavelength = old_context / low, old_context / high
    # Long wavelengths (low frequencies) slowed down by `factor`; short ones kept.
    scaled = np.where(wavelength > low_freq_wavelength, inv_freq / factor, inv_freq)
    # In between: interpolated from one to the other by where the wavelength lies.
    smooth = (old_context / wavelength - low) / (high - low)
    smoothed = (np.float32(1) - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_angles(seq: int, inv_freq: np.ndarray, dtype) -> tuple[Array, Array]:
    """The cosines and sines of positions `0 .. seq-1` times every frequency, each
    frequency's column written twice (`(seq, head_dim)`: Hugging Face's half-rotation
    layout), computed in float32 and cast to `dtype`."""
    positions = jnp.arange(seq, dtype=jnp.float32)
    angles = positions[:, None] * jnp.asarray(inv_freq)[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rotary(x: Float[Array, "*batch seq heads head_dim"], cos: Array, sin: Array) -> Array:
    """Rotary embeddings in Hugging Face Llama's convention: channel `i` of the first half
    rotates with channel `i` of the second half (`x * cos + rotate_half(x) * sin`), so
    Hugging Face's `q_proj`/`k_proj` weights load without permuting their rows.

    **Arguments:**

    - `x`: queries or keys, `(*batch, seq, heads, head_dim)`.
    - `cos`, `sin`: `(seq, head_dim)`, from the positions (see `rope_angles`).

    **Returns:**

    The rotated `x`, same shape.
    """
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    shape = (1,) * (x.ndim - 3) + (cos.shape[0], 1, cos.shape[1])
    return x * cos.reshape(shape) + rotated * sin.reshape(shape)


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
    """

    q_proj: ColumnParallelLinear
    k_proj: ColumnParallelLinear
    v_proj: ColumnParallelLinear
    o_proj: RowParallelLinear
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)

    def __init__(self, config: LlamaConfig, *, init_std: float = 0.02, axis_name: str = "model", key: PRNGKeyArray):
        """**Arguments:**

        - `config`: the model's [`eqxpar.models.LlamaConfig`][].
        - `init_std`: the weights' standard deviation (normal, mean 0).
        - `axis_name`: the model axis.
        - `key`: the initialisation key.
        """
        q_key, k_key, v_key, o_key = jax.random.split(key, 4)
        dim, heads, kv, channels = config.dim, config.num_heads, config.kv_heads, config.channels
        self.q_proj = normal_linear(ColumnParallelLinear, dim, heads * channels, init_std, axis_name, q_key)
        self.k_proj = normal_linear(ColumnParallelLinear, dim, kv * channels, init_std, axis_name, k_key)
        self.v_proj = normal_linear(ColumnParallelLinear, dim, kv * channels, init_std, axis_name, v_key)
        self.o_proj = normal_linear(RowParallelLinear, heads * channels, dim, init_std, axis_name, o_key)
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv, channels
        self.axis_name = axis_name

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
        self, x: Float[Array, "*batch seq dim"], cos: Array, sin: Array, *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "*batch seq dim"]:
        """Attention on one device (inside `shard_map`).

        **Arguments:**

        - `x`: the normalised residual stream, `(*batch, seq, dim)`, the same on every
          device of the model axis.
        - `cos`, `sin`: the rotary angles, `(seq, head_dim)`.
        - `key`: ignored (no dropout).

        **Returns:**

        Shape `(*batch, seq, dim)`, the same on every device.
        """
        del key
        with jax.named_scope(type(self).__name__):
            size = self._model_axis_size()
            heads, kv_heads = self.num_heads // size, self.num_kv_heads // size
            lead, seq = x.shape[:-2], x.shape[-2]
            x = _varying(x, self.axis_name)
            q = self.q_proj(x).reshape(*lead, seq, heads, self.head_dim)
            k = self.k_proj(x).reshape(*lead, seq, kv_heads, self.head_dim)
            v = self.v_proj(x).reshape(*lead, seq, kv_heads, self.head_dim)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            # Grouped-query attention: query head h reads key/value head h // (heads /
            # kv_heads), as Hugging Face's repeat_kv (cuDNN's fused kernel on a GPU).
            out = fused_attention(q, k, v, causal=True)
            # Row-parallel output projection: this device's heads' partial products, one psum.
            return self.o_proj(out.reshape(*lead, seq, heads * self.head_dim))


class LlamaMLP(TensorParallelLayer):
    """The SwiGLU MLP, `down_proj(silu(gate_proj(x)) * up_proj(x))`, its hidden units
    split over the model axis: `gate_proj` and `up_proj` are
    [`eqxpar.nn.ColumnParallelLinear`][]s, `down_proj` a
    [`eqxpar.nn.RowParallelLinear`][] (all without bias). One all-reduce forward (in
    `down_proj`) and one backward (the input's gradient, shared by `gate_proj` and
    `up_proj`)."""

    gate_proj: ColumnParallelLinear
    up_proj: ColumnParallelLinear
    down_proj: RowParallelLinear
    axis_name: str = eqx.field(static=True)

    def __init__(self, config: LlamaConfig, *, init_std: float = 0.02, axis_name: str = "model", key: PRNGKeyArray):
        """**Arguments:**

        - `config`: the model's [`eqxpar.models.LlamaConfig`][] (`dim`, `hidden_dim`).
        - `init_std`: the weights' standard deviation (normal, mean 0).
        - `axis_name`: the model axis.
        - `key`: the initialisation key.
        """
        gate_key, up_key, down_key = jax.random.split(key, 3)
        dim, hidden = config.dim, config.hidden_dim
        self.gate_proj = normal_linear(ColumnParallelLinear, dim, hidden, init_std, axis_name, gate_key)
        self.up_proj = normal_linear(ColumnParallelLinear, dim, hidden, init_std, axis_name, up_key)
        self.down_proj = normal_linear(RowParallelLinear, hidden, dim, init_std, axis_name, down_key)
        self.axis_name = axis_name

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        """**Arguments:**

        - `x`: `(*batch, dim)`, the same on every device of the model axis.

        **Returns:**

        `(*batch, dim)`, the same on every device.
        """
        with jax.named_scope(type(self).__name__):
            x = _varying(x, self.axis_name)
            return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(eqx.Module):
    """A pre-norm Llama block: `h = x + self_attn(input_layernorm(x))`, then
    `h + mlp(post_attention_layernorm(h))` (Hugging Face's `LlamaDecoderLayer` names)."""

    input_layernorm: RMSNorm
    self_attn: LlamaAttention
    post_attention_layernorm: RMSNorm
    mlp: LlamaMLP

    def __init__(self, config: LlamaConfig, *, init_std: float = 0.02, axis_name: str = "model", key: PRNGKeyArray):
        """**Arguments:**

        - `config`: the model's [`eqxpar.models.LlamaConfig`][].
        - `init_std`: the linear layers' standard deviation.
        - `axis_name`: the model axis.
        - `key`: the initialisation key.
        """
        attention_key, mlp_key = jax.random.split(key)
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.self_attn = LlamaAttention(config, init_std=init_std, axis_name=axis_name, key=attention_key)
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = LlamaMLP(config, init_std=init_std, axis_name=axis_name, key=mlp_key)

    def __call__(
        self,
        x: Float[Array, "*batch seq dim"],
        *,
        cos: Array,
        sin: Array,
        key: PRNGKeyArray | None = None,
        name: str | None = None,
    ) -> Float[Array, "*batch seq dim"]:
        """Apply the block on one device (inside `shard_map`).

        **Arguments:**

        - `x`: the residual stream, `(*batch, seq, dim)`, the same on every device of the
          model axis.
        - `cos`, `sin`: the rotary angles, `(seq, head_dim)`.
        - `key`: ignored (no dropout).
        - `name`: the `jax.named_scope` (default `"LlamaBlock"`).

        **Returns:**

        The new residual stream, the shape of `x`.
        """
        del key
        with jax.named_scope(name or "LlamaBlock"):
            x = x + self.self_attn(self.input_layernorm(x), cos, sin)
            return x + self.mlp(self.post_attention_layernorm(x))
