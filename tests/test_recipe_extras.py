"""The documented install lines install what the recipes import, and a missing optional
dependency is a one-line install hint.

Without a fresh virtual environment per extra (minutes each): every `pip install ...[EXTRAS]`
line of README.md and docs/ gives a set of extras; their requirements in pyproject.toml,
with eqxpar's own dependencies, expand through the installed packages' metadata to the
distributions that install brings. Every recipe's imports, and those of the eqxpar modules
it reaches (imports inside functions too, and `eqxpar.checkpoint.X`-style attribute use of
the lazily imported subpackages), must come from those distributions or the standard library.
"""

import ast
import functools
import importlib
import importlib.metadata as metadata
import pathlib
import re
import sys
import tomllib

import pytest
from _recipes import RECIPES, load_recipe
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = RECIPES.parent
PACKAGE = ROOT / "eqxpar"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
NAMES = sorted(p.stem for p in RECIPES.glob("*.py"))


# ---- What each documented install line installs ----------------------------------------------


def documented_extras() -> set[frozenset[str]]:
    """The extras of every `pip install -e ".[a,b]"` / `pip install "eqxpar[a]"` in the docs."""
    found = set()
    for path in [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").rglob("*.md")]:
        for extras in re.findall(r"pip install (?:-e )?[\"']?(?:\.|eqxpar)\[([\w,\s-]+)\]", path.read_text()):
            found.add(frozenset(e.strip() for e in extras.split(",")))
    return found


def requirements(extras: frozenset[str]) -> list[Requirement]:
    """eqxpar's dependencies and those of `extras` (with `eqxpar[...]` inside an extra expanded)."""
    project = PYPROJECT["project"]
    reqs, todo, seen = [Requirement(r) for r in project["dependencies"]], list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        assert extra in project["optional-dependencies"], f"the docs install an extra pyproject.toml lacks: {extra}"
        for text in project["optional-dependencies"][extra]:
            req = Requirement(text)
            if canonicalize_name(req.name) == "eqxpar":
                todo.extend(req.extras)
            else:
                reqs.append(req)
    return reqs


def distributions(reqs: list[Requirement]) -> set[str]:
    """The installed distributions `reqs` bring in, their own requirements followed."""
    found, todo = set(), [(r, frozenset()) for r in reqs]
    while todo:
        req, extras = todo.pop()
        name = canonicalize_name(req.name)
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in extras or {""}):
            continue
        key = (name, frozenset(req.extras))
        if key in found:
            continue
        found.add(key)
        try:
            needs = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            continue  # not installed here (e.g. an optional accelerator plugin)
        todo.extend((Requirement(r), frozenset(req.extras)) for r in needs)
    return {name for name, _ in found}


# ---- What each recipe imports -----------------------------------------------------------------


def module_path(name: str) -> pathlib.Path | None:
    parts = name.split(".")[1:]
    for path in (PACKAGE.joinpath(*parts, "__init__.py"), PACKAGE.joinpath(*parts).with_suffix(".py")):
        if parts and path.exists() or not parts and path.name == "__init__.py":
            return path if path.exists() else None
    return None


def imports_of(path: pathlib.Path, module: str | None) -> set[str]:
    """Every module `path` imports (absolute names), anywhere in it (`require("tyro", ...)` and
    `import_module("x")` too), and the `eqxpar.X[.Y]` subpackages it uses as attributes
    (`eqxpar.checkpoint.Checkpointer`)."""
    package = module if module is None or path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = ".".join(base[: len(base) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names if module_path(f"{source}.{alias.name}"))
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", None)) in ("require", "import_module")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and not str(node.args[0].value).startswith(".")
        ):  # eqxpar._optional.require("tyro", ...), importlib.import_module("x")
            names.add(node.args[0].value)
        elif isinstance(node, ast.Attribute):
            chain = []
            while isinstance(node, ast.Attribute):
                chain.append(node.attr)
                node = node.value
            if isinstance(node, ast.Name) and node.id == "eqxpar":
                chain.reverse()
                for i in range(1, len(chain) + 1):
                    if module_path(".".join(["eqxpar", *chain[:i]])):
                        names.add(".".join(["eqxpar", *chain[:i]]))
    return names


@functools.cache  # read once per recipe for all the install lines (4 s a line before)
def third_party_imports(recipe: str) -> dict[str, str]:
    """Top-level names of the non-eqxpar, non-stdlib modules a recipe reaches -> who imports each."""
    todo, seen, found = [(RECIPES / f"{recipe}.py", None)], set(), {}
    while todo:
        path, module = todo.pop()
        for name in imports_of(path, module):
            top = name.split(".")[0]
            if top == "eqxpar":
                for i in range(1, name.count(".") + 2):  # a package's __init__ runs first
                    prefix = ".".join(name.split(".")[:i])
                    target = module_path(prefix)
                    if target is not None and prefix not in seen:
                        seen.add(prefix)
                        todo.append((target, prefix))
            elif top not in sys.stdlib_module_names and top != "__future__":
                found.setdefault(top, module or f"recipes/{recipe}.py")
    return found


# Imports inside functions that no recipe calls (the reader follows every import, so it
# must be told): the module that imports, and what.
NOT_REACHED = {("eqxpar.testing", "hypothesis")}  # mesh_sizes: a hypothesis strategy for tests


def test_the_docs_install_the_recipes_extra():
    assert frozenset({"recipes"}) in documented_extras()


@pytest.mark.parametrize("extras", sorted(documented_extras(), key=sorted), ids=lambda e: ",".join(sorted(e)))
def test_each_documented_install_line_brings_what_every_recipe_imports(extras):
    installed = distributions(requirements(extras))
    providers = metadata.packages_distributions()
    problems = []
    for recipe in NAMES:
        for top, importer in sorted(third_party_imports(recipe).items()):
            if (importer, top) in NOT_REACHED:
                continue
            dists = {canonicalize_name(d) for d in providers.get(top, [])}
            if not dists:
                problems.append(f"{recipe}: {top} (imported by {importer}) is not installed here at all")
            elif not dists & installed:
                problems.append(f"{recipe}: {top} (from {sorted(dists)}, imported by {importer})")
    # Extras that install only part of what the recipes need (data, checkpoint) are not install
    # lines for the recipes: only lines with `recipes` (or `all`) must run every recipe.
    if {"recipes", "all"} & extras:
        assert not problems, f'pip install ".[{",".join(sorted(extras))}]" leaves out: {problems}'


def test_the_import_reader_sees_lazy_and_attribute_imports():
    """The check above is only as good as its reader: grain via `import eqxpar.data`, orbax
    via `eqxpar.checkpoint.Checkpointer` (a lazy subpackage) and a function-level import."""
    assert {"grain", "orbax", "tyro", "sklearn", "tensorboardX"} <= set(third_party_imports("data_parallel"))
    # A lazy subpackage no import reaches is not counted: moe_gpt keeps no checkpoints. (Every
    # recipe reaches grain now: eqxpar.recipe's text pipeline loads through eqxpar.data.)
    assert "orbax" not in third_party_imports("moe_gpt")
    assert {"orbax", "tensorboardX"} <= set(third_party_imports("tensor_parallel"))


def test_the_recipes_extra_alone_leaves_out_nothing_the_recipes_import():
    """The `recipes` extra itself (not through `all`) has grain and orbax-checkpoint."""
    installed = distributions(requirements(frozenset({"recipes"})))
    assert {"grain", "orbax-checkpoint", "tyro", "scikit-learn", "tensorboardx"} <= installed


# ---- A missing optional dependency: one line saying what to install ---------------------------


def hide(monkeypatch, *modules, forget=()):
    """Make `import m` fail for each of `modules` (and their submodules), as if not installed;
    `forget`: modules (and submodules) to import afresh (monkeypatch puts all back after)."""
    for name in list(sys.modules):
        if any(name == m or name.startswith(f"{m}.") for m in (*modules, *forget)):
            monkeypatch.delitem(sys.modules, name)
    for m in modules:
        monkeypatch.setitem(sys.modules, m, None)


HINT = 'eqxpar needs {} for {}: pip install "eqxpar[{}]"'


def test_checkpoint_dir_without_orbax_is_one_line_with_the_install_hint(monkeypatch, tmp_path, capsys):
    recipe = load_recipe("data_parallel")
    hide(monkeypatch, "orbax")
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        recipe.main(["--steps", "1", "--checkpoint-dir", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert err == f"data_parallel.py: error: {HINT.format('orbax-checkpoint', '--checkpoint-dir', 'checkpoint')}\n"


def test_library_checkpointer_without_orbax_names_the_extra(monkeypatch, tmp_path):
    import eqxpar.checkpoint

    hide(monkeypatch, "orbax")
    with pytest.raises(ImportError) as error:
        eqxpar.checkpoint.Checkpointer(tmp_path / "ckpt")
    assert str(error.value) == HINT.format("orbax-checkpoint", "eqxpar.checkpoint.Checkpointer", "checkpoint")


def test_eqxpar_data_without_grain_names_the_extra(monkeypatch):
    hide(monkeypatch, "grain", forget=["eqxpar.data"])
    with pytest.raises(ImportError, match=r'eqxpar needs grain for eqxpar.data .*: pip install "eqxpar\[data\]"'):
        importlib.import_module("eqxpar.data")


def test_log_dir_without_tensorboardx_is_one_line_with_the_install_hint(monkeypatch, tmp_path, capsys):
    recipe = load_recipe("data_parallel")
    hide(monkeypatch, "tensorboardX")
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        recipe.main(["--steps", "1", "--log-dir", str(tmp_path / "logs")])
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert err == f"data_parallel.py: error: {HINT.format('tensorboardX', '--log-dir', 'recipes')}\n"


def test_flags_without_tyro_and_logs_without_tensorboardx_name_the_extra(monkeypatch, tmp_path):
    import eqxpar.recipe

    hide(monkeypatch, "tyro", "tensorboardX")
    recipe = load_recipe("three_ways")
    with pytest.raises(ImportError, match=r'eqxpar needs tyro for .*: pip install "eqxpar\[recipes\]"'):
        eqxpar.recipe.parse_flags(recipe.Config, [])
    with pytest.raises(ImportError, match=r'eqxpar needs tensorboardX for --log-dir: pip install "eqxpar\[recipes\]"'):
        eqxpar.recipe.RunLog(tmp_path / "logs", recipe.Config())
