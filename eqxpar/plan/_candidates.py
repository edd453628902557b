"""The layouts a plan chooses from: every factorisation of the devices into
`data x fsdp x context x model`, times remat, sequence parallelism and the context-parallel
attention, and the divisibility rules that rule some out."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from ..models import GPT, gpt_activation_theory, gpt_tensor_parallel_theory
from ..nn import zigzag_order
from ._abstract import AXES, abstract_mesh

REMATS = ("none", "save_matmuls", "block")
"""The GPT remat policies a plan chooses from (`"offload"` is not modelled)."""
CONTEXT_ATTENTION = ("ring", "all_gather")


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to run a GPT step: axis sizes (`data` copies the model, `fsdp` splits
    parameters and optimizer state too, `context` splits every sequence, `model` splits
    the layers), the GPT's `remat` policy, Megatron `sequence_parallel` over the model axis,
    and `attention` (`"dot_product"` without a context axis; `"ring"` or `"all_gather"`
    with one)."""

    data: int
    fsdp: int
    context: int
    model: int
    remat: str
    sequence_parallel: bool
    attention: str

    @property
    def sizes(self) -> dict[str, int]:
        """Axis name to size, for every axis (size-1 axes included), in mesh order."""
        return {a: getattr(self, a) for a in AXES}

    @property
    def batch_shards(self) -> int:
        return self.data * self.fsdp

    def mesh_text(self) -> str:
        """The axes of size above 1 as `data=2,model=4` (`"one device"` for none)."""
        used = [f"{a}={n}" for a, n in self.sizes.items() if n > 1]
        return ",".join(used) or "one device"

    def __str__(self) -> str:
        sp = " sp" if self.sequence_parallel else ""
        attention = f" {self.attention}" if self.context > 1 else ""
        return f"{self.mesh_text()} remat={self.remat}{sp}{attention}"


def factorisations(n: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every ordered tuple of `parts` positive integers whose product is `n`."""
    if parts == 1:
        yield (n,)
        return
    for first in range(1, n + 1):
        if n % first == 0:
            for rest in factorisations(n // first, parts - 1):
                yield (first, *rest)


def layouts(devices: int, axes: tuple[str, ...] = AXES) -> Iterator[Layout]:
    """Every layout of `devices` devices over `axes` (the others of size 1), before any
    divisibility rule."""
    for data, fsdp, context, model in factorisations(devices, 4):
        sizes = {"data": data, "fsdp": fsdp, "context": context, "model": model}
        if any(n > 1 and a not in axes for a, n in sizes.items()):
            continue
        for remat in REMATS:
            for sp in (False, True) if model > 1 else (False,):
                for attention in CONTEXT_ATTENTION if context > 1 else ("dot_product",):
                    yield Layout(data, fsdp, context, model, remat, sp, attention)


_CHECKED: dict[tuple[int, int], str] = {}  # (id of an abstract GPT, model size): "" or why not; GPTs are cached


def clear_checks() -> None:
    """Forget the model-axis checks kept by GPT id (`eqxpar.plan.plan` clears them when it starts)."""
    _CHECKED.clear()


def rule_out(layout: Layout, gpt: GPT, batch: int, seq: int) -> str | None:
    """Why `layout` cannot run `gpt` on `batch` sequences of `seq` tokens, or None.

    The rules are the library's own checks, called rather than restated: the GPT's own
    `check_axis_size` (heads, MLP width and padded vocabulary split over `model`), the GPT's
    theories (the batch over `data x fsdp`, the sequence over `context`, and over
    `context x model` with sequence parallelism), the zigzag layout of context parallelism
    (the sequence in `2 x context` equal chunks).
    """
    mesh = abstract_mesh(layout.sizes)
    split = _CHECKED.get((id(gpt), layout.model))
    if split is None:
        try:
            gpt.check_axis_size(layout.model)
            split = ""
        except ValueError as error:
            split = str(error)
        _CHECKED[(id(gpt), layout.model)] = split
    if split:
        return split
    context_axis = "context" if layout.context > 1 else None
    try:
        gpt_tensor_parallel_theory(gpt, mesh, batch, seq, batch_axis=("data", "fsdp"), context_axis=context_axis)
        gpt_activation_theory(gpt, mesh, batch, seq, batch_axis=("data", "fsdp"), context_axis=context_axis)
        if context_axis:
            zigzag_order(seq, layout.context)
    except ValueError as error:
        return str(error)
    return None
