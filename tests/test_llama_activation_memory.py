"""Activation memory per device: `llama_activation_theory` against what autodiff keeps.

`TrainStep.saved_activation_bytes` counts the residuals JAX's autodiff keeps from the
forward pass for the backward pass, inside the per-device program (traced, not compiled).
One more layer adds exactly the theory's `per_block` bytes when the remat policy decides
what is kept ("block", "save_matmuls"), over drawn data x context x model meshes, every
attention implementation, with and without sequence parallelism, grouped-query attention,
tied embeddings, scanned layers and bfloat16 compute (`Precision(compute_dtype=bfloat16)`,
under which each layer also keeps its weights' bfloat16 copies); under remat "none" the
theory is the least the backward pass reads, a lower bound. A residual stream that
sequence parallelism failed to split, key/value heads counted as query heads, bfloat16
values counted as float32, or a context split that kept whole sequences would each change
the measured bytes and fail the equality (the first pin catches all four, the others each
of those their settings reach).
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
from eqxpar.inspect import ActivationTheory
from eqxpar.models import GPT, Llama, LlamaConfig, MoEOptions, llama_activation_theory, llama_loss
from eqxpar.models._block import Remat
from eqxpar.train import Precision

VOCAB, SEQ, DIM, HEADS, HIDDEN = 16, 32, 16, 4, 24
# (data, context, model) over at most 8 devices; the model axis divides the key/value heads.
SHAPES = [(8, 1, 1), (2, 1, 4), (4, 1, 2), (2, 2, 2), (1, 4, 2), (2, 4, 1), (1, 8, 1), (1, 2, 4)]


def loss_fn(model, batch, key=None):
    return llama_loss(model, batch, key=key)


@dataclasses.dataclass(frozen=True)
class Case:
    shape: tuple[int, int, int]
    attention: str
    remat: Remat
    sequence_parallel: bool
    kv_heads: int
    tie: bool
    bfloat16: bool
    scan_layers: bool = False

    @property
    def context(self) -> bool:
        return self.attention in ("ring", "all_gather")

    def llama(self, layers: int) -> Llama:
        config = LlamaConfig(
            vocab_size=VOCAB,
            dim=DIM,
            num_layers=layers,
            num_heads=HEADS,
            num_kv_heads=self.kv_heads,
            hidden_dim=HIDDEN,
            max_seq_len=SEQ,
            tie_embeddings=self.tie,
        )
        return Llama(
            config,
            scan_layers=self.scan_layers,
            remat=self.remat,
            sequence_parallel=self.sequence_parallel,
            attention_impl=self.attention,
            key=jax.random.key(2),
        )

    def mesh(self):
        data, context, model = self.shape
        return eqxpar.make_mesh(data=data, context=context, model=model)

    @property
    def batch_size(self) -> int:
        return 2 * self.shape[0]

    @property
    def dtype(self):
        return jnp.bfloat16 if self.bfloat16 else None

    def saved(self, layers: int) -> int:
        """What autodiff keeps per device for a Llama of `layers` layers."""
        mesh = self.mesh()
        step = eqxpar.train.hybrid_step(
            loss_fn,
            optax.sgd(0.1),
            mesh,
            batch_axis="data",
            context_axis="context" if self.context else None,
            precision=Precision(compute_dtype=self.dtype),
        )
        tokens = jnp.zeros((self.batch_size, SEQ), jnp.int32)
        batch = eqxpar.shard((tokens, tokens), mesh, P("data", "context") if self.context else P("data"))
        model, opt_state = step.init(self.llama(layers))
        # jax.nn.dot_product_attention's XLA path needs standard promotion in bfloat16 (see
        # conftest.py); everything else stays strict.
        standard = self.bfloat16 and self.attention == "dot_product"
        with jax.numpy_dtype_promotion("standard" if standard else "strict"):
            saved = step.saved_activation_bytes(model, opt_state, batch)
        assert saved is not None
        return saved

    def theory(self, layers: int) -> ActivationTheory:
        return llama_activation_theory(
            self.llama(layers),
            self.mesh(),
            self.batch_size,
            SEQ,
            batch_axis="data",
            context_axis="context" if self.context else None,
            dtype=self.dtype,
        )


@st.composite
def cases(draw, remat):
    shape = draw(st.sampled_from(SHAPES))
    _, context, model = shape
    attention = draw(st.sampled_from(("ring", "all_gather") if context > 1 else ("dot_product", "ring", "all_gather")))
    return Case(
        shape,
        attention,
        draw(remat),
        sequence_parallel=draw(st.booleans()) if (SEQ // context) % model == 0 else False,
        kv_heads=draw(st.sampled_from([k for k in (1, 2, 4) if k % model == 0])),
        tie=draw(st.booleans()),
        bfloat16=draw(st.booleans()),
        scan_layers=draw(st.booleans()),
    )


@PINS_ONLY  # the four pins; draws under HYPOTHESIS_PROFILE=thorough (make test time)
@given(case=cases(st.sampled_from(("block", "save_matmuls"))))
# SP over 2, a context split, one key/value head of two query heads per device, bfloat16, tied.
@example(case=Case((2, 2, 2), "ring", "save_matmuls", True, 2, True, True))
# SP over 4 (the residual stream a quarter of the tokens), float32: no weight copies.
@example(case=Case((2, 1, 4), "dot_product", "block", True, 4, False, False))
# The gathered attention, grouped-query, over a context split of 4, float32, scanned layers.
@example(case=Case((1, 4, 2), "all_gather", "save_matmuls", False, 2, False, False, True))
# Only the block inputs and, in bfloat16, the weights' copies (a quarter of them over 4 devices), tied.
@example(case=Case((2, 1, 4), "dot_product", "block", False, 4, True, True))
def test_one_more_layer_keeps_what_the_theory_says(case):
    one, two = case.saved(1), case.saved(2)
    theory = case.theory(2)
    assert theory.exact_blocks
    assert two - one == theory.per_block, (case, two - one, str(theory))
    # Outside the blocks the theory counts the least the backward pass reads.
    assert theory.total <= two, (case, two, theory.total)


@PINS_ONLY
@given(case=cases(st.just("none")))
@example(case=Case((2, 2, 2), "all_gather", "none", True, 2, False, True))
def test_without_remat_the_theory_is_a_lower_bound(case):
    one, two = case.saved(1), case.saved(2)
    theory = case.theory(2)
    assert not theory.exact_blocks
    assert 0 < theory.per_block <= two - one, (case, two - one, str(theory))
    assert theory.total <= two


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(model="not a llama"), "must be an eqxpar.models.Llama"),
        (dict(model="gpt"), "must be an eqxpar.models.Llama"),
        (dict(remat="offload"), "host memory"),
        (dict(context_axis=None), "pass context_axis"),
        (dict(attention="dot_product"), "context_axis=None"),
        (dict(sequence_parallel=True, seq_len=18), "sequence_parallel splits"),
        (dict(moe=True, attention="dot_product", context_axis=None), "not modelled yet"),
    ],
)
def test_bad_arguments_are_value_errors(change, match):
    mesh = eqxpar.make_mesh(data=2, context=2, model=2)
    config = LlamaConfig(
        vocab_size=VOCAB, dim=DIM, num_layers=1, num_heads=HEADS, num_kv_heads=2, hidden_dim=HIDDEN, max_seq_len=SEQ
    )
    model = Llama(
        config,
        remat=change.get("remat", "none"),
        attention_impl=change.get("attention", "ring"),
        sequence_parallel=change.get("sequence_parallel", False),
        moe=MoEOptions(num_experts=2, top_k=1, expert_axis="data") if change.get("moe") else None,
        key=jax.random.key(0),
    )
    if change.get("model") == "gpt":
        model = GPT(VOCAB, SEQ, DIM, HEADS, 1, attention_impl="ring", key=jax.random.key(0))
    elif "model" in change:
        model = change["model"]
    context_axis = change.get("context_axis", "context")
    with pytest.raises(ValueError, match=match):
        llama_activation_theory(
            model, mesh, 4, change.get("seq_len", SEQ), batch_axis="data", context_axis=context_axis
        )
