"""Draw the docs' pictures into docs/images/ (PNG), from the code they describe.

`make docs` runs this before `mkdocs build --strict`, so the pictures never go stale. It
takes seconds, needs no network and no display (matplotlib's Agg backend), and runs on 8
simulated CPU devices:

- `mesh_grid.png`: `eqxpar.make_mesh(data=2, model=4)`; which rows of a batch
  (`P("data")`) and which block of a column-parallel weight each device holds, read from
  the `NamedSharding`s' `devices_indices_map`;
- `column_row.png`: the blocks of `ColumnParallelLinear` and `RowParallelLinear` weights,
  from `eqxpar.nn.partition_specs` and the same map;
- `collectives.png`: what each of 4 devices holds before and after `all_gather`,
  `psum_scatter` and `psum`: the values come from running them under `jax.shard_map`;
- `two_hosts.png`: `eqxpar.make_mesh(data=2, model=4)` over 2 processes of 4 devices: the
  device ids and their processes are the ones a real `python -m eqxpar.launch --nproc 2
  --devices-per-proc 4` run recorded in docs/data/losses/multihost.json (`make figures`);
- `loss_<recipe>.png`: each training recipe's loss per step, from docs/data/losses/*.json
  (`make figures` re-runs the recipes to rewrite those: minutes, so not part of `make docs`);
- `loss_precision.png`: the same recipe trained with `--dtype float32` and `--dtype
  bfloat16` (same seed), both losses and their relative gap per step, from
  docs/data/losses/precision/*.json (also written by `make figures`);
- `sequence_parallel.png`: which positions of the residual stream each device holds
  with tensor parallelism, with Megatron sequence parallelism, and with context
  parallelism as well, from the GPT's token embedding run under `shard_map`;
- `expert_routing.png`: a `MixtureOfExperts` on `expert=4`: each device's tokens, the
  expert each chose (dropped ones hatched), and the slots they fill after the all-to-all,
  read from the layer under `shard_map`;
- `bench_strategies.png`: the table of docs/benchmarks.md (`benchmarks/strategies.py`'s
  output, pasted there) as bar charts, parsed from the page itself.

Each picture is drawn from its **inputs**, the data it plots (computed by a `*_inputs`
function, without drawing), and the script records them in docs/images/manifest.json: per
PNG, a hash of its inputs and one of the code that draws it (the functions' syntax trees,
so comments and formatting do not count). tests/test_docs_figures.py recomputes both, in
seconds and without matplotlib drawing anything, and fails when a picture is older than
what it shows: rerun `make docs` (or this script) and commit the pictures with the
manifest. The PNG bytes themselves are not hashed: matplotlib's output may vary between
versions and machines.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import os
import pathlib
import re
import sys
import textwrap
from collections.abc import Callable
from typing import Any

os.environ.setdefault("MPLBACKEND", "Agg")

import eqxpar

eqxpar.simulate_cpu_devices(8)  # before JAX starts

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from matplotlib.patches import FancyBboxPatch, Rectangle  # noqa: E402

DOCS = pathlib.Path(__file__).resolve().parents[1]
IMAGES = DOCS / "images"
MANIFEST = IMAGES / "manifest.json"
LOSSES = DOCS / "data" / "losses"
DPI = 80
# One colour per data index (batch shard) and per model index (weight block).
DATA_COLORS = ["#cfe2f3", "#fce5cd"]
MODEL_COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#e15759", "#76b7b2", "#edc948", "#9c755f"]
plt.rcParams.update({"font.size": 10, "savefig.bbox": "tight", "savefig.dpi": DPI, "figure.dpi": DPI})


def save(fig, name: str) -> None:
    fig.savefig(IMAGES / name, metadata={"Software": None})  # no version stamp: stable bytes
    plt.close(fig)
    print(f"make_figures: docs/images/{name}")


def span(index: slice, size: int) -> tuple[int, int]:
    """(first, last) of an index slice of an axis of `size`."""
    start, stop, _ = index.indices(size)
    return start, stop - 1


def mesh_position(mesh, device) -> tuple[int, ...]:
    return tuple(int(i) for i in zip(*(mesh.devices == device).nonzero()).__next__())


# --- (a) the data x model mesh ---------------------------------------------------------------


def mesh_grid_inputs() -> dict[str, Any]:
    """Per device of `make_mesh(data=2, model=4)`: its id, mesh position, and the rows of the
    batch and of the weight it holds."""
    mesh = eqxpar.make_mesh(data=2, model=4)
    batch_shape, weight_shape = (16, 64), (256, 64)  # 16 examples; a (256, 64) column-parallel weight
    rows = NamedSharding(mesh, P("data")).devices_indices_map(batch_shape)
    blocks = NamedSharding(mesh, P("model", None)).devices_indices_map(weight_shape)
    devices = [
        [
            device.id,
            *mesh_position(mesh, device),
            *span(rows[device][0], batch_shape[0]),
            *span(blocks[device][0], weight_shape[0]),
        ]
        for device in mesh.devices.flat
    ]
    return {"mesh_grid.png": {"devices": devices}}


def mesh_grid(inputs: dict[str, Any]) -> None:
    fig, ax = plt.subplots(figsize=(9.5, 4.2))
    for device_id, d, m, r0, r1, w0, w1 in inputs["mesh_grid.png"]["devices"]:
        x, y = m * 2.3, (1 - d) * 1.9
        ax.add_patch(
            FancyBboxPatch((x, y), 2.0, 1.6, boxstyle="round,pad=0.02", fc=DATA_COLORS[d], ec=MODEL_COLORS[m], lw=3)
        )
        ax.text(x + 1.0, y + 1.25, f"device {device_id}", ha="center", weight="bold")
        ax.text(x + 1.0, y + 0.8, f"batch rows {r0}-{r1}", ha="center", fontsize=9)
        ax.text(x + 1.0, y + 0.35, f"weight rows {w0}-{w1}", ha="center", color=MODEL_COLORS[m], fontsize=9)
    for m in range(4):
        ax.text(m * 2.3 + 1.0, 3.75, f"model={m}", ha="center", color=MODEL_COLORS[m], weight="bold")
    for d in range(2):
        ax.text(-0.15, (1 - d) * 1.9 + 0.8, f"data={d}", ha="right", va="center", weight="bold")
    ax.set_title(
        'make_mesh(data=2, model=4): a batch split P("data"), a (256, 64) weight split P("model", None)', fontsize=10
    )
    ax.set_xlim(-1.3, 9.2)
    ax.set_ylim(-0.2, 4.0)
    ax.axis("off")
    save(fig, "mesh_grid.png")


# --- (b) column- and row-parallel splits -----------------------------------------------------


def column_row_inputs() -> dict[str, Any]:
    """Per layer: its weight's shape and spec, and each device's block of it."""
    mesh = eqxpar.make_mesh(model=4)
    key = jax.random.key(0)
    layers = {
        (
            "ColumnParallelLinear(8, 16): output features split\n(x whole on every device -> y split; no collective)"
        ): eqxpar.nn.ColumnParallelLinear(8, 16, key=key),
        (
            "RowParallelLinear(16, 8): input features split\n(x split -> each device's partial W x -> psum)"
        ): eqxpar.nn.RowParallelLinear(16, 8, key=key),
    }
    panels = []
    for title, layer in layers.items():
        spec = eqxpar.nn.partition_specs(layer, mesh).weight
        shape = layer.weight.shape  # (out_features, in_features)
        owner = NamedSharding(mesh, spec).devices_indices_map(shape)
        blocks = [
            [device.id, mesh_position(mesh, device)[0], *span(ri, shape[0]), *span(ci, shape[1])]
            for device, (ri, ci) in owner.items()
        ]
        panels.append({"title": title, "shape": list(shape), "spec": str(spec), "blocks": blocks})
    return {"column_row.png": {"panels": panels}}


def column_row(inputs: dict[str, Any]) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, panel in zip(axes, inputs["column_row.png"]["panels"]):
        title, shape, spec = panel["title"], panel["shape"], panel["spec"]
        for device_id, m, r0, r1, c0, c1 in panel["blocks"]:
            ax.add_patch(
                Rectangle(
                    (c0, shape[0] - r1 - 1), c1 - c0 + 1, r1 - r0 + 1, fc=MODEL_COLORS[m], ec="white", lw=2, alpha=0.85
                )
            )
            ax.text(
                (c0 + c1 + 1) / 2,
                shape[0] - (r0 + r1 + 1) / 2,
                f"device {device_id}",
                ha="center",
                va="center",
                color="white",
                weight="bold",
            )
        ax.set_xlim(0, shape[1])
        ax.set_ylim(0, shape[0])
        ax.set_aspect("equal")
        ax.set_xticks([0, shape[1]])
        ax.set_yticks([0, shape[0]], [str(shape[0]), "0"])
        ax.set_xlabel(f"in_features ({shape[1]})")
        ax.set_ylabel(f"out_features ({shape[0]})")
        ax.set_title(f"{title}\nweight {tuple(shape)}, spec {spec}", fontsize=10)
    save(fig, "column_row.png")


# --- (c) all_gather, psum_scatter, psum ------------------------------------------------------


def collectives_inputs() -> dict[str, Any]:
    """What each of 4 devices holds before, and after each collective (run under shard_map)."""
    mesh = eqxpar.make_mesh(i=4)
    x = jnp.arange(16.0).reshape(4, 4)  # device d holds row d: [4d, 4d+1, 4d+2, 4d+3]
    ops = {
        "all_gather(x, 'i', tiled=True)": lambda v: jax.lax.all_gather(v[0], "i", tiled=True)[None],
        "psum_scatter(x, 'i', tiled=True)": lambda v: jax.lax.psum_scatter(v[0], "i", tiled=True)[None],
        "psum(x, 'i')": lambda v: jax.lax.psum(v, "i"),
    }
    results = {
        name: jax.jit(jax.shard_map(op, mesh=mesh, in_specs=P("i"), out_specs=P("i")))(x) for name, op in ops.items()
    }
    before = [[float(v) for v in x[d]] for d in range(4)]
    after = {name: [[float(v) for v in row] for row in out.reshape(4, -1)] for name, out in results.items()}
    return {"collectives.png": {"before": before, "after": after}}


def collectives(inputs: dict[str, Any]) -> None:
    before, results = inputs["collectives.png"]["before"], inputs["collectives.png"]["after"]
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 7.6))
    for ax, (name, after) in zip(axes, results.items()):
        for d in range(4):
            y = 3 - d
            ax.text(-0.4, y + 0.4, f"device {d}", ha="right", va="center", weight="bold", color=MODEL_COLORS[d])
            for k, v in enumerate(before[d]):
                ax.add_patch(Rectangle((k, y), 0.95, 0.8, fc=MODEL_COLORS[d], alpha=0.8))
                ax.text(k + 0.47, y + 0.4, f"{v:g}", ha="center", va="center", color="white")
            for k, v in enumerate(after[d]):
                # a value's colour: the device it came from (sums are grey)
                source = int(v) // 4 if name.startswith("all_gather") else None
                color = MODEL_COLORS[source] if source is not None else "#555555"
                ax.add_patch(Rectangle((6 + k * 0.95, y), 0.9, 0.8, fc=color, alpha=0.8))
                ax.text(6 + k * 0.95 + 0.45, y + 0.4, f"{v:g}", ha="center", va="center", color="white", fontsize=9)
        ax.annotate("", xy=(5.8, 2.0), xytext=(4.2, 2.0), arrowprops={"arrowstyle": "->", "lw": 2})
        ax.text(1.9, 4.05, "before: x split P('i'), 4 values each", ha="center")
        ax.text(6, 4.05, f"after {name}: {len(after[0])} value(s) each", ha="left", weight="bold")
        ax.set_xlim(-2.2, 21.5)
        ax.set_ylim(-0.1, 4.5)
        ax.axis("off")
    fig.suptitle("Collectives over a 4-device mesh axis 'i' (values computed by jax.shard_map)", y=0.995)
    save(fig, "collectives.png")


# --- (d) two hosts ---------------------------------------------------------------------------


def two_hosts_inputs() -> dict[str, Any]:
    """The mesh a real two-process run recorded: (device id, process) per position."""
    recorded = json.loads((LOSSES / "multihost.json").read_text()).get("mesh_data2_model4")
    if not recorded:
        raise SystemExit("make_figures: docs/data/losses/multihost.json has no mesh_data2_model4: run `make figures`")
    return {"two_hosts.png": {"mesh": recorded}}


def two_hosts(inputs: dict[str, Any]) -> None:
    recorded = inputs["two_hosts.png"]["mesh"]
    fig, ax = plt.subplots(figsize=(10, 4.6))
    for d, row in enumerate(recorded):  # a mesh row; its processes (one each, as make_mesh lays them out)
        procs = ", ".join(str(p) for p in sorted({p for _, p in row}))
        ax.add_patch(
            FancyBboxPatch(
                (-0.3, (1 - d) * 2.1 - 0.25), 9.6, 1.85, boxstyle="round,pad=0.05", fc="#f3f3f3", ec="#888888", lw=1.5
            )
        )
        ax.text(-0.5, (1 - d) * 2.1 + 0.65, f"process {procs}\n(host {procs})", ha="right", va="center", weight="bold")
        for m, (device_id, _) in enumerate(row):
            x, y = m * 2.3, (1 - d) * 2.1
            ax.add_patch(
                FancyBboxPatch((x, y), 2.0, 1.3, boxstyle="round,pad=0.02", fc=DATA_COLORS[d], ec=MODEL_COLORS[m], lw=3)
            )
            ax.text(x + 1.0, y + 0.85, f"device {device_id}", ha="center", weight="bold")
            ax.text(x + 1.0, y + 0.35, f"data={d}, model={m}", ha="center", fontsize=8)
    ax.annotate("", xy=(9.6, 0.65), xytext=(9.6, 2.75), arrowprops={"arrowstyle": "<->", "lw": 2, "color": "#c0392b"})
    ax.text(9.75, 1.7, "data axis:\ngradient all-reduce\nbetween hosts", va="center", color="#c0392b")
    ax.text(4.5, -0.65, "model axis: the layers' collectives stay inside one host", ha="center", color="#1f4e79")
    ax.set_title(
        "make_mesh(data=2, model=4) in a real run of eqxpar.launch --nproc 2 --devices-per-proc 4", fontsize=10
    )
    ax.set_xlim(-2.1, 12.3)
    ax.set_ylim(-0.9, 4.0)
    ax.axis("off")
    save(fig, "two_hosts.png")


# --- (e) loss curves -------------------------------------------------------------------------


def loss_curves_inputs() -> dict[str, Any]:
    """Per recipe: its recorded losses, steps, command and source."""
    files = sorted(LOSSES.glob("*.json"))
    if not files:
        raise SystemExit("make_figures: no docs/data/losses/*.json: run `make figures` once")
    out = {}
    for path in files:
        run = json.loads(path.read_text())
        out[f"loss_{run['recipe']}.png"] = {k: run[k] for k in ("steps", "loss", "command", "source")}
    return out


def loss_curves(inputs: dict[str, Any]) -> None:
    for name, run in inputs.items():
        fig, ax = plt.subplots(figsize=(6.4, 3.2))
        ax.plot(
            run["steps"],
            run["loss"],
            color=MODEL_COLORS[0],
            lw=1.5,
            marker="o" if len(run["loss"]) < 40 else None,
            ms=3,
        )
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.grid(alpha=0.3)
        ax.set_title(f"{run['command']}\n(loss from {run['source']})", fontsize=9)
        save(fig, name)


def precision_gaps(fp32: list[float], bf16: list[float]) -> dict[str, float]:
    """The relative gap `|bf16 - fp32| / fp32` of two loss curves: its largest value over
    the steps, at the last step, and of the means of the last 10 steps."""
    import numpy as np

    a, b = np.asarray(fp32, np.float64), np.asarray(bf16, np.float64)
    if a.shape != b.shape or a.size < 10:
        raise SystemExit(
            f"make_figures: the float32 and bfloat16 runs need the same steps (10 or more), got {a.size} and {b.size}"
        )
    gap = np.abs(b - a) / a
    return {
        "max": float(gap.max()),
        "final": float(gap[-1]),
        "last10": float(abs(b[-10:].mean() - a[-10:].mean()) / a[-10:].mean()),
    }


def precision_curves_inputs() -> dict[str, Any]:
    """The float32 and bfloat16 runs' losses, steps and commands."""
    runs = {}
    for path in sorted((LOSSES / "precision").glob("*.json")):
        run = json.loads(path.read_text())
        runs[run["final_metrics"].get("dtype")] = run
    if set(runs) != {"float32", "bfloat16"}:
        raise SystemExit(
            "make_figures: docs/data/losses/precision/ needs a float32 and a bfloat16 run: run `make figures`"
        )
    keep = {
        dtype: {"steps": run["steps"], "loss": run["loss"], "command": run["command"], "dtype": dtype}
        for dtype, run in runs.items()
    }
    return {"loss_precision.png": keep}


def precision_curves(inputs: dict[str, Any]) -> None:
    fp32, bf16 = inputs["loss_precision.png"]["float32"], inputs["loss_precision.png"]["bfloat16"]
    gaps = precision_gaps(fp32["loss"], bf16["loss"])
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.4, 4.8), sharex=True, height_ratios=(2, 1))
    for run, color in ((fp32, MODEL_COLORS[0]), (bf16, MODEL_COLORS[1])):
        dtype = run["dtype"]
        top.plot(run["steps"], run["loss"], color=color, lw=1.2, label=f"--dtype {dtype} (final {run['loss'][-1]:.3f})")
    top.set_ylabel("training loss")
    top.legend()
    gap = [abs(b - a) / a for a, b in zip(fp32["loss"], bf16["loss"])]
    bottom.plot(fp32["steps"], [100 * g for g in gap], color="#555555", lw=1)
    bottom.set_ylabel("|bf16 - fp32| / fp32 (%)")
    bottom.set_xlabel("step")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    command = fp32["command"].replace("--dtype float32", "--dtype {float32, bfloat16}")
    top.set_title(
        f"{command}\nrelative gap: max {gaps['max']:.2%} per step, "
        f"{gaps['final']:.2%} at the last step, {gaps['last10']:.2%} on the last 10 steps' mean",
        fontsize=9,
    )
    save(fig, "loss_precision.png")


# --- (f) benchmark bars ----------------------------------------------------------------------


def benchmark_table(text: str) -> list[dict[str, str]]:
    """The rows of the `strategy  step ms ...` table on docs/benchmarks.md, as dicts."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if (
            line.startswith("strategy ")
            and "step ms" in line
            and i + 1 < len(lines)
            and set(lines[i + 1]) <= {"-", " "}
        ):
            cols = [(m.start(), m.end()) for m in re.finditer(r"-+", lines[i + 1])]
            names = [line[a:b].strip() for a, b in cols]
            rows = []
            for row in lines[i + 2 :]:
                if not row.strip():
                    break
                rows.append({n: row[a:b].strip() for n, (a, b) in zip(names, cols)})
            return rows
    raise SystemExit("make_figures: docs/benchmarks.md has no `strategy  step ms ...` table to draw")


def benchmarks_inputs() -> dict[str, Any]:
    """The rows of docs/benchmarks.md's table."""
    return {"bench_strategies.png": {"rows": benchmark_table((DOCS / "benchmarks.md").read_text())}}


def benchmarks(inputs: dict[str, Any]) -> None:
    rows = inputs["bench_strategies.png"]["rows"]
    number = lambda s: float(s.replace(",", ""))  # noqa: E731
    panels = [
        ("step ms", "step time (ms, 8 CPU devices)", 1),
        ("comm B/device", "collective bytes per device per step (MB)", 1e6),
        ("state/device", "parameters + Adam state per device (MB)", 1e6),
        ("temp/device", "XLA temporaries per device (MB)", 1e6),
    ]
    panels = [p for p in panels if p[0] in rows[0]]
    labels = [r["strategy"] for r in rows]
    # Two panels a row: the picture is shown at the text column's width (about 700 px), where
    # four side by side shrank their labels below legibility.
    columns = min(2, len(panels))
    fig, grid = plt.subplots(
        -(-len(panels) // columns), columns, figsize=(9.0, 3.1 * -(-len(panels) // columns)), sharey=True, squeeze=False
    )
    axes = list(grid.flat)
    for ax in axes[len(panels) :]:
        ax.axis("off")
    for ax, (column, title, scale) in zip(axes, panels):
        values = [number(r[column]) / scale for r in rows]
        ax.barh(range(len(rows)), values, color=[MODEL_COLORS[i % len(MODEL_COLORS)] for i in range(len(rows))])
        ax.set_title(title, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[0].invert_yaxis()  # shared: once, the table's first row on top
    axes[0].set_yticks(range(len(rows)), labels)
    fig.suptitle("benchmarks/strategies.py (the table above)", fontsize=11)
    fig.tight_layout()
    save(fig, "bench_strategies.png")


def _architecture_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("eqxpar_docs_architecture", DOCS / "figures" / "architecture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def architecture_inputs() -> dict[str, Any]:
    """What the picture shows of the import graph: the layers and their parts' labels, the
    arrows between parts and the imports that break the layering."""
    module = _architecture_module()
    graph = module.import_graph()
    parts = [part for _, layer in module.LAYERS for part in layer]
    return {
        "architecture.png": {
            "layers": [[title, list(layer)] for title, layer in module.LAYERS],
            "labels": {part: module._label(part) for part in parts},
            "edges": sorted(module.part_edges(graph)),
            "violations": sorted(module.violations(graph)),
        }
    }


def architecture(inputs: dict[str, Any]) -> None:
    """`architecture.png`: eqxpar's layers and the imports between them, read from the source
    by docs/figures/architecture.py (tests/test_architecture.py checks the same layering)."""
    _architecture_module().draw(IMAGES / "architecture.png")
    print("make_figures: docs/images/architecture.png")


def pipeline_schedules_inputs() -> dict[str, Any]:
    """The three schedules' tables: per tick and stage, the micro-batch and chunk each pass works on."""
    from eqxpar.train import make_schedule

    tables = [make_schedule("gpipe", 4, 8), make_schedule("circular", 4, 8, 2), make_schedule("1f1b", 4, 8)]
    return {
        "pipeline_schedules.png": [
            {
                "name": t.name,
                "ticks": t.ticks,
                "stages": t.stages,
                "virtual_stages": t.virtual_stages,
                "bubble": t.bubble_fraction(),
                "in_flight": t.max_in_flight(),
                **{k: getattr(t, k).tolist() for k in ("forward", "forward_chunk", "backward", "backward_chunk")},
            }
            for t in tables
        ]
    }


def pipeline_schedules(inputs: dict[str, Any]) -> None:
    """`pipeline_schedules.png`: which micro-batch each stage works on at each tick, for
    GPipe, circular and 1F1B (P=4, M=8), from `eqxpar.train.make_schedule`: the tables the
    pipeline step runs."""
    from eqxpar.train import make_schedule

    tables = [make_schedule("gpipe", 4, 8), make_schedule("circular", 4, 8, 2), make_schedule("1f1b", 4, 8)]
    fig, axes = plt.subplots(len(tables), 1, figsize=(12, 6.5))
    for ax, table in zip(axes, tables):
        for t in range(table.ticks):
            for s in range(table.stages):
                cells = [(m, c, "F") for m, c in [(table.forward[t, s], table.forward_chunk[t, s])] if m >= 0]
                cells += [(m, c, "B") for m, c in [(table.backward[t, s], table.backward_chunk[t, s])] if m >= 0]
                for k, (mb, chunk, kind) in enumerate(cells):
                    height = 1.0 / len(cells)
                    color = MODEL_COLORS[int(mb) % len(MODEL_COLORS)]
                    ax.add_patch(
                        Rectangle(
                            (t, s + k * height),
                            1,
                            height,
                            facecolor=color,
                            edgecolor="white",
                            alpha=0.45 if kind == "F" else 1.0,
                            hatch=None if chunk <= 0 else "//",
                        )
                    )
                    ax.text(t + 0.5, s + (k + 0.5) * height, f"{kind}{mb}", ha="center", va="center", fontsize=6)
        ax.set_xlim(0, table.ticks)
        ax.set_ylim(table.stages, 0)
        ax.set_yticks([s + 0.5 for s in range(table.stages)], [f"stage {s}" for s in range(table.stages)])
        ax.set_xticks([])
        r = f", r={table.virtual_stages} (hatched: 2nd chunk)" if table.virtual_stages > 1 else ""
        ax.set_title(
            f"{table.name}{r}: {table.ticks} ticks, bubble {table.bubble_fraction():.3f}, "
            f"up to {table.max_in_flight()} stage inputs kept",
            fontsize=10,
        )
    fig.supxlabel("tick (light: forward, dark: backward; colour: micro-batch)")
    save(fig, "pipeline_schedules.png")


def sequence_parallel_positions_inputs() -> dict[str, Any]:
    """`sequence_parallel.png`: which positions of the residual stream each device holds
    between the tensor-parallel layers, without and with Megatron sequence parallelism
    (and with context parallelism too), read from what the GPT's token embedding returns
    (`VocabParallelEmbedding(..., sequence_dim=-1)` reduce-scatters its lookup) on a table
    whose row `t` is the number `t`, fed the positions as token ids."""
    length = 16
    table = eqx.nn.Embedding(weight=jnp.arange(length, dtype=jnp.float32)[:, None])  # id t -> the number t
    embedding = eqxpar.nn.VocabParallelEmbedding.from_dense(table, axis_name="model")
    cases = [
        ({"model": 4}, False, "tensor parallelism, model=4: every device holds the whole sequence (embedding: psum)"),
        ({"model": 4}, True, "+ sequence parallelism: each holds S/4 positions (embedding: psum_scatter)"),
        ({"context": 2, "model": 2}, True, "context=2 (zigzag) x model=2 with sequence parallelism: S/(C N) each"),
    ]
    panels = []
    for shape, sequence_parallel, title in cases:
        mesh = eqxpar.make_mesh(**shape)
        contexts = shape.get("context", 1)
        order = eqxpar.nn.layout_order(length, contexts, "zigzag") if contexts > 1 else jnp.arange(length)
        tokens = jnp.asarray(order)[None]  # one sequence whose ids are its positions, in the devices' layout

        # the positions this device's residual stream holds, gathered to all (mesh and
        # sequence_parallel bound as defaults: ruff B023)
        def held(embedding, tokens, mesh=mesh, sequence_parallel=sequence_parallel):
            x = embedding(tokens, sequence_dim=-1 if sequence_parallel else None)[..., 0]
            return jax.lax.all_gather(x, tuple(mesh.axis_names))

        spec = P(None, "context" if contexts > 1 else None)
        shard = eqxpar.filter_shard_map(
            held, mesh=mesh, in_specs=(eqxpar.nn.partition_specs(embedding, mesh), spec), out_specs=P(), check_vma=False
        )
        positions = shard(embedding, tokens).reshape(mesh.devices.size, -1)
        rows = []
        for row, device in enumerate(mesh.devices.flat):
            where = dict(zip(mesh.axis_names, mesh_position(mesh, device)))
            label = ", ".join(f"{k}={v}" for k, v in where.items())
            rows.append([f"device {device.id} ({label})", sorted({int(p) for p in positions[row]})])
        panels.append({"title": title, "rows": rows})
    return {"sequence_parallel.png": {"length": length, "panels": panels}}


def sequence_parallel_positions(inputs: dict[str, Any]) -> None:
    """`sequence_parallel.png`: the positions of `sequence_parallel_positions_inputs`."""
    length, panels = inputs["sequence_parallel.png"]["length"], inputs["sequence_parallel.png"]["panels"]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10.5, 7.4), gridspec_kw={"height_ratios": [4, 4, 4]})
    for ax, panel in zip(axes, panels):
        title, size = panel["title"], len(panel["rows"])
        for row, (label, held) in enumerate(panel["rows"]):
            y = size - 1 - row
            ax.text(-0.3, y + 0.4, label, ha="right", va="center", fontsize=9)
            mine = set(held)
            for p in range(length):
                color = MODEL_COLORS[row] if p in mine else "#eeeeee"
                ax.add_patch(Rectangle((p, y), 0.92, 0.8, fc=color, ec="#bbbbbb", lw=0.5))
                ax.text(
                    p + 0.46,
                    y + 0.4,
                    str(p),
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="white" if p in mine else "#999999",
                )
        ax.set_title(title, fontsize=10, loc="left")
        ax.set_xlim(-5.2, length + 0.2)
        ax.set_ylim(-0.2, size)
        ax.axis("off")
    fig.suptitle(
        f"Positions 0-{length - 1} of the residual stream held by each device, between the TP layers "
        "(computed by the GPT's embedding)",
        fontsize=10,
        y=1.0,
    )
    save(fig, "sequence_parallel.png")


def expert_routing_inputs() -> dict[str, Any]:
    """`expert_routing.png`: where the tokens of a `MixtureOfExperts` go on `expert=4`
    (one expert per device, top-1, capacity factor 1: 2 slots per expert and sequence),
    each device holding one sequence of 8 tokens. Read from the layer itself under
    `shard_map`: each token's expert from `tokens_per_expert` with every token its own
    routing group (the router scores tokens one by one), the drops per sequence from
    `dropped` with each sequence one group."""
    tokens, experts, dim = 8, 4, 8
    mesh = eqxpar.make_mesh(expert=experts)
    moe = eqxpar.nn.MixtureOfExperts(dim, 16, experts, 1, capacity_factor=1.0, key=jax.random.key(3))
    x = jax.random.normal(jax.random.key(4), (experts, tokens, dim))
    specs = eqxpar.nn.partition_specs(moe, mesh)

    def route(moe, x):
        return moe(x)[1]

    # Compiled once per shape (op by op it took 13 s of the docs-figures test's setup).
    routed = eqxpar.filter_shard_map(route, mesh=mesh, in_specs=(specs, P("expert")), out_specs=P("expert"))
    run = eqx.filter_jit(routed)
    per_token = run(moe, x.reshape(experts * tokens, 1, dim))  # every token its own group
    per_sequence = run(moe, x)  # every sequence one group
    chosen = [[int(c) for c in jnp.argmax(per_token.tokens_per_expert.reshape(experts, tokens, experts), -1)[d]]
              for d in range(experts)]  # fmt: skip
    capacity = moe.capacity(tokens)
    # Priority in token order: an expert's first `capacity` tokens of a sequence are kept.
    kept = [[chosen[d][: t + 1].count(chosen[d][t]) <= capacity for t in range(tokens)] for d in range(experts)]
    dropped = [int(n) for n in per_sequence.dropped]
    assert dropped == [row.count(False) for row in kept], (dropped, kept)  # the layer's own count
    return {"expert_routing.png": {"capacity": capacity, "chosen": chosen, "kept": kept, "dropped": dropped}}


def expert_routing(inputs: dict[str, Any]) -> None:
    """`expert_routing.png`: the tokens of `expert_routing_inputs` before the first
    all-to-all (on their devices) and after it (in their experts' slots)."""
    data = inputs["expert_routing.png"]
    chosen, kept, capacity = data["chosen"], data["kept"], data["capacity"]
    n, tokens = len(chosen), len(chosen[0])
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(13, 3.8), gridspec_kw={"width_ratios": [tokens, n * capacity], "wspace": 0.3}
    )
    for d in range(n):
        y = n - 1 - d
        left.text(-0.3, y + 0.4, f"device {d}", ha="right", va="center", fontsize=9)
        for t in range(tokens):
            e = chosen[d][t]
            style = {"fc": MODEL_COLORS[e]} if kept[d][t] else {"fc": "white", "ec": MODEL_COLORS[e], "hatch": "//"}
            left.add_patch(Rectangle((t, y), 0.9, 0.8, lw=1, **style))
            left.text(t + 0.45, y + 0.4, f"t{t}", ha="center", va="center", fontsize=8,
                      color="white" if kept[d][t] else "black")  # fmt: skip
        right.text(n * capacity + 0.2, y + 0.4, f"device {d}: expert {d}", ha="left", va="center", fontsize=9)
        # Device d's buffer after the all-to-all: expert d's slots from every device, in device order.
        for source in range(n):
            mine = [t for t in range(tokens) if chosen[source][t] == d and kept[source][t]]
            for slot in range(capacity):
                x0 = source * capacity + slot
                if slot < len(mine):
                    right.add_patch(Rectangle((x0, y), 0.9, 0.8, fc=MODEL_COLORS[d], lw=0))
                    right.text(x0 + 0.45, y + 0.4, f"d{source}\nt{mine[slot]}", ha="center", va="center",
                               fontsize=7, color="white")  # fmt: skip
                else:
                    right.add_patch(Rectangle((x0, y), 0.9, 0.8, fc="#eeeeee", ec="#bbbbbb", lw=0.5))
    left.set_title("before: each device's own sequence\ncolour = the expert chosen, hatched = dropped", fontsize=9)
    right.set_title(
        f"after the all_to_all: expert e's {capacity} slots\nfrom each device (d0..d3), in device order", fontsize=9
    )
    for ax, width in ((left, tokens), (right, n * capacity)):
        ax.set_xlim(-0.1, width)
        ax.set_ylim(-0.1, n)
        ax.axis("off")
    fig.suptitle(
        f"MixtureOfExperts on expert={n}: top-1 routing, capacity {capacity} per expert and sequence "
        f"(dropped per device: {data['dropped']}; computed by the layer under shard_map)",
        fontsize=10,
        y=1.08,
    )
    save(fig, "expert_routing.png")


# --- the layout planner's candidates ----------------------------------------------------------


def planner_pareto_inputs() -> dict[str, Any]:
    """Every layout `eqxpar.plan.plan` prices for the 1.3b GPT on one 8-GPU H100 node (64
    sequences of 2,048 tokens, bfloat16 compute, AdamW): predicted step time and peak memory
    per device, whether it fits, and which are on the Pareto front (no other layout is both
    faster and smaller)."""
    machine = eqxpar.plan.cluster("h100")  # `import eqxpar` imports eqxpar.plan and eqxpar.models
    plans = eqxpar.plan.plan(
        eqxpar.models.gpt_config("1.3b"), batch=64, cluster=machine, top=None, include_infeasible=True
    )
    # The front from the unrounded figures: layouts that tie to the rounding (e.g. data=8 and
    # fsdp=8) differ by microseconds, and the fastest plan is on the front by definition.
    front, best = [], float("inf")
    for p in sorted(plans, key=lambda p: (p.memory.peak, p.time.expected)):
        if p.time.expected < best:
            front.append(str(p.layout))
            best = p.time.expected
    points = [
        {
            "layout": str(p.layout),
            "peak_gb": round(p.memory.peak / 1e9, 2),
            "step_ms": round(p.time.expected * 1e3, 1),
            "fits": p.fits,
        }
        for p in plans
    ]
    chosen = str(plans[0].layout)
    title = f"1.3b GPT, batch 64 x 2,048 tokens, on {machine.name} ({machine.memory_per_device / 1e9:.0f} GB each)"
    return {
        "planner_pareto.png": {
            "points": points,
            "front": front,
            "chosen": chosen,
            "memory_gb": machine.memory_per_device / 1e9,
            "title": title,
        }
    }


def planner_pareto(inputs: dict[str, Any]) -> None:
    data = inputs["planner_pareto.png"]
    points, front = data["points"], set(data["front"])
    fig, ax = plt.subplots(figsize=(8.0, 4.6))
    for fits, color, label in ((True, MODEL_COLORS[0], "fits"), (False, "#bbbbbb", "does not fit")):
        chosen = [q for q in points if q["fits"] == fits]
        ax.scatter([q["peak_gb"] for q in chosen], [q["step_ms"] for q in chosen], s=12, color=color, label=label)
    line = sorted((q for q in points if q["layout"] in front), key=lambda q: q["peak_gb"])
    ax.step(
        [q["peak_gb"] for q in line],
        [q["step_ms"] for q in line],
        where="post",
        color=MODEL_COLORS[1],
        lw=1.5,
        label="Pareto front",
    )
    ax.scatter([q["peak_gb"] for q in line], [q["step_ms"] for q in line], s=28, color=MODEL_COLORS[1], zorder=3)
    ax.axvline(data["memory_gb"], color=MODEL_COLORS[4], ls="--", lw=1, label="memory per device")
    (best,) = [q for q in points if q["layout"] == data["chosen"]]
    ax.annotate(
        f"the plan: {best['layout']}",
        (best["peak_gb"], best["step_ms"]),
        xytext=(25, 90),
        textcoords="offset points",
        fontsize=9,
        arrowprops={"arrowstyle": "->", "lw": 0.8},
    )
    ax.set_xlabel("predicted peak memory per device (GB)")
    ax.set_ylabel("predicted step time (ms)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9, loc="upper right")
    ax.set_title(f"{len(points)} layouts priced by eqxpar.plan.plan: {data['title']}", fontsize=9)
    save(fig, "planner_pareto.png")


# --- the manifest: what each picture was drawn from -----------------------------------------

FIGURES: tuple[Callable[[dict[str, Any]], None], ...] = (
    mesh_grid,
    column_row,
    collectives,
    two_hosts,
    loss_curves,
    precision_curves,
    benchmarks,
    architecture,
    pipeline_schedules,
    sequence_parallel_positions,
    expert_routing,
    planner_pareto,
)


def inputs_of(draw: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """A figure's inputs, `{png name: JSON-able data}`, from its `<name>_inputs` function."""
    return globals()[f"{draw.__name__}_inputs"]()


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _code(function: Callable) -> str:
    """The syntax tree of a function without its docstring: what it does, not how it is laid out."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    node = tree.body[0]
    if node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
        node.body = node.body[1:]
    return ast.dump(tree)


def code_digest(draw: Callable[[dict[str, Any]], None]) -> str:
    """A hash of the code that draws a figure: its drawing and inputs functions, the shared
    style (colours, sizes) and, for the architecture, docs/figures/architecture.py's drawing."""
    parts = [_code(draw), _code(globals()[f"{draw.__name__}_inputs"])]
    parts.append(json.dumps([DATA_COLORS, MODEL_COLORS, DPI]))
    if draw is architecture:
        module = _architecture_module()
        parts += [_code(module.draw), _code(module._positions)]
    return _digest(parts)


def manifest_entries(draw: Callable[[dict[str, Any]], None], inputs: dict[str, Any]) -> dict[str, dict[str, str]]:
    """The manifest's entries for one figure: per PNG, the hashes of its inputs and code."""
    code = code_digest(draw)
    return {name: {"drawn_by": draw.__name__, "inputs": _digest(data), "code": code} for name, data in inputs.items()}


def main() -> None:
    IMAGES.mkdir(exist_ok=True)
    only = set(sys.argv[1:])
    manifest = json.loads(MANIFEST.read_text()) if MANIFEST.exists() else {}
    for draw in FIGURES:
        if not only or draw.__name__ in only:
            inputs = inputs_of(draw)
            draw(inputs)
            manifest = {k: v for k, v in manifest.items() if v.get("drawn_by") != draw.__name__}
            manifest.update(manifest_entries(draw, inputs))
    MANIFEST.write_text(json.dumps(dict(sorted(manifest.items())), indent=2) + "\n")
    print("make_figures: docs/images/manifest.json")


if __name__ == "__main__":
    main()
