"""A user's attention that cuts its q/k/v projections into heads by a fixed count
(`reshape(seq, num_heads, -1)`, einops' `h=num_heads`) instead of by their size: under
`parallelize`'s 'column' split every shape still fits, each device takes slivers of every
head, and the model trained silently wrong (loss 3.5441 against the dense 3.5720, every
gradient off). The step now traces the user's code on both sides before compiling and
refuses it, naming the line; written by size (`reshape(seq, -1, head_dim)`) it trains as
one device (tests/test_parallelize_drawn.py, tests/test_parallelize_llama_style.py)."""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _plain_layers import DIM, HEAD_DIM, SEQ, VOCAB, Attention, rope

import eqxpar
from eqxpar.train import fsdp_step, hybrid_step, shard_batch


class CountCutAttention(Attention):
    """`Attention`'s layers, cut into `heads` / `kv_heads` parts of whatever size."""

    def cut(self, x, parts):
        return x.reshape(x.shape[0], parts, -1)  # by count: the bug

    def __call__(self, x):
        seq = x.shape[0]
        q = rope(self.cut(jax.vmap(self.q)(x), self.heads))
        k = rope(self.cut(jax.vmap(self.k)(x), self.kv_heads))
        v = self.cut(jax.vmap(self.v)(x), self.kv_heads)
        group = self.heads // self.kv_heads
        k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
        logits = jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(HEAD_DIM)
        causal = jnp.tril(jnp.ones((seq, seq), bool))[None]
        weights = jax.nn.softmax(jnp.where(causal, logits, -1e30), axis=-1)
        return jax.vmap(self.o)(jnp.einsum("hqk,khd->qhd", weights, v).reshape(seq, -1))


class Model(eqx.Module):
    embedding: eqx.nn.Embedding
    attention: CountCutAttention  # with `stacked`, two layers built with eqx.filter_vmap
    head: eqx.nn.Linear
    stacked: bool = eqx.field(static=True)

    def __init__(self, stacked: bool, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embedding = eqx.nn.Embedding(VOCAB, DIM, key=k1)
        make = lambda k: CountCutAttention(2, key=k)  # noqa: E731
        self.attention = eqx.filter_vmap(make)(jax.random.split(k2, 2)) if stacked else make(k2)
        self.head = eqx.nn.Linear(DIM, VOCAB, key=k3)
        self.stacked = stacked

    def __call__(self, tokens):
        x = jax.vmap(self.embedding)(tokens)
        if self.stacked:
            arrays, static = eqx.partition(self.attention, eqx.is_array)
            x, _ = jax.lax.scan(lambda h, layer: (h + eqx.combine(layer, static)(h), None), x, arrays)
        else:
            x = x + self.attention(x)
        return jax.vmap(self.head)(x)


def loss_fn(model, batch, key):
    del key
    logits = jax.vmap(model)(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


@pytest.mark.parametrize("strategy, stacked", [("hybrid", False), ("fsdp", True)])
def test_cutting_split_heads_by_count_is_refused_before_compiling(strategy, stacked):
    mesh = eqxpar.make_mesh(**{"data" if strategy == "hybrid" else "fsdp": 2, "model": 2})
    prefix = "attention"
    plan = {f"{prefix}.{name}": "column" for name in "qkv"} | {f"{prefix}.o": "row"}
    parallel = eqxpar.nn.parallelize(Model(stacked, key=jax.random.key(0)), plan, mesh=mesh)
    step = (hybrid_step if strategy == "hybrid" else fsdp_step)(loss_fn, optax.sgd(0.1), mesh)
    model, opt_state = step.init(parallel)
    tokens = shard_batch(np.zeros((4, SEQ + 1), np.int32), mesh, batch_axis=step.batch_axis)
    with pytest.raises(ValueError) as error:
        step.lower(model, opt_state, tokens)
    message = str(error.value)
    # The line of q's reshape (the first cut), both cuts, and the fix.
    line = CountCutAttention.cut.__code__.co_firstlineno + 1
    assert f"test_parallelize_head_cuts.py:{line} cuts an output" in message, message
    assert "into (4, 4) on each device, where the dense model has (4, 8)" in message, message
    assert "reshape(seq, -1, head_dim)" in message and "train silently wrong" in message


def test_refused_with_gradient_accumulation_and_from_a_folder_named_jax(tmp_path, monkeypatch):
    """The check traces one micro-batch (a loss may reshape by its micro-batch size), and
    tells the model's code from the libraries' by their install folders: a user's project
    under a folder named `jax` is still the user's code."""
    folder = tmp_path / "jax"
    folder.mkdir()
    (folder / "user_cut.py").write_text("def cut(x, parts):\n    return x.reshape(x.shape[0], parts, -1)\n")
    monkeypatch.syspath_prepend(str(folder))
    from user_cut import cut

    class FolderCutAttention(CountCutAttention):
        def cut(self, x, parts):
            return cut(x, parts)  # the user's helper, in their folder named jax

    mesh = eqxpar.make_mesh(data=2, model=2)
    dense = Model(False, key=jax.random.key(0))
    dense = eqx.tree_at(lambda m: m.attention, dense, FolderCutAttention(2, key=jax.random.key(1)))
    plan = {"attention.q": "column", "attention.k": "column", "attention.v": "column", "attention.o": "row"}

    def micro_loss(model, batch, key):  # reshapes by its micro-batch: 8 / (data=2 x grad_accum=2)
        return loss_fn(model, batch.reshape(2, SEQ + 1), key)

    step = hybrid_step(micro_loss, optax.sgd(0.1), mesh, grad_accum=2)
    model, opt_state = step.init(eqxpar.nn.parallelize(dense, plan, mesh=mesh))
    tokens = shard_batch(np.zeros((8, SEQ + 1), np.int32), mesh, batch_axis="data")
    with pytest.raises(ValueError, match=r"jax/user_cut\.py:2 cuts an output .* into \(4, 4\) on each device"):
        step.lower(model, opt_state, tokens)
