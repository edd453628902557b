"""Hugging Face Mixtral checkpoints in and out: `load_hf` reads a `MixtralForCausalLM` folder
into a Llama with `moe=` (dropless, softmax then the chosen experts renormalised), straight
into its shards; `save_hf` writes it back.

The folders are written with safetensors and numpy (tests/_hf_mixtral_files.py, no torch):
the logits equal an independent numpy forward of transformers' Mixtral on one device and
with the experts split over `expert` and their units over `model` (under FSDP too); the
round trip is bit for bit; each device reads only its slice of every tensor; what eqxpar
cannot compute is a ValueError naming the key before any weight is read.
"""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _hf_files import CountingReads, config_json, hf_tensors, write_checkpoint
from _hf_mixtral_files import MIXTRAL_SHAPE, mixtral_config_json, mixtral_reference_logits, mixtral_tensors
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file

import eqxpar
import eqxpar.nn
from eqxpar.models import Llama, LlamaConfig, LlamaMoEBlock, MoEOptions, load_hf, save_hf
from eqxpar.models._hf_mixtral import mixtral_settings_from_hf


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tensors = mixtral_tensors(0)
    folder = write_checkpoint(tmp_path_factory.mktemp("mixtral"), tensors, mixtral_config_json(), shards=2)
    return tensors, folder


def read_folder(folder) -> dict:
    index = folder / "model.safetensors.index.json"
    files = set(json.loads(index.read_text())["weight_map"].values()) if index.exists() else {"model.safetensors"}
    out = {}
    for file in files:
        out.update(load_file(str(folder / file)))
    return out


def logits(model, mesh, tokens: np.ndarray) -> np.ndarray:
    """The whole logits, the batch split over the expert axis (each device routes its own
    sequences: the all-to-all path), the vocabulary over the model axis."""
    batch = "expert" if "expert" in mesh.shape else None
    forward = eqxpar.filter_shard_map(
        lambda m, t: m(t),
        mesh=mesh,
        in_specs=(eqxpar.nn.partition_specs(model, mesh), P(batch)),
        out_specs=P(batch, None, "model"),
    )
    with jax.default_matmul_precision("highest"):
        return np.asarray(eqx.filter_jit(forward)(model, jnp.asarray(tokens, jnp.int32)))


@pytest.mark.parametrize(
    "sizes, strategy, tie, older",
    [
        ({"expert": 1, "model": 1}, "replicated", False, True),  # one device: ragged_dot
        ({"fsdp": 2, "expert": 2, "model": 2}, "fsdp", True, False),  # all_to_all, units split, FSDP
        pytest.param({"expert": 4, "model": 2}, "tensor", False, False, marks=pytest.mark.thorough),
        pytest.param({"data": 2, "expert": 2, "model": 2}, "tensor", True, True, marks=pytest.mark.thorough),
    ],
)
def test_logits_equal_a_numpy_mixtral(tmp_path, sizes, strategy, tie, older):
    tensors = mixtral_tensors(1, tie=tie)
    config = mixtral_config_json(tie=tie, older=older)
    folder = write_checkpoint(tmp_path / "ckpt", tensors, config)
    mesh = eqxpar.make_mesh(**sizes)
    model, _ = load_hf(folder, mesh, strategy=strategy)
    assert all(isinstance(block, LlamaMoEBlock) for block in model.layers)
    assert model.moe == MoEOptions(4, 2, capacity_factor=None, aux_loss_weight=0.0, normalize_weights=True)
    tokens = np.random.default_rng(2).integers(0, MIXTRAL_SHAPE["vocab_size"], (4, 16))
    want, gap = mixtral_reference_logits(tensors, config, tokens)
    assert gap > 1e-4  # every token's choice of experts is clear of float32 rounding
    got = logits(model, mesh, tokens)
    scale = np.abs(want).max()
    # float32 against float64: measured 4.7e-7 to 8.2e-7 of the largest logit.
    print(f"Mixtral {sizes} {strategy}: largest error {np.abs(got - want).max() / scale:.1e} of the largest logit")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("max_shard_bytes", [2**31, 20_000])
def test_round_trip_is_bit_exact(checkpoint, tmp_path, max_shard_bytes):
    tensors, folder = checkpoint
    model, _ = load_hf(folder, eqxpar.make_mesh(expert=2, model=2), strategy="tensor")
    np.testing.assert_array_equal(  # expert 3's w1, transposed into the stacked gate
        np.asarray(model.layers[1].block_sparse_moe.gate[3]),
        tensors["model.layers.1.block_sparse_moe.experts.3.w1.weight"].T,
    )
    out = save_hf(model, tmp_path / "out", max_shard_bytes=max_shard_bytes)
    written = read_folder(out)
    assert set(written) == set(tensors)
    for name, array in tensors.items():
        assert written[name].dtype == np.float32
        np.testing.assert_array_equal(written[name], array, err_msg=name)
    assert (out / "model.safetensors.index.json").exists() == (max_shard_bytes < 2**31)
    config = json.loads((out / "config.json").read_text())
    original = mixtral_config_json()
    for key in (*MIXTRAL_SHAPE, "architectures", "model_type", "rope_theta", "tie_word_embeddings"):
        assert config[key] == original[key], key
    assert (config["sliding_window"], config["router_jitter_noise"], config["output_router_logits"]) == (None, 0, False)
    assert not {"attention_bias", "mlp_bias", "pretraining_tp"} & set(config)  # not MixtralConfig keys
    again, _ = load_hf(out, eqxpar.make_mesh(fsdp=4), strategy="fsdp")
    assert again.config == model.config and again.moe == model.moe
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(model)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bfloat16_folders_in_and_out(tmp_path):
    """The Hub's Mixtral weights are bfloat16: read as float32 by default (exactly), and
    written back as bfloat16 bit for bit."""
    tensors = mixtral_tensors(4)
    folder = write_checkpoint(tmp_path / "bf16", tensors, mixtral_config_json(), bfloat16=True)
    model, _ = load_hf(folder, eqxpar.make_mesh(expert=2, model=2), strategy="tensor")
    name = "model.layers.0.block_sparse_moe.experts.1.w2.weight"
    want = tensors[name].astype(ml_dtypes.bfloat16)
    got = model.layers[0].block_sparse_moe.down[1]
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), want.astype(np.float32).T)
    written = read_folder(save_hf(model, tmp_path / "out", dtype="bfloat16"))
    for key, array in tensors.items():
        assert written[key].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(written[key].view(np.uint16), array.astype(ml_dtypes.bfloat16).view(np.uint16))


def test_each_device_reads_only_its_slice(checkpoint, monkeypatch):
    tensors, folder = checkpoint
    counter = CountingReads(monkeypatch)
    load_hf(folder, eqxpar.make_mesh(expert=4, model=2), strategy="tensor")
    assert counter.whole == []
    reads = counter.by_tensor()
    assert set(reads) == set(tensors)
    for name, blocks in reads.items():
        total = tensors[name].nbytes
        if ".experts." in name:  # one expert per expert device; its units halved over model
            assert blocks == [(total // 2, total)] * 2, (name, blocks)
        elif name.endswith(("norm.weight", "block_sparse_moe.gate.weight")):  # replicated: read once
            assert blocks == [(total, total)], (name, blocks)
    assert sum(n for _, n, _ in counter.reads) == sum(t.nbytes for t in tensors.values())


@pytest.mark.parametrize(
    "change, key",
    [
        ({"router_jitter_noise": 0.01}, "router_jitter_noise"),
        ({"sliding_window": 8}, "sliding_window"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
        ({"num_local_experts": 0}, "num_local_experts"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"architectures": ["MixtralForSequenceClassification"]}, "architectures"),
        ({"output_router_logits": "yes"}, "output_router_logits"),
        ({"router_aux_loss_coef": -1.0}, "router_aux_loss_coef"),
        ({"shared_expert_intermediate_size": 16}, "shared_expert_intermediate_size"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
    ],
)
def test_what_eqxpar_cannot_compute_is_refused_by_key(tmp_path, monkeypatch, change, key):
    folder = write_checkpoint(tmp_path / "bad", mixtral_tensors(2), mixtral_config_json(**change))
    counter = CountingReads(monkeypatch)
    with pytest.raises(ValueError, match=rf"config.json key '{key}'"):
        load_hf(folder, eqxpar.make_mesh(expert=2, model=2), strategy="tensor")
    assert counter.reads == []  # refused before any weight is read


def test_bad_layouts_and_mismatched_weights_are_refused_before_any_read(checkpoint, tmp_path, monkeypatch):
    _, folder = checkpoint
    counter = CountingReads(monkeypatch)
    with pytest.raises(ValueError, match=r"has no \['expert'\]; add them"):
        load_hf(folder, eqxpar.make_mesh(model=2), strategy="tensor")
    with pytest.raises(ValueError, match=r"scan_layers=False"):
        load_hf(folder, eqxpar.make_mesh(model=1), scan_layers=True)
    with pytest.raises(ValueError, match=r"capacity_factor=0"):
        load_hf(folder, eqxpar.make_mesh(model=1), capacity_factor=0)
    # A config with 3 experts over weights with 4: the router's shape disagrees.
    fewer = write_checkpoint(tmp_path / "fewer", mixtral_tensors(2), mixtral_config_json(num_local_experts=3))
    with pytest.raises(
        ValueError, match=r"gate.weight' in model.safetensors has shape \(4, 32\), but config.json gives \(3, 32\)"
    ):
        load_hf(fewer, eqxpar.make_mesh(model=1))
    # The experts' options are for a Mixtral.
    llama = write_checkpoint(tmp_path / "llama", hf_tensors(0), config_json("current"))
    with pytest.raises(ValueError, match=r"capacity_factor and expert_axis are for a Mixtral"):
        load_hf(llama, eqxpar.make_mesh(model=1), capacity_factor=1.25)
    assert counter.reads == []


def test_expert_options_and_training_keys(tmp_path):
    """A long enough sliding window is accepted; the capacity factor is the caller's; the
    aux-loss coefficient becomes eqxpar's per-layer weight and goes back as it was."""
    config = mixtral_config_json(sliding_window=16, output_router_logits=True, router_aux_loss_coef=0.02)
    llama_config, moe = mixtral_settings_from_hf(config, capacity_factor=1.25, expert_axis="ep")
    assert (moe.capacity_factor, moe.expert_axis, moe.every, moe.score) == (1.25, "ep", 1, "softmax")
    assert moe.aux_loss_weight == 0.02 * 2 / 2  # coefficient * top_k / layers
    assert llama_config.max_seq_len == 16 and llama_config.rope_theta == 5e5
    folder = write_checkpoint(tmp_path / "ckpt", mixtral_tensors(3), config)
    model, _ = load_hf(folder, eqxpar.make_mesh(model=1), capacity_factor=1.25)
    out = save_hf(model, tmp_path / "out")
    written = json.loads((out / "config.json").read_text())
    assert (written["output_router_logits"], written["router_aux_loss_coef"]) == (True, 0.02)


# transformers 5.17.0's MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=24,
# num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=8,
# max_position_embeddings=16, num_local_experts=4, num_experts_per_tok=2,
# output_router_logits=True, router_aux_loss_coef=0.02).save_pretrained(...), pasted verbatim.
WRITTEN_BY_TRANSFORMERS_5_17 = {
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "head_dim": 8,
    "hidden_act": "silu",
    "hidden_size": 32,
    "initializer_range": 0.02,
    "intermediate_size": 24,
    "max_position_embeddings": 16,
    "model_type": "mixtral",
    "num_attention_heads": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_key_value_heads": 4,
    "num_local_experts": 4,
    "output_router_logits": True,
    "pad_token_id": None,
    "rms_norm_eps": 1e-05,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "router_aux_loss_coef": 0.02,
    "router_jitter_noise": 0.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "transformers_version": "5.17.0",
    "use_cache": True,
    "vocab_size": 64,
}


def test_a_config_written_by_transformers_reads():
    config, moe = mixtral_settings_from_hf(WRITTEN_BY_TRANSFORMERS_5_17)
    assert config == LlamaConfig(
        vocab_size=64,
        dim=32,
        num_layers=2,
        num_heads=8,
        num_kv_heads=4,
        head_dim=8,
        hidden_dim=24,
        rope_theta=1e6,
        norm_eps=1e-5,
        max_seq_len=16,
    )
    assert moe == MoEOptions(4, 2, capacity_factor=None, aux_loss_weight=0.02, normalize_weights=True)


def test_the_hub_mixtral_8x7b_config_gives_its_shape():
    # Mixtral-8x7B-v0.1's config.json on the Hub (transformers 4.36 wrote it); its parameter
    # count, 46.7B, is the published one.
    hub = {
        "architectures": ["MixtralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "model_type": "mixtral",
        "num_attention_heads": 32,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "output_router_logits": False,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.36.0.dev0",
        "use_cache": True,
        "vocab_size": 32000,
    }
    config, moe = mixtral_settings_from_hf(hub)
    assert config == LlamaConfig(
        vocab_size=32000,
        dim=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        hidden_dim=14336,
        rope_theta=1e6,
        norm_eps=1e-5,
        max_seq_len=32768,
    )
    assert (moe.num_experts, moe.top_k, moe.aux_loss_weight) == (8, 2, 0.0)
    shapes = eqx.filter_eval_shape(Llama, config, moe=moe, key=jax.random.key(0))
    assert sum(leaf.size for leaf in jax.tree.leaves(shapes)) == 46_702_792_704


def test_save_refuses_a_mixture_no_mixtral_computes(tmp_path):
    config = LlamaConfig(vocab_size=32, dim=16, num_layers=2, num_heads=2, hidden_dim=32, max_seq_len=8)
    for moe, problem in [
        (MoEOptions(4, 2, every=2, normalize_weights=True), r"moe.every=2"),
        (MoEOptions(4, 2, score="sigmoid", normalize_weights=True), r"moe.score='sigmoid'"),
        (MoEOptions(4, 2), r"moe.normalize_weights=False"),
    ]:
        model = eqx.filter_eval_shape(Llama, config, moe=moe, key=jax.random.key(0))  # refused from its options
        with pytest.raises(ValueError, match=rf"not a Mixtral's.*{problem}"):
            save_hf(model, tmp_path / "refused", dtype="float32")
        assert not (tmp_path / "refused").exists()
