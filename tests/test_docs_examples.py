"""The code on the docs' home page runs as written."""

import pathlib
import re

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"


def test_home_page_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / "index.md").read_text(), re.S)
    assert blocks, "the home page has no python example"
    for code in blocks:
        exec(compile(code, "docs/index.md", "exec"), {})
    assert "P('data',)" in capsys.readouterr().out  # the report shows the split logits
