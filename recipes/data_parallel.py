"""Data-parallel training: a digits classifier, its global batch split over 8 devices.

Every device holds the whole model and one shard of each global batch. Each step, every
device computes the loss and gradient on its shard; one all-reduce over the `data` axis
averages them (`jax.lax.psum` of each shard's share, in `per_device_gradients` in
`eqxpar/train/_gradients.py`), and every device applies the same update, so the replicas stay
identical. The result equals training on one device with
the whole batch: run it with `--mesh data=1` and compare the final loss.

Run (no accelerator needed: 8 CPU devices are simulated):

    python recipes/data_parallel.py
    python recipes/data_parallel.py --mesh data=1            # same final loss, one device
    python recipes/data_parallel.py --devices 1              # one device (--mesh auto: data=1)
    python recipes/data_parallel.py --grad-accum 4           # 4 micro-batches per device
    python recipes/data_parallel.py --steps 100 --metrics-out /tmp/dp.json
    python recipes/data_parallel.py --checkpoint-dir /tmp/dp --checkpoint-every 50 --resume
                                         # checkpoints; run it again after a kill: it resumes
"""

from __future__ import annotations

import dataclasses
import functools
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqxpar
import eqxpar.data
import eqxpar.datasets
import eqxpar.recipe
from eqxpar.train import data_parallel_step, shard_batch


@dataclasses.dataclass
class Config(eqxpar.recipe.CheckpointFlags, eqxpar.recipe.LogFlags):  # + checkpoint flags, --log-dir, --log-every
    devices: int = 8  # simulated CPU devices when there is no accelerator
    mesh: str = "auto"  # a `data` axis, e.g. data=4; auto: as many devices as divide the batch
    steps: int = 500  # training steps
    batch_size: int = 128  # the global batch: examples per step, over all devices
    grad_accum: int = 1  # micro-batches per device and step (gradient accumulation)
    learning_rate: float = 0.05  # SGD step size
    momentum: float = 0.9  # SGD momentum
    width: int = 128  # hidden layer width
    seed: int = 0  # seeds the model and the batch order
    metrics_out: str | None = None  # write the results as JSON here
    eval_every: int = 0  # test accuracy every N steps (printed, and in --log-dir); 0: only at the end


# --- Model and loss -------------------------------------------------------------------------


def make_model(key: jax.Array, num_features: int, num_classes: int, width: int) -> eqx.nn.MLP:
    return eqx.nn.MLP(num_features, num_classes, width_size=width, depth=2, activation=jax.nn.relu, key=key)


def loss_fn(model: eqx.nn.MLP, batch: tuple[jax.Array, jax.Array], key: None) -> jax.Array:
    """Mean cross-entropy over the batch it is given: on each device, that device's shard.
    The step averages it over the data axis; it is not averaged here."""
    x, y = batch
    logits = jax.vmap(model)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    # SGD with momentum: unlike Adam, its updates scale with the gradient, so a gradient
    # that came out N times too large would show (see docs/concepts/data_parallel.md).
    return optax.sgd(cfg.learning_rate, momentum=cfg.momentum)


def make_train_step(cfg: Config, mesh: jax.sharding.Mesh):
    """The data-parallel step: `step(model, opt_state, batch) -> (model, opt_state, metrics)`."""
    return data_parallel_step(loss_fn, make_optimizer(cfg), mesh, batch_axis="data", grad_accum=cfg.grad_accum)


@eqx.filter_jit
def predict(model: eqx.nn.MLP, x: jax.Array) -> jax.Array:
    return jnp.argmax(jax.vmap(model)(x), axis=-1)


# --- Training -------------------------------------------------------------------------------


def check_flags(cfg: Config) -> Config:
    """Every check of the flags, before anything compiles; returns `cfg` with its mesh chosen."""
    eqxpar.recipe.require_positive(cfg, "steps", "batch_size", "grad_accum", "width")
    if cfg.batch_size % cfg.grad_accum:
        raise ValueError(f"--batch-size {cfg.batch_size} is not divisible by --grad-accum {cfg.grad_accum}.")
    eqxpar.simulate_cpu_devices(cfg.devices)  # before JAX touches a backend
    per_step = cfg.batch_size // cfg.grad_accum
    what = f"--batch-size {cfg.batch_size} / --grad-accum {cfg.grad_accum} ="
    sizes = eqxpar.recipe.mesh_from_flag(cfg.mesh, {"data": 8}, divides={"data": {what: per_step}})
    return dataclasses.replace(cfg, mesh=eqxpar.recipe.mesh_text(sizes))


def main(argv=None) -> dict:
    cfg = eqxpar.recipe.parse_flags(Config, argv, validate=check_flags)  # bad flags: one line, exit 2
    # Checks --checkpoint-dir now, before anything compiles: checkpoints there need --resume,
    # and --resume needs the saved model's --width; if not, one line and exit 2.
    with eqxpar.recipe.flag_errors():
        ckpt = eqxpar.checkpoint.Checkpointer.from_config(cfg, shape_fields=("width",))
    mesh = eqxpar.make_mesh(**eqxpar.parse_mesh(cfg.mesh))

    data = eqxpar.datasets.digits()
    num_train = len(data.x_train)

    model = make_model(jax.random.key(cfg.seed), data.num_features, data.num_classes, cfg.width)
    step = make_train_step(cfg, mesh)
    # Replicate the model, and the optimizer state made for it, on every device of the mesh.
    model, opt_state = step.init(model)

    # With --checkpoint-dir: continue from the newest checkpoint (--resume), save every
    # --checkpoint-every steps. The data order below depends on the step only, so a resumed
    # run trains exactly as the run that was interrupted would have.
    (model, opt_state), first_step, _ = ckpt.restore((model, opt_state))

    # --log-dir: metrics every --log-every steps, TensorBoard events, config.json.
    run_log = eqxpar.recipe.RunLog.from_config(cfg, items_per_step=cfg.batch_size, items="examples")

    def accuracy(model) -> float:  # on the held-out digits: every --eval-every steps, and at the end
        return float(np.mean(np.asarray(predict(model, data.x_test)) == data.y_test))

    # The loop waits for the device only every --log-every steps (run_log fetches those steps'
    # losses in one go), at evaluations, checkpoints and the end.
    start = time.perf_counter()
    steps = eqxpar.recipe.steps_to_run(first_step, cfg.steps)  # none left: says so
    for i in run_log.progress(steps, desc=f"data parallel ({cfg.mesh})"):
        # Global batch i: a pure function of (seed, i), so a run resumed at step i sees the
        # same batches as one that never stopped.
        rows = eqxpar.data.global_batch_records(num_train, cfg.batch_size, i, seed=cfg.seed)
        # Each device receives its slice of the global batch straight from the host.
        batch = shard_batch((data.x_train[rows], data.y_train[rows]), mesh, batch_axis="data")
        model, opt_state, metrics = step(model, opt_state, batch)
        run_log.step(i, metrics)
        run_log.maybe_eval(i, test_accuracy=functools.partial(accuracy, model))
        ckpt.maybe_save(i + 1, (model, opt_state), force=i + 1 == cfg.steps)
    ckpt.close()
    run_log.close()
    seconds = time.perf_counter() - start

    final_loss = run_log.losses[-1] if run_log.losses else None  # None (null): no step run
    test_accuracy = accuracy(model)
    result = {
        "final_loss": final_loss,
        "test_accuracy": test_accuracy,
        "test_accuracies": run_log.evals,  # every --eval-every steps: {"step", "test_accuracy"}
        "steps": cfg.steps,
        "mesh": cfg.mesh,
        "devices": int(mesh.size),
        "batch_size": cfg.batch_size,
        "grad_accum": cfg.grad_accum,
        "seed": cfg.seed,
        "train_seconds": seconds,
        "resumed_from_step": first_step,
        "param_digest": eqxpar.recipe.parameter_digest(model),  # equal digests: bitwise-equal parameters
    }
    if eqxpar.recipe.is_main_process():
        print(f"test accuracy: {test_accuracy:.2%} on {len(data.x_test)} held-out digits")
        print(
            f"data_parallel: mesh {cfg.mesh}, {cfg.steps} steps of {cfg.batch_size} examples "
            f"(grad_accum {cfg.grad_accum}), final loss {'-' if final_loss is None else f'{final_loss:.5f}'}, "
            f"test accuracy {test_accuracy:.2%}, {seconds:.1f} s"
        )
    eqxpar.recipe.write_metrics(cfg.metrics_out, result)
    return result


if __name__ == "__main__":
    main()
