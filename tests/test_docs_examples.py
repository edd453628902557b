"""The code on the docs' pages runs as written: the home page, every concept page and the
profiling page.

A page's ```python blocks run in order. A block that calls `simulate_cpu_devices(n)` starts
a new script (the page says "before JAX starts": a fresh namespace); the blocks after it,
up to the next such block, continue that script in the same namespace. Scripts for the 8
devices of conftest.py run in this process; a script that asks for another device count
runs in a fresh Python process, as a reader would run it. Everything runs in a temporary
directory (pages write checkpoints to relative paths).

A block that cannot run here (an excerpt of library code, or code that needs several
processes) is preceded on its page by an HTML comment the rendered page does not show,
with the reason in parentheses (required):

    <!-- docs-test: skip (needs two processes: run it under python -m eqxpar.launch) -->

docs/concepts/your_model.md runs in tests/test_parallelize_parity.py, which also checks
the table it prints.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

# The pages' code is user code: it runs under JAX's default promotion rules, not the
# suite's strict ones (tests/conftest.py), as it does for a reader.
pytestmark = [pytest.mark.standard_promotion, pytest.mark.allow_rank_promotion]


DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
CONCEPTS = sorted((DOCS / "concepts").glob("*.md"))
RUN_ELSEWHERE = {"your_model": "tests/test_parallelize_parity.py::test_the_concept_page_runs_as_written"}
BLOCK = re.compile(r"(?:<!--\s*docs-test:\s*skip\s*\((?P<why>[^)]+)\)\s*-->\s*\n)?```python\n(?P<code>.*?)```", re.S)
SKIP_WITHOUT_REASON = re.compile(r"<!--\s*docs-test:\s*skip(?!\s*\()")
DEVICES = re.compile(r"simulate_cpu_devices\((\d+)\)")


def page_blocks(text: str, name: str = "page") -> tuple[list[str], list[str]]:
    """(blocks to run, reasons given for the skipped ones), in page order."""
    if SKIP_WITHOUT_REASON.search(text):
        raise ValueError(f"{name}: a docs-test skip marker without a (reason)")
    run, skipped = [], []
    for match in BLOCK.finditer(text):
        if match["why"]:
            skipped.append(match["why"].strip())
        else:
            run.append(match["code"])
    return run, skipped


def scripts(blocks: list[str]) -> list[tuple[int, str]]:
    """The blocks grouped into scripts: (device count, code); 8 where none is asked for."""
    groups: list[tuple[int, list[str]]] = []
    for code in blocks:
        asked = DEVICES.search(code)
        if asked or not groups:
            groups.append((int(asked[1]) if asked else 8, []))
        groups[-1][1].append(code)
    return [(n, "\n".join(codes)) for n, codes in groups]


def run_page(page: pathlib.Path) -> None:
    name = str(page.relative_to(DOCS.parent))
    blocks, _ = page_blocks(page.read_text(), name)
    for devices, code in scripts(blocks):
        if devices == 8:
            exec(compile(code, name, "exec"), {"__name__": "__main__"})
        else:
            env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "EQXPAR_CPU_DEVICES")}
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
            assert done.returncode == 0, f"{name} (a script on {devices} devices) failed:\n{done.stderr[-3000:]}"


def test_home_page_example_runs(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks, _ = page_blocks((DOCS / "index.md").read_text())
    assert blocks, "the home page has no python example"
    run_page(DOCS / "index.md")
    assert "P('data',)" in capsys.readouterr().out  # the report shows the split logits


def test_profiling_page_example_runs(capsys, tmp_path, monkeypatch):
    """docs/profiling.md traces 3 steps and finds the collectives and their layers in the trace."""
    monkeypatch.chdir(tmp_path)
    run_page(DOCS / "profiling.md")
    out = capsys.readouterr().out
    assert list(tmp_path.glob("profile/plugins/profile/*/*.xplane.pb")), out
    assert list(tmp_path.glob("profile/plugins/profile/*/perfetto_trace.json.gz")), out
    # every collective of the step was seen in the trace, under its layer's scope
    assert "all-reduce  24 x" in out and "GPT/block_0/mlp/ParallelMLP/RowParallelLinear" in out, out


@pytest.mark.parametrize("page", CONCEPTS, ids=[p.stem for p in CONCEPTS])
def test_concept_page_examples_run(page, capsys, tmp_path, monkeypatch):
    if page.stem in RUN_ELSEWHERE:
        pytest.skip(f"runs in {RUN_ELSEWHERE[page.stem]}")
    blocks, _ = page_blocks(page.read_text(), page.name)
    if not blocks:
        pytest.skip(f"{page.name} has no python example that runs on one process")
    monkeypatch.chdir(tmp_path)
    run_page(page)
    capsys.readouterr()


def test_every_page_elsewhere_exists():
    assert len(CONCEPTS) >= 10, CONCEPTS
    for stem, test in RUN_ELSEWHERE.items():
        assert (DOCS / "concepts" / f"{stem}.md").exists()
        path, name = test.split("::")
        assert f"def {name}(" in (DOCS.parent / path).read_text()


def test_skip_markers_and_scripts_are_read():
    text = (
        "a\n<!-- docs-test: skip (needs two processes) -->\n```python\nraise SystemExit\n```\n```python\nx = 1\n```\n"
    )
    assert page_blocks(text) == (["x = 1\n"], ["needs two processes"])
    with pytest.raises(ValueError, match="without a"):
        page_blocks("<!-- docs-test: skip -->\n```python\nx = 1\n```\n")
    blocks = [
        "import eqxpar\neqxpar.simulate_cpu_devices(4)\n",
        "y = 2\n",
        "x = 1\n",
        "eqxpar.simulate_cpu_devices(8)\n",
    ]
    assert [n for n, _ in scripts(blocks[1:3])] == [8]  # no call: the 8 devices of the tests
    assert [n for n, _ in scripts(blocks)] == [4, 8]
    assert scripts(blocks)[0][1] == "import eqxpar\neqxpar.simulate_cpu_devices(4)\n\ny = 2\n\nx = 1\n"


def test_benchmark_table_on_its_page_parses_for_the_bar_chart():
    """docs/figures/make_figures.py draws docs/benchmarks.md's table: its format must stay readable."""
    pytest.importorskip("matplotlib")
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_figures", DOCS / "figures" / "make_figures.py")
    figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figures)  # simulate_cpu_devices(8): the tests' own count already
    rows = figures.benchmark_table((DOCS / "benchmarks.md").read_text())
    assert rows[0]["strategy"] == "single device", rows[0]
    assert all(float(r["step ms"].replace(",", "")) > 0 for r in rows)
    with pytest.raises(SystemExit, match="no `strategy"):
        figures.benchmark_table("no table here")
