"""The per-device half of the pipeline step: one scan over ticks per schedule phase, the
activations (forward) and their gradients (1F1B backward) moved one stage per tick with
`jax.lax.ppermute` over the stage axis. Runs inside `shard_map`."""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PyTree

from .._shard_map import varying_axes
from ._gradients import micro_batches
from ._pipeline_stages import Stages, layer_key
from ._schedule import Schedule

__all__ = ["PipelinePlan", "gpipe_loss", "one_f_one_b"]


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """What every device needs to run its part of the schedule."""

    stages: Stages
    schedule: Schedule
    stage_axis: str
    batch_axes: tuple[str, ...]
    num_layers: int
    share: float  # each micro-batch's share of the global-batch mean
    is_layer: tuple[bool, ...]  # per leaf of the params tree: part of the stacked layers
    remat: bool = False  # GPipe: keep only each tick's inputs, recompute the rest backward

    @property
    def P(self) -> int:
        return self.schedule.stages

    @property
    def chunk(self) -> int:
        """Layers per chunk: num_layers / (stages * virtual_stages)."""
        return self.num_layers // (self.schedule.stages * self.schedule.virtual_stages)

    def forward_perm(self) -> list[tuple[int, int]]:
        ring = self.schedule.virtual_stages > 1  # the last stage feeds the first again
        return [(s, (s + 1) % self.P) for s in range(self.P if ring else self.P - 1)]

    def backward_perm(self) -> list[tuple[int, int]]:
        return [(s + 1, s) for s in range(self.P - 1)]


def _key_of(key: Any, micro: Array | int, plan: PipelinePlan) -> Any:
    # As the other builders: fold in the batch shard, then the micro-batch index.
    if key is None:
        return None
    return jax.random.fold_in(jax.random.fold_in(key, jax.lax.axis_index(plan.batch_axes)), micro)


def _pick(tree: PyTree, i: Array | int) -> PyTree:
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False) if eqx.is_array(x) else x, tree)


def _chunks(model: PyTree, plan: PipelinePlan) -> PyTree:
    """This device's stacked layers as `(virtual_stages, chunk, ...)`."""
    r = plan.schedule.virtual_stages
    return jax.tree.map(
        lambda x: x.reshape(r, x.shape[0] // r, *x.shape[1:]) if eqx.is_array(x) else x, plan.stages.layers(model)
    )


def stage_pass(model: PyTree, x_in: PyTree, micro_batch: PyTree, mkey: Any, chunk: Array, plan: PipelinePlan):
    """One stage's work on one micro-batch: `first` on the first virtual stage, its chunk of
    layers, `last` (masked to the last virtual stage). Returns `(x_out, loss_share)`; with
    `Stages.layer_aux`, the share holds this stage's layers' aux as well."""
    s = jax.lax.axis_index(plan.stage_axis)
    r = plan.schedule.virtual_stages
    virtual = chunk * plan.P + s
    x0 = plan.stages.first(model, micro_batch, layer_key(mkey, 0))
    x = jax.tree.map(lambda a, b: jnp.where(virtual == 0, a, b), x0, x_in)
    layers = _pick(_chunks(model, plan), chunk)
    out = plan.stages.run_layers(layers, x, mkey, virtual * plan.chunk)
    x, aux = out if plan.stages.layer_aux else (out, None)
    loss = plan.stages.last(model, x, micro_batch, layer_key(mkey, plan.num_layers + 1))
    is_last = virtual == r * plan.P - 1
    share = jnp.where(is_last, loss.astype(jnp.float32) * plan.share, 0.0)
    if aux is None:
        return x, share
    # The layers' aux counts on the stage that ran them, with no communication: the step's
    # psum over the stage axis adds every stage's share as it adds the last stage's loss, and
    # the schedules' valid-tick masks (and 1F1B's vjp seeds) cover every stage's share.
    return x, share + aux * plan.share


def _varying(x: PyTree, axes: tuple[str, ...]) -> PyTree:
    """`x` typed as varying over `axes` (a loop carry must match what the body returns)."""

    def cast(a):
        missing = tuple(ax for ax in axes if ax not in varying_axes(a))
        return jax.lax.pcast(a, missing, to="varying") if missing else a

    return jax.tree.map(cast, x)


def _inexact(a) -> bool:
    return jnp.issubdtype(a.dtype, jnp.inexact)


def _cotangent(g: PyTree) -> PyTree:
    """`g` as `jax.vjp` takes it: the integer leaves (whose carry slots hold zeros) as float0."""
    return jax.tree.map(lambda a: a if _inexact(a) else np.zeros(a.shape, jax.dtypes.float0), g)


def _row(table, t, s):
    return jnp.asarray(table)[t, s]


def _activation_like(model: PyTree, micros: PyTree, key: Any, plan: PipelinePlan) -> PyTree:
    """Zeros shaped like one stage's output, typed as varying like the activations."""
    mkey = _key_of(key, 0, plan)
    x, _ = eqx.filter_eval_shape(
        lambda m, b: stage_pass(m, plan.stages.first(m, b, None), b, mkey, jnp.int32(0), plan), model, _pick(micros, 0)
    )
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), x)
    return _varying(zeros, tuple(sorted(set(plan.batch_axes) | {plan.stage_axis} | set(_vma(x)))))


def _vma(tree: PyTree) -> set:
    out = set()
    for a in jax.tree.leaves(tree):
        out |= varying_axes(a)
    return out


def gpipe_loss(model: PyTree, batch: PyTree, key: Any, plan: PipelinePlan) -> Array:
    """This device's share of the loss under the GPipe / circular schedule: one scan over
    the forward ticks; autodiff of the scan is the backward, ticks in reverse, ppermutes
    transposed. It keeps every tick's activations for the backward pass (with
    `plan.remat`: only each tick's inputs, the rest recomputed, as in the GPipe paper)."""
    sched = plan.schedule
    s = jax.lax.axis_index(plan.stage_axis)
    micros = micro_batches(batch, sched.microbatches)
    T = sched.phases[0][2]
    mb_table, chunk_table = sched.forward[:T], sched.forward_chunk[:T]

    def tick(carry, t):
        x_recv, loss = carry
        mb, chunk = _row(mb_table, t, s), _row(chunk_table, t, s)
        valid = mb >= 0
        i = jnp.maximum(mb, 0)
        x, share = stage_pass(model, x_recv, _pick(micros, i), _key_of(key, i, plan), jnp.maximum(chunk, 0), plan)
        loss = loss + jnp.where(valid, share, 0.0)
        x = jax.tree.map(lambda a: jax.lax.ppermute(a, plan.stage_axis, plan.forward_perm()), x)
        return (x, loss), None

    if plan.remat:
        tick = jax.checkpoint(tick, policy=jax.checkpoint_policies.nothing_saveable)
    x0 = _activation_like(model, micros, key, plan)
    loss0 = _varying(jnp.zeros((), jnp.float32), tuple(sorted(set(plan.batch_axes) | {plan.stage_axis} | _vma(x0))))
    (_, loss), _ = jax.lax.scan(tick, (x0, loss0), jnp.arange(T))
    return loss


def one_f_one_b(params: PyTree, static: PyTree, batch: PyTree, key: Any, plan: PipelinePlan):
    """This device's loss share and parameter gradients under 1F1B: explicit `jax.vjp` per
    micro-batch; a stash of at most `min(M, 2P-1)` stage inputs (the backward recomputes
    the stage's forward from its input); gradients sent one stage up per tick."""
    sched = plan.schedule
    s = jax.lax.axis_index(plan.stage_axis)
    micros = micro_batches(batch, sched.microbatches)
    depth = max(1, min(sched.microbatches, 2 * plan.P - 1))
    zero_chunk = jnp.int32(0)

    def run(p, x_in, i):
        return stage_pass(eqx.combine(p, static), x_in, _pick(micros, i), _key_of(key, i, plan), zero_chunk, plan)

    model = eqx.combine(params, static)
    x0 = _activation_like(model, micros, key, plan)
    axes = tuple(sorted(set(plan.batch_axes) | {plan.stage_axis} | _vma(x0)))
    stash0 = jax.tree.map(lambda a: jnp.zeros((depth, *a.shape), a.dtype), x0)
    stash0 = _varying(stash0, axes)
    grads0 = jax.tree.map(jnp.zeros_like, params)
    loss0 = _varying(jnp.zeros((), jnp.float32), axes)

    def make_tick(do_forward: bool, do_backward: bool):
        def tick(carry, t):
            x_recv, g_recv, stash, grads, loss = carry
            if do_forward:
                mb = _row(sched.forward, t, s)
                valid = mb >= 0
                i = jnp.maximum(mb, 0)
                slot = i % depth
                kept = jax.tree.map(lambda st, a: jnp.where(valid, a, st[slot]), stash, x_recv)
                stash = jax.tree.map(lambda st, a: st.at[slot].set(a), stash, kept)
                x_out, _ = run(params, x_recv, i)
                x_send = jax.tree.map(lambda a: jax.lax.ppermute(a, plan.stage_axis, plan.forward_perm()), x_out)
            else:
                x_send = x_recv
            if do_backward:
                mb = _row(sched.backward, t, s)
                valid = mb >= 0
                j = jnp.maximum(mb, 0)
                x_in = _pick(stash, j % depth)
                (_, share), vjp = jax.vjp(lambda p, x: run(p, x, j), params, x_in)
                g_out = jax.tree.map(lambda g: jnp.where(valid, g, jnp.zeros_like(g)), g_recv)
                seed = _varying(jnp.where(valid, 1.0, 0.0).astype(share.dtype), tuple(sorted(varying_axes(share))))
                g_out = _varying(g_out, axes)
                d_params, d_x = vjp((_cotangent(g_out), seed))
                grads = jax.tree.map(jnp.add, grads, d_params)
                loss = loss + jnp.where(valid, share, 0.0)
                # Integer parts of x (packed documents' segment ids) have no gradient: their
                # slot in the carry stays as it is, and only the others travel back.
                g_send = jax.tree.map(
                    lambda d, g: jax.lax.ppermute(d, plan.stage_axis, plan.backward_perm()) if _inexact(g) else g,
                    d_x,
                    g_recv,
                )
            else:
                g_send = g_recv
            return (x_send, g_send, stash, grads, loss), None

        return tick

    carry = (x0, x0, stash0, grads0, loss0)
    for kind, first_tick, ticks in sched.phases:
        tick = make_tick(kind in ("forward", "both"), kind in ("backward", "both"))
        carry, _ = jax.lax.scan(tick, carry, first_tick + jnp.arange(ticks))
    _, _, _, grads, loss = carry
    return loss, grads
