"""Benchmark: an A/B of two eqxpar source trees on `benchmarks/gpu.py`'s candidates, in one call.

    python benchmarks/gpu_ab.py --baseline ab --candidates 124m:none:64 --pairs 2 --out results/

runs each candidate once with the eqxpar in `--baseline` (A) and once with this checkout's
(B), `--pairs` times, every run in a process of its own (gpu.py's `--one`), the order
alternating (A B, then B A, ...) so that a machine that drifts during the call moves both
sides alike. Per candidate it reports each pair's step-time ratio B / A and their median,
both sides' MFU and last losses (the same batches: a change that should not touch the
arithmetic gives the same losses), and which tree each run imported (checked: an A/B that
ran one tree twice stops with an error). `--hlo DIR` also writes every run's compiled
program (`DIR/<candidate>_<A|B><pair>.hlo.txt`) and counts its transpose fusions.

Make the baseline tree from a commit with `mkdir ab && git archive <commit> eqxpar | tar -x
-C ab`; on the GPU machine, carry that folder with the working tree. Writes
`gpu_ab.json` and `gpu_ab.md` under `--out`.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _gpu():
    spec = importlib.util.spec_from_file_location("gpu_bench", Path(__file__).with_name("gpu.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="a folder holding the A side's eqxpar/")
    parser.add_argument("--candidates", default="124m:none:64", help="as gpu.py's --candidates")
    parser.add_argument("--pairs", type=int, default=2, help="A/B pairs per candidate (order alternating)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per run (gpu.py's --rounds)")
    parser.add_argument("--steps", type=int, default=5, help="steps per round (gpu.py's --steps)")
    parser.add_argument("--budget-s", type=float, default=420, help="start no pair after this many seconds")
    parser.add_argument("--no-xla-flags", action="store_true", help="run without gpu.py's XLA flags")
    parser.add_argument("--hlo", type=Path, help="write each run's compiled program here")
    parser.add_argument("--out", type=Path, help="folder for gpu_ab.json and gpu_ab.md")
    args = parser.parse_args(argv)
    if not (args.baseline / "eqxpar" / "__init__.py").is_file():
        parser.error(
            f"--baseline {args.baseline}: no eqxpar/__init__.py there; make it with "
            f"`mkdir {args.baseline} && git archive <commit> eqxpar | tar -x -C {args.baseline}`"
        )
    if args.baseline.resolve() == ROOT:
        parser.error("--baseline is this checkout: an A/B needs another tree")
    if args.pairs < 1:
        parser.error(f"--pairs must be at least 1, got {args.pairs}")
    gpu_argv = ["--candidates", args.candidates, "--rounds", str(args.rounds), "--steps", str(args.steps)]
    args.gpu_args = _gpu().parse(gpu_argv)  # its checks of --candidates, --rounds and --steps
    return args


def order(pair: int) -> tuple[str, str]:
    """The sides of pair `pair` in the order they run: A first in even pairs, B in odd ones."""
    return ("A", "B") if pair % 2 == 0 else ("B", "A")


def summary(pairs: list[dict]) -> dict:
    """Per candidate: the pairs' B / A step-time ratios, their median, and both sides' median
    step time, from pairs of `{"A": row, "B": row}` (gpu.py's rows)."""
    done = [p for p in pairs if p["A"].get("status") == "ok" and p["B"].get("status") == "ok"]
    ratios = [p["B"]["step_ms"] / p["A"]["step_ms"] for p in done]
    return dict(
        ratios=ratios,
        median_ratio=statistics.median(ratios) if ratios else None,
        a_ms=statistics.median(p["A"]["step_ms"] for p in done) if done else None,
        b_ms=statistics.median(p["B"]["step_ms"] for p in done) if done else None,
        losses=[(p["A"]["last_loss"], p["B"]["last_loss"]) for p in done],
    )


def main(argv=None) -> dict:
    args = parse(argv)
    gpu = _gpu()
    env, flags, rejected = gpu.child_environment(args.no_xla_flags, [])
    trees = {"A": args.baseline.resolve(), "B": ROOT}
    sides = side_environments(env, trees)
    if args.hlo:
        args.hlo.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    results = []
    for name, candidates in args.gpu_args.chosen.items():
        shape = gpu.CONFIGS[name][0]
        for remat, per_device, scan in candidates:
            label = f"{name}:{remat}:{per_device}" + (":scan" if scan else "")
            pairs = []
            for pair in range(args.pairs):
                if time.perf_counter() - start > args.budget_s:
                    break
                runs = {}
                for side in order(pair):
                    spec = dict(shape=shape, remat=remat, per_device=per_device, rounds=args.rounds,
                                steps=args.steps, profile=0, scan=scan, attention="dot_product")  # fmt: skip
                    if args.hlo:
                        spec["hlo_path"] = str(args.hlo / f"{label.replace(':', '_')}_{side}{pair}.hlo.txt")
                    runs[side] = dict(side=side, **gpu._child(spec, sides[side], args, start))
                    print(f"{label} pair {pair} {side}: {_brief(runs[side])}", flush=True)
                    if runs[side].get("status") == "ok" and not _imported_from(runs[side], trees[side]):
                        raise SystemExit(
                            f"gpu_ab: side {side} imported eqxpar from {runs[side]['eqxpar_path']}, not "
                            f"{trees[side]}: is eqxpar installed into this Python? Uninstall it or use a venv."
                        )
                pairs.append(runs)
            results.append(dict(candidate=label, pairs=pairs, **summary(pairs)))
            print(_line(results[-1]), flush=True)
    result = dict(
        date=datetime.date.today().isoformat(),
        baseline=str(trees["A"]),
        xla_flags=flags,
        rejected_flags=rejected,
        seconds=time.perf_counter() - start,
        candidates=results,
    )
    gpu.write_results(result, args.out, "gpu_ab", markdown(result))
    return result


def side_environments(env: dict, trees: dict[str, Path]) -> dict[str, dict]:
    """Per side, `env` with that side's tree first on PYTHONPATH (before any entry `env` has)."""
    ahead = lambda tree: os.pathsep.join([str(tree), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)  # noqa: E731
    return {side: dict(env, PYTHONPATH=ahead(tree)) for side, tree in trees.items()}


def _imported_from(row: dict, tree: Path) -> bool:
    """Whether the run imported `tree`'s own eqxpar (not, say, a copy of A's inside B's tree)."""
    return Path(row["eqxpar_path"]).resolve() == (tree / "eqxpar").resolve()


def _brief(row: dict) -> str:
    if row.get("status") != "ok":
        return f"{row.get('status')} {row.get('error', '')[-300:]}"
    mfu = "-" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
    return f"step {row['step_ms']:.1f} ms, MFU {mfu}, loss {row['last_loss']:.4f}"


def _line(c: dict) -> str:
    if c["median_ratio"] is None:
        return f"{c['candidate']}: no complete pair"
    ratios = ", ".join(f"{r:.3f}" for r in c["ratios"])
    return f"{c['candidate']}: B / A step time {c['median_ratio']:.3f} (pairs: {ratios})"


def markdown(result: dict) -> str:
    """One row per candidate: both sides' median step time, each pair's ratio and the median."""
    flags = " ".join(result["xla_flags"]) or "none"
    lines = [
        f"{result['date']}: A = {result['baseline']}, B = this checkout; XLA flags: {flags}",
        "",
        "| candidate | A ms | B ms | B / A per pair | median B / A | last loss A, B |",
        "|---|---:|---:|---|---:|---|",
    ]
    for c in result["candidates"]:
        if c["median_ratio"] is None:
            lines.append(f"| {c['candidate']} | | | no complete pair | | |")
            continue
        losses = "; ".join(f"{a:.4f}, {b:.4f}" for a, b in c["losses"])
        ratios = ", ".join(f"{r:.3f}" for r in c["ratios"])
        lines.append(
            f"| {c['candidate']} | {c['a_ms']:.1f} | {c['b_ms']:.1f} | {ratios} | {c['median_ratio']:.3f} | {losses} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
