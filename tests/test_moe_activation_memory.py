"""Activation memory of the MoE GPT: `gpt_activation_theory` against what autodiff keeps.

`TrainStep.saved_activation_bytes` traces the step (nothing compiles) and counts the
residuals autodiff keeps per device. Under remat "block" and "save_matmuls" one more MoE
block must add exactly the theory's `per_block` bytes, over drawn data x expert x model
meshes, shared experts, a z-loss, residual dropout, dropless routing and blocks stacked
with `stack_blocks` (scanned); under remat "none" the theory is a lower bound. A batch
that the expert axis failed to split, a shared MLP's hidden layer that the model axis did
not split, or a routed expert's hidden layer kept by "save_matmuls" would each change the
measured bytes and fail the equality.
"""

import dataclasses

import jax
import jax.numpy as jnp
import optax
import pytest
from _budget import PINS_ONLY
from hypothesis import example, given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar.models import GPT, MoEOptions, gpt_activation_theory, next_token_loss, stack_blocks
from eqxpar.train import hybrid_step

VOCAB, SEQ, DIM, BATCH = 32, 8, 16, 8
# (data, expert, model) over at most 8 devices: the batch of 8 over data x expert.
MESHES = [(1, 1, 1), (2, 2, 2), (1, 4, 2), (2, 4, 1), (8, 1, 1), (4, 2, 1)]


@dataclasses.dataclass(frozen=True)
class Case:
    mesh_shape: tuple[int, int, int]
    remat: str
    shared_experts: int = 0
    z_loss_weight: float = 0.0
    dropout: float = 0.0
    capacity_factor: float | None = 1.0
    stacked: bool = False
    every: int = 1

    def gpt(self, layers: int) -> GPT:
        options = MoEOptions(
            4,
            2,
            every=self.every,
            capacity_factor=self.capacity_factor,
            aux_loss_weight=0.1,
            z_loss_weight=self.z_loss_weight,
            shared_experts=self.shared_experts,
        )
        model = GPT(
            VOCAB, SEQ, dim=DIM, num_heads=2, num_layers=layers, mlp_ratio=2, pad_vocab_to_multiple_of=8,
            dropout_p=self.dropout, moe=options, remat=self.remat, key=jax.random.key(0),
        )  # fmt: skip
        return stack_blocks(model) if self.stacked else model

    def mesh(self):
        data, expert, model = self.mesh_shape
        return eqxpar.make_mesh(data=data, expert=expert, model=model)

    def saved(self, layers: int) -> int:
        mesh = self.mesh()
        loss = lambda m, b, key: next_token_loss(m, b, key=key)  # noqa: E731
        # The batch is split over data x expert (the step splits it over its expert axis too).
        step = hybrid_step(loss, optax.sgd(0.1), mesh, batch_axis="data", expert_axis="expert")
        model, opt_state = step.init(self.gpt(layers))
        tokens = eqxpar.shard(jnp.zeros((BATCH, SEQ + 1), jnp.int32), mesh, P(("data", "expert")))
        key = jax.random.key(0) if self.dropout else None
        return step.saved_activation_bytes(model, opt_state, tokens, key)

    def theory(self, layers: int):
        return gpt_activation_theory(self.gpt(layers), self.mesh(), BATCH, SEQ, batch_axis=("data", "expert"))


def cases(remat):
    return st.builds(
        Case,
        mesh_shape=st.sampled_from(MESHES),
        remat=remat,
        shared_experts=st.sampled_from([0, 1, 2]),
        z_loss_weight=st.sampled_from([0.0, 0.01]),
        dropout=st.sampled_from([0.0, 0.1]),
        capacity_factor=st.sampled_from([1.0, None]),
        stacked=st.booleans(),
    )


@PINS_ONLY  # drawn cases under HYPOTHESIS_PROFILE=thorough
@given(case=cases(st.sampled_from(["block", "save_matmuls"])))
@example(case=Case((2, 2, 2), "save_matmuls", shared_experts=1, z_loss_weight=0.01, dropout=0.1))
@example(case=Case((1, 4, 2), "block", shared_experts=2, stacked=True))
@example(case=Case((2, 4, 1), "save_matmuls", capacity_factor=None, stacked=True))
def test_one_more_moe_block_keeps_what_the_theory_says(case):
    one, two = case.saved(1), case.saved(2)
    theory = case.theory(2)
    assert theory.exact_blocks
    assert two - one == theory.per_block, (case, two - one, str(theory))
    assert theory.total <= two, (case, two, theory.total)


def test_save_matmuls_keeps_the_shared_mlp_split_over_the_model_axis():
    """The measured scaling: the shared experts' hidden layer (2 x 32 units), split over
    model=2 and kept by save_matmuls, adds T x 32 floats per block on data=2,expert=2 (T = 16
    tokens per device: the batch of 8 over 4 devices); the routed experts add nothing."""
    base = Case((2, 2, 2), "save_matmuls")
    without = base.saved(2) - base.saved(1)
    shared = dataclasses.replace(base, shared_experts=2)
    assert shared.saved(2) - shared.saved(1) - without == (BATCH // 4) * SEQ * (2 * 32 // 2) * 4


@PINS_ONLY
@given(case=cases(st.just("none")))
@example(case=Case((2, 4, 1), "none", shared_experts=1))
def test_without_remat_the_moe_theory_is_a_lower_bound(case):
    one, two = case.saved(1), case.saved(2)
    theory = case.theory(2)
    assert not theory.exact_blocks
    assert 0 < theory.per_block <= two - one, (case, two - one, str(theory))
    assert theory.total <= two


@pytest.mark.parametrize(
    "case",
    [
        Case((2, 2, 2), "save_matmuls", shared_experts=2, z_loss_weight=0.01, every=2),
        pytest.param(Case((1, 4, 2), "block", dropout=0.1, every=2), marks=pytest.mark.thorough),
        pytest.param(Case((2, 4, 1), "save_matmuls", capacity_factor=None, every=3), marks=pytest.mark.thorough),
    ],
    ids=str,
)
def test_moe_every_few_blocks_keeps_what_the_theory_says(case):
    """MoE blocks every 2 or 3 blocks (the others plain): each block added keeps the bytes
    the theory adds with it: a plain block's MLP hidden layer (split over model), an MoE
    block's shared experts' and its aux-loss constants. Blocks 0, 1, 2, ... are added one
    at a time over one period and a half, so both kinds are added."""
    depths = range(case.every, 2 * case.every + 2)
    saved = {layers: case.saved(layers) for layers in depths}
    theory = {layers: case.theory(layers) for layers in depths}
    for layers in depths[1:]:
        added, predicted = saved[layers] - saved[layers - 1], theory[layers].blocks - theory[layers - 1].blocks
        assert added == predicted, (case, layers, added, predicted, str(theory[layers]))
    plain, moe = (theory[case.every + k].blocks - theory[case.every + k - 1].blocks for k in (1, case.every))
    assert plain != moe  # the two kinds do differ here, so the check above tells them apart
