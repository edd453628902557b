"""The GPT with `moe=` (every block a mixture of experts) under `pipeline_step` equals one
device: the loss with the routers' auxiliary losses, the gradient norm and the parameters
after two SGD-with-momentum steps, for GPipe, circular and 1F1B, top-k 1 and 2, capacity
(with drops) and dropless, on stage=2 with data=1/2 (and the experts split over an expert
axis inside the stages). Each stage adds its own blocks' auxiliary losses to its share of
the loss (`Stages(layer_aux=True)`): one stage's dropped, or counted twice, changes the
loss and the gradients. Bad input is named before compile.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _budget import THOROUGH, examples
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar import nn
from eqxpar.models import GPT, MoEOptions, gpt_stages, next_token_loss, stack_blocks, unstack_blocks
from eqxpar.testing import assert_trees_close
from eqxpar.train import pipeline_step, shard_batch

VOCAB, SEQ, DIM = 32, 6, 8
STEPS = 2
# Not Adam (scale-invariant, it would hide a gradient off by a constant factor).
OPTIMIZER = optax.sgd(0.1, momentum=0.9)


def moe_gpt(layers, top_k, capacity_factor, seed):
    options = MoEOptions(
        num_experts=4,
        top_k=top_k,
        capacity_factor=capacity_factor,
        aux_loss_weight=0.1,  # large enough that one stage's auxiliary loss shows in the loss
        z_loss_weight=1e-2,
    )
    return GPT(
        VOCAB, SEQ, dim=DIM, num_heads=2, num_layers=layers, mlp_ratio=2, pad_vocab_to_multiple_of=8, moe=options,
        key=jax.random.key(seed),
    )  # fmt: skip


def token_batches(rows, seed):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.integers(0, VOCAB, (rows, SEQ + 1)), jnp.int32) for _ in range(STEPS)]


def one_device_run(model, batches):
    """The GPT's own loss (its blocks in a Python loop, `next_token_loss` with the auxiliary
    losses) and plain optax on one device, each step one compiled program."""
    mesh = eqxpar.make_mesh(expert=1, model=1)
    specs = nn.partition_specs(model)
    value_and_grad = eqxpar.filter_shard_map(
        eqx.filter_value_and_grad(lambda m, b: next_token_loss(m, b)),
        mesh=mesh,
        in_specs=(specs, P()),
        out_specs=(P(), specs),
    )

    @eqx.filter_jit
    def step(model, opt_state, batch):
        loss, grads = value_and_grad(model, batch)
        grads = eqx.filter(grads, eqx.is_inexact_array)
        updates, opt_state = OPTIMIZER.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state, loss, optax.tree.norm(grads)

    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_inexact_array))
    losses, norms = [], []
    for batch in batches:
        model, opt_state, loss, norm = step(model, opt_state, batch)
        losses.append(float(loss))
        norms.append(float(norm))
    return model, losses, norms


def pipeline_run(model, batches, step):
    model, opt_state = step.init(model)
    losses, norms = [], []
    for batch in batches:
        model, opt_state, metrics = step(model, opt_state, shard_batch(batch, step.mesh, batch_axis="data"))
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    return model, losses, norms


def check_parity(schedule, data, expert, top_k, capacity_factor, seed):
    """Stage=2 (one block per stage; two per device under circular, r=2), two micro-batches
    of two sequences per data shard: the pipeline against the unstacked GPT on one device."""
    virtual = 2 if schedule == "circular" else 1
    layers, micro = 2 * virtual, 2
    batches = token_batches(data * micro * 2, seed)
    want, want_losses, want_norms = one_device_run(moe_gpt(layers, top_k, capacity_factor, seed), batches)
    stacked = stack_blocks(moe_gpt(layers, top_k, capacity_factor, seed))
    mesh = eqxpar.make_mesh(data=data, stage=2, expert=expert, model=1)
    step = pipeline_step(
        gpt_stages(stacked), OPTIMIZER, mesh, schedule=schedule, microbatches=micro, virtual_stages=virtual
    )
    got, losses, norms = pipeline_run(stacked, batches, step)
    what = f"{schedule} data={data} expert={expert} top_k={top_k} capacity={capacity_factor}"
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, err_msg=f"{what}: losses")
    np.testing.assert_allclose(norms, want_norms, rtol=1e-5, err_msg=f"{what}: gradient norms")
    assert_trees_close(
        eqx.filter(unstack_blocks(got), eqx.is_inexact_array),
        eqx.filter(want, eqx.is_inexact_array),
        rtol=1e-5,
        atol=1e-6,
        what=f"{what}: parameters after {STEPS} steps",
    )


# Every example compiles a pipeline step and a one-device step (about 15 s on two busy
# cores), so the default profile runs the first pinned case only: 1F1B on stage=2,data=2
# with drops (capacity 0.5, top-2). The thorough profile adds GPipe dropless top-1 and
# circular (r=2) top-1 with capacity, and draws its many.
PINNED = [dict(schedule="1f1b", data=2, top_k=2, capacity_factor=0.5, seed=1)]
if THOROUGH:
    PINNED += [
        dict(schedule="gpipe", data=1, top_k=1, capacity_factor=None, seed=2),
        dict(schedule="circular", data=2, top_k=1, capacity_factor=1.25, seed=4),
    ]


def pinned(test):
    for case in reversed(PINNED):
        test = example(**case)(test)
    return test


@(examples(1) if THOROUGH else settings(phases=[Phase.explicit]))
@pinned
@given(
    schedule=st.sampled_from(["gpipe", "1f1b", "circular"]),
    data=st.sampled_from([1, 2]),
    top_k=st.sampled_from([1, 2]),
    capacity_factor=st.sampled_from([0.5, 1.25, None]),
    seed=st.integers(0, 2**16),
)
def test_moe_gpt_pipeline_equals_one_device(schedule, data, top_k, capacity_factor, seed):
    check_parity(schedule, data, 1, top_k, capacity_factor, seed)


@pytest.mark.thorough
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "circular"])
def test_experts_split_over_an_expert_axis_inside_the_stages(schedule):
    """An expert axis beside the stages (not a batch axis): each MoE layer routes its block
    of the micro-batch's sequences on each device of it, the experts split over it."""
    check_parity(schedule, 1, 2, 2, 1.25, 3)


@functools.cache
def _stacked():
    return stack_blocks(moe_gpt(2, 2, None, 0))


def test_stages_loss_is_the_gpt_loss_with_the_aux_losses():
    """`Stages.loss` (one device, the stacked blocks scanned) is the GPT's own
    `next_token_loss`, auxiliary losses included, and so is the stacked GPT's own call."""
    model = moe_gpt(2, 2, 1.25, 0)
    stacked = stack_blocks(model)
    batch = token_batches(4, 0)[0]
    mesh = eqxpar.make_mesh(expert=1, model=1)

    def losses(m, s, b):
        return next_token_loss(m, b), next_token_loss(s, b), gpt_stages(s).loss(s, b)

    specs = (nn.partition_specs(model), nn.partition_specs(stacked), P())
    run = eqx.filter_jit(eqxpar.filter_shard_map(losses, mesh=mesh, in_specs=specs, out_specs=P()))
    loop, scanned, stages = run(model, stacked, batch)
    np.testing.assert_allclose(float(scanned), float(loop), rtol=1e-6)
    np.testing.assert_allclose(float(stages), float(loop), rtol=1e-6)


def test_every_greater_than_one_is_refused_naming_every_1():
    model = GPT(
        VOCAB, SEQ, dim=DIM, num_heads=2, num_layers=2, mlp_ratio=2, pad_vocab_to_multiple_of=8,
        moe=MoEOptions(num_experts=4, every=2), key=jax.random.key(0),
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"stack_blocks: .*moe.every=2.*MoEOptions\(every=1\)"):
        stack_blocks(model)
    with pytest.raises(ValueError, match=r"gpt_stages: .*moe.every=2.*MoEOptions\(every=1\)"):
        gpt_stages(model)


def test_stages_without_the_model_refuse_an_moe_gpt():
    """`gpt_stages()` has no MoE options to weight the auxiliary losses with: named before
    compile, with the fix."""
    step = pipeline_step(gpt_stages(), OPTIMIZER, eqxpar.make_mesh(data=1, stage=2, expert=1, model=1))
    with pytest.raises(ValueError, match=r"made by gpt_stages\(\).*build them with gpt_stages\(model\)"):
        step.init(_stacked())


def test_an_expert_axis_that_is_a_batch_axis_is_refused():
    mesh = eqxpar.make_mesh(stage=2, expert=2, model=1)
    step = pipeline_step(gpt_stages(_stacked()), OPTIMIZER, mesh, batch_axis="expert")
    with pytest.raises(
        ValueError, match=r"splits its experts over 'expert', which is also a batch axis.*no expert_axis"
    ):
        step.init(_stacked())


def test_layer_aux_needs_a_pair_from_layer():
    stages = gpt_stages()
    bad = type(stages)(first=stages.first, layers=stages.layers, layer=stages.layer, last=stages.last, layer_aux=True)
    model = GPT(
        VOCAB, SEQ, dim=DIM, num_heads=2, num_layers=2, mlp_ratio=2, pad_vocab_to_multiple_of=8, scan_layers=True,
        key=jax.random.key(0),
    )  # fmt: skip
    mesh = eqxpar.make_mesh(model=1)
    with pytest.raises(ValueError, match=r"layer_aux=True asks for a pair \(x, aux\)"):
        eqxpar.filter_shard_map(bad.loss, mesh=mesh, in_specs=(nn.partition_specs(model), P()), out_specs=P())(
            model, token_batches(2, 0)[0]
        )
