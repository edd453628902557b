"""eqxpar: Equinox functional training recipes for parallel JAX.

Layers, bottom to top: placement (meshes, shardings), mapping (`filter_shard_map`) and
inspection, tensor-parallel layers (`eqxpar.nn`), train steps (`eqxpar.train`), models
(`eqxpar.models`), and what goes around a step (multi-host start-up, data loading,
checkpointing); see docs/concepts/architecture.md.
"""

from . import (
    distributed,  # multi-host start-up: eqxpar.distributed.initialize()
    inspect,  # what a compiled function communicates
    models,  # a small GPT built from eqxpar.nn layers
    nn,  # tensor-parallel layers: eqxpar.nn.ParallelMLP, ...
    plan,  # the layout planner: eqxpar.plan.plan(config, batch=..., cluster=...)
    train,  # train steps: eqxpar.train.data_parallel_step
)
from ._mesh import fit_mesh, make_mesh, parse_mesh, simulate_cpu_devices
from ._shard_map import filter_shard_map
from ._sharding import (
    ShardingReport,
    gather,
    init_sharded,
    shard,
    sharding_report,
)
from ._specs import broadcast_specs, validate_spec
from .inspect import communication_report, memory_report

__version__ = "0.1.0"

__all__ = [
    "make_mesh",
    "fit_mesh",
    "parse_mesh",
    "simulate_cpu_devices",
    "filter_shard_map",
    "shard",
    "init_sharded",
    "gather",
    "sharding_report",
    "ShardingReport",
    "broadcast_specs",
    "validate_spec",
    "communication_report",
    "memory_report",
    # Submodules: the layers, train steps, models, inspection and multi-host start-up.
    "distributed",
    "inspect",
    "models",
    "nn",
    "plan",
    "train",
]

# Submodules whose dependencies are optional extras load on first use, so that a plain
# `import eqxpar` does not need them: `eqxpar.checkpoint` needs orbax-checkpoint,
# `eqxpar.data` needs grain.
_LAZY_SUBMODULES = ("checkpoint", "data")


def __getattr__(name: str):
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
