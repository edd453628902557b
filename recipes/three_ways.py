"""One layer, three ways to run it on many devices: jit, sharding constraints, shard_map.

The layer is `sigmoid(x @ W + b)` with x: (32,), W: (32, 4), b: (4,) drawn from
`np.random.default_rng(seed)`. The dot product's contracted axis (the 32 input features) is
split over a 1-D mesh named `x`, and the layer is computed

1. by `jax.jit` on inputs already sharded with `jax.device_put` (the compiler works out the
   communication: "computation follows data");
2. by `jax.jit` on unsharded inputs, with `jax.lax.with_sharding_constraint` inside the
   function saying how they should be laid out;
3. by `jax.shard_map`, writing the per-device program by hand: each device multiplies its
   block of x by its block of W's rows, and `jax.lax.psum` adds the partial products;

and once on a single device as the reference. All four must agree, and with the default
seed they reproduce the numbers printed in the tutorial this recipe is built on.

Run it:

    python recipes/three_ways.py                  # 8 simulated CPU devices, mesh x=8
    python recipes/three_ways.py --devices 1      # one device: mesh x=1
    python recipes/three_ways.py --mesh x=4       # use only the first 4 devices
    python recipes/three_ways.py --seed 3 --metrics-out three_ways.json
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import eqxpar
import eqxpar.recipe
from eqxpar.testing import F32_ATOL, F32_RTOL, assert_trees_close, on_one_device


@dataclasses.dataclass
class Config:
    devices: int = 8  # simulated CPU devices when there is no accelerator
    mesh: str = "auto"  # one axis whose size divides 32, e.g. x=4; auto: the largest the devices allow
    seed: int = 0  # seed of np.random.default_rng
    metrics_out: str | None = None  # write the results as JSON here


FEATURES = 32  # length of x and rows of W: the axis the devices split
OUTPUTS = 4  # columns of W and length of b

# What the tutorial printed for seed 0 (an external reference, run on a TPU). Its own four
# runs differ from each other by up to 1.2e-7, and the exact (float64) values differ from
# its printout by up to 5.1e-7, so its numbers are good to about 5e-7: 2e-6 absolute leaves
# room for a different machine's float32 rounding and still fails on any real mistake (a
# missing or doubled psum moves the outputs by orders of magnitude more).
TUTORIAL_SEED = 0
TUTORIAL_VALUES = np.array([0.02138912, 0.893112, 0.59892005, 0.97742504])
TUTORIAL_ATOL = 2e-6


def make_inputs(seed: int, features: int = FEATURES, outputs: int = OUTPUTS):
    """x: (features,), W: (features, outputs), b: (outputs,) from `np.random.default_rng(seed)`.

    Drawn in the tutorial's order (x, then W, then b) and cast to float32, which is what
    JAX does to float64 NumPy input anyway.
    """
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(features,)).astype(np.float32)
    weights = rng.normal(size=(features, outputs)).astype(np.float32)
    bias = rng.normal(size=(outputs,)).astype(np.float32)
    return x, weights, bias


def layer(x, weights, bias):
    """The layer as written for one device: `sigmoid(x @ W + b)`."""
    return jax.nn.sigmoid(x @ weights + bias)


# ---- Way 1: jit on sharded inputs -------------------------------------------------------
def way_jit(mesh, x, weights, bias):
    """Shard x and W's rows over the mesh with device_put, then call the plain jitted layer.

    The code of `layer` does not change; the compiler sees that `x @ W` contracts a split
    axis and inserts the all-reduce itself.
    """
    (axis,) = mesh.axis_names
    split = NamedSharding(mesh, P(axis))
    x_sharded = jax.device_put(x, split)
    weights_sharded = jax.device_put(weights, split)  # P("x") splits W's first axis: rows
    return jax.jit(layer)(x_sharded, weights_sharded, bias)


# ---- Way 2: sharding constraints inside jit --------------------------------------------
# The mesh is a static argument: one compile per mesh, reused on every call.
@functools.partial(jax.jit, static_argnames="mesh")
def way_constraint(mesh, x, weights, bias):
    """Pass unsharded inputs; `with_sharding_constraint` inside jit says how to lay them out."""
    (axis,) = mesh.axis_names
    split = NamedSharding(mesh, P(axis))
    x = jax.lax.with_sharding_constraint(x, split)
    weights = jax.lax.with_sharding_constraint(weights, split)
    return layer(x, weights, bias)


# ---- Way 3: shard_map, the per-device program written by hand ---------------------------
def layer_per_device(x_block, weights_block, bias, axis_name):
    """What one device runs: its share of the dot product, then a sum over all devices.

    `x_block` is this device's slice of x (features / devices entries) and `weights_block`
    the matching rows of W, so `x_block @ weights_block` is a partial sum of the full dot
    product. `psum` adds the partial sums of every device on `axis_name`: the one collective
    this layer needs. Every device ends with the same (replicated) result.
    """
    partial_product = x_block @ weights_block
    return jax.nn.sigmoid(jax.lax.psum(partial_product, axis_name) + bias)


@functools.partial(jax.jit, static_argnames="mesh")
def way_shard_map(mesh, x, weights, bias):
    """`jax.shard_map` of `layer_per_device`: x and W's rows split, b and the output replicated."""
    (axis,) = mesh.axis_names
    per_device = functools.partial(layer_per_device, axis_name=axis)
    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(P(axis), P(axis, None), P()),
        out_specs=P(),  # replicated: every device holds the whole (outputs,) vector
    )(x, weights, bias)


WAYS = {"jit": way_jit, "constraint": way_constraint, "shard_map": way_shard_map}


def check_mesh(sizes: dict[str, int], features: int = FEATURES) -> None:
    """Raise a ValueError unless `sizes` is one axis whose size divides `features`."""
    if len(sizes) != 1:
        raise ValueError(
            f"three_ways: the mesh must have exactly one axis (the one the {features} input "
            f"features are split over), got {sizes}. Use e.g. --mesh x=8."
        )
    ((name, size),) = sizes.items()
    if features % size:
        divisors = [d for d in range(1, features + 1) if features % d == 0]
        raise ValueError(
            f"three_ways: mesh axis {name}={size} does not divide the {features} input "
            f"features. Use a size from {divisors}."
        )


def check_flags(cfg: Config) -> Config:
    """Every check of the flags, before anything compiles; returns `cfg` with its mesh chosen."""
    if cfg.seed < 0:
        raise ValueError(f"--seed must be at least 0 (a NumPy seed), got {cfg.seed}.")
    eqxpar.simulate_cpu_devices(cfg.devices)  # before JAX touches a backend
    sizes = eqxpar.recipe.mesh_from_flag(
        cfg.mesh, {"x": 8}, divides={"x": {"the input features": FEATURES}}, any_names=True
    )
    check_mesh(sizes)
    return dataclasses.replace(cfg, mesh=eqxpar.recipe.mesh_text(sizes))


def main(argv=None) -> dict:
    cfg = eqxpar.recipe.parse_flags(Config, argv, validate=check_flags)  # bad flags: one line, exit 2
    mesh = eqxpar.make_mesh(**eqxpar.parse_mesh(cfg.mesh))
    x, weights, bias = make_inputs(cfg.seed)
    print(
        f"mesh {dict(mesh.shape)} on {mesh.size} of {jax.device_count()} devices; "
        f"x {x.shape}, W {weights.shape}, b {bias.shape}"
    )

    reference = on_one_device(layer, x, weights, bias)
    results = {name: way(mesh, x, weights, bias) for name, way in WAYS.items()}

    print(f"{'single device':>14}: {np.asarray(reference)}")
    for name, value in results.items():
        print(f"{name:>14}: {np.asarray(value)}   output sharding {value.sharding.spec}")
    if cfg.seed == TUTORIAL_SEED:
        print(f"{'tutorial':>14}: {TUTORIAL_VALUES.astype(np.float32)}")

    # Each way must agree with the single-device layer to float32 accuracy.
    errors = {name: float(np.max(np.abs(np.asarray(v) - np.asarray(reference)))) for name, v in results.items()}
    agree = {
        name: bool(np.allclose(np.asarray(v), np.asarray(reference), rtol=F32_RTOL, atol=F32_ATOL))
        for name, v in results.items()
    }
    metrics = {
        "mesh": dict(mesh.shape),
        "seed": cfg.seed,
        "single_device": np.asarray(reference).tolist(),
        **{name: np.asarray(v).tolist() for name, v in results.items()},
        "max_abs_error_vs_single_device": errors,
        "ways_match_single_device": all(agree.values()),
    }
    # The tutorial printed seed 0 only; for other seeds there is nothing to compare with.
    if cfg.seed == TUTORIAL_SEED:
        to_tutorial = max(
            float(np.max(np.abs(np.asarray(v) - TUTORIAL_VALUES))) for v in [reference, *results.values()]
        )
        metrics["tutorial_values"] = TUTORIAL_VALUES.tolist()
        metrics["max_abs_error_vs_tutorial"] = to_tutorial
        metrics["matches_tutorial"] = to_tutorial <= TUTORIAL_ATOL
    else:
        metrics["matches_tutorial"] = None
    eqxpar.recipe.write_metrics(cfg.metrics_out, metrics)

    # The final check: fail loudly (after the metrics are written) if anything disagrees.
    for name, value in results.items():
        assert_trees_close(value, reference, what=f"way {name!r} vs single device")
    if metrics["matches_tutorial"] is False:
        raise AssertionError(
            f"the results differ from the tutorial's {TUTORIAL_VALUES} by "
            f"{metrics['max_abs_error_vs_tutorial']:.2e} > {TUTORIAL_ATOL}"
        )
    note = ""
    if metrics["matches_tutorial"]:
        note = f"; all reproduce the tutorial's values (max abs error {metrics['max_abs_error_vs_tutorial']:.1e})"
    print(
        f"three_ways: jit, with_sharding_constraint and shard_map+psum on {mesh.size} "
        f"device(s) match one device (max abs error {max(errors.values()):.1e}){note}"
    )
    return metrics


if __name__ == "__main__":
    main()
