"""One collective operation: its kind, arrays, replica groups, mesh axes and named scope."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
from jax.sharding import AbstractMesh, Mesh

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
"""The collective kinds a report counts, in HLO spelling."""

# Name-stack components JAX adds by itself (not a `jax.named_scope` of the user's):
# mapping, remat, loops, calls. `jit(...)` components are left out too.
_JAX_COMPONENTS = frozenset(
    {
        "shard_map",
        "checkpoint",
        "rematted_computation",
        "remat",
        "while",
        "body",
        "cond",
        "closed_call",
        "core_call",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "eval_jaxpr",  # JAX 0.11: around a scan body (`loop/eval_jaxpr/step`)
    }
)
# Transformations JAX wraps around a component: `transpose(jvp(dense))` is scope `dense`.
_TRANSFORMS = frozenset({"jvp", "transpose", "vmap", "linearize", "vjp", "pmap"})


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective operation in a program.

    `shapes` and `dtypes` are those of the operation's **result** on one device: for an
    all-reduce the array reduced, for an all-gather the gathered array, for a
    reduce-scatter the slice each device keeps. A collective over several arrays at once
    (XLA's combined form) has several `shapes`.

    `elements` and `bytes` follow the module's bytes convention instead: for a
    reduce-scatter they count the full operand (the result times the group size), what
    each device contributes; for every other kind they equal the result's.
    `result_elements` and `result_bytes` are always the result's.
    """

    kind: str
    """One of [`eqxpar.inspect.COLLECTIVE_KINDS`][]."""
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    group_size: int | None
    """Devices per replica group (how many take part in each reduction), when known."""
    replica_groups: tuple[tuple[int, ...], ...] | None = None
    """The groups of (logical) device ids that communicate, when known; `()` when the
    program says "all devices in one group"."""
    op_name: str | None = None
    """JAX's name for the operation, when the program records it: the name stack
    (`jit(f)/block_0/attention/psum`), from the HLO `metadata={op_name=...}` or the
    StableHLO location. See `scopes`."""
    source_target_pairs: tuple[tuple[int, int], ...] | None = None
    """For a collective-permute: the `(source, target)` device ids each value travels
    between, when known."""

    @property
    def scopes(self) -> tuple[str, ...]:
        """The `jax.named_scope`s (layers) that issued this collective, e.g.
        `("block_0/attention",)`: `op_name` without the operation itself, JAX's own
        components (`jit(...)`, `shard_map`, `checkpoint`, loops) and transformations
        (`jvp(...)`, `transpose(...)`, `vmap(...)`). A collective XLA combined from several
        has one scope per origin; `()` when unnamed or unknown."""
        return named_scopes(self.op_name)

    @property
    def scope(self) -> str:
        """`scopes` as one label: `"a + b"` for a combined collective, `""` for none."""
        return " + ".join(self.scopes)

    @property
    def result_elements(self) -> int:
        """Number of result elements per device (summed over a combined collective's arrays)."""
        return sum(math.prod(s) for s in self.shapes)

    @property
    def result_bytes(self) -> int:
        """Result bytes per device."""
        return sum(math.prod(s) * itemsize(d) for s, d in zip(self.shapes, self.dtypes))

    @property
    def _scale(self) -> int:
        # A reduce-scatter's operand is its result times the group size. When the group is
        # unknown (`replica_groups={}` in HLO), the result size is all we can say.
        return (self.group_size or 1) if self.kind == "reduce-scatter" else 1

    @property
    def elements(self) -> int:
        """Elements per device by the bytes convention (a reduce-scatter's operand)."""
        return self.result_elements * self._scale

    @property
    def bytes(self) -> int:
        """Bytes per device by the bytes convention (a reduce-scatter's operand)."""
        return self.result_bytes * self._scale

    def axes(self, mesh: Mesh | AbstractMesh) -> tuple[str, ...] | None:
        """The mesh axes this collective runs over, in the mesh's order.

        Read from the replica groups (for a collective-permute, from its source-target
        pairs, each pair a group): an axis is named when devices in one group differ in
        their position along it. `()` when every group holds one device (the collective
        moves nothing); `None` when the groups are unknown (HLO text without replica
        groups). Device ids are positions in `mesh.devices.flat`, which is
        how `jax.jit` numbers the devices of a program on that mesh.

        **Arguments:**

        - `mesh`: the mesh the program runs on.

        **Returns:**

        A tuple of axis names, `()`, or `None`.

        **Raises:**

        - `ValueError` if a device id is outside the mesh (not the program's mesh).
        """
        groups = self.source_target_pairs if self.kind == "collective-permute" else self.replica_groups
        if groups is None:
            return None
        names = tuple(mesh.axis_names)
        sizes = tuple(mesh.shape[a] for a in names)
        if groups == ():  # one group of all devices
            return tuple(a for a, n in zip(names, sizes) if n > 1)
        total = math.prod(sizes)
        varying = set()
        for group in groups:
            if any(d >= total for d in group):
                raise ValueError(
                    f"Collective.axes: device id {max(group)} is outside the mesh of {total} "
                    f"devices {dict(mesh.shape)}; pass the mesh the program was compiled for."
                )
            coords = np.array(np.unravel_index(np.asarray(group, int), sizes)).reshape(len(sizes), -1)
            varying |= {names[i] for i in range(len(names)) if len(set(coords[i].tolist())) > 1}
        return tuple(a for a in names if a in varying)

    def describe(self) -> str:
        """One line: kind, arrays and group size."""
        arrays = ", ".join(f"{d}{list(s)}" for s, d in zip(self.shapes, self.dtypes))
        group = f" over {self.group_size} devices" if self.group_size else ""
        return f"{self.kind} {arrays}{group}"


def itemsize(dtype: str) -> int:
    """Bytes per element for an HLO (`f32`, `bf16`, `pred`, `s8`, `c64`) or MLIR (`f32`,
    `i1`, `ui8`, `complex<f32>`) element type name."""
    if dtype in ("pred", "i1"):
        return 1
    if dtype.startswith("complex<"):
        return 2 * itemsize(dtype[len("complex<") : -1])
    bits = re.search(r"\d+", dtype)
    if bits is None:
        raise ValueError(f"unknown element type {dtype!r}")
    return max(1, int(bits.group()) // 8)


def group_size(groups: tuple[tuple[int, ...], ...] | None) -> int | None:
    """Devices per group (`None` when the groups are unknown or "all devices")."""
    return len(groups[0]) if groups else None


def _split(text: str, sep: str) -> list[str]:
    """`text` split at `sep` outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _paths(name: str) -> list[list[str]]:
    """The name stacks in one op name; XLA writes a combined op's origins as
    `prefix/(first/suffix:second/suffix)`."""
    parts = _split(name, "/")
    for i, part in enumerate(parts):
        if part.startswith("(") and part.endswith(")") and len(_split(part[1:-1], ":")) > 1:
            rest = "/".join(parts[i + 1 :])
            out = []
            for alternative in _split(part[1:-1], ":"):
                for tail in _paths(alternative + ("/" + rest if rest else "")):
                    out.append(parts[:i] + tail)
            return out
    return [parts]


def _components(part: str) -> list[str]:
    """One name-stack component without JAX's wrappers: `transpose(jvp(dense))` -> `dense`,
    `jit(f)` and `shard_map` -> nothing."""
    match = re.fullmatch(r"([A-Za-z_]\w*)\((.*)\)", part)
    if match and match.group(1) in ("jit", "pjit"):
        return []
    if match and match.group(1) in _TRANSFORMS:
        return [c for p in _split(match.group(2), "/") for c in _components(p)]
    return [] if part in _JAX_COMPONENTS or not part else [part]


def named_scopes(op_name: str | None) -> tuple[str, ...]:
    """The user's named scopes in a JAX op name (see `Collective.scopes`), one per origin.

    **Arguments:**

    - `op_name`: e.g. `"jit(step)/transpose(jvp(block_0))/shard_map/attention/psum"`.

    **Returns:**

    E.g. `("block_0/attention",)`; `()` for `None` or a name without scopes.
    """
    if not op_name:
        return ()
    found: list[str] = []
    for path in _paths(op_name):
        kept: list[str] = []
        for part in path[:-1]:  # the last component is the operation (psum, dot_general)
            for c in _components(part):
                if not kept or kept[-1] != c:  # JAX repeats a scope around a transformation
                    kept.append(c)
        scope = "/".join(kept)
        if scope and scope not in found:
            found.append(scope)
    return tuple(found)
