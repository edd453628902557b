"""`Stages`: a model cut into the three parts a pipeline needs, and the GPT's cut."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PyTree

__all__ = ["Stages", "gpt_stages", "layer_key"]


def layer_key(key: Any, index: Any) -> Any:
    """The key of part `index` of one micro-batch's pass (0: `first`, `1 + l`: layer `l`,
    `num_layers + 1`: `last`), or None without a key."""
    return None if key is None else jax.random.fold_in(key, index)


@dataclasses.dataclass(frozen=True)
class Stages:
    """A model as a pipeline sees it: a first part, a stack of identical layers, a last part.

    - `first(model, micro_batch, key) -> x`: e.g. the embedding; runs on the first stage.
    - `layers(model) -> node`: the stacked layers, a PyTree whose every array has a leading
      layer axis (e.g. `lambda m: m.blocks.layers` for an [`eqxpar.nn.StackedLayers`][]).
      The pipeline splits that axis over the stage axis.
    - `layer(layer, x, key) -> x`: one layer (the node with one slice of every array).
    - `last(model, x, micro_batch, key) -> loss`: e.g. the head and the mean loss over the
      micro-batch; runs on the last stage.

    `first` and `last` may use every array of the model except the stacked layers; `x`
    must have the same shape and dtype after every layer. [`eqxpar.train.Stages.loss`][]
    is the same computation on one device, the reference the pipeline matches.
    """

    first: Callable[..., PyTree]
    layers: Callable[[PyTree], PyTree]
    layer: Callable[..., PyTree]
    last: Callable[..., Array]

    def num_layers(self, model: PyTree) -> int:
        """The length of the stacked layers' leading axis (a `ValueError` if they differ)."""
        sizes = {x.shape[0] if x.ndim else None for x in jax.tree.leaves(eqx.filter(self.layers(model), eqx.is_array))}
        if len(sizes) != 1 or None in sizes:
            raise ValueError(
                f"Stages.layers(model) must be a PyTree whose arrays all have one leading layer "
                f"axis of the same length; got leading sizes {sorted(map(str, sizes))}."
            )
        return sizes.pop()

    def run_layers(self, layers: PyTree, x: PyTree, key: Any, first_index: Any) -> PyTree:
        """Run stacked `layers` in order with `jax.lax.scan`; layer `j` gets the key of
        global layer `first_index + j`."""
        dynamic, static = eqx.partition(layers, eqx.is_array)
        count = jax.tree.leaves(dynamic)[0].shape[0]

        def body(x, inputs):
            arrays, j = inputs
            return self.layer(eqx.combine(arrays, static), x, layer_key(key, 1 + first_index + j)), None

        x, _ = jax.lax.scan(body, x, (dynamic, jnp.arange(count)))
        return x

    def loss(self, model: PyTree, batch: PyTree, key: Any = None) -> Array:
        """The loss on one device, layer after layer: `loss_fn(model, batch, key)` for the
        one-device builders (the pipeline's reference).

        **Arguments:**

        - `model`: the whole model.
        - `batch`: one (micro-)batch.
        - `key`: a PRNG key or None.

        **Returns:**

        `last(model, layers(...first(model, batch)...), batch)`.
        """
        n = self.num_layers(model)
        x = self.first(model, batch, layer_key(key, 0))
        x = self.run_layers(self.layers(model), x, key, 0)
        return self.last(model, x, batch, layer_key(key, n + 1))


def gpt_stages() -> Stages:
    """The [`eqxpar.train.Stages`][] of an [`eqxpar.models.GPT`][] built with
    `scan_layers=True` (or converted with [`eqxpar.models.stack_blocks`][]), whose batch
    is `(batch, seq + 1)` token ids: the embeddings (token and position, with dropout)
    first, the transformer blocks stacked, the final norm, head and next-token
    cross-entropy last (as [`eqxpar.models.next_token_loss`][]). Without dropout (or
    without a key) it computes exactly the GPT's own loss; with dropout, each layer's key
    is `fold_in(key, 1 + layer)` ([`eqxpar.train.Stages.loss`][] is then the one-device
    reference, not the GPT's own call, which splits its key differently).

    **Returns:**

    The `Stages`.
    """
    from ..nn import layer_norm, vocab_parallel_cross_entropy

    def first(model, tokens, key):
        inputs = tokens[..., :-1]
        x = model.token_embedding(inputs) + model.position_embedding.weight[: inputs.shape[-1]]
        return model.dropout(x, key=key, inference=key is None)

    def layer(block, x, key):
        return block(x, key=key, inference=key is None)

    def last(model, x, tokens, key):
        logits = model.head(layer_norm(model.final_norm, x))
        if model.padded_vocab_size != model.vocab_size:
            block = logits.shape[-1]
            ids = jax.lax.axis_index(model.axis_name) * block + jnp.arange(block)
            logits = jnp.where(ids < model.vocab_size, logits, -jnp.inf)
        return jnp.mean(vocab_parallel_cross_entropy(logits, tokens[..., 1:], model.axis_name, model.vocab_size))

    def layers(model):
        if not model.scan_layers:
            raise ValueError(
                "gpt_stages: the GPT's blocks must be stacked to split them over stages: build it "
                "with scan_layers=True or convert it with eqxpar.models.stack_blocks(model)."
            )
        return model.blocks.layers

    return Stages(first=first, layers=layers, layer=layer, last=last)
