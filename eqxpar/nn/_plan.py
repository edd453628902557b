"""Plans for `eqxpar.nn.parallelize`: the styles, the model's layers by path, and the table.

A plan maps parts of a model to a *style*. A part is named by a path string in the form
`jax.tree_util.keystr` prints, without the leading dot (`"head"`, `"blocks[0].mlp"`,
`"layers['enc']"`), where `*` stands for any one key (`"blocks[*].mlp"`), or by a
where-function as in `eqx.tree_at` (`lambda m: m.head`, `lambda m: [b.mlp for b in m.blocks]`).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import equinox as eqx
import jax

from ._base import TensorParallelLayer
from ._plan_stacked import VmappedStack

__all__ = ["Plan", "PlanRow", "STYLES", "Style", "REGISTERED", "Registered"]


@dataclasses.dataclass(frozen=True)
class Style:
    """A `parallelize` style: the dense layer it takes, what it does, and the collectives
    (kinds as [`eqxpar.inspect.COLLECTIVE_KINDS`][] spells them) it runs over the model
    axis: `forward` in the forward pass, `backward` what the backward pass adds (the
    gradient of a differentiated input). `tests/test_parallelize_styles.py` compiles each
    style's layer and checks its collectives against these."""

    takes: str
    forward: tuple[str, ...]
    backward: tuple[str, ...]
    does: str

    def text(self, direction: str) -> str:
        """`"all-reduce"`, or `"none"`, for the `"forward"` or `"backward"` column of a table."""
        return " + ".join(getattr(self, direction)) or "none"


# Every style, in the order the tables list them.
STYLES: dict[str, Style] = {
    "column": Style("eqx.nn.Linear", (), ("all-reduce",), "output features split; output stays split"),
    "column_gathered": Style("eqx.nn.Linear", ("all-gather",), ("all-reduce",), "output features split, then gathered"),
    "row": Style("eqx.nn.Linear", ("all-reduce",), (), "input features split (input from a 'column')"),
    "vocab": Style("eqx.nn.Embedding", ("all-reduce",), (), "vocabulary rows split"),
    "mlp": Style("eqx.nn.MLP (depth=1)", ("all-reduce",), ("all-reduce",), "hidden units split"),
    "attention": Style("eqx.nn.MultiheadAttention", ("all-reduce",), ("all-reduce",), "heads split"),
    "replicate": Style("any layer", (), (), "a whole copy on every device"),
}


@dataclasses.dataclass(frozen=True)
class Registered:
    """A style added with [`eqxpar.nn.register_style`][]: the layer class it takes, the
    function that makes its tensor-parallel form, the attribute the model axis divides, and
    whether the automatic plan uses it."""

    takes: type
    convert: Callable[[Any, str], TensorParallelLayer]
    split: str
    auto: bool


# The registered styles by name (their `Style` rows are in STYLES too).
REGISTERED: dict[str, Registered] = {}

# Layers that `parallelize` treats as one unit (never looks inside unless a plan entry does).
_UNIT_TYPES = (eqx.nn.Linear, eqx.nn.MLP, eqx.nn.MultiheadAttention, eqx.nn.Embedding, TensorParallelLayer)
_CONTAINERS = (eqx.nn.Sequential, eqx.nn.Lambda)

Path = tuple  # a tuple of jax key entries (GetAttrKey, SequenceKey, DictKey, ...)


def path_text(path: Path) -> str:
    """`blocks[0].mlp` for a key path (`<root>` for the empty one)."""
    text = jax.tree_util.keystr(tuple(path))
    return (text[1:] if text.startswith(".") else text) or "<root>"


def children(node: Any) -> list[tuple[Path, Any]]:
    """The immediate sub-nodes of `node` with their one-step key paths (none for a leaf)."""
    kids = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)[0]
    if len(kids) == 1 and kids[0][0] == () and kids[0][1] is node:
        return []
    return kids


def walk(tree: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Every node of `tree` (the root first, then depth-first in leaf order) with its path."""
    yield path, tree
    for key, child in children(tree):
        yield from walk(child, path + key)


def is_unit(node: Any) -> bool:
    """Whether `node` is a layer `parallelize` plans as a whole: the convertible layers, any
    other `equinox.nn` layer (norms, convolutions), and tensor-parallel layers."""
    if isinstance(node, _UNIT_TYPES) or any(isinstance(node, r.takes) for r in REGISTERED.values()):
        return True
    return (
        isinstance(node, eqx.Module)
        and type(node).__module__.startswith("equinox.nn")
        and not isinstance(node, _CONTAINERS)
    )


def has_arrays(node: Any) -> bool:
    return bool(jax.tree.leaves(eqx.filter(node, eqx.is_array)))


def units(tree: Any, opened: set[Path], path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """The model's layers and loose arrays in field order: the parts a plan gives styles to.

    A unit whose path is in `opened` (a plan entry names something inside it) is walked
    into instead."""
    if (is_unit(tree) and path not in opened) or eqx.is_array(tree):
        yield path, tree
        return
    for key, child in children(tree):
        yield from units(child, opened, path + key)


def stacked_weight(node: Any) -> tuple[str, tuple[int, ...]] | None:
    """Where `node` holds layers stacked with `eqx.filter_vmap` (to run with `lax.scan`).

    Such a stack's weights carry a leading axis that counts layers, which no mesh axis may
    split and which an FSDP unit cannot gather on call:
    [`eqxpar.nn.parallelize`][] splits these stacks per layer, and the train steps refuse one
    named as an FSDP unit. Layers inside eqxpar's tensor-parallel layers (such as
    [`eqxpar.nn.StackedLayers`][]) keep their own stacks and are not looked into.

    **Arguments:**

    - `node`: a model or any part of one (a PyTree of Equinox modules).

    **Returns:**

    `(path, shape)` of the first `eqx.nn.Linear` or `eqx.nn.Embedding` weight in `node`
    (itself included) with axes in front of its own two, or of the first array of a stack
    `parallelize` already split per layer ([`eqxpar.nn.VmappedStack`][]); `path` is where
    it sits inside `node` (e.g. `"blocks.mlp.weight"`). `None` if `node` holds no stack.
    """
    inside_tp: list[Path] = []  # tensor-parallel layers (StackedLayers) keep their own stacks
    for path, sub in walk(node):
        if any(path[: len(t)] == t for t in inside_tp):
            continue
        if isinstance(sub, VmappedStack):  # a stack parallelize split per layer: still a stack
            inner, leaf = next((k, x) for k, x in jax.tree_util.tree_flatten_with_path(sub)[0] if eqx.is_array(x))
            return path_text(path + inner).replace("<root>", ""), tuple(leaf.shape)
        if isinstance(sub, TensorParallelLayer):
            inside_tp.append(path)
            continue
        weight = getattr(sub, "weight", None)
        if (
            isinstance(sub, (eqx.nn.Linear, eqx.nn.Embedding))
            and weight is not None
            and eqx.is_array(weight)
            and weight.ndim > 2
        ):
            return ".".join(filter(None, [path_text(path).replace("<root>", ""), "weight"])), tuple(weight.shape)
    return None


def _pattern(text: str) -> re.Pattern:
    text = text.strip()
    text = text[1:] if text.startswith(".") else text
    if text in ("", "<root>"):
        return re.compile(re.escape("<root>"))
    return re.compile(re.escape(text).replace(r"\*", r"[^.\[\]]+"))


def resolve(entry: str | Callable, tree: Any, nodes: list[tuple[Path, Any]]) -> list[Path]:
    """The paths a plan key names: a path string (with `*` wildcards) or a where-function.

    **Raises:** `ValueError` naming the key if it names nothing in the model.
    """
    if isinstance(entry, str):
        pattern = _pattern(entry)
        found = [p for p, _ in nodes if pattern.fullmatch(path_text(p))]
        if not found:
            names = [path_text(p) for p, n in nodes if is_unit(n)]
            close = difflib.get_close_matches(entry.strip().lstrip("."), names, n=3)
            hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
            raise ValueError(
                f"parallelize: the plan names {entry!r}, which is not a path in the model.{hint} "
                f"Paths are written as jax.tree_util.keystr prints them without the leading dot "
                f"(e.g. 'blocks[0].mlp'), with '*' for any one key (e.g. 'blocks[*].mlp'); "
                f"the model's layers are: {', '.join(names[:12])}{' ...' if len(names) > 12 else ''}."
            )
        return found
    if not callable(entry):
        raise ValueError(
            f"parallelize: a plan key must be a path string (e.g. 'blocks[0].mlp') or a "
            f"where-function (e.g. lambda m: m.head), got {type(entry).__name__} {entry!r:.60}."
        )
    name = _where_name(entry)
    try:
        picked = entry(tree)
    except Exception as e:  # the user's function failed on this model
        raise ValueError(f"parallelize: the plan's {name} failed on the model: {e!r}") from None
    found = _by_identity(picked, nodes)
    if not found and isinstance(picked, (tuple, list)):
        found = [p for item in picked for p in _by_identity(item, nodes)]
        if len(found) < len(picked):
            found = []
    if not found:
        raise ValueError(
            f"parallelize: the plan's {name} returned {type(picked).__name__}, "
            f"which is not a layer (or a tuple/list of layers) of the model. Return a part of the "
            f"model as eqx.tree_at's where does, e.g. lambda m: m.blocks[0].mlp."
        )
    return found


def _where_name(fn: Callable) -> str:
    """`where-function <lambda> (model.py:12)`: where the user wrote it."""
    code = getattr(fn, "__code__", None)
    where = f" ({code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno})" if code else ""
    return f"where-function {getattr(fn, '__name__', type(fn).__name__)}{where}"


def _by_identity(item: Any, nodes: list[tuple[Path, Any]]) -> list[Path]:
    if not (isinstance(item, (eqx.Module, tuple, list, dict)) or eqx.is_array(item)):
        return []
    return [p for p, n in nodes if n is item]


def describe(node: Any) -> str:
    """A short description of a layer for the plan table (`Linear(64->96)`)."""
    if isinstance(node, TensorParallelLayer):
        return f"{type(node).__name__} (already parallel)"
    if isinstance(node, eqx.nn.Linear):
        return f"Linear({node.in_features}->{node.out_features})"
    if isinstance(node, eqx.nn.MLP):
        return f"MLP({node.in_size}->{node.width_size}->{node.out_size}, depth {node.depth})"
    if isinstance(node, eqx.nn.MultiheadAttention):
        return f"MultiheadAttention({node.num_heads} heads, {node.query_size}->{node.output_size})"
    if isinstance(node, eqx.nn.Embedding):
        return f"Embedding({node.num_embeddings}x{node.embedding_size})"
    if eqx.is_array(node):
        return f"array {node.dtype}{list(node.shape)}"
    return type(node).__name__


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """One layer of a [`eqxpar.nn.Plan`][]: where it is, what it is, how it is split."""

    path: str
    layer: str
    style: str
    split: str  # e.g. "num_heads=8" (and "-> 2 per device" when the axis size is known)
    forward: str  # the collective its forward pass does over the model axis
    backward: str
    note: str = ""


class Plan(Mapping):
    """The plan [`eqxpar.nn.parallelize`][] applied: a read-only mapping from every layer's
    path to its style, with the details in `rows` and a table as `str(plan)`.

    Being a mapping, a plan can be edited and passed back:
    `parallelize(model, {**plan, "head": "column_gathered"})`.
    """

    def __init__(self, rows: tuple[PlanRow, ...], axis_name: str, axis_size: int | None = None):
        self.rows = tuple(rows)
        self.axis_name = axis_name
        self.axis_size = axis_size
        self._styles = {row.path: row.style for row in self.rows if row.style in STYLES}

    def __getitem__(self, path: str) -> str:
        return self._styles[path]

    def __iter__(self):
        return iter(self._styles)

    def __len__(self) -> int:
        return len(self._styles)

    def __repr__(self) -> str:
        return f"Plan({self._styles!r}, axis_name={self.axis_name!r})"

    def __str__(self) -> str:
        size = "" if self.axis_size is None else f"={self.axis_size}"
        head = ("path", "layer", "style", f"split over {self.axis_name}{size}", "forward", "backward")
        rows = [(r.path, r.layer, r.style, r.split, r.forward, r.backward) for r in self.rows]
        widths = [max(len(x) for x in column) for column in zip(head, *rows)]
        lines = ["  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip() for line in (head, *rows)]
        lines.insert(1, "  ".join("-" * w for w in widths))
        notes = [f"  {r.path}: {r.note}" for r in self.rows if r.note]
        return "\n".join(lines + (["notes:", *notes] if notes else []))
