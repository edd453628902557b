"""The router of a mixture-of-experts layer: scores, top-k choice, and the balancing terms.

Everything here acts on one **routing group** (a `(tokens, experts)` array of router
logits): the layer `vmap`s it over its groups. Nothing here communicates.

- **Scores**: `softmax` over the experts (Switch, GShard, Mixtral) or an elementwise
  `sigmoid` (DeepSeek-V3).
- **Choice**: each token takes the `k` experts with the highest scores (ties to the lower
  expert index, as `jax.lax.top_k`). An optional per-expert **selection bias** is added to
  the scores for the choice only (auxiliary-loss-free balancing, DeepSeek-V3): it moves
  tokens between experts without entering the weights or the gradient; it is trained
  outside the gradient by [`eqxpar.nn.update_router_bias`][].
- **Weights**: each chosen expert's output is scaled by its score, optionally
  renormalised over the `k` chosen experts to sum to one.
- **Load-balancing loss** (Switch/GShard form): `E * sum_e f_e * P_e`, with `f_e` the
  share of the group's `tokens * k` choices that went to expert `e` (counted before any
  capacity drop) and `P_e` the mean over the group's tokens of expert `e`'s score
  normalised over the experts (the softmax probability itself; for sigmoid scores,
  `s_e / sum_j s_j`). It is 1 when the load is uniform.
- **Router z-loss** (ST-MoE): the mean over the group's tokens of
  `logsumexp(logits)^2`, which keeps the logits small.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

__all__ = ["MoEAux", "update_router_bias"]


class MoEAux(eqx.Module):
    """What a [`eqxpar.nn.MixtureOfExperts`][] call reports beside its output, one value per
    routing group (the input's leading dimensions `*groups`; scalars for a single group).

    Add the losses to the training loss with your own coefficients, e.g.
    `loss + 1e-2 * aux.load_balance_loss.mean() + 1e-3 * aux.z_loss.mean()`.
    """

    load_balance_loss: Float[Array, "*groups"]
    """`E * sum_e f_e * P_e` (Switch/GShard): 1 for a uniform load, up to `E` for all on one."""
    z_loss: Float[Array, "*groups"]
    """The router z-loss: the mean over the group's tokens of `logsumexp(logits)^2`."""
    tokens_per_expert: Int[Array, "*groups experts"]
    """How many of the group's `tokens * top_k` choices went to each expert, before any drop
    (the load [`eqxpar.nn.update_router_bias`][] balances)."""
    dropped: Int[Array, "*groups"]
    """How many of the group's choices found their expert full and were dropped (0 dropless)."""


def router_scores(logits: Float[Array, "tokens experts"], score: str) -> Float[Array, "tokens experts"]:
    """The routing scores of one group's logits (float32)."""
    logits = logits.astype(jnp.float32)
    if score == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    return jax.nn.sigmoid(logits)


def choose_experts(
    scores: Float[Array, "tokens experts"],
    k: int,
    bias: Float[Array, " experts"] | None,
    normalize: bool,
) -> tuple[Int[Array, "tokens k"], Float[Array, "tokens k"]]:
    """Each token's `k` experts (best first) and their weights.

    The bias (if any) is added for the choice only and carries no gradient; the weights
    are the unbiased scores of the chosen experts, divided by their sum if `normalize`.
    """
    selection = scores
    if bias is not None:
        selection = scores + jax.lax.stop_gradient(bias.astype(scores.dtype)).reshape(1, -1)
    _, experts = jax.lax.top_k(selection, k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return experts.astype(jnp.int32), weights


def tokens_per_expert(experts: Int[Array, "tokens k"], num_experts: int) -> Int[Array, " experts"]:
    """How many of the group's `tokens * k` choices went to each expert (before capacity)."""
    return jnp.sum(jax.nn.one_hot(experts.reshape(-1), num_experts, dtype=jnp.int32), axis=0)


def load_balance_loss(
    scores: Float[Array, "tokens experts"], counts: Int[Array, " experts"], k: int
) -> Float[Array, ""]:
    """`E * sum_e f_e * P_e` for one group (see the module docstring); `f_e` carries no
    gradient (it is a count), the gradient flows through `P_e`."""
    tokens, num_experts = scores.shape
    fraction = counts.astype(jnp.float32) / float(tokens * k)
    probabilities = scores / jnp.sum(scores, axis=-1, keepdims=True)
    mean_probability = jnp.mean(probabilities, axis=0)
    return float(num_experts) * jnp.sum(fraction * mean_probability)


def router_z_loss(logits: Float[Array, "tokens experts"]) -> Float[Array, ""]:
    """The mean over the group's tokens of `logsumexp(logits)^2`."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)))


def update_router_bias(
    bias: Float[Array, " experts"],
    tokens_per_expert: Int[Array, "*groups experts"],
    rate: float,
) -> Float[Array, " experts"]:
    """One step of auxiliary-loss-free load balancing (DeepSeek-V3): the new selection bias.

    Each expert's bias moves by `rate` towards balance: up for an expert that received
    fewer tokens than the mean over the experts, down for one that received more,
    unchanged for one at the mean (`bias + rate * sign(mean_load - load)`). Call it outside
    the gradient, after a step, with the `tokens_per_expert` the layer reported (any
    leading dimensions, e.g. one row per routing group, are summed), and put the result
    back into the layer:

    ```python
    bias = eqxpar.nn.update_router_bias(moe.selection_bias, aux.tokens_per_expert, 1e-3)
    moe = eqx.tree_at(lambda m: m.selection_bias, moe, bias)
    ```

    **Arguments:**

    - `bias`: the layer's current `selection_bias`, shape `(experts,)`.
    - `tokens_per_expert`: the routed token counts, shape `(*groups, experts)`.
    - `rate`: the step size (DeepSeek-V3 uses 1e-3), a non-negative number.

    **Returns:**

    The updated bias, same shape and dtype as `bias`.

    **Raises:**

    - `ValueError` if the shapes disagree or `rate` is negative.
    """
    if bias.ndim != 1:
        raise ValueError(f"update_router_bias: bias must have shape (experts,), got {bias.shape}.")
    if tokens_per_expert.ndim < 1 or tokens_per_expert.shape[-1] != bias.shape[0]:
        raise ValueError(
            f"update_router_bias: tokens_per_expert has shape {tokens_per_expert.shape}, but its last "
            f"dimension must be the {bias.shape[0]} experts of bias; pass the layer's aux.tokens_per_expert."
        )
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or rate < 0:
        raise ValueError(f"update_router_bias: rate must be a non-negative number (e.g. 1e-3), got {rate!r}.")
    load = jnp.sum(tokens_per_expert.reshape(-1, bias.shape[0]).astype(jnp.float32), axis=0)
    step = jnp.sign(jnp.mean(load) - load) * float(rate)
    return (bias.astype(jnp.float32) + step).astype(bias.dtype)
