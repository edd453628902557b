"""The collectives of a layout's step, from eqxpar's theories, and the seconds one
(kind, axes) class of them takes as a ring over its link (see `_predict.py`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from jax.sharding import Mesh

from ..inspect import CommTheory, TheoryTerm, data_parallel_theory, fsdp_theory
from ..models import GPT
from ._candidates import Layout, used_axes
from ._cluster import Link
from ._experts import expert_comm
from ._family import PlanModel, context_theory, tensor_parallel_theory
from ._predict import block_bytes

# Bytes over each device's link per byte of the array a collective is defined on (the
# bytes convention of eqxpar.inspect), for a ring of n devices: an all-reduce is a
# reduce-scatter then an all-gather, 2 (n-1)/n; an all-gather or reduce-scatter (n-1)/n;
# an all-to-all (n-1)/n; a collective-permute sends its array once.
RING_FACTORS = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1.0,
}
"""Per collective kind, `n -> ` bytes over each device's link per byte of the collective's
array (the bytes convention of `eqxpar.inspect`), for a ring of `n` devices."""
# Hops a ring collective takes (each paying the link's latency once).
RING_HOPS = {
    "all-reduce": lambda n: 2 * (n - 1),
    "all-gather": lambda n: n - 1,
    "reduce-scatter": lambda n: n - 1,
    "all-to-all": lambda n: n - 1,
    "collective-permute": lambda n: 1,
}


def comm_theory(
    gpt: PlanModel, mesh: Mesh, layout: Layout, specs: Any, batch: int, seq: int, *, document_mask: bool = False
) -> CommTheory:
    """The collectives of the layout's step, by the library's theories:

    - without `fsdp`: `data_parallel_theory` over `data` (and `context`, a batch axis for
      the gradient sum);
    - with `fsdp`: `fsdp_theory` over `fsdp`; the gradients it scatters are then summed over
      the other batch axes (`data`, `context`) with one all-reduce of each device's block,
      and the loss's reduction runs over all batch axes together;
    - the family's tensor-parallel theory over `model` (`gpt_tensor_parallel_theory` or
      `llama_tensor_parallel_theory`, with the model's remat), and its attention's traffic
      over `context` (`context_parallel_theory`, `llama_context_parallel_theory`);
    - with an expert axis, `expert` is a batch axis too, and `expert_comm` (`_experts.py`)
      adds the experts' part.
    """
    sizes = layout.sizes
    context_axis = "context" if layout.context > 1 else None
    batch_axes = layout.batch_axes
    every = used_axes((*batch_axes, "context"), sizes)
    if layout.fsdp == 1:
        theory = data_parallel_theory(
            gpt, mesh, specs, batch_axis=tuple(a for a in (*batch_axes, "context") if a != "fsdp")
        )
    else:
        fsdp = fsdp_theory(gpt, mesh, specs, batch_axis="fsdp")
        others = tuple(a for a in every if a != "fsdp")
        terms: list[TheoryTerm] = []
        for t in fsdp.terms:
            if t.what.startswith("loss"):
                terms.append(dataclasses.replace(t, axes=every))
            elif t.kind == "all-reduce" and t.what.startswith("gradients of the parameters kept whole"):
                terms.append(dataclasses.replace(t, axes=every))
            else:
                terms.append(t)
        scattered = sum(t.bytes for t in fsdp.terms if t.kind == "reduce-scatter")
        if others and scattered:
            blocks = block_bytes(gpt, specs, sizes, split_only=True)
            terms.append(TheoryTerm("all-reduce", others, blocks, "gradient blocks summed over the other batch axes"))
        theory = CommTheory(tuple(terms))
    theory += tensor_parallel_theory(
        gpt, mesh, batch, seq, batch_axis=batch_axes, context_axis=context_axis, remat=layout.remat
    )
    if context_axis:
        theory += context_theory(
            gpt, mesh, batch, seq, batch_axis=batch_axes, remat=layout.remat, segment_ids=document_mask
        )
    if layout.expert is not None:
        assert isinstance(gpt, GPT)  # plan() refuses moe= for a Llama
        theory = expert_comm(theory, gpt, mesh, layout, specs, batch, seq)
    return theory


def is_parameter_collective(kind: str, axes: tuple[str, ...]) -> bool:
    """Whether a (kind, axes) class carries gradients or parameters (rather than
    activations): all-reduces over batch axes only (data, fsdp, context: gradient sums and
    the loss), and FSDP's gathers and scatters over `fsdp` alone."""
    if "model" in axes:
        return False
    if kind == "all-reduce":
        return True
    return kind in ("all-gather", "reduce-scatter") and tuple(axes) == ("fsdp",)


def collective_seconds(kind: str, axes: tuple[str, ...], nbytes: int, sizes: dict[str, int], link: Link) -> float:
    """Seconds for one (kind, axes) class of collectives moving `nbytes` (the bytes
    convention) over `link`, as one ring over the group."""
    n = math.prod(sizes[a] for a in axes)
    if n <= 1 or nbytes == 0:
        return 0.0
    seconds = RING_FACTORS[kind](n) * nbytes / link.bandwidth if link.bandwidth else math.inf
    return seconds + RING_HOPS[kind](n) * link.latency


def in_dtype(comm: CommTheory, param_dtype: Any, dtype: Any) -> CommTheory:
    """The activation collectives carried in the compute dtype: the theory counts the
    parameters' dtype. Scaled: everything over `model` (the Megatron all-reduces, sequence
    parallelism's gathers and scatters), the context-parallel attention's keys and values
    over `context`, the all-to-alls over `expert`, a pipeline's stage outputs
    (collective-permutes over `stage`). Kept: gradient and parameter collectives (all-reduces
    over the batch axes, `context` among them; FSDP's gathers and scatters) and the terms
    that travel in float32 whatever the compute dtype (`FLOAT32_TERMS`). Checked against a
    bfloat16 step's lowered program (tests/test_plan_llama.py, tests/test_plan_validate.py)."""
    ratio = np.dtype(dtype).itemsize / np.dtype(param_dtype).itemsize
    if ratio == 1:
        return comm
    terms = tuple(dataclasses.replace(t, bytes=int(t.bytes * ratio)) if _is_activation(t) else t for t in comm.terms)
    return CommTheory(terms)


FLOAT32_TERMS = ("cross-entropy:", "gradient norm:")
"""The starts of the theories' `what` for terms carried in float32 whatever the compute
dtype: the vocabulary-parallel cross-entropy's statistics and the gradient norm's partial
sums; besides them, every term whose `what` says `(float32)` (ring attention's key and
value gradients, the GPT's layer-norm and position-row gradients under sequence
parallelism, the MoE routing weights' gradient)."""


def _is_activation(t: TheoryTerm) -> bool:
    if t.what.startswith(FLOAT32_TERMS) or "(float32)" in t.what or is_parameter_collective(t.kind, t.axes):
        return False
    if set(t.axes) & {"model", "context"} or t.kind == "all-to-all" and t.axes == ("expert",):
        return True
    return t.kind == "collective-permute" and t.axes == ("stage",) and not t.what.startswith("circular")
