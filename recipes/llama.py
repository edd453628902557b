"""Train a Llama-style model on any mesh, start from a Hugging Face checkpoint, export one.

What it shows: `eqxpar.models.Llama` (RMSNorm, rotary embeddings, grouped-query attention,
SwiGLU; Hugging Face's field names) trained on your text (`--data`, `--tokenizer`; by default
a corpus of Python's own source code with a byte-level BPE trained on it, through the same
token store and packed rows with document masks). With `--from-hf DIR` it reads the folder's
own tokenizer and refuses one whose vocabulary the checkpoint does not hold. Its axes: `data`
splits the batch, `model` the heads, key/value heads, MLP units and vocabulary (tensor
parallelism), an optional `fsdp` axis splits every parameter and its optimizer state as well
(FSDP x TP), and an optional `context` axis splits every sequence
(context parallelism: ring attention over the zigzag layout, each token rotated by its global
position). `--sequence-parallel` splits the positions over `model` as well between the
tensor-parallel layers (Megatron sequence parallelism). The model is created directly in its shards
(`eqxpar.init_sharded`: no device ever holds all of it), or, with `--from-hf DIR`, loaded
from a Hugging Face `LlamaForCausalLM` folder straight into them (`eqxpar.models.load_hf`:
each device reads only its slice of each tensor). `--export-hf DIR` writes the trained
model as such a folder (`eqxpar.models.save_hf`), which transformers (and `--from-hf`) read.

Run it (8 simulated CPU devices when there is no accelerator):

    python recipes/llama.py                                  # data=2, model=4
    python recipes/llama.py --mesh fsdp=2,model=4            # FSDP x tensor parallel
    python recipes/llama.py --devices 1                      # one device: the same losses
    python recipes/llama.py --mesh data=2,context=2,model=2 --sequence-parallel   # CP x TP + SP
    python recipes/llama.py --export-hf /tmp/llama-hf        # train, then write a HF folder
    python recipes/llama.py --from-hf /tmp/llama-hf --mesh fsdp=8 --steps 50   # fine-tune it
    python recipes/llama.py --data corpus/*.jsonl --tokenizer tokenizer.json  # your text
    python recipes/llama.py --checkpoint-dir /tmp/llama --checkpoint-every 100 --resume

Every mesh trains the same model on the same batches: the same seed gives the same losses
on any mesh (up to float rounding).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os

import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import eqxpar
import eqxpar.data.text
import eqxpar.nn
import eqxpar.recipe
from eqxpar.models import Llama, LlamaConfig, llama_flops_per_token, llama_loss, load_hf, save_hf
from eqxpar.train import fsdp_specs, fsdp_step, hybrid_step

AXES = ("data", "fsdp", "context", "model")


@dataclasses.dataclass
class Config(eqxpar.recipe.CheckpointFlags, eqxpar.recipe.LogFlags, eqxpar.recipe.TextFlags):  # + their flags
    devices: int = 8  # simulated CPU devices when there is no accelerator
    mesh: str = "auto"  # axes data (batch), fsdp (parameters and batch), context (sequences), model (heads)
    steps: int = 300  # training steps
    batch_size: int = 16  # the global batch: sequences per step, over all replicas
    context: int = 64  # tokens the model sees (max_seq_len); with --from-hf the checkpoint's; --seq-len: per row
    dim: int = 64  # the model's width (hidden_size); with --from-hf the checkpoint's shape is used
    heads: int = 8  # query heads (the model axis size must divide --kv-heads)
    kv_heads: int = 4  # key/value heads (grouped-query attention: --heads a multiple of it)
    hidden_dim: int = 192  # the SwiGLU MLP's width (intermediate_size)
    layers: int = 2  # transformer blocks
    scan_layers: bool = False  # stack the blocks and run them with jax.lax.scan (one compiled block at any depth)
    sequence_parallel: bool = False  # also split the positions over `model` between the tensor-parallel layers
    learning_rate: float = 3e-3  # AdamW step size
    seed: int = 0  # seeds the weights and the batches
    from_hf: str | None = None  # start from this Hugging Face Llama folder (its config.json sets the shape)
    export_hf: str | None = None  # write the trained model here as a Hugging Face folder (a new folder)
    metrics_out: str | None = None  # write the results as JSON here
    eval_every: int = 0  # held-out loss every N steps (printed, and in --log-dir); 0: only at the end


def check_flags(cfg: Config) -> Config:
    """Every check of the flags, before anything compiles; returns `cfg` with its mesh chosen."""
    eqxpar.simulate_cpu_devices(cfg.devices)  # before JAX touches a backend
    eqxpar.recipe.require_positive(cfg, "steps", "batch_size", "context", "dim", "heads", "kv_heads", "hidden_dim")
    eqxpar.recipe.require_positive(cfg, "layers")
    if not cfg.learning_rate > 0:
        raise ValueError(f"--learning-rate must be positive, got {cfg.learning_rate}.")
    if cfg.heads % cfg.kv_heads:
        raise ValueError(f"--heads {cfg.heads} is not a multiple of --kv-heads {cfg.kv_heads}.")
    if cfg.from_hf is not None and not os.path.isfile(os.path.join(cfg.from_hf, "config.json")):
        raise ValueError(f"--from-hf {cfg.from_hf}: no config.json there; give a Hugging Face Llama folder.")
    cfg = _text_flags(cfg)  # --data, --tokenizer (--from-hf: the folder's own), --seq-len
    if cfg.export_hf is not None and os.path.exists(cfg.export_hf):
        held = sorted(f for f in os.listdir(cfg.export_hf) if f == "config.json" or f.endswith(".safetensors"))
        if held:
            raise ValueError(f"--export-hf {cfg.export_hf} already holds {held}: give a new folder.")
    # The batch splits over data x fsdp; the model axis splits the key/value heads (and the
    # vocabulary, padded to a multiple of 8).
    sizes = eqxpar.recipe.mesh_from_flag(
        cfg.mesh,
        {"data": 2, "model": 4},
        divides={"data": {"--batch-size": cfg.batch_size}, "model": {"--kv-heads": cfg.kv_heads, "the vocabulary": 8}},
        any_names=True,
    )
    unknown = sorted(set(sizes) - set(AXES))
    if unknown:
        raise ValueError(f"--mesh {cfg.mesh}: unknown axes {unknown}; this recipe's axes are {list(AXES)}.")
    if cfg.batch_size % (sizes.get("data", 1) * sizes.get("fsdp", 1)):
        raise ValueError(f"--mesh {cfg.mesh}: data x fsdp does not divide --batch-size {cfg.batch_size}.")
    if cfg.from_hf is None and cfg.kv_heads % sizes.get("model", 1):
        raise ValueError(f"--mesh {cfg.mesh}: model={sizes['model']} does not divide --kv-heads {cfg.kv_heads}.")
    c, n = sizes.get("context", 1), sizes.get("model", 1)
    if cfg.seq_len % (2 * c):
        raise ValueError(
            f"--mesh {cfg.mesh}: context={c} splits each sequence into {2 * c} zigzag chunks, which do not divide "
            f"--seq-len {cfg.seq_len}; use a --seq-len that is a multiple of {2 * c}."
        )
    if cfg.sequence_parallel and (cfg.seq_len // c) % n:
        raise ValueError(
            f"--sequence-parallel splits the {cfg.seq_len // c} positions per context shard over model={n}, which "
            f"does not divide them; use a --seq-len that is a multiple of {c * n}."
        )
    if cfg.from_hf is not None and ("context" in sizes or cfg.sequence_parallel):
        raise ValueError(
            "--from-hf loads the Llama with whole sequences on each device: leave out the context axis and "
            "--sequence-parallel (or fine-tune on data, fsdp and model axes)."
        )
    if "fsdp" not in sizes:
        sizes.setdefault("data", 1)
    sizes = {axis: sizes.get(axis, 1) for axis in AXES if axis in sizes or axis == "model"}
    return dataclasses.replace(cfg, mesh=eqxpar.recipe.mesh_text(sizes))


def _text_flags(cfg: Config) -> Config:
    """The text flags checked against the model: with --from-hf, the folder's tokenizer (unless
    --tokenizer names one), whose vocabulary must fit the checkpoint's, and its context."""
    if cfg.from_hf is None:
        return eqxpar.recipe.check_text_flags(cfg, context=cfg.context)
    with open(os.path.join(cfg.from_hf, "config.json")) as f:
        hf = json.load(f)
    cfg = dataclasses.replace(cfg, tokenizer=cfg.tokenizer or cfg.from_hf)
    context = int(hf.get("max_position_embeddings", cfg.context))
    cfg = eqxpar.recipe.check_text_flags(
        dataclasses.replace(cfg, seq_len=cfg.seq_len or min(cfg.context, context)), context=context
    )
    vocab = eqxpar.data.text.load_tokenizer(cfg.tokenizer).vocab_size
    if vocab > int(hf["vocab_size"]):
        raise ValueError(
            f"--tokenizer {cfg.tokenizer}: its {vocab} token ids do not fit the vocabulary of {hf['vocab_size']} of "
            f"--from-hf {cfg.from_hf}; use the checkpoint's own tokenizer (leave out --tokenizer)."
        )
    return cfg


def main(argv=None) -> dict:
    cfg = eqxpar.recipe.parse_flags(Config, argv, validate=check_flags)  # bad flags: one line, exit 2
    with eqxpar.recipe.flag_errors():  # checkpoints there need --resume, with the same shape
        ckpt = eqxpar.checkpoint.Checkpointer.from_config(
            cfg, shape_fields=("context", "dim", "heads", "kv_heads", "hidden_dim", "layers", "scan_layers", "from_hf")
        )
    sizes = eqxpar.parse_mesh(cfg.mesh)
    mesh = eqxpar.make_mesh(**sizes)
    batch_axes = tuple(axis for axis in ("data", "fsdp") if axis in sizes)
    batch_axis = batch_axes[0] if len(batch_axes) == 1 else batch_axes
    # A context axis splits every sequence: inputs and targets in the zigzag layout, the
    # attention a ring over the axis, each token rotated by its global position.
    context = "context" in sizes
    say = print if eqxpar.recipe.is_main_process() else (lambda *a, **k: None)

    # --- Data: the corpus tokenized once into a token store, cut into packed rows of
    # --seq-len + 1 tokens with each token's document and position in it; the last
    # --held-out share of documents held out. Under context parallelism each row is shifted
    # into inputs and targets and laid out in zigzag order before it is split. ---
    with eqxpar.recipe.flag_errors():  # unreadable files or tokenizer, a stale store: one line, exit 2
        text = eqxpar.recipe.load_text(cfg)

    # --- Model: created in its shards, or loaded into them from a Hugging Face folder. ---
    model_key, train_key = jax.random.split(jax.random.key(cfg.seed))
    fsdp = "fsdp" in sizes
    if cfg.from_hf is not None:
        with eqxpar.recipe.flag_errors():  # a checkpoint this mesh cannot split: one line, exit 2
            model, _ = load_hf(cfg.from_hf, mesh, strategy="fsdp" if fsdp else "tensor", scan_layers=cfg.scan_layers)

        config = model.config
        say(f"loaded {cfg.from_hf}: {config}")
    else:
        config = LlamaConfig(
            vocab_size=text.vocab_size,
            dim=cfg.dim,
            num_layers=cfg.layers,
            num_heads=cfg.heads,
            num_kv_heads=cfg.kv_heads,
            hidden_dim=cfg.hidden_dim,
            max_seq_len=cfg.context,
        )

        def placement(abstract):  # where the step keeps each array (fsdp_step's own default under FSDP)
            tensor = eqxpar.nn.partition_specs(abstract, mesh)
            return fsdp_specs(abstract, mesh, param_specs=tensor) if fsdp else tensor

        def build():
            return Llama(
                config,
                scan_layers=cfg.scan_layers,
                sequence_parallel=cfg.sequence_parallel,
                attention_impl="ring" if context else "dot_product",
                key=model_key,
            )

        model = eqxpar.init_sharded(build, mesh, placement)
    specs = eqxpar.nn.partition_specs(model, mesh)  # how the model computes: split over `model`

    # --- The step: hybrid (data x model), or FSDP x TP when the mesh has an fsdp axis. ---
    def loss_fn(model, tokens, key):
        return llama_loss(model, tokens, key=key)

    optimizer = optax.adamw(cfg.learning_rate)
    context_axis = "context" if context else None
    if fsdp:
        step = fsdp_step(loss_fn, optimizer, mesh, batch_axis=batch_axis, context_axis=context_axis)
    else:
        step = hybrid_step(
            loss_fn,
            optimizer,
            mesh,
            param_specs=specs,
            batch_axis="data",
            model_axis="model",
            context_axis=context_axis,
        )
    model, opt_state = step.init(model)

    def batch(i: int):  # a pure function of (seed, step): any mesh, and a resumed run, sees the same
        return text.batch(
            i, mesh, global_batch_size=cfg.batch_size, seed=cfg.seed, batch_axis=batch_axis, context_axis=context_axis
        )

    # The held-out rows stay whole on every batch shard (64 of them need not divide the
    # shards); under context parallelism each device takes its part of every sequence.
    evaluate = eqxpar.recipe.held_out_loss(
        lambda model, tokens: llama_loss(model, tokens), mesh, specs, batch_spec=P(None, "context") if context else P()
    )
    val_tokens, val_counts = text.val_batch(mesh, context_axis=context_axis)

    def val_metrics(model):  # val_loss (per held-out token), val_perplexity, val_bits_per_byte
        return text.val_metrics(float(evaluate(model, val_tokens)), val_counts)

    def val_loss_of(model):
        return val_metrics(model)["val_loss"]

    start_val_loss = val_loss_of(model)  # the model we start from (--from-hf: the file's)
    start_digest = eqxpar.recipe.parameter_digest(model)
    say(f"mesh {dict(mesh.shape)}; held-out loss before training {start_val_loss:.4f}")

    flops_per_token = llama_flops_per_token(model, cfg.seq_len)  # 6 N + attention, forward and backward
    (model, opt_state, train_key), first_step, history = ckpt.restore((model, opt_state, train_key))
    run_log = eqxpar.recipe.RunLog.from_config(
        cfg,
        items_per_step=cfg.batch_size * cfg.seq_len,
        flops_per_item=flops_per_token,
        n_devices=mesh.size,
        losses=history["losses"] if history else [],
    )
    for i in run_log.progress(eqxpar.recipe.steps_to_run(first_step, cfg.steps), desc=f"llama {cfg.mesh}"):
        model, opt_state, metrics = step(model, opt_state, batch(i), jax.random.fold_in(train_key, i))
        run_log.step(i, metrics)
        run_log.maybe_eval(i, val_loss=functools.partial(val_loss_of, model))
        ckpt.maybe_save(i + 1, (model, opt_state, train_key), data_state=run_log.data_state, force=i + 1 == cfg.steps)
    ckpt.close()
    run_log.close()
    losses = run_log.losses
    val = val_metrics(model)
    val_loss = val["val_loss"]
    if cfg.export_hf is not None:
        with eqxpar.recipe.flag_errors():
            save_hf(model, cfg.export_hf)  # array by array; only process 0 writes
            if eqxpar.recipe.is_main_process():  # the folder's own tokenizer, for --from-hf
                text.tokenizer.save(cfg.export_hf)
        say(f"exported the trained model to {cfg.export_hf} (config.json, model.safetensors, its tokenizer)")

    params = eqxpar.sharding_report(model)
    metrics = {
        "mesh": cfg.mesh,
        "steps": cfg.steps,
        "from_hf": cfg.from_hf,
        "export_hf": cfg.export_hf,
        "losses": losses,
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "final_loss_mean10": float(np.mean(losses[-10:])),
        "start_val_loss": start_val_loss,
        **val,  # val_loss, val_perplexity, val_bits_per_byte
        "val_losses": run_log.evals,
        "uniform_loss": math.log(text.vocab_size),
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,
        "vocab_size": text.vocab_size,
        "seq_len": cfg.seq_len,
        "document_mask": cfg.document_mask,
        **eqxpar.recipe.speed_metrics(run_log.per_second, flops_per_token, mesh.size, "float32"),
        "param_bytes_total": params.bytes_total,
        "param_bytes_per_device": params.bytes_per_device,
        "resumed_from_step": first_step,
        "start_param_digest": start_digest,
        "param_digest": eqxpar.recipe.parameter_digest(model),  # of the whole (gathered) weights
    }
    say(
        f"{cfg.mesh}: loss {metrics['first_loss']:.3f} -> {metrics['final_loss_mean10']:.3f} (last 10 steps), "
        f"held-out {start_val_loss:.3f} -> {val_loss:.3f} ({val['val_bits_per_byte']:.3f} bits/byte; uniform "
        f"guessing {metrics['uniform_loss']:.3f}); "
        f"{eqxpar.recipe.speed_text(metrics)}; parameters {params.bytes_per_device:,} of {params.bytes_total:,} "
        f"bytes per device"
    )
    eqxpar.recipe.write_metrics(cfg.metrics_out, metrics)
    return metrics


if __name__ == "__main__":
    main()
