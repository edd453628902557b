"""The parity toolkit eqxpar's own tests use, public so users can test their parallel code.

- [`eqxpar.testing.mesh_sizes`][]: a hypothesis strategy for mesh shapes that fit the devices.
- [`eqxpar.testing.on_one_device`][]: run a function on a single device, the reference.
- [`eqxpar.testing.assert_trees_close`][]: compare two PyTrees leaf by leaf, naming the
  first leaf that differs and by how much.
- [`eqxpar.testing.check_parallel_parity`][]: the first thing to run on your own model:
  does its parallel form (loss, gradients, optimizer steps) equal the dense model on one
  device?
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax

from ._sharding import gather
from ._testing_parity import ParityReport, check_parallel_parity
from ._testing_trees import F32_ATOL, F32_RTOL, assert_trees_close

__all__ = [
    "mesh_sizes",
    "on_one_device",
    "assert_trees_close",
    "check_parallel_parity",
    "ParityReport",
    "F32_RTOL",
    "F32_ATOL",
]


def mesh_sizes(
    axis_names: Sequence[str] = ("data",),
    device_counts: Sequence[int] = (1, 2, 4, 8),
):
    """A hypothesis strategy drawing mesh shapes: dicts `{axis: size}` ready for `make_mesh`.

    Each draw picks a total device count from `device_counts` (only those not larger than
    `jax.device_count()`) and splits it over `axis_names` in every possible way (for two axes
    and 8 devices: 8x1, 4x2, 2x4, 1x8).

    **Arguments:**

    - `axis_names`: the mesh's axes, in order.
    - `device_counts`: the total device counts to draw from (powers of two keep compiles few).

    **Returns:**

    A `hypothesis.strategies.SearchStrategy[dict[str, int]]`.
    """
    from hypothesis import strategies as st

    have = jax.device_count()
    counts = [n for n in device_counts if n <= have]
    if not counts:
        raise ValueError(f"mesh_sizes: none of {device_counts} fit the {have} devices present.")

    def factorisations(n: int, k: int) -> list[tuple[int, ...]]:
        if k == 1:
            return [(n,)]
        return [(d, *rest) for d in range(1, n + 1) if n % d == 0 for rest in factorisations(n // d, k - 1)]

    shapes = sorted({s for n in counts for s in factorisations(n, len(axis_names))})
    return st.sampled_from(shapes).map(lambda s: dict(zip(axis_names, s)))


def on_one_device(
    fn: Callable[..., Any],
    *args: Any,
    device: jax.Device | None = None,  # pyright: ignore[reportInvalidTypeForm]  # jaxlib's Device, re-exported as a plain variable
) -> Any:
    """Run `fn(*args)` on a single device: the reference a parallel result is compared with.

    The array arguments are gathered (whatever their sharding) and placed on `device`
    before `fn` runs under `eqx.filter_jit`.

    **Arguments:**

    - `fn`: the function, written for one device (no collectives).
    - `*args`: its arguments, any PyTrees.
    - `device`: where to run. Default: `jax.devices()[0]`.

    **Returns:**

    `fn`'s output, with its arrays on `device`.
    """
    device = device or jax.devices()[0]
    local = jax.tree.map(lambda x: jax.device_put(x, device) if eqx.is_array(x) else x, gather(args))
    with jax.default_device(device):
        return eqx.filter_jit(fn)(*local)
