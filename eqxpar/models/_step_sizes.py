"""The sizes a GPT step's theories start from, checked once for all of them."""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import Mesh

from .._specs import AxisNames, check_axes
from ._gpt import GPT


@dataclasses.dataclass(frozen=True)
class GPTStepSizes:
    """Per-device sizes of one micro-batch of a GPT step: `model_size` devices on the model
    axis, `replicas` batch shards, `contexts` context shards, `local_batch` examples and
    `local_seq` positions of each on one device."""

    model_size: int
    replicas: int
    contexts: int
    local_batch: int
    local_seq: int

    @property
    def tokens(self) -> int:
        """Tokens one device holds (in the tensor-parallel regions)."""
        return self.local_batch * self.local_seq


def gpt_step_sizes(
    who: str,
    model: Any,
    mesh: Mesh,
    batch_size: int,
    seq_len: int,
    *,
    batch_axis: AxisNames | None,
    context_axis: str | None,
) -> GPTStepSizes:
    """Check a GPT theory's arguments and return the step's per-device sizes.

    **Raises:**

    - `ValueError` naming `who` if `model` is not a GPT, the mesh lacks an axis, or
      `batch_size` or `seq_len` do not split over the batch and context shards.
    """
    if not isinstance(model, GPT):
        raise ValueError(f"{who}: model must be an eqxpar.models.GPT, got {type(model).__name__}.")
    n = check_axes(mesh, model.axis_name, who=who, arg="the GPT's axis_name", role="to split the layers over")
    replicas = (
        1
        if batch_axis is None
        else check_axes(mesh, batch_axis, who=who, arg="batch_axis", role="to split the batch over")
    )
    contexts = (
        1
        if context_axis is None
        else check_axes(mesh, context_axis, who=who, arg="context_axis", role="to split the sequence over")
    )
    if not (isinstance(batch_size, int) and batch_size > 0 and batch_size % replicas == 0):
        raise ValueError(
            f"{who}: batch_size must be a positive multiple of the {replicas} data shards, got {batch_size!r}."
        )
    if not (isinstance(seq_len, int) and 0 < seq_len <= model.context_length and seq_len % contexts == 0):
        raise ValueError(
            f"{who}: seq_len must be in 1..{model.context_length} (the GPT's context) and split over the "
            f"{contexts} context shards, got {seq_len!r}."
        )
    return GPTStepSizes(n, replicas, contexts, batch_size // replicas, seq_len // contexts)
