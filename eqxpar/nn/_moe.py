"""MixtureOfExperts: a routed SwiGLU layer whose experts can be split over an `expert` axis.

The layer's global form holds every expert (stacked weights); `specs()` splits the stack
over the `expert` mesh axis. Inside `eqxpar.filter_shard_map` each device holds
`num_experts / N` experts and **its own tokens** (the batch split over `expert`, and over
`data` too if the mesh has it). Each device routes its tokens, packs them into one
fixed-size buffer per expert, and one `all_to_all` over `expert` sends every expert's
buffer to the device that holds it; the local experts run on what they received, and a
second `all_to_all` brings the outputs back to the tokens' devices, where each token sums
its experts' outputs. Backward, autodiff transposes each `all_to_all` into the reverse one.

Capacity is per **routing group** (one row of the input's leading dimensions, e.g. one
sequence), never per device: a group's drops depend on its own tokens only, and the batch
is split over devices by whole groups, so the expert-parallel layer equals the layer on
one device (outputs, drops, auxiliary losses, gradients) on any mesh.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, PRNGKeyArray

from .._shard_map import varying_axes
from ._base import TensorParallelLayer, local_block, to_varying
from ._moe_dispatch import (
    capacity_slots,
    check_moe_options,
    combine,
    dispatch,
    expert_capacity,
    ragged_experts,
    swiglu,
)
from ._moe_router import (
    MoEAux,
    choose_experts,
    load_balance_loss,
    router_scores,
    router_z_loss,
    tokens_per_expert,
)

__all__ = ["MixtureOfExperts"]


class MixtureOfExperts(TensorParallelLayer):
    """A mixture of SwiGLU experts with a top-k router, split over an `expert` mesh axis.

    For each token `x` (a row of the input), the router (`router`, a bias-free
    `eqx.nn.Linear` to `num_experts` logits) scores the experts (`softmax` or `sigmoid`),
    the token chooses its `top_k` best, and its output is the sum over its chosen experts
    of score times `(silu(x W_gate[e]) * (x W_up[e])) W_down[e]`. See
    `eqxpar/nn/_moe_router.py` for the router, the balancing losses and the selection bias.

    **Routing groups and capacity.** The input is `(*groups, tokens, dim)`: each row of
    the leading dimensions (e.g. a sequence of a batch) is a routing group. With
    `capacity_factor` set, each expert takes at most
    `C = min(tokens, ceil(capacity_factor * tokens * top_k / num_experts))` of a group's
    choices ([`eqxpar.nn.expert_capacity`][]); the priority is all first choices in
    token order, then all second choices, and so on; a choice over capacity is dropped
    (the token keeps its other experts; `aux.dropped` counts the drops). Buffers have a
    fixed size, `(num_experts, C, dim)` per group. To route over bigger groups, reshape
    the input (e.g. `(batch, seq, dim)` to `(batch // 4, 4 * seq, dim)`). With
    `capacity_factor=None` (dropless) nothing is dropped: on one device the tokens are
    grouped by expert and run with `jax.lax.ragged_dot` (`dropless_impl="ragged_dot"`)
    or in fixed buffers of `C = tokens` (`"dense"`, the fallback); over an expert axis
    the exchange uses the fixed buffers of `C = tokens`, the bound that can never drop.

    **Expert parallelism.** Outside `shard_map` (or in one whose mesh has no `axis_name`
    axis) the layer runs every expert itself. Inside `eqxpar.filter_shard_map` over a mesh
    with an `axis_name` axis of `N` devices, place it with
    `eqxpar.nn.partition_specs(moe, mesh)` (each device holds `num_experts / N` experts;
    router and selection bias replicated) and split the input's groups over `axis_name`
    (and `data`, if any). Each call then runs two explicit `all_to_all`s forward (tokens
    to experts, outputs back) and their two transposes backward: per call and device,
    each sends `num_experts * groups * C * dim` elements
    ([`eqxpar.inspect.expert_parallel_theory`][]). The result equals the one-device
    layer's on any mesh, since a group never spans devices. The step builders train it so
    with `expert_axis=axis_name` ([`eqxpar.train.hybrid_step`][] and the others: the batch
    split over the expert axis too, the experts' gradients summed over the data axes
    only). An input that is the same on every device of the axis (a step without
    `expert_axis`, whose batch is split over `data` only) works too: each device routes
    its block of the groups and an `all_gather` hands every device all outputs (see
    `__call__`), at the price of every expert device repeating the rest of the model's work.

    **Auxiliary-loss-free balancing.** With `balance_bias=True` the layer holds a
    `selection_bias` (zeros, shape `(num_experts,)`), added to the scores for the choice
    only (no gradient flows to it: exclude it from the optimizer, or let it see zero
    gradients); update it between steps with [`eqxpar.nn.update_router_bias`][].
    """

    router: eqx.nn.Linear
    gate: Float[Array, "experts dim hidden"]
    up: Float[Array, "experts dim hidden"]
    down: Float[Array, "experts hidden dim"]
    selection_bias: Float[Array, " experts"] | None
    dim: int = eqx.field(static=True)
    hidden_size: int = eqx.field(static=True)
    num_experts: int = eqx.field(static=True)
    top_k: int = eqx.field(static=True)
    score: str = eqx.field(static=True)
    normalize_weights: bool = eqx.field(static=True)
    capacity_factor: float | None = eqx.field(static=True)
    dropless_impl: str = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)
    model_axis: str | None = eqx.field(static=True)

    def __init__(
        self,
        dim: int,
        hidden_size: int,
        num_experts: int,
        top_k: int = 2,
        *,
        score: str = "softmax",
        normalize_weights: bool = False,
        capacity_factor: float | None = 1.25,
        balance_bias: bool = False,
        dropless_impl: str = "ragged_dot",
        dtype=None,
        axis_name: str = "expert",
        model_axis: str | None = None,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `dim`: the model dimension (the input's and output's last dimension).
        - `hidden_size`: each expert's SwiGLU hidden size.
        - `num_experts`: how many experts.
        - `top_k`: how many experts each token chooses, 1 to `num_experts`.
        - `score`: `"softmax"` (over the experts) or `"sigmoid"` (each expert on its own).
        - `normalize_weights`: divide each token's chosen scores by their sum.
        - `capacity_factor`: the experts' capacity per group, as a multiple of an even
          share (`tokens * top_k / num_experts`); None for the dropless path.
        - `balance_bias`: hold a `selection_bias` for auxiliary-loss-free balancing.
        - `dropless_impl`: the one-device dropless path, `"ragged_dot"` or `"dense"`.
        - `dtype`: the parameters' dtype (default float32). The router computes in float32.
        - `axis_name`: the mesh axis the experts are split over.
        - `model_axis`: a mesh axis to split every expert's hidden units over as well
          (tensor parallelism inside the experts, Megatron-style: `gate`/`up` by columns,
          `down` by rows, one `psum` of the output), or None.
        - `key`: the initialisation key. The router is initialised as `eqx.nn.Linear`; the
          experts' weights uniformly in `+-1/sqrt(fan_in)`, as `eqx.nn.Linear` does.

        **Raises:**

        - `ValueError` for a size that is not a positive integer, `top_k` outside
          `1..num_experts`, a `capacity_factor` that is not a positive finite number (or
          None), or an unknown `score` or `dropless_impl`.
        """
        check_moe_options(dim, hidden_size, num_experts, top_k, score, capacity_factor, dropless_impl)
        dtype = jnp.float32 if dtype is None else dtype
        router_key, gate_key, up_key, down_key = jax.random.split(key, 4)
        self.router = eqx.nn.Linear(dim, num_experts, use_bias=False, dtype=dtype, key=router_key)

        def uniform(k, shape, fan_in):
            limit = 1.0 / math.sqrt(fan_in)
            return jax.random.uniform(k, shape, dtype, minval=-limit, maxval=limit)

        self.gate = uniform(gate_key, (num_experts, dim, hidden_size), dim)
        self.up = uniform(up_key, (num_experts, dim, hidden_size), dim)
        self.down = uniform(down_key, (num_experts, hidden_size, dim), hidden_size)
        self.selection_bias = jnp.zeros((num_experts,), jnp.float32) if balance_bias else None
        self.dim = dim
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.score = score
        self.normalize_weights = normalize_weights
        self.capacity_factor = capacity_factor
        self.dropless_impl = dropless_impl
        self.axis_name = axis_name
        self.model_axis = model_axis

    def specs(self) -> MixtureOfExperts:
        """`gate`, `up`, `down`: `P(axis_name, None, None)` (split by expert; with
        `model_axis`, also `gate`/`up` by hidden columns and `down` by hidden rows); the
        router and the selection bias: `P()` (replicated)."""
        columns = PartitionSpec(self.axis_name, None, self.model_axis)
        rows = PartitionSpec(self.axis_name, self.model_axis, None)
        specs = jax.tree.map(lambda _: PartitionSpec(), self)
        return eqx.tree_at(lambda m: (m.gate, m.up, m.down), specs, (columns, columns, rows))

    def to_dense(self) -> MixtureOfExperts:
        """The layer itself: Equinox has no mixture of experts, and the global form is the
        one-device layer (so [`eqxpar.nn.to_dense`][] leaves it, and its gradients, as they are)."""
        return self

    def check_axis_size(self, size: int, where: str = "") -> None:
        """`ValueError` unless `num_experts` is divisible by `size` (the expert axis size)."""
        if self.num_experts % size:
            raise ValueError(
                f"{self._name(where)}: num_experts={self.num_experts} is not divisible by the size {size} "
                f"of the expert axis {self.axis_name!r}, so the experts cannot be split evenly over its "
                f"devices. Choose num_experts a multiple of {size}, or an expert axis size that divides "
                f"{self.num_experts}."
            )

    def capacity(self, tokens: int) -> int:
        """The slots each expert has in a group of `tokens` tokens (`tokens` when dropless)."""
        return expert_capacity(tokens, self.num_experts, self.top_k, self.capacity_factor)

    def _expert_axis_size(self) -> int | None:
        """The expert axis size while tracing, checked; None where no such axis is bound."""
        try:
            size = jax.lax.axis_size(self.axis_name)
        except NameError:
            return None
        self.check_axis_size(size)
        return size

    def __call__(
        self,
        x: Float[Array, "*groups tokens dim"],
        *,
        input_replicated: bool | None = None,
        key: PRNGKeyArray | None = None,
    ) -> tuple[Float[Array, "*groups tokens dim"], MoEAux]:
        """Route the tokens to their experts and combine the outputs.

        **Arguments:**

        - `x`: the tokens, `(*groups, tokens, dim)`: each row of the leading dimensions is
          one routing group (`(tokens, dim)` is one group). Over an expert axis, either this
          device's own groups (the batch split over the expert axis: the usual expert
          parallelism), or the same groups on every device of the axis (e.g. inside
          `eqxpar.train.data_parallel_step`, whose batch is split over `data` only): then
          each device takes its block of the groups, the experts run as usual, and an
          `all_gather` over the axis returns every group's output and aux to every device
          (forward: that all-gather; backward: an all-reduce of the input's gradient).
        - `input_replicated`: which of the two `x` is; default: read off `x` (JAX tracks
          whether a value varies over the axis; under `check_vma=False` it cannot, and the
          default is then "split": pass `True` for a replicated input).
        - `key`: ignored (the layer draws nothing); accepted so the layer can be called
          like the others.

        **Returns:**

        `(output, aux)`: the output, shaped like `x`, and a [`eqxpar.nn.MoEAux`][] with
        one entry per group of `x`.

        **Raises:**

        - `ValueError`, while tracing, if `x` is not `(*groups, tokens, dim)`, the experts
          do not split over the expert axis, or a replicated input's groups do not.
        """
        del key
        with jax.named_scope(type(self).__name__):
            bound = self._expert_axis_size()
            n = bound or 1
            if x.ndim < 2 or x.shape[-1] != self.dim:
                raise ValueError(
                    f"MixtureOfExperts: x has shape {x.shape}; it must be (*groups, tokens, {self.dim}): "
                    f"a token per row of the last-but-one dimension, dim={self.dim} features."
                )
            groups_shape, tokens = x.shape[:-2], x.shape[-2]
            xg = x.reshape(-1, tokens, self.dim)
            # A replicated input (even over an axis of size 1, where the sharded experts still
            # make the result vary in JAX's eyes) comes back replicated, by the all_gather below.
            if bound is None:
                input_replicated = False
            elif input_replicated is None:
                input_replicated = _replicated_over(x, self.axis_name)
            if input_replicated:
                if xg.shape[0] % n:
                    raise ValueError(
                        f"MixtureOfExperts: the input is the same on every device of the expert axis "
                        f"{self.axis_name!r}, so each of its {n} devices routes a block of the "
                        f"{xg.shape[0]} groups, which do not split; use a multiple of {n} groups, or "
                        f"split the batch over {self.axis_name!r} yourself."
                    )
                xg = local_block(xg, self.axis_name, axis=0)  # no communication
            results = self._route_and_run(xg, n)
            if input_replicated:
                # all_gather: every device's block of groups, in device order, on every device
                # (backward: each device keeps its block of the cotangent; no communication).
                results = jax.lax.all_gather(results, self.axis_name, axis=0, tiled=True, to="invarying")
            y, balance, z_loss, counts, dropped = results
            aux = MoEAux(
                load_balance_loss=balance.reshape(groups_shape),
                z_loss=z_loss.reshape(groups_shape),
                tokens_per_expert=counts.reshape(*groups_shape, self.num_experts),
                dropped=dropped.reshape(groups_shape),
            )
            return y.reshape(x.shape), aux

    def _split_hidden_over(self) -> str | None:
        """The model axis the experts' hidden units are split over here (bound, checked), or None."""
        if self.model_axis is None:
            return None
        try:
            size = jax.lax.axis_size(self.model_axis)
        except NameError:
            return None
        if self.hidden_size % size:
            raise ValueError(
                f"MixtureOfExperts: hidden_size={self.hidden_size} is not divisible by the size {size} of "
                f"the model axis {self.model_axis!r}; choose a multiple of {size}, or model_axis=None."
            )
        return self.model_axis

    def _route_and_run(self, xg: Array, n: int) -> tuple[Array, Array, Array, Array, Array]:
        """(output, balance loss, z-loss, tokens per expert, dropped) of `(groups, tokens, dim)`."""
        model = self._split_hidden_over()
        w_router = self.router.weight.astype(jnp.float32)
        logits = jnp.einsum("gtd,ed->gte", xg.astype(jnp.float32), w_router)
        scores = jax.vmap(router_scores, in_axes=(0, None))(logits, self.score)
        experts, weights = jax.vmap(choose_experts, in_axes=(0, None, None, None))(
            scores, self.top_k, self.selection_bias, self.normalize_weights
        )
        counts = jax.vmap(tokens_per_expert, in_axes=(0, None))(experts, self.num_experts)
        balance = jax.vmap(load_balance_loss, in_axes=(0, 0, None))(scores, counts, self.top_k)
        z_loss = jax.vmap(router_z_loss)(logits)
        # With the hidden units split over the model axis, the experts' input is marked as
        # varying there: its gradient's blocks are added up by a psum over the model axis.
        x_in = xg if model is None else to_varying(xg, model)
        if self.capacity_factor is None and n == 1 and self.dropless_impl == "ragged_dot":
            flat = ragged_experts(
                x_in.reshape(-1, self.dim),
                experts.reshape(-1, self.top_k),
                weights.reshape(-1, self.top_k),
                self.gate,
                self.up,
                self.down,
            )
            y = flat.reshape(xg.shape)
            dropped = jnp.zeros(xg.shape[:1], jnp.int32)
        else:
            y, dropped = self._through_buffers(x_in, experts, weights, n)
        if model is not None:
            # Each model device's hidden block gave a partial output: one all-reduce adds them up.
            y = jax.lax.psum(y, model)
        return y, balance, z_loss, counts, dropped

    def _through_buffers(self, xg: Array, experts: Array, weights: Array, n: int) -> tuple[Array, Array]:
        """Capacity dispatch: fixed-size buffers, over the expert axis when `n > 1`."""
        num_groups, tokens, dim = xg.shape
        num_experts, capacity = self.num_experts, self.capacity(tokens)
        expert, slot, kept = jax.vmap(capacity_slots, in_axes=(0, None, None))(experts, num_experts, capacity)
        buffers = jax.vmap(dispatch, in_axes=(0, 0, 0, None, None))(xg, expert, slot, num_experts, capacity)
        # One row per expert, holding this device's groups' slots side by side: (E, G*C, dim).
        send = jnp.transpose(buffers, (1, 0, 2, 3)).reshape(num_experts, num_groups * capacity, dim)
        if n == 1:
            returned = swiglu(send, self.gate, self.up, self.down)
        else:
            # all_to_all #1, tokens to their experts: split the expert rows into N blocks (block j
            # holds device j's experts) and send block j to device j; the blocks received from the
            # N devices are joined along the slot axis, in device order: (E/N, N*G*C, dim).
            received = jax.lax.all_to_all(send, self.axis_name, split_axis=0, concat_axis=1, tiled=True)
            # The local experts on every device's tokens (empty slots are zeros and give zeros).
            out = swiglu(received, self.gate, self.up, self.down)
            # all_to_all #2, the outputs home: split the slot axis back into the N devices'
            # blocks, send block i to device i, and join what comes back along the expert axis,
            # in device order, so row e is again global expert e: (E, G*C, dim).
            returned = jax.lax.all_to_all(out, self.axis_name, split_axis=1, concat_axis=0, tiled=True)
        outputs = jnp.transpose(returned.reshape(num_experts, num_groups, capacity, dim), (1, 0, 2, 3))
        y = jax.vmap(combine)(outputs, expert, slot, kept, weights)
        dropped = jnp.sum(jnp.logical_not(kept), axis=-1, dtype=jnp.int32)
        return y, dropped


def _replicated_over(x: Array, axis_name: str) -> bool:
    """Whether `x` is the same on every device of `axis_name`, as far as JAX tracks it: a
    value that varies over no axis while JAX does track variation (the axis index varies)."""
    tracked = axis_name in varying_axes(jax.lax.axis_index(axis_name))
    return tracked and axis_name not in varying_axes(x)
