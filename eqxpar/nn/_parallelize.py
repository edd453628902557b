"""`parallelize`: a plain Equinox model to its tensor-parallel form, by a plan, in one call.

The model keeps its own code: `parallelize` swaps dense `equinox.nn` layers for their
tensor-parallel forms in `eqxpar.nn` (which take the same per-example inputs and return the
same outputs inside `shard_map`) and shares their arrays. What comes back is the model in
global form, ready for [`eqxpar.nn.partition_specs`][] and any train step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
from jax.sharding import Mesh

from ._base import TensorParallelLayer
from ._convert import from_dense
from ._coverage import check_coverage
from ._plan import (
    REGISTERED,
    STYLES,
    Plan,
    PlanRow,
    describe,
    has_arrays,
    is_unit,
    path_text,
    resolve,
    units,
    walk,
)
from ._plan_checks import check_not_inside_composite, check_pairs, stack_size, stacked_problem, stacks
from ._plan_stacked import VmappedStack, convert_stack
from ._registry import convert_registered

__all__ = ["parallelize", "auto_plan"]

PlanLike = Mapping[str | Callable[[Any], Any], str] | None


def _auto_style(node: Any) -> tuple[str, str]:
    """The automatic plan's style for one layer, and a note when it stays whole."""
    if isinstance(node, TensorParallelLayer):
        return "kept", "already tensor-parallel: left as it is"
    if (stacked := stacked_problem(node)) is not None:
        return "replicate", f"{stacked}: stays whole"
    for name, registered in REGISTERED.items():  # a user's style first: its class may subclass ours
        if registered.auto and isinstance(node, registered.takes):
            return name, ""
    if isinstance(node, eqx.nn.MultiheadAttention):
        return "attention", ""
    if isinstance(node, eqx.nn.Embedding):
        return "vocab", ""
    if isinstance(node, eqx.nn.MLP):
        problem = _mlp_problem(node)
        if problem is None:
            return "mlp", ""
        return "replicate", f"{problem}: stays whole (an explicit plan can split its Linears as 'column'/'row')"
    return "replicate", ""


def _mlp_problem(mlp: eqx.nn.MLP) -> str | None:
    if mlp.depth != 1:
        return f"depth={mlp.depth} (ParallelMLP is depth=1)"
    if mlp.in_size == "scalar" or mlp.out_size == "scalar":
        return "a 'scalar' input or output"
    if not isinstance(mlp.layers, tuple):
        return "layers stored stacked (scan=True)"
    for name in ("activation", "final_activation"):
        if has_arrays(getattr(mlp, name)):
            return f"its {name} has parameters"
    return None


def _fit_problem(style: str, node: Any) -> str | None:
    """Why `style` cannot apply to `node` (None if it can)."""
    if isinstance(node, TensorParallelLayer):
        return "it is already tensor-parallel: leave it out of the plan (it is placed as it is)"
    if style == "replicate":
        return None
    wanted = {
        "column": eqx.nn.Linear,
        "column_gathered": eqx.nn.Linear,
        "row": eqx.nn.Linear,
        "vocab": eqx.nn.Embedding,
        "mlp": eqx.nn.MLP,
        "attention": eqx.nn.MultiheadAttention,
    }.get(style) or REGISTERED[style].takes
    if not isinstance(node, wanted):
        return f"style {style!r} takes an {STYLES[style].takes}"
    if (stacked := stacked_problem(node)) is not None:
        return stacked
    if isinstance(node, eqx.nn.Linear) and "scalar" in (node.in_features, node.out_features):
        return "a Linear with a 'scalar' input or output has nothing to split"
    if isinstance(node, eqx.nn.MLP):
        problem = _mlp_problem(node)
        if problem is not None:
            return (
                "style 'mlp' needs a depth=1 MLP with vector input and output and parameter-free "
                f"activations; this one has {problem}"
            )
    return None


def _convert(style: str, node: Any, axis_name: str) -> TensorParallelLayer:
    if style in REGISTERED:
        return convert_registered(style, node, axis_name)
    if style in ("column", "column_gathered"):
        return from_dense(node, axis_name=axis_name, linear="column", gather_output=style == "column_gathered")
    if style == "row":
        return from_dense(node, axis_name=axis_name, linear="row", input_is_split=True)
    return from_dense(node, axis_name=axis_name)


def _split_size(style: str, node: Any) -> tuple[str, int]:
    """What a split style divides (styles checked already: "replicate" and "kept" never get here)."""
    if style in ("column", "column_gathered"):
        return "out_features", node.out_features
    if style in REGISTERED:
        return REGISTERED[style].split, getattr(node, REGISTERED[style].split)
    return {
        "row": ("in_features", getattr(node, "in_features", 0)),
        "vocab": ("num_embeddings", getattr(node, "num_embeddings", 0)),
        "mlp": ("width_size", getattr(node, "width_size", 0)),
        "attention": ("num_heads", getattr(node, "num_heads", 0)),
    }[style]


def _explicit_styles(plan: Mapping, model: Any, nodes: list) -> tuple[dict, set]:
    """Resolve an explicit plan to `{unit path: style}`, later entries winning."""
    resolved = []
    for key, style in plan.items():
        if style not in STYLES:
            raise ValueError(
                f"parallelize: the plan gives {key!r:.60} the style {style!r}; the styles are "
                f"{', '.join(map(repr, STYLES))}."
            )
        resolved.append((key, style, resolve(key, model, nodes)))
    targets = {p for _, _, paths in resolved for p in paths}
    opened = {t[:i] for t in targets for i in range(len(t))}
    unit_paths = [p for p, _ in units(model, opened)]
    unit_set = set(unit_paths)
    by_path = dict(nodes)
    styles: dict = {}
    for _key, style, paths in resolved:
        for p in paths:
            node = by_path[p]
            if style != "replicate":
                check_not_inside_composite(p, style, by_path)
            if p in unit_set:
                styles[p] = style
                continue
            if is_unit(node) and style != "replicate":
                inner = sorted(path_text(t) for t in targets if t[: len(p)] == p and t != p)
                raise ValueError(
                    f"parallelize: plan entries overlap at {path_text(p)}: it is planned as "
                    f"{style!r} as a whole, and {', '.join(inner)} inside it separately. Plan "
                    f"either the {describe(node)} as a whole or its parts, not both."
                )
            under = [u for u in unit_paths if u[: len(p)] == p and u != p]
            if style != "replicate" or not under:
                why = f"style {style!r} takes an {STYLES[style].takes}" if under else "it is not a layer"
                fits = [path_text(u) for u in under if _fit_problem(style, by_path[u]) is None]
                hint = f" Name the layers themselves, e.g. '{fits[0]}'." if fits else ""
                raise ValueError(
                    f"parallelize: the plan gives {path_text(p)} ({describe(node)}) the style "
                    f"{style!r}, but {why}.{hint}"
                )
            # A container kept whole (tensor-parallel layers in it stay as they are).
            styles.update({u: "replicate" for u in under if not isinstance(by_path[u], TensorParallelLayer)})
    return styles, opened


def parallelize(
    model: Any,
    plan: PlanLike | str = None,
    *,
    axis_name: str = "model",
    mesh: Mesh | None = None,
    return_plan: bool = False,
    strict: bool = False,
) -> Any:
    """A plain Equinox model with tensor-parallel layers in place of dense ones, by a plan.

    Each planned layer is replaced by its [`eqxpar.nn`][] form, sharing its arrays; the
    model's own `__call__` is unchanged and calls them per example as it called the dense
    ones. The result is in global form: pass it to [`eqxpar.nn.partition_specs`][] and a
    train step (e.g. [`eqxpar.train.hybrid_step`][]); [`eqxpar.nn.to_dense`][] goes back.

    | style | takes | becomes | forward / backward over the model axis |
    |---|---|---|---|
    | `"attention"` | `eqx.nn.MultiheadAttention` | [`eqxpar.nn.ParallelMultiheadAttention`][] (heads split) | all-reduce / all-reduce |
    | `"mlp"` | `eqx.nn.MLP`, `depth=1` | [`eqxpar.nn.ParallelMLP`][] (hidden units split) | all-reduce / all-reduce |
    | `"vocab"` | `eqx.nn.Embedding` | [`eqxpar.nn.VocabParallelEmbedding`][] (rows split) | all-reduce / none |
    | `"column"` | `eqx.nn.Linear` | [`eqxpar.nn.ColumnParallelLinear`][], output left split | none / all-reduce |
    | `"column_gathered"` | `eqx.nn.Linear` | the same, output all-gathered | all-gather / all-reduce |
    | `"row"` | `eqx.nn.Linear` | [`eqxpar.nn.RowParallelLinear`][] after a `"column"` | all-reduce / none |
    | `"replicate"` | anything | unchanged: a whole copy on every device | none / none |

    A `"column"` layer must be followed by a `"row"` layer of matching width (a pair, as
    inside an MLP), or be the model's last layer: split logits, for
    [`eqxpar.nn.vocab_parallel_cross_entropy`][]. Order is the order of the model's fields,
    the order most models call their layers in.

    **Stacked layers.** A layer stacked with `eqx.filter_vmap` (every array with a leading
    layer axis, run by the model's own `jax.lax.scan`) is planned by its path like a single
    one (`"blocks.attention"`), and every layer of the stack gets the style: its
    tensor-parallel form is made per layer around the same stacked arrays, in a wrapper
    whose specs put `None` on the layer axis, so that nothing (the model axis, FSDP) splits
    it, and that, named as an FSDP unit, is gathered one layer at a time inside the scan.
    The stack's other `equinox.nn` layers (its norms) are marked the same way. Stacks of
    stacks (nested `filter_vmap`) are refused.

    **Arguments:**

    - `model`: any PyTree holding `equinox.nn` layers (global form).
    - `plan`: `None` (or `"auto"`): every `MultiheadAttention`, every depth-1 `MLP` and
      every `Embedding` is split, the rest stays whole. Or a mapping from parts of the model
      to styles; parts not named stay whole. A part is a path string as
      `jax.tree_util.keystr` prints it without the leading dot (`"head"`,
      `"blocks[0].mlp"`), with `*` for any one key (`"blocks[*].mlp"`), or a
      where-function as in `eqx.tree_at` (`lambda m: m.head`). Later entries win, so
      `{**eqxpar.nn.auto_plan(model), "head": "column_gathered"}` edits the automatic
      plan. `"replicate"` on a container keeps everything in it whole.
    - `axis_name`: the mesh axis the layers are split over.
    - `mesh`: optional; check every split size against `mesh.shape[axis_name]` now (else
      [`eqxpar.nn.partition_specs`][]`(model, mesh)` checks it, also before any compile).
    - `return_plan`: also return the [`eqxpar.nn.Plan`][] applied (`print(plan)` shows a
      table of every layer, its style and its collectives).
    - `strict`: raise, instead of warning, when the plan splits no layer or leaves more
      than half of the parameter bytes whole. Either way the message names the classes
      it could not plan (a model's own attention class holding Linears, a `Conv2d`), the
      largest whole layers and why, and the ways out: teach it a class with
      [`eqxpar.nn.register_style`][], name the layers in an explicit plan, or use data
      parallelism.

    **Returns:**

    The model with tensor-parallel layers; with `return_plan=True`, `(model, plan)`.

    **Raises:**

    - `ValueError`, naming the layer's path: a path or where-function that names nothing,
      a style that does not fit the layer, overlapping entries, a `"row"` layer without a
      `"column"` one before it (or a `"column"` layer whose split output would reach a layer
      that wants it whole), a stack of stacks or a stacked layer whose arrays do not share
      one leading size, and with `mesh` a size the model axis does not divide; with
      `strict=True`, a plan that splits no layer or leaves more than half of the parameter
      bytes whole (the text of the `UserWarning` it gives otherwise).
    """  # noqa: E501 - a markdown table row cannot wrap
    if mesh is not None:
        if not isinstance(mesh, Mesh):
            raise ValueError(f"parallelize: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
        if axis_name not in mesh.shape:
            raise ValueError(
                f"parallelize: the mesh has no axis {axis_name!r} to split the layers over (its "
                f"axes are {tuple(mesh.axis_names)}). Pass axis_name=<the model axis>."
            )
    size = None if mesh is None else mesh.shape[axis_name]
    nodes = list(walk(model))
    notes: dict = {}
    if plan is None or (isinstance(plan, str) and plan == "auto"):
        opened: set = set()
        styles = {}
        for p, node in units(model, opened):
            styles[p], notes[p] = _auto_style(node)
    elif isinstance(plan, Mapping):
        styles, opened = _explicit_styles(plan, model, nodes)
    else:
        raise ValueError(
            f"parallelize: plan must be None (or 'auto') or a mapping from paths or where-functions "
            f"to styles, e.g. {{'blocks[*].mlp': 'mlp', 'head': 'column'}}; got {type(plan).__name__}."
        )

    seq = []
    for p, node in units(model, opened):
        style = styles.get(p, "kept" if isinstance(node, TensorParallelLayer) else "replicate")
        if style != "kept" and (problem := _fit_problem(style, node)) is not None:
            raise ValueError(f"parallelize: {path_text(p)} ({describe(node)}) cannot be {style!r}: {problem}.")
        if has_arrays(node) or style != "replicate":
            seq.append((p, node, style))
    check_pairs([s for s in seq if has_arrays(s[1])], axis_name)
    check_coverage(
        seq,
        notes,
        dict(nodes),
        lambda node: _auto_style(node)[0] not in ("replicate", "kept"),
        explicit=isinstance(plan, Mapping),
        strict=strict,
    )

    rows, new = [], {}
    last = seq[-1][0] if seq else None
    stacked = stacks(seq)
    for p, node, style in seq:
        where, note = path_text(p), notes.get(p, "")
        if style == "replicate" and (layers := stacked.get(p)) is not None:
            # A layer of a filter_vmap stack kept whole: marked, so nothing splits its layer axis.
            new[p] = VmappedStack(node, num_layers=layers, axis_name=axis_name)
            note = "; ".join(filter(None, [note, f"one of {layers} stacked layers: the layer axis never split"]))
        if style in ("replicate", "kept"):
            rows.append(
                PlanRow(
                    where,
                    describe(node),
                    style,
                    "",
                    "none" if style == "replicate" else "-",
                    "none" if style == "replicate" else "-",
                    note,
                )
            )
            continue
        layers = stack_size(node)
        try:
            if layers is None:
                layer = _convert(style, node, axis_name)
            else:  # every layer of a filter_vmap stack, the layer axis kept whole
                layer = convert_stack(lambda n, style=style: _convert(style, n, axis_name), node, layers, axis_name)
        except ValueError as e:
            raise ValueError(f"parallelize: {where} ({describe(node)}) cannot be {style!r}: {e}") from None
        if size is not None:
            try:
                layer.check_axis_size(size, where)
            except ValueError as e:
                raise ValueError(f"parallelize: {e} Or keep it whole: plan {{'{where}': 'replicate'}}.") from None
        what, n = _split_size(style, node)
        split = f"{what}={n}" + ("" if size is None else f" -> {n // size} per device")
        if style == "column" and p == last:
            note = f"output stays split over {axis_name!r}: take the loss with eqxpar.nn.vocab_parallel_cross_entropy"
        if layers is not None:
            split += f", in each of {layers} stacked layers"
            note = "; ".join(
                filter(None, [note, "stacked with eqx.filter_vmap: split per layer, the layer axis whole"])
            )
        rows.append(
            PlanRow(
                where, describe(node), style, split, STYLES[style].text("forward"), STYLES[style].text("backward"), note
            )
        )
        new[p] = layer

    model = _replace(model, new)
    return (model, Plan(tuple(rows), axis_name, size)) if return_plan else model


def _get(tree: Any, path: tuple) -> Any:
    for key in path:
        if isinstance(key, jax.tree_util.GetAttrKey):
            tree = getattr(tree, key.name)
        elif isinstance(key, jax.tree_util.SequenceKey):
            tree = tree[key.idx]
        elif isinstance(key, jax.tree_util.DictKey):
            tree = tree[key.key]
        else:
            raise ValueError(
                f"parallelize: cannot follow the path key {key!r} (a custom PyTree node); plan "
                f"layers held in Equinox Modules, tuples, lists or dicts."
            )
    return tree


def _replace(model: Any, new: dict) -> Any:
    if not new:
        return model
    if () in new:  # the model is itself one layer
        return new[()]
    paths = list(new)
    return eqx.tree_at(lambda m: [_get(m, p) for p in paths], model, [new[p] for p in paths])


def auto_plan(model: Any, *, axis_name: str = "model", mesh: Mesh | None = None) -> Plan:
    """The plan `parallelize(model)` would apply, without applying it.

    **Arguments:**

    - `model`, `axis_name`, `mesh`: as in [`eqxpar.nn.parallelize`][].

    **Returns:**

    A [`eqxpar.nn.Plan`][]: a mapping from each layer's path to its style (edit it with
    `{**plan, "head": "column_gathered"}` and pass it to `parallelize`), and a table as
    `str(plan)`.

    **Raises:**

    - `ValueError` as `parallelize` does.
    """
    return parallelize(model, None, axis_name=axis_name, mesh=mesh, return_plan=True)[1]
