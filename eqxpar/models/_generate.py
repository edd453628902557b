"""Sampling from a GPT or a Llama: whole-vocabulary logits and a token-by-token loop."""

from __future__ import annotations

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

from .._shard_map import filter_shard_map
from ._gpt import GPT
from ._llama import Llama

__all__ = ["generate", "whole_logits"]


def generate(
    logits_fn: Callable[[Int[Array, "1 context"]], Float[Array, "1 context vocab"]],
    prompt: Int[np.ndarray, " prompt"],
    num_tokens: int,
    *,
    context_length: int,
    key: PRNGKeyArray,
    temperature: float = 1.0,
) -> np.ndarray:
    """Sample a continuation of `prompt` one token at a time.

    Every call of `logits_fn` sees the same shape, `(1, context_length)` (the last tokens,
    padded on the right, which a causal model ignores), so it compiles once.

    **Arguments:**

    - `logits_fn`: whole-vocabulary logits for a batch of one window, e.g.
      [`eqxpar.models.whole_logits`][]. Logits of `-inf` (a GPT's vocabulary padding) are
      never sampled.
    - `prompt`: the starting token ids (at least one).
    - `num_tokens`: how many tokens to add.
    - `context_length`: the window the model sees.
    - `key`: the sampling key.
    - `temperature`: divides the logits; lower is greedier.

    **Returns:**

    The prompt followed by the sampled tokens, as a NumPy int32 array.
    """
    tokens = [int(t) for t in np.asarray(prompt).reshape(-1)]
    if not tokens:
        raise ValueError("generate: the prompt needs at least one token.")
    for step_key in jax.random.split(key, num_tokens):
        window = tokens[-context_length:]
        padded = np.zeros((1, context_length), np.int32)
        padded[0, : len(window)] = window
        logits = logits_fn(jnp.asarray(padded))[0, len(window) - 1]
        tokens.append(int(jax.random.categorical(step_key, logits / temperature)))
    return np.asarray(tokens, np.int32)


def whole_logits(
    model: GPT | Llama, mesh: Mesh, specs: PyTree
) -> Callable[[Int[Array, "batch seq"]], Float[Array, "batch seq vocab"]]:
    """A function from token windows to whole-vocabulary logits, for [`eqxpar.models.generate`][].

    It runs `model` in inference mode inside `shard_map` and assembles the vocabulary blocks
    of the model axis side by side (the only place the whole logits exist: sampling needs
    them, training never does). Other mesh axes hold copies.

    **Arguments:**

    - `model`: a [`eqxpar.models.GPT`][] or [`eqxpar.models.Llama`][] placed on `mesh`
      with `specs`.
    - `mesh`: the device mesh (it must have the model's axis).
    - `specs`: the model's spec tree, e.g. `eqxpar.nn.partition_specs(model, mesh)`.

    **Returns:**

    `logits_fn(tokens) -> logits`, `(batch, seq)` ids to `(batch, seq, vocab_size)` (the
    real vocabulary, without the padding ids), compiled once per shape.
    """
    if isinstance(model, GPT):
        vocab_size = model.vocab_size
        forward = lambda m, tokens: m(tokens, inference=True)  # noqa: E731  (dropout off)
    elif isinstance(model, Llama):
        vocab_size = model.config.vocab_size
        forward = lambda m, tokens: m(tokens)  # noqa: E731  (no dropout to turn off)
    else:
        raise ValueError(f"whole_logits: model must be an eqxpar.models.GPT or Llama, got {type(model).__name__}.")
    fn = eqx.filter_jit(
        filter_shard_map(
            forward,
            mesh=mesh,
            in_specs=(specs, PartitionSpec()),
            out_specs=PartitionSpec(None, None, model.axis_name),
        )
    )

    def logits_fn(tokens):
        return fn(model, tokens)[..., :vocab_size]  # the padding ids' columns dropped

    return logits_fn
