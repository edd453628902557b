"""The tensor-parallel recipe's speed flags and the `"offload"` remat choice.

- `--attention`, `--remat` and `--scan-layers` change how the recipe's GPT computes, never
  what: the same losses as the defaults; `--dtype bfloat16` stays within the tolerance
  stated in tests/test_precision.py; every run writes its speed (tokens/s, FLOPs per
  token, MFU: null on CPU) to `--metrics-out`.
- `--model-size` sets the model's shape before the shape checks run.
- `remat="offload"` keeps the matmul outputs in host memory where the backend can (GPU,
  TPU): the same loss and gradients as `remat="none"`, with the moves to the host in the
  compiled program. Where it cannot (JAX's CPU backend compiles the moves away), it is a
  `ValueError` naming the backend and the other choices, before anything compiles.
"""

import logging
import re
import time
import types

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _recipes import load_recipe, run_recipe
from _reference import recipe_text
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar.models import (
    GPT,
    GPT_CONFIGS,
    TransformerBlock,
    gpt_flops_per_token,
    next_token_loss,
)
from eqxpar.models._block import REMAT_CHOICES, remat_policy, remat_wrapper
from eqxpar.recipe import Throughput
from eqxpar.testing import assert_trees_close
from eqxpar.train import hybrid_step, shard_batch

SMALL = ("--steps", "6", "--layers", "2", "--dim", "32", "--context", "16", "--batch-size", "4", "--sample-chars", "0")
OFFLOAD_BACKEND = jax.devices()[0].platform in ("gpu", "tpu")


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    return run_recipe("tensor_parallel", tmp_path_factory.mktemp("tp"), *SMALL, "--mesh", "model=4")


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [
        ("--remat", "block", "--scan-layers", "--attention", "reference"),
        ("--remat", "save_matmuls", "--mesh", "model=2"),
    ],
)
def test_options_change_how_the_recipe_computes_not_what(default_run, tmp_path, flags):
    mesh = ["--mesh", "model=4"] if "--mesh" not in flags else []
    run = run_recipe("tensor_parallel", tmp_path, *SMALL, *mesh, *flags)
    for name in ("first_loss", "final_loss", "val_loss"):
        # Six Adam steps; the options reorder float32 sums (scan, remat's recompute, the
        # reference softmax), a few ulps per step. A dropped or doubled all-reduce is off by
        # far more (test_models.py checks the collectives' count).
        np.testing.assert_allclose(run[name], default_run[name], rtol=1e-5, err_msg=f"{name} with {flags}")
    assert run["remat"] == flags[1] and run["scan_layers"] == ("--scan-layers" in flags)


@pytest.mark.slow
@pytest.mark.standard_promotion  # bfloat16 training: jax.nn.dot_product_attention (tests/conftest.py)
def test_bfloat16_run_stays_near_float32_and_every_run_reports_its_speed(default_run, tmp_path):
    run = run_recipe("tensor_parallel", tmp_path, *SMALL, "--mesh", "model=4", "--dtype", "bfloat16")
    # The tolerance stated in tests/test_precision.py: 0.05 per step (bfloat16 resolves
    # losses of 2.5-5 to about 0.01-0.02).
    assert run["first_loss"] != default_run["first_loss"]  # bfloat16 really ran
    for name in ("first_loss", "final_loss", "val_loss"):
        assert abs(run[name] - default_run[name]) < 0.05, (name, run[name], default_run[name])
    # The FLOPs of the model the recipe built (GPT of the same shape and vocabulary).
    vocab = recipe_text(16).vocab_size  # the recipe's tokenizer's (rows of --context 16)
    model = eqx.filter_eval_shape(lambda: GPT(vocab, 16, 32, 8, 2, axis_name="model", key=jax.random.key(0)))
    for metrics in (run, default_run):
        assert metrics["flops_per_token"] == gpt_flops_per_token(model)
        assert metrics["tokens_per_second"] > 0
        assert metrics["flops_per_second"] == pytest.approx(metrics["tokens_per_second"] * metrics["flops_per_token"])
        assert metrics["mfu"] is None  # no known peak for a CPU
    assert run["dtype"] == "bfloat16" and default_run["dtype"] == "float32"


def test_throughput_ends_at_the_last_step():
    """What runs after the training loop (evaluation, sampling) does not dilute tokens/s."""
    meter = Throughput(per_step=100)
    meter.tick()
    time.sleep(0.02)
    meter.tick()
    rate = meter.per_second
    time.sleep(0.05)
    assert meter.per_second == rate and 0 < rate <= 100 / 0.02


def test_config_flag_sets_the_shape_before_the_shape_checks():
    recipe = load_recipe("tensor_parallel")
    cfg = recipe.check_flags(recipe.Config(model_size="10m", mesh="model=2"))
    shape = GPT_CONFIGS["10m"]
    assert (cfg.context, cfg.dim, cfg.heads, cfg.layers) == (shape.context, shape.dim, shape.heads, shape.layers)
    # 10m has 6 heads: model=4 does not divide them, whatever --heads says.
    with pytest.raises(ValueError, match="model=4 does not divide --heads 6"):
        recipe.check_flags(recipe.Config(model_size="10m", mesh="model=4", heads=8))


# ---- remat="offload" ------------------------------------------------------------------------

CONTEXT = 8


def _gpt(remat):
    return GPT(16, CONTEXT, dim=16, num_heads=4, num_layers=2, mlp_ratio=2, remat=remat, key=jax.random.key(0))


def _tokens():
    return np.random.default_rng(0).integers(0, 16, (4, CONTEXT + 1)).astype(np.int32)


def _loss_and_grads(model, mesh):
    specs = eqxpar.nn.partition_specs(model, mesh)
    fn = eqx.filter_jit(
        eqxpar.filter_shard_map(
            lambda m, t: eqx.filter_value_and_grad(next_token_loss)(m, t),
            mesh=mesh,
            in_specs=(specs, P()),
            out_specs=(P(), specs),
        )
    )
    return fn, eqxpar.shard(model, mesh, specs)


@pytest.mark.skipif(OFFLOAD_BACKEND, reason="this backend can offload")
def test_offload_is_refused_before_compile_where_the_backend_cannot(caplog, capsys):
    platform = jax.devices()[0].platform
    with pytest.raises(ValueError, match=f"backend here is '{platform}'") as error:
        remat_wrapper("offload")
    for other in REMAT_CHOICES[:-1]:
        assert repr(other) in str(error.value)
    # In a train step: the error comes while tracing, before anything compiles.
    mesh = eqxpar.make_mesh(data=2, model=4)
    step = hybrid_step(lambda m, t, k: next_token_loss(m, t, key=k), optax.sgd(0.1), mesh)
    model, opt_state = step.init(_gpt("offload"))
    caplog.set_level(logging.WARNING)
    with (
        jax.log_compiles(True),
        pytest.raises(ValueError, match="remat='offload' keeps saved activations in host memory"),
    ):
        step(model, opt_state, shard_batch(_tokens(), mesh), jax.random.key(1))
    assert not [r for r in caplog.records if r.getMessage().startswith("Compiling")]
    # And as a recipe flag: one line, exit 2.
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        load_recipe("tensor_parallel").main(["--remat", "offload"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and "--remat offload" in err and platform in err, err


@jax.custom_vjp
def _product_by_custom_rule(x, weight):
    return jnp.einsum("...i,oi->...o", x, weight)


_product_by_custom_rule.defvjp(
    lambda x, w: (_product_by_custom_rule(x, w), (x, w)),
    lambda saved, dy: (jnp.einsum("...o,oi->...i", dy, saved[1]), jnp.einsum("...o,...i->oi", dy, saved[0])),
)


@pytest.mark.parametrize("custom_rule", [False, True])
@pytest.mark.parametrize("n", [1, 4])
def test_the_offload_policy_finds_the_linear_layers_outputs(n, custom_rule, monkeypatch):
    """What remat="offload" moves to the host, read from the traced program (tracing works
    on any backend; only the compiled moves need a GPU or TPU): per block the query, key and
    value projections (column-parallel: dim/n features each), the attention's output
    projection before its all-reduce (dim) and the MLP's hidden layer (mlp_ratio x dim/n).
    The policy offloads by name (`eqxpar.nn.MATMUL_NAME`); the test also computes every
    linear layer's product through a custom rule (as a fused kernel or a hand-written
    weight gradient would): the named policy still finds them, while a policy that picks
    `dot_general`s by shape (JAX's `offload_dot_with_no_batch_dims`, which remat="offload"
    used before) then silently offloads nothing."""
    dim, mlp_ratio, batch = 16, 2, (3, CONTEXT)
    block = TransformerBlock(dim, 4, mlp_ratio, key=jax.random.key(0))
    mesh = eqxpar.make_mesh(model=n)
    specs = eqxpar.nn.partition_specs(block, mesh)
    if custom_rule:  # the linear layers' einsum (their only use of jnp) through a custom_vjp
        einsum = types.SimpleNamespace(einsum=lambda _, x, w: _product_by_custom_rule(x, w))
        monkeypatch.setattr(eqxpar.nn._linear, "jnp", einsum)
    # The policy remat_wrapper("offload") uses, and the shape-based one it replaced.
    by_name = remat_policy("offload")
    by_shape = jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")

    def moved(policy):
        def grads(block, x):
            run = eqx.filter_checkpoint(lambda block, x: block(x), policy=policy)
            return eqx.filter_grad(lambda block: run(block, x).sum())(block)

        params, static = eqx.partition(block, eqx.is_array)
        fn = eqxpar.filter_shard_map(grads, mesh=mesh, in_specs=(specs, P()), out_specs=specs)
        x = np.ones((*batch, dim), np.float32)
        jaxpr = str(jax.make_jaxpr(lambda p, x: fn(eqx.combine(p, static), x))(params, x))
        found = re.findall(r"f32<host>\[([\d,]+)\]\S* = device_put", jaxpr)
        return sorted(tuple(map(int, s.split(","))) for s in found)

    expected = sorted([(*batch, dim // n)] * 3 + [(*batch, dim), (*batch, mlp_ratio * dim // n)])
    assert moved(by_name) == expected
    assert moved(by_shape) == ([] if custom_rule else expected)


@pytest.mark.skipif(not OFFLOAD_BACKEND, reason="JAX's CPU backend does not offload to host memory")
def test_offload_equals_no_remat_and_moves_activations_to_the_host():
    mesh = eqxpar.make_mesh(model=1)
    fn, model = _loss_and_grads(_gpt("offload"), mesh)
    loss, grads = fn(model, _tokens())
    want_fn, want_model = _loss_and_grads(_gpt("none"), mesh)
    want_loss, want_grads = want_fn(want_model, _tokens())
    assert_trees_close(loss, want_loss, what="offload loss")
    assert_trees_close(jax.tree.leaves(grads), jax.tree.leaves(want_grads), what="offload gradients")
    # The compiled program keeps the saved matmul outputs in host memory: memory space 5
    # (pinned host) in XLA's layouts, or host temporaries in its memory analysis.
    compiled = fn.lower(model, _tokens()).compile()
    hlo = compiled.as_text()
    host_temp = getattr(compiled.memory_analysis(), "host_temp_size_in_bytes", 0)
    assert re.search(r"S\(5\)", hlo) or host_temp > 0, "no transfers to host memory in the compiled program"
    plain_hlo = want_fn.lower(want_model, _tokens()).compile().as_text()
    assert not re.search(r"S\(5\)", plain_hlo)
