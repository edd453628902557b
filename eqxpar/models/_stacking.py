"""Converting a GPT between its two block layouts: a tuple run in a Python loop and a stack
run with `jax.lax.scan`."""

from __future__ import annotations

import equinox as eqx

from ..nn import StackedLayers
from ._gpt import GPT

__all__ = ["stack_blocks", "unstack_blocks"]


def stack_blocks(model: GPT) -> GPT:
    """The same GPT with its blocks stacked (`scan_layers=True`), sharing nothing mutable.

    Works on the global form, on abstract models and on trees shaped like a GPT's (e.g. a
    checkpoint restored into the unscanned form): load a checkpoint into the form it was
    saved in, then convert.

    **Arguments:**

    - `model`: a GPT with `blocks` a tuple (unchanged if already stacked). A GPT with
      `moe=` stacks when every block is an [`eqxpar.models.MoEBlock`][] (`every=1`); its
      call then scans them and returns their auxes as the loop does.

    **Returns:**

    The GPT with `blocks` an [`eqxpar.nn.StackedLayers`][].

    **Raises:**

    - `ValueError` for a GPT with `moe=` and `every > 1` (two kinds of block).
    """
    if isinstance(model.blocks, StackedLayers):  # model.scan_layers
        return model
    moe = getattr(model, "moe", None)
    if moe is not None and moe.every > 1:
        raise ValueError(
            f"stack_blocks: a GPT with moe= mixes two kinds of block when moe.every={moe.every} (MoE blocks "
            f"between plain ones), which cannot be stacked: keep the loop, or build the GPT with "
            f"MoEOptions(every=1) so that every block is an MoE block."
        )
    return eqx.tree_at(lambda m: m.blocks, model, StackedLayers(model.blocks, axis_name=model.axis_name))


def unstack_blocks(model: GPT) -> GPT:
    """The same GPT with its blocks as a tuple of [`eqxpar.models.TransformerBlock`][]s
    (the inverse of [`eqxpar.models.stack_blocks`][]).

    **Arguments:**

    - `model`: a GPT with stacked blocks (unchanged if they are a tuple already).

    **Returns:**

    The GPT with `blocks` a tuple.
    """
    if not isinstance(model.blocks, StackedLayers):  # not model.scan_layers
        return model
    return eqx.tree_at(lambda m: m.blocks, model, model.blocks.unstack())
