"""The layouts a plan chooses from: every factorisation of the devices into
`stage x data x fsdp x context x model`, times remat, sequence parallelism, the
context-parallel attention and (with `stage > 1`) the pipeline's schedule, micro-batches
and virtual stages, and the divisibility rules that rule some out."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

from ..nn import zigzag_order
from ..train import make_schedule
from ._abstract import AXES, EXPERT_AXES, abstract_mesh, abstract_model, experts_of
from ._family import PlanModel, activation_theory, tensor_parallel_theory

REMATS = ("none", "save_matmuls", "block")
"""The remat policies (the GPT's and the Llama's) a plan chooses from (`"offload"` is not modelled)."""
CONTEXT_ATTENTION = ("ring", "all_gather")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "circular")
"""The pipeline schedules a plan chooses from (see [`eqxpar.train.make_schedule`][])."""
VIRTUAL_STAGES = (2, 4)
"""The virtual stages (layer chunks per device) a circular plan chooses from."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to run a GPT or Llama step: axis sizes (`data` copies the model, `fsdp` splits
    parameters and optimizer state too, `context` splits every sequence, `model` splits
    the layers), the model's `remat` policy, Megatron `sequence_parallel` over the model axis,
    and `attention` (`"dot_product"` without a context axis; `"ring"` or `"all_gather"`
    with one).

    With `stage > 1` the layout is a pipeline ([`eqxpar.train.pipeline_step`][] with
    [`eqxpar.models.gpt_stages`][] or [`eqxpar.models.llama_stages`][]): the blocks split
    over `stage`, `schedule` one of `"gpipe"`, `"1f1b"`, `"circular"`, `microbatches` per
    batch shard, `virtual_stages` layer chunks per device (circular). `remat` is then the pipeline's: `"none"` keeps
    every tick's activations, `"block"` keeps only each tick's input and recomputes the
    stage (GPipe's `remat=True`; 1F1B always does).

    `expert` is None for a GPT without experts (no expert axis in the mesh); for a
    mixture-of-experts GPT (`plan(..., moe=...)`) the size of the `expert` axis (1
    included): the experts split over it, and the batch over `data x fsdp x expert`."""

    data: int
    fsdp: int
    context: int
    model: int
    remat: str
    sequence_parallel: bool
    attention: str
    stage: int = 1
    schedule: str = ""
    microbatches: int = 1
    virtual_stages: int = 1
    expert: int | None = None

    @property
    def sizes(self) -> dict[str, int]:
        """Axis name to size, for every axis (size-1 axes included), in mesh order
        (`EXPERT_AXES` with an expert axis)."""
        if self.expert is None:
            return {a: getattr(self, a) for a in AXES}
        return {a: getattr(self, a) for a in EXPERT_AXES}

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The axes the step splits the batch over: `data, fsdp`, and `expert` after them
        with an expert axis (the step builders' `expert_axis` adds it)."""
        return ("data", "fsdp") if self.expert is None else ("data", "fsdp", "expert")

    @property
    def batch_shards(self) -> int:
        return math.prod(self.sizes[a] for a in self.batch_axes)

    def mesh_text(self) -> str:
        """The axes of size above 1 as `data=2,model=4` (`"one device"` for none)."""
        used = [f"{a}={n}" for a, n in self.sizes.items() if n > 1]
        return ",".join(used) or "one device"

    @property
    def devices(self) -> int:
        return math.prod(self.sizes.values())

    def pipeline_text(self) -> str:
        """`" 1f1b M=8"`, `" circular r=2 M=8"` (empty without a stage axis)."""
        if self.stage == 1:
            return ""
        r = f" r={self.virtual_stages}" if self.schedule == "circular" else ""
        return f" {self.schedule}{r} M={self.microbatches}"

    def __str__(self) -> str:
        sp = " sp" if self.sequence_parallel else ""
        attention = f" {self.attention}" if self.context > 1 else ""
        return f"{self.mesh_text()} remat={self.remat}{sp}{attention}{self.pipeline_text()}"


def used_axes(axes: tuple[str, ...], sizes: dict[str, int]) -> tuple[str, ...]:
    """`axes` of size above 1, in mesh order (the order of a layout's `sizes`): how a
    theory keys a collective's axes."""
    return tuple(a for a in sizes if a in axes and sizes[a] > 1)


def factorisations(n: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every ordered tuple of `parts` positive integers whose product is `n`."""
    if parts == 1:
        yield (n,)
        return
    for first in range(1, n + 1):
        if n % first == 0:
            for rest in factorisations(n // first, parts - 1):
                yield (first, *rest)


def layouts(devices: int, axes: tuple[str, ...] = AXES, experts: bool = False) -> Iterator[Layout]:
    """Every layout of `devices` devices over `axes` (the others of size 1), before any
    divisibility rule. A pipeline (`stage > 1`) comes once per remat, with no schedule
    yet ([`pipeline_variants`][] adds them): with `data`, `fsdp` and `model` around it, as
    the planner prices it (no `context`, no sequence parallelism: `pipeline_step` runs
    whole sequences; `fsdp` splits the stage's parameters, gathered once per step), and
    remat `none` or `block` (the pipeline's own).

    With `experts` (a mixture-of-experts GPT), the layouts of `data x fsdp x expert x
    model` ([`expert_layouts`][])."""
    if experts:
        yield from expert_layouts(devices, axes)
        return
    for stage, data, fsdp, context, model in factorisations(devices, 5):
        sizes = {"stage": stage, "data": data, "fsdp": fsdp, "context": context, "model": model}
        if any(n > 1 and a not in axes for a, n in sizes.items()):
            continue
        if stage > 1:
            if context == 1:
                for remat in PIPELINE_REMATS:
                    yield Layout(data, fsdp, context, model, remat, False, "dot_product", stage=stage)
            continue
        for remat in REMATS:
            for sp in (False, True) if model > 1 else (False,):
                for attention in CONTEXT_ATTENTION if context > 1 else ("dot_product",):
                    yield Layout(data, fsdp, context, model, remat, sp, attention)


def expert_layouts(devices: int, axes: tuple[str, ...]) -> Iterator[Layout]:
    """The layouts of a mixture-of-experts GPT: `data x fsdp x expert x model` over `axes`,
    times remat. Not `context` nor sequence parallelism: the GPT refuses `moe=` with
    either (it routes whole sequences: `eqxpar.models.GPT`'s own check). Not `stage`:
    `pipeline_step` takes no `expert_axis` (its MoE layers split each micro-batch over an
    axis that carries no batch), a layout the planner does not price."""
    for data, fsdp, expert, model in factorisations(devices, 4):
        sizes = {"data": data, "fsdp": fsdp, "expert": expert, "model": model}
        if any(n > 1 and a not in axes for a, n in sizes.items()):
            continue
        for remat in REMATS:
            yield Layout(data, fsdp, 1, model, remat, False, "dot_product", expert=expert)


PIPELINE_REMATS = ("none", "block")
"""The remat choices of a pipeline: keep every tick's activations, or only its input."""


def pipeline_variants(layout: Layout, batch: int, layers: int) -> Iterator[Layout]:
    """A pipeline layout (no schedule yet) with every schedule, micro-batch count and
    virtual-stage count the planner considers: micro-batches `M` from `P, 2P, 4P` and the
    batch shard's rows (one row each) where they divide the rows, at least 2; `gpipe` with
    either remat, `1f1b` with `block` (it always recomputes the stage), `circular` with
    `r` of [`VIRTUAL_STAGES`][] that divide the stage's layers and `M` a multiple of `P`.
    Divisibility by layers is left to [`rule_out`][] (the step's own checks)."""
    P = layout.stage
    rows = batch // layout.batch_shards if batch % layout.batch_shards == 0 else 0
    counts = sorted({m for m in (P, 2 * P, 4 * P, rows) if m >= 2 and rows and rows % m == 0})
    for m in counts:
        for schedule in PIPELINE_SCHEDULES:
            if schedule == "1f1b" and layout.remat != "block":
                continue
            for r in VIRTUAL_STAGES if schedule == "circular" else (1,):
                if schedule == "circular" and (m % P or layers % (P * r)):
                    continue
                yield dataclasses.replace(layout, schedule=schedule, microbatches=m, virtual_stages=r)


_CHECKED: dict[tuple[int, int], str] = {}  # (id of an abstract model, model size): "" or why not; models are cached


def clear_checks() -> None:
    """Forget the model-axis checks kept by model id (`eqxpar.plan.plan` clears them when it starts)."""
    _CHECKED.clear()


def rule_out(layout: Layout, gpt: PlanModel, batch: int, seq: int) -> str | None:
    """Why `layout` cannot run `gpt` on `batch` sequences of `seq` tokens, or None.

    The rules are the library's own checks, called rather than restated: the model's own
    `check_axis_size` (heads, key/value heads, MLP width and (padded) vocabulary split over
    `model`), the model's theories (the batch over `data x fsdp`, the sequence over `context`, and over
    `context x model` with sequence parallelism), the zigzag layout of context parallelism
    (the sequence in `2 x context` equal chunks); with an expert axis, the MoE layers' own
    `check_axis_size` (the experts over `expert`, as the step builders check them) and
    the batch over `data x fsdp x expert`.
    """
    mesh = abstract_mesh(layout.sizes)
    if layout.stage > 1:
        why = _pipeline_rule(layout, gpt, batch)
        if why:
            return why
    split = _CHECKED.get((id(gpt), layout.model))
    if split is None:
        try:
            gpt.check_axis_size(layout.model)
            split = ""
        except ValueError as error:
            split = str(error)
        _CHECKED[(id(gpt), layout.model)] = split
    if split:
        return split
    context_axis = "context" if layout.context > 1 else None
    axes = layout.batch_axes
    try:
        experts = experts_of(gpt)
        if layout.expert is not None and experts is not None:
            experts.check_axis_size(layout.expert, "blocks")
        tensor_parallel_theory(gpt, mesh, batch, seq, batch_axis=axes, context_axis=context_axis)
        activation_theory(gpt, mesh, batch, seq, batch_axis=axes, context_axis=context_axis)
        if context_axis:
            zigzag_order(seq, layout.context)
    except ValueError as error:
        return str(error)
    return None


def _pipeline_rule(layout: Layout, gpt: PlanModel, batch: int) -> str | None:
    """What `pipeline_step` refuses: a schedule [`eqxpar.train.make_schedule`][] refuses
    (circular micro-batches not a multiple of the stages: the one rule a planned schedule
    can break; its message is make_schedule's), layers that do not split into
    `stage x virtual_stages`, a batch that does not split into batch shards x micro-batches."""
    P, M, r = layout.stage, layout.microbatches, layout.virtual_stages
    if layout.schedule == "circular" and r > 1 and M % P:  # make_schedule's rule (its tables cost ticks x P)
        try:
            make_schedule("circular", P, M, r)
        except ValueError as error:
            return str(error)
    chunks = layout.stage * layout.virtual_stages
    if gpt.num_layers % chunks:
        return (
            f"{gpt.num_layers} layers do not split into {layout.stage} stages x {layout.virtual_stages} virtual stages"
        )
    if batch % (layout.batch_shards * layout.microbatches):
        return f"batch {batch} does not split into {layout.batch_shards} shards x {layout.microbatches} micro-batches"
    return None


def no_layout_message(config, batch, seq, cluster, vocab_size, pad, axes, pipeline, moe=None) -> str:
    """The message for a batch (and sequence) no layout over `axes` divides, naming the
    smallest batch above `batch` that one would (a pipeline's with 2 micro-batches)."""
    candidates = []
    for lay in layouts(cluster.devices, axes, experts=moe is not None):
        if pipeline is not None and (lay.stage > 1) != pipeline:
            continue
        if lay.stage > 1:
            lay = dataclasses.replace(lay, schedule="gpipe", microbatches=2)
        if lay.remat == "block" and not lay.sequence_parallel and lay.attention in ("dot_product", "ring"):
            gpt = abstract_model(
                config,
                vocab_size,
                remat="block" if lay.stage == 1 else "none",
                sequence_parallel=False,
                attention_impl=lay.attention,
                pad_vocab_to_multiple_of=pad,
                moe=moe,
            )
            candidates.append((lay, gpt))
    shards = "data x fsdp" if moe is None else "data x fsdp x expert"
    for larger in range(batch + 1, batch * cluster.devices + cluster.devices + 1):
        if any(rule_out(lay, gpt, larger, seq) is None for lay, gpt in candidates):
            return (
                f"plan: no layout of {cluster.devices} devices over {' x '.join(axes)} divides batch={batch} "
                f"(seq={seq}) for {config}: the "
                f"batch must split over {shards} (and a pipeline's micro-batches, at least 2), "
                f"and the other devices over model (heads, MLP width, vocabulary), context (the sequence, in 2 x "
                f"context chunks) and stage (the layers). The smallest batch above it that a layout divides is "
                f"{larger}."
            )
    experts = f", {moe.num_experts} experts over expert" if moe is not None else ""
    return (
        f"plan: no layout of {cluster.devices} devices fits {config} (heads, MLP width and vocabulary over model, "
        f"seq={seq} over context, layers over stage{experts}): use a device count that divides them."
    )
