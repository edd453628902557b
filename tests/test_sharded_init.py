"""`eqxpar.init_sharded`: a model created directly in its shards equals the dense
initialisation exactly, lands with the shardings asked for, and no device holds more than
its shard and the initialisation's temporaries (read from the compiled initialisation)."""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar.models import GPT, Llama, LlamaConfig, llama_config


def _arrays(tree):
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


@pytest.mark.parametrize(
    "make, sizes, specs",
    [
        (
            lambda: Llama(llama_config("tiny"), key=jax.random.key(3)),
            {"fsdp": 8},
            lambda mesh: lambda abstract: eqxpar.train.fsdp_specs(abstract, mesh),
        ),
        (
            lambda: Llama(llama_config("tiny"), scan_layers=True, key=jax.random.key(4)),
            {"data": 2, "model": 4},
            lambda mesh: lambda abstract: eqxpar.nn.partition_specs(abstract, mesh),
        ),
        (
            lambda: GPT(64, 16, 32, 4, 2, scan_layers=True, key=jax.random.key(1)),
            {"fsdp": 2, "model": 4},
            lambda mesh: (
                lambda abstract: eqxpar.train.fsdp_specs(
                    abstract, mesh, param_specs=eqxpar.nn.partition_specs(abstract, mesh)
                )
            ),
        ),
    ],
    ids=["llama-fsdp", "llama-scan-tp", "gpt-scan-fsdp-tp"],
)
def test_sharded_init_equals_the_dense_init_and_lands_split(make, sizes, specs):
    mesh = eqxpar.make_mesh(**sizes)
    model = eqxpar.init_sharded(make, mesh, specs(mesh))
    # The values: those of the dense initialisation, compiled (bit for bit); an eager
    # make() rounds its unfused element-wise steps differently, within one float32 ulp.
    dense = eqx.filter_jit(lambda: eqx.filter(make(), eqx.is_array))()
    eager = make()
    assert jax.tree.structure(eqx.filter(model, eqx.is_array)) == jax.tree.structure(dense)
    for got, want, plain in zip(_arrays(model), jax.tree.leaves(dense), _arrays(eager)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        np.testing.assert_allclose(np.asarray(got), np.asarray(plain), rtol=1.2e-7, atol=1e-8)
    # The placement: what eqxpar.shard would give the same specs.
    placed = eqxpar.shard(eager, mesh, specs(mesh)(eqx.filter_eval_shape(make)))
    for got, want in zip(_arrays(model), _arrays(placed)):
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim), (got.sharding, want.sharding)
    assert any(x.sharding.spec != P() for x in _arrays(model))


def _init_memory(config: LlamaConfig, devices: int = 8):
    mesh = eqxpar.make_mesh(fsdp=devices)
    make = lambda: Llama(config, key=jax.random.key(0))  # noqa: E731
    abstract = eqx.filter_eval_shape(make)
    arrays = [x for x in jax.tree.leaves(abstract) if isinstance(x, jax.ShapeDtypeStruct)]
    specs = [s for x, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(eqxpar.train.fsdp_specs(abstract, mesh)))]
    whole = sum(x.size * x.dtype.itemsize for x in arrays)
    # Per device: each array's bytes over the devices its spec splits it across.
    shard = sum(x.size * x.dtype.itemsize // (devices if s != P() else 1) for x, s in zip(arrays, specs))
    lowered = eqxpar.init_sharded(make, mesh, lambda a: eqxpar.train.fsdp_specs(a, mesh), lower=True)
    memory = lowered.compile().memory_analysis()
    # XLA counts the output tuple's table of buffer pointers too: 8 bytes per array.
    return whole, shard, memory.output_size_in_bytes - 8 * len(arrays), memory.temp_size_in_bytes


def _check_memory(config: LlamaConfig):
    """Each device's output is exactly its shard (the arrays fsdp_specs splits, 1/8 each;
    the few it keeps whole, in full), and its temporaries (the random bits of its blocks
    before they become floats) stay under its shard: the initialisation's peak per device
    is at most twice its shard, about a quarter of the whole model, which no device ever
    holds."""
    whole, shard, output, temp = _init_memory(config)
    assert output == shard < whole / 7
    assert temp <= output, (temp, output)


def test_sharded_init_holds_a_shard_per_device():
    _check_memory(LlamaConfig(vocab_size=4096, dim=256, num_layers=4, num_heads=8, num_kv_heads=2, hidden_dim=768))


@pytest.mark.thorough
def test_an_8b_llama_initialises_in_its_shards():
    """Llama-3-8B's shape (29.9 GiB of float32 parameters) on 8 devices: 3.74 GiB of
    output and 3.32 GiB of temporaries per device when measured (2026-11-26)."""
    _check_memory(llama_config("llama-3-8b"))


def test_sharded_init_refuses_bad_input_before_computing():
    mesh = eqxpar.make_mesh(fsdp=8)
    make = lambda: Llama(llama_config("tiny"), key=jax.random.key(0))  # noqa: E731
    with pytest.raises(ValueError, match="make must be a function of no arguments"):
        eqxpar.init_sharded(llama_config("tiny"), mesh, P())
    with pytest.raises(ValueError, match=r"init_sharded specs at \.embed_tokens\.weight: .* has 3 entries"):
        eqxpar.init_sharded(make, mesh, P(None, "fsdp", None))
    with pytest.raises(ValueError, match=r"init_sharded specs at \.weight: .*divisible"):
        eqxpar.init_sharded(lambda: eqx.nn.Linear(3, 5, key=jax.random.key(0)), mesh, lambda abstract: P("fsdp"))
    with pytest.raises(ValueError, match="'expert'"):
        eqxpar.init_sharded(make, mesh, P("expert"))
