"""Tiny Hugging Face Mixtral checkpoint folders (safetensors and numpy, no torch) and an
independent numpy forward pass of transformers' `MixtralForCausalLM` (float64).

The folder is written with tests/_hf_files.py's `write_checkpoint`: a `config.json` as
transformers writes a MixtralConfig, and the state dict's tensors under their names
(`model.layers.{i}.block_sparse_moe.gate.weight`, `...experts.{j}.w1/w2/w3.weight`, torch
`Linear` layout `[out, in]`).
"""

import math

import numpy as np
from _hf_files import hf_tensors

# 8 query heads over 4 key/value heads of 8 channels (8 * 8 != hidden_size 32), 4 experts of
# 24 units, 2 chosen per token; every width divisible by 2 (model axis) and the experts by 4.
MIXTRAL_SHAPE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=8,
    max_position_embeddings=16,
    rms_norm_eps=1e-5,
    num_local_experts=4,
    num_experts_per_tok=2,
)
MIXTRAL_THETA = 500000.0  # not MixtralConfig's default (1e6): a loader that ignored it would fail


def mixtral_config_json(*, tie: bool = False, older: bool = True, **changes) -> dict:
    """A `config.json` as transformers writes a MixtralConfig (`older`: 4.x, top-level
    `rope_theta` and `torch_dtype`; else 5.x, `rope_parameters` and `dtype`)."""
    config = {
        "architectures": ["MixtralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "model_type": "mixtral",
        "output_router_logits": False,
        "router_aux_loss_coef": 0.02,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
        "tie_word_embeddings": tie,
        "use_cache": True,
        **MIXTRAL_SHAPE,
    }
    if older:
        config.update(rope_theta=MIXTRAL_THETA, torch_dtype="float32", transformers_version="4.46.3")
    else:
        rope = {"rope_type": "default", "rope_theta": MIXTRAL_THETA}
        config.update(rope_parameters=rope, dtype="float32", transformers_version="5.24.0")
    config.update(changes)
    return config


def mixtral_moe_tensors(prefix: str, w, shape) -> dict[str, np.ndarray]:
    """One MixtralForCausalLM layer's router and experts, drawn with `w(*shape)`."""
    d, ff = shape["hidden_size"], shape["intermediate_size"]
    tensors = {prefix + "block_sparse_moe.gate.weight": w(shape["num_local_experts"], d)}
    for j in range(shape["num_local_experts"]):
        q = f"{prefix}block_sparse_moe.experts.{j}."
        tensors.update({q + "w1.weight": w(ff, d), q + "w2.weight": w(d, ff), q + "w3.weight": w(ff, d)})
    return tensors


def mixtral_tensors(seed: int = 0, *, tie: bool = False, shape=MIXTRAL_SHAPE) -> dict[str, np.ndarray]:
    """A MixtralForCausalLM state dict (float32), weights far from their initialisation: the
    Llama's, with each layer's router and experts in place of its MLP."""
    return hf_tensors(seed, tie=tie, shape=shape, mlp=mixtral_moe_tensors)


def _rms(x, weight, eps):
    return weight * x / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + eps)


def _silu(x):
    return x / (1 + np.exp(-x))


def _half_rotation(x):
    a, b = np.split(x, 2, axis=-1)
    return np.concatenate([-b, a], axis=-1)


def _sparse_moe(h, t, prefix, experts, k):
    """One `block_sparse_moe` on tokens `h` `(n, d)`: softmax over all experts, the k best
    (stable order: ties to the lower index), their probabilities over their sum, each token
    through its experts one at a time. Returns the output and the smallest gap between a
    token's k-th and (k+1)-th probability (how safely the choice is made)."""
    logits = h @ t[prefix + "gate.weight"].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    order = np.argsort(-probs, axis=-1, kind="stable")
    out = np.zeros_like(h)
    for n in range(h.shape[0]):
        chosen = order[n, :k]
        weights = probs[n, chosen] / probs[n, chosen].sum()
        for e, weight in zip(chosen, weights):
            q = f"{prefix}experts.{e}."
            hidden = _silu(t[q + "w1.weight"] @ h[n]) * (t[q + "w3.weight"] @ h[n])
            out[n] += weight * (t[q + "w2.weight"] @ hidden)
    ranked = np.take_along_axis(probs, order, axis=-1)
    gap = float((ranked[:, k - 1] - ranked[:, k]).min()) if k < probs.shape[1] else math.inf
    return out, gap


def mixtral_reference_logits(tensors: dict, config: dict, tokens: np.ndarray) -> tuple[np.ndarray, float]:
    """MixtralForCausalLM's logits for `tokens` `(batch, seq)` (float64), and the smallest
    router gap over every layer and token (see `_sparse_moe`): RMS norms, the default
    rotary embedding (rotate_half), grouped-query causal attention, a sparse mixture of
    SwiGLU experts in every layer, tied or untied head."""
    t = {name: array.astype(np.float64) for name, array in tensors.items()}
    eps, heads, kv = config["rms_norm_eps"], config["num_attention_heads"], config["num_key_value_heads"]
    hd, experts, k = config["head_dim"], config["num_local_experts"], config["num_experts_per_tok"]
    theta = config.get("rope_theta") or config["rope_parameters"]["rope_theta"]
    batch, seq = tokens.shape
    inv_freq = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    angles = np.outer(np.arange(seq), inv_freq)
    cos = np.cos(np.concatenate([angles, angles], -1))[None, :, None, :]
    sin = np.sin(np.concatenate([angles, angles], -1))[None, :, None, :]
    future = np.triu(np.ones((seq, seq), bool), 1)
    x = t["model.embed_tokens.weight"][tokens]
    gap = math.inf
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rms(x, t[p + "input_layernorm.weight"], eps)
        q = (h @ t[p + "self_attn.q_proj.weight"].T).reshape(batch, seq, heads, hd)
        key = (h @ t[p + "self_attn.k_proj.weight"].T).reshape(batch, seq, kv, hd)
        value = (h @ t[p + "self_attn.v_proj.weight"].T).reshape(batch, seq, kv, hd)
        q = q * cos + _half_rotation(q) * sin
        key = key * cos + _half_rotation(key) * sin
        group = heads // kv  # query head n reads key/value head n // group
        key, value = key[:, :, np.arange(heads) // group], value[:, :, np.arange(heads) // group]
        scores = np.einsum("bqnd,bknd->bnqk", q, key) / math.sqrt(hd)
        scores[..., future] = -np.inf
        attention = np.exp(scores - scores.max(-1, keepdims=True))
        attention /= attention.sum(-1, keepdims=True)
        mixed = np.einsum("bnqk,bknd->bqnd", attention, value).reshape(batch, seq, heads * hd)
        x = x + mixed @ t[p + "self_attn.o_proj.weight"].T
        h = _rms(x, t[p + "post_attention_layernorm.weight"], eps).reshape(batch * seq, -1)
        moe, layer_gap = _sparse_moe(h, t, p + "block_sparse_moe.", experts, k)
        gap = min(gap, layer_gap)
        x = x + moe.reshape(batch, seq, -1)
    x = _rms(x, t["model.norm.weight"], eps)
    head = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    return x @ head.T, gap
