"""Theory: the least communication each strategy needs, per collective kind and mesh axes.

[`eqxpar.inspect.data_parallel_theory`][] and [`eqxpar.inspect.fsdp_theory`][] know only
parameter shapes and specs; a model's own activation traffic (tensor parallelism) lives
beside the model ([`eqxpar.models.gpt_tensor_parallel_theory`][]) and is built from
[`eqxpar.inspect.theory_term`][] (here) and [`eqxpar.inspect.report_axes`][] (`_format.py`);
`axis_size`, `params_and_specs` and `block_nbytes` here serve this package's theories.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import PyTree

from .._specs import AxisNames, broadcast_specs, entry_axes, pad_spec, validate_spec
from ._collective import COLLECTIVE_KINDS
from ._format import Stage, axes_label, report_axes, table


@dataclasses.dataclass(frozen=True)
class TheoryTerm:
    """One part of a strategy's expected communication: `bytes` per device per step, by
    the module's bytes convention, moved by collectives of `kind` over the mesh `axes`."""

    kind: str
    """One of [`eqxpar.inspect.COLLECTIVE_KINDS`][]."""
    axes: tuple[str, ...]
    """The mesh axes, in the mesh's order (axes of size 1 left out)."""
    bytes: int
    what: str
    """What the term counts, in words."""


@dataclasses.dataclass(frozen=True)
class CommTheory:
    """The expected communication of a train step: a sum of [`eqxpar.inspect.TheoryTerm`][]s.

    Add theories for combined strategies (`data_parallel_theory(...) +
    gpt_tensor_parallel_theory(...)` for hybrid parallelism); `print` one to list its
    terms; compare with measurements by [`CommReport.versus`][eqxpar.inspect.CommReport.versus].
    """

    terms: tuple[TheoryTerm, ...] = ()

    def __add__(self, other: CommTheory) -> CommTheory:
        if not isinstance(other, CommTheory):
            return NotImplemented
        return CommTheory(self.terms + other.terms)

    def bytes(self, kind: str | None = None, *, axes: tuple[str, ...] | None = None) -> int:
        """Expected bytes per device of one kind (all with `None`), over exactly `axes`
        (given in mesh order; any with `None`)."""
        if kind is not None and kind not in COLLECTIVE_KINDS:
            raise ValueError(f"CommTheory: unknown collective kind {kind!r}; use one of {COLLECTIVE_KINDS}.")
        axes = (axes,) if isinstance(axes, str) else axes
        return sum(
            t.bytes for t in self.terms if (kind is None or t.kind == kind) and (axes is None or t.axes == tuple(axes))
        )

    def traffic(self) -> dict[tuple[str, tuple[str, ...]], int]:
        """Expected bytes per device by `(kind, axes)`, as [`CommReport.traffic`][eqxpar.inspect.CommReport.traffic]."""
        out: dict = {}
        for t in self.terms:
            out[(t.kind, t.axes)] = out.get((t.kind, t.axes), 0) + t.bytes
        return out

    def __str__(self) -> str:
        rows = [(t.kind, axes_label(t.axes), f"{t.bytes:,}", t.what) for t in self.terms]
        rows.append(("TOTAL", "", f"{self.bytes():,}", ""))
        lines = table(("collective", "axes", "bytes/device", "for"), rows, left=(0, 3))
        return "\n".join(line.rstrip() for line in lines)


def theory_term(kind: str, axes: tuple[str, ...], nbytes: int, what: str) -> tuple[TheoryTerm, ...]:
    """One term of a communication theory, or none when it moves nothing.

    The building block of the theory functions (and of a model's own, like
    [`eqxpar.models.gpt_tensor_parallel_theory`][]): add the results up and pass the sum to
    [`eqxpar.inspect.CommTheory`][].

    ```python
    axes = report_axes("model", mesh, "my_theory")
    theory = CommTheory(
        theory_term("all-reduce", axes, 2 * layers * stream, "attention and MLP outputs, forward")
        + theory_term("all-reduce", axes, stream, "head input gradient, backward")
    )
    ```

    **Arguments:**

    - `kind`: the collective, one of [`eqxpar.inspect.COLLECTIVE_KINDS`][].
    - `axes`: the mesh axes it runs over, keyed as a report keys them (in mesh order, axes
      of size 1 left out): pass them through [`eqxpar.inspect.report_axes`][].
    - `nbytes`: bytes per device per step, by the module's bytes convention.
    - `what`: what the term counts, in words.

    **Returns:**

    A 1-tuple holding the [`eqxpar.inspect.TheoryTerm`][], or `()` when `axes` is empty
    (every axis of size 1) or `nbytes` is 0.

    **Raises:**

    `ValueError` if `kind` is not one of `COLLECTIVE_KINDS`.
    """
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"theory_term: unknown collective kind {kind!r}; use one of {COLLECTIVE_KINDS}.")
    return (TheoryTerm(kind, axes, int(nbytes), what),) if axes and nbytes else ()


def block_nbytes(leaf: Any, spec: PartitionSpec, mesh: Mesh, *, whole_over: tuple[str, ...] = ()) -> int:
    """Bytes of one device's block of `leaf` laid out by `spec`, as if the axes in
    `whole_over` did not split it."""
    shape = list(leaf.shape)
    for dim, entry in enumerate(pad_spec(spec, leaf.ndim)):
        parts = math.prod(mesh.shape[a] for a in entry_axes(entry) if a not in whole_over)
        shape[dim] //= parts
    return math.prod(shape) * np.dtype(leaf.dtype).itemsize


def params_and_specs(model: PyTree, param_specs: PyTree, mesh: Mesh, who: str) -> list[tuple[int, Any, PartitionSpec]]:
    """(index in `jax.tree.leaves(model)`, leaf, spec) for every floating-point array of
    `model`, the specs checked against the mesh."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"{who}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
    out = []
    leaves = jax.tree.leaves(model)
    for index, (leaf, spec) in enumerate(zip(leaves, broadcast_specs(param_specs, model, what="param_specs"))):
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype") and np.issubdtype(leaf.dtype, np.inexact):
            validate_spec(spec, tuple(leaf.shape), mesh, where=f"{who} param_specs")
            out.append((index, leaf, spec))
    if not out:
        raise ValueError(f"{who}: the model holds no floating-point arrays.")
    return out


def axis_size(mesh: Mesh, axes: AxisNames, who: str, what: str) -> int:
    """The product of the sizes of `axes` (the `what` axis, e.g. "data"), which `mesh`
    must have; a `ValueError` naming `who` otherwise."""
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    for a in names:
        if a not in mesh.shape:
            raise ValueError(
                f"{who}: the mesh has no {what} axis {a!r} (its axes are {tuple(mesh.axis_names)}); "
                f"pass the {what} axis name the step uses."
            )
    return math.prod(mesh.shape[a] for a in names)


def data_parallel_theory(
    model: PyTree,
    mesh: Mesh,
    param_specs: PyTree[PartitionSpec] = PartitionSpec(),
    *,
    batch_axis: AxisNames = "data",
) -> CommTheory:
    """The least communication of a data-parallel (or hybrid) step: one all-reduce of the gradient.

    Each device adds its shard's gradient to the others' over `batch_axis`: one all-reduce of
    the gradient bytes it holds, i.e. its block of every floating-point parameter (the
    whole parameter when replicated; the model-axis block under tensor parallelism), plus
    the 4-byte float32 loss that [`eqxpar.train.data_parallel_step`][] reduces with it, and
    for `metrics["grad_norm"]` a 4-byte sum of squares over each set of axes the specs
    split parameters over (none when everything is replicated). On a
    `(data, model)` mesh add [`eqxpar.models.gpt_tensor_parallel_theory`][] for the model
    axis.

    **Arguments:**

    - `model`: the model in its global form (full-size arrays, or `jax.ShapeDtypeStruct`s).
    - `mesh`: the step's mesh.
    - `param_specs`: where the parameters live over the other axes (default replicated),
      as given to the step.
    - `batch_axis`: the batch axis (or axes).

    **Returns:**

    A [`eqxpar.inspect.CommTheory`][] (empty when the data axis has size 1).
    """
    who = "data_parallel_theory"
    axis_size(mesh, batch_axis, who, "data")
    axes = report_axes(batch_axis, mesh, who)
    pairs = params_and_specs(model, param_specs, mesh, who)
    grads = sum(block_nbytes(leaf, spec, mesh) for _, leaf, spec in pairs)
    return CommTheory(
        theory_term("all-reduce", axes, grads, "gradients: each device's parameter bytes")
        + theory_term("all-reduce", axes, 4, "loss (float32 scalar), reduced with the gradients")
        + _grad_norm_terms(pairs, mesh, who)
    )


def _grad_norm_terms(pairs: list, mesh: Mesh, who: str) -> tuple:
    """The step's `grad_norm`: a 4-byte partial sum of squares for each set of axes the
    specs split parameters over, as the step groups them (`("model", "fsdp")` and
    `("fsdp", "model")` are two sets)."""
    groups = {tuple(a for e in pad_spec(spec, leaf.ndim) for a in entry_axes(e)) for _, leaf, spec in pairs}
    terms: tuple = ()
    for axes in sorted(g for g in groups if g):
        terms += theory_term(
            "all-reduce", report_axes(axes, mesh, who), 4, f"gradient norm: partial sum of squares over {axes}"
        )
    return terms


def fsdp_theory(
    model: PyTree,
    mesh: Mesh,
    param_specs: PyTree[PartitionSpec],
    *,
    batch_axis: str = "fsdp",
    regathered: Callable[[PyTree], Any] | None = None,
    metrics: bool = True,
) -> CommTheory:
    """The least communication of an FSDP step ([`eqxpar.train.fsdp_step`][]).

    Over `batch_axis`, for every parameter `param_specs` splits over it: one all-gather of
    the parameter forward (bytes: the gathered parameter, or its model-axis block under
    tensor parallelism) and one reduce-scatter of its gradient backward (bytes: the full
    gradient each device contributes, the same figure). Parameters the specs keep whole
    over `batch_axis` need an all-reduce of their gradient instead. With `regathered`, the
    parameters gathered again in the backward pass (remat) count a second all-gather.

    With `metrics`, the step's reported numbers too: the loss (4 bytes over `batch_axis`)
    and the gradient norm (a 4-byte partial sum of squares for each set of axes the specs
    split parameters over, as `fsdp_step` groups them: `("model", "fsdp")`
    and `("fsdp", "model")` are two sets).

    For tensor parallelism on the same mesh add
    [`eqxpar.models.gpt_tensor_parallel_theory`][] with `batch_axis=batch_axis`.

    **Arguments:**

    - `model`: the model in its global form.
    - `mesh`: the step's mesh.
    - `param_specs`: the specs given to the step ([`eqxpar.train.fsdp_specs`][]).
    - `batch_axis`: the axis parameters and batch are split over.
    - `regathered`: `model -> node or nodes` selecting the parameters the backward pass
      gathers again (e.g. the blocks, minus parameters the backward does not read).
    - `metrics`: count the loss and gradient-norm reductions of `fsdp_step`.

    **Returns:**

    A [`eqxpar.inspect.CommTheory`][].
    """
    who = "fsdp_theory"
    axis_size(mesh, batch_axis, who, "fsdp")
    pairs = params_and_specs(model, param_specs, mesh, who)
    fsdp_key = report_axes(batch_axis, mesh, who)
    again = _selected(model, regathered, who) if regathered is not None else set()
    gathered = scattered = reduced = regather = 0
    for index, leaf, spec in pairs:
        block = block_nbytes(leaf, spec, mesh, whole_over=(batch_axis,))
        split_axes = tuple(a for e in pad_spec(spec, leaf.ndim) for a in entry_axes(e))
        if batch_axis in split_axes:
            gathered += block
            scattered += block
            if index in again:
                regather += block
        else:
            reduced += block
    terms = (
        theory_term("all-gather", fsdp_key, gathered, "parameters, gathered forward")
        + theory_term("all-gather", fsdp_key, regather, "parameters gathered again for the backward pass (remat)")
        + theory_term("reduce-scatter", fsdp_key, scattered, "gradients of the split parameters")
        + theory_term("all-reduce", fsdp_key, reduced, "gradients of the parameters kept whole")
    )
    if metrics:
        terms += theory_term("all-reduce", fsdp_key, 4, "loss, reduced with the gradients of the parameters kept whole")
        terms += _grad_norm_terms(pairs, mesh, who)
    return CommTheory(terms)


def _selected(model: PyTree, select: Callable[[PyTree], Any], who: str) -> set[int]:
    """Indices (in `jax.tree.leaves(model)` order) of the leaves under the nodes `select` picks."""
    leaves, treedef = jax.tree_util.tree_flatten(model)
    ids = jax.tree_util.tree_unflatten(treedef, list(range(len(leaves))))
    try:
        picked = select(ids)
    except Exception as error:
        raise ValueError(
            f"{who}: regathered must pick nodes of the model by attribute access (e.g. "
            f"lambda m: m.blocks); calling it failed with {error!r}."
        ) from error
    return {i for i in jax.tree.leaves(picked) if isinstance(i, int)}


@dataclasses.dataclass(frozen=True)
class ComparisonRow:
    """Measured and expected bytes per device for one collective kind over one set of axes."""

    kind: str
    axes: tuple[str, ...] | None
    theory: int
    lowered: int
    compiled: int


@dataclasses.dataclass(frozen=True)
class CommComparison:
    """A [`eqxpar.inspect.CommReport`][]'s bytes beside a [`eqxpar.inspect.CommTheory`][].

    One row per collective kind and mesh axes, with the measured bytes of the lowered and
    the compiled program and the theory's; `ratio()` divides measured by theory. From
    [`CommReport.versus`][eqxpar.inspect.CommReport.versus].
    """

    rows: tuple[ComparisonRow, ...]
    theory: CommTheory

    def ratio(self, kind: str | None = None, *, stage: Stage = "compiled", axes: AxisNames | None = None) -> float:
        """Measured / theory bytes for one kind (all with `None`) over exactly `axes` (any
        with `None`): 1.0 means the program communicates exactly the minimum. `inf` if the
        theory expects nothing there but something is measured; `nan` if both are zero."""
        if stage not in ("compiled", "lowered"):
            raise ValueError(f"CommComparison: stage must be 'compiled' or 'lowered', got {stage!r}.")
        axes = (axes,) if isinstance(axes, str) else (None if axes is None else tuple(axes))
        rows = [r for r in self.rows if (kind is None or r.kind == kind) and (axes is None or r.axes == axes)]
        measured = sum(getattr(r, stage) for r in rows)
        expected = sum(r.theory for r in rows)
        if expected == 0:
            return math.nan if measured == 0 else math.inf
        return measured / expected

    def __str__(self) -> str:
        def ratio(m, t):
            return "-" if t == 0 and m == 0 else ("inf" if t == 0 else f"{m / t:.3f}")

        rows = [
            (
                r.kind,
                axes_label(r.axes),
                f"{r.theory:,}",
                f"{r.lowered:,}",
                ratio(r.lowered, r.theory),
                f"{r.compiled:,}",
                ratio(r.compiled, r.theory),
            )
            for r in self.rows
        ]
        t, lo, co = (sum(getattr(r, f) for r in self.rows) for f in ("theory", "lowered", "compiled"))
        rows.append(("TOTAL", "", f"{t:,}", f"{lo:,}", ratio(lo, t), f"{co:,}", ratio(co, t)))
        head = ("collective", "axes", "theory B", "lowered B", "ratio", "compiled B", "ratio")
        return "\n".join(table(head, rows) + ["theory:"] + ["  " + line for line in str(self.theory).splitlines()])
