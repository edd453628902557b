"""Layers stacked with eqx.filter_vmap and run with lax.scan (issue 20): nothing splits their
layer axis. fsdp_step refuses such a stack as one unit, with a ValueError naming the path
before any compile (was: "axis 1 is out of bounds"). (parallelize splits them per layer:
tests/test_parallelize_stacked.py.)"""

import logging

import jax
import optax
import pytest
from _stacked_plain import DIM, LAYERS, ScannedNet, loss_fn

import eqxpar
import eqxpar.nn
from eqxpar.train import fsdp_step, shard_batch


def no_compiles(caplog):
    return not [r for r in caplog.records if r.getMessage().startswith("Compiling")]


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


def test_stacked_weight_finds_the_first_stacked_weight():
    model = ScannedNet(jax.random.key(0))
    assert eqxpar.nn.stacked_weight(model) == ("blocks.up.weight", (LAYERS, 16, 8))
    assert eqxpar.nn.stacked_weight(model.blocks.down) == ("weight", (LAYERS, 8, 16))
    assert eqxpar.nn.stacked_weight(model.head) is None
