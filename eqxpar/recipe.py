"""Plumbing shared by the recipes: flags from a config dataclass, a progress bar, metrics JSON.

A recipe declares its settings as a dataclass, with a comment (or docstring) per field, and
lets [`eqxpar.recipe.parse_flags`][] turn every field into a command-line flag
(`batch_size` becomes `--batch-size`) and run the recipe's checks before anything compiles:

```python
@dataclasses.dataclass
class Config:
    devices: int = 8  # simulated CPU devices when there is no accelerator
    mesh: str = "auto"  # e.g. data=8; auto: the largest data axis the devices allow
    steps: int = 300  # training steps

def check_flags(cfg: Config) -> Config:  # raises ValueError, or returns the completed config
    eqxpar.recipe.require_positive(cfg, "steps")
    eqxpar.simulate_cpu_devices(cfg.devices)  # before JAX starts
    sizes = eqxpar.recipe.mesh_from_flag(cfg.mesh, {"data": 8})
    return dataclasses.replace(cfg, mesh=eqxpar.recipe.mesh_text(sizes))

cfg = eqxpar.recipe.parse_flags(Config, validate=check_flags)  # bad flags: one line, exit 2
```
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, NoReturn, TypeVar
from unittest import mock

import jax
from jaxtyping import PyTree

from ._mesh import fit_mesh, parse_mesh

__all__ = [
    "parse_flags",
    "flag_error",
    "flag_errors",
    "mesh_from_flag",
    "mesh_text",
    "require_positive",
    "progress",
    "write_metrics",
    "is_main_process",
    "CheckpointFlags",
    "GPTFlags",
    "check_gpt_flags",
    "speed_metrics",
    "parameter_digest",
    "Throughput",
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
    import tyro

    if not dataclasses.is_dataclass(config_cls):
        raise TypeError(f"parse_flags needs a dataclass, got {config_cls!r}")
    module = sys.modules.get(config_cls.__module__)
    prog = os.path.basename(getattr(module, "__file__", None) or sys.argv[0])
    if description is None:
        doc = (getattr(module, "__doc__", None) or "").strip()
        description = doc.splitlines()[0] if doc else None
    _PROG[:] = [prog]
    args = sys.argv[1:] if argv is None else list(argv)
    captured = io.StringIO()
    # A wide "terminal" while parsing: tyro's error box unwrapped, to read back as one line.
    wide = {} if {"-h", "--help"} & set(args) else {"COLUMNS": "100000"}
    try:
        with mock.patch.dict(os.environ, wide), contextlib.redirect_stderr(captured):
            cfg = tyro.cli(config_cls, args=args, prog=prog, description=description)
    except SystemExit as stop:
        if stop.code in (0, None):
            raise  # --help
        flag_error(_one_line(captured.getvalue()) or f"bad flags {args}", prog)
    if validate is not None:
        with flag_errors(prog):
            cfg = validate(cfg) or cfg
    return cfg


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

    For checks of the flags that can only run after `parse_flags` (e.g. after joining a
    multi-process job): `with eqxpar.recipe.flag_errors(): sizes = mesh_from_flag(...)`.
    """
    try:
        yield
    except ValueError as error:
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
                raise ValueError(f"--mesh {text}: {axis}={size} does not divide {what} {number}; use a {axis} size from {fits}.")
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
    bar = tqdm(iterable, total=total, desc=desc, disable=disable, **kwargs)
    if not interactive:
        # In a log, `set_postfix` must not redraw the bar on every call: the new numbers
        # show at the next (throttled) refresh instead.
        set_postfix = bar.set_postfix
        bar.set_postfix = lambda *args, refresh=False, **kw: set_postfix(*args, refresh=refresh, **kw)
    return bar


class Throughput:
    """Items (tokens, examples) per second over a training loop, leaving out its first step.

    The first step includes compiling; timing starts when it ends. Call `tick()` after each
    step has finished (e.g. after reading its loss, which waits for it).

    **Arguments:**

    - `per_step`: items each step processes (e.g. `batch_size * context` tokens).
    """

    def __init__(self, per_step: int):
        self.per_step = per_step
        self._started: float | None = None
        self._last: float | None = None
        self._steps = 0

    def tick(self) -> None:
        """Count one finished step."""
        self._last = time.perf_counter()
        if self._started is None:
            self._started = self._last
        else:
            self._steps += 1

    @property
    def per_second(self) -> float:
        """Items per second from the end of the first step to the end of the last one
        (NaN before a second step); what runs after the loop does not count."""
        if not self._steps:
            return float("nan")
        return self.per_step * self._steps / (self._last - self._started)


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


# -- The GPT recipes' speed flags -----------------------------------------------------------


@dataclasses.dataclass
class GPTFlags:
    """The flags of the GPT training recipes that choose how the model computes, not what:
    derive the recipe's `Config` from it (next to [`eqxpar.recipe.CheckpointFlags`][]), and
    check them with [`eqxpar.recipe.check_gpt_flags`][].

    - `--config NAME`: a named size of `eqxpar.models.GPT_CONFIGS` (10m, 124m, 1.3b) sets the
      recipe's `context`, `dim`, `heads` and `layers`; `custom` (default) keeps those flags.
    - `--dtype`: `float32`, or `bfloat16` compute on float32 master weights (the loss and
      the gradient sums stay float32): `cfg.precision()` is the [`eqxpar.train.Precision`][].
    - `--attention`, `--remat`, `--scan-layers`: the [`eqxpar.models.GPT`][] options
      `attention_impl`, `remat` and `scan_layers`.
    """

    # The comments are the flags' --help text (eqxpar.recipe.parse_flags reads them).
    config: str = "custom"  # a named GPT size (10m, 124m, 1.3b) in place of --context/--dim/--heads/--layers; custom: those flags
    dtype: str = "float32"  # compute dtype: float32, or bfloat16 (float32 master weights, float32 gradient sums)
    attention: str = "dot_product"  # dot_product (jax.nn.dot_product_attention, cuDNN flash attention on GPU) or reference
    remat: str = "none"  # what the backward pass recomputes: none, block, save_matmuls, or offload (matmul outputs kept in host memory; GPU/TPU)
    scan_layers: bool = False  # stack the blocks and run them with jax.lax.scan (one compiled block at any depth)

    def precision(self):
        """The [`eqxpar.train.Precision`][] of `--dtype`: `Precision()` (no change) for float32."""
        import jax.numpy as jnp

        from .train import Precision

        return Precision(compute_dtype=jnp.bfloat16 if self.dtype == "bfloat16" else None)


def check_gpt_flags(cfg: C) -> C:
    """Check a [`eqxpar.recipe.GPTFlags`][] config's flags; returns it with `--config` applied.

    Call it from the recipe's `validate`, after `eqxpar.simulate_cpu_devices` (`--remat
    offload` asks the backend whether it can offload) and before the checks of
    `context`, `dim`, `heads` and `layers` (a named `--config` sets them).

    **Arguments:**

    - `cfg`: the parsed config, an instance of a subclass of `GPTFlags` with `context`,
      `dim`, `heads` and `layers` fields.

    **Returns:**

    `cfg`, with the named size's shape in place of its own when `--config` is not `custom`.

    **Raises:**

    - `ValueError` naming the flag, its choices and the value given; for `--remat offload`
      on a backend without host offload, naming the backend and the other choices.
    """
    from .models import GPT_CONFIGS, gpt_config
    from .models._block import REMAT_CHOICES, remat_wrapper

    choices = {
        "config": ("custom", *GPT_CONFIGS),
        "dtype": ("float32", "bfloat16"),
        "attention": ("dot_product", "reference"),
        "remat": REMAT_CHOICES,
    }
    for name, allowed in choices.items():
        if getattr(cfg, name) not in allowed:
            raise ValueError(f"--{name} must be one of {', '.join(allowed)}, got {getattr(cfg, name)!r}.")
    try:
        remat_wrapper(cfg.remat)  # "offload": only where the backend can move arrays to the host
    except ValueError as error:
        raise ValueError(f"--remat {cfg.remat}: {error}") from None
    if cfg.config != "custom":
        cfg = dataclasses.replace(cfg, **dataclasses.asdict(gpt_config(cfg.config)))
    return cfg


def speed_metrics(tokens_per_second: float, flops_per_token: float, n_devices: int, dtype: str) -> dict[str, Any]:
    """A training run's speed, as the GPT recipes write it to `--metrics-out`.

    **Arguments:**

    - `tokens_per_second`: tokens trained per second, by all devices together.
    - `flops_per_token`: model FLOPs per trained token ([`eqxpar.models.gpt_flops_per_token`][]).
    - `n_devices`: the devices that share the work (the mesh's size).
    - `dtype`: the compute dtype's name (`--dtype`), for the peak the MFU is measured against.

    **Returns:**

    `{"tokens_per_second", "flops_per_token", "flops_per_second", "mfu"}`; `mfu` is a
    fraction of the devices' peak ([`eqxpar.inspect.mfu`][]), `None` where the peak is
    unknown (on CPU).
    """
    import jax.numpy as jnp

    from .inspect import mfu

    return {
        "tokens_per_second": tokens_per_second,
        "flops_per_token": flops_per_token,
        "flops_per_second": tokens_per_second * flops_per_token,
        # No rate (a one-step run: its step included the compile) and no peak: no MFU.
        "mfu": mfu(tokens_per_second, flops_per_token, n_devices, jax.devices()[0], jnp.dtype(dtype))
        if math.isfinite(tokens_per_second) else None,
    }


# -- Checkpointing a recipe's training run ------------------------------------------------


@dataclasses.dataclass
class CheckpointFlags:
    """The checkpoint flags of every training recipe: derive the recipe's `Config` from it.

    ```python
    @dataclasses.dataclass
    class Config(eqxpar.recipe.CheckpointFlags):
        steps: int = 500
        ...
    ```

    gives the recipe `--checkpoint-dir DIR`, `--checkpoint-every N` and `--resume`, which
    [`eqxpar.checkpoint.Checkpointer.from_config`][] reads:

    - `--checkpoint-dir DIR`: save the training state in `DIR` (default: no checkpoints).
    - `--checkpoint-every N`: every `N` steps, and at the last step (default 100).
    - `--resume`: continue from the newest complete checkpoint in `DIR`; start fresh when
      there is none. Without it, a `DIR` that holds checkpoints is an error (nothing is
      overwritten).
    """

    # The comments are the flags' --help text (eqxpar.recipe.parse_flags reads them).
    checkpoint_dir: str | None = None  # save checkpoints of the training state in this folder
    checkpoint_every: int = 100  # save a checkpoint every N steps (and at the last step)
    resume: bool = False  # continue from the newest checkpoint in --checkpoint-dir (start fresh if there is none)


def parameter_digest(tree: PyTree) -> str:
    """A SHA-256 digest of every array in `tree`: equal digests mean bitwise-equal arrays.

    Each array is gathered to the host first (whatever mesh or process holds it), so the
    digest depends on the values only, not on the layout. In a multi-process run every
    process must call it (gathering is a collective).

    **Arguments:**

    - `tree`: a PyTree, e.g. a model; non-array leaves are ignored, typed PRNG keys count
      by their key data.

    **Returns:**

    The hex digest: each array's path, dtype, shape and bytes, in tree order.
    """
    import hashlib

    import equinox as eqx
    import numpy as np

    from ._sharding import gather
    from ._specs import path_str

    def raw(x):
        if eqx.is_array(x) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.key_data(x)
        return x

    arrays = eqx.filter(jax.tree.map(raw, tree), eqx.is_array)
    digest = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(gather(arrays))[0]:
        if leaf is None:
            continue
        value = np.ascontiguousarray(leaf)
        digest.update(f"{path_str(path)} {value.dtype} {value.shape};".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()
