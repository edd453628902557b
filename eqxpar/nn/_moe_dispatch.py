"""Moving tokens to experts and back on one device: capacity buffers, and the dropless path.

**Capacity buffers** (fixed size, what an `all_to_all` can send). In one routing group of
`T` tokens each expert has `capacity` slots. The group's `T * k` choices claim slots in a
fixed priority order: **all first choices, in token order, then all second choices, in
token order, and so on** (a token's best expert before anyone's second-best, as in
GShard). A choice that finds its expert's slots full is **dropped**: that expert's output
is left out of the token's sum (the token keeps its other experts, and the residual
stream around the layer keeps the token). `capacity_slots` numbers the slots,
`dispatch` writes the tokens into an `(experts, capacity, dim)` buffer, `combine` reads the
experts' outputs back and sums each token's weighted choices.

**Dropless, grouped** (`ragged_experts`): every choice is kept. The `T * k` rows are
sorted by expert (stable: ties in the priority order above) and each expert's SwiGLU runs
on its contiguous rows with `jax.lax.ragged_dot` (group sizes: the tokens per expert);
the rows are then put back in order and combined. No buffer, no padding, no wasted FLOPs.

Also here: `expert_capacity` (the slots formula) and the layer's option checks.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

__all__ = ["expert_capacity"]

DROPLESS_IMPLS = ("ragged_dot", "dense")
SCORE_FUNCTIONS = ("softmax", "sigmoid")


def expert_capacity(tokens: int, num_experts: int, top_k: int, capacity_factor: float | None) -> int:
    """The slots each expert has in a routing group: `ceil(capacity_factor * tokens * top_k
    / num_experts)`, at most `tokens` (no expert can receive a token twice, so more slots
    would stay empty). `capacity_factor=None` (dropless) gives the bound `tokens`.

    **Arguments:**

    - `tokens`: the tokens in one routing group.
    - `num_experts`, `top_k`: the layer's experts, and how many each token chooses.
    - `capacity_factor`: a positive number (1.0: exactly the uniform load), or None.

    **Returns:**

    The capacity, an `int` between 1 and `tokens`.

    **Raises:**

    - `ValueError` for a size that is not a positive integer, a `top_k` above
      `num_experts`, or a `capacity_factor` that is not a positive finite number.
    """
    who = "expert_capacity"
    for name, value in (("tokens", tokens), ("num_experts", num_experts), ("top_k", top_k)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{who}: {name} must be a positive integer, got {value!r}.")
    if top_k > num_experts:
        raise ValueError(f"{who}: top_k={top_k} is more than num_experts={num_experts}; choose top_k <= num_experts.")
    if capacity_factor is None:
        return int(tokens)
    if (
        isinstance(capacity_factor, bool)
        or not isinstance(capacity_factor, (int, float))
        or not math.isfinite(capacity_factor)
        or capacity_factor <= 0
    ):
        raise ValueError(
            f"{who}: capacity_factor must be a positive finite number (e.g. 1.25), or None for the "
            f"dropless path; got {capacity_factor!r}."
        )
    return int(min(tokens, math.ceil(capacity_factor * tokens * top_k / num_experts)))


def choice_major(a: Array) -> Array:
    """`(tokens, k, ...)` -> `(k * tokens, ...)`, all first choices first: the priority order."""
    return jnp.swapaxes(a, 0, 1).reshape(-1, *a.shape[2:])


def capacity_slots(
    experts: Int[Array, "tokens k"], num_experts: int, capacity: int
) -> tuple[Int[Array, " choices"], Int[Array, " choices"], Bool[Array, " choices"]]:
    """For each of the group's `k * tokens` choices, in priority order: its expert, its
    slot in that expert's buffer (the number of earlier choices of the same expert), and
    whether the slot is within `capacity` (kept) or not (dropped)."""
    expert = choice_major(experts)
    claims = jax.nn.one_hot(expert, num_experts, dtype=jnp.int32)
    earlier = jnp.cumsum(claims, axis=0) - claims
    slot = jnp.sum(earlier * claims, axis=-1)
    return expert, slot, slot < capacity


def dispatch(
    x: Float[Array, "tokens dim"],
    expert: Int[Array, " choices"],
    slot: Int[Array, " choices"],
    num_experts: int,
    capacity: int,
) -> Float[Array, "experts capacity dim"]:
    """The group's tokens written into each expert's slots; empty slots are zeros and
    dropped choices (slot >= capacity) are not written."""
    k = expert.shape[0] // x.shape[0]
    rows = jnp.tile(x, (k, 1))
    buffer = jnp.zeros((num_experts, capacity, x.shape[-1]), x.dtype)
    return buffer.at[expert, slot].add(rows, mode="drop")


def combine(
    buffer: Float[Array, "experts capacity dim"],
    expert: Int[Array, " choices"],
    slot: Int[Array, " choices"],
    kept: Bool[Array, " choices"],
    weights: Float[Array, "tokens k"],
) -> Float[Array, "tokens dim"]:
    """Each token's output: the sum over its kept choices of weight times the expert's
    output in the choice's slot."""
    tokens, k = weights.shape
    picked = buffer.at[expert, slot].get(mode="fill", fill_value=0)
    scale = jnp.where(kept, choice_major(weights), 0.0).astype(buffer.dtype)
    return jnp.sum((picked * scale[:, None]).reshape(k, tokens, -1), axis=0)


def swiglu(
    x: Float[Array, "experts rows dim"],
    gate: Float[Array, "experts dim hidden"],
    up: Float[Array, "experts dim hidden"],
    down: Float[Array, "experts hidden dim"],
) -> Float[Array, "experts rows dim"]:
    """Every expert's SwiGLU on its own rows: `(silu(x W_gate) * (x W_up)) W_down`."""
    hidden = jax.nn.silu(jnp.einsum("esd,edh->esh", x, gate)) * jnp.einsum("esd,edh->esh", x, up)
    return jnp.einsum("esh,ehd->esd", hidden, down)


def ragged_experts(
    x: Float[Array, "tokens dim"],
    experts: Int[Array, "tokens k"],
    weights: Float[Array, "tokens k"],
    gate: Float[Array, "experts dim hidden"],
    up: Float[Array, "experts dim hidden"],
    down: Float[Array, "experts hidden dim"],
) -> Float[Array, "tokens dim"]:
    """The dropless path: every choice's row sorted by expert, each expert's SwiGLU on its
    contiguous rows (`jax.lax.ragged_dot`), the rows put back and combined."""
    tokens, k = experts.shape
    num_experts = gate.shape[0]
    expert = choice_major(experts)
    order = jnp.argsort(expert, stable=True)
    sizes = jnp.bincount(expert, length=num_experts).astype(jnp.int32)
    rows = jnp.tile(x, (k, 1))[order]
    hidden = jax.nn.silu(jax.lax.ragged_dot(rows, gate, sizes)) * jax.lax.ragged_dot(rows, up, sizes)
    out = jax.lax.ragged_dot(hidden, down, sizes)
    out = jnp.zeros_like(out).at[order].set(out)  # back to priority order
    scale = choice_major(weights).astype(out.dtype)
    return jnp.sum((out * scale[:, None]).reshape(k, tokens, -1), axis=0)


def check_moe_options(dim, hidden_size, num_experts, top_k, score, capacity_factor, dropless_impl) -> None:
    """The MixtureOfExperts constructor's checks: a `ValueError` naming the option and the fix."""
    who = "MixtureOfExperts"
    for name, value in (("dim", dim), ("hidden_size", hidden_size), ("num_experts", num_experts)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{who}: {name} must be a positive integer, got {value!r}.")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= num_experts:
        raise ValueError(
            f"{who}: top_k={top_k!r}, but each token chooses between 1 and num_experts={num_experts} "
            f"experts; choose top_k in 1..{num_experts} (or more experts)."
        )
    if score not in SCORE_FUNCTIONS:
        raise ValueError(f"{who}: score must be one of {SCORE_FUNCTIONS}, got {score!r}.")
    if capacity_factor is not None and (
        isinstance(capacity_factor, bool)
        or not isinstance(capacity_factor, (int, float))
        or not math.isfinite(capacity_factor)
        or capacity_factor <= 0
    ):
        raise ValueError(
            f"{who}: capacity_factor={capacity_factor!r}; it must be a positive finite number (1.0 gives "
            f"each expert exactly its share of the tokens, 1.25 is usual), or None for the dropless path."
        )
    if dropless_impl not in DROPLESS_IMPLS:
        raise ValueError(f"{who}: dropless_impl must be one of {DROPLESS_IMPLS}, got {dropless_impl!r}.")
