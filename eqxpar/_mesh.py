"""Meshes: named device grids, and simulated CPU devices for running without accelerators."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Literal

import jax
from jax.sharding import AxisType, Mesh

from ._compat import backends_started

AxisTypeName = Literal["auto", "explicit"]

_AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}


def simulate_cpu_devices(n: int) -> None:
    """Ask JAX's CPU backend for `n` devices, so parallel code runs on one machine.

    Must run before anything touches a JAX backend (creating an array, listing devices).
    It only affects the CPU backend: on a machine with accelerators the accelerators are
    still used, and the CPU devices stay unused.

    **Arguments:**

    - `n`: how many CPU devices to simulate (at least 1).

    **Raises:**

    - `ValueError` if `n < 1`, or if a backend is already running with a different CPU
      device count (it is too late to change it then).
    """
    if n < 1:
        raise ValueError(f"simulate_cpu_devices: n must be at least 1, got {n}.")
    if backends_started():
        have = len(jax.devices("cpu"))
        if have != n:
            raise ValueError(
                f"simulate_cpu_devices({n}) came too late: JAX's CPU backend is already "
                f"running with {have} device(s). Call it before any JAX array is created "
                f"or any device is listed (e.g. at the top of the script), or set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={n}."
            )
        return
    jax.config.update("jax_num_cpu_devices", n)
    # Subprocesses started from here (tests, launchers) inherit the same count.
    os.environ["EQXPAR_CPU_DEVICES"] = str(n)


def make_mesh(
    axis_type: AxisTypeName = "auto",
    devices: Sequence[jax.Device] | None = None,  # pyright: ignore[reportInvalidTypeForm]  # jaxlib's Device, re-exported as a plain variable
    **axis_sizes: int,
) -> Mesh:
    """A device mesh from named axis sizes, e.g. `make_mesh(data=2, model=4)`.

    The axes keep the order they are given in; the first `prod(sizes)` devices are used
    (all of `devices` if given, else `jax.devices()`), so a mesh may be smaller than the
    machine.

    **Axis type.** The default is `"auto"` (`jax.sharding.AxisType.Auto`), chosen on
    purpose: eqxpar's steps do their communication by hand inside `shard_map`, and with Auto
    axes `shard_map` and `jax.jit` accept inputs that are not laid out yet and move them
    (visible in the communication report) instead of refusing them. Pass
    `axis_type="explicit"` for JAX's sharding-in-types mode (`jax.make_mesh`'s default):
    then every input must already carry the sharding its `in_specs` name; put it there with
    [`eqxpar.shard`][] or `jax.device_put` first.

    **Arguments:**

    - `axis_type`: `"auto"` (default) or `"explicit"`, applied to every axis.
    - `devices`: the devices to draw from, in order. Default: `jax.devices()`.
    - `**axis_sizes`: axis name to size, in mesh order. At least one.

    **Returns:**

    A `jax.sharding.Mesh` with those axis names and sizes.

    **Raises:**

    - `ValueError` if no axes are given, a size is not a positive integer, the sizes
      multiply to more devices than there are, or `axis_type` is unknown.
    """
    if not axis_sizes:
        raise ValueError("make_mesh needs at least one named axis, e.g. make_mesh(data=8).")
    for name, size in axis_sizes.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"make_mesh: axis {name!r} has size {size!r}; sizes must be positive integers.")
    if axis_type not in _AXIS_TYPES:
        raise ValueError(f"make_mesh: axis_type must be one of {sorted(_AXIS_TYPES)}, got {axis_type!r}.")
    pool = list(jax.devices() if devices is None else devices)
    need = math.prod(axis_sizes.values())
    if need > len(pool):
        shape = " x ".join(f"{k}={v}" for k, v in axis_sizes.items())
        raise ValueError(
            f"make_mesh: the mesh {shape} needs {need} devices but only {len(pool)} are "
            f"available. Use smaller axis sizes whose product is at most {len(pool)}, or "
            f"start with more devices (on CPU: --devices {need}, or "
            f"eqxpar.simulate_cpu_devices({need}) before JAX starts)."
        )
    names = tuple(axis_sizes)
    sizes = tuple(axis_sizes.values())
    return jax.make_mesh(
        sizes,
        names,
        axis_types=(_AXIS_TYPES[axis_type],) * len(names),
        devices=pool[:need],
    )


def parse_mesh(text: str) -> dict[str, int]:
    """Parse a mesh written as `"data=2,model=4"` into `{"data": 2, "model": 4}`.

    **Arguments:**

    - `text`: comma-separated `name=size` pairs.

    **Returns:**

    An ordered dict of axis name to size, ready for `make_mesh(**sizes)`.

    **Raises:**

    - `ValueError` on an empty string, a pair without `=`, a repeated name, or a size that
      is not a positive integer.
    """
    sizes: dict[str, int] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"mesh {text!r}: {part!r} is not of the form name=size.")
        if name in sizes:
            raise ValueError(f"mesh {text!r}: axis {name!r} is given twice.")
        try:
            size = int(value)
        except ValueError:
            size = 0
        if size < 1:
            raise ValueError(f"mesh {text!r}: axis {name!r} needs a positive integer size.")
        sizes[name] = size
    if not sizes:
        raise ValueError(f"mesh {text!r}: give at least one axis, e.g. data=8.")
    return sizes


def fit_mesh(
    preferred: Mapping[str, int],
    num_devices: int | None = None,
    *,
    divides: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """The mesh with `preferred`'s axes that uses the most devices there are.

    Of all axis sizes whose product is at most `num_devices` (and where `divides` names a
    number for an axis, dividing it), the ones with the largest product; among those, the
    closest to `preferred` (the fewest doublings or halvings away). With exactly
    `prod(preferred)` devices this is `preferred` itself, if it fits `divides`; on one
    device every axis has size 1.

    ```python
    fit_mesh({"data": 2, "model": 4}, 8)  # {"data": 2, "model": 4}
    fit_mesh({"data": 2, "model": 4}, 1)  # {"data": 1, "model": 1}
    fit_mesh({"data": 2, "model": 4}, 16, divides={"model": 4})  # {"data": 4, "model": 4}
    ```

    **Arguments:**

    - `preferred`: axis name to size, in mesh order: the layout to stay close to.
    - `num_devices`: how many devices the mesh may use. Default: `jax.device_count()`.
    - `divides`: axis name to a number its size must divide (e.g. the attention heads for
      a tensor-parallel axis, the batch size for a data axis).

    **Returns:**

    An ordered dict of axis name to size, ready for `make_mesh(**sizes)`.

    **Raises:**

    - `ValueError` if `preferred` is empty or has a size that is not a positive integer,
      `num_devices` is below 1, or `divides` names an axis `preferred` lacks or a number
      below 1.
    """
    if not preferred:
        raise ValueError("fit_mesh needs at least one axis, e.g. fit_mesh({'data': 8}).")
    divides = dict(divides or {})
    for name, size in [*preferred.items(), *divides.items()]:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"fit_mesh: axis {name!r} has {size!r}; sizes must be positive integers.")
    unknown = sorted(set(divides) - set(preferred))
    if unknown:
        raise ValueError(f"fit_mesh: divides names axes {unknown} that are not in {dict(preferred)}.")
    n = jax.device_count() if num_devices is None else num_devices
    if n < 1:
        raise ValueError(f"fit_mesh: num_devices must be at least 1, got {n}.")
    names = list(preferred)
    options = [[s for s in range(1, min(n, divides.get(a, n)) + 1) if divides.get(a, s) % s == 0] for a in names]

    def distance(sizes: tuple[int, ...]) -> float:
        return sum(abs(math.log2(s / preferred[a])) for a, s in zip(names, sizes))

    best: tuple[int, ...] = (1,) * len(names)

    def search(i: int, sizes: tuple[int, ...], product: int) -> None:
        nonlocal best
        if i == len(names):
            key, best_key = (-product, distance(sizes)), (-math.prod(best), distance(best))
            if key < best_key:
                best = sizes
            return
        for s in options[i]:
            if product * s > n:
                break
            search(i + 1, (*sizes, s), product * s)

    search(0, (), 1)
    return dict(zip(names, best))
