"""What the docs point at exists: every file path and every `eqxpar.*` name they mention.

Read (no compiles, a few seconds): the docs' pages (docs/**/*.md), the recipes, README.md,
CONTRIBUTING.md, and every docstring in eqxpar/ (read with `ast`, as mkdocstrings reads
them for the API pages). In them:

- a path under one of the project's folders (`eqxpar/train/_builders.py`, `recipes/fsdp.py`,
  `docs/concepts/pipeline.md`, `docs/data/losses/*.json`) must exist in this checkout;
- an `eqxpar.` dotted name (`eqxpar.train.fsdp_step`, `eqxpar.train.Stages.loss`) must
  import: its longest module prefix imports and the rest are attributes of it;
- no docstring holds an unexpanded `{placeholder}` (a template filled at import would show
  on the API pages, which mkdocstrings renders from the source without importing it).

When `site/` was built (`make docs`) after the last change to docs/ and eqxpar/, the API
pages it holds are checked too: every argument a rendered object's docstring lists shows on
its page. The suite does not build the site (CI runs `make docs` on its own).
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = ("eqxpar", "recipes", "docs", "tests", "benchmarks", "tools")
# A path under one of the project's folders: a file with an extension or a folder written
# with its slash (`eqxpar/train/`); not part of a URL or of a longer path
# (`github.com/eqxpar/eqxpar`, `/tmp/eqxpar/...`), nor a key such as `eqxpar/failure`.
PATH = re.compile(r"(?<![\w/.~-])((?:" + "|".join(FOLDERS) + r")/(?:[\w*.-]+/)*(?:[\w*-]+\.[A-Za-z]+\b)?)")
# A segment in capitals is a placeholder for the reader to fill (`recipes/NAME.py`).
TEMPLATE = re.compile(r"(?:^|/)[A-Z][A-Z_]*(?:\.\w+)?(?:/|$)")
NAME = re.compile(r"(?<![\w/.-])(eqxpar(?:\.[A-Za-z_]\w*)+)")
PLACEHOLDER = re.compile(r"(?<![{$\w])\{[A-Za-z_]\w*\}(?!\})")
# Names that look like eqxpar names and are not: the site's address.
NOT_NAMES = ("eqxpar.github",)


def _texts() -> list[tuple[str, str]]:
    """(where, text) for every page, recipe, top-level document and eqxpar docstring."""
    out = []
    for path in [
        *sorted((ROOT / "docs").rglob("*.md")),
        *sorted((ROOT / "recipes").glob("*.py")),
        ROOT / "README.md",
        ROOT / "CONTRIBUTING.md",
    ]:
        if path.exists():
            out.append((str(path.relative_to(ROOT)), path.read_text()))
    out.extend(_docstrings())
    return out


def _docstrings() -> list[tuple[str, str]]:
    """(file:line, docstring) of every module, class and function in eqxpar/."""
    out = []
    for path in sorted((ROOT / "eqxpar").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    line = getattr(node, "lineno", 1)
                    out.append((f"{path.relative_to(ROOT)}:{line}", doc))
    return out


def missing_paths(text: str, root: pathlib.Path = ROOT) -> list[str]:
    """The project paths `text` mentions that do not exist under `root` (globs: no match)."""
    bad = []
    for match in PATH.finditer(text):
        path = match[1]
        if TEMPLATE.search(path):
            continue
        if "*" in path:
            if not any(root.glob(path)):
                bad.append(path)
        elif not (root / path).exists():
            bad.append(path)
    return bad


def lookup(name: str):
    """The object a dotted name names: its longest importable module prefix, then attributes
    (`AttributeError` or `ImportError` if there is none)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(name)


def _resolves(name: str) -> bool:
    try:
        lookup(name)
    except (AttributeError, ImportError):
        return False
    return True


def missing_names(text: str) -> list[str]:
    """The `eqxpar.*` names `text` mentions that do not import."""
    names = {m[1] for m in NAME.finditer(text) if not m[1].startswith(NOT_NAMES)}
    return sorted(name for name in names if not _resolves(name))


TEXTS = _texts()


def test_the_texts_are_read():
    where = {w.split(":")[0] for w, _ in TEXTS}
    assert {"README.md", "recipes/fsdp.py", "docs/concepts/architecture.md", "eqxpar/train/_builders.py"} <= where
    assert len(TEXTS) > 300


def test_every_path_mentioned_exists():
    bad = [f"{where}: {path}" for where, text in TEXTS for path in missing_paths(text)]
    assert not bad, "paths mentioned that do not exist (moved or renamed?):\n" + "\n".join(bad)


def test_every_eqxpar_name_mentioned_imports():
    bad = [f"{where}: {name}" for where, text in TEXTS for name in missing_names(text)]
    assert not bad, "eqxpar names mentioned that do not import (moved or renamed?):\n" + "\n".join(bad)


def test_no_docstring_holds_a_placeholder():
    bad = [f"{where}: {m[0]}" for where, doc in _docstrings() for m in PLACEHOLDER.finditer(doc)]
    assert not bad, "docstrings with unexpanded {placeholders} (write them out in the source):\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "text, paths, names",
    [
        ("see `eqxpar/train.py` and eqxpar/train/_builders.py", ["eqxpar/train.py"], []),
        ("`recipes/nope.py`, docs/data/losses/*.json, docs/nothing/*.md", ["recipes/nope.py", "docs/nothing/*.md"], []),
        ("`eqxpar/models/`, eqxpar/nope/, recipes/NAME.py, key eqxpar/failure, ms (eqxpar/peer)", ["eqxpar/nope/"], []),
        ("https://github.com/eqxpar/eqxpar/blob/main/x.py and eqxpar.github.io", [], []),
        ("[`eqxpar.train.gpt_stages`][] and eqxpar.models.gpt_stages.", [], ["eqxpar.train.gpt_stages"]),
        ("`eqxpar.fsdp.fsdp_step`, eqxpar.train.Stages.loss, `python -m eqxpar.launch`", [], ["eqxpar.fsdp.fsdp_step"]),
    ],
)
def test_a_stale_reference_is_reported(text, paths, names):
    assert missing_paths(text) == paths
    assert missing_names(text) == names


def test_a_placeholder_is_reported():
    found = [m[0] for m in PLACEHOLDER.finditer('Args:\n    {common}\n  `{"loss": x}` {{escaped}} ${HOME}')]
    assert found == ["{common}"]


# The built site, when it is there and newer than what it is built from.

SITE = ROOT / "site"
DIRECTIVE = re.compile(r"^::: (eqxpar[\w.]*)\s*$", re.M)
ARGUMENT = re.compile(r"^\s*- `(\w+)`", re.M)


def _site_is_current() -> bool:
    if not (SITE / "index.html").exists():
        return False
    built = (SITE / "index.html").stat().st_mtime
    sources = [*(ROOT / "docs").rglob("*.md"), *(ROOT / "eqxpar").rglob("*.py"), ROOT / "mkdocs.yml"]
    return all(path.stat().st_mtime <= built for path in sources)


@pytest.mark.skipif(not _site_is_current(), reason="no site/ built after the last change (make docs builds it)")
def test_the_built_api_pages_show_every_argument():
    bad = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        rel = page.relative_to(ROOT / "docs").with_suffix("")
        html_path = SITE / rel / "index.html" if rel.name != "index" else SITE / rel.parent / "index.html"
        names = DIRECTIVE.findall(page.read_text())
        if not names:
            continue
        html = html_path.read_text()
        for name in names:
            doc = lookup(name).__doc__ or ""
            section = doc.split("**Arguments:**", 1)[1].split("**", 1)[0] if "**Arguments:**" in doc else ""
            bad += [f"{rel}: {name}: {arg}" for arg in ARGUMENT.findall(section) if f"<code>{arg}</code>" not in html]
            bad += [f"{rel}: {name}: {m[0]}" for m in PLACEHOLDER.finditer(html) if m[0] in doc]
    assert not bad, "arguments missing from the built pages:\n" + "\n".join(bad)


# A collective a recipe's comment places in a file of eqxpar is one that file calls.

COLLECTIVE = re.compile(r"\b(psum_scatter|psum|pmean|pmax|all_gather|ppermute|all_to_all)\b")
SOURCE_PATH = re.compile(r"\beqxpar/[\w/]+\.py\b")
SENTENCE_END = re.compile(r"(?<=[.!?;])\s+(?=[A-Z`(])")


def _prose(path: pathlib.Path) -> list[str]:
    """A Python file's docstrings and comment blocks (consecutive `#` lines joined)."""
    text = path.read_text()
    blocks = [
        ast.get_docstring(node, clean=True) or ""
        for node in ast.walk(ast.parse(text))
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
    ]
    comment: list[str] = []
    for line in [*text.splitlines(), ""]:
        stripped = line.strip()
        if stripped.startswith("#"):
            comment.append(stripped.lstrip("#").strip())
        elif comment:
            blocks.append(" ".join(comment))
            comment = []
    return blocks


def misplaced_collectives(prose: str, root: pathlib.Path = ROOT) -> list[str]:
    """`name in path` for each collective a sentence of `prose` names together with an
    eqxpar source file none of whose named files calls it (`jax.lax.name(`)."""
    bad = []
    for sentence in SENTENCE_END.split(" ".join(prose.split())):
        files = [root / p for p in SOURCE_PATH.findall(sentence)]
        code = "".join(f.read_text() for f in files if f.exists())
        for name in sorted(set(COLLECTIVE.findall(sentence)) if files else ()):
            if f"lax.{name}(" not in code:
                bad.append(f"{name} in {', '.join(SOURCE_PATH.findall(sentence))}")
    return bad


def test_a_collective_a_recipe_names_runs_where_it_says():
    bad = [
        f"{path.name}: {hit}"
        for path in sorted((ROOT / "recipes").glob("*.py"))
        for prose in _prose(path)
        for hit in misplaced_collectives(prose)
    ]
    assert not bad, "recipes' comments name a collective their file does not call:\n" + "\n".join(bad)


def test_a_misplaced_collective_is_reported():
    stale = (
        "the step's one `jax.lax.pmean` over the `data` axis (`per_device_gradients` in\n"
        "`eqxpar/train/_gradients.py`) averages the gradients. Then psum."
    )
    assert misplaced_collectives(stale) == ["pmean in eqxpar/train/_gradients.py"]
    true = "one `jax.lax.psum` of each shard's share (in `eqxpar/train/_gradients.py`)"
    assert misplaced_collectives(true) == []
