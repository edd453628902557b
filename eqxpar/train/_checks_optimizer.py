"""The optimizer against the model, checked abstractly before anything compiles (see
`_checks.py`): a weight-decay mask made for another model is named."""

from __future__ import annotations

import inspect
from typing import Any

import equinox as eqx
import jax
from jaxtyping import PyTree

from .._specs import path_str


def _closure_masks(fn: Any, seen: set, depth: int = 0) -> list:
    """The `mask` arguments of the optax.masked transformations (optax.adamw(mask=...),
    optax.masked(...)) inside an optimizer's `init`, found through the closures."""
    if depth > 12 or id(fn) in seen:
        return []
    seen.add(id(fn))
    if hasattr(fn, "init") and hasattr(fn, "update") and not inspect.isfunction(fn):
        return _closure_masks(fn.init, seen, depth + 1)
    if isinstance(fn, (tuple, list)):
        return [m for f in fn for m in _closure_masks(f, seen, depth + 1)]
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or not cells:
        return []
    found = []
    for name, cell in zip(code.co_freevars, cells):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if name == "mask" and value is not None:
            found.append(value)
        elif callable(value) or isinstance(value, (tuple, list)):
            found.extend(_closure_masks(value, seen, depth + 1))
    return found


def _mask_mismatch(mask: PyTree, params: PyTree) -> str | None:
    """Where a mask (the params' structure, or a prefix of it) does not fit `params`."""
    mask_paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(mask)[0]]
    param_paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]

    def covered(path) -> bool:
        return any(path[: len(m)] == m for m in mask_paths)

    for path in param_paths:
        if not covered(path):
            return f"the model's parameter model{path_str(path)} has no entry in the mask"
    for m in mask_paths:
        if not any(p[: len(m)] == m for p in param_paths):
            return f"the mask has an entry at {path_str(m)}, where the model has no parameter"
    if jax.tree.structure(mask) != jax.tree.structure(params):
        try:
            jax.tree.map(lambda _m, _p: None, mask, params)
        except (ValueError, TypeError) as error:
            first = str(error).strip().splitlines()[0]
            return f"the mask's structure differs from the model's ({first} ...)"
    return None


def check_optimizer_fits(who: str, optimizer: Any, model: PyTree) -> None:
    """`optimizer.init` must accept the model's parameters, checked abstractly (nothing
    compiles): a weight-decay mask (`optax.adamw(mask=...)`, `optax.masked`) made for
    another model would otherwise fail with a bare pytree error after the model was
    placed and compiled pieces of it."""
    params = eqx.filter(model, eqx.is_inexact_array)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    try:
        jax.eval_shape(optimizer.init, abstract)
    except (ValueError, TypeError) as error:
        fix = (
            "Build the mask from the parameters the step trains, e.g. "
            "optax.adamw(lr, mask=lambda params: jax.tree.map(lambda x: x.ndim > 1, params)) "
            "(a function of the parameters always fits), or a tree made from "
            "eqx.filter(model, eqx.is_inexact_array) of this model."
        )
        for mask in _closure_masks(optimizer, set()):
            leaves = jax.tree.leaves(jax.tree.map(callable, mask))
            tree = mask(abstract) if leaves and all(leaves) else mask  # as optax.masked decides
            where = _mask_mismatch(tree, abstract)
            if where is not None:
                raise ValueError(
                    f"{who}: the optimizer's weight-decay mask does not fit the model: {where}. "
                    f"A mask must have the structure of the model's floating-point parameters "
                    f"(eqx.filter(model, eqx.is_inexact_array)) or a prefix of it. {fix}"
                ) from None
        first = str(error).strip().splitlines()[0]
        raise ValueError(
            f"{who}: optimizer.init fails on the model's parameters (eqx.filter(model, "
            f"eqx.is_inexact_array)), so the optimizer does not fit this model: "
            f"{type(error).__name__}: {first}. Any tree the optimizer was built with (a mask, "
            f"per-parameter learning rates, optax.multi_transform labels) must have the "
            f"parameters' structure. {fix}"
        ) from error
