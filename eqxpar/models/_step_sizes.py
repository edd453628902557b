"""The sizes a GPT or Llama step's theories start from, checked once for all of them."""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import Mesh

from .._specs import AxisNames, check_axes
from ._gpt import GPT
from ._llama import Llama


@dataclasses.dataclass(frozen=True)
class StepSizes:
    """Per-device sizes of one micro-batch of a GPT or Llama step: `model_size` devices on the model
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


def step_sizes(
    who: str,
    model: Any,
    mesh: Mesh,
    batch_size: int,
    seq_len: int,
    *,
    batch_axis: AxisNames | None,
    context_axis: str | None,
    family: type = GPT,
) -> StepSizes:
    """Check a GPT or Llama theory's arguments and return the step's per-device sizes.

    **Raises:**

    - `ValueError` naming `who` if `model` is not a `family` (GPT by default, or Llama),
      the mesh lacks an axis, or `batch_size` or `seq_len` do not split over the batch and context shards.
    """
    name = family.__name__
    if family not in (GPT, Llama) or not isinstance(model, family):
        raise ValueError(f"{who}: model must be an eqxpar.models.{name}, got {type(model).__name__}.")
    n = check_axes(mesh, model.axis_name, who=who, arg=f"the {name}'s axis_name", role="to split the layers over")
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
            f"{who}: batch_size must be a positive multiple of the {replicas} batch shards, got {batch_size!r}."
        )
    if isinstance(model, GPT):
        longest, what = model.context_length, "context"
    else:
        longest, what = model.config.max_seq_len, "max_seq_len"
    if not (isinstance(seq_len, int) and 0 < seq_len <= longest and seq_len % contexts == 0):
        raise ValueError(
            f"{who}: seq_len must be in 1..{longest} (the {name}'s {what}) and split over the "
            f"{contexts} context shards, got {seq_len!r}."
        )
    return StepSizes(n, replicas, contexts, batch_size // replicas, seq_len // contexts)
