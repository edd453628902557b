"""The layers communicate the minimum, read from the compiled HLO (and the lowered module):
an MLP or attention layer does one all-reduce of `batch x features` forward, two with the
backward pass; an embedding lookup one; and a wasteful variant fails these checks."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar import nn
from eqxpar.inspect import communication_report
from eqxpar.nn._base import local_block


def _forward_and_backward(layer, inputs, n, *, out_spec=P()):
    """Communication reports of the layer's forward pass over a batch, and of the gradients
    with respect to the layer and its (floating-point) inputs."""
    mesh = eqxpar.make_mesh(model=n)
    specs = nn.partition_specs(layer, mesh)
    forward = eqxpar.filter_shard_map(
        lambda layer, *inputs: jax.vmap(layer)(*inputs),
        mesh=mesh,
        in_specs=(specs, *(P() for _ in inputs)),
        out_specs=out_spec,
    )
    placed = eqxpar.shard(layer, mesh, specs)
    # A loss whose gradient depends on the output, as in training: with a loss linear in the
    # output the backward pass would not need the forward all-reduce's result, and XLA may
    # then drop it (grad only) or merge it with the backward one (value_and_grad).
    grads = eqx.filter_value_and_grad(
        lambda layer_and_inputs: jnp.sum(forward(layer_and_inputs[0], *layer_and_inputs[1]) ** 2)
    )
    return communication_report(forward, placed, *inputs), communication_report(grads, (placed, tuple(inputs)))


def assert_all_reduces(report, elements, what):
    """Exactly these all-reduces (their per-device element counts, in any order) and no other
    collective, both as lowered and as compiled."""
    for stage in ("lowered", "compiled"):
        ops = report.collectives(stage=stage)
        got = sorted((c.kind, c.elements) for c in ops)
        want = sorted(("all-reduce", e) for e in elements)
        assert got == want, f"{what} ({stage}): expected all-reduces of {elements} elements, got\n{report}"


@pytest.mark.parametrize("n", [2, 8])
def test_parallel_mlp_one_all_reduce_each_way(n):
    batch, in_size, out_size = 5, 6, 7
    mlp = nn.ParallelMLP(in_size, out_size, 4 * n, key=jax.random.key(0))
    forward, backward = _forward_and_backward(mlp, [jnp.ones((batch, in_size))], n)
    assert_all_reduces(forward, [batch * out_size], "ParallelMLP forward")
    # Backward adds one: the input gradient, batch x in_size.
    assert_all_reduces(backward, [batch * out_size, batch * in_size], "ParallelMLP forward+backward")


@pytest.mark.parametrize("n", [2, 8])
def test_parallel_self_attention_one_all_reduce_each_way(n):
    batch, seq, dim = 2, 5, 6
    attention = nn.ParallelMultiheadAttention(n, dim, qk_size=2, vo_size=3, causal=True, key=jax.random.key(0))
    forward, backward = _forward_and_backward(attention, [jnp.ones((batch, seq, dim))], n)
    assert_all_reduces(forward, [batch * seq * dim], "attention forward")
    # Query, key and value read one input: their gradients are added locally, then one psum.
    assert_all_reduces(backward, [batch * seq * dim] * 2, "attention forward+backward")


def test_embedding_and_row_layer_communicate_nothing_backward():
    n, tokens, dim = 4, 9, 5
    embedding = nn.VocabParallelEmbedding(8, dim, key=jax.random.key(0))
    forward, backward = _forward_and_backward(embedding, [jnp.zeros((tokens,), jnp.int32)], n)
    assert_all_reduces(forward, [tokens * dim], "embedding forward")
    assert_all_reduces(backward, [tokens * dim], "embedding forward+backward")


def test_column_gather_output_is_one_all_gather_and_a_free_backward_slice():
    n, batch, out = 4, 3, 8
    column = nn.ColumnParallelLinear(5, out, gather_output=True, key=jax.random.key(0))
    forward, backward = _forward_and_backward(column, [jnp.ones((batch, 5))], n)
    for report in (forward, backward):
        (gathered,) = report.collectives("all-gather")
        assert gathered.elements == batch * out
    assert forward.count() == 1
    # Backward: only the input gradient's all-reduce; the gathered output's gradient is a
    # local slice of the (replicated) output gradient.
    assert backward.count("all-reduce") == 1 and backward.count() == 2, str(backward)


class _GatheringMLP(nn.ParallelMLP):
    """A wasteful MLP: all-gathers the hidden units, then each device takes its block again
    for the row layer. Same result, one collective too many."""

    def __call__(self, x, *, key=None, inference=None):
        h = jax.vmap(self.activation)(self.hidden(x))
        h = jax.lax.all_gather(h, self.axis_name, tiled=True, to="invarying")
        return self.output(local_block(h, self.axis_name))


def test_a_wasteful_mlp_fails_the_minimum_check():
    n, batch = 4, 5
    wasteful = _GatheringMLP.from_dense(eqx.nn.MLP(6, 7, 16, 1, key=jax.random.key(0)))
    forward, _ = _forward_and_backward(wasteful, [jnp.ones((batch, 6))], n)
    with pytest.raises(AssertionError, match="expected all-reduces"):
        assert_all_reduces(forward, [batch * 7], "wasteful MLP forward")
