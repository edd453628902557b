"""Benchmark: building a token store (`eqxpar.data.text.build_token_store`) against the
tokenizer's own speed, its memory as the corpus grows, and random access into packed rows.

It writes a generated corpus (`.jsonl` files of Zipf-distributed words), trains a byte-level
BPE on its first 250k characters, and measures:

- **(a) throughput**: the build's tokens/s (reading and parsing the files, tokenizing, writing
  the store; `workers=None`, the default) over tokens/s of tokenizers' own batch encode of the
  same documents already in memory: `Tokenizer.encode_batch` and `encode_batch_fast` on every
  core, all documents in one call, and `encode_batch_fast` in calls of 1 MB of text (as the
  build calls it); ids taken out as lists. Baseline and build alternate `--repeats` times,
  each in its own child process; the figure is the median of the rounds' ratios to the
  fastest of the three. Target: >= 0.9.
- **(b) memory**: the peak RSS of a build of a corpus of `--rss-mb` MB and of 10 times that,
  each in a fresh child process, the two side by side (its own peak, and its worker processes'
  largest, from `resource.getrusage`). Target: the 10x build's peak / the 1x build's <= 1.2.
- **(c) random access**: the time to read a batch of `--batch` `PackedRows` rows (`seq_len`
  1024) at row 0 and at row `10**6 * batch` (mod the number of rows): medians of `--rounds`.

Builds and baselines run in child processes (`python benchmarks/text_store.py --role ...`)
so that none inherits another's memory or threads; (c) runs in this process. Run:
`python benchmarks/text_store.py`; `--quick` takes seconds (its figures mean nothing);
`--out text_store.json` keeps the figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve()


@functools.cache
def made_up_words(count: int = 50_000) -> np.ndarray:
    rng = np.random.default_rng(1234)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    return np.array(["".join(rng.choice(letters, n)) for n in rng.integers(1, 11, count)])


def write_corpus(folder: pathlib.Path, megabytes: float, files: int, seed: int = 0) -> list[str]:
    """`files` .jsonl files of about `megabytes` MB in all: documents of 20-2000 words drawn
    from a Zipf law over 50k made-up words."""
    rng = np.random.default_rng(seed)
    words = made_up_words()
    folder.mkdir(parents=True, exist_ok=True)
    target, paths = megabytes * 1e6 / files, []
    for k in range(files):
        path = folder / f"part-{k:03d}.jsonl"
        size = 0
        with open(path, "w") as f:
            while size < target:
                n = int(rng.integers(20, 2000))
                ids = np.minimum(rng.zipf(1.2, n), words.size) - 1
                line = json.dumps({"text": " ".join(words[ids]) + "."}) + "\n"
                f.write(line)
                size += len(line)
        paths.append(str(path))
    return paths


def launch(role: str, **kwargs) -> subprocess.Popen:
    """Start one measurement in a fresh Python process (`finish` reads its result)."""
    command = [sys.executable, str(HERE), "--role", role, "--args", json.dumps(kwargs)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen) -> dict:
    """The child's result: its last line of output, as JSON."""
    out, err = process.communicate()
    if process.returncode != 0:
        raise SystemExit(f"benchmark child {process.args[3]} failed:\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def role_baseline(files: list[str], tokenizer: str) -> dict:
    """tokenizers' own batch encode of the documents, read beforehand (not timed): all in one
    call, and in calls of 1 MB of text (the chunks the store's build encodes)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    import tokenizers  # the child's only library: no eqxpar, no JAX

    docs = [json.loads(line)["text"] for file in files for line in open(file)]
    chunks, size = [[]], 0
    for doc in docs:
        chunks[-1].append(doc)
        size += len(doc)
        if size >= 1 << 20:
            chunks.append([])
            size = 0
    tok = tokenizers.Tokenizer.from_file(tokenizer)
    result = {}
    for name, method, batches in (
        ("encode_batch", "encode_batch", [docs]),
        ("encode_batch_fast", "encode_batch_fast", [docs]),
        ("encode_batch_fast_1mb_chunks", "encode_batch_fast", chunks),
    ):
        start = time.perf_counter()
        ids = [e.ids for batch in batches for e in getattr(tok, method)(batch, add_special_tokens=False)]
        seconds = time.perf_counter() - start
        n = sum(map(len, ids)) + len(docs)  # + the EOS per document the store holds
        result[name] = dict(seconds=seconds, tokens=n, tokens_per_s=n / seconds)
    return result


def role_build(files: list[str], tokenizer: str, store: str, workers: int | None) -> dict:
    import eqxpar.data.text as text

    tok = text.load_tokenizer(tokenizer)
    start = time.perf_counter()
    built = text.build_token_store(files, tok, store, workers=workers, progress=False)
    seconds = time.perf_counter() - start
    return dict(
        seconds=seconds,
        tokens=built.num_tokens,
        tokens_per_s=built.num_tokens / seconds,
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        workers_peak_rss_mb=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    )


def access(store: str, batch: int, rounds: int) -> dict:
    import eqxpar.data.text as text

    rows = text.PackedRows(text.open_token_store(store), seq_len=1024)
    far = (10**6 * batch) % len(rows)
    result = dict(rows=len(rows), far_row=far)
    for name, first in (("step_0", 0), ("far", far)):
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            for i in range(first, first + batch):
                rows[i % len(rows)]
            times.append(time.perf_counter() - start)
        result[f"{name}_median_s"] = statistics.median(times)
    result["far_over_step_0"] = result["far_median_s"] / result["step_0_median_s"]
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: seconds, for the smoke test")
    parser.add_argument("--mb", type=float, default=32, help="corpus size for (a) and (c), MB")
    parser.add_argument("--rss-mb", type=float, default=8, help="the smaller corpus of (b), MB (the other is 10x)")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--workers", type=int, default=None, help="build_token_store's workers (default: its own)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=21, help="(c)'s timed rounds")
    parser.add_argument("--repeats", type=int, default=3, help="(a)'s alternating baseline/build rounds")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument("--args", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role:
        roles = dict(baseline=role_baseline, build=role_build)
        print(json.dumps(roles[args.role](**json.loads(args.args))))
        return {}
    if args.quick:
        args.mb, args.rss_mb, args.vocab, args.rounds, args.repeats = 0.5, 0.1, 512, 5, 1
    import eqxpar.data.text as text

    with tempfile.TemporaryDirectory(prefix="eqxpar-text-bench-") as tmp:
        root = pathlib.Path(tmp)
        files = write_corpus(root / "corpus", args.mb, files=8)
        sample, size = [], 0
        for line in open(files[0]):
            sample.append(json.loads(line)["text"])
            size += len(sample[-1])
            if size > 250_000:
                break
        tokenizer = str(root / "tokenizer.json")
        start = time.perf_counter()
        text.train_bpe(sample, args.vocab, tokenizer)
        train_s = time.perf_counter() - start
        # (a) one at a time (the timings must not share the cores), alternating, `--repeats` times:
        # the ratio of each round, then their median, so that load that comes and goes on the
        # machine moves both sides of a round alike
        rounds = []
        for _ in range(args.repeats):
            baseline = finish(launch("baseline", files=files, tokenizer=tokenizer))
            shutil.rmtree(root / "store", ignore_errors=True)
            store = str(root / "store")
            build = finish(launch("build", files=files, tokenizer=tokenizer, store=store, workers=args.workers))
            fastest = max(b["tokens_per_s"] for b in baseline.values())
            rounds.append(
                dict(
                    build=build,
                    tokenizers=baseline,
                    ratio_to_fastest=build["tokens_per_s"] / fastest,
                    ratio_to_encode_batch=build["tokens_per_s"] / baseline["encode_batch"]["tokens_per_s"],
                )
            )
        middle = sorted(rounds, key=lambda r: r["ratio_to_fastest"])[len(rounds) // 2]
        throughput = dict(
            corpus_mb=args.mb,
            ratio_to_fastest=statistics.median(r["ratio_to_fastest"] for r in rounds),
            ratio_to_encode_batch=statistics.median(r["ratio_to_encode_batch"] for r in rounds),
            build=middle["build"],  # the median round's figures
            tokenizers=middle["tokenizers"],
            rounds=rounds,
        )
        build, baseline = middle["build"], middle["tokenizers"]
        # (b) side by side: each child's peak memory is its own
        runs = {}
        for scale in (1, 10):
            corpus = write_corpus(root / f"rss{scale}", args.rss_mb * scale, files=8, seed=scale)
            store = str(root / f"store{scale}")
            runs[scale] = launch("build", files=corpus, tokenizer=tokenizer, store=store, workers=args.workers)
        memory = {f"{k}x": dict(corpus_mb=args.rss_mb * k, **finish(p)) for k, p in runs.items()}
        peak = {k: max(v["peak_rss_mb"], v["workers_peak_rss_mb"]) for k, v in memory.items()}
        memory["ratio_10x_over_1x"] = peak["10x"] / peak["1x"]
        rows = access(str(root / "store"), args.batch, args.rounds)
    results = dict(
        config=dict(vars(args), role=None, args=None, cpus=os.cpu_count(), python=platform.python_version()),
        tokenizer_train_s=train_s,
        throughput=throughput,
        memory=memory,
        access=rows,
    )
    print(
        f"(a) build {build['tokens_per_s']:,.0f} tok/s; tokenizers' encode_batch_fast "
        f"{baseline['encode_batch_fast']['tokens_per_s']:,.0f}, "
        f"encode_batch {baseline['encode_batch']['tokens_per_s']:,.0f}; "
        f"ratio to the fastest {throughput['ratio_to_fastest']:.3f} (target >= 0.9; median of {args.repeats} rounds: "
        f"{', '.join(format(r['ratio_to_fastest'], '.3f') for r in rounds)})"
    )
    print(
        f"(b) peak RSS {peak['1x']:.0f} MB at {args.rss_mb:g} MB of corpus, {peak['10x']:.0f} MB at "
        f"{10 * args.rss_mb:g} MB: ratio {memory['ratio_10x_over_1x']:.3f} (target <= 1.2)"
    )
    print(
        f"(c) a batch of {args.batch} rows: {rows['step_0_median_s'] * 1e3:.3f} ms at row 0, "
        f"{rows['far_median_s'] * 1e3:.3f} ms at row {rows['far_row']} of {rows['rows']}"
    )
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
