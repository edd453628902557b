"""Comparing PyTrees leaf by leaf, within float32's tolerances (`eqxpar.testing`'s
`assert_trees_close`, and the per-leaf errors its parity check reports)."""

from __future__ import annotations

import jax
import numpy as np
from jaxtyping import PyTree

from ._sharding import gather
from ._specs import path_str

__all__ = ["F32_RTOL", "F32_ATOL", "assert_trees_close", "leaf_errors"]

# float32 has a 2**-24 ~ 6e-8 unit roundoff. A parallel run adds the same numbers in a
# different order (a psum over shards instead of one long sum), which moves results by a
# few ulps per reduction level: 1e-5 relative leaves room for that and nothing more.
F32_RTOL = 1e-5
# Values that should be ~0 (a gradient entry that cancels) have no meaningful relative
# error; below 1e-6 absolute they count as equal.
F32_ATOL = 1e-6


def assert_trees_close(
    actual: PyTree,
    expected: PyTree,
    *,
    rtol: float = F32_RTOL,
    atol: float = F32_ATOL,
    what: str = "trees",
) -> None:
    """Assert two PyTrees have the same structure and allclose arrays, leaf by leaf.

    Sharded arrays are gathered first, so a parallel result can be compared with a
    single-device one directly. Non-array leaves must be equal.

    **Arguments:**

    - `actual`, `expected`: the two PyTrees.
    - `rtol`, `atol`: as in `numpy.testing.assert_allclose`; float32 defaults, see
      `F32_RTOL` / `F32_ATOL`.
    - `what`: a name for the trees in the failure message.

    **Returns:**

    Nothing.

    **Raises:**

    - `AssertionError` naming the first differing leaf's path, its largest absolute and
      relative error, and the tolerance.
    """
    a_leaves, a_def = jax.tree_util.tree_flatten_with_path(gather(actual))
    e_leaves, e_def = jax.tree_util.tree_flatten_with_path(gather(expected))
    if a_def != e_def:
        raise AssertionError(f"{what}: structures differ:\n  actual:   {a_def}\n  expected: {e_def}")
    checked = 0
    for (path, a), (_, e) in zip(a_leaves, e_leaves):
        where = f"{what} at {path_str(path)}"
        if not isinstance(a, np.ndarray):
            if a != e:
                raise AssertionError(f"{where}: {a!r} != {e!r}")
            continue
        if a.shape != e.shape or a.dtype != e.dtype:
            raise AssertionError(f"{where}: {a.shape} {a.dtype} vs expected {e.shape} {e.dtype}")
        checked += 1
        if a.dtype.kind in "biu":
            if not np.array_equal(a, e):
                raise AssertionError(f"{where}: integer arrays differ")
            continue
        a64, e64 = a.astype(np.float64), e.astype(np.float64)
        if not np.all(np.isfinite(a64) == np.isfinite(e64)):
            raise AssertionError(f"{where}: non-finite values in different places")
        err = np.abs(a64 - e64)
        bad = err > atol + rtol * np.abs(e64)
        if np.any(bad):
            i = np.unravel_index(np.argmax(np.where(bad, err, -1)), err.shape) if err.ndim else ()
            rel = err[i] / max(abs(e64[i]), 1e-300)
            raise AssertionError(
                f"{where}: {int(bad.sum())} of {err.size} entries differ beyond "
                f"rtol={rtol}, atol={atol}; worst at index {tuple(int(j) for j in i)}: "
                f"actual {a64[i]!r}, expected {e64[i]!r} (abs {err[i]:.3g}, rel {rel:.3g})"
            )
    if checked == 0:
        raise AssertionError(f"{what}: no arrays to compare")


def leaf_errors(actual: PyTree, expected: PyTree, rtol: float, atol: float) -> list[tuple[str, float, bool, str]]:
    """`(path, share of the tolerance used, within tolerance, detail)` for every float leaf."""
    a_leaves, a_def = jax.tree_util.tree_flatten_with_path(gather(actual))
    e_leaves, e_def = jax.tree_util.tree_flatten_with_path(gather(expected))
    if a_def != e_def:
        raise AssertionError(f"structures differ:\n  parallel: {a_def}\n  dense:    {e_def}")
    rows = []
    for (path, a), (_, e) in zip(a_leaves, e_leaves):
        if not isinstance(a, np.ndarray) or a.dtype.kind != "f":
            continue
        if a.shape != e.shape or a.size == 0:
            rows.append((path_str(path), np.inf, a.shape == e.shape, f"shape {a.shape} vs {e.shape}"))
            continue
        a64, e64 = a.astype(np.float64), e.astype(np.float64)
        used = np.abs(a64 - e64) / (atol + rtol * np.abs(e64))
        used = np.where(np.isnan(used), np.inf, used)  # a NaN on either side counts as off
        i = np.unravel_index(np.argmax(used), used.shape)
        bad = int(np.sum(used > 1))
        worst = tuple(int(j) for j in i)
        detail = f"{bad}/{used.size} entries off; worst at {worst}: parallel {a64[i]:.8g}, dense {e64[i]:.8g}"
        rows.append((path_str(path), float(used[i]), not bad, detail))
    return rows
