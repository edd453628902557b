"""The Llama equals Hugging Face's `LlamaForCausalLM` given the same weights, each tensor
copied to the field of the same name with no permutation (RoPE's half rotation, the
grouped-query head order, Llama 3's frequency scaling, tied embeddings).

Needs PyTorch and transformers, which eqxpar does not depend on: skipped without them.
(Run on an H200 machine with transformers 5.17.0 and torch 2.11.0, 2026-11-26: logits
within 3.7e-6 absolute, 5.9e-7 normwise, the inverse frequencies bit for bit equal.)
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hf_transformers_models import SCALING, hugging_face_llama, torch_logits  # skips without torch
from jax.sharding import PartitionSpec as P

import eqxpar
import eqxpar.nn
from eqxpar.models import Llama, LlamaConfig, rope_frequencies


def load(model: Llama, state: dict) -> Llama:
    """Every Hugging Face tensor into the field of the same name, as it is."""

    def put(model, where, name):
        return eqx.tree_at(where, model, jnp.asarray(state[name].detach().float().numpy()))

    model = put(model, lambda m: m.embed_tokens.weight, "model.embed_tokens.weight")
    for i in range(model.num_layers):
        for part, names in (
            ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
            ("mlp", ("gate_proj", "up_proj", "down_proj")),
        ):
            for name in names:
                where = lambda m, i=i, part=part, name=name: getattr(getattr(m.layers[i], part), name).weight  # noqa: E731
                model = put(model, where, f"model.layers.{i}.{part}.{name}.weight")
        for name in ("input_layernorm", "post_attention_layernorm"):
            model = put(
                model, lambda m, i=i, name=name: getattr(m.layers[i], name).weight, f"model.layers.{i}.{name}.weight"
            )
    model = put(model, lambda m: m.norm.weight, "model.norm.weight")
    if model.lm_head is not None:
        model = put(model, lambda m: m.lm_head.weight, "lm_head.weight")
    return model


@pytest.mark.parametrize(
    "num_kv_heads, tie, scaling", [(2, False, None), (1, True, SCALING), (8, False, SCALING), (4, True, None)]
)
def test_equals_hugging_face_llama(num_kv_heads, tie, scaling):
    reference = hugging_face_llama(num_kv_heads, tie, scaling, seed=num_kv_heads)
    config = LlamaConfig(
        vocab_size=64,
        dim=32,
        num_layers=2,
        num_heads=8,
        num_kv_heads=num_kv_heads,
        hidden_dim=64,
        rope_theta=10000.0,
        rope_scaling=scaling,
        tie_embeddings=tie,
        max_seq_len=16,
    )
    model = load(Llama(config, key=jax.random.key(0)), reference.state_dict())
    inv_freq = reference.model.rotary_emb.inv_freq.detach().float().numpy()
    np.testing.assert_array_equal(rope_frequencies(4, 10000.0, config.scaling), inv_freq)
    tokens = np.random.default_rng(num_kv_heads).integers(0, 64, (3, 16))
    want = torch_logits(reference, tokens)
    mesh = eqxpar.make_mesh(model=1)
    specs = eqxpar.nn.partition_specs(model, mesh)
    forward = eqxpar.filter_shard_map(
        lambda m, t: m(t), mesh=mesh, in_specs=(specs, P()), out_specs=P(None, None, "model")
    )
    with jax.default_matmul_precision("highest"):
        got = np.asarray(eqx.filter_jit(forward)(model, jnp.asarray(tokens, jnp.int32)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)
