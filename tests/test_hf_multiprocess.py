"""load_hf and save_hf in a job of 2 real processes x 2 CPU devices, on meshes that span both
(no mocks): each process reads only the slices its devices hold, the logits equal the
numpy forwards of tests/_hf_files.py, and the folder `save_hf` writes from both processes
(process 0 alone writing) equals, tensor by tensor and bit for bit, what one process saves.

The processes are started by `python -m eqxpar.launch` (tests/_hf_processes.py) under a hard
timeout: a deadlock (a process left alone in a gather) or a failed rank fails the test.
"""

import json
import os
import subprocess

import numpy as np
import pytest
from _hf_files import (
    GPT2_SHAPE,
    LLAMA3,
    config_json,
    gpt2_config_json,
    gpt2_reference_logits,
    gpt2_tensors,
    hf_tensors,
    reference_logits,
    write_checkpoint,
)
from _hf_processes import CASES, TOKENS
from _launch import run_job
from safetensors.numpy import load_file

import eqxpar
from eqxpar.models import load_hf, save_hf


def checkpoints(directory) -> dict:
    """The checkpoint folders the cases load: name -> (tensors, config)."""
    out = {
        "llama": (hf_tensors(5), config_json("current")),
        "gpt2": (gpt2_tensors(2, tie=False), gpt2_config_json(tie=False)),
    }
    write_checkpoint(directory / "llama", *out["llama"], shards=2)
    write_checkpoint(directory / "gpt2", *out["gpt2"])
    return out


def run_cases(directory, *cases: str) -> subprocess.CompletedProcess:
    # Every process exits 0 (the launcher stops all and fails if one fails or the job hangs).
    run = run_job(2, 2, os.path.join("tests", "_hf_processes.py"), str(directory), *cases, timeout_s=120)
    for rank in range(2):
        assert f"[rank {rank}] done process {rank} of 2: 2 local / 4 global cpu devices" in run.stdout, run.stdout
    return run


def reports(directory, case: str) -> list[dict]:
    return [json.loads((directory / f"{case}_rank{r}.json").read_text()) for r in range(2)]


def folder_tensors(folder) -> dict:
    out = {}
    for file in sorted(os.listdir(folder)):
        if file.endswith(".safetensors"):
            out.update(load_file(str(folder / file)))
    return out


def check_logits(directory, case: str, want: np.ndarray) -> None:
    scale = np.abs(want).max()
    got = [np.load(directory / f"{case}_rank{r}_logits.npy") for r in range(2)]
    np.testing.assert_array_equal(got[0], got[1])  # both processes gathered the same logits
    # float32 against float64: as in tests/test_hf.py, within 1e-5 of the largest logit.
    assert got[0].shape == want.shape
    assert np.abs(got[0] - want).max() <= 1e-5 * scale, np.abs(got[0] - want).max() / scale


def check_saved(directory, tmp_path, case: str, tensors: dict) -> None:
    """The folder both processes saved: written by process 0 alone, complete in both when
    save_hf returned, equal to a one-process save of the same checkpoint on the same mesh."""
    checkpoint, sizes, strategy, max_shard_bytes = CASES[case]
    saved = directory / f"{case}_saved_by_two"
    files = sorted(os.listdir(saved))
    zero, one = reports(directory, case)
    assert one["writes"] == []  # process 1 wrote nothing: no file, no folder
    assert sorted(os.path.basename(p) for p in zero["writes"]) == sorted([saved.name, *files])
    assert zero["spans_processes"] and one["spans_processes"] and zero["arrays"] > 0

    # One process (this one, 8 devices; the mesh takes the first 4) saves the same model.
    model, _ = load_hf(directory / checkpoint, eqxpar.make_mesh(**sizes), strategy=strategy)
    alone = save_hf(model, tmp_path / f"{case}_saved_by_one", max_shard_bytes=max_shard_bytes)
    assert sorted(os.listdir(alone)) == files
    for file in files:
        if file.endswith(".json"):  # config.json and the index
            assert json.loads((saved / file).read_text()) == json.loads((alone / file).read_text()), file
    by_two, by_one = folder_tensors(saved), folder_tensors(alone)
    assert by_two.keys() == by_one.keys() == tensors.keys()
    for name, array in by_two.items():
        assert array.dtype == by_one[name].dtype == np.float32 and array.shape == by_one[name].shape, name
        assert array.tobytes() == by_one[name].tobytes(), name
        # ... and both are the checkpoint's own tensors, bit for bit.
        assert array.tobytes() == tensors[name].tobytes(), name

    # What each process found on disk the moment its save_hf returned: the whole folder.
    for report in (zero, one):
        found = report["found_after_save"]
        assert found["files"] == files
        assert found["config"] == json.loads((saved / "config.json").read_text())
        assert found["tensors"].keys() == by_two.keys()
        for name, (dtype, shape, data) in found["tensors"].items():
            assert (dtype, tuple(shape), bytes.fromhex(data)) == ("float32", by_two[name].shape, by_two[name].tobytes())


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The 2 x 2 job on the Llama under FSDP over 4 devices and the GPT-2 under tensor
    parallelism with `model=2` across the processes."""
    directory = tmp_path_factory.mktemp("hf_two_processes")
    written = checkpoints(directory)
    run_cases(directory, "llama", "gpt2")
    return directory, written


@pytest.mark.slow
def test_each_process_reads_only_what_its_devices_hold(job):
    directory, written = job
    # The Llama under fsdp=4: every tensor cut in 4 blocks, 2 on each process's devices.
    tensors = written["llama"][0]
    total = sum(t.nbytes for t in tensors.values())
    for report in reports(directory, "llama"):
        assert report["whole_reads"] == []  # nothing read whole through get_tensor
        blocks = {}
        for name, nbytes, of in report["reads"]:
            blocks.setdefault(name, []).append((nbytes, of))
        assert blocks == {name: [(t.nbytes // 4, t.nbytes)] * 2 for name, t in tensors.items()}
        assert sum(n for _, n, _ in report["reads"]) == total // 2  # 51,520 of 103,040 bytes

    # The GPT-2 under model=2 across the processes (data=2 within each): the Megatron-split
    # weights (c_attn's query, key and value columns, c_fc's units, both c_proj's inputs) are
    # read half by each process; norms, positions and c_proj's output biases whole by each.
    # The vocabulary, padded from 50 to 128, is cut at row 64: process 0 holds every real row
    # of wte and lm_head, process 1 only padding, which is not read.
    tensors = written["gpt2"][0]
    split = ("attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_fc.bias")
    split += ("mlp.c_proj.weight",)
    assert GPT2_SHAPE["vocab_size"] <= 64
    for rank, report in enumerate(reports(directory, "gpt2")):
        assert report["whole_reads"] == []
        per_tensor = {}
        for name, nbytes, _ in report["reads"]:
            per_tensor[name] = per_tensor.get(name, 0) + nbytes
        want = {}
        for name, t in tensors.items():
            if name in ("transformer.wte.weight", "lm_head.weight"):
                want[name] = t.nbytes if rank == 0 else 0
            else:
                want[name] = t.nbytes // 2 if name.endswith(split) else t.nbytes
        assert {k: v for k, v in per_tensor.items() if v} == {k: v for k, v in want.items() if v}, rank


@pytest.mark.slow
def test_logits_equal_the_numpy_forwards(job):
    directory, written = job
    tensors, config = written["llama"]
    check_logits(directory, "llama", reference_logits(tensors, config, TOKENS, LLAMA3))
    tensors, config = written["gpt2"]
    check_logits(directory, "gpt2", gpt2_reference_logits(tensors, config, TOKENS))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["llama", "gpt2"])
def test_save_from_two_processes_equals_a_one_process_save(job, tmp_path, case):
    directory, written = job
    check_saved(directory, tmp_path, case, written[CASES[case][0]][0])


@pytest.mark.slow
@pytest.mark.thorough
def test_tensor_parallel_llama_saved_in_shards_from_two_processes(tmp_path):
    """data=2 across the processes, model=2 within: each process holds a whole copy and reads
    the whole checkpoint once; the save is cut into several shard files with their index."""
    directory = tmp_path / "job"
    directory.mkdir()
    written = checkpoints(directory)
    run_cases(directory, "llama_data_model")
    tensors, config = written["llama"]
    for report in reports(directory, "llama_data_model"):
        assert sum(n for _, n, _ in report["reads"]) == sum(t.nbytes for t in tensors.values())
    check_logits(directory, "llama_data_model", reference_logits(tensors, config, TOKENS, LLAMA3))
    files = os.listdir(directory / "llama_data_model_saved_by_two")
    assert "model.safetensors.index.json" in files and sum(f.startswith("model-") for f in files) > 1
    check_saved(directory, tmp_path, "llama_data_model", tensors)
