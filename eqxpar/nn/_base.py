"""What every tensor-parallel layer shares: its model axis, its spec tree, its size checks.

A tensor-parallel layer has two forms with the same PyTree structure:

- the **global form**, outside `shard_map`: every weight at its full, dense size (this is
  what a constructor or `from_dense` returns, what `eqxpar.shard` places and what
  `to_dense` reads);
- the **local form**, inside `shard_map` over the model axis: every split weight is this
  device's block. `__call__` is written for this form, with its collectives in plain sight.

`layer.specs()` is the bridge: the PartitionSpec of every array, so `shard_map` (or
`eqxpar.filter_shard_map`) turns one form into the other.
"""

from __future__ import annotations

import equinox as eqx
import jax
from jax.sharding import PartitionSpec
from jaxtyping import Array, PRNGKeyArray, PyTree

from .._shard_map import varying_axes

__all__ = ["TensorParallelLayer", "gather_sequence"]


class TensorParallelLayer(eqx.Module):
    """Base class of the layers in `eqxpar.nn`: Equinox Modules split over a model axis.

    Subclasses have a static `axis_name` field (the mesh axis the layer is split over) and
    provide:

    - `specs()`: a PyTree of the layer's structure with a `PartitionSpec` per array;
    - `to_dense()`: the equivalent dense Equinox layer (from the global form);
    - `check_axis_size(size, where)`: a `ValueError` if the layer cannot be split into
      `size` parts.

    The default `specs` and `check_axis_size` cover layers made of other tensor-parallel
    layers: each sublayer gives its own specs and checks, every other array is replicated.
    """

    axis_name: eqx.AbstractVar[str]

    def specs(self) -> PyTree[PartitionSpec]:
        """The `PartitionSpec` of every array of this layer (a tree shaped like the layer).

        **Returns:**

        A copy of the layer whose array leaves are `PartitionSpec`s: split weights name
        `self.axis_name`, replicated ones are `P()`.
        """
        return jax.tree.map(
            lambda node: node.specs() if isinstance(node, TensorParallelLayer) else PartitionSpec(),
            self,
            is_leaf=lambda node: node is not self and isinstance(node, TensorParallelLayer),
        )

    def check_axis_size(self, size: int, where: str = "") -> None:
        """Raise a `ValueError` if this layer cannot be split over `size` devices.

        **Arguments:**

        - `size`: the size of the model axis (`mesh.shape[self.axis_name]`).
        - `where`: the layer's path inside a bigger model, for the error message.

        **Returns:**

        Nothing.
        """
        for path, node in jax.tree_util.tree_flatten_with_path(
            self, is_leaf=lambda n: n is not self and isinstance(n, TensorParallelLayer)
        )[0]:
            if isinstance(node, TensorParallelLayer):
                node.check_axis_size(size, where + jax.tree_util.keystr(path))

    def to_dense(self) -> eqx.Module:  # pragma: no cover - every concrete layer overrides it
        raise NotImplementedError

    # Helpers for the concrete layers.

    def _model_axis_size(self) -> int:
        """The model axis size, read while tracing inside shard_map, with the layer checked.

        This is the backstop for a layer used without `eqxpar.nn.partition_specs(..., mesh)`:
        the same `ValueError` as that function raises, before anything compiles.
        """
        try:
            size = jax.lax.axis_size(self.axis_name)
        except NameError:
            raise ValueError(
                f"{type(self).__name__} runs inside shard_map over its model axis "
                f"{self.axis_name!r}, but no axis of that name is bound here. Call it inside "
                f"eqxpar.filter_shard_map (or jax.shard_map) over a mesh with a "
                f"{self.axis_name!r} axis (a mesh with {self.axis_name}=1 runs it densely), "
                f"or build the layer with axis_name set to your mesh's model axis."
            ) from None
        self.check_axis_size(size, "")
        return size

    def _name(self, where: str) -> str:
        return f"{type(self).__name__}{' at ' + where if where else ''}"

    def _split_error(self, where: str, what: str, value: int, size: int) -> ValueError:
        return ValueError(
            f"{self._name(where)}: {what}={value} is not divisible by the size {size} of the "
            f"model axis {self.axis_name!r}, so it cannot be split evenly over the devices. "
            f"Choose {what} a multiple of {size}, or a model axis size that divides {value}."
        )


def to_varying(x: Array, axis_name: str) -> Array:
    """Mark a replicated `x` as varying over `axis_name`: the identity in the forward pass.

    Its transpose is a `psum` over `axis_name`: when each device uses the replicated `x`
    with its own block of a weight, every device holds only a part of `x`'s gradient, and
    this is where the backward pass adds the parts up (Megatron's "f" operator). Values that
    already vary over `axis_name` pass through unchanged, so several layers reading the
    same input share one backward all-reduce.
    """
    if axis_name in varying_axes(x):
        return x
    return jax.lax.pcast(x, axis_name, to="varying")


def local_block(x: Array, axis_name: str, *, axis: int = -1) -> Array:
    """This device's contiguous block of a replicated `x` along `axis` (no communication)."""
    size = jax.lax.axis_size(axis_name)
    block = x.shape[axis] // size
    start = jax.lax.axis_index(axis_name) * block
    return jax.lax.dynamic_slice_in_dim(to_varying(x, axis_name), start, block, axis=axis)


def per_shard_key(key: PRNGKeyArray, axis_name: str) -> PRNGKeyArray:
    """A different key on every device of `axis_name`, for randomness on split activations."""
    return jax.random.fold_in(key, jax.lax.axis_index(axis_name))


def skeleton(cls, *args, **kwargs):
    """An instance of `cls` with `ShapeDtypeStruct`s for arrays, built without allocating.

    `from_dense` fills its arrays in with `eqx.tree_at`: the layer's own `__init__` stays
    the single place that decides its structure.
    """
    return eqx.filter_eval_shape(cls, *args, **kwargs, key=jax.random.key(0))


def elementwise(fn, x: Array) -> Array:
    """`fn` applied to every element of `x` on its own (as `eqx.nn.MLP` applies activations,
    one unit at a time), over any shape: one `vmap` per dimension. (Not one `vmap` over the
    flattened array: XLA:CPU then runs the activation's backward on the flat shape, fused
    with the weight gradient's transpose, and an MLP's backward pass took twice as long.)"""
    for _ in range(x.ndim):
        fn = jax.vmap(fn)
    return fn(x)


def identity(x):
    """The identity function (the default final activation, as in `eqx.nn.MLP`)."""
    return x


def gather_sequence(x: Array, axis_name: str, sequence_dim: int) -> Array:
    """Megatron sequence parallelism's entry into a tensor-parallel region: the devices'
    blocks of `x` along `sequence_dim`, all-gathered over `axis_name` (backward: a
    reduce-scatter of the gradient, in place of the region's input all-reduce).

    [`eqxpar.nn.ColumnParallelLinear`][] and [`eqxpar.nn.ParallelMultiheadAttention`][] do
    this themselves when called with `sequence_dim=`. Call it to gather once for several
    layers that read the same input, as [`eqxpar.models.LlamaAttention`][] does for its
    `q_proj`, `k_proj` and `v_proj`. Inside `shard_map` only.

    **Arguments:**

    - `x`: this device's block of the sequence.
    - `axis_name`: the mesh axis the sequence is split over (the model axis).
    - `sequence_dim`: the dimension of `x` that holds the sequence (e.g. `-2`).

    **Returns:**

    The whole sequence: `x` with its blocks from every device of `axis_name`
    concatenated, in device order, along `sequence_dim`.
    """
    return jax.lax.all_gather(x, axis_name, axis=sequence_dim % x.ndim, tiled=True)


def scatter_sequence(x: Array, axis_name: str, sequence_dim: int, who: str) -> Array:
    """Megatron sequence parallelism's exit from a tensor-parallel region: the devices'
    partial sums `x` added up, each keeping its block along `sequence_dim` (a
    `psum_scatter` over `axis_name` in place of the `psum`; backward, an all-gather).

    **Raises:**

    - `ValueError` naming `who` if the sequence does not split over the axis.
    """
    dim = sequence_dim % x.ndim
    size = jax.lax.axis_size(axis_name)
    if x.shape[dim] % size:
        raise ValueError(
            f"{who}: sequence parallelism splits dimension {dim} (length {x.shape[dim]}) over the "
            f"{size} devices of the model axis {axis_name!r}, which do not divide it. Use a "
            f"sequence length that is a multiple of {size}, or turn sequence parallelism off."
        )
    return jax.lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=True)
