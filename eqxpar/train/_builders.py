"""The step builders: one shape, `builder(loss_fn, optimizer, mesh, *, param_specs, batch_axis,
grad_accum, has_state, ...)`, for every strategy. Each is `build_step` (`_step_body.py`:
the per-device loss and gradients, then the optimizer on global arrays) with its own
default parameter specs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import optax
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import PyTree

from .._specs import AxisNames, axis_names
from ..nn import partition_specs
from ._fsdp import fsdp_specs
from ._precision import Precision
from ._step import TrainStep
from ._step_body import LossFn, build_step


def _fixed(specs: PyTree) -> Callable[[PyTree], PyTree]:
    return lambda model: specs


def data_parallel_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    param_specs: PyTree[PartitionSpec] = PartitionSpec(),
    batch_axis: AxisNames = "data",
    grad_accum: int = 1,
    has_state: bool = False,
    precision: Precision | None = None,
    context_axis: str | None = None,
    expert_axis: str | None = None,
) -> TrainStep:
    """Data parallelism: a copy of the model on every device, the batch split over `batch_axis`.

    Each device differentiates its share of the global-batch mean loss (its shard's mean
    over the number of shards) with respect to its own copy of the parameters; one
    `jax.lax.psum` over `batch_axis` then adds up the shares of the loss and the gradients
    (one combined all-reduce per step), and the optimizer updates every copy alike. The
    result equals a single-device step on the whole global batch.

    **Arguments:**

    - `loss_fn`: `loss_fn(model, batch, key) -> loss`, written for one device: `batch` is
      this device's shard (or micro-batch), `loss` its mean over that shard (a float
      scalar), `key` this shard's own PRNG key (`fold_in` of the step's key with the shard
      index, and with the micro-batch index under `grad_accum`), or None when the step is
      called without a key. With `has_state=True`: `loss_fn(model, state, batch, key) ->
      (loss, state)`.
    - `optimizer`: any optax `GradientTransformation`, including whole-gradient ones
      (`optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4))`, `optax.MultiSteps`,
      masked weight decay): it runs on the global gradient.
    - `mesh`: the device mesh; it must have the batch axes.
    - `grad_accum`: split each device's shard into this many micro-batches (rows `k, k+A,
      k+2A, ...` form micro-batch `k`) and add up their gradients with `jax.lax.scan`
      before the reduction. Same result as one step on the whole batch, with the
      activation memory of one micro-batch.
    - `precision`: an [`eqxpar.train.Precision`][]: the dtype the loss computes in and the
      dtype gradients cross devices in (default: the parameters' own, e.g. all float32).
    - `context_axis`: a mesh axis to split every example's sequence over (context
      parallelism), or None. The batch's arrays are then `(batch, seq, ...)`, split as
      `P(batch_axis, context_axis)`; `loss_fn` gets this device's part of every sequence
      (e.g. in `eqxpar.nn.zigzag_order` layout) and returns its mean over those tokens,
      and the step sums the gradients over the context axis as over a batch axis (every
      device holds the same number of tokens, so the result is the global mean). The
      dropout key differs between batch shards but is the same on every part of one
      sequence, so a model can draw a whole sequence's mask and keep its own positions
      (as [`eqxpar.models.GPT`][] does).
    - `expert_axis`: a mesh axis to split mixture-of-experts layers' experts over (expert
      parallelism), or None. The batch is split over it too, after the batch axes
      (`P((*batch_axis, expert_axis))`: each device of the axis routes its own tokens, as
      in MaxText and torchtitan); every [`eqxpar.nn.MixtureOfExperts`][] must have
      `axis_name=expert_axis`, with `num_experts` divisible by the axis size. Leaves split
      over the axis (the experts' stacked weights, by their `specs()`) stay on their
      devices and their gradients are summed over the batch axes only: the all-to-alls
      that bring every device's tokens to an expert already sum its gradient over the
      expert axis. Every other leaf is copied over the axis and its gradient summed over
      it like over a batch axis.
    - `has_state`: whether the model carries `eqx.nn.State` (e.g. `eqx.nn.BatchNorm`, whose
      `axis_name` must include the batch axes, e.g. `("batch", "data")` with a
      `jax.vmap(..., axis_name="batch")` in the loss).
    - `param_specs`: where the arrays live over the mesh's *other* axes (a prefix tree of
      `PartitionSpec`s; default: copied everywhere). A tensor-parallel model passes its
      specs here; that is [`eqxpar.train.hybrid_step`][]. Specs must not use the batch axes.
    - `batch_axis`: the mesh axis (or tuple of axes) the batch is split over.

    **Returns:**

    A [`eqxpar.train.TrainStep`][]: `model, opt_state = step.init(model)`, then
    `step(model, opt_state, batch, key=None) -> (model, opt_state, metrics)` (with
    `has_state=True`: `step(model, state, opt_state, batch, key=None) -> (model, state,
    opt_state, metrics)`); `metrics` holds `"loss"` and `"grad_norm"`, both global. The
    batch is split as `P(batch_axis)`, or `P((*batch_axis, expert_axis))` with an expert
    axis (`step.batch_axis`; [`eqxpar.train.shard_batch`][]).

    **Raises:**

    - `ValueError` at once for a mesh without the axes (`expert_axis` included, or
      `expert_axis` also in `batch_axis`), `grad_accum < 1`, a non-optax
      optimizer or a `loss_fn` that cannot take the step's arguments; when the step is first
      called, before anything is compiled, if `param_specs` does not fit the model, the
      global batch size is not divisible by the batch shards times `grad_accum`, or
      `loss_fn` does not return a float scalar (and, with `has_state`, a pair), or a
      mixture-of-experts layer is split over an axis the mesh lacks, another axis than
      `expert_axis`, or an axis its experts do not divide; at every
      call, for arguments in the wrong order, a key that is not a PRNG key, or a model or
      optimizer state whose buffers an earlier call consumed (donated).
    """
    return build_step(
        "data_parallel_step",
        loss_fn,
        optimizer,
        mesh,
        param_specs=_fixed(param_specs),
        batch_axis=batch_axis,
        grad_accum=grad_accum,
        has_state=has_state,
        precision=precision,
        splits_batch_axis=False,
        context_axis=context_axis,
        expert_axis=expert_axis,
    )


def hybrid_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    param_specs: PyTree[PartitionSpec] | None = None,
    batch_axis: AxisNames = "data",
    grad_accum: int = 1,
    has_state: bool = False,
    precision: Precision | None = None,
    model_axis: str = "model",
    context_axis: str | None = None,
    expert_axis: str | None = None,
) -> TrainStep:
    """Data x tensor parallelism on a `(data, model)` mesh.

    The model's tensor-parallel layers ([`eqxpar.nn`][]) are split over `model_axis` and
    do their own collectives there; the batch is split over `batch_axis`, and each model
    replica (the devices that share a data index) works on one shard of it. After the
    backward pass one `psum` over `batch_axis` adds up the replicas' shares, exactly as in
    [`eqxpar.train.data_parallel_step`][] (this is that step with the parameters placed by
    `param_specs`). `loss_fn` returns the same value on every device of the model axis
    (e.g. [`eqxpar.models.next_token_loss`][]).

    **Arguments:**

    - `loss_fn`: `loss_fn(model, batch, key) -> loss`, written for one device: `batch` is
      this device's shard (or micro-batch), `loss` its mean over that shard (a float
      scalar), `key` this shard's own PRNG key (`fold_in` of the step's key with the shard
      index, and with the micro-batch index under `grad_accum`), or None when the step is
      called without a key. With `has_state=True`: `loss_fn(model, state, batch, key) ->
      (loss, state)`.
    - `optimizer`: any optax `GradientTransformation`, including whole-gradient ones
      (`optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4))`, `optax.MultiSteps`,
      masked weight decay): it runs on the global gradient.
    - `mesh`: the device mesh; it must have the batch axes.
    - `grad_accum`: split each device's shard into this many micro-batches (rows `k, k+A,
      k+2A, ...` form micro-batch `k`) and add up their gradients with `jax.lax.scan`
      before the reduction. Same result as one step on the whole batch, with the
      activation memory of one micro-batch.
    - `precision`: an [`eqxpar.train.Precision`][]: the dtype the loss computes in and the
      dtype gradients cross devices in (default: the parameters' own, e.g. all float32).
    - `context_axis`: a mesh axis to split every example's sequence over (context
      parallelism), or None. The batch's arrays are then `(batch, seq, ...)`, split as
      `P(batch_axis, context_axis)`; `loss_fn` gets this device's part of every sequence
      (e.g. in `eqxpar.nn.zigzag_order` layout) and returns its mean over those tokens,
      and the step sums the gradients over the context axis as over a batch axis (every
      device holds the same number of tokens, so the result is the global mean). The
      dropout key differs between batch shards but is the same on every part of one
      sequence, so a model can draw a whole sequence's mask and keep its own positions
      (as [`eqxpar.models.GPT`][] does).
    - `expert_axis`: a mesh axis to split mixture-of-experts layers' experts over (expert
      parallelism), or None. The batch is split over it too, after the batch axes
      (`P((*batch_axis, expert_axis))`: each device of the axis routes its own tokens, as
      in MaxText and torchtitan); every [`eqxpar.nn.MixtureOfExperts`][] must have
      `axis_name=expert_axis`, with `num_experts` divisible by the axis size. Leaves split
      over the axis (the experts' stacked weights, by their `specs()`) stay on their
      devices and their gradients are summed over the batch axes only: the all-to-alls
      that bring every device's tokens to an expert already sum its gradient over the
      expert axis. Every other leaf is copied over the axis and its gradient summed over
      it like over a batch axis.
    - `has_state`: whether the model carries `eqx.nn.State` (e.g. `eqx.nn.BatchNorm`, whose
      `axis_name` must include the batch axes, e.g. `("batch", "data")` with a
      `jax.vmap(..., axis_name="batch")` in the loss).
    - `param_specs`: the model's spec tree; default
      [`eqxpar.nn.partition_specs`][]`(model, mesh)`, the specs its tensor-parallel layers give.
    - `batch_axis`: the batch axis (or axes).
    - `model_axis`: the tensor-parallel axis; checked to be in the mesh.

    **Returns:**

    A [`eqxpar.train.TrainStep`][]: `model, opt_state = step.init(model)`, then
    `step(model, opt_state, batch, key=None) -> (model, opt_state, metrics)` (with
    `has_state=True`: `step(model, state, opt_state, batch, key=None) -> (model, state,
    opt_state, metrics)`); `metrics` holds `"loss"` and `"grad_norm"`, both global. The
    batch is split as `P(batch_axis)`, or `P((*batch_axis, expert_axis))` with an expert
    axis (`step.batch_axis`; [`eqxpar.train.shard_batch`][]).

    **Raises:**

    - `ValueError` at once for a mesh without the axes (`expert_axis` included, or
      `expert_axis` also in `batch_axis`), `grad_accum < 1`, a non-optax
      optimizer or a `loss_fn` that cannot take the step's arguments; when the step is first
      called, before anything is compiled, if `param_specs` does not fit the model, the
      global batch size is not divisible by the batch shards times `grad_accum`, or
      `loss_fn` does not return a float scalar (and, with `has_state`, a pair), or a
      mixture-of-experts layer is split over an axis the mesh lacks, another axis than
      `expert_axis`, or an axis its experts do not divide; at every
      call, for arguments in the wrong order, a key that is not a PRNG key, or a model or
      optimizer state whose buffers an earlier call consumed (donated).
    """
    if isinstance(mesh, Mesh) and model_axis not in mesh.shape:
        raise ValueError(
            f"hybrid_step: the mesh has no model axis {model_axis!r} (its axes are "
            f"{tuple(mesh.axis_names)}). Build it with both axes, e.g. "
            f"eqxpar.make_mesh(data=2, {model_axis}=4), or pass model_axis=..."
        )
    specs_of = (lambda model: partition_specs(model, mesh)) if param_specs is None else _fixed(param_specs)
    return build_step(
        "hybrid_step",
        loss_fn,
        optimizer,
        mesh,
        param_specs=specs_of,
        batch_axis=batch_axis,
        grad_accum=grad_accum,
        has_state=has_state,
        precision=precision,
        splits_batch_axis=False,
        context_axis=context_axis,
        expert_axis=expert_axis,
    )


def fsdp_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    param_specs: PyTree[PartitionSpec] | None = None,
    batch_axis: AxisNames = "fsdp",
    grad_accum: int = 1,
    has_state: bool = False,
    precision: Precision | None = None,
    units: Callable[[PyTree], Any] | None = None,
    remat: bool = False,
    context_axis: str | None = None,
    expert_axis: str | None = None,
) -> TrainStep:
    """Fully sharded data parallelism (ZeRO-3): parameters, optimizer state and batch split.

    Each device stores a slice of every parameter (and of its optimizer state). In the step
    it all-gathers the parameters for the forward pass; autodiff's transpose of the gather
    reduce-scatters the gradient, so each device gets the global gradient of its own slice
    and updates it. Parameters too small to split stay whole, with their gradients summed
    by one `psum`. With `batch_axis=("data", "fsdp")` and specs over `"fsdp"` only, the
    parameters are copied over `data` and split over `fsdp` (hybrid sharding).

    **Arguments:**

    - `loss_fn`: `loss_fn(model, batch, key) -> loss`, written for one device: `batch` is
      this device's shard (or micro-batch), `loss` its mean over that shard (a float
      scalar), `key` this shard's own PRNG key (`fold_in` of the step's key with the shard
      index, and with the micro-batch index under `grad_accum`), or None when the step is
      called without a key. With `has_state=True`: `loss_fn(model, state, batch, key) ->
      (loss, state)`.
    - `optimizer`: any optax `GradientTransformation`, including whole-gradient ones
      (`optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4))`, `optax.MultiSteps`,
      masked weight decay): it runs on the global gradient.
    - `mesh`: the device mesh; it must have the batch axes.
    - `grad_accum`: split each device's shard into this many micro-batches (rows `k, k+A,
      k+2A, ...` form micro-batch `k`) and add up their gradients with `jax.lax.scan`
      before the reduction. Same result as one step on the whole batch, with the
      activation memory of one micro-batch.
    - `precision`: an [`eqxpar.train.Precision`][]: the dtype the loss computes in and the
      dtype gradients cross devices in (default: the parameters' own, e.g. all float32).
    - `context_axis`: a mesh axis to split every example's sequence over (context
      parallelism), or None. The batch's arrays are then `(batch, seq, ...)`, split as
      `P(batch_axis, context_axis)`; `loss_fn` gets this device's part of every sequence
      (e.g. in `eqxpar.nn.zigzag_order` layout) and returns its mean over those tokens,
      and the step sums the gradients over the context axis as over a batch axis (every
      device holds the same number of tokens, so the result is the global mean). The
      dropout key differs between batch shards but is the same on every part of one
      sequence, so a model can draw a whole sequence's mask and keep its own positions
      (as [`eqxpar.models.GPT`][] does).
    - `expert_axis`: a mesh axis to split mixture-of-experts layers' experts over (expert
      parallelism), or None. The batch is split over it too, after the batch axes
      (`P((*batch_axis, expert_axis))`: each device of the axis routes its own tokens, as
      in MaxText and torchtitan); every [`eqxpar.nn.MixtureOfExperts`][] must have
      `axis_name=expert_axis`, with `num_experts` divisible by the axis size. Leaves split
      over the axis (the experts' stacked weights, by their `specs()`) stay on their
      devices and their gradients are summed over the batch axes only: the all-to-alls
      that bring every device's tokens to an expert already sum its gradient over the
      expert axis. Every other leaf is copied over the axis and its gradient summed over
      it like over a batch axis.
    - `has_state`: whether the model carries `eqx.nn.State` (e.g. `eqx.nn.BatchNorm`, whose
      `axis_name` must include the batch axes, e.g. `("batch", "data")` with a
      `jax.vmap(..., axis_name="batch")` in the loss).
    - `param_specs`: where each parameter lives; default [`eqxpar.train.fsdp_specs`][]`(model,
      mesh, batch_axis=<the last batch axis>, param_specs=eqxpar.nn.partition_specs(model))`
      (so tensor-parallel layers stay split over their model axis too).
    - `batch_axis`: the axis (or axes) the batch is split over; parameters may be split
      over them.
    - `units`: `model -> node or tuple of nodes` (e.g. `lambda m: m.blocks`): submodules that
      gather their own weights when called, only while they run, so one unit's whole
      weights are alive at a time. Units may only be called by the model, not inspected.
      Default: gather the whole model at the start.
    - `remat`: with `units`, gather each unit's weights again in the backward pass (and
      recompute its activations) instead of keeping them from the forward pass.

    **Returns:**

    A [`eqxpar.train.TrainStep`][]: `model, opt_state = step.init(model)`, then
    `step(model, opt_state, batch, key=None) -> (model, opt_state, metrics)` (with
    `has_state=True`: `step(model, state, opt_state, batch, key=None) -> (model, state,
    opt_state, metrics)`); `metrics` holds `"loss"` and `"grad_norm"`, both global. The
    batch is split as `P(batch_axis)`, or `P((*batch_axis, expert_axis))` with an expert
    axis (`step.batch_axis`; [`eqxpar.train.shard_batch`][]).

    **Raises:**

    - `ValueError` at once for a mesh without the axes (`expert_axis` included, or
      `expert_axis` also in `batch_axis`), `grad_accum < 1`, a non-optax
      optimizer or a `loss_fn` that cannot take the step's arguments; when the step is first
      called, before anything is compiled, if `param_specs` does not fit the model, the
      global batch size is not divisible by the batch shards times `grad_accum`, or
      `loss_fn` does not return a float scalar (and, with `has_state`, a pair), or a
      mixture-of-experts layer is split over an axis the mesh lacks, another axis than
      `expert_axis`, or an axis its experts do not divide; at every
      call, for arguments in the wrong order, a key that is not a PRNG key, or a model or
      optimizer state whose buffers an earlier call consumed (donated).
    - `ValueError` at once if `remat` is set without `units`.
    """
    if remat and units is None:
        raise ValueError(
            "fsdp_step: remat=True needs units (e.g. units=lambda m: m.blocks): re-gathering "
            "in the backward pass happens per unit."
        )
    if param_specs is None:
        last = axis_names(batch_axis)[-1] if isinstance(batch_axis, (str, tuple, list)) and batch_axis else batch_axis

        def specs_of(model, /):
            # cast: `last` is not a str only for a batch_axis fsdp_specs rejects (with its message).
            return fsdp_specs(model, mesh, batch_axis=cast(str, last), param_specs=partition_specs(model))
    else:
        specs_of = _fixed(param_specs)
    return build_step(
        "fsdp_step",
        loss_fn,
        optimizer,
        mesh,
        param_specs=specs_of,
        batch_axis=batch_axis,
        grad_accum=grad_accum,
        has_state=has_state,
        precision=precision,
        splits_batch_axis=True,
        units=units,
        remat=remat,
        context_axis=context_axis,
        expert_axis=expert_axis,
    )
