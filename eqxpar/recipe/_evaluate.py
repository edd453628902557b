"""The recipes' held-out loss: the training loss in inference mode, on a batch no step trains on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import PyTree

from .._shard_map import filter_shard_map
from .._specs import spec_axes

__all__ = ["held_out_loss"]


def held_out_loss(
    loss_fn: Callable[[Any, Any], jax.Array],
    mesh: Mesh,
    param_specs: PyTree[PartitionSpec],
    *,
    batch_spec: PartitionSpec = PartitionSpec(),
) -> Callable[[Any, Any], jax.Array]:
    """A compiled `evaluate(model, batch)`: the mean of `loss_fn` over a held-out batch.

    ```python
    evaluate = eqxpar.recipe.held_out_loss(lambda m, tokens: next_token_loss(m, tokens), mesh, specs)
    run_log.maybe_eval(i, val_loss=functools.partial(evaluate, model, val_tokens))
    ```

    The model runs in inference mode (`eqx.nn.inference_mode`: no dropout) inside
    `shard_map` with `param_specs`. The model may be stored in another layout (split over
    an `fsdp` axis, or its stacked layers over pipeline stages): the compiled function
    moves it into `param_specs` first, so one function serves every recipe's train step.

    **Arguments:**

    - `loss_fn`: `loss_fn(model, batch) -> scalar`, as it runs on one device inside
      `shard_map` (e.g. [`eqxpar.models.next_token_loss`][]): the mean over this device's
      share of `batch`.
    - `mesh`: the device mesh.
    - `param_specs`: the specs the model runs with (e.g. `eqxpar.nn.partition_specs(model, mesh)`).
    - `batch_spec`: how `batch` is split (default: whole on every device). The losses of
      the devices are averaged over the axes it names, so the shares must be of equal size.

    **Returns:**

    A function `(model, batch) -> scalar`, the mean held-out loss (float32 as `loss_fn`
    computes it), the same on every device.
    """
    axes = spec_axes(batch_spec)

    def per_device(model, batch):
        loss = loss_fn(eqx.nn.inference_mode(model), batch)
        return jax.lax.pmean(loss, axes) if axes else loss

    return eqx.filter_jit(
        filter_shard_map(per_device, mesh=mesh, in_specs=(param_specs, batch_spec), out_specs=PartitionSpec())
    )
