"""parallelize says so when a plan splits nothing or leaves most parameters whole (issue 20:
the automatic plan split 0 of 17 layers of a ViT, silently): a warning naming the largest
whole layers and why, a ValueError with strict=True; a plan that splits most stays quiet."""

import warnings

import equinox as eqx
import jax
import pytest
import test_parallelize as tp

import eqxpar.nn


class Attention(eqx.Module):  # a ViT's own attention: Linears, not eqx.nn.MultiheadAttention
    qkv: eqx.nn.Linear
    proj: eqx.nn.Linear

    def __init__(self, dim, key):
        k1, k2 = jax.random.split(key)
        self.qkv = eqx.nn.Linear(dim, 3 * dim, key=k1)
        self.proj = eqx.nn.Linear(dim, dim, key=k2)


class TinyViT(eqx.Module):
    patch: eqx.nn.Conv2d
    norm: eqx.nn.LayerNorm
    attn: Attention
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.patch = eqx.nn.Conv2d(3, 8, kernel_size=2, stride=2, key=k1)
        self.norm = eqx.nn.LayerNorm(8)
        self.attn = Attention(8, k2)
        self.head = eqx.nn.Linear(8, 4, key=k3)


def test_a_plan_that_splits_nothing_warns_and_strict_raises():
    model = TinyViT(jax.random.key(0))
    with pytest.warns(UserWarning, match=r"the automatic plan splits 0 of 5 layers, 0% of the parameters") as record:
        eqxpar.nn.parallelize(model)
    text = str(record[0].message)
    assert "attn.qkv (Linear(8->24), 216 parameters), attn.proj (Linear(8->8), 72 parameters), head" in text, text
    assert "eqx.nn.Linear, which the automatic plan does not split" in text, text
    assert "patch (Conv2d, 104 parameters): Conv2d has no tensor-parallel form" in text, text
    with pytest.raises(ValueError, match=r"splits 0 of 5 layers.*\(strict=True\)"):
        eqxpar.nn.parallelize(model, strict=True)
    # The explicit plan the message suggests splits most of it: no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eqxpar.nn.parallelize(model, {"attn.qkv": "column_gathered", "head": "column"}, strict=True)


def test_a_plan_that_splits_most_is_quiet():
    model = tp.PlainLM(vocab=16, dim=8, heads=4, width=16, layers=2, bias=False, key=jax.random.key(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eqxpar.nn.parallelize(model, strict=True)
