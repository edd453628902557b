"""A tiny model with a MixtureOfExperts layer trained by eqxpar's step builders with
`expert_axis="expert"`: the batch split over `data x expert`, each device routing its own
sequences and holding its experts. The same losses (cross-entropy plus the auxiliary
losses), gradients and parameters after two SGD-with-momentum steps as one device; the
all-to-all bytes of the theory in the compiled step; bad input named before compile.

`expert_parity` (`eqxpar.testing.check_parallel_parity` with an expert axis, and the loss
going down) is shared with tests/test_moe_llama.py.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _budget import PINS_ONLY
from hypothesis import example, given
from hypothesis import strategies as st

import eqxpar
from eqxpar import nn
from eqxpar.inspect import CommReport, expert_parallel_theory
from eqxpar.testing import check_parallel_parity, mesh_sizes
from eqxpar.train import data_parallel_step, fsdp_step, hybrid_step, shard_batch

VOCAB, DIM, HIDDEN, SEQ = 16, 8, 16, 6
meshes = mesh_sizes(("data", "expert")).filter(lambda s: s["data"] <= 2)


class TinyMoEModel(eqx.Module):
    """Embedding, one MoE layer on a residual, a linear head: one routing group per sequence."""

    embedding: eqx.nn.Embedding
    moe: nn.MixtureOfExperts
    head: eqx.nn.Linear

    def __init__(self, experts, top_k, capacity_factor, *, key, axis_name="expert"):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embedding = eqx.nn.Embedding(VOCAB, DIM, key=k1)
        self.moe = nn.MixtureOfExperts(
            DIM, HIDDEN, experts, top_k, capacity_factor=capacity_factor, axis_name=axis_name, key=k2
        )
        self.head = eqx.nn.Linear(DIM, VOCAB, key=k3)

    def __call__(self, tokens):
        h = jnp.take(self.embedding.weight, tokens, axis=0)  # (batch, seq, dim)
        y, aux = self.moe(h)
        h = h + y
        logits = jnp.einsum("bsd,vd->bsv", h, self.head.weight) + self.head.bias.reshape(1, 1, VOCAB)
        return logits, aux


def loss_fn(model, batch, key):
    tokens, targets = batch
    logits, aux = model(tokens)
    cross_entropy = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    return cross_entropy + 1e-2 * aux.load_balance_loss.mean() + 1e-3 * aux.z_loss.mean()


def token_batch(size, seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, size=(size, SEQ)).astype(np.int32)
    return tokens, np.roll(tokens, -1, axis=1)


def expert_parity(model, loss_fn, mesh, batch, *, strategy):
    """`check_parallel_parity` with `expert_axis="expert"` (the batch split over the batch
    axes and `expert`, each device holding its experts) against one device: the losses, the
    first step's gradients and the parameters after two SGD-with-momentum steps, within
    float32's tolerances; and the loss goes down."""
    optimizer = optax.sgd(0.05, momentum=0.9)
    report = check_parallel_parity(
        model, model, loss_fn, optimizer, mesh, batch, strategy=strategy, expert_axis="expert", steps=2
    )
    assert report.losses[-1] < report.losses[0], report
    return report


@PINS_ONLY  # the two pinned below (each compiles a parallel and a one-device step); draws under thorough
@given(
    sizes=meshes,
    experts_per_device=st.sampled_from([1, 2]),
    top_k=st.sampled_from([1, 2]),
    capacity_factor=st.sampled_from([0.5, 1.25, None]),
    seed=st.integers(0, 2**16),
)
@example(sizes={"data": 2, "expert": 4}, experts_per_device=1, top_k=2, capacity_factor=0.5, seed=1)
@example(sizes={"data": 1, "expert": 8}, experts_per_device=1, top_k=2, capacity_factor=None, seed=2)
def test_step_with_an_expert_axis_equals_one_device(sizes, experts_per_device, top_k, capacity_factor, seed):
    mesh = eqxpar.make_mesh(**sizes)
    experts = sizes["expert"] * experts_per_device
    model = TinyMoEModel(experts, min(top_k, experts), capacity_factor, key=jax.random.key(seed))
    expert_parity(model, loss_fn, mesh, token_batch(2 * sizes["data"] * sizes["expert"], seed), strategy="data")


@pytest.mark.thorough
@pytest.mark.parametrize("strategy", ["hybrid", "fsdp"])
def test_hybrid_and_fsdp_steps_take_an_expert_axis(strategy):
    """The same on the two other builders: fsdp_step (the batch over `fsdp`, fsdp_step's own
    param_specs) splits the router, embedding and head over `fsdp` as well (gathered,
    reduce-scattered) and keeps the experts on their devices."""
    if strategy == "hybrid":
        mesh = eqxpar.make_mesh(data=2, expert=2, model=2)
    else:
        mesh = eqxpar.make_mesh(fsdp=2, expert=4)
    model = TinyMoEModel(4, 2, 1.0, key=jax.random.key(3))
    expert_parity(model, loss_fn, mesh, token_batch(16, 3), strategy=strategy)


@functools.cache
def _compiled_step(sizes: tuple):
    mesh = eqxpar.make_mesh(**dict(sizes))
    model = TinyMoEModel(8, 2, 1.25, key=jax.random.key(0))
    step = data_parallel_step(
        loss_fn, optax.sgd(0.1, momentum=0.9), mesh, param_specs=nn.partition_specs(model, mesh), expert_axis="expert"
    )
    placed, opt_state = step.init(model)
    lowered = step.lower(placed, opt_state, shard_batch(token_batch(16, 0), mesh, batch_axis=step.batch_axis))
    return mesh, model, lowered, lowered.compile()


@pytest.mark.parametrize("sizes", [(("data", 2), ("expert", 4)), (("data", 1), ("expert", 8))])
def test_the_step_sends_the_all_to_all_bytes_of_the_theory(sizes):
    mesh, model, lowered, compiled = _compiled_step(sizes)
    report = CommReport.of(lowered, compiled)
    # The layer's input (the embedding lookup) has a gradient: four all-to-alls.
    theory = expert_parallel_theory(
        mesh, groups=16, capacity=model.moe.capacity(SEQ), dim=DIM, num_experts=8, batch_axis=("data", "expert")
    )
    comparison = report.versus(theory)
    for stage in ("lowered", "compiled"):
        assert report.count("all-to-all", stage=stage) == 4, str(report)
        assert report.bytes("all-to-all", axes="expert", stage=stage) == theory.bytes("all-to-all") > 0
        assert comparison.ratio("all-to-all", stage=stage) == 1.0
    # No all-gather of the MoE's outputs (the replicated-input mode) and no all-reduce of the
    # experts' gradients over `expert`: each device keeps its experts' gradients.
    assert report.count("all-gather", stage="lowered") == 0, str(report)


def test_experts_gradients_are_not_summed_over_the_expert_axis():
    """The lowered step sums the experts' gradients over `data` only: every all-reduce of
    expert-sized arrays names `data` alone."""
    mesh, model, lowered, _ = _compiled_step((("data", 2), ("expert", 4)))
    report = CommReport.of(lowered)
    expert_bytes = 2 * DIM * HIDDEN * 4 + HIDDEN * DIM * 4  # gate, up, down of this device's 2 experts
    assert report.bytes("all-reduce", axes="data", stage="lowered") >= expert_bytes
    everywhere = report.bytes("all-reduce", axes=("data", "expert"), stage="lowered")
    # Over both axes: the loss, router, embedding and head gradients, and the norm: no experts.
    dense_bytes = 4 * (1 + DIM * 8 + VOCAB * DIM + VOCAB * DIM + VOCAB)
    assert 0 < everywhere <= dense_bytes + 64, str(report)


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: (eqxpar.make_mesh(data=8), TinyMoEModel(8, 2, 1.0, key=jax.random.key(0))),
            r"expert_axis='expert', but the mesh has no 'expert' axis .* eqxpar.make_mesh\(data=2, expert=4\)",
        ),
        (
            lambda: (eqxpar.make_mesh(data=2, expert=4), TinyMoEModel(6, 2, 1.0, key=jax.random.key(0))),
            r"num_experts=6 is not divisible by the size 4 of the expert axis 'expert'.*Choose num_experts a multiple",
        ),
        (
            lambda: (
                eqxpar.make_mesh(data=2, expert=4),
                TinyMoEModel(8, 2, 1.0, key=jax.random.key(0), axis_name="data"),
            ),
            r"splits its experts over 'data', but the step's expert_axis is 'expert'.*axis_name='expert'",
        ),
    ],
)
def test_bad_expert_input_is_named_before_compile(make, message):
    mesh, model = make()
    with pytest.raises(ValueError, match=message):
        step = data_parallel_step(loss_fn, optax.sgd(0.1), mesh, expert_axis="expert")
        step.init(model)


def test_expert_axis_in_the_batch_axes_or_not_a_name():
    mesh = eqxpar.make_mesh(data=2, expert=4)
    with pytest.raises(ValueError, match=r"also in batch_axis.*Pass batch_axis='data' and expert_axis='expert'"):
        data_parallel_step(loss_fn, optax.sgd(0.1), mesh, batch_axis=("data", "expert"), expert_axis="expert")
    with pytest.raises(ValueError, match=r"expert_axis must be one mesh axis name"):
        hybrid_step(loss_fn, optax.sgd(0.1), eqxpar.make_mesh(data=2, model=4), expert_axis=("expert",))


def test_experts_on_a_batch_axis_without_expert_axis():
    mesh = eqxpar.make_mesh(fsdp=2, expert=4)
    model = TinyMoEModel(8, 2, 1.0, key=jax.random.key(0))
    step = fsdp_step(loss_fn, optax.sgd(0.1), mesh, batch_axis=("fsdp", "expert"))
    with pytest.raises(ValueError, match=r"also a batch axis of the step.*expert_axis='expert'"):
        step.init(model)


def test_replicated_groups_must_split_over_the_expert_axis():
    """Without an expert axis in the step, the batch is the same on every device of
    `expert` and the layer routes a block of it on each (its replicated-input mode)."""
    mesh = eqxpar.make_mesh(data=1, expert=4)
    model = TinyMoEModel(4, 2, 1.0, key=jax.random.key(0))
    step = data_parallel_step(loss_fn, optax.sgd(0.1), mesh, param_specs=nn.partition_specs(model, mesh))
    model, opt_state = step.init(model)
    with pytest.raises(ValueError, match=r"6 groups, which do not split; use a multiple of 4"):
        step(model, opt_state, shard_batch(token_batch(6, 0), mesh))


def test_the_parity_toolkit_takes_an_expert_axis():
    """`eqxpar.testing.check_parallel_parity`, as a user checks their own MoE model: on a
    mesh with an `expert` axis it builds its step with `expert_axis="expert"` (the batch split
    over data x expert, each device holding its experts) and compares losses, gradients and
    parameters with one device. Without the expert axis the step would treat the experts'
    leaves as replicated and refuse them (test_experts_on_a_batch_axis_without_expert_axis)."""
    model = TinyMoEModel(4, 2, 1.0, key=jax.random.key(0))
    mesh = eqxpar.make_mesh(data=2, expert=4)
    report = check_parallel_parity(
        model, model, loss_fn, optax.sgd(0.05, momentum=0.9), mesh, token_batch(16, 0), steps=2
    )
    assert report.losses[-1] < report.losses[0], report
    assert report.leaves == len(jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))
