"""Pipeline schedules as tables: which micro-batch each stage works on at each tick.

The tables are plain NumPy; the pipeline step (`_pipeline.py`) executes them tick by tick,
the docs draw them, and the bubble fraction is counted from them (and checked against the
closed forms in the tests).

A *tick* is one step of the `jax.lax.scan` every device runs in lockstep. In a tick a stage
may run one forward of one chunk of layers (`F`) and/or one backward (`B`). Every device
runs the same program, so a tick costs the same on every stage: a forward slot costs one
unit (one chunk's forward) on every stage if any stage has a forward in that tick, a
backward slot likewise. The bubble is the share of that time a stage spends idle.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["SCHEDULES", "Schedule", "bubble_theory", "make_schedule", "stage_boundary_bytes"]

SCHEDULES = ("gpipe", "circular", "1f1b")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline schedule as tables of shape `(ticks, stages)`.

    - `forward[t, s]`: the micro-batch stage `s` runs forward at tick `t` (`-1`: none);
      `forward_chunk[t, s]`: which of the stage's `virtual_stages` chunks of layers it runs.
    - `backward[t, s]`, `backward_chunk[t, s]`: the same for the backward pass.
    - `phases`: `(kind, first_tick, ticks)` runs of ticks, `kind` one of `"forward"`,
      `"backward"`, `"both"`: the scans the step runs one after the other.

    Ticks are numbered across the whole step (forward phases first for GPipe, whose
    backward is autodiff's reverse of the forward scan).
    """

    name: str
    stages: int
    microbatches: int
    virtual_stages: int
    forward: np.ndarray
    forward_chunk: np.ndarray
    backward: np.ndarray
    backward_chunk: np.ndarray
    phases: tuple[tuple[str, int, int], ...]

    @property
    def ticks(self) -> int:
        return self.forward.shape[0]

    def bubble_fraction(self, backward_cost: float = 1.0) -> float:
        """The share of each stage's time spent idle, counted from the tables.

        **Arguments:**

        - `backward_cost`: the cost of one chunk's backward in units of its forward (the
          result does not depend on it for these schedules).

        **Returns:**

        `1 - busy / total` for stage 0 (every stage has the same busy time).
        """
        has_f = (self.forward >= 0).any(axis=1)
        has_b = (self.backward >= 0).any(axis=1)
        total = has_f.sum() + backward_cost * has_b.sum()
        busy = (self.forward[:, 0] >= 0).sum() + backward_cost * (self.backward[:, 0] >= 0).sum()
        return float(1.0 - busy / total)

    def max_in_flight(self) -> int:
        """The most micro-batch chunks any stage has run forward but not yet backward: how
        many stage inputs it must keep."""
        forward = np.cumsum(self.forward >= 0, axis=0)
        backward_before = np.cumsum(self.backward >= 0, axis=0) - (self.backward >= 0)
        return int((forward - backward_before).max(initial=0))  # after each tick's forward

    def text(self) -> str:
        """The table as text: one row per stage, one column per tick, `F3` for micro-batch
        3's forward, `B3` its backward, `F3.1` its forward through the stage's chunk 1."""
        cells = []
        for s in range(self.stages):
            row = []
            for t in range(self.ticks):
                parts = []
                for tag, mb, chunk in (
                    ("F", self.forward, self.forward_chunk),
                    ("B", self.backward, self.backward_chunk),
                ):
                    if mb[t, s] >= 0:
                        parts.append(f"{tag}{mb[t, s]}" + (f".{chunk[t, s]}" if self.virtual_stages > 1 else ""))
                row.append("+".join(parts) or ".")
            cells.append(row)
        width = max(len(c) for row in cells for c in row)
        return "\n".join(f"stage {s}: " + " ".join(c.rjust(width) for c in row) for s, row in enumerate(cells))


def bubble_theory(schedule: str, stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """The closed-form bubble: `(P-1)/(r*M+P-1)` (`r = 1` for GPipe and 1F1B)."""
    r = virtual_stages if schedule == "circular" else 1
    return (stages - 1) / (r * microbatches + stages - 1)


def stage_boundary_bytes(schedule: Schedule, activation_bytes: int) -> int:
    """The bytes each device sends over the stage axis in one step of `schedule`: one
    stage output per forward tick and one activation gradient per backward tick (GPipe and
    circular: autodiff's transposes of the forward ppermutes; 1F1B: its own), each
    `activation_bytes`. Every device sends in every tick, idle or not (one SPMD program), so
    the count is the schedule's ticks, not its micro-batches. Nothing with one stage.

    **Arguments:**

    - `schedule`: the [`eqxpar.train.Schedule`][] the step runs (`step.schedule`).
    - `activation_bytes`: one micro-batch's stage output on one device (for a GPT:
      `rows x seq x dim x itemsize`, rows = the batch / batch shards / micro-batches).

    **Returns:**

    Bytes per device per step, by `eqxpar.inspect`'s convention for collective-permutes
    (the array sent). This is what the program asks for (`CommReport`'s lowered figure);
    XLA may drop a send whose result is never read (see docs/concepts/planner.md).
    """
    if schedule.stages == 1:
        return 0
    forward = sum(n for kind, _, n in schedule.phases if kind in ("forward", "both"))
    backward = sum(n for kind, _, n in schedule.phases if kind in ("backward", "both"))
    return (forward + backward) * int(activation_bytes)


def _circular_forward(P: int, M: int, r: int) -> tuple[np.ndarray, np.ndarray]:
    # Micro-batches go round the ring in groups of P: device s at tick t works on k = t - s;
    # group k // (rP), pass (chunk) (k % rP) // P, micro-batch group*P + k % P.
    ticks = r * M + P - 1
    k = np.arange(ticks)[:, None] - np.arange(P)[None, :]
    valid = (k >= 0) & (k < r * M)
    group, within = np.divmod(np.where(valid, k, 0), r * P)
    mb = np.where(valid, group * P + within % P, -1)
    chunk = np.where(valid, within // P, -1)
    return mb, chunk


def make_schedule(schedule: str, stages: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The tables for one schedule.

    **Arguments:**

    - `schedule`: `"gpipe"` (all forwards, then all backwards), `"circular"` (each device
      holds `virtual_stages` chunks of layers, `P` apart; micro-batches go round the ring
      `virtual_stages` times) or `"1f1b"` (after `P - 1` forward-only ticks, each tick
      runs one forward and one backward).
    - `stages`: `P`, the size of the stage axis.
    - `microbatches`: `M`.
    - `virtual_stages`: `r`, chunks per device (circular only; 1 otherwise).

    **Returns:**

    A [`eqxpar.train.Schedule`][].

    **Raises:**

    - `ValueError` for an unknown schedule, non-positive sizes, `virtual_stages != 1`
      outside `"circular"`, or a circular schedule whose `microbatches` is not a multiple
      of `stages` (micro-batches go round in groups of `P`).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}.")
    for name, value in (("stages", stages), ("microbatches", microbatches), ("virtual_stages", virtual_stages)):
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    P, M, r = stages, microbatches, virtual_stages
    if schedule != "circular" and r != 1:
        raise ValueError(f"virtual_stages={r} needs schedule='circular'; {schedule!r} holds one chunk per device.")
    if schedule == "circular" and r > 1 and M % P:
        raise ValueError(
            f"the circular schedule sends micro-batches round the ring in groups of {P} (the stage "
            f"axis size): microbatches must be a multiple of {P}, got {M}."
        )
    if schedule in ("gpipe", "circular"):
        fwd, fchunk = _circular_forward(P, M, r)
        idle = np.full_like(fwd, -1)
        # Autodiff runs the forward scan backwards: tick t's backward mirrors tick T-1-t.
        forward = np.concatenate([fwd, idle])
        forward_chunk = np.concatenate([fchunk, idle])
        backward = np.concatenate([idle, fwd[::-1]])
        backward_chunk = np.concatenate([idle, fchunk[::-1]])
        T = fwd.shape[0]
        return Schedule(
            schedule, P, M, r, forward, forward_chunk, backward, backward_chunk, (("forward", 0, T), ("backward", T, T))
        )
    # 1F1B: forward of micro-batch i on stage s at tick i + s; the last stage runs its
    # backward in the same tick as its forward, and each gradient moves one stage up per
    # tick, so stage s runs micro-batch i's backward at tick i + 2(P-1) - s.
    ticks = M + 2 * (P - 1)
    forward = np.full((ticks, P), -1)
    backward = np.full((ticks, P), -1)
    i, s = np.meshgrid(np.arange(M), np.arange(P), indexing="ij")
    forward[i + s, s] = i
    backward[i + 2 * (P - 1) - s, s] = i
    zeros = np.where(forward >= 0, 0, -1), np.where(backward >= 0, 0, -1)
    phases = (("forward", 0, P - 1), ("both", P - 1, M), ("backward", M + P - 1, P - 1))
    return Schedule("1f1b", P, M, 1, forward, zeros[0], backward, zeros[1], tuple(p for p in phases if p[2] > 0))
