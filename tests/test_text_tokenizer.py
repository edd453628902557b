"""eqxpar.data.text's tokenizers: Hugging Face tokenizer.json files and folders, SentencePiece
models and char vocabularies behind one `Tokenizer`; `train_bpe` (deterministic) and
`char_tokenizer`; the end- and beginning-of-document ids; every bad file refused by name.

`make_tokenizer` (every kind, trained here on `TRAINING_TEXT`) is shared with the store tests."""

import io
import json
import pathlib
import pickle

import pytest
import sentencepiece as spm
import tokenizers
from hypothesis import given
from hypothesis import strategies as st

from eqxpar.data.text import char_tokenizer, load_tokenizer, train_bpe

# A small training corpus: some English, some accents, CJK and emoji, so every kind has merges.
TRAINING_TEXT = [
    f"Document {i}: the quick brown fox jumps over the lazy dog. Naïve café, smörgåsbord; 東京 {i * 7} 🙂\n"
    f"{'lorem ipsum dolor sit amet ' * (i % 4)}end of {i}."
    for i in range(60)
]
KINDS = ["huggingface", "sentencepiece", "char"]


def sentencepiece_model(path: pathlib.Path, **options) -> pathlib.Path:
    """Train a small SentencePiece BPE (byte fallback: any text encodes) and save its .model."""
    model = io.BytesIO()
    settings = dict(vocab_size=400, model_type="bpe", byte_fallback=True, character_coverage=1.0, minloglevel=2)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TRAINING_TEXT), model_writer=model, **settings | options)
    path.write_bytes(model.getvalue())
    return path


def make_tokenizer(kind: str, folder: pathlib.Path, text: str = ""):
    """A tokenizer of `kind` saved in `folder` (a char tokenizer knows `text`'s characters too)."""
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "huggingface":
        return train_bpe(TRAINING_TEXT, 300, folder / "tokenizer.json")
    if kind == "sentencepiece":
        return load_tokenizer(sentencepiece_model(folder / "sp.model"))
    return char_tokenizer("".join(TRAINING_TEXT) + text, folder / "chars.json")


@pytest.fixture(scope="module")
def tokenizers_by_kind(tmp_path_factory):
    return {kind: make_tokenizer(kind, tmp_path_factory.mktemp(kind)) for kind in KINDS}


def test_train_bpe_is_deterministic(tmp_path):
    a = train_bpe(TRAINING_TEXT, 320, tmp_path / "a" / "tokenizer.json")
    b = train_bpe(iter(TRAINING_TEXT), 320, tmp_path / "b.json")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert a.fingerprint == b.fingerprint and a.kind == "huggingface" and a.vocab_size == 320
    assert a.eos_id == a.encode_batch(["<|endoftext|>"])[0][0] and a.bos_id is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b.json"]  # no temporary file left


@given(text=st.text(st.characters(exclude_categories=("Cs",)), max_size=50))
def test_byte_level_bpe_and_char_round_trip(tokenizers_by_kind, text):
    bpe = tokenizers_by_kind["huggingface"]
    ids = bpe.encode(text)
    assert bpe.decode(ids) == text and all(0 <= i < bpe.vocab_size for i in ids)
    assert bpe.document(text) == ids + [bpe.eos_id]
    assert bpe.encode_batch([text, "fox"]) == [ids, bpe.encode("fox")]


def test_every_kind(tokenizers_by_kind):
    for kind, tok in tokenizers_by_kind.items():
        assert tok.kind == kind and len(tok.fingerprint) == 64
        texts = ["the quick brown fox", "", "東京 🙂"]
        docs = tok.document_batch(texts)
        head = [] if tok.bos_id is None else [tok.bos_id]
        assert docs == [head + tok.encode(t) + [tok.eos_id] for t in texts]
        assert all(0 <= i < tok.vocab_size for d in docs for i in d)
        # pickles as its path: a worker process loads the same tokenizer again
        again = pickle.loads(pickle.dumps(tok))
        assert again.fingerprint == tok.fingerprint and again.document_batch(texts) == docs
    sp = tokenizers_by_kind["sentencepiece"]
    assert (sp.bos_id, sp.eos_id) == (1, 2)  # the model's own bos_id() and eos_id()
    assert sp.decode(sp.encode("the quick brown fox")) == "the quick brown fox"
    char = tokenizers_by_kind["char"]
    assert char.eos_id == char.vocab_size - 1 and char.bos_id is None
    assert char.decode(char.document("fox")) == "fox\x03"


def test_char_tokenizer_file_and_its_end_of_document(tmp_path):
    tok = char_tokenizer("ba\x03c", tmp_path / "c.json")
    saved = json.loads((tmp_path / "c.json").read_text())
    assert saved == {"eqxpar_char_tokenizer": 1, "vocab": "\x03abc\ue000"}  # \x03 is taken: the first private-use
    assert tok.encode("cab\x03") == [3, 1, 2, 0] and tok.eos_id == 4
    assert load_tokenizer(tmp_path / "c.json").fingerprint == tok.fingerprint
    with pytest.raises(
        ValueError, match=r"c.json: the char tokenizer has no id for the character 'z' \(U\+007A, at character 1"
    ):
        tok.encode("az")
    with pytest.raises(ValueError, match=r"no id for the character '\\ue000'"):  # its own end-of-document
        tok.encode("\ue000")


def _wordlevel(folder: pathlib.Path, tokens: list[str], template: str | None = None) -> pathlib.Path:
    """A tiny Hugging Face tokenizer.json (word level) with `tokens` as its specials."""
    vocab = {t: i for i, t in enumerate([*tokens, "[UNK]", "a", "b"])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(tokens)
    if template:
        tok.post_processor = tokenizers.processors.TemplateProcessing(
            single=template, special_tokens=[(t, vocab[t]) for t in tokens if t in template]
        )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_huggingface_end_and_beginning_of_document(tmp_path):
    # no config: the first end-of-document candidate it has; no post-processor, no BOS
    tok = load_tokenizer(_wordlevel(tmp_path / "plain", ["[SEP]", "</s>"]) / "tokenizer.json")
    assert (tok.eos_id, tok.bos_id, tok.vocab_size) == (1, None, 5)
    # a Llama-style post-processor puts <s> first: that is the BOS
    tok = load_tokenizer(_wordlevel(tmp_path / "llama", ["<s>", "</s>"], template="<s> $A"))
    assert (tok.eos_id, tok.bos_id) == (1, 0) and tok.document("a b") == [0, 3, 4, 1]
    # a folder's tokenizer_config.json decides, as in a checkpoint folder
    folder = _wordlevel(tmp_path / "config", ["<s>", "</s>", "<eot>"])
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "<eot>"}, "bos_token": "<s>", "add_bos_token": True})
    )
    tok = load_tokenizer(folder)
    assert (tok.eos_id, tok.bos_id) == (2, 0) and tok.source == str(folder.absolute())
    # and the overrides decide over everything
    tok = load_tokenizer(folder, eos_token="</s>", bos_token="<eot>")
    assert (tok.eos_id, tok.bos_id) == (1, 2)
    assert pickle.loads(pickle.dumps(tok)).eos_id == 1


def test_sentencepiece_folder_and_model_without_eos(tmp_path):
    folder = tmp_path / "llama2"
    folder.mkdir()
    sentencepiece_model(folder / "tokenizer.model")
    assert load_tokenizer(folder).kind == "sentencepiece"
    sentencepiece_model(tmp_path / "noeos.model", eos_id=-1, bos_id=-1, byte_fallback=False, vocab_size=300)
    with pytest.raises(
        ValueError,
        match=r"noeos.model: the tokenizer has no end-of-document token \(the model's eos_id is -1\); .*eos_token=",
    ):
        load_tokenizer(tmp_path / "noeos.model")
    tok = load_tokenizer(tmp_path / "noeos.model", eos_token="<unk>")
    assert tok.eos_id == 0 and tok.bos_id is None


def test_a_changed_file_is_refused_when_loaded_again(tmp_path):
    tok = char_tokenizer("abc", tmp_path / "c.json")
    blob = pickle.dumps(tok)
    (tmp_path / "c.json").write_text(json.dumps({"eqxpar_char_tokenizer": 1, "vocab": "abcd"}))
    with pytest.raises(ValueError, match=r"c.json: the tokenizer file changed since it was loaded"):
        pickle.loads(blob)


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("missing.json", None, r"missing.json: no such file or folder; pass a tokenizer.json"),
        (
            "empty_folder",
            None,
            r"empty_folder: the folder holds no tokenizer \(looked for tokenizer.json and tokenizer.model\)",
        ),
        ("tokenizer.json", b'{"model": ', r"tokenizer.json: not a valid tokenizer.json \(EOF while parsing"),
        ("bad.model", b"not a model", r"bad.model: not a valid SentencePiece model \("),
        ("c.json", b'{"eqxpar_char_tokenizer": 1, "vocab": ', r"c.json: not a valid char tokenizer \(Expecting value"),
        ("c.json", b'{"eqxpar_char_tokenizer": 1, "vocab": "aa"}', r"c.json: not a valid char tokenizer \(needs"),
        (
            "nospecial",
            None,
            r"tokenizer.json: the tokenizer has no end-of-document token \(none of <\|endoftext\|>, </s>",
        ),
        ("config", b"{not json", r"tokenizer_config.json: not a valid tokenizer_config.json \("),
        ("override", None, r"the end-of-document token '<nope>' is not in the tokenizer's vocabulary"),
    ],
)
def test_bad_tokenizers(tmp_path, name, content, message):
    path = tmp_path / name
    kwargs = {}
    if name == "empty_folder":
        path.mkdir()
        (path / "vocab.txt").write_text("a")
    elif name == "nospecial":
        path = _wordlevel(path, [])
    elif name == "config":
        path = _wordlevel(path, ["</s>"])
        (path / "tokenizer_config.json").write_bytes(content)
    elif name == "override":
        path = _wordlevel(path, ["</s>"])
        kwargs = dict(eos_token="<nope>")
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        load_tokenizer(path, **kwargs)


def test_bad_training_inputs(tmp_path):
    (tmp_path / "taken.json").write_text("{}")
    with pytest.raises(
        ValueError, match=r"taken.json already exists; load it with load_tokenizer, or pick another path"
    ):
        train_bpe(TRAINING_TEXT, 300, tmp_path / "taken.json")
    with pytest.raises(ValueError, match=r"taken.json already exists"):
        char_tokenizer("abc", tmp_path / "taken.json")
    with pytest.raises(ValueError, match=r"vocab_size must be an integer >= 257 \(256 bytes \+ eos_token\), got 100"):
        train_bpe(TRAINING_TEXT, 100, tmp_path / "t.json")
    with pytest.raises(ValueError, match=r"texts is a single string; pass a list"):
        train_bpe("one long text", 300, tmp_path / "t.json")
    with pytest.raises(ValueError, match=r"char_tokenizer: text must be a non-empty string"):
        char_tokenizer("", tmp_path / "t.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken.json"]
