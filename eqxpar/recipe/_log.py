"""A training run's records (`--log-dir`): per-step metrics as JSON lines, TensorBoard events,
and the resolved config, plus periodic held-out evaluation (`--eval-every`). The training
loop stays asynchronous: the steps' metrics stay on the device and come to the host
together, every `--log-every` steps."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from .._optional import require
from ..inspect import mfu
from ._output import Throughput, is_main_process, progress

__all__ = ["LogFlags", "RunLog", "check_log_flags"]

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"


@dataclasses.dataclass
class LogFlags:
    """The run-record flags of every training recipe: derive the recipe's `Config` from it.

    - `--log-dir DIR`: write `DIR/metrics.jsonl` (one JSON object per logged step),
      TensorBoard events (`tensorboard --logdir DIR`) and `DIR/config.json` (the resolved
      flags). Default: no records.
    - `--log-every N`: log the training metrics of every `N`-th step, and of the first and
      last (default 10). The loop waits for the device only then (and at evaluations,
      checkpoints and the end): in between the host runs up to `N` steps ahead, so
      `--watchdog-s` must exceed `N` steps' time.

    [`eqxpar.recipe.RunLog.from_config`][] reads them.
    """

    # The comments are the flags' --help text (eqxpar.recipe.parse_flags reads them).
    log_dir: str | None = None  # write metrics.jsonl, TensorBoard events and config.json in this folder
    log_every: int = 10  # log the training metrics every N steps (and the first and last step)


def check_log_flags(cfg: Any) -> None:
    """`ValueError` for `--log-every` below 1 or `--eval-every` below 0, `MissingDependency`
    for `--log-dir` without tensorboardX (`parse_flags` calls it for every config derived from
    [`eqxpar.recipe.LogFlags`][])."""
    if cfg.log_every < 1:
        raise ValueError(f"--log-every must be at least 1, got {cfg.log_every}.")
    if getattr(cfg, "eval_every", 0) < 0:
        raise ValueError(f"--eval-every must be at least 0 (0: no evaluation during training), got {cfg.eval_every}.")
    if cfg.log_dir is not None:  # before anything compiles: one line naming the install
        require("tensorboardX", package="tensorboardX", extra="recipes", purpose="--log-dir", load=False)


def _plain(value: Any) -> Any:
    """A device or NumPy scalar as a Python number (this waits for it); others as they are."""
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else value
    return value


class RunLog:
    """A training run's records in a folder, written by process 0.

    ```python
    log = eqxpar.recipe.RunLog.from_config(cfg, items_per_step=cfg.batch_size * cfg.context, losses=[])
    for i in log.progress(range(first_step, cfg.steps)):
        model, opt_state, metrics = step(model, opt_state, batch(i))
        log.step(i, metrics)  # kept on the device; fetched together every --log-every steps
        log.maybe_eval(i, val_loss=functools.partial(evaluate, model, held_out))  # every --eval-every steps
        ckpt.maybe_save(i + 1, (model, opt_state), data_state=log.data_state)  # called when it saves
    log.close()  # fetches what is left
    log.losses, log.per_second  # every step's loss, and the items per second
    ```

    `step` does not wait for the device: it keeps the step's metrics (device scalars) and
    fetches those of all the steps since the last fetch in one `jax.device_get` on logged
    steps, on the loop's first step (which starts the clock) and in `flush` (evaluations,
    `data_state`, `close`). `fetches` counts those waits.

    Step numbers are steps done: the loop's step `i` is logged as `i + 1`, as checkpoints count.
    `metrics.jsonl` has one object per logged step: `step`, `time_s` (since the log began),
    the step's metrics (`loss`, `grad_norm`, ...), `learning_rate` (when known),
    `<items>_per_second` over the steps since the previous logged step, and `mfu` (when
    the FLOPs per item and the devices' peak are known; `None` on CPU); evaluations add
    objects with `step` and their metrics (`val_loss`). TensorBoard gets the same values as
    scalars `train/<name>` and `eval/<name>`, and the config as text.

    **Arguments:**

    - `log_dir`: the folder (created), or `None`: nothing is written, evaluations still run
      and are printed.
    - `config`: the resolved config (a dataclass), written as `config.json`.
    - `every`: log every `every`-th step, and the first and the last (`total_steps`).
    - `total_steps`: the run's length, to log its last step.
    - `items_per_step`, `items`: what one step trains (`batch_size * context` tokens) and its
      name, for the rate.
    - `learning_rate`: a number, or an optax schedule (a function of the step).
    - `flops_per_item`, `n_devices`, `dtype`: for the MFU ([`eqxpar.inspect.mfu`][]).
    - `eval_every`: evaluate every `eval_every` steps (`maybe_eval`); 0: never.
    - `losses`: the losses of the steps before (restored from a checkpoint's `data_state`);
      each step's `loss` is appended to it as it is fetched.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike | None,
        config: Any = None,
        *,
        every: int = 10,
        total_steps: int | None = None,
        items_per_step: int | None = None,
        items: str = "tokens",
        learning_rate: float | Callable[[int], Any] | None = None,
        flops_per_item: float | None = None,
        n_devices: int | None = None,
        dtype: Any = "float32",
        eval_every: int = 0,
        losses: list[float] | None = None,
    ):
        for name, value, least in (("every", every, 1), ("eval_every", eval_every, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"RunLog: {name} must be an integer of at least {least}, got {value!r}.")
        self.every, self.total_steps, self.eval_every = every, total_steps, eval_every
        self.items_per_step, self.items = items_per_step, items
        self.learning_rate, self.flops_per_item, self.dtype = learning_rate, flops_per_item, dtype
        self.n_devices = n_devices
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self.evals: list[dict[str, Any]] = []  # every evaluation: {"step": ..., "val_loss": ...}
        self._writes = self.log_dir is not None and is_main_process()
        self._start = time.perf_counter()
        self._last: tuple[int, float] | None = None  # (step, time) of the previous logged step
        self._jsonl = self._board = None
        self.losses: list[float] = [] if losses is None else list(losses)
        self.fetches = 0  # how often the loop waited for the device (one jax.device_get each)
        self._pending: list[tuple[int, Mapping[str, Any]]] = []  # steps not yet fetched
        self._throughput = Throughput(items_per_step or 1)
        self._bar: Any = None
        if self.log_dir is not None:
            tbx = require("tensorboardX", package="tensorboardX", extra="recipes", purpose="--log-dir")
            if self._writes:
                os.makedirs(self.log_dir, exist_ok=True)
                if config is not None:
                    with open(os.path.join(self.log_dir, CONFIG_FILE), "w") as f:
                        json.dump(_as_dict(config), f, indent=2, default=str)
                        f.write("\n")
                self._jsonl = open(os.path.join(self.log_dir, METRICS_FILE), "a")  # a resumed run appends
                self._board = tbx.SummaryWriter(logdir=self.log_dir, flush_secs=30)
                if config is not None:
                    text = json.dumps(_as_dict(config), indent=2, default=str)
                    self._board.add_text("config", f"```\n{text}\n```", 0)

    @classmethod
    def from_config(cls, cfg: Any, **kwargs: Any) -> RunLog:
        """The `RunLog` of a recipe from its flags ([`eqxpar.recipe.LogFlags`][]): `--log-dir`,
        `--log-every`, and where the config has them `--eval-every`, `--steps`,
        `--learning-rate` and `--dtype`; `kwargs` as for `RunLog` (they win, `log_dir` too)."""
        settings = dict(
            log_dir=cfg.log_dir,
            config=cfg,
            every=cfg.log_every,
            total_steps=getattr(cfg, "steps", None),
            learning_rate=getattr(cfg, "learning_rate", None),
            dtype=getattr(cfg, "dtype", "float32"),
            eval_every=getattr(cfg, "eval_every", 0),
        )
        return cls(**{**settings, **kwargs})

    def due(self, i: int) -> bool:
        """Whether the loop's step `i` is logged: the first, every `every`-th, the last."""
        done = i + 1
        return done == 1 or done % self.every == 0 or done == self.total_steps

    def progress(self, steps: range, *, desc: str = "train"):
        """[`eqxpar.recipe.progress`][] over the loop's `steps`; each fetch shows the newest
        loss and the items per second on it."""
        self._bar = progress(steps, desc=desc)
        return self._bar

    def step(self, i: int, metrics: Mapping[str, Any]) -> None:
        """Record the loop's step `i`: its metrics (device scalars) are kept, not waited for.

        On the loop's first step and on logged steps it fetches them with those of the
        steps before (`flush`); on the others it returns at once: the loop stays asynchronous.
        """
        self._pending.append((i, metrics))
        if self.due(i) or not self.fetches:
            self.flush()

    def flush(self) -> None:
        """Fetch the metrics of every step not yet fetched in one `jax.device_get` (this waits
        for the newest of them), append their losses to `losses`, write the rows of the
        logged steps among them, and show the newest loss on the progress bar."""
        if not self._pending:
            return
        fetched = jax.device_get([metrics for _, metrics in self._pending])
        self.fetches += 1
        self._throughput.tick(len(fetched))
        now = time.perf_counter()  # after the fetch: the steps have finished
        for (i, _), metrics in zip(self._pending, fetched):
            if "loss" in metrics:
                self.losses.append(float(metrics["loss"]))
            if self._writes and self.due(i):
                self._row(i, metrics, now)
        self._pending = []
        if self._bar is not None and self.losses:
            name = "tok_s" if self.items == "tokens" else f"{self.items}_s"
            rate = {} if math.isnan(self.per_second) else {name: f"{self.per_second:,.0f}"}
            self._bar.set_postfix(loss=f"{self.losses[-1]:.4f}", **rate)

    def data_state(self) -> dict[str, list[float]]:
        """`{"losses": [...]}`, every step's loss so far (fetched first): pass the method
        itself as `Checkpointer.maybe_save`'s `data_state`, which calls it only when it saves."""
        self.flush()
        return {"losses": list(self.losses)}

    @property
    def per_second(self) -> float:
        """Items per second from the end of the loop's first step to the last fetch
        ([`eqxpar.recipe.Throughput`][]; NaN before a second step)."""
        return self._throughput.per_second

    def _row(self, i: int, metrics: Mapping[str, Any], now: float) -> None:
        row: dict[str, Any] = {"step": i + 1}
        row.update({name: _plain(value) for name, value in metrics.items()})
        row["time_s"] = now - self._start
        if self.learning_rate is not None:
            lr = self.learning_rate(i) if callable(self.learning_rate) else self.learning_rate
            row["learning_rate"] = _plain(jax.device_get(lr)) if callable(self.learning_rate) else float(lr)
        if self.items_per_step is not None:
            rate = None
            if self._last is not None and i + 1 > self._last[0] and now > self._last[1]:
                rate = self.items_per_step * (i + 1 - self._last[0]) / (now - self._last[1])
            row[f"{self.items}_per_second"] = rate
            if self.flops_per_item is not None and self.n_devices is not None:
                row["mfu"] = (
                    None
                    if rate is None
                    else mfu(rate, self.flops_per_item, self.n_devices, jax.devices()[0], jnp.dtype(self.dtype))
                )
        self._last = (i + 1, now)
        self._write(row, "train")

    def maybe_eval(self, i: int, **evaluations: Callable[[], Any]) -> dict[str, Any] | None:
        """After the loop's step `i`, every `eval_every` steps: call each of `evaluations`
        (e.g. `val_loss=functools.partial(evaluate, model, held_out)`), record and print the
        results, and return them (`None` when no evaluation is due). Every process calls it
        (an evaluation may be a collective); process 0 prints and writes."""
        if not self.eval_every or (i + 1) % self.eval_every:
            return None
        self.flush()  # the evaluation waits for step i anyway
        row = {"step": i + 1, **{name: _plain(evaluate()) for name, evaluate in evaluations.items()}}
        self.evals.append(row)
        if self._last is not None:  # the next rate leaves out the evaluation's time
            self._last = (i + 1, time.perf_counter())
        if is_main_process():
            from tqdm.auto import tqdm  # as eqxpar.recipe.progress: tqdm loads with the first bar

            shown = ", ".join(
                f"{name} {value:.4f}" if isinstance(value, float) else f"{name} {value}"
                for name, value in row.items()
                if name != "step"
            )
            tqdm.write(f"step {i + 1}: {shown}")
        if self._writes:
            self._write(row, "eval")
        return row

    def _write(self, row: dict[str, Any], group: str) -> None:
        assert self._jsonl is not None and self._board is not None
        self._jsonl.write(json.dumps(row, default=str) + "\n")
        self._jsonl.flush()
        for name, value in row.items():
            if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._board.add_scalar(f"{group}/{name}", value, row["step"])

    def close(self) -> None:
        """Fetch the steps not yet fetched, then flush and close the files (also safe to call
        twice)."""
        self._bar = None  # the loop has ended, and its bar with it
        self.flush()
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._board is not None:
            self._board.close()
            self._board = None


def _as_dict(config: Any) -> Any:
    return dataclasses.asdict(config) if dataclasses.is_dataclass(config) and not isinstance(config, type) else config
