"""Smoke test of benchmarks/text_store.py: `--quick` runs (in a subprocess, as a user runs
it) and writes every figure it promises. Its sizes are tiny: the figures are not checked."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_text_store_benchmark_quick(tmp_path):
    out = tmp_path / "text_store.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "text_store.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for line in ("(a) build", "(b) peak RSS", "(c) a batch of 32 rows"):
        assert line in done.stdout, done.stdout
    results = json.loads(out.read_text())
    assert set(results) == {"config", "tokenizer_train_s", "throughput", "memory", "access"}
    throughput = results["throughput"]
    assert set(throughput["tokenizers"]) == {"encode_batch", "encode_batch_fast", "encode_batch_fast_1mb_chunks"}
    assert throughput["ratio_to_fastest"] > 0 and throughput["build"]["tokens_per_s"] > 0
    # the build and every baseline tokenized the same corpus: the same number of tokens
    assert {b["tokens"] for b in throughput["tokenizers"].values()} == {throughput["build"]["tokens"]}
    memory = results["memory"]
    assert memory["10x"]["corpus_mb"] == 10 * memory["1x"]["corpus_mb"] and memory["ratio_10x_over_1x"] > 0
    assert memory["1x"]["peak_rss_mb"] > 0 and "workers_peak_rss_mb" in memory["10x"]
    access = results["access"]
    assert access["step_0_median_s"] > 0 and access["far_median_s"] > 0 and 0 <= access["far_row"] < access["rows"]
