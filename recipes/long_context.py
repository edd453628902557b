"""Long sequences with context parallelism: the GPT on thousands of characters per example.

What it shows: every example's sequence split over a `context` mesh axis (beside `data`,
which splits the batch, and `model`, which splits the layers). Each device holds `S / C`
positions of every sequence, laid out zig-zag (device `i` holds chunks `i` and `2C-1-i` of
`2C`, so the causal mask gives every device the same work); attention fetches the other
devices' keys and values by a ring of `ppermute`s (`--attention ring`) or one all-gather
(`--attention all_gather`). Everything else in the model works on its own positions only,
so the activations of a step shrink with `C`. With `--sequence-parallel` (Megatron sequence
parallelism) the positions are split once more over `model` between the tensor-parallel
layers: layer norms, dropout and the residual stream work on `S / (C N)` positions, and each
attention and MLP all-gathers its input and reduce-scatters its output over `model` in place
of the all-reduce. The train step is the ordinary `eqxpar.train.hybrid_step` with
`context_axis="context"`.

Run it:

    python recipes/long_context.py                                  # data=2,context=2,model=2
    python recipes/long_context.py --mesh data=1,context=8,model=1  # 1/8 of each sequence per device
    python recipes/long_context.py --mesh data=1,context=1,model=1  # one device, the same losses
    python recipes/long_context.py --attention all_gather --metrics-out /tmp/lc.json
    python recipes/long_context.py --sequence-parallel                 # + Megatron SP over model
    python recipes/long_context.py --layout auto   # the planner's fastest mesh, attention, SP, remat
    python recipes/long_context.py --checkpoint-dir /tmp/lc --checkpoint-every 5 --resume

The same seed gives the same losses on every mesh (up to float rounding).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import optax
from jax.sharding import PartitionSpec as P

import eqxpar
import eqxpar.recipe
from eqxpar.inspect import CommReport, MemoryReport, context_parallel_theory, data_parallel_theory
from eqxpar.models import GPT, gpt_activation_theory, gpt_tensor_parallel_theory, next_token_loss

MODES = ("ring", "all_gather")


@dataclasses.dataclass
class Config(
    eqxpar.recipe.CheckpointFlags, eqxpar.recipe.LogFlags, eqxpar.recipe.LayoutFlags, eqxpar.recipe.TextFlags
):  # + checkpoint flags, --log-dir, --log-every, --layout, --memory-per-device, --data and the text flags
    devices: int = 8  # simulated CPU devices when there is no accelerator
    mesh: str = "auto"  # data, context and model axes, e.g. data=2,context=2,model=2; auto: fit the devices
    attention: Literal["ring", "all_gather"] = "ring"  # ring: K/V blocks passed on; all_gather: K/V gathered per layer
    sequence_parallel: bool = False  # also split the positions over `model` between the tensor-parallel layers
    remat: Literal["none", "block", "save_matmuls"] = "none"  # what the backward pass recomputes
    scan_layers: bool = False  # run the blocks as one jax.lax.scan over stacked weights
    steps: int = 10  # training steps
    batch_size: int = 2  # sequences per step
    seq_len: int = 1024  # tokens per sequence (packed rows; the model's context)
    dim: int = 32  # the model's width
    heads: int = 4  # attention heads (the model axis size must divide them)
    layers: int = 2  # transformer blocks
    learning_rate: float = 3e-3  # AdamW step size
    seed: int = 0  # seeds the weights and the batches
    metrics_out: str | None = None  # write the results as JSON here
    eval_every: int = 0  # held-out loss every N steps (printed, and in --log-dir); 0: only at the end


def check_flags(cfg: Config) -> Config:
    """Every check of the flags, before anything compiles; returns `cfg` with its mesh chosen."""
    eqxpar.recipe.require_positive(cfg, "steps", "batch_size", "seq_len", "dim", "heads", "layers")
    cfg = eqxpar.recipe.check_text_flags(cfg, context=cfg.seq_len)  # --data, --tokenizer
    if cfg.remat not in ("none", "block", "save_matmuls"):
        raise ValueError(f"--remat must be one of none, block, save_matmuls, got {cfg.remat!r}.")
    if cfg.attention not in MODES:
        raise ValueError(f"--attention must be one of {', '.join(MODES)}, got {cfg.attention!r}.")
    if cfg.dim % cfg.heads:
        raise ValueError(f"--dim {cfg.dim} is not divisible by --heads {cfg.heads}: every head needs the same width.")
    if not cfg.learning_rate > 0:
        raise ValueError(f"--learning-rate must be positive, got {cfg.learning_rate}.")
    eqxpar.simulate_cpu_devices(cfg.devices)  # before JAX touches a backend
    eqxpar.recipe.check_layout_flags(cfg)  # --layout auto with --mesh: one line, before any data is read
    if cfg.layout == "auto":  # the planner chooses the mesh (in main), and checks what divides what
        return cfg
    # The zigzag layout cuts each sequence into 2 x context chunks.
    sizes = eqxpar.recipe.mesh_from_flag(
        cfg.mesh,
        {"data": 2, "context": 2, "model": 2},
        divides={
            "data": {"--batch-size": cfg.batch_size},
            "context": {"--seq-len / 2": cfg.seq_len // 2},
            "model": {"--heads": cfg.heads},
        },
    )
    if cfg.seq_len % (2 * sizes["context"]):
        raise ValueError(
            f"--seq-len {cfg.seq_len} is not divisible by 2 x context={sizes['context']} (the zigzag chunks)."
        )
    if cfg.sequence_parallel and (cfg.seq_len // sizes["context"]) % sizes["model"]:
        raise ValueError(
            f"--sequence-parallel splits the {cfg.seq_len // sizes['context']} positions per context shard over "
            f"model={sizes['model']}, which does not divide them; choose --seq-len a multiple of "
            f"context x model = {sizes['context'] * sizes['model']}."
        )
    return dataclasses.replace(cfg, mesh=eqxpar.recipe.mesh_text(sizes))


def main(argv=None) -> dict:
    cfg = eqxpar.recipe.parse_flags(Config, argv, validate=check_flags)  # bad flags: one line, exit 2
    # --- Data: the corpus tokenized once into a token store, cut into packed rows of
    # --seq-len + 1 tokens with each token's document and position in it; each step's batch
    # depends on (seed, step) only. The last --held-out share of documents is held out. ---
    with eqxpar.recipe.flag_errors():  # unreadable files or tokenizer, a stale store: one line, exit 2
        text = eqxpar.recipe.load_text(cfg)

    # --- Layout (--layout auto): the planner prices every data x context x model layout of
    # these devices, with each remat policy, ring and all-gather attention, and with and
    # without sequence parallelism, from the shapes alone (eqxpar.plan: exact collective
    # and memory theories, a roofline for time); it prints the fastest that fit
    # --memory-per-device with why, and the recipe runs the first: its mesh, attention,
    # sequence parallelism and remat replace the flags', and its GPT has scanned blocks, as
    # the planner builds and prices it (unrolled, XLA merges some of remat's recomputed
    # collectives with the forward pass's, and the step would move fewer bytes than the
    # plan says). A plan with context=1 runs whole sequences: attention "dot_product". ---
    with eqxpar.recipe.flag_errors():  # nothing fits, or no layout divides the batch: one line, exit 2
        cfg, plan = eqxpar.recipe.auto_layout(
            cfg,
            vocab_size=text.vocab_size,
            axes=("data", "context", "model"),
            seq_field="seq_len",
            sequence_parallel=True,
        )
    if plan is not None:
        cfg = dataclasses.replace(cfg, scan_layers=True)

    # Checks --checkpoint-dir now, before anything compiles (and after the plan, so that
    # checkpoints record the layout that ran): checkpoints there need --resume, and
    # --resume needs the saved model's --seq-len, --dim, --layers and --scan-layers; else
    # one line, exit 2.
    with eqxpar.recipe.flag_errors():
        ckpt = eqxpar.checkpoint.Checkpointer.from_config(cfg, shape_fields=("seq_len", "dim", "layers", "scan_layers"))
    mesh = eqxpar.make_mesh(**eqxpar.parse_mesh(cfg.mesh))
    c = mesh.shape["context"]
    # Else a plan's "dot_product" on context=1: whole sequences, no context axis in the step.
    context_axis = "context" if cfg.attention in MODES else None

    # Each row shifted into inputs and targets (with their documents, positions and target
    # weights), put in the zigzag order the devices hold it, then split over data x context.
    def batch(i: int):
        return text.batch(
            i, mesh, global_batch_size=cfg.batch_size, seed=cfg.seed, batch_axis="data", context_axis="context"
        )

    # --- Model: the GPT, its attention over the context axis (positions follow the layout). ---
    model_key = jax.random.split(jax.random.key(cfg.seed))[0]
    model = GPT(
        text.vocab_size,
        cfg.seq_len,
        cfg.dim,
        cfg.heads,
        cfg.layers,
        axis_name="model",
        attention_impl=cfg.attention,
        sequence_parallel=cfg.sequence_parallel,
        remat=cfg.remat,
        scan_layers=cfg.scan_layers,
        key=model_key,
    )

    def loss_fn(model, batch, key=None):
        # This device's positions of its examples: the mean over them is its share.
        return next_token_loss(model, batch)

    step = eqxpar.train.hybrid_step(
        loss_fn, optax.adamw(cfg.learning_rate), mesh, batch_axis="data", context_axis=context_axis
    )
    model, opt_state = step.init(model)

    # --- What one step moves and keeps, read from the compiled program, against theory. ---
    lowered = step.lower(model, opt_state, batch(0))
    compiled = lowered.compile()
    temp_bytes = compiled.memory_analysis().temp_size_in_bytes
    memory = MemoryReport.of(compiled, model, opt_state, batch(0))
    with eqxpar.recipe.flag_errors():  # --layout auto: the compiled step must fit the memory, or stop here
        eqxpar.recipe.check_compiled_peak(cfg, plan, memory)
    # Activation memory: what autodiff keeps for the backward pass (traced), and its theory.
    saved_bytes = step.saved_activation_bytes(model, opt_state, batch(0))
    activations = gpt_activation_theory(
        model, mesh, cfg.batch_size, cfg.seq_len, batch_axis="data", context_axis=context_axis
    )
    comm = CommReport.of(lowered, compiled, mesh=mesh)
    # The theory, axis by axis: the gradient all-reduce over data and context, the
    # tensor-parallel (or sequence-parallel) layers over model, the K/V traffic over context.
    # Remat runs forward collectives again in the backward pass: under "block" all of a
    # block's; under "save_matmuls" those whose results are not the linear layers' matmul
    # outputs (the model axis's sums and gathers, and attention's K/V traffic).
    theory = data_parallel_theory(
        model, mesh, eqxpar.nn.partition_specs(model, mesh), batch_axis=("data", "context")
    ) + gpt_tensor_parallel_theory(
        model,
        mesh,
        cfg.batch_size,
        cfg.seq_len,
        batch_axis="data",
        context_axis=context_axis,
        remat=cfg.remat != "none",
    )
    if context_axis:
        theory += context_parallel_theory(
            mesh,
            batch=cfg.batch_size,
            seq_len=cfg.seq_len,
            num_heads=cfg.heads,
            head_dim=cfg.dim // cfg.heads,
            num_layers=cfg.layers,
            mode=cfg.attention,
            model_axis="model",
            remat=cfg.remat != "none",
            segment_ids=cfg.document_mask,  # packed documents' ids travel with K/V
        )
    comparison = comm.versus(theory)
    if eqxpar.recipe.is_main_process():
        print(f"mesh {dict(mesh.shape)}, {cfg.seq_len} tokens per sequence, {cfg.seq_len // c} per device")
        print(activations)
        print(activations.versus(saved=saved_bytes, temporaries=temp_bytes))
        print(comparison if comparison.rows else "one device: no collectives")

    # --- Checkpoints (--checkpoint-dir, --checkpoint-every, --resume): the state as it is
    # split, and the loss history. Batches depend on (seed, step) only, so a resumed run
    # continues exactly as the interrupted one would have. ---
    (model, opt_state), first_step, history = ckpt.restore((model, opt_state))

    # The held-out loss, every --eval-every steps and at the end: held-out windows laid out
    # as the training batches are, the devices' losses averaged over `data` and `context`.
    evaluate = eqxpar.recipe.held_out_loss(
        loss_fn, mesh, eqxpar.nn.partition_specs(model, mesh), batch_spec=P(None, "context")
    )
    val_batch, val_counts = text.val_batch(mesh, context_axis="context")

    def val_metrics(model):  # val_loss (per held-out token), val_perplexity, val_bits_per_byte
        return text.val_metrics(float(evaluate(model, val_batch)), val_counts)

    def val_loss_of(model):
        return val_metrics(model)["val_loss"]

    # --- Training loop. --log-dir: metrics every --log-every steps, TensorBoard, config.json. ---
    # The loop waits for the device only every --log-every steps (run_log fetches those steps'
    # losses in one go), at evaluations, checkpoints and the end.
    run_log = eqxpar.recipe.RunLog.from_config(
        cfg,
        items_per_step=cfg.batch_size * cfg.seq_len,
        flops_per_item=eqxpar.models.gpt_flops_per_token(model),
        n_devices=mesh.size,
        losses=history["losses"] if history else [],
    )
    steps = eqxpar.recipe.steps_to_run(first_step, cfg.steps)  # none left: says so
    for i in run_log.progress(steps, desc=f"long context {cfg.mesh} {cfg.attention}"):
        model, opt_state, metrics = step(model, opt_state, batch(i))
        run_log.step(i, metrics)
        run_log.maybe_eval(i, val_loss=functools.partial(val_loss_of, model))
        ckpt.maybe_save(i + 1, (model, opt_state), data_state=run_log.data_state, force=i + 1 == cfg.steps)
    ckpt.close()
    run_log.close()
    losses = run_log.losses  # every step's loss
    val = val_metrics(model)
    val_loss = val["val_loss"]

    metrics = {
        "mesh": cfg.mesh,
        "attention": cfg.attention,
        "sequence_parallel": cfg.sequence_parallel,
        "seq_len": cfg.seq_len,
        "steps": cfg.steps,
        "first_loss": losses[0],
        "final_loss": losses[-1],
        **val,  # val_loss, val_perplexity, val_bits_per_byte
        "val_losses": run_log.evals,
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,
        "vocab_size": text.vocab_size,
        "document_mask": cfg.document_mask,  # every --eval-every steps: {"step", "val_loss"}
        "remat": cfg.remat,
        "scan_layers": cfg.scan_layers,
        "temp_bytes_per_device": int(temp_bytes),
        "activation_bytes_saved": int(saved_bytes),  # kept by autodiff for the backward pass, per device
        "activation_bytes_theory": activations.total,
        "activation_bytes_per_block_theory": activations.per_block,
        "comm_bytes_measured": {f"{r.kind} {'/'.join(r.axes)}": int(r.compiled) for r in comparison.rows},
        "comm_bytes_theory": {f"{r.kind} {'/'.join(r.axes)}": int(r.theory) for r in comparison.rows},
        "comm_ratio": comparison.ratio() if comparison.rows else None,  # measured / theory, all bytes
        "resumed_from_step": first_step,
        "param_digest": eqxpar.recipe.parameter_digest(model),
        # The layout run ("data=2,context=2,model=2 remat=none ring"), and the plan's
        # predicted bytes per device (with --layout auto; else null) beside the compiled step's.
        **eqxpar.recipe.layout_metrics(cfg, plan, comm, memory),
    }
    if eqxpar.recipe.is_main_process():
        print(f"{cfg.mesh} ({cfg.attention}): loss {losses[0]:.4f} -> {losses[-1]:.4f}, held-out {val_loss:.4f}")
    eqxpar.recipe.write_metrics(cfg.metrics_out, metrics)
    return metrics


if __name__ == "__main__":
    main()
