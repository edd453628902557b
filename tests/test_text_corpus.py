"""eqxpar.data.text's corpus readers: which files a set of paths names, in which order
(`corpus_files`), and the documents of each format (`read_documents`), with every bad input
refused by a one-line error naming the file (and line or byte).

`write_documents` and `documents_strategy` are shared with the store tests."""

import gzip
import json
import os
import pathlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from eqxpar.data.text import corpus_files, read_documents

# Text as users have it: any Unicode scalar (no lone surrogates, which UTF-8 cannot hold),
# newlines, JSON-hostile characters and the empty document included.
documents_strategy = st.lists(
    st.text(st.characters(exclude_categories=("Cs",)), max_size=40) | st.sampled_from(["", "\n", 'a "b"\\\n\u2028']),
    min_size=1,
    max_size=6,
)


def write_documents(path: pathlib.Path, documents: list[str], field: str = "text") -> pathlib.Path:
    """Write `documents` in the format `path`'s suffix names (a .txt holds exactly one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    name = path.name
    if name.endswith(".txt"):
        (document,) = documents
        path.write_bytes(document.encode("utf-8"))
    elif name.endswith(".parquet"):
        pq.write_table(pa.table({field: documents, "id": list(range(len(documents)))}), path, row_group_size=2)
    else:
        lines = "".join(
            json.dumps({"id": i, field: d}, ensure_ascii=False) + "\n" + " \n" * (i % 2)
            for i, d in enumerate(documents)
        )
        data = lines.encode("utf-8")
        path.write_bytes(gzip.compress(data, mtime=0) if name.endswith(".gz") else data)
    return path


@given(docs=documents_strategy, suffix=st.sampled_from([".jsonl", ".jsonl.gz", ".parquet"]))
def test_every_format_reads_back_its_documents(tmp_path_factory, docs, suffix):
    path = write_documents(tmp_path_factory.mktemp("corpus") / f"part{suffix}", docs)
    assert list(read_documents(path)) == docs


@given(doc=st.text(st.characters(exclude_categories=("Cs",)), min_size=1))
def test_a_txt_file_is_one_document_byte_for_byte(tmp_path_factory, doc):
    path = write_documents(tmp_path_factory.mktemp("corpus") / "doc.txt", [doc])
    assert list(read_documents(path)) == [doc]  # "\r\n" stays "\r\n": no newline translation


def test_another_field(tmp_path):
    path = write_documents(tmp_path / "a.jsonl", ["x", "y"], field="content")
    assert list(read_documents(path, field="content")) == ["x", "y"]
    path = write_documents(tmp_path / "a.parquet", ["x", "y"], field="content")
    assert list(read_documents(path, field="content")) == ["x", "y"]


def test_the_documented_order(tmp_path):
    """Folders sort by relative POSIX path (uppercase before lowercase, a folder's files
    where its name sorts); entries keep their order; later copies of a file drop out."""
    for name in ["b.txt", "B.txt", "a/z.jsonl", "a/y/x.parquet", "ab.jsonl.gz", "c.md", ".hidden.txt", ".git/x.txt"]:
        write_documents(tmp_path / "corpus" / name, ["doc"]) if not name.endswith(".md") else None
    (tmp_path / "corpus" / "c.md").write_text("not corpus: a folder skips it")
    first = write_documents(tmp_path / "first.txt", ["doc"])
    expected = ["B.txt", "a/y/x.parquet", "a/z.jsonl", "ab.jsonl.gz", "b.txt"]
    found = corpus_files([first, tmp_path / "corpus", tmp_path / "corpus" / "b.txt", str(tmp_path / "first.txt")])
    assert found == [first] + [tmp_path / "corpus" / e for e in expected]
    # a glob: its matches sorted as strings, a folder among them expanded
    found = corpus_files(str(tmp_path / "corpus" / "[aB]*"))
    assert found == [tmp_path / "corpus" / e for e in ["B.txt", "a/y/x.parquet", "a/z.jsonl", "ab.jsonl.gz"]]
    # the same file through a link is a copy too
    os.symlink(tmp_path / "first.txt", tmp_path / "link.txt")
    assert corpus_files([tmp_path / "first.txt", tmp_path / "link.txt"]) == [first]
    assert corpus_files(str(first)) == [first]


@pytest.mark.parametrize(
    "entry, message",
    [
        ("missing.jsonl", r"missing.jsonl: no such file or folder; pass an existing"),
        ("nothing*.jsonl", r"nothing\*.jsonl: the pattern matches no file"),
        ("empty_folder", r"empty_folder: the folder holds no corpus files \(.txt, .jsonl, .jsonl.gz, .parquet"),
        ("notes.md", r"notes.md: not a corpus file \(the formats are .txt, .jsonl, .jsonl.gz, .parquet\)"),
        ("empty.txt", r"empty.txt: the file is empty \(0 bytes\)"),
        ("folder_with_empty", r"folder_with_empty/b.jsonl: the file is empty"),
        ("*.md", r"notes.md: not a corpus file"),
    ],
)
def test_bad_corpus_paths(tmp_path, monkeypatch, entry, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty_folder" / "sub").mkdir(parents=True)
    (tmp_path / "empty_folder" / "readme.md").write_text("x")
    (tmp_path / "notes.md").write_text("x")
    (tmp_path / "empty.txt").write_bytes(b"")
    write_documents(tmp_path / "folder_with_empty" / "a.jsonl", ["x"])
    (tmp_path / "folder_with_empty" / "b.jsonl").write_bytes(b"")
    with pytest.raises(ValueError, match=message):
        corpus_files([entry])


def test_no_entries():
    with pytest.raises(ValueError, match="no corpus paths given"):
        corpus_files([])


def _bad(tmp_path, name, data: bytes):
    path = tmp_path / name
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    return path


@pytest.mark.parametrize(
    "name, data, message",
    [
        ("a.jsonl", b'{"text": "a"}\n\n{"text": "b"\n', r"a.jsonl:3: not JSON \(Expecting ',' delimiter, column 13\)"),
        ("a.jsonl", b'{"text": "a"}\n["b"]\n', r"a.jsonl:2: a JSON list, not an object"),
        (
            "a.jsonl",
            b'{"text": "a"}\n{"body": "b", "id": 1}\n',
            r"a.jsonl:2: the record has no field 'text' \(its fields: 'body', 'id'\); .*\(--data-field\)",
        ),
        ("a.jsonl", b'{"text": 3}\n', r"a.jsonl:1: field 'text' is a JSON int, not a string"),
        ("a.jsonl", b'{"text": null}\n', r"a.jsonl:1: field 'text' is null, not a string"),
        (
            "a.jsonl",
            b'{"text": "ok"}\n{"text": "caf\xe9"}\n',
            r"a.jsonl: byte 28 \(line 2\) is not UTF-8 \(invalid continuation byte\); re-encode the file as UTF-8",
        ),
        (
            "a.jsonl.gz",
            b'{"text": "ok"}\n{"text": "\xff"}\n',
            r"a.jsonl.gz: byte 25 \(line 2\) of the decompressed text is not UTF-8 .*; re-encode",
        ),
        ("a.txt", "naïve".encode() + b"\xc3(", r"a.txt: byte 6 is not UTF-8 \(invalid continuation byte\); re-encode"),
        ("a.jsonl.gz", b"", r"a.jsonl.gz: not a valid gzip file"),
        ("a.parquet", b"PAR1 not really", r"a.parquet: not a valid Parquet file"),
    ],
)
def test_bad_documents(tmp_path, name, data, message):
    path = _bad(tmp_path, name, data)
    if name == "a.jsonl.gz" and not data:
        path.write_bytes(b"\x1f\x8b not gzip at all")
    with pytest.raises(ValueError, match=message):
        list(read_documents(path))


def test_bad_parquet_columns(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"body": ["a"], "n": [1]}), path)
    with pytest.raises(ValueError, match=r"a.parquet: no column 'text' \(its columns: 'body', 'n'\); .*--data-field"):
        list(read_documents(path))
    with pytest.raises(ValueError, match=r"a.parquet: column 'n' holds int64, not strings"):
        list(read_documents(path, field="n"))
    pq.write_table(pa.table({"text": ["a", None, "c"]}), path)
    with pytest.raises(ValueError, match=r"a.parquet: row 1: column 'text' is null"):
        list(read_documents(path))
