"""How many times each part of a program runs per call: loop trip counts.

A collective inside a loop body (`jax.lax.scan`, `fori_loop`: scanned layers, gradient
accumulation, a pipeline's ticks) runs once per iteration. The readers in `_hlo.py` count
it that many times where the trip count can be read, and once where it cannot:

- **compiled HLO**: XLA's while loops carry `known_trip_count` in their backend config
  when it has proved the count (it does for JAX's scans and static-bound `fori_loop`s);
  a computation runs as many times as its callers run it, times the count for a loop body.
- **lowered StableHLO**: JAX's loops count an induction variable from a constant up to a
  constant by a constant step (`while i < n: ...; i = i + 1`); the count is read from the
  loop's condition, its initial value and its body.
"""

from __future__ import annotations

import math
import re
from typing import Any

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$")
_ENTRY = re.compile(r"^ENTRY\s")
_CALLEE = re.compile(
    r"\b(?P<attr>body|condition|to_apply|calls|true_computation|false_computation)=%(?P<name>[\w.\-]+)"
)
_BRANCHES = re.compile(r"\bbranch_computations=\{(?P<names>[^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


def hlo_computation_runs(text: str) -> tuple[dict[str, int], list[str | None]]:
    """For compiled HLO text: how many times each computation runs per call of the
    program, and the computation each line belongs to (None outside any).

    A computation the entry does not reach (or a text without an `ENTRY`, such as a
    fragment) counts as running once."""
    owner: list[str | None] = []
    calls: dict[str, list[tuple[str, int]]] = {}
    current, entry = None, None
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = header.group("name")
            calls.setdefault(current, [])
            if _ENTRY.match(line):
                entry = current
        elif line.startswith("}"):
            owner.append(current)
            current = None
            continue
        owner.append(current)
        if current is None or header:
            continue
        trips = _TRIP_COUNT.search(line)
        for callee in _CALLEE.finditer(line):
            times = int(trips.group(1)) if trips and callee.group("attr") == "body" else 1
            calls[current].append((callee.group("name"), times))
        branches = _BRANCHES.search(line)
        if branches:
            for name in re.findall(r"%([\w.\-]+)", branches.group("names")):
                calls[current].append((name, 1))
    runs: dict[str, int] = {}
    if entry is not None:
        _add_runs(entry, 1, calls, runs, ())
    return {name: runs.get(name, 1) for name in calls}, owner


def _add_runs(name: str, times: int, calls: dict, runs: dict, path: tuple) -> None:
    if name in path:  # not in valid HLO; guards against a misread
        return
    runs[name] = runs.get(name, 0) + times
    for callee, factor in calls.get(name, ()):
        _add_runs(callee, times * factor, calls, runs, (*path, name))


def stablehlo_trip_count(ir: Any, op: Any) -> int | None:
    """The number of iterations of a `stablehlo.while` `op`, when its condition is
    `i < n` on one loop variable `i` that starts at a constant and grows by a constant
    step in the body, with `n` a constant; otherwise None."""
    try:
        cond, body = op.regions[0].blocks[0], op.regions[1].blocks[0]
        compare = list(cond.operations)[-1].operands[0].owner
        if compare.name != "stablehlo.compare" or "LT" not in str(compare.attributes["comparison_direction"]):
            return None
        variable, limit = compare.operands
        index = _argument_number(ir, variable)
        if index is None:
            return None
        start = _constant(ir, op.operands[index])
        stop = _constant(ir, limit)
        update = list(body.operations)[-1].operands[index].owner
        if update.name != "stablehlo.add":
            return None
        a, b = update.operands
        if _argument_number(ir, a) == index:
            step = _constant(ir, b)
        elif _argument_number(ir, b) == index:
            step = _constant(ir, a)
        else:
            return None
        if start is None or stop is None or step is None or step <= 0:
            return None
        return max(0, math.ceil((stop - start) / step))
    except (AttributeError, IndexError, KeyError, TypeError, ValueError):
        return None


def _argument_number(ir: Any, value: Any) -> int | None:
    """The position of `value` among its block's arguments, or None if an operation made it."""
    if not isinstance(value.owner, ir.Block):
        return None
    return ir.BlockArgument(value).arg_number


def _constant(ir: Any, value: Any) -> int | None:
    """The integer a scalar `stablehlo.constant` holds, or None."""
    if isinstance(value.owner, ir.Block):
        return None
    owner = value.owner
    if owner.name != "stablehlo.constant":
        return None
    attr = ir.DenseIntElementsAttr(owner.attributes["value"])
    if not attr.is_splat:
        return None
    return int(attr.get_splat_value().value)
