"""Dtype helpers that work under `jax_numpy_dtype_promotion="strict"` (the tests' setting)."""

import jax.numpy as jnp


def at_least_float32(dtype) -> jnp.dtype:
    """`dtype` if it is a float of 32 bits or more, else float32: what
    `jnp.promote_types(dtype, jnp.float32)` gives for floats, written so that it needs no
    implicit promotion (strict promotion has no path from bfloat16 or float16 to float32).
    """
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits >= 32:
        return dtype
    return jnp.dtype(jnp.float32)
