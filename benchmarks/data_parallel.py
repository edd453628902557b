"""Benchmark: eqxpar's data-parallel step against a hand-written `jax.jit` step.

Both steps train the same MLP on the same batch and mesh with the same optimizer:

- `eqxpar`: `eqxpar.train.data_parallel_step` (`eqx.filter_jit` around `filter_shard_map`,
  one explicit all-reduce of loss and gradients);
- `jax.jit`: a plain single-program step whose parameters are replicated and whose batch is
  split with `NamedSharding`, leaving the gradient all-reduce to XLA's SPMD partitioner.

For a small model (dispatch-bound: the time is Python and runtime overhead) and a larger one
(compute-bound), it prints the median time per step of each, measured alternately in one
run, and their ratio (target: at most 1.05). From each compiled HLO it prints the number of
all-reduces per step and the bytes they carry, next to the gradient (= parameter) bytes
(target: one combined all-reduce of the gradients, plus the 4-byte loss).

    python benchmarks/data_parallel.py                # 8 simulated CPU devices
    python benchmarks/data_parallel.py --repeats 200
"""

from __future__ import annotations

import argparse
import statistics
import time

import eqxpar
from eqxpar.inspect import collectives_in_hlo


def all_reduces(hlo_text: str) -> list[int]:
    """Bytes of each all-reduce in a compiled (per-device) HLO module, in program order
    (a combined all-reduce of several arrays counts once, with all their bytes)."""
    return [c.bytes for c in collectives_in_hlo(hlo_text) if c.kind == "all-reduce"]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument(
        "--repeats",
        type=int,
        default=400,
        help="timed steps of each kind for the small model (a tenth of that for the large one)",
    )
    args = parser.parse_args(argv)
    eqxpar.simulate_cpu_devices(args.devices)

    import equinox as eqx
    import jax
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from eqxpar.train import data_parallel_step, shard_batch

    mesh = eqxpar.make_mesh(data=args.devices)
    optimizer = optax.sgd(0.01, momentum=0.9)

    def loss_fn(model, batch, key):
        x, y = batch
        return optax.softmax_cross_entropy_with_integer_labels(jax.vmap(model)(x), y).mean()

    def handwritten_step(static):
        """The comparison: jax.jit with NamedSharding, no shard_map, no Equinox filtering."""
        replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

        def step(params, opt_state, batch):
            loss, grads = jax.value_and_grad(lambda p: loss_fn(eqx.combine(p, static), batch, None))(params)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, {"loss": loss}

        return jax.jit(
            step,
            in_shardings=(replicated, replicated, split),
            out_shardings=(replicated, replicated, replicated),
            donate_argnums=(0, 1),
        )

    cases = {
        # name: (features, width, depth, classes, global batch, timed steps)
        "small (dispatch-bound)": (64, 32, 2, 10, 64, args.repeats),
        "large (compute-bound)": (512, 1024, 2, 10, 1024, max(20, args.repeats // 10)),
    }
    results = {}
    print(f"{args.devices} devices ({jax.devices()[0].platform}), mesh data={args.devices}\n")
    for name, (features, width, depth, classes, batch_size, repeats) in cases.items():
        key = jax.random.key(0)
        model = eqx.nn.MLP(features, classes, width, depth, activation=jax.nn.relu, key=key)
        params, static = eqx.partition(model, eqx.is_inexact_array)
        rng = np.random.default_rng(0)
        host_batch = (
            rng.normal(size=(batch_size, features)).astype(np.float32),
            rng.integers(0, classes, batch_size).astype(np.int32),
        )
        batch = shard_batch(host_batch, mesh)

        ours = data_parallel_step(loss_fn, optimizer, mesh)
        theirs = handwritten_step(static)
        state_ours = eqxpar.shard((model, optimizer.init(params)), mesh)
        state_theirs = eqxpar.shard((jax.tree.map(np.array, params), optimizer.init(params)), mesh)

        hlo_ours = ours.lower(*state_ours, batch).compile().as_text()
        hlo_theirs = theirs.lower(*state_theirs, batch).compile().as_text()

        times = {"eqxpar": [], "jax.jit": []}

        # Both run within this iteration of the loop, so they see its `ours`, `theirs` and
        # `batch`; they are bound as defaults all the same (ruff B023).
        def run_ours(state, ours=ours, batch=batch, times=times):
            t = time.perf_counter()
            model, opt_state, metrics = ours(*state, batch)
            jax.block_until_ready(metrics)
            times["eqxpar"].append(time.perf_counter() - t)
            return model, opt_state

        def run_theirs(state, theirs=theirs, batch=batch, times=times):
            t = time.perf_counter()
            params, opt_state, metrics = theirs(*state, batch)
            jax.block_until_ready(metrics)
            times["jax.jit"].append(time.perf_counter() - t)
            return params, opt_state

        for _ in range(5):  # compile and warm up
            state_ours, state_theirs = run_ours(state_ours), run_theirs(state_theirs)
        times = {k: [] for k in times}
        # Alternate the two so that load from anything else on the machine hits both alike.
        for i in range(repeats):
            if i % 2:
                state_ours, state_theirs = run_ours(state_ours), run_theirs(state_theirs)
            else:
                state_theirs, state_ours = run_theirs(state_theirs), run_ours(state_ours)

        med = {k: statistics.median(v) for k, v in times.items()}
        ratio = med["eqxpar"] / med["jax.jit"]
        grad_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
        reduces_ours, reduces_theirs = all_reduces(hlo_ours), all_reduces(hlo_theirs)
        n_params = sum(x.size for x in jax.tree.leaves(params))
        print(
            f"{name}: MLP {features}-{'-'.join([str(width)] * depth)}-{classes}, {n_params:,} parameters, "
            f"global batch {batch_size}, {repeats} timed steps each"
        )
        print(
            f"  median step: eqxpar {med['eqxpar'] * 1e3:8.3f} ms   jax.jit {med['jax.jit'] * 1e3:8.3f} ms   "
            f"ratio {ratio:.3f} (target <= 1.05)"
        )
        print(
            f"  all-reduces per step: eqxpar {len(reduces_ours)} carrying {sum(reduces_ours):,} bytes; "
            f"jax.jit {len(reduces_theirs)} carrying {sum(reduces_theirs):,} bytes"
        )
        print(f"  gradient bytes {grad_bytes:,} (+ 4 for the loss = {grad_bytes + 4:,})\n")
        results[name] = {
            "median_s": med,
            "ratio": ratio,
            "all_reduces": {"eqxpar": reduces_ours, "jax.jit": reduces_theirs},
            "gradient_bytes": grad_bytes,
        }
    return results


if __name__ == "__main__":
    main()
