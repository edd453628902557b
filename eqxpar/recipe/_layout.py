"""`--layout auto` for the GPT recipes: plan the fastest layout for the devices present
([`eqxpar.plan.plan`][]), print the planner's table, and put the chosen layout's predicted
and compiled bytes into the metrics."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Literal, TypeVar

import jax
import jax.numpy as jnp

from ..inspect import CommReport, MemoryReport
from ..models import GPTConfig
from ..plan import PRESETS, Cluster, Plan, cluster, plan, table
from ._flags import mesh_text
from ._output import is_main_process

__all__ = ["LayoutFlags", "auto_layout", "check_compiled_peak", "local_cluster", "layout_metrics", "CPU_CLUSTER"]

C = TypeVar("C")
LayoutChoice = Literal["mesh", "auto"]  # --layout's choices: --help lists them, tyro refuses others
GB = 1e9

# The figures a plan on simulated CPU devices is priced with. They only rank layouts (the
# simulated devices share the host's cores, and their "links" are memory copies): a few
# tens of GFLOP/s per device, 10 GB/s between devices, 4 GB of memory each.
CPU_CLUSTER: dict[str, Any] = dict(
    memory_per_device=4 * GB,
    peak_flops={"float32": 50e9, "bfloat16": 50e9},
    intra_host_bandwidth=10 * GB,
    inter_host_bandwidth=10 * GB,
    name="simulated CPU devices",
)
"""The [`eqxpar.plan.Cluster`][] fields [`eqxpar.recipe.local_cluster`][] uses on CPU:
memory per device 4 GB, 50 GFLOP/s, 10 GB/s between devices (rough figures that only rank
layouts)."""


@dataclasses.dataclass
class LayoutFlags:
    """The flags of a recipe that can plan its own layout: derive the recipe's `Config` from
    it and call [`eqxpar.recipe.auto_layout`][] before building the mesh.

    - `--layout auto`: plan every layout of the recipe's mesh axes for the devices present
      (with remat), print the fastest that fit, and run the first: it sets `--mesh` and
      `--remat`. `--layout mesh` (default): run `--mesh` as given.
    - `--memory-per-device GB`: the memory a device may use, for `--layout auto`. Default:
      the accelerator's memory as JAX reports it, or 4 GB per simulated CPU device.
    """

    # The comments are the flags' --help text (eqxpar.recipe.parse_flags reads them).
    layout: LayoutChoice = "mesh"  # auto: the planner's fastest layout that fits (prints its plans); mesh: --mesh
    memory_per_device: float | None = None  # GB a device may use, for --layout auto; default: its memory (CPU: 4)


def local_cluster(memory_per_device: float | None = None) -> Cluster:
    """The devices present as an [`eqxpar.plan.Cluster`][]: `jax.local_device_count()`
    devices per host, `jax.process_count()` hosts.

    **Arguments:**

    - `memory_per_device`: bytes a device may use. Default: the accelerator's memory
      (`memory_stats()["bytes_limit"]`), else the preset's; 4 GB on CPU.

    **Returns:**

    A preset's `Cluster` (H100, H200, A100, TPU v5p: the device kind names it) with the
    devices present, or on CPU one with the figures of [`eqxpar.recipe.CPU_CLUSTER`][].

    **Raises:**

    - `ValueError` for a non-positive memory, or an accelerator the presets do not know
      (naming its kind: run with `--mesh` instead).
    """
    if memory_per_device is not None and not memory_per_device > 0:
        raise ValueError(f"local_cluster: memory_per_device must be positive bytes, got {memory_per_device!r}.")
    device = jax.local_devices()[0]
    shape: dict[str, int] = dict(devices_per_host=jax.local_device_count(), hosts=jax.process_count())
    if device.platform == "cpu":
        count = jax.device_count()
        name = f"{count} {CPU_CLUSTER['name']}" if count > 1 else "1 simulated CPU device"
        fields = {**CPU_CLUSTER, **shape, "name": name}
        if memory_per_device is not None:
            fields["memory_per_device"] = memory_per_device
        return Cluster(**fields)
    kind = device.device_kind.lower()
    preset = next((p for p in PRESETS if p in kind), None)
    if preset is None:
        raise ValueError(
            f"--layout auto: no planner preset for device kind {device.device_kind!r} (presets: {PRESETS}); "
            f"choose the layout with --mesh instead."
        )
    if memory_per_device is None:
        stats = device.memory_stats() or {}
        memory_per_device = stats.get("bytes_limit")
    overrides: dict[str, Any] = {} if memory_per_device is None else {"memory_per_device": float(memory_per_device)}
    return cluster(preset, **shape, **overrides)


def check_layout_flags(cfg: Any) -> None:
    """With `--layout auto`, `--mesh` must stay `auto` (the planner chooses the mesh): a
    recipe calls this in its flag checks, before it reads data or compiles.

    **Raises:**

    - `ValueError` naming both flags and the fix.
    """
    if cfg.layout == "auto" and cfg.mesh != "auto":
        raise ValueError(
            f"--layout auto chooses the mesh itself: drop --mesh {cfg.mesh}, or drop --layout auto to run that mesh."
        )


def auto_layout(
    cfg: C,
    *,
    vocab_size: int,
    axes: Sequence[str] = ("data", "model"),
    top: int = 5,
    pipeline: bool = False,
    seq_field: str = "context",
    sequence_parallel: bool = False,
) -> tuple[C, Plan | None]:
    """`--layout auto`: plan the recipe's GPT for the devices present, print the top plans,
    and return `cfg` with the first one's `--mesh` and `--remat` (and pipeline flags), and
    that plan.

    Plans only what the recipe builds: the mesh `axes`, every remat policy, sequence
    parallelism only where the recipe asks for it (the GPT recipes sample from the trained
    model, which runs whole sequences), the recipe's compute dtype (float32 for a recipe
    without `--dtype`) and AdamW's state. With a `context` axis among `axes`, ring and
    all-gather attention are both planned. Nothing compiles. With `--layout mesh` it
    returns `(cfg, None)` and prints nothing.

    **Arguments:**

    - `cfg`: a recipe config with the fields of [`eqxpar.recipe.LayoutFlags`][], and
      `mesh`, `remat`, `batch_size`, `dim`, `heads`, `layers` and the sequence length
      (the field `seq_field`) (and those of [`eqxpar.recipe.GPTFlags`][] where it has
      them: `dtype`).
    - `vocab_size`: the model's vocabulary (padded to a multiple of 128, as the GPT pads it).
    - `axes`: the mesh axes the recipe builds, in its mesh order.
    - `top`: how many plans to print.
    - `pipeline`: only pipelines (`stage > 1`: a recipe that always runs
      `eqxpar.train.pipeline_step`); `cfg` then has `schedule`, `microbatches` and
      `virtual_stages`, set from the plan, and a boolean `remat` (the pipeline's:
      recompute each tick).
    - `seq_field`: the field of `cfg` holding the tokens per sequence (`"context"`; a
      long-context recipe's `"seq_len"`).
    - `sequence_parallel`: also plan Megatron sequence parallelism over `model`; `cfg`
      then has a boolean `sequence_parallel`, set from the plan.

    **Returns:**

    `(cfg, plan)`: `cfg` with `mesh` the plan's sizes of `axes` (`"data=8,model=1"`) and
    `remat` its remat policy (with `pipeline`, its schedule, micro-batches and virtual
    stages; with `sequence_parallel`, its sequence parallelism; with a `context` axis,
    `attention` the plan's: `"ring"` or `"all_gather"`, or `"dot_product"` for a plan
    whose context axis has size 1, which runs whole sequences); the
    [`eqxpar.plan.Plan`][] (or `None` without `--layout auto`).

    **Raises:**

    - `ValueError` (before anything compiles) when `--mesh` is given too; when no layout
      divides the batch (naming the smallest batch that one would); when nothing fits
      `--memory-per-device` (naming the smallest memory that would do); for an unknown
      accelerator.
    """
    flags: Any = cfg
    if flags.layout != "auto":
        return cfg, None
    check_layout_flags(cfg)
    if flags.memory_per_device is not None and not flags.memory_per_device > 0:
        raise ValueError(f"--memory-per-device must be positive (GB per device), got {flags.memory_per_device}.")
    memory = None if flags.memory_per_device is None else flags.memory_per_device * GB
    machine = local_cluster(memory)
    config = GPTConfig(context=getattr(flags, seq_field), dim=flags.dim, heads=flags.heads, layers=flags.layers)
    dtype = jnp.bfloat16 if getattr(flags, "dtype", "float32") == "bfloat16" else jnp.float32
    try:  # every layout, those that do not fit too: a message in the flag's units if none fits
        plans = plan(
            config,
            batch=flags.batch_size,
            cluster=machine,
            dtype=dtype,
            optimizer="adamw",
            vocab_size=vocab_size,
            axes=tuple(axes),
            sequence_parallel=(False, True) if sequence_parallel else (False,),
            top=None,
            include_infeasible=True,
            pipeline=True if pipeline else None,
            document_mask=bool(getattr(flags, "document_mask", False)),  # TextFlags: packed rows' ids
        )
    except ValueError as error:  # no layout divides the batch (or a bad shape)
        raise ValueError(f"--layout auto with --batch-size {flags.batch_size}: {error}") from None
    best = plans[0]
    if not best.fits:
        least = min(plans, key=lambda p: p.memory.peak)
        raise ValueError(
            f"--layout auto: no {' x '.join(axes)} layout of this GPT with --batch-size {flags.batch_size} fits "
            f"--memory-per-device {machine.memory_per_device / GB:g} (GB) on {machine.name}: the smallest predicted "
            f"peak is {least.memory.peak:,} bytes ({least.layout}). Give --memory-per-device "
            f"{_three_digits(least.memory.peak / GB):g} or more, or a smaller --batch-size."
        )
    plans = [p for p in plans if p.fits][:top]
    if is_main_process():
        print(
            f"--layout auto: {len(plans)} fastest of the {' x '.join(axes)} layouts on {machine.name} "
            f"({machine.memory_per_device / GB:g} GB each); running the first:\n{table(plans)}\n",
            flush=True,
        )
    sizes = {axis: best.layout.sizes[axis] for axis in axes}
    lay = best.layout
    if pipeline:
        flags = dataclasses.replace(
            flags, schedule=lay.schedule, microbatches=lay.microbatches, virtual_stages=lay.virtual_stages
        )
    if sequence_parallel:
        flags = dataclasses.replace(flags, sequence_parallel=lay.sequence_parallel)
    if "context" in axes:
        flags = dataclasses.replace(flags, attention=lay.attention)
    remat = lay.remat == "block" if isinstance(flags.remat, bool) else lay.remat
    return dataclasses.replace(flags, mesh=mesh_text(sizes), remat=remat), best


def check_compiled_peak(cfg: Any, plan: Plan | None, memory: MemoryReport) -> None:
    """`--layout auto`, once the step is compiled and before it trains: print the chosen
    plan's predicted peak beside the compiled step's, and stop if the compiled one does not
    fit. The planner's peak is an estimate (its temporaries are calibrated on GPU steps, and
    XLA's buffer assignment differs by backend and model size: see the planner's page), so
    the figure that decides is XLA's memory analysis of the program about to run.

    **Arguments:**

    - `cfg`: the recipe's config (its `memory_per_device`, GB, or `None` for the devices'
      own memory, as in [`eqxpar.recipe.auto_layout`][]).
    - `plan`: the plan `auto_layout` chose, or `None` (`--layout mesh`: nothing is
      checked or printed).
    - `memory`: the compiled step's [`eqxpar.inspect.MemoryReport`][].

    **Raises:**

    - `ValueError` (before the first step: nothing is trained or written) when the compiled
      peak (`MemoryReport.peak`) exceeds the memory per device, naming both peaks and the
      memory that would do.
    """
    if plan is None:
        return
    flags: Any = cfg
    given = None if flags.memory_per_device is None else flags.memory_per_device * GB
    limit = local_cluster(given).memory_per_device
    predicted, compiled = int(plan.memory.peak), memory.peak
    if compiled > limit:
        # More memory is only advice where the user set the limit: by default it is the device's own.
        more = (
            f"--memory-per-device {_three_digits(compiled / GB):g} if the devices have that much, "
            if flags.memory_per_device is not None
            else ""
        )
        margin = _three_digits(limit * predicted / compiled / GB, up=False)
        raise ValueError(
            f"--layout auto chose {plan.layout}, whose predicted peak ({predicted:,} bytes per device) fits "
            f"{limit / GB:g} GB, but its compiled step needs {compiled:,} bytes per device (XLA's memory analysis), "
            f"{compiled / predicted:.2f} times the prediction: give {more}a smaller --batch-size, --memory-per-device "
            f"{margin:g} to plan with that margin (if a layout is predicted to fit it), or drop --layout auto and "
            f"run a layout of the table above with --mesh and its other choices."
        )
    if is_main_process():
        print(
            f"layout {plan.layout}: peak per device predicted {predicted:,} bytes, compiled {compiled:,} "
            f"({compiled / predicted:.2f} of the prediction; {limit / GB:g} GB available)",
            flush=True,
        )


def _three_digits(x: float, up: bool = True) -> float:
    """`x` to 3 significant digits, rounded up (a memory that is enough, printed short) or
    down (one that stays within `x`)."""
    step = 10.0 ** (math.floor(math.log10(x)) - 2)
    return (math.ceil(x / step) if up else math.floor(x / step)) * step


def layout_metrics(cfg: Any, plan: Plan | None, comm: CommReport, memory: MemoryReport) -> dict[str, Any]:
    """The layout a recipe ran and its bytes, for `--metrics-out`.

    **Arguments:**

    - `cfg`: the recipe's config (its `mesh` and `remat`; a pipeline recipe's `schedule`,
      `microbatches`, `virtual_stages`).
    - `plan`: the plan [`eqxpar.recipe.auto_layout`][] chose, or `None` (`--layout mesh`).
    - `comm`, `memory`: the compiled step's [`eqxpar.inspect.CommReport`][] and
      [`eqxpar.inspect.MemoryReport`][].

    **Returns:**

    `{"layout", "predicted_comm_bytes", "compiled_comm_bytes", "predicted_peak_bytes",
    "compiled_peak_bytes"}`: the layout as the planner names it (`"data=8 remat=none"`,
    `"data=2,context=2,model=2 remat=none sp ring"`),
    collective bytes per device and step (the plan's, in the compute dtype; the compiled
    program's, over groups of more than one device) and peak bytes per device (the plan's
    prediction; `MemoryReport.peak`). The predictions are `None` without a plan.
    """
    if plan is not None:
        name = str(plan.layout)
    else:
        sizes = {axis: int(size) for axis, size in (comm.mesh.shape.items() if comm.mesh is not None else ())}
        used = ",".join(f"{a}={n}" for a, n in sizes.items() if n > 1) or "one device"
        remat = ("block" if cfg.remat else "none") if isinstance(cfg.remat, bool) else cfg.remat
        name = f"{used} remat={remat}"
        if sizes.get("model", 1) > 1 and getattr(cfg, "sequence_parallel", False):  # as a Layout names it
            name += " sp"
        if sizes.get("context", 1) > 1:  # a context-parallel recipe's attention
            name += f" {cfg.attention}"
        if sizes.get("stage", 1) > 1 and hasattr(cfg, "schedule"):  # a pipeline recipe's flags
            r = f" r={cfg.virtual_stages}" if cfg.schedule == "circular" else ""
            if cfg.schedule == "1f1b":  # it always recomputes the stage: the planner's "block"
                name = f"{used} remat=block"
            name += f" {cfg.schedule}{r} M={cfg.microbatches}"
    return {
        "layout": name,
        "predicted_comm_bytes": plan.comm_in_dtype().bytes() if plan is not None else None,
        "compiled_comm_bytes": sum(comm.traffic().values()),
        "predicted_peak_bytes": int(plan.memory.peak) if plan is not None else None,
        "compiled_peak_bytes": memory.peak,
    }
