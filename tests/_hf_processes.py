"""Run by tests/test_hf_multiprocess.py under `python -m eqxpar.launch --nproc 2 --devices-per-proc 2`.

Every process of the 2 x 2 job, for each case of `CASES` named on the command line (a
checkpoint folder the test wrote in `DIR`, loaded on a mesh of all 4 devices):

1. loads it with `load_hf`, counting what it reads from the files (`CountingReads`);
2. computes `whole_logits` of fixed tokens and gathers them;
3. saves the model with `save_hf` into `DIR/<case>_saved_by_two`, counting the files it
   writes (only process 0 may write), and right after `save_hf` returns reads the whole
   folder back: a process must find it complete when `save_hf` returns.

Each process writes what it saw to `DIR/<case>_rank<i>.json` and its logits to
`DIR/<case>_rank<i>_logits.npy` for the test to compare with its own references.

Usage: python tests/_hf_processes.py DIR CASE [CASE ...]
"""

import json
import os
import pathlib
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from _hf_files import CountingReads

import eqxpar
import eqxpar.distributed
from eqxpar.models import load_hf, save_hf, whole_logits

# case -> (checkpoint folder, mesh sizes in mesh order, load_hf strategy, save_hf's
# max_shard_bytes). The first axis crosses the two processes (devices 0, 1 are process 0's),
# so fsdp=4 leaves each process half of every tensor, model=2 first splits the heads, MLP
# units and vocabulary between the processes, and data=2 first gives each a whole copy.
CASES = {
    "llama": ("llama", {"fsdp": 4, "model": 1}, "fsdp", 2**31),
    "gpt2": ("gpt2", {"model": 2, "data": 2}, "tensor", 2**31),
    "llama_data_model": ("llama", {"data": 2, "model": 2}, "tensor", 20_000),
}
TOKENS = np.random.default_rng(2).integers(0, 50, (2, 16))  # below both vocabularies (64, 50)


class _Writes:
    """Every write `save_hf` can make into `folder` (a safetensors file, a text file, the
    folder itself), recorded by path and then made."""

    def __init__(self, mp: pytest.MonkeyPatch, folder: pathlib.Path):
        self.paths: list[str] = []
        save_file, write_text, mkdir = safetensors.numpy.save_file, pathlib.Path.write_text, pathlib.Path.mkdir
        paths = self.paths

        def record(path) -> None:
            if pathlib.Path(path) == folder or folder in pathlib.Path(path).parents:
                paths.append(str(path))

        def recorded_save_file(tensors, filename, *args, **kwargs):
            record(filename)
            return save_file(tensors, filename, *args, **kwargs)

        def recorded_write_text(self, *args, **kwargs):
            record(self)
            return write_text(self, *args, **kwargs)

        def recorded_mkdir(self, *args, **kwargs):
            record(self)
            return mkdir(self, *args, **kwargs)

        mp.setattr(safetensors.numpy, "save_file", recorded_save_file)
        mp.setattr(pathlib.Path, "write_text", recorded_write_text)
        mp.setattr(pathlib.Path, "mkdir", recorded_mkdir)


def _folder_contents(folder: pathlib.Path) -> dict:
    """The folder as this process finds it: its file names, config.json, and every tensor's
    bytes (hex of a hash would hide which tensor differs; these are tiny)."""
    names = sorted(os.listdir(folder)) if folder.is_dir() else []
    tensors = {}
    for name in names:
        if name.endswith(".safetensors"):
            for key, value in safetensors.numpy.load_file(str(folder / name)).items():
                tensors[key] = [str(value.dtype), list(value.shape), value.tobytes().hex()]
    config = json.loads((folder / "config.json").read_text()) if "config.json" in names else None
    return {"files": names, "config": config, "tensors": tensors}


def run_case(directory: pathlib.Path, case: str) -> None:
    rank = jax.process_index()
    checkpoint, sizes, strategy, max_shard_bytes = CASES[case]
    mesh = eqxpar.make_mesh(**sizes)
    with pytest.MonkeyPatch.context() as mp:
        counter = CountingReads(mp)
        model, _ = load_hf(directory / checkpoint, mesh, strategy=strategy)
    arrays = [leaf for leaf in jax.tree.leaves(model) if eqx.is_array(leaf)]
    specs = eqxpar.nn.partition_specs(model, mesh)  # the computation's split (an fsdp layout is moved)
    with jax.default_matmul_precision("highest"):
        logits = whole_logits(model, mesh, specs)(jnp.asarray(TOKENS, jnp.int32))
    np.save(directory / f"{case}_rank{rank}_logits.npy", eqxpar.gather(logits))

    saved = directory / f"{case}_saved_by_two"
    with pytest.MonkeyPatch.context() as mp:
        writes = _Writes(mp, saved)
        save_hf(model, saved, max_shard_bytes=max_shard_bytes)
    found = _folder_contents(saved)  # at once: save_hf has returned in this process
    report = {
        "reads": counter.reads,
        "whole_reads": counter.whole,
        "spans_processes": all(not a.is_fully_addressable for a in arrays),
        "arrays": len(arrays),
        "writes": writes.paths,
        "found_after_save": found,
    }
    (directory / f"{case}_rank{rank}.json").write_text(json.dumps(report))
    print(f"{case}: read {sum(n for _, n, _ in counter.reads)} bytes, wrote {len(writes.paths)} paths", flush=True)


def main(directory: str, cases: list[str]) -> None:
    info = eqxpar.distributed.initialize(timeout_s=60)
    for case in cases:
        run_case(pathlib.Path(directory), case)
    print("done", info, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
