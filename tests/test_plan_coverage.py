"""parallelize says so when a plan splits nothing or leaves more than half of the parameter
bytes whole (issues 20 and 41: the automatic plan split 0 of 17 layers of a ViT with its own
attention class, silently): a warning naming the classes it could not plan, the largest whole
layers and why, and eqxpar.nn.register_style; a ValueError with the same text with
strict=True; a plan that splits most stays quiet."""

import warnings

import equinox as eqx
import jax
import pytest
import test_parallelize as tp
from _plain_layers import DIM, FusedAttention, fused_attention_registered

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
    headline = r"the automatic plan splits 0 of 5 layers, 0% of the parameter bytes"
    with pytest.warns(UserWarning, match=headline) as record:
        eqxpar.nn.parallelize(model)
    text = str(record[0].message)
    # The classes it could not plan, most whole bytes first: the ViT's own attention holds
    # the Linears it does not recognise; and the hook that teaches it such a class.
    assert "Classes it could not plan, most whole bytes first: Attention (at attn), Conv2d (at patch)" in text, text
    assert "eqxpar.nn.register_style(name, Attention, convert, split=...)" in text, text
    assert "attn.qkv (Linear(8->24), 216 parameters), attn.proj (Linear(8->8), 72 parameters), head" in text, text
    assert "eqx.nn.Linear, which the automatic plan does not split" in text, text
    assert "patch (Conv2d, 104 parameters): Conv2d has no tensor-parallel form" in text, text
    with pytest.raises(ValueError, match=r"splits 0 of 5 layers.*\(strict=True\)") as raised:
        eqxpar.nn.parallelize(model, strict=True)
    assert str(raised.value) == text + " (strict=True)"
    # The explicit plan the message suggests splits most of it: no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eqxpar.nn.parallelize(model, {"attn.qkv": "column_gathered", "head": "column"}, strict=True)


def test_a_plan_that_splits_most_is_quiet():
    model = tp.PlainLM(vocab=16, dim=8, heads=4, width=16, layers=2, bias=False, key=jax.random.key(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eqxpar.nn.parallelize(model, strict=True)


class Block(eqx.Module):
    attn: FusedAttention  # another library's attention: one fused q/k/v Linear
    mlp: eqx.nn.MLP

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.attn = FusedAttention(key=k1)
        self.mlp = eqx.nn.MLP(DIM, DIM, 16, depth=1, key=k2)


def test_a_plan_that_leaves_most_bytes_in_an_unknown_attention_class_warns_until_it_is_registered():
    """The MLPs split (2 of 6 layers) but the attention class, 80% of the bytes, stays
    whole: the warning names that class and register_style; once registered, it is quiet."""
    blocks = [Block(k) for k in jax.random.split(jax.random.key(0), 2)]
    with pytest.warns(UserWarning, match=r"splits 2 of 6 layers, 20% of the parameter bytes") as record:
        eqxpar.nn.parallelize(blocks)
    text = str(record[0].message)
    assert "Classes it could not plan, most whole bytes first: FusedAttention (at [0].attn, [1].attn)." in text, text
    assert "register_style(name, FusedAttention, convert, split=...)" in text, text
    with pytest.raises(ValueError, match=r"FusedAttention.*\(strict=True\)"):
        eqxpar.nn.parallelize(blocks, strict=True)
    with fused_attention_registered(), warnings.catch_warnings():
        warnings.simplefilter("error")
        eqxpar.nn.parallelize(blocks, strict=True)
