"""The user's corpus: which files (`corpus_files`, in a fixed order) and the documents in
each file (`read_documents`)."""

from __future__ import annotations

import glob
import gzip
import json
import os
import pathlib
import zlib
from collections.abc import Iterable, Iterator, Sequence

from ..._optional import require

__all__ = ["SUFFIXES", "corpus_files", "read_documents"]

# The corpus formats, by how a file's name ends (case-insensitive).
SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".parquet")
_REENCODE = "re-encode the file as UTF-8 (e.g. iconv -f LATIN1 -t UTF-8)"


def _suffix(path: pathlib.Path) -> str | None:
    name = path.name.lower()
    return next((s for s in (".jsonl.gz", ".jsonl", ".txt", ".parquet") if name.endswith(s)), None)


def _file(path: pathlib.Path) -> pathlib.Path:
    """`path`, a file named directly or by a glob, checked: a corpus format, not empty."""
    if _suffix(path) is None:
        raise ValueError(
            f"{path}: not a corpus file (the formats are {', '.join(SUFFIXES)}); convert it, or leave it out"
        )
    if path.stat().st_size == 0:
        raise ValueError(f"{path}: the file is empty (0 bytes); leave it out, or fill it")
    return path


def _folder(folder: pathlib.Path) -> list[pathlib.Path]:
    """The corpus files under `folder` (hidden files and folders skipped), sorted by their path
    relative to it as a POSIX string."""
    found = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            path = pathlib.Path(root, name)
            if not name.startswith(".") and _suffix(path) is not None:
                found.append((path.relative_to(folder).as_posix(), path))
    if not found:
        raise ValueError(
            f"{folder}: the folder holds no corpus files ({', '.join(SUFFIXES)}, searched recursively); "
            f"pass a folder that does"
        )
    return [_file(path) for _, path in sorted(found)]


def corpus_files(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[pathlib.Path]:
    """The corpus files `paths` name, in the order that defines the token stream.

    Each entry of `paths` is a file, a folder or a glob pattern (`"data/*.jsonl"`,
    `"data/**/*.parquet"`):

    - a file is taken as it is;
    - a folder gives every file under it (recursively; hidden files and folders skipped) whose
      name ends in `.txt`, `.jsonl`, `.jsonl.gz` or `.parquet`, sorted by its path relative to
      the folder as a POSIX string (`a/x.txt` before `b.txt`, `B.txt` before `a.txt`);
    - a pattern (an entry that does not exist as a path and holds `*`, `?` or `[`) gives its
      matches sorted as strings, each taken as a file or folder as above.

    The result is the entries in the order given, each expanded as above, with later copies of
    a file (the same file after resolving links and `..`) dropped.

    **Arguments:**

    - `paths`: one entry, or a sequence of them.

    **Returns:**

    The files, as `pathlib.Path`s (relative where the entry was).

    **Raises:**

    - `ValueError`: no entries; an entry that does not exist; a pattern that matches nothing; a
      folder with no corpus files; a file in another format; an empty (0-byte) file.
    """
    entries = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    if not entries:
        raise ValueError("corpus_files: no corpus paths given; pass files, folders or glob patterns")
    files: list[pathlib.Path] = []
    seen: set[str] = set()
    for entry in entries:
        text = os.fspath(entry)
        path = pathlib.Path(text)
        if path.exists():
            found = _folder(path) if path.is_dir() else [_file(path)]
        elif glob.has_magic(text):
            matches = sorted(glob.glob(text, recursive=True))
            if not matches:
                raise ValueError(f"{text}: the pattern matches no file; fix it (quote it so the shell leaves it)")
            found = []
            for match in map(pathlib.Path, matches):
                found.extend(_folder(match) if match.is_dir() else [_file(match)])
        else:
            raise ValueError(f"{text}: no such file or folder; pass an existing file, folder or glob pattern")
        for file in found:
            key = os.path.realpath(file)
            if key not in seen:
                seen.add(key)
                files.append(file)
    return files


def _decode(raw: bytes, path: pathlib.Path, offset: int, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        at = f"byte {offset + error.start}{where}"
        raise ValueError(f"{path}: {at} is not UTF-8 ({error.reason}); {_REENCODE}") from error


def _jsonl(path: pathlib.Path, stream: Iterable[bytes], field: str, where: str) -> Iterator[str]:
    offset = 0
    for number, raw in enumerate(stream, 1):
        start, offset = offset, offset + len(raw)
        if not raw.strip():
            continue
        line = _decode(raw, path, start, f" (line {number}){where}")
        try:
            record = json.loads(line.rstrip("\r\n"))
        except json.JSONDecodeError as error:
            message = f"{path}:{number}: not JSON ({error.msg}, column {error.colno}); write one JSON object per line"
            raise ValueError(message) from error
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: a JSON {type(record).__name__}, not an object; write one per line")
        if field not in record:
            fields = ", ".join(map(repr, record)) or "none"
            raise ValueError(
                f"{path}:{number}: the record has no field {field!r} (its fields: {fields}); "
                f"pass the field that holds the text (--data-field)"
            )
        text = record[field]
        if not isinstance(text, str):
            kind = "null" if text is None else f"a JSON {type(text).__name__}"
            raise ValueError(f"{path}:{number}: field {field!r} is {kind}, not a string; pass the text field")
        yield text


def _parquet(path: pathlib.Path, field: str) -> Iterator[str]:
    pa = require("pyarrow", package="pyarrow", extra="text", purpose=".parquet corpus files")
    pq = require("pyarrow.parquet", package="pyarrow", extra="text", purpose=".parquet corpus files")
    try:
        reader = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as error:
        raise ValueError(f"{path}: not a valid Parquet file ({error}); pass the file as written") from error
    columns = reader.schema_arrow.names
    if field not in columns:
        raise ValueError(
            f"{path}: no column {field!r} (its columns: {', '.join(map(repr, columns))}); "
            f"pass the column that holds the text (--data-field)"
        )
    kind = reader.schema_arrow.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or str(kind) == "string_view"):
        raise ValueError(f"{path}: column {field!r} holds {kind}, not strings; pass the text column")
    row = 0
    try:
        for batch in reader.iter_batches(batch_size=1024, columns=[field]):
            texts = batch.column(0).to_pylist()
            if None in texts:
                at = row + texts.index(None)
                raise ValueError(f"{path}: row {at}: column {field!r} is null; drop the row, or fill it")
            row += len(texts)
            yield from texts
    except pa.ArrowException as error:
        raise ValueError(f"{path}: cannot read the rows from {row} on ({error}); pass an intact file") from error


def read_documents(path: str | os.PathLike, field: str = "text") -> Iterator[str]:
    """The documents of one corpus file, in order, read as they are needed.

    - `.txt`: the whole file is one document.
    - `.jsonl`, `.jsonl.gz`: one JSON object per line (blank lines skipped); the document is
      its `field`, a string.
    - `.parquet`: the column `field` (strings), one document per row, read a batch of rows at
      a time.

    Text must be UTF-8: a byte that is not is an error naming the file and the byte's offset
    (of the decompressed stream for `.jsonl.gz`), never replaced, so the tokens are of the
    text the user has.

    **Arguments:**

    - `path`: the file (see [`eqxpar.data.text.corpus_files`][]).
    - `field`: the JSON field or Parquet column that holds the text.

    **Returns:**

    An iterator of strings.

    **Raises:**

    - `ValueError` (while iterating): a line that is not JSON (`file:LINE: not JSON (...)`), a record
      without `field` (the message names the fields it has) or whose `field` is not a string; a
      Parquet file without the column (the message names its columns) or with a null in it;
      bytes that are not UTF-8; a file in another format; a damaged gzip or Parquet file.
    """
    path = pathlib.Path(path)
    suffix = _suffix(path)
    if suffix == ".txt":
        yield _decode(path.read_bytes(), path, 0, "")
    elif suffix == ".jsonl":
        with open(path, "rb") as stream:
            yield from _jsonl(path, stream, field, "")
    elif suffix == ".jsonl.gz":
        with gzip.open(path, "rb") as stream:
            try:
                yield from _jsonl(path, stream, field, " of the decompressed text")
            except (OSError, EOFError, zlib.error) as error:
                raise ValueError(f"{path}: not a valid gzip file ({error}); pass the file as written") from error
    elif suffix == ".parquet":
        yield from _parquet(path, field)
    else:
        raise ValueError(f"{path}: not a corpus file (the formats are {', '.join(SUFFIXES)}); convert it")
