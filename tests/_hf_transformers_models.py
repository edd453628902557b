"""Tiny random transformers models for the tests that compare eqxpar with transformers
itself (tests/test_hf_transformers.py, tests/test_llama_hf.py).

Needs PyTorch and transformers, which eqxpar does not depend on: importing this module
skips the importing test module without them (CI has neither).
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Llama 3's frequency scaling, with wavelengths at head_dim 4 on all three of its branches.
SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def _randomise(model, is_norm):
    """Weights far from their initialisation (attention far from uniform): norms' weights
    around 1, the rest around 0."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if is_norm(name) else 0.2 * torch.randn_like(p))
    return model


def hugging_face_llama(num_kv_heads: int, tie: bool, scaling, seed: int):
    """A random `LlamaForCausalLM` (float32, eval mode): 8 heads over hidden size 32, 2 layers,
    `num_kv_heads` key/value heads, tied or untied, Llama 3 scaling or none, in the config
    style of the installed transformers (5.x: `rope_parameters`; 4.x: `rope_theta`)."""
    config = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=16,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
    )
    if int(transformers.__version__.split(".")[0]) >= 5:
        rope = {"rope_type": "default"} if scaling is None else {"rope_type": "llama3", **scaling}
        config["rope_parameters"] = {**rope, "rope_theta": 10000.0}
    else:
        config["rope_theta"] = 10000.0
        config["rope_scaling"] = None if scaling is None else {"rope_type": "llama3", **scaling}
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval().float()
    return _randomise(model, lambda name: "norm" in name)


def hugging_face_gpt2(tie: bool, seed: int):
    """A random `GPT2LMHeadModel` (float32, eval mode): 4 heads over n_embd 32, 2 layers, an
    MLP of 64 units, a vocabulary of 50 (eqxpar pads it to 128) and layer_norm_epsilon 1e-3."""
    config = transformers.GPT2Config(
        vocab_size=50,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_inner=64,
        layer_norm_epsilon=1e-3,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config).eval().float()
    return _randomise(model, lambda name: ".ln_" in name and name.endswith("weight"))


def hugging_face_mixtral(tie: bool, seed: int):
    """A random `MixtralForCausalLM` (float32, eval mode): 8 heads (4 key/value heads) over
    hidden size 32, 2 layers of 4 experts of 24 units, 2 chosen per token, rotary base 5e5,
    in the config style of the installed transformers."""
    config = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=16,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_jitter_noise=0.0,
        sliding_window=None,
    )
    if int(transformers.__version__.split(".")[0]) >= 5:
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    else:
        config["rope_theta"] = 500000.0
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**config)).eval().float()
    return _randomise(model, lambda name: "norm" in name)


def torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()
