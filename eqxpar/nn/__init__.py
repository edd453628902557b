"""Tensor-parallel Equinox layers with their collectives in plain sight.

Each layer is an Equinox Module with the same parameters and initialisation as its dense
counterpart in `equinox.nn`. Outside `shard_map` it holds full-size (global) arrays;
[`eqxpar.nn.partition_specs`][] says how to split them over the model axis, and inside
`eqxpar.filter_shard_map` each device holds its block and the layer's `__call__` does the
communication by hand (`psum`, `all_gather`, `pmax`).

```python
mesh = eqxpar.make_mesh(model=4)
mlp = eqxpar.nn.ParallelMLP(64, 64, 256, key=jax.random.key(0))
specs = eqxpar.nn.partition_specs(mlp, mesh)
forward = eqxpar.filter_shard_map(lambda mlp, x: jax.vmap(mlp)(x), mesh=mesh, in_specs=(specs, P()), out_specs=P())
y = forward(eqxpar.shard(mlp, mesh, specs), x)  # equals eqx.nn.MLP's output
```
"""

from ._all_gather_attention import all_gather_attention
from ._attention import ATTENTION_IMPLS, ParallelMultiheadAttention
from ._attention_inputs import segment_mask
from ._attention_kernels import fused_attention
from ._base import TensorParallelLayer, gather_sequence
from ._context_blocks import context_segment_ids
from ._context_layout import context_positions, layout_order, zigzag_inverse, zigzag_order
from ._convert import from_dense, partition_specs, to_dense
from ._embedding import VocabParallelEmbedding, vocab_parallel_cross_entropy
from ._linear import MATMUL_NAME, ColumnParallelLinear, RowParallelLinear
from ._mlp import ParallelMLP
from ._moe import MixtureOfExperts
from ._moe_dispatch import expert_capacity
from ._moe_router import MoEAux, update_router_bias
from ._norm import gelu, layer_norm
from ._parallelize import auto_plan, parallelize
from ._plan import Plan, PlanRow, stacked_weight
from ._plan_stacked import VmappedStack
from ._registry import register_style, unregister_style
from ._ring_attention import ring_attention
from ._stacked import StackedLayers

__all__ = [
    "layer_norm",
    "gelu",
    "TensorParallelLayer",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "MATMUL_NAME",
    "ATTENTION_IMPLS",
    "ParallelMLP",
    "MixtureOfExperts",
    "MoEAux",
    "update_router_bias",
    "expert_capacity",
    "ParallelMultiheadAttention",
    "fused_attention",
    "segment_mask",
    "gather_sequence",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "StackedLayers",
    "VmappedStack",
    "stacked_weight",
    "partition_specs",
    "from_dense",
    "to_dense",
    "parallelize",
    "auto_plan",
    "Plan",
    "PlanRow",
    "register_style",
    "unregister_style",
    "ring_attention",
    "all_gather_attention",
    "zigzag_order",
    "zigzag_inverse",
    "layout_order",
    "context_positions",
    "context_segment_ids",
]
