"""Hugging Face GPT-2 (`GPT2LMHeadModel`) checkpoints <-> [`eqxpar.models.GPT`][]: the
`config.json` read (anything the GPT cannot compute refused by key), the GPT built to match,
and where each of its arrays lives in the checkpoint (`Source`s, read by `load_hf` and
inverted by `save_hf`)."""

from __future__ import annotations

import dataclasses
import numbers
import re
from collections.abc import Iterable, Mapping
from typing import Any

import equinox as eqx
import jax

from ..nn import ParallelMultiheadAttention, StackedLayers
from ._block import Remat, TransformerBlock
from ._gpt import GPT
from ._hf_config import INFORMATIONAL_KEYS, check_architecture, check_fixed, config_error
from ._hf_source import Source
from ._stacking import stack_blocks

__all__ = [
    "GPT2_PREFIX",
    "Gpt2Settings",
    "checkpoint_prefix",
    "gpt2_abstract",
    "gpt2_config_dict",
    "gpt2_settings_from_hf",
    "gpt2_sources",
    "gpt2_tensor_shapes",
    "is_gpt2_buffer",
]

# How GPT2LMHeadModel.save_pretrained names the tensors of its GPT2Model (save_hf writes it).
GPT2_PREFIX = "transformer."

# config.json keys that only GPT2DoubleHeadsModel's classification head or generation read.
_UNUSED = frozenset(
    {
        "summary_type",
        "summary_use_proj",
        "summary_activation",
        "summary_proj_to_labels",
        "summary_first_dropout",
        "task_specific_params",
        "n_ctx",  # older configs: the context length again (checked against n_positions)
    }
)
_SIZES = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
# Keys the GPT computes with one value only (transformers' default), and what it computes.
_FIXED = {
    "model_type": ("gpt2", "a GPT-2 checkpoint (model_type 'gpt2')"),
    "scale_attn_weights": (True, "attention scores scaled by 1/sqrt(head_dim)"),
    "scale_attn_by_inverse_layer_idx": (False, "the same attention scaling in every layer"),
    "reorder_and_upcast_attn": (False, "attention scores in the weights' dtype, scaled after the product"),
    "add_cross_attention": (False, "a decoder without cross-attention"),
}
# The tanh-approximated GELU, the GPT's MLP activation (eqxpar.nn.gelu), under its names.
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")
_DROPOUTS = ("resid_pdrop", "embd_pdrop", "attn_pdrop")


@dataclasses.dataclass(frozen=True)
class Gpt2Settings:
    """What a GPT-2 `config.json` says about the computation."""

    vocab_size: int
    n_positions: int
    n_embd: int
    n_layer: int
    n_head: int
    mlp_ratio: int
    layer_norm_epsilon: float
    dropout_p: float
    attention_dropout_p: float
    tie_word_embeddings: bool


def gpt2_settings_from_hf(config: Mapping[str, Any], ignore_keys: Iterable[str] = ()) -> Gpt2Settings:
    """The settings of a `GPT2LMHeadModel` `config.json`; a `ValueError` naming the key for
    anything the GPT cannot compute, for a missing size and for an unknown key."""
    config = dict(config)
    check_fixed(config, _FIXED, "GPT")
    check_architecture(config, "GPT2LMHeadModel", "a GPT2LMHeadModel's language model")
    known = INFORMATIONAL_KEYS | _UNUSED | set(_SIZES) | set(_FIXED) | set(_DROPOUTS) | set(ignore_keys)
    known |= {"n_inner", "activation_function", "layer_norm_epsilon", "tie_word_embeddings"}
    unknown = sorted(set(config) - known)
    if unknown:
        raise config_error(
            unknown[0],
            "unknown to eqxpar's GPT-2 loader",
            f"if it does not change the computation, pass ignore_keys=[{unknown[0]!r}] (unknown keys: {unknown})",
        )
    sizes = {}
    for key in _SIZES:
        if key not in config:
            raise config_error(key, "missing", "every GPT-2 config.json gives it")
        value = config[key]
        if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise config_error(key, f"must be a positive integer, got {value!r}", "fix the value")
        sizes[key] = value
    if config.get("n_ctx", sizes["n_positions"]) != sizes["n_positions"]:
        raise config_error(
            "n_ctx", f"{config['n_ctx']!r} differs from n_positions={sizes['n_positions']}", "keep one length"
        )
    dim, heads = sizes["n_embd"], sizes["n_head"]
    if dim % heads:
        raise config_error("n_head", f"{heads} heads do not divide n_embd={dim}", "fix the value")
    inner = config.get("n_inner")
    inner = 4 * dim if inner is None else inner
    if not (isinstance(inner, int) and not isinstance(inner, bool) and inner > 0 and inner % dim == 0):
        raise config_error(
            "n_inner",
            f"{inner!r} is not a positive multiple of n_embd={dim}",
            "eqxpar's GPT has MLPs of mlp_ratio * n_embd units (null gives 4 * n_embd)",
        )
    activation = config.get("activation_function", "gelu_new")
    if activation not in _GELU_TANH:
        raise config_error(
            "activation_function",
            f"{activation!r} is not supported",
            f"eqxpar's GPT computes the tanh-approximated GELU ({' or '.join(map(repr, _GELU_TANH))})",
        )
    numbers_ = {"layer_norm_epsilon": config.get("layer_norm_epsilon", 1e-5)}
    numbers_.update({key: config.get(key, 0.1) for key in _DROPOUTS})
    for key, value in numbers_.items():
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or not 0 <= float(value) < 1:
            raise config_error(key, f"must be a number in [0, 1), got {value!r}", "fix the value")
    if numbers_["layer_norm_epsilon"] <= 0:
        raise config_error("layer_norm_epsilon", "must be positive", "fix the value")
    if numbers_["embd_pdrop"] != numbers_["resid_pdrop"]:
        raise config_error(
            "embd_pdrop",
            f"{numbers_['embd_pdrop']!r} differs from resid_pdrop={numbers_['resid_pdrop']!r}",
            "eqxpar's GPT has one dropout for the embeddings and the residual branches: make them equal",
        )
    tie = config.get("tie_word_embeddings", True)
    if not isinstance(tie, bool):
        raise config_error("tie_word_embeddings", f"must be true or false, got {tie!r}", "fix the value")
    return Gpt2Settings(
        **sizes,
        mlp_ratio=inner // dim,
        layer_norm_epsilon=float(numbers_["layer_norm_epsilon"]),
        dropout_p=float(numbers_["resid_pdrop"]),
        attention_dropout_p=float(numbers_["attn_pdrop"]),
        tie_word_embeddings=tie,
    )


def gpt2_abstract(settings: Gpt2Settings, *, scan_layers: bool, remat: Remat, axis_name: str) -> GPT:
    """The GPT that computes a GPT-2 of `settings`, abstract (`eqx.filter_eval_shape`).

    The GPT's blocks are built without attention biases and with LayerNorm's default
    epsilon; GPT-2 has both biases (`c_attn`'s and `c_proj`'s) and its own epsilon, so each
    block's attention and norms are replaced by ones that have them (the block calls them
    alike)."""
    s = settings
    model = eqx.filter_eval_shape(
        GPT,
        s.vocab_size,
        s.n_positions,
        dim=s.n_embd,
        num_heads=s.n_head,
        num_layers=s.n_layer,
        mlp_ratio=s.mlp_ratio,
        dropout_p=s.dropout_p,
        attention_dropout_p=s.attention_dropout_p,
        remat=remat,
        axis_name=axis_name,
        key=jax.random.key(0),
    )

    def norm():
        return eqx.filter_eval_shape(eqx.nn.LayerNorm, s.n_embd, eps=s.layer_norm_epsilon)

    def block(b):
        attention = eqx.filter_eval_shape(
            ParallelMultiheadAttention,
            s.n_head,
            s.n_embd,
            use_query_bias=True,
            use_key_bias=True,
            use_value_bias=True,
            use_output_bias=True,
            dropout_p=s.attention_dropout_p,
            causal=True,
            attention_impl=b.attention.attention_impl,
            axis_name=axis_name,
            key=jax.random.key(0),
        )
        return eqx.tree_at(lambda b: (b.attention, b.attention_norm, b.mlp_norm), b, (attention, norm(), norm()))

    blocks = tuple(block(b) for b in model.blocks)
    model = eqx.tree_at(lambda m: (m.blocks, m.final_norm), model, (blocks, norm()))
    return stack_blocks(model) if scan_layers else model


# A block's arrays: its path in a TransformerBlock -> (GPT-2 tensor, transposed, which third of c_attn).
_BLOCK = {
    "attention_norm.weight": ("ln_1.weight", False, None),
    "attention_norm.bias": ("ln_1.bias", False, None),
    "attention.query_proj.weight": ("attn.c_attn.weight", True, 0),
    "attention.key_proj.weight": ("attn.c_attn.weight", True, 1),
    "attention.value_proj.weight": ("attn.c_attn.weight", True, 2),
    "attention.query_proj.bias": ("attn.c_attn.bias", False, 0),
    "attention.key_proj.bias": ("attn.c_attn.bias", False, 1),
    "attention.value_proj.bias": ("attn.c_attn.bias", False, 2),
    "attention.output_proj.weight": ("attn.c_proj.weight", True, None),
    "attention.output_proj.bias": ("attn.c_proj.bias", False, None),
    "mlp_norm.weight": ("ln_2.weight", False, None),
    "mlp_norm.bias": ("ln_2.bias", False, None),
    "mlp.hidden.weight": ("mlp.c_fc.weight", True, None),
    "mlp.hidden.bias": ("mlp.c_fc.bias", False, None),
    "mlp.output.weight": ("mlp.c_proj.weight", True, None),
    "mlp.output.bias": ("mlp.c_proj.bias", False, None),
}


def gpt2_tensor_shapes(model: GPT, prefix: str, tied: bool) -> dict[str, tuple[int, ...]]:
    """Every tensor of the `GPT2LMHeadModel` with `model`'s shape, in save_pretrained's order,
    with its shape (`lm_head.weight` only when untied)."""
    dim, vocab = model.position_embedding.weight.shape[1], model.vocab_size
    inner = _block(model).mlp.width_size
    shapes: dict[str, tuple[int, ...]] = {f"{prefix}wte.weight": (vocab, dim)}
    shapes[f"{prefix}wpe.weight"] = (model.context_length, dim)
    per_layer = {
        "ln_1.weight": (dim,),
        "ln_1.bias": (dim,),
        "attn.c_attn.weight": (dim, 3 * dim),
        "attn.c_attn.bias": (3 * dim,),
        "attn.c_proj.weight": (dim, dim),
        "attn.c_proj.bias": (dim,),
        "ln_2.weight": (dim,),
        "ln_2.bias": (dim,),
        "mlp.c_fc.weight": (dim, inner),
        "mlp.c_fc.bias": (inner,),
        "mlp.c_proj.weight": (inner, dim),
        "mlp.c_proj.bias": (dim,),
    }
    for i in range(model.num_layers):
        shapes.update({f"{prefix}h.{i}.{name}": shape for name, shape in per_layer.items()})
    shapes.update({f"{prefix}ln_f.weight": (dim,), f"{prefix}ln_f.bias": (dim,)})
    if not tied:
        shapes["lm_head.weight"] = (vocab, dim)
    return shapes


def _block(model: GPT) -> TransformerBlock:
    """One block (for its static sizes): the stack's, or the first of the tuple; a
    `ValueError` for blocks GPT-2 has no tensors for (a mixture of experts)."""
    blocks = (model.blocks.layers,) if isinstance(model.blocks, StackedLayers) else model.blocks
    for i, block in enumerate(blocks):
        if not isinstance(block, TransformerBlock):
            raise ValueError(
                f"save_hf: block {i} of this GPT is a {type(block).__name__}; GPT-2 has only dense "
                f"transformer blocks (eqxpar.models.TransformerBlock): save a GPT without them."
            )
    block = blocks[0]
    assert isinstance(block, TransformerBlock)  # checked above
    return block


def gpt2_sources(model: GPT, prefix: str, tied: bool) -> list[Source | None]:
    """Per array leaf of `model` (in `jax.tree.leaves` order of its arrays), its `Source` in
    a GPT-2 checkpoint whose names start with `prefix` (`"transformer."` or `""`); `None` for
    an array GPT-2 has no tensor for. With `tied`, the head reads the token embedding."""
    shapes = gpt2_tensor_shapes(model, prefix, tied=False)
    dim = model.position_embedding.weight.shape[1]
    vocab = model.vocab_size
    head = f"{prefix}wte.weight" if tied else "lm_head.weight"
    top = {
        "token_embedding.weight": Source((f"{prefix}wte.weight",), (vocab, dim), rows=vocab),
        "position_embedding.weight": Source((f"{prefix}wpe.weight",), (model.context_length, dim)),
        "final_norm.weight": Source((f"{prefix}ln_f.weight",), (dim,)),
        "final_norm.bias": Source((f"{prefix}ln_f.bias",), (dim,)),
        "head.weight": Source((head,), (vocab, dim), rows=vocab),
    }
    sources: list[Source | None] = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(model)[0]:
        if not eqx.is_array(leaf) and not isinstance(leaf, jax.ShapeDtypeStruct):
            continue
        parts = [str(getattr(k, "name", getattr(k, "idx", k))) for k in path]
        name = ".".join(parts)
        if parts[0] != "blocks":
            sources.append(top.get(name))
            continue
        stacked = parts[1] == "layers" and model.scan_layers
        rest = ".".join(parts[2:])
        layers = range(model.num_layers) if stacked else [int(parts[1])]
        if rest not in _BLOCK:
            sources.append(None)
            continue
        tensor, transpose, third = _BLOCK[rest]
        names = tuple(f"{prefix}h.{i}.{tensor}" for i in layers)
        sources.append(
            Source(
                names,
                shapes[names[0]],
                stacked=stacked,
                transpose=transpose,
                offset=0 if third is None else third * dim,
            )
        )
    return sources


def gpt2_config_dict(model: GPT, tied: bool, dtype: str) -> dict[str, Any]:
    """The `config.json` of a `GPT2LMHeadModel` computing `model`: a `ValueError` for a GPT
    GPT-2 cannot express (layer norms with different epsilons, or without weight or bias)."""
    is_norm = lambda x: isinstance(x, eqx.nn.LayerNorm)  # noqa: E731
    norms = [n for n in jax.tree.leaves(model, is_leaf=is_norm) if is_norm(n)]
    eps = {float(n.eps) for n in norms}
    if len(eps) != 1 or not all(n.use_weight and n.use_bias for n in norms):
        raise ValueError(
            f"save_hf: GPT-2 has one layer_norm_epsilon and layer norms with weight and bias; this GPT's "
            f"norms have epsilons {sorted(eps)}: save a GPT built by eqxpar.models.GPT or load_hf."
        )
    block = _block(model)
    dim = model.position_embedding.weight.shape[1]
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": model.vocab_size,
        "n_positions": model.context_length,
        "n_embd": dim,
        "n_layer": model.num_layers,
        "n_head": block.attention.num_heads,
        "n_inner": block.mlp.width_size,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": eps.pop(),
        "resid_pdrop": float(model.dropout.p),
        "embd_pdrop": float(model.dropout.p),
        "attn_pdrop": float(block.attention.dropout.p),
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": tied,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,
    }


def checkpoint_prefix(names: Iterable[str]) -> str:
    """`"transformer."` or `""`: how a GPT-2 checkpoint's tensor names start (save_pretrained
    of a GPT2LMHeadModel writes `transformer.h.0...`; older files, as on the Hub, `h.0...`)."""
    names = set(names)
    for prefix in ("transformer.", ""):
        if f"{prefix}wte.weight" in names:
            return prefix
    raise ValueError(
        "load_hf: config.json says model_type 'gpt2', but the checkpoint has no 'transformer.wte.weight' or "
        "'wte.weight'; check that config.json belongs to these weights."
    )


def is_gpt2_buffer(name: str) -> bool:
    """Tensors older GPT-2 files hold that are no weights: each attention's causal mask
    (`h.0.attn.bias`, `[1, 1, n_positions, n_positions]`) and `masked_bias`."""
    return re.fullmatch(r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)", name) is not None
