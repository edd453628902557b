"""`check_parallel_parity` (public as `eqxpar.testing.check_parallel_parity`): does a
model's parallel form (loss, gradients, optimizer steps) equal the dense model on one device?"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jaxtyping import PyTree

from ._mesh import make_mesh
from ._shard_map import filter_shard_map
from ._sharding import gather
from ._testing_trees import F32_ATOL, F32_RTOL, leaf_errors
from .nn import partition_specs, to_dense
from .train import data_parallel_step, fsdp_step, hybrid_step, shard_batch

__all__ = ["ParityReport", "check_parallel_parity"]


@dataclasses.dataclass(frozen=True)
class ParityReport:
    """What [`eqxpar.testing.check_parallel_parity`][] compared, and how close it was.

    `losses` / `dense_losses`: the loss at each step; `grad_norm` / `dense_grad_norm`: the
    global gradient norm at the first step; `worst`: for `"loss"`, `"gradients"` and
    `"parameters"`, the largest difference as a share of the tolerance (`atol + rtol *
    |dense|`; at most 1 when it passed) and the leaf where it is.
    """

    losses: tuple[float, ...]
    dense_losses: tuple[float, ...]
    grad_norm: float
    dense_grad_norm: float
    worst: dict[str, tuple[float, str]]
    leaves: int

    def __str__(self) -> str:
        parts = [f"{what} {used:.1%}" + (f" ({where})" if where else "") for what, (used, where) in self.worst.items()]
        return (
            f"parallel == dense over {len(self.losses)} step(s): losses {', '.join(f'{x:.6f}' for x in self.losses)} "
            f"(dense {', '.join(f'{x:.6f}' for x in self.dense_losses)}); grad norm {self.grad_norm:.6f} "
            f"(dense {self.dense_grad_norm:.6f}); {self.leaves} parameter arrays compared; largest "
            f"difference as a share of the tolerance: {'; '.join(parts)}"
        )


def _keep(grads: PyTree, inner: tuple) -> tuple:
    updates, state = inner
    return updates, (grads, state)


def _copy(tree: PyTree) -> PyTree:
    # The steps donate their inputs and parallelize shares arrays with the dense model:
    # whatever placement does, the caller's models stay intact.
    return jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, tree)


def _strategy(mesh: Mesh, strategy: str | None, batch_axis: Any) -> tuple[str, Any]:
    """The parity check's step and batch axes, by the mesh's axes unless given."""
    names = tuple(mesh.axis_names)
    strategy = strategy or ("fsdp" if "fsdp" in names else "hybrid" if "model" in names else "data")
    if strategy not in ("hybrid", "data", "fsdp"):
        raise ValueError(f"check_parallel_parity: strategy must be 'hybrid', 'data' or 'fsdp', got {strategy!r}.")
    axes = tuple(a for a in ("data", "fsdp") if a in names) if strategy == "fsdp" else ("data",)
    return strategy, batch_axis if batch_axis is not None else (axes[0] if len(axes) == 1 else axes)


def check_parallel_parity(
    dense_model: PyTree,
    parallel_model: PyTree,
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    batch: PyTree,
    *,
    key: jax.Array | None = None,
    param_specs: PyTree | None = None,
    batch_axis: Any = None,
    strategy: str | None = None,
    expert_axis: str | None = None,
    units: Callable[[PyTree], Any] | None = None,
    steps: int = 1,
    rtol: float = F32_RTOL,
    atol: float = F32_ATOL,
) -> ParityReport:
    """Check that a parallelized model trains exactly as the dense model does on one device.

    Run this first on your own model. The parallel side is a train step on `mesh` (the
    batch split over `batch_axis`, the tensor-parallel layers over their model axis):
    `strategy` `"hybrid"` ([`eqxpar.train.hybrid_step`][]), `"data"`
    ([`eqxpar.train.data_parallel_step`][]) or `"fsdp"` ([`eqxpar.train.fsdp_step`][],
    parameters split over the batch axis too); default `"fsdp"` on a mesh with an `fsdp`
    axis, else `"hybrid"` on one with a `model` axis, else `"data"`. The dense side is plain
    `eqx.filter_value_and_grad` and `optimizer.update` on one device, on the whole batch.
    Compared: the loss, every gradient (tensor-parallel layers mapped back with
    [`eqxpar.nn.to_dense`][]), the gradient norm, and the parameters after `steps`
    optimizer steps on `batch`. The inputs are copied, not consumed.

    `loss_fn(model, batch, key)` is the one you train with: the mean over the examples of
    the batch it is given. On the dense side it runs in `shard_map` over a one-device mesh
    with `mesh`'s axis names, so a loss that uses
    [`eqxpar.nn.vocab_parallel_cross_entropy`][] runs on both sides. Randomness (dropout)
    depends on how the batch is split: check with it off, or with one batch shard (the dense
    side gets `fold_in(key, 0)`, as the step gives its first shard).

    **Arguments:**

    - `dense_model`: the plain Equinox model.
    - `parallel_model`: its parallel form in global form, e.g.
      [`eqxpar.nn.parallelize`][]`(dense_model)`, with the same parameters.
    - `loss_fn`: `loss_fn(model, batch, key) -> scalar loss`.
    - `optimizer`: an optax optimizer.
    - `mesh`: the mesh to run the parallel side on, e.g. `eqxpar.make_mesh(data=2, model=4)`.
    - `batch`: one global batch (a PyTree of arrays with a common leading dimension).
    - `key`: the PRNG key passed to the step (default None).
    - `param_specs`: the parallel model's specs; default
      [`eqxpar.nn.partition_specs`][]`(parallel_model, mesh)`.
    - `batch_axis`: the mesh axis (or axes) the batch is split over; default `"data"`, and
      under `"fsdp"` the mesh's `data` and `fsdp` axes (those it has).
    - `strategy`: `"hybrid"`, `"data"` or `"fsdp"`, as above (any order of checks and
      steps in one process works).
    - `expert_axis`: the mesh axis a mixture-of-experts model's experts are split over,
      passed to the step builder (which splits the batch over it too); default `"expert"`
      on a mesh with an axis of that name, else none.
    - `units`: under `"fsdp"`, the layers gathered one at a time when called, as in
      [`eqxpar.train.fsdp_step`][] (default None: all parameters gathered at the start).
    - `steps`: how many optimizer steps to compare (on the same batch).
    - `rtol`, `atol`: the tolerance per entry (float32 defaults, see `F32_RTOL`).

    **Returns:**

    A [`eqxpar.testing.ParityReport`][] (`print` it for a one-line summary).

    **Raises:**

    - `AssertionError` listing every loss, gradient and parameter leaf that differs beyond
      the tolerance, with its path, the number of entries off and the worst one.
    - `ValueError` if `parallel_model` is not a parallel form of `dense_model` (different
      structure once made dense, or different starting parameters), `steps < 1`, or
      `units` under a strategy other than `"fsdp"`.
    """
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"check_parallel_parity: steps must be a positive integer, got {steps!r}.")
    strategy, batch_axis = _strategy(mesh, strategy, batch_axis)
    if units is not None and strategy != "fsdp":
        raise ValueError(
            f"check_parallel_parity: units= is for strategy='fsdp' (layers gathered one at a time), "
            f"got strategy={strategy!r}. Drop units, or check under strategy='fsdp' on a mesh with an "
            f"'fsdp' axis."
        )
    if expert_axis is None and "expert" in mesh.axis_names:
        expert_axis = "expert"
    as_dense = to_dense(parallel_model)
    if jax.tree.structure(as_dense) != jax.tree.structure(dense_model):
        raise ValueError(
            "check_parallel_parity: eqxpar.nn.to_dense(parallel_model) does not have dense_model's "
            "structure; pass the dense model and its parallel form, e.g. "
            "eqxpar.nn.parallelize(dense_model)."
        )
    start = [r for r in leaf_errors(as_dense, dense_model, 0.0, 1e-30) if not r[2]]
    if start:
        raise ValueError(
            f"check_parallel_parity: the two models start from different parameters ({len(start)} "
            f"arrays differ, first {start[0][0]}); parallelize the dense model itself."
        )
    # The dense side: one device, the same axis names (all of size 1) so collectives in the
    # loss (vocab_parallel_cross_entropy) run as the identity they are there.
    one = make_mesh("auto", jax.devices()[:1], **dict.fromkeys(mesh.axis_names, 1))
    P = jax.sharding.PartitionSpec
    dense_key = None if key is None else jax.random.fold_in(key, 0)

    def dense_loss(model, batch):
        per_device = filter_shard_map(
            lambda m, b, k: loss_fn(m, b, k), mesh=one, in_specs=(P(), P(), P()), out_specs=P()
        )
        return per_device(model, batch, dense_key)

    @eqx.filter_jit
    def dense_step(model, opt_state, batch):
        loss, grads = eqx.filter_value_and_grad(dense_loss)(model, batch)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, loss, grads

    device = jax.devices()[0]

    def put(tree):
        return jax.tree.map(lambda x: jax.device_put(x, device) if eqx.is_array(x) else x, tree)

    model = put(_copy(dense_model))
    local_batch = put(gather(batch))
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    dense_losses = []
    for i in range(steps):
        model, opt_state, loss, grads = dense_step(model, opt_state, local_batch)
        dense_losses.append(float(loss))
        if i == 0:
            dense_grads = grads
    dense_after = model

    # The parallel side: the step, with the optimizer wrapped to keep the gradient it was
    # given in its state, so the gradients come out of the very same step.
    def keep_update(updates, state: Any, params=None):
        return _keep(updates, optimizer.update(updates, state[1], params))

    keeping = optax.GradientTransformation(
        lambda params: (jax.tree.map(jnp.zeros_like, params), optimizer.init(params)),
        keep_update,
    )
    if param_specs is None and strategy != "fsdp":  # fsdp_step's own default adds the fsdp split
        param_specs = partition_specs(parallel_model, mesh)
    build = {"fsdp": fsdp_step, "hybrid": hybrid_step, "data": data_parallel_step}[strategy]
    options = {} if units is None else {"units": units}
    step = build(
        loss_fn, keeping, mesh, param_specs=param_specs, batch_axis=batch_axis, expert_axis=expert_axis, **options
    )
    placed = shard_batch(batch, mesh, batch_axis=step.batch_axis)  # with an expert axis, split over it too
    model, opt_state = step.init(_copy(parallel_model))
    losses = []
    for i in range(steps):
        model, opt_state, metrics = step(model, opt_state, placed, key)
        losses.append(float(metrics["loss"]))
        if i == 0:
            grads, grad_norm = _copy(opt_state[0]), float(metrics["grad_norm"])

    def dense_form(tree, like):  # a gradient tree, completed with `like`'s other leaves, made dense
        filled = eqx.combine(tree, eqx.filter(like, eqx.is_inexact_array, inverse=True))
        return eqx.filter(to_dense(filled), eqx.is_inexact_array)

    def dense_arrays(tree, like):
        return eqx.filter(eqx.combine(tree, eqx.filter(like, eqx.is_inexact_array, inverse=True)), eqx.is_inexact_array)

    dense_norm = float(np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64))) for g in jax.tree.leaves(dense_grads))))
    scalars = {f"loss at step {i}": (a, e) for i, (a, e) in enumerate(zip(losses, dense_losses))}
    scalars["grad norm"] = (grad_norm, dense_norm)
    sections = {
        "loss": [
            (what, *leaf_errors([np.float32(a)], [np.float32(e)], rtol, atol)[0][1:])
            for what, (a, e) in scalars.items()
        ],
        "gradients": leaf_errors(dense_form(grads, parallel_model), dense_arrays(dense_grads, dense_model), rtol, atol),
        "parameters": leaf_errors(
            eqx.filter(to_dense(gather(model)), eqx.is_inexact_array),
            eqx.filter(dense_after, eqx.is_inexact_array),
            rtol,
            atol,
        ),
    }
    failures = [
        f"  {what} {path}: {detail}" for what, rows in sections.items() for path, _, ok, detail in rows if not ok
    ]
    if any(not ok for *_, ok, _ in sections["parameters"]) and all(ok for *_, ok, _ in sections["gradients"]):
        failures.append(
            "  (the gradients agree: parameters that still differ usually have gradients that are "
            "~0 up to rounding, which an adaptive optimizer such as Adam scales to a full-size "
            "step. Check with optax.sgd to compare the parameters as tightly as the gradients.)"
        )
    if failures:
        raise AssertionError(
            f"check_parallel_parity: the parallel model on mesh {dict(mesh.shape)} differs from the "
            f"dense model on one device (rtol={rtol}, atol={atol}) in {len(failures)} place(s):\n"
            + "\n".join(failures[:40])
            + ("\n  ..." if len(failures) > 40 else "")
        )
    worst = {
        what: max(((used, path) for path, used, _, _ in rows), default=(0.0, "")) for what, rows in sections.items()
    }
    return ParityReport(tuple(losses), tuple(dense_losses), grad_norm, dense_norm, worst, len(sections["parameters"]))
