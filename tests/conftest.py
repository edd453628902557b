"""Test set-up: 8 simulated CPU devices and the hypothesis profiles.

`make test` uses the `default` profile (few examples, deterministic, fast enough for CI on
two cores: compiles dominate, so strategies draw from small sets of shapes).
`HYPOTHESIS_PROFILE=thorough make test` draws many more examples with fresh randomness.
"""

import os

import eqxpar

# Before anything touches a JAX backend.
eqxpar.simulate_cpu_devices(8)

import jax  # noqa: E402
from hypothesis import HealthCheck, Phase, settings  # noqa: E402

# The library must not lean on implicit dtype promotion or rank broadcasting: under these
# settings a mixed-dtype op (float32 + bfloat16, int32 + float32 arrays) or an implicit
# broadcast between ranks (a (n,) with a (m, n)) raises, so every promotion in eqxpar is an
# explicit astype and every broadcast an explicit [..., None] or broadcast_to. The recipes run
# with JAX's defaults; library code works under both.
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

settings.register_profile(
    "default",
    # 4: the suite grew to ~500 tests (pipeline, context parallelism, parallelize) and must
    # stay near 15 minutes on two cores; `thorough` draws 60 with fresh randomness.
    max_examples=4,
    deadline=None,
    derandomize=True,
    # No shrinking: a failing example is printed as drawn. Most properties compile a program
    # per example, so shrinking one failure took 3-5 minutes; the draw (and the pinned
    # @examples) already name a small case. `thorough` still shrinks.
    phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile(
    "thorough",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "thorough: a heavy variant (another mesh, mode or size of a case the default run "
        "already covers); runs only under HYPOTHESIS_PROFILE=thorough",
    )


def pytest_collection_modifyitems(config, items):
    if THOROUGH:
        return
    import pytest

    skip = pytest.mark.skip(reason="heavy variant: HYPOTHESIS_PROFILE=thorough runs it")
    for item in items:
        if "thorough" in item.keywords:
            item.add_marker(skip)
