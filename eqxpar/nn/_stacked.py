"""StackedLayers: identical layers stored as one layer with a leading layer axis, run with
`jax.lax.scan` (one compiled body whatever the depth)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array, PRNGKeyArray, PyTree

from .._specs import is_spec
from ._base import TensorParallelLayer

__all__ = ["StackedLayers"]


def _is_array_like(leaf) -> bool:
    # Arrays and the ShapeDtypeStructs of an abstract model (`eqx.filter_eval_shape`).
    return hasattr(leaf, "shape") and hasattr(leaf, "dtype")


class StackedLayers(TensorParallelLayer):
    """`num_layers` layers of one structure, stored as one layer whose every array has a
    leading `num_layers` axis, and applied one after the other with `jax.lax.scan`.

    The compiled program holds one copy of the layer's body whatever the depth, so compile
    time stays flat as layers are added. [`eqxpar.nn.partition_specs`][] gives every array
    the spec of the layer it came from with a leading `None` (the layer axis is never
    split): `P(None, "model", None)` for a column-parallel weight.

    `StackedLayers(layers)` stacks a sequence of layers (each a PyTree of the same
    structure); [`eqxpar.nn.StackedLayers.unstack`][] gives them back, so checkpoints of
    either form restore into the other.
    """

    layers: PyTree
    num_layers: int = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)

    def __init__(self, layers: Sequence[PyTree], *, axis_name: str = "model"):
        """**Arguments:**

        - `layers`: the layers, all with the same structure and array shapes.
        - `axis_name`: the model axis of the tensor-parallel layers inside.

        **Raises:**

        - `ValueError` for no layers or layers of different structures or shapes.
        """
        if isinstance(layers, eqx.Module) or not isinstance(layers, Sequence) or isinstance(layers, str):
            raise ValueError(
                f"StackedLayers: layers must be a sequence (list or tuple) of layers, got "
                f"{type(layers).__name__}. Pass a list, e.g. StackedLayers([layer])."
            )
        if not isinstance(axis_name, str):
            raise ValueError(f"StackedLayers: axis_name must be a mesh axis name (a str), got {axis_name!r}.")
        layers = tuple(layers)
        if not layers:
            raise ValueError("StackedLayers needs at least one layer.")
        dynamic, static = zip(*(eqx.partition(layer, _is_array_like) for layer in layers))
        for i in range(1, len(layers)):
            difference = _difference(dynamic[0], static[0], dynamic[i], static[i])
            if difference is not None:
                raise ValueError(
                    f"StackedLayers: layer {i} differs from layer 0: {difference}. Every layer needs "
                    f"the same structure, array shapes and dtypes, and static fields to be stacked "
                    f"(one layer with a leading layer axis); build the layers with the same arguments."
                )
        stacked = jax.tree.map(lambda *xs: _stack(xs), *dynamic)
        self.layers = eqx.combine(stacked, static[0])
        self.num_layers = len(layers)
        self.axis_name = axis_name

    def unstack(self) -> tuple[PyTree, ...]:
        """The layers one by one (the inverse of the constructor).

        **Returns:**

        A tuple of `num_layers` layers, each with the stacked arrays' slice `i`.
        """
        dynamic, static = eqx.partition(self.layers, _is_array_like)
        return tuple(
            eqx.combine(jax.tree.map(lambda x, i=i: _index(x, i), dynamic), static) for i in range(self.num_layers)
        )

    def __len__(self) -> int:
        return self.num_layers

    def specs(self) -> PyTree[PartitionSpec]:
        """Each array's layer spec with a leading `None` for the layer axis."""
        inner = TensorParallelLayer.specs(self)
        return jax.tree.map(
            lambda spec, leaf: PartitionSpec(None, *(spec or ())) if _is_array_like(leaf) else spec,
            inner,
            self,
            is_leaf=is_spec,
        )

    def to_dense(self) -> tuple[PyTree, ...]:
        """The layers one by one, each tensor-parallel layer in them made dense."""

        def dense(layer):
            return jax.tree.map(
                lambda node: node.to_dense() if isinstance(node, TensorParallelLayer) else node,
                layer,
                is_leaf=lambda node: isinstance(node, TensorParallelLayer),
            )

        # One layer first, abstractly (nothing runs): a device's block (called inside
        # shard_map) is refused by its layers' own checks before any slicing compiles.
        dynamic, static = eqx.partition(self.layers, _is_array_like)
        one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), dynamic)
        jax.eval_shape(lambda d: (dense(eqx.combine(d, static)), None)[1], one)
        return tuple(dense(layer) for layer in self.unstack())

    def __call__(
        self,
        x: Array,
        *,
        keys: PRNGKeyArray | None = None,
        wrap: Callable[[Callable], Callable] | None = None,
        **kwargs,
    ) -> Array:
        """Apply the layers in order: `x = layer_i(x, key=keys[i], **kwargs)`.

        **Arguments:**

        - `x`: the input of the first layer (the carry of the scan).
        - `keys`: `num_layers` keys (one per layer), or `None`.
        - `wrap`: applied to the per-layer function `(layer, x, key) -> x` before scanning,
          e.g. `functools.partial(eqx.filter_checkpoint, policy=...)` for rematerialisation.
        - `**kwargs`: passed to every layer (e.g. `inference=True`).

        **Returns:**

        The last layer's output.
        """
        with jax.named_scope(type(self).__name__):
            dynamic, static = eqx.partition(self.layers, eqx.is_array)

            def apply(layer, x, key):
                return layer(x, key=key, **kwargs)

            if wrap is not None:
                apply = wrap(apply)

            def body(x, layer_and_key):
                arrays, key = layer_and_key
                return apply(eqx.combine(arrays, static), x, key), None

            x, _ = jax.lax.scan(body, x, (dynamic, keys))
            return x


def _aval_text(x) -> str:
    return f"{jnp.dtype(x.dtype).name}{list(x.shape)}"


def _static_difference(a, b, where: str) -> str | None:
    """The first static field (or non-array value) that differs between two layers."""
    if type(a) is not type(b):
        return f"{where or 'the layer'} is a {type(b).__name__}, not a {type(a).__name__}"
    if isinstance(a, eqx.Module):
        for field in dataclasses.fields(a):
            va, vb = getattr(a, field.name, None), getattr(b, field.name, None)
            if field.metadata.get("static", False):
                if va != vb:
                    return f"its static field {where}.{field.name} is {vb!r}, layer 0's {va!r}"
            else:
                found = _static_difference(va, vb, f"{where}.{field.name}")
                if found is not None:
                    return found
        return None
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{where or 'the layer'} has {len(b)} entries, layer 0's {len(a)}"
        for k, (va, vb) in enumerate(zip(a, b)):
            found = _static_difference(va, vb, f"{where}[{k}]")
            if found is not None:
                return found
        return None
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return f"{where or 'the layer'} has keys {sorted(map(str, b))}, layer 0's {sorted(map(str, a))}"
        for k in a:
            found = _static_difference(a[k], b[k], f"{where}[{k!r}]")
            if found is not None:
                return found
        return None
    if a is None or b is None or _is_array_like(a):
        return None
    try:
        same = bool(a == b)
    except Exception:  # values that do not compare: take them as equal
        same = True
    return None if same else f"{where or 'the layer'} is {b!r}, layer 0's {a!r}"


def _difference(dynamic0, static0, dynamic, static) -> str | None:
    """How a layer differs from layer 0 (arrays: paths, shapes, dtypes; then static fields),
    or None when the two stack."""
    arrays0 = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(dynamic0)[0]}
    arrays = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(dynamic)[0]}
    for path in arrays0:
        if path not in arrays:
            return f"layer 0 has an array at {path or '<root>'} ({_aval_text(arrays0[path])}), this one has none"
    for path in arrays:
        if path not in arrays0:
            return f"it has an array at {path or '<root>'} ({_aval_text(arrays[path])}), layer 0 has none"
        a, b = arrays0[path], arrays[path]
        if (tuple(a.shape), a.dtype) != (tuple(b.shape), b.dtype):
            return f"its {path or 'array'} is {_aval_text(b)}, layer 0's {_aval_text(a)}"
    if jax.tree.structure(dynamic0) != jax.tree.structure(dynamic) or static != static0:
        found = _static_difference(eqx.combine(dynamic0, static0), eqx.combine(dynamic, static), "")
        return found or "its structure or static fields (non-array values kept with the layer) differ"
    return None


def _stack(xs):
    return jnp.stack(xs) if isinstance(xs[0], jax.Array) or hasattr(xs[0], "__array__") else _abstract_stack(xs)


def _abstract_stack(xs):
    return jax.ShapeDtypeStruct((len(xs), *xs[0].shape), xs[0].dtype)


def _index(x, i):
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    return x[i]
