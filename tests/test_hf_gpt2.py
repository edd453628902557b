"""eqxpar.models.load_hf and save_hf for GPT-2: a GPT2LMHeadModel folder loaded into an
eqxpar.models.GPT straight into its shards, and a GPT written back as one.

Checkpoints are written with safetensors and numpy alone (tests/_hf_files.py: tied and
untied, with and without the `transformer.` prefix, with the older files' attention-mask
buffers). The logits are compared with a numpy GPT-2 forward written in the helper; every
device's block with the file's tensors cut as GPT-2 stores them (Conv1D `[in, out]`, fused
`c_attn`), written out here by hand; the bytes each device reads are counted.
"""

import json
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _hf_files import (
    GPT2_SHAPE,
    CountingReads,
    gpt2_config_json,
    gpt2_reference_logits,
    gpt2_tensors,
    write_checkpoint,
)
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file

import eqxpar
import eqxpar.nn
from eqxpar.models import GPT, MoEOptions, load_hf, next_token_loss, save_hf, whole_logits
from eqxpar.testing import assert_trees_close
from eqxpar.train import fsdp_step, hybrid_step, shard_batch

D, VOCAB, PADDED = GPT2_SHAPE["n_embd"], GPT2_SHAPE["vocab_size"], 128
MESHES = [
    ({"model": 1}, "replicated"),
    ({"model": 2}, "tensor"),
    ({"data": 2, "model": 2}, "tensor"),
    ({"fsdp": 4, "model": 1}, "fsdp"),
]


def read_folder(folder) -> dict:
    index = folder / "model.safetensors.index.json"
    files = set(json.loads(index.read_text())["weight_map"].values()) if index.exists() else {"model.safetensors"}
    out = {}
    for file in files:
        out.update(load_file(str(folder / file)))
    return out


def expected_arrays(tensors: dict, scan: bool) -> dict:
    """The GPT's arrays by path, cut by hand from GPT-2's tensors."""
    prefix = "transformer." if "transformer.wte.weight" in tensors else ""
    t = {k.removeprefix(prefix): v for k, v in tensors.items()}

    def pad(table):
        return np.pad(table, ((0, PADDED - VOCAB), (0, 0)))

    out = {
        ".token_embedding.weight": pad(t["wte.weight"]),
        ".position_embedding.weight": t["wpe.weight"],
        ".final_norm.weight": t["ln_f.weight"],
        ".final_norm.bias": t["ln_f.bias"],
        ".head.weight": pad(t.get("lm_head.weight", t["wte.weight"])),
    }
    layers = []
    for i in range(GPT2_SHAPE["n_layer"]):
        p = f"h.{i}."
        w, b = t[p + "attn.c_attn.weight"], t[p + "attn.c_attn.bias"]
        layers.append(
            {
                "attention_norm.weight": t[p + "ln_1.weight"],
                "attention_norm.bias": t[p + "ln_1.bias"],
                "attention.query_proj.weight": w[:, :D].T,
                "attention.query_proj.bias": b[:D],
                "attention.key_proj.weight": w[:, D : 2 * D].T,
                "attention.key_proj.bias": b[D : 2 * D],
                "attention.value_proj.weight": w[:, 2 * D :].T,
                "attention.value_proj.bias": b[2 * D :],
                "attention.output_proj.weight": t[p + "attn.c_proj.weight"].T,
                "attention.output_proj.bias": t[p + "attn.c_proj.bias"],
                "mlp_norm.weight": t[p + "ln_2.weight"],
                "mlp_norm.bias": t[p + "ln_2.bias"],
                "mlp.hidden.weight": t[p + "mlp.c_fc.weight"].T,
                "mlp.hidden.bias": t[p + "mlp.c_fc.bias"],
                "mlp.output.weight": t[p + "mlp.c_proj.weight"].T,
                "mlp.output.bias": t[p + "mlp.c_proj.bias"],
            }
        )
    for name in layers[0]:
        if scan:
            out[f".blocks.layers.{name}"] = np.stack([layer[name] for layer in layers])
        else:
            out.update({f".blocks[{i}].{name}": layer[name] for i, layer in enumerate(layers)})
    return out


def logits(model, mesh, tokens):
    specs = eqxpar.nn.partition_specs(model, mesh)  # the computation's split (an fsdp layout is moved)
    with jax.default_matmul_precision("highest"):
        return np.asarray(whole_logits(model, mesh, specs)(jnp.asarray(tokens, jnp.int32)))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> (tensors, config, folder): tied (older config, no prefix, mask buffers, one
    file) and untied (current config, `transformer.` prefix, two shards)."""
    out = {}
    for name, tie, older, prefix, buffers, shards in (
        ("tied", True, True, "", True, 1),
        ("untied", False, False, "transformer.", False, 2),
    ):
        tensors = gpt2_tensors(1 if tie else 2, tie=tie, prefix=prefix, buffers=buffers)
        config = gpt2_config_json(tie=tie, older=older)
        out[name] = tensors, config, write_checkpoint(tmp_path_factory.mktemp(name), tensors, config, shards=shards)
    return out


@pytest.mark.parametrize("sizes, strategy", MESHES)
@pytest.mark.parametrize("which", ["tied", "untied"])
def test_logits_equal_a_numpy_gpt2(folders, sizes, strategy, which):
    tensors, config, folder = folders[which]
    mesh = eqxpar.make_mesh(**sizes)
    model, _ = load_hf(folder, mesh, strategy=strategy)
    assert isinstance(model, GPT) and model.vocab_size == VOCAB and model.padded_vocab_size == PADDED
    tokens = np.random.default_rng(3).integers(0, VOCAB, (4, GPT2_SHAPE["n_positions"]))
    got, want = logits(model, mesh, tokens), gpt2_reference_logits(tensors, config, tokens)
    error = np.abs(got - want).max() / np.abs(want).max()
    # float32 against float64: measured 3-5e-7 of the largest logit.
    print(f"GPT-2 {which} {sizes} {strategy}: largest logit error {error:.1e} of the largest logit")
    assert error <= 1e-5
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("scan_layers", [False, True])
@pytest.mark.parametrize("sizes, strategy", [({"data": 2, "model": 2}, "tensor"), ({"fsdp": 4, "model": 2}, "fsdp")])
def test_every_device_holds_its_block_of_the_file(folders, sizes, strategy, scan_layers):
    tensors, _, folder = folders["untied"]
    mesh = eqxpar.make_mesh(**sizes)
    model, specs = load_hf(folder, mesh, strategy=strategy, scan_layers=scan_layers)
    want = expected_arrays(tensors, scan_layers)
    arrays = {jax.tree_util.keystr(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(model)[0]}
    arrays = {k: v for k, v in arrays.items() if eqx.is_array(v)}
    assert set(arrays) == set(want)
    returned = {
        jax.tree_util.keystr(p): s
        for p, s in jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]
    }
    split = {"model": 0, "fsdp": 0}
    for path, leaf in arrays.items():
        for axis in leaf.sharding.spec:
            for name in (axis,) if isinstance(axis, str) else axis or ():
                split[name] += 1
        assert leaf.sharding.spec == returned[path], path  # placed as the returned specs say
        if scan_layers and ".blocks.layers." in path:
            assert leaf.sharding.spec[0] is None, path  # the layer axis is never split
        for shard in leaf.addressable_shards:  # each device's own block, bit for bit
            np.testing.assert_array_equal(np.asarray(shard.data), want[path][shard.index], err_msg=path)
    assert split["model"] > 0 and (strategy != "fsdp" or split["fsdp"] > 0), split


@pytest.mark.parametrize("sizes, strategy, parts", [({"model": 2}, "tensor", 2), ({"fsdp": 4}, "fsdp", 4)])
def test_each_device_reads_only_its_slice(folders, monkeypatch, sizes, strategy, parts):
    tensors, _, folder = folders["untied"]
    counter = CountingReads(monkeypatch)
    load_hf(folder, eqxpar.make_mesh(**sizes), strategy=strategy)
    assert counter.whole == []
    reads = counter.by_tensor()
    assert set(reads) == set(tensors)
    for name, blocks in reads.items():
        total = tensors[name].nbytes
        assert sum(n for n, _ in blocks) == total, (name, blocks)  # every byte read once, by one device
        big = name.endswith("weight") and tensors[name].ndim == 2 and "wte" not in name and "lm_head" not in name
        if big and (strategy == "fsdp" or "wpe" not in name):
            # c_attn: query, key and value each read in `parts` column blocks.
            assert max(n for n, _ in blocks) * parts <= total, (name, blocks)
    read = sum(n for _, n, _ in counter.reads)
    print(
        f"GPT-2 {sizes}: {read} bytes read of {sum(t.nbytes for t in tensors.values())}, {read / parts:.0f} per device"
    )


@pytest.mark.parametrize(
    "which, sizes, strategy, scan_layers, max_shard_bytes",
    [
        ("tied", {"model": 2}, "tensor", True, 2**31),
        ("untied", {"fsdp": 4, "model": 2}, "fsdp", False, 20_000),
    ],
)
def test_round_trip_is_exact(folders, tmp_path, which, sizes, strategy, scan_layers, max_shard_bytes):
    tensors, config, folder = folders[which]
    model, _ = load_hf(folder, eqxpar.make_mesh(**sizes), strategy=strategy, scan_layers=scan_layers)
    out = save_hf(model, tmp_path / "out", max_shard_bytes=max_shard_bytes)
    written = read_folder(out)
    # save_pretrained's names (transformer. prefix), no mask buffers; tied: no lm_head.
    want = {
        k if k.startswith(("transformer.", "lm_head")) else "transformer." + k: v
        for k, v in tensors.items()
        if not re.search(r"h\.\d+\.attn\.(bias|masked_bias)$", k)
    }
    assert set(written) == set(want)
    for name, array in want.items():
        np.testing.assert_array_equal(written[name], array, err_msg=name)
    saved = json.loads((out / "config.json").read_text())
    assert saved["tie_word_embeddings"] == (which == "tied")
    for key in ("n_embd", "n_head", "n_layer", "n_positions", "vocab_size", "layer_norm_epsilon", "resid_pdrop"):
        assert saved[key] == config[key], key
    assert saved["n_inner"] == GPT2_SHAPE["n_inner"] and saved["activation_function"] == "gelu_new"
    if max_shard_bytes < 2**31:
        assert (out / "model.safetensors.index.json").exists()


def test_tied_weights_are_written_as_the_head_says(folders, tmp_path):
    _, _, folder = folders["tied"]
    model, _ = load_hf(folder, eqxpar.make_mesh(model=2), strategy="tensor")
    # Trained apart: the head differs from the embedding, so it is written as lm_head.
    moved = eqx.tree_at(lambda m: m.head.weight, model, model.head.weight.at[3, 0].add(1.0))
    with pytest.raises(ValueError, match="tie_embeddings=True, but this GPT's head differs"):
        save_hf(moved, tmp_path / "refused", tie_embeddings=True)
    written = read_folder(save_hf(moved, tmp_path / "untied"))
    np.testing.assert_array_equal(written["lm_head.weight"], np.asarray(moved.head.weight)[:VOCAB])
    assert json.loads((tmp_path / "untied" / "config.json").read_text())["tie_word_embeddings"] is False
    # Equal, but asked not to tie: lm_head is written all the same.
    assert "lm_head.weight" in read_folder(save_hf(model, tmp_path / "asked", tie_embeddings=False))


def test_a_gpt_without_attention_biases_saves_as_the_same_gpt2(tmp_path):
    """eqxpar's own GPT (no attention biases, LayerNorm's epsilon) written as GPT-2 and read
    back: zero biases, the numpy GPT-2 of the written tensors gives the GPT's logits."""
    shapes = eqx.filter_eval_shape(
        GPT, VOCAB, 16, dim=32, num_heads=4, num_layers=2, mlp_ratio=2, key=jax.random.key(0)
    )
    rng = np.random.default_rng(7)  # random values in the constructor's structure (drawing them eagerly takes 6 s)
    model = jax.tree.map(
        lambda x: (
            jnp.asarray(0.2 * rng.standard_normal(x.shape), x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x
        ),
        shapes,
    )
    model = eqx.tree_at(lambda m: m.token_embedding.weight, model, model.token_embedding.weight.at[VOCAB:].set(0))
    mesh = eqxpar.make_mesh(model=2)
    model = eqxpar.shard(model, mesh, eqxpar.nn.partition_specs(model, mesh))
    out = save_hf(model, tmp_path / "gpt")
    written, config = read_folder(out), json.loads((out / "config.json").read_text())
    assert not written["transformer.h.1.attn.c_attn.bias"].any() and config["layer_norm_epsilon"] == 1e-5
    tokens = np.random.default_rng(4).integers(0, VOCAB, (2, 16))
    want = gpt2_reference_logits(written, config, tokens)
    got = logits(model, mesh, tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    back, _ = load_hf(out, mesh, strategy="tensor")
    np.testing.assert_array_equal(logits(back, mesh, tokens), got)


@pytest.mark.parametrize(
    "change, key",
    [
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
        ({"reorder_and_upcast_attn": True}, "reorder_and_upcast_attn"),
        ({"activation_function": "gelu"}, "activation_function"),
        ({"activation_function": "relu"}, "activation_function"),
        ({"add_cross_attention": True}, "add_cross_attention"),
        ({"n_inner": 48}, "n_inner"),
        ({"embd_pdrop": 0.0}, "embd_pdrop"),
        ({"n_ctx": 32}, "n_ctx"),
        ({"architectures": ["GPT2DoubleHeadsModel"]}, "architectures"),
        ({"n_embd": None}, "n_embd"),
        ({"layer_norm_epsilon": -1.0}, "layer_norm_epsilon"),
        ({"rotary_dim": 8}, "rotary_dim"),
    ],
)
def test_what_the_gpt_cannot_compute_is_refused_by_key(tmp_path, monkeypatch, change, key):
    folder = write_checkpoint(tmp_path / "c", gpt2_tensors(5), gpt2_config_json(**change))
    counter = CountingReads(monkeypatch)
    with pytest.raises(ValueError, match=f"config.json key '{key}'"):
        load_hf(folder, eqxpar.make_mesh(model=1))
    assert counter.reads == []  # refused before any weight is read


def test_bad_checkpoints_are_refused_before_reading(tmp_path, monkeypatch):
    counter = CountingReads(monkeypatch)
    mesh = eqxpar.make_mesh(model=2)
    untied = gpt2_tensors(6, tie=True)  # no lm_head.weight, but the config says untied
    with pytest.raises(ValueError, match="no tensor 'lm_head.weight'"):
        load_hf(write_checkpoint(tmp_path / "a", untied, gpt2_config_json(tie=False)), mesh)
    tensors = gpt2_tensors(6)
    tensors["transformer.h.1.mlp.c_fc.weight"] = tensors["transformer.h.1.mlp.c_fc.weight"][:, :48]
    with pytest.raises(ValueError, match=r"'transformer.h.1.mlp.c_fc.weight' .* shape \(32, 48\).*\(32, 64\)"):
        load_hf(write_checkpoint(tmp_path / "b", tensors, gpt2_config_json()), mesh)
    extra = {**gpt2_tensors(6), "transformer.h.2.ln_1.weight": np.ones(D, np.float32)}
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel has no place for: \['transformer.h.2.ln_1.weight'\]"):
        load_hf(write_checkpoint(tmp_path / "c", extra, gpt2_config_json()), mesh)
    renamed = {k.replace("wte", "embed"): v for k, v in gpt2_tensors(6).items()}
    with pytest.raises(ValueError, match="no 'transformer.wte.weight' or 'wte.weight'"):
        load_hf(write_checkpoint(tmp_path / "d", renamed, gpt2_config_json()), mesh)
    with pytest.raises(ValueError, match="heads"):  # 4 heads do not split over 8 devices
        load_hf(
            write_checkpoint(tmp_path / "e", gpt2_tensors(6), gpt2_config_json()),
            eqxpar.make_mesh(model=8),
            strategy="tensor",
        )
    assert counter.reads == []


def test_save_hf_refuses_what_gpt2_cannot_hold(folders, tmp_path):
    _, _, folder = folders["tied"]
    model, _ = load_hf(folder, eqxpar.make_mesh(model=1))
    other_eps = eqx.tree_at(lambda m: m.final_norm, model, eqx.nn.LayerNorm(D, eps=1e-6))
    with pytest.raises(ValueError, match="one layer_norm_epsilon"):
        save_hf(other_eps, tmp_path / "eps")
    with pytest.raises(ValueError, match="tie_embeddings must be True, False or None"):
        save_hf(model, tmp_path / "bad", tie_embeddings="yes")  # type: ignore[arg-type]
    assert not (tmp_path / "eps").exists() and not (tmp_path / "bad").exists()


@pytest.mark.thorough
@pytest.mark.parametrize("sizes, strategy", [({"data": 2, "model": 2}, "tensor"), ({"fsdp": 4, "model": 2}, "fsdp")])
def test_fine_tuning_a_loaded_gpt2_equals_one_device(tmp_path, sizes, strategy):
    """Two SGD-momentum steps from a loaded GPT-2 (its attention biases and epsilon in the
    GPT's blocks) under the hybrid step and under FSDP x TP equal one device's."""
    tensors = gpt2_tensors(8, tie=True)
    config = gpt2_config_json(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # no dropout: comparable
    folder = write_checkpoint(tmp_path / "ckpt", tensors, config)
    optimizer = optax.sgd(0.1, momentum=0.9)
    one = eqxpar.make_mesh(model=1)
    want, one_specs = load_hf(folder, one)
    value_and_grad = eqx.filter_jit(
        eqxpar.filter_shard_map(
            eqx.filter_value_and_grad(lambda m, b: next_token_loss(m, b)),
            mesh=one,
            in_specs=(one_specs, P()),
            out_specs=(P(), one_specs),
        )
    )
    mesh = eqxpar.make_mesh(**sizes)
    model, specs = load_hf(folder, mesh, strategy=strategy)
    loss_fn = lambda m, b, key: next_token_loss(m, b, key=key)  # noqa: E731
    if strategy == "fsdp":
        step = fsdp_step(loss_fn, optimizer, mesh, param_specs=specs)
    else:
        step = hybrid_step(loss_fn, optimizer, mesh, param_specs=specs)
    batch_axis = "fsdp" if strategy == "fsdp" else "data"
    model, opt_state = step.init(model)
    want_state = optimizer.init(eqx.filter(want, eqx.is_inexact_array))
    rng = np.random.default_rng(9)
    for _ in range(2):
        tokens = rng.integers(0, VOCAB, (8, 9)).astype(np.int32)
        loss, grads = value_and_grad(want, tokens)
        updates, want_state = optimizer.update(eqx.filter(grads, eqx.is_inexact_array), want_state)
        want = eqx.apply_updates(want, updates)
        model, opt_state, metrics = step(model, opt_state, shard_batch(tokens, mesh, batch_axis=batch_axis))
        np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-5)
    assert_trees_close(eqxpar.gather(model), want, rtol=1e-5, atol=1e-6, what="parameters after two steps")


def test_save_hf_refuses_a_mixture_of_experts_gpt(tmp_path):
    shapes = eqx.filter_eval_shape(
        GPT, VOCAB, 16, dim=32, num_heads=4, num_layers=2, moe=MoEOptions(num_experts=2, every=2), key=jax.random.key(0)
    )
    model = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x, shapes)
    with pytest.raises(ValueError, match="block 1 of this GPT is a MoEBlock; GPT-2 has only dense transformer blocks"):
        save_hf(model, tmp_path / "moe")
    assert not (tmp_path / "moe").exists()
