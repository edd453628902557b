"""The Llama presets have the published models' parameter counts, and the FLOPs formula
counts the matmuls the model has (built abstractly: no weights are allocated)."""

import math

import equinox as eqx
import jax
import numpy as np
import pytest

from eqxpar.models import Llama, llama_config, llama_flops_per_token, llama_matmul_params, rope_frequencies


def abstract_params(name: str, **changes) -> tuple[Llama, int]:
    model = eqx.filter_eval_shape(Llama, llama_config(name, **changes), key=jax.random.key(0))
    return model, sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(model))


@pytest.mark.parametrize(
    "name, published",
    [
        # Hugging Face's safetensors metadata of each checkpoint: total parameters.
        ("llama-3.2-1b", 1_235_814_400),
        ("llama-3-8b", 8_030_261_248),
    ],
)
def test_presets_have_the_published_parameter_counts(name, published):
    # One and two layers built abstractly; the difference is one layer's parameters.
    _, one = abstract_params(name, num_layers=1)
    _, two = abstract_params(name, num_layers=2)
    assert one + (llama_config(name).num_layers - 1) * (two - one) == published


@pytest.mark.parametrize("name", ["tiny", "llama-3.2-1b"])
def test_matmul_params_are_the_weights_that_multiply(name):
    model, total = abstract_params(name, num_layers=2)
    config = model.config
    norms = (2 * config.num_layers + 1) * config.dim
    embedding = config.vocab_size * config.dim
    head_counted_twice = embedding if config.tie_embeddings else 0  # the tied head multiplies too
    assert llama_matmul_params(model) == total - norms - embedding + head_counted_twice


def test_flops_are_six_n_plus_the_attention_term():
    config = llama_config("llama-3-8b")
    n = llama_matmul_params(config)
    assert n == 7_504_658_432  # 8.03B minus the embedding table and the norms
    t = 8192
    assert llama_flops_per_token(config) == 6 * n + 12 * 32 * t * 4096
    assert llama_flops_per_token(config, 2048, backward=False) == 2 * n + 4 * 32 * 2048 * 4096


def test_llama3_scaling_keeps_high_slows_low_and_blends_between():
    config = llama_config("llama-3.2-1b")
    plain = rope_frequencies(64, 500000.0)
    scaled = rope_frequencies(64, 500000.0, config.scaling)
    wavelength = 2 * np.pi / plain
    high, low = wavelength < 8192 / 4.0, wavelength > 8192 / 1.0
    np.testing.assert_array_equal(scaled[high], plain[high])
    np.testing.assert_allclose(scaled[low], plain[low] / 32.0, rtol=1e-6)
    between = ~high & ~low
    assert between.any() and np.all(scaled[between] < plain[between]) and np.all(scaled[between] > plain[between] / 32)
