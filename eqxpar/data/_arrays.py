"""Global `jax.Array`s from the rows one process (or one device) loaded."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding
from jaxtyping import Array, PyTree


def global_shapes(batch: PyTree, rows: int, global_batch_size: int) -> PyTree:
    """Each leaf's global shape: its `rows` leading rows become `global_batch_size`."""

    def one(leaf):
        if np.ndim(leaf) == 0 or np.shape(leaf)[0] != rows:
            raise ValueError(
                f"every leaf of a loaded batch needs a leading dimension of {rows} rows; got shape {np.shape(leaf)}."
            )
        return (global_batch_size, *np.shape(leaf)[1:])

    return jax.tree.map(one, batch)


def from_process_local(
    local: PyTree[np.ndarray], sharding: NamedSharding, rows: int, global_batch_size: int
) -> PyTree[Array]:
    """Global arrays of `global_batch_size` rows laid out as `sharding`, from this process's `rows`."""
    shapes = global_shapes(local, rows, global_batch_size)
    return jax.tree.map(
        lambda leaf, shape: jax.make_array_from_process_local_data(sharding, np.asarray(leaf), shape),
        local,
        shapes,
        is_leaf=lambda x: isinstance(x, np.ndarray),
    )
