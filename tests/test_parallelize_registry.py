"""`eqxpar.nn.register_style`: an attention class `parallelize` does not know (here one with
a fused q/k/v projection, as other libraries write it, which no built-in style may split)
gets a parallel form its author writes from `eqxpar.nn` layers; the automatic plan then
uses it, and the parallel step equals the dense model on one device."""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _budget import THOROUGH
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import eqxpar
from eqxpar.nn import ColumnParallelLinear, RowParallelLinear, TensorParallelLayer
from eqxpar.testing import check_parallel_parity

VOCAB, DIM, HEADS, SEQ = 32, 32, 4, 8
HEAD_DIM = DIM // HEADS


class FusedAttention(eqx.Module):
    """Causal attention with one fused q/k/v Linear (another library's layer)."""

    qkv: eqx.nn.Linear
    out: eqx.nn.Linear
    num_heads: int = eqx.field(static=True)

    def __init__(self, *, key):
        k1, k2 = jax.random.split(key)
        self.qkv = eqx.nn.Linear(DIM, 3 * DIM, key=k1)
        self.out = eqx.nn.Linear(DIM, DIM, key=k2)
        self.num_heads = HEADS

    def __call__(self, x):
        q, k, v = jnp.split(jax.vmap(self.qkv)(x), 3, axis=-1)
        return jax.vmap(self.out)(attend(q, k, v))


def attend(q, k, v):
    """Causal attention over however many heads of HEAD_DIM the projections hold."""
    seq = q.shape[0]
    q, k, v = (t.reshape(seq, -1, HEAD_DIM) for t in (q, k, v))
    logits = jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(HEAD_DIM)
    logits = jnp.where(jnp.tril(jnp.ones((seq, seq), bool))[None], logits, -1e30)
    return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(logits, axis=-1), v).reshape(seq, -1)


def _linear(weight, bias):
    template = eqx.filter_eval_shape(eqx.nn.Linear, weight.shape[1], weight.shape[0], key=jax.random.key(0))
    return eqx.tree_at(lambda l: (l.weight, l.bias), template, (weight, bias))


class ParallelFusedAttention(TensorParallelLayer):
    """Its parallel form, written by the layer's user: q, k and v each split by heads."""

    q: ColumnParallelLinear
    k: ColumnParallelLinear
    v: ColumnParallelLinear
    out: RowParallelLinear
    num_heads: int = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)

    def __init__(self, dense: FusedAttention, axis_name: str):
        weights, biases = jnp.split(dense.qkv.weight, 3), jnp.split(dense.qkv.bias, 3)
        q, k, v = (ColumnParallelLinear.from_dense(_linear(w, b), axis_name=axis_name) for w, b in zip(weights, biases))
        self.q, self.k, self.v = q, k, v
        self.out = RowParallelLinear.from_dense(dense.out, axis_name=axis_name)
        self.num_heads, self.axis_name = dense.num_heads, axis_name

    def to_dense(self):
        dense = eqx.filter_eval_shape(FusedAttention, key=jax.random.key(0))
        qkv = [self.q.to_dense(), self.k.to_dense(), self.v.to_dense()]
        weight = jnp.concatenate([layer.weight for layer in qkv])
        bias = jnp.concatenate([layer.bias for layer in qkv])
        dense = eqx.tree_at(lambda d: (d.qkv.weight, d.qkv.bias), dense, (weight, bias))
        return eqx.tree_at(lambda d: (d.out.weight, d.out.bias), dense, (self.out.weight, self.out.bias))

    def check_axis_size(self, size, where=""):
        if self.num_heads % size:
            raise self._split_error(where, "num_heads", self.num_heads, size)

    def __call__(self, x):
        # This device's heads end to end; the row layer's psum adds the heads' outputs.
        return self.out(attend(self.q(x), self.k(x), self.v(x)))


class Model(eqx.Module):
    embedding: eqx.nn.Embedding
    attention: FusedAttention
    head: eqx.nn.Linear

    def __init__(self, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embedding = eqx.nn.Embedding(VOCAB, DIM, key=k1)
        self.attention = FusedAttention(key=k2)
        self.head = eqx.nn.Linear(DIM, VOCAB, key=k3)

    def __call__(self, tokens):
        x = jax.vmap(self.embedding)(tokens)
        return jax.vmap(self.head)(x + self.attention(x))


def loss_fn(model, batch, key):
    del key
    logits = jax.vmap(model)(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


@pytest.fixture
def fused_style():
    eqxpar.nn.register_style("fused_attention", FusedAttention, ParallelFusedAttention, split="num_heads")
    yield
    eqxpar.nn.unregister_style("fused_attention")


# The fixture registers once per test, not per drawn example: the same style each time.
@settings(
    max_examples=60 if THOROUGH else 1, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(model=st.sampled_from([2, 4]), seed=st.integers(0, 2**16))
@example(model=4, seed=0)  # one head per device
def test_a_registered_style_is_planned_and_trains_as_one_device(fused_style, model, seed):
    dense = Model(key=jax.random.key(seed))
    plan = eqxpar.nn.auto_plan(dense)
    assert plan["attention"] == "fused_attention" and plan["embedding"] == "vocab"
    parallel = eqxpar.nn.parallelize(dense, {"attention": "fused_attention"})
    assert isinstance(parallel.attention, ParallelFusedAttention)
    tokens = np.random.default_rng(seed).integers(0, VOCAB, (4, SEQ + 1)).astype(np.int32)
    report = check_parallel_parity(
        dense, parallel, loss_fn, optax.sgd(0.1, momentum=0.9), eqxpar.make_mesh(data=2, model=model), tokens, steps=2
    )
    assert report.losses[1] < report.losses[0]


def test_the_plan_table_shows_a_registered_style(fused_style):
    _, plan = eqxpar.nn.parallelize(
        Model(key=jax.random.key(0)), {"attention": "fused_attention"}, mesh=eqxpar.make_mesh(model=2), return_plan=True
    )
    row = next(r for r in plan.rows if r.path == "attention")
    assert (row.style, row.split, row.forward) == ("fused_attention", "num_heads=4 -> 2 per device", "all-reduce")


def test_a_registered_style_checks_the_axis_size(fused_style):
    with pytest.raises(ValueError, match="num_heads=4 is not divisible by the size 8"):
        eqxpar.nn.parallelize(
            Model(key=jax.random.key(0)), {"attention": "fused_attention"}, mesh=eqxpar.make_mesh(model=8)
        )


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        (("column", FusedAttention, ParallelFusedAttention), {"split": "num_heads"}, "is a built-in style"),
        (("x", int, ParallelFusedAttention), {"split": "num_heads"}, "takes must be an eqx.Module class"),
        (("x", FusedAttention, lambda layer: layer), {"split": "num_heads"}, r"convert\(layer, axis_name\)"),
        (("x", FusedAttention, ParallelFusedAttention), {"split": 4}, "split must name an attribute"),
    ],
)
def test_bad_registrations_are_refused(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        eqxpar.nn.register_style(*args, **kwargs)


def test_registering_twice_needs_replace(fused_style):
    with pytest.raises(ValueError, match="registered already"):
        eqxpar.nn.register_style("fused_attention", FusedAttention, ParallelFusedAttention, split="num_heads")
    eqxpar.nn.register_style("fused_attention", FusedAttention, ParallelFusedAttention, split="num_heads", replace=True)


def test_a_converter_that_returns_something_else_is_named():
    eqxpar.nn.register_style("plain", FusedAttention, lambda layer, axis_name: layer, split="num_heads", auto=False)
    try:
        with pytest.raises(ValueError, match="returned a FusedAttention, not an eqxpar.nn.TensorParallelLayer"):
            eqxpar.nn.parallelize(Model(key=jax.random.key(0)), {"attention": "plain"})
    finally:
        eqxpar.nn.unregister_style("plain")
