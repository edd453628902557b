"""How much of a model a plan splits: `parallelize` warns (or, with `strict=True`, raises)
when a plan splits nothing or leaves more than half of the parameter bytes whole, naming the
classes it could not plan, the largest layers that stayed whole and why, and the way to
teach it a class, [`eqxpar.nn.register_style`][] (issues 20 and 41: the automatic plan split
0 of 17 layers of a ViT with its own attention class, and nothing of a ResNet, and said
nothing)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

from ._base import TensorParallelLayer
from ._plan import describe, path_text

__all__ = ["check_coverage"]

# Above this share of the parameter bytes left whole, the plan is reported.
MOST = 0.5

_CONTAINERS = (eqx.nn.Sequential, eqx.nn.Lambda)


def _params(node: Any) -> list:
    return jax.tree.leaves(eqx.filter(node, eqx.is_inexact_array))


def _size(node: Any) -> int:
    return sum(int(x.size) for x in _params(node))


def _bytes(node: Any) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in _params(node))


def _why_whole(node: Any, style: str, note: str, explicit: bool) -> str:
    """Why a layer stayed whole, in a few words."""
    if note:
        return note
    if explicit and style == "replicate":
        return "the plan keeps it whole (it names it 'replicate', or does not name it)"
    if eqx.is_array(node):
        return "a loose array, not in an equinox.nn layer"
    if isinstance(node, eqx.nn.Linear):
        return (
            "eqx.nn.Linear, which the automatic plan does not split (it splits MultiheadAttention, "
            "depth-1 MLP and Embedding layers): pair Linears as 'column' then 'row' in an explicit plan"
        )
    return f"{type(node).__name__} has no tensor-parallel form"


def _unplanned(path: tuple, node: Any, by_path: dict) -> tuple[type, tuple] | None:
    """The class the plan could not plan for a layer left whole, and where it sits.

    A Linear or a loose array is a part of the module that holds it (the innermost one below
    the model, `eqx.nn.Sequential` skipped), which uses it in a way the plan does not know
    (a ViT's own attention class holding `qkv` and `proj` Linears): that module's class. A
    Linear held by the model itself is just a Linear; a loose array of the model, the
    model's class. Any other layer (a `Conv2d`, a norm) is its own class."""
    if not (isinstance(node, eqx.nn.Linear) or eqx.is_array(node)):
        return type(node), path
    for i in range(len(path) - 1, 0, -1):
        owner = by_path.get(path[:i])
        if isinstance(owner, eqx.Module) and not isinstance(owner, _CONTAINERS):
            return type(owner), path[:i]
    if isinstance(node, eqx.nn.Linear):
        return type(node), path
    root = by_path.get(())
    return (type(root), ()) if isinstance(root, eqx.Module) else None


def _classes(whole: list, by_path: dict, plannable: Callable[[Any], bool]) -> tuple[str, list[type]]:
    """`Attention (at attn), Conv2d (at patch)`: the classes that hold the whole bytes of
    layers the automatic plan has no style for, most bytes first, each with up to two of its
    places; and the classes in that order. (A layer it could split, kept whole by an explicit
    plan, is the plan's choice, not a class it could not plan.)"""
    found: dict[type, list] = {}  # class -> [whole bytes, places]
    for p, node, _style, _n, size in whole:
        hit = None if plannable(node) else _unplanned(p, node, by_path)
        if hit is None:
            continue
        cls, where = hit
        entry = found.setdefault(cls, [0, []])
        entry[0] += size
        if where not in entry[1]:
            entry[1].append(where)
    ordered = sorted(found.items(), key=lambda kv: -kv[1][0])
    parts = []
    for cls, (_, places) in ordered[:6]:
        at = ", ".join(path_text(w) for w in places[:2]) + (f" and {len(places) - 2} more" if len(places) > 2 else "")
        parts.append(f"{cls.__name__} (at {at})")
    more = f", and {len(ordered) - 6} more" if len(ordered) > 6 else ""
    return ", ".join(parts) + more, [cls for cls, _ in ordered]


def check_coverage(
    seq: list, notes: dict, by_path: dict, plannable: Callable[[Any], bool], *, explicit: bool, strict: bool
) -> None:
    """Warn (`strict`: raise a `ValueError` with the same text) if the plan `seq`
    (`(path, node, style)` in field order) splits no layer or leaves more than half of the
    parameter bytes whole. `by_path`: every node of the model by its path; `plannable`:
    whether the automatic plan has a style that splits a layer."""
    sizes = [(p, node, style, _size(node), _bytes(node)) for p, node, style in seq]
    total = sum(b for *_, b in sizes)

    def is_split(node: Any, style: str) -> bool:
        return style != "replicate" or isinstance(node, TensorParallelLayer)

    split = sum(b for _, node, style, _, b in sizes if is_split(node, style))
    layers = sum(1 for _, node, style, _, _ in sizes if is_split(node, style))
    if total == 0 or (layers and split >= MOST * total):
        return
    whole = sorted((s for s in sizes if not is_split(s[1], s[2])), key=lambda s: -s[4])
    by_reason: dict[str, list[str]] = {}  # each reason once, its layers largest first
    for p, node, style, n, _ in whole[:8]:
        why = _why_whole(node, style, notes.get(p, ""), explicit)
        by_reason.setdefault(why, []).append(f"{path_text(p)} ({describe(node)}, {n:,} parameters)")
    listed = "; ".join(f"{', '.join(where)}: {why}" for why, where in by_reason.items())
    more = f"; and {len(whole) - 8} more" if len(whole) > 8 else ""
    classes, order = _classes(whole, by_path, plannable)
    # The example names the user's own class first: the one register_style is meant for.
    ours = [c for c in order if not c.__module__.startswith("equinox")]
    others = [c for c in order if c is not eqx.nn.Linear]  # a bare Linear: pair it in a plan
    name = (ours + others)[0].__name__ if ours + others else "YourLayer"
    text = (
        f"parallelize: the {'plan' if explicit else 'automatic plan'} splits {layers} of "
        f"{len(sizes)} layers, {split / total:.0%} of the parameter bytes ({split:,} of {total:,} bytes): "
        f"the model would train with most of its parameters whole on every device. "
        + (f"Classes it could not plan, most whole bytes first: {classes}. " if classes else "")
        + f"Whole, largest first: {listed}{more}. Teach the automatic plan a class with "
        f"eqxpar.nn.register_style(name, {name}, convert, split=...), where convert(layer, "
        f"axis_name) returns its tensor-parallel form (every {name} is then split); or name "
        f"the layers to split in an explicit plan (e.g. {{'blocks[*].attn.qkv': 'column', "
        f"'blocks[*].attn.proj': 'row'}}); or use data parallelism "
        f"(eqxpar.train.data_parallel_step) for a model this plan cannot split."
    )
    if strict:
        raise ValueError(text + " (strict=True)")
    warnings.warn(text, UserWarning, stacklevel=3)
