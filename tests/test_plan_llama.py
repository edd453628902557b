"""The planner on the Llama (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU):
every layout it enumerates for a small Llama on 8 simulated devices obeys the Llama's own
rules (key/value heads, MLP width and vocabulary over `model`); each built with its own
mesh and step and compiled predicts the compiled collectives per (kind, axes) exactly,
parameters + optimizer state exactly, and one more layer adds exactly the predicted saved
bytes for `block` and `save_matmuls`; Llama configs of real sizes plan from shapes alone;
what the planner does not price for a Llama is refused with the fix.

The default run compiles two layouts that between them use every non-pipeline axis (FSDP
with data and sequence parallelism; data with ring attention over context, sequence
parallelism and grouped-query keys and values over `model`, in bfloat16) and traces three;
`HYPOTHESIS_PROFILE=thorough` compiles every layout and pipeline and traces every remat
layout."""

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from _budget import case
from test_plan import cpu_cluster, saved_bytes
from test_plan_validate import check_bfloat16_prices, check_compiled

import eqxpar.plan
from eqxpar.models import Llama, LlamaConfig, MoEOptions, llama_config
from eqxpar.plan._abstract import abstract_llama

# Grouped-query attention (8 query heads over 4 key/value heads), tied embeddings off.
TINY = LlamaConfig(vocab_size=64, dim=32, num_layers=2, num_heads=8, num_kv_heads=4, hidden_dim=48, max_seq_len=16)
BATCH = 8


@functools.cache
def all_plans(layers: int = TINY.num_layers, pipeline: bool | None = None) -> dict[str, eqxpar.plan.Plan]:
    config = dataclasses.replace(TINY, num_layers=layers)
    plans = eqxpar.plan.plan(
        config, batch=BATCH, cluster=cpu_cluster(), dtype=jnp.float32, optimizer="adamw", top=None, pipeline=pipeline
    )
    return {str(p.layout): p for p in plans}


def _names(pipelines: bool) -> list[str]:
    return sorted(name for name, p in all_plans().items() if (p.layout.stage > 1) == pipelines)


def test_plans_the_small_llama_on_8_devices():
    plans = list(all_plans().values())
    layouts = [str(p.layout) for p in plans]
    assert len(layouts) == len(set(layouts)) > 100
    for p in plans:
        lay = p.layout
        # The Llama's own rules: key/value heads, MLP width and vocabulary over model.
        assert TINY.num_kv_heads % lay.model == 0 and TINY.hidden_dim % lay.model == 0
        assert TINY.vocab_size % lay.model == 0
        assert BATCH % (lay.data * lay.fsdp) == 0
        assert p.vocab_size == TINY.vocab_size and p.pad_vocab_to_multiple_of == 1
    assert not any("model=8" in name for name in layouts)  # 4 key/value heads do not split 8 ways
    for text in ("data=8 ", "fsdp=8 ", "model=4 ", "context=8 ", " sp", " ring", " all_gather", "stage=2", " 1f1b"):
        assert any(text in name + " " for name in layouts), text
    times = [round(p.time.expected * 1e6) for p in plans]
    assert times == sorted(times)


# FSDP with data and sequence parallelism by default; ring attention over context is
# compiled by the bfloat16 test below (its compiled program against this float32 theory).
DEFAULT = ("data=2,fsdp=2,model=2 remat=save_matmuls sp",)
EVERY = _names(pipelines=False)


@pytest.mark.parametrize("name", [case(n, default=n in DEFAULT) for n in EVERY])
def test_predictions_equal_the_compiled_llama_step(name):
    check_compiled(name, all_plans()[name])


PIPELINES = _names(pipelines=True)
DEFAULT_PIPELINES = ()  # pipeline_comm is the GPT's (tests/test_plan_pipeline.py); every Llama one under thorough


@pytest.mark.parametrize("name", [case(n, default=n in DEFAULT_PIPELINES) for n in PIPELINES])
def test_pipelined_llama_collectives_equal_the_compiled_step(name):
    (v,) = eqxpar.plan.validate([all_plans()[name]])
    assert v.comm_exact, (name, str(v.comm))
    assert v.state_exact, (v.plan.memory, v.memory)


EXACT_BLOCKS = [n for n in EVERY if " remat=none" not in n]
# Sequence and context parallelism with grouped keys and values over model; FSDP (each
# layer also keeps its gathered weights). The rest under thorough.
DEFAULT_BLOCKS = (
    "context=2,model=4 remat=save_matmuls sp all_gather",
    "fsdp=2,model=4 remat=block",
)


@pytest.mark.parametrize("name", [case(n, default=n in DEFAULT_BLOCKS) for n in EXACT_BLOCKS])
def test_one_more_llama_layer_saves_exactly_the_predicted_bytes(name):
    """Traced only (no compile): the saved bytes of the same layout at 2 and 3 layers differ
    by the predicted per-layer bytes (under FSDP the layer's gathered weights included)."""
    two, three = all_plans(2, pipeline=False)[name], all_plans(3, pipeline=False)[name]
    assert two.memory.saved_per_block == three.memory.saved_per_block > 0
    assert saved_bytes(three) - saved_bytes(two) == three.memory.saved_per_block


@functools.cache
def bfloat16_plans(layers: int, axes: tuple[str, ...]) -> dict[str, eqxpar.plan.Plan]:
    config = dataclasses.replace(TINY, num_layers=layers)
    plans = eqxpar.plan.plan(
        config, batch=BATCH, cluster=cpu_cluster(), dtype=jnp.bfloat16, top=None, pipeline=False, axes=axes
    )
    return {str(p.layout): p for p in plans}


@pytest.mark.standard_promotion  # bfloat16 XLA attention (see conftest.py)
@pytest.mark.parametrize(
    "name",
    [
        # FSDP: each layer keeps its gathered weights' bfloat16 copies (not float32 ones).
        "fsdp=2,model=4 remat=save_matmuls",
        # Sequence and context parallelism, the weights' copies split over model.
        case("data=2,context=2,model=2 remat=block sp ring", default=False),
    ],
)
def test_with_bfloat16_compute_one_more_layer_saves_exactly_the_predicted_bytes(name):
    """A bfloat16 step keeps each layer's weights cast (this device's copies): counted once,
    in the saved activations, not again with the temporaries (the peak is the same)."""
    axes = tuple(a for a in ("data", "fsdp", "context", "model") if f"{a}=" in name)
    two, three = bfloat16_plans(2, axes)[name], bfloat16_plans(3, axes)[name]
    assert two.memory.saved_per_block == three.memory.saved_per_block > 0
    assert saved_bytes(three) - saved_bytes(two) == three.memory.saved_per_block


@pytest.mark.parametrize("name, devices, hosts", [("llama-3.2-1b", 8, 1), ("llama-3-8b", 8, 8)])
def test_plans_llama_configs_of_real_sizes_from_shapes_alone(name, devices, hosts):
    config = llama_config(name)
    machine = eqxpar.plan.cluster("h100", hosts=hosts)
    plans = eqxpar.plan.plan(config, batch=devices * hosts * 4, seq=4096, cluster=machine, top=3, pipeline=False)
    assert plans and all(p.fits and p.layout.devices == devices * hosts for p in plans)
    for p in plans:
        assert config.num_kv_heads % p.layout.model == 0
        assert p.memory.peak <= machine.memory_per_device
        assert p.flops > 0 and p.reason
        # Split: an 8B model's float32 weights (32 GB) and AdamW state do not fit one GPU.
        assert name != "llama-3-8b" or p.memory.parameters < 8e9 * 4 / 2


def test_what_the_planner_does_not_price_for_a_llama_is_refused():
    cluster = cpu_cluster()
    with pytest.raises(ValueError, match=r"holds its vocabulary \(vocab_size=64\).*leave it out"):
        eqxpar.plan.plan(TINY, batch=BATCH, cluster=cluster, vocab_size=50257)
    with pytest.raises(ValueError, match="pad_vocab_to_multiple_of=128 is the GPT's option"):
        eqxpar.plan.plan(TINY, batch=BATCH, cluster=cluster, pad_vocab_to_multiple_of=128)
    with pytest.raises(ValueError, match="moe= is planned for the GPT"):
        eqxpar.plan.plan(TINY, batch=BATCH, cluster=cluster, moe=MoEOptions(num_experts=4, top_k=1))
    with pytest.raises(ValueError, match="config must be an eqxpar.models.GPTConfig or LlamaConfig"):
        eqxpar.plan.plan({"dim": 32}, batch=BATCH, cluster=cluster)
    with pytest.raises(ValueError, match=r"seq=17 is longer than the config's context \(16\)"):
        eqxpar.plan.plan(TINY, batch=BATCH, seq=17, cluster=cluster)


def test_bfloat16_plans_price_what_the_step_sends_in_each_dtype():
    """With bfloat16 compute the step sends its activations in bfloat16 and its gradients,
    cross-entropy statistics and ring attention's key/value gradients in float32: the
    plan's `comm_in_dtype()` equals the lowered program per (kind, axes), over the batch
    axes (`data` with `context`: gradient sums), `model` (sequence parallelism) and
    `context` (ring). (The CPU compiler carries bfloat16 collectives in float32, so the
    compiled program equals `plan.comm`, the float32 theory, instead.)"""
    p = bfloat16_plans(TINY.num_layers, ("data", "context", "model"))["data=2,context=2,model=2 remat=block sp ring"]
    check_bfloat16_prices(p)


@pytest.mark.parametrize(
    "remat, sequence_parallel, attention", [("block", True, "ring"), ("none", False, "all_gather")]
)
def test_the_abstract_llama_is_the_llama_built_whole(remat, sequence_parallel, attention):
    """The planner builds one layer and stacks it (fast for 32 layers), then puts the whole
    config back: the same tree, static fields and leaf shapes as building every layer."""
    config = dataclasses.replace(TINY, num_layers=3, tie_embeddings=True)
    fast = abstract_llama(config, remat=remat, sequence_parallel=sequence_parallel, attention_impl=attention)
    whole = eqx.filter_eval_shape(
        lambda: Llama(
            config,
            scan_layers=True,
            remat=remat,
            sequence_parallel=sequence_parallel,
            attention_impl=attention,
            key=jax.random.key(0),
        )
    )
    fast_leaves, fast_tree = jax.tree.flatten(fast)
    whole_leaves, whole_tree = jax.tree.flatten(whole)
    assert fast_tree == whole_tree and fast.config == config and fast.num_layers == 3
    assert [(x.shape, x.dtype) for x in fast_leaves] == [(x.shape, x.dtype) for x in whole_leaves]
