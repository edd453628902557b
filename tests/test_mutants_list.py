"""`make mutants` stays runnable: every mutant in tools/mutants.toml still applies to the code.

A change to eqxpar (a reformat, a renamed variable) can make a mutant's `original` text
disappear; `make mutants` would then stop before running anything. This test, cheap and in
`make test`, says which mutant went stale and why, and that its covering tests exist.
"""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _mutants_module():
    spec = importlib.util.spec_from_file_location("eqxpar_mutants_tool", ROOT / "tools" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


TOOL = _mutants_module()
MUTANTS = TOOL.load_mutants()


def test_the_list_covers_at_least_thirty_mutants():
    assert len(MUTANTS) >= 30, len(MUTANTS)


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_each_mutant_applies_once_and_its_tests_exist(mutant):
    original, mutated = TOOL.mutated_text(mutant, ROOT)  # ValueError names what is stale
    assert mutated != original
    for arg in mutant.tests:
        if arg.startswith("-"):
            continue
        path = arg.split("::", 1)[0]
        if path.endswith(".py"):
            assert (ROOT / path).is_file(), f"{mutant.name}: no test file {path}"
