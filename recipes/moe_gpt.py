"""Expert parallelism: a mixture-of-experts GPT trained on a `(data, expert)` mesh.

What it shows: the GPT of `hybrid_gpt.py`, trained on your text (`--data`, `--tokenizer`;
by default a corpus of Python's own source code, through the same tokenizer, token store
and packed rows), with a mixture of SwiGLU experts (`eqxpar.nn.MixtureOfExperts`, top-k
routing) in place of the MLP of every `--moe-every`-th block. The experts are split over
the `expert` axis (each device holds `experts / N` of them); the batch is split over `data`
and `expert` together, so each device routes its own sequences. In every MoE block one
`all_to_all` sends each token to the device holding its expert and a second brings the
outputs back (and their transposes in the backward pass); everything else is data parallel.
The step is `eqxpar.train.hybrid_step(..., expert_axis="expert")`: the experts' gradients
are summed over `data` only, the rest over `data` and `expert`. An optional `model` axis
splits the attention heads and each expert's hidden units (tensor parallelism).

It prints the tokens each expert received, the dropped tokens (over capacity) and the
auxiliary (load-balancing) loss on a held-out batch, and the compiled step's all-to-all
bytes against `eqxpar.inspect.expert_parallel_theory`.

Run it (8 simulated CPU devices when there is no accelerator):

    python recipes/moe_gpt.py                                  # data=2, expert=4
    python recipes/moe_gpt.py --mesh data=1,expert=2,model=4
    python recipes/moe_gpt.py --devices 1                      # one device: the same losses
    python recipes/moe_gpt.py --dropless --steps 50 --metrics-out /tmp/moe.json
    python recipes/moe_gpt.py --data corpus/*.jsonl --tokenizer tokenizer.json

Every mesh trains the same model on the same batches: a sequence is routed as a whole on
one device, so routing, drops and losses are those of one device up to float rounding;
routing is discontinuous, so after tens of steps a near-tie between two experts may flip
and the runs drift apart slowly (docs/recipes/moe_gpt.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import eqxpar
import eqxpar.nn
import eqxpar.recipe
from eqxpar.inspect import CommReport, expert_parallel_theory
from eqxpar.models import GPT, MoEOptions, moe_aux_loss, next_token_batch, next_token_loss
from eqxpar.train import hybrid_step


@dataclasses.dataclass
class Config(
    eqxpar.recipe.LogFlags, eqxpar.recipe.TextFlags
):  # + --log-dir, --log-every, --data, --tokenizer, --seq-len
    devices: int = 8  # simulated CPU devices when there is no accelerator
    mesh: str = "auto"  # batch over data and expert, experts over expert, e.g. data=2,expert=4 (optionally model=...)
    steps: int = 200  # training steps
    batch_size: int = 16  # the global batch: sequences per step
    context: int = 64  # tokens the model sees (one routing group per row); --seq-len: tokens per training row
    dim: int = 64  # the model's width
    heads: int = 4  # attention heads (the model axis size must divide them)
    layers: int = 2  # transformer blocks
    experts: int = 8  # experts per MoE block (the expert axis size must divide them)
    top_k: int = 2  # experts each token chooses
    moe_every: int = 1  # every N-th block is an MoE block (1: all)
    capacity_factor: float = 1.25  # each expert's slots per sequence, as a multiple of an even share
    dropless: bool = False  # no capacity: every token reaches its experts (overrides --capacity-factor)
    aux_loss_weight: float = 1e-2  # weight of each MoE block's load-balancing loss
    z_loss_weight: float = 1e-3  # weight of each MoE block's router z-loss
    learning_rate: float = 3e-3  # AdamW step size
    seed: int = 0  # seeds the weights and the batches
    metrics_out: str | None = None  # write the results as JSON here
    eval_every: int = 0  # held-out loss every N steps (printed, and in --log-dir); 0: only at the end


def check_flags(cfg: Config) -> Config:
    """Every check of the flags, before anything compiles; returns `cfg` with its mesh chosen."""
    eqxpar.simulate_cpu_devices(cfg.devices)  # before JAX touches a backend
    eqxpar.recipe.require_positive(cfg, "steps", "batch_size", "context", "dim", "heads", "layers", "experts")
    eqxpar.recipe.require_positive(cfg, "top_k", "moe_every")
    if not cfg.learning_rate > 0:
        raise ValueError(f"--learning-rate must be positive, got {cfg.learning_rate}.")
    if cfg.dim % cfg.heads:
        raise ValueError(f"--dim {cfg.dim} is not divisible by --heads {cfg.heads}: every head needs the same width.")
    cfg = eqxpar.recipe.check_text_flags(cfg, context=cfg.context)  # --data, --tokenizer, --seq-len
    if cfg.top_k > cfg.experts:
        raise ValueError(f"--top-k {cfg.top_k} is more than --experts {cfg.experts}; choose --top-k <= {cfg.experts}.")
    if cfg.moe_every > cfg.layers:
        raise ValueError(
            f"--moe-every {cfg.moe_every} is more than --layers {cfg.layers}: no block would have experts."
        )
    if not cfg.dropless and not cfg.capacity_factor > 0:
        raise ValueError(
            f"--capacity-factor must be positive (1.25 is usual), got {cfg.capacity_factor}; or --dropless."
        )
    sizes = eqxpar.recipe.mesh_from_flag(
        cfg.mesh,
        {"data": 2, "expert": 4, "model": 1},
        divides={
            "data": {"--batch-size": cfg.batch_size},
            "expert": {"--experts": cfg.experts, "--batch-size": cfg.batch_size},
            "model": {"--heads": cfg.heads},
        },
        optional=("model",),
    )
    sizes = {**sizes, "model": sizes.get("model", 1)}
    if cfg.batch_size % (sizes["data"] * sizes["expert"]):
        raise ValueError(
            f"--batch-size {cfg.batch_size} does not split over data x expert = {sizes['data'] * sizes['expert']} "
            f"devices (each routes its own sequences); use a multiple of {sizes['data'] * sizes['expert']}."
        )
    return dataclasses.replace(cfg, mesh=eqxpar.recipe.mesh_text(sizes))


def held_out_rows(text: eqxpar.recipe.TextData, mesh, shards: int):
    """The held-out rows and their counts (`text.val_batch`), cut to a multiple of `shards`:
    the MoE blocks route each device's own rows, so every device of data x expert gets as
    many (64 rows split over 8 devices as they are; a few are left out over 6)."""
    rows, counts = text.val_batch(mesh)
    n = jax.tree.leaves(rows)[0].shape[0]
    keep = n - n % shards
    if keep == n:
        return rows, counts
    if keep == 0:
        raise ValueError(
            f"the held-out text gives {n} rows of --seq-len {text.seq_len}, fewer than the {shards} devices of "
            f"data x expert that each route their own: hold out more (--held-out, --val-data) or use fewer devices."
        )
    rows = jax.tree.map(lambda a: np.asarray(a)[:keep], rows)
    shifted = next_token_batch(rows)  # as text.val_batch counts: targets that count, and all of them
    counted = np.sum(shifted["loss_weights"]) if text.document_mask else shifted["targets"].size
    return eqxpar.shard(rows, mesh, P()), (float(counted), float(shifted["targets"].size))


def main(argv=None) -> dict:
    cfg = eqxpar.recipe.parse_flags(Config, argv, validate=check_flags)  # bad flags: one line, exit 2

    # --- Data: the corpus tokenized once into a token store (reused while the tokenizer
    # and files match), cut into packed rows of --seq-len + 1 tokens with each token's
    # document and position in it; the last --held-out share of documents held out. ---
    with eqxpar.recipe.flag_errors():  # unreadable files or tokenizer, a stale store: one line, exit 2
        text = eqxpar.recipe.load_text(cfg)

    # --- Mesh: `data` and `expert` split the batch, `expert` the experts, `model` the layers. ---
    mesh = eqxpar.make_mesh(**eqxpar.parse_mesh(cfg.mesh))
    batch_axes = ("data", "expert")  # the step's batch_axis: its split of the batch

    # --- Model: built whole from the seed, then split by its spec tree. ---
    model_key, train_key = jax.random.split(jax.random.key(cfg.seed))
    moe = MoEOptions(
        num_experts=cfg.experts,
        top_k=cfg.top_k,
        every=cfg.moe_every,
        capacity_factor=None if cfg.dropless else cfg.capacity_factor,
        aux_loss_weight=cfg.aux_loss_weight,
        z_loss_weight=cfg.z_loss_weight,
    )
    model = GPT(text.vocab_size, cfg.context, cfg.dim, cfg.heads, cfg.layers, moe=moe, key=model_key)
    specs = eqxpar.nn.partition_specs(model, mesh)  # experts over `expert`, heads and hidden units over `model`
    moe_blocks = [i for i in range(cfg.layers) if moe.is_moe_block(i)]

    # --- The step: next_token_loss is the cross-entropy plus the routers' auxiliary losses.
    # A packed batch keeps attention inside each document (the routing is per token, each
    # row one routing group); with --no-document-mask it is the tokens alone. ---
    def loss_fn(model, tokens, key):
        return next_token_loss(model, tokens, key=key)

    step = hybrid_step(loss_fn, optax.adamw(cfg.learning_rate), mesh, param_specs=specs, expert_axis="expert")
    model, opt_state = step.init(model)

    def batch(i: int):  # a pure function of (seed, step), split over data and expert
        return text.batch(i, mesh, global_batch_size=cfg.batch_size, seed=cfg.seed, batch_axis=step.batch_axis)

    # What one step sends: the all-to-alls, read from the compiled program, against the theory.
    lowered = step.lower(model, opt_state, batch(0), train_key)
    comm = CommReport.of(lowered, lowered.compile())
    capacity = model.blocks[moe_blocks[0]].moe.capacity(cfg.seq_len)
    theory = expert_parallel_theory(
        mesh,
        groups=cfg.batch_size,
        capacity=capacity,
        dim=cfg.dim,
        num_experts=cfg.experts,
        num_layers=len(moe_blocks),
        batch_axis=batch_axes,
    )
    measured = comm.bytes("all-to-all", stage="compiled")
    expected = theory.bytes("all-to-all")
    ratio = measured / expected if expected else None
    if eqxpar.recipe.is_main_process():
        print(f"mesh {dict(mesh.shape)}; collectives of one train step (per device):\n{comm}\n")
        local = cfg.batch_size // (mesh.shape["data"] * mesh.shape["expert"])  # sequences per device
        print(
            f"all-to-all per step and device: compiled {measured:,} B, theory {expected:,} B "
            f"({len(moe_blocks)} MoE blocks x 4 x {cfg.experts} experts x {local} sequences x "
            f"{capacity} slots x {cfg.dim} x 4 B)"
            + (f": ratio {ratio:.2f}" if ratio is not None else ": one expert device, nothing to send")
        )

    # Held-out loss, and the routing on the held-out rows (every row routed on one device).
    with eqxpar.recipe.flag_errors():  # fewer held-out rows than devices: one line, exit 2
        val_batch, val_counts = held_out_rows(text, mesh, mesh.shape["data"] * mesh.shape["expert"])
    val_rows = jax.tree.leaves(val_batch)[0].shape[0]
    val_spec = P(batch_axes)
    evaluate = eqxpar.recipe.held_out_loss(
        lambda m, tokens: next_token_loss(m, tokens), mesh, specs, batch_spec=val_spec
    )

    def val_metrics(model):  # val_loss, val_perplexity, val_bits_per_byte
        return text.val_metrics(float(evaluate(model, val_batch)), val_counts)

    def val_loss_of(model):
        return val_metrics(model)["val_loss"]

    @eqx.filter_jit
    def routing(model, rows):
        def per_device(model, rows):
            inputs = next_token_batch(rows)  # the inputs, with their segment ids and positions when packed
            _, auxes = eqx.nn.inference_mode(model)(
                inputs["inputs"], segment_ids=inputs["segment_ids"], positions=inputs["positions"], return_aux=True
            )
            # The mean over this device's sequences, averaged over the devices (equal shares).
            aux_loss = jax.lax.pmean(moe_aux_loss(model, auxes), batch_axes)
            return auxes, aux_loss

        run = eqxpar.filter_shard_map(per_device, mesh=mesh, in_specs=(specs, val_spec), out_specs=(val_spec, P()))
        return run(model, rows)

    # --- Training loop. ---
    run_log = eqxpar.recipe.RunLog.from_config(cfg, items_per_step=cfg.batch_size * cfg.seq_len, n_devices=mesh.size)
    for i in run_log.progress(range(cfg.steps), desc=f"moe {cfg.mesh}"):
        model, opt_state, metrics = step(model, opt_state, batch(i), jax.random.fold_in(train_key, i))
        run_log.step(i, metrics)
        run_log.maybe_eval(i, val_loss=functools.partial(val_loss_of, model))
    run_log.close()
    losses = run_log.losses

    val = val_metrics(model)
    val_loss = val["val_loss"]
    auxes, aux_loss = routing(model, val_batch)
    per_expert = [np.asarray(jnp.sum(a.tokens_per_expert, axis=0)).tolist() for a in auxes]
    dropped = [int(jnp.sum(a.dropped)) for a in auxes]
    choices = val_rows * cfg.seq_len * cfg.top_k  # per MoE block
    params = eqxpar.sharding_report(model)
    metrics = {
        "mesh": cfg.mesh,
        "steps": cfg.steps,
        "batch_size": cfg.batch_size,
        "losses": losses,
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "final_loss_mean10": float(np.mean(losses[-10:])),
        **val,  # val_loss (nats per held-out token), val_perplexity, val_bits_per_byte
        "val_losses": run_log.evals,  # every --eval-every steps: {"step", "val_loss"}
        "uniform_loss": math.log(text.vocab_size),  # guessing every token equally
        "tokens_seen": cfg.steps * cfg.batch_size * cfg.seq_len,  # row positions trained on
        "vocab_size": text.vocab_size,
        "seq_len": cfg.seq_len,
        "document_mask": cfg.document_mask,
        "moe_blocks": moe_blocks,
        "capacity": capacity,
        "tokens_per_expert": per_expert,  # per MoE block, on the held-out batch, before drops
        "dropped_tokens": dropped,  # per MoE block, of `routed_choices` each
        "routed_choices": choices,
        "aux_loss": float(aux_loss),  # the weighted balance and z-losses on the held-out batch
        "all_to_alls_per_step": comm.count("all-to-all", stage="compiled"),
        "all_to_all_bytes_per_step": measured,
        "all_to_all_bytes_theory": expected,
        "all_to_all_ratio": ratio,
        "tokens_per_second": run_log.per_second,
        "param_bytes_total": params.bytes_total,
        "param_bytes_per_device": params.bytes_per_device,
        "param_digest": eqxpar.recipe.parameter_digest(model),
    }
    if eqxpar.recipe.is_main_process():
        for block, counts, drops in zip(moe_blocks, per_expert, dropped):
            print(
                f"block {block}: tokens per expert {counts}; dropped {drops} of {choices} choices "
                f"({drops / choices:.1%}, capacity {capacity} per expert and sequence)"
            )
        print(
            f"{cfg.mesh}: loss {losses[0]:.3f} -> {metrics['final_loss_mean10']:.3f} (last 10 steps), "
            f"held-out {val_loss:.3f} ({val['val_bits_per_byte']:.3f} bits/byte; uniform guessing "
            f"{metrics['uniform_loss']:.3f}); aux loss "
            f"{metrics['aux_loss']:.4f}; {run_log.per_second:,.0f} tokens/s; parameters "
            f"{params.bytes_per_device:,} of {params.bytes_total:,} bytes per device"
        )
    eqxpar.recipe.write_metrics(cfg.metrics_out, metrics)
    return metrics


if __name__ == "__main__":
    main()
