"""Benchmark: the GPT's training step on whatever accelerators exist, in one command.

For GPT-2 small's shape ("124m": 12 x 768, 12 heads, 1024 tokens) and GPT-3 XL's ("1.3b":
24 x 2048, 16 heads, 2048 tokens), both with GPT-2's 50257-token vocabulary, it trains
with bfloat16 compute (float32 master weights and AdamW state), the blocks in a Python loop
(`scan_layers=False`: on an H200 7 to 8% faster than under `lax.scan`, docs/benchmarks.md),
cuDNN's fused attention where it applies, and a few (remat, batch) candidates each, and
writes per candidate:

- **step time** (median over rounds of several steps, dispatched without a host sync in
  between, as a training loop runs) and **tokens/s**;
- **MFU**: tokens/s x `eqxpar.models.gpt_flops_per_token` (`6 N + 12 L T d`, the count
  llm.c, nanotron, MaxText and NeMo use: the output head included, attention counted
  without causal halving) / (devices x the chip's dense bf16 peak,
  `eqxpar.inspect.peak_flops`);
- **memory**: the device's peak bytes in use (`memory_stats`), or `OOM`;
- **fused attention**: whether the compiled step holds cuDNN's attention kernel;
- the loss of the first and last step (it must be finite and fall: every step trains on
  the same batch of uniformly drawn tokens, which the model memorises).

Each candidate runs in its own process (a clean memory peak, and an out-of-memory candidate
cannot spoil the next). Candidates run best-first and stop at `--budget-s` (default 420 s),
so the whole run ends within 8 minutes on one GPU. The XLA flags for GPUs are set before
JAX starts (`GPU_XLA_FLAGS` below; each flag this JAX does not know is dropped and listed).

Run: `python benchmarks/gpu.py --out results/` writes `gpu_bench.json` and `gpu_bench.md`;
`--quick` runs a tiny GPT for a few steps on any backend (the test suite runs it on CPU).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

# The flags the fastest JAX GPU training runs set (MaxText's and Paxml's GPU guides, the XLA
# GPU flag reference): the latency-hiding scheduler overlaps collectives with compute;
# collectives combined into large messages and pipelined out of scanned layers; the async
# collectives on a high-priority stream; while-loop double buffering for scanned layers. On
# one GPU none of them moved a step time by more than the noise (docs/benchmarks.md, H200,
# 2026-11-26). Not set: `--xla_gpu_enable_triton_gemm=false` (cuBLAS for every GEMM, which
# MaxText's GPU configs set), measured slower here: the 1.3b step with remat="save_matmuls"
# took 640 ms with it and 578-582 ms without, twice each (XLA's Triton GEMMs fuse the
# recomputed elementwise work into the matmuls).
GPU_XLA_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_highest_priority_async_stream=true",
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
    "--xla_gpu_enable_pipelined_all_gather=true",
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_pipelined_all_reduce=true",
    "--xla_gpu_enable_while_loop_double_buffering=true",
)

VOCAB = 50257  # GPT-2's BPE vocabulary (padded to 50304 by the GPT)

# (context, dim, heads, layers) and the (remat, sequences per device) candidates, best-first
# by expectation: no recomputation while it fits, then larger batches that recompute.
CONFIGS = {
    "124m": ((1024, 768, 12, 12), (("none", 32), ("none", 64), ("save_matmuls", 64))),
    "1.3b": ((2048, 2048, 16, 24), (("none", 8), ("save_matmuls", 16), ("block", 16))),
    "quick": ((32, 64, 4, 2), (("none", 4), ("save_matmuls", 4))),
}


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="124m,1.3b", help=f"comma-separated, from {sorted(CONFIGS)}")
    parser.add_argument("--quick", action="store_true", help="the tiny config only, few steps (any backend)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per candidate")
    parser.add_argument("--steps", type=int, default=5, help="steps per round, dispatched without a sync")
    parser.add_argument("--budget-s", type=float, default=420, help="start no candidate after this many seconds")
    parser.add_argument("--no-xla-flags", action="store_true", help="run without GPU_XLA_FLAGS (an A/B)")
    parser.add_argument("--out", type=Path, help="folder for gpu_bench.json and gpu_bench.md")
    parser.add_argument(
        "--candidates",
        help="config:remat:batch-per-device[:loop],... in place of each config's own list (e.g. 124m:none:16); "
        "`:scan` runs the blocks under lax.scan instead of a Python loop",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        help="trace this many steps of each candidate and add its per-operation profile (profile_step.py's tables)",
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: one candidate, as JSON
    args = parser.parse_args(argv)
    if args.quick:
        args.configs, args.rounds, args.steps = "quick", 2, 2
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(args.configs) - set(CONFIGS))
    if unknown:
        parser.error(f"--configs: unknown {unknown}; choose from {sorted(CONFIGS)}")
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be at least 1")
    if args.profile < 0:
        parser.error(f"--profile must be at least 0, got {args.profile}")
    args.chosen = None
    if args.candidates:
        args.chosen = {}
        for item in args.candidates.split(","):
            parts = item.strip().split(":")
            ok = len(parts) in (3, 4) and parts[0] in CONFIGS and parts[2].isdigit() and int(parts[2]) >= 1
            if not ok or parts[3:] not in ([], ["loop"], ["scan"]):
                parser.error(
                    f"--candidates: {item!r} is not config:remat:batch-per-device[:scan] (configs {sorted(CONFIGS)})"
                )
            args.chosen.setdefault(parts[0], []).append((parts[1], int(parts[2]), parts[3:] == ["scan"]))
        args.configs = list(args.chosen)
    return args


def accepted_flags(flags, env) -> tuple[list[str], list[str]]:
    """The flags a JAX process starts with, and the ones it rejects (XLA aborts at start on
    a flag it does not know: each is tried alone once the whole set fails)."""

    def starts(candidate) -> bool:
        trial = dict(env, XLA_FLAGS=" ".join([env.get("XLA_FLAGS", ""), *candidate]).strip())
        code = "import jax; jax.devices()"
        return subprocess.run([sys.executable, "-c", code], env=trial, capture_output=True).returncode == 0

    if starts(flags):
        return list(flags), []
    good = [f for f in flags if starts([f])]
    return good, [f for f in flags if f not in good]


def run_candidate(spec: dict) -> dict:
    """Build, compile and time one (config, remat, batch) candidate in this process."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import PartitionSpec as P

    import eqxpar
    from eqxpar.inspect import mfu
    from eqxpar.models import GPT, gpt_flops_per_token, next_token_loss
    from eqxpar.nn import partition_specs
    from eqxpar.train import Precision, hybrid_step

    context, dim, heads, layers = spec["shape"]
    n = jax.device_count()
    mesh = eqxpar.make_mesh(data=n, model=1)
    batch_size = spec["per_device"] * n
    gpt = GPT(
        VOCAB,
        context,
        dim,
        heads,
        layers,
        scan_layers=spec["scan"],
        remat=spec["remat"],
        attention_impl=spec["attention"],
        key=jax.random.key(0),
    )
    step = hybrid_step(
        lambda model, batch, key: next_token_loss(model, batch, key=key),
        optax.adamw(3e-4, weight_decay=0.1),
        mesh,
        param_specs=partition_specs(gpt, mesh),
        precision=Precision(compute_dtype=jnp.bfloat16),
    )
    model, opt_state = step.init(gpt)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (batch_size, context + 1), dtype=np.int32)
    batch = eqxpar.shard(tokens, mesh, P("data"))
    fused = all(word in step.lower(model, opt_state, batch).as_text().lower() for word in ("cudnn", "fmha"))
    transposes = None
    t = time.perf_counter()  # with hlo_path the compile is timed here, the first call reuses it
    if spec.get("hlo_path"):  # the compiled (optimised) program, for reading its fusions and layouts
        optimised = step.lower(model, opt_state, batch).compile().as_text()
        Path(spec["hlo_path"]).write_text(optimised)
        transposes = len(re.findall(r"calls=%\w*transpose", optimised))  # fusions that transpose
    model, opt_state, metrics = step(model, opt_state, batch)
    first_loss = float(metrics["loss"])  # waits: compile + first step
    compile_s = time.perf_counter() - t
    times = []
    for _ in range(spec["rounds"]):
        t = time.perf_counter()
        for _ in range(spec["steps"]):
            model, opt_state, metrics = step(model, opt_state, batch)
        jax.block_until_ready(metrics["loss"])
        times.append((time.perf_counter() - t) / spec["steps"])
    step_s = statistics.median(times)
    profile = _profile(step, (model, opt_state, batch), spec["profile"]) if spec.get("profile") else None
    flops_per_token = gpt_flops_per_token(gpt, context)
    tokens_per_s = batch_size * context / step_s
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    return dict(
        step_ms=1e3 * step_s,
        tokens_per_s=tokens_per_s,
        flops_per_token=flops_per_token,
        mfu=mfu(tokens_per_s, flops_per_token, n, device, jnp.bfloat16),
        peak_memory_gb=stats["peak_bytes_in_use"] / 2**30 if "peak_bytes_in_use" in stats else None,
        fused_attention=fused,
        transpose_fusions=transposes,
        compile_s=compile_s,
        first_loss=first_loss,
        last_loss=float(metrics["loss"]),
        devices=n,
        device=device.device_kind,
        eqxpar_path=str(Path(eqxpar.__file__).parent),
        platform=device.platform,
        profile=profile,
    )


def _profile(step, args: tuple, steps: int) -> dict:
    """`steps` steps under `jax.profiler.trace`, read back with profile_step.py's parser: ms
    per step by kind, by layer and pass, and the 25 largest operations."""
    import importlib.util
    import tempfile

    import jax

    spec = importlib.util.spec_from_file_location("profile_step", Path(__file__).with_name("profile_step.py"))
    assert spec is not None and spec.loader is not None
    prof = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prof)
    module, instructions = prof.hlo_instructions(step.lower(*args).compile().as_text())
    model, opt_state, batch = args
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(steps):
                model, opt_state, metrics = step(model, opt_state, batch)
            jax.block_until_ready(metrics["loss"])
        summary = prof.summarize(prof.trace_events(trace_dir), module, instructions, steps)
    keep = ("total_ms", "span_ms", "kinds", "layers", "least_ms", "unmatched", "events")
    return dict({k: summary[k] for k in keep}, ops=summary["ops"][:80])


def main(argv=None) -> dict:
    args = parse(argv)
    if args.one:  # a child: one candidate, its result as the last line of output
        print(json.dumps(run_candidate(json.loads(args.one))))
        return {}
    # A GPU runs a step's kernels as CUDA graphs (XLA's command buffers), which a trace
    # records as one event per graph: turned off for --profile, every kernel is its own event
    # (the step times of a profiled run are then those without command buffers).
    extra = ["--xla_gpu_enable_command_buffer="] if args.profile else []
    env, flags, rejected = child_environment(args.no_xla_flags, extra)
    start = time.perf_counter()
    rows = []
    for name in args.configs:
        shape, candidates = CONFIGS[name]
        candidates = args.chosen[name] if args.chosen else candidates
        for remat, per_device, *loop in candidates:  # (remat, batch per device[, scanned])
            scan = bool(loop) and loop[0]
            row = dict(config=name, remat=remat, per_device=per_device, shape=shape, scan=scan)
            if time.perf_counter() - start > args.budget_s:
                rows.append(dict(row, status="skipped (time budget)"))
                continue
            spec = dict(
                shape=shape,
                remat=remat,
                per_device=per_device,
                rounds=args.rounds,
                steps=args.steps,
                profile=args.profile,
                scan=scan,
            )
            # The fused attention first; if that candidate fails for another reason than
            # memory, once more with the explicit softmax, so one kernel cannot sink the run.
            for attention in ("dot_product", "reference"):
                rows.append(dict(row, attention=attention, **_child(dict(spec, attention=attention), env, args, start)))
                print(_line(rows[-1]), flush=True)
                if rows[-1].get("profile"):
                    print(_profile_text(rows[-1]["profile"]), flush=True)
                if rows[-1]["status"] != "failed":
                    break
    result = dict(
        date=datetime.date.today().isoformat(),
        xla_flags=flags,
        rejected_flags=rejected,
        seconds=time.perf_counter() - start,
        rows=rows,
    )
    write_results(result, args.out, "gpu_bench", markdown(result))
    return result


def child_environment(no_xla_flags: bool, extra: list[str]) -> tuple[dict, list[str], list[str]]:
    """The candidates' environment (XLA_FLAGS plus the accepted GPU_XLA_FLAGS and `extra`), the flags, the rejected."""
    env = dict(os.environ)
    env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = env.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    flags, rejected = ([], []) if no_xla_flags else accepted_flags(GPU_XLA_FLAGS, env)
    flags = [*flags, *extra]
    env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), *flags]).strip()
    if rejected:
        print(f"this JAX rejects {rejected}: running without them", flush=True)
    return env, flags, rejected


def write_results(result: dict, out: Path | None, stem: str, table: str) -> None:
    """Print the Markdown `table`; with `out`, write `<stem>.json` and `<stem>.md` there."""
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
        (out / f"{stem}.md").write_text(table)
    print(table)


def _child(spec: dict, env: dict, args, start: float) -> dict:
    """Run one candidate in a fresh process, within what is left of the time budget."""
    limit = max(60.0, args.budget_s + 60 - (time.perf_counter() - start))
    try:
        child = subprocess.run(
            [sys.executable, __file__, "--one", json.dumps(spec)],
            env=env,
            capture_output=True,
            text=True,
            timeout=limit,
        )
    except subprocess.TimeoutExpired:
        return dict(status="failed", error=f"no result within {limit:.0f} s")
    lines = child.stdout.strip().splitlines()
    if child.returncode == 0 and lines:
        return dict(status="ok", **json.loads(lines[-1]))
    oom = "RESOURCE_EXHAUSTED" in child.stderr or "out of memory" in child.stderr.lower()
    return dict(status="OOM" if oom else "failed", error=child.stderr.strip()[-2000:])


def _line(r: dict) -> str:
    layers = " (scan)" if r.get("scan") else ""
    head = f"{r['config']:>5} remat={r['remat']:<12} batch/device={r['per_device']:<3} {r['attention']:<11}{layers}"
    if r["status"] != "ok":
        tail = r.get("error", "").splitlines()[-1:] if r["status"] == "failed" else []
        return f"{head} {r['status']} {' '.join(tail)[:300]}"
    mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    return (
        f"{head} step {r['step_ms']:8.1f} ms  {r['tokens_per_s']:11,.0f} tokens/s  MFU {mfu:>6}  "
        f"fused attention {'yes' if r['fused_attention'] else 'no'}  compile+1st {r['compile_s']:.0f} s  "
        f"loss {r['first_loss']:.3f} -> {r['last_loss']:.3f}"
    )


def _profile_text(p: dict) -> str:
    """A candidate's profile: ms per step by kind and by layer/pass, then its largest operations."""
    span = "-" if p["span_ms"] is None else f"{p['span_ms']:.1f}"
    lines = [f"  profile: busy {p['total_ms']:.1f} ms/step, span {span} ms; by kind:"]
    lines += [f"    {k:<24}{v:8.2f}" for k, v in sorted(p["kinds"].items(), key=lambda kv: -kv[1])]
    lines.append("  by layer and pass:")
    lines += [f"    {k:<24}{v:8.2f}" for k, v in sorted(p["layers"].items(), key=lambda kv: -kv[1])]
    lines.append("  largest operations (ms/step, calls/step, kind, layer/pass, shape):")
    lines += [
        f"    {o['ms']:8.2f} {o['calls_per_step']:5.0f}  {o['op'][:36]:<36} {o['kind']:<12} {o['scope']:<20} "
        f"{o['shape'][:48]}"
        for o in p["ops"]
    ]
    return "\n".join(lines)


def markdown(result: dict) -> str:
    """The rows as a Markdown table (the best MFU of each config in bold)."""
    ok = [r for r in result["rows"] if r["status"] == "ok"]
    device = ok[0]["device"] if ok else "?"
    best = {}
    for r in ok:
        if r["mfu"] is not None and r["mfu"] > best.get(r["config"], (-1, None))[0]:
            best[r["config"]] = (r["mfu"], id(r))
    flags = " ".join(result["xla_flags"]) or "none"
    lines = [
        (
            f"{result['date']}, {device}, bf16 compute, AdamW, blocks in a Python loop (unless marked scanned); "
            f"XLA flags: {flags}"
        ),
        "",
        "| config | remat | batch/device x tokens | step (ms) | tokens/s | MFU | memory (GiB) | attention | loss |",
        "|---|---|---|---:|---:|---:|---:|---|---|",
    ]
    for r in result["rows"]:
        shape = f"{r['per_device']} x {r['shape'][0]}"
        remat = f"{r['remat']} (scanned)" if r.get("scan") else r["remat"]
        if r["status"] != "ok":
            lines.append(f"| {r['config']} | {remat} | {shape} | {r['status']} | | | | | |")
            continue
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        if best.get(r["config"], (None, None))[1] == id(r):
            mfu = f"**{mfu}**"
        attention = "cuDNN fused" if r["fused_attention"] else f"{r['attention']} (XLA)"
        memory = "-" if r["peak_memory_gb"] is None else f"{r['peak_memory_gb']:.1f}"
        lines.append(
            f"| {r['config']} | {remat} | {shape} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | {mfu} | "
            f"{memory} | {attention} | {r['first_loss']:.3f} -> {r['last_loss']:.3f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
