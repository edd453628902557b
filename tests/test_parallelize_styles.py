"""Each `parallelize` style communicates what its table says (`eqxpar.nn._plan.STYLES`, the
forward and backward columns of `str(plan)` and of `parallelize`'s docstring): a tiny dense
layer of each kind, parallelized with that style over `model=4`, is compiled forward and
forward+backward (gradients of the layer and of its input), and the kinds of the compiled
collectives are compared with the table's. A few seconds: one tiny layer per style."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar import nn
from eqxpar.inspect import communication_report
from eqxpar.nn._plan import STYLES

N, BATCH, SEQ, IN, OUT = 4, 3, 5, 8, 12


class _Holder(eqx.Module):
    layer: eqx.Module


class _Pair(eqx.Module):
    """A "row" layer needs a "column" one before it (parallelize checks the pair)."""

    column: eqx.nn.Linear
    layer: eqx.nn.Linear


def _dense(style: str) -> tuple[eqx.Module, jax.Array]:
    """A tiny dense layer the style takes, and a global input batch for it."""
    key = jax.random.key(0)
    if style == "vocab":
        return eqx.nn.Embedding(4 * N, IN, key=key), jnp.arange(BATCH) % (4 * N)
    if style == "mlp":
        return eqx.nn.MLP(IN, OUT, 4 * N, 1, key=key), jnp.ones((BATCH, IN))
    if style == "attention":
        return eqx.nn.MultiheadAttention(N, IN, key=key), jnp.ones((BATCH, SEQ, IN))
    return eqx.nn.Linear(IN, OUT, key=key), jnp.ones((BATCH, IN))


def _kinds(report, ignore: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The kinds of the compiled collectives, sorted, without one of each kind in `ignore`."""
    kinds = sorted(c.kind for c in report.collectives(stage="compiled"))
    for kind in ignore:
        kinds.remove(kind)
    return tuple(kinds)


def measured(style: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(forward kinds, the kinds the backward pass adds) of `style`'s layer, compiled."""
    dense, x = _dense(style)
    mesh = eqxpar.make_mesh(model=N)
    if style == "row":  # the pair's row layer, alone; its input arrives split (x_spec)
        pair = _Pair(eqx.nn.Linear(OUT, IN, key=jax.random.key(1)), dense)
        layer = nn.parallelize(pair, {"column": "column", "layer": "row"}, mesh=mesh).layer
    else:
        layer = nn.parallelize(_Holder(dense), {"layer": style}, mesh=mesh).layer
    specs = nn.partition_specs(layer, mesh)
    # A row layer takes the features a column layer left split; a column layer leaves its
    # output split.
    x_spec = P(None, "model") if style == "row" else P()
    out_spec = P(None, "model") if style == "column" else P()
    call = (lambda layer, x: layer(x, x, x)) if style == "attention" else (lambda layer, x: layer(x))
    forward = eqxpar.filter_shard_map(
        lambda layer, x: jax.vmap(call, in_axes=(None, 0))(layer, x),
        mesh=mesh,
        in_specs=(specs, x_spec),
        out_specs=out_spec,
    )
    placed = eqxpar.shard(layer, mesh, specs)
    x = eqxpar.shard(x, mesh, x_spec)
    # A loss that needs the forward result in the backward pass (as training does), so the
    # compiler keeps the forward collectives; the integer ids of "vocab" take no gradient.
    differentiable = jnp.issubdtype(x.dtype, jnp.floating)
    loss = lambda args: jnp.sum(forward(*args) ** 2)  # noqa: E731
    if differentiable:
        grads = eqx.filter_grad(loss)
        args = (placed, x)
    else:
        grads = eqx.filter_grad(lambda layer: loss((layer, x)))
        args = placed
    fwd = _kinds(communication_report(forward, placed, x))
    both = _kinds(communication_report(grads, args))
    # The backward pass runs the forward one first (its collectives once more in `both`).
    return fwd, _kinds_minus(both, fwd)


def _kinds_minus(both: tuple[str, ...], fwd: tuple[str, ...]) -> tuple[str, ...]:
    rest = list(both)
    for kind in fwd:
        assert kind in rest, f"the forward pass's {kind} is missing from forward+backward: {both}"
        rest.remove(kind)
    return tuple(sorted(rest))


@pytest.mark.parametrize("style", list(STYLES))
def test_each_style_communicates_what_its_table_says(style):
    forward, backward = measured(style)
    row = STYLES[style]
    assert (forward, backward) == (tuple(sorted(row.forward)), tuple(sorted(row.backward))), (
        f"style {style!r}: the table says forward {row.text('forward')}, backward "
        f"{row.text('backward')}; compiled: forward {forward or 'none'}, backward {backward or 'none'}"
    )


def test_the_docstring_table_is_the_styles_table():
    """`parallelize`'s docstring lists each style's forward / backward as STYLES does."""
    doc = nn.parallelize.__doc__
    found = dict(re.findall(r'^\s*\| `"(\w+)"` \|.*\| ([\w-]+ / [\w-]+) \|\s*$', doc, re.M))
    assert found == {name: f"{s.text('forward')} / {s.text('backward')}" for name, s in STYLES.items()}
