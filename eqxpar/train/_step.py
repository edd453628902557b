"""`TrainStep`: the compiled step every builder returns, and its checks on each call."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import PyTree

from .._sharding import shard
from .._specs import path_str
from ._checks_optimizer import check_optimizer_fits
from ._placement import optimizer_specs
from ._saved import recording_saved_activations


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Static:
    """Hashable data that rides through `jax.jit` untraced: a tree structure and the tree's
    non-array leaves (activation functions, strings, Python numbers)."""

    treedef: Any
    others: tuple


def _split_arrays(tree: PyTree) -> tuple[list, _Static]:
    """A tree's array leaves (None elsewhere) and everything else, for `jax.jit`."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    is_array = [eqx.is_array(x) for x in leaves]
    arrays = [x if a else None for x, a in zip(leaves, is_array)]
    return arrays, _Static(treedef, tuple(None if a else x for x, a in zip(leaves, is_array)))


def _join_arrays(arrays: list, static: _Static) -> PyTree:
    leaves = [other if array is None else array for array, other in zip(arrays, static.others)]
    return jax.tree_util.tree_unflatten(static.treedef, leaves)


def _is_key(key: Any) -> bool:
    if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key.shape == ()
    # A raw uint32[2] key, as jax.random.PRNGKey makes.
    return isinstance(key, (jax.Array, np.ndarray)) and key.dtype == np.uint32 and key.shape == (2,)


class TrainStep:
    """A compiled train step, returned by every step builder; call it like a function.

    `step(model, opt_state, batch, key=None) -> (model, opt_state, metrics)` (with
    `has_state=True`: `step(model, state, opt_state, batch, key=None) -> (model, state,
    opt_state, metrics)`). `metrics` holds `"loss"` (the global-batch mean loss before the
    update) and `"grad_norm"` (the global gradient norm, as one device would compute it).
    The first call traces and compiles; later calls with arrays of the same shapes, dtypes
    and shardings (and the same non-array leaves) reuse that compilation. The buffers of
    the model, state and optimizer state passed in are donated: use the returned ones.
    Like `jax.jit`, a call returns before the computation finishes.

    `step.init(model)` (`step.init(model, state)` with state) makes the optimizer state and
    places everything where the step wants it. `step.lower(...)` takes the step's arguments
    and returns the `jax.stages.Lowered` computation (`.compile().as_text()` is the
    per-device HLO, with its collectives).

    `step.saved_activation_bytes(...)` takes the step's arguments and returns the bytes one
    device keeps from the forward pass for the backward pass (traced, not compiled).

    Attributes: `mesh`, `batch_axis`, `grad_accum`, `has_state`, as given to the builder
    (with `expert_axis=`, `batch_axis` is the tuple of the batch axes and the expert axis:
    the axes the batch is split over, for [`eqxpar.train.shard_batch`][]).
    """

    # Only on the steps pipeline_step returns (declared, not set: hasattr stays False elsewhere).
    schedule: Any
    stage_axis: str

    def __init__(
        self,
        fn: Callable,
        *,
        who: str,
        optimizer: Any,
        specs_for: Callable[[PyTree], PyTree],
        mesh: Mesh,
        batch_axis: Any,
        grad_accum: int,
        has_state: bool,
    ):
        # `fn(batch_and_key, model, state, opt_state) -> (model, state, opt_state, metrics)`.
        # Equinox Modules hold non-array leaves, which jax.jit cannot take; this splits them
        # off as a static argument (what eqx.filter_jit does, with a fraction of its
        # per-call overhead, which matters for small, dispatch-bound steps).
        def flat_fn(donated, kept, static):
            donated_static, kept_static = static
            out = fn(_join_arrays(kept, kept_static), *_join_arrays(donated, donated_static))
            return _split_arrays(out)

        self._flat_fn = flat_fn
        self._jitted = jax.jit(flat_fn, static_argnums=2, donate_argnums=0)
        self._who = who
        self._optimizer = optimizer
        self._specs_for = specs_for
        self._opt_structures: dict[Any, Any] = {}
        self.mesh = mesh
        self.batch_axis = batch_axis
        self.grad_accum = grad_accum
        self.has_state = has_state

    def init(self, model: PyTree, state: PyTree = None) -> tuple:
        """The model and a fresh optimizer state, placed on the mesh for this step.

        **Arguments:**

        - `model`: the model in global form (full-size arrays, anywhere).
        - `state`: with `has_state=True`, the model's `eqx.nn.State`.

        **Returns:**

        `(model, opt_state)`, or `(model, state, opt_state)` with `has_state=True`: the
        model split as the step's `param_specs` say, the optimizer state
        (`optimizer.init` of the model's floating-point arrays, made on the mesh, never
        whole on one device) split like the parameters it belongs to, the state copied.
        """
        specs = self._specs_for(model)
        check_optimizer_fits(self._who, self._optimizer, model)  # before anything is placed or compiled
        model = shard(model, self.mesh, specs)
        params = eqx.filter(model, eqx.is_inexact_array)
        abstract = jax.eval_shape(self._optimizer.init, params)
        opt_specs = optimizer_specs(self._optimizer, abstract, model, specs)
        shardings = jax.tree.map(
            lambda s: jax.sharding.NamedSharding(self.mesh, s),
            opt_specs,
            is_leaf=lambda x: isinstance(x, PartitionSpec),
        )
        opt_state = jax.jit(self._optimizer.init, out_shardings=shardings)(params)
        if self.has_state:
            return model, shard(state, self.mesh, PartitionSpec()), opt_state
        return model, opt_state

    def _arguments(self, args: tuple, kwargs: dict) -> tuple:
        names = (
            ("model", "state", "opt_state", "batch", "key")
            if self.has_state
            else ("model", "opt_state", "batch", "key")
        )
        sig = ", ".join(names)
        unknown = set(kwargs) - set(names)
        if unknown or len(args) > len(names):
            raise ValueError(
                f"{self._who}: the step is called as step({sig}); "
                f"got {len(args)} positional arguments and keywords {sorted(kwargs)}."
            )
        bound = dict(zip(names, args))
        for name, value in kwargs.items():
            if name in bound:
                raise ValueError(f"{self._who}: step() got {name!r} twice.")
            bound[name] = value
        bound.setdefault("key", None)
        missing = [n for n in names if n not in bound]
        if missing:
            raise ValueError(f"{self._who}: the step is called as step({sig}); {', '.join(missing)} missing.")
        return tuple(bound.get(n) for n in ("model", "state", "opt_state", "batch", "key"))

    def _check(self, model, opt_state, key, donated: list) -> bool:
        """Mistakes a user makes at the call, caught before anything is traced. Cheap on the
        common path (a cached structure comparison and one pass over the donated leaves);
        the messages are worked out only when something is wrong."""
        if key is not None and not _is_key(key):
            raise ValueError(
                f"{self._who}: key must be a PRNG key such as jax.random.key(seed), or None; "
                f"got {type(key).__name__} {key!r:.40}. If that was a seed, pass "
                f"jax.random.key({key!r:.20})."
            )
        model_def = jax.tree.structure(model)
        want = self._opt_structures.get(model_def)
        if want is None:
            want = jax.tree.structure(jax.eval_shape(self._optimizer.init, eqx.filter(model, eqx.is_inexact_array)))
            self._opt_structures[model_def] = want
        if jax.tree.structure(opt_state) != want:
            swapped = jax.tree.structure(model) == want
            raise ValueError(
                f"{self._who}: opt_state does not have the structure optimizer.init gives for this "
                f"model{' (model and opt_state look swapped)' if swapped else ''}. The step is "
                f"called as step(model, {'state, ' if self.has_state else ''}opt_state, batch, key), "
                f"with opt_state from step.init(model) or optimizer.init(eqx.filter(model, eqx.is_inexact_array))."
            )
        # Whether a donated leaf is already gone (named by _name_deleted).
        return any(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted() for x in donated)

    def _name_deleted(self, trees: tuple) -> None:
        for what, tree in zip(("model", "state", "opt_state"), trees):
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
                if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer) and leaf.is_deleted():
                    raise ValueError(
                        f"{self._who}: {what} leaf {path_str(path)} was donated to an earlier call "
                        f"of this step, and its buffer is gone. The step donates the model, state "
                        f"and optimizer state it is given: keep the ones it returns, e.g. "
                        f"`model, opt_state, metrics = step(model, opt_state, batch)`."
                    )

    def _flatten(self, args: tuple, kwargs: dict) -> tuple:
        model, state, opt_state, batch, key = self._arguments(args, kwargs)
        # Donated: what the step replaces. Kept: the batch and the key.
        donated, donated_static = _split_arrays((model, state, opt_state))
        if self._check(model, opt_state, key, donated):
            self._name_deleted((model, state, opt_state))
        kept, kept_static = _split_arrays((batch, key))
        return donated, kept, (donated_static, kept_static)

    def __call__(self, *args: Any, **kwargs: Any) -> tuple:
        model, state, opt_state, metrics = _join_arrays(*self._jitted(*self._flatten(args, kwargs)))
        if self.has_state:
            return model, state, opt_state, metrics
        return model, opt_state, metrics

    def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """The lowered step for these arguments (see the class docstring)."""
        return self._jitted.lower(*self._flatten(args, kwargs))

    def saved_activation_bytes(self, *args: Any, **kwargs: Any) -> int | None:
        """The bytes one device keeps from the forward pass for the backward pass of one
        micro-batch: the residuals of JAX's autodiff of the per-device loss (activations
        such as matmul inputs and softmax outputs; under remat only what the policy saves;
        under FSDP without remat also the gathered weights the backward pass reads: e.g.
        an MLP's second layer's, for its input gradient), counted once each, without
        the parameters, batch and key the step holds anyway. Only traces the step: nothing
        compiles or runs, and nothing is donated.

        This is the figure an activation-memory theory (e.g.
        [`eqxpar.models.gpt_activation_theory`][]) predicts. XLA's temporaries
        ([`eqxpar.inspect.memory_report`][]) differ: XLA may fuse cheap elementwise
        residuals away, and adds the gradients, optimizer temporaries and scratch.

        **Arguments:**

        The step's arguments, as in a call: `model, opt_state, batch, key=None`.

        **Returns:**

        Bytes per device (per micro-batch with `grad_accum > 1`), or `None` for a step with
        no one backward pass to measure (the pipeline step, whose schedule keeps a set per
        micro-batch in flight).

        **Raises:**

        - `ValueError` for the argument mistakes a call would raise for.
        """
        donated, kept, static = self._flatten(args, kwargs)
        with recording_saved_activations() as record:
            jax.eval_shape(lambda d, k: self._flat_fn(d, k, static), donated, kept)
        return max(record) if record else None
