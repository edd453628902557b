"""Mixed precision: in which dtype a step computes the loss and reduces the gradients."""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Precision:
    """A step's mixed-precision policy; pass it as `precision=` to any step builder.

    The model keeps its parameters (and the optimizer its state) in their own dtype, e.g.
    float32 master weights; the policy says what the step does with them:

    - `compute_dtype`: the dtype the loss sees the floating-point parameters and the
      batch's floating-point arrays in (e.g. `jnp.bfloat16`: matmuls in bfloat16). The
      gradient comes back in the parameters' dtype.
    - `reduce_dtype`: the dtype gradients cross devices in: the `psum` of the copies'
      gradients and, under FSDP, the all-gather of the parameters and the reduce-scatter
      of their gradients (so `jnp.bfloat16` halves those bytes). Default: the parameters'
      dtype, so sums over many devices lose nothing.

    `None` (the default for both) means "the parameters' own dtype": `Precision()` changes
    nothing, and a step built without `precision=` is exactly a float32 step for a float32
    model. The loss a step reports is always float32; keep the loss's own reductions (the
    softmax's max and sum) in float32 inside `loss_fn` (eqxpar's cross-entropy does).

    ```python
    step = eqxpar.train.hybrid_step(
        loss_fn, optimizer, mesh, precision=eqxpar.train.Precision(compute_dtype=jnp.bfloat16)
    )
    ```
    """

    compute_dtype: Any = None
    reduce_dtype: Any = None

    def __post_init__(self):
        for name in ("compute_dtype", "reduce_dtype"):
            dtype = getattr(self, name)
            if dtype is None:
                continue
            try:
                floating = jnp.issubdtype(np.dtype(dtype), jnp.floating)
            except TypeError:
                floating = False
            if not floating:
                raise ValueError(
                    f"Precision: {name} must be a floating-point dtype such as jnp.bfloat16 or "
                    f"jnp.float32 (or None for the parameters' own dtype), got {dtype!r}."
                )
            object.__setattr__(self, name, np.dtype(dtype))

    @property
    def is_identity(self) -> bool:
        return self.compute_dtype is None and self.reduce_dtype is None

    def for_compute(self, x: Any) -> Any:
        """`x` as the loss sees it (floating-point arrays only are cast)."""
        if self.compute_dtype is None or not eqx.is_inexact_array(x) or x.dtype == self.compute_dtype:
            return x
        return x.astype(self.compute_dtype)

    def for_reduction(self, x: Any) -> Any:
        """`x` as it crosses devices."""
        if self.reduce_dtype is None or not eqx.is_inexact_array(x) or x.dtype == self.reduce_dtype:
            return x
        return x.astype(self.reduce_dtype)
