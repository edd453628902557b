"""Helpers that make a promotion explicit, so that eqxpar runs under
`jax_numpy_dtype_promotion="strict"` and `jax_numpy_rank_promotion="raise"` (the tests'
settings) as under JAX's defaults."""

import jax.numpy as jnp
from jaxtyping import Array


def at_least_float32(dtype) -> jnp.dtype:
    """`dtype` if it is a float of 32 bits or more, else float32: what
    `jnp.promote_types(dtype, jnp.float32)` gives for floats, written so that it needs no
    implicit promotion (strict promotion has no path from bfloat16 or float16 to float32).
    """
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits >= 32:
        return dtype
    return jnp.dtype(jnp.float32)


def with_rank(p: Array, ndim: int) -> Array:
    """`p` (e.g. a bias of shape `(dim,)`) with leading size-1 axes up to rank `ndim`, to add
    to or multiply an `(..., dim)` array: the broadcast NumPy would do, made explicit.

    A reshape, not `jnp.broadcast_to(p, shape)`: inside `shard_map` the varying-axes cast
    JAX inserts for a replicated parameter then applies to `p`'s own size, so its gradient is
    summed over devices at that size, not at the size of the activations.
    """
    return p.reshape((1,) * (ndim - p.ndim) + p.shape)
