"""eqxpar's layering holds: no module imports one of a higher layer.

The layers and the import reader live in docs/figures/architecture.py, which also draws the
picture on the Architecture page from the same data, so the page and this test cannot
disagree. Imports inside functions count (a lazy import is still a dependency).
"""

import ast
import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load_architecture():
    path = ROOT / "docs" / "figures" / "architecture.py"
    spec = importlib.util.spec_from_file_location("eqxpar_docs_architecture", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


arch = _load_architecture()


def test_every_module_is_in_a_layer():
    graph = arch.import_graph()
    assert len(graph) > 40  # the reader found the package
    missing = []
    for module in graph:
        try:
            arch.part_of(module)
        except KeyError:
            missing.append(module)
    assert not missing, f"add these modules to LAYERS in docs/figures/architecture.py: {missing}"


def test_no_lower_layer_imports_a_higher_one():
    bad = arch.violations(arch.import_graph())
    assert not bad, f"imports that go up a layer (importer, imported), see docs/concepts/architecture.md: {bad}"


# The import circles known when the test was written (issue 41: "models/ ... 2 import
# circles"); each is closed only by an `if TYPE_CHECKING:` import of the model class in its
# `_parts` module. The test fails on any circle not listed here; remove an entry once its
# circle is gone (issue 41's models/ packages should leave this set empty).
KNOWN_CIRCLES = {
    frozenset({"eqxpar.models._gpt", "eqxpar.models._gpt_parts"}),
    frozenset({"eqxpar.models._llama", "eqxpar.models._llama_parts"}),
}


def test_no_new_import_circle():
    """No import circle inside eqxpar beyond the known ones: a strongly connected component
    of the import graph with more than one module. Every import counts, those inside
    functions and under `if TYPE_CHECKING:` too (the reader does not tell them apart, and a
    circle closed by a lazy import still ties its modules together: it is how
    `_watchdog` <-> `_failfast` hid before eqxpar/distributed/)."""
    circles = arch.import_cycles(arch.import_graph())
    new = [c for c in circles if frozenset(c) not in KNOWN_CIRCLES]
    assert not new, f"import circles (break them, e.g. move what both modules need into a third): {new}"


def test_an_import_circle_is_reported():
    graph = {
        "eqxpar.a": {"eqxpar.b"},
        "eqxpar.b": {"eqxpar.c"},
        "eqxpar.c": {"eqxpar.a", "eqxpar.d"},
        "eqxpar.d": set(),
        "eqxpar.e": {"eqxpar.f"},
        "eqxpar.f": {"eqxpar.e"},
    }
    assert arch.import_cycles(graph) == [("eqxpar.a", "eqxpar.b", "eqxpar.c"), ("eqxpar.e", "eqxpar.f")]
    assert arch.import_cycles({**graph, "eqxpar.c": {"eqxpar.d"}, "eqxpar.f": set()}) == []


def test_no_module_imports_another_modules_private_name():
    """`from ._x import _name` ties a module to another one's internals (as `_watchdog`
    once took `_failfast`'s `_installed`): a name shared between modules is public in the
    module that defines it. Private submodules (`from . import _folder`) are fine."""
    modules = set(arch.import_graph())
    bad = []
    for path in sorted((ROOT / "eqxpar").rglob("*.py")):
        name = arch.module_name(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not (node.level or (node.module or "").startswith("eqxpar")):
                continue
            base = arch._resolve(name, path.name == "__init__.py", node)[0]
            for alias in node.names:
                if alias.name.startswith("_") and f"{base}.{alias.name}" not in modules:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {alias.name} from {base}")
    assert not bad, f"make these names public in their module (drop the underscore), or keep them there: {bad}"


def test_the_reader_sees_relative_lazy_and_submodule_imports():
    """The check is only as good as the reader: it must see the imports it judges."""
    graph = arch.import_graph()
    # `from ._specs import ...` at module level
    assert "eqxpar._specs" in graph["eqxpar._shard_map"]
    # `from ._orbax import OwnSteps` inside a function
    assert "eqxpar.checkpoint._orbax" in graph["eqxpar.checkpoint._save"]
    # `from .. _specs import ...` two levels up, and `from . import _folder`
    assert "eqxpar._specs" in graph["eqxpar.checkpoint._leaves"]
    assert "eqxpar.checkpoint._folder" in graph["eqxpar.checkpoint._config"]
    # ... which is no import of the package that holds the importer (it is loading already)
    assert "eqxpar.checkpoint" not in graph["eqxpar.checkpoint._config"]


@pytest.mark.parametrize(
    "importer, imported",
    [
        ("eqxpar._specs", "eqxpar.train"),
        ("eqxpar.nn._linear", "eqxpar.train._step"),
        ("eqxpar.train._gradients", "eqxpar.checkpoint"),
    ],
)
def test_an_upward_import_is_reported(importer, imported):
    graph = {importer: {imported}, imported: set()}
    assert arch.violations(graph) == [(importer, imported)]
    assert arch.violations({imported: {importer}, importer: set()}) == []


def test_private_jax_only_in_compat():
    """`jax._src` is imported (or named) only in eqxpar/_compat.py."""
    users = []
    for path in sorted((ROOT / "eqxpar").rglob("*.py")):
        if path.name == "_compat.py" and path.parent.name == "eqxpar":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            elif isinstance(node, ast.Attribute) and node.attr == "_src":
                names = ["jax._src"]
            if any(n == "jax._src" or n.startswith("jax._src.") for n in names):
                users.append(str(path.relative_to(ROOT)))
    assert not users, f"private JAX outside eqxpar/_compat.py: {sorted(set(users))}"


def _local_imports_without_reason(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """The imports of eqxpar modules inside functions of `path` with no comment saying why:
    on the line itself, or in the comment lines just above it (blank lines and the other
    imports of the same group skipped)."""
    lines = path.read_text().splitlines()
    found = []
    for fn in ast.walk(ast.parse("\n".join(lines))):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.ImportFrom):
                ours = node.level > 0 or (node.module or "").split(".")[0] == "eqxpar"
            elif isinstance(node, ast.Import):
                ours = any(alias.name.split(".")[0] == "eqxpar" for alias in node.names)
            else:
                continue
            if not ours:
                continue
            reason = "#" in lines[node.lineno - 1]
            i = node.lineno - 2
            while not reason and i >= 0:
                text = lines[i].strip()
                if text.startswith("#"):
                    reason = True
                elif not (text == "" or text.startswith(("import ", "from "))):
                    break
                i -= 1
            if not reason:
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return sorted(set(found))


def test_imports_inside_functions_say_why():
    """An eqxpar module imported inside a function, not at the top, says why in a comment
    (the import cycle it breaks, or the optional extra it defers): a local import that
    needs no reason belongs at the top of the file, where the reader looks for it."""
    bad = [hit for path in sorted((ROOT / "eqxpar").rglob("*.py")) for hit in _local_imports_without_reason(path)]
    assert not bad, f"move these imports to the top of the file, or comment the cycle they break: {bad}"


def test_a_local_import_without_reason_is_reported(tmp_path):
    (tmp_path / "m.py").write_text(
        "def f():\n    from .nn import x\n\n"
        "def g():\n    # cycle: eqxpar.a imports eqxpar.b, which imports eqxpar.a\n    from .a import y\n"
    )
    assert _local_imports_without_reason(tmp_path / "m.py", tmp_path) == ["m.py:2"]
