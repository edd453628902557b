"""Sharding basics: how a jax.Array is laid out over devices, and what jit and shard_map do with it.

Follows the tutorial this project's seed recipes come from, on the same 4x8 array
`arange(32.0).reshape(4, 8)`:

1. a device mesh, a `NamedSharding` and `jax.device_put` split the array into blocks, one
   per device; `jax.debug.visualize_array_sharding` draws which device holds which block;
2. a jitted elementwise function keeps its input's sharding ("computation follows data");
3. a jitted reduction over the first axis comes out *partially replicated*: each block of
   the result lives on several devices;
4. `jax.lax.with_sharding_constraint` asks for the reduction's result fully sharded instead;
5. `jax.shard_map` runs a function on each device's local block (its shape is printed), and
   a sum over all blocks needs the explicit collective `jax.lax.psum`.

Every step is checked (shardings, values against NumPy), and the checks are written to the
metrics JSON.

Run it:

    python recipes/sharding_basics.py                      # 8 simulated CPU devices, mesh x=2,y=4
    python recipes/sharding_basics.py --mesh x=2,y=2       # only the first 4 devices
    python recipes/sharding_basics.py --devices 1          # one device: mesh x=1,y=1
    python recipes/sharding_basics.py --metrics-out basics.json
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import eqxpar
import eqxpar.recipe


@dataclasses.dataclass
class Config:
    devices: int = 8  # simulated CPU devices when there is no accelerator
    mesh: str = "auto"  # two axes: the 1st splits the 4 rows, the 2nd the 8 columns (e.g. x=2,y=4); auto: fit
    metrics_out: str | None = None  # write the results as JSON here


ROWS, COLS = 4, 8  # the tutorial's array: arange(32.0).reshape(4, 8)


def replicas_per_block(array: jax.Array) -> int:
    """How many devices hold each block of `array` (1: fully sharded; all: fully replicated)."""
    index_map = array.sharding.devices_indices_map(array.shape)
    blocks = {tuple((s.start, s.stop) for s in index) for index in index_map.values()}
    return len(index_map) // len(blocks)


def shards_hold_their_blocks(array: jax.Array, expected: np.ndarray) -> bool:
    """True if every device's shard is exactly the block of `expected` its index names."""
    return all(np.array_equal(np.asarray(s.data), expected[s.index]) for s in array.addressable_shards)


def elementwise(x):
    return 2 * jnp.sin(x) + 1


def contract(x):
    return x.sum(axis=0)


def check_mesh(sizes: dict[str, int]) -> None:
    """Raise a ValueError unless `sizes` has two axes that split the 4x8 array evenly."""
    if len(sizes) != 2:
        raise ValueError(
            f"sharding_basics: the mesh needs exactly two axes (rows, columns), got {sizes}. Use e.g. --mesh x=2,y=4."
        )
    (row_axis, rows), (col_axis, cols) = sizes.items()
    if ROWS % rows or COLS % cols:
        raise ValueError(
            f"sharding_basics: mesh {row_axis}={rows},{col_axis}={cols} does not split the "
            f"{ROWS}x{COLS} array evenly: the first axis size must divide {ROWS} and the "
            f"second must divide {COLS} (e.g. --mesh x=2,y=4 or x=1,y=2)."
        )


def check_flags(cfg: Config) -> Config:
    """Every check of the flags, before anything compiles; returns `cfg` with its mesh chosen."""
    eqxpar.simulate_cpu_devices(cfg.devices)  # before JAX touches a backend
    sizes = eqxpar.recipe.mesh_from_flag(
        cfg.mesh, {"x": 2, "y": 4}, divides={"x": {"the rows": ROWS}, "y": {"the columns": COLS}}, any_names=True
    )
    check_mesh(sizes)
    return dataclasses.replace(cfg, mesh=eqxpar.recipe.mesh_text(sizes))


def main(argv=None) -> dict:
    cfg = eqxpar.recipe.parse_flags(Config, argv, validate=check_flags)  # bad flags: one line, exit 2
    sizes = eqxpar.parse_mesh(cfg.mesh)
    row_axis, col_axis = sizes
    checks: dict[str, bool] = {}

    # ---- 1. One array, one device; then split over a mesh -------------------------------
    arr = jnp.arange(32.0).reshape(ROWS, COLS)
    host = np.arange(32.0, dtype=np.float32).reshape(ROWS, COLS)
    print(f"a new array lives on one device: {arr.sharding}")
    jax.debug.visualize_array_sharding(arr)

    mesh = eqxpar.make_mesh(**sizes)  # Auto axes: see docs/concepts/sharding.md
    sharding = NamedSharding(mesh, P(row_axis, col_axis))
    print(sharding)
    arr_sharded = jax.device_put(arr, sharding)
    print(arr_sharded)
    jax.debug.visualize_array_sharding(arr_sharded)
    block = sharding.shard_shape(arr.shape)
    print(f"each of the {mesh.size} devices holds a {block} block")
    checks["device_put_blocks_correct"] = shards_hold_their_blocks(arr_sharded, host)

    # ---- 2. jit of an elementwise function: the output keeps the input's sharding -------
    result = jax.jit(elementwise)(arr_sharded)
    print("elementwise: shardings match:", result.sharding == arr_sharded.sharding)
    checks["elementwise_sharding_preserved"] = result.sharding == arr_sharded.sharding
    checks["elementwise_values_correct"] = bool(
        np.allclose(np.asarray(result), 2 * np.sin(host) + 1, rtol=1e-5, atol=1e-6)
    )

    # ---- 3. jit of a contraction: the result is partially replicated --------------------
    summed = jax.jit(contract)(arr_sharded)
    print(f"sum over axis 0: {summed.sharding.spec}, each block held by {replicas_per_block(summed)} device(s)")
    jax.debug.visualize_array_sharding(summed)
    print(summed)
    # The row axis was summed away, so the devices along it hold the same columns.
    checks["contract_replicated_along_rows"] = replicas_per_block(summed) == mesh.shape[row_axis]
    checks["contract_values_correct"] = bool(np.array_equal(np.asarray(summed), host.sum(axis=0)))

    # ---- 4. with_sharding_constraint: ask for the result split over every device --------
    @jax.jit
    def contract_fully_sharded(x):
        out = contract(x)
        # Both mesh axes on the one dimension that is left: mesh.size blocks, one per device.
        return jax.lax.with_sharding_constraint(out, NamedSharding(mesh, P((row_axis, col_axis))))

    constrained = contract_fully_sharded(arr_sharded)
    print(
        f"with_sharding_constraint: {constrained.sharding.spec}, each block held by "
        f"{replicas_per_block(constrained)} device(s)"
    )
    jax.debug.visualize_array_sharding(constrained)
    checks["constrained_fully_sharded"] = replicas_per_block(constrained) == 1
    checks["constrained_values_correct"] = bool(np.array_equal(np.asarray(constrained), host.sum(axis=0)))

    # ---- 5. shard_map: write what one device does with its block ------------------------
    line = eqxpar.make_mesh(x=mesh.size)  # a 1-D mesh over the same devices, as in the tutorial
    x = jnp.arange(32)
    print(f"global shape: {x.shape}")
    local_shapes = []

    def double(block):
        # Runs once while tracing: the shape a device sees is its block, not the array.
        print(f"device local shape: {block.shape}")
        local_shapes.append(block.shape)
        return block * 2

    doubled = jax.shard_map(double, mesh=line, in_specs=P("x"), out_specs=P("x"))(x)
    checks["shard_map_local_shape_correct"] = local_shapes == [(32 // line.size,)]
    checks["shard_map_values_correct"] = bool(np.array_equal(np.asarray(doubled), 2 * np.arange(32)))

    # jnp.sum inside shard_map sums one block: one partial sum per device.
    def block_sum(block):
        return jnp.sum(block, keepdims=True)

    per_block = jax.shard_map(block_sum, mesh=line, in_specs=P("x"), out_specs=P("x"))(x)
    print(f"sum per block (no collective): {per_block}")

    # The total across blocks needs a collective, asked for by name: psum over "x".
    def total_sum(block):
        return jax.lax.psum(block.sum(), "x")

    total = jax.shard_map(total_sum, mesh=line, in_specs=P("x"), out_specs=P())(x)
    print(f"psum over all blocks: {total}")
    expected_total = int(np.arange(32).sum())
    checks["per_block_sums_correct"] = bool(
        np.array_equal(np.asarray(per_block), np.arange(32).reshape(line.size, -1).sum(axis=1))
    )
    checks["psum_total_correct"] = int(total) == expected_total

    metrics = {
        "mesh": dict(mesh.shape),
        "block_shape": list(block),
        "contract_spec": str(summed.sharding.spec),
        "contract_replicas_per_block": replicas_per_block(summed),
        "constrained_spec": str(constrained.sharding.spec),
        "shard_map_local_shape": list(local_shapes[0]),
        "per_block_sums": np.asarray(per_block).tolist(),
        "psum_total": int(total),
        "expected_total": expected_total,
        "checks": checks,
        "all_checks_pass": all(checks.values()),
    }
    eqxpar.recipe.write_metrics(cfg.metrics_out, metrics)
    failed = [name for name, ok in checks.items() if not ok]
    if failed:
        raise AssertionError(f"sharding_basics: checks failed: {failed}")
    print(
        f"sharding_basics: {len(checks)} checks pass on mesh {dict(mesh.shape)}; "
        f"psum total {int(total)} = sum(arange(32))"
    )
    return metrics


if __name__ == "__main__":
    main()
