"""A tiny model with a MixtureOfExperts layer trained by eqxpar's own data-parallel step over
`data x expert`: the same losses (cross-entropy plus the auxiliary losses), gradients and
parameters after two SGD-with-momentum steps as one device, and the all-to-all bytes of the
theory in the compiled step.

The step splits the batch over `data`; the experts are split over `expert` by the layer's
specs, and the tokens reach the MoE layer the same on every device of `expert`: each device
routes its block of the groups and an all-gather returns every output (the layer's
replicated-input mode).
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _budget import examples
from hypothesis import example, given
from hypothesis import strategies as st

import eqxpar
from eqxpar import nn
from eqxpar.inspect import CommReport, expert_parallel_theory
from eqxpar.testing import check_parallel_parity, mesh_sizes
from eqxpar.train import data_parallel_step, optimizer_specs, shard_batch

VOCAB, DIM, HIDDEN, SEQ = 16, 8, 16, 6
meshes = mesh_sizes(("data", "expert")).filter(lambda s: s["data"] <= 2)


class TinyMoEModel(eqx.Module):
    """Embedding, one MoE layer on a residual, a linear head: one routing group per sequence."""

    embedding: eqx.nn.Embedding
    moe: nn.MixtureOfExperts
    head: eqx.nn.Linear

    def __init__(self, experts, top_k, capacity_factor, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embedding = eqx.nn.Embedding(VOCAB, DIM, key=k1)
        self.moe = nn.MixtureOfExperts(DIM, HIDDEN, experts, top_k, capacity_factor=capacity_factor, key=k2)
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


@examples(2)  # and the two pinned below: each example compiles a parallel and a one-device step
@given(
    sizes=meshes,
    experts_per_device=st.sampled_from([1, 2]),
    top_k=st.sampled_from([1, 2]),
    capacity_factor=st.sampled_from([0.5, 1.25, None]),
    seed=st.integers(0, 2**16),
)
@example(sizes={"data": 2, "expert": 4}, experts_per_device=1, top_k=2, capacity_factor=0.5, seed=1)
@example(sizes={"data": 1, "expert": 8}, experts_per_device=1, top_k=2, capacity_factor=None, seed=2)
def test_data_parallel_step_over_data_and_expert_equals_one_device(
    sizes, experts_per_device, top_k, capacity_factor, seed
):
    mesh = eqxpar.make_mesh(**sizes)
    experts = sizes["expert"] * experts_per_device
    model = TinyMoEModel(experts, min(top_k, experts), capacity_factor, key=jax.random.key(seed))
    batch = token_batch(2 * sizes["data"] * sizes["expert"], seed)
    report = check_parallel_parity(model, model, loss_fn, optax.sgd(0.1, momentum=0.9), mesh, batch, steps=2)
    assert len(report.losses) == 2 and report.losses[1] < report.losses[0]


@functools.cache
def _compiled_step(sizes: tuple):
    mesh = eqxpar.make_mesh(**dict(sizes))
    model = TinyMoEModel(8, 2, 1.25, key=jax.random.key(0))
    specs = nn.partition_specs(model, mesh)
    optimizer = optax.sgd(0.1, momentum=0.9)
    step = data_parallel_step(loss_fn, optimizer, mesh, param_specs=specs)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    opt_state = eqxpar.shard(opt_state, mesh, optimizer_specs(optimizer, opt_state, model, specs))
    batch = shard_batch(token_batch(16, 0), mesh, batch_axis="data")
    lowered = step.lower(eqxpar.shard(model, mesh, specs), opt_state, batch)
    return mesh, model, lowered, lowered.compile()


@pytest.mark.parametrize("sizes", [(("data", 2), ("expert", 4)), (("data", 1), ("expert", 8))])
def test_the_step_sends_the_all_to_all_bytes_of_the_theory(sizes):
    mesh, model, lowered, compiled = _compiled_step(sizes)
    report = CommReport.of(lowered, compiled)
    theory = expert_parallel_theory(
        mesh,
        groups=16,
        capacity=model.moe.capacity(SEQ),
        dim=DIM,
        num_experts=8,
        batch_axis=tuple(mesh.axis_names),  # each device routes 16 / (data x expert) groups
    )
    comparison = report.versus(theory)
    for stage in ("lowered", "compiled"):
        assert report.count("all-to-all", stage=stage) == 4, str(report)
        assert report.bytes("all-to-all", axes="expert", stage=stage) == theory.bytes("all-to-all") > 0
        assert comparison.ratio("all-to-all", stage=stage) == 1.0


def test_replicated_groups_must_split_over_the_expert_axis():
    mesh = eqxpar.make_mesh(data=1, expert=4)
    model = TinyMoEModel(4, 2, 1.0, key=jax.random.key(0))
    step = data_parallel_step(loss_fn, optax.sgd(0.1), mesh, param_specs=nn.partition_specs(model, mesh))
    model, opt_state = step.init(model)
    with pytest.raises(ValueError, match=r"6 groups, which do not split; use a multiple of 4"):
        step(model, opt_state, shard_batch(token_batch(6, 0), mesh))
