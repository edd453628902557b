"""Benchmark: one GPT under every parallel strategy, side by side, against theory.

For the GPT of `eqxpar.models` (trained with Adam on windows of Python's source text),
this builds one train step per strategy on 8 simulated CPU devices:

- single device (`data=1,model=1`), data parallel (`data=8`), tensor parallel
  (`model=8`), hybrid data x tensor (`data=2,model=4` and `data=4,model=2`), all with
  `eqxpar.train.hybrid_step`;
- FSDP (`fsdp=8`) and FSDP x tensor parallel (`fsdp=2,model=4`, with and without remat),
  with `eqxpar.train.fsdp_step`, each block gathering its own weights (`units=blocks`).

and prints one table with a row per strategy:

- **step time / single**: the median time of a step divided by the single-device step's,
  all strategies measured in turn within each round (the order rotating between rounds),
  so that load from anything else on the machine hits them alike;
- **collective bytes / theory**: the bytes per device per step of all collectives (read
  from the lowered and from the compiled program by `eqxpar.inspect`), divided by the
  theoretical minimum of `eqxpar.inspect`'s theory functions (and the GPT's,
  `eqxpar.models.gpt_tensor_parallel_theory`) for that strategy (1.000 =
  exactly the minimum). Under remat the theory counts the weights gathered again;
- **state / single** and **ideal**: parameter + optimizer bytes per device (from the
  shardings of the arguments, checked against XLA's memory analysis) as a fraction of
  the single-device figure, and the ideal split 1/N over the N devices that share it;
- **temp / single**: XLA's temporary bytes per device over the single-device step's.

Run: `python benchmarks/strategies.py` (a few minutes on two cores), or smaller:
`python benchmarks/strategies.py --dim 128 --layers 2 --rounds 5`. `--detail` prints each
strategy's measured-vs-theory table per collective kind and mesh axes.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time

import eqxpar


@dataclasses.dataclass(frozen=True)
class Strategy:
    name: str
    mesh: dict
    fsdp: bool = False
    remat: bool = False

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.values())


STRATEGIES = (
    Strategy("single device", {"data": 1, "model": 1}),
    Strategy("DP data=8", {"data": 8, "model": 1}),
    Strategy("TP model=8", {"data": 1, "model": 8}),
    Strategy("hybrid data=2,model=4", {"data": 2, "model": 4}),
    Strategy("hybrid data=4,model=2", {"data": 4, "model": 2}),
    Strategy("FSDP fsdp=8", {"fsdp": 8, "model": 1}, fsdp=True),
    Strategy("FSDP+TP fsdp=2,model=4", {"fsdp": 2, "model": 4}, fsdp=True),
    Strategy("FSDP+TP fsdp=2,model=4 remat", {"fsdp": 2, "model": 4}, fsdp=True, remat=True),
)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=32, help="global batch (sequences per step)")
    parser.add_argument("--rounds", type=int, default=9, help="timed steps of each strategy")
    parser.add_argument("--detail", action="store_true", help="print measured vs theory per collective and axes")
    args = parser.parse_args(argv)
    eqxpar.simulate_cpu_devices(args.devices)

    import equinox as eqx
    import jax
    import numpy as np
    import optax
    from jax.sharding import PartitionSpec as P

    from eqxpar.datasets import python_source_text
    from eqxpar.inspect import (
        CommReport,
        MemoryReport,
        data_parallel_theory,
        fsdp_theory,
    )
    from eqxpar.models import GPT, gpt_tensor_parallel_theory, next_token_loss
    from eqxpar.nn import partition_specs
    from eqxpar.train import fsdp_specs, fsdp_step, hybrid_step, optimizer_specs

    strategies = [s for s in STRATEGIES if s.devices <= jax.device_count()]
    text = python_source_text()
    optimizer = optax.adam(1e-3)

    def new_model():
        return GPT(text.vocab_size, args.context, args.dim, args.heads, args.layers, key=jax.random.key(0))

    def loss_fn(model, tokens, key):
        return next_token_loss(model, tokens, key=key)

    def regathered(gpt):
        # What a recomputed block reads again: all its weights but the MLP's output bias,
        # which is added last (nothing in the block's backward pass needs its result).
        return [(b.attention_norm, b.attention, b.mlp_norm, b.mlp.hidden, b.mlp.output.weight) for b in gpt.blocks]

    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(text.ids) - args.context - 1, args.batch)
    tokens = np.stack([text.ids[s : s + args.context + 1] for s in starts]).astype(np.int32)

    model = new_model()
    n_params = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))
    print(
        f"GPT vocab={text.vocab_size} dim={args.dim} heads={args.heads} layers={args.layers} "
        f"context={args.context}: {n_params:,} parameters; Adam; global batch {args.batch} x "
        f"{args.context} tokens; {jax.device_count()} {jax.devices()[0].platform} devices\n"
    )

    runs = {}
    for s in strategies:
        mesh = eqxpar.make_mesh(**s.mesh)
        tp_specs = partition_specs(model, mesh)
        if s.fsdp:
            specs = fsdp_specs(model, mesh, param_specs=tp_specs)
            step = fsdp_step(loss_fn, optimizer, mesh, param_specs=specs, units=lambda m: m.blocks, remat=s.remat)
            batch_axis = "fsdp"
            theory = fsdp_theory(model, mesh, specs, regathered=regathered if s.remat else None)
        else:
            specs = tp_specs
            step = hybrid_step(loss_fn, optimizer, mesh, param_specs=specs)
            batch_axis = "data"
            theory = data_parallel_theory(model, mesh, specs)
        theory += gpt_tensor_parallel_theory(
            model, mesh, args.batch, args.context, batch_axis=batch_axis, remat=s.remat
        )
        fresh = new_model()
        opt_state = optimizer.init(eqx.filter(fresh, eqx.is_inexact_array))
        opt_state = eqxpar.shard(opt_state, mesh, optimizer_specs(optimizer, opt_state, fresh, specs))
        state = (eqxpar.shard(fresh, mesh, specs), opt_state)
        batch = eqxpar.shard(tokens, mesh, P(batch_axis))
        lowered = step.lower(*state, batch)
        compiled = lowered.compile()
        comm = CommReport.of(lowered, compiled)
        memory = MemoryReport.of(compiled, *state, batch)
        assert memory.arguments == memory.state + memory.other_inputs, "shardings disagree with XLA"
        runs[s.name] = dict(
            strategy=s,
            step=step,
            state=state,
            batch=batch,
            memory=memory,
            comparison=comm.versus(theory),
            theory=theory,
            times=[],
        )

    def timed_step(run):
        t = time.perf_counter()
        model, opt_state, metrics = run["step"](*run["state"], run["batch"])
        jax.block_until_ready(metrics["loss"])
        run["state"] = (model, opt_state)
        return time.perf_counter() - t

    names = list(runs)
    for name in names:  # first call: the step compiles for real; then one warm step
        timed_step(runs[name])
        timed_step(runs[name])
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            runs[name]["times"].append(timed_step(runs[name]))

    single = runs[names[0]]
    t_single = statistics.median(single["times"])
    state_single = single["memory"].state
    temp_single = single["memory"].temporaries
    head = (
        "strategy",
        "step ms",
        "time/single",
        "comm B/device",
        "theory B",
        "lowered/th",
        "compiled/th",
        "state/device",
        "state/single",
        "ideal",
        "vs ideal",
        "temp/device",
        "temp/single",
    )
    rows = []
    results = {}
    for name, run in runs.items():
        s, memory, comparison = run["strategy"], run["memory"], run["comparison"]
        t = statistics.median(run["times"])
        split = _state_split(s)
        theory_bytes = run["theory"].bytes()
        lowered = sum(r.lowered for r in comparison.rows)
        compiled = sum(r.compiled for r in comparison.rows)

        def ratio(m, theory_bytes=theory_bytes):
            return "-" if theory_bytes == 0 and m == 0 else f"{m / theory_bytes:.3f}"

        state_ratio = memory.state / state_single
        results[name] = dict(
            step_ms=t * 1e3,
            time_ratio=t / t_single,
            comm_lowered=lowered,
            comm_compiled=compiled,
            theory=theory_bytes,
            state=memory.state,
            state_ratio=state_ratio,
            ideal=1 / split,
            temp=memory.temporaries,
            temp_ratio=memory.temporaries / temp_single,
        )
        rows.append(
            (
                name,
                f"{t * 1e3:.1f}",
                f"{t / t_single:.2f}",
                f"{compiled:,}",
                f"{theory_bytes:,}",
                ratio(lowered),
                ratio(compiled),
                f"{memory.state:,}",
                f"{state_ratio:.4f}",
                f"{1 / split:.4f}",
                f"{state_ratio * split:.3f}",
                f"{memory.temporaries:,}",
                f"{memory.temporaries / temp_single:.2f}",
            )
        )
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    fmt = "  ".join(f"{{:{'<' if i == 0 else '>'}{w}}}" for i, w in enumerate(widths))
    print(fmt.format(*head))
    print(fmt.format(*("-" * w for w in widths)))
    for row in rows:
        print(fmt.format(*row))

    print(
        f"\nstep ms: median of {args.rounds} steps, all strategies measured in turn in each round; "
        f"time/single: over the single-device step.\ncomm B/device: collective bytes per device per "
        f"step in the compiled program (collectives over one device excluded: they move nothing); "
        f"theory B: the minimum from eqxpar.inspect; lowered/th, compiled/th: measured / theory.\n"
        f"state: parameters + Adam state per device; ideal: 1/N for the N devices that split it "
        f"(DP keeps a whole copy on each device: ideal 1); vs ideal: state/single x N.\ntemp: XLA's "
        f"temporary bytes per device (activations, gathered weights, scratch), from memory_analysis()."
    )
    _explain_state(model, eqxpar, jax, eqx, runs)
    for run in (r for r in runs.values() if r["strategy"].remat):
        c, theory = run["comparison"], run["theory"]
        again = sum(t.bytes for t in theory.terms if t.kind == "all-gather" and "again" in t.what)
        gathered = sum(r.compiled for r in c.rows if r.kind == "all-gather")
        verdict = (
            "the compiled program keeps them"
            if gathered == theory.bytes("all-gather")
            else "the compiled program gathers only the forward pass's weights: XLA merged the second gathers "
            "into the first and keeps the gathered weights alive"
            if gathered == theory.bytes("all-gather") - again
            else "the compiled program gathers neither exactly once nor exactly twice"
        )
        print(
            f"\n{run['strategy'].name}: all-gather bytes lowered "
            f"{c.ratio('all-gather', stage='lowered'):.3f} x theory, "
            f"which counts {again:,} B of weights gathered again for the backward pass; compiled "
            f"{c.ratio('all-gather'):.3f} x: {verdict}."
        )
    if args.detail:
        for name, run in runs.items():
            print(f"\n{name}\n{run['comparison']}")
    return results


def _state_split(s: Strategy) -> int:
    """How many devices share (split) the parameters and optimizer state."""
    return s.mesh.get("model", 1) * (s.mesh.get("fsdp", 1))


def _explain_state(model, eqxpar, jax, eqx, runs) -> None:
    """Where the state sits above the ideal split: arrays the mesh cannot cut N ways."""
    single = next(iter(runs.values()))["memory"].state
    for name, run in runs.items():
        split = _state_split(run["strategy"])
        if split == 1:
            continue
        params, opt_state = run["state"]
        extra = {}
        kinds = set()
        for what, tree in (("parameters", params), ("optimizer state", opt_state)):
            rows = [r for r in eqxpar.sharding_report(tree).rows if r.bytes_per_device * split > r.bytes_total]
            extra[what] = sum(r.bytes_per_device - r.bytes_total / split for r in rows)
            kinds |= {_kind(r.path) for r in rows}
        gap = run["memory"].state - single / split
        print(
            f"{name}: {gap:,.0f} B per device above 1/{split}: {extra['parameters']:,.0f} B of parameters and "
            f"{extra['optimizer state']:,.0f} B of optimizer state in arrays split fewer than {split} ways "
            f"({', '.join(sorted(kinds))})."
        )


def _kind(path: str) -> str:
    labels = (
        ("norm", "layer norms"),
        ("position", "position embedding"),
        ("bias", "MLP output biases"),
        ("count", "Adam's step count"),
    )
    for word, label in labels:
        if word in path:
            return label
    return path


if __name__ == "__main__":
    main()
