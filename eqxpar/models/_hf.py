"""Loading a Hugging Face Llama checkpoint (`config.json` and `.safetensors` shards) straight
into its shards on a mesh: every device reads only its own slice of every tensor."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
from collections.abc import Iterable
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
from ._hf_config import llama_config_from_hf
from ._llama import Llama

__all__ = ["load_hf", "hf_tensor_names", "read_hf_config", "safetensors_module"]

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


def _check_tensors(abstract: Llama, names: list[tuple[tuple[str, ...], bool]], handles, weight_map) -> None:
    """Every tensor the model needs is there with its shape, and the checkpoint holds nothing
    the model would drop (before any weight is read)."""
    needed = set()
    for leaf, (leaf_names, stacked) in zip(jax.tree.leaves(abstract), names):
        shape = tuple(leaf.shape[1:] if stacked else leaf.shape)
        for name in leaf_names:
            needed.add(name)
            if name not in weight_map:
                raise ValueError(
                    f"load_hf: the checkpoint has no tensor {name!r}, which the config's model needs; check that "
                    f"config.json belongs to these weights (num_hidden_layers, tie_word_embeddings)."
                )
            got = tuple(handles[weight_map[name]].get_slice(name).get_shape())
            if got != shape:
                raise ValueError(
                    f"load_hf: tensor {name!r} in {weight_map[name]} has shape {got}, but config.json gives {shape} "
                    f"(hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim, "
                    f"vocab_size); check that config.json belongs to these weights."
                )
    tied = abstract.config.tie_embeddings
    extra = sorted(
        n
        for n in set(weight_map) - needed
        if not n.endswith("rotary_emb.inv_freq") and not (tied and n == "lm_head.weight")
    )
    if extra:
        raise ValueError(
            f"load_hf: the checkpoint holds tensors a Llama has no place for: {extra[:5]}"
            + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
            + "; it is not a LlamaForCausalLM of this config (biases, another architecture)."
        )


def _build_array(leaf, leaf_names, stacked: bool, spec, mesh, handles, weight_map, dtype) -> jax.Array:
    """One array made on `mesh` with `spec`, each device's block read as a slice of the file."""
    dtype = jnp.dtype(dtype)
    blocks: dict[tuple, np.ndarray] = {}  # devices holding the same block read it once

    def read(index: Any) -> np.ndarray:  # a tuple of slices, one per dimension
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in blocks:
            if stacked:
                layers = range(len(leaf_names))[index[0]]
                parts = [handles[weight_map[leaf_names[i]]].get_slice(leaf_names[i])[index[1:]] for i in layers]
                block = np.stack(parts)
            else:
                block = handles[weight_map[leaf_names[0]]].get_slice(leaf_names[0])[index]
            blocks[key] = np.asarray(block).astype(dtype, copy=False)
        return blocks[key]

    return jax.make_array_from_callback(tuple(leaf.shape), NamedSharding(mesh, spec), read, dtype=dtype)


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
) -> tuple[Llama, PyTree[PartitionSpec]]:
    """A Hugging Face `LlamaForCausalLM` checkpoint folder loaded straight into its shards.

    Reads `config.json` (the keys of current transformers, `rope_parameters`, and of older
    ones, top-level `rope_theta`/`rope_scaling`, with Llama 3's scaling), builds the
    matching [`eqxpar.models.Llama`][] abstractly (`eqx.filter_eval_shape`: no weights
    drawn), computes where each array goes, and makes each with
    `jax.make_array_from_callback`: every device reads only its own slice of every tensor
    through `safetensors`' `get_slice` (from one `model.safetensors` or the shards of
    `model.safetensors.index.json`). No device, and no process, ever holds more of the model
    than its shards. Weights are cast to `dtype` (bfloat16 checkpoints to float32 by
    default). Tensors need no permuting: the Llama stores Hugging Face's layouts.

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
    - `dtype`: the arrays' dtype; default float32 (the Llama's own).
    - `scan_layers`, `remat`, `axis_name`: as for [`eqxpar.models.Llama`][].
    - `batch_axis`, `min_size`: as for [`eqxpar.train.fsdp_specs`][] (`"fsdp"` only).
    - `ignore_keys`: `config.json` keys to skip that eqxpar does not know and that do not
      change the computation.

    **Returns:**

    `(model, specs)`: the model with its arrays placed on `mesh`, and their
    `PartitionSpec`s (for the train steps' `param_specs` and `eqxpar.filter_shard_map`).

    **Raises:**

    - `ValueError`, before any weight is read: a bad argument; a missing `config.json`,
      shard or tensor; a `config.json` key the Llama cannot compute (another `model_type`,
      biases, another activation or rotary embedding), naming the key; a tensor whose
      shape disagrees with `config.json`; a mesh that does not split the model (e.g. a
      model axis that does not divide `num_key_value_heads`).
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
    config = llama_config_from_hf(read_hf_config(folder), ignore_keys)
    abstract = eqx.filter_eval_shape(
        Llama, config, scan_layers=scan_layers, remat=remat, axis_name=axis_name, key=jax.random.key(0)
    )
    if strategy == "replicated":
        specs = jax.tree.map(lambda _: PartitionSpec(), abstract)
    elif strategy == "tensor":
        specs = partition_specs(abstract, mesh)
    else:
        base = partition_specs(abstract, mesh) if axis_name in mesh.shape else PartitionSpec()
        specs = fsdp_specs(abstract, mesh, batch_axis=batch_axis, param_specs=base, min_size=min_size)
    names = hf_tensor_names(abstract)
    leaves, treedef = jax.tree.flatten(abstract)
    with contextlib.ExitStack() as stack:
        handles, weight_map = _open(folder, stack, safetensors)
        _check_tensors(abstract, names, handles, weight_map)
        spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        arrays = [
            _build_array(
                leaf, leaf_names, stacked, spec, mesh, handles, weight_map, leaf.dtype if dtype is None else dtype
            )
            for leaf, (leaf_names, stacked), spec in zip(leaves, names, spec_leaves)
        ]
    return jax.tree.unflatten(treedef, arrays), specs
