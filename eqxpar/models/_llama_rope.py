"""The Llama's rotary embeddings: the frequencies (with Llama 3's scaling), the angles of
each token's global position, and the rotation in Hugging Face's half-rotation layout."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from ._llama_config import LlamaRopeScaling

__all__ = ["rope_frequencies", "rope_angles", "apply_rotary"]


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


def rope_angles(positions: Array, inv_freq: np.ndarray, dtype) -> tuple[Array, Array]:
    """The cosines and sines of each token's global `positions` (`(seq,)` integers: `0 ..
    seq-1` for a whole sequence, the true positions of a device's tokens under context
    parallelism) times every frequency, each frequency's column written twice (`(seq,
    head_dim)`: Hugging Face's half-rotation layout), computed in float32 and cast to
    `dtype`."""
    positions = jnp.asarray(positions).astype(jnp.float32)
    angles = positions[..., None] * jnp.asarray(inv_freq).reshape((1,) * positions.ndim + (-1,))
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rotary(x: Float[Array, "*batch seq heads head_dim"], cos: Array, sin: Array) -> Array:
    """Rotary embeddings in Hugging Face Llama's convention: channel `i` of the first half
    rotates with channel `i` of the second half (`x * cos + rotate_half(x) * sin`), so
    Hugging Face's `q_proj`/`k_proj` weights load without permuting their rows.

    **Arguments:**

    - `x`: queries or keys, `(*batch, seq, heads, head_dim)`.
    - `cos`, `sin`: `(seq, head_dim)`, or per example `(*batch, seq, head_dim)` (packed
      documents' positions), from the positions (see `rope_angles`).

    **Returns:**

    The rotated `x`, same shape.
    """
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    shape = (1,) * (x.ndim - cos.ndim - 1) + cos.shape[:-1] + (1, cos.shape[-1])  # over the heads
    return x * cos.reshape(shape) + rotated * sin.reshape(shape)
