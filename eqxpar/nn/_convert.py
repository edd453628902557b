"""Whole-model helpers: the spec tree of any PyTree holding tensor-parallel layers, and the
conversions between dense Equinox layers and their tensor-parallel forms."""

from __future__ import annotations

from typing import Literal

import equinox as eqx
import jax
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import PyTree

from ._attention import ParallelMultiheadAttention
from ._base import TensorParallelLayer
from ._embedding import VocabParallelEmbedding
from ._linear import ColumnParallelLinear, RowParallelLinear
from ._mlp import ParallelMLP

__all__ = ["partition_specs", "from_dense", "to_dense"]


def _is_tp(node) -> bool:
    return isinstance(node, TensorParallelLayer)


def partition_specs(tree: PyTree, mesh: Mesh | None = None) -> PyTree[PartitionSpec]:
    """The `PartitionSpec` of every array of a model that holds tensor-parallel layers.

    Tensor-parallel layers give their own specs (see each layer's `specs()`); every other
    array (layer norms, dense layers, anything else) is replicated, `P()`. The result is
    shaped like `tree`, ready for `eqxpar.shard(tree, mesh, specs)` and as the model's entry
    in `eqxpar.filter_shard_map`'s `in_specs`/`out_specs` (and for its gradients).

    With `mesh`, every layer is checked against its model axis first, so a size that does
    not split raises here, naming the layer, rather than later inside a trace.

    **Arguments:**

    - `tree`: a model (any PyTree) in global form.
    - `mesh`: optional; the mesh to check the layers against.

    **Returns:**

    A PyTree like `tree` with a `PartitionSpec` at every leaf.

    **Raises:**

    - `ValueError` (with `mesh`) if a layer's model axis is not in the mesh, or a size
      (features, heads, vocabulary) is not divisible by the model axis size; the message
      names the layer's path, the size and the axis.
    """
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_tp)[0]
    if mesh is not None:
        for path, node in leaves:
            if not _is_tp(node):
                continue
            where = jax.tree_util.keystr(path) or "<root>"
            if node.axis_name not in mesh.shape:
                raise ValueError(
                    f"{type(node).__name__} at {where} is split over the axis "
                    f"{node.axis_name!r}, which the mesh does not have (its axes are "
                    f"{tuple(mesh.axis_names)}). Add that axis to the mesh (size 1 runs the "
                    f"layer densely) or build the layer with axis_name set to a mesh axis."
                )
            node.check_axis_size(mesh.shape[node.axis_name], where)
    return jax.tree.map(lambda node: node.specs() if _is_tp(node) else PartitionSpec(), tree, is_leaf=_is_tp)


def from_dense(
    layer: eqx.Module,
    *,
    axis_name: str = "model",
    linear: Literal["column", "row"] | None = None,
    **options,
) -> TensorParallelLayer:
    """The tensor-parallel form (global) of a dense Equinox layer, sharing its arrays.

    | dense | tensor-parallel |
    |---|---|
    | `eqx.nn.Linear` | [`eqxpar.nn.ColumnParallelLinear`][] (`linear="column"`) or [`eqxpar.nn.RowParallelLinear`][] (`linear="row"`) |
    | `eqx.nn.MLP` with `depth=1` | [`eqxpar.nn.ParallelMLP`][] |
    | `eqx.nn.MultiheadAttention` | [`eqxpar.nn.ParallelMultiheadAttention`][] |
    | `eqx.nn.Embedding` | [`eqxpar.nn.VocabParallelEmbedding`][] |

    The result holds the full arrays; put it on a mesh with
    `eqxpar.shard(tp, mesh, eqxpar.nn.partition_specs(tp, mesh))`. [`eqxpar.nn.to_dense`][]
    goes back.

    **Arguments:**

    - `layer`: the dense layer.
    - `axis_name`: the mesh axis to split over.
    - `linear`: for an `eqx.nn.Linear`, which way to split it (required for Linear only).
    - `**options`: passed to the target's `from_dense` (e.g. `gather_output=True`,
      `input_is_split=False`, `causal=True`, `dropout_p=0.1`).

    **Returns:**

    The tensor-parallel layer in global form.

    **Raises:**

    - `ValueError` for a layer type with no tensor-parallel form, or an `eqx.nn.Linear`
      without `linear="column"` / `"row"`.
    """  # noqa: E501 - a markdown table row cannot wrap
    if isinstance(layer, eqx.nn.Linear):
        if linear == "column":
            return ColumnParallelLinear.from_dense(layer, axis_name=axis_name, **options)
        if linear == "row":
            return RowParallelLinear.from_dense(layer, axis_name=axis_name, **options)
        raise ValueError(
            f"from_dense: an eqx.nn.Linear can be split two ways; pass linear='column' (split "
            f"the output features) or linear='row' (split the input features), got {linear!r}."
        )
    targets = {
        eqx.nn.MLP: ParallelMLP,
        eqx.nn.MultiheadAttention: ParallelMultiheadAttention,
        eqx.nn.Embedding: VocabParallelEmbedding,
    }
    for dense_cls, tp_cls in targets.items():
        if isinstance(layer, dense_cls):
            return tp_cls.from_dense(layer, axis_name=axis_name, **options)
    raise ValueError(
        f"from_dense: no tensor-parallel form for {type(layer).__name__}; supported are "
        f"eqx.nn.Linear, eqx.nn.MLP (depth=1), eqx.nn.MultiheadAttention and eqx.nn.Embedding."
    )


def to_dense(tree: PyTree) -> PyTree:
    """Replace every tensor-parallel layer in `tree` by its dense Equinox equivalent.

    Works on a model in global form and on PyTrees shaped like one (e.g. its gradients),
    as long as the arrays are the full, global ones: outside `shard_map`, gathered or not.

    **Arguments:**

    - `tree`: any PyTree holding tensor-parallel layers.

    **Returns:**

    The same PyTree with `eqx.nn.Linear`, `eqx.nn.MLP`, `eqx.nn.MultiheadAttention` and
    `eqx.nn.Embedding` in their place (a registered style's layer gives back its own dense
    layer). [`eqxpar.models.GPT`][] and [`eqxpar.models.Llama`][] are left as they are:
    each is its own dense form (it runs on one device over a model axis of size 1).
    """
    return jax.tree.map(lambda node: node.to_dense() if _is_tp(node) else node, tree, is_leaf=_is_tp)
