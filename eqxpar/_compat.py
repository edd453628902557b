"""The one place eqxpar touches JAX's private modules (`jax._src`).

Everything here is a small function with a stable meaning and a fallback, so that a JAX
release that moves the private name breaks only this file, visibly.
"""

from __future__ import annotations

import functools
import os


def backends_started() -> bool:
    """Whether JAX has already started its backends (any device listed or array made).

    Settings such as the CPU device count and `jax.distributed.initialize` must come before
    that. JAX has no public query for it.
    """
    from jax._src import xla_bridge

    return bool(getattr(xla_bridge, "_backends", {}))


def distributed_client():
    """The client of JAX's coordination service in this process, or `None` when not joined.

    Its key-value store (`key_value_set`, `blocking_key_value_get`, `key_value_dir_get`) is
    how the processes of a job tell each other about a failure. JAX has no public accessor.
    """
    from jax._src import distributed

    state = getattr(distributed, "global_state", None)
    return getattr(state, "client", None)


def forget_traced_constants() -> None:
    """Drop the arrays Equinox caches at module level while a function is traced.

    `eqx.nn.RotaryPositionalEmbedding` keeps its sine and cosine tables in a module-level
    dict (`equinox.nn._embedding.internal_rope_embedding_cache`, Equinox 0.13), computed
    under `jax.ensure_compile_time_eval`. Computed inside `shard_map`, they carry that
    `shard_map`'s mesh, and the next trace over another mesh (another step, the one-device
    side of a parity check) fails with "context mesh ... should match the aval mesh".
    `eqx.clear_caches()` would also clear every `eqx.filter_jit`'s compiled programs, so
    only this dict is emptied; without it (another Equinox), nothing to do.
    """
    try:
        from equinox.nn import _embedding
    except ImportError:
        return
    cache = getattr(_embedding, "internal_rope_embedding_cache", None)
    if isinstance(cache, dict):
        cache.clear()


def user_source_line(eqn) -> tuple[str, int] | None:
    """The `(file, line)` of the model's own code that made a jaxpr equation: the innermost
    frame of its traceback outside the installed JAX, jaxlib, Equinox, einops and eqxpar
    packages (by their install directories, not by folder names a user's project may
    share); None if it has none.

    Equations carry their Python traceback (`eqn.source_info.traceback`, a jaxlib object);
    JAX has no public accessor for it.
    """
    traceback = getattr(getattr(eqn, "source_info", None), "traceback", None)
    frames = getattr(traceback, "frames", None)
    if not frames:
        return None
    libraries = _library_dirs()
    for frame in frames:
        if not os.path.abspath(frame.file_name).startswith(libraries):
            return frame.file_name, frame.line_num
    return None


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    """The install directories of the packages whose frames are not the model's code."""
    import importlib.util

    dirs = []
    for name in ("jax", "jaxlib", "equinox", "einops", "eqxpar"):
        spec = importlib.util.find_spec(name)
        locations = spec.submodule_search_locations if spec is not None else None
        dirs.extend(os.path.join(os.path.abspath(location), "") for location in locations or ())
    return tuple(dirs)
