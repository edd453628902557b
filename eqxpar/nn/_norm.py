"""Layer norm and GELU with lean backward passes: each keeps for the backward pass only
what its gradient formula reads.

Autodiff of the plain formulas keeps every intermediate value: for a layer norm over
`(*batch, dim)`, four `(*batch, dim)` arrays and four of per-row statistics; for the
tanh-approximated GELU, four arrays the size of its input. Here a layer norm keeps its
normalised input and the inverse deviation, and GELU keeps its input; the backward pass
recomputes the rest (a few elementwise operations). The forward passes are the same
operations as before, so their results are bitwise the same.
"""

from __future__ import annotations

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .._promotion import at_least_float32, with_rank
from .._shard_map import varying_axes
from ._base import to_varying

__all__ = ["layer_norm", "gelu"]

_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)
_CUBIC = 0.044715


def layer_norm(norm: eqx.nn.LayerNorm, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
    """`norm` (an `eqx.nn.LayerNorm` over the last axis) applied to every position of `x`,
    with the arithmetic of `eqx.nn.LayerNorm`, over any leading dimensions.

    The backward pass keeps the normalised input and the inverse deviation of each row
    (`x.size + x.size / dim` values in float32), not the formula's intermediates.

    **Arguments:**

    - `norm`: the layer norm (its `shape` is `(dim,)`).
    - `x`: shape `(*batch, dim)`.

    **Returns:**

    The normalised `x`, same shape and dtype.

    **Raises:**

    - `ValueError` if `x`'s last dimension is not the norm's shape.
    """
    with jax.named_scope("LayerNorm"):
        if x.shape[-1:] != tuple(norm.shape):
            raise ValueError(f"layer_norm: the norm's shape is {norm.shape}, but x has shape {x.shape}.")
        dtype = at_least_float32(x.dtype)
        weight = _as(norm.weight, dtype) if norm.use_weight else None
        bias = _as(norm.bias, dtype) if norm.use_bias else None
        # Inside shard_map, parameters the same on every device meet an `x` that differs
        # (e.g. a sequence split over devices): mark them as differing too, so that their
        # gradients, computed from this device's rows, are summed over those devices.
        axes = varying_axes(x)
        weight, bias = (None if p is None else _varying_over(p, axes) for p in (weight, bias))
        out: Array = _normalize(x.astype(dtype), weight, bias, norm.eps)  # (custom_vjp: an object to pyright)
        return out.astype(x.dtype)


def _varying_over(p: Array, axes: frozenset) -> Array:
    return functools.reduce(to_varying, sorted(axes - varying_axes(p)), p)


def _as(x, dtype):
    return x if x.dtype == dtype else x.astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _normalize(x, weight, bias, eps):
    return _normalize_fwd(x, weight, bias, eps)[0]


def _normalize_fwd(x, weight, bias, eps):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    variance = jnp.maximum(0.0, jnp.var(x, axis=-1, keepdims=True))
    inverse = jax.lax.rsqrt(variance + eps)
    normalised = (x - mean) * inverse
    # weight and bias, shape (dim,), given x's rank explicitly (size-1 leading axes).
    out = normalised if weight is None else with_rank(weight, x.ndim) * normalised
    out = out if bias is None else out + with_rank(bias, x.ndim)
    return out, (normalised, inverse, weight, None if bias is None else ())


def _normalize_bwd(eps, residuals, d_out):
    normalised, inverse, weight, has_bias = residuals
    rows = tuple(range(d_out.ndim - 1))
    d_weight = None if weight is None else jnp.sum(d_out * normalised, axis=rows)
    d_bias = None if has_bias is None else jnp.sum(d_out, axis=rows)
    d_normalised = d_out if weight is None else d_out * with_rank(weight, d_out.ndim)
    d_x = inverse * (
        d_normalised
        - jnp.mean(d_normalised, axis=-1, keepdims=True)
        - normalised * jnp.mean(d_normalised * normalised, axis=-1, keepdims=True)
    )
    return d_x, d_weight, d_bias


_normalize.defvjp(_normalize_fwd, _normalize_bwd)


@jax.custom_vjp
def gelu(x: Array) -> Array:
    """The tanh-approximated GELU, `jax.nn.gelu(x)` (the same values), whose backward pass
    keeps only `x` and recomputes the `tanh`.

    **Arguments:**

    - `x`: any array of floats.

    **Returns:**

    `0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))`, the shape of `x`.
    """
    return jax.nn.gelu(x, approximate=True)


def _gelu_fwd(x):
    return jax.nn.gelu(x, approximate=True), x


def _gelu_bwd(x, d_out):
    inner = _SQRT_2_OVER_PI * (x + _CUBIC * x**3)
    t = jnp.tanh(inner)
    slope = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * _CUBIC * x * x)
    return (d_out * slope,)


gelu.defvjp(_gelu_fwd, _gelu_bwd)
