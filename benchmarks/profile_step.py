"""Profile: where eqxpar's train step and the plain-jit peer's spend their time, per operation.

For each strategy (`--strategies`, default `hybrid,fsdp`) this builds the two steps of
`benchmarks/peer.py` (same GPT, weights, batches, Adam; parity checked first), warms both,
then runs `--steps` steps of each, alternating eqxpar / peer, under `jax.profiler.trace`,
and reads the trace back: every event the runtime records for an HLO operation (its
`hlo_op` and `hlo_module`: an XLA:CPU thunk on each simulated device's thread, or a GPU
kernel on the device's streams) is matched to its instruction in the compiled program and
summed by

- **kind**: matmul (dots, and fusions holding one), copy/transpose (fusions of layout moves
  only), reduce, gather/scatter/slice, elementwise (other fusions), each collective kind
  (on CPU its time includes the rendezvous: waiting for the other devices' threads), other;
- **layer and pass**: the `jax.named_scope`s both programs carry (`embedding`, `attention`,
  `mlp`, `head`, `loss`; the peer's loss in `peer.py` is scoped like eqxpar's GPT) and
  forward / backward (`jvp(...)` / `transpose(...)` in the op name) / the rest (optimizer,
  gradient sums);
- **operation**: the largest single instructions, with their kind and scope.

Figures are milliseconds per step, averaged over the devices (on the simulated CPU
devices each device is a thread, 8 threads share the machine's cores, and an operation's
time includes the time its thread waits for a core). Where a runtime runs operations of
one device at once (XLA:CPU's thunk executor, a GPU's streams), their common time is split
evenly among them, so each program's figures add up to the time its devices were busy,
at most its step time; "overlapped" is how much the plain durations exceed that. Beside
them: each program's step wall time as Python saw it (median) and its *span* (first
operation's start to the last one's end, over all devices), whose difference from the wall
time is dispatch and the runtime's own work between operations. Collectives are split into
the time each device waits for the last device to arrive ("collective wait": load
imbalance, and on CPU threads that have not had a core yet) and the rest (the exchange).
The "least time" table is the work with the machine's load taken out as far as a trace
can: for each instruction, its fastest run (of every device and step; a collective's
without its wait) times its runs per step: a load-independent floor to compare programs.

Run: `python benchmarks/profile_step.py` (a few minutes on two cores);
`--strategies hybrid --steps 10 --top 25`; `--quick` (tiny GPT, 2 steps: a smoke test);
`--out profile.json` keeps every table (and every instruction's least time, `least_ops`);
`--trace-dir DIR` keeps the raw traces (open `perfetto_trace.json.gz` in ui.perfetto.dev).
The same command runs on a GPU (without `simulate_cpu_devices`, which only applies on CPU);
the strategies' meshes need 8 devices, so on a one-GPU machine use `--strategies single`
(both steps on one device).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import importlib.util
import json
import os
import pathlib
import re
import statistics
import tempfile
import time

import eqxpar

HERE = pathlib.Path(__file__).resolve().parent
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
LAYERS = ("attention", "mlp", "embedding", "head", "loss")
MOVES = {
    "copy",
    "transpose",
    "bitcast",
    "reshape",
    "parameter",
    "broadcast",
    "slice",
    "concatenate",
    "tuple",
    "get-tuple-element",
    "constant",
    "pad",
    "reverse",
}


def _load_peer():
    spec = importlib.util.spec_from_file_location("eqxpar_bench_peer", HERE / "peer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    peer = _load_peer()
    peer.add_model_flags(parser)
    parser.add_argument("--steps", type=int, default=None, help="profiled steps of each program (8; --quick: 2)")
    parser.add_argument("--strategies", default="hybrid,fsdp", help="comma-separated: dp, tp, hybrid, fsdp, single")
    parser.add_argument(
        "--rounds", type=int, default=None, help="A/B rounds timed without the profiler first (8; --quick: 1)"
    )
    parser.add_argument("--top", type=int, default=12, help="rows in the per-operation table")
    parser.add_argument("--quick", action="store_true", help="tiny GPT, 2 steps: a smoke test")
    parser.add_argument("--trace-dir", help="keep the raw traces here (default: a temporary folder, removed)")
    parser.add_argument("--out", help="write the tables as JSON here")
    args = parser.parse_args(argv)
    peer.finish_model_flags(parser, args)
    if args.steps is None:
        args.steps = 2 if args.quick else 8
    if args.rounds is None:
        args.rounds = 1 if args.quick else 8
    if args.rounds < 0:
        parser.error(f"--rounds must be at least 0, got {args.rounds}")
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    return args


# ------------------------------------------------------------------------ the program
def hlo_instructions(text: str) -> tuple[str, dict]:
    """A compiled module's name and, per instruction name, what the profile needs of it:
    `opcode`, `kind` (see the module docstring), `op_name` (JAX's name stack), `shape`."""
    module = re.match(r"HloModule\s+([^\s,]+)", text)
    computations: dict[str, list[str]] = collections.defaultdict(list)
    rows = []
    current = None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and "=" not in line.split("{")[0]:
            current = head.group(1)
            continue
        m = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$", line)
        if not m or current is None:
            continue
        name, rest = m.groups()
        op = re.search(r"\s([a-z][a-z0-9\-]*)\(", " " + rest)
        if not op:
            continue
        opcode = op.group(1)
        computations[current].append(opcode)
        calls = re.search(r"calls=%?([\w.\-]+)", rest)
        op_name = re.search(r'op_name="([^"]*)"', rest)
        rows.append(
            (
                name,
                opcode,
                calls.group(1) if calls else None,
                op_name.group(1) if op_name else "",
                rest[: op.start()].strip(),
            )
        )
    out = {}
    for name, opcode, calls, op_name, shape in rows:
        inner = set(computations.get(calls, ())) if calls else set()
        out[name] = dict(opcode=opcode, kind=_kind(opcode, inner, name), op_name=op_name, shape=shape)
    return (module.group(1) if module else ""), out


def _kind(opcode: str, inner: set, name: str) -> str:
    base = opcode.removesuffix("-start").removesuffix("-done")
    if base in COLLECTIVES:
        return base
    ops = inner or {opcode}
    if ops & {"dot", "convolution"} or "dot" in name or "ynn" in name or "xnn" in name or opcode == "custom-call":
        return "matmul"
    if ops & {"gather", "scatter", "dynamic-slice", "dynamic-update-slice"}:
        return "gather/scatter/slice"
    if ops & {"reduce", "reduce-window"}:
        return "reduce"
    if ops <= MOVES and ops & {"copy", "transpose"}:
        return "copy/transpose"
    if opcode in ("while", "call", "conditional"):
        return "control"
    return "elementwise" if opcode == "fusion" or ops - MOVES else "other"


def layer_and_pass(op_name: str) -> tuple[str, str]:
    """The layer (first of `LAYERS` in the name stack, else "other") and the pass:
    "backward" (`transpose(` in the name), "forward" (`jvp(`) or "update" (neither: the
    optimizer and whatever runs outside the differentiated loss)."""
    parts = re.split(r"[/()]", op_name)
    layer = next((p for p in parts if p in LAYERS), "other")
    phase = "backward" if "transpose(" in op_name else "forward" if "jvp(" in op_name else "update"
    return layer, phase


# -------------------------------------------------------------------------- the trace
def trace_events(trace_dir: str) -> list[dict]:
    """Every complete event with `hlo_op` and `hlo_module` of the newest trace in
    `trace_dir`, with `self` (its duration less that of the HLO events nested in it on the
    same thread). Where the trace has device processes (a GPU's `/device:...`), only
    theirs: the host's launch events of the same operations would count twice."""
    files = sorted(
        glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
        or glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True),
        key=os.path.getmtime,
    )
    if not files:
        raise FileNotFoundError(f"no trace under {trace_dir}")
    with gzip.open(files[-1], "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    processes = {e["pid"]: e.get("args", {}).get("name", "") for e in events if e.get("name") == "process_name"}
    ops = [e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {}) and "hlo_module" in e["args"]]
    on_device = [e for e in ops if processes.get(e["pid"], "").startswith("/device:")]
    ops = on_device or ops
    by_thread = collections.defaultdict(list)
    for e in ops:
        by_thread[(e["pid"], e["tid"])].append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        for e in evs:
            e["self"] = e["dur"]
            while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]:
                stack.pop()
            if stack:
                stack[-1]["self"] -= e["dur"]
            stack.append(e)
    _share_overlaps(ops)
    return ops


def _share_overlaps(ops: list[dict]) -> None:
    """Set each event's `share`: its time with the time it overlaps other operations of
    the same device split evenly among them (a runtime may run independent operations of
    one device at once: XLA:CPU's thunk executor, a GPU's streams). Per device the shares
    add up to the time at least one operation runs. An event with nested events keeps its
    `self` time as its share."""
    by_device = collections.defaultdict(list)
    for e in ops:
        e["share"] = float(e["self"])
        if e["self"] >= e["dur"] - 1e-9:  # no nested events: takes part in the split
            by_device[(e["pid"], e["args"].get("device_ordinal"))].append(e)
    for evs in by_device.values():
        edges = sorted(
            [(e["ts"], 1, i) for i, e in enumerate(evs)] + [(e["ts"] + e["dur"], 0, i) for i, e in enumerate(evs)]
        )
        for e in evs:
            e["share"] = 0.0
        active: set[int] = set()
        last = None
        for t, starts, i in edges:
            if active and last is not None and t > last:
                part = (t - last) / len(active)
                for j in active:
                    evs[j]["share"] += part
            last = t
            (active.add if starts else active.discard)(i)


def summarize(events: list[dict], module: str, instructions: dict, steps: int) -> dict:
    """One program's events in ms per step, averaged over its devices: by kind, by layer
    and pass, by instruction; the per-step span (by `run_id` where the runtime records
    one); and, for each collective, the time devices spent waiting for the last one to
    arrive (`wait`, kind "collective wait") apart from the time after it arrived."""
    mine = [e for e in events if e["args"]["hlo_module"] == module]
    devices = {e["args"].get("device_ordinal", e["pid"]) for e in mine}
    ms = 1e-3 / (steps * max(len(devices), 1))  # trace times are microseconds
    runs = collections.defaultdict(list)
    for e in mine:
        runs[e["args"].get("run_id")].append(e)
    # A collective's instance: one run, one instruction; its devices' events.
    instances = collections.defaultdict(list)
    for e in mine:
        info = instructions.get(e["args"]["hlo_op"])
        if info and info["kind"] in COLLECTIVES and e["args"].get("run_id") is not None:
            instances[(e["args"]["run_id"], e["args"]["hlo_op"])].append(e)
    for group in instances.values():
        last = max(e["ts"] for e in group)
        for e in group:
            e["waited"] = min(e["self"], last - e["ts"]) if len(group) > 1 else 0.0
            e["wait"] = e["share"] * e["waited"] / e["self"] if e["self"] > 0 else 0.0
    kinds, layers, ops = collections.Counter(), collections.Counter(), collections.Counter()
    counts = collections.Counter()
    fastest: dict[str, float] = {}
    for e in mine:
        own = e["self"] - e.get("waited", 0.0)
        fastest[e["args"]["hlo_op"]] = min(own, fastest.get(e["args"]["hlo_op"], own))
    for e in mine:
        name = e["args"]["hlo_op"]
        info = instructions.get(name, dict(kind="other", op_name="", opcode="?", shape=""))
        layer, phase = layer_and_pass(info["op_name"])
        wait = e.get("wait", 0.0)
        kinds[info["kind"]] += (e["share"] - wait) * ms
        if wait:
            kinds["collective wait"] += wait * ms
        layers[f"{layer} {phase}"] += e["share"] * ms
        ops[name] += e["share"] * ms
        counts[name] += 1
    least = collections.Counter()  # per kind: each instruction's fastest run times its runs per step and device
    least_ops = collections.Counter()  # the same per instruction
    for name, t in fastest.items():
        least[instructions.get(name, {}).get("kind", "other")] += t * counts[name] * ms
        least_ops[name] = t * counts[name] * ms
    spans = [
        (max(e["ts"] + e["dur"] for e in r) - min(e["ts"] for e in r)) / 1e3 for k, r in runs.items() if k is not None
    ]
    n_dev = max(len(devices), 1)

    def listed(counter):
        return [
            dict(
                op=n,
                ms=t,
                calls_per_step=counts[n] / (steps * n_dev),
                kind=instructions.get(n, {}).get("kind", "other"),
                scope="/".join(layer_and_pass(instructions.get(n, {}).get("op_name", ""))),
                shape=instructions.get(n, {}).get("shape", ""),
            )
            for n, t in counter.most_common()
        ]

    return dict(
        total_ms=sum(kinds.values()),
        events=len(mine),
        least=dict(least),
        least_ms=sum(least.values()),
        least_ops=listed(least_ops),
        overlapped_ms=sum(e["self"] - e["share"] for e in mine) * ms,
        devices=len(devices),
        kinds=dict(kinds),
        layers=dict(layers),
        ops=listed(ops),
        span_ms=statistics.median(spans) if spans else None,
        collectives_per_step=sum(counts[n] for n in counts if instructions.get(n, {}).get("kind") in COLLECTIVES)
        / (steps * n_dev),
        unmatched=sum(1 for e in mine if e["args"]["hlo_op"] not in instructions),
    )


# -------------------------------------------------------------------------- profiling
def profile_pair(pair, steps: int, rounds: int, trace_dir: str, jax) -> dict:
    """Time `rounds` A/B rounds without the profiler, then run `steps` steps of each
    program, alternating, under it; parse the trace."""
    a_module, a_instr = hlo_instructions(pair.a_compiled.as_text())
    b_module, b_instr = hlo_instructions(pair.b_compiled.as_text())
    if a_module == b_module:
        raise RuntimeError(f"both programs are named {a_module!r}; the trace cannot tell them apart")
    for i in range(2):  # warm
        pair.run_a(i), pair.run_b(i)
    plain = []  # the same A/B rounds without the profiler: does profiling move the ratio?
    for i in range(rounds):
        if i % 2 == 0:
            x, y = pair.run_a(i), pair.run_b(i)
        else:
            y, x = pair.run_b(i), pair.run_a(i)
        plain.append(x / y)
    options = None
    if hasattr(jax.profiler, "ProfileOptions"):
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0  # Python call events would slow eqxpar's dispatch more than jit's
    ta, tb = [], []
    kwargs = {"profiler_options": options} if options is not None else {}
    try:
        ctx = jax.profiler.trace(trace_dir, create_perfetto_trace=True, **kwargs)
    except TypeError:
        ctx = jax.profiler.trace(trace_dir, create_perfetto_trace=True)
    with ctx:
        for i in range(steps):  # A/B order alternating, as peer.py does
            if i % 2 == 0:
                ta.append(pair.run_a(i)), tb.append(pair.run_b(i))
            else:
                tb.append(pair.run_b(i)), ta.append(pair.run_a(i))
    events = trace_events(trace_dir)
    a = summarize(events, a_module, a_instr, steps)
    b = summarize(events, b_module, b_instr, steps)
    a["wall_ms"], b["wall_ms"] = statistics.median(ta) * 1e3, statistics.median(tb) * 1e3
    a["module"], b["module"] = a_module, b_module
    return dict(eqxpar=a, peer=b, ratios=[x / y for x, y in zip(ta, tb)], unprofiled_ratios=plain)


def print_profile(name: str, r: dict, top: int) -> None:
    a, b = r["eqxpar"], r["peer"]

    def table(title, keys, get):
        print(f"  {title:<34}{'eqxpar':>10}{'peer':>10}{'diff':>10}")
        for k in keys:
            x, y = get(a, k), get(b, k)
            print(f"  {k:<34}{x:>10.1f}{y:>10.1f}{x - y:>+10.1f}")

    span = lambda s: "-" if s["span_ms"] is None else f"{s['span_ms']:.1f}"  # noqa: E731
    print(
        f"\n== {name}: ms per step (mean over {a['devices']} devices), {a['events']}/{b['events']} events "
        f"eqxpar/peer; collectives run per step {a['collectives_per_step']:.0f}/{b['collectives_per_step']:.0f} =="
    )
    plain = f"{statistics.median(r['unprofiled_ratios']):.2f}" if r["unprofiled_ratios"] else "-"
    print(
        f"  wall (Python, median)  eqxpar {a['wall_ms']:.1f}  peer {b['wall_ms']:.1f}  ratio "
        f"{statistics.median(r['ratios']):.2f} (without the profiler: {plain});  span  eqxpar {span(a)}  peer {span(b)}"
    )
    kinds = sorted(set(a["kinds"]) | set(b["kinds"]), key=lambda k: -(a["kinds"].get(k, 0) + b["kinds"].get(k, 0)))
    table("by kind", kinds, lambda s, k: s["kinds"].get(k, 0.0))
    print(f"  {'total':<34}{a['total_ms']:>10.1f}{b['total_ms']:>10.1f}{a['total_ms'] - b['total_ms']:>+10.1f}")
    print(
        f"  {'(overlapped, split above)':<34}{a['overlapped_ms']:>10.1f}{b['overlapped_ms']:>10.1f}"
        f"{a['overlapped_ms'] - b['overlapped_ms']:>+10.1f}"
    )
    kinds = sorted(set(a["least"]) | set(b["least"]), key=lambda k: -(a["least"].get(k, 0) + b["least"].get(k, 0)))
    table("least time by kind (fastest runs)", kinds, lambda s, k: s["least"].get(k, 0.0))
    print(f"  {'total':<34}{a['least_ms']:>10.1f}{b['least_ms']:>10.1f}{a['least_ms'] - b['least_ms']:>+10.1f}")
    layers = sorted(set(a["layers"]) | set(b["layers"]))
    table("by layer and pass", layers, lambda s, k: s["layers"].get(k, 0.0))
    for who, s in (("eqxpar", a), ("peer", b)):
        print(f"  {who}: largest operations (ms/step, calls/step, kind, layer/pass, shape)")
        for o in s["ops"][:top]:
            print(
                f"    {o['ms']:8.2f}  {o['calls_per_step']:4.0f}  {o['op'][:40]:<40} {o['kind']:<20} "
                f"{o['scope']:<18} {o['shape'][:40]}"
            )


def main(argv=None) -> dict:
    args = parse(argv)
    eqxpar.simulate_cpu_devices(8)  # only on CPU: no effect where an accelerator is the backend
    import jax

    peer = _load_peer()
    ctx = peer.Context(args)
    print(ctx.describe() + f"; {args.steps} profiled steps of each program, alternating")
    keep = args.trace_dir
    results = {}
    for key in args.strategies:
        pair = peer.Pair(ctx, key)
        parity, worst = pair.parity()
        if worst > 1e-4:
            raise SystemExit(f"{pair.name}: eqxpar and the peer disagree (relative {worst:.2e}): {parity}")
        with tempfile.TemporaryDirectory() as tmp:
            where = os.path.join(keep, key) if keep else tmp
            t = time.perf_counter()
            r = profile_pair(pair, args.steps, args.rounds, where, jax)
            r["profile_s"] = time.perf_counter() - t
        r["parity_rel"] = worst
        results[pair.name] = r
        print_profile(pair.name, r, args.top)
        del pair
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                dict(config=vars(args), load=os.getloadavg(), source=peer.source_version(), results=results),
                f,
                indent=1,
            )
    return results


if __name__ == "__main__":
    main()
