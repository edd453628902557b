"""Small real data sets that ship with installed packages: nothing is downloaded.

- [`eqxpar.datasets.digits`][]: scikit-learn's 8x8 handwritten digits (1,797 images,
  bundled inside the scikit-learn wheel), for the classifier recipes.
- [`eqxpar.datasets.python_source_documents`][]: the source code of some of Python's own
  standard-library modules, cut into documents at their top-level definitions: the
  language-model recipes' default corpus (through the same token store as a user's).
- [`eqxpar.datasets.python_source_text`][]: the same source as characters.
"""

from __future__ import annotations

import dataclasses
import os
import sysconfig

import numpy as np

from ._optional import require

__all__ = ["digits", "Split", "python_source_documents", "python_source_text", "CharText", "text_windows"]


@dataclasses.dataclass(frozen=True)
class Split:
    """A supervised data set split into train and test parts (NumPy arrays)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def num_features(self) -> int:
        return int(self.x_train.shape[1])

    @property
    def num_classes(self) -> int:
        return int(max(self.y_train.max(), self.y_test.max()) + 1)


def digits(test_fraction: float = 0.2, seed: int = 0) -> Split:
    """scikit-learn's digits: 64 pixel features in [0, 1], labels 0-9.

    **Arguments:**

    - `test_fraction`: the share of the 1,797 examples held out for testing.
    - `seed`: seeds the shuffle that decides the split (the same seed, the same split).

    **Returns:**

    A [`eqxpar.datasets.Split`][] with float32 features of shape `(n, 64)` and int32 labels.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"digits: test_fraction must be in (0, 1), got {test_fraction}.")
    sklearn_datasets = require(
        "sklearn.datasets", package="scikit-learn", extra="recipes", purpose="eqxpar.datasets.digits"
    )
    pixels, labels = sklearn_datasets.load_digits(return_X_y=True)
    x = (pixels / 16.0).astype(np.float32)
    y = labels.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(round(len(x) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return Split(x[train], y[train], x[test], y[test])


# Standard-library modules whose source makes the text corpus: plain, well-written English
# in docstrings and comments, mixed with code. All exist in every CPython since 3.8.
_TEXT_MODULES = ("textwrap", "string", "functools", "heapq", "bisect", "fractions", "statistics", "difflib")


@dataclasses.dataclass(frozen=True)
class CharText:
    """A text as integer character ids, with the vocabulary to turn ids back into text."""

    ids: np.ndarray  # int32, shape (n,)
    vocab: str  # vocab[i] is the character with id i

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> np.ndarray:
        """Character ids of `text` (characters outside the vocabulary raise `KeyError`)."""
        index = {c: i for i, c in enumerate(self.vocab)}
        return np.array([index[c] for c in text], dtype=np.int32)

    def decode(self, ids) -> str:
        """The text for a sequence of character ids."""
        return "".join(self.vocab[int(i)] for i in np.asarray(ids).reshape(-1))


def python_source_documents(modules: tuple[str, ...] = _TEXT_MODULES) -> list[str]:
    """The source files of some standard-library modules, cut into documents: each module's
    text up to its first top-level definition, then every top-level `def`, `class` or
    decorated definition with what follows it up to the next one (comments and blank lines
    included). Joined in order, the documents are the files exactly.

    **Arguments:**

    - `modules`: standard-library module names, read in this order.

    **Returns:**

    The documents, in file order (119 for the default modules, 256k characters).
    """
    documents = []
    for text in _module_sources(modules):
        lines = text.splitlines(keepends=True)
        start = 0
        for i, line in enumerate(lines):
            starts_definition = line.startswith(("def ", "class ", "async def ", "@"))
            if starts_definition and i > start and not lines[i - 1].startswith("@"):
                documents.append("".join(lines[start:i]))
                start = i
        documents.append("".join(lines[start:]))
    return [d for d in documents if d]


def _module_sources(modules: tuple[str, ...]) -> list[str]:
    stdlib = sysconfig.get_paths()["stdlib"]
    parts = []
    for name in modules:
        path = os.path.join(stdlib, *name.split(".")) + ".py"
        if not os.path.exists(path):
            raise ValueError(f"python_source_text: no source file for module {name!r} at {path}.")
        with open(path, encoding="utf-8") as f:
            parts.append(f.read())
    return parts


def python_source_text(modules: tuple[str, ...] = _TEXT_MODULES, vocab_multiple: int = 8) -> CharText:
    """Character-level text from the source files of Python's standard library.

    **Arguments:**

    - `modules`: standard-library module names whose `.py` source is concatenated.
    - `vocab_multiple`: the vocabulary is padded with unused characters up to a multiple of
      this, so it divides a vocab-parallel model axis (8 fits every mesh up to 8 devices).

    **Returns:**

    A [`eqxpar.datasets.CharText`][] (about 250k characters for the default modules).
    """
    text = "\n".join(_module_sources(modules))
    vocab = sorted(set(text))
    pad = (-len(vocab)) % vocab_multiple
    # Padding characters come from the private-use area: they never occur in the text.
    vocab += [chr(0xE000 + i) for i in range(pad)]
    index = {c: i for i, c in enumerate(vocab)}
    ids = np.fromiter((index[c] for c in text), dtype=np.int32, count=len(text))
    return CharText(ids=ids, vocab="".join(vocab))


def text_windows(ids: np.ndarray, batch_size: int, context: int, *, seed: int, step: int) -> np.ndarray:
    """A batch of random `context + 1`-character windows: inputs and their next characters.

    The windows are a pure function of `(seed, step)`, so a run resumed at step `k` sees
    exactly the batches an uninterrupted run saw from step `k` on.

    **Arguments:**

    - `ids`: the text as character ids (e.g. `python_source_text().ids`).
    - `batch_size`: how many windows.
    - `context`: the characters the model sees; each window has `context + 1`.
    - `seed`: the run's data seed.
    - `step`: the training step the batch is for.

    **Returns:**

    An int32 array of shape `(batch_size, context + 1)`.
    """
    if len(ids) < context + 2:
        raise ValueError(f"text_windows: a text of {len(ids)} characters is too short for context {context}.")
    starts = np.random.default_rng([seed, step]).integers(0, len(ids) - context - 1, batch_size)
    return ids[starts[:, None] + np.arange(context + 1)].astype(np.int32)
