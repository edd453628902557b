"""A training state's leaves: what is saved of each, what a restore target asks for, and the
checks that refuse bad input before anything is written or read."""

from __future__ import annotations

import json
import math
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jaxtyping import PyTree

from .._specs import entry_axes, pad_spec, path_str

__all__ = [
    "kind",
    "describe",
    "saved_arrays",
    "first_difference",
    "restore_target",
    "rebuild",
    "json_text",
    "first_line",
]


def is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def _key_impl(x: Any) -> str:
    """The PRNG implementation name of a key array or of an abstract key."""
    if isinstance(x, jax.Array):
        return str(jax.random.key_impl(x))
    found = []
    abstract = jax.ShapeDtypeStruct(x.shape, x.dtype)
    jax.eval_shape(lambda k: found.append(str(jax.random.key_impl(k))), abstract)
    return found[0]


def kind(x: Any) -> str:
    """`"key"` (a typed PRNG key), `"array"` (saved) or `"static"` (configuration)."""
    if is_key(x):
        return "key"
    if eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct):
        return "array"
    return "static"


def describe(path, leaf) -> dict[str, Any]:
    """One leaf's JSON description: path, kind, and for arrays/keys shape and dtype."""
    entry: dict[str, Any] = {"path": path_str(path), "kind": kind(leaf)}
    if entry["kind"] == "array":
        entry["shape"] = [int(d) for d in np.shape(leaf)]
        entry["dtype"] = str(np.dtype(leaf.dtype))
    elif entry["kind"] == "key":
        entry["shape"] = [int(d) for d in leaf.shape]
        entry["dtype"] = f"key<{_key_impl(leaf)}>"
    return entry


# -- saving ----------------------------------------------------------------------------------


def saved_arrays(state: PyTree) -> tuple[list, list[dict[str, Any]]]:
    """The arrays to write for `state` (keys as key data) and every leaf's description.

    **Raises:**

    - `ValueError` naming the leaf if one is traced, abstract or deleted (donated to a
      train step), or if `state` holds no arrays.
    """
    arrays, described = [], []
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        where = path_str(path)
        if isinstance(leaf, jax.core.Tracer):
            raise ValueError(
                f"maybe_save: the leaf at {where} is a traced value; call maybe_save outside "
                f"jit/shard_map, on the concrete state."
            )
        if isinstance(leaf, jax.ShapeDtypeStruct):
            raise ValueError(
                f"maybe_save: the leaf at {where} is an abstract ShapeDtypeStruct, which has no values to save."
            )
        if isinstance(leaf, jax.Array) and leaf.is_deleted():
            raise ValueError(
                f"maybe_save: the array at {where} has been deleted: its buffer was donated. "
                f"A train step donates its inputs, so after `model, opt_state, metrics = "
                f"step(model, opt_state, batch)` only the returned model and optimizer state "
                f"hold values: save those, not the ones passed in. Nothing was written."
            )
        entry = describe(path, leaf)
        described.append(entry)
        if entry["kind"] == "key":
            arrays.append(jax.random.key_data(leaf))
        elif entry["kind"] == "array":
            arrays.append(np.asarray(leaf) if isinstance(leaf, np.generic) else leaf)
    if not arrays:
        raise ValueError("maybe_save: the state holds no arrays; there is nothing to save.")
    return arrays, described


def json_text(data_state: Any) -> str:
    """`data_state` as JSON text, refusing values that would not come back unchanged."""
    try:
        text = json.dumps(data_state, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"maybe_save: data_state must be a JSON value (dicts with string keys, lists, "
            f"strings, finite numbers, booleans, None); {e}. For a grain DataLoader iterator "
            f"pass iterator.get_state().decode()."
        ) from None
    if json.loads(text) != data_state:
        raise ValueError(
            f"maybe_save: data_state {data_state!r} would not come back unchanged from JSON "
            f"(tuples become lists, non-string keys become strings). Use lists and string keys."
        )
    return text


# -- restoring -------------------------------------------------------------------------------


def _fmt(entry: dict[str, Any]) -> str:
    if entry["kind"] == "static":
        return "a non-array leaf"
    return f"shape {tuple(entry['shape'])} {entry['dtype']}"


def first_difference(saved: list[dict], target: list[dict], where: str) -> str | None:
    """A message naming the first leaf where saved and target differ, or None if they fit."""
    for i, (s, t) in enumerate(zip(saved, target)):
        if s["path"] != t["path"]:
            return (
                f"{where}: the saved state and the target differ in structure at leaf {i}: the "
                f"checkpoint has {s['path']} ({_fmt(s)}) where the target has {t['path']} "
                f"({_fmt(t)})."
            )
        if s["kind"] != t["kind"] or (s["kind"] != "static" and (s["shape"] != t["shape"] or s["dtype"] != t["dtype"])):
            return f"{where}: leaf {s['path']} differs: saved {_fmt(s)}, target {_fmt(t)}."
    if len(saved) != len(target):
        longer, name = (saved, "checkpoint") if len(saved) > len(target) else (target, "target")
        extra = longer[min(len(saved), len(target))]
        return (
            f"{where}: the saved state has {len(saved)} leaves and the target {len(target)}; "
            f"the first leaf only the {name} has is {extra['path']} ({_fmt(extra)})."
        )
    return None


def uncommitted(leaf: Any) -> bool:
    """A jax.Array that was never placed explicitly (e.g. `jnp.zeros`, or a jit output of
    such arrays): jit may move it to wherever a computation needs it."""
    return isinstance(leaf, jax.Array) and not leaf.committed


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_divides(shape: tuple[int, ...], sharding: Any, where: str) -> None:
    """Refuse a target sharding whose mesh axes do not divide the array's dimensions."""
    if not isinstance(sharding, NamedSharding):
        return
    for dim, entry in enumerate(pad_spec(sharding.spec, len(shape))):
        axes = entry_axes(entry)
        parts = math.prod(sharding.mesh.shape[a] for a in axes)
        if shape[dim] % parts:
            split = " x ".join(f"{a}={sharding.mesh.shape[a]}" for a in axes)
            fits = _divisors(shape[dim])[:12]
            raise ValueError(
                f"restore: the target mesh does not divide the leaf at {where}: its dimension "
                f"{dim} has size {shape[dim]}, split over {split} ({parts} parts). The checkpoint "
                f"is fine; restore onto a mesh whose {' x '.join(axes)} size divides "
                f"{shape[dim]} (one of {fits}), or give this leaf a spec that does not split "
                f"dimension {dim}."
            )


def restore_target(path, leaf) -> Any:
    """What orbax should restore one array/key leaf of `like` as (shape, dtype, sharding).

    **Raises:**

    - `ValueError` if an abstract leaf has no sharding, or its sharding's mesh does not
      divide its shape (naming the leaf, the dimension and the sizes that would).
    """
    where = path_str(path)
    if isinstance(leaf, (np.ndarray, np.generic)):
        return np.asarray(leaf)
    if uncommitted(leaf):
        # Read to the host; `rebuild` puts it on the default device without committing it.
        shape = jax.eval_shape(jax.random.key_data, leaf) if is_key(leaf) else leaf
        return np.empty(shape.shape, shape.dtype)
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        raise ValueError(
            f"restore target at {where} is a ShapeDtypeStruct without a sharding, so there is "
            f"no telling where to put the restored array. Give it one, e.g. "
            f"jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P())), or pass "
            f"concrete arrays already placed on the mesh (e.g. the freshly initialised state)."
        )
    _check_divides(tuple(leaf.shape), sharding, where)
    if is_key(leaf):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
        # A spec covers leading dimensions only, so the key's sharding also fits its data,
        # whose extra trailing dimension stays whole.
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)


def rebuild(like_leaves, treedef, saved: list[dict], arrays: list) -> PyTree:
    """The restored state: `like`'s structure and non-array leaves, the saved arrays."""
    values = iter(arrays)
    out = []
    for (_, leaf), entry in zip(like_leaves, saved):
        if entry["kind"] == "static":
            out.append(leaf)
            continue
        value = next(values)
        if uncommitted(leaf):  # uncommitted like the original, so jit may move it
            value = jax.device_put(value)
        if entry["kind"] == "key":
            value = jax.random.wrap_key_data(value, impl=entry["dtype"][len("key<") : -1])
        out.append(value[()] if isinstance(leaf, np.generic) else value)
    return jax.tree.unflatten(treedef, out)


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    line = text[0] if text else ""
    return line if len(line) <= 300 else line[:300] + "..."
