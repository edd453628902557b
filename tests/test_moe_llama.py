"""The Llama with `moe=` (Mixtral-style MoE layers) trained with `expert_axis="expert"` equals
one device: loss with the routers' auxiliary losses, gradients and parameters after two
SGD-with-momentum steps; its bad options are named."""

import equinox as eqx
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_moe_train import expert_parity

import eqxpar
from eqxpar.models import Llama, LlamaConfig, LlamaMoEBlock, MoEOptions, llama_loss

CONFIG = LlamaConfig(vocab_size=32, dim=16, num_layers=2, num_heads=2, num_kv_heads=2, hidden_dim=32, max_seq_len=8)


def moe_llama(every=2, experts=8, capacity_factor=1.0):
    moe = MoEOptions(experts, 2, every, capacity_factor, aux_loss_weight=0.1, z_loss_weight=1e-2)
    return Llama(CONFIG, moe=moe, key=jax.random.key(0))


def loss_fn(model, tokens, key):
    return llama_loss(model, tokens, key=key)


@pytest.mark.thorough  # the MoE GPT's parity runs by default; the layer and the step are the same
def test_moe_llama_with_an_expert_axis_equals_one_device():
    model = moe_llama(every=2)  # layer 0 dense, layer 1 Mixtral-style
    assert [type(b).__name__ for b in model.layers] == ["LlamaBlock", "LlamaMoEBlock"]
    mesh = eqxpar.make_mesh(data=2, expert=4, model=1)
    tokens = np.random.default_rng(0).integers(0, 32, size=(8, 9)).astype(np.int32)
    expert_parity(model, loss_fn, mesh, tokens, strategy="hybrid")


def test_the_llama_reports_its_moe_layers_aux():
    model = moe_llama(every=1)
    mesh = eqxpar.make_mesh(data=1, expert=1, model=1)
    run = eqxpar.filter_shard_map(lambda m, t: m(t, return_aux=True)[1], mesh=mesh, in_specs=(P(), P()), out_specs=P())
    auxes = eqx.filter_jit(run)(model, np.zeros((3, 8), np.int32))
    assert len(auxes) == 2 and all(isinstance(b, LlamaMoEBlock) for b in model.layers)
    # Each of the 3 sequences' 8 tokens makes 2 choices, counted per sequence.
    assert [a.tokens_per_expert.shape for a in auxes] == [(3, 8), (3, 8)]
    assert all(int(a.tokens_per_expert.sum()) == 3 * 8 * 2 for a in auxes)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"moe": MoEOptions(4, every=3)}, r"moe.every=3 is more than the config's num_layers=2"),
        ({"moe": MoEOptions(4), "scan_layers": True}, r"moe= needs scan_layers=False"),
        ({"moe": (4, 2)}, r"moe must be an eqxpar.models.MoEOptions"),
    ],
)
def test_bad_llama_moe_options(options, message):
    with pytest.raises(ValueError, match=message):
        Llama(CONFIG, key=jax.random.key(0), **options)
