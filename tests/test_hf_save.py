"""eqxpar.models.save_hf: a Llama written as a Hugging Face folder, read back exactly; it
never replaces files it did not write; and load_hf's bad inputs are ValueErrors naming the
key, file or tensor before any weight is read."""

import json
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors
from _hf_files import CountingReads, config_json, hf_tensors, write_checkpoint
from safetensors.numpy import load_file

import eqxpar
from eqxpar.models import Llama, llama_config, load_hf, save_hf


def read_folder(folder) -> dict:
    """Every tensor of a checkpoint folder, through its index if it has one."""
    index = folder / "model.safetensors.index.json"
    files = set(json.loads(index.read_text())["weight_map"].values()) if index.exists() else {"model.safetensors"}
    out = {}
    for file in files:
        out.update(load_file(str(folder / file)))
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tensors = hf_tensors(5)
    return tensors, write_checkpoint(tmp_path_factory.mktemp("ckpt"), tensors, config_json("current"), shards=2)


@pytest.mark.parametrize(
    "sizes, strategy, scan_layers, max_shard_bytes",
    [
        ({"model": 1}, "replicated", False, 2**31),
        ({"model": 4}, "tensor", True, 20_000),
        ({"fsdp": 8}, "fsdp", False, 1),
    ],
)
def test_round_trip_is_exact(checkpoint, tmp_path, sizes, strategy, scan_layers, max_shard_bytes):
    tensors, folder = checkpoint
    mesh = eqxpar.make_mesh(**sizes)
    model, specs = load_hf(folder, mesh, strategy=strategy, scan_layers=scan_layers)
    out = save_hf(model, tmp_path / "out", max_shard_bytes=max_shard_bytes)
    written = read_folder(out)
    assert set(written) == set(tensors)
    for name, array in tensors.items():  # the very tensors that were loaded, bit for bit
        assert written[name].dtype == np.float32
        np.testing.assert_array_equal(written[name], array, err_msg=name)
    files = sorted(p.name for p in out.iterdir())
    if max_shard_bytes == 2**31:
        assert files == ["config.json", "model.safetensors"]
    else:
        shards = [f for f in files if f.startswith("model-")]
        assert len(shards) > 1 and "model.safetensors.index.json" in files
        for file in shards:  # each shard under the limit, unless one tensor alone exceeds it
            sizes_in = [a.nbytes for a in load_file(str(out / file)).values()]
            assert sum(sizes_in) <= max_shard_bytes or len(sizes_in) == 1
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert index["metadata"]["total_size"] == sum(a.nbytes for a in tensors.values())
    weights = next(f for f in files if f.endswith(".safetensors"))
    with safetensors.safe_open(str(out / weights), framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}  # transformers refuses safetensors files without it
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["torch_dtype"] == "float32"
    # Loaded again, under another strategy: the same model.
    again, _ = load_hf(out, eqxpar.make_mesh(model=2), strategy="tensor", scan_layers=scan_layers)
    assert again.config == model.config
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(model)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_saved_config_lists_every_field(tmp_path):
    scaling = {
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    small = llama_config("tiny", tie_embeddings=True, rope_scaling=scaling, rope_theta=5e5)
    model = Llama(small, key=jax.random.key(0))
    out = save_hf(model, tmp_path / "tiny", dtype="bfloat16")
    config_json_written = json.loads((out / "config.json").read_text())
    written = read_folder(out)
    assert config_json_written == {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 192,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 8,
        "hidden_act": "silu",
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "bfloat16",
    }
    assert "lm_head.weight" not in written  # tied: transformers writes no head either
    want = np.asarray(model.embed_tokens.weight).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(written["model.embed_tokens.weight"], want)


def test_refuses_to_overwrite_files_it_did_not_write(checkpoint, tmp_path):
    _, folder = checkpoint
    model, _ = load_hf(folder, eqxpar.make_mesh(model=1))
    # A folder with someone's config.json: nothing written, nothing changed.
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "config.json").write_text("{}")
    (theirs / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"already holds \['config.json'\].*new folder"):
        save_hf(model, theirs)
    assert sorted(p.name for p in theirs.iterdir()) == ["config.json", "notes.txt"]
    assert (theirs / "config.json").read_text() == "{}"
    # A second save into its own earlier output is refused too (names every file).
    out = save_hf(model, tmp_path / "out")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ValueError, match=r"\['config.json', 'model.safetensors'\]"):
        save_hf(model, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # Other files in the folder are left alone.
    other = tmp_path / "other"
    other.mkdir()
    (other / "README.md").write_text("hello")
    save_hf(model, other)
    assert (other / "README.md").read_text() == "hello"
    with pytest.raises(ValueError, match="is a file"):
        save_hf(model, other / "README.md")


@pytest.mark.parametrize(
    "bad, message",
    [
        ({}, "model must be an eqxpar.models.Llama"),
        ({"dtype": jnp.int32}, "dtype must be float32, bfloat16 or float16"),
        ({"max_shard_bytes": 0}, "max_shard_bytes must be a positive int"),
    ],
)
def test_save_bad_arguments(tmp_path, bad, message):
    model = Llama(llama_config("tiny", num_layers=1), key=jax.random.key(0)) if bad else {"not": "a llama"}
    with pytest.raises(ValueError, match=message):
        save_hf(model, tmp_path / "out", **bad)
    assert not (tmp_path / "out").exists()


# ---- load_hf's bad inputs: ValueErrors naming the key, before any weight is read ---------------

BAD_CONFIGS = [
    ({"model_type": "mistral"}, "'model_type': 'mistral' is not supported"),
    ({"architectures": ["LlamaModel"]}, "'architectures'"),
    ({"attention_bias": True}, "'attention_bias': True is not supported"),
    ({"mlp_bias": True}, "'mlp_bias'"),
    ({"hidden_act": "gelu"}, "'hidden_act'"),
    ({"attention_dropout": 0.1}, "'attention_dropout'"),
    (
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
        r"'rope_parameters.rope_type'.*yarn",
    ),
    (
        {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}},
        "'rope_parameters.low_freq_factor'",
    ),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "factor": 2.0}}, "'rope_parameters.factor'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}}, "'rope_theta': must be a positive number"),
    ({"num_key_value_heads": 3}, "'num_key_value_heads': 3 does not divide num_attention_heads=8"),
    ({"head_dim": 7}, "'head_dim': must be even"),
    ({"vocab_size": 0}, "'vocab_size': must be a positive integer"),
    ({"quantization_config": {"bits": 4}}, r"'quantization_config': unknown.*ignore_keys"),
    ({"rope_theta": 500000.0}, "'rope_theta': 500000.0 disagrees with rope_parameters' 10000.0"),
]


@pytest.mark.parametrize("change, message", BAD_CONFIGS, ids=[next(iter(c)) for c, _ in BAD_CONFIGS])
def test_bad_configs_name_the_key(checkpoint, tmp_path, monkeypatch, change, message):
    tensors, _ = checkpoint
    folder = write_checkpoint(tmp_path / "bad", tensors, config_json("current", **change))
    opened = []
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: opened.append(a))
    with pytest.raises(ValueError, match=message):
        load_hf(folder, eqxpar.make_mesh(model=1))
    assert opened == []  # refused from config.json alone: no weight file opened


def test_older_style_bad_rope_scaling_names_the_key(checkpoint, tmp_path):
    tensors, _ = checkpoint
    config = config_json("older", rope_scaling={"type": "linear", "factor": 2.0})
    folder = write_checkpoint(tmp_path / "bad", tensors, config)
    with pytest.raises(ValueError, match=r"'rope_scaling.rope_type': the rotary embedding 'linear' is not supported"):
        load_hf(folder, eqxpar.make_mesh(model=1))


def test_unknown_keys_can_be_ignored(checkpoint, tmp_path):
    tensors, _ = checkpoint
    folder = write_checkpoint(tmp_path / "extra", tensors, config_json("current", my_tool_version="1.2"))
    model, _ = load_hf(folder, eqxpar.make_mesh(model=1), ignore_keys=["my_tool_version"])
    assert model.config.vocab_size == 64


def test_bad_files_and_meshes_are_refused_before_any_read(checkpoint, tmp_path, monkeypatch):
    tensors, good = checkpoint
    counted = CountingReads(monkeypatch)  # headers may be read, tensors' data not (asserted last)
    mesh = eqxpar.make_mesh(model=1)
    # A shard named by the index is missing.
    missing = write_checkpoint(tmp_path / "missing", tensors, config_json("current"), shards=2)
    (missing / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match=r"shard files that are not in .*model-00002-of-00002.safetensors"):
        load_hf(missing, mesh)
    # Shards without their index; no config.json; not a folder.
    no_index = write_checkpoint(tmp_path / "no_index", tensors, config_json("current"), shards=2)
    (no_index / "model.safetensors.index.json").unlink()
    with pytest.raises(
        ValueError, match="neither model.safetensors nor model.safetensors.index.json.*need their index"
    ):
        load_hf(no_index, mesh)
    (no_index / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json' is missing"):
        load_hf(no_index, mesh)
    with pytest.raises(ValueError, match="is not a folder"):
        load_hf(tmp_path / "nowhere", mesh)
    # A tensor missing, a shape that disagrees with config.json, a tensor with no place.
    fewer = {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}
    folder = write_checkpoint(tmp_path / "fewer", fewer, config_json("current"))
    with pytest.raises(ValueError, match="no tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_hf(folder, mesh)
    folder = write_checkpoint(tmp_path / "wide", tensors, config_json("current", intermediate_size=64))
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.gate_proj.weight' .* shape \(48, 32\).*\(64, 32\)"):
        load_hf(folder, mesh)
    biased = {**tensors, "model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}
    folder = write_checkpoint(tmp_path / "biased", biased, config_json("current"))
    with pytest.raises(ValueError, match=r"no place for: \['model.layers.0.self_attn.q_proj.bias'\]"):
        load_hf(folder, mesh)
    # A model axis that does not divide the 4 key/value heads; a mesh without the axis.
    with pytest.raises(ValueError, match=r"8 devices.*num_kv_heads=4"):
        load_hf(good, eqxpar.make_mesh(model=8), strategy="tensor")
    with pytest.raises(ValueError, match="'model', which the mesh does not have"):
        load_hf(good, eqxpar.make_mesh(data=8), strategy="tensor")
    with pytest.raises(ValueError, match="the mesh does not have|fsdp"):
        load_hf(good, eqxpar.make_mesh(data=8), strategy="fsdp")
    assert counted.reads == [] and counted.whole == [], (counted.reads, counted.whole)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"strategy": "zero3"}, "strategy must be one of"),
        ({"dtype": jnp.int32}, "dtype must be a floating dtype"),
        ({"remat": "all"}, "remat must be one of"),
        ({"ignore_keys": "x"}, "ignore_keys must be a list"),
    ],
)
def test_load_bad_arguments(checkpoint, bad, message):
    with pytest.raises(ValueError, match=message):
        load_hf(checkpoint[1], eqxpar.make_mesh(model=1), **bad)
    with pytest.raises(ValueError, match="mesh must be a jax.sharding.Mesh"):
        load_hf(checkpoint[1], {"model": 1})


def test_without_safetensors_the_error_is_the_install_line(checkpoint, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    with pytest.raises(
        ImportError, match=r'eqxpar needs safetensors for eqxpar.models.load_hf: pip install "eqxpar\[hf\]"'
    ):
        load_hf(checkpoint[1], eqxpar.make_mesh(model=1))


def test_save_imports_the_safetensors_module_it_uses(monkeypatch, tmp_path):
    """safetensors.numpy is a submodule `import safetensors` does not load: save_hf imports it."""
    monkeypatch.delitem(sys.modules, "safetensors.numpy")
    monkeypatch.delattr(safetensors, "numpy")
    out = save_hf(Llama(llama_config("tiny", num_layers=1), key=jax.random.key(0)), tmp_path / "out")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
