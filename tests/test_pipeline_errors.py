"""pipeline_step's bad arguments: a ValueError naming the problem, before anything compiles."""

import jax
import jax.numpy as jnp
import optax
import pytest

import eqxpar
from eqxpar.models import GPT, gpt_stages
from eqxpar.train import pipeline_step, shard_batch

OPT = optax.sgd(0.1)


@pytest.fixture(scope="module")
def mesh():
    return eqxpar.make_mesh(stage=2, data=2, model=1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"schedule": "zigzag"}, "schedule must be one of"),
        ({"microbatches": 0}, "microbatches must be a positive integer"),
        ({"virtual_stages": 2}, "needs schedule='circular'"),
        ({"schedule": "circular", "virtual_stages": 2, "microbatches": 3}, "multiple of 2"),
        ({"stage_axis": "pipe"}, "pipe"),
        ({"batch_axis": "stage"}, "also a batch axis"),
        ({"has_state": True}, "has_state"),
        ({"remat": "yes"}, "remat must be True or False"),
    ],
)
def test_bad_arguments_at_once(mesh, kwargs, message):
    with pytest.raises(ValueError, match=message):
        pipeline_step(gpt_stages(), OPT, mesh, **kwargs)


def test_not_stages(mesh):
    with pytest.raises(ValueError, match="eqxpar.train.Stages"):
        pipeline_step(lambda m, b, k: 0.0, OPT, mesh)


def test_layers_that_do_not_split_and_unstacked_blocks(mesh):
    step = pipeline_step(gpt_stages(), OPT, mesh, microbatches=2)
    model = GPT(
        16, 4, dim=8, num_heads=2, num_layers=3, scan_layers=True, pad_vocab_to_multiple_of=8, key=jax.random.key(0)
    )
    with pytest.raises(ValueError, match="3 layers do not split into 2 stages"):
        step.init(model)
    unstacked = GPT(16, 4, dim=8, num_heads=2, num_layers=2, pad_vocab_to_multiple_of=8, key=jax.random.key(0))
    with pytest.raises(ValueError, match="scan_layers=True"):
        step.init(unstacked)


def test_a_sequence_parallel_gpt_is_refused():
    """Megatron SP splits the residual stream's sequence over the model axis; the pipeline
    carries whole sequences between stages. Before, JAX's "Incompatible types for
    broadcasting" came out of the first step."""
    step = pipeline_step(gpt_stages(), OPT, eqxpar.make_mesh(stage=2, data=2, model=2), microbatches=2)
    model = GPT(
        16, 4, dim=8, num_heads=2, num_layers=2, scan_layers=True, sequence_parallel=True, pad_vocab_to_multiple_of=8,
        key=jax.random.key(0),
    )  # fmt: skip
    with pytest.raises(ValueError, match="sequence_parallel=True cannot be pipelined yet"):
        step.init(model)


def test_batch_that_does_not_split_into_micro_batches(mesh):
    step = pipeline_step(gpt_stages(), OPT, mesh, microbatches=3)
    model = GPT(
        16, 4, dim=8, num_heads=2, num_layers=2, scan_layers=True, pad_vocab_to_multiple_of=8, key=jax.random.key(0)
    )
    model, opt_state = step.init(model)
    with pytest.raises(ValueError, match="divisible"):
        step(model, opt_state, shard_batch(jnp.zeros((4, 5), jnp.int32), mesh, batch_axis="data"))
