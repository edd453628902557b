"""Benchmark: tokens/s, FLOP/s and MFU of the GPT's train step, per config and dtype, on
one device and on the full mesh.

For each GPT config (`--configs`, `DIMxLAYERS`) and dtype (`--dtypes`) it builds
`eqxpar.train.hybrid_step` on a one-device mesh and on the full mesh (`--mesh`, default
`data=N,model=1` for all N devices), times `--steps` steps after two warm ones, and prints:

- **tokens/s**: global batch x context / median step time;
- **model FLOP/s**: tokens/s x `eqxpar.models.gpt_flops_per_token` (`6 N + 12 L T d`);
- **XLA FLOP/s**: XLA's FLOP count of the compiled step (`eqxpar.inspect.compiled_flops`,
  per device, x devices) / step time: the model FLOPs plus element-wise work and the
  optimizer;
- **MFU**: model FLOP/s / (devices x the chip's peak, `eqxpar.inspect.peak_flops`), or `-`
  where the peak is unknown (CPU: read FLOP/s instead).

`bfloat16` is mixed precision: float32 master weights and Adam state, the loss computed in
bf16 (`eqxpar.train.Precision(compute_dtype=jnp.bfloat16)`), so its matmuls run in bf16.

Run: `python benchmarks/mfu.py`; `--configs 128x2 --steps 3` is quick;
`--out mfu.json` keeps the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import eqxpar


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="128x2,256x4", help="comma-separated DIMxLAYERS GPTs")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--context", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=32, help="global batch (sequences per step)")
    parser.add_argument("--dtypes", default="float32", help="comma-separated: float32, bfloat16")
    parser.add_argument("--mesh", default=None, help="the full mesh, e.g. data=2,model=4 (default data=N)")
    parser.add_argument("--steps", type=int, default=7, help="timed steps per run")
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (CPU only)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    try:
        args.configs = [tuple(int(v) for v in c.lower().split("x")) for c in args.configs.split(",")]
        assert all(len(c) == 2 and min(c) > 0 for c in args.configs)
    except (ValueError, AssertionError):
        parser.error(f"--configs takes DIMxLAYERS items like 128x2,256x4, got {args.configs!r}")
    args.dtypes = [d.strip() for d in args.dtypes.split(",")]
    if set(args.dtypes) - {"float32", "bfloat16"}:
        parser.error(f"--dtypes takes float32 and/or bfloat16, got {args.dtypes}")
    if args.mesh:
        try:
            args.mesh = {k.strip(): int(v) for k, v in (item.split("=") for item in args.mesh.split(","))}
        except ValueError:
            parser.error(f"--mesh takes axis=size items like data=2,model=4, got {args.mesh!r}")
    return args


def main(argv=None) -> list:
    args = parse(argv)
    eqxpar.simulate_cpu_devices(args.devices)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import PartitionSpec as P

    from eqxpar.datasets import python_source_text
    from eqxpar.inspect import compiled_flops, mfu, peak_flops
    from eqxpar.models import GPT, gpt_flops_per_token, next_token_loss
    from eqxpar.nn import partition_specs
    from eqxpar.train import Precision, hybrid_step

    full = args.mesh or {"data": jax.device_count(), "model": 1}
    full.setdefault("model", 1)
    meshes = {"1 device": {"data": 1, "model": 1}, ",".join(f"{k}={v}" for k, v in full.items()): full}
    text = python_source_text()
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(text.ids) - args.context - 1, args.batch)
    tokens = np.stack([text.ids[s : s + args.context + 1] for s in starts]).astype(np.int32)
    device = jax.devices()[0]
    print(
        f"{device.device_kind} ({device.platform}); peak bf16 {peak_flops(device, jnp.bfloat16)}, "
        f"fp32 {peak_flops(device, jnp.float32)} FLOP/s per chip; global batch {args.batch} x {args.context} tokens\n"
    )

    def loss_fn(model, batch, key):
        return next_token_loss(model, batch, key=key)

    rows = []
    for dim, layers in args.configs:
        for dtype_name in args.dtypes:
            dtype = jnp.dtype(dtype_name)
            for mesh_name, sizes in meshes.items():
                gpt = GPT(text.vocab_size, args.context, dim, args.heads, layers, key=jax.random.key(0))
                flops_per_token = gpt_flops_per_token(gpt, args.context)
                mesh = eqxpar.make_mesh(**sizes)
                n = mesh.devices.size
                precision = Precision(compute_dtype=dtype) if dtype != jnp.float32 else None
                step = hybrid_step(
                    loss_fn, optax.adam(1e-3), mesh, param_specs=partition_specs(gpt, mesh), precision=precision
                )
                state = step.init(gpt)
                batch = eqxpar.shard(tokens, mesh, P("data"))
                xla_flops = compiled_flops(step.lower(*state, batch).compile())  # per device
                times = []
                for i in range(args.steps + 2):
                    t = time.perf_counter()
                    m, o, metrics = step(*state, batch)
                    jax.block_until_ready(metrics["loss"])
                    state = (m, o)
                    if i >= 2:
                        times.append(time.perf_counter() - t)
                t = statistics.median(times)
                tokens_per_s = args.batch * args.context / t
                rows.append(
                    dict(
                        config=f"{dim}x{layers}",
                        dtype=dtype_name,
                        mesh=mesh_name,
                        devices=n,
                        step_ms=t * 1e3,
                        tokens_per_s=tokens_per_s,
                        flops_per_token=flops_per_token,
                        model_flops_per_s=tokens_per_s * flops_per_token,
                        xla_flops_per_s=None if xla_flops is None else xla_flops * n / t,
                        mfu=mfu(tokens_per_s, flops_per_token, n, device, dtype),
                        loss=float(metrics["loss"]),
                    )
                )
                print(_row(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(config=dict(vars(args)), device=device.device_kind, rows=rows), f, indent=1)
    return rows


def _row(r: dict) -> str:
    xla = "-" if r["xla_flops_per_s"] is None else f"{r['xla_flops_per_s'] / 1e9:.2f}"
    mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    return (
        f"{r['config']:>7} {r['dtype']:>8} {r['mesh']:>14}: step {r['step_ms']:8.1f} ms  "
        f"{r['tokens_per_s']:10,.0f} tokens/s  model {r['model_flops_per_s'] / 1e9:8.2f} GFLOP/s  "
        f"XLA {xla:>8} GFLOP/s  MFU {mfu:>6}"
    )


if __name__ == "__main__":
    main()
