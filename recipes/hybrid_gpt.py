"""Hybrid data x tensor parallel training of a GPT on a 2-D mesh: eqxpar's main recipe.

What it shows: a GPT trained on your text (`--data`, `--tokenizer`; by default a corpus of
Python's own source code, through the same tokenizer, token store and packed rows), on a
`(data, model)` mesh. Along `model` the transformer is tensor-parallel (Megatron-style:
each device holds 1/M of every big weight, and the layers all-reduce their activations
with `psum`); along `data` the batch is split, and each group of devices that shares a
data index is one model replica working on its own slice of the batch. After the backward
pass one `psum` over `data` combines the replicas' gradients. The loss comes from
vocabulary-split logits and never needs the whole logits on one device.

Run it (8 simulated CPU devices when there is no accelerator):

    python recipes/hybrid_gpt.py                          # data=2, model=4
    python recipes/hybrid_gpt.py --mesh data=4,model=2
    python recipes/hybrid_gpt.py --mesh data=1,model=1    # one device: the same losses
    python recipes/hybrid_gpt.py --devices 1              # a one-device machine (--mesh auto)
    python recipes/hybrid_gpt.py --layout auto            # the planner's fastest layout that fits
    python recipes/hybrid_gpt.py --steps 50 --metrics-out /tmp/gpt.json
    python recipes/hybrid_gpt.py --data corpus/*.jsonl --tokenizer tokenizer.json
    python recipes/hybrid_gpt.py --checkpoint-dir /tmp/gpt --checkpoint-every 100 --resume

Every factorisation of the devices trains the same model on the same batches, so the
same seed gives the same losses on any mesh (up to float rounding).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import numpy as np
import optax

import eqxpar
import eqxpar.nn
import eqxpar.recipe
from eqxpar.inspect import CommReport, MemoryReport
from eqxpar.models import GPT, generate, next_token_loss, whole_logits
from eqxpar.train import hybrid_step


@dataclasses.dataclass
class Config(
    eqxpar.recipe.CheckpointFlags,
    eqxpar.recipe.LogFlags,
    eqxpar.recipe.GPTFlags,
    eqxpar.recipe.LayoutFlags,
    eqxpar.recipe.TextFlags,
):  # + their flags
    devices: int = 8  # simulated CPU devices when there is no accelerator
    mesh: str = "auto"  # batch split over `data`, layers over `model`, e.g. data=2,model=4; auto: fit the devices
    steps: int = 800  # training steps
    batch_size: int = 32  # the global batch: sequences per step, over all replicas
    context: int = 64  # tokens the model sees (its position table); --seq-len: tokens per training row
    dim: int = 64  # the model's width
    heads: int = 8  # attention heads (the model axis size must divide them)
    layers: int = 2  # transformer blocks
    learning_rate: float = 3e-3  # AdamW step size
    seed: int = 0  # seeds the weights, the batches and the sample
    sample_chars: int = 100  # tokens sampled at the end; 0: no sample
    metrics_out: str | None = None  # write the results as JSON here
    eval_every: int = 0  # held-out loss every N steps (printed, and in --log-dir); 0: only at the end


def check_flags(cfg: Config) -> Config:
    """Every check of the flags, before anything compiles; returns `cfg` with its mesh chosen."""
    eqxpar.simulate_cpu_devices(cfg.devices)  # before JAX touches a backend
    cfg = eqxpar.recipe.check_gpt_flags(cfg)  # --dtype, --attention, --remat; --model-size sets the shape
    eqxpar.recipe.require_positive(cfg, "steps", "batch_size", "context", "dim", "heads", "layers")
    if not cfg.learning_rate > 0:
        raise ValueError(f"--learning-rate must be positive, got {cfg.learning_rate}.")
    cfg = eqxpar.recipe.check_text_flags(cfg, context=cfg.context)  # --data, --tokenizer, --seq-len
    if cfg.dim % cfg.heads:
        raise ValueError(f"--dim {cfg.dim} is not divisible by --heads {cfg.heads}: every head needs the same width.")
    eqxpar.recipe.check_layout_flags(cfg)  # --layout auto with --mesh: one line, before any data is read
    if cfg.layout == "auto":  # the planner chooses the mesh (in main), and checks what divides what
        return cfg
    # The data axis splits the batch (every replica the same number of sequences), the
    # model axis the layers (every device the same number of heads).
    sizes = eqxpar.recipe.mesh_from_flag(
        cfg.mesh,
        {"data": 2, "model": 4},
        divides={"data": {"--batch-size": cfg.batch_size}, "model": {"--heads": cfg.heads}},
    )
    return dataclasses.replace(cfg, mesh=eqxpar.recipe.mesh_text(sizes))


def main(argv=None) -> dict:
    cfg = eqxpar.recipe.parse_flags(Config, argv, validate=check_flags)  # bad flags: one line, exit 2
    # Checks --checkpoint-dir now, before anything compiles: checkpoints there need --resume,
    # and --resume needs the saved model's --context, --dim and --layers; else one line, exit 2.
    with eqxpar.recipe.flag_errors():
        ckpt = eqxpar.checkpoint.Checkpointer.from_config(cfg, shape_fields=("context", "dim", "layers", "scan_layers"))

    # --- Data: the corpus tokenized once into a token store (reused while the tokenizer
    # and files match), cut into packed rows of --seq-len + 1 tokens with each token's
    # document and position in it; the last --held-out share of documents held out. Each
    # step's batch is a pure function of (seed, step): any mesh, any number of processes,
    # and a resumed run see the same batches. ---
    with eqxpar.recipe.flag_errors():  # unreadable files or tokenizer, a stale store: one line, exit 2
        text = eqxpar.recipe.load_text(cfg)

    # --- Layout (--layout auto): the planner prices every data x model layout of these
    # devices, with each remat policy, from the shapes alone (eqxpar.plan: exact collective
    # and memory theories, a roofline for time); it prints the fastest that fit
    # --memory-per-device with why, and the first one's mesh and remat replace the flags'. ---
    with eqxpar.recipe.flag_errors():  # nothing fits, or no layout divides the batch: one line, exit 2
        cfg, plan = eqxpar.recipe.auto_layout(cfg, vocab_size=text.vocab_size, axes=("data", "model"))

    # --- Mesh: the data axis splits the batch, the model axis splits the layers. ---
    mesh = eqxpar.make_mesh(**eqxpar.parse_mesh(cfg.mesh))

    # --- Model: built whole from the seed, then split over `model` by its spec tree. ---
    model_key, train_key, sample_key = jax.random.split(jax.random.key(cfg.seed), 3)
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
        remat=cfg.remat,
    )
    specs = eqxpar.nn.partition_specs(model, mesh)  # checks that heads, widths and vocab divide
    flops_per_token = eqxpar.models.gpt_flops_per_token(model)  # 6 N + attention, forward and backward
    optimizer = optax.adamw(cfg.learning_rate)

    # --- The parallel step. ---
    # `loss_fn` runs on every device inside shard_map: `model` holds this device's blocks,
    # `tokens` this replica's slice of the batch. Inside `next_token_loss` the layers psum
    # their activations over `model` (and the loss does a pmax and a psum of per-token
    # statistics there). `hybrid_step` differentiates it, then does the one psum over
    # `data` that adds up the replicas' gradients (see eqxpar/train/_gradients.py), and
    # applies AdamW to the global gradient, each device updating its own blocks.
    # A packed batch (`{"tokens", "segment_ids", "positions"}`) keeps attention inside each
    # document; with --no-document-mask it is the tokens alone (plain causal attention).
    def loss_fn(model, tokens, key):
        return next_token_loss(model, tokens, key=key)

    # Mixed precision: bfloat16 matmuls on float32 master weights; the loss and the
    # gradient sums stay float32.
    step = hybrid_step(
        loss_fn, optimizer, mesh, param_specs=specs, batch_axis="data", model_axis="model", precision=cfg.precision()
    )
    model, opt_state = step.init(model)  # the model split by `specs`, AdamW's state beside it

    def batch(i: int):
        return text.batch(i, mesh, global_batch_size=cfg.batch_size, seed=cfg.seed, batch_axis="data")

    # What one step communicates and holds per device, read from the compiled program.
    lowered = step.lower(model, opt_state, batch(0), train_key)
    compiled = lowered.compile()
    comm = CommReport.of(lowered, compiled)
    memory = MemoryReport.of(compiled, model, opt_state, batch(0), train_key)
    with eqxpar.recipe.flag_errors():  # --layout auto: the compiled step must fit the memory, or stop here
        eqxpar.recipe.check_compiled_peak(cfg, plan, memory)
    if eqxpar.recipe.is_main_process():
        print(f"mesh {dict(mesh.shape)}; collectives of one train step (per device):\n{comm}\n")

    # --- Checkpoints (--checkpoint-dir, --checkpoint-every, --resume): the state as it is
    # split, and the loss history. Batches and keys depend on (seed, step) only, so a
    # resumed run continues exactly as the interrupted one would have. ---
    (model, opt_state, train_key), first_step, history = ckpt.restore((model, opt_state, train_key))

    # The held-out loss: every --eval-every steps, and at the end.
    evaluate = eqxpar.recipe.held_out_loss(lambda model, tokens: next_token_loss(model, tokens), mesh, specs)
    val_batch, val_counts = text.val_batch(mesh)

    def val_metrics(model):  # val_loss, val_perplexity, val_bits_per_byte
        return text.val_metrics(float(evaluate(model, val_batch)), val_counts)

    def val_loss_of(model):
        return val_metrics(model)["val_loss"]

    # --- Training loop. --log-dir: metrics every --log-every steps, TensorBoard, config.json. ---
    # The loop never waits for the device but every --log-every steps, where run_log fetches
    # those steps' losses in one go (and at evaluations, checkpoints and the end).
    run_log = eqxpar.recipe.RunLog.from_config(
        cfg,
        items_per_step=cfg.batch_size * cfg.seq_len,
        flops_per_item=flops_per_token,
        n_devices=mesh.size,
        losses=history["losses"] if history else [],
    )
    for i in run_log.progress(eqxpar.recipe.steps_to_run(first_step, cfg.steps), desc=f"hybrid {cfg.mesh}"):
        model, opt_state, metrics = step(model, opt_state, batch(i), jax.random.fold_in(train_key, i))
        run_log.step(i, metrics)
        run_log.maybe_eval(i, val_loss=functools.partial(val_loss_of, model))
        ckpt.maybe_save(i + 1, (model, opt_state, train_key), data_state=run_log.data_state, force=i + 1 == cfg.steps)
    ckpt.close()
    run_log.close()
    losses, tokens_per_second = run_log.losses, run_log.per_second  # every step's loss; tokens/s

    # --- Final check: held-out loss, and a sample from the trained model. ---
    val = val_metrics(model)
    val_loss = val["val_loss"]
    sample = ""
    if cfg.sample_chars > 0:
        prompt = np.asarray(text.tokenizer.encode("def "), np.int32)
        ids = generate(
            whole_logits(model, mesh, specs),
            prompt,
            cfg.sample_chars,
            context_length=cfg.context,
            key=sample_key,
            temperature=0.8,
        )
        sample = text.tokenizer.decode(np.asarray(ids).tolist())

    params = eqxpar.sharding_report(model)
    metrics = {
        "mesh": cfg.mesh,
        "steps": cfg.steps,
        "batch_size": cfg.batch_size,
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
        # tokens_per_second, flops_per_token, flops_per_second, and the model FLOPs
        # utilisation against the chips' peak (mfu; null where the peak is unknown: CPU).
        **eqxpar.recipe.speed_metrics(tokens_per_second, flops_per_token, mesh.size, cfg.dtype),
        "model_size": cfg.model_size,
        "dtype": cfg.dtype,
        "attention": cfg.attention,
        "remat": cfg.remat,
        "scan_layers": cfg.scan_layers,
        "param_bytes_total": params.bytes_total,
        "param_bytes_per_device": params.bytes_per_device,
        "all_reduces_per_step": comm.count("all-reduce"),
        "all_reduce_bytes_per_step": comm.bytes("all-reduce"),
        "sample": sample,
        "resumed_from_step": first_step,
        "param_digest": eqxpar.recipe.parameter_digest(model),  # of the whole (gathered) weights
        # The layout run ("data=8 remat=none"), and the plan's predicted bytes per device
        # (with --layout auto; else null) beside the compiled step's.
        **eqxpar.recipe.layout_metrics(cfg, plan, comm, memory),
    }
    if eqxpar.recipe.is_main_process():
        if sample:
            print(f"\nsample:\n{sample}\n")
        print(
            f"{cfg.mesh}: loss {metrics['first_loss']:.3f} -> {metrics['final_loss_mean10']:.3f} "
            f"(last 10 steps), held-out {val_loss:.3f} ({val['val_bits_per_byte']:.3f} bits/byte; uniform guessing "
            f"{metrics['uniform_loss']:.3f}); "
            f"{eqxpar.recipe.speed_text(metrics)}; parameters {params.bytes_per_device:,} of "
            f"{params.bytes_total:,} bytes per device"
        )
    eqxpar.recipe.write_metrics(cfg.metrics_out, metrics)
    return metrics


if __name__ == "__main__":
    main()
