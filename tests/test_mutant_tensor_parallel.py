"""ColumnParallelLinear(gather_output=True) called on a batch of inputs, `(batch, in)` at
once, equals the dense layer: the blocks are gathered along the features, not the batch.
(The parity property calls it on one vector at a time, where the two dimensions are the
same one.) Caught by this test: tools/mutants.toml's tp-column-gather-wrong-dimension."""

import equinox as eqx
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_nn_parity import _dense, _normal, assert_parallel_equals_dense

from eqxpar import nn


@pytest.mark.parametrize("n, batch", [(2, 3), (4, 4)])
def test_column_gather_output_on_a_batch_equals_dense(n, batch):
    rng = np.random.default_rng(n)
    dense = _dense(eqx.nn.Linear, 5, 2 * n, True, rng=rng)
    tp = nn.ColumnParallelLinear.from_dense(dense, gather_output=True)
    x = _normal(rng, 2, batch, 5)  # two examples, each a (batch, 5) array
    assert_parallel_equals_dense(
        tp, dense, [x], n, call=lambda layer, x: layer(x), dense_call=lambda layer, x: jax.vmap(layer)(x), out_spec=P()
    )
