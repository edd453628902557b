"""How much of a model a plan splits: `parallelize` warns (or, with `strict=True`, raises)
when a plan splits nothing or leaves most of the parameters whole, naming the largest layers
that stayed whole and why (issue 20: the automatic plan split 0 of 17 layers of a ViT, and
said nothing)."""

from __future__ import annotations

import warnings
from typing import Any

import equinox as eqx
import jax

from ._base import TensorParallelLayer
from ._plan import describe, path_text

__all__ = ["check_coverage"]

# Below this share of the parameters split, the plan is reported.
MOST = 0.5


def _size(node: Any) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(eqx.filter(node, eqx.is_inexact_array)))


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


def check_coverage(seq: list, notes: dict, *, explicit: bool, strict: bool) -> None:
    """Warn (`strict`: raise a `ValueError`) if the plan `seq` (`(path, node, style)` in
    field order) splits no layer or under half of the parameters."""
    sizes = [(p, node, style, _size(node)) for p, node, style in seq]
    total = sum(n for *_, n in sizes)
    split = sum(n for _, node, style, n in sizes if style != "replicate" or isinstance(node, TensorParallelLayer))
    layers = sum(1 for _, node, style, _ in sizes if style != "replicate" or isinstance(node, TensorParallelLayer))
    if total == 0 or (layers and split >= MOST * total):
        return
    whole = sorted((s for s in sizes if s[2] == "replicate"), key=lambda s: -s[3])
    by_reason: dict[str, list[str]] = {}  # each reason once, its layers largest first
    for p, node, style, n in whole[:8]:
        why = _why_whole(node, style, notes.get(p, ""), explicit)
        by_reason.setdefault(why, []).append(f"{path_text(p)} ({describe(node)}, {n:,} parameters)")
    listed = "; ".join(f"{', '.join(where)}: {why}" for why, where in by_reason.items())
    more = f"; and {len(whole) - 8} more" if len(whole) > 8 else ""
    text = (
        f"parallelize: the {'plan' if explicit else 'automatic plan'} splits {layers} of "
        f"{len(sizes)} layers, {split / total:.0%} of the parameters ({split:,} of {total:,}): "
        f"the model would train with most of its parameters whole on every device. Whole, "
        f"largest first: {listed}{more}. Name the layers to split in an explicit plan (e.g. "
        f"{{'blocks[*].attn.qkv': 'column', 'blocks[*].attn.proj': 'row'}}), or use data "
        f"parallelism (eqxpar.train.data_parallel_step) for a model this plan cannot split."
    )
    if strict:
        raise ValueError(text + " (strict=True)")
    warnings.warn(text, UserWarning, stacklevel=3)
