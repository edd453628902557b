"""The collectives of a layout's step, from eqxpar's theories, and the seconds one
(kind, axes) class of them takes as a ring over its link (see `_predict.py`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jax.sharding import Mesh

from ..inspect import CommTheory, TheoryTerm, context_parallel_theory, data_parallel_theory, fsdp_theory
from ..models import GPT, gpt_tensor_parallel_theory
from ._abstract import AXES
from ._candidates import Layout
from ._cluster import Link
from ._predict import BATCH_AXES, attention_of, block_bytes

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


def _key(axes: tuple[str, ...], sizes: dict[str, int]) -> tuple[str, ...]:
    return tuple(a for a in AXES if a in axes and sizes[a] > 1)


def comm_theory(gpt: GPT, mesh: Mesh, layout: Layout, specs: Any, batch: int, seq: int) -> CommTheory:
    """The collectives of the layout's step, by the library's theories:

    - without `fsdp`: `data_parallel_theory` over `data` (and `context`, a batch axis for
      the gradient sum);
    - with `fsdp`: `fsdp_theory` over `fsdp`; the gradients it scatters are then summed over
      the other batch axes (`data`, `context`) with one all-reduce of each device's block,
      and the loss's reduction runs over all batch axes together;
    - `gpt_tensor_parallel_theory` over `model` (with remat when the GPT recomputes), and
      `context_parallel_theory` over `context`.
    """
    sizes = layout.sizes
    context_axis = "context" if layout.context > 1 else None
    remat = layout.remat != "none"
    if layout.fsdp == 1:
        theory = data_parallel_theory(gpt, mesh, specs, batch_axis=("data", "context"))
    else:
        fsdp = fsdp_theory(gpt, mesh, specs, batch_axis="fsdp")
        every = _key(("data", "fsdp", "context"), sizes)
        others = _key(("data", "context"), sizes)
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
    theory += gpt_tensor_parallel_theory(
        gpt, mesh, batch, seq, batch_axis=BATCH_AXES, context_axis=context_axis, remat=remat
    )
    if context_axis:
        block = attention_of(gpt)
        theory += context_parallel_theory(
            mesh,
            batch=batch,
            seq_len=seq,
            num_heads=block.num_heads,
            head_dim=block.qk_size,
            num_layers=gpt.num_layers,
            mode=layout.attention,
            context_axis="context",
            batch_axis=BATCH_AXES,
            model_axis="model",
            dtype=gpt.position_embedding.weight.dtype,
            remat=remat,
        )
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
