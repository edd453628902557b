"""Inspection: what a compiled function communicates.

[`eqxpar.inspect.communication_report`][] lists the collectives of any function (kind,
count, bytes), read twice:

- from the **lowered** module (StableHLO, what JAX emitted: one entry per `psum`,
  `all_gather`, ... the code asked for), and
- from the **compiled** HLO (what XLA will run: it may merge collectives, drop ones over a
  single device, or add its own to move inputs into place).

Comparing the two shows both what the code says and what the machine does.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable
from typing import Any, Literal

import equinox as eqx

__all__ = [
    "Collective",
    "CommReport",
    "communication_report",
    "collectives_in_hlo",
    "collectives_in_lowered",
    "COLLECTIVE_KINDS",
]

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
"""The collective kinds a report counts, in HLO spelling."""

Stage = Literal["compiled", "lowered"]


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective operation in a program.

    Sizes are per device and refer to the operation's **result**: for an all-reduce the
    array being reduced, for an all-gather the gathered array, for a reduce-scatter the
    scattered block. A collective over several arrays at once (XLA's combined form) has
    several `shapes`.
    """

    kind: str
    """One of [`eqxpar.inspect.COLLECTIVE_KINDS`][]."""
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    group_size: int | None
    """Devices per replica group (how many take part in each reduction), when known."""

    @property
    def elements(self) -> int:
        """Number of result elements per device (summed over a combined collective's arrays)."""
        return sum(math.prod(s) for s in self.shapes)

    @property
    def bytes(self) -> int:
        """Result bytes per device."""
        return sum(math.prod(s) * _itemsize(d) for s, d in zip(self.shapes, self.dtypes))

    def describe(self) -> str:
        arrays = ", ".join(f"{d}{list(s)}" for s, d in zip(self.shapes, self.dtypes))
        group = f" over {self.group_size} devices" if self.group_size else ""
        return f"{self.kind} {arrays}{group}"


@dataclasses.dataclass(frozen=True)
class CommReport:
    """The collectives of one function, as lowered and as compiled.

    `print(report)` shows a table per kind; `count`, `bytes` and `elements` give numbers,
    for the compiled program by default (`stage="lowered"` for what the code emitted).
    A collective inside a loop body (e.g. `jax.lax.scan`) is counted once.
    """

    compiled: tuple[Collective, ...]
    lowered: tuple[Collective, ...]

    @classmethod
    def of(cls, lowered: Any, compiled: Any = None) -> "CommReport":
        """The report of a function already lowered (and, optionally, compiled).

        Use it to inspect the very program you then run, compiling once:
        `lowered = eqx.filter_jit(step).lower(*args)`, `step = lowered.compile()`,
        `CommReport.of(lowered, step)`.

        **Arguments:**

        - `lowered`: a `jax.stages.Lowered`, or Equinox's wrapper of one
          (`eqx.filter_jit(f).lower(...)`).
        - `compiled`: its compiled form (a `jax.stages.Compiled` or Equinox's wrapper).
          Default: compile `lowered` now.

        **Returns:**

        A [`eqxpar.inspect.CommReport`][].
        """
        lowered = _unwrap(lowered, "lowered")
        compiled = lowered.compile() if compiled is None else _unwrap(compiled, "compiled")
        return cls(compiled=collectives_in_hlo(compiled.as_text()), lowered=collectives_in_lowered(lowered))

    def collectives(self, kind: str | None = None, *, stage: Stage = "compiled") -> tuple[Collective, ...]:
        """The collectives of one kind (all kinds with `kind=None`) at one stage."""
        if kind is not None and kind not in COLLECTIVE_KINDS:
            raise ValueError(f"CommReport: unknown collective kind {kind!r}; use one of {COLLECTIVE_KINDS}.")
        if stage not in ("compiled", "lowered"):
            raise ValueError(f"CommReport: stage must be 'compiled' or 'lowered', got {stage!r}.")
        ops = self.compiled if stage == "compiled" else self.lowered
        return tuple(c for c in ops if kind is None or c.kind == kind)

    def count(self, kind: str | None = None, *, stage: Stage = "compiled") -> int:
        """How many collectives of `kind` (all kinds with `None`) the program has."""
        return len(self.collectives(kind, stage=stage))

    def bytes(self, kind: str | None = None, *, stage: Stage = "compiled") -> int:
        """Total result bytes per device of the collectives of `kind`."""
        return sum(c.bytes for c in self.collectives(kind, stage=stage))

    def elements(self, kind: str | None = None, *, stage: Stage = "compiled") -> int:
        """Total result elements per device of the collectives of `kind`."""
        return sum(c.elements for c in self.collectives(kind, stage=stage))

    def __str__(self) -> str:
        head = ("collective", "lowered", "compiled", "compiled bytes/device")
        rows = [
            (kind, str(self.count(kind, stage="lowered")), str(self.count(kind)), f"{self.bytes(kind):,}")
            for kind in COLLECTIVE_KINDS
            if self.count(kind, stage="lowered") or self.count(kind)
        ]
        rows.append(("TOTAL", str(self.count(stage="lowered")), str(self.count()), f"{self.bytes():,}"))
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        fmt = "  ".join(f"{{:{'<' if i == 0 else '>'}{w}}}" for i, w in enumerate(widths))
        lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
        lines += [fmt.format(*r) for r in rows]
        if self.compiled:
            lines.append("compiled:")
            lines += [f"  {c.describe()}" for c in self.compiled]
        return "\n".join(lines)


def communication_report(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> CommReport:
    """Lower and compile `fn(*args, **kwargs)` and report its collectives.

    `fn` may be any function of JAX arrays and PyTrees (Equinox Modules included; it is
    wrapped in `eqx.filter_jit`, so an already jitted function works too). Nothing runs:
    the function is only lowered and compiled for these arguments' shapes and shardings.

    **Arguments:**

    - `fn`: the function, typically a train step or a `filter_shard_map`-ed forward pass.
    - `*args`, `**kwargs`: example arguments (arrays or `jax.ShapeDtypeStruct`s with
      shardings).

    **Returns:**

    A [`eqxpar.inspect.CommReport`][] with the collectives of the lowered module and of
    the compiled program.
    """
    return CommReport.of(eqx.filter_jit(fn).lower(*args, **kwargs))


# ----------------------------------------------------------------------------------------
# Compiled HLO text: one instruction per line, `%name = TYPE opcode(operands), attributes`.

# The result type: one array (`f32[16,8]{1,0}`) or a tuple of them, which XLA may annotate
# with `/*index=5*/` comments and memory spaces `S(1)` (hence one level of nested parens).
_HLO_OP = re.compile(
    r"=\s*(?P<type>\((?:[^()]|\([^()]*\))*\)|[a-z][a-z0-9]*\[[0-9,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?P<async>-start|-done)?\("
)
_HLO_NAME = re.compile(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_HLO_OPERAND = re.compile(r"%([\w.\-]+)")
_HLO_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HLO_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
_HLO_GROUPS_LIST = re.compile(r"replica_groups=\{\{([0-9,]*)\}")


def collectives_in_hlo(text: str) -> tuple[Collective, ...]:
    """The collectives of a compiled program's HLO text (`compiled.as_text()`).

    Asynchronous pairs (`all-reduce-start` / `all-reduce-done`, as on GPUs) count once,
    with the sizes of the `-done` result.

    **Arguments:**

    - `text`: HLO text, e.g. `jax.jit(f).lower(*args).compile().as_text()`.

    **Returns:**

    A tuple of [`eqxpar.inspect.Collective`][], in program order.
    """
    found = []
    started: dict[str, int | None] = {}  # async start name -> its replica group size
    for line in text.splitlines():
        match = _HLO_OP.search(line)
        if match is None:
            continue
        if match.group("async") == "-start":
            name = _HLO_NAME.match(line)
            if name:
                started[name.group(1)] = _hlo_group_size(line)
            continue
        group_size = _hlo_group_size(line)
        if match.group("async") == "-done":
            operand = _HLO_OPERAND.search(line, match.end() - 1)
            group_size = started.get(operand.group(1)) if operand else None
        arrays = _HLO_ARRAY.findall(match.group("type"))
        shapes = tuple(tuple(int(d) for d in dims.split(",") if d) for _, dims in arrays)
        dtypes = tuple(dtype for dtype, _ in arrays)
        found.append(Collective(match.group("op"), shapes, dtypes, group_size))
    return tuple(found)


def _hlo_group_size(line: str) -> int | None:
    iota = _HLO_GROUPS_IOTA.search(line)
    if iota:
        return int(iota.group(2))
    listed = _HLO_GROUPS_LIST.search(line)
    if listed:
        return len([d for d in listed.group(1).split(",") if d])
    return None


# ----------------------------------------------------------------------------------------
# Lowered module (StableHLO): walked as MLIR operations rather than parsed as text.

_STABLEHLO_KINDS = {
    "stablehlo.all_reduce": "all-reduce",
    "stablehlo.all_gather": "all-gather",
    "stablehlo.reduce_scatter": "reduce-scatter",
    "stablehlo.all_to_all": "all-to-all",
    "stablehlo.collective_permute": "collective-permute",
}


def collectives_in_lowered(lowered: Any) -> tuple[Collective, ...]:
    """The collectives of a lowered function's StableHLO module.

    **Arguments:**

    - `lowered`: a `jax.stages.Lowered` (from `jax.jit(f).lower(...)` or
      `eqx.filter_jit(f).lower(...)`).

    **Returns:**

    A tuple of [`eqxpar.inspect.Collective`][], in program order.
    """
    from jax._src.lib.mlir import ir

    module = _unwrap(lowered, "lowered").compiler_ir("stablehlo")
    found: list[Collective] = []
    with module.context:
        for op in _walk(module.operation):
            kind = _STABLEHLO_KINDS.get(op.name)
            if kind is None:
                continue
            types = [ir.RankedTensorType(r.type) for r in op.results]
            group_size = None
            if "replica_groups" in op.attributes:
                group_size = int(ir.DenseElementsAttr(op.attributes["replica_groups"]).type.shape[1])
            found.append(
                Collective(
                    kind,
                    tuple(tuple(int(d) for d in t.shape) for t in types),
                    tuple(str(t.element_type) for t in types),
                    group_size,
                )
            )
    return tuple(found)


def _unwrap(stage: Any, name: str) -> Any:
    """The `jax.stages.Lowered`/`Compiled` inside Equinox's wrapper (itself if already one)."""
    return getattr(stage, name, stage)


def _walk(operation) -> Iterable:
    for region in operation.regions:
        for block in region.blocks:
            for op in block.operations:
                yield op.operation
                yield from _walk(op.operation)


def _itemsize(dtype: str) -> int:
    """Bytes per element for an HLO (`f32`, `bf16`, `pred`, `s8`, `c64`) or MLIR (`f32`,
    `i1`, `ui8`, `complex<f32>`) element type name."""
    if dtype in ("pred", "i1"):
        return 1
    if dtype.startswith("complex<"):
        return 2 * _itemsize(dtype[len("complex<") : -1])
    bits = re.search(r"\d+", dtype)
    if bits is None:
        raise ValueError(f"unknown element type {dtype!r}")
    return max(1, int(bits.group()) // 8)
