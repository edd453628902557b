"""Pool the per-round time ratios of several `benchmarks/peer.py --out` runs: one median per strategy.

On a shared machine a run's median moves by up to 0.2 from one run to the next (other
processes, the 8 simulated devices' threads on few cores), so one run cannot tell a ratio
of 0.93 from one of 0.97. Every run keeps each round's ratio (`ratios` in its JSON); this
script puts the rounds of all the runs given together and prints, per strategy, how many
runs and rounds there are, each run's median, the pooled median and quartiles, and the
share of rounds at or under the target (`peer.py`'s `TARGETS["time"]`).

    python benchmarks/peer.py --rounds 21 --out run1.json    # as many runs as you like,
    python benchmarks/peer.py --strategies fsdp --rounds 101 --out run2.json
    python benchmarks/pool.py run1.json run2.json            # then pool them

`--out FILE` writes the pooled table as JSON. Each run's commit is printed first. Runs of
different model shapes (the `config` in each file) or targets are refused: their ratios
measure different things.
"""

from __future__ import annotations

import argparse
import json
import statistics

MODEL_KEYS = ("dim", "heads", "layers", "context", "batch", "fsdp_min_size", "quick")


def pool(runs: list[dict]) -> dict:
    """`{strategy: {...}}` from the loaded JSON of `peer.py` runs (in order of first appearance).

    **Raises:** `ValueError` if there are no runs, a run is not a `peer.py --out` file (no
    config, results or targets) or has no per-round ratios, or the runs timed different model
    shapes or have different time targets.
    """
    if not runs:
        raise ValueError("pool: no runs given; pass the JSON files that `peer.py --out` wrote.")
    for i, run in enumerate(runs):
        if not all(isinstance(run.get(k), dict) for k in ("config", "results", "targets")):
            raise ValueError(f"pool: run {i} has no config, results or targets: not a file `peer.py --out` wrote.")
    for key in MODEL_KEYS:
        values = [run["config"].get(key) for run in runs]
        if len(set(values)) > 1:
            raise ValueError(
                f"pool: the runs timed different models ({key} = {', '.join(map(str, values))}, in the order "
                f"given); pool runs of one shape only."
            )
    targets = [run["targets"].get("time") for run in runs]
    if len(set(targets)) > 1:
        raise ValueError(f"pool: the runs have different time targets ({', '.join(map(str, targets))}).")
    target = targets[0]
    pooled: dict = {}
    for i, run in enumerate(runs):
        for name, r in run["results"].items():
            if not r.get("ratios"):
                raise ValueError(f"pool: run {i} has no per-round ratios for {name!r} (a peer.py --out file?).")
            entry = pooled.setdefault(name, dict(run_medians=[], ratios=[]))
            entry["run_medians"].append(statistics.median(r["ratios"]))
            entry["ratios"].extend(r["ratios"])
    for entry in pooled.values():
        ratios = entry["ratios"]
        entry["runs"], entry["rounds"] = len(entry["run_medians"]), len(ratios)
        entry["median"] = statistics.median(ratios)
        entry["quartiles"] = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        entry["share_at_or_under_target"] = sum(x <= target for x in ratios) / len(ratios)
        entry["target"] = target
    return pooled


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="JSON files written by benchmarks/peer.py --out")
    parser.add_argument("--out", help="write the pooled table as JSON here")
    args = parser.parse_args(argv)
    runs = []
    for path in args.runs:
        try:
            with open(path) as f:
                runs.append(json.load(f))
        except (OSError, json.JSONDecodeError) as e:
            parser.error(f"cannot read {path} as JSON ({e}); pass the files that `peer.py --out` wrote.")
    try:
        pooled = pool(runs)
    except ValueError as e:
        parser.error(str(e))
    for path, run in zip(args.runs, runs):
        source = run.get("source") or {}
        dirty = " (uncommitted changes)" if source.get("uncommitted") else ""
        print(f"{path}: commit {str(source.get('commit', '?'))[:7]}{dirty}, {', '.join(run['results'])}")
    print(f"\n{'strategy':<22} runs  rounds  run medians{'':<26} pooled median  quartiles      <= target")
    for name, e in pooled.items():
        medians = " ".join(f"{m:.2f}" for m in e["run_medians"])
        q1, _, q3 = e["quartiles"]
        print(
            f"{name:<22} {e['runs']:>4}  {e['rounds']:>6}  {medians:<37} {e['median']:>13.3f}  "
            f"{q1:.3f}-{q3:.3f}  {e['share_at_or_under_target']:>9.0%}"
        )
    print("\npooled median: of every round's eqxpar / peer step time, all runs together.")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(runs=args.runs, pooled=pooled), f, indent=1)
    return pooled


if __name__ == "__main__":
    main()
