"""Plumbing shared by the recipes: flags from a config dataclass, a progress bar, metrics JSON.

A recipe declares its settings as a dataclass and lets [`eqxpar.recipe.parse_flags`][] turn
every field into a command-line flag (`batch_size` becomes `--batch-size`):

```python
@dataclasses.dataclass
class Config:
    devices: int = 8          # simulated CPU devices when there is no accelerator
    mesh: str = "data=8"
    steps: int = 300
    metrics_out: str | None = None

cfg = eqxpar.recipe.parse_flags(Config)
eqxpar.simulate_cpu_devices(cfg.devices)   # before JAX starts
```
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

import jax

__all__ = ["parse_flags", "progress", "write_metrics", "is_main_process"]

C = TypeVar("C")


def _flag_type(tp: Any):
    """The argparse type for a dataclass field annotation (int, float, str, bool, X | None)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return _flag_type(args[0])
    if tp in (int, float, str, bool):
        return tp
    raise TypeError(f"recipe config fields must be int, float, str, bool or X | None; got {tp}")


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def parse_flags(config_cls: type[C], argv: Sequence[str] | None = None, description: str | None = None) -> C:
    """Build a config dataclass from command-line flags, one flag per field.

    Field `batch_size: int = 64` becomes `--batch-size N` (default 64). Booleans take
    `--flag` / `--no-flag`. The field's `metadata["help"]`, if any, is the flag's help.

    **Arguments:**

    - `config_cls`: a dataclass whose fields all have defaults.
    - `argv`: the arguments to parse. Default: `sys.argv[1:]`.
    - `description`: the `--help` text. Default: the calling script's docstring first line.

    **Returns:**

    An instance of `config_cls` with the defaults overridden by the flags given.
    """
    if not dataclasses.is_dataclass(config_cls):
        raise TypeError(f"parse_flags needs a dataclass, got {config_cls!r}")
    hints = typing.get_type_hints(config_cls)
    if description is None:
        main = sys.modules.get("__main__")
        doc = (getattr(main, "__doc__", None) or "").strip()
        description = doc.splitlines()[0] if doc else None
    parser = argparse.ArgumentParser(description=description)
    for field in dataclasses.fields(config_cls):
        flag = "--" + field.name.replace("_", "-")
        tp = _flag_type(hints[field.name])
        default = field.default
        if default is dataclasses.MISSING:
            raise TypeError(f"config field {field.name!r} needs a default")
        helptext = field.metadata.get("help", "") + f" (default: {default})"
        if tp is bool:
            parser.add_argument(
                flag, dest=field.name, default=default, action=argparse.BooleanOptionalAction, help=helptext
            )
        else:
            parser.add_argument(flag, dest=field.name, type=tp, default=default, help=helptext)
    ns = parser.parse_args(argv)
    return config_cls(**vars(ns))


def is_main_process() -> bool:
    """True in process 0 (and in every single-process run): the one that prints and writes."""
    return jax.process_index() == 0


def progress(iterable: Iterable, *, total: int | None = None, desc: str = "train", **kwargs):
    """A progress bar over `iterable`, shown by process 0 only.

    **Arguments:**

    - `iterable`: what to iterate over (usually `range(steps)`).
    - `total`: its length, if `len()` does not give it.
    - `desc`: the bar's label.
    - `**kwargs`: passed on to `tqdm.tqdm`.

    **Returns:**

    A `tqdm` iterator; call `.set_postfix(loss=...)` on it to show metrics. When stderr is
    not a terminal (CI, logs) it refreshes at most every few seconds.
    """
    from tqdm.auto import tqdm

    interactive = sys.stderr.isatty()
    kwargs.setdefault("mininterval", 0.1 if interactive else 5.0)
    kwargs.setdefault("dynamic_ncols", True)
    disable = kwargs.pop("disable", False) or not is_main_process()
    return tqdm(iterable, total=total, desc=desc, disable=disable, **kwargs)


def write_metrics(path: str | os.PathLike | None, metrics: Mapping[str, Any]) -> None:
    """Write a recipe's results as JSON (process 0 only); does nothing when `path` is None.

    **Arguments:**

    - `path`: where to write, or `None`. Parent folders are created.
    - `metrics`: JSON-serialisable values; NumPy/JAX scalars are converted.

    **Returns:**

    Nothing.
    """
    if path is None or not is_main_process():
        return

    def plain(x):
        if hasattr(x, "item") and getattr(x, "ndim", 1) == 0:
            return x.item()
        if hasattr(x, "tolist"):
            return x.tolist()
        raise TypeError(f"cannot write {type(x)} to JSON")

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(dict(metrics), f, indent=2, default=plain)
        f.write("\n")
    os.replace(tmp, path)
