"""The communication report: what a compiled function communicates, per kind, axes and scope."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from ._collective import COLLECTIVE_KINDS, Collective
from ._format import AxisNames, Stage, axes_label, is_stage, report_axes, stages, table, unwrap
from ._hlo import collectives_in_hlo, collectives_in_lowered, mesh_of_lowered
from ._theory import CommComparison, CommTheory, ComparisonRow


@dataclasses.dataclass(frozen=True)
class CommReport:
    """The collectives of one function, as lowered and as compiled.

    `print(report)` shows a table per kind; `count`, `bytes` and `elements` give numbers,
    for the compiled program by default (`stage="lowered"` for what the code emitted),
    optionally for one kind, one set of mesh `axes` (`axes="data"`, `axes=("fsdp",
    "model")`; this needs `mesh`) and one `jax.named_scope` (`scope="block_0"`: the
    collectives issued inside it, see [`Collective.scopes`][eqxpar.inspect.Collective.scopes]).
    [`CommReport.by_scope`][eqxpar.inspect.CommReport.by_scope] groups them per layer;
    [`CommReport.versus`][eqxpar.inspect.CommReport.versus] puts a theory beside the
    measured bytes. A collective inside a loop body (e.g. `jax.lax.scan`) counts once per
    iteration where the trip count can be read (see `collectives_in_hlo`), once otherwise.
    """

    compiled: tuple[Collective, ...]
    lowered: tuple[Collective, ...]
    mesh: Mesh | AbstractMesh | None = None
    """The mesh the program runs on (for `axes`), when known: its axis names and sizes."""

    @classmethod
    def of(cls, lowered: Any, compiled: Any = None, *, mesh: Mesh | AbstractMesh | None = None) -> CommReport:
        """The report of a function already lowered (and, optionally, compiled).

        Use it to inspect the very program you then run, compiling once:
        `lowered = eqx.filter_jit(step).lower(*args)`, `step = lowered.compile()`,
        `CommReport.of(lowered, step)`.

        **Arguments:**

        - `lowered`: a `jax.stages.Lowered`, or Equinox's wrapper of one
          (`eqx.filter_jit(f).lower(...)`).
        - `compiled`: its compiled form (a `jax.stages.Compiled` or Equinox's wrapper).
          Default: compile `lowered` now.
        - `mesh`: the mesh the program runs on, to name the axes of each collective.
          Default: the one mesh the lowered module declares (from `shard_map` or
          shardings), else that of the first input with a `NamedSharding`, else none.

        **Returns:**

        A [`eqxpar.inspect.CommReport`][].
        """
        lowered = unwrap(lowered, "lowered")
        compiled = lowered.compile() if compiled is None else unwrap(compiled, "compiled")
        if mesh is None:
            mesh = mesh_of_lowered(lowered) or _mesh_of_tree(getattr(compiled, "input_shardings", None))
        return cls(compiled=collectives_in_hlo(compiled.as_text()), lowered=collectives_in_lowered(lowered), mesh=mesh)

    def collectives(
        self,
        kind: str | None = None,
        *,
        stage: Stage = "compiled",
        axes: AxisNames | None = None,
        scope: str | None = None,
    ) -> tuple[Collective, ...]:
        """The collectives of one kind (all kinds with `kind=None`) at one stage, over
        exactly the mesh axes `axes` (any axes with `None`), issued inside the named scope
        `scope` or a scope nested in it (anywhere with `None`; `""` for the collectives no
        scope claims)."""
        if kind is not None and kind not in COLLECTIVE_KINDS:
            raise ValueError(f"CommReport: unknown collective kind {kind!r}; use one of {COLLECTIVE_KINDS}.")
        if stage not in ("compiled", "lowered"):
            raise ValueError(f"CommReport: stage must be 'compiled' or 'lowered', got {stage!r}.")
        ops = self.compiled if stage == "compiled" else self.lowered
        ops = tuple(c for c in ops if kind is None or c.kind == kind)
        if scope is not None:
            ops = tuple(c for c in ops if _in_scope(c, scope))
        if axes is None:
            return ops
        mesh = self._require_mesh("axes=")
        want = report_axes(axes, mesh, "CommReport")
        return tuple(c for c in ops if c.axes(mesh) == want)

    def count(
        self,
        kind: str | None = None,
        *,
        stage: Stage = "compiled",
        axes: AxisNames | None = None,
        scope: str | None = None,
    ) -> int:
        """How many collectives of `kind` (all kinds with `None`) the program has. Filters as `collectives`."""
        return len(self.collectives(kind, stage=stage, axes=axes, scope=scope))

    def bytes(
        self,
        kind: str | None = None,
        *,
        stage: Stage = "compiled",
        axes: AxisNames | None = None,
        scope: str | None = None,
    ) -> int:
        """Total bytes per device of the collectives of `kind`, by the bytes convention. Filters as `collectives`."""
        return sum(c.bytes for c in self.collectives(kind, stage=stage, axes=axes, scope=scope))

    def elements(
        self,
        kind: str | None = None,
        *,
        stage: Stage = "compiled",
        axes: AxisNames | None = None,
        scope: str | None = None,
    ) -> int:
        """Total elements per device of the collectives of `kind`, by the bytes convention. Filters as `collectives`."""
        return sum(c.elements for c in self.collectives(kind, stage=stage, axes=axes, scope=scope))

    def traffic(self, *, stage: Stage = "compiled") -> dict[tuple[str, tuple[str, ...] | None], int]:
        """Bytes per device by `(kind, axes)`: the form a [`eqxpar.inspect.CommTheory`][]
        has. Collectives over one-device groups (axes `()`) move nothing and are left out;
        those whose groups are unknown appear under axes `None`."""
        mesh = self._require_mesh("traffic()")
        out: dict = {}
        for c in self.collectives(stage=stage):
            key = (c.kind, c.axes(mesh))
            if key[1] == ():
                continue
            out[key] = out.get(key, 0) + c.bytes
        return out

    def by_scope(
        self, kind: str | None = None, *, stage: Stage = "compiled", depth: int | None = None
    ) -> dict[str, tuple[int, int]]:
        """Count and bytes per device of the collectives each named scope (layer) issued.

        **Arguments:**

        - `kind`: one collective kind, or all with `None`.
        - `stage`: `"compiled"` (XLA may combine collectives of several scopes into one:
          its scope is then `"a + b"`) or `"lowered"` (one collective per `psum`, ..., each
          with exactly the scope that issued it).
        - `depth`: keep only the first `depth` levels of each scope (`depth=1` groups
          `block_0/attention` and `block_0/mlp` under `block_0`); all with `None`.

        **Returns:**

        A dict from scope label (`""` for collectives no scope claims) to `(count, bytes)`,
        in program order.

        **Raises:**

        - `ValueError` for an unknown kind or stage, or a `depth` below 1.
        """
        if depth is not None and not (isinstance(depth, int) and depth >= 1):
            raise ValueError(f"CommReport.by_scope: depth must be a positive int or None, got {depth!r}.")
        out: dict[str, tuple[int, int]] = {}
        for c in self.collectives(kind, stage=stage):
            scopes = dict.fromkeys("/".join(s.split("/")[:depth]) for s in c.scopes)
            label = " + ".join(scopes)
            count, nbytes = out.get(label, (0, 0))
            out[label] = (count + 1, nbytes + c.bytes)
        return out

    def versus(self, theory: CommTheory) -> CommComparison:
        """The measured bytes beside a theory's, per collective kind and mesh axes.

        **Arguments:**

        - `theory`: the expected communication, e.g. `data_parallel_theory(...) +
          gpt_tensor_parallel_theory(...)` for a hybrid step.

        **Returns:**

        A [`eqxpar.inspect.CommComparison`][]: `print` it for the table,
        `.ratio(stage=...)` for measured / theory.
        """
        if not isinstance(theory, CommTheory):
            raise ValueError(f"CommReport.versus: expected a CommTheory, got {type(theory).__name__}.")
        self._require_mesh("versus()")
        lowered, compiled = self.traffic(stage="lowered"), self.traffic()
        expected: dict[Any, int] = theory.traffic()  # its keys never have axes None
        keys = sorted(set(lowered) | set(compiled) | set(expected), key=_row_order)
        rows = tuple(
            ComparisonRow(kind, axes, expected.get(key, 0), lowered.get(key, 0), compiled.get(key, 0))
            for key in keys
            for kind, axes in [key]
        )
        return CommComparison(rows=rows, theory=theory)

    def _require_mesh(self, what: str) -> Mesh | AbstractMesh:
        if self.mesh is None:
            raise ValueError(
                f"CommReport.{what} needs the mesh to name the axes of each collective; this "
                f"report has none. Build it with CommReport.of(lowered, compiled, mesh=mesh)."
            )
        return self.mesh

    def __str__(self) -> str:
        head = ("collective", "lowered", "compiled", "compiled bytes/device")
        rows = [
            (kind, str(self.count(kind, stage="lowered")), str(self.count(kind)), f"{self.bytes(kind):,}")
            for kind in COLLECTIVE_KINDS
            if self.count(kind, stage="lowered") or self.count(kind)
        ]
        rows.append(("TOTAL", str(self.count(stage="lowered")), str(self.count()), f"{self.bytes():,}"))
        lines = table(head, rows)
        if self.compiled:
            lines.append("compiled:")
            # Name the axes where the group size alone does not say which (2+ real axes).
            named = self.mesh is not None and sum(n > 1 for n in self.mesh.shape.values()) > 1
            for c in self.compiled:
                try:
                    axes = c.axes(self.mesh) if named and self.mesh is not None else None
                except ValueError:  # a mesh that does not fit this program
                    axes = None
                where = "" if axes is None else f" (axes {axes_label(axes)})"
                scope = f" in {c.scope}" if c.scope else ""
                lines.append(f"  {c.describe()}{where}{scope}")
        return "\n".join(lines)


def communication_report(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> CommReport:
    """Lower and compile `fn(*args, **kwargs)` and report its collectives.

    Takes what [`eqxpar.inspect.memory_report`][] takes. `fn` is a function with a
    `.lower` method (a train step, a `jax.jit` or `eqx.filter_jit` function: lowered as it
    is, so the report is of the program it runs) or any other function of JAX arrays and
    PyTrees, Equinox Modules included (wrapped in `eqx.filter_jit`). Nothing runs: the
    function is only lowered and compiled for these arguments' shapes and shardings. `fn`
    may also be a program already lowered (`jax.stages.Lowered`, compiled here) or
    compiled (`jax.stages.Compiled`: the report then has no lowered collectives), with no
    arguments. The mesh (for the axes of each collective) is the one the program declares,
    else that of its first input with a `NamedSharding`.

    **Arguments:**

    - `fn`: the function, typically a train step or a `filter_shard_map`-ed forward pass,
      or a lowered or compiled program.
    - `*args`, `**kwargs`: example arguments (arrays or `jax.ShapeDtypeStruct`s with
      shardings).

    **Returns:**

    A [`eqxpar.inspect.CommReport`][] with the collectives of the lowered module and of
    the compiled program.

    **Raises:**

    - `ValueError` if `fn` is neither a function nor a program, or a program comes with
      arguments.
    """
    if is_stage(fn) and (args or kwargs):
        raise ValueError(
            "communication_report: got a lowered or compiled program and arguments; it is "
            "already lowered for its arguments, so pass the program alone."
        )
    lowered, compiled = stages("communication_report", fn, args, kwargs)
    if lowered is None:
        mesh = _mesh_of_tree(compiled.input_shardings)
        return CommReport(compiled=collectives_in_hlo(compiled.as_text()), lowered=(), mesh=mesh)
    return CommReport.of(lowered, compiled)


def _mesh_of_tree(tree: Any) -> Mesh | AbstractMesh | None:
    for leaf in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, NamedSharding)):
        sharding = leaf if isinstance(leaf, NamedSharding) else getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None


def _row_order(key: tuple[str, tuple[str, ...] | None]):
    kind, axes = key
    return (COLLECTIVE_KINDS.index(kind), axes is None, axes or ())


def _in_scope(c: Collective, scope: str) -> bool:
    if scope == "":
        return not c.scopes
    return any(s == scope or s.startswith(scope + "/") for s in c.scopes)
