"""Layers of a stack built with `eqx.filter_vmap` (a leading layer axis on every array, run by
the model's own `lax.scan`), made tensor-parallel by `eqxpar.nn.parallelize`: the per-layer
plan applied to every layer, the layer axis never split."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

from ._base import TensorParallelLayer
from ._stacked import StackedLayers

__all__ = ["VmappedStack", "convert_stack"]


class VmappedStack(StackedLayers):
    """One tensor-parallel layer per layer of a stack the model scans itself.

    A model that builds its blocks with `eqx.filter_vmap` holds each of their layers once,
    every array with a leading layer axis, and runs them with its own `lax.scan`, which
    hands the layer slice `i` of every array to the block's code. `parallelize` replaces
    such a stacked layer by this wrapper around its tensor-parallel form (with the same
    stacked arrays): in the scan, each slice is that layer's tensor-parallel form, and the
    wrapper's call is the layer's call. Being an [`eqxpar.nn.StackedLayers`][], its specs
    put `None` (never split) on the layer axis in front of the layer's own specs,
    [`eqxpar.train.fsdp_specs`][] never splits that axis, and as an FSDP unit it gathers one
    layer at a time inside the scan.
    """

    def __init__(self, layers: Any, *, num_layers: int, axis_name: str):
        """**Arguments:**

        - `layers`: the tensor-parallel layer with every array stacked on axis 0 (or a layer
          of the stack kept whole, e.g. its `eqx.nn.LayerNorm`: marked so that nothing
          splits its layer axis either).
        - `num_layers`: the length of that axis.
        - `axis_name`: the model axis.
        """
        self.layers = layers
        self.num_layers = num_layers
        self.axis_name = axis_name

    def __call__(self, *args, **kwargs):  # type: ignore[override]
        """The layer's own call (on one layer's slice, inside the model's scan)."""
        return self.layers(*args, **kwargs)

    def to_dense(self) -> Any:  # type: ignore[override]
        """The dense layer, stacked as the model built it (each layer made dense)."""
        if not isinstance(self.layers, TensorParallelLayer):
            return self.layers
        return eqx.filter_vmap(lambda layer: layer.to_dense())(self.layers)


def convert_stack(convert: Callable[[Any], TensorParallelLayer], node: Any, num_layers: int, axis_name: str):
    """`convert` applied to every layer of the stacked dense layer `node` (through
    `eqx.filter_vmap`, so the arrays stay stacked and shared), wrapped as a `VmappedStack`."""
    layers = eqx.filter_vmap(convert)(node)
    if not isinstance(layers, TensorParallelLayer):  # pragma: no cover - every style makes one
        raise ValueError(f"parallelize: converting a stacked layer gave a {type(layers).__name__}.")
    return VmappedStack(layers, num_layers=num_layers, axis_name=axis_name)


def leading_sizes(node: Any) -> set[int]:
    """The leading sizes of every array in `node` (one value for a single stack)."""
    return {x.shape[0] if x.ndim else -1 for x in jax.tree.leaves(eqx.filter(node, eqx.is_array))}
