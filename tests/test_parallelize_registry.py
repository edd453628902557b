"""`eqxpar.nn.register_style`: an attention class `parallelize` does not know (here one with
a fused q/k/v projection, as other libraries write it, which no built-in style may split)
gets a parallel form its author writes from `eqxpar.nn` layers; the automatic plan then
uses it, and the parallel step equals the dense model on one device."""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from _budget import THOROUGH
from _plain_layers import DIM, SEQ, VOCAB, FusedAttention, ParallelFusedAttention, fused_attention_registered
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

import eqxpar
from eqxpar.testing import check_parallel_parity


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
    with fused_attention_registered():
        yield


# The fixture registers once per test, not per drawn example: the same style each time.
# The default run takes the pinned example only; test_parallelize_drawn.py also pins this
# style inside a scanned stack under FSDP x TP.
@settings(
    max_examples=60 if THOROUGH else 1,
    phases=settings().phases if THOROUGH else (Phase.explicit,),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
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
