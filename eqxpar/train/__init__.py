"""Train steps: `step(model, opt_state, batch, key=None) -> (model, opt_state, metrics)`.

Every builder has one shape, as every optax optimizer does:

```python
step = eqxpar.train.hybrid_step(
    loss_fn, optimizer, mesh, param_specs=..., batch_axis="data", grad_accum=1, has_state=False
)
model, opt_state = step.init(model)  # optimizer state made and placed on the mesh
model, opt_state, metrics = step(model, opt_state, batch, key)  # metrics: loss, grad_norm
```

- [`eqxpar.train.data_parallel_step`][]: a copy of the model per device, the batch split.
- [`eqxpar.train.hybrid_step`][]: the same with tensor-parallel layers over a model axis.
- [`eqxpar.train.fsdp_step`][]: parameters and optimizer state split over the batch axis too
  ([`eqxpar.train.fsdp_specs`][] says where).
- [`eqxpar.train.pipeline_step`][]: the stacked layers split over a stage axis, micro-batches
  pipelined through them (GPipe, circular or 1F1B schedules; takes an
  [`eqxpar.train.Stages`][] in place of `loss_fn`).

The loss and gradients come from per-device code with every collective in sight
(`eqxpar.filter_shard_map`); the optimizer then runs on the global gradient, so
whole-gradient transformations (global-norm clipping, `optax.MultiSteps`, masked weight
decay) give the single-device result under every strategy.
"""

from ._builders import LossFn, data_parallel_step, fsdp_step, hybrid_step
from ._fsdp import fsdp_specs
from ._pipeline import pipeline_specs, pipeline_step
from ._pipeline_stages import Stages
from ._placement import optimizer_specs, shard_batch
from ._precision import Precision
from ._schedule import SCHEDULES, Schedule, bubble_theory, make_schedule, stage_boundary_bytes
from ._step import TrainStep

__all__ = [
    "data_parallel_step",
    "hybrid_step",
    "fsdp_step",
    "fsdp_specs",
    "shard_batch",
    "optimizer_specs",
    "TrainStep",
    "Precision",
    "LossFn",
    "Schedule",
    "make_schedule",
    "bubble_theory",
    "stage_boundary_bytes",
    "SCHEDULES",
    "pipeline_step",
    "pipeline_specs",
    "Stages",
]
