"""MixtureOfExperts on one device against a plain reference, and its bad inputs.

The reference below is written from the definitions, one token at a time in float64 NumPy:
a loop over the experts, an explicit top-k (a sort), the capacity drops in the documented
priority order (all first choices in token order, then all second choices) and the
balancing terms. The layer (float32, vectorised, scatter/gather buffers or ragged_dot)
must equal it to 1e-5 relative, with the same routed and dropped counts.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar import nn
from eqxpar.testing import assert_trees_close

KEY = jax.random.key(0)


def random_moe(rng, dim, hidden, experts, top_k, *, bias=False, **options):
    """A layer with NumPy-drawn weights (no eager JAX initialisation to compile per shape)."""
    shapes = eqx.filter_eval_shape(
        nn.MixtureOfExperts, dim, hidden, experts, top_k, balance_bias=bias, **options, key=KEY
    )

    def fill(s):
        if not isinstance(s, jax.ShapeDtypeStruct):
            return s
        scale = 1.0 / math.sqrt(s.shape[-2] if s.ndim == 3 else s.shape[-1])
        if s.shape == (experts,):  # the selection bias: large enough to change choices
            scale = 0.3
        return (rng.normal(size=s.shape) * scale).astype(np.float32)

    return jax.tree.map(fill, shapes)


def reference(layer, x):
    """(output, load-balance loss, z-loss, tokens per expert, dropped) per group, float64."""
    w_router = np.asarray(layer.router.weight, np.float64)
    gate, up, down = (np.asarray(a, np.float64) for a in (layer.gate, layer.up, layer.down))
    bias = None if layer.selection_bias is None else np.asarray(layer.selection_bias, np.float64)
    e_count, k = layer.num_experts, layer.top_k
    groups, tokens, dim = x.shape
    capacity = (
        tokens
        if layer.capacity_factor is None
        else min(tokens, math.ceil(layer.capacity_factor * tokens * k / e_count))
    )

    def expert(e, v):
        h = v @ gate[e]
        return ((h / (1.0 + np.exp(-h))) * (v @ up[e])) @ down[e]

    outs, balance, z_loss, routed, dropped = [], [], [], [], []
    for g in range(groups):
        xs = np.asarray(x[g], np.float64)
        logits = xs @ w_router.T
        if layer.score == "softmax":
            scores = np.exp(logits - logits.max(-1, keepdims=True))
            scores /= scores.sum(-1, keepdims=True)
        else:
            scores = 1.0 / (1.0 + np.exp(-logits))
        select = scores if bias is None else scores + bias
        choices = [sorted(range(e_count), key=lambda e: (-select[t, e], e))[:k] for t in range(tokens)]
        weights = np.array([[scores[t, e] for e in choices[t]] for t in range(tokens)])
        if layer.normalize_weights:
            weights /= weights.sum(-1, keepdims=True)
        y = np.zeros((tokens, dim))
        filled, counts, lost = [0] * e_count, np.zeros(e_count, np.int64), 0
        for j in range(k):  # all first choices, in token order, then all second choices
            for t in range(tokens):
                e = choices[t][j]
                counts[e] += 1
                if filled[e] < capacity:
                    filled[e] += 1
                    y[t] += weights[t, j] * expert(e, xs[t])
                else:
                    lost += 1
        probabilities = scores / scores.sum(-1, keepdims=True)
        balance.append(e_count * np.sum(counts / (tokens * k) * probabilities.mean(0)))
        top = logits.max(-1)
        z_loss.append(np.mean((top + np.log(np.exp(logits - top[:, None]).sum(-1))) ** 2))
        outs.append(y)
        routed.append(counts)
        dropped.append(lost)
    return (
        np.stack(outs).astype(np.float32),
        np.array(balance, np.float32),
        np.array(z_loss, np.float32),
        np.stack(routed).astype(np.int32),
        np.array(dropped, np.int32),
    )


@given(
    top_k=st.sampled_from([1, 2, 3]),
    experts=st.sampled_from([4, 6]),
    capacity_factor=st.sampled_from([0.5, 1.0, 2.0, None]),
    score=st.sampled_from(["softmax", "sigmoid"]),
    normalize=st.booleans(),
    bias=st.booleans(),
    dropless_impl=st.sampled_from(["ragged_dot", "dense"]),
    seed=st.integers(0, 2**16),
)
@example(
    top_k=2, experts=4, capacity_factor=0.5, score="softmax", normalize=False, bias=False, dropless_impl="dense", seed=1
)
@example(
    top_k=2,
    experts=6,
    capacity_factor=None,
    score="sigmoid",
    normalize=True,
    bias=True,
    dropless_impl="ragged_dot",
    seed=2,
)
@example(
    top_k=1, experts=4, capacity_factor=1.0, score="softmax", normalize=False, bias=True, dropless_impl="dense", seed=3
)
def test_layer_equals_the_reference(top_k, experts, capacity_factor, score, normalize, bias, dropless_impl, seed):
    rng = np.random.default_rng(seed)
    layer = random_moe(
        rng,
        4,
        8,
        experts,
        top_k,
        bias=bias,
        score=score,
        normalize_weights=normalize,
        capacity_factor=capacity_factor,
        dropless_impl=dropless_impl,
    )
    x = rng.normal(size=(3, 7, 4)).astype(np.float32)
    y, aux = eqx.filter_jit(lambda layer, x: layer(x))(layer, x)
    want_y, want_balance, want_z, want_routed, want_dropped = reference(layer, x)
    assert_trees_close(y, want_y, what="output")
    assert_trees_close((aux.load_balance_loss, aux.z_loss), (want_balance, want_z), what="aux losses")
    assert_trees_close((aux.tokens_per_expert, aux.dropped), (want_routed, want_dropped), what="counts")
    if capacity_factor == 0.5 and top_k > 1:
        assert int(aux.dropped.sum()) > 0  # the drop path taken
    if capacity_factor is None:
        assert int(aux.dropped.sum()) == 0


def test_groups_route_alone_and_any_leading_shape_works():
    """A group's result does not depend on the other groups; one group may come as (tokens, dim)."""
    rng = np.random.default_rng(0)
    layer = random_moe(rng, 4, 8, 4, 2, capacity_factor=0.5)
    x = rng.normal(size=(2, 3, 5, 4)).astype(np.float32)
    call = eqx.filter_jit(lambda layer, x: layer(x))
    y, aux = call(layer, x)
    assert y.shape == x.shape and aux.dropped.shape == (2, 3) and aux.tokens_per_expert.shape == (2, 3, 4)
    y1, aux1 = call(layer, x[1, 2])
    assert_trees_close(y1, y[1, 2], what="one group alone")
    assert_trees_close(aux1, jax.tree.map(lambda a: a[1, 2], aux), what="its aux alone")


def test_gradients_flow_to_router_and_experts_but_not_the_selection_bias():
    rng = np.random.default_rng(1)
    layer = random_moe(rng, 4, 8, 4, 2, bias=True, capacity_factor=1.0)
    x = rng.normal(size=(2, 6, 4)).astype(np.float32)

    def loss(layer):
        y, aux = layer(x)
        return jnp.sum(y**2) + aux.load_balance_loss.sum() + aux.z_loss.sum()

    grads = eqx.filter_jit(eqx.filter_grad(loss))(layer)
    for name in ("gate", "up", "down"):
        assert float(jnp.abs(getattr(grads, name)).max()) > 0
    assert float(jnp.abs(grads.router.weight).max()) > 0
    assert float(jnp.abs(grads.selection_bias).max()) == 0.0


def test_router_bias_balances_the_load_without_a_loss():
    """Auxiliary-loss-free balancing: biasing the choice towards under-used experts evens
    the load out over steps, though nothing is trained."""
    rng = np.random.default_rng(2)
    layer = random_moe(rng, 4, 8, 4, 1, bias=True, capacity_factor=None)
    layer = eqx.tree_at(lambda m: m.selection_bias, layer, jnp.zeros(4, jnp.float32))
    # Skewed tokens: most prefer one expert.
    x = (rng.normal(size=(4, 16, 4)) + np.array([2.0, 0.0, 0.0, 0.0])).astype(np.float32)
    route = eqx.filter_jit(lambda layer, x: layer(x)[1].tokens_per_expert)
    first = np.asarray(route(layer, x)).sum(0)
    for _ in range(30):
        counts = route(layer, x)
        layer = eqx.tree_at(
            lambda m: m.selection_bias, layer, nn.update_router_bias(layer.selection_bias, counts, 0.02)
        )
    last = np.asarray(route(layer, x)).sum(0)
    assert first.sum() == last.sum() == 64
    assert last.max() - last.min() < first.max() - first.min()


def test_update_router_bias_moves_towards_the_mean():
    bias = jnp.array([0.0, 0.5, -0.5, 0.0], jnp.float32)
    counts = jnp.array([[4, 1, 3, 0], [4, 1, 1, 2]], jnp.int32)  # loads 8, 2, 4, 2; mean 4
    new = nn.update_router_bias(bias, counts, 0.1)
    np.testing.assert_allclose(np.asarray(new), [-0.1, 0.6, -0.5, 0.1], rtol=1e-6)
    with pytest.raises(ValueError, match=r"last dimension.*4 experts"):
        nn.update_router_bias(bias, jnp.zeros((2, 3), jnp.int32), 0.1)
    with pytest.raises(ValueError, match=r"rate must be a non-negative number"):
        nn.update_router_bias(bias, counts, -1.0)


def test_capacity_formula():
    assert nn.expert_capacity(8, 4, 2, 1.0) == 4
    assert nn.expert_capacity(7, 4, 2, 1.25) == 5  # ceil(4.375)
    assert nn.expert_capacity(7, 4, 2, 10.0) == 7  # never more slots than tokens
    assert nn.expert_capacity(7, 4, 2, None) == 7
    assert nn.expert_capacity(3, 8, 1, 0.01) == 1


# --- Bad inputs: ValueErrors that name the fix, before anything compiles -----------------


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(top_k=5), r"top_k=5.*num_experts=4.*choose top_k in 1..4"),
        (dict(top_k=0), r"top_k=0.*choose top_k in 1..4"),
        (dict(capacity_factor=0.0), r"capacity_factor=0.0.*positive finite number.*None for the dropless"),
        (dict(capacity_factor=-1.25), r"capacity_factor=-1.25.*positive finite"),
        (dict(capacity_factor=float("nan")), r"capacity_factor=nan.*positive finite"),
        (dict(capacity_factor=float("inf")), r"capacity_factor=inf.*positive finite"),
        (dict(capacity_factor="1.25"), r"capacity_factor='1.25'.*positive finite"),
        (dict(capacity_factor=True), r"capacity_factor=True.*positive finite"),
        (dict(score="relu"), r"score must be one of \('softmax', 'sigmoid'\)"),
        (dict(dropless_impl="sparse"), r"dropless_impl must be one of"),
    ],
)
def test_bad_options_are_named(options, message):
    kwargs = dict(top_k=2) | options
    with pytest.raises(ValueError, match=message):
        nn.MixtureOfExperts(4, 8, 4, kwargs.pop("top_k"), **kwargs, key=KEY)


def test_experts_that_do_not_split_over_the_expert_axis():
    layer = eqx.filter_eval_shape(nn.MixtureOfExperts, 4, 8, 6, 2, key=KEY)
    with pytest.raises(ValueError, match=r"num_experts=6 is not divisible by the size 4 of the expert axis 'expert'.*"):
        nn.partition_specs(layer, eqxpar.make_mesh(expert=4))


def test_indivisible_experts_are_caught_while_tracing_too():
    """Replicated weights pass shard_map's own checks; the layer still refuses to split 6
    experts over 4 devices, before compiling."""
    mesh = eqxpar.make_mesh(expert=4)
    layer = nn.MixtureOfExperts(4, 8, 6, 2, key=KEY)
    f = eqxpar.filter_shard_map(lambda m, x: m(x)[0], mesh=mesh, in_specs=(P(), P("expert")), out_specs=P("expert"))
    with pytest.raises(ValueError, match=r"num_experts=6 is not divisible by the size 4.*multiple of 4"):
        eqx.filter_jit(f).lower(layer, jnp.zeros((4, 3, 4)))


def test_an_expert_axis_missing_from_the_mesh():
    layer = eqx.filter_eval_shape(nn.MixtureOfExperts, 4, 8, 4, 2, key=KEY)
    with pytest.raises(ValueError, match=r"axis 'expert'.*mesh does not have.*Add that axis"):
        nn.partition_specs(layer, eqxpar.make_mesh(data=2))


def test_input_without_a_token_dimension():
    layer = nn.MixtureOfExperts(4, 8, 4, 2, key=KEY)
    with pytest.raises(ValueError, match=r"must be \(\*groups, tokens, 4\)"):
        eqx.filter_eval_shape(layer, jnp.zeros((4,)))
    with pytest.raises(ValueError, match=r"must be \(\*groups, tokens, 4\)"):
        eqx.filter_eval_shape(layer, jnp.zeros((3, 5)))
