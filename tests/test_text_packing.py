"""eqxpar.data.text.PackedRows: a store's stream in rows of seq_len + 1 tokens, with segment
ids and positions that agree with a slow reference computed token by token from the
document starts, at any row index (row 10^9 of a 10^12-token store as well as row 0)."""

import json
import pathlib
import pickle
import time

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from eqxpar.data.text import PackedRows, open_token_store


def write_store(folder: pathlib.Path, lengths: list[int], tokens: np.ndarray | None = None, seed: int = 0):
    """A store written directly (no tokenizer): documents of `lengths` tokens, random ids."""
    folder.mkdir(parents=True)
    total = int(sum(lengths))
    if tokens is None:
        tokens = np.random.default_rng(seed).integers(0, 1000, total).astype("<u2")
    tokens.tofile(folder / "tokens.bin")
    np.save(folder / "documents.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    np.save(folder / "document_bytes.npy", np.asarray(lengths, np.int64) * 3)
    manifest = dict(
        format="eqxpar-token-store",
        version=1,
        dtype="<u2",
        tokenizer=dict(kind="char", fingerprint="0" * 64, vocab_size=1000, eos_id=0, bos_id=None, source="-"),
        field="text",
        files=[],
        num_documents=len(lengths),
        num_tokens=total,
        num_bytes=3 * total,
    )
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return open_token_store(folder)


def slow_reference(starts: list[int], start: int, width: int):
    """Segment ids and positions of tokens start..start+width, one token at a time."""
    segments, positions = [], []
    for t in range(start, start + width):
        doc = max(d for d, s in enumerate(starts[:-1]) if s <= t)
        first_doc = max(d for d, s in enumerate(starts[:-1]) if s <= start)
        segments.append(doc - first_doc + 1)
        positions.append(t - max(starts[doc], start))
    return segments, positions


@example(lengths=[3, 5, 4, 2, 7, 1, 6], seq_len=3, held_out=0.3)  # a view, documents across rows
@example(lengths=[2, 1], seq_len=4, held_out=None)  # fewer tokens than one row
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=30),
    seq_len=st.integers(1, 16),
    held_out=st.sampled_from([None, 0.3]),
)
def test_rows_are_the_stream_with_reference_segments_and_positions(tmp_path_factory, lengths, seq_len, held_out):
    store = write_store(tmp_path_factory.mktemp("store") / "s", lengths)
    if held_out is not None and len(lengths) > 1:
        store = store.split(held_out)[1]  # a view: its own document range, starts rebased
    if store.num_tokens < seq_len + 1:
        with pytest.raises(
            ValueError, match=rf"holds {store.num_tokens} tokens, and one row of seq_len={seq_len} needs {seq_len + 1}"
        ):
            PackedRows(store, seq_len)
        return
    rows = PackedRows(store, seq_len)
    assert len(rows) == store.num_tokens // (seq_len + 1)
    records = [rows[i] for i in range(len(rows))]
    stream = np.concatenate([r["tokens"] for r in records])
    assert stream.tolist() == store.tokens[: len(rows) * (seq_len + 1)].tolist()  # remainder dropped
    starts = store.document_starts.tolist()
    for i, record in enumerate(records):
        assert {k: (v.dtype, v.shape) for k, v in record.items()} == {
            k: (np.dtype(np.int32), (seq_len + 1,)) for k in ("tokens", "segment_ids", "positions")
        }
        segments, positions = slow_reference(starts, i * (seq_len + 1), seq_len + 1)
        assert record["segment_ids"].tolist() == segments and record["positions"].tolist() == positions
    assert rows[-1]["tokens"].tolist() == records[-1]["tokens"].tolist()
    again = pickle.loads(pickle.dumps(rows))  # as a loader's worker process gets it: by path
    assert len(again) == len(rows) and again[len(rows) - 1]["positions"].tolist() == records[-1]["positions"].tolist()


def test_rows_cross_documents_as_documented(tmp_path):
    # documents of 3, 5 and 4 tokens: 0 1 2 | 3 4 5 6 7 | 8 9 10 11; rows of 5 tokens
    store = write_store(tmp_path / "s", [3, 5, 4], tokens=np.arange(12, dtype="<u2"))
    rows = PackedRows(store, seq_len=4)
    assert len(rows) == 2
    assert rows[0]["tokens"].tolist() == [0, 1, 2, 3, 4]
    assert rows[0]["segment_ids"].tolist() == [1, 1, 1, 2, 2] and rows[0]["positions"].tolist() == [0, 1, 2, 0, 1]
    # the second document runs on into row 1: segment 1 there, positions from 0 at the row start
    assert rows[1]["segment_ids"].tolist() == [1, 1, 1, 2, 2] and rows[1]["positions"].tolist() == [0, 1, 2, 0, 1]
    with pytest.raises(IndexError, match=r"row 2 is out of range for 2 rows"):
        rows[2]
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=r"PackedRows: seq_len must be an integer >= 1"):
            PackedRows(store, bad)
    with pytest.raises(ValueError, match=r"PackedRows: store must be an eqxpar.data.text.TokenStore, got str"):
        PackedRows("store", 4)


def test_row_a_billion_is_as_quick_as_row_zero(tmp_path):
    """10^12 tokens (a sparse 2 TB file: nothing is written) in documents of 10^7 tokens."""
    folder = tmp_path / "big"
    folder.mkdir()
    n_tokens, doc = 10**12, 10**7
    try:
        with open(folder / "tokens.bin", "wb") as f:
            f.truncate(2 * n_tokens)
    except OSError as error:  # a file system without sparse files of this size
        pytest.skip(f"no 2 TB sparse file here: {error}")
    lengths = [doc] * (n_tokens // doc)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    np.save(folder / "documents.npy", starts.astype(np.int64))
    np.save(folder / "document_bytes.npy", np.full(len(lengths), doc, np.int64))
    tokenizer = dict(vocab_size=2, eos_id=0, bos_id=None)
    manifest = dict(format="eqxpar-token-store", version=1, dtype="<u2", tokenizer=tokenizer)
    manifest |= dict(num_documents=len(lengths), num_tokens=n_tokens)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    rows = PackedRows(open_token_store(folder), seq_len=1023)
    assert len(rows) == n_tokens // 1024 > 9 * 10**8
    # the row holding the start of document 58593 (token 585_930_000_000): row 572_197_265
    i = 585_930_000_000 // 1024
    timings = {}
    for index in (0, i):
        start = time.perf_counter()
        record = rows[index]
        timings[index] = time.perf_counter() - start
    cut = 585_930_000_000 - i * 1024
    assert record["segment_ids"].tolist() == [1] * cut + [2] * (1024 - cut)
    assert record["positions"].tolist() == list(range(cut)) + list(range(1024 - cut))  # from 0 at the row start
    assert timings[i] < 0.05, timings  # a binary search, not a scan of 10^5 starts or 10^12 tokens
