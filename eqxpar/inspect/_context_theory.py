"""Theory for context parallelism: the bytes ring and all-gather attention move per step.

Per attention layer and device, with `C` context shards, a local batch of `B` examples
(the global batch over the batch axes), `L = S / C` positions of each, and `H` key/value
heads (`num_kv_heads` over the model axis: `num_heads` unless the attention sends grouped
keys and values) of `d` dimensions, one device's keys and values are `KV = 2 B L H d`
elements.

- **ring**: `C - 1` collective-permutes forward (each sends this device's current K/V
  block on: `(C - 1) KV`, that is `(C - 1) / C` of the whole sequence's K and V); backward,
  the blocks go around again (`(C - 1) KV`) and their gradients with them, home after `C`
  hops (`C KV` in float32, the dtype the ring accumulates gradients in).
- **all_gather**: one all-gather of K and V forward (`C KV` gathered, by the bytes
  convention: the gathered array) and its transpose, a reduce-scatter of their gradients,
  backward (`C KV` contributed). Over the link, a ring all-gather sends `(C - 1) / C` of
  the gathered array: the ring's forward bytes, in one collective.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from jax.sharding import Mesh

from ._theory import CommTheory, axis_size, theory_term

CONTEXT_MODES = ("ring", "all_gather")


def _positive(who: str, **values: Any) -> None:
    for name, value in values.items():
        if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise ValueError(f"{who}: {name} must be a positive integer, got {value!r}.")


def context_parallel_theory(
    mesh: Mesh,
    *,
    batch: int,
    seq_len: int,
    num_heads: int,
    head_dim: int,
    num_layers: int,
    mode: str = "ring",
    context_axis: str = "context",
    batch_axis: Any = "data",
    model_axis: str | None = None,
    dtype: Any = np.float32,
    remat: bool = False,
    num_kv_heads: int | None = None,
    segment_ids: bool = False,
) -> CommTheory:
    """The attention traffic of a context-parallel train step (forward and backward).

    **Arguments:**

    - `mesh`: the mesh the step runs on.
    - `batch`: the global batch size (examples); `seq_len`: the global sequence length.
    - `num_heads`, `head_dim`, `num_layers`: the attention's shape (keys and values have
      the same head size).
    - `num_kv_heads`: the key/value heads that travel (grouped-query attention that sends
      its keys and values before repeating them to the query heads), a divisor of
      `num_heads`; default `num_heads`.
    - `mode`: `"ring"` or `"all_gather"`.
    - `context_axis`: the axis the sequence is split over.
    - `batch_axis`: the axis (or axes) the batch is split over (None: not split).
    - `model_axis`: the tensor-parallel axis the heads are split over, or None.
    - `dtype`: the dtype of the keys and values.
    - `remat`: the blocks are recomputed in the backward pass (`GPT(remat="block")`): the
      forward's K/V traffic runs once more.
    - `segment_ids`: packed documents: their int32 document ids are all-gathered over the
      context axis once per step (`eqxpar.nn.context_segment_ids`), for every layer.

    **Returns:**

    A [`eqxpar.inspect.CommTheory`][] with collective-permute terms (ring) or all-gather
    and reduce-scatter terms (all-gather) over the context axis.

    **Raises:**

    - `ValueError` for an unknown mode, a missing axis, or sizes that do not split.
    """
    who = "context_parallel_theory"
    if mode not in CONTEXT_MODES:
        raise ValueError(f"{who}: mode must be one of {CONTEXT_MODES}, got {mode!r}.")
    kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    _positive(
        who,
        batch=batch,
        seq_len=seq_len,
        num_heads=num_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        num_layers=num_layers,
    )
    if num_heads % kv_heads:
        raise ValueError(f"{who}: num_kv_heads={kv_heads} must divide num_heads={num_heads}.")
    c = axis_size(mesh, context_axis, who, "context")
    n_batch = 1 if batch_axis is None else axis_size(mesh, batch_axis, who, "batch")
    n_model = 1 if model_axis is None else axis_size(mesh, model_axis, who, "model")
    splits = (
        ("batch", batch, n_batch),
        ("seq_len", seq_len, c),
        ("num_heads", num_heads, n_model),
        ("num_kv_heads", kv_heads, n_model),
    )
    for what, total, parts in splits:
        if total % parts:
            raise ValueError(f"{who}: {what}={total} does not split over {parts} devices.")
    kv = 2 * (batch // n_batch) * (seq_len // c) * (kv_heads // n_model) * head_dim
    item = np.dtype(dtype).itemsize
    axes = (context_axis,) if c > 1 else ()
    ids = (batch // n_batch) * (seq_len // c) * 4 if segment_ids else 0  # one block's int32 segment ids
    documents = theory_term("all-gather", axes, c * ids, "document ids, once per step") if ids and c > 1 else ()
    if mode == "ring":
        forward = num_layers * (c - 1) * kv * item
        return CommTheory(
            theory_term("collective-permute", axes, forward, "ring: K/V blocks, forward")
            + theory_term("collective-permute", axes, forward, "ring: K/V blocks again, backward")
            + theory_term(
                "collective-permute", axes, num_layers * c * kv * 4, "ring: K/V gradients (float32), backward"
            )
            + (theory_term("collective-permute", axes, forward, "ring: forward recomputed (remat)") if remat else ())
            + documents
        )
    gathered = num_layers * c * kv * item
    return CommTheory(
        theory_term("all-gather", axes, gathered, "all-gather of K and V, forward")
        + theory_term("reduce-scatter", axes, gathered, "reduce-scatter of K/V gradients, backward")
        + (theory_term("all-gather", axes, gathered, "all-gather of K and V recomputed (remat)") if remat else ())
        + documents
    )


def sequence_parallel_theory(
    mesh: Mesh,
    *,
    batch: int,
    seq_len: int,
    dim: int,
    num_layers: int,
    batch_axis: Any = "data",
    context_axis: str | None = None,
    model_axis: str = "model",
    dtype: Any = np.float32,
) -> CommTheory:
    """The residual-stream traffic of Megatron sequence parallelism over the model axis.

    Each transformer block has two tensor-parallel regions (attention, MLP). Without SP,
    each ends in an all-reduce of the `(B, L, dim)` activations forward and the input
    gradient's all-reduce backward: `4 B L dim` elements per block. With SP, each region
    begins with an all-gather of the sequence-split activations and ends with a
    reduce-scatter (forward), and the transposes backward: two all-gathers and two
    reduce-scatters of `B L dim` per region and direction. By the bytes convention that is
    twice the all-reduces' count; over each link it is the same bytes (a ring all-reduce
    sends `2 (N - 1) / N` of its array, an all-gather or a reduce-scatter `(N - 1) / N`).
    Parameters used on sequence blocks (biases, layer norms) add an all-reduce of their
    gradients, not counted here
    ([`eqxpar.models.gpt_tensor_parallel_theory`][] adds them for the GPT).

    **Arguments:**

    - `mesh`, `batch`, `seq_len`, `batch_axis`, `context_axis`: as in
      [`eqxpar.inspect.context_parallel_theory`][] (`L` is the sequence per context shard).
    - `dim`, `num_layers`: the residual width and the number of blocks.
    - `model_axis`: the tensor-parallel axis.
    - `dtype`: the activations' dtype.

    **Returns:**

    A [`eqxpar.inspect.CommTheory`][] with all-gather and reduce-scatter terms over the
    model axis.
    """
    who = "sequence_parallel_theory"
    _positive(who, batch=batch, seq_len=seq_len, dim=dim, num_layers=num_layers)
    n_model = axis_size(mesh, model_axis, who, "model")
    n_batch = 1 if batch_axis is None else axis_size(mesh, batch_axis, who, "batch")
    c = 1 if context_axis is None else axis_size(mesh, context_axis, who, "context")
    if batch % n_batch or seq_len % (c * n_model):
        raise ValueError(
            f"{who}: batch={batch} must split over {n_batch} and seq_len={seq_len} over "
            f"{c} context x {n_model} model shards."
        )
    act = (batch // n_batch) * (seq_len // c) * dim * np.dtype(dtype).itemsize
    axes = (model_axis,) if n_model > 1 else ()
    per_direction = 2 * num_layers * act  # two regions per block
    return CommTheory(
        theory_term(
            "all-gather",
            axes,
            2 * per_direction,
            "SP: gather the sequence into each TP region (fwd) and its transpose (bwd)",
        )
        + theory_term(
            "reduce-scatter",
            axes,
            2 * per_direction,
            "SP: scatter each TP region's output (fwd) and its transpose (bwd)",
        )
    )
