"""Packing a token store into fixed-length training rows: a random-access data source for
the `eqxpar.data` loaders."""

from __future__ import annotations

import operator

import numpy as np

from ._store import TokenStore

__all__ = ["PackedRows"]


class PackedRows:
    """A token store's stream cut into rows of `seq_len + 1` tokens: a data source (random
    access, [`eqxpar.data.DataSource`][]) for language-model training.

    Row `i` is tokens `i * (seq_len + 1)` to `(i + 1) * (seq_len + 1)` of the store's (or
    view's) stream: consecutive rows do not overlap, documents run on across rows, and the
    tokens after the last whole row are dropped. Record `i` is a dict of three `int32` arrays of
    shape `(seq_len + 1,)` (inputs are `[:-1]`, targets `[1:]`):

    - `"tokens"`: the ids.
    - `"segment_ids"`: which document of the row each token is in: 1, 2, 3, ... in order (a
      document that began in an earlier row is 1).
    - `"positions"`: each token's position in its document, counted from 0 at the document's
      start or at the row's start, whichever is later (so always `< seq_len + 1`).

    Reading a row costs a binary search over the document starts and a copy of its tokens:
    row 10^9 is as fast as row 0.

    ```python
    rows = eqxpar.data.text.PackedRows(store, seq_len=1024)
    batch = eqxpar.data.load_per_process(rows, step, global_batch_size=8, mesh=mesh, batch_axis="data")
    ```

    **Arguments:**

    - `store`: a [`eqxpar.data.text.TokenStore`][] or a view of one (`store.split(...)`).
    - `seq_len`: the tokens a model sees per row; each row holds one more (the last target).

    **Raises:**

    - `ValueError`: `seq_len` is not a positive integer; the store holds fewer than `seq_len + 1` tokens.
    - `IndexError`: `rows[i]` with `i` outside `range(len(rows))` (as any sequence).
    """

    def __init__(self, store: TokenStore, seq_len: int):
        if not isinstance(store, TokenStore):
            raise ValueError(f"PackedRows: store must be an eqxpar.data.text.TokenStore, got {type(store).__name__}")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int | np.integer) or seq_len < 1:
            raise ValueError(f"PackedRows: seq_len must be an integer >= 1, got {seq_len!r}")
        self.store = store
        self.seq_len = int(seq_len)
        self._width = self.seq_len + 1
        self._length = store.num_tokens // self._width
        if self._length < 1:
            raise ValueError(
                f"PackedRows: {store.path} (documents {store.documents[0]} to {store.documents[1]}) holds "
                f"{store.num_tokens} tokens, and one row of seq_len={self.seq_len} needs {self._width}; "
                f"lower seq_len, or add text"
            )
        self._tokens = store.tokens
        self._starts = store.document_starts

    def __reduce__(self):
        return (PackedRows, (self.store, self.seq_len))  # the store pickles as its path, not its tokens

    def __repr__(self) -> str:
        return f"PackedRows({self.store!r}, seq_len={self.seq_len}, rows={self._length})"

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        i = operator.index(index)
        if i < 0:
            i += self._length
        if not 0 <= i < self._length:
            raise IndexError(f"PackedRows: row {index} is out of range for {self._length} rows")
        start = i * self._width
        stop = start + self._width
        tokens = np.asarray(self._tokens[start:stop], dtype=np.int32)
        # The documents that start inside the row, after its first token (starts are strictly
        # increasing: every document holds at least its EOS).
        first = int(np.searchsorted(self._starts, start, side="right"))
        last = int(np.searchsorted(self._starts, stop, side="left"))
        cuts = np.asarray(self._starts[first:last], dtype=np.int64) - start
        offsets = np.arange(self._width, dtype=np.int64)
        segment = np.searchsorted(cuts, offsets, side="right")  # documents begun at or before each token
        begins = np.concatenate([np.zeros(1, np.int64), cuts])
        return {
            "tokens": tokens,
            "segment_ids": (segment + 1).astype(np.int32),
            "positions": (offsets - begins[segment]).astype(np.int32),
        }
