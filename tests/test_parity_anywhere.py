"""check_parallel_parity in any order, on data-only and FSDP meshes (issue 20): after another
parallel step in the process (Equinox's rotary tables cached on that step's mesh made the
check fail with "context mesh ... should match the aval mesh"), on a mesh without a model
axis (was: "hybrid_step: the mesh has no model axis"), and with fsdp_step."""

import jax
import optax
from test_process_heads import VOCAB, RopeLM, loss_fn

import eqxpar
import eqxpar.nn
from eqxpar.testing import check_parallel_parity
from eqxpar.train import hybrid_step, shard_batch

OPTIMIZER = optax.sgd(0.1)


def tokens():
    return jax.random.randint(jax.random.key(1), (8, 7), 0, VOCAB)


def passed(report):
    return all(used <= 1 for used, _ in report.worst.values()) and report.leaves == 7


def test_after_a_step_on_another_mesh_and_on_a_data_only_mesh():
    model = RopeLM(jax.random.key(0))
    mesh = eqxpar.make_mesh(data=2, model=4)
    parallel = eqxpar.nn.parallelize(model, mesh=mesh)
    step = hybrid_step(loss_fn, OPTIMIZER, mesh, param_specs=eqxpar.nn.partition_specs(parallel, mesh))
    placed, opt_state = step.init(parallel)
    step(placed, opt_state, shard_batch(tokens(), mesh))  # caches rotary tables on this mesh
    # The dense model itself, its batch over 8 devices: data_parallel_step.
    assert passed(check_parallel_parity(model, model, loss_fn, OPTIMIZER, eqxpar.make_mesh(data=8), tokens()))


def test_fsdp_with_tensor_parallel_layers():
    model = RopeLM(jax.random.key(0))
    mesh = eqxpar.make_mesh(fsdp=2, model=4)
    parallel = eqxpar.nn.parallelize(model, mesh=mesh)
    assert passed(check_parallel_parity(model, parallel, loss_fn, OPTIMIZER, mesh, tokens()))
