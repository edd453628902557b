"""eqxpar.models.load_hf: a Hugging Face Llama folder loaded straight into its shards.

Checkpoints are written here with safetensors and numpy (no torch or transformers: see
tests/_hf_files.py), in both config.json styles, as one file and as two shards. Loaded
under replicated, tensor-parallel and FSDP meshes, every device's block equals that block
of the file and sits where the strategy says; the logits equal an independent numpy
forward of Hugging Face's Llama; and each device reads only its own slice (the bytes that
come out of safetensors are counted).
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _hf_files import LLAMA3, SHAPE, CountingReads, config_json, hf_tensors, reference_logits, write_checkpoint
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar.models import LlamaConfig, LlamaRopeScaling, load_hf
from eqxpar.models._hf import hf_tensor_names


def loaded_tensors(model) -> dict:
    """The model's arrays under their Hugging Face names (stacked arrays cut per layer)."""
    out = {}
    for leaf, (names, stacked) in zip(jax.tree.leaves(model), hf_tensor_names(model)):
        for layer, name in enumerate(names):
            out[name] = leaf[layer] if stacked else leaf
    return out


# Where the strategies put each tensor (by the end of its name).
TENSOR_SPECS = {
    "embed_tokens.weight": P("model", None),
    "q_proj.weight": P("model", None),
    "k_proj.weight": P("model", None),
    "v_proj.weight": P("model", None),
    "o_proj.weight": P(None, "model"),
    "gate_proj.weight": P("model", None),
    "up_proj.weight": P("model", None),
    "down_proj.weight": P(None, "model"),
    "lm_head.weight": P("model", None),
    "layernorm.weight": P(),
    "norm.weight": P(),
}


def padded(spec: P, ndim: int) -> tuple:
    return tuple(spec) + (None,) * (ndim - len(spec))


def expected_spec(strategy: str, name: str, shape, mesh) -> P:
    if strategy == "replicated":
        return P()
    spec = next(s for end, s in TENSOR_SPECS.items() if name.endswith(end))
    if strategy == "tensor":
        return spec
    # fsdp: the first dimension the tensor split leaves and the fsdp axis divides.
    entries = list(spec) + [None] * (len(shape) - len(spec))
    if "model" not in mesh.shape:
        entries = [None] * len(shape)
    for dim, size in enumerate(shape):
        if entries[dim] is None and size % mesh.shape["fsdp"] == 0:
            entries[dim] = "fsdp"
            break
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(style, shards) -> folder of one untied checkpoint with Llama 3 scaling."""
    tensors = hf_tensors(0)
    out = {}
    for style in ("current", "older"):
        for shards in (1, 2):
            folder = tmp_path_factory.mktemp(f"{style}_{shards}")
            out[style, shards] = write_checkpoint(folder, tensors, config_json(style), shards=shards)
    return tensors, out


def test_both_config_styles_give_one_config(checkpoints):
    want = LlamaConfig(
        vocab_size=64,
        dim=32,
        num_layers=2,
        num_heads=8,
        num_kv_heads=4,
        head_dim=8,
        hidden_dim=48,
        rope_theta=10000.0,
        rope_scaling=LlamaRopeScaling(**LLAMA3),
        norm_eps=1e-5,
        tie_embeddings=False,
        max_seq_len=16,
    )
    mesh = eqxpar.make_mesh(model=1)
    for folder in checkpoints[1].values():
        model, _ = load_hf(folder, mesh)
        assert model.config == want, folder


@pytest.mark.parametrize("style, shards", [("current", 1), ("older", 2)])
@pytest.mark.parametrize(
    "sizes, strategy",
    [
        ({"model": 1}, "replicated"),
        ({"data": 8}, "replicated"),
        ({"model": 2}, "tensor"),
        ({"data": 2, "model": 4}, "tensor"),
        ({"fsdp": 8}, "fsdp"),
        ({"fsdp": 2, "model": 4}, "fsdp"),
    ],
)
@pytest.mark.parametrize("scan_layers", [False, True])
def test_every_device_holds_its_block_of_the_file(checkpoints, style, shards, sizes, strategy, scan_layers):
    tensors, folders = checkpoints
    mesh = eqxpar.make_mesh(**sizes)
    model, specs = load_hf(folders[style, shards], mesh, strategy=strategy, scan_layers=scan_layers)
    assert model.scan_layers == scan_layers
    got = loaded_tensors(model)
    assert set(got) == set(tensors)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    for leaf, spec, (names, stacked) in zip(jax.tree.leaves(model), spec_leaves, hf_tensor_names(model)):
        want_spec = expected_spec(strategy, names[0], tensors[names[0]].shape, mesh)
        if stacked:
            want_spec = P(None, *want_spec)
        assert isinstance(leaf.sharding, NamedSharding) and leaf.sharding.mesh == mesh, names[0]
        assert padded(leaf.sharding.spec, leaf.ndim) == padded(want_spec, leaf.ndim) == padded(spec, leaf.ndim), (
            names[0],
            leaf.sharding.spec,
            want_spec,
        )
        whole = np.stack([tensors[n] for n in names]) if stacked else tensors[names[0]]
        assert leaf.dtype == jnp.float32
        for shard in leaf.addressable_shards:  # each device's own block, bit for bit
            np.testing.assert_array_equal(np.asarray(shard.data), whole[shard.index], err_msg=names[0])


@pytest.mark.parametrize(
    "sizes, scaling, tie, scan_layers",
    [
        ({"model": 1}, LLAMA3, False, False),
        ({"model": 2}, LLAMA3, False, True),
        ({"data": 2, "model": 4}, None, True, False),
        ({"model": 4}, LLAMA3, True, False),
    ],
)
def test_logits_equal_a_numpy_hugging_face_llama(tmp_path, sizes, scaling, tie, scan_layers):
    tensors = hf_tensors(1, tie=tie)
    config = config_json("current" if tie else "older", scaling=scaling, tie=tie)
    folder = write_checkpoint(tmp_path / "ckpt", tensors, config, shards=2)
    mesh = eqxpar.make_mesh(**sizes)
    model, specs = load_hf(folder, mesh, strategy="tensor", scan_layers=scan_layers)
    assert (model.lm_head is None) == tie
    tokens = np.random.default_rng(2).integers(0, SHAPE["vocab_size"], (4, SHAPE["max_position_embeddings"]))
    batch = "data" if "data" in sizes else None
    forward = eqxpar.filter_shard_map(
        lambda m, t: m(t), mesh=mesh, in_specs=(specs, P(batch)), out_specs=P(batch, None, "model")
    )
    with jax.default_matmul_precision("highest"):
        got = np.asarray(eqx.filter_jit(forward)(model, jnp.asarray(tokens, jnp.int32)))
    want = reference_logits(tensors, config, tokens, scaling)
    scale = np.abs(want).max()
    # float32 against float64: measured 4-6e-7 of the largest logit.
    print(f"logits {sizes}: largest error {np.abs(got - want).max() / scale:.1e} of the largest logit")
    assert np.abs(got - want).max() <= 1e-5 * scale, np.abs(got - want).max() / scale
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale)


def test_bfloat16_checkpoints_load_as_float32_or_as_asked(tmp_path):
    tensors = hf_tensors(3)
    folder = write_checkpoint(tmp_path / "bf16", tensors, config_json("older"), bfloat16=True)
    mesh = eqxpar.make_mesh(model=2)
    model, _ = load_hf(folder, mesh, strategy="tensor")
    for name, leaf in loaded_tensors(model).items():
        assert leaf.dtype == jnp.float32
        want = tensors[name].astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(leaf), want, err_msg=name)
    model, _ = load_hf(folder, mesh, strategy="tensor", dtype=jnp.bfloat16)
    assert {leaf.dtype for leaf in jax.tree.leaves(model)} == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.parametrize(
    "sizes, strategy, parts", [({"model": 4}, "tensor", 4), ({"fsdp": 8}, "fsdp", 8), ({"data": 8}, "replicated", 1)]
)
def test_each_device_reads_only_its_slice(checkpoints, monkeypatch, sizes, strategy, parts):
    tensors, folders = checkpoints
    counter = CountingReads(monkeypatch)
    load_hf(folders["current", 2], eqxpar.make_mesh(**sizes), strategy=strategy)
    assert counter.whole == []  # no tensor read whole through get_tensor
    reads = counter.by_tensor()
    assert set(reads) == set(tensors)
    for name, blocks in reads.items():
        total = tensors[name].nbytes
        split = strategy == "fsdp" or strategy == "tensor" and not name.endswith("norm.weight")
        if split:
            # parts reads of 1/parts of the tensor each: the tensor read exactly once in all.
            assert blocks == [(total // parts, total)] * parts, (name, blocks)
        else:
            # Whole on every device: read once, shared by the devices that hold it.
            assert blocks == [(total, total)], (name, blocks)
    assert sum(n for _, n, _ in counter.reads) == sum(t.nbytes for t in tensors.values())


def test_scan_layers_read_each_layer_slice_once(checkpoints, monkeypatch):
    tensors, folders = checkpoints
    counter = CountingReads(monkeypatch)
    load_hf(folders["older", 1], eqxpar.make_mesh(model=2), strategy="tensor", scan_layers=True)
    reads = counter.by_tensor()
    q = "model.layers.1.self_attn.q_proj.weight"
    assert reads[q] == [(tensors[q].nbytes // 2, tensors[q].nbytes)] * 2


# config.json files as transformers itself wrote them (LlamaConfig(...).save_pretrained, no
# torch needed), pasted verbatim: 4.46.3 (top-level rope_theta and rope_scaling) and 5.24.0
# (rope_parameters; it converts the older keyword arguments to it). Both read save_hf's
# config.json back with these values (checked by hand with AutoConfig.from_pretrained).
WRITTEN_BY_TRANSFORMERS = {
    "4.46.3": {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "head_dim": 8,
        "hidden_act": "silu",
        "hidden_size": 32,
        "initializer_range": 0.02,
        "intermediate_size": 48,
        "max_position_embeddings": 16,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 8,
        "num_hidden_layers": 2,
        "num_key_value_heads": 4,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "factor": 8.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 64,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "transformers_version": "4.46.3",
        "use_cache": True,
        "vocab_size": 64,
    },
    "5.24.0": {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "head_dim": 8,
        "hidden_act": "silu",
        "hidden_size": 32,
        "initializer_range": 0.02,
        "intermediate_size": 48,
        "max_position_embeddings": 16,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 8,
        "num_hidden_layers": 2,
        "num_key_value_heads": 4,
        "pad_token_id": None,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "factor": 8.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
            "rope_type": "llama3",
        },
        "tie_word_embeddings": True,
        "transformers_version": "5.24.0",
        "use_cache": True,
        "vocab_size": 64,
    },
}


@pytest.mark.parametrize("version", sorted(WRITTEN_BY_TRANSFORMERS))
def test_configs_written_by_transformers_load(tmp_path, version):
    folder = write_checkpoint(tmp_path / version, hf_tensors(4, tie=True), WRITTEN_BY_TRANSFORMERS[version])
    model, _ = load_hf(folder, eqxpar.make_mesh(model=2), strategy="tensor")
    assert model.config == LlamaConfig(
        vocab_size=64,
        dim=32,
        num_layers=2,
        num_heads=8,
        num_kv_heads=4,
        head_dim=8,
        hidden_dim=48,
        rope_theta=500000.0,
        rope_scaling=LlamaRopeScaling(**LLAMA3),
        norm_eps=1e-6,
        tie_embeddings=True,
        max_seq_len=16,
    )
    assert model.lm_head is None
