"""`eqxpar.models.whole_logits` and `generate` on a Llama (tied and untied head): the whole
vocabulary's logits from the split head equal one device's, and sampling gives the same
tokens on any mesh."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import eqxpar
from eqxpar.models import Llama, generate, llama_config, whole_logits


def _placed(llama, **sizes):
    mesh = eqxpar.make_mesh(**sizes)
    specs = eqxpar.nn.partition_specs(llama, mesh)
    return eqxpar.shard(llama, mesh, specs), mesh, specs


@pytest.mark.parametrize("tie", [False, True])
def test_llama_whole_logits_and_generate_equal_one_device(tie):
    config = llama_config("tiny", tie_embeddings=tie)
    model = Llama(config, key=jax.random.key(7))
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 12)).astype(np.int32)
    one = whole_logits(*_placed(model, data=1, model=1))
    split = whole_logits(*_placed(model, data=2, model=4))
    want, got = np.asarray(one(tokens)), np.asarray(split(tokens))
    assert want.shape == got.shape == (2, 12, config.vocab_size)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    prompt = tokens[0, :3]
    sampled = [generate(fn, prompt, 6, context_length=16, key=jax.random.key(1)) for fn in (one, split)]
    np.testing.assert_array_equal(sampled[0], sampled[1])
    assert len(sampled[0]) == 9 and (sampled[0][:3] == prompt).all()


def test_whole_logits_names_what_it_takes():
    with pytest.raises(ValueError, match="must be an eqxpar.models.GPT or Llama"):
        whole_logits(object(), eqxpar.make_mesh(model=1), None)
