"""Theory for expert parallelism: the all-to-all bytes a mixture-of-experts layer moves.

A [`eqxpar.nn.MixtureOfExperts`][] layer routes tokens in **groups** of `T` tokens (one
group per row of its input's leading dimensions), each expert having `C` slots per group
([`eqxpar.nn.expert_capacity`][], or the layer's `capacity(T)`; `C = T` on the dropless
bound). Over an `expert` axis of `N` devices,
with `G` groups on each device (the global groups over the axes the batch is split over),
each device packs an `(E, G, C, dim)` buffer, one block per expert:

- forward: one all-to-all sends it to the experts' devices (`E G C dim` elements sent,
  `(N - 1) / N` of it leaving the device), and one all-to-all brings the experts' outputs
  back (the same size);
- backward: the transposes, in reverse: the outputs' cotangents go to the experts (needed
  for the experts' weight gradients) and the inputs' cotangents come back (needed only when
  the layer's input has a gradient: skipped when the input is data).

With the experts' hidden units split over a model axis too (`model_axis=`), every model
device exchanges the same buffers over its own expert axis: the same bytes per device, and
the model axis's psums (of the output forward, of the input's gradient backward) on top,
which this theory leaves out.

Bytes convention of [`eqxpar.inspect`][]: for an all-to-all, the array sent.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jax.sharding import Mesh

from ._format import report_axes
from ._theory import CommTheory, axis_size, theory_term


def _positive_int(who: str, name: str, value: Any) -> None:
    if not (isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value > 0):
        raise ValueError(f"{who}: {name} must be a positive integer, got {value!r}.")


def expert_parallel_theory(
    mesh: Mesh,
    *,
    groups: int,
    capacity: int,
    dim: int,
    num_experts: int,
    num_layers: int = 1,
    expert_axis: str = "expert",
    batch_axis: Any = None,
    dtype: Any = np.float32,
    input_grad: bool = True,
) -> CommTheory:
    """The all-to-all traffic of a train step's mixture-of-experts layers (forward and backward).

    **Arguments:**

    - `mesh`: the mesh the step runs on.
    - `groups`: the global number of routing groups (rows of the layer's input's leading
      dimensions, e.g. the batch).
    - `capacity`: each expert's slots per group, `moe.capacity(tokens)` (the number of
      tokens in a group when dropless).
    - `dim`, `num_experts`: the model dimension and the number of experts.
    - `num_layers`: how many such layers the step runs.
    - `expert_axis`: the axis the experts are split over.
    - `batch_axis`: the axis (or axes) the groups are split over; default `expert_axis`
      alone (pass `("data", "expert")` when the batch is split over both).
    - `dtype`: the dtype of the layer's input.
    - `input_grad`: the layer's input has a gradient (it follows other layers): the
      backward pass sends the input cotangents back (one all-to-all more per layer).

    **Returns:**

    A [`eqxpar.inspect.CommTheory`][] with all-to-all terms over the expert axis (empty
    when that axis has size 1).

    **Raises:**

    - `ValueError` for a missing axis, sizes that are not positive integers or do not
      split.
    """
    who = "expert_parallel_theory"
    for name, value in (
        ("groups", groups),
        ("capacity", capacity),
        ("dim", dim),
        ("num_experts", num_experts),
        ("num_layers", num_layers),
    ):
        _positive_int(who, name, value)
    n = axis_size(mesh, expert_axis, who, "expert")
    batch_axis = expert_axis if batch_axis is None else batch_axis
    shards = axis_size(mesh, batch_axis, who, "batch")
    if groups % shards:
        raise ValueError(
            f"{who}: groups={groups} do not split over the {shards} devices of the batch axes {batch_axis!r}; "
            f"use a multiple of {shards}."
        )
    if num_experts % n:
        raise ValueError(
            f"{who}: num_experts={num_experts} do not split over the {n} devices of the expert axis "
            f"{expert_axis!r}; use a multiple of {n}."
        )
    axes = report_axes(expert_axis, mesh, who)
    buffer = num_experts * (groups // shards) * capacity * dim * np.dtype(dtype).itemsize * num_layers
    return CommTheory(
        theory_term("all-to-all", axes, buffer, "forward: tokens to their experts (E x groups x capacity x dim)")
        + theory_term("all-to-all", axes, buffer, "forward: the experts' outputs back")
        + theory_term("all-to-all", axes, buffer, "backward: the outputs' cotangents to the experts")
        + (theory_term("all-to-all", axes, buffer, "backward: the inputs' cotangents back") if input_grad else ())
    )
