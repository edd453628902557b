"""Multi-host data parallelism: one digits classifier trained by several cooperating processes.

Every process runs this same script (SPMD). After `eqxpar.distributed.initialize()`,
`jax.devices()` lists the devices of *all* processes and the mesh spans them, so one
data-parallel step runs on all of them: each process loads only its own part of every global
batch (`eqxpar.data.load_per_process`), each device computes the gradient of its shard, and
the step's one `jax.lax.psum` over the `data` axis of each shard's share (its mean over the
number of shards; `per_device_gradients` in `eqxpar/train/_gradients.py`) averages the
gradients across all devices of all processes. The replicas stay identical,
and the result equals training on one device: compare the final losses below.

Run it as 2 processes with 4 simulated CPU devices each (8 devices in all), one process
with 8 devices, or one device:

    python -m eqxpar.launch --nproc 2 --devices-per-proc 4 recipes/multihost.py
    python recipes/multihost.py                       # one process, 8 devices
    python recipes/multihost.py --mesh data=1         # one device: the same final loss
    python recipes/multihost.py --devices 1           # a one-device machine (--mesh auto: data=1)

With `--checkpoint-dir DIR --checkpoint-every N --resume`, every process saves its shards of
the state into DIR (a folder all processes see) and a restarted job continues from the newest
checkpoint, with any number of processes.

On a SLURM cluster, one process per node (or per GPU): `srun python recipes/multihost.py`.
Under the launcher, `--devices-per-proc` sets each process's CPU devices and `--devices`
is ignored.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import eqxpar
import eqxpar.data
import eqxpar.datasets
import eqxpar.distributed
import eqxpar.recipe
from eqxpar.train import data_parallel_step


@dataclasses.dataclass
class Config(eqxpar.recipe.CheckpointFlags, eqxpar.recipe.LogFlags):  # + checkpoint flags, --log-dir, --log-every
    devices: int = 8  # simulated CPU devices of this process (the launcher's --devices-per-proc wins)
    mesh: str = "auto"  # a `data` axis, e.g. data=4; auto: all devices of all processes that divide the batch
    steps: int = 300  # training steps
    batch_size: int = 128  # the global batch: examples per step, all processes together
    learning_rate: float = 0.05  # SGD step size
    momentum: float = 0.9  # SGD momentum
    width: int = 128  # hidden layer width
    seed: int = 0  # seeds the model and the batch order
    metrics_out: str | None = None  # write the results as JSON here (process 0)
    eval_every: int = 0  # test accuracy every N steps (printed, and in --log-dir); 0: only at the end


# --- Model and loss (the same as recipes/data_parallel.py) ------------------------------------


def make_model(key: jax.Array, num_features: int, num_classes: int, width: int) -> eqx.nn.MLP:
    return eqx.nn.MLP(num_features, num_classes, width_size=width, depth=2, activation=jax.nn.relu, key=key)


def loss_fn(model: eqx.nn.MLP, batch: tuple[jax.Array, jax.Array], key: None) -> jax.Array:
    """Mean cross-entropy over this device's shard; the step averages it over `data`."""
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(jax.vmap(model)(x), y).mean()


@eqx.filter_jit
def accuracy(model: eqx.nn.MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean(jnp.argmax(jax.vmap(model)(x), axis=-1) == y)


# --- Training -------------------------------------------------------------------------------


def check_flags(cfg: Config) -> Config:
    """Every check of the flags, before anything compiles; returns `cfg` with its mesh chosen."""
    eqxpar.recipe.require_positive(cfg, "steps", "batch_size", "width")
    # Join the job: reads the launcher's (or SLURM's) settings; a no-op for one process.
    # It must come before anything touches a JAX backend (the mesh check counts devices).
    eqxpar.distributed.initialize(cpu_devices=cfg.devices)
    sizes = eqxpar.recipe.mesh_from_flag(cfg.mesh, {"data": 8}, divides={"data": {"--batch-size": cfg.batch_size}})
    return dataclasses.replace(cfg, mesh=eqxpar.recipe.mesh_text(sizes))


def main(argv=None) -> dict:
    cfg = eqxpar.recipe.parse_flags(Config, argv, validate=check_flags)  # bad flags: one line, exit 2
    # 1. The job check_flags joined (a second call returns what the first did).
    info = eqxpar.distributed.initialize(cpu_devices=cfg.devices)
    print(info)  # every process: the launcher prefixes each line with its rank
    # Checks --checkpoint-dir now, before anything compiles: checkpoints there need --resume,
    # and --resume needs the saved model's --width; if not, one line and exit 2.
    with eqxpar.recipe.flag_errors():
        ckpt = eqxpar.checkpoint.Checkpointer.from_config(cfg, shape_fields=("width",))

    # 2. One mesh over the devices of every process (jax.devices() is the global list).
    mesh = eqxpar.make_mesh(**eqxpar.parse_mesh(cfg.mesh))

    # 3. Data: every process opens the same source; each loads only its rows of each batch.
    data = eqxpar.datasets.digits()
    source = eqxpar.data.ArrayRecords((data.x_train, data.y_train))
    layout = eqxpar.data.batch_layout(mesh, "data", cfg.batch_size)
    mine = layout.process_rows(jax.process_index())
    print(
        f"process {jax.process_index()} loads rows {mine[0]}..{mine[-1]} of every global batch of "
        f"{cfg.batch_size} ({len(mine)} rows for its {jax.local_device_count()} devices)"
    )

    def load(step: int):
        return eqxpar.data.load_per_process(
            source, step, global_batch_size=cfg.batch_size, mesh=mesh, batch_axis="data", seed=cfg.seed
        )

    # 4. The same model on every process (same seed), replicated on every device.
    model = make_model(jax.random.key(cfg.seed), data.num_features, data.num_classes, cfg.width)
    optimizer = optax.sgd(cfg.learning_rate, momentum=cfg.momentum)
    step = data_parallel_step(loss_fn, optimizer, mesh, batch_axis="data")
    model, opt_state = step.init(model)

    # The silent failure of multi-host loading is wrong rows without an error: check once.
    eqxpar.data.check_batch_consistency(load(0), mesh, "data")

    # 5. Checkpoints (--checkpoint-dir, --checkpoint-every, --resume): every process makes the
    #    same calls; each writes and reads its own devices' shards. Batch i is load(i), a
    #    function of (seed, i): a resumed run sees the batches the interrupted one would have.
    (model, opt_state), first_step, _ = ckpt.restore((model, opt_state))

    # --log-dir (process 0 writes): metrics every --log-every steps, TensorBoard, config.json.
    run_log = eqxpar.recipe.RunLog.from_config(cfg, items_per_step=cfg.batch_size, items="examples")
    x_test, y_test = eqxpar.shard((data.x_test, data.y_test), mesh)  # held out: every process calls accuracy
    # The loop waits for the device only every --log-every steps (run_log fetches those steps'
    # losses in one go), at evaluations, checkpoints and the end.
    start = time.perf_counter()
    steps = eqxpar.recipe.steps_to_run(first_step, cfg.steps)  # none left: says so
    for i in run_log.progress(steps, desc=f"multihost ({info.num_processes} process(es))"):
        model, opt_state, metrics = step(model, opt_state, load(i))
        run_log.step(i, metrics)
        run_log.maybe_eval(i, test_accuracy=functools.partial(accuracy, model, x_test, y_test))
        ckpt.maybe_save(i + 1, (model, opt_state), force=i + 1 == cfg.steps)
    ckpt.close()
    run_log.close()
    seconds = time.perf_counter() - start

    # The loss and the model are replicated on every device of every process, so every
    # process can read them; only process 0 prints and writes.
    final_loss = run_log.losses[-1] if run_log.losses else None  # None (null): no step run
    test_accuracy = float(accuracy(model, x_test, y_test))
    result = {
        "final_loss": final_loss,
        "test_accuracy": test_accuracy,
        "test_accuracies": run_log.evals,  # every --eval-every steps: {"step", "test_accuracy"}
        "steps": cfg.steps,
        "processes": info.num_processes,
        "devices": int(mesh.size),
        "batch_size": cfg.batch_size,
        "seed": cfg.seed,
        "train_seconds": seconds,
        "resumed_from_step": first_step,
        "param_digest": eqxpar.recipe.parameter_digest(model),  # every process takes part (a gather)
    }
    eqxpar.distributed.print_main(
        f"multihost: {info.num_processes} process(es) x {jax.local_device_count()} devices, mesh "
        f"{dict(mesh.shape)}, {cfg.steps} steps of {cfg.batch_size} examples, final loss "
        f"{'-' if final_loss is None else f'{final_loss:.5f}'}, test accuracy {test_accuracy:.2%}, {seconds:.1f} s"
    )
    eqxpar.recipe.write_metrics(cfg.metrics_out, result)
    return result


if __name__ == "__main__":
    main()
