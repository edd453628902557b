"""Saving a Llama as a Hugging Face checkpoint folder (`config.json` and `.safetensors`
shards), fetched one array at a time: no whole copy of the model is ever built."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from ._hf import INDEX, SINGLE, hf_tensor_names, safetensors_module
from ._hf_config import hf_config_dict
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


def save_hf(model: Llama, path: str | os.PathLike, *, dtype: Any = None, max_shard_bytes: int = 2**31) -> pathlib.Path:
    """Write `model` as a Hugging Face `LlamaForCausalLM` checkpoint folder.

    `config.json` gets every field of the model's config (`model_type: "llama"`,
    `architectures: ["LlamaForCausalLM"]`, the rotary settings as top-level `rope_theta` and
    `rope_scaling`), and the weights go to `model.safetensors`, or, past `max_shard_bytes`,
    to `model-0000k-of-0000n.safetensors` with a `model.safetensors.index.json`. Arrays are
    fetched one at a time (`jax.device_get` of one array, or, for arrays spread over
    several processes, one array's gather) and one shard file is written before the next
    is assembled, so the host holds at most one shard's worth; only process 0 writes.
    Tensors keep Hugging Face's layouts (the Llama stores them so) and names; tied
    embeddings write no `lm_head.weight`, as transformers does.

    eqxpar never replaces files it did not write: if the folder already holds a
    `config.json` or weights, nothing is written.

    **Arguments:**

    - `model`: a [`eqxpar.models.Llama`][] (global form, arrays anywhere: placed on a
      mesh, split or whole).
    - `path`: the folder (created if missing).
    - `dtype`: the saved weights' dtype (`"bfloat16"`, `jnp.float16`, ...); default the
      model's own.
    - `max_shard_bytes`: the largest shard file; default 2 GiB.

    **Returns:**

    The folder's path.

    **Raises:**

    - `ValueError` for a model that is not a Llama, a non-floating `dtype`, a
      non-positive `max_shard_bytes`, a path that is a file, or a folder that already
      holds checkpoint files (naming them: write to a new folder).
    - `MissingDependency` (an `ImportError`) without `safetensors`: `pip install "eqxpar[hf]"`.
    """
    if not isinstance(model, Llama):
        raise ValueError(
            f"save_hf: model must be an eqxpar.models.Llama (from eqxpar.models.Llama or load_hf), got "
            f"{type(model).__name__}."
        )
    leaves = jax.tree.leaves(model)
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
    tensors = []  # (name, leaf index, layer index or None, bytes)
    for i, (leaf, (names, stacked)) in enumerate(zip(leaves, hf_tensor_names(model))):
        per_tensor = int(np.prod(leaf.shape[1:] if stacked else leaf.shape)) * dtype.itemsize
        tensors.extend((name, i, layer if stacked else None, per_tensor) for layer, name in enumerate(names))
    shards: list[list[tuple[str, int, int | None, int]]] = [[]]
    for tensor in tensors:
        if shards[-1] and sum(t[3] for t in shards[-1]) + tensor[3] > max_shard_bytes:
            shards.append([])
        shards[-1].append(tensor)
    files = (
        [SINGLE]
        if len(shards) == 1
        else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    )

    writer = jax.process_index() == 0
    if writer:
        folder.mkdir(parents=True, exist_ok=True)
    fetched: tuple[int, np.ndarray] | None = None  # the last array fetched (a stack serves several tensors)
    for file, shard in zip(files, shards):
        arrays = {}
        for name, i, layer, _ in shard:
            if fetched is None or fetched[0] != i:
                fetched = (i, _host(leaves[i]))
            array = fetched[1] if layer is None else fetched[1][layer]
            arrays[name] = np.ascontiguousarray(array.astype(dtype, copy=False))
        if writer:
            safetensors_numpy.save_file(arrays, str(folder / file), metadata={"format": "pt"})
        del arrays
    if writer:
        if len(files) > 1:
            index = {
                "metadata": {"total_size": sum(t[3] for t in tensors)},
                "weight_map": {name: file for file, shard in zip(files, shards) for name, *_ in shard},
            }
            (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        config = hf_config_dict(model.config, _DTYPE_NAMES[dtype])
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder
