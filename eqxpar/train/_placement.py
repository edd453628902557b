"""Where a step's inputs live: the batch split over the batch axes, the optimizer state
following the parameters."""

from __future__ import annotations

import equinox as eqx
import jax
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, ArrayLike, PyTree

from .._sharding import shard
from .._specs import AxisNames, broadcast_specs, check_axes, is_spec
from ._checks import global_batch_size


def shard_batch(batch: PyTree[ArrayLike], mesh: Mesh, *, batch_axis: AxisNames = "data") -> PyTree[Array]:
    """Split a global batch over the batch axis of `mesh`, ready for a train step.

    Every array's leading dimension is split over `batch_axis` (`PartitionSpec(batch_axis)`);
    the other mesh axes, if any, hold copies. Placing the batch before calling the step
    lets each device receive its shard straight from the host.

    **Arguments:**

    - `batch`: a PyTree of arrays (NumPy or JAX) sharing one leading batch size.
    - `mesh`: the device mesh.
    - `batch_axis`: the mesh axis (or tuple of axes) the batch is split over.

    **Returns:**

    The batch with every array a `jax.Array` laid out as `NamedSharding(mesh, P(batch_axis))`.

    **Raises:**

    - `ValueError` if the mesh lacks `batch_axis`, the arrays' leading sizes differ, or the
      batch size is not divisible by the number of batch shards.
    """
    n = check_axes(mesh, batch_axis, who="shard_batch", arg="batch_axis", role="to split the batch over")
    size = global_batch_size(batch, "shard_batch")
    if size % n:
        raise ValueError(
            f"shard_batch: the global batch size {size} is not divisible by the {n} shards of "
            f"batch axis {batch_axis!r}. Use a batch size that is a multiple of {n}."
        )
    return shard(batch, mesh, PartitionSpec(batch_axis))


def optimizer_specs(
    optimizer: optax.GradientTransformation, opt_state: PyTree, model: PyTree, param_specs: PyTree
) -> PyTree[PartitionSpec]:
    """Specs for an optax state whose parameter-shaped parts follow `param_specs`.

    Moments and other per-parameter buffers get their parameter's spec; counters and other
    scalars are replicated. [`eqxpar.train.TrainStep`][]`.init` uses it; call it yourself to
    place an optimizer state made elsewhere with [`eqxpar.shard`][].

    **Arguments:**

    - `optimizer`: the optax optimizer that made `opt_state`.
    - `opt_state`: its state (or `jax.eval_shape` of it).
    - `model`: the model the state belongs to.
    - `param_specs`: a prefix tree of specs for `model`.

    **Returns:**

    A tree of `PartitionSpec`s with the structure of `opt_state`.
    """
    specs = jax.tree_util.tree_unflatten(
        jax.tree.structure(model), broadcast_specs(param_specs, model, what="param_specs")
    )
    # optax states hold `eqx.filter(model, eqx.is_inexact_array)`-shaped trees, with None
    # where the model has other leaves: give the spec tree the same holes.
    specs = jax.tree.map(lambda s, x: s if eqx.is_inexact_array(x) else None, specs, model, is_leaf=is_spec)
    return optax.tree_map_params(
        optimizer,
        lambda _, spec: spec,
        opt_state,
        specs,
        transform_non_params=lambda _: PartitionSpec(),
        is_leaf=is_spec,
    )


def constrain_to_specs(tree: PyTree, specs: PyTree, mesh: Mesh) -> PyTree:
    """Pin a step's outputs (the updated model, the optimizer state) to the layout of its
    inputs, `specs` on `mesh`, so the buffers can be donated and the next call reuses the
    compilation. On an Explicit mesh the layout is in the types already: `tree` as it is."""
    if any(t == AxisType.Explicit for t in mesh.axis_types):
        return tree
    arrays, others = eqx.partition(tree, eqx.is_array)
    shardings = jax.tree.map(
        lambda s, x: None if x is None else NamedSharding(mesh, s or PartitionSpec()), specs, arrays, is_leaf=is_spec
    )
    return eqx.combine(jax.lax.with_sharding_constraint(arrays, shardings), others)
