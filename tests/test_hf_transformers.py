"""load_hf and save_hf against transformers itself: a folder written by `save_pretrained`
(one file, or size-capped shards with their index) loads with load_hf under replicated,
tensor and FSDP placements and gives transformers' logits; save_hf's folder loads with
`LlamaForCausalLM.from_pretrained` to the very same tensors and logits.

Needs PyTorch and transformers, which eqxpar does not depend on: skipped without them (CI
has neither). Run by hand on 2026-11-26 with torch 2.13.0 (CPU) and transformers 5.24.0, and
with transformers 4.46.3: all pass; logits within 1.3e-6 of the largest logit (elementwise
rtol 1e-5), and save_hf's folders load to the same tensors bit for bit.

The GPT-2 test does the same with `GPT2LMHeadModel` (tied and untied, one file and shards)
into an eqxpar.models.GPT, and the Mixtral test with `MixtralForCausalLM` into a Llama with
`moe=` (one device, and the experts split over `expert` with their units over `model`, under
FSDP too). Both were run by hand on 2026-11-26 with torch 2.13.0+cpu and transformers 5.17.0
(the whole file: 13 passed): GPT-2 logits within 8.8e-7 and Mixtral's within 1.1e-6 of the
largest logit, save_hf's folders read back by `from_pretrained` bit for bit (transformers
5.x fuses a Mixtral's experts in memory, but its save_pretrained writes the per-expert
`w1`/`w2`/`w3` tensors load_hf reads). tests/test_hf_gpt2.py and tests/test_mixtral_hf.py
check the same mappings against numpy forwards in CI.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hf_transformers_models import (  # skips without torch and transformers
    SCALING,
    hugging_face_gpt2,
    hugging_face_llama,
    hugging_face_mixtral,
    torch,
    torch_logits,
    transformers,
)
from jax.sharding import PartitionSpec as P

import eqxpar
import eqxpar.nn
from eqxpar.models import GPT, load_hf, save_hf


def eqxpar_logits(model, mesh, tokens: np.ndarray) -> np.ndarray:
    specs = eqxpar.nn.partition_specs(model, mesh)  # computes split over `model` (an fsdp layout is moved)
    batch = "data" if "data" in mesh.shape else None
    forward = eqxpar.filter_shard_map(
        lambda m, t: m(t, inference=True) if isinstance(m, GPT) else m(t),
        mesh=mesh,
        in_specs=(specs, P(batch)),
        out_specs=P(batch, None, "model"),
    )
    with jax.default_matmul_precision("highest"):
        return np.asarray(eqx.filter_jit(forward)(model, jnp.asarray(tokens, jnp.int32)))


@pytest.mark.parametrize(
    "num_kv_heads, tie, scaling, shard_size, sizes, strategy",
    [
        (2, False, None, None, {"model": 1}, "replicated"),
        (4, True, SCALING, "20KB", {"model": 2}, "tensor"),
        (8, False, SCALING, None, {"data": 2, "model": 4}, "tensor"),
        (1, False, SCALING, "20KB", {"fsdp": 4, "model": 1}, "fsdp"),
        (2, True, None, None, {"fsdp": 4, "model": 2}, "fsdp"),
    ],
)
def test_transformers_folders_in_and_out(tmp_path, num_kv_heads, tie, scaling, shard_size, sizes, strategy):
    reference = hugging_face_llama(num_kv_heads, tie, scaling, seed=num_kv_heads)
    kwargs = {} if shard_size is None else {"max_shard_size": shard_size}
    reference.save_pretrained(tmp_path / "hf", **kwargs)
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists() == (shard_size is not None)
    tokens = np.random.default_rng(num_kv_heads).integers(0, 64, (4, 16))
    want = torch_logits(reference, tokens)

    mesh = eqxpar.make_mesh(**sizes)
    model, _ = load_hf(tmp_path / "hf", mesh, strategy=strategy)
    got = eqxpar_logits(model, mesh, tokens)
    scale = np.abs(want).max()
    print(f"{sizes} {strategy}: largest logit error {np.abs(got - want).max() / scale:.1e} of the largest logit")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale)

    out = save_hf(model, tmp_path / "eqxpar", max_shard_bytes=2**31 if shard_size is None else 20_000)
    back = transformers.LlamaForCausalLM.from_pretrained(out).eval().float()
    assert back.config.tie_word_embeddings == tie and back.config.num_key_value_heads == num_kv_heads
    original, loaded = reference.state_dict(), back.state_dict()
    assert set(original) == set(loaded)
    for name, tensor in original.items():  # every tensor bit for bit
        np.testing.assert_array_equal(loaded[name].numpy(), tensor.numpy(), err_msg=name)
    np.testing.assert_array_equal(torch_logits(back, tokens), want)


def test_bfloat16_checkpoints_of_transformers(tmp_path):
    reference = hugging_face_llama(4, False, SCALING, seed=0)
    reference.to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    model, _ = load_hf(tmp_path / "hf", eqxpar.make_mesh(model=2), strategy="tensor")
    state = reference.state_dict()
    np.testing.assert_array_equal(
        np.asarray(model.layers[1].mlp.down_proj.weight), state["model.layers.1.mlp.down_proj.weight"].float().numpy()
    )
    out = save_hf(model, tmp_path / "eqxpar", dtype="bfloat16")
    back = transformers.LlamaForCausalLM.from_pretrained(out)  # 5.x: bfloat16 (dtype "auto"); 4.x: float32
    for name, tensor in state.items():  # the bfloat16 values, exactly
        assert tensor.dtype == torch.bfloat16 and torch.equal(back.state_dict()[name].to(torch.bfloat16), tensor), name


@pytest.mark.parametrize(
    "tie, shard_size, sizes, strategy",
    [
        (True, None, {"model": 1}, "replicated"),
        (False, "20KB", {"model": 2}, "tensor"),
        (True, None, {"data": 2, "model": 2}, "tensor"),
        (False, None, {"fsdp": 4, "model": 1}, "fsdp"),
    ],
)
def test_transformers_gpt2_folders_in_and_out(tmp_path, tie, shard_size, sizes, strategy):
    reference = hugging_face_gpt2(tie, seed=len(sizes) + tie)
    kwargs = {} if shard_size is None else {"max_shard_size": shard_size}
    reference.save_pretrained(tmp_path / "hf", **kwargs)
    tokens = np.random.default_rng(5).integers(0, 50, (4, 16))
    want = torch_logits(reference, tokens)

    mesh = eqxpar.make_mesh(**sizes)
    model, _ = load_hf(tmp_path / "hf", mesh, strategy=strategy)
    assert isinstance(model, GPT)
    got = eqxpar_logits(model, mesh, tokens)[..., :50]  # the padding ids' columns dropped
    scale = np.abs(want).max()
    print(f"GPT-2 {sizes} {strategy}: largest logit error {np.abs(got - want).max() / scale:.1e} of the largest logit")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale)

    out = save_hf(model, tmp_path / "eqxpar", max_shard_bytes=2**31 if shard_size is None else 20_000)
    back = transformers.GPT2LMHeadModel.from_pretrained(out).eval().float()
    assert back.config.tie_word_embeddings == tie
    original, loaded = reference.state_dict(), back.state_dict()
    assert set(original) == set(loaded)
    for name, tensor in original.items():  # every tensor bit for bit
        np.testing.assert_array_equal(loaded[name].numpy(), tensor.numpy(), err_msg=name)
    np.testing.assert_array_equal(torch_logits(back, tokens), want)


@pytest.mark.parametrize(
    "tie, shard_size, sizes, strategy",
    [
        (False, None, {"expert": 1, "model": 1}, "replicated"),
        (True, "20KB", {"expert": 2, "model": 2}, "tensor"),
        (False, None, {"fsdp": 2, "expert": 2, "model": 2}, "fsdp"),
    ],
)
def test_transformers_mixtral_folders_in_and_out(tmp_path, tie, shard_size, sizes, strategy):
    reference = hugging_face_mixtral(tie, seed=len(sizes) + tie)
    kwargs = {} if shard_size is None else {"max_shard_size": shard_size}
    reference.save_pretrained(tmp_path / "hf", **kwargs)
    tokens = np.random.default_rng(6).integers(0, 64, (4, 16))
    want = torch_logits(reference, tokens)

    mesh = eqxpar.make_mesh(**sizes)
    model, _ = load_hf(tmp_path / "hf", mesh, strategy=strategy)
    assert model.moe is not None and model.moe.normalize_weights and model.moe.capacity_factor is None
    got = eqxpar_logits(model, mesh, tokens)
    scale = np.abs(want).max()
    print(
        f"Mixtral {sizes} {strategy}: largest logit error {np.abs(got - want).max() / scale:.1e} of the largest logit"
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale)

    out = save_hf(model, tmp_path / "eqxpar", max_shard_bytes=2**31 if shard_size is None else 20_000)
    back = transformers.MixtralForCausalLM.from_pretrained(out).eval().float()
    assert back.config.tie_word_embeddings == tie and back.config.num_local_experts == 4
    original, loaded = reference.state_dict(), back.state_dict()
    assert set(original) == set(loaded)
    for name, tensor in original.items():  # every tensor bit for bit
        np.testing.assert_array_equal(loaded[name].numpy(), tensor.numpy(), err_msg=name)
    np.testing.assert_array_equal(torch_logits(back, tokens), want)
