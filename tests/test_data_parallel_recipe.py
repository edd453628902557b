"""recipes/data_parallel.py: its own step equals one device; it runs on any mesh."""

import dataclasses
import functools

import equinox as eqx
import jax
import numpy as np
from _recipes import load_recipe, run_recipe
from hypothesis import given
from hypothesis import strategies as st

import eqxpar
import eqxpar.data
import eqxpar.datasets
from eqxpar.testing import assert_trees_close, on_one_device
from eqxpar.train import shard_batch

recipe = load_recipe("data_parallel")
DATA = eqxpar.datasets.digits()
# The recipe's settings with a narrower model and a smaller batch: the same code, cheaper compiles.
CONFIG = recipe.Config(width=16, batch_size=32)


@functools.cache
def recipe_step(n_data, grad_accum):
    cfg = dataclasses.replace(CONFIG, grad_accum=grad_accum)
    return recipe.make_train_step(cfg, eqxpar.make_mesh(data=n_data))


def reference_step(model, opt_state, batch):
    optimizer = recipe.make_optimizer(CONFIG)
    loss, grads = eqx.filter_value_and_grad(recipe.loss_fn)(model, batch, None)
    updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
    return eqx.apply_updates(model, updates), opt_state, loss


@given(
    n_data=st.sampled_from([1, 2, 4, 8]),
    grad_accum=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
    steps=st.integers(1, 3),
)
def test_recipe_step_equals_one_device(n_data, grad_accum, seed, steps):
    step = recipe_step(n_data, grad_accum)
    model = recipe.make_model(jax.random.key(seed), DATA.num_features, DATA.num_classes, CONFIG.width)
    opt_state = recipe.make_optimizer(CONFIG).init(eqx.filter(model, eqx.is_inexact_array))
    ref_model, ref_opt_state = jax.tree.map(lambda a: np.array(a) if eqx.is_array(a) else a, (model, opt_state))
    model, opt_state = eqxpar.shard((model, opt_state), step.mesh)
    for i in range(steps):
        rows = eqxpar.data.global_batch_records(len(DATA.x_train), CONFIG.batch_size, i, seed=seed)
        batch = (DATA.x_train[rows], DATA.y_train[rows])
        ref_model, ref_opt_state, ref_loss = on_one_device(reference_step, ref_model, ref_opt_state, batch)
        model, opt_state, metrics = step(model, opt_state, shard_batch(batch, step.mesh))
        assert_trees_close(metrics["loss"], ref_loss, what=f"loss at step {i}")
        assert_trees_close(model, ref_model, what=f"parameters after step {i}")
        assert_trees_close(opt_state, ref_opt_state, what=f"optimizer state after step {i}")


def test_recipe_runs_and_its_final_loss_does_not_depend_on_the_mesh(tmp_path):
    flags = ("--steps", "60", "--batch-size", "64")
    eight = run_recipe("data_parallel", tmp_path, *flags, "--mesh", "data=8")
    one = run_recipe("data_parallel", tmp_path, *flags, "--mesh", "data=1")
    accum = run_recipe("data_parallel", tmp_path, *flags, "--mesh", "data=4", "--grad-accum", "2")
    assert eight["steps"] == 60 and eight["mesh"] == "data=8" and eight["devices"] == 8
    assert one["devices"] == 1 and accum["grad_accum"] == 2
    # Training happened: the loss fell well below chance level (log 10 = 2.30).
    assert eight["final_loss"] < 1.5
    assert 0.5 < eight["test_accuracy"] <= 1.0
    for other in (one, accum):
        np.testing.assert_allclose(other["final_loss"], eight["final_loss"], rtol=1e-5)
