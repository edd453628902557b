"""Parallelize your own model: a plain Equinox transformer made tensor-parallel by one call.

What it shows: a small language model written with `equinox.nn` layers only, as you would
write it (`Embedding`, `MultiheadAttention`, `MLP`, `LayerNorm`, a `Linear` head), trained
on a `(data, model)` mesh on your text (`--data`, `--tokenizer`; by default a corpus of
Python's own source code, through the same tokenizer, token store and packed rows as
hybrid_gpt.py).
`eqxpar.nn.parallelize` swaps its attention, MLPs and embedding for tensor-parallel ones
(heads, hidden units and vocabulary split over `model`) and keeps the model's own code;
`eqxpar.testing.check_parallel_parity` then checks loss, gradients and an optimizer step
against the dense model on one device, and the training losses match the dense model's.
A second part plans the output head too ("column": split logits, and the loss made
vocabulary-parallel), and prints what that changes in the communication.

Run it (8 simulated CPU devices when there is no accelerator):

    python recipes/your_model.py                         # data=2, model=4
    python recipes/your_model.py --mesh data=1,model=8   # every device splits the layers
    python recipes/your_model.py --steps 20 --metrics-out /tmp/your_model.json
    python recipes/your_model.py --data corpus/*.jsonl --tokenizer tokenizer.json
    python recipes/your_model.py --checkpoint-dir /tmp/yours --checkpoint-every 50 --resume
"""

from __future__ import annotations

import dataclasses
import functools
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqxpar
import eqxpar.nn
import eqxpar.recipe
import eqxpar.testing
from eqxpar.models import next_token_batch
from eqxpar.train import hybrid_step


@dataclasses.dataclass
class Config(
    eqxpar.recipe.CheckpointFlags, eqxpar.recipe.LogFlags, eqxpar.recipe.TextFlags
):  # + checkpoints and --log-dir (a folder per part), --data, --tokenizer, --seq-len
    devices: int = 8  # simulated CPU devices when there is no accelerator
    mesh: str = "auto"  # batch split over `data`, layers over `model`, e.g. data=2,model=4; auto: fit the devices
    steps: int = 200  # training steps (each part)
    batch_size: int = 16  # the global batch: sequences per step, over all replicas
    context: int = 32  # tokens the model sees (its position table); --seq-len: tokens per training row
    dim: int = 64  # the model's width
    heads: int = 4  # attention heads (the model axis size must divide them)
    layers: int = 2  # transformer blocks
    learning_rate: float = 3e-3  # AdamW step size
    seed: int = 0  # seeds the weights and the batches
    eval_every: int = 0  # held-out loss every N steps (printed, and in --log-dir); 0: only at the end
    metrics_out: str | None = None  # write the results as JSON here


# The flags that set the models' array shapes: --resume refuses checkpoints saved with others.
SHAPE_FIELDS = ("context", "dim", "heads", "layers")


# The vocabulary is padded to a multiple of 8 (VOCAB_MULTIPLE, in main), so it splits over
# any model axis up to 8; the MLP's hidden width is 4 * dim.
VOCAB_MULTIPLE = 8


def check_flags(cfg: Config) -> Config:
    """Every check of the flags, before anything compiles; returns `cfg` with its mesh chosen."""
    eqxpar.recipe.require_positive(cfg, "steps", "batch_size", "context", "dim", "heads", "layers")
    if cfg.dim % cfg.heads:
        raise ValueError(f"--dim {cfg.dim} is not divisible by --heads {cfg.heads}: every head needs the same width.")
    cfg = eqxpar.recipe.check_text_flags(cfg, context=cfg.context)  # --data, --tokenizer, --seq-len
    eqxpar.simulate_cpu_devices(cfg.devices)  # before JAX touches a backend
    sizes = eqxpar.recipe.mesh_from_flag(
        cfg.mesh,
        {"data": 2, "model": 4},
        divides={
            "data": {"--batch-size": cfg.batch_size},
            "model": {"--heads": cfg.heads, "the vocabulary": VOCAB_MULTIPLE},
        },
    )
    return dataclasses.replace(cfg, mesh=eqxpar.recipe.mesh_text(sizes))


# --- Your model: plain Equinox, nothing from eqxpar. Layers are called per example. ---
class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, dim: int, heads: int, *, key):
        k1, k2 = jax.random.split(key)
        self.norm1 = eqx.nn.LayerNorm(dim)
        self.attention = eqx.nn.MultiheadAttention(heads, dim, key=k1)
        self.norm2 = eqx.nn.LayerNorm(dim)
        self.mlp = eqx.nn.MLP(dim, dim, 4 * dim, depth=1, activation=jax.nn.gelu, key=k2)

    def __call__(self, x, mask):  # x: (seq, dim)
        h = jax.vmap(self.norm1)(x)
        x = x + self.attention(h, h, h, mask=mask)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class CharLM(eqx.Module):
    embedding: eqx.nn.Embedding
    positions: jax.Array
    blocks: tuple[Block, ...]
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, vocab: int, context: int, dim: int, heads: int, layers: int, *, key):
        keys = jax.random.split(key, layers + 3)
        self.embedding = eqx.nn.Embedding(vocab, dim, key=keys[0])
        self.positions = 0.02 * jax.random.normal(keys[1], (context, dim))
        self.blocks = tuple(Block(dim, heads, key=k) for k in keys[3:])
        self.norm = eqx.nn.LayerNorm(dim)
        self.head = eqx.nn.Linear(dim, vocab, key=keys[2])

    def __call__(self, tokens, segment_ids=None, positions=None):  # each (seq,) -> logits (seq, vocab)
        positions = jnp.arange(len(tokens)) if positions is None else positions
        x = jax.vmap(self.embedding)(tokens) + self.positions[positions]
        mask = jnp.tril(jnp.ones((len(tokens), len(tokens)), bool))  # causal
        if segment_ids is not None:  # packed documents: each token sees its own document only
            mask = mask & (segment_ids[:, None] == segment_ids[None, :])
        for block in self.blocks:
            x = block(x, mask)
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


# The batches are packed rows `{"tokens", "segment_ids", "positions"}`, each (batch, seq + 1)
# (with --no-document-mask, the tokens alone); `next_token_batch` shifts them into inputs and
# targets, and weighs 0 a target that starts another document (None: plain token rows).
def loss_fn(model, batch, key=None):
    """Next-token cross-entropy, the mean over this batch's targets: what you would write anyway."""
    b = next_token_batch(batch)
    logits = jax.vmap(model)(b["inputs"], b["segment_ids"], b["positions"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"])
    return losses.mean() if b["loss_weights"] is None else (losses * b["loss_weights"]).mean()


def split_head_loss_fn(model, batch, key=None):
    """The same loss when the head's output (the logits) stays split over `model`."""
    b = next_token_batch(batch)
    logits = jax.vmap(model)(b["inputs"], b["segment_ids"], b["positions"])  # this device's block of the vocabulary
    losses = eqxpar.nn.vocab_parallel_cross_entropy(logits, b["targets"], axis_name="model")
    return losses.mean() if b["loss_weights"] is None else (losses * b["loss_weights"]).mean()


# Each part trains its own model: with --checkpoint-dir DIR, each saves in a folder of its
# own, DIR/auto_plan and DIR/split_head (as --log-dir), and --resume continues both.
PARTS = ("auto plan", "split head")


def part_config(cfg: Config, title: str) -> Config:
    """The flags of one part: its checkpoints in DIR/<part>."""
    if cfg.checkpoint_dir is None:
        return cfg
    return dataclasses.replace(cfg, checkpoint_dir=os.path.join(cfg.checkpoint_dir, title.replace(" ", "_")))


def main(argv=None) -> dict:
    cfg = eqxpar.recipe.parse_flags(Config, argv, validate=check_flags)  # bad flags: one line, exit 2
    # Checks both parts' checkpoint folders now, before anything compiles: checkpoints there
    # need --resume, and --resume the saved model's shape; else one line, exit 2. (Only a
    # check: each part opens its folder when it starts training, its watchdog with it.)
    with eqxpar.recipe.flag_errors():
        for title in PARTS:
            eqxpar.checkpoint.Checkpointer.from_config(
                dataclasses.replace(part_config(cfg, title), watchdog_s=0), shape_fields=SHAPE_FIELDS
            ).close()
    mesh = eqxpar.make_mesh(**eqxpar.parse_mesh(cfg.mesh))
    say = print if eqxpar.recipe.is_main_process() else (lambda *a, **k: None)

    # --- Data: the corpus tokenized once into a token store (reused while the tokenizer and
    # files match), cut into packed rows of --seq-len + 1 tokens with each token's document
    # and position in it; the last --held-out share of documents held out: the held-out loss
    # every --eval-every steps, and at the end. ---
    with eqxpar.recipe.flag_errors():  # unreadable files or tokenizer, a stale store: one line, exit 2
        text = eqxpar.recipe.load_text(cfg)
    val_batch, val_counts = text.val_batch(mesh)
    vocab = -(-text.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE  # the rows past the tokenizer's: never a target
    model = CharLM(vocab, cfg.context, cfg.dim, cfg.heads, cfg.layers, key=jax.random.key(cfg.seed))
    optimizer = optax.adamw(cfg.learning_rate)

    def batch(i: int):  # a pure function of (seed, step): every run sees the same batches, split over `data`
        return text.batch(i, mesh, global_batch_size=cfg.batch_size, seed=cfg.seed, batch_axis="data")

    def host_batch(i: int):  # the same batch as NumPy arrays, for the dense model on one device
        return jax.device_get(batch(i))

    def train(parallel, loss, title):
        """The standard hybrid step: tensor-parallel over `model`, the batch over `data`;
        with --log-dir and --checkpoint-dir, its records and checkpoints in folders of their
        own (auto_plan/, split_head/). Returns the model, its losses, the step's
        communication, the step it resumed from and the held-out metrics (val_loss,
        val_perplexity, val_bits_per_byte)."""
        where = None if cfg.log_dir is None else os.path.join(cfg.log_dir, title.replace(" ", "_"))
        ckpt = eqxpar.checkpoint.Checkpointer.from_config(part_config(cfg, title), shape_fields=SHAPE_FIELDS)
        specs = eqxpar.nn.partition_specs(parallel, mesh)
        step = hybrid_step(loss, optimizer, mesh, param_specs=specs)
        evaluate = eqxpar.recipe.held_out_loss(lambda m, tokens: loss(m, tokens), mesh, specs)

        def val_metrics(parallel):  # the mean over target positions, as nats per counted target
            return text.val_metrics(float(evaluate(parallel, val_batch)), val_counts)

        def val_loss_of(parallel):
            return val_metrics(parallel)["val_loss"]

        parallel, opt_state = step.init(parallel)
        comm = eqxpar.communication_report(step, parallel, opt_state, batch(0))
        say(f"{title}: collectives of one train step (per device):\n{comm}\n")
        # The state as it is split, and the loss history; batches depend on (seed, step) only.
        (parallel, opt_state), first_step, history = ckpt.restore((parallel, opt_state))
        # No wait for the device but every --log-every steps (run_log fetches those losses at once).
        run_log = eqxpar.recipe.RunLog.from_config(
            cfg, log_dir=where, items_per_step=cfg.batch_size * cfg.seq_len, losses=history["losses"] if history else []
        )
        for i in run_log.progress(eqxpar.recipe.steps_to_run(first_step, cfg.steps), desc=title):
            parallel, opt_state, metrics = step(parallel, opt_state, batch(i))
            run_log.step(i, metrics)
            run_log.maybe_eval(i, val_loss=functools.partial(val_loss_of, parallel))
            ckpt.maybe_save(i + 1, (parallel, opt_state), data_state=run_log.data_state, force=i + 1 == cfg.steps)
        ckpt.close()
        run_log.close()
        return parallel, run_log.losses, comm, first_step, val_metrics(parallel)

    # --- Part 1: the automatic plan. Attention, MLPs and embedding split; the rest whole. ---
    # `parallelize` shares the model's arrays; `step.init` places copies of them on the mesh,
    # so the dense `model` stays usable for the comparisons below.
    parallel, plan = eqxpar.nn.parallelize(model, mesh=mesh, return_plan=True)
    say(f"mesh {dict(mesh.shape)}; the automatic plan:\n{plan}\n")
    # First thing to run on your own model: loss, gradients and one optimizer step against
    # the dense model on one device. Plain SGD maps gradients to updates linearly, so the
    # parameters compare as tightly as the gradients do.
    parity = eqxpar.testing.check_parallel_parity(model, parallel, loss_fn, optax.sgd(0.1), mesh, batch(0))
    say(f"parity check: {parity}\n")
    parallel, losses, comm, first_step, val = train(parallel, loss_fn, PARTS[0])

    # The dense model, trained on one device on the same batches: the same losses.
    @eqx.filter_jit
    def dense_step(model, opt_state, tokens):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    dense, dense_opt = model, optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    dense_losses = []
    with jax.default_device(jax.devices()[0]):
        for i in range(cfg.steps):
            dense, dense_opt, loss = dense_step(dense, dense_opt, host_batch(i))
            dense_losses.append(loss)  # on the device: fetched together below, not step by step
    dense_losses = [float(loss) for loss in jax.device_get(dense_losses)]
    gap = float(np.max(np.abs(np.array(losses) - dense_losses) / np.array(dense_losses)))
    say(
        f"auto plan: loss {losses[0]:.4f} -> {losses[-1]:.4f} (held-out {val['val_loss']:.4f}, "
        f"{val['val_bits_per_byte']:.3f} bits/byte); dense model on one device "
        f"{dense_losses[0]:.4f} -> {dense_losses[-1]:.4f}; largest relative gap over {cfg.steps} steps {gap:.1e}"
    )
    # And back: the trained parallel model as a plain Equinox model.
    trained = eqxpar.nn.to_dense(eqxpar.gather(parallel))
    dense_loss = float(eqx.filter_jit(loss_fn)(trained, host_batch(0)))
    say(f"to_dense: {type(trained.blocks[0].attention).__name__}, loss on batch 0 {dense_loss:.4f}\n")

    # --- Part 2: an explicit plan that also splits the output head. Its logits stay split
    # over `model`, so the loss is the vocabulary-parallel cross-entropy. ---
    explicit = {
        "embedding": "vocab",
        "blocks[*].attention": "attention",
        "blocks[*].mlp": "mlp",
        lambda m: m.head: "column",
    }
    split, split_plan = eqxpar.nn.parallelize(model, explicit, mesh=mesh, return_plan=True)
    say(f"an explicit plan, with the head split:\n{split_plan}\n")
    split_parity = eqxpar.testing.check_parallel_parity(
        model, split, split_head_loss_fn, optax.sgd(0.1), mesh, batch(0)
    )
    say(f"parity check: {split_parity}\n")
    split, split_losses, split_comm, split_first_step, split_val = train(split, split_head_loss_fn, PARTS[1])
    split_gap = float(np.max(np.abs(np.array(split_losses) - dense_losses) / np.array(dense_losses)))
    report = eqxpar.sharding_report(split)
    say(
        f"split head: loss {split_losses[0]:.4f} -> {split_losses[-1]:.4f} (largest relative gap to the dense "
        f"model {split_gap:.1e}); all-reduce bytes per step {comm.bytes('all-reduce'):,} -> "
        f"{split_comm.bytes('all-reduce'):,}; parameters per device "
        f"{eqxpar.sharding_report(parallel).bytes_per_device:,} "
        f"-> {report.bytes_per_device:,} of {report.bytes_total:,} bytes"
    )

    metrics = {
        "mesh": cfg.mesh,
        "steps": cfg.steps,
        "plan": dict(plan),
        "split_plan": dict(split_plan),
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "dense_final_loss": dense_losses[-1],
        **val,  # val_loss (nats per held-out token), val_perplexity, val_bits_per_byte
        "split_head_val_loss": split_val["val_loss"],
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,  # row positions trained on (each part)
        "vocab_size": text.vocab_size,  # the tokenizer's (the model's rows: padded to a multiple of 8)
        "seq_len": cfg.seq_len,
        "document_mask": cfg.document_mask,
        "max_relative_loss_gap": gap,
        "split_head_final_loss": split_losses[-1],
        "split_head_max_relative_loss_gap": split_gap,
        "parity_losses": list(parity.losses),
        "parity_dense_losses": list(parity.dense_losses),
        "all_reduces_per_step": comm.count("all-reduce"),
        "all_reduce_bytes_per_step": comm.bytes("all-reduce"),
        "split_head_all_reduce_bytes_per_step": split_comm.bytes("all-reduce"),
        "param_bytes_per_device": eqxpar.sharding_report(parallel).bytes_per_device,
        "split_head_param_bytes_per_device": report.bytes_per_device,
        "resumed_from_step": first_step,
        "split_head_resumed_from_step": split_first_step,
        "param_digest": eqxpar.recipe.parameter_digest(parallel),  # of the whole (gathered) weights
        "split_head_param_digest": eqxpar.recipe.parameter_digest(split),
    }
    eqxpar.recipe.write_metrics(cfg.metrics_out, metrics)
    return metrics


if __name__ == "__main__":
    main()
