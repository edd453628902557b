"""eqxpar.data.text's token store: its stream is the plain reference (each document's
`tokenizer.encode`, BOS before and EOS after, in the documented file order) for every
tokenizer kind and every corpus format, in this process and in worker processes; it is
reused while corpus and tokenizer match, refused (never deleted) when they do not, and an
interrupted build leaves nothing a later build trusts."""

import hashlib
import json
import os
import pathlib
import pickle
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import THOROUGH
from hypothesis import given, settings
from hypothesis import strategies as st
from test_text_corpus import documents_strategy, write_documents
from test_text_tokenizer import KINDS, make_tokenizer

from eqxpar.data.text import TokenStore, build_token_store, char_tokenizer, open_token_store
from eqxpar.data.text import _build as build_module

# Files of every format, in nested folders whose names make the sort order matter
# (uppercase before lowercase, a folder's files where its name sorts).
NAMES = ["B.txt", "a/x.jsonl", "a.jsonl.gz", "a/b/c.parquet", "b.jsonl", "Z/y.parquet", "c.txt", "z.jsonl.gz"]
text_documents = st.lists(
    st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=40), min_size=1, max_size=1
)
corpora = st.lists(st.sampled_from(NAMES), min_size=4, max_size=8, unique=True).flatmap(
    lambda names: st.tuples(*[text_documents if n.endswith(".txt") else documents_strategy for n in names]).map(
        lambda docs: dict(zip(names, docs))
    )
)


def write_corpus(root: pathlib.Path, corpus: dict) -> list[pathlib.Path]:
    """Write `corpus` ({relative name: documents}) under `root`; the files in the documented
    order (sorted by relative POSIX path)."""
    for name, docs in corpus.items():
        write_documents(root / name, docs)
    return [root / name for name in sorted(corpus)]


def reference(tokenizer, corpus: dict) -> tuple[list[int], list[int], list[int]]:
    """The stream built plainly: each document's encode, BOS first if any, EOS last, in order."""
    tokens, lengths, sizes = [], [], []
    for name in sorted(corpus):
        for doc in corpus[name]:
            ids = ([] if tokenizer.bos_id is None else [tokenizer.bos_id]) + tokenizer.encode(doc) + [tokenizer.eos_id]
            tokens += ids
            lengths.append(len(ids))
            sizes.append(len(doc.encode("utf-8")))
    return tokens, lengths, sizes


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return {kind: make_tokenizer(kind, tmp_path_factory.mktemp(kind)) for kind in KINDS if kind != "char"}


def _tokenizer(trained, kind, corpus, folder):
    if kind == "char":  # knows exactly the corpus's characters
        return char_tokenizer("".join(d for docs in corpus.values() for d in docs) + "x", folder / "chars.json")
    return trained[kind]


def check_store(store: TokenStore, tokenizer, corpus: dict, files: list[pathlib.Path]):
    tokens, lengths, sizes = reference(tokenizer, corpus)
    assert store.tokens.dtype == np.dtype("<u2") and store.tokens.tolist() == tokens
    assert store.document_starts.tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist()
    assert store.document_bytes.tolist() == sizes and store.num_bytes == sum(sizes)
    assert (store.num_documents, store.num_tokens) == (len(lengths), len(tokens))
    m = store.manifest
    assert m["tokenizer"]["fingerprint"] == tokenizer.fingerprint and m["num_tokens"] == len(tokens)
    assert [f["path"] for f in m["files"]] == [str(f.resolve()) for f in files]
    assert [f["sha256"] for f in m["files"]] == [hashlib.sha256(f.read_bytes()).hexdigest() for f in files]
    # and NumPy alone reads it as the docs say
    raw = np.memmap(store.path / "tokens.bin", dtype=m["dtype"], mode="r")
    assert raw.tolist() == tokens and np.load(store.path / "documents.npy")[-1] == len(tokens)


@pytest.mark.parametrize("kind", KINDS)
@given(corpus=corpora)
def test_the_store_is_the_reference_stream(tmp_path_factory, trained, kind, corpus):
    root = tmp_path_factory.mktemp("corpus")
    files = write_corpus(root / "corpus", corpus)
    tokenizer = _tokenizer(trained, kind, corpus, root)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(build_module, "CHUNK_CHARS", 30)  # many chunks: two threads encode them, in order
        store = build_token_store(root / "corpus", tokenizer, root / "store", workers=0, progress=False)
    check_store(store, tokenizer, corpus, files)
    whole = build_token_store(root / "corpus", tokenizer, root / "store2", workers=0, progress=False)
    assert whole.tokens.tolist() == store.tokens.tolist()  # one chunk: the same stream


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=4 if THOROUGH else 1)  # each example starts two Python processes (~1.5 s)
@given(corpus=corpora)
def test_worker_processes_write_the_same_stream(tmp_path_factory, trained, kind, corpus):
    root = tmp_path_factory.mktemp("corpus")
    files = write_corpus(root / "corpus", corpus)
    tokenizer = _tokenizer(trained, kind, corpus, root)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(build_module, "CHUNK_CHARS", 30)  # many small tasks: their order matters
        store = build_token_store(root / "corpus", tokenizer, root / "store", workers=2, progress=False)
    check_store(store, tokenizer, corpus, files)


def _snapshot(folder: pathlib.Path) -> dict:
    return {p.name: (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest()) for p in folder.iterdir()}


@pytest.fixture
def built(tmp_path, trained):
    corpus = {"a.jsonl": ["one", "two"], "b/c.txt": ["three"], "d.parquet": ["four", "five"]}
    files = write_corpus(tmp_path / "corpus", corpus)
    store = build_token_store(tmp_path / "corpus", trained["huggingface"], tmp_path / "store", progress=False)
    return tmp_path, files, store


def test_a_matching_store_is_reused(built, trained, capsys):
    tmp_path, files, store = built
    before = _snapshot(store.path)
    again = build_token_store(files, trained["huggingface"], tmp_path / "store")
    assert "reusing the token store" in capsys.readouterr().err and _snapshot(store.path) == before
    assert again.tokens.tolist() == store.tokens.tolist()
    # the same content elsewhere (a copied corpus) is the same store
    (tmp_path / "copy").mkdir()
    for f in files:
        (tmp_path / "copy" / f.name).write_bytes(f.read_bytes())
    moved = [tmp_path / "copy" / f.name for f in files]
    assert build_token_store(moved, trained["huggingface"], tmp_path / "store", progress=False).num_documents == 5


@pytest.mark.parametrize(
    "change, message",
    [
        ("tokenizer", r"it was built with another tokenizer \(.*sp.model"),
        ("field", r"it was built from the field 'text', not 'body'"),
        ("changed", r"files changed \(.*a.jsonl\)"),
        ("added", r"files were added \(.*e.jsonl\)"),
        ("removed", r"files were removed \(.*d.parquet\)"),
        ("order", r"the files come in another order"),
    ],
)
def test_a_store_that_does_not_match_is_refused_and_kept(built, trained, change, message):
    tmp_path, files, store = built
    before = _snapshot(store.path)
    tokenizer, paths, field = trained["huggingface"], list(files), "text"
    if change == "tokenizer":
        tokenizer = trained["sentencepiece"]
    elif change == "field":
        field = "body"
    elif change == "changed":
        write_documents(files[0], ["one", "TWO"])
    elif change == "added":
        paths.append(write_documents(tmp_path / "e.jsonl", ["six"]))
    elif change == "removed":
        paths.pop()
    else:
        paths.reverse()
    expected = (
        rf"store: holds a token store that does not match: {message}.*; "
        r"use another store folder \(--store-dir\), or delete .*store yourself to rebuild it"
    )
    with pytest.raises(ValueError, match=expected):
        build_token_store(paths, tokenizer, tmp_path / "store", field=field, progress=False)
    assert _snapshot(store.path) == before


def test_a_folder_that_is_not_a_store_is_refused(tmp_path, trained):
    write_corpus(tmp_path / "corpus", {"a.jsonl": ["one"]})
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(
        ValueError, match=r"out: exists and is not a token store \(no manifest.json\); pass a new or empty folder"
    ):
        build_token_store(tmp_path / "corpus", trained["huggingface"], tmp_path / "out")
    assert os.listdir(tmp_path / "out") == ["notes.txt"]
    (tmp_path / "empty").mkdir()  # an empty folder is fine: the store goes there
    assert (
        build_token_store(tmp_path / "corpus", trained["huggingface"], tmp_path / "empty", progress=False).num_documents
        == 1
    )
    assert sorted(os.listdir(tmp_path)) == ["corpus", "empty", "out"]  # no building folder left


def test_a_corpus_without_documents(tmp_path, trained):
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    with pytest.raises(ValueError, match=r"the corpus holds no documents \(.*blank.jsonl\); pass files that hold text"):
        build_token_store(tmp_path / "blank.jsonl", trained["huggingface"], tmp_path / "store", progress=False)
    assert sorted(os.listdir(tmp_path)) == ["blank.jsonl"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tokenizer="tokenizer.json"), r"tokenizer must be a Tokenizer \(load_tokenizer\), got str"),
        (dict(workers=-1), r"workers must be None or an integer >= 0, got -1"),
        (dict(timeout_s=0), r"timeout_s must be a number of seconds > 0, got 0"),
        (dict(field=""), r"field must be a non-empty string"),
    ],
)
def test_bad_arguments(tmp_path, trained, kwargs, message):
    write_corpus(tmp_path / "corpus", {"a.jsonl": ["one"]})
    args = dict(paths=tmp_path / "corpus", tokenizer=trained["huggingface"], store_dir=tmp_path / "store") | kwargs
    with pytest.raises(ValueError, match=message):
        build_token_store(**args)


def test_other_processes_wait_for_the_builder(tmp_path, trained):
    tok = trained["huggingface"]
    write_corpus(tmp_path / "corpus", {"a.jsonl": ["one", "two"]})
    with pytest.raises(
        TimeoutError,
        match=r"store: no token store after 0.3 s: the builder process \(process 0, builder=True\) did not finish it",
    ):
        build_token_store(tmp_path / "corpus", tok, tmp_path / "store", builder=False, timeout_s=0.3)
    assert not (tmp_path / "store").exists()
    builder = threading.Timer(
        0.5, build_token_store, (tmp_path / "corpus", tok, tmp_path / "store"), dict(progress=False)
    )
    builder.start()
    waited = build_token_store(tmp_path / "corpus", tok, tmp_path / "store", builder=False, timeout_s=30)
    builder.join()
    assert waited.tokens.tolist() == reference(tok, {"a.jsonl": ["one", "two"]})[0]


# A build slowed down (tiny chunks, a pause per chunk) so that it can be killed half-way.
SLOW_BUILD = """
import sys, time
import eqxpar.data.text as text
from eqxpar.data.text import _build
_build.CHUNK_CHARS = 20
encode = _build._encode
_build._encode = lambda tokenizer, texts: (time.sleep(0.05), encode(tokenizer, texts))[1]
text.build_token_store(sys.argv[1], text.load_tokenizer(sys.argv[2]), sys.argv[3], workers=0, progress=False)
"""


def test_an_interrupted_build_leaves_nothing_trusted(tmp_path):
    corpus = {"a.jsonl": [f"document {i} " * 3 for i in range(300)], "b.txt": ["the end"]}
    files = write_corpus(tmp_path / "corpus", corpus)
    tok = char_tokenizer("".join(corpus["a.jsonl"]) + "the end", tmp_path / "chars.json")
    runs = {}
    for sig in (signal.SIGKILL, signal.SIGINT):
        store = tmp_path / f"store-{sig.name}"
        args = [sys.executable, "-c", SLOW_BUILD, str(tmp_path / "corpus"), tok.source, str(store)]
        runs[sig] = (store, subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    for sig, (store, proc) in runs.items():
        deadline = time.monotonic() + 120
        while not any(p.stat().st_size for p in tmp_path.glob(f".{store.name}.building-*/tokens.bin")):
            assert proc.poll() is None, proc.communicate()[0].decode()
            assert time.monotonic() < deadline, "the slowed build never started writing"
            time.sleep(0.05)
        proc.send_signal(sig)
        output = proc.communicate(timeout=60)[0].decode()
        assert proc.returncode != 0 and not store.exists(), output
        left = list(tmp_path.glob(f".{store.name}.building-*"))
        # SIGKILL leaves its folder (nothing can clean up), SIGINT removes it on the way out
        assert len(left) == (1 if sig == signal.SIGKILL else 0), (left, output)
        if sig == signal.SIGINT:
            assert "KeyboardInterrupt" in output
        with pytest.raises(ValueError, match="not a token store"):
            open_token_store(store)
        rebuilt = build_token_store(tmp_path / "corpus", tok, store, progress=False)
        check_store(rebuilt, tok, corpus, files)
        assert not list(tmp_path.glob(f".{store.name}.building-*"))  # the dead build's folder is gone


def test_a_folder_another_build_left_is_kept(tmp_path, trained):
    """Only folders with our marker and a dead process are removed: here the process lives."""
    write_corpus(tmp_path / "corpus", {"a.jsonl": ["one"]})
    alive = tmp_path / ".store.building-1-abcd"
    alive.mkdir()
    (alive / ".eqxpar-building").write_text(json.dumps(dict(pid=os.getpid(), host=os.uname().nodename)))
    foreign = tmp_path / ".store.building-2-efgh"
    foreign.mkdir()
    build_token_store(tmp_path / "corpus", trained["huggingface"], tmp_path / "store", progress=False)
    assert alive.exists() and foreign.exists()


def test_open_and_split(built):
    tmp_path, files, store = built
    opened = open_token_store(tmp_path / "store")
    assert opened.tokens.tolist() == store.tokens.tolist() and opened.num_documents == 5
    train, held = opened.split(0.3)  # ceil(0.3 * 5) = 2 documents held out
    assert (train.documents, held.documents) == ((0, 3), (3, 5))
    assert train.tokens.tolist() + held.tokens.tolist() == opened.tokens.tolist()
    assert held.document_starts[0] == 0 and held.document_starts[-1] == held.num_tokens
    assert held.document_bytes.tolist() == [4, 4] and held.num_bytes == 8  # "four", "five"
    assert held.document(1).tolist() == opened.document(4).tolist()
    # a view pickles as its folder and range (for a loader's worker processes), not its tokens
    blob = pickle.dumps(held)
    assert len(blob) < 1000 and pickle.loads(blob).tokens.tolist() == held.tokens.tolist()
    assert train.split(0.2)[1].documents == (2, 3)  # a view splits again
    assert [v.documents for v in opened.split(0.01)] == [(0, 4), (4, 5)]  # at least one held out
    with pytest.raises(ValueError, match=r"split: holding out 5 of the 5 documents in .*store leaves none to train on"):
        opened.split(0.99)
    for bad in (0, 1, 1.5, "0.1"):
        with pytest.raises(ValueError, match=r"split: held_out must be a share in \(0, 1\)"):
            opened.split(bad)


def test_damaged_stores(built, tmp_path_factory):
    tmp_path, files, store = built
    with pytest.raises(
        ValueError, match=r"corpus: not a token store \(no manifest.json in it\); build one with build_token_store"
    ):
        open_token_store(tmp_path / "corpus")
    manifest = json.loads((store.path / "manifest.json").read_text())
    (store.path / "manifest.json").write_text(json.dumps(manifest | dict(version=99)))
    with pytest.raises(ValueError, match=r"token store format version 99, this eqxpar reads 1; build the store again"):
        open_token_store(store.path)
    (store.path / "manifest.json").write_text(json.dumps(manifest))
    with open(store.path / "tokens.bin", "r+b") as f:
        f.truncate(4)
    with pytest.raises(
        ValueError,
        match=r"tokens.bin: holds 4 bytes, the manifest says \d+ tokens of 2; "
        r"the token store is damaged: delete .*store yourself",
    ):
        open_token_store(store.path)
