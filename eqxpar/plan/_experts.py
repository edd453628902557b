"""The mixture-of-experts part of a plan (`plan(..., moe=MoEOptions(...))`): the options
checked by the library's own checks, the experts' collectives and the FLOPs their
recomputation adds.

A plan for an MoE GPT has an `expert` mesh axis (`EXPERT_AXES`, size 1 included): the
experts are split over it ([`eqxpar.nn.MixtureOfExperts`][]'s specs), the batch over
`data x fsdp x expert` (the step builders' `expert_axis="expert"`), and its step differs
from a dense GPT's by:

- the all-to-alls over `expert` ([`eqxpar.inspect.expert_parallel_theory`][]): four per
  MoE block (tokens to their experts and back, and the transposes backward), and with
  remat (`block` or `save_matmuls`: no remat policy names the experts' einsums) the
  forward two again when the block is recomputed;
- the experts' gradients: summed over the batch axes other than `expert` (the all-to-alls
  already summed them over it), where every other gradient is summed over all of them;
- over `model` (the experts' hidden units split over it): per MoE block the gradient of
  the routing weights (each token's `top_k` float32 weights, invariant over `model` and
  multiplied into the partial outputs) and, with shared experts, their MLP's output
  forward and input gradient backward.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh

from ..inspect import CommTheory, TheoryTerm, expert_parallel_theory, theory_term
from ..models import GPT, GPTConfig, MoEOptions, stack_blocks
from ._abstract import experts_of
from ._candidates import Layout
from ._family import PlanModel
from ._predict import block_bytes

# The gradient all-reduces of the dense theories (inspect's data_parallel_theory and
# fsdp_theory, and comm_theory's FSDP branch), and which experts' blocks each carries:
# every one (None), those FSDP keeps whole (False), those it splits (True).
GRADIENT_SUMS = {
    "gradients: each device's parameter bytes": None,
    "gradients of the parameters kept whole": False,
    "gradient blocks summed over the other batch axes": True,
}


def check_moe(
    config: GPTConfig,
    moe: Any,
    vocab_size: int,
    pad: int,
    pipeline: bool | None,
    axes: tuple[str, ...] | None,
    sequence_parallel: tuple[bool, ...],
) -> None:
    """A `ValueError` (from the GPT's own checks, prefixed `plan:`) unless `moe` is an
    [`eqxpar.models.MoEOptions`][] the planner prices: `every=1`, every block an MoE
    block, which [`eqxpar.models.stack_blocks`][] stacks (the plans scan their blocks),
    with a capacity factor (dropless routing: over an expert axis each expert computes a
    slot for every token, without one the layer takes `ragged_dot`; not priced) and its
    experts over the planner's axis `expert`; and not asked for what it does not plan with
    experts: pipelines (`pipeline=True`, `stage` in the `axes` given), context parallelism
    (`context` in them) or sequence parallelism alone (`sequence_parallel=(True,)`); the
    GPT refuses the last two with `moe=`."""
    axes = axes or ()
    if pipeline or "stage" in axes:
        raise ValueError(
            "plan: pipelines of a GPT with moe= are not planned (pipeline_step takes no expert_axis); "
            "pass pipeline=None or False and leave 'stage' out of axes."
        )
    if "context" in axes or False not in sequence_parallel:
        raise ValueError(
            "plan: a GPT with moe= routes whole sequences on each device: it takes neither context nor sequence "
            "parallelism. Leave 'context' out of axes and let sequence_parallel include False."
        )
    if isinstance(moe, MoEOptions) and moe.capacity_factor is None:
        raise ValueError(
            "plan: dropless routing (MoEOptions(capacity_factor=None)) is not planned: over an expert axis every "
            "expert computes a slot per token, and without one the layer takes jax.lax.ragged_dot; give a "
            "capacity_factor (e.g. 1.25) to plan, and train the dropless model on the plan's mesh."
        )
    if isinstance(moe, MoEOptions) and moe.expert_axis != "expert":
        raise ValueError(
            f"plan: moe.expert_axis={moe.expert_axis!r}: the planner's mesh splits experts over the axis "
            f"'expert' (and builds the step with expert_axis='expert'); use MoEOptions(expert_axis='expert')."
        )
    try:
        shape = eqx.filter_eval_shape(
            GPT,
            vocab_size,
            config.context,
            config.dim,
            config.heads,
            min(getattr(moe, "every", 1), config.layers),
            pad_vocab_to_multiple_of=pad,
            moe=moe,
            key=jax.random.key(0),
        )
        stack_blocks(shape)
    except ValueError as error:
        if moe is not None and not isinstance(moe, MoEOptions):
            raise ValueError(f"plan: {error}") from None
        raise ValueError(
            f"plan: moe={moe!r} cannot be planned: {error} (the planner scans the blocks: it plans a GPT "
            f"whose every block is an MoE block)"
        ) from None


def expert_comm(
    theory: CommTheory, gpt: GPT, mesh: Mesh, layout: Layout, specs: Any, batch: int, seq: int
) -> CommTheory:
    """`theory` (the dense theories over the batch axes, `expert` among them) with the
    experts' part (see the module docs)."""
    sizes = layout.sizes
    terms: list[TheoryTerm] = []
    for t in theory.terms:
        if t.kind != "all-reduce" or "expert" not in t.axes or t.what not in GRADIENT_SUMS:
            terms.append(t)
            continue
        experts = _expert_bytes(gpt, specs, sizes, GRADIENT_SUMS[t.what])
        others = tuple(a for a in t.axes if a != "expert")
        terms += theory_term("all-reduce", t.axes, t.bytes - experts, t.what)
        terms += theory_term("all-reduce", others, experts, "the experts' gradients, over the batch axes but expert")
    moe, layer = gpt.moe, experts_of(gpt)
    assert moe is not None and layer is not None  # a plan with an expert axis is for an MoE GPT
    dim = gpt.position_embedding.weight.shape[-1]
    dtype = gpt.position_embedding.weight.dtype
    a2a = expert_parallel_theory(
        mesh,
        groups=batch,
        capacity=layer.capacity(seq),
        dim=dim,
        num_experts=moe.num_experts,
        num_layers=gpt.num_layers,
        expert_axis="expert",
        batch_axis=layout.batch_axes,
        dtype=dtype,
    )
    terms += a2a.terms
    if layout.remat != "none":
        terms += [dataclasses.replace(t, what=f"{t.what} (recomputed)") for t in a2a.terms if t.what[:7] == "forward"]
    if layout.model > 1:
        tokens = batch // layout.batch_shards * seq
        layers = gpt.num_layers
        weights = layers * tokens * moe.top_k * np.dtype(np.float32).itemsize
        what = "MoE routing weights' gradient, top_k per token (float32)"
        terms += theory_term("all-reduce", ("model",), weights, what)
        if moe.shared_experts:
            stream = 2 * layers * tokens * dim * np.dtype(dtype).itemsize
            terms += theory_term("all-reduce", ("model",), stream, "shared experts: output (fwd), input gradient (bwd)")
    return CommTheory(tuple(terms))


def _expert_bytes(gpt: GPT, specs: Any, sizes: dict[str, int], fsdp_split: bool | None) -> int:
    """Bytes of one device's blocks of the experts' weights (the leaves split over
    `expert`), of all of them (`fsdp_split=None`) or of those FSDP splits or not."""
    every = block_bytes(gpt, specs, sizes, over="expert")
    if fsdp_split is None:
        return every
    split = block_bytes(gpt, specs, sizes, over="expert", split_only=True)
    return split if fsdp_split else every - split


def recomputed_expert_flops(gpt: PlanModel) -> int:
    """FLOPs per token of the MoE blocks' router and routed experts forward (their `top_k`
    experts' SwiGLU), over every block: what `remat="save_matmuls"` recomputes beside the
    attention (no remat policy names their einsums). 0 for a model without experts."""
    layer = experts_of(gpt)
    if layer is None:
        return 0
    experts = (layer.gate.size + layer.up.size + layer.down.size) // layer.num_experts * layer.top_k
    return 2 * (layer.router.weight.size + experts)


def routed_arrays(gpt: PlanModel, layout: Layout, batch: int, seq: int, dtype: Any) -> int:
    """An estimate of what one MoE block keeps of its routed path for the backward pass:
    under `remat="none"` for every block, which [`eqxpar.models.gpt_activation_theory`][]
    leaves out (its lower bound); under the other remats for the block being recomputed
    (no remat policy names the experts' einsums). Per device, with `R = E x groups x capacity` slots (the same on the
    experts' devices after the all-to-all), the dispatch buffer twice (`2 R dim`), six
    arrays of the experts' hidden layer (`6 R hidden / model`: both matmuls' outputs, the
    SiLU's three, their product), the combine's gathered outputs and the tokens copied per
    choice (`2 groups top_k seq dim`), in the compute dtype; and the router's scores in
    float32 (`2 groups seq E`). Read off `jax.ad_checkpoint.print_saved_residuals` of the
    layer; on the planner's toy one more block keeps 0.96-1.006 of it under `remat="none"`
    outside FSDP, 0.84 on `model=8` (docs/concepts/planner.md). 0 for a model without experts."""
    layer = experts_of(gpt)
    if layer is None:
        return 0
    groups = batch // layout.batch_shards
    rows = layer.num_experts * groups * layer.capacity(seq)
    values = rows * (2 * layer.dim + 6 * layer.hidden_size // layout.model) + 2 * groups * layer.top_k * seq * layer.dim
    return values * np.dtype(dtype).itemsize + 2 * groups * seq * layer.num_experts * np.dtype(np.float32).itemsize
