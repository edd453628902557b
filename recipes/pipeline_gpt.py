"""Pipeline-parallel training of a GPT over a `stage` axis (with `data` around it).

It trains on your text (`--data`, `--tokenizer`; by default a corpus of Python's own source
code) through the same tokenizer, token store and packed rows as hybrid_gpt.py: each
micro-batch carries its rows' segment ids and positions through the stages, so attention
stays inside each document.

What it shows: the GPT's 8 stacked transformer blocks split over `stage=4` devices (2
blocks each), the batch split over `data=2` and cut into micro-batches that flow through
the stages one tick at a time, in one SPMD program (`shard_map` + `ppermute` + `scan`).
Three schedules: `gpipe` (all forwards, then all backwards), `circular` (each device holds
`--virtual-stages` chunks of blocks, micro-batches go round the ring; smaller bubble) and
`1f1b` (one forward and one backward per tick; activations of at most 2P-1 micro-batches
alive instead of M). It prints the schedule, its bubble against the formula, the
per-device temporary memory and the ppermute bytes of the compiled step.

    python recipes/pipeline_gpt.py                                  # --mesh auto: stage=4,data=2 on 8 devices, gpipe
    python recipes/pipeline_gpt.py --schedule 1f1b --microbatches 16
    python recipes/pipeline_gpt.py --schedule circular --virtual-stages 2
    python recipes/pipeline_gpt.py --mesh stage=1,data=1            # one device: the same losses
    python recipes/pipeline_gpt.py --layout auto                    # the planner picks mesh, schedule, M, remat
    python recipes/pipeline_gpt.py --data corpus/*.jsonl --tokenizer tokenizer.json
    python recipes/pipeline_gpt.py --checkpoint-dir /tmp/pipe --checkpoint-every 10 --resume

Every mesh and schedule trains the same model on the same batches: the same final loss.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import numpy as np
import optax

import eqxpar
import eqxpar.nn
import eqxpar.recipe
from eqxpar.inspect import CommReport, MemoryReport
from eqxpar.models import GPT, gpt_stages, next_token_loss
from eqxpar.train import (
    SCHEDULES,
    bubble_theory,
    pipeline_step,
    stage_boundary_bytes,
)


@dataclasses.dataclass
class Config(
    eqxpar.recipe.CheckpointFlags, eqxpar.recipe.LogFlags, eqxpar.recipe.LayoutFlags, eqxpar.recipe.TextFlags
):  # + checkpoint flags, --log-dir, --log-every, --layout, --memory-per-device, --data, --tokenizer, --seq-len
    devices: int = 8  # simulated CPU devices when there is no accelerator
    mesh: str = "auto"  # stage splits the blocks, data the batch (e.g. stage=4,data=2; model=: TP); auto: fit
    schedule: Literal["gpipe", "circular", "1f1b"] = "gpipe"  # the pipeline schedule (eqxpar.train.SCHEDULES)
    microbatches: int = 16  # micro-batches per data shard (M; 4P by default)
    virtual_stages: int = 2  # layer chunks per device under --schedule circular (r)
    steps: int = 30  # training steps
    batch_size: int = 64  # the global batch, in sequences
    context: int = 32  # tokens the model sees (its position table); --seq-len: tokens per training row
    dim: int = 64  # the model's width
    heads: int = 4  # attention heads
    layers: int = 8  # transformer blocks (divisible by the stages, times --virtual-stages for circular)
    learning_rate: float = 3e-3  # AdamW step size
    seed: int = 0  # seeds the weights and the batches
    remat: bool = False  # gpipe/circular: keep only each tick's inputs, recompute the rest backward
    metrics_out: str | None = None  # write the results as JSON here
    eval_every: int = 0  # held-out loss every N steps (printed, and in --log-dir); 0: only at the end


def check_flags(cfg: Config) -> Config:
    """Every check of the flags, before anything compiles."""
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {cfg.schedule!r}.")
    eqxpar.recipe.require_positive(
        cfg, "steps", "batch_size", "context", "dim", "heads", "layers", "microbatches", "virtual_stages"
    )
    if cfg.dim % cfg.heads:
        raise ValueError(f"--dim {cfg.dim} is not divisible by --heads {cfg.heads}.")
    cfg = eqxpar.recipe.check_text_flags(cfg, context=cfg.context)  # --data, --tokenizer, --seq-len
    eqxpar.simulate_cpu_devices(cfg.devices)
    eqxpar.recipe.check_layout_flags(cfg)  # --layout auto with --mesh: one line, before any data is read
    if cfg.layout == "auto":  # the planner chooses mesh, schedule and micro-batches (in main), then check_mesh
        return cfg
    return check_mesh(cfg)


def check_mesh(cfg: Config) -> Config:
    """The checks of --mesh against the schedule, layers and batch (after --layout auto too)."""
    divides = {"stage": {"--layers": cfg.layers}}
    if cfg.batch_size % cfg.microbatches == 0:
        divides["data"] = {"--batch-size / --microbatches": cfg.batch_size // cfg.microbatches}
    sizes = eqxpar.recipe.mesh_from_flag(
        cfg.mesh, {"stage": 4, "data": 2, "model": 1}, divides=divides, optional=("model",)
    )
    sizes = {**sizes, "model": sizes.get("model", 1)}  # the GPT's layers name a model axis
    r = cfg.virtual_stages if cfg.schedule == "circular" else 1
    stages, data = sizes["stage"], sizes["data"]
    if cfg.layers % (stages * r):
        raise ValueError(
            f"--layers {cfg.layers} does not split into {stages} stages x {r} chunks; use a multiple of {stages * r}."
        )
    if cfg.batch_size % (data * cfg.microbatches):
        raise ValueError(
            f"--batch-size {cfg.batch_size} is not divisible by data={data} x --microbatches {cfg.microbatches}."
        )
    if cfg.schedule == "circular" and r > 1 and cfg.microbatches % stages:
        raise ValueError(
            f"--schedule circular sends micro-batches round in groups of {stages}: "
            f"--microbatches must be a multiple of {stages}."
        )
    return dataclasses.replace(cfg, mesh=eqxpar.recipe.mesh_text(sizes), virtual_stages=r)


def main(argv=None) -> dict:
    cfg = eqxpar.recipe.parse_flags(Config, argv, validate=check_flags)
    # --- Data: the corpus tokenized once into a token store (reused while the tokenizer
    # and files match), cut into packed rows of --seq-len + 1 tokens with each token's
    # document and position in it; the last --held-out share of documents held out. Each
    # step's batch is a pure function of (seed, step): any mesh and schedule see the same. ---
    with eqxpar.recipe.flag_errors():  # unreadable files or tokenizer, a stale store: one line, exit 2
        text = eqxpar.recipe.load_text(cfg)
    # --- Layout (--layout auto): the planner prices every stage x data x model pipeline of
    # these devices (schedule, micro-batches, virtual stages, remat) from the shapes alone,
    # prints the fastest that fit --memory-per-device with why, and the first one's mesh,
    # schedule, --microbatches, --virtual-stages and --remat replace the flags'. ---
    with eqxpar.recipe.flag_errors():  # nothing fits, or no pipeline divides: one line, exit 2
        cfg, plan = eqxpar.recipe.auto_layout(
            cfg, vocab_size=text.vocab_size, axes=("stage", "data", "model"), pipeline=True
        )
        cfg = check_mesh(cfg) if plan is not None else cfg
    # Checks --checkpoint-dir now, before anything compiles: checkpoints there need --resume,
    # and --resume needs the saved model's --context, --dim and --layers; else one line, exit 2.
    with eqxpar.recipe.flag_errors():
        ckpt = eqxpar.checkpoint.Checkpointer.from_config(cfg, shape_fields=("context", "dim", "layers"))
    sizes = eqxpar.parse_mesh(cfg.mesh)
    mesh = eqxpar.make_mesh(**sizes)
    P, M, r = sizes["stage"], cfg.microbatches, cfg.virtual_stages
    model_key = jax.random.key(cfg.seed)
    # The blocks stacked (scan_layers): one array per weight with a leading layer axis,
    # which the pipeline splits over `stage`.
    model = GPT(text.vocab_size, cfg.context, cfg.dim, cfg.heads, cfg.layers, scan_layers=True, key=model_key)
    # Embedding first, blocks in the middle, final norm + head + loss last.
    step = pipeline_step(
        gpt_stages(),
        optax.adamw(cfg.learning_rate),
        mesh,
        batch_axis="data",
        stage_axis="stage",
        schedule=cfg.schedule,
        microbatches=M,
        virtual_stages=r,
        remat=cfg.remat and cfg.schedule != "1f1b",
    )
    model, opt_state = step.init(model)

    # The global batch split over `data` (whole along `stage` and `model`), as the step takes
    # it: the packed rows `{"tokens", "segment_ids", "positions"}` (the first stage embeds
    # the tokens at their positions, every stage masks attention by segment, the last
    # weighs the targets); with --no-document-mask the tokens alone.
    def batch(i):
        return text.batch(i, mesh, global_batch_size=cfg.batch_size, seed=cfg.seed, batch_axis="data")

    # --- Theory and measurement, from the compiled program. ---
    lowered = step.lower(model, opt_state, batch(0))
    compiled = lowered.compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    comm = CommReport.of(lowered, compiled)
    memory = MemoryReport.of(compiled, model, opt_state, batch(0))
    with eqxpar.recipe.flag_errors():  # --layout auto: the compiled step must fit the memory, or stop here
        eqxpar.recipe.check_compiled_peak(cfg, plan, memory)
    table = step.schedule
    bubble = table.bubble_fraction()
    rows = cfg.batch_size // (sizes["data"] * M)
    activation = rows * cfg.seq_len * cfg.dim * 4  # one micro-batch's stage output, float32
    ticks = sum(n for kind, _, n in table.phases if kind in ("forward", "both"))
    b_ticks = sum(n for kind, _, n in table.phases if kind in ("backward", "both"))
    # Forward: one activation per forward tick; backward: one gradient per backward tick
    # (GPipe: the transposed forward ppermutes). Per device; none with one stage. Packed
    # rows: each micro-batch's segment ids (int32) travel forward with its activation, for
    # the next stage's document mask (integers: no gradient comes back).
    segments = rows * cfg.seq_len * 4 if cfg.document_mask else 0
    permute_theory = stage_boundary_bytes(table, activation) + (ticks * segments if P > 1 else 0)
    segment_text = f" + {ticks} x {segments:,} of segment ids" if segments and P > 1 else ""
    # The pipeline's own ppermutes over `stage` (lowered: what the code asked for; loops
    # counted once per tick), and what the compiled step moves (circular: + XLA's moves of the
    # interleaved weights and gradients).
    # (A permute from each device to itself, as on a one-stage mesh, moves nothing.)
    permute_measured, permute_compiled = (
        sum(c.bytes for c in comm.collectives("collective-permute", stage=stage) if c.axes(mesh))
        for stage in ("lowered", "compiled")
    )
    if eqxpar.recipe.is_main_process():
        print(f"mesh {cfg.mesh}, schedule {cfg.schedule}, M={M} micro-batches" + (f", r={r}" if r > 1 else ""))
        print(
            table.text() if table.ticks <= 48 else f"({table.ticks} ticks; use fewer --microbatches to see the table)"
        )
        formula = f"(P-1)/({'r*' if r > 1 else ''}M+P-1)"
        print(f"bubble {bubble:.4f} (formula {formula} = {bubble_theory(cfg.schedule, P, M, r):.4f})")
        print(
            f"stage inputs alive per device: {table.max_in_flight()} micro-batch chunks "
            f"(activation {activation:,} bytes each)"
        )
        print(f"temp memory per device (compiled): {temp:,} bytes")
        print(
            f"ppermute bytes per device per step: theory {permute_theory:,} ({ticks}+{b_ticks} ticks x "
            f"{activation:,}{segment_text}), measured {permute_measured:,}; "
            f"the compiled step's collective-permutes: {permute_compiled:,}"
        )

    # --- Checkpoints (--checkpoint-dir, --checkpoint-every, --resume): the model and optimizer
    # state as the loop carries them (stacked layers split over `stage`), and the loss history.
    # Batches depend on (seed, step) only: a resumed run continues as the interrupted one. ---
    (model, opt_state), first_step, history = ckpt.restore((model, opt_state))

    # The held-out loss, every --eval-every steps and at the end: the stacked layers gathered
    # from their stages, the GPT run whole (tensor-parallel over any `model` axis).
    evaluate = eqxpar.recipe.held_out_loss(
        lambda model, tokens: next_token_loss(model, tokens), mesh, eqxpar.nn.partition_specs(model, mesh)
    )
    val_batch, val_counts = text.val_batch(mesh)

    def val_metrics(model):  # val_loss, val_perplexity, val_bits_per_byte
        return text.val_metrics(float(evaluate(model, val_batch)), val_counts)

    def val_loss_of(model):
        return val_metrics(model)["val_loss"]

    steps = eqxpar.recipe.steps_to_run(first_step, cfg.steps)  # none left: says so
    # --log-dir: metrics every --log-every steps, TensorBoard events, config.json. The loop
    # waits for the device only every --log-every steps (run_log fetches those steps' losses
    # in one go), at evaluations, checkpoints and the end.
    run_log = eqxpar.recipe.RunLog.from_config(
        cfg,
        items_per_step=cfg.batch_size * cfg.seq_len,
        flops_per_item=eqxpar.models.gpt_flops_per_token(model),
        n_devices=mesh.size,
        losses=history["losses"] if history else [],
    )
    for i in run_log.progress(steps, desc=f"pipeline {cfg.schedule}"):
        model, opt_state, metrics = step(model, opt_state, batch(i))
        run_log.step(i, metrics)
        run_log.maybe_eval(i, val_loss=functools.partial(val_loss_of, model))
        ckpt.maybe_save(i + 1, (model, opt_state), data_state=run_log.data_state, force=i + 1 == cfg.steps)
    ckpt.close()
    run_log.close()
    losses = run_log.losses
    val = val_metrics(model)
    val_loss = val["val_loss"]
    metrics = {
        "mesh": cfg.mesh,
        "schedule": cfg.schedule,
        "microbatches": M,
        "virtual_stages": r,
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "final_loss_mean10": float(np.mean(losses[-10:])),
        **val,  # val_loss (nats per held-out token), val_perplexity, val_bits_per_byte
        "val_losses": run_log.evals,  # every --eval-every steps: {"step", "val_loss"}
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,  # row positions trained on, resumed steps included
        "vocab_size": text.vocab_size,
        "seq_len": cfg.seq_len,
        "document_mask": cfg.document_mask,
        "bubble_fraction": bubble,
        "bubble_theory": bubble_theory(cfg.schedule, P, M, r),
        "temp_bytes_per_device": int(temp),
        "max_in_flight": table.max_in_flight(),
        "ppermute_bytes_theory": permute_theory,
        "ppermute_bytes_measured": permute_measured,  # the pipeline's ppermutes, every tick
        "collective_permute_bytes_compiled": permute_compiled,  # circular: + XLA's weight moves
        "resumed_from_step": first_step,
        "param_digest": eqxpar.recipe.parameter_digest(model),  # of the whole (gathered) weights
        # The layout run ("stage=4,data=2 remat=none gpipe M=16"), and the plan's predicted
        # bytes per device (with --layout auto; else null) beside the compiled step's.
        **eqxpar.recipe.layout_metrics(cfg, plan, comm, memory),
    }
    if eqxpar.recipe.is_main_process():
        print(
            f"{cfg.mesh} {cfg.schedule}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, held-out {val_loss:.4f} "
            f"({val['val_bits_per_byte']:.3f} bits/byte)"
        )
    eqxpar.recipe.write_metrics(cfg.metrics_out, metrics)
    return metrics


if __name__ == "__main__":
    main()
