"""Tokenizers: one `Tokenizer` over a Hugging Face `tokenizer.json`, a SentencePiece `.model`
or a character vocabulary, loaded from a path (`load_tokenizer`; `_train.py` makes new ones)."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ..._optional import require

__all__ = ["Tokenizer", "load_tokenizer", "EOS_CANDIDATES", "CHAR_FORMAT"]

# The end-of-document tokens looked for, in this order, in a tokenizer.json without a
# tokenizer_config.json naming one (GPT-2 and most byte-level BPEs, Llama 2 and T5,
# Gemma, Llama 3, BERT).
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
CHAR_FORMAT = "eqxpar_char_tokenizer"


def _tokenizers():
    return require("tokenizers", package="tokenizers", extra="text", purpose="Hugging Face tokenizers")


def _sentencepiece():
    return require("sentencepiece", package="sentencepiece", extra="text", purpose="SentencePiece tokenizers")


class Tokenizer:
    """A tokenizer: text to token ids and back, with the end-of-document (and optional
    beginning-of-document) ids a language model's training stream needs.

    Made by [`eqxpar.data.text.load_tokenizer`][], [`eqxpar.data.text.train_bpe`][] or
    [`eqxpar.data.text.char_tokenizer`][], never directly. It pickles as its path (and the
    overrides it was loaded with): a worker process that unpickles it loads the file again, and
    refuses a file that changed since.

    **Attributes:**

    - `vocab_size`: every id is in `[0, vocab_size)`.
    - `eos_id`: the end-of-document id, appended to every document.
    - `bos_id`: the beginning-of-document id put before every document, or `None`.
    - `fingerprint`: the sha256 (hex) of the tokenizer's file: the `tokenizer.json`, the
      SentencePiece model or the char tokenizer's JSON.
    - `kind`: `"huggingface"`, `"sentencepiece"` or `"char"`.
    - `source`: the path it was loaded from (absolute).
    """

    def __init__(
        self,
        *,
        backend: Any,
        kind: str,
        source: str,
        vocab_size: int,
        eos_id: int,
        bos_id: int | None,
        fingerprint: str,
        overrides: tuple[str | None, str | None] = (None, None),
    ):
        self._backend = backend
        self.kind = kind
        self.source = source
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.bos_id = bos_id
        self.fingerprint = fingerprint
        self._overrides = overrides

    def __repr__(self) -> str:
        return (
            f"Tokenizer(kind={self.kind!r}, source={self.source!r}, vocab_size={self.vocab_size}, "
            f"eos_id={self.eos_id}, bos_id={self.bos_id})"
        )

    def __reduce__(self):
        return (_reload, (self.source, *self._overrides, self.fingerprint))

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, with no special tokens added.

        **Raises:**

        - `ValueError`: a char tokenizer meets a character outside its vocabulary.
        """
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`[encode(t) for t in texts]`, in one call to the backend (Hugging Face's
        `encode_batch_fast` and SentencePiece's list encode run on several threads)."""
        texts = list(texts)
        if self.kind == "huggingface":
            encode = getattr(self._backend, "encode_batch_fast", self._backend.encode_batch)
            return [e.ids for e in encode(texts, add_special_tokens=False)]
        if self.kind == "sentencepiece":
            return self._backend.encode(texts, out_type=int)
        return [self._backend.encode(text) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`, by the backend's own decode (Hugging Face and char keep special
        tokens; SentencePiece drops its control tokens, BOS and EOS among them)."""
        ids = [int(i) for i in ids]
        if self.kind == "huggingface":
            return self._backend.decode(ids, skip_special_tokens=False)
        return self._backend.decode(ids)

    def save(self, folder: str | os.PathLike) -> list[str]:
        """Write the tokenizer into `folder` as a checkpoint folder holds it, so that
        [`eqxpar.data.text.load_tokenizer`][] (and Hugging Face) read it from there:
        `tokenizer.json` (Hugging Face), `tokenizer.model` (SentencePiece) or the char
        tokenizer's JSON as `tokenizer.json`, plus the `tokenizer_config.json` beside a
        tokenizer loaded from a checkpoint folder.

        **Returns:**

        The names of the files written.

        **Raises:**

        - `ValueError` if `folder` already holds one of them (nothing is overwritten).
        """
        source = pathlib.Path(self.source)
        name = "tokenizer.model" if self.kind == "sentencepiece" else "tokenizer.json"
        files = {name: source / name if source.is_dir() else source}
        if source.is_dir() and (source / "tokenizer_config.json").is_file():
            files["tokenizer_config.json"] = source / "tokenizer_config.json"
        folder = pathlib.Path(folder)
        held = sorted(n for n in files if (folder / n).exists())
        if held:
            raise ValueError(f"Tokenizer.save: {folder} already holds {held}; give a folder without them.")
        folder.mkdir(parents=True, exist_ok=True)
        for target, origin in files.items():
            (folder / target).write_bytes(origin.read_bytes())
        return sorted(files)

    def document(self, text: str) -> list[int]:
        """`[bos_id]` (if `bos_id` is not `None`) + `encode(text)` + `[eos_id]`: a document as
        it goes into the training stream."""
        return self.document_batch([text])[0]

    def document_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`[document(t) for t in texts]`, with one `encode_batch` call."""
        head = [] if self.bos_id is None else [self.bos_id]
        return [head + ids + [self.eos_id] for ids in self.encode_batch(texts)]


class _Chars:
    """The char backend: one id per character, the end-of-document character last."""

    def __init__(self, vocab: str, source: str):
        self.vocab = vocab
        self.source = source
        # Sorted code points of the characters a text may hold (the EOS character excluded).
        self.codes = np.array([ord(c) for c in vocab[:-1]], dtype=np.uint32)
        self.ids = np.argsort(self.codes, kind="stable").astype(np.int64)
        self.codes = self.codes[self.ids]

    def encode(self, text: str) -> list[int]:
        codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
        at = np.minimum(np.searchsorted(self.codes, codes), max(self.codes.size - 1, 0))
        known = self.codes[at] == codes if self.codes.size else np.zeros(codes.shape, bool)
        if known.all():
            return self.ids[at].tolist()
        where = np.flatnonzero(~known)
        c = chr(int(codes[where[0]]))
        raise ValueError(
            f"{self.source}: the char tokenizer has no id for the character {c!r} (U+{ord(c):04X}, at "
            f"character {int(where[0])} of the text); build it with char_tokenizer from text that holds it"
        )

    def token_to_id(self, token: str) -> int | None:
        return self.vocab.index(token) if len(token) == 1 and token in self.vocab else None

    def decode(self, ids: list[int]) -> str:
        return "".join(self.vocab[i] for i in ids)


def _reload(source: str, eos_token: str | None, bos_token: str | None, fingerprint: str) -> Tokenizer:
    tokenizer = load_tokenizer(source, eos_token=eos_token, bos_token=bos_token)
    if tokenizer.fingerprint != fingerprint:
        raise ValueError(f"{source}: the tokenizer file changed since it was loaded; load it again with load_tokenizer")
    return tokenizer


def _read_json(path: pathlib.Path, what: str) -> Any:
    try:
        return json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not a valid {what} ({error}); pass the original file") from error


def _token_name(value: Any) -> str | None:
    """A token as tokenizer_config.json writes it: a string, or an AddedToken's dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _lookup(backend: Any, token: str, path: pathlib.Path, role: str) -> int:
    token_id = backend.token_to_id(token)
    if token_id is None:
        raise ValueError(f"{path}: the {role} token {token!r} is not in the tokenizer's vocabulary; pass one it has")
    return int(token_id)


def _post_processor_bos(backend: Any) -> int | None:
    """The one id a Hugging Face tokenizer's post-processor puts before a text, if any (a
    Llama-style tokenizer.json adds `<s>` or `<|begin_of_text|>` this way)."""
    plain = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return full[0] if i == 1 else None
    return None


def _huggingface(path: pathlib.Path, data: bytes, config: pathlib.Path | None, eos: str | None, bos: str | None):
    tokenizers = _tokenizers()
    try:
        backend = tokenizers.Tokenizer.from_str(data.decode("utf-8"))
    except Exception as error:  # tokenizers raises a bare Exception on a bad file
        message = f"{path}: not a valid tokenizer.json ({error}); pass the file the tokenizer was saved as"
        raise ValueError(message) from error
    settings = _read_json(config, "tokenizer_config.json") if config is not None else {}
    if not isinstance(settings, dict):
        raise ValueError(f"{config}: not a valid tokenizer_config.json (not a JSON object); pass the original file")
    if eos is None:
        eos = _token_name(settings.get("eos_token"))
    if eos is not None:
        eos_id = _lookup(backend, eos, path, "end-of-document")
    else:
        found = [backend.token_to_id(t) for t in EOS_CANDIDATES if backend.token_to_id(t) is not None]
        if not found:
            raise ValueError(
                f"{path}: the tokenizer has no end-of-document token (none of {', '.join(EOS_CANDIDATES)}); "
                f"add one to it, or pass eos_token= naming the token that ends a document"
            )
        eos_id = int(found[0])
    if bos is not None:
        bos_id = _lookup(backend, bos, path, "beginning-of-document")
    elif "add_bos_token" in settings:
        name = _token_name(settings.get("bos_token"))
        if settings["add_bos_token"] and name is None:
            raise ValueError(f"{config}: add_bos_token is true but bos_token is not set; set it, or pass bos_token=")
        bos_id = _lookup(backend, name, path, "beginning-of-document") if settings["add_bos_token"] and name else None
    else:
        bos_id = _post_processor_bos(backend)
    ids = backend.get_vocab(with_added_tokens=True).values()
    vocab_size = max(backend.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)
    return backend, vocab_size, eos_id, bos_id


def _sentencepiece_model(path: pathlib.Path, data: bytes, eos: str | None, bos: str | None):
    backend = _sentencepiece().SentencePieceProcessor()
    try:
        backend.LoadFromSerializedProto(data)
    except Exception as error:  # RuntimeError from the C++ parser
        reason = str(error).strip() or type(error).__name__
        message = f"{path}: not a valid SentencePiece model ({reason}); pass the .model file it was saved as"
        raise ValueError(message) from error

    def lookup(token: str, role: str) -> int:
        token_id = backend.piece_to_id(token)
        if backend.id_to_piece(token_id) != token:
            raise ValueError(f"{path}: the {role} token {token!r} is not in the model's vocabulary; pass one it has")
        return int(token_id)

    eos_id = lookup(eos, "end-of-document") if eos is not None else backend.eos_id()
    if eos_id < 0:
        raise ValueError(
            f"{path}: the tokenizer has no end-of-document token (the model's eos_id is -1); train it with "
            f"eos_id >= 0, or pass eos_token= naming the piece that ends a document"
        )
    bos_id = lookup(bos, "beginning-of-document") if bos is not None else backend.bos_id()
    return backend, backend.get_piece_size(), eos_id, (bos_id if bos_id >= 0 else None)


def _char(path: pathlib.Path, record: dict, eos: str | None, bos: str | None):
    vocab = record.get("vocab")
    if record.get(CHAR_FORMAT) != 1 or not isinstance(vocab, str) or not vocab or len(set(vocab)) != len(vocab):
        raise ValueError(
            f"{path}: not a valid char tokenizer (needs {CHAR_FORMAT}: 1 and a non-empty 'vocab' of distinct "
            f"characters); save one with char_tokenizer"
        )
    backend = _Chars(vocab, str(path))
    eos_id = _lookup(backend, eos, path, "end-of-document") if eos is not None else len(vocab) - 1
    bos_id = _lookup(backend, bos, path, "beginning-of-document") if bos is not None else None
    return backend, len(vocab), eos_id, bos_id


def load_tokenizer(path: str | os.PathLike, *, eos_token: str | None = None, bos_token: str | None = None) -> Tokenizer:
    """Load a tokenizer from a file or a Hugging Face checkpoint folder.

    ```python
    tokenizer = eqxpar.data.text.load_tokenizer("gpt2/tokenizer.json")
    ids = tokenizer.document("Hello world")  # encode("Hello world") + [tokenizer.eos_id]
    ```

    What `path` may be:

    - a `tokenizer.json` (Hugging Face `tokenizers`). The end-of-document token is the first of
      `<|endoftext|>`, `</s>`, `<eos>`, `<|end_of_text|>`, `[SEP]` it has; the beginning-of-document
      token is the one its post-processor puts before a text (Llama-style tokenizers), if any.
    - a folder holding `tokenizer.json` (then its `tokenizer_config.json`, if present, names the
      `eos_token`, `bos_token` and `add_bos_token`), or `tokenizer.model`.
    - a SentencePiece `.model` file: the model's `eos_id()` and `bos_id()` (-1: none).
    - a char tokenizer saved by [`eqxpar.data.text.char_tokenizer`][].

    **Arguments:**

    - `path`: the file or folder.
    - `eos_token`: the token that ends a document, instead of the one found as above.
    - `bos_token`: the token put before every document, instead of the one found as above.

    **Returns:**

    A [`eqxpar.data.text.Tokenizer`][].

    **Raises:**

    - `ValueError`: `path` does not exist; a folder holds neither `tokenizer.json` nor
      `tokenizer.model`; the file does not parse (the message names it and the parser's error);
      the tokenizer has no end-of-document token; `eos_token` or `bos_token` is not in its vocabulary.
    """
    given = pathlib.Path(path)
    if not given.exists():
        raise ValueError(
            f"{given}: no such file or folder; pass a tokenizer.json, a SentencePiece .model, a folder "
            f"holding one of them, or a char tokenizer saved by char_tokenizer"
        )
    given = given.absolute()
    config = None
    file = given
    if given.is_dir():
        if (given / "tokenizer.json").is_file():
            file = given / "tokenizer.json"
            config = given / "tokenizer_config.json" if (given / "tokenizer_config.json").is_file() else None
        elif (given / "tokenizer.model").is_file():
            file = given / "tokenizer.model"
        else:
            raise ValueError(
                f"{given}: the folder holds no tokenizer (looked for tokenizer.json and tokenizer.model); "
                f"pass the folder or file the tokenizer was saved in"
            )
    data = file.read_bytes()
    if file.suffix == ".model":
        kind = "sentencepiece"
        backend, vocab_size, eos_id, bos_id = _sentencepiece_model(file, data, eos_token, bos_token)
    else:
        record = None
        if CHAR_FORMAT.encode() in data[:200]:  # the char format's first key: no tokenizer.json starts so
            record = _read_json(file, "char tokenizer")
        if isinstance(record, dict) and CHAR_FORMAT in record:
            kind = "char"
            backend, vocab_size, eos_id, bos_id = _char(file, record, eos_token, bos_token)
        else:
            kind = "huggingface"
            backend, vocab_size, eos_id, bos_id = _huggingface(file, data, config, eos_token, bos_token)
    return Tokenizer(
        backend=backend,
        kind=kind,
        source=str(given),
        vocab_size=int(vocab_size),
        eos_id=int(eos_id),
        bos_id=None if bos_id is None else int(bos_id),
        fingerprint=hashlib.sha256(data).hexdigest(),
        overrides=(eos_token, bos_token),
    )
