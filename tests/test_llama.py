"""The Llama: one device equals a plain-JAX Llama written out here (RMSNorm, RoPE with
Llama 3 scaling, grouped-query attention, SwiGLU), and the parallel train steps equal one
device (loss, gradients, parameters after SGD-with-momentum steps) over drawn meshes."""

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _budget import PINS_ONLY
from hypothesis import example, given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import eqxpar
import eqxpar.nn
from eqxpar.inspect import CommReport
from eqxpar.models import Llama, LlamaConfig, llama_loss
from eqxpar.testing import assert_trees_close, check_parallel_parity, mesh_sizes
from eqxpar.train import fsdp_step, hybrid_step

VOCAB, SEQ, BATCH = 64, 8, 8
# Every width splits over 1, 2, 4 or 8 devices; num_kv_heads decides which model axes fit.
NUM_HEADS = 8
SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def config(num_kv_heads: int = 2, tie: bool = False, rope_scaling=None) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        dim=32,
        num_layers=2,
        num_heads=NUM_HEADS,
        num_kv_heads=num_kv_heads,
        hidden_dim=64,
        rope_scaling=rope_scaling,
        tie_embeddings=tie,
        max_seq_len=16,
    )


def tiny_llama(seed: int, num_kv_heads: int = 2, tie: bool = False, scan: bool = False, rope_scaling=None) -> Llama:
    # init_std 0.2, not 0.02: attention far from uniform, so RoPE and the head grouping matter.
    cfg = config(num_kv_heads, tie, rope_scaling)
    return Llama(cfg, scan_layers=scan, init_std=0.2, key=jax.random.key(seed))


def token_batch(seed: int, batch: int = BATCH) -> jnp.ndarray:
    return jax.random.randint(jax.random.key(seed), (batch, SEQ + 1), 0, VOCAB, dtype=jnp.int32)


def loss_fn(model, tokens, key):
    return llama_loss(model, tokens, key=key)


# --- One device equals a Llama written out in plain JAX ----------------------------------


def _rms(x, w, eps):
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + jnp.float32(eps)) * w.reshape(1, 1, -1)


def _inv_freq(cfg: LlamaConfig) -> np.ndarray:
    """RoPE frequencies, Llama 3 scaling written out again (float64, then float32)."""
    d = cfg.channels
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    s = cfg.scaling
    if s is not None:
        out = []
        for f in inv:
            wavelength = 2 * math.pi / f
            if wavelength < s.original_max_position_embeddings / s.high_freq_factor:
                out.append(f)  # high frequency: unchanged
            elif wavelength > s.original_max_position_embeddings / s.low_freq_factor:
                out.append(f / s.factor)  # low frequency: slowed down
            else:
                t = (s.original_max_position_embeddings / wavelength - s.low_freq_factor) / (
                    s.high_freq_factor - s.low_freq_factor
                )
                out.append((1 - t) * f / s.factor + t * f)
        inv = np.array(out)
    return inv.astype(np.float32)


def reference_logits(model: Llama, tokens: jnp.ndarray) -> jnp.ndarray:
    """Hugging Face Llama's forward pass, from the model's (global) weights."""
    cfg = model.config
    blocks = model.layers.unstack() if model.scan_layers else model.layers
    batch, seq = tokens.shape
    heads, kv, hd = cfg.num_heads, cfg.kv_heads, cfg.channels
    angles = np.arange(seq, dtype=np.float32)[:, None] * _inv_freq(cfg)[None, :]
    cos = jnp.asarray(np.cos(np.concatenate([angles, angles], -1)))[None, :, None, :]
    sin = jnp.asarray(np.sin(np.concatenate([angles, angles], -1)))[None, :, None, :]

    def rotate(x):  # HF rotate_half: (x1, x2) -> (-x2, x1)
        return jnp.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], axis=-1)

    causal = jnp.tril(jnp.ones((seq, seq), bool))
    x = model.embed_tokens.weight[tokens]
    for block in blocks:
        a = block.self_attn
        h = _rms(x, block.input_layernorm.weight, cfg.norm_eps)
        q = (h @ a.q_proj.weight.T).reshape(batch, seq, heads, hd)
        k = (h @ a.k_proj.weight.T).reshape(batch, seq, kv, hd)
        v = (h @ a.v_proj.weight.T).reshape(batch, seq, kv, hd)
        q, k = q * cos + rotate(q) * sin, k * cos + rotate(k) * sin
        k, v = jnp.repeat(k, heads // kv, axis=2), jnp.repeat(v, heads // kv, axis=2)  # HF repeat_kv
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.float32(math.sqrt(hd))
        scores = jnp.where(causal[None, None], scores, -jnp.inf)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(batch, seq, heads * hd)
        x = x + out @ a.o_proj.weight.T
        m = block.mlp
        h = _rms(x, block.post_attention_layernorm.weight, cfg.norm_eps)
        x = x + (jax.nn.silu(h @ m.gate_proj.weight.T) * (h @ m.up_proj.weight.T)) @ m.down_proj.weight.T
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    return _rms(x, model.norm.weight, cfg.norm_eps) @ head.T


def _random_norms(model: Llama, seed: int) -> Llama:
    """Norm weights away from 1, so a swapped or skipped norm shows."""
    keys = iter(jax.random.split(jax.random.key(seed), 64))

    def is_norm(node):
        return isinstance(node, eqxpar.models.RMSNorm)

    return jax.tree.map(
        lambda n: (
            eqx.tree_at(lambda r: r.weight, n, 1 + 0.3 * jax.random.normal(next(keys), n.weight.shape))
            if is_norm(n)
            else n
        ),
        model,
        is_leaf=is_norm,
    )


def one_device_logits(model: Llama, tokens):
    mesh = eqxpar.make_mesh(model=1)
    specs = eqxpar.nn.partition_specs(model, mesh)
    out = P(*(None,) * tokens.ndim, "model")  # the vocabulary blocks, joined (one block here)
    forward = eqxpar.filter_shard_map(lambda m, t: m(t), mesh=mesh, in_specs=(specs, P()), out_specs=out)
    return eqx.filter_jit(forward)(model, tokens)


@pytest.mark.parametrize(
    "num_kv_heads, tie, scan, scaling",
    [(2, False, False, None), (1, True, True, SCALING), (8, False, False, SCALING), (4, True, False, None)],
)
def test_one_device_equals_plain_jax_llama(num_kv_heads, tie, scan, scaling):
    model = _random_norms(tiny_llama(3, num_kv_heads, tie, scan, scaling), 4)
    tokens = token_batch(5, 4)[:, :-1]
    got = one_device_logits(model, tokens)
    want = reference_logits(model, tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # The logits are far from uniform: a wrong rotation or head grouping would show.
    assert float(jnp.std(want)) > 0.5


def test_reference_would_see_a_wrong_rotation_or_grouping():
    """The comparison is sensitive to what it checks: unscaled frequencies and another
    grouping of query heads onto key/value heads each move the logits by far more than 1e-5."""
    model = tiny_llama(3, 2, rope_scaling=SCALING)
    tokens = token_batch(5, 2)[:, :-1]
    want = np.asarray(reference_logits(model, tokens))
    unscaled = tiny_llama(3, 2)  # the same weights, no frequency scaling
    assert np.max(np.abs(np.asarray(reference_logits(unscaled, tokens)) - want)) > 1e-3
    # Another grouping: the kv heads' order swapped reads the other group's keys.
    swapped = model
    for i in range(2):
        for proj in ("k_proj", "v_proj"):
            w = getattr(model.layers[i].self_attn, proj).weight
            w = jnp.concatenate([w[w.shape[0] // 2 :], w[: w.shape[0] // 2]])
            swapped = eqx.tree_at(lambda m, i=i, proj=proj: getattr(m.layers[i].self_attn, proj).weight, swapped, w)
    assert np.max(np.abs(np.asarray(one_device_logits(swapped, tokens)) - want)) > 1e-3


def test_single_sequence_equals_its_row_of_a_batch():
    model = tiny_llama(1)
    tokens = token_batch(2, 2)[:, :-1]
    batched = one_device_logits(model, tokens)
    single = one_device_logits(model, tokens[1])
    np.testing.assert_allclose(np.asarray(single), np.asarray(batched[1]), rtol=1e-5, atol=1e-6)


def test_rms_norm_statistics_in_float32_for_bfloat16_input():
    norm = eqxpar.models.RMSNorm(32)
    norm = eqx.tree_at(lambda n: n.weight, norm, 1 + 0.3 * jax.random.normal(jax.random.key(0), (32,)))
    # Large values: their squares' mean loses digits in bfloat16 (8 bits of mantissa).
    x = (300 + 10 * jax.random.normal(jax.random.key(1), (4, 32))).astype(jnp.bfloat16)
    got = norm(x)
    assert got.dtype == jnp.bfloat16
    x32 = x.astype(jnp.float32)
    want = (x32 / jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-5)).astype(jnp.bfloat16)
    want = want * norm.weight.astype(jnp.bfloat16)[None]
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_scanned_and_unscanned_layers_are_the_same_model():
    tokens = token_batch(6, 2)[:, :-1]
    looped, scanned = tiny_llama(7, 2), tiny_llama(7, 2, scan=True)
    assert_trees_close(scanned.layers.unstack(), looped.layers, what="the same key's layers")
    np.testing.assert_allclose(
        np.asarray(one_device_logits(scanned, tokens)), np.asarray(one_device_logits(looped, tokens)), rtol=1e-6
    )


# --- Parallel train steps equal one device -----------------------------------------------


def sgd_momentum() -> optax.GradientTransformation:
    # Not Adam: a gradient off by a constant factor (a doubled or dropped psum) would hide.
    return optax.sgd(0.1, momentum=0.9)


def keeping_gradients(optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
    """`optimizer` that also keeps the last gradient it was given in its state (`state[0]`),
    so the parallel step's gradients can be compared with one device's."""

    def init(params):
        return jax.tree.map(jnp.zeros_like, params), optimizer.init(params)

    def update(updates, state, params=None):
        new_updates, inner = optimizer.update(updates, state[1], params)
        return new_updates, (updates, inner)

    return optax.GradientTransformation(init, update)


OPTIMIZER = keeping_gradients(sgd_momentum())
STEPS = 2


@functools.cache
def reference_value_and_grad(num_kv_heads: int, tie: bool, scan: bool):
    """One device: plain Equinox autodiff inside shard_map over a one-device mesh."""
    mesh = eqxpar.make_mesh(model=1)
    specs = eqxpar.nn.partition_specs(tiny_llama(0, num_kv_heads, tie, scan), mesh)
    return eqx.filter_jit(
        eqxpar.filter_shard_map(
            eqx.filter_value_and_grad(lambda m, b: llama_loss(m, b)),
            mesh=mesh,
            in_specs=(specs, P()),
            out_specs=(P(), specs),
        )
    )


def reference_run(model, batches):
    """One device, plain optax: (losses, gradients per step, final model)."""
    value_and_grad = reference_value_and_grad(model.config.kv_heads, model.config.tie_embeddings, model.scan_layers)
    optimizer = sgd_momentum()
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    losses, grads_per_step = [], []
    for batch in batches:
        loss, grads = value_and_grad(model, batch)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        model = eqx.apply_updates(model, updates)
        losses.append(float(loss))
        grads_per_step.append(jax.tree.map(np.asarray, grads))
    return losses, grads_per_step, model


@functools.cache
def cached_step(strategy: str, sizes: tuple, num_kv_heads: int, tie: bool, scan: bool):
    mesh = eqxpar.make_mesh(**dict(sizes))
    if strategy == "hybrid":
        return hybrid_step(loss_fn, OPTIMIZER, mesh)
    units = (lambda m: m.layers) if scan else None  # FSDP gathering one stack of layers at a time
    return fsdp_step(loss_fn, OPTIMIZER, mesh, units=units)


def parallel_run(strategy, sizes, model, batches):
    cfg = model.config
    step = cached_step(strategy, tuple(sizes.items()), cfg.kv_heads, cfg.tie_embeddings, model.scan_layers)
    model, opt_state = step.init(model)
    batch_axis = "data" if strategy == "hybrid" else "fsdp"
    losses, grads_per_step = [], []
    for batch in batches:
        model, opt_state, metrics = step(model, opt_state, eqxpar.shard(batch, step.mesh, P(batch_axis)))
        losses.append(float(metrics["loss"]))
        grads_per_step.append(jax.tree.map(np.asarray, opt_state[0]))  # before the next step donates it
    return losses, grads_per_step, model


def check_parity(strategy, sizes, num_kv_heads, scan, tie, seed):
    model_axis = sizes["model"]
    if num_kv_heads % model_axis:
        # Fewer key/value heads than the model axis (or a split that cuts one): refused
        # before anything compiles, naming both numbers and the fix.
        with pytest.raises(ValueError, match=rf"{model_axis} devices.*num_kv_heads={num_kv_heads}.*Use a model axis"):
            eqxpar.nn.partition_specs(tiny_llama(seed, num_kv_heads, tie, scan), eqxpar.make_mesh(**sizes))
        return
    batches = [token_batch(seed + i) for i in range(STEPS)]
    # A fresh model for each run: the step donates (deletes) the arrays it is given.
    want_losses, want_grads, want = reference_run(tiny_llama(seed, num_kv_heads, tie, scan), batches)
    losses, grads, got = parallel_run(strategy, sizes, tiny_llama(seed, num_kv_heads, tie, scan), batches)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for i in range(STEPS):
        assert_trees_close(grads[i], want_grads[i], what=f"gradients at step {i}")
    assert_trees_close(got, want, what=f"parameters after {strategy} steps")


KV_HEADS = st.sampled_from([1, 2, NUM_HEADS])
PARALLEL = (2, 4, 8)  # device counts: a one-device mesh is the reference itself


@PINS_ONLY  # the three pins; draws under HYPOTHESIS_PROFILE=thorough (make test time)
@given(
    sizes=mesh_sizes(("data", "model"), PARALLEL),
    num_kv_heads=KV_HEADS,
    scan=st.booleans(),
    tie=st.booleans(),
    seed=st.integers(0, 2**16),
)
# kv heads fewer than the model axis: refused (the error is the property's other branch).
@example(sizes={"data": 2, "model": 4}, num_kv_heads=2, scan=False, tie=False, seed=0)
# kv heads == model axis size: one kv head per device.
@example(sizes={"data": 4, "model": 2}, num_kv_heads=2, scan=False, tie=False, seed=1)
# scanned layers with tensor parallelism, and tied embeddings under tensor parallelism.
@example(sizes={"data": 2, "model": 4}, num_kv_heads=NUM_HEADS, scan=True, tie=True, seed=2)
def test_hybrid_llama_matches_one_device(sizes, num_kv_heads, scan, tie, seed):
    check_parity("hybrid", sizes, num_kv_heads, scan, tie, seed)


@PINS_ONLY  # the three pins; draws under HYPOTHESIS_PROFILE=thorough (make test time)
@given(
    sizes=mesh_sizes(("fsdp", "model"), PARALLEL),
    num_kv_heads=KV_HEADS,
    scan=st.booleans(),
    tie=st.booleans(),
    seed=st.integers(0, 2**16),
)
# FSDP x TP with the layers scanned (one stack gathered at a time) and tied embeddings.
@example(sizes={"fsdp": 2, "model": 2}, num_kv_heads=2, scan=True, tie=True, seed=3)
# FSDP x TP over 8 devices, as many key/value heads as query heads (two of each per device).
@example(sizes={"fsdp": 2, "model": 4}, num_kv_heads=NUM_HEADS, scan=False, tie=False, seed=5)
# Pure FSDP (model=1): multi-query attention.
@example(sizes={"fsdp": 4, "model": 1}, num_kv_heads=1, scan=False, tie=False, seed=4)
def test_fsdp_llama_matches_one_device(sizes, num_kv_heads, scan, tie, seed):
    check_parity("fsdp", sizes, num_kv_heads, scan, tie, seed)


def test_the_parity_toolkit_takes_the_llama_as_its_own_dense_model():
    model = tiny_llama(0, 2, tie=True, scan=True)
    report = check_parallel_parity(
        model, model, loss_fn, sgd_momentum(), eqxpar.make_mesh(data=2, model=2), token_batch(0), steps=2
    )
    assert "parallel == dense" in str(report)


def test_tensor_parallel_all_reduces_are_the_designed_ones():
    """Over the model axis: per layer one all-reduce forward in o_proj and in down_proj and
    one backward for each region's input (q/k/v share one, gate/up share one), plus the
    embedding's lookup and the head's input gradient; two of per-token loss statistics;
    one 4-byte one for the gradient norm. Over data: one of the gradients and the loss."""
    sizes = {"data": 2, "model": 4}
    model, batch = tiny_llama(0, 4, tie=True), token_batch(0)
    step = cached_step("hybrid", tuple(sizes.items()), 4, True, False)
    placed, opt_state = step.init(model)
    report = CommReport.of(step.lower(placed, opt_state, eqxpar.shard(batch, step.mesh, P("data"))))
    over_model = [c for c in report.collectives("all-reduce") if c.group_size == 4]
    over_data = [c for c in report.collectives("all-reduce") if c.group_size == 2]
    activation_bytes = (BATCH // 2) * SEQ * model.config.dim * 4
    activations = [c for c in over_model if c.bytes == activation_bytes]
    assert len(activations) == 4 * model.config.num_layers + 2
    assert len([c for c in over_model if c.bytes == 4]) == 1
    assert len([c for c in over_model if c.bytes not in (activation_bytes, 4)]) == 2
    assert len(over_data) == 1
    assert len(report.collectives()) == len(over_model) + len(over_data)


@pytest.mark.thorough
@given(
    sizes=mesh_sizes(("data", "model"), PARALLEL),
    num_kv_heads=KV_HEADS,
    scan=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_hybrid_llama_remat_matches_one_device(sizes, num_kv_heads, scan, seed):
    """Heavy variant: recomputing each block (remat='block') changes nothing."""
    if num_kv_heads % sizes["model"]:
        return
    batches = [token_batch(seed + i) for i in range(STEPS)]
    want_losses, _, want = reference_run(tiny_llama(seed, num_kv_heads, scan=scan), batches)
    model = Llama(config(num_kv_heads), scan_layers=scan, remat="block", init_std=0.2, key=jax.random.key(seed))
    step = hybrid_step(loss_fn, OPTIMIZER, eqxpar.make_mesh(**sizes))
    model, opt_state = step.init(model)
    losses = []
    for batch in batches:
        model, opt_state, metrics = step(model, opt_state, eqxpar.shard(batch, step.mesh, P("data")))
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_trees_close(jax.tree.leaves(model), jax.tree.leaves(want), what="parameters with remat")
