"""`pipeline_step`: pipeline parallelism over a stage axis, in one SPMD program.

The stacked layers are split over the stage axis (each device holds `num_layers / stages`
of them; under the circular schedule, `virtual_stages` chunks `stages` apart); `first`
(the embedding) and `last` (head and loss) are copied on every stage and run, masked, on
the first and last stage: they are small next to the layers, and a copy keeps every
device's program the same (their gradients come from one stage each and are added up over
the stage axis with the rest of the reduction). The batch is split over the batch axes and
cut into micro-batches, which flow through the stages one tick at a time (see
`_pipeline_run.py`). The optimizer runs on the global gradient, as in every builder.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import PyTree

from .._shard_map import filter_shard_map
from .._specs import (
    AxisNames,
    axis_names,
    check_axes,
    full_specs,
    is_spec,
    pad_spec,
    spec_axes,
)
from ..nn import partition_specs
from ._checks import check_batch_divides, check_builder
from ._checks_experts import check_experts, moe_layers
from ._checks_model import check_model_axes
from ._gradients import leaf_plans, whole_leaf
from ._pipeline_run import PipelinePlan, gpipe_loss, one_f_one_b
from ._pipeline_stages import Stages
from ._placement import constrain_to_specs, optimizer_specs
from ._precision import Precision
from ._schedule import SCHEDULES, make_schedule
from ._step import TrainStep

__all__ = ["pipeline_specs", "pipeline_step"]


def _layer_mask(stages: Stages, model: PyTree) -> list[bool]:
    """Per leaf of `model`: whether it belongs to the stacked layers."""
    leaves, treedef = jax.tree_util.tree_flatten(model)
    ids = jax.tree_util.tree_unflatten(treedef, list(range(len(leaves))))
    inside = set(jax.tree.leaves(stages.layers(ids)))
    return [i in inside for i in range(len(leaves))]


def _check_experts(model: PyTree, mesh: Mesh, batch_axes: tuple[str, ...]) -> None:
    """A mixture of experts inside the stages splits its experts over its own axis, which
    must not be a batch axis: pipeline_step takes no `expert_axis` (the batch is not split
    over it by the step; each MoE layer splits its micro-batch's sequences over it)."""
    for where, layer in moe_layers(model):
        if layer.axis_name in batch_axes:
            raise ValueError(
                f"pipeline_step: the MixtureOfExperts at model{where} splits its experts over "
                f"{layer.axis_name!r}, which is also a batch axis of the step; pipeline_step takes no "
                f"expert_axis (expert parallelism that carries data, as hybrid_step's). Leave "
                f"{layer.axis_name!r} out of batch_axis: each MoE layer then routes its own block of the "
                f"micro-batch's sequences on each device of {layer.axis_name!r}."
            )
    check_experts(model, mesh, "pipeline_step", None, batch_axes)  # experts divisible by the axis


def pipeline_specs(stages: Stages, model: PyTree, specs: PyTree, stage_axis: str = "stage") -> PyTree:
    """`specs` (one `PartitionSpec` per leaf) with the stacked layers' leading axis split over
    `stage_axis`.

    **Arguments:**

    - `stages`: the model's [`eqxpar.train.Stages`][].
    - `model`: the model (global form).
    - `specs`: a full spec tree for `model` (e.g. `eqxpar.nn.partition_specs(model)`).
    - `stage_axis`: the mesh axis the layers are split over.

    **Returns:**

    The spec tree, the layers' specs `P(stage_axis, ...)`.

    **Raises:**

    - `ValueError` if a layer's leading axis is already split over another axis, or a spec
      outside the layers uses the stage axis.
    """
    flat, treedef = jax.tree_util.tree_flatten(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    leaves = jax.tree.leaves(model)
    mask = _layer_mask(stages, model)
    out = []
    for spec, leaf, is_layer in zip(flat, leaves, mask):
        if not eqx.is_array(leaf):
            out.append(spec)
            continue
        entries = pad_spec(spec or PartitionSpec(), leaf.ndim)
        if is_layer:
            if entries[0] not in (None, stage_axis):
                raise ValueError(
                    f"pipeline_step: the stacked layers' leading (layer) axis must be split over "
                    f"{stage_axis!r} only; param_specs gives {spec}. Leave the first entry None."
                )
            entries[0] = stage_axis
        elif stage_axis in spec_axes(spec or PartitionSpec()):
            raise ValueError(
                f"pipeline_step: param_specs splits a parameter outside the stacked layers over the "
                f"stage axis ({spec}); first and last parts are copied on every stage."
            )
        out.append(PartitionSpec(*entries))
    return jax.tree_util.tree_unflatten(treedef, out)


def _interleave(tree: PyTree, mask: list[bool], P: int, r: int, inverse: bool) -> PyTree:
    """Circular schedule: reorder the stacked layers so that device `s`'s contiguous block
    holds chunks `s, s+P, s+2P, ...` (and back)."""
    if r == 1:
        return tree
    leaves, treedef = jax.tree_util.tree_flatten(tree)

    def move(x):
        L = x.shape[0]
        k = L // (r * P)
        shape = (r, P, k) if not inverse else (P, r, k)
        x = x.reshape(*shape, *x.shape[1:])
        return jnp.swapaxes(x, 0, 1).reshape(L, *x.shape[3:])

    return jax.tree_util.tree_unflatten(
        treedef, [move(x) if m and eqx.is_array(x) else x for x, m in zip(leaves, mask)]
    )


def pipeline_step(
    stages: Stages,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    param_specs: PyTree[PartitionSpec] | Callable[[PyTree], PyTree] | None = None,
    batch_axis: AxisNames = "data",
    stage_axis: str = "stage",
    schedule: str = "gpipe",
    microbatches: int = 1,
    virtual_stages: int = 1,
    has_state: bool = False,
    precision: Precision | None = None,
    remat: bool = False,
) -> TrainStep:
    """Pipeline parallelism: the stacked layers split over `stage_axis`, micro-batches
    flowing through the stages tick by tick, everything in one SPMD program.

    **Arguments:**

    - `stages`: the model's [`eqxpar.train.Stages`][] (e.g. [`eqxpar.models.gpt_stages`][]`()`).
    - `optimizer`: any optax `GradientTransformation`; it runs on the global gradient.
    - `mesh`: a mesh with the stage axis and the batch axes (and any model axis the layers
      are tensor-parallel over).
    - `param_specs`: the specs of the model's arrays over the other axes, or a function of
      the model giving them; default [`eqxpar.nn.partition_specs`][]. The stacked layers'
      leading axis is split over `stage_axis` on top ([`eqxpar.train.pipeline_specs`][]).
      Specs may split parameters over the batch axes too (FSDP inside the stages, e.g.
      [`eqxpar.train.fsdp_specs`][] with these specs as its `param_specs`): such leaves
      are gathered once per step and their gradients reduce-scattered once per step.
    - `batch_axis`: the axis (or axes) the batch is split over (size-1 axes are fine).
    - `stage_axis`: the mesh axis of the pipeline stages, `P` devices.
    - `schedule`: `"gpipe"`, `"circular"` or `"1f1b"` (see
      [`eqxpar.train.make_schedule`][]).
    - `microbatches`: `M`, micro-batches per batch shard (rows `k, k+M, ...` form
      micro-batch `k`, as `grad_accum` in the other builders).
    - `virtual_stages`: `r`, layer chunks per device (circular only).
    - `has_state`: must be False (stateful layers are not pipelined).
    - `precision`: an [`eqxpar.train.Precision`][]; `compute_dtype` casts the parameters
      and the batch inside each stage.
    - `remat`: GPipe and circular only: keep just each tick's inputs for the backward
      pass and recompute the rest (GPipe's re-materialisation). 1F1B always keeps only
      its stages' inputs and recomputes each stage's forward inside its `jax.vjp`.

    **Returns:**

    A [`eqxpar.train.TrainStep`][]: `model, opt_state = step.init(model)`, then
    `step(model, opt_state, batch, key=None) -> (model, opt_state, metrics)` with
    `metrics["loss"]` (the global-batch mean) and `metrics["grad_norm"]`; `step.schedule`
    is the [`eqxpar.train.Schedule`][] it runs.

    **Raises:**

    - `ValueError` at once for a mesh without the axes, an unknown schedule, bad
      `microbatches` / `virtual_stages`, or `has_state=True`; when first called, before
      compiling, if the number of layers is not divisible by `stages * virtual_stages`,
      the batch by the batch shards times `microbatches`, or a `MixtureOfExperts` splits
      its experts over a batch axis (there is no `expert_axis` here: an expert axis beside
      the stage axis splits the experts, each layer routing a block of the sequences).
    """
    who = "pipeline_step"
    if not isinstance(stages, Stages):
        raise ValueError(
            f"{who}: stages must be an eqxpar.train.Stages (e.g. eqxpar.models.gpt_stages()), "
            f"got {type(stages).__name__}."
        )
    if not isinstance(remat, bool):
        raise ValueError(f"{who}: remat must be True or False, got {remat!r}.")
    for name, value in (("microbatches", microbatches), ("virtual_stages", virtual_stages)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{who}: {name} must be a positive integer, got {value!r}.")
    if has_state:
        raise ValueError(f"{who}: has_state=True is not supported; pipelined layers carry no eqx.nn.State.")
    n_batch = check_builder(who, stages.loss, optimizer, mesh, batch_axis, microbatches, False)
    P = check_axes(mesh, stage_axis, who=who, arg="stage_axis", role="to split the layers over")
    batch_axes = axis_names(batch_axis)
    if stage_axis in batch_axes:
        raise ValueError(f"{who}: stage_axis {stage_axis!r} is also a batch axis; use separate mesh axes.")
    if schedule not in SCHEDULES:
        raise ValueError(f"{who}: schedule must be one of {SCHEDULES}, got {schedule!r}.")
    try:
        table = make_schedule(schedule, P, microbatches, virtual_stages)
    except ValueError as error:
        raise ValueError(f"{who}: {error}") from None
    precision = Precision() if precision is None else precision
    if not isinstance(precision, Precision):
        raise ValueError(f"{who}: precision must be an eqxpar.train.Precision, got {type(precision).__name__}.")
    share = 1.0 / (n_batch * microbatches)

    def specs_for(model):
        check_model_axes(model, mesh, who, None, splits_sequences=False)  # before anything compiles
        _check_experts(model, mesh, batch_axes)
        layers = stages.num_layers(model)
        if layers % (P * virtual_stages):
            raise ValueError(
                f"{who}: {layers} layers do not split into {P} stages x {virtual_stages} virtual stages; "
                f"use a number of layers divisible by {P * virtual_stages}."
            )
        given = (
            partition_specs(model)
            if param_specs is None
            else (param_specs(model) if callable(param_specs) else param_specs)
        )
        return pipeline_specs(stages, model, full_specs(given, model, mesh, what="param_specs"), stage_axis)

    def step(batch_and_key, model, state, opt_state):
        batch, key = batch_and_key
        check_batch_divides(batch, who, n_batch, microbatches, batch_axis, accum_name="microbatches")
        specs = specs_for(model)
        L = stages.num_layers(model)
        mask = _layer_mask(stages, model)
        plan = PipelinePlan(stages, table, stage_axis, batch_axes, L, share, tuple(mask), remat)
        flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        grad_specs = jax.tree.map(lambda s, x: s if eqx.is_inexact_array(x) else None, specs, model, is_leaf=is_spec)

        plans = [q for q in leaf_plans(specs, model, batch_axes, who) if q is not None]

        def per_device(model, batch, key):
            params, static = eqx.partition(model, eqx.is_inexact_array)
            leaves, treedef = jax.tree_util.tree_flatten(params)
            live = [(m, sp) for m, sp, x in zip(mask, flat_specs, jax.tree.leaves(model)) if eqx.is_inexact_array(x)]
            # Own copies over the batch axes a leaf is not split over (first/last: over the
            # stage axis too); leaves split over a batch axis (FSDP inside the stages) are
            # gathered whole once per step, and autodiff's transpose of that gather
            # reduce-scatters their gradients once per step.
            copied = [q.copied if m else (*q.copied, stage_axis) for (m, _), q in zip(live, plans)]
            leaves = [jax.lax.pcast(x, c, to="varying") if c else x for x, c in zip(leaves, copied)]
            params = jax.tree_util.tree_unflatten(treedef, leaves)
            batch = jax.tree.map(precision.for_compute, batch)

            def whole(p):
                flat = jax.tree.leaves(p)
                return jax.tree_util.tree_unflatten(
                    treedef, [whole_leaf(x, q.gathers, precision) for x, q in zip(flat, plans)]
                )

            if schedule == "1f1b":
                gathered, scatter = jax.vjp(whole, params)
                loss, grads = one_f_one_b(gathered, static, batch, key, plan)
                (grads,) = scatter(grads)
            else:

                def local(p):
                    return gpipe_loss(eqx.combine(whole(p), static), batch, key, plan)

                loss, grads = jax.value_and_grad(local)(params)
            # One reduction per step: the micro-batches were summed in the scan.
            g_leaves = jax.tree.leaves(grads)
            dtypes = [g.dtype for g in g_leaves]
            groups: dict[tuple, list[int]] = {}
            for i, c in enumerate(copied):
                groups.setdefault(c, []).append(i)
            g_leaves = [precision.for_reduction(g) for g in g_leaves]
            loss = jax.lax.psum(loss, (*batch_axes, stage_axis))
            for axes, ids in groups.items():
                if not axes:
                    continue
                for i, g in zip(ids, jax.lax.psum([g_leaves[i] for i in ids], axes)):
                    g_leaves[i] = g.astype(dtypes[i])
            sq: dict[tuple, Any] = {}
            for g, (_, sp) in zip(g_leaves, live):
                key_axes = spec_axes(sp or PartitionSpec())
                sq[key_axes] = sq.get(key_axes, 0.0) + jnp.sum(jnp.square(g.astype(jnp.float32)))
            total = sum((jax.lax.psum(v, a) if a else v) for a, v in sq.items())
            return loss, jax.tree_util.tree_unflatten(treedef, g_leaves), total

        r = virtual_stages
        inner = _interleave(model, mask, P, r, inverse=False)
        loss, grads, grad_sq = filter_shard_map(
            per_device,
            mesh=mesh,
            in_specs=(specs, PartitionSpec(batch_axis), PartitionSpec()),
            out_specs=(PartitionSpec(), grad_specs, PartitionSpec()),
        )(inner, batch, key)
        grad_mask = [m for m, x in zip(mask, jax.tree.leaves(model)) if eqx.is_inexact_array(x)]
        grads = _interleave(grads, grad_mask, P, r, inverse=True)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        model = constrain_to_specs(eqx.apply_updates(model, updates), specs, mesh)
        opt_state = constrain_to_specs(opt_state, optimizer_specs(optimizer, opt_state, model, specs), mesh)
        return model, state, opt_state, {"loss": loss, "grad_norm": jnp.sqrt(grad_sq)}

    out = TrainStep(
        step,
        who=who,
        optimizer=optimizer,
        specs_for=specs_for,
        mesh=mesh,
        batch_axis=batch_axis,
        grad_accum=microbatches,
        has_state=False,
    )
    out.schedule = table
    out.stage_axis = stage_axis
    return out
