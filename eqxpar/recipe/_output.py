"""What a recipe shows and keeps: process 0's progress bar, throughput, metrics JSON, and a
digest of the trained parameters."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import PyTree

from .._sharding import gather
from .._specs import path_str

__all__ = ["is_main_process", "progress", "steps_to_run", "Throughput", "write_metrics", "parameter_digest"]


def is_main_process() -> bool:
    """True in process 0 (and in every single-process run): the one that prints and writes."""
    return jax.process_index() == 0


def progress(iterable: Iterable, *, total: int | None = None, desc: str = "train", **kwargs):
    """A progress bar over `iterable`, shown by process 0 only.

    **Arguments:**

    - `iterable`: what to iterate over (usually `range(steps)`).
    - `total`: its length, if `len()` does not give it.
    - `desc`: the bar's label.
    - `**kwargs`: passed on to `tqdm.tqdm`.

    **Returns:**

    A `tqdm` iterator; call `.set_postfix(loss=...)` on it to show metrics. When stderr is
    not a terminal (CI, logs) it refreshes at most every few seconds.
    """
    from tqdm.auto import tqdm

    interactive = sys.stderr.isatty()
    kwargs.setdefault("mininterval", 0.1 if interactive else 5.0)
    kwargs.setdefault("dynamic_ncols", True)
    disable = kwargs.pop("disable", False) or not is_main_process()
    bar = tqdm(iterable, total=total, desc=desc, disable=disable, **kwargs)
    if not interactive:
        # In a log, `set_postfix` must not redraw the bar on every call: the new numbers
        # show at the next (throttled) refresh instead.
        set_postfix = bar.set_postfix

        def quiet_set_postfix(*args, refresh: bool | None = False, **kw) -> None:
            set_postfix(*args, refresh=refresh, **kw)

        bar.set_postfix = quiet_set_postfix
    return bar


def steps_to_run(first_step: int, steps: int) -> range:
    """The training loop's steps, `range(first_step, steps)`, saying so when there are none.

    A `--resume` of a run that already finished (its newest checkpoint at `--steps` or
    beyond) has nothing left to train: process 0 prints that, and the recipe goes on to
    report the restored run (its loss history, held-out loss, digest) instead of failing.

    **Arguments:**

    - `first_step`: where training starts: 0, or the step of the restored checkpoint.
    - `steps`: the run's length (`--steps`).

    **Returns:**

    `range(first_step, steps)`, empty when `first_step >= steps`.
    """
    if first_step >= steps and is_main_process():
        past = "at" if first_step == steps else "past"
        print(
            f"nothing left to do: the checkpoint is at step {first_step}, {past} --steps {steps}; "
            f"reporting the finished run (pass a larger --steps to train on)",
            flush=True,
        )
    return range(first_step, steps)


class Throughput:
    """Items (tokens, examples) per second over a training loop, leaving out its first step.

    The first step includes compiling; timing starts when it ends. Call `tick()` after each
    step has finished (e.g. after reading its loss, which waits for it), or `tick(n)` once
    for `n` steps fetched together ([`eqxpar.recipe.RunLog`][] does, every `--log-every` steps).

    **Arguments:**

    - `per_step`: items each step processes (e.g. `batch_size * context` tokens).
    """

    def __init__(self, per_step: int):
        self.per_step = per_step
        self._started: float | None = None
        self._last: float | None = None
        self._steps = 0

    def tick(self, steps: int = 1) -> None:
        """Count `steps` steps that have just finished; the first call starts the clock (its
        steps, the first of which compiled, are left out)."""
        self._last = time.perf_counter()
        if self._started is None:
            self._started = self._last
        else:
            self._steps += steps

    @property
    def per_second(self) -> float:
        """Items per second from the end of the first step to the end of the last one
        (NaN before a second step); what runs after the loop does not count."""
        if not self._steps:
            return float("nan")
        assert self._last is not None and self._started is not None  # set by the first step
        return self.per_step * self._steps / (self._last - self._started)


def write_metrics(path: str | os.PathLike | None, metrics: Mapping[str, Any]) -> None:
    """Write a recipe's results as JSON (process 0 only); does nothing when `path` is None.

    **Arguments:**

    - `path`: where to write, or `None`. Parent folders are created.
    - `metrics`: JSON-serialisable values; NumPy/JAX scalars are converted.

    **Returns:**

    Nothing.
    """
    if path is None or not is_main_process():
        return

    def plain(x):
        if hasattr(x, "item") and getattr(x, "ndim", 1) == 0:
            return x.item()
        if hasattr(x, "tolist"):
            return x.tolist()
        raise TypeError(f"cannot write {type(x)} to JSON")

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(dict(metrics), f, indent=2, default=plain)
        f.write("\n")
    os.replace(tmp, path)


def parameter_digest(tree: PyTree) -> str:
    """A SHA-256 digest of every array in `tree`: equal digests mean bitwise-equal arrays.

    Each array is gathered to the host first (whatever mesh or process holds it), so the
    digest depends on the values only, not on the layout. In a multi-process run every
    process must call it (gathering is a collective).

    **Arguments:**

    - `tree`: a PyTree, e.g. a model; non-array leaves are ignored, typed PRNG keys count
      by their key data.

    **Returns:**

    The hex digest: each array's path, dtype, shape and bytes, in tree order.
    """
    import hashlib

    import equinox as eqx
    import numpy as np

    def raw(x):
        if eqx.is_array(x) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.key_data(x)
        return x

    arrays = eqx.filter(jax.tree.map(raw, tree), eqx.is_array)
    digest = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(gather(arrays))[0]:
        if leaf is None:
            continue
        value = np.ascontiguousarray(leaf)
        digest.update(f"{path_str(path)} {value.dtype} {value.shape};".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()
