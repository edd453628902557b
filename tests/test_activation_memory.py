"""Activation memory per device: `gpt_activation_theory` against what autodiff keeps.

`TrainStep.saved_activation_bytes` counts the residuals JAX's autodiff keeps from the
forward pass for the backward pass, inside the per-device program (traced, not compiled).
One more block adds exactly the theory's `per_block` bytes when the remat policy decides
what is kept ("block", "save_matmuls"), over drawn data x context x model meshes, every
attention implementation, with and without sequence parallelism, dropout, scanned layers
and bfloat16 compute (`Precision(compute_dtype=bfloat16)`, under which each block also
keeps the bfloat16 copies of the weights it reads); under remat "none" the theory is the
least the backward pass reads, a lower bound. A residual stream that sequence parallelism
failed to split, a context split that kept whole sequences, a policy that kept attention's
scores, or the weights' copies left out or counted at float32 would each change the
measured bytes and fail the equality.
"""

import dataclasses

import jax
import jax.numpy as jnp
import optax
import pytest
from _budget import PINS_ONLY, examples
from hypothesis import example, given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar.inspect import ActivationTheory, memory_report
from eqxpar.models import GPT, gpt_activation_theory
from eqxpar.nn import vocab_parallel_cross_entropy
from eqxpar.train import Precision

VOCAB, SEQ, DIM, HEADS = 11, 32, 16, 4
# (data, context, model) over at most 8 devices; heads split up to 4 ways.
SHAPES = [(8, 1, 1), (2, 1, 4), (4, 1, 2), (2, 2, 2), (1, 4, 2), (2, 4, 1), (1, 8, 1), (1, 2, 4)]


def loss_fn(model, batch, key=None):
    inputs, targets = batch
    return jnp.mean(vocab_parallel_cross_entropy(model(inputs, key=key), targets, model.axis_name, model.vocab_size))


@dataclasses.dataclass(frozen=True)
class Case:
    shape: tuple[int, int, int]
    attention: str
    remat: str
    sequence_parallel: bool
    scan_layers: bool
    dropout: float
    grad_accum: int = 1
    bfloat16: bool = False

    @property
    def context(self) -> bool:
        return self.attention in ("ring", "all_gather")

    def gpt(self, layers: int) -> GPT:
        return GPT(
            VOCAB,
            SEQ,
            DIM,
            HEADS,
            layers,
            dropout_p=self.dropout,
            attention_dropout_p=0.0 if self.context else None,
            pad_vocab_to_multiple_of=8,
            attention_impl=self.attention,
            sequence_parallel=self.sequence_parallel,
            scan_layers=self.scan_layers,
            remat=self.remat,
            key=jax.random.key(2),
        )

    def mesh(self):
        data, context, model = self.shape
        return eqxpar.make_mesh(data=data, context=context, model=model)

    @property
    def batch_size(self) -> int:
        return 2 * self.shape[0] * self.grad_accum

    @property
    def dtype(self):
        return jnp.bfloat16 if self.bfloat16 else None

    def saved(self, layers: int) -> int:
        """What autodiff keeps per device for a GPT of `layers` blocks."""
        mesh = self.mesh()
        step = eqxpar.train.hybrid_step(
            loss_fn,
            optax.sgd(0.1),
            mesh,
            batch_axis="data",
            grad_accum=self.grad_accum,
            context_axis="context" if self.context else None,
            precision=Precision(compute_dtype=self.dtype),
        )
        tokens = jnp.zeros((self.batch_size, SEQ), jnp.int32)
        batch = eqxpar.shard((tokens, tokens), mesh, P("data", "context") if self.context else P("data"))
        model, opt_state = step.init(self.gpt(layers))
        key = jax.random.key(0) if self.dropout else None
        # jax.nn.dot_product_attention's XLA path needs standard promotion in bfloat16 (see
        # conftest.py); everything else stays strict.
        standard = self.bfloat16 and self.attention == "dot_product"
        with jax.numpy_dtype_promotion("standard" if standard else "strict"):
            saved = step.saved_activation_bytes(model, opt_state, batch, key)
        assert saved is not None
        return saved

    def theory(self, layers: int) -> ActivationTheory:
        return gpt_activation_theory(
            self.gpt(layers),
            self.mesh(),
            self.batch_size // self.grad_accum,
            SEQ,
            batch_axis="data",
            context_axis="context" if self.context else None,
            dtype=self.dtype,
        )


@st.composite
def cases(draw, remat):
    shape = draw(st.sampled_from(SHAPES))
    _, context, model = shape
    attention = draw(
        st.sampled_from(("ring", "all_gather") if context > 1 else ("dot_product", "reference", "ring", "all_gather"))
    )
    return Case(
        shape,
        attention,
        draw(remat),
        sequence_parallel=draw(st.booleans()) if (SEQ // context) % model == 0 else False,
        scan_layers=draw(st.booleans()),
        dropout=draw(st.sampled_from((0.0, 0.1))),
        bfloat16=draw(st.booleans()),
    )


@PINS_ONLY  # the five pins; draws under HYPOTHESIS_PROFILE=thorough (make test time)
@given(case=cases(st.sampled_from(("block", "save_matmuls"))))
@example(case=Case((2, 2, 2), "ring", "save_matmuls", True, False, 0.0))
@example(case=Case((1, 8, 1), "ring", "save_matmuls", False, True, 0.1))
@example(case=Case((2, 1, 4), "dot_product", "block", True, False, 0.1))
# bfloat16, SP over 4, scanned: the weights' copies (a quarter of the linear ones, all the
# norms') beside the quarter of the residual stream and the matmul outputs.
@example(case=Case((2, 1, 4), "dot_product", "save_matmuls", True, True, 0.0, bfloat16=True))
# bfloat16, a context split of 4 over model=2, scanned: only the block input and the weights' copies.
@example(case=Case((1, 4, 2), "all_gather", "block", False, True, 0.0, bfloat16=True))
def test_one_more_block_keeps_what_the_theory_says(case):
    one, two = case.saved(1), case.saved(2)
    theory = case.theory(2)
    assert theory.exact_blocks
    assert two - one == theory.per_block, (case, two - one, str(theory))
    # Outside the blocks the theory counts the least the backward pass reads.
    assert theory.total <= two, (case, two, theory.total)


@examples(3)
@given(case=cases(st.just("none")))
@example(case=Case((2, 2, 2), "all_gather", "none", True, False, 0.1))
def test_without_remat_the_theory_is_a_lower_bound(case):
    one, two = case.saved(1), case.saved(2)
    theory = case.theory(2)
    assert not theory.exact_blocks
    assert 0 < theory.per_block <= two - one, (case, two - one, str(theory))
    assert theory.total <= two


def test_sequence_and_context_parallelism_divide_the_kept_block_input():
    """The theory's scaling, measured: under remat="block" a block keeps only its input,
    T_r x dim values, which context parallelism divides by C and sequence parallelism by N."""
    base = Case((8, 1, 1), "ring", "block", False, False, 0.0)
    per_block = {}
    for shape, sp in [((8, 1, 1), False), ((1, 8, 1), False), ((2, 2, 2), False), ((2, 2, 2), True)]:
        case = dataclasses.replace(base, shape=shape, sequence_parallel=sp)
        per_block[shape, sp] = case.saved(2) - case.saved(1)
    whole = 2 * SEQ * DIM * 4  # two sequences per device, float32
    assert per_block[(8, 1, 1), False] == whole
    assert per_block[(1, 8, 1), False] == whole // 8
    assert per_block[(2, 2, 2), False] == whole // 2
    assert per_block[(2, 2, 2), True] == whole // 4


def test_gradient_accumulation_keeps_one_micro_batch():
    """With grad_accum=2 the step keeps one micro-batch's activations at a time: the same
    bytes as the step without accumulation on a batch half the size."""
    case = Case((2, 2, 2), "ring", "save_matmuls", True, False, 0.0)
    accumulated = dataclasses.replace(case, grad_accum=2)
    assert accumulated.saved(2) == case.saved(2)
    assert accumulated.theory(2).total == case.theory(2).total


def test_memory_report_carries_the_saved_bytes():
    case = Case((2, 2, 2), "all_gather", "block", False, False, 0.0)
    mesh = case.mesh()
    step = eqxpar.train.hybrid_step(loss_fn, optax.sgd(0.1), mesh, batch_axis="data", context_axis="context")
    tokens = jnp.zeros((case.batch_size, SEQ), jnp.int32)
    batch = eqxpar.shard((tokens, tokens), mesh, P("data", "context"))
    model, opt_state = step.init(case.gpt(2))
    report = memory_report(step, model, opt_state, batch)
    assert report.saved_activations == case.saved(2)
    assert "saved for the backward pass" in str(report)
    table = case.theory(2).versus(saved=report.saved_activations, temporaries=report.temporaries)
    assert f"{report.saved_activations:,}" in table and f"{report.temporaries:,}" in table
    # A plain function has no train step to trace: the field stays empty.
    plain = memory_report(jax.jit(lambda x, y: x @ y), jnp.ones((4, 4)), jnp.ones((4, 4)))
    assert plain.saved_activations is None


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(model="not a gpt"), "must be an eqxpar.models.GPT"),
        (dict(remat="offload"), "host memory"),
        (dict(context_axis=None), "pass context_axis"),
        (dict(attention="dot_product"), "context_axis=None"),
        (dict(seq_len=31), "seq_len must be"),
        (dict(batch_size=3), "batch_size must be"),
        (dict(sequence_parallel=True, mesh=(1, 2, 4), seq_len=20), "sequence_parallel splits"),
    ],
)
def test_bad_arguments_are_value_errors(change, match):
    mesh_shape = change.pop("mesh", (2, 2, 2))
    data, context, model_size = mesh_shape
    mesh = eqxpar.make_mesh(data=data, context=context, model=model_size)
    gpt = GPT(
        VOCAB,
        SEQ,
        DIM,
        HEADS,
        1,
        pad_vocab_to_multiple_of=8,
        attention_impl=change.pop("attention", "ring"),
        sequence_parallel=change.pop("sequence_parallel", False),
        remat=change.pop("remat", "none"),
        key=jax.random.key(0),
    )
    kwargs = dict(batch_axis="data", context_axis="context")
    kwargs.update({k: change.pop(k) for k in ("context_axis",) if k in change})
    model = change.pop("model", gpt)
    with pytest.raises(ValueError, match=match):
        gpt_activation_theory(model, mesh, change.pop("batch_size", 4), change.pop("seq_len", SEQ), **kwargs)


def test_fsdp_without_remat_keeps_the_gathered_weights_the_backward_pass_reads():
    """An MLP under FSDP: the second layer's input gradient reads its whole (gathered)
    weight, which the step keeps without remat; with remat the unit gathers it again."""
    import equinox as eqx

    mesh = eqxpar.make_mesh(fsdp=8)
    mlp = eqx.nn.MLP(64, 32, 128, 1, key=jax.random.key(0))

    def mse(model, batch, key=None):
        x, y = batch
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    specs = eqxpar.train.fsdp_specs(mlp, mesh, batch_axis="fsdp")
    batch = eqxpar.shard((jnp.ones((16, 64)), jnp.ones((16, 32))), mesh, P("fsdp"))
    saved = {}
    for remat in (False, True):
        step = eqxpar.train.fsdp_step(
            mse,
            optax.sgd(0.1),
            mesh,
            param_specs=specs,
            batch_axis="fsdp",
            remat=remat,
            units=(lambda m: m.layers) if remat else None,
        )
        saved[remat] = step.saved_activation_bytes(*step.init(mlp), batch)
    second_weight = 128 * 32 * 4
    assert saved[False] - saved[True] >= second_weight
    # With remat each unit keeps only its inputs (this device's 2 rows), less than one weight.
    assert saved[True] < second_weight
