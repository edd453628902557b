"""parallelize on layers stacked with eqx.filter_vmap and run with the model's own lax.scan
(issue 20): the per-layer plan applies to every layer of the stack, the layer axis is never
split, and the model trains as the dense one on one device, under tensor parallelism (the
hybrid step) and under FSDP with the stacked layers as units (gathered one layer at a time
inside the scan).

The model is written here as a third-party library writes one: equinox.nn layers only,
called per example, its blocks built with `eqx.filter_vmap` and scanned by its own code.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import eqxpar
import eqxpar.nn
from eqxpar.inspect import CommReport
from eqxpar.testing import assert_trees_close, check_parallel_parity, mesh_sizes
from eqxpar.train import fsdp_specs, fsdp_step, shard_batch

OPTIMIZER = optax.sgd(0.1, momentum=0.9)
VOCAB = 16


class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, dim, heads, width, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm1 = eqx.nn.LayerNorm(dim)
        self.attention = eqx.nn.MultiheadAttention(heads, dim, use_query_bias=True, use_output_bias=True, key=k1)
        self.norm2 = eqx.nn.LayerNorm(dim)
        self.up = eqx.nn.Linear(dim, width, key=k2)
        self.down = eqx.nn.Linear(width, dim, key=k3)

    def __call__(self, x):
        mask = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
        h = jax.vmap(self.norm1)(x)
        x = x + self.attention(h, h, h, mask=mask)
        h = jax.vmap(self.norm2)(x)
        return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(h)))


class ScannedLM(eqx.Module):
    embedding: eqx.nn.Embedding
    blocks: Block  # every array with a leading layer axis
    head: eqx.nn.Linear

    def __init__(self, dim, heads, width, layers, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embedding = eqx.nn.Embedding(VOCAB, dim, key=k1)
        self.blocks = eqx.filter_vmap(lambda k: Block(dim, heads, width, k))(jax.random.split(k2, layers))
        self.head = eqx.nn.Linear(dim, VOCAB, key=k3)

    def __call__(self, tokens):
        x = jax.vmap(self.embedding)(tokens)
        arrays, static = eqx.partition(self.blocks, eqx.is_array)

        def body(x, layer):
            return eqx.combine(layer, static)(x), None

        x, _ = jax.lax.scan(body, x, arrays)
        return jax.vmap(self.head)(x)


PLAN = {
    "embedding": "vocab",
    "blocks.attention": "attention",
    "blocks.up": "column",
    "blocks.down": "row",
    "head": "column",
}


def split_loss(model, tokens, key=None):
    logits = jax.vmap(model)(tokens[:, :-1])  # this device's block of the vocabulary
    return eqxpar.nn.vocab_parallel_cross_entropy(logits, tokens[:, 1:], axis_name="model").mean()


def plain_loss(model, tokens, key=None):
    logits = jax.vmap(model)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def model_for(model_size: int, layers: int, seed: int) -> ScannedLM:
    heads = 2 * model_size
    return ScannedLM(2 * heads, heads, 4 * model_size, layers, jax.random.key(seed))


@pytest.mark.thorough
@given(sizes=mesh_sizes(("data", "model"), (8,)), layers=st.sampled_from([2, 4]), seed=st.integers(0, 2**16))
# model=4 and 4 layers: a split of the layer axis over the model axis would divide evenly and
# run, each device scanning one layer; this pins that it is not split.
@example(sizes={"data": 2, "model": 4}, layers=4, seed=0)
def test_tensor_parallel_stack_trains_as_one_device(sizes, layers, seed):
    check_tensor_parallel_stack(sizes, layers, seed)


def test_tensor_parallel_stack_of_as_many_layers_as_model_devices():
    """The drawn test's pinned example, in the default run: 4 layers over model=4, where a
    split layer axis would run (one layer per device) and train wrong."""
    check_tensor_parallel_stack({"data": 2, "model": 4}, 4, 0)


def check_tensor_parallel_stack(sizes, layers, seed):
    mesh = eqxpar.make_mesh(**sizes)
    dense = model_for(sizes["model"], layers, seed)
    parallel, plan = eqxpar.nn.parallelize(dense, PLAN, mesh=mesh, return_plan=True)
    assert plan["blocks.attention"] == "attention" and "stacked layers" in str(plan)
    specs = eqxpar.nn.partition_specs(parallel, mesh)
    for leaf in jax.tree.leaves(specs.blocks, is_leaf=lambda x: isinstance(x, P)):
        assert len(leaf) == 0 or leaf[0] is None, leaf  # the layer axis whole
    assert specs.blocks.up.layers.weight == P(None, "model", None)
    assert bool(eqx.tree_equal(eqxpar.nn.to_dense(parallel), dense))  # the same arrays, stacked as before
    tokens = np.random.default_rng(seed).integers(0, VOCAB, (2 * sizes["data"], 7)).astype(np.int32)
    report = check_parallel_parity(dense, parallel, split_loss, OPTIMIZER, mesh, tokens, steps=2)
    assert len(report.losses) == 2 and all(used <= 1 for used, _ in report.worst.values()), report


@pytest.mark.parametrize(
    "sizes", [{"fsdp": 4, "model": 2}, pytest.param({"fsdp": 4, "model": 1}, marks=pytest.mark.thorough)]
)
def test_fsdp_gathers_one_layer_at_a_time(sizes):
    """4 layers over fsdp=4: the layer axis divides, and fsdp_specs would split it first were
    it not marked as a stack; it splits another dimension, and each layer of the stack, a
    unit, is gathered one layer at a time inside the model's scan. Two SGD-momentum steps
    equal one device's (a dropped or doubled reduce-scatter changes them)."""
    mesh = eqxpar.make_mesh(**sizes)
    dense = model_for(sizes["model"], 4, 11)
    plan = {"blocks.attention": "attention", "blocks.up": "column", "blocks.down": "row"}
    parallel = eqxpar.nn.parallelize(dense, plan, mesh=mesh)
    base = eqxpar.nn.partition_specs(parallel, mesh)
    specs = fsdp_specs(parallel, mesh, param_specs=base)
    for name in ("norm1", "attention", "norm2", "up", "down"):
        layer = getattr(parallel.blocks, name)
        for leaf, spec in zip(
            jax.tree.leaves(layer), jax.tree.structure(layer).flatten_up_to(getattr(specs.blocks, name))
        ):
            if eqx.is_array(leaf):
                assert len(spec) and spec[0] is None and "fsdp" in str(spec), (name, spec)

    b = lambda m: m.blocks  # noqa: E731
    units = lambda m: (b(m).norm1, b(m).attention, b(m).norm2, b(m).up, b(m).down)  # noqa: E731
    step = fsdp_step(plain_loss, OPTIMIZER, mesh, param_specs=specs, units=units)
    model, opt_state = step.init(parallel)

    @eqx.filter_jit
    def dense_step(model, opt_state, tokens):
        loss, grads = eqx.filter_value_and_grad(plain_loss)(model, tokens)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    want, want_state = dense, OPTIMIZER.init(eqx.filter(dense, eqx.is_inexact_array))
    rng = np.random.default_rng(12)
    for _ in range(2):
        tokens = rng.integers(0, VOCAB, (8, 7)).astype(np.int32)
        want, want_state, loss = dense_step(want, want_state, tokens)
        model, opt_state, metrics = step(model, opt_state, shard_batch(tokens, mesh, batch_axis="fsdp"))
        np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-5)
    got = eqxpar.nn.to_dense(eqxpar.gather(model))
    assert_trees_close(
        eqx.filter(got, eqx.is_inexact_array), eqx.filter(want, eqx.is_inexact_array), what="parameters after 2 steps"
    )

    tokens = shard_batch(np.zeros((8, 7), np.int32), mesh, batch_axis="fsdp")
    gathers = CommReport.of(step.lower(model, opt_state, tokens)).collectives("all-gather", stage="lowered")
    in_scan = [c for c in gathers if "while/body" in c.op_name]
    stacked = {tuple(x.shape) for x in jax.tree.leaves(eqx.filter(dense.blocks, eqx.is_array))}
    rest = {tuple(x.shape) for x in jax.tree.leaves(eqx.filter((dense.embedding, dense.head), eqx.is_array))}
    # Every array of the stack gathered inside the scan, one layer's slice at a time ...
    assert len(in_scan) >= len(stacked) and all(len(s) < 3 for c in in_scan for s in c.shapes), in_scan
    # ... and nothing outside it but the embedding and head: no stack gathered whole.
    assert {tuple(s) for c in gathers if c not in in_scan for s in c.shapes} <= rest, gathers


def stacked(layer, *lead):
    """`layer` with every array stacked `lead` deep, as eqx.filter_vmap builds it (zeros:
    only the shapes matter here)."""
    return jax.tree.map(lambda x: jnp.zeros((*lead, *x.shape)) if eqx.is_array(x) else x, layer)


def test_auto_plan_splits_a_stacked_attention_per_layer():
    attention = stacked(eqx.nn.MultiheadAttention(2, 8, key=jax.random.key(0)), 3)
    parallel, plan = eqxpar.nn.parallelize({"attention": attention}, return_plan=True)
    assert dict(plan) == {"['attention']": "attention"}
    assert "num_heads=2, in each of 3 stacked layers" in str(plan), str(plan)
    assert eqxpar.nn.partition_specs(parallel)["attention"].layers.query_proj.weight == P(None, "model", None)


def test_what_still_cannot_be_split_is_refused_with_the_fix():
    linear = eqx.nn.Linear(8, 8, key=jax.random.key(0))
    nested = stacked(linear, 2, 3)  # a stack of stacks: weight (2, 3, 8, 8)
    with pytest.raises(ValueError, match=r"cannot be 'column': .*\(2, 3, 8, 8\), with 2 axes .*Stack the layers once"):
        eqxpar.nn.parallelize({"nested": nested}, {"['nested']": "column"})
    mixed = eqx.tree_at(lambda l: l.bias, stacked(linear, 2), jnp.zeros(8))
    with pytest.raises(ValueError, match=r"leading sizes are \[2, 8\]: not one stack of layers"):
        eqxpar.nn.parallelize({"mixed": mixed}, {"['mixed']": "column"})
    attention = stacked(eqx.nn.MultiheadAttention(2, 8, key=jax.random.key(1)), 2, 3)
    with pytest.warns(UserWarning, match="splits 0 of 1 layers"):  # kept whole, saying why
        _, plan = eqxpar.nn.parallelize({"nested": attention}, return_plan=True)
    assert dict(plan) == {"['nested']": "replicate"} and "a stack of stacks" in plan.rows[0].note


def test_fsdp_refuses_a_parallelized_stack_as_one_unit():
    """The block holding the stacked layers is no unit (its scan never calls it whole): a
    ValueError naming the stack, before anything compiles; its layers are the units."""
    mesh = eqxpar.make_mesh(fsdp=4, model=2)
    plan = {"blocks.attention": "attention", "blocks.up": "column", "blocks.down": "row"}
    parallel = eqxpar.nn.parallelize(model_for(2, 4, 0), plan, mesh=mesh)
    step = fsdp_step(plain_loss, OPTIMIZER, mesh, units=lambda m: m.blocks)
    model, opt_state = step.init(parallel)
    with pytest.raises(ValueError, match=r"units names model.blocks, layers stacked with eqx.filter_vmap: its norm1"):
        step(model, opt_state, shard_batch(np.zeros((8, 7), np.int32), mesh, batch_axis="fsdp"))
