"""The token store: a corpus tokenized once, kept on disk, read by memory map.

A store is a folder of four files, readable with NumPy alone:

- `tokens.bin`: the token stream, raw little-endian `uint16` if the tokenizer's
  `vocab_size <= 65536`, else `uint32` (the manifest's `dtype`: `"<u2"` or `"<u4"`). It is
  every document's `tokenizer.document(text)` (`[bos_id]` if any, its ids, `eos_id`),
  concatenated in corpus order ([`eqxpar.data.text.corpus_files`][]'s order of files, each
  file's documents in [`eqxpar.data.text.read_documents`][]'s order).
- `documents.npy`: `int64`, shape `(num_documents + 1,)`: where each document starts in
  `tokens.bin` (in tokens); the last entry is `num_tokens`.
- `document_bytes.npy`: `int64`, shape `(num_documents,)`: each document's text length in
  UTF-8 bytes (for bits per byte).
- `manifest.json`: `format` (`"eqxpar-token-store"`), `version` (1), `dtype`, `tokenizer`
  (`kind`, `fingerprint`, `vocab_size`, `eos_id`, `bos_id`, `source`), `field`, `files` (each
  file's `path`, `size`, `mtime_ns` and `sha256`, in order), `num_documents`, `num_tokens`,
  `num_bytes` and `eqxpar_version`.

```python
import json, numpy as np

manifest = json.load(open("store/manifest.json"))
tokens = np.memmap("store/tokens.bin", dtype=manifest["dtype"], mode="r")
starts = np.load("store/documents.npy")
third = tokens[starts[2] : starts[3]]  # the third document, EOS last
```

A folder is a store once `manifest.json` is in it: [`eqxpar.data.text.build_token_store`][]
writes the store in a hidden sibling folder and renames it into place whole, so an
interrupted build never leaves a folder that looks finished.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._tokenizer import Tokenizer

__all__ = ["TokenStore", "open_token_store", "FORMAT", "VERSION", "MANIFEST"]

FORMAT = "eqxpar-token-store"
VERSION = 1
TOKENS, STARTS, BYTES, MANIFEST = "tokens.bin", "documents.npy", "document_bytes.npy", "manifest.json"


def token_dtype(vocab_size: int) -> np.dtype:
    """The stream's dtype: `uint16` while every id fits, else `uint32` (little-endian)."""
    return np.dtype("<u2" if vocab_size <= 65536 else "<u4")


class TokenStore:
    """A token store, or a range of its documents (a view, from `split`).

    Opened by [`eqxpar.data.text.open_token_store`][] or
    [`eqxpar.data.text.build_token_store`][]; read by [`eqxpar.data.text.PackedRows`][].

    **Attributes:**

    - `path`: the store's folder.
    - `manifest`: its `manifest.json` (a dict; see the module docs for the fields).
    - `documents`: `(first, stop)`: the range of the store's documents this one holds.
    - `tokens`: the token stream of those documents (a read-only memory map, not loaded).
    - `document_starts`: `int64`, `(num_documents + 1,)`: where each document starts in
      `tokens`; the last entry is `num_tokens`.
    - `document_bytes`: `int64`, `(num_documents,)`: each document's UTF-8 length.
    - `num_documents`, `num_tokens`, `num_bytes`: counts (`num_bytes` is the UTF-8 bytes of the
      documents' text, for bits per byte: `loss_nats * num_tokens / (num_bytes * ln 2)`).
    - `vocab_size`, `eos_id`, `bos_id`: the tokenizer's, from the manifest.
    """

    def __init__(self, path: pathlib.Path, manifest: dict, arrays: tuple[Any, Any, Any], documents: tuple[int, int]):
        self.path = path
        self.manifest = manifest
        self._arrays = arrays
        tokens, starts, sizes = arrays
        first, stop = documents
        self.documents = (first, stop)
        origin = int(starts[first])
        self.tokens = tokens[origin : int(starts[stop])]
        self.document_starts = starts[first : stop + 1] if origin == 0 else starts[first : stop + 1] - origin
        self.document_bytes = sizes[first:stop]
        self.num_documents = stop - first
        self.num_tokens = int(self.tokens.shape[0])
        self.vocab_size = int(manifest["tokenizer"]["vocab_size"])
        self.eos_id = int(manifest["tokenizer"]["eos_id"])
        bos = manifest["tokenizer"]["bos_id"]
        self.bos_id = None if bos is None else int(bos)

    @functools.cached_property
    def num_bytes(self) -> int:
        """The UTF-8 bytes of the documents' text (read from the manifest for a whole store)."""
        if self.documents == (0, int(self.manifest["num_documents"])) and "num_bytes" in self.manifest:
            return int(self.manifest["num_bytes"])
        return int(np.sum(self.document_bytes, dtype=np.int64))

    def __repr__(self) -> str:
        return f"TokenStore({str(self.path)!r}, documents={self.documents}, num_tokens={self.num_tokens})"

    def __reduce__(self):
        # Pickles as its folder and range (a data loader's worker process opens it again), not
        # as the contents of its memory maps.
        return (_reopen, (str(self.path), *self.documents))

    def document(self, index: int) -> np.ndarray:
        """The tokens of document `index` of this store or view (a view of `tokens`)."""
        index = range(self.num_documents)[index]
        return self.tokens[int(self.document_starts[index]) : int(self.document_starts[index + 1])]

    def split(self, held_out: float) -> tuple[TokenStore, TokenStore]:
        """Split by documents: the last `ceil(held_out * num_documents)` (at least one) are held out.

        ```python
        train, validation = store.split(0.01)
        ```

        **Arguments:**

        - `held_out`: the share of documents held out, in `(0, 1)`.

        **Returns:**

        `(train, held)`: two views (`TokenStore`s over document ranges) whose documents are
        this one's, in order, without overlap.

        **Raises:**

        - `ValueError`: `held_out` is not in `(0, 1)`; the training part would hold no document.
        """
        if isinstance(held_out, bool) or not isinstance(held_out, int | float) or not 0 < held_out < 1:
            raise ValueError(f"split: held_out must be a share in (0, 1), e.g. 0.01, got {held_out!r}")
        n = self.num_documents
        # The small epsilon keeps 0.1 * 30 (3.0000000000000004 in floats) at 3 documents.
        held = max(1, math.ceil(held_out * n - 1e-9))
        if held >= n:
            raise ValueError(
                f"split: holding out {held} of the {n} documents in {self.path} leaves none to train on; "
                f"lower held_out, or add documents"
            )
        first, stop = self.documents
        return (
            TokenStore(self.path, self.manifest, self._arrays, (first, stop - held)),
            TokenStore(self.path, self.manifest, self._arrays, (stop - held, stop)),
        )


def _reopen(path: str, first: int, stop: int) -> TokenStore:
    store = open_token_store(path)
    return TokenStore(store.path, store.manifest, store._arrays, (first, stop))


def _damaged(path: pathlib.Path, what: str) -> ValueError:
    return ValueError(f"{path}: {what}; the token store is damaged: delete {path.parent} yourself and build it again")


def open_token_store(store_dir: str | os.PathLike) -> TokenStore:
    """Open a token store (memory maps: nothing is loaded), checking its format only.

    **Arguments:**

    - `store_dir`: the store's folder.

    **Returns:**

    The [`eqxpar.data.text.TokenStore`][] of all its documents.

    **Raises:**

    - `ValueError`: the folder does not exist or holds no `manifest.json`; a file of the store is
      missing, unreadable, or disagrees with the manifest (sizes, counts, dtype).
    """
    path = pathlib.Path(store_dir)
    if not (path / MANIFEST).is_file():
        raise ValueError(
            f"{path}: not a token store (no {MANIFEST} in it); build one with build_token_store (--store-dir)"
        )
    try:
        manifest = json.loads((path / MANIFEST).read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise _damaged(path / MANIFEST, f"not JSON ({error})") from error
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise _damaged(path / MANIFEST, f"not a token store manifest (no format {FORMAT!r})")
    if manifest.get("version") != VERSION:
        raise ValueError(
            f"{path / MANIFEST}: token store format version {manifest.get('version')!r}, this eqxpar reads "
            f"{VERSION}; build the store again with this eqxpar in another folder"
        )
    try:
        dtype = np.dtype(manifest["dtype"])
        n_docs, n_tokens = int(manifest["num_documents"]), int(manifest["num_tokens"])
        tokenizer = manifest["tokenizer"]
        ids = [int(tokenizer["eos_id"])] + ([] if tokenizer["bos_id"] is None else [int(tokenizer["bos_id"])])
        vocab_size = int(tokenizer["vocab_size"])
    except (KeyError, TypeError, ValueError) as error:
        raise _damaged(path / MANIFEST, f"a field is missing or malformed ({error!r})") from error
    if not all(0 <= i < vocab_size for i in ids):
        raise _damaged(path / MANIFEST, f"the tokenizer's ids {ids} are not all in [0, vocab_size={vocab_size})")
    if dtype not in (np.dtype("<u2"), np.dtype("<u4")):
        raise _damaged(path / MANIFEST, f"dtype {manifest['dtype']!r} is neither <u2 nor <u4")
    size = (path / TOKENS).stat().st_size if (path / TOKENS).is_file() else None
    if size != n_tokens * dtype.itemsize or n_tokens == 0:
        raise _damaged(path / TOKENS, f"holds {size} bytes, the manifest says {n_tokens} tokens of {dtype.itemsize}")
    arrays = []
    for name, length in ((STARTS, n_docs + 1), (BYTES, n_docs)):
        try:
            array = np.load(path / name, mmap_mode="r")
        except (OSError, ValueError) as error:
            raise _damaged(path / name, f"cannot be read ({error})") from error
        if array.dtype != np.int64 or array.shape != (length,):
            raise _damaged(path / name, f"holds {array.dtype} {array.shape}, the manifest needs int64 ({length},)")
        arrays.append(array)
    starts, sizes = arrays
    if int(starts[0]) != 0 or int(starts[-1]) != n_tokens:
        raise _damaged(path / STARTS, f"runs from {int(starts[0])} to {int(starts[-1])}, not 0 to {n_tokens}")
    tokens = np.memmap(path / TOKENS, dtype=dtype, mode="r", shape=(n_tokens,))
    return TokenStore(path, manifest, (tokens, starts, sizes), (0, n_docs))


def file_records(files: Sequence[pathlib.Path], known: Sequence[dict] = ()) -> list[dict]:
    """Each file's resolved `path`, `size`, `mtime_ns` and `sha256`; a file whose path, size and
    mtime equal an entry of `known` (a manifest's `files`) takes its hash instead of reading it."""
    by_path = {entry.get("path"): entry for entry in known}
    records = []
    for file in files:
        stat = file.stat()
        record = dict(path=str(file.resolve()), size=stat.st_size, mtime_ns=stat.st_mtime_ns)
        old = by_path.get(record["path"], {})
        if old.get("size") == record["size"] and old.get("mtime_ns") == record["mtime_ns"] and "sha256" in old:
            record["sha256"] = old["sha256"]
        else:
            with open(file, "rb") as f:
                record["sha256"] = hashlib.file_digest(f, "sha256").hexdigest()
        records.append(record)
    return records


def tokenizer_record(tokenizer: Tokenizer) -> dict:
    """What the manifest keeps of the tokenizer."""
    return dict(
        kind=tokenizer.kind,
        fingerprint=tokenizer.fingerprint,
        vocab_size=tokenizer.vocab_size,
        eos_id=tokenizer.eos_id,
        bos_id=tokenizer.bos_id,
        source=tokenizer.source,
    )


def differences(manifest: dict, tokenizer: Tokenizer, field: str, files: Sequence[pathlib.Path]) -> list[str]:
    """Why a store (its manifest) is not the one `tokenizer`, `field` and `files` would build;
    empty if it is. Files are compared by content (size and sha256) in order, so a corpus moved
    or copied elsewhere still matches."""
    found = []
    old = manifest["tokenizer"]
    new = tokenizer_record(tokenizer)
    if old.get("fingerprint") != new["fingerprint"]:
        found.append(f"it was built with another tokenizer ({old.get('source')}, not {new['source']})")
    else:
        for key, name in (("eos_id", "end-of-document id"), ("bos_id", "beginning-of-document id")):
            if old.get(key) != new[key]:
                found.append(f"its tokenizer's {name} is {old.get(key)}, not {new[key]}")
    if manifest.get("field") != field:
        found.append(f"it was built from the field {manifest.get('field')!r}, not {field!r}")
    known = manifest.get("files", [])
    records = file_records(files, known)
    if [(r["size"], r["sha256"]) for r in records] != [(k.get("size"), k.get("sha256")) for k in known]:
        old_paths = {k.get("path"): k for k in known}
        new_paths = {r["path"]: r for r in records}
        added = [p for p in new_paths if p not in old_paths]
        removed = [p for p in old_paths if p not in new_paths]
        changed = [p for p in new_paths if p in old_paths and new_paths[p]["sha256"] != old_paths[p].get("sha256")]
        if added:
            found.append(f"files were added ({', '.join(added)})")
        if removed:
            found.append(f"files were removed ({', '.join(removed)})")
        if changed:
            found.append(f"files changed ({', '.join(changed)})")
        if not (added or removed or changed):
            found.append("the files come in another order")
    return found
