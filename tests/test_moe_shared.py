"""Shared experts (`MoEOptions(shared_experts=n)`, DeepSeek-MoE / Qwen-MoE style): a dense
MLP of `n * expert_hidden` hidden units that every token goes through, its output added to
the routed experts'. The MoE GPT with one trained on data x expert x model equals one
device; the block's output is exactly the routed one plus the shared MLP's; the FLOPs'
and parameters' counts include it; bad values and a Mixtral save are refused."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_moe_gpt import gpt_parity

import eqxpar
from eqxpar.models import (
    GPT,
    Llama,
    LlamaConfig,
    MoEOptions,
    gpt_flops_per_token,
    gpt_matmul_params,
    llama_matmul_params,
    next_token_loss,
    save_hf,
)
from eqxpar.nn import layer_norm

VOCAB, SEQ, DIM = 32, 8, 16
CONFIG = LlamaConfig(
    vocab_size=VOCAB, dim=DIM, num_layers=2, num_heads=2, num_kv_heads=2, hidden_dim=32, max_seq_len=SEQ
)


def options(shared, **fields):
    return MoEOptions(
        4, 2, capacity_factor=1.0, aux_loss_weight=0.1, z_loss_weight=1e-2, shared_experts=shared, **fields
    )


def moe_gpt(shared, layers=1, seed=0):
    return GPT(
        VOCAB, SEQ, dim=DIM, num_heads=2, num_layers=layers, mlp_ratio=2, pad_vocab_to_multiple_of=8,
        moe=options(shared), key=jax.random.key(seed),
    )  # fmt: skip


def tokens(size, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, size=(size, SEQ + 1)).astype(np.int32)


def test_moe_gpt_with_shared_experts_on_data_expert_model_equals_one_device():
    """data=2, expert=2, model=2: the shared MLP split over `model` (its row-parallel output
    summed there) and copied over `expert` (its gradients summed over data x expert, as the
    attention's); loss with aux losses, gradients and parameters after 2 steps."""
    mesh = eqxpar.make_mesh(data=2, expert=2, model=2)
    model = moe_gpt(shared=1)
    print(gpt_parity(model, lambda m, b, key: next_token_loss(m, b, key=key), mesh, tokens(8)))


def _one_device(fn, *args):
    mesh = eqxpar.make_mesh(data=1, expert=1, model=1)
    run = eqxpar.filter_shard_map(fn, mesh=mesh, in_specs=(P(),) * len(args), out_specs=P())
    return eqx.filter_jit(run)(*args)


def _x(seed=1):
    return jax.random.normal(jax.random.key(seed), (2, SEQ, DIM))


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_the_block_adds_the_shared_mlp_to_the_routed_output(kind):
    """With and without shared experts the same key draws the same attention and routed
    experts; the block with them returns exactly the block without them plus the shared
    MLP of the normalised residual stream after attention (once: not dropped, not doubled);
    with the shared MLP's output weights zeroed it returns the block without them."""
    if kind == "gpt":
        with_shared, without = moe_gpt(2).blocks[0], moe_gpt(0).blocks[0]
        assert with_shared.shared_experts.width_size == 2 * 32  # 2 x expert_hidden (mlp_ratio x dim)

        def parts(block, x):
            y = x + block.attention(layer_norm(block.attention_norm, x))
            return block(x)[0], layer_norm(block.mlp_norm, y)

        zero = lambda b: (b.shared_experts.output.weight, b.shared_experts.output.bias)  # noqa: E731
    else:
        moe = options(2, every=1)
        with_shared = Llama(CONFIG, moe=moe, key=jax.random.key(0)).layers[0]
        without = Llama(CONFIG, moe=options(0, every=1), key=jax.random.key(0)).layers[0]
        assert with_shared.shared_experts.gate_proj.weight.shape == (2 * 32, DIM)

        def parts(block, x):
            cos, sin = block.self_attn.rotary_angles(jnp.arange(SEQ), x.dtype)
            y = x + block.self_attn(block.input_layernorm(x), cos, sin)
            return block(x, cos=cos, sin=sin)[0], block.post_attention_layernorm(y)

        zero = lambda b: (b.shared_experts.down_proj.weight,)  # noqa: E731

    def check(a, zeroed, b, x):  # one program: with, with zeroed, without, expected
        out, normed = parts(a, x)
        base = parts(b, x)[0]
        return out, parts(zeroed, x)[0], base, base + a.shared_experts(normed)

    zeroed = eqx.tree_at(zero, with_shared, replace_fn=jnp.zeros_like)
    out, out_zeroed, base, expected = _one_device(check, with_shared, zeroed, without, _x())
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    assert float(jnp.max(jnp.abs(out - base))) > 1e-3  # the shared MLP is there
    np.testing.assert_array_equal(out_zeroed, base)


def _weights(tree):
    return sum(leaf.size for leaf in jax.tree.leaves(eqx.filter(tree, eqx.is_array)) if leaf.ndim >= 2)


@pytest.mark.parametrize("shared", [0, 1, 2])
def test_the_parameter_and_flop_counts_include_the_shared_experts(shared):
    gpt = moe_gpt(shared, layers=2)
    embeddings = gpt.token_embedding.weight.size + gpt.position_embedding.weight.size
    assert gpt_matmul_params(gpt, all_experts=True, count_padding=True) == _weights(gpt) - embeddings
    attention, router, expert = 4 * DIM * DIM, DIM * 4, 3 * DIM * 32
    per_block = attention + router + 2 * expert + shared * 2 * DIM * 32  # top-2; GELU MLP: 2 matrices
    assert gpt_matmul_params(gpt) == 2 * per_block + VOCAB * DIM
    assert gpt_flops_per_token(gpt) == 6 * gpt_matmul_params(gpt) + 12 * 2 * SEQ * DIM

    llama = Llama(CONFIG, moe=options(shared, every=2), key=jax.random.key(0))  # layer 1 of 2 MoE
    embedding = llama.embed_tokens.weight.size
    assert llama_matmul_params(llama, all_experts=True) == _weights(llama) - embedding
    dense_mlp = 3 * DIM * CONFIG.hidden_dim
    moe_mlp = router + (2 + shared) * expert
    assert llama_matmul_params(llama) == 2 * attention + dense_mlp + moe_mlp + VOCAB * DIM


@pytest.mark.parametrize("value", [-1, 1.5, True, "1"])
def test_bad_shared_experts_are_refused(value):
    with pytest.raises(ValueError, match=r"shared_experts=.*non-negative integer.*0 for none"):
        MoEOptions(4, shared_experts=value)


def test_a_mixtral_save_refuses_shared_experts(tmp_path):
    moe = MoEOptions(4, 2, capacity_factor=None, normalize_weights=True, shared_experts=1)
    model = Llama(CONFIG, moe=moe, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"moe.shared_experts=1 .*shared_experts=0"):
        save_hf(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
