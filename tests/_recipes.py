"""Run a recipe in this process, the way a user runs it from the command line.

Recipes define `main(argv) -> dict`; running them in-process reuses the test session's
8 simulated devices and JAX's compile cache instead of starting a fresh interpreter.
"""

import importlib.util
import json
import pathlib
import sys

RECIPES = pathlib.Path(__file__).resolve().parent.parent / "recipes"


def load_recipe(name: str):
    """Import `recipes/NAME.py` as a module (without running its `__main__` block)."""
    path = RECIPES / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", path)
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs, as a normal import does: dataclasses (and pickling) look
    # a class's module up in sys.modules, which fails for recipes that use
    # `from __future__ import annotations`.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run_recipe(name: str, tmp_path, *flags: str) -> dict:
    """Run `recipes/NAME.py FLAGS --metrics-out ...`; return the metrics JSON it wrote."""
    out = pathlib.Path(tmp_path) / f"{name}_metrics.json"
    returned = load_recipe(name).main([*flags, "--metrics-out", str(out)])
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(returned)), "metrics JSON differs from main()'s return"
    return written
