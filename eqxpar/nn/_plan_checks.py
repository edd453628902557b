"""The structural checks `eqxpar.nn.parallelize` runs on a plan before converting anything:
no part of a composite `equinox.nn` layer split on its own, every split output meeting a
layer that takes it split, and which layers are stacked with `eqx.filter_vmap` (split per
layer) or stacked in a way that cannot be."""

from __future__ import annotations

from typing import Any

import equinox as eqx

from ._base import TensorParallelLayer
from ._plan import describe, has_arrays, is_unit, path_text, stacked_weight
from ._plan_stacked import leading_sizes

__all__ = ["check_not_inside_composite", "check_pairs", "stack_size", "stacked_problem", "stacks"]


def check_not_inside_composite(path: tuple, style: str, by_path: dict) -> None:
    """Refuse to split a part of an `equinox.nn` layer whose own code reshapes what its parts
    compute: `eqx.nn.MultiheadAttention` cuts its projections' outputs into heads with its
    own `num_heads`, so a "column" `value_proj` (and a "row" `output_proj`) gives each
    device a slice that is not a whole number of its heads, and it trains silently wrong
    (loss 3.5e-3 off). Only `eqx.nn.MLP` (Linears called one after another with elementwise
    activations between) can be split part by part."""
    for i in range(len(path) - 1, -1, -1):
        outer = by_path.get(path[:i])
        if outer is None or isinstance(outer, (eqx.nn.MLP, TensorParallelLayer)) or not is_unit(outer):
            continue
        whole = path_text(path[:i])
        fix = (
            f"plan {{'{whole}': 'attention'}} (its heads split whole, with their projections)"
            if isinstance(outer, eqx.nn.MultiheadAttention)
            else f"plan {{'{whole}': 'replicate'}} (keep it whole)"
        )
        how = (
            f" (it cuts its projections' outputs into its num_heads={outer.num_heads} heads)"
            if isinstance(outer, eqx.nn.MultiheadAttention)
            else ""
        )
        raise ValueError(
            f"parallelize: the plan splits {path_text(path)} as {style!r}, a part of {whole} "
            f"({describe(outer)}), whose own code works on its parts' whole outputs{how}: split "
            f"separately, it would train silently wrong. Plan the {type(outer).__name__} as a "
            f"whole instead: {fix}."
        )


def check_pairs(seq: list, axis_name: str) -> None:
    """A 'row' layer needs its input split by 'column' layers right before it; a 'column'
    layer's split output must go to such a 'row' layer (or leave the model as split logits).

    Consecutive 'column' layers form one group (in the model's field order), as in
    attention's separate `q`/`k`/`v` projections or a SwiGLU MLP's `gate` and `up`: the
    group must be followed by a 'row' layer that takes the width of one of them (`o`, or
    `down`), and a 'row' layer must follow such a group. Inside the group the layers
    combine their split outputs element by element or head by head, on each device's own
    block (this checks the order and the widths, not the arithmetic in between:
    [`eqxpar.testing.check_parallel_parity`][] does)."""
    for i, (path, node, style) in enumerate(seq):
        if style == "row":
            group = column_group(seq, i)
            if not any(member[1].out_features == node.in_features for member in group):
                before = seq[i - 1] if i > 0 else None
                what = (
                    "nothing"
                    if before is None
                    else f"{path_text(before[0])} ({describe(before[1])}, planned {before[2]!r})"
                )
                raise ValueError(
                    f"parallelize: 'row' at {path_text(path)} expects its input already split over "
                    f"{axis_name!r} by a 'column' Linear with out_features={node.in_features} right "
                    f"before it (in the model's field order), but before it comes {what}: its input "
                    f"would arrive whole and the split would need a collective the plan does not "
                    f"have. Plan the preceding Linear as 'column', or this one as 'column_gathered' "
                    f"or 'replicate'."
                )
        if style == "column":
            j = i + 1
            while j < len(seq) and seq[j][2] == "column":  # the rest of its group
                j += 1
            after = seq[j] if j < len(seq) else None
            if after is None and j == i + 1:
                continue  # the model's last layer: split logits
            if (
                after is None
                or after[2] != "row"
                or getattr(after[1], "in_features", None)
                not in (member[1].out_features for member in seq[group_start(seq, i) : j])
            ):
                nxt = seq[i + 1] if after is None else after
                fused = ""
                if after is not None and after[2] == "row":
                    # A 'row' of another width: the usual cause is a fused projection (q, k
                    # and v, or gate and up, side by side in one Linear), whose contiguous
                    # split would hand a device a slice of q instead of its block of each.
                    fused = (
                        f" If {path_text(path)} computes several projections side by side (a fused "
                        f"q/k/v or gate/up Linear: out_features={node.out_features} against the "
                        f"{after[1].in_features} {path_text(after[0])} takes), a 'column' split would "
                        f"give each device a slice of the first projection, not its block of each, and "
                        f"train silently wrong: keep it whole ('replicate') or make it separate Linears."
                    )
                raise ValueError(
                    f"parallelize: 'column' at {path_text(path)} leaves its output split over "
                    f"{axis_name!r}, but the next layer, {path_text(nxt[0])} ({describe(nxt[1])}, "
                    f"planned {nxt[2]!r}), expects the whole vector: that would need an all-gather "
                    f"the plan does not have. Plan {path_text(nxt[0])} as 'row' (a Linear with "
                    f"in_features={node.out_features}), or this layer as 'column_gathered'.{fused}"
                )


def group_start(seq: list, i: int) -> int:
    """The index where the run of consecutive 'column' layers holding `seq[i]` starts."""
    while i > 0 and seq[i - 1][2] == "column":
        i -= 1
    return i


def column_group(seq: list, i: int) -> list:
    """The run of consecutive 'column' layers right before `seq[i]` (empty if none)."""
    if i == 0 or seq[i - 1][2] != "column":
        return []
    return seq[group_start(seq, i - 1) : i]


def stacks(seq: list) -> dict:
    """The stack size of every unit of a stack built with `eqx.filter_vmap` that can be split
    per layer: units whose own weights are stacked (`stacked_weight`), and the `equinox.nn`
    layers beside them in the same container (norms, whose shapes alone do not tell) whose
    every array has that leading size."""
    nodes = {p: node for p, node, _ in seq}
    sizes = {}
    for p, node in nodes.items():
        n = None if isinstance(node, TensorParallelLayer) else stack_size(node)
        if n is not None and stacked_problem(node) is None:
            sizes[p] = n
    containers = {p[:-1]: n for p, n in sizes.items()}
    for p, node in nodes.items():
        n = containers.get(p[:-1])
        if n is None or p in sizes or isinstance(node, TensorParallelLayer) or not is_unit(node):
            continue
        if has_arrays(node) and leading_sizes(node) == {n}:
            sizes[p] = n
    return sizes


def stack_size(node: Any) -> int | None:
    """The number of layers when `node` is a layer stacked with `eqx.filter_vmap` (every
    array with one leading layer axis), else None."""
    found = stacked_weight(node)
    return None if found is None else found[1][0]


def stacked_problem(node: Any) -> str | None:
    """Why `node`, a layer stacked with `eqx.filter_vmap`, cannot be split per layer (None
    if it is not stacked, or can be: one leading layer axis on every array)."""
    found = stacked_weight(node)
    if found is None:
        return None
    where, shape = found
    if len(shape) != 3:
        return (
            f"its {where} has shape {shape}, with {len(shape) - 2} axes in front of the layer's "
            f"own two: a stack of stacks (nested eqx.filter_vmap), whose layer axes a split per "
            f"layer would have to tell apart. Stack the layers once (one filter_vmap), or keep "
            f"them in a list and plan each"
        )
    sizes = leading_sizes(node)
    if sizes != {shape[0]}:
        return (
            f"its {where} has shape {shape}, a layer axis of {shape[0]}, but its arrays' leading "
            f"sizes are {sorted(sizes)}: not one stack of layers. Stack every array of the layer "
            f"with one eqx.filter_vmap, or keep the layers in a list and plan each"
        )
    return None
