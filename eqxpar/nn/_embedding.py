"""Vocabulary-parallel embedding and cross-entropy: the vocabulary split over the model axis."""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._promotion import at_least_float32
from .._shard_map import varying_axes
from ._base import TensorParallelLayer, scatter_sequence, to_varying

__all__ = ["VocabParallelEmbedding", "vocab_parallel_cross_entropy"]


class VocabParallelEmbedding(TensorParallelLayer):
    """An embedding table whose rows (the vocabulary) are split over the model axis.

    Global form: `weight` of shape `(num_embeddings, embedding_size)` as in
    `eqx.nn.Embedding`; `specs()` splits it along the rows. Inside `shard_map` device `i`
    holds rows `[i * V/N, (i + 1) * V/N)`. A lookup: the device that owns the token's row
    returns it, every other device returns zeros, and a `psum` over the model axis gives
    everyone the row.

    Communication: one all-reduce of the embeddings forward (`embedding_size` numbers per
    token); none backward (each device's rows get their gradient locally).
    """

    weight: Float[Array, "num_embeddings embedding_size"]
    num_embeddings: int = eqx.field(static=True)
    embedding_size: int = eqx.field(static=True)
    axis_name: str = eqx.field(static=True)

    def __init__(
        self,
        num_embeddings: int,
        embedding_size: int,
        dtype=None,
        *,
        axis_name: str = "model",
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `num_embeddings`, `embedding_size`, `dtype`: as in `eqx.nn.Embedding`; the table
          is initialised exactly as `eqx.nn.Embedding(..., key=key)` initialises it.
        - `axis_name`: the mesh axis the vocabulary is split over.
        - `key`: the initialisation key.
        """
        dense = eqx.nn.Embedding(num_embeddings, embedding_size, dtype=dtype, key=key)
        self.weight = dense.weight
        self.num_embeddings = num_embeddings
        self.embedding_size = embedding_size
        self.axis_name = axis_name

    @classmethod
    def from_dense(cls, embedding: eqx.nn.Embedding, *, axis_name: str = "model") -> VocabParallelEmbedding:
        """The vocabulary-parallel form (global) of a dense `eqx.nn.Embedding`.

        **Arguments:**

        - `embedding`: the dense layer.
        - `axis_name`: the mesh axis to split the vocabulary over.

        **Returns:**

        A `VocabParallelEmbedding` in global form sharing `embedding`'s table.
        """
        if not isinstance(embedding, eqx.nn.Embedding):
            raise ValueError(
                f"VocabParallelEmbedding.from_dense needs an eqx.nn.Embedding, got {type(embedding).__name__}."
            )
        num, size = embedding.weight.shape
        layer = eqx.filter_eval_shape(
            cls, num, size, embedding.weight.dtype, axis_name=axis_name, key=jax.random.key(0)
        )
        return eqx.tree_at(lambda l: l.weight, layer, embedding.weight)

    def to_dense(self) -> eqx.nn.Embedding:
        """The dense `eqx.nn.Embedding` with this layer's (global) table."""
        if tuple(self.weight.shape) != (self.num_embeddings, self.embedding_size):
            raise ValueError(
                f"VocabParallelEmbedding.to_dense: weight has shape {tuple(self.weight.shape)}, "
                f"not the global ({self.num_embeddings}, {self.embedding_size}); call it on the "
                f"global form (outside shard_map)."
            )
        return eqx.nn.Embedding(weight=self.weight)

    def specs(self) -> VocabParallelEmbedding:
        """`weight`: `P(axis_name, None)`: split along the vocabulary."""
        return eqx.tree_at(lambda l: l.weight, self, PartitionSpec(self.axis_name, None))

    def check_axis_size(self, size: int, where: str = "") -> None:
        """`ValueError` unless `num_embeddings` is divisible by `size`."""
        if self.num_embeddings % size:
            raise self._split_error(where, "num_embeddings", self.num_embeddings, size)

    def __call__(
        self, x: Int[Array, "*batch"], *, key: PRNGKeyArray | None = None, sequence_dim: int | None = None
    ) -> Float[Array, "*batch embedding_size"]:
        """Look up tokens on one device (inside `shard_map`).

        **Arguments:**

        - `x`: integer token ids in `[0, num_embeddings)`, any shape (a scalar for one
          token, as in `eqx.nn.Embedding`; `(batch, seq)` for a batch), the same on every
          device.
        - `key`: ignored (for compatibility with the Equinox API).
        - `sequence_dim`: Megatron sequence parallelism: return only this device's block of
          the embeddings along dimension `sequence_dim` of `x` (e.g. `-1` for `(batch,
          seq)` ids): a `psum_scatter` over the model axis in place of the `psum` (backward,
          an all-gather). Default None.

        **Returns:**

        The tokens' embeddings, shape `(*x.shape, embedding_size)`, the same on every
        device (with `sequence_dim`, that dimension divided by the model axis size).
        """
        del key
        with jax.named_scope(type(self).__name__):
            size = self._model_axis_size()
            rows = self.num_embeddings // size
            if self.weight.shape != (rows, self.embedding_size):
                raise ValueError(
                    f"VocabParallelEmbedding: inside shard_map its weight should be this device's "
                    f"block ({rows}, {self.embedding_size}), but it is {self.weight.shape}. Pass "
                    f"eqxpar.nn.partition_specs(layer) as the layer's in_specs."
                )
            if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
                raise ValueError(f"VocabParallelEmbedding: expected integer token ids, got dtype {jnp.result_type(x)}.")
            row = x - jax.lax.axis_index(self.axis_name) * rows  # the tokens' rows in our block
            ours = (row >= 0) & (row < rows)
            vectors = jnp.where(ours[..., None], jnp.take(self.weight, jnp.clip(row, 0, rows - 1), axis=0), 0)
            if sequence_dim is not None:
                # Sequence parallelism: each device keeps its block of the positions.
                return scatter_sequence(vectors, self.axis_name, sequence_dim % x.ndim, type(self).__name__)
            # Exactly one device contributes a non-zero row: the all-reduce hands it to all.
            return jax.lax.psum(vectors, self.axis_name)


def vocab_parallel_cross_entropy(
    logits: Float[Array, "*batch vocab_block"],
    labels: Int[Array, "*batch"],
    axis_name: str = "model",
    vocab_size: int | None = None,
) -> Float[Array, "*batch"]:
    """Softmax cross-entropy with integer labels, the logits split over the vocabulary.

    Call it inside `shard_map` with this device's block of the logits (e.g. the output of a
    [`eqxpar.nn.ColumnParallelLinear`][] head with `gather_output=False`). The result equals
    `optax.softmax_cross_entropy_with_integer_labels` on the whole logits, which are never
    put together on one device:

    1. `pmax` of the local maxima: the global max, subtracted for numerical stability
       (the loss does not depend on it);
    2. one `psum` of two numbers per example: the sum of `exp(logit - max)` over each
       device's block, and the label's logit (non-zero only on the device that owns it);
    3. `loss = log(sum) - (label_logit - max)`, the same on every device.

    Backward there is no communication: each device's logit gradients are
    `g * (exp(logit - max) / sum - one_hot)` on its own block (`g` the loss's cotangent),
    from the max and the reduced sum it already has. A custom VJP computes them in one
    elementwise pass over the logits, kept in their own dtype: float32 inside, one rounding
    to the logits' dtype, zero at padding ids: the backward writes no float32 array of the
    logits' size. (A custom VJP has no forward mode: `jax.jvp` of the loss raises.)

    **Arguments:**

    - `logits`: this device's block of the logits, shape `(*batch, vocab / N)`.
    - `labels`: the integer labels in `[0, vocab)`, shape `(*batch)`, the same on every
      device.
    - `axis_name`: the mesh axis the vocabulary is split over.
    - `vocab_size`: with a vocabulary padded to split evenly (see
      [`eqxpar.models.GPT`][]'s `pad_vocab_to_multiple_of`), the number of real entries:
      the logits of ids `>= vocab_size` are left out of the softmax. `None` (default): all
      are real.

    **Returns:**

    The per-example losses, shape `(*batch)`, the same on every device, in float32 at
    least (bfloat16 logits are promoted before the softmax statistics).
    """
    with jax.named_scope("vocab_parallel_cross_entropy"):
        if labels.shape != logits.shape[:-1]:
            raise ValueError(
                f"vocab_parallel_cross_entropy: labels have shape {labels.shape} but logits have "
                f"shape {logits.shape}; labels need the logits' shape without its last (vocabulary) "
                f"dimension."
            )
        try:
            index = jax.lax.axis_index(axis_name)
        except NameError:
            raise ValueError(
                f"vocab_parallel_cross_entropy runs inside shard_map over the model axis "
                f"{axis_name!r}, which is not bound here (a mesh with {axis_name}=1 runs it densely)."
            ) from None
        # The logits' gradient varies over the model axis (each device's block) and over the
        # axes the labels vary over. Logits typed as not varying over them (replicated ones,
        # as on a mesh with axis_name=1) are marked varying here, outside the custom backward,
        # so that autodiff sums their gradient over those axes, as it does without one. (Under
        # shard_map's check_vma=False nothing is typed varying, the axis index included, and
        # nothing is cast: a cast there would sum the devices' blocks of the gradient.)
        axes = (varying_axes(labels) | varying_axes(index)) - varying_axes(logits)
        logits = functools.reduce(to_varying, sorted(axes), logits)
        block = logits.shape[-1]
        first = index * block
        # The softmax statistics in float32 at least, whatever the logits' dtype (bfloat16
        # under mixed precision): a sum of exponentials over the vocabulary in bfloat16 would
        # lose the loss's third significant digit. The max and the label's logit are exact in
        # the logits' own dtype, so only the sum reads the logits converted.
        wide = at_least_float32(logits.dtype)
        # 1. The global max over the vocabulary: one all-reduce (max).
        local_max = jax.lax.stop_gradient(jnp.max(_masked(logits, first, vocab_size), axis=-1).astype(wide))
        global_max = jax.lax.pmax(local_max, axis_name)
        # 2. Sum of exponentials and the label's logit, in one all-reduce (sum). Autodiff
        # transposes the collectives (under check_vma, without communication); the custom
        # VJP of the block's sums writes the logits' gradient.
        sums: tuple[Array, Array] = _block_sums(logits, labels, global_max, axis_name, vocab_size)  # (custom_vjp)
        sum_exp, label_logit = sums
        sum_exp, label_logit = jax.lax.psum(jnp.stack([sum_exp, label_logit]), axis_name)
        # 3. log-sum-exp minus the label's logit (both shifted by the same max).
        return jnp.log(sum_exp) - label_logit


def _masked(logits: Array, first: Array, vocab_size: int | None) -> Array:
    """This block's logits, `-inf` at padding ids (`>= vocab_size`), in their own dtype."""
    if vocab_size is not None:
        ids = first + jnp.arange(logits.shape[-1])
        logits = jnp.where(ids < vocab_size, logits, -jnp.inf)
    return logits


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _block_sums(logits, labels, global_max, axis_name, vocab_size):
    return _block_sums_fwd(logits, labels, global_max, axis_name, vocab_size)[0]


def _block_sums_fwd(logits, labels, global_max, axis_name, vocab_size):
    """This block's `sum(exp(logit - max))` and label logit `l_y - max` (zero where the
    label is in another block); kept for the backward: the logits in their own dtype, the
    labels and the max."""
    block = logits.shape[-1]
    first = jax.lax.axis_index(axis_name) * block
    shifted = _masked(logits, first, vocab_size).astype(global_max.dtype) - global_max[..., None]
    sum_exp = jnp.sum(jnp.exp(shifted), axis=-1)
    label = labels - first  # the label's index in our block
    ours = (label >= 0) & (label < block)
    picked = jnp.take_along_axis(logits, jnp.clip(label, 0, block - 1)[..., None], axis=-1)[..., 0]
    label_logit = jnp.where(ours, picked.astype(global_max.dtype) - global_max, 0)
    return (sum_exp, label_logit), (logits, labels, global_max)


def _block_sums_bwd(axis_name, vocab_size, residuals, cotangents):
    # The barrier keeps XLA from merging the exponentials below with the forward's (the
    # same expression): merged, the forward would write them out in float32 for us.
    logits, labels, global_max = jax.lax.optimization_barrier(residuals)
    d_sum_exp, d_label_logit = cotangents  # g / sum and -g, from the log and the subtraction
    block = logits.shape[-1]
    first = jax.lax.axis_index(axis_name) * block
    # g * (softmax - one_hot) on this block in one elementwise pass over the logits: float32
    # inside, one rounding to the logits' dtype. Zero at padding ids (exp(-inf)).
    exps = jnp.exp(_masked(logits, first, vocab_size).astype(global_max.dtype) - global_max[..., None])
    one_hot = jax.lax.broadcasted_iota(labels.dtype, logits.shape, logits.ndim - 1) == (labels - first)[..., None]
    d_logits = d_sum_exp[..., None] * exps + jnp.where(one_hot, d_label_logit[..., None], 0)
    return d_logits.astype(logits.dtype), None, None


_block_sums.defvjp(_block_sums_fwd, _block_sums_bwd)
