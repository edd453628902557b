"""Activation-memory theory: the bytes a step keeps from its forward pass, by what they are."""

from __future__ import annotations

import dataclasses
from typing import Any

from ._format import table


@dataclasses.dataclass(frozen=True)
class ActivationTerm:
    """One kind of array a step keeps for its backward pass, per device.

    - `what`: what the arrays are (e.g. `"q, k, v: column-parallel outputs"`).
    - `nbytes`: bytes of one of them on one device.
    - `count`: how many the step keeps (e.g. one per block).
    - `in_blocks`: whether it is kept once per block (a `count` of the number of blocks,
      or of the blocks of its kind where blocks differ: an MoE GPT's MLP terms with
      `every > 1`).
    """

    what: str
    nbytes: int
    count: int = 1
    in_blocks: bool = False

    @property
    def total(self) -> int:
        return self.nbytes * self.count


@dataclasses.dataclass(frozen=True)
class ActivationTheory:
    """What a step keeps from its forward pass for its backward pass, per device and
    micro-batch, term by term (built by e.g. [`eqxpar.models.gpt_activation_theory`][]).

    `exact_blocks` says how the per-block terms were counted: `True` when they are what the
    model's remat policy saves, which autodiff then keeps exactly (compare `blocks` with
    the difference of [`eqxpar.train.TrainStep.saved_activation_bytes`][] between two
    depths: for uniform blocks one more block adds `per_block`); `False` when they are the
    least the backward pass needs (each layer keeping only what its gradient formula
    reads), a lower bound that autodiff exceeds by the intermediate values it keeps as
    well. Terms outside the blocks are always such a least count.

    `print(theory)` shows the terms; [`ActivationTheory.versus`]
    [eqxpar.inspect.ActivationTheory.versus] puts the total beside measured figures.
    """

    terms: tuple[ActivationTerm, ...]
    num_blocks: int
    remat: str
    exact_blocks: bool

    @property
    def per_block(self) -> int:
        """Bytes kept per block: what one more block adds when every block keeps the same
        terms. With blocks of two kinds (an MoE GPT with `every > 1`, whose MLP terms count
        the blocks of their kind), the mean over the blocks, rounded down; compare `blocks`
        at two depths for what one more block of a kind adds."""
        return self.blocks // self.num_blocks if self.num_blocks else 0

    @property
    def blocks(self) -> int:
        """Bytes kept by all the blocks."""
        return sum(t.total for t in self.terms if t.in_blocks)

    @property
    def outside(self) -> int:
        """Bytes kept outside the blocks (embedding, final norm, head, loss)."""
        return sum(t.total for t in self.terms if not t.in_blocks)

    @property
    def total(self) -> int:
        return self.blocks + self.outside

    def __str__(self) -> str:
        how = "saved by the remat policy" if self.exact_blocks else "the least the backward pass reads"
        rows = [(t.what, f"{t.nbytes:,}", f"x {t.count}", f"{t.total:,}") for t in self.terms if t.total]
        rows.append((f"total (blocks: {how}; remat={self.remat!r})", "", "", f"{self.total:,}"))
        return "\n".join(table(("kept for the backward pass, per device", "bytes", "", "total"), rows))

    def versus(self, saved: int | None = None, temporaries: int | None = None) -> str:
        """The theory's total beside measured figures, with their ratios to it.

        **Arguments:**

        - `saved`: the bytes autodiff keeps (e.g.
          [`eqxpar.train.TrainStep.saved_activation_bytes`][], or a
          [`eqxpar.inspect.MemoryReport`][]'s `saved_activations`).
        - `temporaries`: XLA's temporaries of the compiled step (a `MemoryReport`'s
          `temporaries`): the activations as XLA keeps them after fusion, plus the
          gradients, optimizer temporaries and the backward pass's working set.

        **Returns:**

        The table, as a string.
        """
        rows = [("theory", f"{self.total:,}", "1.00")]
        for name, value in (("saved by autodiff (measured)", saved), ("XLA temporaries (measured)", temporaries)):
            if value is not None:
                rows.append((name, f"{int(value):,}", f"{value / self.total:.2f}" if self.total else "-"))
        return "\n".join(table(("activation memory per device", "bytes", "/ theory"), rows))


def activation_terms(*terms: Any) -> tuple[ActivationTerm, ...]:
    """The terms that keep something (a zero-byte term is left out)."""
    return tuple(t for t in terms if t.total)
