"""`Stages`: a model cut into the three parts a pipeline needs (a model's own cut lives with
the model, e.g. [`eqxpar.models.gpt_stages`][])."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PyTree

__all__ = ["Stages", "layer_key"]


def layer_key(key: Any, index: Any) -> Any:
    """The key of part `index` of one micro-batch's pass (0: `first`, `1 + l`: layer `l`,
    `num_layers + 1`: `last`), or None without a key."""
    return None if key is None else jax.random.fold_in(key, index)


def _describe(tree: PyTree) -> str:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    if len(leaves) == 1 and not leaves[0][0]:
        return _aval(leaves[0][1])
    return "{" + ", ".join(f"{jax.tree_util.keystr(p)}: {_aval(x)}" for p, x in leaves) + "}"


def _aval(x: Any) -> str:
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    return f"{type(x).__name__}" if shape is None else f"{jnp.dtype(dtype).name}{list(shape)}"


def _check_same_activation(x: PyTree, out: PyTree) -> None:
    """A stacked layer must return the activation it takes, in shape and dtype: the layers
    are scanned, and the pipeline sends `x` from stage to stage in a buffer of that shape."""
    same = jax.tree.structure(x) == jax.tree.structure(out) and all(
        (getattr(a, "shape", None), getattr(a, "dtype", None)) == (getattr(b, "shape", None), getattr(b, "dtype", None))
        for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(out))
    )
    if not same:
        raise ValueError(
            f"Stages.layer changes the activation: it takes x = {_describe(x)} and returns "
            f"{_describe(out)}. Every stacked layer must return x with the shape and dtype it "
            f"takes (the layers are scanned, and the pipeline passes x from stage to stage): "
            f"keep the width constant across the layers, and put a layer that changes it in "
            f"Stages.first or Stages.last."
        )


def _split_aux(out: Any) -> tuple[PyTree, Any]:
    """`layer`'s `(x, aux)` under `layer_aux=True`, or a `ValueError` naming the contract."""
    aux = out[1] if isinstance(out, tuple) and len(out) == 2 else None
    if aux is None or getattr(aux, "shape", None) != () or not jnp.issubdtype(jnp.result_type(aux), jnp.floating):
        raise ValueError(
            f"Stages.layer returned {_describe(out)}, but layer_aux=True asks for a pair (x, aux), aux "
            f"a float scalar added to the loss: return (x, aux) from layer, or build the Stages with "
            f"layer_aux=False."
        )
    return out[0], aux


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
    - `layer_aux`: with True, `layer` returns `(x, aux)`, `aux` a scalar added to the loss
      (e.g. a mixture of experts' weighted balancing losses, a mean over the micro-batch as
      `last`'s loss is). Each stage adds its own layers' `aux` to its share of the loss:
      nothing more travels between stages (the step already sums the loss over the stage
      axis), and the gradient of `aux` reaches the earlier stages through `x`.

    `first` and `last` may use every array of the model except the stacked layers; `x`
    must have the same shape and dtype after every layer. [`eqxpar.train.Stages.loss`][]
    is the same computation on one device, the reference the pipeline matches.
    """

    first: Callable[..., PyTree]
    layers: Callable[[PyTree], PyTree]
    layer: Callable[..., PyTree]
    last: Callable[..., Array]
    layer_aux: bool = False

    def __post_init__(self):
        if not isinstance(self.layer_aux, bool):
            raise ValueError(f"Stages: layer_aux must be True or False, got {self.layer_aux!r}.")

    def num_layers(self, model: PyTree) -> int:
        """The length of the stacked layers' leading axis (a `ValueError` if they differ)."""
        sizes = {x.shape[0] if x.ndim else None for x in jax.tree.leaves(eqx.filter(self.layers(model), eqx.is_array))}
        if len(sizes) != 1 or None in sizes:
            raise ValueError(
                f"Stages.layers(model) must be a PyTree whose arrays all have one leading layer "
                f"axis of the same length; got leading sizes {sorted(map(str, sizes))}."
            )
        (size,) = sizes
        assert size is not None  # checked above
        return size

    def run_layers(self, layers: PyTree, x: PyTree, key: Any, first_index: Any) -> PyTree:
        """Run stacked `layers` in order with `jax.lax.scan`; layer `j` gets the key of
        global layer `first_index + j`.

        **Returns:**

        The last layer's `x`; with `layer_aux`, `(x, aux)` as `layer` returns, `aux` the
        layers' `aux` summed in float32.
        """
        dynamic, static = eqx.partition(layers, eqx.is_array)
        count = jax.tree.leaves(dynamic)[0].shape[0]

        def body(x, inputs):
            arrays, j = inputs
            out = self.layer(eqx.combine(arrays, static), x, layer_key(key, 1 + first_index + j))
            aux = None
            if self.layer_aux:
                out, aux = _split_aux(out)
                aux = jnp.asarray(aux, jnp.float32)
            _check_same_activation(x, out)  # while tracing: before the scan's carry TypeError
            return out, aux

        # The layers' aux leave the scan as its outputs (not in the carry: the carry must keep
        # one type, while the aux varies over the mesh axes x does inside shard_map).
        x, auxes = jax.lax.scan(body, x, (dynamic, jnp.arange(count)))
        if not self.layer_aux:
            return x
        assert auxes is not None  # one float32 aux per layer
        return x, jnp.sum(auxes)

    def loss(self, model: PyTree, batch: PyTree, key: Any = None) -> Array:
        """The loss on one device, layer after layer: `loss_fn(model, batch, key)` for the
        one-device builders (the pipeline's reference).

        **Arguments:**

        - `model`: the whole model.
        - `batch`: one (micro-)batch.
        - `key`: a PRNG key or None.

        **Returns:**

        `last(model, layers(...first(model, batch)...), batch)`, plus the layers' summed
        `aux` with `layer_aux`.
        """
        n = self.num_layers(model)
        x = self.first(model, batch, layer_key(key, 0))
        out = self.run_layers(self.layers(model), x, key, 0)
        x, aux = out if self.layer_aux else (out, None)
        loss = self.last(model, x, batch, layer_key(key, n + 1))
        return loss if aux is None else loss + aux
