"""eqxpar: Equinox functional training recipes for parallel JAX.

Layers, bottom to top: placement (meshes, shardings), mapping (`filter_shard_map`),
tensor-parallel layers (`eqxpar.nn`), train steps, and what goes around a step
(multi-host start-up, data loading, checkpointing, inspection).
"""

from ._mesh import make_mesh, parse_mesh, simulate_cpu_devices
from ._shard_map import filter_shard_map
from ._sharding import (
    ShardingReport,
    broadcast_specs,
    gather,
    shard,
    sharding_report,
    validate_spec,
)

__version__ = "0.1.0"

__all__ = [
    "make_mesh",
    "parse_mesh",
    "simulate_cpu_devices",
    "filter_shard_map",
    "shard",
    "gather",
    "sharding_report",
    "ShardingReport",
    "broadcast_specs",
    "validate_spec",
]
