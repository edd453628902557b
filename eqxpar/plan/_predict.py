"""What a layout costs, from eqxpar's exact theories: collective bytes per (kind, axes),
bytes per device (parameters, optimizer state, saved activations, temporaries) and FLOPs,
put into a roofline step time."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec

from ..inspect import CommTheory, TheoryTerm, context_parallel_theory, data_parallel_theory, fsdp_theory
from ..models import GPT, gpt_activation_theory, gpt_flops_per_token, gpt_tensor_parallel_theory
from ..nn import StackedLayers, partition_specs
from ..train import fsdp_specs, optimizer_specs
from ._abstract import AXES
from ._candidates import Layout
from ._cluster import Cluster, Link

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


# The batch is split over both: `data` copies the parameters, `fsdp` slices them.
BATCH_AXES = ("data", "fsdp")


def clear_caches() -> None:
    """Forget the specs, optimizer layouts and leaf tables kept by object id (one plan
    call's worth: `eqxpar.plan.plan` clears them when it starts)."""
    for cache in (_SPECS, _OPTIMIZER, _LEAVES):
        cache.clear()


def layout_specs(gpt: GPT, mesh: Mesh, layout: Layout) -> Any:
    """The parameters' specs the layout's step uses: the GPT's tensor-parallel specs, and
    with `fsdp > 1` [`eqxpar.train.fsdp_specs`][] over `fsdp` on top (as `fsdp_step`'s default).
    Cached per GPT and (fsdp, model) sizes: nothing else changes them."""
    return _specs(gpt, layout.fsdp, layout.model, mesh)


_SPECS: dict[tuple, Any] = {}


def _specs(gpt: GPT, fsdp: int, model: int, mesh: Mesh) -> Any:
    key = (id(gpt), fsdp, model)
    if key not in _SPECS:
        specs = partition_specs(gpt)
        if fsdp > 1:
            specs = fsdp_specs(gpt, mesh, batch_axis="fsdp", param_specs=specs)
        _SPECS[key] = (gpt, specs)  # the GPT kept alive with its id
    return _SPECS[key][1]


def attention_of(gpt: GPT) -> Any:
    """The attention of the (stacked) GPT's blocks."""
    blocks = gpt.blocks
    return blocks.layers.attention if isinstance(blocks, StackedLayers) else blocks[0].attention


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


def block_bytes(
    tree: Any,
    specs: Any,
    sizes: dict[str, int],
    *,
    split_only: bool = False,
    dtype: Any = None,
    floating_only: bool = True,
) -> int:
    """Bytes of one device's blocks of `tree`'s floating-point arrays (every array with
    `floating_only=False`: an optimizer's step counts too) laid out by `specs` (with
    `split_only`, only those split over `fsdp`; with `dtype`, as if in that dtype)."""
    total = 0
    for shape, itemsize, dims in _leaf_table(tree, specs, floating_only):
        if split_only and not any("fsdp" in axes for axes in dims):
            continue
        blocks = [size // math.prod(sizes[a] for a in axes) for size, axes in zip(shape, dims)]
        total += math.prod(blocks) * (np.dtype(dtype).itemsize if dtype is not None else itemsize)
    return total


_LEAVES: dict[tuple[int, int, bool], Any] = {}


def _leaf_table(tree: Any, specs: Any, floating_only: bool) -> list[tuple[tuple[int, ...], int, list[tuple[str, ...]]]]:
    """(shape, itemsize, the axes splitting each dimension) of every floating-point leaf
    (every array leaf without `floating_only`), once per (tree, specs) pair."""
    key = (id(tree), id(specs), floating_only)
    if key not in _LEAVES:
        table = []
        spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        for leaf, spec in zip(jax.tree.leaves(tree), spec_leaves, strict=True):
            if not hasattr(leaf, "dtype") or (floating_only and not np.issubdtype(leaf.dtype, np.inexact)):
                continue
            entries = tuple(spec) + (None,) * (len(leaf.shape) - len(spec))
            dims = [() if e is None else ((e,) if isinstance(e, str) else tuple(e)) for e in entries]
            table.append((tuple(leaf.shape), np.dtype(leaf.dtype).itemsize, dims))
        _LEAVES[key] = (tree, specs, table)  # the tree and specs kept alive with their ids
    return _LEAVES[key][2]


@dataclasses.dataclass(frozen=True)
class Memory:
    """Predicted bytes per device: `parameters` and `optimizer_state` (exact: the blocks
    their specs give), `saved_activations` (the GPT's activation theory: exact for
    `block`/`save_matmuls`, a lower bound for `none`), `temporaries` (an estimate: see
    [`eqxpar.plan.plan`][])."""

    parameters: int
    optimizer_state: int
    saved_activations: int
    temporaries: int
    saved_per_block: int = 0
    """Of `saved_activations`, what one more block adds (exact for `block`/`save_matmuls`
    outside FSDP: see [`eqxpar.models.gpt_activation_theory`][])."""

    @property
    def state(self) -> int:
        return self.parameters + self.optimizer_state

    @property
    def peak(self) -> int:
        return self.parameters + self.optimizer_state + self.saved_activations + self.temporaries


def memory(
    gpt: GPT,
    mesh: Mesh,
    layout: Layout,
    specs: Any,
    optimizer: optax.GradientTransformation,
    batch: int,
    seq: int,
    dtype: Any,
    fused_attention: bool = False,
) -> Memory:
    """Bytes per device of the layout's step (see [`eqxpar.plan.Memory`][])."""
    sizes = layout.sizes
    params = block_bytes(gpt, specs, sizes)
    opt_shapes, opt_specs = optimizer_layout(gpt, optimizer, specs)
    opt = block_bytes(opt_shapes, opt_specs, sizes, floating_only=False)
    context_axis = "context" if layout.context > 1 else None
    activations = gpt_activation_theory(
        gpt, mesh, batch, seq, batch_axis=BATCH_AXES, context_axis=context_axis, dtype=dtype
    )
    saved, per_block = activations.total, activations.per_block
    if fused_attention and layout.remat == "none" and layout.attention == "dot_product":
        # A fused kernel (cuDNN's flash attention) keeps its float32 log-sum-exp per query,
        # not the probabilities the theory counts for XLA's attention.
        block = attention_of(gpt)
        tokens = batch // layout.batch_shards * seq
        probabilities = sum(t.nbytes for t in activations.terms if t.what == "attention probabilities")
        per_block += tokens * (block.num_heads // layout.model) * 4 - probabilities
        saved += gpt.num_layers * (tokens * (block.num_heads // layout.model) * 4 - probabilities)
    weights = 0
    if layout.fsdp > 1 and layout.remat != "none":
        # Under FSDP each block's backward pass reads its gathered weights: autodiff keeps
        # them with the block's residuals (the same buffers the temporaries count as the
        # gathered parameters, so they move from there to here).
        weights = _gathered_block_weights(gpt, specs, layout.sizes)
        per_block += weights
        saved += gpt.num_layers * weights
    temporaries = _temporaries(gpt, layout, specs, params, activations, dtype, batch, seq)
    return Memory(params, opt, saved, temporaries - gpt.num_layers * weights, per_block)


# The blocks' parameters a block's backward pass does not read (each only shifts an output
# whose gradient is the incoming one): what autodiff does not keep from the gathered weights.
UNREAD_BIASES = (
    ".attention.query_proj.bias",
    ".attention.key_proj.bias",
    ".attention.value_proj.bias",
    ".attention.output_proj.bias",
    ".mlp.output.bias",
)


def _gathered_block_weights(gpt: GPT, specs: Any, sizes: dict[str, int]) -> int:
    """Bytes of one block's gathered weights (its model-axis blocks) that its backward pass
    reads: every array of the block but `UNREAD_BIASES`."""
    whole = {**sizes, "fsdp": 1}
    paths = jax.tree_util.tree_leaves_with_path(gpt.blocks)
    spec_leaves = jax.tree.leaves(specs.blocks, is_leaf=lambda x: isinstance(x, PartitionSpec))
    total = 0
    for (path, leaf), spec in zip(paths, spec_leaves, strict=True):
        name = jax.tree_util.keystr(path)
        if not hasattr(leaf, "dtype") or not np.issubdtype(leaf.dtype, np.inexact) or name.endswith(UNREAD_BIASES):
            continue
        entries = tuple(spec) + (None,) * (leaf.ndim - len(spec))
        shape = [
            size // math.prod(whole[a] for a in (() if e is None else (e,) if isinstance(e, str) else e))
            for size, e in zip(leaf.shape, entries)
        ]
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total // gpt.num_layers


_OPTIMIZER: dict[tuple, Any] = {}


def optimizer_layout(gpt: GPT, optimizer: Any, specs: Any) -> tuple[Any, Any]:
    """The optimizer state's shapes (once per GPT and optimizer) and specs
    (`eqxpar.train.optimizer_specs`, once per parameter specs too: they are cached)."""
    shapes_key = (id(gpt), id(optimizer))
    if shapes_key not in _OPTIMIZER:
        _OPTIMIZER[shapes_key] = (gpt, optimizer, jax.eval_shape(optimizer.init, _floating(gpt)))
    shapes = _OPTIMIZER[shapes_key][2]
    key = (id(gpt), id(optimizer), id(specs))
    if key not in _OPTIMIZER:
        _OPTIMIZER[key] = (gpt, optimizer, specs, optimizer_specs(optimizer, shapes, gpt, specs))
    return shapes, _OPTIMIZER[key][-1]


def _floating(gpt: GPT) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(gpt)
    return jax.tree_util.tree_unflatten(
        treedef,
        [
            jax.ShapeDtypeStruct(x.shape, x.dtype)
            if hasattr(x, "dtype") and np.issubdtype(x.dtype, np.inexact)
            else None
            for x in leaves
        ],
    )


# The estimate of XLA's temporaries, calibrated on measured steps (docs/concepts/planner.md):
# the gradients (one copy of this device's parameter blocks), the parameters cast to the
# compute dtype when it differs, under FSDP the gathered parameters and their gradient
# before the reduce-scatter (the model-axis blocks, in the parameters' dtype), one float32
# buffer of the logits (this device's tokens times its vocabulary block: the
# cross-entropy's working set) and the working set of the block being computed, taken as
# WORKING_SET_BLOCKS blocks' saved activations.
WORKING_SET_BLOCKS = 2


def _temporaries(
    gpt: GPT, layout: Layout, specs: Any, params: int, activations: Any, dtype: Any, batch: int, seq: int
) -> int:
    sizes = layout.sizes
    param_dtype = gpt.position_embedding.weight.dtype
    total = params  # gradients
    if np.dtype(dtype) != np.dtype(param_dtype):
        total += block_bytes(gpt, specs, sizes, dtype=dtype)
    if layout.fsdp > 1:
        # The gathered parameters, and their gradient whole before its reduce-scatter.
        total += 2 * block_bytes(gpt, specs, {**sizes, "fsdp": 1}) - params
    tokens = batch // layout.batch_shards * (seq // layout.context)
    total += tokens * (gpt.padded_vocab_size // layout.model) * 4
    total += WORKING_SET_BLOCKS * activations.per_block
    return int(total)


def flops_per_device(gpt: GPT, layout: Layout, batch: int, seq: int) -> float:
    """The FLOPs one device executes in a step: the model FLOPs (`6 N + 12 L T d` per
    token, with the vocabulary padding the program multiplies) over the devices, plus what
    remat recomputes: the blocks' forward pass for `block`, the attention's forward
    (`4 L T d` per token) for `save_matmuls`."""
    devices = math.prod(layout.sizes.values())
    train, forward, attention_forward, head_forward = flops_per_token(gpt, seq)
    recompute = {"none": 0, "save_matmuls": attention_forward, "block": forward - head_forward}[layout.remat]
    return (train + recompute) * batch * seq / devices


_FLOPS: dict[tuple, tuple[int, int, int, int]] = {}


def flops_per_token(gpt: GPT, seq: int) -> tuple[int, int, int, int]:
    """(training, forward, attention forward, head forward) FLOPs per token, once per shape
    (the count unstacks the layers, which is slow for a deep stacked GPT)."""
    block = attention_of(gpt)
    dim = gpt.position_embedding.weight.shape[-1]
    key = (gpt.padded_vocab_size, gpt.vocab_size, dim, gpt.num_layers, block.num_heads, block.qk_size, seq)
    if key not in _FLOPS:
        _FLOPS[key] = (
            gpt_flops_per_token(gpt, seq, count_padding=True),
            gpt_flops_per_token(gpt, seq, backward=False, count_padding=True),
            4 * gpt.num_layers * seq * block.num_heads * block.qk_size,
            2 * gpt.padded_vocab_size * dim,
        )
    return _FLOPS[key]


@dataclasses.dataclass(frozen=True)
class StepTime:
    """A roofline step time in seconds.

    - `compute`: FLOPs / (peak x efficiency).
    - `activation_comm`: the collectives the next layer waits for (everything over `model`;
      the context-parallel attention's permutes, gathers and scatters over `context`), by
      ring bytes / bandwidth of the slowest link crossed + hops x latency.
    - `parameter_comm`: the gradient and parameter collectives (all-reduces over the batch
      axes, FSDP's gathers and scatters over `fsdp`), the same way.
    - `by_link`: communication seconds per link name.
    - `parameter_overlap`: the fraction of `parameter_comm` assumed hidden behind compute
      (the cluster's; 0 by default, see [`eqxpar.plan.Cluster`][]).
    - `bubble`: a pipeline's idle time, `compute x (P-1)/(r M)`: the schedule's ticks are
      `r M + P - 1` and each device works in `r M` of them, so the bubble is
      `(P-1)/(r M + P - 1)` of `compute + bubble` ([`eqxpar.train.bubble_theory`][]). 0
      without a stage axis.

    The bounds: `no_overlap` (everything in sequence) and `overlap` (the largest of compute
    with the bubble and each link's traffic, as if everything overlapped perfectly);
    `expected` (the ranking figure): compute, the bubble, the activation collectives, and
    the parameter collectives less the hidden fraction.
    """

    compute: float
    activation_comm: float
    parameter_comm: float
    by_link: dict[str, float]
    parameter_overlap: float = 0.0
    bubble: float = 0.0

    @property
    def no_overlap(self) -> float:
        return self.compute + self.bubble + self.activation_comm + self.parameter_comm

    @property
    def overlap(self) -> float:
        return max([self.compute + self.bubble, *self.by_link.values()])

    @property
    def expected(self) -> float:
        hidden = min(self.parameter_overlap * self.parameter_comm, self.compute)
        return self.compute + self.bubble + self.activation_comm + self.parameter_comm - hidden


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


def step_time(
    theory: CommTheory, flops: float, layout: Layout, cluster: Cluster, dtype: Any
) -> tuple[StepTime, list[tuple[float, str, tuple[str, ...], int, str]]]:
    """The roofline time of a step, and its collective classes by time (seconds, kind,
    axes, bytes, link name), slowest first."""
    sizes = layout.sizes
    compute = flops / (cluster.flops(dtype) * cluster.efficiency)
    classes = []
    for (kind, axes), nbytes in theory.traffic().items():
        link = cluster.link(axes, sizes)
        classes.append((collective_seconds(kind, axes, nbytes, sizes, link), kind, axes, nbytes, link.name))
    classes.sort(reverse=True)
    activation = sum(s for s, kind, axes, _, _ in classes if not is_parameter_collective(kind, axes))
    parameter = sum(s for s, kind, axes, _, _ in classes if is_parameter_collective(kind, axes))
    by_link: dict[str, float] = {}
    for s, _, _, _, name in classes:
        by_link[name] = by_link.get(name, 0.0) + s
    bubble = 0.0
    if layout.stage > 1:
        bubble = compute * (layout.stage - 1) / (layout.virtual_stages * layout.microbatches)
    return StepTime(compute, activation, parameter, by_link, cluster.parameter_overlap, bubble), classes
