"""Tiny Hugging Face Llama checkpoint folders written with safetensors and numpy alone (no
torch, no transformers), and an independent numpy forward pass of Hugging Face's Llama.

The checkpoint: a `config.json` as transformers writes it (current style, `rope_parameters`;
or older, top-level `rope_theta`/`rope_scaling`) and the `LlamaForCausalLM` state dict's
tensors under their names, in one `model.safetensors` or two shards with their index.
"""

import json
import math
import pathlib

import ml_dtypes
import numpy as np
import safetensors
from safetensors.numpy import save_file

# GQA (8 query heads, 4 key/value heads), head_dim given (8 * 8 = 64 != hidden_size 32),
# every width divisible by 8 devices.
SHAPE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=8,
    max_position_embeddings=16,
    rms_norm_eps=1e-5,
)
# head_dim 8 gives wavelengths 2*pi*(1, 10, 100, 1000) at theta 1e4: with these, one is kept,
# one interpolated and two slowed down (all three branches of the scaling).
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
THETA = 10000.0


def config_json(style: str, *, scaling=LLAMA3, tie=False, **changes) -> dict:
    """A config.json as transformers writes it: `style` "current" (5.x: `rope_parameters`,
    `dtype`) or "older" (4.x: `rope_theta`, `rope_scaling`, `torch_dtype`)."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "mlp_bias": False,
        "model_type": "llama",
        "pretraining_tp": 1,
        "tie_word_embeddings": tie,
        "use_cache": True,
        **SHAPE,
    }
    if style == "current":
        rope = {"rope_type": "default"} if scaling is None else {"rope_type": "llama3", **scaling}
        config.update(rope_parameters={**rope, "rope_theta": THETA}, dtype="float32", transformers_version="5.0.0")
    else:
        rope = None if scaling is None else {"rope_type": "llama3", **scaling}
        config.update(rope_theta=THETA, rope_scaling=rope, torch_dtype="float32", transformers_version="4.45.0")
    config.update(changes)
    return config


def llama_mlp_tensors(prefix: str, w, shape) -> dict[str, np.ndarray]:
    """One LlamaForCausalLM layer's SwiGLU MLP, drawn with `w(*shape)`."""
    d, ff = shape["hidden_size"], shape["intermediate_size"]
    return {
        prefix + "mlp.gate_proj.weight": w(ff, d),
        prefix + "mlp.up_proj.weight": w(ff, d),
        prefix + "mlp.down_proj.weight": w(d, ff),
    }


def hf_tensors(seed: int = 0, *, tie: bool = False, shape=SHAPE, mlp=llama_mlp_tensors) -> dict[str, np.ndarray]:
    """A LlamaForCausalLM state dict (float32), weights far from their initialisation;
    `mlp(prefix, w, shape)` draws each layer's MLP after its attention and norms (a
    Mixtral's experts: tests/_hf_mixtral_files.py)."""
    rng = np.random.default_rng(seed)
    d, h, kv, hd = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    vocab = shape["vocab_size"]

    def w(*s):
        return (0.2 * rng.standard_normal(s)).astype(np.float32)

    def norm(n):
        return (1 + 0.3 * rng.standard_normal(n)).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(vocab, d)}
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "input_layernorm.weight": norm(d),
                p + "self_attn.q_proj.weight": w(h * hd, d),
                p + "self_attn.k_proj.weight": w(kv * hd, d),
                p + "self_attn.v_proj.weight": w(kv * hd, d),
                p + "self_attn.o_proj.weight": w(d, h * hd),
                p + "post_attention_layernorm.weight": norm(d),
            }
        )
        tensors.update(mlp(p, w, shape))
    tensors["model.norm.weight"] = norm(d)
    if not tie:
        tensors["lm_head.weight"] = w(vocab, d)
    return tensors


def write_checkpoint(folder, tensors: dict, config: dict, *, shards: int = 1, bfloat16: bool = False) -> pathlib.Path:
    """`config.json` and the tensors in `model.safetensors`, or in `shards` files with
    `model.safetensors.index.json` (the tensors dealt out in order, as save_pretrained does)."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if bfloat16:
        tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder
    names = list(tensors)
    parts = np.array_split(np.arange(len(names)), shards)
    weight_map = {}
    for k, part in enumerate(parts):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({names[i]: tensors[names[i]] for i in part}, str(folder / file), metadata={"format": "pt"})
        weight_map.update({names[i]: file for i in part})
    total = sum(v.nbytes for v in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return folder


class CountingReads:
    """safetensors.safe_open, wrapped: every array that comes out of the file (a slice's
    block, or a whole tensor by get_tensor) is recorded with its tensor's name."""

    def __init__(self, monkeypatch):
        self.reads = []  # (tensor name, bytes read, the tensor's bytes)
        self.whole = []
        original = safetensors.safe_open
        counter = self

        class Slice:
            def __init__(self, inner, name):
                self.inner, self.name = inner, name

            def get_shape(self):
                return self.inner.get_shape()

            def __getitem__(self, index):
                block = self.inner[index]
                total = int(np.prod(self.inner.get_shape())) * block.dtype.itemsize
                counter.reads.append((self.name, block.nbytes, total))
                return block

        class File:
            def __init__(self, *args, **kwargs):
                self.inner = original(*args, **kwargs)

            def __enter__(self):
                self.inner.__enter__()
                return self

            def __exit__(self, *exc):
                return self.inner.__exit__(*exc)

            def keys(self):
                return self.inner.keys()

            def get_slice(self, name):
                return Slice(self.inner.get_slice(name), name)

            def get_tensor(self, name):
                counter.whole.append(name)
                return self.inner.get_tensor(name)

        monkeypatch.setattr(safetensors, "safe_open", File)

    def by_tensor(self) -> dict:
        out = {}
        for name, nbytes, total in self.reads:
            out.setdefault(name, []).append((nbytes, total))
        return out


# ---- Hugging Face's Llama forward pass, in numpy (float64) ---------------------------------


def llama3_inv_freq(head_dim: int, theta: float, scaling) -> np.ndarray:
    """RoPE's inverse frequencies with Llama 3's scaling, one frequency at a time."""
    out = []
    for i in range(0, head_dim, 2):
        f = 1.0 / theta ** (i / head_dim)
        if scaling is not None:
            old = scaling["original_max_position_embeddings"]
            low, high, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
            wavelength = 2 * math.pi / f
            if wavelength > old / low:  # long wavelengths: slowed down
                f = f / factor
            elif wavelength >= old / high:  # between: interpolated
                t = (old / wavelength - low) / (high - low)
                f = (1 - t) * f / factor + t * f
        out.append(f)
    return np.array(out)


def _rms_norm(x, weight, eps):
    return weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def reference_logits(tensors: dict, config: dict, tokens: np.ndarray, scaling) -> np.ndarray:
    """LlamaForCausalLM's logits for `tokens` `(batch, seq)`: RMSNorm, rotate_half RoPE,
    grouped-query attention (repeat_kv), SwiGLU, tied or untied head; float64."""
    t = {k: v.astype(np.float64) for k, v in tensors.items()}
    eps, heads, kv = config["rms_norm_eps"], config["num_attention_heads"], config["num_key_value_heads"]
    hd = config["head_dim"]
    batch, seq = tokens.shape
    x = t["model.embed_tokens.weight"][tokens]
    angles = np.arange(seq)[:, None] * llama3_inv_freq(hd, THETA, scaling)[None, :]
    emb = np.concatenate([angles, angles], axis=-1)[:, None, :]  # (seq, 1, head_dim)
    cos, sin = np.cos(emb), np.sin(emb)
    causal = np.tril(np.ones((seq, seq), bool))
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rms_norm(x, t[p + "input_layernorm.weight"], eps)
        q = (h @ t[p + "self_attn.q_proj.weight"].T).reshape(batch, seq, heads, hd)
        k = (h @ t[p + "self_attn.k_proj.weight"].T).reshape(batch, seq, kv, hd)
        v = (h @ t[p + "self_attn.v_proj.weight"].T).reshape(batch, seq, kv, hd)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        k, v = np.repeat(k, heads // kv, axis=2), np.repeat(v, heads // kv, axis=2)  # repeat_kv
        scores = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        scores = np.where(causal, scores, -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        attended = np.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, seq, heads * hd)
        x = x + attended @ t[p + "self_attn.o_proj.weight"].T
        h = _rms_norm(x, t[p + "post_attention_layernorm.weight"], eps)
        gate = h @ t[p + "mlp.gate_proj.weight"].T
        x = x + ((gate / (1 + np.exp(-gate))) * (h @ t[p + "mlp.up_proj.weight"].T)) @ t[p + "mlp.down_proj.weight"].T
    x = _rms_norm(x, t["model.norm.weight"], eps)
    head = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    return x @ head.T


# ---- GPT-2 (GPT2LMHeadModel) checkpoints and its forward pass, in numpy -------------------

# 4 heads of 8 channels, MLP of 2 * n_embd units, a vocabulary (50) that the GPT pads to 128,
# and a layer-norm epsilon far from LayerNorm's default (a wrong epsilon moves the logits).
GPT2_SHAPE = dict(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=4, n_inner=64, layer_norm_epsilon=1e-3)


def gpt2_config_json(*, tie: bool = True, older: bool = False, **changes) -> dict:
    """A GPT-2 config.json as transformers writes it (`older`: 4.x with `n_ctx`, the
    classification-head `summary_*` keys and `torch_dtype`, as on the Hub)."""
    config = {
        "activation_function": "gelu_new",
        "architectures": ["GPT2LMHeadModel"],
        "attn_pdrop": 0.1,
        "bos_token_id": 50256,
        "embd_pdrop": 0.1,
        "eos_token_id": 50256,
        "initializer_range": 0.02,
        "model_type": "gpt2",
        "reorder_and_upcast_attn": False,
        "resid_pdrop": 0.1,
        "scale_attn_by_inverse_layer_idx": False,
        "scale_attn_weights": True,
        "summary_activation": None,
        "summary_first_dropout": 0.1,
        "summary_proj_to_labels": True,
        "summary_type": "cls_index",
        "summary_use_proj": True,
        "use_cache": True,
        **GPT2_SHAPE,
    }
    if not tie:
        config["tie_word_embeddings"] = False
    if older:
        config.update(n_ctx=GPT2_SHAPE["n_positions"], torch_dtype="float32", transformers_version="4.46.3")
    else:
        config.update(dtype="float32", transformers_version="5.24.0")
    config.update(changes)
    return config


def gpt2_tensors(seed: int = 0, *, tie: bool = True, prefix: str = "transformer.", buffers: bool = False) -> dict:
    """A GPT2LMHeadModel state dict (float32): `Conv1D` weights `[in, out]`, fused `c_attn`;
    names under `prefix` (`""` as in the Hub's older files); `buffers`: each attention's
    causal-mask buffers too, as older files hold them."""
    rng = np.random.default_rng(seed)
    d, f, n = GPT2_SHAPE["n_embd"], GPT2_SHAPE["n_inner"], GPT2_SHAPE["n_positions"]

    def w(*s):
        return (0.2 * rng.standard_normal(s)).astype(np.float32)

    def norm(k):
        return (1 + 0.3 * rng.standard_normal(k)).astype(np.float32)

    tensors = {prefix + "wte.weight": w(GPT2_SHAPE["vocab_size"], d), prefix + "wpe.weight": w(n, d)}
    for i in range(GPT2_SHAPE["n_layer"]):
        p = f"{prefix}h.{i}."
        tensors.update(
            {
                p + "ln_1.weight": norm(d),
                p + "ln_1.bias": w(d),
                p + "attn.c_attn.weight": w(d, 3 * d),
                p + "attn.c_attn.bias": w(3 * d),
                p + "attn.c_proj.weight": w(d, d),
                p + "attn.c_proj.bias": w(d),
                p + "ln_2.weight": norm(d),
                p + "ln_2.bias": w(d),
                p + "mlp.c_fc.weight": w(d, f),
                p + "mlp.c_fc.bias": w(f),
                p + "mlp.c_proj.weight": w(f, d),
                p + "mlp.c_proj.bias": w(d),
            }
        )
        if buffers:
            tensors[p + "attn.bias"] = np.tril(np.ones((n, n), np.float32))[None, None]
            tensors[p + "attn.masked_bias"] = np.array(-1e4, np.float32)
    tensors.update({prefix + "ln_f.weight": norm(d), prefix + "ln_f.bias": w(d)})
    if not tie:
        tensors["lm_head.weight"] = w(GPT2_SHAPE["vocab_size"], d)
    return tensors


def _layer_norm(x, weight, bias, eps):
    mean = x.mean(-1, keepdims=True)
    return weight * (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps) + bias


def _gelu_new(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def gpt2_reference_logits(tensors: dict, config: dict, tokens: np.ndarray) -> np.ndarray:
    """GPT2LMHeadModel's logits for `tokens` `(batch, seq)` in eval mode, float64: learned
    positions, pre-norm blocks, fused c_attn split into q, k, v, scores / sqrt(head_dim),
    gelu_new, final norm, head tied to wte unless lm_head.weight is given."""
    prefix = "transformer." if "transformer.wte.weight" in tensors else ""
    t = {k.removeprefix(prefix): v.astype(np.float64) for k, v in tensors.items()}
    eps, heads, d = config["layer_norm_epsilon"], config["n_head"], config["n_embd"]
    hd = d // heads
    batch, seq = tokens.shape
    x = t["wte.weight"][tokens] + t["wpe.weight"][:seq]
    causal = np.tril(np.ones((seq, seq), bool))
    for i in range(config["n_layer"]):
        p = f"h.{i}."
        h = _layer_norm(x, t[p + "ln_1.weight"], t[p + "ln_1.bias"], eps)
        qkv = h @ t[p + "attn.c_attn.weight"] + t[p + "attn.c_attn.bias"]
        q, k, v = (a.reshape(batch, seq, heads, hd) for a in np.split(qkv, 3, axis=-1))
        scores = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        scores = np.where(causal, scores, -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        attended = np.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, seq, d)
        x = x + attended @ t[p + "attn.c_proj.weight"] + t[p + "attn.c_proj.bias"]
        h = _layer_norm(x, t[p + "ln_2.weight"], t[p + "ln_2.bias"], eps)
        hidden = _gelu_new(h @ t[p + "mlp.c_fc.weight"] + t[p + "mlp.c_fc.bias"])
        x = x + hidden @ t[p + "mlp.c_proj.weight"] + t[p + "mlp.c_proj.bias"]
    x = _layer_norm(x, t["ln_f.weight"], t["ln_f.bias"], eps)
    head = t.get("lm_head.weight", t["wte.weight"])
    return x @ head.T
