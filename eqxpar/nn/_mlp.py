"""ParallelMLP: a column-parallel layer, then a row-parallel one: one all-reduce each way."""

from __future__ import annotations

from collections.abc import Callable

import equinox as eqx
import jax
from jaxtyping import Array, Float, PRNGKeyArray

from ._base import TensorParallelLayer, elementwise, identity, per_shard_key, skeleton
from ._linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["ParallelMLP"]


class ParallelMLP(TensorParallelLayer):
    """A one-hidden-layer MLP split over the model axis (Megatron-style).

    `in_size -> width_size -> out_size`, the same function and initialisation as
    `eqx.nn.MLP(in_size, out_size, width_size, depth=1, ...)`:

    - `hidden`: a [`eqxpar.nn.ColumnParallelLinear`][]: each device computes its
      `width_size / N` hidden units from the whole input; the activation (and dropout)
      act on that block locally, since they are elementwise.
    - `output`: a [`eqxpar.nn.RowParallelLinear`][]: each device multiplies its hidden
      block by its columns of the output weight; one `psum` adds the partial outputs.

    Exactly one all-reduce forward (of `out_size` numbers per example) and one backward
    (the input gradient, in the column layer). The hidden activations, the largest
    tensors, never leave their device.

    Dropout (`dropout_p > 0`) acts on the hidden units, which are split: each device draws
    its mask from its own key (`fold_in(key, axis_index)`), so the masks of different
    blocks are independent. The mask therefore depends on the model axis size, as in
    Megatron-LM: a run at `model=1` and one at `model=8` see different masks.
    """

    hidden: ColumnParallelLinear
    output: RowParallelLinear
    activation: Callable
    final_activation: Callable
    dropout: eqx.nn.Dropout
    in_size: int = eqx.field(static=True)
    out_size: int = eqx.field(static=True)
    width_size: int = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)
    use_final_bias: bool = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)

    def __init__(
        self,
        in_size: int,
        out_size: int,
        width_size: int,
        activation: Callable = jax.nn.relu,
        final_activation: Callable = identity,
        use_bias: bool = True,
        use_final_bias: bool = True,
        dropout_p: float = 0.0,
        inference: bool = False,
        dtype=None,
        *,
        axis_name: str = "model",
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `in_size`, `out_size`, `width_size`, `activation`, `final_activation`,
          `use_bias`, `use_final_bias`, `dtype`: as in `eqx.nn.MLP` with `depth=1`; the
          weights are initialised exactly as that `eqx.nn.MLP(..., key=key)` would be.
          Activations must be elementwise functions without parameters.
        - `dropout_p`, `inference`: dropout on the hidden units, as `eqx.nn.Dropout`.
        - `axis_name`: the mesh axis the hidden units are split over.
        - `key`: the initialisation key.
        """
        dense = eqx.nn.MLP(
            in_size,
            out_size,
            width_size,
            1,
            activation,
            final_activation,
            use_bias,
            use_final_bias,
            dtype=dtype,
            key=key,
        )
        self.hidden = ColumnParallelLinear.from_dense(dense.layers[0], axis_name=axis_name)
        self.output = RowParallelLinear.from_dense(dense.layers[1], input_is_split=True, axis_name=axis_name)
        self.activation = activation
        self.final_activation = final_activation
        self.dropout = eqx.nn.Dropout(dropout_p, inference=inference)
        self.in_size = in_size
        self.out_size = out_size
        self.width_size = width_size
        self.use_bias = use_bias
        self.use_final_bias = use_final_bias
        self.axis_name = axis_name

    @classmethod
    def from_dense(cls, mlp: eqx.nn.MLP, *, dropout_p: float = 0.0, axis_name: str = "model") -> ParallelMLP:
        """The tensor-parallel form (global) of a dense `eqx.nn.MLP` with `depth=1`.

        **Arguments:**

        - `mlp`: the dense MLP: one hidden layer, vector input and output, activations
          without parameters.
        - `dropout_p`: dropout on the hidden units (the dense MLP has none).
        - `axis_name`: the mesh axis to split over.

        **Returns:**

        A `ParallelMLP` in global form sharing `mlp`'s arrays.
        """
        if not isinstance(mlp, eqx.nn.MLP):
            raise ValueError(f"ParallelMLP.from_dense needs an eqx.nn.MLP, got {type(mlp).__name__}.")
        if mlp.depth != 1:
            raise ValueError(
                f"ParallelMLP.from_dense: the MLP has depth={mlp.depth}; ParallelMLP is one "
                f"column-parallel and one row-parallel layer, i.e. depth=1. Split a deeper MLP "
                f"into pairs of layers (one all-reduce per pair)."
            )
        if mlp.in_size == "scalar" or mlp.out_size == "scalar":
            raise ValueError("ParallelMLP.from_dense: 'scalar' inputs/outputs are not supported.")
        for name in ("activation", "final_activation"):
            if jax.tree.leaves(eqx.filter(getattr(mlp, name), eqx.is_array)):
                raise ValueError(
                    f"ParallelMLP.from_dense: the MLP's {name} has parameters (arrays); only "
                    f"parameter-free elementwise activations are supported."
                )
        layer = skeleton(
            cls,
            mlp.in_size,
            mlp.out_size,
            mlp.width_size,
            mlp.activation,
            mlp.final_activation,
            mlp.use_bias,
            mlp.use_final_bias,
            dropout_p,
            dtype=mlp.layers[0].weight.dtype,
            axis_name=axis_name,
        )
        return eqx.tree_at(
            lambda l: (l.hidden, l.output),
            layer,
            (
                ColumnParallelLinear.from_dense(mlp.layers[0], axis_name=axis_name),
                RowParallelLinear.from_dense(mlp.layers[1], input_is_split=True, axis_name=axis_name),
            ),
        )

    def to_dense(self) -> eqx.nn.MLP:
        """The dense `eqx.nn.MLP` (`depth=1`) with this layer's (global) weights."""
        mlp = eqx.filter_eval_shape(
            eqx.nn.MLP,
            self.in_size,
            self.out_size,
            self.width_size,
            1,
            self.activation,
            self.final_activation,
            self.use_bias,
            self.use_final_bias,
            dtype=self.hidden.weight.dtype,
            key=jax.random.key(0),
        )
        return eqx.tree_at(lambda m: m.layers, mlp, (self.hidden.to_dense(), self.output.to_dense()))

    def check_axis_size(self, size: int, where: str = "") -> None:
        """`ValueError` unless `width_size` is divisible by `size`."""
        if self.width_size % size:
            raise self._split_error(where, "width_size", self.width_size, size)

    def __call__(
        self,
        x: Float[Array, "*batch in_size"],
        *,
        key: PRNGKeyArray | None = None,
        inference: bool | None = None,
        sequence_dim: int | None = None,
    ) -> Float[Array, "*batch out_size"]:
        """Apply the MLP on one device (inside `shard_map`).

        **Arguments:**

        - `x`: the whole input, shape `(*batch, in_size)` (any leading dimensions, none for
          one example as in `eqx.nn.MLP`), the same on every device.
        - `key`: the dropout key, the same on every device (each device folds in its index).
          Only needed when dropout is active.
        - `inference`: as in `eqx.nn.Dropout`.
        - `sequence_dim`: Megatron sequence parallelism: `x` is this device's block of the
          sequence along this dimension (e.g. `-2`), all-gathered on the way in; the output
          is reduce-scattered back to blocks of the sequence (same bytes as the two
          all-reduces). Default None.

        **Returns:**

        The whole output, shape `(*batch, out_size)`, the same on every device (with
        `sequence_dim`, this device's block of the sequence).
        """
        with jax.named_scope(type(self).__name__):
            self._model_axis_size()
            # This device's hidden block; backward: all-reduce (SP: reduce-scatter) of x's gradient.
            h = self.hidden(x, sequence_dim=sequence_dim)
            h = elementwise(self.activation, h)  # elementwise, on the local block
            if key is not None:
                # The hidden units are split: a different mask on each device.
                key = per_shard_key(key, self.axis_name)
            h = self.dropout(h, key=key, inference=inference)
            # Partial products, then the forward all-reduce (SP: reduce-scatter).
            y = self.output(h, sequence_dim=sequence_dim)
            return elementwise(self.final_activation, y)
