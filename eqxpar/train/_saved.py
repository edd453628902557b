"""What a step's backward pass keeps from its forward pass, measured from JAX's autodiff.

Reverse-mode autodiff runs the forward pass, keeps some of its values (the *residuals*:
matmul inputs, softmax outputs, layer-norm statistics, or, under `jax.checkpoint`, only
what the policy saves), and reads them in the backward pass. Those values are the step's
activation memory. JAX's `jax.vjp` returns the backward pass as a function that holds them:
traced inside the per-device program, its array leaves are the residuals with this
device's shapes. Counting them (once each; not the parameters, batch or key it was given,
which the step holds anyway, and not constants baked into the program) gives the bytes one
device keeps between the forward and the backward pass of one micro-batch, before XLA's
buffer assignment (which may fuse cheap elementwise residuals away, and adds its own
scratch, gradients and optimizer temporaries: see `MemoryReport.temporaries`).

Measuring only traces (nothing compiles or runs): [`TrainStep.saved_activation_bytes`]
[eqxpar.train.TrainStep.saved_activation_bytes] switches the recording on and traces the
step; the per-device gradient code reports what it saw.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.core

_RECORD: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("eqxpar_saved_activations", default=None)


@contextlib.contextmanager
def recording_saved_activations() -> Iterator[list[int]]:
    """While open, every traced per-device gradient appends its saved bytes to the list."""
    recorded: list[int] = []
    token = _RECORD.set(recorded)
    try:
        yield recorded
    finally:
        _RECORD.reset(token)


def record_saved_activations(fn: Callable, primals: Any, held: Any) -> None:
    """If a recording is open: trace `jax.vjp(fn, primals, has_aux=True)` and append the
    bytes of the arrays its backward pass keeps (tracers, each once, other than the leaves
    of `primals` and of `held`, the inputs the step holds anyway). Otherwise nothing.

    The extra trace is never compiled: a recording runs under `jax.eval_shape` only."""
    record = _RECORD.get()
    if record is None:
        return
    _, backward, _ = jax.vjp(fn, primals, has_aux=True)
    leaves = jax.tree.leaves(backward)
    if leaves == [backward]:  # not a pytree: its residuals are out of sight
        raise ValueError(
            f"saved_activation_bytes: this JAX ({jax.__version__}) returns the backward pass of "
            f"jax.vjp as a {type(backward).__name__} that is not a pytree of its residuals, so "
            f"they cannot be counted here."
        )
    inputs = {id(x) for x in jax.tree.leaves((primals, held))}
    residuals = {id(x): x for x in leaves if isinstance(x, jax.core.Tracer) and id(x) not in inputs}
    record.append(sum(x.size * x.dtype.itemsize for x in residuals.values()))
