"""The language-model recipes on a user's corpus: `--data` (.jsonl, .parquet and .txt files)
and `--tokenizer tokenizer.json` (a byte-level BPE trained here), through the token store and
packed rows with document masks.

- On its default 8-device mesh each recipe gives the final and held-out loss of `--mesh` with
  every axis 1 (float32, relative 1e-5): hybrid (data x model), Llama (data x model) and
  long_context (data x context x model: rows shifted and laid out in zigzag order).
- A 2-process `eqxpar.launch` run of hybrid_gpt (process 0 builds the store, process 1 waits
  for it) ends with the parameters of the one-process run, bit for bit.
- Bad input stops the recipe with one line and exit status 2 before anything compiles.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _recipes import RECIPES, run_recipe

import eqxpar.data.text as text
from eqxpar.datasets import python_source_documents

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A user's corpus in three formats (the source of three standard-library modules, one
    document per top-level definition) and a BPE tokenizer trained on it."""
    root = tmp_path_factory.mktemp("corpus")
    docs = python_source_documents(("csv", "shlex", "json.decoder"))
    folder = root / "data"
    folder.mkdir()
    half = len(docs) // 2
    with open(folder / "a.jsonl", "w") as f:
        for d in docs[:half]:
            f.write(json.dumps({"body": d, "id": 1}) + "\n")
    pq.write_table(pa.table({"body": docs[half:-3]}), folder / "b.parquet")
    for i, d in enumerate(docs[-3:]):
        (folder / f"c{i}.txt").write_text(d)
    tokenizer = text.train_bpe(docs, 320, root / "tokenizer.json")
    env = {**os.environ, "EQXPAR_CACHE": str(root / "cache")}
    return {"data": str(folder), "tokenizer": tokenizer.source, "env": env, "root": root}


def user_flags(corpus):
    return ["--data", corpus["data"], "--data-field", "body", "--tokenizer", corpus["tokenizer"]]


SMALL = {
    "hybrid_gpt": (["--steps", "3", "--batch-size", "8", "--context", "32", "--sample-chars", "0"], "data=1,model=1"),
    "llama": (["--steps", "3", "--batch-size", "8", "--context", "32"], "data=1,model=1"),
    "long_context": (
        ["--steps", "2", "--batch-size", "2", "--seq-len", "64", "--dim", "16", "--heads", "2", "--layers", "1"],
        "data=1,context=1,model=1",
    ),
}


@pytest.mark.parametrize("recipe", sorted(SMALL))
def test_user_corpus_default_mesh_equals_one_device(recipe, corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("EQXPAR_CACHE", corpus["env"]["EQXPAR_CACHE"])
    flags, one_mesh = SMALL[recipe]
    default = run_recipe(recipe, tmp_path / "default", *flags, *user_flags(corpus))
    one = run_recipe(recipe, tmp_path / "one", *flags, *user_flags(corpus), "--mesh", one_mesh)
    assert default["vocab_size"] == 320 and default["document_mask"] is True
    np.testing.assert_allclose(default["final_loss"], one["final_loss"], rtol=1e-5)
    np.testing.assert_allclose(default["val_loss"], one["val_loss"], rtol=1e-5)
    assert 0 < default["val_bits_per_byte"] < 8 and default["val_perplexity"] > 1


def test_two_processes_equal_one(corpus, tmp_path):
    flags = [*SMALL["hybrid_gpt"][0], *user_flags(corpus)]
    env = {**corpus["env"], "EQXPAR_CACHE": str(tmp_path / "fresh-cache"), "JAX_PLATFORMS": "cpu"}
    two, one = tmp_path / "two.json", tmp_path / "one.json"
    launch = [sys.executable, "-m", "eqxpar.launch", "--nproc", "2", "--devices-per-proc", "4"]
    done = subprocess.run(
        [*launch, str(RECIPES / "hybrid_gpt.py"), *flags, "--metrics-out", str(two)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    done = subprocess.run(
        [sys.executable, str(RECIPES / "hybrid_gpt.py"), *flags, "--metrics-out", str(one)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = json.loads(two.read_text()), json.loads(one.read_text())
    assert a["param_digest"] == b["param_digest"] and a["final_loss"] == b["final_loss"]


BAD = [
    (["--data", "/nonexistent/corpus.jsonl"], "/nonexistent/corpus.jsonl: no such file or folder"),
    (["--data-field", "text"], "has no field 'text'"),
    (["--seq-len", "64"], "--seq-len 64 exceeds the model's context of 32"),
    (["--tokenizer", "/nonexistent/tokenizer.json"], "tokenizer"),
]


@pytest.mark.parametrize("extra, message", BAD, ids=["missing-data", "wrong-field", "seq-len", "missing-tokenizer"])
def test_bad_input_is_one_line_before_compiling(extra, message, corpus, tmp_path):
    flags = [*SMALL["hybrid_gpt"][0], *user_flags(corpus), *extra]
    done = subprocess.run(
        [sys.executable, str(RECIPES / "hybrid_gpt.py"), *flags],
        env={**corpus["env"], "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert message in last and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "collectives of one train step" not in done.stdout  # nothing compiled
