"""Test set-up: 8 simulated CPU devices and the hypothesis profiles.

`make test` uses the `default` profile (few examples, deterministic, fast enough for CI on
two cores: compiles dominate, so strategies draw from small sets of shapes).
`HYPOTHESIS_PROFILE=thorough make test` draws many more examples with fresh randomness.
"""

import atexit
import os
import shutil
import tempfile

# One persistent compilation cache for the whole run: both xdist workers and every process a
# test starts (recipes, `eqxpar.launch` jobs) inherit this variable, so a program compiled
# once (the same recipe run whole, then half and resumed; the same shapes drawn by two
# properties) is read back instead of compiled again. Made by the first process (pytest
# itself, before its workers start), empty at the start of each run and removed at its end.
# A cached program is the same executable: results are bit for bit those of a fresh compile.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ and "PYTEST_XDIST_WORKER" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="eqxpar-tests-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)

# One eqxpar cache (the bundled corpus, the BPE trained on it, token stores) for the whole run,
# shared the same way: the language-model recipes' first run builds the default store, and every
# later run, worker and subprocess reuses it (a store is written atomically and reused only
# while its manifest matches). Nothing is written to the user's ~/.cache.
if "EQXPAR_CACHE" not in os.environ and "PYTEST_XDIST_WORKER" not in os.environ:
    _text_cache = tempfile.mkdtemp(prefix="eqxpar-tests-cache-")
    os.environ["EQXPAR_CACHE"] = _text_cache
    atexit.register(shutil.rmtree, _text_cache, ignore_errors=True)

# The tests' programs are tiny, so compiling them, not running them, is most of the suite's
# time, and LLVM's optimisation passes are most of a CPU compile: at -O0 the suite takes about
# a third less CPU (tests/test_models_options.py and test_llama.py: 166 s -> 106 s). Every
# process a test starts inherits it, so both sides of every comparison compile alike. HLO
# passes (collectives, fusion, buffer assignment, the bytes the inspect tests read) are
# untouched; only the machine code is less optimised.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

import eqxpar

# Before anything touches a JAX backend.
eqxpar.simulate_cpu_devices(8)

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, Phase, settings  # noqa: E402

# The library must not lean on implicit dtype promotion or rank broadcasting: under these
# settings a mixed-dtype op (float32 + bfloat16, int32 + float32 arrays) or an implicit
# broadcast between ranks (a (n,) with a (m, n)) raises, so every promotion in eqxpar is an
# explicit astype and every broadcast an explicit [..., None] or broadcast_to. The recipes run
# with JAX's defaults; library code works under both.
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


def _standard_promotion(fn):
    def wrapped(*args, **kwargs):
        with jax.numpy_dtype_promotion("standard"):
            return fn(*args, **kwargs)

    return wrapped


# Third-party code that promotes implicitly, scoped out of the strict setting one function at a
# time (so everything else, eqxpar's calls into optax included, stays strict):
# - optax's Adam/AdamW bias correction computes `1 - decay**count`, a Python float to the power
#   of the int32 step count (optax/tree_utils/_tree_math.py, tree_bias_correction; optax 0.2.8),
#   which strict promotion rejects. transform.py calls it as `optax.tree.bias_correction`.
import optax  # noqa: E402

optax.tree.bias_correction = _standard_promotion(optax.tree.bias_correction)
# - optax.MultiSteps's running mean divides the float gradient by the int32 step count
#   (`(grad - acc) / (n_acc + 1)`, optax/transforms/_accumulation.py; optax 0.2.8).
optax.MultiSteps.update = _standard_promotion(optax.MultiSteps.update)
# - jax.nn.dot_product_attention's XLA path takes bfloat16 queries to float32 logits by
#   `jnp.promote_types(query.dtype, np.float32)` and an einsum with a float32
#   preferred_element_type (jax/_src/nn/functions.py, _dot_product_attention_core; JAX 0.10.2),
#   and the einsum's transpose mixes float32 and bfloat16: bfloat16 attention fails under strict,
#   in the backward pass, which runs outside any wrapper of the forward call. So tests that
#   train in bfloat16 are marked `standard_promotion` and run under standard dtype promotion
#   (rank promotion stays "raise").

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


@pytest.fixture(autouse=True)
def _promotion(request):
    standard = request.node.get_closest_marker("standard_promotion") is not None
    allow_rank = request.node.get_closest_marker("allow_rank_promotion") is not None
    with (
        jax.numpy_dtype_promotion("standard" if standard else "strict"),
        jax.numpy_rank_promotion("allow" if allow_rank else "raise"),
    ):
        yield


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "standard_promotion: runs under jax_numpy_dtype_promotion='standard' instead of the "
        "suite's 'strict' (bfloat16 training: see the comment in conftest.py)",
    )
    config.addinivalue_line(
        "markers",
        "allow_rank_promotion: runs under jax_numpy_rank_promotion='allow' instead of the "
        "suite's 'raise': for code that is not eqxpar's (benchmarks/peer.py, plain JAX written as "
        "its users write it)",
    )
    config.addinivalue_line(
        "markers",
        "thorough: a heavy variant (another mesh, mode or size of a case the default run "
        "already covers); runs only under HYPOTHESIS_PROFILE=thorough",
    )


def pytest_collection_modifyitems(config, items):
    if THOROUGH:
        return
    skip = pytest.mark.skip(reason="heavy variant: HYPOTHESIS_PROFILE=thorough runs it")
    for item in items:
        if "thorough" in item.keywords:
            item.add_marker(skip)
