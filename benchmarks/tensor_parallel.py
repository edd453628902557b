"""Tensor parallelism: parameter memory per device and communication per step, measured.

For a GPT from `eqxpar.models` split over model axes of size N = 1, 2, 4, 8, this compiles
the tensor-parallel loss-and-gradient function and reads, from the compiled program:

- **parameter bytes per device** (`memory_analysis().argument_size_in_bytes`, minus the
  token batch), as a fraction of the dense model's, next to the ideal 1/N. Layer norms,
  the position embedding and the row layers' biases stay replicated, so the measured
  fraction sits a little above 1/N;
- **temp bytes per device** (activations and other scratch of the step), for information:
  the hidden units and attention heads are split, the residual stream is not;
- **all-reduce bytes per step** (from the compiled HLO via `eqxpar.inspect`), next to the
  Megatron formula: each attention and each MLP all-reduces `batch x tokens x dim`
  numbers once forward and once backward, i.e. `2 x batch x tokens x dim x bytes` per
  sublayer, `4 x ...` per block; plus the embedding lookup (forward), the head's input
  gradient (backward) and the vocabulary-parallel loss (a max and two sums per token).

Run: `python benchmarks/tensor_parallel.py` (8 simulated CPU devices; a minute or two).
The bytes are those of the all-reduce operands; a ring all-reduce sends about
`2 (N - 1) / N` times that over each device's link.
"""

from __future__ import annotations

import argparse
import math

import equinox as eqx
import jax
import numpy as np
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar import nn
from eqxpar.inspect import CommReport
from eqxpar.models import GPT, next_token_loss


def measure(model: GPT, n: int, args) -> dict:
    mesh = eqxpar.make_mesh(model=n)
    specs = nn.partition_specs(model, mesh)
    model = eqxpar.shard(model, mesh, specs)
    tokens = np.zeros((args.batch, args.tokens + 1), np.int32)

    def local_loss_and_grads(model, tokens):  # on each device, with its blocks
        return eqx.filter_value_and_grad(next_token_loss)(model, tokens)

    loss_and_grads = eqxpar.filter_shard_map(
        local_loss_and_grads, mesh=mesh, in_specs=(specs, P()), out_specs=(P(), specs)
    )
    lowered = eqx.filter_jit(loss_and_grads).lower(model, tokens)
    compiled = lowered.compile()
    memory = compiled.compiled.memory_analysis()
    token_bytes = math.prod(tokens.shape) * 4  # replicated: every device holds the batch
    comm = CommReport.of(lowered, compiled)
    return {
        "param_bytes": memory.argument_size_in_bytes - token_bytes,
        "temp_bytes": memory.temp_size_in_bytes,
        "all_reduce_bytes": comm.bytes("all-reduce"),
        "all_reduces": comm.count("all-reduce"),
        "other_collectives": comm.count() - comm.count("all-reduce"),
    }


def formula_bytes(args, itemsize: int = 4) -> dict:
    activation = args.batch * args.tokens * args.dim * itemsize  # one all-reduce of the stream
    per_token = args.batch * args.tokens * itemsize
    blocks = args.layers * 2 * (2 * activation)  # 2 sublayers x (forward + backward)
    extra = 2 * activation + 3 * per_token  # embedding, head input grad; loss max + 2 sums
    return {"blocks": blocks, "total": blocks + extra}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args(argv)
    eqxpar.simulate_cpu_devices(args.devices)

    sizes = [n for n in (1, 2, 4, 8) if n <= jax.device_count()]
    model = GPT(args.vocab, args.tokens, args.dim, args.heads, args.layers, key=jax.random.key(0))
    results = {n: measure(model, n, args) for n in sizes}
    expected = formula_bytes(args)
    dense = results[1]["param_bytes"]
    print(
        f"GPT vocab={args.vocab} dim={args.dim} heads={args.heads} layers={args.layers}, "
        f"batch={args.batch} x tokens={args.tokens}, float32\n"
    )
    head = (
        f"{'model N':>7}  {'params/device':>14}  {'vs dense':>8}  {'ideal 1/N':>9}  "
        f"{'all-reduce bytes/step':>21}  {'formula':>11}  {'measured/formula':>16}  {'all-reduces':>11}  "
        f"{'temp bytes/device':>17}"
    )
    print(head)
    print("-" * len(head))
    for n, r in results.items():
        ratio = r["param_bytes"] / dense
        comm = r["all_reduce_bytes"] / expected["total"]
        print(
            f"{n:>7}  {r['param_bytes']:>14,}  {ratio:>8.3f}  {1 / n:>9.3f}  "
            f"{r['all_reduce_bytes']:>21,}  {expected['total']:>11,}  {comm:>16.3f}  "
            f"{r['all_reduces']:>11}  {r['temp_bytes']:>17,}"
        )
        assert r["other_collectives"] == 0, "expected all-reduces only"
    print(
        f"\nformula: blocks {args.layers} x 2 sublayers x 2 (fwd+bwd) x batch x tokens x dim x 4 B = "
        f"{expected['blocks']:,} B, plus embedding, head and loss = {expected['total']:,} B per step.\n"
        f"The all-reduce operands do not depend on N (at N=1 they span one device and move "
        f"nothing); what a ring all-reduce sends per device is 2 (N-1)/N times the operand."
    )
    return results


if __name__ == "__main__":
    main()
