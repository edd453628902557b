"""Saving a Llama or a GPT as a Hugging Face checkpoint folder (`config.json` and `.safetensors`
shards), fetched one array at a time: no whole copy of the model is ever built."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from ._gpt import GPT
from ._hf import INDEX, SINGLE, llama_sources, safetensors_module
from ._hf_config import hf_config_dict
from ._hf_gpt2 import GPT2_PREFIX, gpt2_config_dict, gpt2_sources, gpt2_tensor_shapes
from ._hf_mixtral import check_mixtral_options, mixtral_config_dict
from ._hf_source import Source, assemble
from ._llama import Llama

__all__ = ["save_hf"]

_DTYPE_NAMES = {
    jnp.dtype(jnp.float32): "float32",
    jnp.dtype(jnp.bfloat16): "bfloat16",
    jnp.dtype(jnp.float16): "float16",
}


def _host(array: jax.Array) -> np.ndarray:
    """One array on this host: fetched whole if this process holds all of it, else gathered
    from every process (each process sends its own shards)."""
    if array.is_fully_addressable:
        return np.asarray(jax.device_get(array))
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def _existing(folder: pathlib.Path) -> list[str]:
    """The files in `folder` that a save would write (which it refuses to replace)."""
    if not folder.exists():
        return []
    names = {"config.json", SINGLE, INDEX}
    return sorted(
        p.name
        for p in folder.iterdir()
        if p.name in names or (p.name.startswith("model-") and p.suffix == ".safetensors")
    )


def _tied(model: GPT, tie_embeddings: bool | None) -> bool:
    """Whether a GPT is written with GPT-2's tied head: the head is the token embedding bit for
    bit (checked on the devices, nothing gathered), or as `tie_embeddings` says."""
    if tie_embeddings is not None and not isinstance(tie_embeddings, bool):
        raise ValueError(f"save_hf: tie_embeddings must be True, False or None, got {tie_embeddings!r}.")
    if tie_embeddings is False:
        return False
    vocab = model.vocab_size
    same = bool(
        eqx.filter_jit(lambda a, b: jnp.array_equal(a[:vocab], b[:vocab]))(
            model.token_embedding.weight, model.head.weight
        )
    )
    if tie_embeddings and not same:
        raise ValueError(
            "save_hf: tie_embeddings=True, but this GPT's head differs from its token embedding (a GPT "
            "holds and trains them apart, even when loaded from a tied checkpoint). Pass "
            "tie_embeddings=False to write lm_head.weight too (tie_word_embeddings: false), or None "
            "to tie only when they are equal."
        )
    return same


def _plan(model: Llama | GPT, tie_embeddings: bool | None, dtype_name: str):
    """The model's arrays, every tensor to write in order with its shape and the (array index,
    layer, source) pairs that fill it, and config.json."""
    if isinstance(model, Llama):
        if tie_embeddings is not None:
            raise ValueError(
                "save_hf: tie_embeddings is for a GPT; a Llama is tied or not by its config "
                "(LlamaConfig.tie_embeddings): leave it None."
            )
        arrays = jax.tree.leaves(model)
        sources: list[Source | None] = list(llama_sources(model))
        if model.moe is None:
            config = hf_config_dict(model.config, dtype_name)
        else:
            check_mixtral_options(model.moe)
            config = mixtral_config_dict(model.config, model.moe, dtype_name)
        shapes = {name: s.shape for s in sources if s is not None for name in s.names}
    else:
        tied = _tied(model, tie_embeddings)
        arrays = [leaf for leaf in jax.tree.leaves(model) if eqx.is_array(leaf)]
        sources = [
            None if s is None or (tied and s.names == ("lm_head.weight",)) else s
            for s in gpt2_sources(model, GPT2_PREFIX, tied=False)
        ]
        config = gpt2_config_dict(model, tied, dtype_name)
        shapes = gpt2_tensor_shapes(model, GPT2_PREFIX, tied)
    fills: dict[str, list[tuple[int, int | None, Source]]] = {name: [] for name in shapes}
    for i, source in enumerate(sources):
        if source is not None:
            for layer, name in enumerate(source.names):
                fills[name].append((i, layer if source.stacked else None, source))
    # Tensors in the order of the first array that fills them (one stacked array's layers
    # together), so each array is fetched once and let go when no later tensor needs it.
    first = {name: min((i for i, _, _ in f), default=len(arrays)) for name, f in fills.items()}
    order = sorted(shapes, key=lambda name: first[name])
    return arrays, [(name, shapes[name], fills[name]) for name in order], config


def save_hf(
    model: Llama | GPT,
    path: str | os.PathLike,
    *,
    dtype: Any = None,
    max_shard_bytes: int = 2**31,
    tie_embeddings: bool | None = None,
) -> pathlib.Path:
    """Write `model` as a Hugging Face checkpoint folder: a Llama as a `LlamaForCausalLM`,
    a Llama with `moe=` as a `MixtralForCausalLM`, a GPT as a `GPT2LMHeadModel`.

    `config.json` gets every field of the model's config (for a Llama `model_type: "llama"`,
    the rotary settings as top-level `rope_theta` and `rope_scaling`; for a GPT `model_type:
    "gpt2"`, `activation_function: "gelu_new"`, its layer norms' epsilon and its dropouts),
    and the weights go to `model.safetensors`, or, past `max_shard_bytes`, to
    `model-0000k-of-0000n.safetensors` with a `model.safetensors.index.json`. Arrays are
    fetched one at a time (`jax.device_get` of one array, or, for arrays spread over
    several processes, one array's gather; GPT-2's fused `c_attn` needs the query, key and
    value arrays together) and one shard file is written before the next is assembled, so
    the host holds at most one shard's worth and the arrays it is cut from; only process 0
    writes. **Several processes:** for a model whose arrays span processes, every process
    calls `save_hf` (each gather takes them all) with the same `path` (on a file system they
    share), and none returns before process 0 has written the whole folder. A Llama's
    tensors keep their layouts and names; tied embeddings write no `lm_head.weight`, as
    transformers does.

    A **Mixtral** (a Llama with `moe=`, every layer an expert layer with softmax scores and
    `normalize_weights=True`, as `load_hf` builds it) gets `model_type: "mixtral"`, its
    experts' `intermediate_size`, `num_local_experts`, `num_experts_per_tok`, and
    `router_aux_loss_coef` from `aux_loss_weight` (inverting `load_hf`'s scaling; with a
    weight of 0, `output_router_logits: false` and transformers' default coefficient);
    each layer's router is written as `block_sparse_moe.gate.weight` and its stacked
    experts as each expert's `w1`, `w3` and `w2` (`block_sparse_moe.experts.0.w1.weight`,
    ..., `[out, in]`). transformers computes a Mixtral dropless: a model trained with a
    `capacity_factor` is saved as it is, and computes in transformers what it computes in
    eqxpar with `capacity_factor=None`. A router z-loss (`z_loss_weight`) shapes training
    only and has no key in a Mixtral config: it is not written, and `load_hf` gives 0.

    A GPT's tensors are named as `GPT2LMHeadModel.save_pretrained` names them
    (`transformer.h.0.attn.c_attn.weight`, ...), its `Conv1D` weights transposed to
    `[in, out]`, query, key and value fused into `c_attn`, the vocabulary padding dropped.
    A GPT built without attention biases (`eqxpar.models.GPT(...)`) gets zero `c_attn` and
    `c_proj` biases: the same function. **Tied weights:** a GPT holds its head apart from
    its token embedding, also when loaded from a tied GPT-2 (the head is a copy), and
    training moves them apart. By default (`tie_embeddings=None`) the folder is tied
    (`tie_word_embeddings: true`, no `lm_head.weight`) when the head equals the embedding
    bit for bit, as after `load_hf` of a tied checkpoint, and untied (the head written as
    `lm_head.weight`) otherwise; `True` demands the tie, `False` never ties. Nothing is
    averaged or dropped silently.

    eqxpar never replaces files it did not write: if the folder already holds a
    `config.json` or weights, nothing is written.

    **Arguments:**

    - `model`: a [`eqxpar.models.Llama`][] or [`eqxpar.models.GPT`][] (global form,
      arrays anywhere: placed on a mesh, split or whole).
    - `path`: the folder (created if missing).
    - `dtype`: the saved weights' dtype (`"bfloat16"`, `jnp.float16`, ...); default the
      model's own.
    - `max_shard_bytes`: the largest shard file; default 2 GiB.
    - `tie_embeddings`: for a GPT only (see above): `None`, `True` or `False`.

    **Returns:**

    The folder's path.

    **Raises:**

    - `ValueError` for a model that is neither a Llama nor a GPT, a non-floating `dtype`, a
      non-positive `max_shard_bytes`, a path that is a file, a folder that already holds
      checkpoint files (naming them: write to a new folder), `tie_embeddings` given for a
      Llama, `tie_embeddings=True` for a GPT whose head differs from its embedding, or a
      GPT whose layer norms GPT-2 cannot express (different epsilons), or a Llama with
      `moe=` options no Mixtral has (`every` > 1, sigmoid scores, `normalize_weights=False`,
      `shared_experts` > 0).
    - `MissingDependency` (an `ImportError`) without `safetensors`: `pip install "eqxpar[hf]"`.
    """
    if not isinstance(model, (Llama, GPT)):
        raise ValueError(
            f"save_hf: model must be an eqxpar.models.Llama or GPT (from their constructors or load_hf), got "
            f"{type(model).__name__}."
        )
    leaves = [leaf for leaf in jax.tree.leaves(model) if eqx.is_array(leaf)]
    if dtype is None:
        dtype = leaves[0].dtype
    dtype = jnp.dtype(dtype)
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"save_hf: dtype must be float32, bfloat16 or float16, got {dtype}.")
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise ValueError(f"save_hf: max_shard_bytes must be a positive int, got {max_shard_bytes!r}.")
    folder = pathlib.Path(path)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"save_hf: {str(folder)!r} is a file; give a folder to write the checkpoint into.")
    existing = _existing(folder)
    if existing:
        raise ValueError(
            f"save_hf: {str(folder)!r} already holds {existing}; eqxpar does not replace files it did not "
            f"write. Save to a new folder (or move those files away yourself)."
        )
    safetensors_numpy = safetensors_module("eqxpar.models.save_hf", "safetensors.numpy")

    # The plan, from shapes alone: every Hugging Face tensor, in order, cut into shards.
    arrays, tensors, config = _plan(model, tie_embeddings, _DTYPE_NAMES[dtype])
    sizes = {name: int(np.prod(shape)) * dtype.itemsize for name, shape, _ in tensors}
    shards: list[list[tuple[str, tuple[int, ...], list]]] = [[]]
    for tensor in tensors:
        if shards[-1] and sum(sizes[t[0]] for t in shards[-1]) + sizes[tensor[0]] > max_shard_bytes:
            shards.append([])
        shards[-1].append(tensor)
    files = (
        [SINGLE]
        if len(shards) == 1
        else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    )
    last_use = {i: k for k, (_, _, fills) in enumerate(tensors) for i, _, _ in fills}

    writer = jax.process_index() == 0
    if writer:
        folder.mkdir(parents=True, exist_ok=True)
    fetched: dict[int, np.ndarray] = {}  # arrays on the host while a later tensor needs them
    k = 0
    for file, shard in zip(files, shards):
        out = {}
        for name, shape, fills in shard:
            for i, _, _ in fills:
                if i not in fetched:
                    fetched[i] = _host(arrays[i])
            parts = [(source, fetched[i] if layer is None else fetched[i][layer]) for i, layer, source in fills]
            out[name] = assemble(parts, dtype) if parts else np.zeros(shape, dtype)  # a bias it lacks: zeros
            for i in [i for i in fetched if last_use[i] <= k]:
                del fetched[i]
            k += 1
        if writer:
            safetensors_numpy.save_file(out, str(folder / file), metadata={"format": "pt"})
        del out
    if writer:
        if len(files) > 1:
            index = {
                "metadata": {"total_size": sum(sizes.values())},
                "weight_map": {name: file for file, shard in zip(files, shards) for name, *_ in shard},
            }
            (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if any(isinstance(a, jax.Array) and not a.is_fully_addressable for a in leaves):
        # Every process took part in the gathers; without this one more, the others return
        # while process 0 is still writing, and find the folder empty or half written.
        multihost_utils.sync_global_devices("eqxpar.models.save_hf: folder written")
    return folder
