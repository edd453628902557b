"""Data parallelism with `jax.pmap`, and the same program with `shard_map`.

Data parallelism copies the model's parameters to every device and gives each device its
own slice of the batch. The older way to write that in JAX is `jax.pmap`:

    jax.pmap(predict, in_axes=(None, 0))(params, batch.reshape(devices, per_device, features))

`in_axes=None` broadcasts the parameters to every device, `in_axes=0` maps the leading axis
of the batch, which therefore has to be reshaped to `[devices, per_device, features]` first.

In today's JAX, `pmap` is itself implemented with `jit` and `shard_map`: it builds a 1-D
mesh over its devices, turns `in_axes` into PartitionSpecs (`None` -> `P()`, `0` -> a spec
on that mesh axis) and squeezes the mapped axis away inside. Written directly with
`shard_map` (here `eqxpar.filter_shard_map`, which also takes Equinox Modules), the same
program is `in_specs=(P(), P("data"))` on the *unreshaped* global batch, and its result is
one global array instead of a stack of per-device results.

The recipe runs a linear classifier's forward pass on real data (scikit-learn's digits),
both ways and on a single device, checks all three agree, and does the same for a batch
statistic that needs a collective (`pmean` over the data axis), written once for both.

Run it:

    python recipes/pmap_data_parallel.py                     # 8 simulated CPU devices
    python recipes/pmap_data_parallel.py --devices 1         # one device
    python recipes/pmap_data_parallel.py --mesh data=2 --per-device-batch 8
    python recipes/pmap_data_parallel.py --metrics-out pmap.json
"""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import eqxpar
import eqxpar.recipe
from eqxpar.datasets import digits
from eqxpar.testing import F32_ATOL, F32_RTOL, assert_trees_close, on_one_device


@dataclasses.dataclass
class Config:
    devices: int = 8  # simulated CPU devices when there is no accelerator
    mesh: str = "auto"  # one data axis, e.g. data=4 (pmap uses the same devices); auto: all devices
    per_device_batch: int = 32  # examples per device
    seed: int = 0  # seeds the parameters
    metrics_out: str | None = None  # write the results as JSON here


# ---- The model, written for one device ---------------------------------------------------
def init_params(key, in_features: int, num_classes: int) -> dict:
    """A linear classifier's parameters: weights (in_features, num_classes) and a bias."""
    wkey, bkey = jax.random.split(key)
    return {
        "w": jax.random.normal(wkey, (in_features, num_classes)) / np.sqrt(in_features),
        "b": jax.random.normal(bkey, (num_classes,)),
    }


def predict(params, inputs):
    """Logits for a batch of inputs: `inputs @ w + b`. No collectives: rows are independent."""
    return inputs @ params["w"] + params["b"]


def batch_mean_logits(params, inputs):
    """The mean of the logits over a batch, on one device."""
    return jnp.mean(predict(params, inputs), axis=0)


def mean_logits(params, inputs, axis_name):
    """The batch-mean of the logits across devices: a local mean, then `pmean`.

    Every device holds the same number of examples, so the mean of the per-device means is
    the global mean. Without the `pmean` each device would return its own batch's mean.
    """
    return jax.lax.pmean(batch_mean_logits(params, inputs), axis_name)


# ---- Way 1: pmap (the older API) -----------------------------------------------------------
def pmap_predict(devices, params, batch):
    """`jax.pmap(predict, in_axes=(None, 0))` over `devices` on the global `batch`.

    pmap maps the leading axis over devices, so the batch is reshaped to
    [devices, per_device, features]; the result comes back stacked the same way.

    **Returns:** `(stacked, flat)`: the `[devices, per_device, classes]` output and the same
    values reshaped to the global `[batch, classes]`.
    """
    n = len(devices)
    per_device = batch.shape[0] // n
    stacked_batch = batch.reshape(n, per_device, batch.shape[1])
    parallel_predict = jax.pmap(predict, in_axes=(None, 0), devices=devices)
    stacked = parallel_predict(params, stacked_batch)  # params broadcast, batch split
    return stacked, stacked.reshape(n * per_device, -1)


def _mean_logits_over_data(params, inputs):
    return mean_logits(params, inputs, "data")


def pmap_mean_logits(devices, params, batch):
    """`mean_logits` under pmap: `axis_name="data"` names the axis the `pmean` reduces over."""
    n = len(devices)
    stacked_batch = batch.reshape(n, batch.shape[0] // n, batch.shape[1])
    per_device = jax.pmap(_mean_logits_over_data, axis_name="data", in_axes=(None, 0), devices=devices)(
        params, stacked_batch
    )
    return per_device[0]  # every device holds the same mean after pmean


# ---- Way 2: shard_map (today's API) --------------------------------------------------------
# eqx.filter_jit treats the mesh (not an array) as static: one compile per mesh and shape.
@eqx.filter_jit
def shard_map_predict(mesh, params, batch):
    """The same program as `pmap_predict` with `filter_shard_map`, on the unreshaped batch.

    `P()` replicates the parameters (pmap's `in_axes=None`); `P("data")` splits the batch's
    leading axis over the mesh's data axis (pmap's `in_axes=0`, without the reshape). The
    output is one global `[batch, classes]` array, split over `data`.
    """
    (axis,) = mesh.axis_names
    return eqxpar.filter_shard_map(predict, mesh=mesh, in_specs=(P(), P(axis)), out_specs=P(axis))(params, batch)


@eqx.filter_jit
def shard_map_mean_logits(mesh, params, batch):
    """`mean_logits` under shard_map: the collective's axis is the mesh axis name."""
    (axis,) = mesh.axis_names
    return eqxpar.filter_shard_map(
        lambda p, x: mean_logits(p, x, axis), mesh=mesh, in_specs=(P(), P(axis)), out_specs=P()
    )(params, batch)


def global_batch(num_devices: int, per_device_batch: int) -> np.ndarray:
    """The first `num_devices * per_device_batch` digits training images, (n, 64) float32."""
    images = digits().x_train
    need = num_devices * per_device_batch
    if per_device_batch < 1 or need > len(images):
        raise ValueError(
            f"pmap_data_parallel: {num_devices} devices x --per-device-batch "
            f"{per_device_batch} = {need} examples, but the digits training set has "
            f"{len(images)}. Use a --per-device-batch from 1 to {len(images) // num_devices}."
        )
    return images[:need]


def check_mesh(sizes: dict[str, int]) -> None:
    """Raise a ValueError unless `sizes` is a single (data) axis."""
    if len(sizes) != 1:
        raise ValueError(
            f"pmap_data_parallel: pmap maps one axis, so the mesh must have exactly one "
            f"(the data axis), got {sizes}. Use e.g. --mesh data=8."
        )


def check_flags(cfg: Config) -> Config:
    """Every check of the flags, before anything compiles; returns `cfg` with its mesh chosen."""
    eqxpar.simulate_cpu_devices(cfg.devices)  # before JAX touches a backend
    sizes = eqxpar.recipe.mesh_from_flag(cfg.mesh, {"data": 8}, any_names=True)
    check_mesh(sizes)
    global_batch(math.prod(sizes.values()), cfg.per_device_batch)  # enough digits?
    return dataclasses.replace(cfg, mesh=eqxpar.recipe.mesh_text(sizes))


def main(argv=None) -> dict:
    cfg = eqxpar.recipe.parse_flags(Config, argv, validate=check_flags)  # bad flags: one line, exit 2
    mesh = eqxpar.make_mesh(**eqxpar.parse_mesh(cfg.mesh))
    devices = list(mesh.devices.flat)  # pmap runs on the same devices as the mesh

    batch = global_batch(mesh.size, cfg.per_device_batch)
    num_classes = 10
    params = init_params(jax.random.key(cfg.seed), batch.shape[1], num_classes)
    print(
        f"{mesh.size} devices x {cfg.per_device_batch} examples = global batch {batch.shape}; "
        f"params w {params['w'].shape}, b {params['b'].shape}"
    )

    # Reference: the whole batch on one device.
    reference = on_one_device(predict, params, batch)
    reference_mean = on_one_device(batch_mean_logits, params, batch)

    stacked, from_pmap = pmap_predict(devices, params, batch)
    # pmap's output is an ordinary jax.Array with a NamedSharding over the 1-D mesh pmap built.
    print(
        f"pmap: input reshaped to {(mesh.size, cfg.per_device_batch, batch.shape[1])}, "
        f"output {stacked.shape} sharded {stacked.sharding.spec}"
    )
    from_shard_map = shard_map_predict(mesh, params, batch)
    print(f"shard_map: input {batch.shape} as is, output {from_shard_map.shape} sharded {from_shard_map.sharding.spec}")

    mean_pmap = pmap_mean_logits(devices, params, batch)
    mean_shard_map = shard_map_mean_logits(mesh, params, batch)

    results = {
        "pmap_predictions": (from_pmap, reference),
        "shard_map_predictions": (from_shard_map, reference),
        "pmap_mean_logits": (mean_pmap, reference_mean),
        "shard_map_mean_logits": (mean_shard_map, reference_mean),
    }
    errors = {k: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for k, (a, b) in results.items()}
    matches = {
        k: bool(np.allclose(np.asarray(a), np.asarray(b), rtol=F32_RTOL, atol=F32_ATOL))
        for k, (a, b) in results.items()
    }
    for k in results:
        print(f"{k:>22} vs one device: max abs error {errors[k]:.1e}")

    metrics = {
        "mesh": dict(mesh.shape),
        "global_batch": list(batch.shape),
        "pmap_output_shape": list(stacked.shape),
        "pmap_output_mesh_axes": list(stacked.sharding.mesh.axis_names),
        "shard_map_output_shape": list(from_shard_map.shape),
        "shard_map_output_spec": str(from_shard_map.sharding.spec),
        "max_abs_error_vs_single_device": errors,
        "matches_single_device": matches,
        "all_match": all(matches.values()),
    }
    eqxpar.recipe.write_metrics(cfg.metrics_out, metrics)

    for k, (actual, expected) in results.items():
        assert_trees_close(actual, expected, what=f"{k} vs single device")
    print(
        f"pmap_data_parallel: pmap and shard_map on {mesh.size} device(s) match one device "
        f"on {len(batch)} digits images (max abs error {max(errors.values()):.1e})"
    )
    return metrics


if __name__ == "__main__":
    main()
