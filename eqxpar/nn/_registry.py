"""`register_style`: a way in for layer classes `parallelize` does not know (attention and MLP
classes of other libraries, or a model's own), with the tensor-parallel form their author
writes."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

from ._base import TensorParallelLayer
from ._plan import REGISTERED, STYLES, Registered, Style

__all__ = ["register_style", "unregister_style", "convert_registered"]


def register_style(
    name: str,
    takes: type,
    convert: Callable[[Any, str], TensorParallelLayer],
    *,
    split: str,
    forward: tuple[str, ...] = ("all-reduce",),
    backward: tuple[str, ...] = ("all-reduce",),
    does: str = "",
    auto: bool = True,
    replace: bool = False,
) -> None:
    """Teach [`eqxpar.nn.parallelize`][] a new style: how to split layers of class `takes`.

    After `register_style("my_attention", MyAttention, to_parallel, split="num_heads")`, a
    plan can name the style (`{"blocks[*].attention": "my_attention"}`), and the automatic
    plan gives it to every `MyAttention` (with `auto=True`). `parallelize` then calls
    `convert(layer, axis_name)` for each such layer, and treats the result like its own
    tensor-parallel layers: [`eqxpar.nn.partition_specs`][] reads its `specs()`,
    [`eqxpar.nn.to_dense`][] (and so [`eqxpar.testing.check_parallel_parity`][]) its
    `to_dense()`. Write the parallel form from [`eqxpar.nn`][] layers (a
    [`eqxpar.nn.TensorParallelLayer`][] whose fields are `ColumnParallelLinear`s,
    `RowParallelLinear`s, ...: their specs and size checks come for free) and check it
    with `check_parallel_parity` before training.

    **Arguments:**

    - `name`: the style's name in plans; not one of the built-in styles.
    - `takes`: the dense layer class the style converts (an `eqx.Module` subclass).
    - `convert`: `convert(layer, axis_name) -> TensorParallelLayer`, the parallel form in
      global form (full-size arrays), whose `to_dense()` gives back a layer of the same
      structure as `layer`.
    - `split`: the attribute of a `takes` layer that the model axis must divide (e.g.
      `"num_heads"`), shown in the plan table.
    - `forward`, `backward`: the collectives the parallel form runs over the model axis
      (`eqxpar.inspect.COLLECTIVE_KINDS` spelling), for the plan table.
    - `does`: a few words for the plan table (default: the converter's name).
    - `auto`: whether [`eqxpar.nn.auto_plan`][] (and `parallelize(model)` without a plan)
      uses the style for every `takes` layer.
    - `replace`: allow registering `name` again (e.g. when a notebook cell runs twice).

    **Returns:**

    Nothing; the style is known to every later `parallelize` call in this process.

    **Raises:**

    - `ValueError` for a built-in or already-registered name (without `replace=True`), a
      `takes` that is not an `eqx.Module` class, a `convert` that is not callable or does
      not take `(layer, axis_name)`, or a `split` that is not a string.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_style: name must be a non-empty string, got {name!r}.")
    if name in STYLES and name not in REGISTERED:
        raise ValueError(f"register_style: {name!r} is a built-in style ({', '.join(STYLES)}); choose another name.")
    if name in REGISTERED and not replace:
        raise ValueError(
            f"register_style: a style named {name!r} is registered already (for "
            f"{REGISTERED[name].takes.__name__}); pass replace=True to register it again."
        )
    if not (isinstance(takes, type) and issubclass(takes, eqx.Module)):
        raise ValueError(f"register_style: takes must be an eqx.Module class, got {takes!r}.")
    if not callable(convert) or not _takes_two(convert):
        raise ValueError(
            f"register_style: convert must be a function convert(layer, axis_name) returning the "
            f"layer's tensor-parallel form, got {convert!r}."
        )
    if not isinstance(split, str):
        raise ValueError(f"register_style: split must name an attribute of {takes.__name__}, got {split!r}.")
    STYLES[name] = Style(
        takes.__name__, tuple(forward), tuple(backward), does or f"converted by {getattr(convert, '__name__', convert)}"
    )
    REGISTERED[name] = Registered(takes, convert, split, bool(auto))


def unregister_style(name: str) -> None:
    """Forget a style added with [`eqxpar.nn.register_style`][].

    **Raises:**

    - `ValueError` if no style of that name was registered (built-in styles stay).
    """
    if name not in REGISTERED:
        raise ValueError(f"unregister_style: no registered style {name!r}; registered: {sorted(REGISTERED) or 'none'}.")
    del REGISTERED[name]
    del STYLES[name]


def convert_registered(style: str, node: Any, axis_name: str) -> TensorParallelLayer:
    """The registered converter's result for `node`, checked: a tensor-parallel layer whose
    dense form has `node`'s structure (read from shapes only: nothing is computed)."""
    registered = REGISTERED[style]
    layer = registered.convert(node, axis_name)
    name = getattr(registered.convert, "__name__", repr(registered.convert))
    if not isinstance(layer, TensorParallelLayer):
        raise ValueError(
            f"the converter {name} of style {style!r} returned a {type(layer).__name__}, not an "
            f"eqxpar.nn.TensorParallelLayer: build the parallel form from eqxpar.nn layers (a "
            f"TensorParallelLayer subclass with to_dense)."
        )
    dense = eqx.filter_eval_shape(layer.to_dense)
    if jax.tree.structure(dense) != jax.tree.structure(eqx.filter_eval_shape(lambda: node)):
        raise ValueError(
            f"the converter {name} of style {style!r} returned a layer whose to_dense() is a "
            f"{type(dense).__name__} of another structure than the {type(node).__name__} it "
            f"converted: to_dense must give back the dense layer (check_parallel_parity and "
            f"checkpoints compare through it)."
        )
    return layer


def _takes_two(fn: Callable) -> bool:
    try:
        inspect.signature(fn).bind(None, "model")
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): let the call tell
        return True
    return True
