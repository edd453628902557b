"""Hugging Face Mixtral (`MixtralForCausalLM`) checkpoints <-> the Llama with `moe=`.

A Mixtral is the Llama (attention, RMS norms, rotary embedding, Hugging Face's names) with a
mixture of experts in place of every layer's MLP, `block_sparse_moe`:

- the router `gate` (`[num_local_experts, hidden_size]`, no bias) gives each token's
  logits; transformers takes their softmax over **all** experts in float32, keeps the
  `num_experts_per_tok` largest, and divides those by their sum;
- expert `j` is a SwiGLU of `intermediate_size` units, `w2(silu(w1 x) * w3 x)`: `w1` the
  gate projection, `w3` the up projection, `w2` the down projection, each a torch `Linear`
  stored `[out, in]`;
- nothing is dropped (transformers runs every token through its experts), no expert is
  shared, and the router adds no bias.

That is [`eqxpar.nn.MixtureOfExperts`][] with `score="softmax"`, `normalize_weights=True`
and `capacity_factor=None` (dropless) in a [`eqxpar.models.LlamaMoEBlock`][] in every
layer: its `router.weight` is `gate.weight` as it is, and its stacked `gate`, `up` and
`down` (`[experts, in, out]`) are the experts' `w1`, `w3` and `w2` transposed and stacked.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ._hf_config import HfFamily, config_error, hf_config_dict, llama_config_from_hf
from ._hf_source import Source
from ._llama_config import LlamaConfig
from ._moe_block import MoEOptions, is_capacity_factor

__all__ = ["MIXTRAL", "mixtral_settings_from_hf", "mixtral_config_dict", "moe_source", "check_mixtral_options"]

# The keys MixtralConfig adds to the Llama's, read here.
_EXPERT_KEYS = frozenset(
    {
        "num_local_experts",
        "num_experts_per_tok",
        "router_aux_loss_coef",
        "output_router_logits",
        "router_jitter_noise",
        "sliding_window",
    }
)
# transformers' MixtralConfig defaults where they differ from the Llama's.
MIXTRAL = HfFamily(
    "Mixtral",
    "mixtral",
    "MixtralForCausalLM",
    defaults={"rms_norm_eps": 1e-5, "max_position_embeddings": 4096 * 32},
    rope_theta=1e6,
    extra_keys=_EXPERT_KEYS,
)
_DEFAULT_KV_HEADS = 8  # MixtralConfig's num_key_value_heads when the key is absent (null: the heads)
_DEFAULT_AUX_COEF = 0.001  # MixtralConfig's router_aux_loss_coef


def _positive_int(config: Mapping[str, Any], key: str, default: int) -> int:
    value = config.get(key, default)
    if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        raise config_error(key, f"must be a positive integer, got {value!r}", "fix the value")
    return int(value)


def _round(x: float) -> float:
    """`x` to 12 significant digits: a coefficient scaled and scaled back reads as written."""
    return float(f"{x:.12g}")


def mixtral_settings_from_hf(
    config: Mapping[str, Any],
    ignore_keys: Iterable[str] = (),
    *,
    capacity_factor: float | None = None,
    expert_axis: str = "expert",
) -> tuple[LlamaConfig, MoEOptions]:
    """The Llama config and the `moe=` options of a `MixtralForCausalLM` `config.json`.

    The Llama keys are read as for a Llama (with MixtralConfig's defaults); the expert keys:

    - `num_local_experts`, `num_experts_per_tok`: `num_experts`, `top_k`; every layer is an
      MoE layer of `intermediate_size` units per expert; softmax scores, the chosen ones
      renormalised (`normalize_weights=True`); dropless unless `capacity_factor` is given.
    - `output_router_logits`, `router_aux_loss_coef`: transformers adds
      `router_aux_loss_coef * E * sum_e f_e P_e` to the loss only with
      `output_router_logits: true`, with `f_e` (the share of tokens choosing expert `e`,
      counting every one of a token's `k` choices) and `P_e` (the mean probability) pooled
      over all layers and the whole batch. eqxpar's load-balancing loss is per layer and
      per sequence and counts `f_e` over the `tokens * k` choices, so the loaded model's
      `aux_loss_weight` is `router_aux_loss_coef * k / layers` (the same loss when every
      layer and sequence routes alike), and 0 without `output_router_logits`.
    - `router_jitter_noise`: must be 0 (eqxpar's router has no jitter).
    - `sliding_window`: null, or at least `max_position_embeddings` (eqxpar's attention
      has no window; a window that long masks nothing in any sequence the model takes).

    **Raises:**

    - `ValueError` naming the key, before any weight is read.
    """
    config = dict(config)
    if "num_key_value_heads" not in config:
        config["num_key_value_heads"] = _DEFAULT_KV_HEADS
    llama = llama_config_from_hf(config, ignore_keys, family=MIXTRAL)
    ignored = set(ignore_keys)
    experts = _positive_int(config, "num_local_experts", 8)
    top_k = _positive_int(config, "num_experts_per_tok", 2)
    if top_k > experts:
        raise config_error(
            "num_experts_per_tok",
            f"{top_k} is more than num_local_experts={experts}",
            "each token chooses that many different experts: fix the value",
        )
    jitter = config.get("router_jitter_noise") or 0.0
    if "router_jitter_noise" not in ignored and jitter != 0:
        raise config_error(
            "router_jitter_noise",
            f"{jitter!r} is not supported",
            "eqxpar's router multiplies no noise into its input while training; set it to 0.0 (it changes "
            "nothing at inference)",
        )
    window = config.get("sliding_window")
    if window is not None and "sliding_window" not in ignored:
        if not (isinstance(window, int) and not isinstance(window, bool) and window > 0):
            raise config_error("sliding_window", f"must be null or a positive integer, got {window!r}", "fix it")
        if window < llama.max_seq_len:
            raise config_error(
                "sliding_window",
                f"{window} is shorter than max_position_embeddings={llama.max_seq_len}, and eqxpar's attention "
                f"has no sliding window",
                f"a window masks nothing in sequences of at most {window} tokens: set max_position_embeddings "
                f"to at most {window} in config.json (eqxpar then refuses longer sequences)",
            )
    coefficient = config.get("router_aux_loss_coef", _DEFAULT_AUX_COEF)
    if isinstance(coefficient, bool) or not isinstance(coefficient, (int, float)) or not coefficient >= 0:
        raise config_error(
            "router_aux_loss_coef", f"must be a non-negative number, got {coefficient!r}", "fix the value"
        )
    output_logits = config.get("output_router_logits", False)
    if not isinstance(output_logits, bool):
        raise config_error("output_router_logits", f"must be true or false, got {output_logits!r}", "fix the value")
    weight = _round(float(coefficient) * top_k / llama.num_layers) if output_logits else 0.0
    if not is_capacity_factor(capacity_factor):
        raise ValueError(
            f"load_hf: capacity_factor={capacity_factor!r}; it must be a positive number, or None for the "
            f"dropless path (what transformers computes)."
        )
    if not isinstance(expert_axis, str):
        raise ValueError(f"load_hf: expert_axis must be a mesh axis name (a str), got {expert_axis!r}.")
    moe = MoEOptions(
        num_experts=experts,
        top_k=top_k,
        every=1,
        capacity_factor=capacity_factor,
        aux_loss_weight=weight,
        z_loss_weight=0.0,
        score="softmax",
        expert_axis=expert_axis,
        normalize_weights=True,
    )
    return llama, moe


def check_mixtral_options(moe: MoEOptions) -> None:
    """`ValueError` unless a Llama with these `moe=` options is a Mixtral (what save_hf writes)."""
    problems = []
    if moe.every != 1:
        problems.append(f"moe.every={moe.every} (a Mixtral has experts in every layer: every=1)")
    if moe.score != "softmax":
        problems.append(f"moe.score={moe.score!r} (Mixtral's router takes a softmax: score='softmax')")
    if not moe.normalize_weights:
        problems.append("moe.normalize_weights=False (Mixtral divides the chosen experts' scores by their sum: True)")
    if moe.shared_experts:
        problems.append(
            f"moe.shared_experts={moe.shared_experts} (a Mixtral has routed experts only: shared_experts=0)"
        )
    if problems:
        raise ValueError(
            "save_hf: this Llama's mixture of experts is not a Mixtral's, so no MixtralForCausalLM computes it: "
            + "; ".join(problems)
            + ". Build the model with those options (eqxpar.models.MoEOptions) to save it as a Mixtral."
        )


def mixtral_config_dict(config: LlamaConfig, moe: MoEOptions, dtype: str) -> dict[str, Any]:
    """The `config.json` of a `MixtralForCausalLM` with the Llama's shape and `moe`'s experts
    (rotary settings as top-level `rope_theta`/`rope_scaling`, as for a Llama)."""
    out = hf_config_dict(config, dtype)
    for key in ("attention_bias", "mlp_bias", "pretraining_tp"):  # no such keys in MixtralConfig
        del out[key]
    coefficient = _round(moe.aux_loss_weight * config.num_layers / moe.top_k)
    out.update(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        intermediate_size=moe.expert_hidden or config.hidden_dim,
        num_local_experts=moe.num_experts,
        num_experts_per_tok=moe.top_k,
        output_router_logits=moe.aux_loss_weight > 0,
        router_aux_loss_coef=coefficient if moe.aux_loss_weight > 0 else _DEFAULT_AUX_COEF,
        router_jitter_noise=0.0,
        sliding_window=None,
    )
    return out


# An expert array's Hugging Face tensor (per expert) and whether the file holds it transposed.
_EXPERT_TENSORS = {"gate": "w1", "up": "w3", "down": "w2"}


def moe_source(name: str, shape: tuple[int, ...]) -> Source | None:
    """The `Source` of a Llama leaf named as `hf_tensor_names` names it (the eqxpar path
    under `model.`), if it belongs to a layer's `block_sparse_moe`; else None.

    `...block_sparse_moe.router.weight` is the router, `...block_sparse_moe.gate.weight`;
    `...block_sparse_moe.{gate,up,down}` (`[experts, in, out]`) stack each expert's
    `w1`/`w3`/`w2` (`[out, in]`), transposed."""
    prefix, found, field = name.partition(".block_sparse_moe.")
    if not found:
        return None
    prefix += ".block_sparse_moe."
    if field == "router.weight":
        return Source((prefix + "gate.weight",), tuple(shape))
    if field in _EXPERT_TENSORS:
        experts, inputs, outputs = shape
        tensor = _EXPERT_TENSORS[field]
        names = tuple(f"{prefix}experts.{j}.{tensor}.weight" for j in range(experts))
        return Source(names, (outputs, inputs), stacked=True, transpose=True)
    raise ValueError(
        f"load_hf: the mixture of experts' array {field!r} has no tensor in a Mixtral checkpoint (a selection "
        f"bias or a shared expert); a MixtralForCausalLM has a router and its experts only."
    )
