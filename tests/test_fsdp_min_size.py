"""fsdp_specs(min_size=...): arrays below the size stay whole on every FSDP shard (their
gradients join the combined all-reduce), the rest are split; training equals one device."""

import functools

import equinox as eqx
import jax
import numpy as np
import pytest
from _gpt_reference import loss_fn, reference_run, sgd_momentum, tiny_gpt, token_batch
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import eqxpar
import eqxpar.nn
from eqxpar.inspect import CommReport
from eqxpar.testing import assert_trees_close
from eqxpar.train import fsdp_specs, fsdp_step, optimizer_specs

OPTIMIZER = sgd_momentum()
# tiny_gpt: biases and norm scales have 32 or 128 elements, weight matrices 1,024 or more;
# 129 keeps the small ones whole and splits the rest (min_size=0 is tests/test_fsdp.py's).
MIN_SIZE = 129


@functools.cache
def cached_step(sizes: tuple, min_size: int):
    mesh = eqxpar.make_mesh(**dict(sizes))
    specs = fsdp_specs(tiny_gpt(0), mesh, param_specs=eqxpar.nn.partition_specs(tiny_gpt(0), mesh), min_size=min_size)
    return specs, fsdp_step(loss_fn, OPTIMIZER, mesh, param_specs=specs, units=lambda m: m.blocks)


def _arrays(tree):
    return jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))


def _split_leaves(specs, model):
    flat = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    leaves = jax.tree.leaves(model)
    return [(x.size, "fsdp" in str(s)) for x, s in zip(leaves, flat) if eqx.is_inexact_array(x)]


# Two meshes (compiles dominate): FSDP alone, and FSDP x tensor parallelism.
@given(sizes=st.sampled_from([{"fsdp": 8, "model": 1}, {"fsdp": 2, "model": 4}]), seed=st.integers(0, 2**16))
def test_fsdp_min_size_matches_one_device(sizes, seed):
    """Parity with one device over two steps: a gradient summed twice or not at all (the
    whole arrays' all-reduce, the split arrays' reduce-scatter) moves the parameters."""
    batches = [token_batch(8, seed + i) for i in range(2)]
    want, want_losses = reference_run(tiny_gpt(seed), batches, OPTIMIZER)
    specs, step = cached_step(tuple(sizes.items()), MIN_SIZE)
    model = tiny_gpt(seed)
    opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_inexact_array))
    opt_state = eqxpar.shard(opt_state, step.mesh, optimizer_specs(OPTIMIZER, opt_state, model, specs))
    model = eqxpar.shard(model, step.mesh, specs)
    losses = []
    for batch in batches:
        model, opt_state, metrics = step(model, opt_state, eqxpar.shard(batch, step.mesh, P("fsdp")))
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_trees_close(model, want, what="parameters after FSDP steps with min_size")
    if sizes["fsdp"] > 1:
        split = _split_leaves(specs, tiny_gpt(0))
        assert not any(s for n, s in split if n < MIN_SIZE) and all(s for n, s in split if n >= 1024)


def test_fsdp_min_size_gathers_fewer_arrays():
    """Arrays kept whole are neither gathered nor reduce-scattered: the program has as many
    all-gathers and reduce-scatters as split arrays, and fewer than with min_size=0."""
    counts = {}
    for min_size in (0, MIN_SIZE):
        specs, step = cached_step((("fsdp", 8), ("model", 1)), min_size)
        model = eqxpar.shard(tiny_gpt(0), step.mesh, specs)
        opt_state = OPTIMIZER.init(eqx.filter(model, eqx.is_inexact_array))
        opt_state = eqxpar.shard(opt_state, step.mesh, optimizer_specs(OPTIMIZER, opt_state, model, specs))
        report = CommReport.of(step.lower(model, opt_state, eqxpar.shard(token_batch(8, 0), step.mesh, P("fsdp"))))
        kinds = [c.kind for c in report.collectives()]
        n_split = sum(s for _, s in _split_leaves(specs, tiny_gpt(0)))
        assert kinds.count("all-gather") == kinds.count("reduce-scatter") == n_split
        counts[min_size] = n_split
    assert 0 < counts[MIN_SIZE] < counts[0]


@pytest.mark.parametrize("bad", [-1, 1.5, "big"])
def test_fsdp_min_size_rejects_bad_values(bad):
    mesh = eqxpar.make_mesh(fsdp=8, model=1)
    with pytest.raises(ValueError, match="min_size"):
        fsdp_specs(tiny_gpt(0), mesh, min_size=bad)
