"""Tensor-parallel training of a small GPT on Python's own source code.

What it shows: a character-level transformer language model whose embedding, attention,
MLPs and output head are split over a `model` mesh axis (Megatron-style), trained with an
explicit `shard_map` step. Each device holds 1/N of every big weight; the layers talk with
one all-reduce per attention and per MLP going forward and one each going backward, and the
loss is computed from vocabulary-split logits (a `pmax` and a `psum`) without ever putting
the whole logits on one device.

Run it:

    python recipes/tensor_parallel.py                  # 8 simulated CPU devices, model=8
    python recipes/tensor_parallel.py --mesh model=1   # the same model, densely
    python recipes/tensor_parallel.py --devices 1      # a one-device machine (--mesh auto: model=1)
    python recipes/tensor_parallel.py --steps 50 --metrics-out /tmp/tp.json
    python recipes/tensor_parallel.py --dtype bfloat16 --remat block --scan-layers
    python recipes/tensor_parallel.py --model-size 124m --devices 1   # GPT-2 small's shape (a GPU)
    python recipes/tensor_parallel.py --checkpoint-dir /tmp/tp --checkpoint-every 100 --resume

The same seed gives the same losses for every model axis size (up to float rounding).
`--attention`, `--remat` and `--scan-layers` change how the model computes, not what;
`--dtype bfloat16` computes in bfloat16 on float32 weights (a stated tolerance away).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import equinox as eqx
import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import eqxpar
import eqxpar.nn
import eqxpar.recipe
from eqxpar.datasets import python_source_text, text_windows
from eqxpar.inspect import CommReport
from eqxpar.models import GPT, generate, next_token_loss


@dataclasses.dataclass
class Config(eqxpar.recipe.CheckpointFlags, eqxpar.recipe.LogFlags, eqxpar.recipe.GPTFlags):  # + their flags
    devices: int = 8  # simulated CPU devices when there is no accelerator
    mesh: str = "auto"  # a `model` axis, e.g. model=4 (1/N of each big layer per device); auto: fit the devices
    steps: int = 600  # training steps
    batch_size: int = 16  # sequences per step
    context: int = 64  # characters the model sees
    dim: int = 64  # the model's width
    heads: int = 8  # attention heads (the model axis size must divide them)
    layers: int = 2  # transformer blocks
    dropout: float = 0.0  # dropout probability while training
    learning_rate: float = 5e-3  # AdamW step size
    seed: int = 0  # seeds the weights, the batches and the sample
    sample_chars: int = 200  # characters sampled at the end; 0: no sample
    metrics_out: str | None = None  # write the results as JSON here
    eval_every: int = 0  # held-out loss every N steps (printed, and in --log-dir); 0: only at the end


def batch_of_windows(ids: np.ndarray, starts: np.ndarray, context: int) -> np.ndarray:
    """`(len(starts), context + 1)` character windows: inputs and their next characters."""
    return ids[starts[:, None] + np.arange(context + 1)]


def check_flags(cfg: Config) -> Config:
    """Every check of the flags, before anything compiles; returns `cfg` with its mesh chosen."""
    eqxpar.simulate_cpu_devices(cfg.devices)  # before JAX touches a backend
    cfg = eqxpar.recipe.check_gpt_flags(cfg)  # --dtype, --attention, --remat; --model-size sets the shape
    eqxpar.recipe.require_positive(cfg, "steps", "batch_size", "context", "dim", "heads", "layers")
    if cfg.dim % cfg.heads:
        raise ValueError(f"--dim {cfg.dim} is not divisible by --heads {cfg.heads}: every head needs the same width.")
    if not 0 <= cfg.dropout < 1 or cfg.sample_chars < 0:
        raise ValueError(
            f"--dropout must be in [0, 1) and --sample-chars at least 0, got {cfg.dropout}, {cfg.sample_chars}."
        )
    sizes = eqxpar.recipe.mesh_from_flag(cfg.mesh, {"model": 8}, divides={"model": {"--heads": cfg.heads}})
    return dataclasses.replace(cfg, mesh=eqxpar.recipe.mesh_text(sizes))


def main(argv=None) -> dict:
    cfg = eqxpar.recipe.parse_flags(Config, argv, validate=check_flags)  # bad flags: one line, exit 2
    # Checks --checkpoint-dir now, before anything compiles: checkpoints there need --resume,
    # and --resume needs the saved model's --context, --dim, --layers and --scan-layers; else
    # one line, exit 2.
    with eqxpar.recipe.flag_errors():
        ckpt = eqxpar.checkpoint.Checkpointer.from_config(cfg, shape_fields=("context", "dim", "layers", "scan_layers"))

    # --- Data: characters of some standard-library modules; the last 10% held out. ---
    text = python_source_text()
    split = int(0.9 * len(text.ids))
    train_ids, val_ids = text.ids[:split], text.ids[split:]

    # --- Mesh and model: a GPT built in global form, then split over `model`. ---
    mesh = eqxpar.make_mesh(**eqxpar.parse_mesh(cfg.mesh))
    model_key, train_key, sample_key = jax.random.split(jax.random.key(cfg.seed), 3)
    model = GPT(
        text.vocab_size,
        cfg.context,
        cfg.dim,
        cfg.heads,
        cfg.layers,
        dropout_p=cfg.dropout,
        axis_name="model",
        key=model_key,
        attention_impl=cfg.attention,
        scan_layers=cfg.scan_layers,
        remat=cfg.remat,
    )
    specs = eqxpar.nn.partition_specs(model, mesh)  # checks heads/width/vocab divide
    flops_per_token = eqxpar.models.gpt_flops_per_token(model)  # 6 N + attention, forward and backward
    model = eqxpar.shard(model, mesh, specs)
    params = eqxpar.sharding_report(model)

    # --- The parallel part: loss and gradients on each device, in shard_map. ---
    # Inside, each device holds its block of every split weight; the layers' psums and the
    # loss's pmax/psum are the only communication. Gradients come out split like the model.
    # Mixed precision (--dtype bfloat16): the loss sees the float32 weights cast to bfloat16,
    # so the matmuls and the activations' all-reduces run in bfloat16; the loss is float32,
    # and the gradient, through the cast, comes back float32. (float32: no cast at all.)
    precision = cfg.precision()

    def loss_in_precision(model, tokens, key):
        if not precision.is_identity:
            model = jax.tree.map(precision.for_compute, model)
        return next_token_loss(model, tokens, key=key).astype(np.float32)

    def local_loss_and_grads(model, tokens, key):
        return eqx.filter_value_and_grad(loss_in_precision)(model, tokens, key)

    loss_and_grads = eqxpar.filter_shard_map(
        local_loss_and_grads, mesh=mesh, in_specs=(specs, P(), P()), out_specs=(P(), specs)
    )
    optimizer = optax.adamw(cfg.learning_rate)
    opt_state = eqx.filter_jit(optimizer.init)(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def train_step(model, opt_state, tokens, key):
        loss, grads = loss_and_grads(model, tokens, key)
        # The optimizer is elementwise: under jit it runs on each device's blocks, no
        # communication (the split gradients meet split optimizer state).
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    evaluate = eqxpar.recipe.held_out_loss(lambda model, tokens: next_token_loss(model, tokens), mesh, specs)

    # Checkpoints (--checkpoint-dir, --checkpoint-every, --resume): the model (split as it
    # is), the optimizer state and the key; the loss history rides along as JSON.
    (model, opt_state, train_key), first_step, history = ckpt.restore((model, opt_state, train_key))

    # Compile the step once, ahead of time, and read what it communicates from the program.
    example = np.zeros((cfg.batch_size, cfg.context + 1), np.int32)
    lowered = train_step.lower(model, opt_state, example, train_key)
    train_step = lowered.compile()
    comm = CommReport.of(lowered, train_step)

    # The held-out windows: the loss on them every --eval-every steps, and at the end.
    val_rng = np.random.default_rng(1234)  # the same validation windows for every run
    val_starts = val_rng.integers(0, len(val_ids) - cfg.context - 1, 64)
    val_tokens = batch_of_windows(val_ids, val_starts, cfg.context)

    # --- Training loop. Batch and dropout key of each step depend on (seed, step) only. ---
    # --log-dir: metrics every --log-every steps, TensorBoard events, config.json.
    # The loop waits for the device only every --log-every steps (run_log fetches those steps'
    # losses in one go), at evaluations, checkpoints and the end.
    run_log = eqxpar.recipe.RunLog.from_config(
        cfg,
        items_per_step=cfg.batch_size * cfg.context,
        flops_per_item=flops_per_token,
        n_devices=mesh.size,
        losses=history["losses"] if history else [],
    )
    steps = eqxpar.recipe.steps_to_run(first_step, cfg.steps)  # none left: says so
    for step in run_log.progress(steps, desc=f"tensor parallel {cfg.mesh}"):
        tokens = text_windows(train_ids, cfg.batch_size, cfg.context, seed=cfg.seed, step=step)
        model, opt_state, loss = train_step(model, opt_state, tokens, jax.random.fold_in(train_key, step))
        run_log.step(step, {"loss": loss})
        run_log.maybe_eval(step, val_loss=functools.partial(evaluate, model, val_tokens))
        ckpt.maybe_save(
            step + 1, (model, opt_state, train_key), data_state=run_log.data_state, force=step + 1 == cfg.steps
        )
    ckpt.close()
    run_log.close()
    losses = run_log.losses  # every step's loss

    # --- Final check: held-out loss, and a sample from the trained model. ---
    val_loss = float(evaluate(model, val_tokens))

    whole_logits = eqx.filter_jit(
        eqxpar.filter_shard_map(
            lambda model, tokens: jax.vmap(functools.partial(model, inference=True))(tokens),
            mesh=mesh,
            in_specs=(specs, P()),
            out_specs=P(None, None, "model"),  # vocab blocks side by side
        )
    )
    sample = generate(
        functools.partial(whole_logits, model),
        text.encode("def "),
        cfg.sample_chars,
        context_length=cfg.context,
        key=sample_key,
        temperature=0.8,
    )

    metrics = {
        "mesh": cfg.mesh,
        "steps": cfg.steps,
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "final_loss_mean10": float(np.mean(losses[-10:])),
        "val_loss": val_loss,
        "val_losses": run_log.evals,  # every --eval-every steps: {"step", "val_loss"}
        "uniform_loss": math.log(text.vocab_size),  # guessing every character equally
        "param_bytes_total": params.bytes_total,
        "param_bytes_per_device": params.bytes_per_device,
        "all_reduces_per_step": comm.count("all-reduce"),
        "all_reduce_bytes_per_step": comm.bytes("all-reduce"),
        "sample": text.decode(sample),
        "resumed_from_step": first_step,
        "param_digest": eqxpar.recipe.parameter_digest(model),  # of the whole (gathered) weights
        "batch_size": cfg.batch_size,
        # tokens_per_second, flops_per_token, flops_per_second, and the model FLOPs
        # utilisation against the chips' peak (mfu; null where the peak is unknown: CPU).
        **eqxpar.recipe.speed_metrics(run_log.per_second, flops_per_token, mesh.size, cfg.dtype),
        "model_size": cfg.model_size,
        "dtype": cfg.dtype,
        "attention": cfg.attention,
        "remat": cfg.remat,
        "scan_layers": cfg.scan_layers,
    }
    if eqxpar.recipe.is_main_process():
        print(f"\ncollectives of one train step (per device):\n{comm}\n")
        print(f"sample:\n{metrics['sample']}\n")
        print(
            f"{cfg.mesh}: loss {metrics['first_loss']:.3f} -> {metrics['final_loss_mean10']:.3f} "
            f"(last 10 steps), held-out {val_loss:.3f} (uniform guessing: {metrics['uniform_loss']:.3f}); "
            f"{eqxpar.recipe.speed_text(metrics)}; "
            f"parameters {params.bytes_per_device:,} of {params.bytes_total:,} bytes per device"
        )
    eqxpar.recipe.write_metrics(cfg.metrics_out, metrics)
    return metrics


if __name__ == "__main__":
    main()
