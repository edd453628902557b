"""eqxpar's optional dependencies: a missing one is a one-line install hint, not a bare
`No module named ...`.

The extras of `pyproject.toml`: `data` (grain), `checkpoint` (orbax-checkpoint), `recipes`
(what every recipe imports: scikit-learn, tyro, rich, tensorboardX, grain and
orbax-checkpoint).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from types import ModuleType
from typing import Literal, overload

__all__ = ["MissingDependency", "missing", "require", "available"]


class MissingDependency(ImportError):
    """An optional dependency of eqxpar is not installed; the message is the install line.

    A subclass of `ImportError`: `except ImportError` still catches it. Inside
    [`eqxpar.recipe.flag_errors`][] it ends a recipe with that one line (exit status 2).
    """


def missing(package: str, extra: str, purpose: str) -> MissingDependency:
    """The error for a missing `package` (its PyPI name), installed by eqxpar's `extra`, that
    `purpose` (what needs it: a module, a flag) needs."""
    return MissingDependency(f'eqxpar needs {package} for {purpose}: pip install "eqxpar[{extra}]"')


def available(module: str) -> bool:
    """Whether `module` (a dotted name) can be imported, without importing it: a missing
    parent package, or a `None` in `sys.modules` (how tests hide a module), count as missing."""
    parts = module.split(".")
    if any(sys.modules.get(".".join(parts[: i + 1]), 0) is None for i in range(len(parts))):
        return False
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ModuleNotFoundError: a parent package is missing
        return False


@overload
def require(module: str, *, package: str, extra: str, purpose: str, load: Literal[True] = True) -> ModuleType: ...
@overload
def require(module: str, *, package: str, extra: str, purpose: str, load: Literal[False]) -> None: ...
def require(module: str, *, package: str, extra: str, purpose: str, load: bool = True) -> ModuleType | None:
    """Import `module`, or raise `MissingDependency` naming the install line.

    **Arguments:**

    - `module`: the module to import, e.g. `"orbax.checkpoint"`.
    - `package`: the distribution that provides it, e.g. `"orbax-checkpoint"`.
    - `extra`: eqxpar's extra that installs it, e.g. `"checkpoint"`.
    - `purpose`: what needs it, for the message (`"--checkpoint-dir"`).
    - `load`: `False` only checks that it can be imported (a cheap check before any work),
      and returns `None`.

    **Returns:**

    The module (or `None` with `load=False`).

    **Raises:**

    - `MissingDependency`: `eqxpar needs orbax-checkpoint for --checkpoint-dir: pip install "eqxpar[checkpoint]"`.
    """
    if not load:
        if not available(module):
            raise missing(package, extra, purpose)
        return None
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise missing(package, extra, purpose) from error
