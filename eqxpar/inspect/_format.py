"""What the inspection modules share: stages of a program, axis keys and text tables."""

from __future__ import annotations

from typing import Any, Literal

import equinox as eqx
import jax
from jax.sharding import AbstractMesh, Mesh

from .._specs import AxisNames

Stage = Literal["compiled", "lowered"]


def unwrap(stage: Any, name: str) -> Any:
    """The `jax.stages.Lowered`/`Compiled` inside Equinox's wrapper (itself if already one)."""
    return getattr(stage, name, stage)


def is_stage(fn: Any) -> bool:
    """Whether `fn` is a lowered or compiled program (JAX's or Equinox's wrapper of one)."""
    inner = unwrap(unwrap(fn, "lowered"), "compiled")
    return isinstance(inner, (jax.stages.Lowered, jax.stages.Compiled))


def stages(who: str, fn: Any, args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """(lowered or None, compiled) for `fn(*args, **kwargs)`: the common input of the reports.

    `fn` is a function (lowered with its own `.lower` when it has one: a `jax.jit` or
    `eqx.filter_jit` function, a train step; otherwise wrapped in `eqx.filter_jit`) with
    example arguments, or a `Lowered` (compiled here) or `Compiled` program (then the
    arguments are not used to lower anything).
    """
    if is_stage(fn):
        if isinstance(unwrap(fn, "lowered"), jax.stages.Lowered):
            lowered = unwrap(fn, "lowered")
            return lowered, lowered.compile()
        return None, unwrap(fn, "compiled")
    if not callable(fn):
        raise ValueError(f"{who}: expected a function (or a lowered or compiled program), got {type(fn).__name__}.")
    lower = fn.lower if hasattr(fn, "lower") else eqx.filter_jit(fn).lower
    lowered = unwrap(lower(*args, **kwargs), "lowered")
    return lowered, lowered.compile()


def report_axes(axes: AxisNames, mesh: Mesh | AbstractMesh, who: str = "report_axes") -> tuple[str, ...]:
    """Mesh axis names as reports and theories key them: in the mesh's order, axes of size
    1 left out (a collective over them moves nothing).

    [`eqxpar.inspect.CommReport`][] and [`eqxpar.inspect.CommTheory`][] key their traffic by
    such tuples, so a theory built from [`eqxpar.inspect.theory_term`][]s takes its axes
    from here to compare with a report.

    **Arguments:**

    - `axes`: one mesh axis name, or several in any order.
    - `mesh`: the `jax.sharding.Mesh` (or `AbstractMesh`) they belong to.
    - `who`: the name an error message starts with (the caller's).

    **Returns:**

    The names in `axes` whose size is above 1, as a tuple in `mesh.axis_names` order; `()`
    if there are none.

    **Raises:**

    `ValueError` if `mesh` has no axis of one of the names.
    """
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    for a in names:
        if a not in mesh.shape:
            raise ValueError(f"{who}: the mesh has no axis {a!r}; its axes are {tuple(mesh.axis_names)}.")
    return tuple(a for a in mesh.axis_names if a in names and mesh.shape[a] > 1)


def axes_label(axes: tuple[str, ...] | None) -> str:
    if axes is None:
        return "?"
    return ",".join(axes) if axes else "(one device)"


def table(head: tuple[str, ...], rows: list[tuple[str, ...]], left: tuple[int, ...] = (0,)) -> list[str]:
    """Text table lines; the columns in `left` aligned left, the others right."""
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = "  ".join(f"{{:{'<' if i in left else '>'}{w}}}" for i, w in enumerate(widths))
    return [fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows]
