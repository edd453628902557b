"""Expert parallelism equals one device, and sends what the theory says.

The expert-parallel MixtureOfExperts (experts split over `expert`, the routing groups over
`data` x `expert`, two all_to_alls each way) must give the one-device layer's outputs, auxiliary
losses, routed and dropped counts (exactly), gradients of the outputs and the auxiliary
losses with respect to every weight and the input, and parameters after two steps of SGD with
momentum, on every drawn mesh. The compiled program's all-to-all bytes must equal
`eqxpar.inspect.expert_parallel_theory`.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _budget import PINS_ONLY, examples
from hypothesis import example, given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P
from test_moe import random_moe

import eqxpar
from eqxpar import nn
from eqxpar.inspect import communication_report, expert_parallel_theory
from eqxpar.testing import F32_ATOL, assert_trees_close, mesh_sizes, on_one_device

DIM, HIDDEN, TOKENS = 4, 8, 6
# `expert` 1, 2, 4, 8 alone and with `data` 2 (where 8 devices allow).
meshes = mesh_sizes(("data", "expert")).filter(lambda s: s["data"] <= 2)


def losses_and_grads(layer, x, cotangent, balance_weight, z_weight):
    """The layer's output and aux, and the gradients (layer, x) of a loss over both: the
    output against a random cotangent plus each group's aux losses with random weights.
    Inside shard_map it is this device's share; the shares add up to the one-device loss."""

    def loss(layer_and_x):
        layer, x = layer_and_x
        y, aux = layer(x)
        total = jnp.sum(y * cotangent) + jnp.sum(aux.load_balance_loss * balance_weight)
        return total + jnp.sum(aux.z_loss * z_weight), (y, aux)

    (_, (y, aux)), grads = eqx.filter_value_and_grad(loss, has_aux=True)((layer, x))
    return y, aux, grads


def train(grad_fn, layer, x, cotangent, balance_weight, z_weight):
    """The first call's (output, aux, gradients) and the layer after two SGD-with-momentum steps."""
    optimizer = optax.sgd(0.05, momentum=0.9)
    state = optimizer.init(eqx.filter(layer, eqx.is_inexact_array))
    first = None
    for _ in range(2):
        y, aux, (layer_grads, x_grads) = grad_fn(layer, x, cotangent, balance_weight, z_weight)
        first = first or (y, aux, layer_grads, x_grads)
        updates, state = optimizer.update(layer_grads, state, eqx.filter(layer, eqx.is_inexact_array))
        layer = eqx.apply_updates(layer, updates)
    return first, layer


def expert_parallel(layer, mesh):
    """`losses_and_grads` over `mesh`: the layer's experts split over `expert` (and their
    hidden units over `model`, if the mesh has it), the groups over every other axis."""
    specs = nn.partition_specs(layer, mesh)
    batch = P(tuple(a for a in mesh.axis_names if a != "model"))
    mapped = eqxpar.filter_shard_map(
        losses_and_grads,
        mesh=mesh,
        in_specs=(specs, batch, batch, batch, batch),
        out_specs=(batch, batch, (specs, batch)),
    )
    return mapped, specs, batch


@PINS_ONLY  # the three pins; draws under HYPOTHESIS_PROFILE=thorough (make test time)
@given(
    sizes=meshes,
    experts_per_device=st.sampled_from([1, 2]),
    groups_per_device=st.sampled_from([1, 2]),
    top_k=st.sampled_from([1, 2]),
    capacity_factor=st.sampled_from([0.5, 1.25, None]),
    score=st.sampled_from(["softmax", "sigmoid"]),
    seed=st.integers(0, 2**16),
)
# Top-2 with drops, over data x expert, two experts and groups on each device.
@example(
    sizes={"data": 2, "expert": 2},
    experts_per_device=2,
    groups_per_device=2,
    top_k=2,
    capacity_factor=0.5,
    score="softmax",
    seed=1,
)
# One expert per device on eight devices.
@example(
    sizes={"data": 1, "expert": 8},
    experts_per_device=1,
    groups_per_device=1,
    top_k=2,
    capacity_factor=1.25,
    score="sigmoid",
    seed=2,
)
# Dropless: ragged_dot on one device against fixed buffers of `tokens` slots over the axis.
@example(
    sizes={"data": 2, "expert": 4},
    experts_per_device=1,
    groups_per_device=1,
    top_k=2,
    capacity_factor=None,
    score="softmax",
    seed=3,
)
def test_expert_parallel_equals_one_device(
    sizes, experts_per_device, groups_per_device, top_k, capacity_factor, score, seed
):
    experts = sizes["expert"] * experts_per_device
    groups = sizes["data"] * sizes["expert"] * groups_per_device
    check_parity(sizes, experts, groups, min(top_k, experts), capacity_factor, score, seed)


@pytest.mark.thorough
@pytest.mark.parametrize(
    "sizes, experts, top_k, capacity_factor",
    [
        ({"data": 2, "expert": 4}, 16, 4, 0.75),
        ({"data": 1, "expert": 8}, 16, 3, None),
        ({"data": 2, "expert": 2}, 8, 2, 1.0),
    ],
)
def test_expert_parallel_equals_one_device_at_larger_sizes(sizes, experts, top_k, capacity_factor):
    """Each router-gradient entry sums up to 576 tokens' terms, which cancel to far less than
    their size: float32 roundoff then reaches a few 1e-6 absolute (measured 3.7e-6 on an entry
    of 0.14, where one device's ragged_dot and dense paths differ by 1e-6 from each other),
    so the absolute tolerance is 1e-5 here."""
    groups = 3 * sizes["data"] * sizes["expert"]
    check_parity(sizes, experts, groups, top_k, capacity_factor, "softmax", 4, tokens=24, dim=16, hidden=32, atol=1e-5)


def check_parity(
    sizes,
    experts,
    groups,
    top_k,
    capacity_factor,
    score,
    seed,
    *,
    tokens=TOKENS,
    dim=DIM,
    hidden=HIDDEN,
    atol=F32_ATOL,
    model_axis=None,
):
    """Outputs, aux (counts exactly), gradients and parameters after two steps: parallel == one device."""
    mesh = eqxpar.make_mesh(**sizes)
    rng = np.random.default_rng(seed)
    layer = random_moe(
        rng,
        dim,
        hidden,
        experts,
        top_k,
        bias=seed % 2 == 0,
        score=score,
        normalize_weights=seed % 3 == 0,
        capacity_factor=capacity_factor,
        model_axis=model_axis,
    )
    x = rng.normal(size=(groups, tokens, dim)).astype(np.float32)
    cotangent = rng.normal(size=x.shape).astype(np.float32)
    balance_weight, z_weight = rng.normal(size=(2, groups)).astype(np.float32)
    inputs = (x, cotangent, balance_weight, z_weight)

    mapped, specs, batch = expert_parallel(layer, mesh)
    placed = (eqxpar.shard(layer, mesh, specs), *(eqxpar.shard(a, mesh, batch) for a in inputs))
    (y, aux, grads, x_grads), trained = eqx.filter_jit(functools.partial(train, mapped))(*placed)
    (want_y, want_aux, want_grads, want_x_grads), want_trained = on_one_device(
        functools.partial(train, losses_and_grads), layer, *inputs
    )
    what = f" ({sizes}, {experts} experts, top-{top_k}, capacity_factor={capacity_factor})"
    assert_trees_close(y, want_y, what="output" + what, atol=atol)
    # Integers exactly: the same tokens routed to each expert, the same choices dropped.
    assert_trees_close(aux, want_aux, what="aux" + what, atol=atol)
    arrays = functools.partial(eqx.filter, filter_spec=eqx.is_array)
    assert_trees_close(arrays(grads), arrays(want_grads), what="grads" + what, atol=atol)
    assert_trees_close(x_grads, want_x_grads, what="input gradients" + what, atol=atol)
    assert_trees_close(arrays(trained), arrays(want_trained), what="after 2 steps" + what, atol=atol)
    if capacity_factor is not None and capacity_factor < 1 and top_k > 1:
        assert int(np.sum(want_aux.dropped)) > 0  # the drop path was taken


# Heavy (18-31 s): the expert-parallel property and the mutants cover the all_to_alls by default.
@pytest.mark.thorough
@examples(2)  # and the two pins: the model axis adds a psum each way to the same exchange
@given(
    sizes=mesh_sizes(("data", "expert", "model")).filter(lambda s: s["model"] > 1 and s["data"] <= 2),
    top_k=st.sampled_from([1, 2]),
    capacity_factor=st.sampled_from([0.5, None]),
    seed=st.integers(0, 2**16),
)
@example(sizes={"data": 2, "expert": 2, "model": 2}, top_k=2, capacity_factor=0.5, seed=1)
@example(sizes={"data": 1, "expert": 2, "model": 4}, top_k=2, capacity_factor=None, seed=2)
def test_experts_hidden_split_over_model_equals_one_device(sizes, top_k, capacity_factor, seed):
    """Tensor parallelism inside the experts: each expert's hidden units split over `model`
    (the tokens the same on every model device), its output summed by a psum."""
    experts = 2 * sizes["expert"]
    groups = sizes["data"] * sizes["expert"]
    check_parity(sizes, experts, groups, top_k, capacity_factor, "softmax", seed, model_axis="model")


@functools.cache
def _report(sizes: tuple, capacity_factor, input_grad: bool):
    mesh = eqxpar.make_mesh(**dict(sizes))
    experts = 8
    groups = 2 * mesh.size
    layer = nn.MixtureOfExperts(DIM, HIDDEN, experts, 2, capacity_factor=capacity_factor, key=jax.random.key(0))
    mapped, specs, batch = expert_parallel(layer, mesh)
    if not input_grad:  # the input is data: its cotangents are not sent back
        mapped = _without_input_grad(mesh, specs, batch)
    x = jnp.ones((groups, TOKENS, DIM), jnp.float32)
    ones = jnp.ones((groups,), jnp.float32)
    args = (eqxpar.shard(layer, mesh, specs), *(eqxpar.shard(a, mesh, batch) for a in (x, x, ones, ones)))
    report = communication_report(mapped, *args)
    theory = expert_parallel_theory(
        mesh,
        groups=groups,
        capacity=layer.capacity(TOKENS),
        dim=DIM,
        num_experts=experts,
        batch_axis=tuple(mesh.axis_names),
        input_grad=input_grad,
    )
    return report, theory


def _without_input_grad(mesh, specs, batch):
    def per_device(layer, x, cotangent, balance_weight, z_weight):
        def loss(layer):
            y, aux = layer(x)
            return jnp.sum(y * cotangent) + jnp.sum(aux.load_balance_loss * balance_weight)

        return eqx.filter_grad(loss)(layer)

    return eqxpar.filter_shard_map(per_device, mesh=mesh, in_specs=(specs, batch, batch, batch, batch), out_specs=specs)


def test_all_to_all_bytes_equal_the_theory():
    """Two all-to-alls forward and two backward, each of one device's (experts, groups,
    capacity, dim) buffer, over `expert` only: lowered and compiled, ratio 1.00."""
    for sizes, capacity_factor in (((("data", 2), ("expert", 4)), 1.25), ((("expert", 8),), None)):
        report, theory = _report(sizes, capacity_factor, True)
        comparison = report.versus(theory)
        for stage in ("lowered", "compiled"):
            assert report.count("all-to-all", stage=stage) == 4, (stage, str(report))
            assert report.bytes("all-to-all", stage=stage) == theory.bytes("all-to-all") > 0, (stage, str(comparison))
            assert report.bytes("all-to-all", axes="expert", stage=stage) == theory.bytes("all-to-all")
            assert comparison.ratio("all-to-all", stage=stage) == 1.0
        assert all("MixtureOfExperts" in c.scope for c in report.compiled if c.kind == "all-to-all")


def test_input_without_gradient_sends_three_all_to_alls():
    report, theory = _report((("data", 2), ("expert", 4)), 1.25, False)
    for stage in ("lowered", "compiled"):
        assert report.count("all-to-all", stage=stage) == 3, (stage, str(report))
        assert report.bytes("all-to-all", stage=stage) == theory.bytes("all-to-all") > 0


def test_one_expert_device_sends_nothing():
    report, theory = _report((("data", 2), ("expert", 1)), 1.25, True)
    assert report.count("all-to-all", stage="lowered") == report.count("all-to-all") == 0
    assert theory.bytes() == 0


def test_replicated_input_without_vma_tracking():
    """Under check_vma=False JAX cannot tell a replicated input from a split one:
    `input_replicated=True` says it. Each device routes its block of the groups; the
    outputs and aux come back whole on every device, and the gradients (the router's
    summed by hand, as a step without tracking must) equal one device's."""
    mesh = eqxpar.make_mesh(data=2, expert=4)
    rng = np.random.default_rng(5)
    layer = random_moe(rng, DIM, HIDDEN, 8, 2, capacity_factor=0.5)
    x = rng.normal(size=(8, TOKENS, DIM)).astype(np.float32)

    def loss(layer, x, replicated):
        y, aux = layer(x, input_replicated=replicated)
        return jnp.sum(y**2) + jnp.sum(aux.load_balance_loss), (y, aux)

    def per_device(layer, x):
        (_, (y, aux)), grads = eqx.filter_value_and_grad(loss, has_aux=True)(layer, x, True)
        router = jax.lax.psum(grads.router.weight, ("data", "expert"))
        experts = jax.lax.psum((grads.gate, grads.up, grads.down), "data")
        return y, aux, eqx.tree_at(lambda g: (g.router.weight, g.gate, g.up, g.down), grads, (router, *experts))

    specs = nn.partition_specs(layer, mesh)
    mapped = eqxpar.filter_shard_map(
        per_device, mesh=mesh, in_specs=(specs, P("data")), out_specs=(P("data"), P("data"), specs), check_vma=False
    )
    y, aux, grads = eqx.filter_jit(mapped)(eqxpar.shard(layer, mesh, specs), eqxpar.shard(x, mesh, P("data")))
    (_, (want_y, want_aux)), want_grads = on_one_device(
        lambda layer, x: eqx.filter_value_and_grad(loss, has_aux=True)(layer, x, None), layer, x
    )
    assert_trees_close((y, aux), (want_y, want_aux), what="output and aux")
    assert int(np.sum(want_aux.dropped)) > 0
    assert_trees_close(eqx.filter(grads, eqx.is_array), eqx.filter(want_grads, eqx.is_array), what="gradients")
