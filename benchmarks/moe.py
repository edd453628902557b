"""Benchmark: a mixture-of-experts GPT on one device, data parallel, and expert parallel.

For the GPT of `eqxpar.models` with `moe=` (every block's MLP replaced by 8 SwiGLU experts,
top-2 routing, capacity factor 1.25; Adam; windows of Python's source text), this builds one
train step per layout on 8 simulated CPU devices, all with `eqxpar.train.hybrid_step`:

- single device (`data=1,expert=1`);
- data parallel (`data=8,expert=1`): every device holds every expert;
- expert parallel (`data=2,expert=4` and `data=1,expert=8`, `expert_axis="expert"`): each
  device holds `8 / expert` experts of every block and routes its own sequences.

and prints one row per layout: the median step time (all layouts measured in turn within
each round) over the single device's; the compiled all-to-all bytes per device per step
against `eqxpar.inspect.expert_parallel_theory` (1.000: exactly the theory); the
all-reduce bytes; and the parameter + Adam state per device over the single device's.

Run: `python benchmarks/moe.py` (a minute or two on two cores), or smaller:
`python benchmarks/moe.py --dim 64 --layers 2 --rounds 3`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import eqxpar

LAYOUTS = (
    ("single device", {"data": 1, "expert": 1}),
    ("DP data=8", {"data": 8, "expert": 1}),
    ("EP data=2,expert=4", {"data": 2, "expert": 4}),
    ("EP data=1,expert=8", {"data": 1, "expert": 8}),
)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--context", type=int, default=32, help="tokens per sequence (one routing group)")
    parser.add_argument("--batch", type=int, default=32, help="global batch (sequences per step)")
    parser.add_argument("--rounds", type=int, default=9, help="timed steps of each layout")
    args = parser.parse_args(argv)
    eqxpar.simulate_cpu_devices(args.devices)

    import equinox as eqx
    import jax
    import numpy as np
    import optax
    from jax.sharding import PartitionSpec as P

    from eqxpar.datasets import python_source_text
    from eqxpar.inspect import CommReport, MemoryReport, expert_parallel_theory
    from eqxpar.models import GPT, MoEOptions, next_token_loss
    from eqxpar.nn import partition_specs
    from eqxpar.train import hybrid_step

    text = python_source_text()
    moe = MoEOptions(num_experts=args.experts, top_k=2, capacity_factor=1.25)

    def new_model():
        return GPT(text.vocab_size, args.context, args.dim, args.heads, args.layers, moe=moe, key=jax.random.key(0))

    def loss_fn(model, tokens, key):
        return next_token_loss(model, tokens, key=key)

    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(text.ids) - args.context - 1, args.batch)
    tokens = np.stack([text.ids[s : s + args.context + 1] for s in starts]).astype(np.int32)
    model = new_model()
    n_params = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))
    print(
        f"MoE GPT vocab={text.vocab_size} dim={args.dim} heads={args.heads} layers={args.layers} "
        f"experts={args.experts} (top-2, capacity 1.25) context={args.context}: {n_params:,} parameters; "
        f"Adam; global batch {args.batch} x {args.context} tokens; "
        f"{jax.device_count()} {jax.devices()[0].platform} devices\n"
    )

    runs = {}
    for name, sizes in LAYOUTS:
        if sizes["data"] * sizes["expert"] > jax.device_count():
            continue
        mesh = eqxpar.make_mesh(**sizes, model=1)
        specs = partition_specs(model, mesh)
        expert_axis = "expert" if sizes["expert"] > 1 else None
        step = hybrid_step(loss_fn, optax.adam(1e-3), mesh, param_specs=specs, expert_axis=expert_axis)
        state = step.init(new_model())
        batch = eqxpar.shard(tokens, mesh, P(step.batch_axis))
        lowered = step.lower(*state, batch)
        compiled = lowered.compile()
        comm = CommReport.of(lowered, compiled)
        theory = expert_parallel_theory(
            mesh,
            groups=args.batch,
            capacity=model.blocks[0].moe.capacity(args.context),
            dim=args.dim,
            num_experts=args.experts,
            num_layers=args.layers,
            batch_axis=step.batch_axis if expert_axis else "expert",
        )
        memory = MemoryReport.of(compiled, *state, batch)
        runs[name] = dict(step=step, state=state, batch=batch, comm=comm, theory=theory, memory=memory, mesh=mesh)
        runs[name]["times"] = []

    def timed_step(run):
        t = time.perf_counter()
        model, opt_state, metrics = run["step"](*run["state"], run["batch"])
        jax.block_until_ready(metrics["loss"])
        run["state"] = (model, opt_state)
        return time.perf_counter() - t

    names = list(runs)
    for name in names:  # the first call, then one warm step
        timed_step(runs[name])
        timed_step(runs[name])
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            runs[name]["times"].append(timed_step(runs[name]))

    single = runs[names[0]]
    t_single = statistics.median(single["times"])
    head = (
        "layout",
        "step ms",
        "time/single",
        "all-to-all B",
        "theory B",
        "a2a/th",
        "all-reduce B",
        "state/device",
        "state/single",
    )
    rows, results = [], {}
    for name, run in runs.items():
        t = statistics.median(run["times"])
        a2a = run["comm"].bytes("all-to-all", stage="compiled")
        theory = run["theory"].bytes("all-to-all")
        # Over more than one device (one-device collectives, of the size-1 model axis, move nothing).
        reduce = sum(c.bytes for c in run["comm"].collectives("all-reduce") if c.axes(run["mesh"]) != ())
        state = run["memory"].state
        results[name] = dict(
            step_ms=t * 1e3,
            time_ratio=t / t_single,
            all_to_all=a2a,
            theory=theory,
            all_reduce=reduce,
            state=state,
            state_ratio=state / single["memory"].state,
        )
        rows.append(
            (
                name,
                f"{t * 1e3:.1f}",
                f"{t / t_single:.2f}",
                f"{a2a:,}",
                f"{theory:,}",
                "-" if theory == 0 and a2a == 0 else f"{a2a / theory:.3f}",
                f"{reduce:,}",
                f"{state:,}",
                f"{state / single['memory'].state:.3f}",
            )
        )
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    fmt = "  ".join(f"{{:{'<' if i == 0 else '>'}{w}}}" for i, w in enumerate(widths))
    for row in (head, tuple("-" * w for w in widths), *rows):
        print(fmt.format(*row))
    print(
        f"\nstep ms: median of {args.rounds} steps, all layouts measured in turn in each round. all-to-all B, "
        f"all-reduce B: bytes per device per step in the compiled program (collectives over one device "
        f"excluded); theory B: eqxpar.inspect.expert_parallel_theory. state: parameters + Adam state per device."
    )
    return results


if __name__ == "__main__":
    main()
