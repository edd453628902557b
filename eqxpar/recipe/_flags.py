"""The recipes' command line: flags from a config dataclass, checked before anything compiles."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import io
import math
import os
import re
import sys
import tomllib
import types
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NoReturn, TypeVar
from unittest import mock

import jax

from .._mesh import fit_mesh, parse_mesh
from .._optional import MissingDependency, require
from ._log import LogFlags, check_log_flags
from ._output import is_main_process

__all__ = [
    "parse_flags",
    "flag_error",
    "flag_errors",
    "mesh_from_flag",
    "mesh_text",
    "require_positive",
    "CheckpointFlags",
]

C = TypeVar("C")

# The program name `flag_errors` reports, set by the last `parse_flags`.
_PROG: list[str] = []


def parse_flags(
    config_cls: type[C],
    argv: Sequence[str] | None = None,
    *,
    validate: Callable[[C], C | None] | None = None,
    description: str | None = None,
) -> C:
    """Build a recipe's config dataclass from command-line flags, then check it.

    The flags come from [tyro](https://brentyi.github.io/tyro/): field `batch_size: int = 64`
    becomes `--batch-size INT`, a `bool` field `--flag` / `--no-flag`, and the comment after
    a field (or the docstring under it) is its `--help` text. Flags are never abbreviated.
    A mistake (an unknown flag, a value of the wrong type, a `ValueError` from `validate`)
    ends the program before anything compiles: one line `recipe.py: error: ...` on stderr,
    exit status 2.

    `--config-file run.toml` (every recipe has it) reads flag values from a TOML file: its
    keys are the field names (`batch_size = 32`, or `batch-size`), and the flags given on the
    command line override them. An unknown key or a value of the wrong type is one line and
    exit status 2, as a bad flag is.

    **Arguments:**

    - `config_cls`: a dataclass whose fields all have defaults.
    - `argv`: the arguments to parse. Default: `sys.argv[1:]`.
    - `validate`: the recipe's checks of the whole config, run after parsing: it raises
      `ValueError` naming the flag and the fix, and may return a completed config (e.g.
      with `--mesh auto` resolved), which is then returned instead.
    - `description`: the first line of `--help`. Default: the first line of the docstring
      of the module that defines `config_cls`.

    **Returns:**

    An instance of `config_cls` with the defaults overridden by the flags given.
    """
    tyro = require("tyro", package="tyro", extra="recipes", purpose="the recipes' flags (eqxpar.recipe.parse_flags)")

    if not dataclasses.is_dataclass(config_cls):
        raise TypeError(f"parse_flags needs a dataclass, got {config_cls!r}")
    module = sys.modules.get(config_cls.__module__)
    prog = os.path.basename(getattr(module, "__file__", None) or sys.argv[0])
    if description is None:
        doc = (getattr(module, "__doc__", None) or "").strip()
        description = doc.splitlines()[0] if doc else None
    _PROG[:] = [prog]
    args = sys.argv[1:] if argv is None else list(argv)
    args, default = _config_file(config_cls, args, prog)  # --config-file FILE: the file's values
    args = _renamed(config_cls, args, prog)  # --config NAME: now --model-size NAME
    description = f"{description or ''}\n{CONFIG_FILE_HELP}".strip()
    captured = io.StringIO()
    # A wide "terminal" while parsing: tyro's error box unwrapped, to read back as one line.
    wide = {} if {"-h", "--help"} & set(args) else {"COLUMNS": "100000"}
    try:
        with mock.patch.dict(os.environ, wide), contextlib.redirect_stderr(captured):
            cfg: C = tyro.cli(config_cls, args=args, prog=prog, description=description, default=default)
    except SystemExit as stop:
        if stop.code in (0, None):
            raise  # --help
        flag_error(_one_line(captured.getvalue()) or f"bad flags {args}", prog)
    if isinstance(cfg, LogFlags):
        with flag_errors(prog):
            check_log_flags(cfg)
    if validate is not None:
        with flag_errors(prog):
            cfg = validate(cfg) or cfg
    return cfg


CONFIG_FILE_HELP = (
    "--config-file FILE.toml: flag values from a TOML file, its keys the flags' names (batch_size = 32); "
    "flags given on the command line override them."
)


def _config_file(config_cls: type[C], args: list[str], prog: str) -> tuple[list[str], C | None]:
    """`args` without `--config-file PATH`, and the config its TOML file sets (`None`: no file).

    Keys are the dataclass's field names (dashes read as underscores); an unknown key or a
    value of the wrong type ends the program as a bad flag does."""
    rest, path, i = [], None, 0
    while i < len(args):
        if args[i] == "--config-file":
            if i + 1 == len(args):
                flag_error("--config-file needs a path: a TOML file of flag values (batch_size = 32).", prog)
            path, i = args[i + 1], i + 2
            continue
        if args[i].startswith("--config-file="):
            path = args[i].partition("=")[2]
        else:
            rest.append(args[i])
        i += 1
    if path is None:
        return rest, None
    try:
        with open(path, "rb") as f:
            values = tomllib.load(f)
    except OSError as error:
        flag_error(f"--config-file {path}: {error.strerror or error}.", prog)
    except tomllib.TOMLDecodeError as error:
        flag_error(f"--config-file {path} is not valid TOML: {error}.", prog)
    hints = typing.get_type_hints(config_cls)
    names = [f.name for f in dataclasses.fields(config_cls) if f.init]  # type: ignore[arg-type]
    settings = {}
    for key, value in values.items():
        name = key.replace("-", "_")
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            flag_error(f"--config-file {path}: unknown key {key!r}{hint}; the keys are the flags' names.", prog)
        try:
            settings[name] = _file_value(hints[name], value)
        except ValueError as error:
            flag_error(f"--config-file {path}: {key} = {value!r}: {error}", prog)
    return rest, config_cls(**settings)


# Old flag spellings: old -> (new, the field the new one sets). Still read, with a warning.
RENAMED_FLAGS = {"--config": ("--model-size", "model_size")}


def _renamed(config_cls: Any, args: list[str], prog: str) -> list[str]:
    """`args` with renamed flags in their new spelling, each saying so on stderr."""
    fields = {f.name for f in dataclasses.fields(config_cls)}
    out = []
    for arg in args:
        old, eq, value = arg.partition("=")
        if old in RENAMED_FLAGS and RENAMED_FLAGS[old][1] in fields:
            new = RENAMED_FLAGS[old][0]
            print(f"{prog}: warning: {old} is now {new} (a named model size); {old} will go", file=sys.stderr)
            arg = f"{new}{eq}{value}"
        out.append(arg)
    return out


def _file_value(hint: Any, value: Any) -> Any:
    """`value` from a TOML file as the field typed `hint` takes it, or `ValueError`."""
    origin, options = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        if value not in options:
            raise ValueError(f"must be one of {', '.join(map(str, options))}.")
        return value
    if origin in (types.UnionType, typing.Union):
        for option in (o for o in options if o is not type(None)):
            try:
                return _file_value(option, value)
            except ValueError:
                pass
        kinds = [getattr(o, "__name__", str(o)) for o in options if o is not type(None)]
        raise ValueError(f"must be of type {' or '.join(kinds)}.")
    expected = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}.get(hint)
    if expected is None:
        return value
    if not isinstance(value, expected) or (hint is not bool and isinstance(value, bool)):
        raise ValueError(f"must be of type {hint.__name__}.")
    return hint(value)


def _one_line(boxed: str) -> str:
    """tyro's boxed error message as one line: its first section, and any flags it suggests."""
    sections: list[list[str]] = [[]]
    for line in re.sub(r"\x1b\[[0-9;]*m", "", boxed).splitlines():
        line = line.strip()
        if line[:1] in "╭╰":  # the box's top (with its title) and bottom; or a blank line
            continue
        line = line.strip("│").strip()
        if set(line) <= set("─ "):  # a rule between two sections
            sections.append([])
            continue
        sections[-1].append(line)
    message = " ".join(sections[0])
    for section in sections[1:]:
        if section and section[0].startswith("Perhaps you meant"):
            flags = [line.split()[0] for line in section[1:] if line.startswith("-")]
            message += f" (did you mean {' or '.join(flags)}?)" if flags else ""
    return message


def flag_error(message: str, prog: str | None = None) -> NoReturn:
    """End the program as a bad command line does: `prog: error: message` (one line) on stderr,
    exit status 2. `prog` defaults to the program the last `parse_flags` parsed for."""
    prog = prog or (_PROG[0] if _PROG else os.path.basename(sys.argv[0]))
    print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    raise SystemExit(2)


@contextlib.contextmanager
def flag_errors(prog: str | None = None):
    """Within it, a `ValueError` ends the program as a bad flag: see [`eqxpar.recipe.flag_error`][].
    So does a missing optional dependency that a flag needs (orbax-checkpoint for
    `--checkpoint-dir`): one line with the `pip install` that adds it.

    For checks of the flags that can only run after `parse_flags` (e.g. after joining a
    multi-process job): `with eqxpar.recipe.flag_errors(): sizes = mesh_from_flag(...)`.
    """
    try:
        yield
    except (ValueError, MissingDependency) as error:  # a bad flag, or a flag's missing dependency
        flag_error(str(error), prog)


def mesh_from_flag(
    text: str,
    auto: Mapping[str, int],
    *,
    divides: Mapping[str, Mapping[str, int]] | None = None,
    optional: Collection[str] = (),
    any_names: bool = False,
) -> dict[str, int]:
    """The axis sizes a recipe's `--mesh` asks for, checked against the devices there are.

    `"auto"` picks (and prints) the mesh of `auto`'s axes that uses the most devices
    (`eqxpar.fit_mesh`); anything else is parsed as `"data=2,model=4"`. It counts the
    devices, so JAX starts here: simulate CPU devices (or join a multi-process job) first.

    **Arguments:**

    - `text`: the flag's value.
    - `auto`: the recipe's axes and their sizes on 8 devices, in mesh order.
    - `divides`: axis name to `{what: number}` its size must divide (`{"model": {"--heads": 8}}`).
    - `optional`: axes of `auto` that `text` may leave out.
    - `any_names`: accept any axis names (the recipe checks them; `divides` then only
      guides `"auto"`).

    **Returns:**

    An ordered dict of axis name to size, ready for [`eqxpar.make_mesh`][].

    **Raises:**

    - `ValueError` if `text` does not parse, names other axes than `auto`'s, has a size
      that does not divide a number of `divides`, or needs more devices than there are.
    """
    divides = {axis: dict(numbers) for axis, numbers in (divides or {}).items() if numbers}
    count = jax.device_count()
    if text.strip() == "auto":
        sizes = fit_mesh(auto, count, divides={a: math.gcd(*n.values()) for a, n in divides.items()})
        if is_main_process():
            print(f"--mesh auto: {mesh_text(sizes)} ({math.prod(sizes.values())} of {count} devices)", flush=True)
        return sizes
    sizes = parse_mesh(text)
    required = [a for a in auto if a not in optional]
    if not any_names and (set(sizes) - set(auto) or set(required) - set(sizes)):
        extra = f", optionally {' and '.join(map(repr, optional))}" if optional else ""
        raise ValueError(
            f"--mesh {text}: this recipe's mesh has the axes {' and '.join(map(repr, required))}{extra} "
            f"(e.g. --mesh {mesh_text(auto)}, or --mesh auto)."
        )
    for axis, size in sizes.items() if not any_names else ():
        for what, number in divides.get(axis, {}).items():
            if number % size:
                fits = [d for d in range(1, number + 1) if number % d == 0]
                raise ValueError(
                    f"--mesh {text}: {axis}={size} does not divide {what} {number}; choose {axis} from {fits}."
                )
    if math.prod(sizes.values()) > count:
        need = math.prod(sizes.values())
        raise ValueError(
            f"--mesh {text} needs {need} devices but there are {count}: use --mesh auto, sizes "
            f"whose product is at most {count}, or (on CPU) --devices {need}."
        )
    return sizes


def require_positive(cfg: Any, *fields: str) -> None:
    """A `ValueError` naming the first of `fields` below 1 as its flag: "--steps must be at least 1, got 0."."""
    for name in fields:
        value = getattr(cfg, name)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}.")


def mesh_text(sizes: Mapping[str, int]) -> str:
    """`{"data": 2, "model": 4}` as `"data=2,model=4"`: the form `--mesh` takes."""
    return ",".join(f"{axis}={size}" for axis, size in sizes.items())


@dataclasses.dataclass
class CheckpointFlags:
    """The checkpoint flags of every training recipe: derive the recipe's `Config` from it.

    ```python
    @dataclasses.dataclass
    class Config(eqxpar.recipe.CheckpointFlags):
        steps: int = 500
        ...
    ```

    gives the recipe `--checkpoint-dir DIR`, `--checkpoint-every N`, `--resume` and
    `--watchdog-s S`, which [`eqxpar.checkpoint.Checkpointer.from_config`][] reads:

    - `--checkpoint-dir DIR`: save the training state in `DIR` (default: no checkpoints).
    - `--checkpoint-every N`: every `N` steps, and at the last step (default 100).
    - `--resume`: continue from the newest complete checkpoint in `DIR`; start fresh when
      there is none. Without it, a `DIR` that holds checkpoints is an error (nothing is
      overwritten). On SIGTERM a run with `DIR` saves its current step and stops (status
      143); `--resume` continues it.
    - `--watchdog-s S`: when no training step finishes for `S` seconds (the first one's
      compilation included), every process prints its Python stacks and the job ends
      (default 900; 0 turns it off). See [`eqxpar.distributed.Watchdog`][].
    """

    # The comments are the flags' --help text (eqxpar.recipe.parse_flags reads them).
    checkpoint_dir: str | None = None  # save checkpoints of the training state in this folder
    checkpoint_every: int = 100  # save a checkpoint every N steps (and at the last step)
    resume: bool = False  # continue from the newest checkpoint in --checkpoint-dir (start fresh if there is none)
    watchdog_s: float = 900.0  # end the job, printing every process's stacks, when no step ends for this long (0: off)
