"""The examples on docs/troubleshooting.md run as written and print what the page shows.

A ```python block that calls `simulate_cpu_devices(n)` starts a script (a fresh process, as
a reader would run it); the blocks after it continue that script. A ```text block right
after a python block is that block's output: it must equal what the block prints, line by
line, floats within 1e-5 relative. What depends on JAX's version (its own error text,
whether `jax.device_put` reuses a buffer) is compared exactly on the JAX the page was
written with (0.10) and only loosely on others.
"""

import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest

# The pages' code is user code: it runs under JAX's default promotion rules, not the
# suite's strict ones (tests/conftest.py), as it does for a reader.
pytestmark = [pytest.mark.standard_promotion, pytest.mark.allow_rank_promotion]


PAGE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "troubleshooting.md"
BLOCK = re.compile(r"```python\n(?P<code>.*?)```(?:\s*\n```text\n(?P<out>.*?)```)?", re.S)
DEVICES = re.compile(r"simulate_cpu_devices\((\d+)\)")
MARK = "@@ block done @@"
FLOAT = re.compile(r"(-?\d+\.\d+(?:e[-+]?\d+)?)")
ON_PAGE_JAX = jax.__version__.startswith("0.10.")
# jax.device_put's buffer reuse, as the page reports it for JAX 0.10.2.
JAX_DEPENDENT_LINES = {"model deleted: True"}
# JAX's own words, and filter_shard_map's varying-axes check, which reads JAX's types.
JAX_DEPENDENT_ERRORS = ("ValueError: shard_map", "ValueError: filter_shard_map")


def page_scripts() -> list[list[tuple[str, str | None]]]:
    """The page's scripts: each a list of (code, expected output or None)."""
    scripts: list[list[tuple[str, str | None]]] = []
    text = PAGE.read_text()
    for match in BLOCK.finditer(text):
        # An excerpt marked `<!-- docs-test: skip (why) -->` (as tests/test_docs_examples.py
        # reads the mark) names objects built elsewhere: not a script to run.
        before = text[: match.start()].rstrip()
        if before.endswith("-->") and "docs-test: skip" in before.rsplit("<!--", 1)[-1]:
            continue
        if DEVICES.search(match["code"]) or not scripts:
            scripts.append([])
        scripts[-1].append((match["code"], match["out"]))
    return scripts


SCRIPTS = page_scripts()


def same_line(got: str, want: str) -> bool:
    got_parts, want_parts = FLOAT.split(got), FLOAT.split(want)
    if len(got_parts) != len(want_parts):
        return False
    for i, (g, w) in enumerate(zip(got_parts, want_parts)):
        if i % 2 == 0:
            if g.rstrip() != w.rstrip():
                return False
        elif abs(float(g) - float(w)) > 1e-5 * abs(float(w)) + 1e-6:
            return False
    return True


def test_the_page_has_its_examples():
    assert len(SCRIPTS) >= 3, "donated buffers, check_vma and vocabulary padding"
    assert sum(out is not None for script in SCRIPTS for _, out in script) >= 6


@pytest.mark.parametrize("index", range(len(SCRIPTS)), ids=lambda i: f"script{i}")
def test_script_prints_what_the_page_shows(index, tmp_path):
    blocks = SCRIPTS[index]
    code = "\n".join(f"{c}\nprint({MARK!r}, flush=True)\n" for c, _ in blocks)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "EQXPAR_CPU_DEVICES")}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    outputs = done.stdout.split(MARK + "\n")
    assert len(outputs) == len(blocks) + 1, done.stdout
    for (_, want), got in zip(blocks, outputs):
        if want is None:
            continue
        if want.startswith(JAX_DEPENDENT_ERRORS) and not ON_PAGE_JAX:
            assert got.startswith("ValueError:"), got
            continue
        got_lines, want_lines = got.rstrip("\n").split("\n"), want.rstrip("\n").split("\n")
        assert len(got_lines) == len(want_lines), f"printed:\n{got}\npage:\n{want}"
        for g, w in zip(got_lines, want_lines):
            if w in JAX_DEPENDENT_LINES and not ON_PAGE_JAX:
                continue
            assert same_line(g, w), f"printed:\n{g}\npage:\n{w}"
