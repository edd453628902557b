"""Loading a Hugging Face Llama, Mixtral or GPT-2 checkpoint (`config.json` and `.safetensors` shards)
straight into its shards on a mesh: every device reads only its own slice of every tensor."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
from collections.abc import Callable, Iterable
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

from .._optional import require
from ..nn import StackedLayers, partition_specs
from ..train import fsdp_specs
from ._block import REMAT_CHOICES, Remat
from ._gpt import GPT
from ._hf_config import llama_config_from_hf
from ._hf_gpt2 import checkpoint_prefix, gpt2_abstract, gpt2_settings_from_hf, gpt2_sources, is_gpt2_buffer
from ._hf_mixtral import mixtral_settings_from_hf, moe_source
from ._hf_source import Source, read_block
from ._llama import Llama

__all__ = ["load_hf", "hf_tensor_names", "llama_sources", "read_hf_config", "safetensors_module"]

STRATEGIES = ("replicated", "tensor", "fsdp")
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def safetensors_module(who: str, module: str = "safetensors"):
    """`safetensors` (or its `module`, e.g. `"safetensors.numpy"`), or the one-line install
    hint (`pip install "eqxpar[hf]"`)."""
    return require(module, package="safetensors", extra="hf", purpose=who)


def hf_tensor_names(model: Llama) -> list[tuple[tuple[str, ...], bool]]:
    """Per array leaf of `model` (in `jax.tree.leaves` order), the Hugging Face tensor names
    it holds and whether it is stacked: one name, or with `scan_layers=True` one per layer
    (`model.layers.0.self_attn.q_proj.weight`, `model.layers.1...`, stacked on axis 0)."""
    names = []
    for path, _ in jax.tree_util.tree_flatten_with_path(model)[0]:
        parts = [str(getattr(k, "name", getattr(k, "idx", k))) for k in path]
        if parts[:2] == ["layers", "layers"] and isinstance(model.layers, StackedLayers):
            rest = ".".join(parts[2:])
            names.append((tuple(f"model.layers.{i}.{rest}" for i in range(model.num_layers)), True))
        elif parts[0] == "lm_head":
            names.append(((".".join(parts),), False))
        else:
            names.append((("model." + ".".join(parts),), False))
    return names


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed `config.json` of a checkpoint folder (`ValueError` if missing or not JSON)."""
    folder = pathlib.Path(path)
    if not folder.is_dir():
        raise ValueError(f"load_hf: {str(folder)!r} is not a folder; give the checkpoint folder (with config.json).")
    file = folder / "config.json"
    if not file.is_file():
        raise ValueError(f"load_hf: {str(file)!r} is missing; a Hugging Face checkpoint folder has a config.json.")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"load_hf: {str(file)!r} is not valid JSON ({error}).") from None
    if not isinstance(config, dict):
        raise ValueError(f"load_hf: {str(file)!r} must hold a JSON object, got {type(config).__name__}.")
    return config


def _weight_map(folder: pathlib.Path) -> dict[str, str]:
    """Tensor name -> file name, from the index, or from a single `model.safetensors`."""
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"load_hf: {str(index)!r} is not an index (JSON with a 'weight_map').") from None
        missing = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
        if missing:
            raise ValueError(
                f"load_hf: {INDEX} names shard files that are not in {str(folder)!r}: {missing}; copy every "
                f"shard of the checkpoint into the folder."
            )
        return dict(weight_map)
    if (folder / SINGLE).is_file():
        return {}  # filled from the file's header
    found = sorted(p.name for p in folder.glob("*.safetensors"))
    raise ValueError(
        f"load_hf: {str(folder)!r} has neither {SINGLE} nor {INDEX}"
        + (f" (found {found}: shards need their index)" if found else "")
        + "; give a folder saved by save_pretrained or eqxpar.models.save_hf."
    )


def _open(folder: pathlib.Path, stack: contextlib.ExitStack, safetensors) -> tuple[dict[str, Any], dict[str, str]]:
    """Every shard opened (headers only: safetensors maps the files, reads happen on slicing);
    returns file name -> handle and tensor name -> file name, checked against each header."""
    weight_map = _weight_map(folder)
    files = sorted(set(weight_map.values())) or [SINGLE]
    handles = {f: stack.enter_context(safetensors.safe_open(str(folder / f), framework="numpy")) for f in files}
    if not weight_map:
        weight_map = dict.fromkeys(handles[SINGLE].keys(), SINGLE)
    for name, file in weight_map.items():
        if name not in handles[file].keys():
            raise ValueError(f"load_hf: {INDEX} says {name!r} is in {file}, but that file has no such tensor.")
    return handles, weight_map


def llama_sources(model: Llama) -> list[Source]:
    """Per array leaf of a Llama, its `Source`: Hugging Face's tensors as they are; with
    `moe=`, each layer's `block_sparse_moe` as a Mixtral's (router, and each expert's
    `w1`/`w3`/`w2` stacked and transposed)."""
    sources = []
    for leaf, (names, stacked) in zip(jax.tree.leaves(model), hf_tensor_names(model)):
        moe = None if stacked else moe_source(names[0], tuple(leaf.shape))
        sources.append(moe or Source(names, tuple(leaf.shape[1:] if stacked else leaf.shape), stacked=stacked))
    return sources


def _check_tensors(sources: list, handles, weight_map, ignorable: Callable[[str], bool], who: str) -> None:
    """Every tensor the model needs is there with its shape, and the checkpoint holds nothing
    the model would drop (before any weight is read)."""
    needed = set()
    for source in sources:
        if source is None:
            continue
        for name in source.names:
            needed.add(name)
            if name not in weight_map:
                raise ValueError(
                    f"load_hf: the checkpoint has no tensor {name!r}, which the config's model needs; check that "
                    f"config.json belongs to these weights (the number of layers, tie_word_embeddings)."
                )
            got = tuple(handles[weight_map[name]].get_slice(name).get_shape())
            if got != source.shape:
                raise ValueError(
                    f"load_hf: tensor {name!r} in {weight_map[name]} has shape {got}, but config.json gives "
                    f"{source.shape} (its sizes: widths, heads, layers, vocab_size); check that config.json "
                    f"belongs to these weights."
                )
    extra = sorted(n for n in set(weight_map) - needed if not ignorable(n))
    if extra:
        raise ValueError(
            f"load_hf: the checkpoint holds tensors {who} has no place for: {extra[:5]}"
            + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
            + f"; it is not a {who} of this config (biases, another architecture)."
        )


def _build_array(leaf, source: Source, spec, mesh, handles, weight_map, dtype) -> jax.Array:
    """One array made on `mesh` with `spec`, each device's block read as a slice of the file."""
    dtype = jnp.dtype(dtype)
    blocks: dict[tuple, np.ndarray] = {}  # devices holding the same block read it once

    def get_slice(name: str):
        return handles[weight_map[name]].get_slice(name)

    def read(index: Any) -> np.ndarray:  # a tuple of slices, one per dimension
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in blocks:
            block = read_block(source, tuple(index), leaf.shape, get_slice)
            blocks[key] = np.asarray(block).astype(dtype, copy=False)
        return blocks[key]

    return jax.make_array_from_callback(tuple(leaf.shape), NamedSharding(mesh, spec), read, dtype=dtype)


def _check_mixtral_layout(mesh: Mesh, strategy: str, scan_layers: bool, axis_name: str, expert_axis: str) -> None:
    """A Mixtral's placement needs no scan, and both the model and expert axes where it splits."""
    if scan_layers:
        raise ValueError(
            "load_hf: a Mixtral loads with scan_layers=False (its layers are mixtures of experts, which the "
            "Llama runs in a Python loop); leave scan_layers out."
        )
    axes = (axis_name, expert_axis)
    splits = strategy == "tensor" or (strategy == "fsdp" and any(a in mesh.shape for a in axes))
    missing = [a for a in axes if a not in mesh.shape]
    if splits and missing:
        raise ValueError(
            f"load_hf: strategy={strategy!r} splits a Mixtral over the model axis {axis_name!r} (heads, "
            f"vocabulary, each expert's units) and the expert axis {expert_axis!r} (its experts), but the mesh "
            f"{dict(mesh.shape)} has no {missing}; add them (size 1 keeps that dimension whole), e.g. "
            f"eqxpar.make_mesh(..., {expert_axis}=2, {axis_name}=1)."
        )


def _is_abstract_array(leaf) -> bool:
    return isinstance(leaf, jax.ShapeDtypeStruct)


def load_hf(
    path: str | os.PathLike,
    mesh: Mesh,
    *,
    strategy: Literal["replicated", "tensor", "fsdp"] = "replicated",
    dtype: Any = None,
    scan_layers: bool = False,
    remat: Remat = "none",
    axis_name: str = "model",
    batch_axis: str = "fsdp",
    min_size: int = 0,
    ignore_keys: Iterable[str] = (),
    capacity_factor: float | None = None,
    expert_axis: str = "expert",
) -> tuple[Llama | GPT, PyTree[PartitionSpec]]:
    """A Hugging Face checkpoint folder loaded straight into its shards: a `LlamaForCausalLM`
    as an [`eqxpar.models.Llama`][], a `MixtralForCausalLM` as a Llama with `moe=`, a GPT-2
    (`GPT2LMHeadModel`) as an [`eqxpar.models.GPT`][].

    Reads `config.json` (for a Llama the keys of current transformers, `rope_parameters`,
    and of older ones, top-level `rope_theta`/`rope_scaling`, with Llama 3's scaling),
    builds the matching model abstractly (`eqx.filter_eval_shape`: no weights drawn),
    computes where each array goes, and makes each with `jax.make_array_from_callback`:
    every device reads only its own slice of every tensor through `safetensors`'
    `get_slice` (from one `model.safetensors` or the shards of
    `model.safetensors.index.json`). No device, and no process, ever holds more of the model
    than its shards. Weights are cast to `dtype` (bfloat16 checkpoints to float32 by
    default). A Llama's tensors need no permuting: the Llama stores Hugging Face's layouts.

    **GPT-2** (`model_type: "gpt2"`): the GPT gets GPT-2's shape (`n_embd`, `n_head`,
    `n_layer`, `n_positions`, `n_inner` as `mlp_ratio * n_embd`), its `layer_norm_epsilon`,
    its dropouts (`resid_pdrop` = `embd_pdrop` as `dropout_p`, `attn_pdrop` on the attention
    weights: call the model with `inference=True` to evaluate) and attention with GPT-2's
    `c_attn` and `c_proj` biases; the tanh GELU (`gelu_new`) is the GPT's own. Each
    device reads its columns of the `Conv1D` weights (stored `[in, out]`) and of the fused
    `c_attn` (query, key, value). The vocabulary is padded to a multiple of 128 (the GPT's
    padding, zeros, never predicted). The GPT holds its head apart from its embedding: for
    a tied checkpoint (`tie_word_embeddings`, true by default) the head is a copy of
    `wte` (each device reads its rows twice); see [`eqxpar.models.save_hf`][] for what it
    writes. Tensor names with or without the `transformer.` prefix, and the older files'
    attention-mask buffers (`h.0.attn.bias`, skipped), are read. What the GPT cannot
    compute is a `ValueError` naming the key: `scale_attn_by_inverse_layer_idx`,
    `reorder_and_upcast_attn`, `add_cross_attention`, another `activation_function`, an
    `n_inner` that is not a multiple of `n_embd`, `embd_pdrop` different from `resid_pdrop`.

    **Mixtral** (`model_type: "mixtral"`): a Llama whose every layer is an
    [`eqxpar.models.LlamaMoEBlock`][], built with `moe=MoEOptions(num_local_experts,
    num_experts_per_tok, normalize_weights=True, capacity_factor=capacity_factor)`: the
    router's softmax over all experts, the `k` best kept and divided by their sum, as
    transformers computes; dropless by default, so the logits are transformers'. Each
    device reads its experts' slices of the experts' `w1`, `w3` and `w2` (stacked into the
    layer's `gate`, `up` and `down`, transposed) and the router `gate` whole. The experts are
    split over `expert_axis` (`"tensor"`, and `"fsdp"` on a mesh with the model or expert
    axis, need both axes in the mesh; size 1 keeps a dimension whole). `router_aux_loss_coef`
    becomes the model's `aux_loss_weight` (see `eqxpar/models/_hf_mixtral.py`);
    `router_jitter_noise` other than 0 and a `sliding_window` shorter than
    `max_position_embeddings` are refused by name.

    ```python
    mesh = eqxpar.make_mesh(fsdp=2, model=4)
    model, specs = eqxpar.models.load_hf("Llama-3.2-1B/", mesh, strategy="fsdp")
    ```

    **Arguments:**

    - `path`: the checkpoint folder.
    - `mesh`: the mesh to place the model on.
    - `strategy`: `"replicated"` (every array whole on every device), `"tensor"` (split over
      `axis_name` as [`eqxpar.nn.partition_specs`][] says: heads, key/value heads, MLP
      units, vocabulary), or `"fsdp"` ([`eqxpar.train.fsdp_specs`][] over `batch_axis`, on
      top of the tensor split if the mesh has `axis_name`: FSDP x TP, as
      [`eqxpar.train.fsdp_step`][] places it).
    - `dtype`: the arrays' dtype; default float32 (the models' own).
    - `scan_layers`, `remat`, `axis_name`: as for [`eqxpar.models.Llama`][] and
      [`eqxpar.models.GPT`][].
    - `batch_axis`, `min_size`: as for [`eqxpar.train.fsdp_specs`][] (`"fsdp"` only).
    - `ignore_keys`: `config.json` keys to skip that eqxpar does not know and that do not
      change the computation.
    - `capacity_factor`: a Mixtral's experts' capacity per sequence (tokens over it are
      dropped, as training with capacity does); default None, dropless, what transformers
      computes. Only for a Mixtral.
    - `expert_axis`: the mesh axis a Mixtral's experts are split over. Only for a Mixtral.

    **Returns:**

    `(model, specs)`: the model with its arrays placed on `mesh`, and their
    `PartitionSpec`s (for the train steps' `param_specs` and `eqxpar.filter_shard_map`).

    **Raises:**

    - `ValueError`, before any weight is read: a bad argument; a missing `config.json`,
      shard or tensor; a `config.json` key the model cannot compute (another `model_type`,
      a Llama's biases, another activation or rotary embedding, the GPT-2 keys above),
      naming the key; a tensor whose
      shape disagrees with `config.json`; a mesh that does not split the model (e.g. a
      model axis that does not divide `num_key_value_heads`, or GPT-2's `n_head`).
    - `MissingDependency` (an `ImportError`) without `safetensors`: `pip install "eqxpar[hf]"`.
    """
    if not isinstance(mesh, Mesh):
        raise ValueError(f"load_hf: mesh must be a jax.sharding.Mesh (eqxpar.make_mesh), got {type(mesh).__name__}.")
    if strategy not in STRATEGIES:
        raise ValueError(f"load_hf: strategy must be one of {STRATEGIES}, got {strategy!r}.")
    if remat not in REMAT_CHOICES:
        raise ValueError(f"load_hf: remat must be one of {REMAT_CHOICES}, got {remat!r}.")
    if dtype is not None and not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
        raise ValueError(f"load_hf: dtype must be a floating dtype (float32, bfloat16), got {dtype!r}.")
    if isinstance(ignore_keys, str):
        raise ValueError(f"load_hf: ignore_keys must be a list of keys, got the string {ignore_keys!r}.")
    safetensors = safetensors_module("eqxpar.models.load_hf")
    folder = pathlib.Path(path)
    raw = read_hf_config(folder)
    mixtral = raw.get("model_type") == "mixtral"
    if not mixtral and (capacity_factor is not None or expert_axis != "expert"):
        raise ValueError(
            f"load_hf: capacity_factor and expert_axis are for a Mixtral checkpoint's experts, but this one's "
            f"model_type is {raw.get('model_type')!r}; leave them out."
        )
    if raw.get("model_type") == "gpt2":
        settings = gpt2_settings_from_hf(raw, ignore_keys)
        abstract = gpt2_abstract(settings, scan_layers=scan_layers, remat=remat, axis_name=axis_name)
    else:
        moe = None
        if mixtral:
            config, moe = mixtral_settings_from_hf(
                raw, ignore_keys, capacity_factor=capacity_factor, expert_axis=expert_axis
            )
            _check_mixtral_layout(mesh, strategy, scan_layers, axis_name, expert_axis)
        else:
            config = llama_config_from_hf(raw, ignore_keys)
        abstract = eqx.filter_eval_shape(
            Llama, config, scan_layers=scan_layers, remat=remat, moe=moe, axis_name=axis_name, key=jax.random.key(0)
        )
    if strategy == "replicated":
        specs = jax.tree.map(lambda leaf: PartitionSpec() if _is_abstract_array(leaf) else None, abstract)
    elif strategy == "tensor":
        specs = partition_specs(abstract, mesh)
    else:
        split = axis_name in mesh.shape or (mixtral and expert_axis in mesh.shape)
        base = partition_specs(abstract, mesh) if split else PartitionSpec()
        specs = fsdp_specs(abstract, mesh, batch_axis=batch_axis, param_specs=base, min_size=min_size)
    leaves, treedef = jax.tree.flatten(abstract)
    spec_leaves = treedef.flatten_up_to(specs)
    with contextlib.ExitStack() as stack:
        handles, weight_map = _open(folder, stack, safetensors)
        if isinstance(abstract, GPT):
            prefix = checkpoint_prefix(weight_map)
            tied = settings.tie_word_embeddings  # the head reads wte: a copy of the embedding
            sources = iter(gpt2_sources(abstract, prefix, tied))
            ignorable = lambda n: is_gpt2_buffer(n) or (tied and n == "lm_head.weight")  # noqa: E731
            who = "a GPT2LMHeadModel"
        else:
            sources = iter(llama_sources(abstract))
            tied = abstract.config.tie_embeddings
            ignorable = lambda n: n.endswith("rotary_emb.inv_freq") or (tied and n == "lm_head.weight")  # noqa: E731
            who = "a MixtralForCausalLM" if mixtral else "a LlamaForCausalLM"
        placed = [
            (leaf, next(sources) if _is_abstract_array(leaf) else None, spec) for leaf, spec in zip(leaves, spec_leaves)
        ]
        _check_tensors([source for _, source, _ in placed], handles, weight_map, ignorable, who)
        out = []
        for leaf, source, spec in placed:
            if not _is_abstract_array(leaf):
                out.append(leaf)
            elif source is None:  # an array the checkpoint has no tensor for: none in these models
                raise ValueError(f"load_hf: no tensor of the checkpoint fills an array of shape {leaf.shape}.")
            else:
                spec = PartitionSpec() if spec is None else spec
                out.append(
                    _build_array(leaf, source, spec, mesh, handles, weight_map, leaf.dtype if dtype is None else dtype)
                )
    return jax.tree.unflatten(treedef, out), specs
