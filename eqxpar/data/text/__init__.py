"""Training on your own text: tokenizers, corpus files, a token store on disk, packed rows.

The path from text files to training batches:

1. a [`eqxpar.data.text.Tokenizer`][]: [`eqxpar.data.text.load_tokenizer`][] (a Hugging Face
   `tokenizer.json` or checkpoint folder, a SentencePiece `.model`), or one trained here
   ([`eqxpar.data.text.train_bpe`][], [`eqxpar.data.text.char_tokenizer`][]);
2. the corpus: `.txt`, `.jsonl`, `.jsonl.gz` and `.parquet` files, folders or glob patterns,
   in a documented order ([`eqxpar.data.text.corpus_files`][],
   [`eqxpar.data.text.read_documents`][]);
3. a token store ([`eqxpar.data.text.build_token_store`][]): the corpus tokenized once, in
   parallel, into a folder NumPy can read, reused while corpus and tokenizer stay the same;
4. [`eqxpar.data.text.PackedRows`][]: the store's stream cut into rows of `seq_len + 1`
   tokens with segment ids and positions, a data source for the `eqxpar.data` loaders.

```python
import eqxpar.data.text as text

tokenizer = text.train_bpe(text.read_documents("corpus/train.jsonl"), 4096, "runs/tokenizer.json")
store = text.build_token_store("corpus/", tokenizer, "runs/store")
train, validation = store.split(0.01)
rows = text.PackedRows(train, seq_len=256)
```

Needs the `text` extra (`pip install "eqxpar[text]"`: tokenizers, sentencepiece, pyarrow).
"""

from ._build import build_token_store
from ._corpus import corpus_files, read_documents
from ._packing import PackedRows
from ._store import TokenStore, open_token_store
from ._tokenizer import Tokenizer, load_tokenizer
from ._train import char_tokenizer, train_bpe

__all__ = [
    "Tokenizer",
    "load_tokenizer",
    "train_bpe",
    "char_tokenizer",
    "corpus_files",
    "read_documents",
    "build_token_store",
    "open_token_store",
    "TokenStore",
    "PackedRows",
]
