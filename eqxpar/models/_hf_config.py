"""Hugging Face `config.json` <-> [`eqxpar.models.LlamaConfig`][]: the keys of current
(`rope_parameters`) and older (`rope_theta`, `rope_scaling`) transformers versions read,
anything the Llama cannot compute refused by name."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable, Mapping
from typing import Any

from ._llama_config import LlamaConfig, LlamaRopeScaling

__all__ = ["llama_config_from_hf", "hf_config_dict", "INFORMATIONAL_KEYS", "config_error", "HfFamily", "LLAMA"]

# Keys that describe the file, the tokenizer or generation, never the computation.
INFORMATIONAL_KEYS = frozenset(
    {
        "_name_or_path",
        "architectures",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "torch_dtype",
        "dtype",
        "transformers_version",
        "initializer_range",
        "use_cache",
        "pretraining_tp",  # how Meta split matmuls in pre-training: the same product
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "tokenizer_class",
        "id2label",
        "label2id",
    }
)
_SIZES = {  # config.json key -> LlamaConfig field (required)
    "vocab_size": "vocab_size",
    "hidden_size": "dim",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "intermediate_size": "hidden_dim",
}
_OPTIONAL = {  # config.json key -> (LlamaConfig field, transformers' default)
    "num_key_value_heads": ("num_kv_heads", None),
    "head_dim": ("head_dim", None),
    "rms_norm_eps": ("norm_eps", 1e-6),
    "max_position_embeddings": ("max_seq_len", 2048),
    "tie_word_embeddings": ("tie_embeddings", False),
}
# Keys the Llama supports with one value only: what anything else would need.
_FIXED = {
    "model_type": ("llama", "a Llama-architecture checkpoint (model_type 'llama'; load_hf reads 'gpt2' into a GPT)"),
    "hidden_act": ("silu", "the SwiGLU MLP with SiLU"),
    "attention_bias": (False, "q/k/v/o projections without biases"),
    "mlp_bias": (False, "MLP projections without biases"),
    "attention_dropout": (0.0, "no attention dropout"),
}
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclasses.dataclass(frozen=True)
class HfFamily:
    """A Hugging Face architecture whose attention, norms and rotary embedding are the
    Llama's (read by `llama_config_from_hf`): its names, its transformers defaults for the
    optional keys, and the keys its own reader checks (e.g. Mixtral's experts)."""

    name: str  # in messages: "eqxpar's {name} loader"
    model_type: str
    architecture: str
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # key -> default, over _OPTIONAL's
    rope_theta: float = 10000.0  # transformers' default rotary base
    extra_keys: frozenset[str] = frozenset()


LLAMA = HfFamily("Llama", "llama", "LlamaForCausalLM")


def config_error(key: str, problem: str, fix: str) -> ValueError:
    return ValueError(f"load_hf: config.json key {key!r}: {problem}; {fix}")


def check_fixed(config: Mapping[str, Any], fixed: Mapping[str, tuple[Any, str]], model: str) -> None:
    """Every key of `fixed` (key -> (the one value `model` computes, what it means)) that
    `config` sets holds that value, else a `ValueError` naming the key."""
    for key, (want, meaning) in fixed.items():
        if key in config and config[key] != want:
            raise config_error(
                key, f"{config[key]!r} is not supported", f"eqxpar's {model} computes {meaning} ({key}={want!r})"
            )


def check_architecture(config: Mapping[str, Any], architecture: str, builds: str) -> None:
    """`architectures`, where `config` has it, is `[architecture]`, else a `ValueError`;
    `builds` says what load_hf builds."""
    architectures = config.get("architectures")
    if architectures is not None and list(architectures) != [architecture]:
        raise config_error(
            "architectures",
            f"{architectures!r} is not supported",
            f"load_hf builds {builds} (architectures [{architecture!r}])",
        )


def _rope(rope: Any, key: str) -> tuple[float | None, LlamaRopeScaling | None]:
    """`(theta or None, scaling or None)` of a `rope_parameters`/`rope_scaling` dict."""
    if rope is None:
        return None, None
    if not isinstance(rope, Mapping):
        raise config_error(
            key, f"expected a dict, got {rope!r}", "write it as transformers does, e.g. {'rope_type': 'default'}"
        )
    rope = dict(rope)
    if "rope_type" in rope and "type" in rope and rope["rope_type"] != rope["type"]:
        raise config_error(
            key, f"rope_type {rope['rope_type']!r} and type {rope['type']!r} disagree", "keep one of them"
        )
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    rope.pop("type", None)
    theta = rope.pop("rope_theta", None)
    if rope_type == "default":
        extra = sorted(rope)
        if extra:
            raise config_error(f"{key}.{extra[0]}", "not used by the default rotary embedding", "remove it")
        return theta, None
    if rope_type != "llama3":
        raise config_error(
            f"{key}.rope_type",
            f"the rotary embedding {rope_type!r} is not supported",
            "eqxpar's Llama computes 'default' and Llama 3's 'llama3' scaling only",
        )
    missing = [k for k in _LLAMA3_KEYS if k not in rope]
    if missing:
        raise config_error(
            f"{key}.{missing[0]}", "missing: the 'llama3' scaling needs it", f"give all of {list(_LLAMA3_KEYS)}"
        )
    extra = sorted(set(rope) - set(_LLAMA3_KEYS))
    if extra:
        raise config_error(f"{key}.{extra[0]}", "not part of the 'llama3' scaling", "remove it")
    try:
        return theta, LlamaRopeScaling(**{k: rope[k] for k in _LLAMA3_KEYS})
    except ValueError as error:
        raise config_error(key, str(error), "fix the scaling's values") from None


def llama_config_from_hf(
    config: Mapping[str, Any], ignore_keys: Iterable[str] = (), *, family: HfFamily = LLAMA
) -> LlamaConfig:
    """The [`eqxpar.models.LlamaConfig`][] of a Hugging Face `LlamaForCausalLM` `config.json`.

    **Arguments:**

    - `config`: the parsed `config.json`.
    - `ignore_keys`: further keys to skip (ones eqxpar does not know and that do not change
      the computation).
    - `family`: the architecture (default the Llama; Mixtral's reader passes its own, whose
      expert keys it checks itself).

    **Returns:**

    The `LlamaConfig`.

    **Raises:**

    - `ValueError` naming the key: a missing size, a value the Llama cannot compute (another
      `model_type`, biases, another activation or rotary embedding), an unknown key.
    """
    config = dict(config)
    name = family.name
    if "model_type" not in config:
        raise config_error(
            "model_type", "missing", f"a Hugging Face {name} config.json has model_type {family.model_type!r}"
        )
    fixed = dict(_FIXED)
    if family != LLAMA:
        fixed["model_type"] = (family.model_type, f"a {name} checkpoint (model_type {family.model_type!r})")
    check_fixed(config, fixed, name)
    check_architecture(config, family.architecture, f"a {family.architecture}")
    known = set(INFORMATIONAL_KEYS) | set(_SIZES) | set(_OPTIONAL) | set(_FIXED) | family.extra_keys
    known |= {"rope_parameters", "rope_theta", "rope_scaling"} | set(ignore_keys)
    unknown = sorted(set(config) - known)
    if unknown:
        raise config_error(
            unknown[0],
            f"unknown to eqxpar's {name} loader",
            f"if it does not change the computation, pass ignore_keys=[{unknown[0]!r}] (unknown keys: {unknown})",
        )
    fields: dict[str, Any] = {}
    for key, field in _SIZES.items():
        if key not in config:
            raise config_error(key, "missing", f"every {name} config.json gives it")
        fields[field] = config[key]
    for key, (field, default) in _OPTIONAL.items():
        default = family.defaults.get(key, default)
        value = config.get(key, default)
        fields[field] = default if value is None else value
    for key in list(_SIZES) + ["num_key_value_heads", "head_dim", "max_position_embeddings"]:
        value = fields[_SIZES[key] if key in _SIZES else _OPTIONAL[key][0]]
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise config_error(key, f"must be a positive integer, got {value!r}", "fix the value")
    heads, kv = fields["num_heads"], fields["num_kv_heads"] or fields["num_heads"]
    if heads % kv:
        raise config_error(
            "num_key_value_heads",
            f"{kv} does not divide num_attention_heads={heads}",
            "grouped-query attention gives every key/value head the same number of query heads",
        )
    if fields["head_dim"] is None and fields["dim"] % heads:
        raise config_error(
            "head_dim", f"missing, and hidden_size={fields['dim']} is not a multiple of {heads} heads", "give head_dim"
        )
    if (fields["head_dim"] or fields["dim"] // heads) % 2:
        raise config_error("head_dim", "must be even (rotary embeddings rotate pairs of channels)", "fix the value")
    if not isinstance(fields["tie_embeddings"], bool):
        raise config_error(
            "tie_word_embeddings", f"must be true or false, got {fields['tie_embeddings']!r}", "fix the value"
        )
    has_new = config.get("rope_parameters") is not None
    new_theta, new_scaling = _rope(config.get("rope_parameters"), "rope_parameters")
    old_theta, old_scaling = _rope(config.get("rope_scaling"), "rope_scaling")
    old_theta = config.get("rope_theta", old_theta)
    if has_new:
        if old_theta is not None and new_theta is not None and old_theta != new_theta:
            raise config_error("rope_theta", f"{old_theta!r} disagrees with rope_parameters' {new_theta!r}", "keep one")
        if config.get("rope_scaling") is not None and old_scaling != new_scaling:
            raise config_error("rope_scaling", "disagrees with rope_parameters", "keep one of the two")
        theta, scaling = (new_theta if new_theta is not None else old_theta), new_scaling
    else:
        theta, scaling = old_theta, old_scaling
    theta = family.rope_theta if theta is None else theta
    for key, value in (("rope_theta", theta), ("rms_norm_eps", fields["norm_eps"])):
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or value <= 0:
            raise config_error(key, f"must be a positive number, got {value!r}", "fix the value")
    try:
        return LlamaConfig(**fields, rope_theta=float(theta), rope_scaling=scaling)
    except ValueError as error:  # checked above; anything LlamaConfig adds, with its own words
        raise ValueError(f"load_hf: config.json: {error}") from None


def hf_config_dict(config: LlamaConfig, dtype: str) -> dict[str, Any]:
    """The `config.json` of a `LlamaForCausalLM` with `config`'s shape, every field written
    (rotary settings as top-level `rope_theta`/`rope_scaling`, which transformers reads in
    both its older and current versions).

    **Arguments:**

    - `config`: the model's `LlamaConfig`.
    - `dtype`: the weights' dtype name (`"float32"`, `"bfloat16"`), as `torch_dtype`.

    **Returns:**

    A JSON-serialisable dict.
    """
    scaling = config.scaling
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.hidden_dim,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.channels,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": float(config.norm_eps),
        "rope_theta": float(config.rope_theta),
        "rope_scaling": None
        if scaling is None
        else {
            "rope_type": "llama3",
            "factor": float(scaling.factor),
            "low_freq_factor": float(scaling.low_freq_factor),
            "high_freq_factor": float(scaling.high_freq_factor),
            "original_max_position_embeddings": int(scaling.original_max_position_embeddings),
        },
        "tie_word_embeddings": bool(config.tie_embeddings),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,
    }
