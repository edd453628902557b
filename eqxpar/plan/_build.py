"""What a plan builds: its mesh, model (a GPT or a Llama), train step and placed batch, with eqxpar's own
builders (`eqxpar.make_mesh`, `eqxpar.train.hybrid_step` / `fsdp_step` /
`pipeline_step`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from .._mesh import make_mesh
from .._sharding import shard
from ..models import GPT, Llama, LlamaConfig, llama_loss, next_token_loss, stack_blocks
from ..nn import partition_specs, vocab_parallel_cross_entropy, zigzag_order
from ..train import Precision, TrainStep, fsdp_specs, fsdp_step, hybrid_step, pipeline_specs, pipeline_step
from ._candidates import Layout
from ._family import PlanModel, stages_of


def build_mesh(layout: Layout, devices: Sequence[Any] | None = None):
    sizes: dict[str, Any] = layout.sizes
    return make_mesh(devices=devices, **sizes)


def build_model(plan: Any, key: Any) -> PlanModel:
    c, layout = plan.config, plan.layout
    remat = layout.remat if layout.stage == 1 else "none"  # a pipeline's remat is its own
    if isinstance(c, LlamaConfig):
        return Llama(
            c,
            scan_layers=True,
            remat=remat,
            sequence_parallel=layout.sequence_parallel,
            attention_impl=layout.attention,
            key=key,
        )
    gpt = GPT(
        plan.vocab_size,
        c.context,
        c.dim,
        c.heads,
        c.layers,
        attention_dropout_p=0.0,
        pad_vocab_to_multiple_of=plan.pad_vocab_to_multiple_of,
        attention_impl=layout.attention,
        scan_layers=plan.moe is None,  # a GPT with moe= is built unscanned, then stacked
        remat=remat,
        sequence_parallel=layout.sequence_parallel,
        moe=plan.moe,
        key=key,
    )
    return gpt if plan.moe is None else stack_blocks(gpt)


def llama_step_loss(model: Llama, batch: Any, key: Any = None):
    """The Llama's next-token loss: of whole sequences (`(batch, seq + 1)` ids), or of an
    `(inputs, targets)` pair in zigzag layout (context parallelism)."""
    return llama_loss(model, batch, key=key)


def whole_loss(model: GPT, tokens: Any, key: Any = None):
    """Next-token loss of whole sequences (`(batch, seq + 1)` ids)."""
    return next_token_loss(model, tokens, key=key)


def split_loss(model: GPT, batch: Any, key: Any = None):
    """Next-token loss of this device's positions of every sequence (context parallelism:
    inputs and targets already in zigzag layout)."""
    inputs, targets = batch
    logits = model(inputs, key=key)
    assert not isinstance(logits, tuple)  # no return_aux=True: the logits alone (an MoE plan has no context axis)
    return jnp.mean(vocab_parallel_cross_entropy(logits, targets, model.axis_name, model.vocab_size))


def build_step(plan: Any, optimizer: optax.GradientTransformation, mesh: Any, *, precision: Any = None) -> TrainStep:
    layout = plan.layout
    context_axis = "context" if layout.context > 1 else None
    batch_axis = ("data", "fsdp")  # and "expert" with an expert axis: the step adds it
    expert_axis = "expert" if layout.expert is not None else None
    if isinstance(plan.config, LlamaConfig):
        loss = llama_step_loss
    else:
        loss = split_loss if context_axis else whole_loss
    if precision is None and plan.dtype != jnp.float32:
        precision = Precision(compute_dtype=plan.dtype)
    if layout.stage > 1:
        return pipeline_step(
            stages_of(plan.config),
            optimizer,
            mesh,
            param_specs=pipeline_fsdp_specs(mesh, stages_of(plan.config)) if layout.fsdp > 1 else None,
            batch_axis=batch_axis,
            stage_axis="stage",
            schedule=layout.schedule,
            microbatches=layout.microbatches,
            virtual_stages=layout.virtual_stages,
            precision=precision,
            remat=layout.remat == "block" and layout.schedule != "1f1b",
        )
    make = fsdp_step if layout.fsdp > 1 else hybrid_step
    return make(
        loss,
        optimizer,
        mesh,
        batch_axis=batch_axis,
        context_axis=context_axis,
        expert_axis=expert_axis,
        precision=precision,
    )


def pipeline_fsdp_specs(mesh: Any, stages: Any):
    """FSDP inside the stages, as `pipeline_step` documents it: `fsdp_specs` over `fsdp`
    with the pipeline's specs (the GPT's tensor-parallel specs, the layers over `stage`) as
    its `param_specs`."""

    def specs(model: Any) -> Any:
        return fsdp_specs(
            model, mesh, batch_axis="fsdp", param_specs=pipeline_specs(stages, model, partition_specs(model))
        )

    return specs


def build_batch(layout: Layout, tokens: Any, mesh: Any):
    if layout.context == 1:
        return shard(tokens, mesh, PartitionSpec(layout.batch_axes))
    order = zigzag_order(tokens.shape[-1] - 1, layout.context)
    inputs, targets = tokens[:, :-1][:, order], tokens[:, 1:][:, order]
    return shard((inputs, targets), mesh, PartitionSpec(layout.batch_axes, "context"))
