"""Fully sharded data parallel (FSDP, ZeRO-3 style) training of the GPT of hybrid_gpt.py.

It trains on your text (`--data`, `--tokenizer`; by default a corpus of Python's own source
code) through the same tokenizer, token store and packed rows as hybrid_gpt.py.

What it shows: the parameters and the optimizer state are split over an `fsdp` mesh axis,
so each device stores 1/N of them between steps, while the batch is split over the same
axis as in data parallelism. Each transformer block gathers its weights with
`jax.lax.all_gather` just before it runs; in the backward pass the gradients are summed
and cut back to each device's slice (a reduce-scatter, the all_gather's transpose). With
`--remat` the blocks keep nothing for the backward pass and gather their weights again
there: less memory, more communication. Add a `model` axis to combine FSDP with tensor
parallelism (`--mesh fsdp=2,model=4`).

Run it (8 simulated CPU devices when there is no accelerator):

    python recipes/fsdp.py                          # fsdp=8
    python recipes/fsdp.py --mesh fsdp=2,model=4    # FSDP x tensor parallelism
    python recipes/fsdp.py --remat                  # gather again in the backward pass
    python recipes/fsdp.py --devices 1              # a one-device machine (--mesh auto)
    python recipes/fsdp.py --data corpus/*.jsonl --tokenizer tokenizer.json
    python recipes/fsdp.py --checkpoint-dir /tmp/fsdp --checkpoint-every 100 --resume

The same seed gives the same losses as hybrid_gpt.py on any mesh (up to float rounding).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqxpar
import eqxpar.nn
import eqxpar.recipe
from eqxpar.inspect import CommReport
from eqxpar.models import GPT, next_token_loss
from eqxpar.train import fsdp_specs, fsdp_step


@dataclasses.dataclass
class Config(
    eqxpar.recipe.CheckpointFlags, eqxpar.recipe.LogFlags, eqxpar.recipe.TextFlags
):  # + checkpoint flags, --log-dir, --log-every, --data, --tokenizer, --seq-len
    devices: int = 8  # simulated CPU devices when there is no accelerator
    mesh: str = "auto"  # state and batch over `fsdp`, layers optionally over `model` (fsdp=2,model=4); auto: fit
    steps: int = 400  # training steps
    batch_size: int = 32  # the global batch: sequences per step
    context: int = 64  # tokens the model sees (its position table); --seq-len: tokens per training row
    dim: int = 64  # the model's width
    heads: int = 8  # attention heads (the model axis size must divide them)
    layers: int = 2  # transformer blocks
    learning_rate: float = 3e-3  # AdamW step size
    remat: bool = False  # gather each block's weights again in the backward pass
    seed: int = 0  # seeds the weights and the batches
    metrics_out: str | None = None  # write the results as JSON here
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype; bfloat16: float32 master weights, gradient sums
    attention: Literal["dot_product", "reference"] = "dot_product"  # dot_product: cuDNN flash attention on GPU
    scan_layers: bool = False  # stack the blocks and run them with jax.lax.scan, gathering one layer at a time
    eval_every: int = 0  # held-out loss every N steps (printed, and in --log-dir); 0: only at the end


def check_flags(cfg: Config) -> Config:
    """Every check of the flags, before anything compiles; returns `cfg` with its mesh chosen."""
    eqxpar.recipe.require_positive(cfg, "steps", "batch_size", "context", "dim", "heads", "layers")
    for name, allowed in {"dtype": ("float32", "bfloat16"), "attention": ("dot_product", "reference")}.items():
        if getattr(cfg, name) not in allowed:
            raise ValueError(f"--{name} must be one of {', '.join(allowed)}, got {getattr(cfg, name)!r}.")
    if cfg.dim % cfg.heads:
        raise ValueError(f"--dim {cfg.dim} is not divisible by --heads {cfg.heads}: every head needs the same width.")
    cfg = eqxpar.recipe.check_text_flags(cfg, context=cfg.context)  # --data, --tokenizer, --seq-len
    eqxpar.simulate_cpu_devices(cfg.devices)  # before JAX touches a backend
    sizes = eqxpar.recipe.mesh_from_flag(
        cfg.mesh,
        {"fsdp": 8, "model": 1},
        optional=("model",),
        divides={"fsdp": {"--batch-size": cfg.batch_size}, "model": {"--heads": cfg.heads}},
    )
    return dataclasses.replace(cfg, mesh=eqxpar.recipe.mesh_text(sizes))


def main(argv=None) -> dict:
    cfg = eqxpar.recipe.parse_flags(Config, argv, validate=check_flags)  # bad flags: one line, exit 2
    # Checks --checkpoint-dir now, before anything compiles: checkpoints there need --resume,
    # and --resume needs the saved model's --context, --dim and --layers; else one line, exit 2.
    with eqxpar.recipe.flag_errors():
        ckpt = eqxpar.checkpoint.Checkpointer.from_config(cfg, shape_fields=("context", "dim", "layers", "scan_layers"))

    # --- Mesh: `fsdp` splits parameters, optimizer state and batch; `model` (optional,
    # size 1 by default) runs the GPT's layers tensor-parallel. ---
    sizes = eqxpar.parse_mesh(cfg.mesh)
    sizes.setdefault("model", 1)
    mesh = eqxpar.make_mesh(**sizes)

    # --- Data: as in hybrid_gpt.py, the corpus tokenized once into a token store, cut into
    # packed rows of --seq-len + 1 tokens (each token's document and position with it); the
    # last --held-out share of documents held out. Each batch a pure function of (seed, step). ---
    with eqxpar.recipe.flag_errors():  # unreadable files or tokenizer, a stale store: one line, exit 2
        text = eqxpar.recipe.load_text(cfg)

    # --- Model and where it lives: every weight split over `fsdp` (on top of `model`). ---
    model_key, train_key, _ = jax.random.split(jax.random.key(cfg.seed), 3)  # as hybrid_gpt.py
    model = GPT(
        text.vocab_size,
        cfg.context,
        cfg.dim,
        cfg.heads,
        cfg.layers,
        axis_name="model",
        key=model_key,
        attention_impl=cfg.attention,
        scan_layers=cfg.scan_layers,
    )
    flops_per_token = eqxpar.models.gpt_flops_per_token(model)  # 6 N + attention, forward and backward
    layer_specs = eqxpar.nn.partition_specs(model, mesh)  # the tensor-parallel split over `model`
    specs = fsdp_specs(model, mesh, batch_axis="fsdp", param_specs=layer_specs)
    optimizer = optax.adamw(cfg.learning_rate)

    # --- The FSDP step. `loss_fn` sees the whole model: the step gathers each block's
    # weights (all_gather over `fsdp`) when the block runs, and the backward pass
    # reduce-scatters the gradients (see eqxpar/train/_gradients.py); AdamW then runs on
    # the global gradient, each device updating its own slices. A packed batch keeps
    # attention inside each document; with --no-document-mask it is the tokens alone.
    def loss_fn(model, tokens, key):
        return next_token_loss(model, tokens, key=key)

    step = fsdp_step(
        loss_fn,
        optimizer,
        mesh,
        param_specs=specs,
        batch_axis="fsdp",
        units=lambda m: m.blocks,
        remat=cfg.remat,
        precision=eqxpar.train.Precision(compute_dtype=jnp.bfloat16 if cfg.dtype == "bfloat16" else None),
    )
    model, opt_state = step.init(model)  # each device keeps its slices of both
    stored = eqxpar.sharding_report((model, opt_state))
    if eqxpar.recipe.is_main_process():
        print(eqxpar.sharding_report(model))
        print(
            f"\nparameters + optimizer state: {stored.bytes_per_device:,} of {stored.bytes_total:,} bytes per device\n"
        )

    def batch(i: int):  # the rows split over `fsdp`, replicated over `model`
        return text.batch(i, mesh, global_batch_size=cfg.batch_size, seed=cfg.seed, batch_axis="fsdp")

    lowered = step.lower(model, opt_state, batch(0), train_key)
    comm = CommReport.of(lowered)
    temp_bytes = lowered.compile().memory_analysis().temp_size_in_bytes
    if eqxpar.recipe.is_main_process():
        print(f"collectives of one train step (per device):\n{comm}\n")

    # --- Checkpoints (--checkpoint-dir, --checkpoint-every, --resume): the state as it is
    # split, and the loss history. Batches and keys depend on (seed, step) only, so a
    # resumed run continues exactly as the interrupted one would have. ---
    (model, opt_state, train_key), first_step, history = ckpt.restore((model, opt_state, train_key))

    # The held-out loss, every --eval-every steps and at the end: the model gathered from
    # its `fsdp` slices into the tensor-parallel layout, on the same held-out rows as hybrid_gpt.py.
    evaluate = eqxpar.recipe.held_out_loss(lambda model, tokens: next_token_loss(model, tokens), mesh, layer_specs)
    val_batch, val_counts = text.val_batch(mesh)

    def val_metrics(model):  # val_loss, val_perplexity, val_bits_per_byte
        return text.val_metrics(float(evaluate(model, val_batch)), val_counts)

    def val_loss_of(model):
        return val_metrics(model)["val_loss"]

    # --- Training loop. --log-dir: metrics every --log-every steps, TensorBoard, config.json.
    # The loop waits for the device only every --log-every steps (run_log fetches those steps'
    # losses in one go), at evaluations, checkpoints and the end. ---
    run_log = eqxpar.recipe.RunLog.from_config(
        cfg,
        items_per_step=cfg.batch_size * cfg.seq_len,
        flops_per_item=flops_per_token,
        n_devices=mesh.size,
        losses=history["losses"] if history else [],
    )
    steps = eqxpar.recipe.steps_to_run(first_step, cfg.steps)  # none left: says so
    for i in run_log.progress(steps, desc=f"fsdp {cfg.mesh}{' remat' if cfg.remat else ''}"):
        model, opt_state, metrics = step(model, opt_state, batch(i), jax.random.fold_in(train_key, i))
        run_log.step(i, metrics)
        run_log.maybe_eval(i, val_loss=functools.partial(val_loss_of, model))
        ckpt.maybe_save(i + 1, (model, opt_state, train_key), data_state=run_log.data_state, force=i + 1 == cfg.steps)
    ckpt.close()
    run_log.close()
    losses, tokens_per_second = run_log.losses, run_log.per_second  # every step's loss; tokens/s
    val = val_metrics(model)
    val_loss = val["val_loss"]

    metrics = {
        "mesh": cfg.mesh,
        "remat": cfg.remat,
        "steps": cfg.steps,
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "final_loss_mean10": float(np.mean(losses[-10:])),
        **val,  # val_loss (nats per held-out token), val_perplexity, val_bits_per_byte
        "val_losses": run_log.evals,  # every --eval-every steps: {"step", "val_loss"}
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,  # row positions trained on, resumed steps included
        "vocab_size": text.vocab_size,
        "seq_len": cfg.seq_len,
        "document_mask": cfg.document_mask,
        # tokens_per_second, flops_per_token, flops_per_second, and the model FLOPs
        # utilisation against the chips' peak (mfu; null where the peak is unknown: CPU, and
        # all three null where no step was timed: --steps 1, or a finished run resumed).
        **eqxpar.recipe.speed_metrics(tokens_per_second, flops_per_token, mesh.size, cfg.dtype),
        "dtype": cfg.dtype,
        "attention": cfg.attention,
        "scan_layers": cfg.scan_layers,
        "state_bytes_total": stored.bytes_total,
        "state_bytes_per_device": stored.bytes_per_device,
        "temp_bytes_per_device": temp_bytes,
        "all_gathers_per_step": comm.count("all-gather"),
        "all_gathers_per_step_lowered": comm.count("all-gather", stage="lowered"),
        "reduce_scatters_per_step": comm.count("reduce-scatter"),
        "resumed_from_step": first_step,
        "param_digest": eqxpar.recipe.parameter_digest(model),  # of the whole (gathered) weights
    }
    if eqxpar.recipe.is_main_process():
        print(
            f"{cfg.mesh}{' remat' if cfg.remat else ''}: loss {metrics['first_loss']:.3f} -> "
            f"{metrics['final_loss_mean10']:.3f} (last 10 steps), held-out {val_loss:.3f} "
            f"({val['val_bits_per_byte']:.3f} bits/byte); "
            f"{eqxpar.recipe.speed_text(metrics)}; "
            f"parameters + optimizer state {stored.bytes_per_device:,} of {stored.bytes_total:,} bytes "
            f"per device ({stored.bytes_total / stored.bytes_per_device:.1f}x less than one device)"
        )
    eqxpar.recipe.write_metrics(cfg.metrics_out, metrics)
    return metrics


if __name__ == "__main__":
    main()
