"""New tokenizers, trained on the user's text and saved next to their run: a byte-level BPE
(`train_bpe`) or a character vocabulary (`char_tokenizer`)."""

from __future__ import annotations

import json
import os
import pathlib
import secrets
from collections.abc import Iterable

import numpy as np

from ..._optional import require
from ._tokenizer import CHAR_FORMAT, EOS_CANDIDATES, Tokenizer, load_tokenizer

__all__ = ["train_bpe", "char_tokenizer"]


def _write_new(path: pathlib.Path, data: bytes) -> None:
    """Write `data` to the new file `path` at once (a temporary sibling, then `os.replace`)."""
    if path.exists():
        raise ValueError(f"{path} already exists; load it with load_tokenizer, or pick another path")
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        with open(temp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)


def train_bpe(texts: Iterable[str], vocab_size: int, path: str | os.PathLike, *, eos_token: str = "<|endoftext|>"):
    """Train a byte-level BPE tokenizer (GPT-2's kind) on `texts` and save it as a `tokenizer.json`.

    Every byte has an id, so any text encodes; `eos_token` is the one special token. The same
    texts give the same file, byte for byte. Seconds for a few hundred thousand characters.

    ```python
    tokenizer = eqxpar.data.text.train_bpe(eqxpar.data.text.read_documents("corpus.jsonl"), 4096, "tok.json")
    ```

    **Arguments:**

    - `texts`: the training documents (an iterable of strings, read once).
    - `vocab_size`: the number of ids wanted, at least 257 (256 bytes and `eos_token`); a small
      corpus may give fewer.
    - `path`: the file to write; it must not exist. Its folder is made if needed.
    - `eos_token`: the end-of-document token. A name other than the default needs
      `load_tokenizer(path, eos_token=...)` when loaded again.

    **Returns:**

    The trained [`eqxpar.data.text.Tokenizer`][], loaded from `path`.

    **Raises:**

    - `ValueError`: `path` exists; `vocab_size` is not an integer >= 257; `texts` is a single string.
    """
    path = pathlib.Path(path)
    if isinstance(texts, str | bytes):
        raise ValueError("train_bpe: texts is a single string; pass a list (or iterable) of documents")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int | np.integer) or vocab_size < 257:
        raise ValueError(f"train_bpe: vocab_size must be an integer >= 257 (256 bytes + eos_token), got {vocab_size!r}")
    if path.exists():
        raise ValueError(f"{path} already exists; load it with load_tokenizer, or pick another path")
    tk = require("tokenizers", package="tokenizers", extra="text", purpose="train_bpe")
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=int(vocab_size),
        special_tokens=[eos_token],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    _write_new(path, tokenizer.to_str().encode("utf-8"))
    return load_tokenizer(path, eos_token=None if eos_token in EOS_CANDIDATES else eos_token)


def char_tokenizer(text: str, path: str | os.PathLike) -> Tokenizer:
    """A character-level tokenizer over the characters of `text`, saved as a small JSON file.

    The ids are the characters of `text` in code-point order, then the end-of-document
    character (`"\\x03"`, or the first private-use character from U+E000 that `text` does not
    hold). The file is `{"eqxpar_char_tokenizer": 1, "vocab": "<the characters, EOS last>"}`.

    **Arguments:**

    - `text`: text holding every character the tokenizer must know (e.g. the whole corpus).
    - `path`: the file to write; it must not exist.

    **Returns:**

    The [`eqxpar.data.text.Tokenizer`][], loaded from `path`; its `encode` raises `ValueError`
    on a character outside the vocabulary.

    **Raises:**

    - `ValueError`: `text` is empty or not a string; `path` exists; `text` holds every candidate
      end-of-document character.
    """
    if not isinstance(text, str) or not text:
        raise ValueError(f"char_tokenizer: text must be a non-empty string, got {type(text).__name__} {text!r:.40}")
    present = set(text)
    chars = sorted(present)
    eos = next((c for c in ("\x03", *map(chr, range(0xE000, 0xF900))) if c not in present), None)
    if eos is None:
        raise ValueError("char_tokenizer: text holds \\x03 and every private-use character; no end-of-document is left")
    data = json.dumps({CHAR_FORMAT: 1, "vocab": "".join(chars) + eos}).encode("ascii")
    _write_new(pathlib.Path(path), data)
    return load_tokenizer(path)
