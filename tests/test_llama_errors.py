"""The Llama's bad inputs: each a ValueError naming the argument and the fix, raised before
anything compiles."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import eqxpar
import eqxpar.nn
from eqxpar.models import Llama, LlamaConfig, LlamaRopeScaling, llama_config, llama_flops_per_token, llama_loss
from eqxpar.train import hybrid_step

SHAPE = dict(vocab_size=64, dim=32, num_layers=2, num_heads=8, hidden_dim=64, max_seq_len=16)
SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def small(**changes) -> LlamaConfig:
    return LlamaConfig(**{**SHAPE, **changes})


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"vocab_size": 0}, "vocab_size must be a positive integer"),
        ({"dim": -32}, "dim must be a positive integer"),
        ({"num_layers": 2.0}, "num_layers must be a positive integer"),
        ({"num_kv_heads": 3}, "num_heads=8 is not a multiple of num_kv_heads=3.*divisor of num_heads"),
        ({"num_kv_heads": 0}, "num_kv_heads must be a positive integer"),
        ({"dim": 36}, "dim=36 is not a multiple of num_heads=8; pass head_dim"),
        ({"head_dim": 5}, "head_dim=5 must be even"),
        ({"rope_theta": 0.0}, "rope_theta must be a positive number"),
        ({"norm_eps": -1e-5}, "norm_eps must be a positive number"),
        ({"tie_embeddings": "yes"}, "tie_embeddings must be True or False"),
        ({"rope_scaling": 8.0}, "rope_scaling must be None, a LlamaRopeScaling"),
        ({"rope_scaling": {**SCALING, "rope_type": "linear"}}, "rope_type 'linear' is not supported"),
        ({"rope_scaling": {"factor": 8.0}}, "rope_scaling needs exactly the keys"),
        ({"rope_scaling": {**SCALING, "high_freq_factor": 1.0}}, "high_freq_factor.*must exceed low_freq_factor"),
        ({"rope_scaling": {**SCALING, "original_max_position_embeddings": 0}}, "original_max_position_embeddings"),
    ],
)
def test_bad_config_is_refused(changes, match):
    with pytest.raises(ValueError, match=match):
        small(**changes)


def test_config_defaults_and_hugging_face_scaling_dict():
    config = small(rope_scaling={**SCALING, "rope_type": "llama3"})
    assert config.num_kv_heads == 8 and config.head_dim == 4
    assert config.rope_scaling == LlamaRopeScaling(8.0, 1.0, 4.0, 64)
    hash(config)  # a static field of the model: must hash


def test_llama_config_names_and_fields():
    with pytest.raises(ValueError, match="unknown Llama config 'llama-7b'.*choose one of"):
        llama_config("llama-7b")
    with pytest.raises(ValueError, match=r"unknown LlamaConfig fields \['layers'\]"):
        llama_config("tiny", layers=2)
    # head_dim follows dim and num_heads when the preset derived it.
    assert llama_config("tiny", dim=32).head_dim == 4
    assert llama_config("llama-3.2-1b", num_layers=2).head_dim == 64


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"config": {"dim": 32}}, "config must be an eqxpar.models.LlamaConfig"),
        ({"remat": "all"}, "remat must be one of"),
        ({"scan_layers": "yes"}, "scan_layers must be True or False"),
        ({"init_std": 0.0}, "init_std must be a positive number"),
        ({"axis_name": 3}, "axis_name must be a mesh axis name"),
    ],
)
def test_bad_constructor_arguments_are_refused(kwargs, match):
    arguments = {"config": small(), **kwargs}
    with pytest.raises(ValueError, match=match):
        Llama(arguments.pop("config"), key=jax.random.key(0), **arguments)


def test_model_axis_that_splits_a_kv_head_is_refused_with_both_numbers_and_the_fix():
    model = Llama(small(num_kv_heads=2), key=jax.random.key(0))
    with pytest.raises(
        ValueError,
        match=r"4 devices, which do not divide num_kv_heads=2 \(num_heads=8\).*one of \[1, 2\].*multiple of 4",
    ):
        eqxpar.nn.partition_specs(model, eqxpar.make_mesh(data=2, model=4))


def test_the_step_refuses_it_too_while_tracing_with_hand_made_specs():
    """Specs made without the mesh skip partition_specs' check: the model's own check
    stops the first call while tracing, before XLA compiles anything."""
    model = Llama(small(num_kv_heads=1), key=jax.random.key(0))
    mesh = eqxpar.make_mesh(data=4, model=2)
    step = hybrid_step(
        lambda m, b, k: llama_loss(m, b, key=k), optax.sgd(0.1), mesh, param_specs=eqxpar.nn.partition_specs(model)
    )
    opt_state = optax.sgd(0.1).init(eqx.filter(model, eqx.is_inexact_array))
    tokens = jnp.zeros((8, 9), jnp.int32)
    with pytest.raises(ValueError, match="do not divide num_kv_heads=1"):
        step(model, opt_state, tokens)


def test_vocabulary_that_does_not_split_is_refused():
    model = Llama(small(vocab_size=60), key=jax.random.key(0))
    with pytest.raises(ValueError, match="vocab_size=60 is not divisible by the 8 devices.*multiple of 8"):
        eqxpar.nn.partition_specs(model, eqxpar.make_mesh(model=8))


def _run(model, tokens, mesh):
    specs = eqxpar.nn.partition_specs(model, mesh)
    out = P(*(None,) * tokens.ndim, "model")
    return eqxpar.filter_shard_map(lambda m, t: m(t), mesh=mesh, in_specs=(specs, P()), out_specs=out)(model, tokens)


def test_bad_tokens_are_refused():
    model = Llama(small(), key=jax.random.key(0))
    mesh = eqxpar.make_mesh(model=1)
    with pytest.raises(ValueError, match="17 tokens per sequence exceed max_seq_len=16"):
        _run(model, jnp.zeros((2, 17), jnp.int32), mesh)
    with pytest.raises(ValueError, match=r"tokens must be \(seq,\) or \(\*batch, seq\)"):
        _run(model, jnp.zeros((), jnp.int32), mesh)


def test_called_outside_shard_map_says_where_to_call_it():
    model = Llama(small(), key=jax.random.key(0))
    with pytest.raises(ValueError, match="no axis of that name is bound here.*filter_shard_map"):
        model(jnp.zeros((2, 8), jnp.int32))


def test_flops_arguments():
    with pytest.raises(ValueError, match=r"seq_len must be an integer in 1\.\.16"):
        llama_flops_per_token(small(), 17)
    with pytest.raises(ValueError, match="expected an eqxpar.models.Llama or LlamaConfig"):
        llama_flops_per_token("tiny")  # pyright: ignore[reportArgumentType]
