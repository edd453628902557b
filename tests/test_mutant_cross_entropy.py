"""vocab_parallel_cross_entropy with a padded vocabulary (`vocab_size` below the split
width) leaves every padding id out of the softmax, even where the padding's logits are
large and finite (the GPT masks them to -inf itself, which would hide an off-by-one here).
Caught by this test: tools/mutants.toml's ce-padding-off-by-one."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar.nn import vocab_parallel_cross_entropy
from eqxpar.testing import assert_trees_close


@pytest.mark.parametrize("n, vocab, padded", [(2, 5, 6), (4, 9, 12)])
def test_padding_ids_stay_out_of_the_softmax(n, vocab, padded):
    rng = np.random.default_rng(n)
    logits = rng.normal(size=(3, padded)).astype(np.float32)
    logits[:, vocab:] = 5.0  # padding logits that would dominate the softmax if counted
    labels = np.array([0, vocab - 1, vocab // 2], np.int32)
    mesh = eqxpar.make_mesh(model=n)
    parallel = eqxpar.filter_shard_map(
        lambda l, y: jnp.sum(vocab_parallel_cross_entropy(l, y, "model", vocab_size=vocab)),
        mesh=mesh,
        in_specs=(P(None, "model"), P()),
        out_specs=P(),
    )
    loss, grad = jax.jit(jax.value_and_grad(parallel))(logits, labels)

    def whole(l):
        return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(l[:, :vocab], labels))

    want_loss, want_grad = jax.value_and_grad(whole)(jnp.asarray(logits))
    assert_trees_close(loss, want_loss, what="loss over the real vocabulary")
    assert_trees_close(grad, want_grad, what="logit gradients (zero at padding ids)")
