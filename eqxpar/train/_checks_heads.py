"""Before compiling, a step checks how the user's own code cuts a split output into heads.

`eqxpar.nn.parallelize` turns a user's q/k/v (or gate/up) `eqx.nn.Linear`s into
`"column"` layers: each device gets a block of their output features, and the user's code
between them and the `"row"` layer runs on that block. Code that cuts the features into
heads by their size (`q.reshape(seq, -1, head_dim)`) gets whole heads on each device. Code
that cuts by a fixed count (`q.reshape(seq, num_heads, -1)`, or einops' `h=num_heads`) cuts
each device's block into `num_heads` slivers of `head_dim / N` features: every shape still
fits, attention runs over pieces of heads, and the model trains silently wrong.

The check traces the user's loss twice, never compiling: the dense model (`to_dense`) on one
device and the parallel model on the mesh, each on one micro-batch per device. Each
`reshape` that cuts a split last axis into parts, written at the same place of the user's
code, may shrink only its outermost part on the parallel side (fewer whole heads); an inner
part that shrinks is the fixed-count cut, refused with a `ValueError` naming the line.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import PyTree

from .._compat import forget_traced_constants, user_source_line
from .._mesh import make_mesh
from .._shard_map import filter_shard_map
from .._specs import entry_axes, is_spec
from ..nn import ColumnParallelLinear, StackedLayers, TensorParallelLayer, to_dense

__all__ = ["check_head_cuts"]


def has_split_outputs(model: PyTree) -> bool:
    """Whether the model holds a `ColumnParallelLinear` whose split output goes to the
    model's own code: not gathered, and not inside one of eqxpar's composite layers (a
    `StackedLayers` wrapper around it is no composite)."""

    def visit(node: Any, inside: bool) -> bool:
        if isinstance(node, ColumnParallelLinear):
            return not inside and not node.gather_output
        composite = isinstance(node, TensorParallelLayer) and not isinstance(node, StackedLayers)
        children = jax.tree_util.tree_leaves(node, is_leaf=lambda x: x is not node and isinstance(x, eqx.Module))
        return any(visit(child, inside or composite) for child in children if child is not node)

    return visit(model, False)


def check_head_cuts(
    who: str,
    loss_fn: Callable[..., Any],
    model: PyTree,
    batch: PyTree,
    key: Any,
    mesh: Mesh,
    specs: PyTree,
    batch_spec: PartitionSpec,
    n_batch: int,
    grad_accum: int,
    gathered: tuple[str, ...],
) -> None:
    """Raise a `ValueError` if the user's code cuts a split output by a fixed count (see the
    module docs). Traces only, and only for models with split outputs in the user's code.
    `gathered`: the batch axes the step gathers parameters over before the loss (FSDP):
    the trace takes them whole over those axes, as the loss sees them. Both traces take one
    micro-batch (`grad_accum`), the batch the loss sees."""
    if not has_split_outputs(model):
        return

    def as_seen(spec):
        if not isinstance(spec, PartitionSpec):
            return spec
        entries = [tuple(a for a in entry_axes(e) if a not in gathered) for e in spec]
        return PartitionSpec(*[e[0] if len(e) == 1 else (e or None) for e in entries])

    specs = jax.tree.map(as_seen, specs, is_leaf=is_spec)

    def abstract(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if eqx.is_array(x) else x, tree)

    def rows(x, n):  # x: an abstract batch leaf
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x
        return jax.ShapeDtypeStruct((x.shape[0] // n, *x.shape[1:]), x.dtype)

    parallel = filter_shard_map(
        loss_fn, mesh=mesh, in_specs=(specs, batch_spec, PartitionSpec()), out_specs=PartitionSpec(),
        check_vma=False,
    )  # fmt: skip
    one = make_mesh("auto", jax.devices()[:1], **dict.fromkeys(mesh.axis_names, 1))
    dense = filter_shard_map(
        loss_fn, mesh=one, in_specs=(PartitionSpec(),) * 3, out_specs=PartitionSpec(), check_vma=False
    )
    micro_batch = jax.tree.map(lambda x: rows(x, grad_accum), abstract(batch))  # global
    local_batch = jax.tree.map(lambda x: rows(x, n_batch * grad_accum), abstract(batch))
    key = abstract(key)
    try:
        cuts_parallel = _cuts(eqx.filter_make_jaxpr(parallel)(abstract(model), micro_batch, key)[0])
        cuts_dense = _cuts(eqx.filter_make_jaxpr(dense)(abstract(to_dense(model)), local_batch, key)[0])
    finally:
        forget_traced_constants()  # the traces above ran over two meshes
    for where, (par_in, par_out) in cuts_parallel.items():
        if where not in cuts_dense:
            continue
        dense_in, dense_out = cuts_dense[where]
        parts = _parts(dense_in, dense_out, par_in, par_out)
        if parts is None:
            continue
        file, line, nth = where
        raise ValueError(
            f"{who}: the model's code at {file}:{line} cuts an output that tensor parallelism splits "
            f"(last axis {dense_in[-1]} -> {par_in[-1]} per device) into {parts[1]} on each device, "
            f"where the dense model has {parts[0]}: only the outermost part may shrink, and here an "
            f"inner one does: it cuts by a fixed count (e.g. reshape(seq, num_heads, -1), or a "
            f"(head_dim, num_heads) layout), so each device would take slivers of every head "
            f"instead of whole heads, and train silently wrong. Cut by the part's size instead, e.g. "
            f"reshape(seq, -1, head_dim), so that each device gets its whole heads"
            + (f" (occurrence {nth + 1} of that line)." if nth else ".")
        )


def _parts(dense_in, dense_out, par_in, par_out) -> tuple[tuple, tuple] | None:
    """The axes a reshape cut the input's last axis into, `(dense, split side)`, when the
    split side's are not the dense ones with only the outermost divided (whole parts on each
    device); None when they are, or when the last axis is not split."""
    ratio, rest = divmod(dense_in[-1], par_in[-1])
    if rest or ratio == 1:
        return None
    k_dense, k_par = _cut_start(dense_out, dense_in[-1]), _cut_start(par_out, par_in[-1])
    if k_dense is None or k_dense != k_par:
        return None
    dense, par = tuple(dense_out[k_dense:]), tuple(par_out[k_par:])
    if dense[0] == par[0] * ratio and dense[1:] == par[1:]:
        return None
    return dense, par


def _cut_start(shape_out, size: int) -> int | None:
    """Where the trailing axes of `shape_out` whose product is `size` start (None if none)."""
    product = 1
    for k in range(len(shape_out) - 1, -1, -1):
        product *= shape_out[k]
        if product == size:
            return k
        if product > size:
            return None
    return None


def _cuts(closed: Any) -> dict[tuple[str, int, int], tuple[tuple[int, ...], tuple[int, ...]]]:
    """Every `reshape` in the program (nested programs included) that cuts the last axis of
    its input into more axes, keyed by its line in the user's code and its occurrence there:
    `(input shape, output shape)`."""
    seen: Counter = Counter()
    found = {}
    for eqn in _equations(closed.jaxpr):
        if eqn.primitive.name != "reshape":
            continue
        shape_in, shape_out = tuple(eqn.invars[0].aval.shape), tuple(eqn.outvars[0].aval.shape)
        if len(shape_out) <= len(shape_in) or not shape_in or shape_in[-1] == shape_out[-1]:
            continue
        line = user_source_line(eqn)
        if line is None:
            continue
        nth = seen[line]
        seen[line] += 1
        found[(*line, nth)] = (shape_in, shape_out)
    return found


def _equations(jaxpr: Any) -> Iterator[Any]:
    """The equations of `jaxpr` and of every program nested in their parameters, in order."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)
