"""Building a token store: tokenize a corpus once (in worker processes), write it to disk
atomically, and reuse it while its corpus and tokenizer stay the same."""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.process
import functools
import importlib.metadata
import itertools
import json
import math
import multiprocessing
import os
import pathlib
import pickle
import secrets
import shutil
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
from tqdm.auto import tqdm

from ._corpus import corpus_files, read_documents
from ._store import (
    BYTES,
    FORMAT,
    MANIFEST,
    STARTS,
    TOKENS,
    VERSION,
    TokenStore,
    differences,
    file_records,
    open_token_store,
    token_dtype,
    tokenizer_record,
)
from ._tokenizer import Tokenizer

__all__ = ["build_token_store"]

# Text per task (a thread's or a worker's): large enough that a task's overhead (a call, a
# pickle, a round trip) is small next to tokenizing it, small enough that the tasks in flight
# stay small: Hugging Face holds ~100 bytes a token of a batch's encodings until the ids are
# out. On a 64 MB corpus (2 CPUs) 2 MB chunks were no faster and peaked at 514 MB, 1 MB at 371 MB.
CHUNK_CHARS = 1 << 20
# Up to this many CPUs, `workers=None` tokenizes in this process with the backend's own threads:
# on 2 CPUs that built a 64 MB corpus in 6.9 s, and 2 worker processes in 8.7 s (each starts a
# Python that imports eqxpar and JAX, ~1.5 s, and encodes on one thread). This process turns
# the backend's ids into arrays holding the GIL, ~0.05 us a token, which caps it near 20M
# tokens/s, about 8 cores of Hugging Face BPE: past that, worker processes (not measured here).
THREADED_CPUS = 8
MARKER = ".eqxpar-building"  # in every folder a build writes before it is renamed into place

_tokenizer: Tokenizer | None = None  # a worker process's tokenizer, loaded once


def _watch_parent(parent: int) -> None:
    """Ends a worker whose parent died (SIGKILL leaves no one to shut the pool down)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _start_worker(tokenizer: Tokenizer, parent: int, parallelism: str) -> None:
    global _tokenizer
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops the pool
    os.environ["TOKENIZERS_PARALLELISM"] = parallelism
    _tokenizer = tokenizer
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()


class _Hasher(threading.Thread):
    """Hashes the corpus files while they are tokenized (hashlib releases the GIL). A daemon
    that stops between files when told: a failed build does not wait for it."""

    def __init__(self, files: Sequence[pathlib.Path]):
        super().__init__(daemon=True)
        self.files = files
        self.stop = threading.Event()
        self.records: list[dict] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for file in self.files:
                if self.stop.is_set():
                    return
                self.records += file_records([file])
        except BaseException as error:  # raised in the building thread, by result()
            self.error = error

    def result(self) -> list[dict]:
        self.join()
        if self.error is not None:
            raise self.error
        return self.records


def _encode(tokenizer: Tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A chunk of documents as (their tokens concatenated, each one's token count, each one's
    UTF-8 bytes)."""
    docs = tokenizer.document_batch(texts)
    lengths = np.fromiter(map(len, docs), np.int64, len(docs))
    tokens = np.fromiter(itertools.chain.from_iterable(docs), token_dtype(tokenizer.vocab_size), int(lengths.sum()))
    sizes = np.fromiter((len(t) if t.isascii() else len(t.encode("utf-8")) for t in texts), np.int64, len(texts))
    return tokens, lengths, sizes


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    assert _tokenizer is not None, "the pool's initializer loads the tokenizer"
    return _encode(_tokenizer, texts)


def _chunks(files: Sequence[pathlib.Path], field: str) -> Iterator[list[str]]:
    chunk, size = [], 0
    for file in files:
        for text in read_documents(file, field):
            chunk.append(text)
            size += len(text)
            if size >= CHUNK_CHARS:
                yield chunk
                chunk, size = [], 0
    if chunk:
        yield chunk


def _in_order(pool: concurrent.futures.Executor, encode, chunks: Iterable[list[str]], depth: int):
    """`encode(chunk)` of each chunk, run by `pool`, in order, with at most `depth` chunks in flight."""
    pending: deque[concurrent.futures.Future] = deque()
    for chunk in chunks:
        pending.append(pool.submit(encode, chunk))
        if len(pending) >= depth:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _write_npy(path: pathlib.Path, raw: pathlib.Path, length: int, first: np.ndarray | None = None) -> None:
    """`path` as an int64 .npy of `length` entries: `first` (if any), then the raw file `raw`."""
    with open(path, "wb") as out:
        np.lib.format.write_array_header_1_0(out, {"descr": "<i8", "fortran_order": False, "shape": (length,)})
        if first is not None:
            out.write(first.astype("<i8").tobytes())
        with open(raw, "rb") as source:
            shutil.copyfileobj(source, out, 1 << 20)
        out.flush()
        os.fsync(out.fileno())
    raw.unlink()


def _fsync(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(folder: pathlib.Path, files, tokenizer: Tokenizer, field: str, workers: int, progress: bool) -> None:
    """Tokenize `files` into the (new, empty) `folder`, the manifest last."""
    hasher = _Hasher(files)
    hasher.start()
    pool: concurrent.futures.Executor | None = None
    ends_raw, sizes_raw = folder / "documents.raw", folder / "document_bytes.raw"
    n_docs = n_tokens = n_bytes = 0
    try:
        chunks = _chunks(files, field)
        if workers > 1:
            pickle.loads(pickle.dumps(tokenizer))  # what each worker does: refuses a tokenizer file changed since
            parallelism = "false" if tokenizer.kind == "huggingface" else "true"
            pool = concurrent.futures.ProcessPoolExecutor(
                workers,
                mp_context=multiprocessing.get_context("spawn"),  # no fork: the parent may run JAX's threads
                initializer=_start_worker,
                initargs=(tokenizer, os.getpid(), parallelism),
            )
            results = _in_order(pool, _encode_in_worker, chunks, 2 * workers)
        else:
            # Two threads: the backend encodes one chunk on all cores without the GIL (Hugging
            # Face and SentencePiece both release it) while the other chunk's ids become arrays.
            pool = concurrent.futures.ThreadPoolExecutor(2)
            results = _in_order(pool, functools.partial(_encode, tokenizer), chunks, 3)
        bar = tqdm(
            unit="tok", unit_scale=True, file=sys.stderr, disable=not progress, desc=f"tokenizing {len(files)} files"
        )
        with open(folder / TOKENS, "wb") as out, open(ends_raw, "wb") as ends, open(sizes_raw, "wb") as sizes, bar:
            for tokens, lengths, nbytes in results:
                out.write(tokens.tobytes())
                ends.write((n_tokens + np.cumsum(lengths)).astype("<i8").tobytes())
                sizes.write(nbytes.astype("<i8").tobytes())
                n_docs, n_tokens, n_bytes = n_docs + lengths.size, n_tokens + tokens.size, n_bytes + int(nbytes.sum())
                bar.update(tokens.size)
            out.flush()
            os.fsync(out.fileno())
    except concurrent.futures.process.BrokenProcessPool as error:
        raise ValueError(
            f"a worker process of build_token_store died ({error}); in a script, call it under "
            f'`if __name__ == "__main__":` (workers start with spawn, which runs the main module again), '
            f"or pass workers=0"
        ) from error
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        hasher.stop.set()
    if n_docs == 0:
        raise ValueError(f"the corpus holds no documents ({', '.join(map(str, files))}); pass files that hold text")
    _write_npy(folder / STARTS, ends_raw, n_docs + 1, first=np.zeros(1, np.int64))
    _write_npy(folder / BYTES, sizes_raw, n_docs)
    found = hasher.result()
    for record, file in zip(found, files):
        stat = file.stat()
        if (stat.st_size, stat.st_mtime_ns) != (record["size"], record["mtime_ns"]):
            raise ValueError(f"{file}: the file changed while it was being tokenized; build again once it is stable")
    try:
        version = importlib.metadata.version("eqxpar")
    except importlib.metadata.PackageNotFoundError:
        version = None
    manifest = dict(
        format=FORMAT,
        version=VERSION,
        dtype=token_dtype(tokenizer.vocab_size).str,
        tokenizer=tokenizer_record(tokenizer),
        field=field,
        files=found,
        num_documents=n_docs,
        num_tokens=n_tokens,
        num_bytes=n_bytes,
        eqxpar_version=version,
    )
    with open(folder / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync(folder)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _remove_dead_builds(store_dir: pathlib.Path) -> None:
    """Remove the folders that builds of `store_dir` on this machine left when killed: only
    those that carry our marker and whose process is gone."""
    for folder in store_dir.parent.glob(f".{store_dir.name}.building-*"):
        try:
            marker = json.loads((folder / MARKER).read_text())
            pid, host = int(marker["pid"]), marker["host"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not ours, or not readable: never touched
        if host == socket.gethostname() and not _alive(pid):
            shutil.rmtree(folder, ignore_errors=True)


def _check(store: TokenStore, tokenizer: Tokenizer, field: str, files: Sequence[pathlib.Path]) -> TokenStore:
    found = differences(store.manifest, tokenizer, field, files)
    if found:
        raise ValueError(
            f"{store.path}: holds a token store that does not match: {'; '.join(found)}; use another store "
            f"folder (--store-dir), or delete {store.path} yourself to rebuild it"
        )
    return store


def _wait(store_dir: pathlib.Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not (store_dir / MANIFEST).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{store_dir}: no token store after {timeout_s:g} s: the builder process (process 0, builder=True) "
                f"did not finish it; check its output, or give it longer (timeout_s)"
            )
        time.sleep(0.2)


def build_token_store(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    tokenizer: Tokenizer,
    store_dir: str | os.PathLike,
    *,
    field: str = "text",
    workers: int | None = None,
    progress: bool = True,
    builder: bool = True,
    timeout_s: float = 600,
) -> TokenStore:
    """Tokenize a corpus into a token store once, or open the one already built from it.

    ```python
    tokenizer = eqxpar.data.text.load_tokenizer("tokenizer.json")
    store = eqxpar.data.text.build_token_store("corpus/", tokenizer, "store/")
    rows = eqxpar.data.text.PackedRows(store, seq_len=1024)
    ```

    The stream is every document's `tokenizer.document(text)` in corpus order (the format is in
    the docs of `eqxpar.data.text`). If `store_dir` already holds a store built from the same
    files (compared by size and sha256), tokenizer (fingerprint, EOS and BOS ids) and `field`, it
    is opened and returned. A store that differs is an error, and is never deleted or
    overwritten. A new store is written in a hidden sibling folder (`.NAME.building-PID-...`)
    and renamed to `store_dir` when complete, so a build that is interrupted (Ctrl-C, a kill)
    leaves no folder that a later call trusts; that call builds it again, and removes the
    folders that killed builds on this machine left.

    Documents are tokenized in chunks of about 1 MB of text, a few chunks in flight, and written
    in order: memory stays flat whatever the corpus size (but a `.txt` file is one document, held
    whole). With `workers` 0 or 1 this process tokenizes, on the backend's own threads (Hugging
    Face's Rust and SentencePiece's C++ both encode a batch on every core, releasing the GIL);
    with `workers` > 1, that many worker processes do, each on one thread, while this process
    reads the files. They start with "spawn" (no fork: the caller may run JAX's threads), which
    runs the main module again: a script that calls this needs `if __name__ == "__main__":`.

    **Arguments:**

    - `paths`: the corpus: files, folders or glob patterns ([`eqxpar.data.text.corpus_files`][]).
    - `tokenizer`: a [`eqxpar.data.text.Tokenizer`][].
    - `store_dir`: the store's folder: absent, empty, or holding this store.
    - `field`: the JSON field or Parquet column holding the text.
    - `workers`: worker processes; 0 or 1: tokenize in this process; `None`: in this process on
      machines of up to 8 CPUs (faster there), else one per CPU, at most one per MB of corpus.
    - `progress`: a progress bar (tokens/s) on stderr; a line when a store is reused.
    - `builder`: `False` in every process but one of a multi-process job: this process waits
      until the builder's store appears, then opens and checks it.
    - `timeout_s`: how long a process with `builder=False` waits.

    **Returns:**

    The [`eqxpar.data.text.TokenStore`][].

    **Raises:**

    - `ValueError`: a bad corpus (see `corpus_files` and `read_documents`); `store_dir` holds a
      store of another corpus, tokenizer or field (the message says which), or is a non-empty
      folder that is not a store; the corpus holds no documents; a file changed during the build.
    - `TimeoutError`: with `builder=False`, no store appeared within `timeout_s`.
    """
    if not isinstance(tokenizer, Tokenizer):
        raise ValueError(
            f"build_token_store: tokenizer must be a Tokenizer (load_tokenizer), got {type(tokenizer).__name__}"
        )
    if not isinstance(field, str) or not field:
        raise ValueError(f"build_token_store: field must be a non-empty string (the text's field), got {field!r}")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 0):
        raise ValueError(f"build_token_store: workers must be None or an integer >= 0, got {workers!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not timeout_s > 0:
        raise ValueError(f"build_token_store: timeout_s must be a number of seconds > 0, got {timeout_s!r}")
    store_dir = pathlib.Path(store_dir)
    files = corpus_files(paths)
    if not builder:
        _wait(store_dir, timeout_s)
        return _check(open_token_store(store_dir), tokenizer, field, files)
    if (store_dir / MANIFEST).exists():
        store = _check(open_token_store(store_dir), tokenizer, field, files)
        if progress:
            print(f"reusing the token store {store_dir} ({store.num_tokens} tokens)", file=sys.stderr)
        return store
    if store_dir.exists() and (not store_dir.is_dir() or any(store_dir.iterdir())):
        raise ValueError(
            f"{store_dir}: exists and is not a token store (no {MANIFEST}); pass a new or empty folder (--store-dir)"
        )
    if workers is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        chunks = math.ceil(sum(f.stat().st_size for f in files) / CHUNK_CHARS)
        workers = 0 if cpus <= THREADED_CPUS else min(cpus, chunks)
    store_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_builds(store_dir)
    folder = store_dir.parent / f".{store_dir.name}.building-{os.getpid()}-{secrets.token_hex(4)}"
    folder.mkdir()
    try:
        (folder / MARKER).write_text(json.dumps(dict(pid=os.getpid(), host=socket.gethostname())))
        _write(folder, files, tokenizer, field, workers, progress)
        try:
            os.rename(folder, store_dir)  # atomic: the store appears whole, or not at all
        except OSError:
            if not (store_dir / MANIFEST).exists():  # not another builder's store: a folder that appeared
                raise
            shutil.rmtree(folder)  # another builder finished first: use (and check) its store
        else:
            (store_dir / MARKER).unlink()
            _fsync(store_dir.parent)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return _check(open_token_store(store_dir), tokenizer, field, files)
