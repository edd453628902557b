"""`eqxpar.plan.validate`: build and compile plans on the devices at hand, and put every
prediction beside the compiled program's figure."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from ..inspect import CommComparison, CommReport, MemoryReport
from ._plan import Plan

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Validation:
    """A plan's predictions beside the compiled step's figures, per device.

    - `plan`: the [`eqxpar.plan.Plan`][].
    - `comm`: the compiled collectives beside the predicted ones, an
      [`eqxpar.inspect.CommComparison`][] (one row per kind and axes).
    - `memory`: the compiled step's [`eqxpar.inspect.MemoryReport`][] (parameters and
      optimizer state from the placed arrays' shardings, XLA's memory analysis, and the
      saved activations from [`eqxpar.train.TrainStep.saved_activation_bytes`][]).
    """

    plan: Plan
    comm: CommComparison
    memory: MemoryReport

    @property
    def comm_exact(self) -> bool:
        """Every (kind, axes) row of the compiled program equals the prediction."""
        return all(row.compiled == row.theory for row in self.comm.rows)

    @property
    def state_exact(self) -> bool:
        """Parameters and optimizer state equal the prediction."""
        m = self.plan.memory
        return (m.parameters, m.optimizer_state) == (self.memory.parameters, self.memory.optimizer_state)

    @property
    def saved_ratio(self) -> float | None:
        """Measured / predicted saved activations (None for a pipeline: its step keeps a set
        per micro-batch in flight, which `TrainStep.saved_activation_bytes` does not measure)."""
        if self.memory.saved_activations is None:
            return None
        return self.memory.saved_activations / self.plan.memory.saved_activations

    @property
    def peak_ratio(self) -> float:
        """Compiled peak (`MemoryReport.peak`) / predicted peak."""
        return self.memory.peak / self.plan.memory.peak

    def row(self) -> tuple[str, ...]:
        m = self.plan.memory
        return (
            str(self.plan.layout),
            "exact" if self.comm_exact else f"{self.comm.ratio():.3f}",
            "exact" if self.state_exact else "differs",
            f"{m.saved_activations:,} / {_count(self.memory.saved_activations)}",
            f"{m.peak:,} / {self.memory.peak:,} ({self.peak_ratio:.2f})",
        )

    def __str__(self) -> str:
        return "  ".join(self.row())


def _count(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def validation_table(validations: Sequence[Validation]) -> str:
    """Validations as a text table: layout, collective bytes (exact, or compiled / predicted),
    parameters + optimizer state, saved activations and peak (predicted / compiled)."""
    head = ("layout", "collectives", "params+opt", "saved B (pred / compiled)", "peak B (pred / compiled)")
    rows = [head] + [v.row() for v in validations]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "-" * max(len(line) for line in lines))
    return "\n".join(lines)


def validate(plans: Sequence[Plan], *, devices: Sequence[Any] | None = None, seed: int = 0) -> list[Validation]:
    """Build each plan's mesh, GPT and step on `devices`, compile it, and read what it does.

    Nothing runs: each step is lowered and compiled for a random batch of token ids, its
    collectives read with [`eqxpar.inspect.CommReport`][], its memory with
    [`eqxpar.inspect.MemoryReport`][] and `TrainStep.saved_activation_bytes`.

    **Arguments:**

    - `plans`: plans from [`eqxpar.plan.plan`][] (for as many devices as there are).
    - `devices`: the devices to lay each mesh over (default `jax.devices()`).
    - `seed`: seeds the weights and the token ids.

    **Returns:**

    A list of [`eqxpar.plan.Validation`][]s, one per plan.

    **Raises:**

    - `ValueError` if a plan needs more devices than there are.
    """
    devices = list(jax.devices() if devices is None else devices)
    out = []
    for p in plans:
        if not isinstance(p, Plan):
            raise ValueError(f"validate: expected eqxpar.plan.Plan objects, got {type(p).__name__}.")
        need = p.layout.devices
        if need > len(devices):
            raise ValueError(
                f"validate: {p.layout} needs {need} devices, {len(devices)} are given; plan for "
                f"eqxpar.plan.Cluster(devices_per_host={len(devices)}, hosts=1, ...) or simulate more "
                f"(eqxpar.simulate_cpu_devices)."
            )
        mesh = p.mesh(devices)
        step = p.step(p.optimizer, mesh)
        model, opt_state = step.init(p.model(jax.random.key(seed)))
        tokens = np.random.default_rng(seed).integers(0, p.vocab_size, (p.batch_size, p.seq_len + 1), dtype=np.int32)
        batch = p.batch(tokens, mesh)
        lowered = step.lower(model, opt_state, batch)
        compiled = lowered.compile()
        comparison = CommReport.of(lowered, compiled).versus(p.comm)
        memory = MemoryReport.of(compiled, model, opt_state, batch)
        memory = dataclasses.replace(memory, saved_activations=step.saved_activation_bytes(model, opt_state, batch))
        out.append(Validation(p, comparison, memory))
    return out
