"""Benchmark: every layout the planner enumerates for a GPT or a Llama, compiled on simulated CPU devices.

For each candidate of `eqxpar.plan.plan` (a GPT of the given shape, float32, AdamW, on 8
simulated CPU devices; pipelines with `--pipeline`, experts with `--experts`; with
`--llama` a Llama of that width, heads and depth, `--kv-heads` key/value heads and a
SwiGLU MLP of 3 x the width), this builds
the plan's own mesh, model and step, compiles it (`eqxpar.plan.validate`; nothing runs) and
prints one row per candidate: whether the collective bytes per (kind, axes) and the
parameter + optimizer-state bytes equal the prediction, and the compiled peak
(`MemoryReport.peak`) over the predicted one. Then per remat policy the least, median and
largest of those ratios. `--out` writes every row as JSON.

The peak is the planner's estimate (its temporaries calibrated on GPU steps), so its ratio
is what this measures; the bytes are exact, so anything but "exact" there is a bug.

Run: `python benchmarks/plan_validate.py` (`--llama` for the Llama; a GPT of 4 blocks of width 256, 16 sequences of
256 tokens: 132 candidates, about 10 minutes on two cores), or a sample:
`python benchmarks/plan_validate.py --dim 128 --layers 2 --context 512 --batch 8 --sample 0.3`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import eqxpar


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--pipeline", action="store_true", help="the pipeline candidates (stage > 1) instead")
    parser.add_argument("--experts", type=int, default=0, help="plan an MoE GPT with this many experts (top-2)")
    parser.add_argument("--llama", action="store_true", help="plan a Llama (RMSNorm, RoPE, GQA, SwiGLU) instead")
    parser.add_argument("--kv-heads", type=int, default=4, help="the Llama's key/value heads")
    parser.add_argument("--sample", type=float, default=1.0, help="fraction of the candidates to compile (seeded)")
    parser.add_argument("--out", default=None, help="write every row as JSON here")
    args = parser.parse_args(argv)
    if not 0 < args.sample <= 1:
        parser.error(f"--sample must be in (0, 1], got {args.sample}")
    eqxpar.simulate_cpu_devices(args.devices)

    import jax.numpy as jnp

    import eqxpar.plan as planner
    from eqxpar.models import GPTConfig, LlamaConfig, MoEOptions

    if args.llama and args.experts:
        parser.error("--experts plans an MoE GPT; the planner prices no MoE Llama")
    if args.llama:
        config = LlamaConfig(
            vocab_size=args.vocab,
            dim=args.dim,
            num_layers=args.layers,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            hidden_dim=3 * args.dim,
            max_seq_len=args.context,
        )
        vocabulary = {}  # a Llama's is its config's
    else:
        config = GPTConfig(context=args.context, dim=args.dim, heads=args.heads, layers=args.layers)
        vocabulary = {"vocab_size": args.vocab}
    machine = planner.Cluster(
        devices_per_host=args.devices,
        hosts=1,
        memory_per_device=1e12,  # every candidate: this measures the estimate, not the fit
        peak_flops={"float32": 1e12},
        intra_host_bandwidth=1e11,
        inter_host_bandwidth=1e10,
        name="simulated CPU devices",
    )
    moe = MoEOptions(num_experts=args.experts, top_k=2) if args.experts else None
    plans = planner.plan(
        config,
        batch=args.batch,
        cluster=machine,
        dtype=jnp.float32,
        optimizer="adamw",
        top=None,
        pipeline=args.pipeline,  # True: only pipelines
        moe=moe,
        **vocabulary,
    )
    chosen = random.Random(0).sample(plans, max(1, round(args.sample * len(plans))))
    print(f"{len(chosen)} of {len(plans)} candidates of {config}, batch {args.batch}, on {args.devices} devices")

    rows = []
    start = time.perf_counter()
    for p in chosen:
        (v,) = planner.validate([p])
        rows.append(
            {
                "layout": str(p.layout),
                "remat": p.layout.remat,
                "comm_exact": v.comm_exact,
                "state_exact": v.state_exact,
                "predicted_peak": int(p.memory.peak),
                "compiled_peak": int(v.memory.peak),
                "peak_ratio": v.peak_ratio,
            }
        )
        print(str(v), flush=True)
    print(f"\n{len(rows)} compiled in {time.perf_counter() - start:.0f} s")

    summary = {}
    for remat in sorted({r["remat"] for r in rows}):
        ratios = sorted(r["peak_ratio"] for r in rows if r["remat"] == remat)
        summary[remat] = {"n": len(ratios), "least": ratios[0], "median": statistics.median(ratios), "most": ratios[-1]}
    print("\nremat          n  compiled / predicted peak: least  median  most")
    for remat, s in summary.items():
        print(f"{remat:12s} {s['n']:>3d}  {s['least']:>32.2f}  {s['median']:6.2f}  {s['most']:4.2f}")
    exact = sum(r["comm_exact"] and r["state_exact"] for r in rows)
    print(f"collective and state bytes exact: {exact} of {len(rows)}")
    result = {"config": vars(args), "rows": rows, "peak_ratio": summary, "exact": exact}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
