"""`eqxpar.plan.plan`: every layout of a GPT or Llama step on a cluster, priced by exact
theory, the fastest that fit first."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax

from ..inspect import CommTheory
from ..models import GPTConfig, MoEOptions
from . import _cluster, _pipeline
from ._abstract import AXES, EXPERT_AXES, abstract_mesh, abstract_model
from ._build import build_batch, build_mesh, build_model, build_step
from ._candidates import REMATS, Layout, clear_checks, layouts, no_layout_message, pipeline_variants, rule_out
from ._cluster import Cluster
from ._experts import check_moe
from ._family import PlanConfig, PlanModel, config_context, config_layers, param_dtype, vocabulary
from ._predict import clear_caches, layout_specs
from ._predict_comm import comm_theory, in_dtype
from ._predict_memory import Memory, memory
from ._predict_time import StepTime, flops_per_device, step_time

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Plan:
    """One layout of a GPT or Llama step on a cluster, with what it is predicted to cost.

    - `layout`: an [`eqxpar.plan.Layout`][] (axis sizes, remat, sequence parallelism, attention).
    - `comm`: the step's collectives, an [`eqxpar.inspect.CommTheory`][] (per device, per
      step; exact for float32 compute, see the concept page for other dtypes).
    - `memory`: an [`eqxpar.plan.Memory`][] (bytes per device).
    - `flops`: FLOPs one device executes per step (recomputation included).
    - `time`: an [`eqxpar.plan.StepTime`][] (seconds: compute, communication, both bounds).
    - `reason`: one line naming what decided the plan's place.
    - `fits`: whether `memory.peak` is within the cluster's memory per device.

    `plan.mesh()`, `plan.model(key)`, `plan.step(optimizer)` and `plan.batch(tokens, mesh)`
    build what it describes with eqxpar's own builders.
    """

    layout: Layout
    comm: CommTheory
    memory: Memory
    flops: float
    time: StepTime
    fits: bool
    reason: str
    config: PlanConfig
    vocab_size: int
    batch_size: int
    seq_len: int
    dtype: Any
    pad_vocab_to_multiple_of: int
    optimizer: optax.GradientTransformation
    moe: MoEOptions | None = None

    def mesh(self, devices: Sequence[Any] | None = None):
        """The mesh: axes `stage, data, fsdp, context, model` (`EXPERT_AXES` with experts;
        size-1 axes included), over the first devices of `devices` (default `jax.devices()`)."""
        return build_mesh(self.layout, devices)

    def model(self, key: Any) -> PlanModel:
        """The GPT or Llama this plan runs (scanned layers, its remat, sequence parallelism
        and attention), with weights from `key`."""
        return build_model(self, key)

    def step(self, optimizer: optax.GradientTransformation, mesh: Any = None, *, precision: Any = None):
        """The train step ([`eqxpar.train.hybrid_step`][], [`eqxpar.train.fsdp_step`][] with
        `fsdp > 1`, [`eqxpar.train.pipeline_step`][] with `stage > 1`; with experts
        `expert_axis="expert"`) on `mesh` (default `self.mesh()`), taking batches from
        `self.batch`."""
        return build_step(self, optimizer, mesh if mesh is not None else self.mesh(), precision=precision)

    def batch(self, tokens: Any, mesh: Any):
        """`tokens` (`(batch, seq + 1)` ids) placed for the step: split over `data x fsdp`
        (`x expert` with experts), and with a context axis reordered into zigzag layout and
        cut into inputs and targets."""
        return build_batch(self.layout, tokens, mesh)

    def comm_in_dtype(self) -> CommTheory:
        """`comm` as the step's time prices it, each collective in the dtype it travels in:
        the activation collectives (over `model` and `context`, the all-to-alls over
        `expert`) in the compute dtype; gradients, parameters and the float32 statistics in
        float32. The same as `comm` for float32 compute; for bfloat16 it equals the step's
        lowered program per (kind, axes) (docs/concepts/planner.md says where not)."""
        return in_dtype(self.comm, np.float32, self.dtype)

    def row(self, seconds: float = 1e-3, nbytes: float = GB) -> tuple[str, ...]:
        """The plan as a row of [`eqxpar.plan.table`][], times in units of `seconds` (ms by
        default) and bytes in units of `nbytes` (GB by default)."""
        t, m = self.time, self.memory
        return (
            str(self.layout),
            f"{t.expected / seconds:.1f}",
            f"{t.overlap / seconds:.1f}-{t.no_overlap / seconds:.1f}",
            f"{t.compute / seconds:.1f}",
            f"{self.comm_in_dtype().bytes() / nbytes:.2f}",
            f"{m.peak / nbytes:.1f}",
            self.reason,
        )


TIME_UNITS = (("ms", 1e-3), ("us", 1e-6))
BYTE_UNITS = (("GB", GB), ("MB", 1e6), ("KB", 1e3))


def _unit(largest: float, units: tuple[tuple[str, float], ...], least: float = 0.1) -> tuple[str, float]:
    """The first of `units` in which `largest` reads as at least `least` (the last one else)."""
    return next((u for u in units if largest >= least * u[1]), units[-1])


def table(plans: Sequence[Plan]) -> str:
    """The plans as a text table: layout, expected step time, its bounds, compute time,
    collective bytes per device and step, predicted peak bytes per device, and the reason.
    Times are in ms and bytes in GB, or in us (steps under 10 ms), MB or KB where the plans
    are that small."""
    time_name, seconds = _unit(max((p.time.no_overlap for p in plans), default=1.0), TIME_UNITS, least=10)
    byte_name, nbytes = _unit(max((p.memory.peak for p in plans), default=GB), BYTE_UNITS)
    head = (
        "layout",
        f"step {time_name}",
        f"bounds {time_name}",
        f"compute {time_name}",
        f"comm {byte_name}",
        f"peak {byte_name}",
        "why",
    )
    rows = [head] + [p.row(seconds, nbytes) for p in plans]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
    lines = []
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:-1], widths[1:])] + [r[-1]]
        lines.append("  ".join(cells))
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _optimizer(optimizer: Any) -> optax.GradientTransformation:
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer
    makers = {"adamw": lambda: optax.adamw(3e-4), "adam": lambda: optax.adam(3e-4), "sgd": lambda: optax.sgd(0.1)}
    if optimizer not in makers:
        raise ValueError(
            f"plan: optimizer must be an optax GradientTransformation or one of {sorted(makers)}, got {optimizer!r}."
        )
    return makers[optimizer]()


def _check(config, batch, seq, vocab_size, top) -> None:
    for name, value in (("batch", batch), ("seq", seq), ("vocab_size", vocab_size)):
        if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise ValueError(f"plan: {name} must be a positive integer, got {value!r}.")
    if seq > config_context(config):
        raise ValueError(f"plan: seq={seq} is longer than the config's context ({config_context(config)}).")
    if top is not None and not (isinstance(top, int) and top > 0):
        raise ValueError(f"plan: top must be a positive integer or None, got {top!r}.")


def plan(
    config: PlanConfig,
    *,
    batch: int,
    cluster: Cluster | str,
    seq: int | None = None,
    optimizer: Any = "adamw",
    dtype: Any = jnp.bfloat16,
    top: int | None = 5,
    vocab_size: int | None = None,
    pad_vocab_to_multiple_of: int | None = None,
    remats: Sequence[str] = REMATS,
    axes: Sequence[str] | None = None,
    sequence_parallel: Sequence[bool] = (False, True),
    include_infeasible: bool = False,
    pipeline: bool | None = None,
    moe: MoEOptions | None = None,
    document_mask: bool = False,
) -> list[Plan]:
    """The fastest layouts of a GPT or Llama train step that fit the cluster, best first.

    Enumerates every factorisation of the cluster's devices into `stage x data x fsdp x
    context x model`, times remat (`none`, `save_matmuls`, `block`), Megatron sequence
    parallelism (with `model > 1`) and ring or all-gather attention (with `context > 1`),
    and for pipelines (`stage > 1`, with `data`, `fsdp` and `model` around it) the schedule
    (`gpipe`, `1f1b`, `circular` with 2 or 4 virtual stages), the micro-batches (`P`, `2P`,
    `4P` or one row each) and the pipeline's remat (`none`, `block`); rules out what the
    library's own checks refuse (heads, key/value heads, MLP width and vocabulary over
    `model`, the batch
    over `data x fsdp` and the micro-batches, the sequence over `context`, zigzag chunks,
    sequence parallelism's split, the layers over `stage x virtual stages`, the circular
    schedule's groups); prices each by the exact theories (collective bytes per kind and
    axes, parameter, optimizer-state and saved-activation bytes; a pipeline's bubble) plus
    an estimate of XLA's temporaries; drops what exceeds `cluster.memory_per_device`; and
    ranks the rest by a roofline step time (`StepTime.expected`). Gradient accumulation
    outside pipelines is not planned yet. Everything is
    computed from shapes (`equinox.filter_eval_shape`): nothing is allocated or compiled.

    **Arguments:**

    - `config`: the model's shape: an `eqxpar.models.GPTConfig` (e.g.
      `eqxpar.models.gpt_config("1.3b")`) or an `eqxpar.models.LlamaConfig` (e.g.
      `eqxpar.models.llama_config("llama-3-8b")`: RMSNorm, rotary embeddings, grouped-query
      attention, SwiGLU, priced by the Llama's own theories).
    - `batch`: sequences per step (the global batch).
    - `cluster`: an [`eqxpar.plan.Cluster`][] or a preset name (`"h100"`, one host).
    - `seq`: tokens per sequence (default: the config's context).
    - `optimizer`: an optax optimizer or `"adamw"`, `"adam"`, `"sgd"` (its state's size counts).
    - `dtype`: the compute dtype (float32 master weights and optimizer state; `bfloat16`
      matmuls by default).
    - `top`: how many plans to return (None: all).
    - `vocab_size`, `pad_vocab_to_multiple_of`: the GPT's vocabulary (GPT-2's 50257, padded
      to a multiple of 128, by default); a Llama's is its config's, unpadded (leave both out).
    - `remats`: the remat policies to consider.
    - `axes`: the mesh axes a plan may use (default all of `AXES`, and `expert` with `moe`;
      e.g. `("data", "model")` for a recipe that builds only those).
    - `sequence_parallel`: the sequence-parallelism choices to consider (`(False,)` for a
      caller whose model must also run whole sequences, e.g. to sample from it).
    - `include_infeasible`: also return the plans that do not fit (after those that do).
    - `pipeline`: `True` for pipelines only (`stage > 1`), `False` for none, `None` for both.
    - `moe`: an [`eqxpar.models.MoEOptions`][] with `every=1` to plan a GPT with a
      mixture of experts in every block: the layouts of `data x fsdp x expert x model`
      (no context axis, sequence parallelism or pipeline: see docs/concepts/planner.md),
      the experts and the batch split over `expert`.
    - `document_mask`: the batches are packed documents with their segment ids: price the
      ids' all-gather over the context axis (once per step).

    **Returns:**

    A list of [`eqxpar.plan.Plan`][]s, fastest first.

    **Raises:**

    - `ValueError` for a bad argument or unknown device kind; if no layout divides the
      batch (naming the smallest batch that one would); if nothing fits in memory (naming
      the smallest memory per device that would do).
    """
    vocab_size, pad_vocab_to_multiple_of = vocabulary(config, vocab_size, pad_vocab_to_multiple_of, moe)
    seq = config_context(config) if seq is None else seq
    _check(config, batch, seq, vocab_size, top)
    if isinstance(cluster, str):
        cluster = _cluster.cluster(cluster)
    if not isinstance(cluster, Cluster):
        raise ValueError(f"plan: cluster must be an eqxpar.plan.Cluster or a preset name, got {cluster!r}.")
    dtype = np.dtype(dtype)
    cluster.flops(dtype)
    bad = [r for r in remats if r not in REMATS]
    if bad or not remats:
        raise ValueError(f"plan: remats must be a non-empty subset of {REMATS}, got {tuple(remats)!r}.")
    if pipeline not in (None, True, False):
        raise ValueError(f"plan: pipeline must be True, False or None, got {pipeline!r}.")
    if not sequence_parallel or any(not isinstance(sp, bool) for sp in sequence_parallel):
        raise ValueError(
            f"plan: sequence_parallel must be a non-empty subset of (False, True), got {tuple(sequence_parallel)!r}."
        )
    known = AXES if moe is None else EXPERT_AXES
    if axes is not None and (not axes or any(a not in known for a in axes)):
        raise ValueError(f"plan: axes must be a non-empty subset of {known}, got {tuple(axes)!r}.")
    if moe is not None:
        given = None if axes is None else tuple(axes)
        assert isinstance(config, GPTConfig)  # vocabulary() refused moe= for a Llama
        check_moe(config, moe, vocab_size, pad_vocab_to_multiple_of, pipeline, given, tuple(sequence_parallel))
    axes = known if axes is None else axes
    opt = _optimizer(optimizer)
    clear_caches()  # caches keyed by object ids live for one call
    _pipeline.clear_caches()
    clear_checks()
    plans = []
    for base in layouts(cluster.devices, tuple(axes), experts=moe is not None):
        if base.remat not in remats or (base.model > 1 and base.sequence_parallel not in sequence_parallel):
            continue
        if pipeline is not None and (base.stage > 1) != pipeline:
            continue
        for layout in pipeline_variants(base, batch, config_layers(config)) if base.stage > 1 else (base,):
            priced = price(
                layout,
                config,
                batch,
                seq,
                cluster,
                opt,
                dtype,
                vocab_size,
                pad_vocab_to_multiple_of,
                moe,
                document_mask,
            )
            if priced is not None:
                plans.append(priced)
    if not plans:
        raise ValueError(
            no_layout_message(
                config, batch, seq, cluster, vocab_size, pad_vocab_to_multiple_of, tuple(axes), pipeline, moe
            )
        )
    fitting = [p for p in plans if p.fits]
    if not fitting and not include_infeasible:
        least = min(plans, key=lambda p: p.memory.peak)
        raise ValueError(
            f"plan: no layout of {config} with batch={batch}, seq={seq} fits {_size(cluster.memory_per_device)} "
            f"per device on {cluster.name}: the smallest predicted peak is {_size(least.memory.peak)} "
            f"({least.layout}). Give each device at least that much memory, more devices, or a smaller batch."
        )
    ranked = sorted(fitting, key=_rank)
    if include_infeasible:
        ranked += sorted((p for p in plans if not p.fits), key=_rank)
    ranked = [dataclasses.replace(p, reason=_reason(p, i, ranked, cluster)) for i, p in enumerate(ranked)]
    return ranked[:top] if top is not None else ranked


def _size(nbytes: float) -> str:
    return f"{nbytes / GB:.2f} GB" if nbytes >= 1e7 else f"{int(nbytes):,} bytes"


def _rank(p: Plan) -> tuple:
    # Microseconds: layouts whose times differ only by rounding tie, and the one with the
    # smaller peak memory goes first.
    return (round(p.time.expected * 1e6), round(p.time.no_overlap * 1e6), p.memory.peak, str(p.layout))


def price(
    layout: Layout,
    config: PlanConfig,
    batch: int,
    seq: int,
    cluster: Cluster,
    optimizer: optax.GradientTransformation,
    dtype: Any,
    vocab_size: int,
    pad: int,
    moe: MoEOptions | None = None,
    document_mask: bool = False,
) -> Plan | None:
    """The [`eqxpar.plan.Plan`][] for one layout, or None when a divisibility rule rules it out."""

    def gpt_with(remat: str) -> PlanModel:
        return abstract_model(
            config,
            vocab_size,
            remat=remat,
            sequence_parallel=layout.sequence_parallel,
            attention_impl=layout.attention,
            pad_vocab_to_multiple_of=pad,
            moe=moe,
        )

    gpt = gpt_with(layout.remat if layout.stage == 1 else "none")  # a pipeline's remat is its own
    if rule_out(layout, gpt, batch, seq) is not None:
        return None
    mesh = abstract_mesh(layout.sizes)
    if layout.stage > 1:
        specs = _pipeline.pipeline_layout_specs(gpt, layout, mesh)
        comm = _pipeline.pipeline_comm(gpt, layout, specs, batch, seq)
        mem = _pipeline.pipeline_memory(gpt, mesh, layout, specs, optimizer, batch, seq, dtype)
        flops = _pipeline.pipeline_flops(gpt, layout, batch, seq)
    else:
        specs = layout_specs(gpt, mesh, layout)
        comm = comm_theory(gpt, mesh, layout, specs, batch, seq, document_mask=document_mask)
        without_remat = None if layout.remat == "none" else gpt_with("none")  # the recomputed block's working set
        mem = memory(gpt, mesh, layout, specs, optimizer, batch, seq, dtype, cluster.fused_attention, without_remat)
        flops = flops_per_device(gpt, layout, batch, seq)
    time, _ = step_time(in_dtype(comm, param_dtype(gpt), dtype), flops, layout, cluster, dtype)
    return Plan(
        layout=layout,
        comm=comm,
        memory=mem,
        flops=flops,
        time=time,
        fits=mem.peak <= cluster.memory_per_device,
        reason="",
        config=config,
        vocab_size=vocab_size,
        batch_size=batch,
        seq_len=seq,
        dtype=dtype,
        pad_vocab_to_multiple_of=pad,
        optimizer=optimizer,
        moe=moe,
    )


def _reason(p: Plan, index: int, ranked: list[Plan], cluster: Cluster) -> str:
    t = p.time
    _, classes = step_time(p.comm_in_dtype(), p.flops, p.layout, cluster, p.dtype)
    share = t.compute / t.expected if t.expected else 1.0
    memory = _peak_text(p.memory.peak, cluster.memory_per_device)
    if not p.fits:
        return f"does not fit: {memory}"
    if not classes or classes[0][0] == 0:
        return f"no communication; compute is the step; {memory}"
    seconds, kind, axes, nbytes, link = classes[0]
    amount, unit = _unit(nbytes, BYTE_UNITS)
    duration, scale = _unit(seconds, TIME_UNITS)
    biggest = (
        f"largest: {kind} over {','.join(axes)} {nbytes / unit:.2f} {amount}/step {link} "
        f"({seconds / scale:.1f} {duration})"
    )
    lead = "compute-bound" if share >= 0.5 else "communication-bound"
    if t.bubble:
        biggest += f"; bubble {t.bubble / (t.compute + t.bubble):.0%}"
    if index and ranked[0].fits:
        slower = t.expected / ranked[0].time.expected - 1
        lead = f"ties the best, {lead}" if slower < 0.005 else f"{slower:+.0%} vs best, {lead}"
    return f"{lead} ({share:.0%} compute); {biggest}; {memory}"


def _peak_text(peak: float, memory: float) -> str:
    """ "peak 60.7 of 80 GB" (MB or KB for a peak below 0.1 GB)."""
    if peak >= 0.1 * GB:
        return f"peak {peak / GB:.1f} of {memory / GB:.0f} GB"
    name, unit = _unit(peak, BYTE_UNITS)
    return f"peak {peak / unit:.1f} {name} of {memory / GB:g} GB"
