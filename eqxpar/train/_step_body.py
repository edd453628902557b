"""The body every step builder shares: `build_step`, the loss and gradients through
`eqxpar.filter_shard_map` (per-device code with visible collectives, see `_gradients.py`),
then the optimizer on global arrays inside the same `jax.jit`: the gradients leave the
per-device program laid out like the parameters, so any optax transformation, including
those that look at the whole gradient (`clip_by_global_norm`, `MultiSteps`, LAMB's trust
ratios), sees the true global gradient, and the compiler inserts the reductions a global
norm needs. The public builders (`_builders.py`) differ only in their default specs.
"""

from __future__ import annotations

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array, Float, PyTree

from .._shard_map import filter_shard_map
from .._specs import AxisNames, axis_names, full_specs, is_spec, spec_axes
from ._checks import check_batch_divides, check_builder, check_sequence_divides, context_split
from ._checks_experts import check_experts, expert_batch_axes
from ._checks_heads import check_head_cuts
from ._checks_model import check_batch_norms, check_model_axes, check_units
from ._gradients import leaf_plans, per_device_gradients
from ._placement import constrain_to_specs, optimizer_specs
from ._precision import Precision
from ._step import TrainStep

# `loss_fn(model, batch, key) -> loss`, or with state `loss_fn(model, state, batch, key) -> (loss, state)`.
LossFn = Callable[..., Float[Array, ""] | tuple[Float[Array, ""], eqx.nn.State]]


def build_step(
    who: str,
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    param_specs: Callable[[PyTree], PyTree],
    batch_axis: AxisNames,
    grad_accum: int,
    has_state: bool,
    splits_batch_axis: bool,
    precision: Precision | None,
    units: Callable | None = None,
    remat: bool = False,
    context_axis: str | None = None,
    expert_axis: str | None = None,
) -> TrainStep:
    """The one step every builder returns; `param_specs(model)` gives the prefix spec tree."""
    # With an expert axis the batch is split over it too (after the batch axes): from here
    # on it is one more batch axis, except for the leaves split over it (see leaf_plans).
    batch_axis = expert_batch_axes(who, mesh, batch_axis, expert_axis)
    n_batch = check_builder(who, loss_fn, optimizer, mesh, batch_axis, grad_accum, has_state)
    n_context, batch_spec = context_split(who, mesh, batch_axis, context_axis)
    owned = () if expert_axis is None else (expert_axis,)
    if precision is None:
        precision = Precision()
    if not isinstance(precision, Precision):
        raise ValueError(f"{who}: precision must be an eqxpar.train.Precision, got {type(precision).__name__}.")
    # The context axis splits every example's sequence: each device holds a part of the
    # tokens, so for the loss and the gradient sum it is one more batch axis.
    batch_axes = axis_names(batch_axis) + (() if context_axis is None else (context_axis,))
    # Each shard's share of the global-batch mean: its own mean over the number of shards
    # and micro-batches. Summed over the batch axes, the shares are the global mean (the
    # same as a pmean of the shard means; dividing first puts the 1/N into the backward
    # pass instead of an extra pass over the gradients).
    share = 1.0 / (n_batch * n_context * grad_accum)

    def specs_for(model: PyTree) -> PyTree:
        # In init and while tracing: before any compile.
        check_experts(model, mesh, who, expert_axis, batch_axes)
        check_model_axes(model, mesh, who, context_axis)
        specs = full_specs(param_specs(model), model, mesh, what="param_specs")
        if not splits_batch_axis:
            for spec in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec)):
                if (set(batch_axes) - set(owned)) & set(spec_axes(spec)):
                    raise ValueError(
                        f"{who}: param_specs splits a parameter over the batch axis ({spec}); "
                        f"{who} keeps a copy of every parameter on each batch shard. To split "
                        f"parameters over the batch axis too, use eqxpar.train.fsdp_step."
                    )
        return specs

    def step(batch_and_key, model, state, opt_state):
        # Runs once per compilation, while tracing: the checks that need shapes first.
        batch, key = batch_and_key
        check_batch_divides(batch, who, n_batch, grad_accum, batch_axis)
        if context_axis is not None:
            check_sequence_divides(batch, who, n_context, context_axis)
        check_batch_norms(model, batch_axis, who, tuple(mesh.axis_names))
        if units is not None:
            check_units(model, units, who)
        specs = specs_for(model)
        if not has_state and context_axis is None:
            gathered = tuple(a for a in batch_axes if a not in owned)
            check_head_cuts(who, loss_fn, model, batch, key, mesh, specs, batch_spec, n_batch, grad_accum, gathered)
        plans = leaf_plans(specs, model, batch_axes, who, owned=owned)
        grad_specs = jax.tree.map(lambda s, x: s if eqx.is_inexact_array(x) else None, specs, model, is_leaf=is_spec)
        per_device = per_device_gradients(
            who,
            loss_fn,
            batch_axes=batch_axes,
            key_axes=axis_names(batch_axis),
            share=share,
            grad_accum=grad_accum,
            has_state=has_state,
            units=units,
            remat=remat,
            plans=plans,
            precision=precision,
        )
        replicated = PartitionSpec()
        # With check_vma, JAX tracks which values vary over which axes and refuses to
        # return a varying value as replicated. It is off for stateful models only: JAX
        # 0.10 rejects one pmean over a vmap axis and a mesh axis together, which is what
        # eqx.nn.BatchNorm(axis_name=("batch", "data")) does; check_batch_norms stands in.
        loss, grads, grad_sq, state = filter_shard_map(
            per_device,
            mesh=mesh,
            in_specs=(specs, replicated, batch_spec, replicated),
            out_specs=(replicated, grad_specs, replicated, replicated),
            check_vma=not has_state,
        )(model, state, batch, key)
        # The optimizer, on global arrays laid out like the parameters.
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        model = constrain_to_specs(eqx.apply_updates(model, updates), specs, mesh)
        opt_state = constrain_to_specs(opt_state, optimizer_specs(optimizer, opt_state, model, specs), mesh)
        return model, state, opt_state, {"loss": loss, "grad_norm": jnp.sqrt(grad_sq)}

    return TrainStep(
        step,
        who=who,
        optimizer=optimizer,
        specs_for=specs_for,
        mesh=mesh,
        batch_axis=batch_axis,
        grad_accum=grad_accum,
        has_state=has_state,
    )
