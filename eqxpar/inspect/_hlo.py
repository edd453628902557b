"""Reading collectives out of programs: compiled HLO text and lowered StableHLO modules.

XLA prints a collective's replica groups in one of three forms, all read here:

- explicit lists, `replica_groups={{0,1,2,3},{4,5,6,7}}` (`shard_map` collectives);
- the iota form, `replica_groups=[2,4]<=[8]` or `[4,2]<=[2,4]T(1,0)`: `iota(8)` reshaped
  to the bracketed dims, transposed, reshaped to `[groups, size]`;
- the mesh form, `replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}` (XLA's own
  partitioner, e.g. a plain `jax.jit` with `NamedSharding`s), optionally with
  `device_ids=([2,2,2]T(0,2,1))` and sub-axes `'axis_0':(1)2`: the devices laid out on
  XLA's mesh, grouped along the braced axes. XLA's mesh is not the user's: its axes are
  numbered, and the groups are mapped back to the user's mesh axes by device id
  ([`eqxpar.inspect.Collective.axes`][]).

A lowered module (StableHLO) holds explicit lists, or (JAX 0.11) the mesh-axes form
`#stablehlo.replica_group_mesh_axes<mesh = @mesh_0, axes = [#stablehlo.axis_ref<name =
"model">]>`, whose mesh is one of the module's `sdy.mesh` declarations: read the same way as
the mesh form.

Device ids are logical (`use_global_device_ids=true`): positions in the program's device
assignment, i.e. in `mesh.devices.flat` for a program on that mesh.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

import numpy as np
from jax.sharding import AbstractMesh

from ._collective import Collective, group_size
from ._format import unwrap
from ._loops import hlo_computation_runs, stablehlo_trip_count

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
_HLO_OP_NAME = re.compile(r'metadata=\{[^}]*?op_name="((?:[^"\\]|\\.)*)"')
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_GROUPS_LIST = re.compile(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}")
_GROUPS_MESH = re.compile(
    r"replica_groups=mesh\[(?P<axes>[^\]]*)\]"
    r"(?:,\s*device_ids=\((?P<ids>\[[0-9,]*\](?:T\([0-9,]*\))?|[0-9,\s{}]*)\))?"
    r"\s*\{(?P<group>[^}]*)\}"
)
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{[0-9]+,[0-9]+\},?)*)\}")
_GROUPS_MAXIMAL = re.compile(r"replica_groups=maximal_mesh\[device_id=(\d+)\]")
_MESH_AXIS = re.compile(r"""['"]?([^'"=,\s]+)['"]?\s*=\s*(\d+)""")
_GROUP_AXIS = re.compile(r"""['"]?([^'":,\s]+)['"]?(?::\((\d+)\)(\d+))?""")


def collectives_in_hlo(text: str) -> tuple[Collective, ...]:
    """The collectives of a compiled program's HLO text (`compiled.as_text()`).

    Asynchronous pairs (`all-reduce-start` / `all-reduce-done`, as on GPUs) count once,
    with the sizes of the `-done` result. Replica groups are read in each form XLA prints
    (explicit lists, iota, mesh axes); each collective keeps its `op_name` for
    [`Collective.scopes`][eqxpar.inspect.Collective.scopes].

    **Arguments:**

    - `text`: HLO text, e.g. `jax.jit(f).lower(*args).compile().as_text()`.

    **Returns:**

    A tuple of [`eqxpar.inspect.Collective`][], in program order, one per execution: a
    collective in a loop body appears once per iteration where XLA knows the trip count
    (`known_trip_count`: `jax.lax.scan`, static-bound `fori_loop`), once otherwise.

    **Raises:**

    - `ValueError` if a replica-group list in the mesh form names an axis its mesh lacks.
    """
    found = []
    started: dict[str, tuple] = {}  # async start name -> (replica groups, op name, pairs)
    runs, owners = hlo_computation_runs(text)
    for line, owner in zip(text.splitlines(), owners):
        match = _HLO_OP.search(line)
        if match is None:
            continue
        name = _HLO_OP_NAME.search(line)
        info = (hlo_replica_groups(line), name.group(1) if name else None, _source_target_pairs(line))
        if match.group("async") == "-start":
            start = _HLO_NAME.match(line)
            if start:
                started[start.group(1)] = info
            continue
        if match.group("async") == "-done":
            operand = _HLO_OPERAND.search(line, match.end() - 1)
            groups, op_name, pairs = (
                started.get(operand.group(1), (None, None, None)) if operand else (None, None, None)
            )
            info = (groups, info[1] or op_name, info[2] or pairs)
        arrays = _HLO_ARRAY.findall(match.group("type"))
        shapes = tuple(tuple(int(d) for d in dims.split(",") if d) for _, dims in arrays)
        dtypes = tuple(dtype for dtype, _ in arrays)
        groups, op_name, pairs = info
        collective = Collective(match.group("op"), shapes, dtypes, group_size(groups), groups, op_name, pairs)
        found.extend([collective] * (runs.get(owner, 1) if owner else 1))
    return tuple(found)


def _source_target_pairs(line: str) -> tuple[tuple[int, int], ...] | None:
    """A collective-permute's `source_target_pairs={{0,1},{1,2}}`, or None."""
    pairs = _PAIRS.search(line)
    if pairs is None:
        return None
    return tuple((int(a), int(b)) for a, b in re.findall(r"\{([0-9]+),([0-9]+)\}", pairs.group(1)))


def hlo_replica_groups(line: str) -> tuple[tuple[int, ...], ...] | None:
    """The replica groups of one HLO instruction, in any form (see the module docstring);
    `()` for `replica_groups={}` (all devices), `None` when the line has none."""
    iota = _GROUPS_IOTA.search(line)
    if iota:
        count, size = int(iota.group(1)), int(iota.group(2))
        ids = _iota([int(d) for d in iota.group(3).split(",")], iota.group(4))
        return tuple(tuple(int(d) for d in g) for g in ids.reshape(count, size))
    mesh = _GROUPS_MESH.search(line)
    if mesh:
        return _mesh_groups(mesh.group("axes"), mesh.group("ids"), mesh.group("group"), line)
    maximal = _GROUPS_MAXIMAL.search(line)
    if maximal:
        return ((int(maximal.group(1)),),)
    listed = _GROUPS_LIST.search(line)
    if listed:
        groups = re.findall(r"\{([0-9,]*)\}", listed.group(1))
        return tuple(tuple(int(d) for d in g.split(",") if d) for g in groups)
    return None


def _iota(dims: list[int], perm: str | None) -> np.ndarray:
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids


def _mesh_groups(axes_text: str, ids_text: str | None, group_text: str, line: str) -> tuple[tuple[int, ...], ...]:
    """Groups of the mesh form: XLA's mesh `axes_text`, its device order `ids_text`, and the
    axes (or sub-axes `name:(pre)size`) in `group_text` that each group spans."""
    axes = [(n, int(k)) for n, k in _MESH_AXIS.findall(axes_text)]
    names, sizes = [n for n, _ in axes], [k for _, k in axes]
    total = math.prod(sizes)
    if ids_text is None:
        ids = np.arange(total)
    elif ids_text.startswith("["):
        dims_text, _, perm = ids_text[1:].partition("]")
        ids = _iota([int(d) for d in dims_text.split(",") if d], perm[2:-1] if perm.startswith("T(") else None)
    else:
        ids = np.array([int(d) for d in re.findall(r"\d+", ids_text)])
    ids = ids.reshape(sizes)
    refs: list[tuple[int, tuple[int, int] | None]] = []  # (mesh dim, (pre-size, size) or whole)
    for name, pre, size in _GROUP_AXIS.findall(group_text):
        if name not in names:
            raise ValueError(f"collectives_in_hlo: replica groups name axis {name!r}, not in mesh {axes}: {line!r}")
        refs.append((names.index(name), (int(pre), int(size)) if pre else None))
    # Split each mesh dim into the pieces its sub-axes select; note where each ref lands.
    dims: list[int] = []
    where: list[int] = [0] * len(refs)
    for dim, full in enumerate(sizes):
        mine = sorted((ref[1] or (1, full), i) for i, ref in enumerate(refs) if ref[0] == dim)
        covered = 1
        for (pre, size), i in mine:
            if pre != covered:  # a part of the axis the group does not span
                dims.append(pre // covered)
            where[i] = len(dims)
            dims.append(size)
            covered = pre * size
        if covered != full:
            dims.append(full // covered)
    grouped = list(where)
    order = [d for d in range(len(dims)) if d not in grouped] + grouped
    per_group = math.prod(dims[d] for d in grouped)
    table = ids.reshape(dims).transpose(order).reshape(-1, per_group)
    return tuple(tuple(int(d) for d in g) for g in table)


def mesh_of_lowered(lowered: Any) -> AbstractMesh | None:
    """The one mesh a lowered module declares (`sdy.mesh @mesh = <["data"=2, "model"=4]>`),
    as an `AbstractMesh` (names and sizes; device ids in collectives are positions in it)."""
    try:
        text = unwrap(lowered, "lowered").as_text()
    except Exception:  # not every stage or backend can say
        return None
    meshes = {
        tuple((n, int(k)) for n, k in re.findall(r'"([^"]+)"\s*=\s*(\d+)', axes))
        for axes in re.findall(r"^\s*sdy\.mesh\s+@\S+\s*=\s*<\[(.*?)\]", text, re.MULTILINE)
    }
    meshes.discard(())
    if len(meshes) != 1:
        return None
    (axes,) = meshes
    return AbstractMesh(tuple(k for _, k in axes), tuple(n for n, _ in axes))


# ----------------------------------------------------------------------------------------
# Lowered module (StableHLO): walked as MLIR operations (jax.extend.mlir), not parsed.

_STABLEHLO_KINDS = {
    "stablehlo.all_reduce": "all-reduce",
    "stablehlo.all_gather": "all-gather",
    "stablehlo.reduce_scatter": "reduce-scatter",
    "stablehlo.all_to_all": "all-to-all",
    "stablehlo.collective_permute": "collective-permute",
}
# Operations whose body JAX lowers under a fresh name stack, named after the operation.
_NAMING = ("sdy.manual_computation", "func.call")


def collectives_in_lowered(lowered: Any) -> tuple[Collective, ...]:
    """The collectives of a lowered function's StableHLO module.

    Walked from the entry function, so that a function called from several places (an
    inner `jax.jit`) counts once per call; a collective in a loop body counts once per
    iteration where the loop counts a variable from a constant to a constant (JAX's
    `scan` and static-bound `fori_loop`), once otherwise. Each collective's
    `op_name` is its location's name stack, joined with those of the `shard_map` and calls
    around it.

    **Arguments:**

    - `lowered`: a `jax.stages.Lowered` (from `jax.jit(f).lower(...)` or
      `eqx.filter_jit(f).lower(...)`).

    **Returns:**

    A tuple of [`eqxpar.inspect.Collective`][], in program order.
    """
    from jax.extend.mlir import ir

    module = unwrap(lowered, "lowered").compiler_ir("stablehlo")
    found: list[Collective] = []
    with module.context:
        functions, meshes = {}, {}
        for op in module.body.operations:
            if op.operation.name == "func.func":
                functions[ir.StringAttr(op.operation.attributes["sym_name"]).value] = op.operation
            elif op.operation.name == "sdy.mesh":
                meshes[ir.StringAttr(op.operation.attributes["sym_name"]).value] = str(op.operation)
        # From the entry point, following calls: JAX emits an inner `jax.jit` (or a cached
        # function) once as a private function and calls it from every place it is used.
        entry = functions.get("main")
        for op, prefix, times in _walk(ir, entry if entry is not None else module.operation, functions):
            kind = _STABLEHLO_KINDS.get(op.name)
            if kind is None:
                continue
            types = [ir.RankedTensorType(r.type) for r in op.results]
            groups = None
            if "replica_groups" in op.attributes:
                attribute = op.attributes["replica_groups"]
                try:
                    table = np.array(ir.DenseIntElementsAttr(attribute))
                except ValueError:  # not a list: JAX 0.11's mesh-axes form
                    groups = _stablehlo_mesh_axes_groups(str(attribute), meshes)
                else:  # StableHLO pads uneven groups with -1.
                    groups = tuple(tuple(int(d) for d in row if d >= 0) for row in table.reshape(table.shape[0], -1))
            pairs = None
            if "source_target_pairs" in op.attributes:
                table = np.array(ir.DenseIntElementsAttr(op.attributes["source_target_pairs"]))
                pairs = tuple((int(a), int(b)) for a, b in table.reshape(-1, 2))
            found.extend(
                [
                    Collective(
                        kind,
                        tuple(tuple(int(d) for d in t.shape) for t in types),
                        tuple(str(t.element_type) for t in types),
                        group_size(groups),
                        groups,
                        "/".join(p for p in (*prefix, _location_name(op)) if p) or None,
                        pairs,
                    )
                ]
                * times
            )
    return tuple(found)


_SDY_MESH = re.compile(r"<\[(?P<axes>[^\]]*)\](?:,\s*device_ids=\[(?P<ids>[0-9,\s]*)\])?>")
_AXIS_REF = re.compile(r'axis_ref<name\s*=\s*"([^"]+)"(?:,\s*sub_axis_info\s*=\s*<(\d+)\s*,\s*(\d+)>)?>')


def _stablehlo_mesh_axes_groups(text: str, meshes: dict[str, str]) -> tuple[tuple[int, ...], ...]:
    """Groups of `#stablehlo.replica_group_mesh_axes<mesh = @name, axes = [...]>` (JAX 0.11's
    StableHLO), over the module's `sdy.mesh @name = <["data"=2, "model"=4]>`."""
    name = re.search(r"mesh\s*=\s*@([\w.$-]+)", text)
    declared = _SDY_MESH.search(meshes.get(name.group(1), "")) if name else None
    refs = _AXIS_REF.findall(text)
    if declared is None or not refs or len(refs) != text.count("axis_ref<"):
        raise ValueError(
            f"collectives_in_lowered: cannot read the replica groups {text!r} (meshes {sorted(meshes)}); "
            f"read the compiled program's collectives instead (eqxpar.inspect.collectives_in_hlo)."
        )
    group = ",".join(f"'{n}':({pre}){size}" if pre else f"'{n}'" for n, pre, size in refs)
    ids = declared.group("ids")
    return _mesh_groups(declared.group("axes"), None if not ids else f"{{{ids}}}", group, text)


def _location_name(op) -> str:
    """The name stack in an operation's location (`loc("attention/psum"(...))`), or ""."""
    try:
        return op.location.name_str
    except (AttributeError, ValueError, TypeError):  # not a name location
        return ""


def _walk(ir, operation, functions: dict, calling: tuple = (), prefix: tuple = (), times: int = 1) -> Iterable:
    """(operation, name prefix, times it runs) for every operation nested in `operation`,
    with each `func.call` replaced by the body of the function it calls (once per call)
    and a `stablehlo.while` body run its trip count times (once if it cannot be read)."""
    for index, region in enumerate(operation.regions):
        inside = times
        if operation.name == "stablehlo.while" and index == 1:
            count = stablehlo_trip_count(ir, operation)
            inside = times * (1 if count is None else count)
        for block in region.blocks:
            for op in block.operations:
                op = op.operation
                inner = (*prefix, _location_name(op)) if op.name in _NAMING else prefix
                if op.name == "func.call":
                    callee = ir.FlatSymbolRefAttr(op.attributes["callee"]).value
                    if callee in functions and callee not in calling:
                        yield from _walk(ir, functions[callee], functions, (*calling, callee), inner, inside)
                        continue
                yield op, prefix, inside
                yield from _walk(ir, op, functions, calling, inner, inside)
