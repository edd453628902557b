"""Ordinary inputs that used to crash, and bad inputs that used to end in a raw JAX error
(issue 27): each now runs, or gets a ValueError naming the problem and the fix, raised
before anything compiles."""

import jax
import optax
import pytest
from _recipes import run_recipe as _run_recipe

import eqxpar
import eqxpar.nn
import eqxpar.recipe


def run_recipe(*args):
    """A recipe runs with JAX's default promotion rules, as a user runs it (the suite's
    conftest makes implicit promotion raise, for the library's own code)."""
    with jax.numpy_rank_promotion("allow"), jax.numpy_dtype_promotion("standard"):
        return _run_recipe(*args)


# A small GPT: one layer, 16 characters of context, 8 sequences per step.
GPT_FLAGS = ("--layers", "1", "--dim", "32", "--context", "16", "--batch-size", "8")


# -- 1. recipes: any --steps >= 1, and --resume of a finished run -------------------------


def test_speed_metrics_of_a_run_that_timed_no_step_are_null():
    speed = eqxpar.recipe.speed_metrics(float("nan"), 1000.0, 8, "float32")
    assert speed == {"tokens_per_second": None, "flops_per_token": 1000.0, "flops_per_second": None, "mfu": None}
    assert "2 or more steps" in eqxpar.recipe.speed_text(speed)
    timed = eqxpar.recipe.speed_metrics(2000.0, 1000.0, 8, "float32")
    assert eqxpar.recipe.speed_text(timed) == "2,000 tokens/s, 0.0 GFLOP/s"  # CPU: no MFU


def test_steps_to_run_says_when_a_resumed_run_has_nothing_left(capsys):
    assert eqxpar.recipe.steps_to_run(0, 3) == range(3)
    assert capsys.readouterr().out == ""
    assert eqxpar.recipe.steps_to_run(3, 3) == range(3, 3)
    out = capsys.readouterr().out
    assert "nothing left to do" in out and "step 3" in out and "--steps 3" in out


def test_fsdp_recipe_runs_one_step_and_resumes_a_finished_run(tmp_path, capsys):
    """`--steps 1` and `--resume` of a finished run both used to exit with `mfu:
    tokens_per_second must be a non-negative number, got nan` (no step was timed)."""
    flags = (*GPT_FLAGS, "--mesh", "fsdp=8", "--steps", "1", "--checkpoint-dir", str(tmp_path / "ckpt"))
    one = run_recipe("fsdp", tmp_path, *flags)
    assert one["steps"] == 1 and one["tokens_per_second"] is None and one["mfu"] is None
    assert "speed not measured" in capsys.readouterr().out
    again = run_recipe("fsdp", tmp_path, *flags, "--resume")
    assert "nothing left to do" in capsys.readouterr().out
    assert again["resumed_from_step"] == 1 and again["tokens_per_second"] is None
    for name in ("first_loss", "final_loss", "param_digest"):
        assert again[name] == one[name], name


def test_data_parallel_recipe_resumes_a_finished_run(tmp_path, capsys):
    flags = ("--steps", "2", "--batch-size", "32", "--width", "16", "--checkpoint-dir", str(tmp_path / "ckpt"))
    done = run_recipe("data_parallel", tmp_path, *flags)
    capsys.readouterr()
    again = run_recipe("data_parallel", tmp_path, *flags, "--resume")
    assert "nothing left to do" in capsys.readouterr().out
    assert again["resumed_from_step"] == 2 and again["final_loss"] is None  # null: no step run here
    assert again["param_digest"] == done["param_digest"]


def test_hybrid_gpt_recipe_runs_one_step(tmp_path, capsys):
    flags = (*GPT_FLAGS, "--mesh", "data=2,model=4", "--steps", "1", "--sample-chars", "0")
    one = run_recipe("hybrid_gpt", tmp_path, *flags)
    assert one["steps"] == 1 and one["first_loss"] == one["final_loss"] and one["flops_per_second"] is None
    assert "speed not measured" in capsys.readouterr().out


# -- 2. the mesh axes a model needs, named at the step builder and at the call -----------


def compiles(fn) -> int:
    """Run `fn`; return how many XLA compiles it caused (errors must come before any)."""
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logger = logging.getLogger("jax._src.dispatch")
    logger.addHandler(handler)
    try:
        with jax.log_compiles(True):
            fn()
    finally:
        logger.removeHandler(handler)
    return sum("Finished XLA compilation" in m or "Compiling" in m for m in records)


def refused(fn, *words):
    """`fn()` raises a ValueError, before anything compiles, whose message holds `words`."""
    caught = []

    def run():
        with pytest.raises(ValueError) as info:
            fn()
        caught.append(str(info.value))

    assert compiles(run) == 0
    for word in words:
        assert word in caught[0], (word, caught[0])
    return caught[0]


def gpt(**options):
    from eqxpar.models import GPT

    return GPT(64, 16, 32, 4, 1, key=jax.random.key(0), **options)


def gpt_loss(model, tokens, key):
    from eqxpar.models import next_token_loss

    return next_token_loss(model, tokens, key=key)


@pytest.fixture(scope="module")
def ring_gpt():
    return gpt(attention_impl="ring")


@pytest.fixture(scope="module")
def sequence_parallel_gpt():
    return gpt(sequence_parallel=True)


def test_ring_gpt_on_a_mesh_without_a_context_axis(ring_gpt):
    """Used to end in `NameError: unbound axis name: context` inside the step."""
    from eqxpar.train import hybrid_step

    step = hybrid_step(gpt_loss, optax.adam(1e-3), eqxpar.make_mesh(data=2, model=4), batch_axis="data")
    refused(
        lambda: step.init(ring_gpt),
        "hybrid_step:",
        "blocks[0].attention",
        "attention_impl='ring'",
        "'context'",
        "data=2, model=4",
        "context_axis='context'",
        "make_mesh(data=..., context=2",
    )


def test_ring_gpt_trained_without_context_axis(ring_gpt):
    """The mesh has the context axis but the step splits no sequences: used to fail on
    the sequence length or out_specs, not naming context_axis."""
    from eqxpar.train import hybrid_step

    mesh = eqxpar.make_mesh(data=2, context=2, model=2)
    step = hybrid_step(gpt_loss, optax.adam(1e-3), mesh, batch_axis="data")
    text = refused(lambda: step.init(ring_gpt), "splits no sequences", "context_axis='context'")
    assert "make_mesh" not in text  # the mesh is fine
    other = hybrid_step(
        gpt_loss, optax.adam(1e-3), eqxpar.make_mesh(data=2, seq=2, model=2), batch_axis="data", context_axis="seq"
    )
    refused(lambda: other.init(ring_gpt), "context_axis='seq'", "Build the step with context_axis='context'")


def small_llama(**options):
    from eqxpar.models import Llama, LlamaConfig

    config = LlamaConfig(
        vocab_size=64, dim=32, num_layers=1, num_heads=4, num_kv_heads=2, hidden_dim=64, max_seq_len=16
    )
    return Llama(config, key=jax.random.key(0), **options)


@pytest.mark.parametrize("build, impl", [(gpt, "dot_product"), (gpt, "reference"), (small_llama, "dot_product")])
def test_whole_sequence_attention_under_a_context_split_step(build, impl):
    """The opposite mistake: the step splits every sequence over a context axis, but the
    model's attention sees only its device's part of each sequence. It used to train, with
    a wrong loss (each part attending to itself, RoPE at local positions), and say nothing."""
    from eqxpar.train import hybrid_step

    mesh = eqxpar.make_mesh(data=2, context=2, model=2)
    step = hybrid_step(gpt_loss, optax.adam(1e-3), mesh, batch_axis="data", context_axis="context")
    model = build(attention_impl=impl)
    refused(
        lambda: step.init(model),
        "hybrid_step:",
        f"attention_impl={impl!r}",
        "context_axis='context'",
        "attention_impl='ring'",
    )


def test_sequence_parallel_gpt_under_a_data_only_step(sequence_parallel_gpt):
    """Used to end in `NameError: unbound axis name: model`."""
    from eqxpar.train import data_parallel_step

    step = data_parallel_step(gpt_loss, optax.adam(1e-3), eqxpar.make_mesh(data=8))
    refused(
        lambda: step.init(sequence_parallel_gpt),
        "data_parallel_step:",
        "(GPT)",
        "model axis 'model'",
        "its axes: data=8",
        "model=1",
    )


def test_ring_attention_outside_shard_map():
    q = jax.numpy.zeros((16, 2, 8))
    for attend in (eqxpar.nn.ring_attention, eqxpar.nn.all_gather_attention):
        refused(
            lambda attend=attend: attend(q, q, q, axis_name="context", causal=True),
            f"{attend.__name__}:",
            "outside shard_map",
            "'context'",
            "eqxpar.filter_shard_map",
        )


# -- 3. pipeline contracts, checked while tracing (before the scan or anything compiles) -----


@pytest.fixture(scope="module")
def pipeline_mesh():
    return eqxpar.make_mesh(stage=2, data=2, model=1)


def test_a_stage_layer_that_changes_the_activation_width(pipeline_mesh):
    """Used to be the scan's `TypeError: scan body function carry input and carry output
    must have equal types`."""
    import equinox as eqx

    from eqxpar.train import Stages, pipeline_step, shard_batch

    class Widen(eqx.Module):
        weight: jax.Array

    model = {"layers": Widen(jax.numpy.ones((2, 4, 6))), "scale": jax.numpy.ones((4,))}
    stages = Stages(
        first=lambda m, b, k: b * m["scale"][None, :],
        layers=lambda m: m["layers"],
        layer=lambda layer, x, k: x @ layer.weight,
        last=lambda m, x, b, k: jax.numpy.mean(x),
    )
    step = pipeline_step(stages, optax.sgd(0.1), pipeline_mesh, microbatches=2)
    model, opt_state = step.init(model)
    batch = shard_batch(jax.numpy.ones((8, 4)), pipeline_mesh, batch_axis="data")
    refused(
        lambda: step(model, opt_state, batch),
        "Stages.layer changes the activation",
        "float32[2, 4]",
        "float32[2, 6]",
        "Stages.first or Stages.last",
    )


@pytest.fixture(scope="module")
def pipeline_gpt(pipeline_mesh):
    from eqxpar.models import GPT, gpt_stages
    from eqxpar.train import pipeline_step

    step = pipeline_step(gpt_stages(), optax.sgd(0.1), pipeline_mesh, microbatches=2)
    model = GPT(
        16, 4, dim=8, num_heads=2, num_layers=2, scan_layers=True, pad_vocab_to_multiple_of=8, key=jax.random.key(0)
    )
    return step, *step.init(model)


def test_tokens_longer_than_the_context_through_a_pipeline(pipeline_mesh, pipeline_gpt):
    """Used to be `Incompatible types for broadcasting` from the position embedding."""
    from eqxpar.train import shard_batch

    step, model, opt_state = pipeline_gpt
    batch = shard_batch(jax.numpy.zeros((8, 9), jax.numpy.int32), pipeline_mesh, batch_axis="data")
    refused(
        lambda: step(model, opt_state, batch),
        "8 tokens per sequence exceed context_length=4",
        "seq + 1 <= 5",
        "context_length >= 8",
    )


def test_pipeline_messages_speak_of_microbatches(pipeline_mesh):
    from eqxpar.models import gpt_stages
    from eqxpar.train import pipeline_step, shard_batch

    step = pipeline_step(gpt_stages(), optax.sgd(0.1), pipeline_mesh, microbatches=3)
    batch = shard_batch(jax.numpy.zeros((4, 5), jax.numpy.int32), pipeline_mesh, batch_axis="data")
    from eqxpar.models import GPT

    model = GPT(
        16, 4, dim=8, num_heads=2, num_layers=2, scan_layers=True, pad_vocab_to_multiple_of=8, key=jax.random.key(0)
    )
    model, opt_state = step.init(model)
    text = refused(lambda: step(model, opt_state, batch), "times microbatches=3 (= 6)", "multiple of 6")
    assert "grad_accum" not in text


# -- 4. an optimizer tree (a weight-decay mask) that does not fit the model, up front -------


def mlp(depth):
    import equinox as eqx

    return eqx.nn.MLP(8, 8, 16, depth, key=jax.random.key(0))


def weight_mask(model):
    import equinox as eqx

    return jax.tree.map(lambda x: x.ndim > 1, eqx.filter(model, eqx.is_inexact_array))


@pytest.mark.parametrize(
    "optimizer, path",
    [
        (optax.adamw(1e-3, mask=weight_mask(mlp(1))), "model.layers[2].weight has no entry in the mask"),
        (
            optax.chain(optax.masked(optax.add_decayed_weights(1e-4), weight_mask(mlp(1))), optax.sgd(0.1)),
            "model.layers[2].weight has no entry in the mask",
        ),
        (optax.adamw(1e-3, mask=lambda params: {"weights": True}), "model.layers[0].weight has no entry in the mask"),
        (optax.adamw(1e-3, mask=weight_mask(mlp(3))), "the mask has an entry at .layers[3]"),
    ],
)
def test_a_weight_decay_mask_for_another_model_under_fsdp(optimizer, path):
    """Used to be `pytree structure error: different pytree metadata` after 7 compiles."""
    from eqxpar.train import fsdp_step

    def loss(model, batch, key):
        return jax.numpy.mean(jax.vmap(model)(batch) ** 2)

    step = fsdp_step(loss, optimizer, eqxpar.make_mesh(fsdp=8), batch_axis="fsdp")
    model = mlp(2)  # its initialisation compiles; the refusal must not
    refused(lambda: step.init(model), "fsdp_step:", "mask does not fit the model", path, "mask=lambda params:")


def test_a_mask_that_fits_still_trains():
    from eqxpar.train import fsdp_step

    def loss(model, batch, key):
        return jax.numpy.mean(jax.vmap(model)(batch) ** 2)

    mesh = eqxpar.make_mesh(fsdp=8)
    step = fsdp_step(loss, optax.adamw(1e-3, mask=weight_mask(mlp(2))), mesh, batch_axis="fsdp")
    model, opt_state = step.init(mlp(2))
    batch = eqxpar.shard(jax.numpy.ones((16, 8)), mesh, jax.sharding.PartitionSpec("fsdp"))
    _, _, metrics = step(model, opt_state, batch)
    assert float(metrics["loss"]) > 0


# -- 5. StackedLayers of layers that differ: which layer, which leaf, which shapes -----------


@pytest.fixture(scope="module")
def linears():
    import equinox as eqx

    key = jax.random.key(0)
    return {
        "4x4": eqx.nn.Linear(4, 4, key=key),
        "4x5": eqx.nn.Linear(4, 5, key=key),
        "no bias": eqx.nn.Linear(4, 4, use_bias=False, key=key),
        "float16": eqx.nn.Linear(4, 4, key=key, dtype=jax.numpy.float16),
    }


@pytest.mark.parametrize(
    "other, words",
    [
        ("4x5", ("layer 2 differs from layer 0", ".weight is float32[5, 4], layer 0's float32[4, 4]")),
        ("no bias", ("layer 2 differs from layer 0", "layer 0 has an array at .bias (float32[4])")),
        ("float16", ("layer 2 differs from layer 0", ".weight is float16[4, 4], layer 0's float32[4, 4]")),
    ],
)
def test_stacked_layers_name_the_layer_and_the_leaf_that_differ(linears, other, words):
    layers = [linears["4x4"], linears["4x4"], linears[other]]
    refused(lambda: eqxpar.nn.StackedLayers(layers), "StackedLayers:", *words, "same arguments")


def test_stacked_layers_name_a_static_field_that_differs():
    from eqxpar.models import GPT

    key = jax.random.key(0)
    four, eight = (GPT(64, 16, 32, heads, 1, key=key).blocks[0] for heads in (4, 8))
    refused(lambda: eqxpar.nn.StackedLayers([four, eight]), "layer 1 differs", ".attention.num_heads is 8, layer 0's 4")


def test_stacked_layers_bad_arguments(linears):
    refused(lambda: eqxpar.nn.StackedLayers(linears["4x4"]), "layers must be a sequence", "got Linear")
    refused(lambda: eqxpar.nn.StackedLayers([linears["4x4"]], axis_name=3), "axis_name must be a mesh axis name")


# -- 6. arguments checked before any initialisation compiles -------------------------------


@pytest.mark.parametrize(
    "options, words",
    [
        ({"attention_impl": "flash"}, ("attention_impl must be one of", "'ring'", "got 'flash'")),
        ({"remat": "everything"}, ("remat must be one of", "got 'everything'")),
        ({"scan_layers": "yes"}, ("scan_layers must be True or False",)),
        ({"dropout_p": 1.5}, ("dropout_p must be a probability in [0, 1)",)),
        ({"mlp_ratio": 0}, ("mlp_ratio must be a positive integer",)),
        ({"axis_name": None}, ("axis_name must be a mesh axis name",)),
    ],
)
def test_gpt_checks_its_arguments_before_drawing_weights(options, words):
    from eqxpar.models import GPT

    key = jax.random.key(0)
    refused(lambda: GPT(64, 16, 32, 4, 2, key=key, **options), "GPT:", *words)


def test_to_dense_of_a_devices_stacked_block_is_refused_before_unstacking():
    """A device's block of a scanned GPT's blocks (as inside shard_map: the split weights
    cut 4 ways): used to slice every layer out (a compile per array) before a layer's own
    check refused it."""
    from eqxpar.models import GPT

    blocks = GPT(64, 16, 32, 4, 2, scan_layers=True, key=jax.random.key(0)).blocks
    specs = eqxpar.nn.partition_specs(blocks, eqxpar.make_mesh(model=4))

    def cut(x, spec):
        if spec is None or not hasattr(x, "shape"):
            return x
        entries = (*spec, *(None,) * (x.ndim - len(spec)))
        return x[tuple(slice(0, d // 4) if e == "model" else slice(None) for d, e in zip(x.shape, entries))]

    block = jax.tree.map(cut, blocks, specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec) or x is None)
    refused(lambda: block.to_dense(), "to_dense", "not the global", "device's block")


def test_ring_and_sequence_parallel_gpt_called_outside_shard_map(ring_gpt, sequence_parallel_gpt):
    tokens = jax.numpy.zeros((2, 8), jax.numpy.int32)
    refused(
        lambda: ring_gpt(tokens),
        "GPT: attention_impl='ring'",
        "'context'",
        "outside shard_map",
        "context_axis='context'",
    )
    refused(lambda: sequence_parallel_gpt(tokens), "GPT: sequence_parallel=True", "'model'", "outside shard_map")


def test_ring_gpt_in_a_pipeline():
    from eqxpar.models import GPT, gpt_stages
    from eqxpar.train import pipeline_step

    model = GPT(64, 16, 32, 4, 2, attention_impl="ring", scan_layers=True, key=jax.random.key(0))
    step = pipeline_step(gpt_stages(), optax.sgd(0.1), eqxpar.make_mesh(stage=2, data=2, model=2))
    refused(
        lambda: step.init(model),
        "pipeline_step:",
        "attention_impl='ring'",
        "keeps whole sequences",
        "attention_impl='dot_product'",
    )
