"""The language-model recipes' text: `--data`, `--tokenizer` and the rest, through one path.

corpus files -> tokenizer -> token store -> packed rows -> the global batch of `(seed, step)`
([`eqxpar.data.load_per_process`][]) -> the step. Without `--data` the recipes train on the
bundled Python-source corpus ([`eqxpar.datasets.python_source_documents`][]) through the same
path: it is written once as a `.jsonl` file in the cache, a byte-level BPE is trained on it
(cached), and its store is built like any user's.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import pathlib
import time
from typing import Any, TypeVar

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .. import data as eqdata
from .._sharding import shard
from ..data import text as eqtext
from ..datasets import python_source_documents
from ..models import next_token_batch
from ..nn import layout_order

__all__ = ["TextFlags", "check_text_flags", "TextData", "load_text"]

C = TypeVar("C", bound="TextFlags")

VAL_ROWS = 64  # held-out rows evaluated (all of them if fewer)


@dataclasses.dataclass
class TextFlags:
    """The flags of the language-model recipes' data: derive the recipe's `Config` from it
    and check them with [`eqxpar.recipe.check_text_flags`][]; [`eqxpar.recipe.load_text`][]
    then builds (or reuses) the store and serves the batches."""

    # The comments are the flags' --help text (eqxpar.recipe.parse_flags reads them).
    data: str | None = None  # files, folders or globs, comma-separated (.txt .jsonl(.gz) .parquet); default: bundled
    data_field: str = "text"  # the text field of .jsonl records and the column of .parquet files
    tokenizer: str | None = None  # tokenizer.json, a HF checkpoint folder or a .model; default: a BPE trained on --data
    val_data: str | None = None  # held-out corpus; default: the last --held-out share of --data's documents
    held_out: float = 0.05  # the share of --data's documents held out when there is no --val-data
    seq_len: int = 0  # tokens per training row (packed); 0: the model's context
    document_mask: bool = True  # attend within each packed document; off: plain causal attention over rows
    bpe_vocab_size: int = 512  # the vocabulary of the BPE trained when there is no --tokenizer
    store_dir: str | None = None  # the token store's folder; default: in the cache, named by tokenizer and files
    cache_dir: str | None = None  # stores and trained tokenizers; default: $EQXPAR_CACHE or ~/.cache/eqxpar


def _paths(flag: str | None) -> list[str]:
    return [p.strip() for p in (flag or "").split(",") if p.strip()]


def _cache(cfg: TextFlags) -> pathlib.Path:
    root = cfg.cache_dir or os.environ.get("EQXPAR_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "eqxpar")
    return pathlib.Path(root)


def check_text_flags(cfg: C, *, context: int) -> C:
    """Check the text flags before anything compiles; returns `cfg` with `seq_len` set.

    Reads no corpus but checks that every `--data`/`--val-data` path, folder or glob names
    corpus files and that `--tokenizer` loads.

    **Arguments:**

    - `cfg`: a config deriving from [`eqxpar.recipe.TextFlags`][].
    - `context`: the model's longest sequence (`--seq-len` may not exceed it).

    **Raises:**

    - `ValueError` naming the flag, the problem and the fix.
    """
    seq_len = cfg.seq_len or context
    if seq_len < 1:
        raise ValueError(f"--seq-len must be positive, got {cfg.seq_len}.")
    if seq_len > context:
        raise ValueError(
            f"--seq-len {seq_len} exceeds the model's context of {context} tokens: use --seq-len {context} or less, "
            f"or a model with a longer context."
        )
    if not 0 < cfg.held_out < 1:
        raise ValueError(f"--held-out must be a share in (0, 1), got {cfg.held_out}.")
    if cfg.bpe_vocab_size < 257:
        raise ValueError(
            f"--bpe-vocab-size must be at least 257 (the 256 bytes and an end token), got {cfg.bpe_vocab_size}."
        )
    for flag, value in (("--data", cfg.data), ("--val-data", cfg.val_data)):
        if value is not None:
            if not _paths(value):
                raise ValueError(f"{flag} names no file: give files, folders or globs, comma-separated.")
            eqtext.corpus_files(_paths(value))
    if cfg.val_data is not None and cfg.data is None:
        raise ValueError("--val-data needs --data: the bundled corpus holds out its own documents.")
    if cfg.tokenizer is not None:
        eqtext.load_tokenizer(cfg.tokenizer)
    return dataclasses.replace(cfg, seq_len=seq_len)


@dataclasses.dataclass(frozen=True, eq=False)
class TextData:
    """A recipe's text, ready to train on: the tokenizer, the packed training and held-out
    rows, and the batches of `(seed, step)` placed on a mesh."""

    tokenizer: Any
    train: Any  # eqxpar.data.text.PackedRows
    val: Any
    seq_len: int
    document_mask: bool
    val_bytes_per_token: float
    store_path: str

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def batch(
        self,
        step: int,
        mesh: Mesh,
        *,
        global_batch_size: int,
        seed: int,
        batch_axis: Any = "data",
        context_axis: str | None = None,
    ):
        """Global batch `step` (a pure function of `seed` and `step`) placed on `mesh`: the
        packed rows `{"tokens", "segment_ids", "positions"}` split over `batch_axis`, or with
        `--no-document-mask` the tokens alone; with `context_axis`, shifted into next-token
        inputs and targets and put in the zigzag order the context-parallel attention
        expects, split over `(batch_axis, context_axis)`."""
        rows = eqdata.load_per_process(
            self.train, step, global_batch_size=global_batch_size, mesh=mesh, batch_axis=batch_axis, seed=seed
        )
        return self._arrange(rows, mesh, batch_axis, context_axis)

    def val_batch(self, mesh: Mesh, *, context_axis: str | None = None):
        """The held-out rows evaluated (the first `VAL_ROWS`), whole on every device (split
        over `context_axis` when given), and `(counted targets, target positions)`."""
        n = min(len(self.val), VAL_ROWS)
        records = [self.val[i] for i in range(n)]
        rows = {k: np.stack([r[k] for r in records]) for k in ("tokens", "segment_ids", "positions")}
        shifted = next_token_batch(rows)
        counted = float(np.sum(shifted["loss_weights"])) if self.document_mask else float(shifted["targets"].size)
        placed = self._arrange(shard(rows, mesh, P()), mesh, None, context_axis)
        return placed, (counted, float(shifted["targets"].size))

    def _arrange(self, rows, mesh, batch_axis, context_axis):
        if context_axis is None:
            return rows if self.document_mask else rows["tokens"]
        return _context_layout(self.seq_len, self.document_mask, mesh, batch_axis, context_axis)(rows)

    def val_metrics(self, mean_loss: float, counts: tuple[float, float]) -> dict[str, float]:
        """`val_loss` (nats per counted target), `val_perplexity` and `val_bits_per_byte`
        (bits per UTF-8 byte of the held-out text: comparable across tokenizers) from the
        evaluated mean over target positions ([`eqxpar.recipe.held_out_loss`][])."""
        counted, positions = counts
        nats = mean_loss * positions
        loss = nats / max(counted, 1.0)
        return {
            "val_loss": loss,
            "val_perplexity": math.exp(min(loss, 700.0)),
            "val_bits_per_byte": nats / math.log(2) / (positions * self.val_bytes_per_token),
        }


@functools.lru_cache(maxsize=16)
def _context_layout(seq_len: int, document_mask: bool, mesh: Mesh, batch_axis: Any, context_axis: str):
    """The compiled shift into next-token inputs and targets, put in the zigzag order the
    context-parallel attention expects and split over `(batch_axis, context_axis)`: made
    once per layout, not once per batch (a fresh `jax.jit` would trace every step)."""
    order = np.asarray(layout_order(seq_len, mesh.shape[context_axis], "zigzag"))

    def shifted(rows):
        batch = next_token_batch(rows if document_mask else rows["tokens"])
        if not document_mask:
            return batch["inputs"][:, order], batch["targets"][:, order]
        return {k: v[:, order] for k, v in batch.items()}

    return jax.jit(shifted, out_shardings=NamedSharding(mesh, P(batch_axis, context_axis)))


def _digest(files: list[pathlib.Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        stat = f.stat()
        h.update(f"{f.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _wait_for(path: pathlib.Path, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{what}: {path} did not appear within {timeout_s:.0f} s; process 0 makes it, so look at its "
                f"output (the cache folder must be shared by every process of the job)."
            )
        time.sleep(0.2)


def _bundled_corpus(cache: pathlib.Path) -> pathlib.Path:
    """The bundled Python-source corpus as a `.jsonl` file in the cache (written once, atomically)."""
    path = cache / "corpus" / "python-source.jsonl"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for text in python_source_documents():
                f.write(json.dumps({"text": text}) + "\n")
        os.replace(tmp, path)
    return path


def load_text(cfg: TextFlags, *, progress: bool = True, timeout_s: float = 600.0) -> TextData:
    """The recipe's text from its checked flags ([`eqxpar.recipe.check_text_flags`][]): the
    tokenizer (`--tokenizer`, or a BPE trained on the corpus and cached), the token stores
    (built once, reused while the tokenizer and files match), and the packed rows.

    In a job of several processes, process 0 builds the store (and trains the tokenizer) and
    the others wait for it, up to `timeout_s` (then a `TimeoutError`).

    **Raises:**

    - `ValueError` for unreadable corpora or tokenizers, a store that does not match, or
      too little text for one row.
    """
    builder = jax.process_index() == 0
    cache = _cache(cfg)
    if cfg.data is None:
        files = [_bundled_corpus(cache)] if builder else [cache / "corpus" / "python-source.jsonl"]
        if not builder:
            _wait_for(files[0], timeout_s, "the bundled corpus")
    else:
        files = eqtext.corpus_files(_paths(cfg.data))
    if cfg.tokenizer is not None:
        tokenizer = eqtext.load_tokenizer(cfg.tokenizer)
    else:
        path = cache / "tokenizers" / f"bpe-{cfg.bpe_vocab_size}-{_digest(files)}.json"
        if builder and not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            texts = (doc for f in files for doc in eqtext.read_documents(f, cfg.data_field))
            try:
                eqtext.train_bpe(texts, cfg.bpe_vocab_size, path)
            except ValueError:
                if not path.exists():  # not a race with another run training the same file
                    raise
        _wait_for(path, timeout_s, "the trained tokenizer")
        tokenizer = eqtext.load_tokenizer(path)

    def store(files, name):
        field = hashlib.sha256(cfg.data_field.encode()).hexdigest()[:8]
        folder = cache / "stores" / f"{name}-{tokenizer.fingerprint[:12]}-{_digest(files)}-{field}"
        if name == "train" and cfg.store_dir is not None:
            folder = pathlib.Path(cfg.store_dir)
        return eqtext.build_token_store(
            files,
            tokenizer,
            folder,
            field=cfg.data_field,
            progress=progress and builder,
            builder=builder,
            timeout_s=timeout_s,
        )

    train = store(files, "train")
    if cfg.val_data is None:
        train, val = train.split(cfg.held_out)
    else:
        val = store(eqtext.corpus_files(_paths(cfg.val_data)), "val")
    seq_len = cfg.seq_len
    return TextData(
        tokenizer=tokenizer,
        train=eqtext.PackedRows(train, seq_len),
        val=eqtext.PackedRows(val, seq_len),
        seq_len=seq_len,
        document_mask=cfg.document_mask,
        val_bytes_per_token=val.num_bytes / max(val.num_tokens, 1),
        store_path=str(train.path),
    )
