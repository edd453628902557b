"""Collectives inside loops count once per iteration, in the lowered and the compiled
program: scans of drawn lengths, nested scans, static-bound fori_loops, and the backward
pass of a scan; a loop whose count the program does not say counts once."""

import jax
import jax.numpy as jnp
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar.inspect import communication_report


def _mapped(fn):
    mesh = eqxpar.make_mesh(data=2, model=4)
    return eqxpar.filter_shard_map(fn, mesh=mesh, in_specs=(P("model"),), out_specs=P("model"), check_vma=False)


def _counts(fn, *args):
    """All-reduces over `model` (the loops'), as lowered and as compiled."""
    report = communication_report(fn, *args)
    return report.count("all-reduce", axes="model", stage="lowered"), report.count("all-reduce", axes="model")


@settings(max_examples=6, deadline=None)
@given(outer=st.integers(0, 3), inner=st.integers(1, 4))
def test_nested_scans_multiply(outer, inner):
    def local(x):
        def inner_body(c, _):
            return jax.lax.psum(c, "model") * 0.5, None

        def outer_body(c, _):
            return jax.lax.scan(inner_body, c, None, length=inner)[0], None

        return jax.lax.scan(outer_body, x, None, length=outer)[0]

    lowered, compiled = _counts(jax.jit(_mapped(local)), jnp.ones((8,)))
    assert lowered == outer * inner
    assert compiled == outer * inner


def test_the_backward_pass_of_a_scan_counts_every_iteration():
    def local(x):
        return jax.lax.scan(lambda c, _: (jax.lax.psum(jnp.sin(c), "model"), None), x, None, length=5)[0]

    f = _mapped(local)
    lowered, compiled = _counts(jax.jit(jax.grad(lambda x: jnp.sum(f(x)))), jnp.ones((8,)))
    # psum forward, and its transpose (a psum) backward, per iteration.
    assert lowered == compiled == 10


def test_a_static_fori_loop_counts_its_iterations_and_a_data_dependent_loop_once():
    def static(x):
        return jax.lax.fori_loop(2, 9, lambda i, c: jax.lax.psum(c, "model") * 0.5, x)

    def dynamic(x):
        # The count depends on the data: neither program says it.
        return jax.lax.while_loop(lambda c: c[0] < 100.0, lambda c: jax.lax.psum(c, "model") + 1.0, x)

    assert _counts(jax.jit(_mapped(static)), jnp.ones((8,))) == (7, 7)
    assert _counts(jax.jit(_mapped(dynamic)), jnp.ones((8,))) == (1, 1)
