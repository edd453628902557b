"""The built site shows code blocks and API pages as intended.

- docs/stylesheets/extra.css gives code blocks `white-space: pre` and `overflow-x: auto`
  (a long line scrolls inside its block instead of wrapping, so tables of numbers and
  command output keep their columns) through the rule `.md-typeset pre > code`; only API
  signatures (`.doc-signature`) wrap. Checked on the CSS itself, always.
- Every code block of the built pages is a `<code>` directly inside a `<pre>` inside an
  element of class `md-typeset`, which is what that rule reaches: a block built another
  way (a plugin, raw HTML) would wrap or overflow the page.
- No API page shows an unexpanded `{placeholder}` in its text (a docstring template that
  mkdocstrings, reading the source without importing it, renders as written).

The last two read site/, when it was built (`make docs`) after the last change to docs/,
eqxpar/ and mkdocs.yml; the suite does not build the site.
"""

from __future__ import annotations

import html.parser
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SITE = ROOT / "site"
CSS = ROOT / "docs" / "stylesheets" / "extra.css"
CODE_RULE = ".md-typeset pre > code"
PLACEHOLDER = re.compile(r"(?<![{$\w])\{[A-Za-z_]\w*\}(?!\})")  # as tests/test_docs_links.py


def css_rules(text: str) -> list[tuple[list[str], dict[str, str]]]:
    """The rules of a flat stylesheet (no @media blocks): (selectors, {property: value})."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    rules = []
    for selectors, body in re.findall(r"([^{}]+)\{([^{}]*)\}", text):
        names = [" ".join(s.split()) for s in selectors.split(",") if s.strip()]
        declarations = {}
        for declaration in body.split(";"):
            if ":" in declaration:
                prop, value = declaration.split(":", 1)
                declarations[prop.strip().lower()] = " ".join(value.split())
        rules.append((names, declarations))
    return rules


def code_block_style_problems(text: str) -> list[str]:
    """What is wrong with a stylesheet's code-block rules: the main rule missing or without
    `white-space: pre` / `overflow-x: auto`, or another rule on `pre`/`code` that changes
    `white-space` outside API signatures."""
    rules = css_rules(text)
    main = [d for names, d in rules if CODE_RULE in names]
    bad = []
    if not main:
        bad.append(f"no rule for `{CODE_RULE}`")
    for prop, value in (("white-space", "pre"), ("overflow-x", "auto")):
        if main and main[-1].get(prop) != value:
            bad.append(f"`{CODE_RULE}` has {prop}: {main[-1].get(prop)!r}, not {value!r}")
    for names, declarations in rules:
        for name in names:
            if name == CODE_RULE or "white-space" not in declarations:
                continue
            if re.search(r"\b(pre|code)\b", name) and ".doc-signature" not in name:
                bad.append(f"`{name}` sets white-space: {declarations['white-space']} (code blocks would wrap)")
    return bad


class _CodeBlocks(html.parser.HTMLParser):
    """Collects, for every `<pre>` of a page, what the CSS rule needs to reach it."""

    VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}

    def __init__(self):
        super().__init__()
        self.stack: list[tuple[str, set[str]]] = []  # open elements: (tag, classes)
        self.blocks: list[dict] = []  # per <pre>: in .md-typeset, a direct <code> child, text outside it

    def handle_starttag(self, tag, attrs):
        if tag in self.VOID:
            return
        classes = set((dict(attrs).get("class") or "").split())
        if tag == "code" and self.stack and self.stack[-1][0] == "pre":
            self.blocks[-1]["code_child"] = True
        if tag == "pre":
            typeset = any("md-typeset" in c for _, c in self.stack)
            self.blocks.append({"typeset": typeset, "code_child": False, "outside": ""})
        self.stack.append((tag, classes))

    def handle_endtag(self, tag):
        for i in range(len(self.stack) - 1, -1, -1):  # tolerate unclosed elements
            if self.stack[i][0] == tag:
                del self.stack[i:]
                break

    def handle_data(self, data):
        if self.stack and self.stack[-1][0] == "pre":
            self.blocks[-1]["outside"] += data.strip()


def code_block_problems(page: str) -> list[str]:
    """The code blocks of an HTML page that `.md-typeset pre > code` does not reach."""
    parser = _CodeBlocks()
    parser.feed(page)
    bad = []
    for i, block in enumerate(parser.blocks):
        if not block["typeset"]:
            bad.append(f"<pre> #{i + 1} is not inside .md-typeset")
        if not block["code_child"]:
            bad.append(f"<pre> #{i + 1} has no <code> child")
        if block["outside"]:
            bad.append(f"<pre> #{i + 1} has text outside its <code>: {block['outside'][:40]!r}")
    return bad


def prose(page: str) -> str:
    """A page's text outside code (`<pre>`, `<code>`), scripts and styles, tags removed."""
    page = re.sub(r"<(pre|code|script|style)\b.*?</\1>", " ", page, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", " ", page))


def _site_is_current() -> bool:
    if not (SITE / "index.html").exists():
        return False
    built = (SITE / "index.html").stat().st_mtime
    sources = [*(ROOT / "docs").rglob("*.md"), CSS, *(ROOT / "eqxpar").rglob("*.py"), ROOT / "mkdocs.yml"]
    return all(path.stat().st_mtime <= built for path in sources)


def test_code_blocks_scroll_rather_than_wrap():
    bad = code_block_style_problems(CSS.read_text())
    assert not bad, "docs/stylesheets/extra.css:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "css, problems",
    [
        (".md-typeset pre > code { white-space: pre; overflow-x: auto; }", []),
        ("/* c */ .a, .md-typeset pre > code {\n  white-space: pre;\n  overflow-x: auto\n}", []),
        (".md-typeset pre > code { white-space: pre-wrap; overflow-x: auto; }", ["white-space: 'pre-wrap'"]),
        (".md-typeset pre > code { white-space: pre; }", ["overflow-x: None"]),
        ("pre { overflow: auto; }", ["no rule"]),
        (
            ".md-typeset pre > code { white-space: pre; overflow-x: auto; }\n.md-typeset pre { white-space: normal; }",
            ["`.md-typeset pre` sets white-space"],
        ),
        (
            (
                ".md-typeset pre > code { white-space: pre; overflow-x: auto; }\n"
                ".md-typeset .doc-signature pre > code { white-space: pre-wrap; }"
            ),
            [],
        ),
    ],
)
def test_a_css_that_would_wrap_is_reported(css, problems):
    found = code_block_style_problems(css)
    assert len(found) == len(problems), found
    for want, got in zip(problems, found):
        assert want in got, (want, got)


def test_a_code_block_the_rule_misses_is_reported():
    good = '<div class="md-typeset"><div class="highlight"><pre><span></span><code>x = 1\n</code></pre></div></div>'
    assert code_block_problems(good) == []
    outside = '<pre><code class="a">x</code></pre>'
    assert code_block_problems(outside) == ["<pre> #1 is not inside .md-typeset"]
    bare = '<article class="md-content__inner md-typeset"><p>a<br>b</p><pre>x = 1</pre></article>'
    assert code_block_problems(bare) == [
        "<pre> #1 has no <code> child",
        "<pre> #1 has text outside its <code>: 'x = 1'",
    ]
    nested = '<div class="md-typeset"><pre><div><code>x</code></div></pre></div>'
    assert code_block_problems(nested) == ["<pre> #1 has no <code> child"]


def test_prose_leaves_out_code():
    page = '<p>Use <code>{"loss": x}</code> and {name}</p><pre><code>f"{x}"</code></pre>'
    assert [m[0] for m in PLACEHOLDER.finditer(prose(page))] == ["{name}"]


@pytest.mark.skipif(not _site_is_current(), reason="no site/ built after the last change (make docs builds it)")
def test_every_code_block_of_the_built_site_is_reached_by_the_rule():
    pages = sorted(SITE.rglob("*.html"))
    assert len(pages) > 30
    bad = [
        f"{page.relative_to(SITE)}: {problem}" for page in pages for problem in code_block_problems(page.read_text())
    ]
    assert not bad, "code blocks that `.md-typeset pre > code` does not style:\n" + "\n".join(bad)


@pytest.mark.skipif(not _site_is_current(), reason="no site/ built after the last change (make docs builds it)")
def test_no_built_api_page_shows_a_placeholder():
    pages = sorted((SITE / "api").rglob("index.html"))
    assert len(pages) >= 10, pages
    bad = [f"{page.relative_to(SITE)}: {m[0]}" for page in pages for m in PLACEHOLDER.finditer(prose(page.read_text()))]
    assert not bad, "unexpanded {placeholders} on the built API pages:\n" + "\n".join(bad)
