"""Column- and row-parallel linear layers: the two ways to split a weight matrix.

With `y = W x` and `W` of shape `(out_features, in_features)` (as in `eqx.nn.Linear`):

- **column-parallel** splits the output features (the rows of `W`): each device computes
  its block of `y` from the whole `x`. Nothing to communicate going forward.
- **row-parallel** splits the input features (the columns of `W`): each device multiplies
  its block of `x` by its block of `W`, which gives a partial `y`; a `psum` adds them.

Column then row (an MLP, attention) therefore needs one all-reduce forward and one backward.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, PRNGKeyArray

from .._promotion import with_rank
from ._base import TensorParallelLayer, gather_sequence, local_block, scatter_sequence, skeleton, to_varying

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "MATMUL_NAME"]

MATMUL_NAME = "eqxpar.matmul"
"""The `jax.ad_checkpoint.checkpoint_name` of every eqxpar linear layer's matmul output
(before the bias and any all-reduce): a remat policy keeps exactly these products with
`jax.checkpoint_policies.save_only_these_names(MATMUL_NAME)` (what the GPT's
`remat="save_matmuls"` does; `"offload"` moves the same ones to host memory). Policies that
pick dots by their shape (`dots_with_no_batch_dims_saveable`) stop seeing a product once it
is computed by a custom rule or a fused kernel; a name stays."""


def _check_vector_linear(linear: eqx.nn.Linear, cls_name: str) -> None:
    if not isinstance(linear, eqx.nn.Linear):
        raise ValueError(f"{cls_name}.from_dense needs an eqx.nn.Linear, got {type(linear).__name__}.")
    if linear.in_features == "scalar" or linear.out_features == "scalar":
        raise ValueError(
            f"{cls_name}.from_dense: the Linear has a 'scalar' input or output, which has "
            f"nothing to split; keep that layer replicated."
        )


class ColumnParallelLinear(TensorParallelLayer):
    """A linear layer whose **output features** are split over the model axis.

    Global form: `weight` of shape `(out_features, in_features)` and `bias` of shape
    `(out_features,)`, exactly as in `eqx.nn.Linear`; `specs()` splits both along
    `out_features`. Inside `shard_map` each device holds `out_features / N` rows and
    computes that block of the output from the whole (replicated) input.

    Communication: none forward (unless `gather_output=True`: one all-gather of the output).
    Backward, the input's gradient is a sum of every device's `W_block.T @ dy_block`: one
    all-reduce (a `psum`, the transpose of marking the input as varying).
    """

    weight: Float[Array, "out_features in_features"]
    bias: Float[Array, " out_features"] | None
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)
    gather_output: bool = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        use_bias: bool = True,
        dtype=None,
        *,
        gather_output: bool = False,
        axis_name: str = "model",
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `in_features`, `out_features`, `use_bias`, `dtype`: as in `eqx.nn.Linear`; the
          weights are initialised exactly as `eqx.nn.Linear(..., key=key)` initialises them.
        - `gather_output`: all-gather the output so every device gets all `out_features`
          (default `False`: each device keeps its block, ready for a row-parallel layer).
        - `axis_name`: the mesh axis the output features are split over.
        - `key`: the initialisation key.
        """
        dense = eqx.nn.Linear(in_features, out_features, use_bias, dtype=dtype, key=key)
        _check_vector_linear(dense, type(self).__name__)
        self.weight = dense.weight
        self.bias = dense.bias
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias
        self.gather_output = gather_output
        self.axis_name = axis_name

    @classmethod
    def from_dense(
        cls, linear: eqx.nn.Linear, *, gather_output: bool = False, axis_name: str = "model"
    ) -> ColumnParallelLinear:
        """The column-parallel form (global) of a dense `eqx.nn.Linear`, sharing its arrays.

        **Arguments:**

        - `linear`: the dense layer.
        - `gather_output`, `axis_name`: as in the constructor.

        **Returns:**

        A `ColumnParallelLinear` in global form; place it with
        `eqxpar.shard(layer, mesh, layer.specs())`.
        """
        return _from_linear(cls, linear, gather_output=gather_output, axis_name=axis_name)

    def to_dense(self) -> eqx.nn.Linear:
        """The dense `eqx.nn.Linear` with this layer's (global) weights.

        **Returns:**

        An `eqx.nn.Linear`; raises `ValueError` if called on a local block.
        """
        _check_global(self, (self.out_features, self.in_features))
        return _dense_linear(self.in_features, self.out_features, self.weight, self.bias)

    def specs(self) -> ColumnParallelLinear:
        """`weight`: `P(axis_name, None)`, `bias`: `P(axis_name)`: split along the outputs."""
        specs = eqx.tree_at(lambda l: l.weight, self, PartitionSpec(self.axis_name, None))
        if self.use_bias:
            specs = eqx.tree_at(lambda l: l.bias, specs, PartitionSpec(self.axis_name))
        return specs

    def check_axis_size(self, size: int, where: str = "") -> None:
        """`ValueError` unless `out_features` is divisible by `size`."""
        if self.out_features % size:
            raise self._split_error(where, "out_features", self.out_features, size)

    def __call__(
        self, x: Float[Array, "*batch in_features"], *, key: PRNGKeyArray | None = None, sequence_dim: int | None = None
    ) -> Float[Array, "*batch out_block"]:
        """Apply the layer on one device (inside `shard_map`).

        **Arguments:**

        - `x`: the whole input, shape `(*batch, in_features)` (any leading dimensions,
          none for one example as in `eqx.nn.Linear`), the same on every device.
        - `key`: ignored (for compatibility with the Equinox API).
        - `sequence_dim`: Megatron sequence parallelism: `x` is this device's block of the
          sequence along dimension `sequence_dim` (e.g. `-2`), all-gathered over the model
          axis here (backward: a reduce-scatter of the input gradient, in place of the
          all-reduce). Default None: `x` is whole.

        **Returns:**

        This device's block of the output, shape `(*batch, out_features / N)`; or all of
        it, `(*batch, out_features)`, with `gather_output=True`.
        """
        del key
        with jax.named_scope(type(self).__name__):
            size = self._model_axis_size()
            _check_local(self, (self.out_features // size, self.in_features), size)
            _check_input(self, x, self.in_features, "the whole input")
            if sequence_dim is not None:
                x = gather_sequence(x, self.axis_name, sequence_dim)
            # Forward: every device has all of x, nothing to send. Backward: this marks x as
            # varying over the model axis, whose transpose is the psum that adds up the
            # devices' partial input gradients (the one all-reduce of a column layer).
            x = to_varying(x, self.axis_name)
            y = linear(x, self.weight, self.bias)
            if self.gather_output:
                # All-gather of the blocks; the result is the same on every device
                # ("invarying"), so its backward is a plain slice with no communication.
                y = jax.lax.all_gather(y, self.axis_name, axis=y.ndim - 1, tiled=True, to="invarying")
            return y


class RowParallelLinear(TensorParallelLayer):
    """A linear layer whose **input features** are split over the model axis.

    Global form: `weight` of shape `(out_features, in_features)` and `bias` of shape
    `(out_features,)`, exactly as in `eqx.nn.Linear`; `specs()` splits `weight` along
    `in_features` and replicates `bias`. Inside `shard_map` each device multiplies its block
    of the input by its `in_features / N` columns of `weight`: a partial result that a
    `psum` over the model axis completes. The bias is added once, after the `psum` (added
    before it, it would be counted `N` times).

    Communication: one all-reduce of the output forward. Backward: none (the output's
    gradient is already on every device, and each device's weight and input gradients only
    need its own block).
    """

    weight: Float[Array, "out_features in_features"]
    bias: Float[Array, " out_features"] | None
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)
    input_is_split: bool = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        use_bias: bool = True,
        dtype=None,
        *,
        input_is_split: bool = True,
        axis_name: str = "model",
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `in_features`, `out_features`, `use_bias`, `dtype`: as in `eqx.nn.Linear`; the
          weights are initialised exactly as `eqx.nn.Linear(..., key=key)` initialises them.
        - `input_is_split`: `True` (default) when the input arrives already split, e.g. from
          a `ColumnParallelLinear`; `False` to pass the whole input and let the layer take
          this device's block of it.
        - `axis_name`: the mesh axis the input features are split over.
        - `key`: the initialisation key.
        """
        dense = eqx.nn.Linear(in_features, out_features, use_bias, dtype=dtype, key=key)
        _check_vector_linear(dense, type(self).__name__)
        self.weight = dense.weight
        self.bias = dense.bias
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias
        self.input_is_split = input_is_split
        self.axis_name = axis_name

    @classmethod
    def from_dense(
        cls, linear: eqx.nn.Linear, *, input_is_split: bool = True, axis_name: str = "model"
    ) -> RowParallelLinear:
        """The row-parallel form (global) of a dense `eqx.nn.Linear`, sharing its arrays.

        **Arguments:**

        - `linear`: the dense layer.
        - `input_is_split`, `axis_name`: as in the constructor.

        **Returns:**

        A `RowParallelLinear` in global form.
        """
        return _from_linear(cls, linear, input_is_split=input_is_split, axis_name=axis_name)

    def to_dense(self) -> eqx.nn.Linear:
        """The dense `eqx.nn.Linear` with this layer's (global) weights."""
        _check_global(self, (self.out_features, self.in_features))
        return _dense_linear(self.in_features, self.out_features, self.weight, self.bias)

    def specs(self) -> RowParallelLinear:
        """`weight`: `P(None, axis_name)` (split along the inputs), `bias`: `P()`."""
        specs = eqx.tree_at(lambda l: l.weight, self, PartitionSpec(None, self.axis_name))
        if self.use_bias:
            specs = eqx.tree_at(lambda l: l.bias, specs, PartitionSpec())
        return specs

    def check_axis_size(self, size: int, where: str = "") -> None:
        """`ValueError` unless `in_features` is divisible by `size`."""
        if self.in_features % size:
            raise self._split_error(where, "in_features", self.in_features, size)

    def __call__(
        self, x: Float[Array, "*batch in_block"], *, key: PRNGKeyArray | None = None, sequence_dim: int | None = None
    ) -> Float[Array, "*batch out_features"]:
        """Apply the layer on one device (inside `shard_map`).

        **Arguments:**

        - `x`: this device's block of the input, shape `(*batch, in_features / N)` (any
          leading dimensions); or, with `input_is_split=False`, the whole input
          `(*batch, in_features)`.
        - `key`: ignored (for compatibility with the Equinox API).
        - `sequence_dim`: Megatron sequence parallelism: return only this device's block
          of the output along dimension `sequence_dim` (a `psum_scatter` over the model
          axis in place of the `psum`; backward, an all-gather). Default None.

        **Returns:**

        The whole output, shape `(*batch, out_features)`, the same on every device.
        """
        del key
        with jax.named_scope(type(self).__name__):
            size = self._model_axis_size()
            _check_local(self, (self.out_features, self.in_features // size), size)
            if self.input_is_split:
                _check_input(
                    self,
                    x,
                    self.in_features // size,
                    "this device's block of the input",
                    hint=" To pass the whole input instead, build the layer with input_is_split=False.",
                )
            else:
                _check_input(self, x, self.in_features, "the whole input (input_is_split=False)")
                # Take this device's block; backward, the blocks' gradients meet in a psum.
                x = local_block(x, self.axis_name)
            partial_y = linear(x, self.weight, None)
            if sequence_dim is not None:
                # Sequence parallelism: add up the partial products and keep our block of the sequence.
                y = scatter_sequence(partial_y, self.axis_name, sequence_dim, type(self).__name__)
            else:
                # The forward all-reduce: add up the devices' partial products.
                y = jax.lax.psum(partial_y, self.axis_name)
            if self.bias is not None:
                y = y + with_rank(self.bias, y.ndim)  # once, after the psum
            return y


def linear(x: Array, weight: Array, bias: Array | None) -> Array:
    """`x @ weight.T + bias` over any leading dimensions of `x` (one contraction, no vmap),
    the product named [`MATMUL_NAME`][eqxpar.nn.MATMUL_NAME] for remat policies."""
    if x.ndim == 1:
        y = weight @ x  # one example: exactly eqx.nn.Linear's product
    else:
        y = jnp.einsum("...i,oi->...o", x, weight)
    y = checkpoint_name(y, MATMUL_NAME)
    return y if bias is None else y + with_rank(bias, y.ndim)


def _dense_linear(in_features: int, out_features: int, weight, bias) -> eqx.nn.Linear:
    linear = eqx.filter_eval_shape(
        eqx.nn.Linear,
        in_features,
        out_features,
        bias is not None,
        dtype=weight.dtype,
        key=jax.random.key(0),
    )
    linear = eqx.tree_at(lambda l: l.weight, linear, weight)
    if bias is not None:
        linear = eqx.tree_at(lambda l: l.bias, linear, bias)
    return linear


def _check_global(layer: ColumnParallelLinear | RowParallelLinear, shape: tuple[int, ...]) -> None:
    if tuple(layer.weight.shape) != shape:
        raise ValueError(
            f"{type(layer).__name__}.to_dense: weight has shape {tuple(layer.weight.shape)}, not "
            f"the global {shape}. Call to_dense on the global form (outside shard_map, e.g. "
            f"the layer returned by a sharded function), not on a device's block."
        )


def _check_local(layer: ColumnParallelLinear | RowParallelLinear, shape: tuple[int, ...], size: int) -> None:
    if tuple(layer.weight.shape) != shape:
        raise ValueError(
            f"{type(layer).__name__}: inside shard_map its weight should be this device's "
            f"block {shape} (1/{size} of the global ({layer.out_features}, "
            f"{layer.in_features}) split over {layer.axis_name!r}), but it is "
            f"{tuple(layer.weight.shape)}. Pass eqxpar.nn.partition_specs(layer) as the "
            f"layer's in_specs."
        )


def _check_input(layer: TensorParallelLayer, x, features: int, what: str, hint: str = "") -> None:
    if x.ndim < 1 or x.shape[-1] != features:
        raise ValueError(
            f"{type(layer).__name__}: expected {what}, shape ({features},), got {x.shape} "
            f"(leading dimensions are batch dimensions: (*batch, {features})).{hint}"
        )


def _from_linear(cls, linear: eqx.nn.Linear, **options):
    """A `cls` layer in global form holding `linear`'s arrays (not copies)."""
    _check_vector_linear(linear, cls.__name__)
    layer = skeleton(cls, linear.in_features, linear.out_features, linear.use_bias, linear.weight.dtype, **options)
    layer = eqx.tree_at(lambda l: l.weight, layer, linear.weight)
    if linear.use_bias:
        layer = eqx.tree_at(lambda l: l.bias, layer, linear.bias)
    return layer
