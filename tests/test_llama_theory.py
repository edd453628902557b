"""The Llama's tensor-parallel steps communicate exactly what its theory says: the
hybrid step's all-reduces over data and model, and FSDP x TP's gathers, scatters and
all-reduces, byte for byte (with grouped-query attention and tied embeddings)."""

import pytest
from jax.sharding import PartitionSpec as P
from test_llama import BATCH, OPTIMIZER, SEQ, loss_fn, tiny_llama, token_batch

import eqxpar
import eqxpar.nn
from eqxpar.inspect import CommReport, data_parallel_theory, fsdp_theory
from eqxpar.models import llama_tensor_parallel_theory
from eqxpar.train import fsdp_specs, fsdp_step, hybrid_step


@pytest.mark.parametrize("strategy, tie", [("hybrid", True), ("fsdp+tp", False)])
def test_llama_steps_communicate_exactly_the_minimum(strategy, tie):
    model = tiny_llama(0, num_kv_heads=2, tie=tie)
    if strategy == "hybrid":
        mesh, batch_axis = eqxpar.make_mesh(data=2, model=2), "data"
        specs = eqxpar.nn.partition_specs(model, mesh)
        step = hybrid_step(loss_fn, OPTIMIZER, mesh, param_specs=specs)
        theory = data_parallel_theory(model, mesh, specs)
    else:
        mesh, batch_axis = eqxpar.make_mesh(fsdp=2, model=2), "fsdp"
        specs = fsdp_specs(model, mesh, param_specs=eqxpar.nn.partition_specs(model, mesh))
        step = fsdp_step(loss_fn, OPTIMIZER, mesh, param_specs=specs, units=lambda m: m.layers)
        theory = fsdp_theory(model, mesh, specs)
    theory = theory + llama_tensor_parallel_theory(model, mesh, BATCH, SEQ, batch_axis=batch_axis)
    placed, opt_state = step.init(model)
    lowered = step.lower(placed, opt_state, eqxpar.shard(token_batch(0), mesh, P(batch_axis)))
    comparison = CommReport.of(lowered, lowered.compile()).versus(theory)
    for row in comparison.rows:
        for stage in ("lowered", "compiled"):
            assert getattr(row, stage) == row.theory, (row, stage, str(comparison))
    assert comparison.ratio(stage="compiled") == 1.0
    assert theory.bytes(axes=("model",)) > 0


def test_theory_arguments():
    model = tiny_llama(0)
    with pytest.raises(ValueError, match="model must be an eqxpar.models.Llama"):
        llama_tensor_parallel_theory(object(), eqxpar.make_mesh(model=2), BATCH, SEQ)
    with pytest.raises(ValueError, match=r"seq_len must be in 1\.\.16"):
        llama_tensor_parallel_theory(model, eqxpar.make_mesh(model=2), BATCH, 17)
    with pytest.raises(ValueError, match="batch_size must be a positive multiple of the 4 batch shards"):
        llama_tensor_parallel_theory(model, eqxpar.make_mesh(data=4, model=2), 6, SEQ, batch_axis="data")
