"""Layers stacked with eqx.filter_vmap and run with lax.scan (issue 20): nothing splits their
layer axis. parallelize refuses to split them and the automatic plan keeps them whole, and
fsdp_step refuses them as units, each with a ValueError naming the path before any compile
(were: "dimension 0 ... not divisible by 4", the layer count, and "axis 1 is out of bounds")."""

import logging

import equinox as eqx
import jax
import optax
import pytest
from _stacked_plain import DIM, LAYERS, ScannedNet, loss_fn

import eqxpar
import eqxpar.nn
from eqxpar.train import fsdp_step, shard_batch


def no_compiles(caplog):
    return not [r for r in caplog.records if r.getMessage().startswith("Compiling")]


def test_parallelize_refuses_to_split_a_stacked_layer(caplog):
    model = ScannedNet(jax.random.key(0))
    caplog.set_level(logging.WARNING)
    with jax.log_compiles(True), pytest.raises(ValueError) as error:
        eqxpar.nn.parallelize(model, {"blocks.up": "column", "blocks.down": "row"})
    text = str(error.value)
    assert text.startswith("parallelize: blocks.up (Linear(8->16)) cannot be 'column'"), text
    assert f"has shape ({LAYERS}, 16, 8)" in text and "eqxpar.nn.StackedLayers" in text, text
    assert no_compiles(caplog)


def test_auto_plan_keeps_a_stacked_attention_whole():
    stacked = eqx.filter_vmap(lambda k: eqx.nn.MultiheadAttention(2, DIM, key=k))(
        jax.random.split(jax.random.key(0), LAYERS)
    )
    _, plan = eqxpar.nn.parallelize({"attention": stacked}, return_plan=True)
    assert dict(plan) == {"['attention']": "replicate"}
    assert f"query_proj.weight has shape ({LAYERS}, {DIM}, {DIM})" in plan.rows[0].note, plan.rows[0].note


def test_fsdp_units_refuse_a_stack(caplog):
    mesh = eqxpar.make_mesh(fsdp=8)
    step = fsdp_step(loss_fn, optax.sgd(0.1), mesh, units=lambda m: m.blocks)
    model, opt_state = step.init(ScannedNet(jax.random.key(0)))
    batch = shard_batch(jax.random.normal(jax.random.key(1), (8, DIM)), mesh, batch_axis="fsdp")
    caplog.set_level(logging.WARNING)
    with jax.log_compiles(True), pytest.raises(ValueError) as error:
        step(model, opt_state, batch)
    text = str(error.value)
    assert text.startswith("fsdp_step: units names model.blocks, layers stacked with eqx.filter_vmap"), text
    assert f"up.weight has shape ({LAYERS}, 16, 8)" in text and "eqxpar.nn.StackedLayers" in text, text
    assert no_compiles(caplog)
