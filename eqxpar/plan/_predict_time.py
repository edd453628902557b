"""The FLOPs one device executes in a layout's step, and the step's roofline time from
them and from the collectives' seconds (`_predict_comm.py`; see `_predict.py`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ..inspect import CommTheory
from ._candidates import Layout
from ._cluster import Cluster
from ._experts import recomputed_expert_flops
from ._family import PlanModel, attention_shape, vocab_rows, width
from ._family import flops_per_token as model_flops_per_token
from ._predict_comm import collective_seconds, is_parameter_collective


def flops_per_device(gpt: PlanModel, layout: Layout, batch: int, seq: int) -> float:
    """The FLOPs one device executes in a step: the model FLOPs (`6 N + 12 L T d` per
    token, with the vocabulary padding the program multiplies) over the devices, plus what
    remat recomputes: the blocks' forward pass for `block`, the attention's forward
    (`4 L T d` per token) for `save_matmuls`, and with experts their routers' and routed
    experts' forward too (no remat policy names their einsums)."""
    devices = math.prod(layout.sizes.values())
    train, forward, attention_forward, head_forward = flops_per_token(gpt, seq)
    matmuls = attention_forward + recomputed_expert_flops(gpt)
    recompute = {"none": 0, "save_matmuls": matmuls, "block": forward - head_forward}[layout.remat]
    return (train + recompute) * batch * seq / devices


_FLOPS: dict[tuple, tuple[int, int, int, int]] = {}


def flops_per_token(gpt: PlanModel, seq: int) -> tuple[int, int, int, int]:
    """(training, forward, attention forward, head forward) FLOPs per token, once per shape
    (the count unstacks the layers, which is slow for a deep stacked GPT)."""
    shape = attention_shape(gpt)
    dim = width(gpt)
    vocab = vocab_rows(gpt)
    key = (type(gpt), vocab, dim, gpt.num_layers, shape, seq, gpt.moe, getattr(gpt, "config", None))
    if key not in _FLOPS:
        _FLOPS[key] = (
            model_flops_per_token(gpt, seq),
            model_flops_per_token(gpt, seq, backward=False),
            4 * gpt.num_layers * seq * shape.heads * shape.head_dim,
            2 * vocab * dim,
        )
    return _FLOPS[key]


@dataclasses.dataclass(frozen=True)
class StepTime:
    """A roofline step time in seconds.

    - `compute`: FLOPs / (peak x efficiency).
    - `activation_comm`: the collectives the next layer waits for (everything over `model`;
      the context-parallel attention's permutes, gathers and scatters over `context`), by
      ring bytes / bandwidth of the slowest link crossed + hops x latency.
    - `parameter_comm`: the gradient and parameter collectives (all-reduces over the batch
      axes, FSDP's gathers and scatters over `fsdp`), the same way.
    - `by_link`: communication seconds per link name.
    - `parameter_overlap`: the fraction of `parameter_comm` assumed hidden behind compute
      (the cluster's; 0 by default, see [`eqxpar.plan.Cluster`][]).
    - `bubble`: a pipeline's idle time, `compute x (P-1)/(r M)`: the schedule's ticks are
      `r M + P - 1` and each device works in `r M` of them, so the bubble is
      `(P-1)/(r M + P - 1)` of `compute + bubble` ([`eqxpar.train.bubble_theory`][]). 0
      without a stage axis.

    The bounds: `no_overlap` (everything in sequence) and `overlap` (the largest of compute
    with the bubble and each link's traffic, as if everything overlapped perfectly);
    `expected` (the ranking figure): compute, the bubble, the activation collectives, and
    the parameter collectives less the hidden fraction.
    """

    compute: float
    activation_comm: float
    parameter_comm: float
    by_link: dict[str, float]
    parameter_overlap: float = 0.0
    bubble: float = 0.0

    @property
    def no_overlap(self) -> float:
        return self.compute + self.bubble + self.activation_comm + self.parameter_comm

    @property
    def overlap(self) -> float:
        return max([self.compute + self.bubble, *self.by_link.values()])

    @property
    def expected(self) -> float:
        hidden = min(self.parameter_overlap * self.parameter_comm, self.compute)
        return self.compute + self.bubble + self.activation_comm + self.parameter_comm - hidden


def step_time(
    theory: CommTheory, flops: float, layout: Layout, cluster: Cluster, dtype: Any
) -> tuple[StepTime, list[tuple[float, str, tuple[str, ...], int, str]]]:
    """The roofline time of a step, and its collective classes by time (seconds, kind,
    axes, bytes, link name), slowest first."""
    sizes = layout.sizes
    compute = flops / (cluster.flops(dtype) * cluster.efficiency)
    classes = []
    for (kind, axes), nbytes in theory.traffic().items():
        link = cluster.link(axes, sizes)
        classes.append((collective_seconds(kind, axes, nbytes, sizes, link), kind, axes, nbytes, link.name))
    classes.sort(reverse=True)
    activation = sum(s for s, kind, axes, _, _ in classes if not is_parameter_collective(kind, axes))
    parameter = sum(s for s, kind, axes, _, _ in classes if is_parameter_collective(kind, axes))
    by_link: dict[str, float] = {}
    for s, _, _, _, name in classes:
        by_link[name] = by_link.get(name, 0.0) + s
    bubble = 0.0
    if layout.stage > 1:
        bubble = compute * (layout.stage - 1) / (layout.virtual_stages * layout.microbatches)
    return StepTime(compute, activation, parameter, by_link, cluster.parameter_overlap, bubble), classes
