"""Tensor-parallel training of a small GPT on your text.

What it shows: a transformer language model whose embedding, attention, MLPs and output
head are split over a `model` mesh axis (Megatron-style), trained with an explicit
`shard_map` step on your text (`--data`, `--tokenizer`; by default a corpus of Python's own
source code, through the same tokenizer, token store and packed rows as hybrid_gpt.py).
Each device holds 1/N of every big weight; the layers talk with one all-reduce per
attention and per MLP going forward and one each going backward, and the loss is computed
from vocabulary-split logits (a `pmax` and a `psum`) without ever putting the whole logits
on one device.

Run it:

    python recipes/tensor_parallel.py                  # 8 simulated CPU devices, model=8
    python recipes/tensor_parallel.py --mesh model=1   # the same model, densely
    python recipes/tensor_parallel.py --devices 1      # a one-device machine (--mesh auto: model=1)
    python recipes/tensor_parallel.py --steps 50 --metrics-out /tmp/tp.json
    python recipes/tensor_parallel.py --dtype bfloat16 --remat block --scan-layers
    python recipes/tensor_parallel.py --model-size 124m --devices 1   # GPT-2 small's shape (a GPU)
    python recipes/tensor_parallel.py --data corpus/*.jsonl --tokenizer tokenizer.json
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
from eqxpar.inspect import CommReport
from eqxpar.models import GPT, generate, next_token_loss


@dataclasses.dataclass
class Config(
    eqxpar.recipe.CheckpointFlags, eqxpar.recipe.LogFlags, eqxpar.recipe.GPTFlags, eqxpar.recipe.TextFlags
):  # + their flags
    devices: int = 8  # simulated CPU devices when there is no accelerator
    mesh: str = "auto"  # a `model` axis, e.g. model=4 (1/N of each big layer per device); auto: fit the devices
    steps: int = 600  # training steps
    batch_size: int = 16  # sequences per step
    context: int = 64  # tokens the model sees (its position table); --seq-len: tokens per training row
    dim: int = 64  # the model's width
    heads: int = 8  # attention heads (the model axis size must divide them)
    layers: int = 2  # transformer blocks
    dropout: float = 0.0  # dropout probability while training
    learning_rate: float = 5e-3  # AdamW step size
    seed: int = 0  # seeds the weights, the batches and the sample
    sample_chars: int = 100  # tokens sampled at the end; 0: no sample
    metrics_out: str | None = None  # write the results as JSON here
    eval_every: int = 0  # held-out loss every N steps (printed, and in --log-dir); 0: only at the end


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
    cfg = eqxpar.recipe.check_text_flags(cfg, context=cfg.context)  # --data, --tokenizer, --seq-len
    sizes = eqxpar.recipe.mesh_from_flag(cfg.mesh, {"model": 8}, divides={"model": {"--heads": cfg.heads}})
    return dataclasses.replace(cfg, mesh=eqxpar.recipe.mesh_text(sizes))


def main(argv=None) -> dict:
    cfg = eqxpar.recipe.parse_flags(Config, argv, validate=check_flags)  # bad flags: one line, exit 2
    # Checks --checkpoint-dir now, before anything compiles: checkpoints there need --resume,
    # and --resume needs the saved model's --context, --dim, --layers and --scan-layers; else
    # one line, exit 2.
    with eqxpar.recipe.flag_errors():
        ckpt = eqxpar.checkpoint.Checkpointer.from_config(cfg, shape_fields=("context", "dim", "layers", "scan_layers"))

    # --- Data: the corpus tokenized once into a token store (reused while the tokenizer
    # and files match), cut into packed rows of --seq-len + 1 tokens with each token's
    # document and position in it; the last --held-out share of documents held out. ---
    with eqxpar.recipe.flag_errors():  # unreadable files or tokenizer, a stale store: one line, exit 2
        text = eqxpar.recipe.load_text(cfg)

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
    # A packed batch (`{"tokens", "segment_ids", "positions"}`) keeps attention inside each
    # document; with --no-document-mask it is the tokens alone (plain causal attention).
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

    # Each step's batch, a pure function of (seed, step): whole on every device (no data
    # axis: every device of `model` needs every sequence).
    def batch(i: int):
        return text.batch(i, mesh, global_batch_size=cfg.batch_size, seed=cfg.seed, batch_axis=None)

    # Compile the step once, ahead of time, and read what it communicates from the program.
    lowered = train_step.lower(model, opt_state, batch(0), train_key)
    train_step = lowered.compile()
    comm = CommReport.of(lowered, train_step)

    # The held-out rows: the loss on them every --eval-every steps, and at the end.
    val_batch, val_counts = text.val_batch(mesh)

    def val_metrics(model):  # val_loss, val_perplexity, val_bits_per_byte
        return text.val_metrics(float(evaluate(model, val_batch)), val_counts)

    def val_loss_of(model):
        return val_metrics(model)["val_loss"]

    # --- Training loop. Batch and dropout key of each step depend on (seed, step) only. ---
    # --log-dir: metrics every --log-every steps, TensorBoard events, config.json.
    # The loop waits for the device only every --log-every steps (run_log fetches those steps'
    # losses in one go), at evaluations, checkpoints and the end.
    run_log = eqxpar.recipe.RunLog.from_config(
        cfg,
        items_per_step=cfg.batch_size * cfg.seq_len,
        flops_per_item=flops_per_token,
        n_devices=mesh.size,
        losses=history["losses"] if history else [],
    )
    steps = eqxpar.recipe.steps_to_run(first_step, cfg.steps)  # none left: says so
    for step in run_log.progress(steps, desc=f"tensor parallel {cfg.mesh}"):
        model, opt_state, loss = train_step(model, opt_state, batch(step), jax.random.fold_in(train_key, step))
        run_log.step(step, {"loss": loss})
        run_log.maybe_eval(step, val_loss=functools.partial(val_loss_of, model))
        ckpt.maybe_save(
            step + 1, (model, opt_state, train_key), data_state=run_log.data_state, force=step + 1 == cfg.steps
        )
    ckpt.close()
    run_log.close()
    losses = run_log.losses  # every step's loss

    # --- Final check: held-out loss, and a sample from the trained model. ---
    val = val_metrics(model)
    val_loss = val["val_loss"]

    whole_logits = eqx.filter_jit(
        eqxpar.filter_shard_map(
            lambda model, tokens: jax.vmap(functools.partial(model, inference=True))(tokens),
            mesh=mesh,
            in_specs=(specs, P()),
            out_specs=P(None, None, "model"),  # vocab blocks side by side
        )
    )
    sample = ""
    if cfg.sample_chars > 0:
        ids = generate(
            functools.partial(whole_logits, model),
            np.asarray(text.tokenizer.encode("def "), np.int32),
            cfg.sample_chars,
            context_length=cfg.context,
            key=sample_key,
            temperature=0.8,
        )
        sample = text.tokenizer.decode(np.asarray(ids).tolist())

    metrics = {
        "mesh": cfg.mesh,
        "steps": cfg.steps,
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "final_loss_mean10": float(np.mean(losses[-10:])),
        **val,  # val_loss (nats per held-out token), val_perplexity, val_bits_per_byte
        "val_losses": run_log.evals,  # every --eval-every steps: {"step", "val_loss"}
        "uniform_loss": math.log(text.vocab_size),  # guessing every token equally
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,  # row positions trained on, resumed steps included
        "vocab_size": text.vocab_size,
        "seq_len": cfg.seq_len,
        "document_mask": cfg.document_mask,
        "param_bytes_total": params.bytes_total,
        "param_bytes_per_device": params.bytes_per_device,
        "all_reduces_per_step": comm.count("all-reduce"),
        "all_reduce_bytes_per_step": comm.bytes("all-reduce"),
        "sample": sample,
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
        if sample:
            print(f"sample:\n{sample}\n")
        print(
            f"{cfg.mesh}: loss {metrics['first_loss']:.3f} -> {metrics['final_loss_mean10']:.3f} "
            f"(last 10 steps), held-out {val_loss:.3f} ({val['val_bits_per_byte']:.3f} bits/byte; uniform guessing "
            f"{metrics['uniform_loss']:.3f}); "
            f"{eqxpar.recipe.speed_text(metrics)}; "
            f"parameters {params.bytes_per_device:,} of {params.bytes_total:,} bytes per device"
        )
    eqxpar.recipe.write_metrics(cfg.metrics_out, metrics)
    return metrics


if __name__ == "__main__":
    main()
