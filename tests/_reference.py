"""The GPT recipes' training run written out plainly on one device, for the recipe tests to
compare against: no eqxpar step builder, no planner, just Equinox and optax, on the text the
recipes train on (their text flags checked and loaded through `eqxpar.recipe`'s public
functions, each batch placed on a one-device mesh)."""

from __future__ import annotations

import dataclasses
import functools

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import eqxpar
import eqxpar.nn
import eqxpar.recipe
from eqxpar.datasets import python_source_text, text_windows
from eqxpar.models import GPT, next_token_loss


@dataclasses.dataclass
class TextConfig(eqxpar.recipe.TextFlags):
    """The recipes' text flags alone, at their defaults: the bundled corpus, a BPE of 512
    tokens trained on it (cached in $EQXPAR_CACHE, which tests/conftest.py shares with the
    recipes), 5% of its documents held out, document masks."""


@functools.cache
def recipe_text(seq_len: int, **flags) -> eqxpar.recipe.TextData:
    """The text a recipe trains on with rows of `seq_len` tokens (its `--context`, or
    `--seq-len`) and the text flags `flags` (defaults otherwise), checked and loaded as the
    recipes do it."""
    cfg = eqxpar.recipe.check_text_flags(TextConfig(seq_len=seq_len, **flags), context=seq_len)
    return eqxpar.recipe.load_text(cfg, progress=False)


def one_device_mesh(**axes: int):
    """A mesh of the first device, every axis of size 1 (default: `model`, which the GPT's
    layers need bound; size 1 runs them densely)."""
    return eqxpar.make_mesh(**(axes or {"model": 1}))


def text_reference_losses(
    model: GPT, *, seq: int, batch: int, steps: int, seed: int, lr: float, **text_flags
) -> dict[str, float]:
    """Train `model` as the recipes do: global batch `i` of the packed rows (`text.batch(i,
    ..., seed=seed)`, here whole on one device), AdamW(`lr`), `next_token_loss` on the packed
    dict (document masks); then the held-out rows' metrics (`text.val_batch`,
    `text.val_metrics`). Returns the first and final losses, their mean (`final_loss_mean10`:
    the recipes' mean of the last ten, all of them here), `val_loss`, `val_perplexity` and
    `val_bits_per_byte`."""
    text = recipe_text(seq, **text_flags)
    mesh = one_device_mesh()
    specs = eqxpar.nn.partition_specs(model, mesh)

    def loss_fn(model, rows):
        return eqxpar.filter_shard_map(
            lambda m, b: next_token_loss(m, b), mesh=mesh, in_specs=(specs, P()), out_specs=P()
        )(model, rows)

    optimizer = optax.adamw(lr)

    @eqx.filter_jit
    def train_step(model, opt_state, rows):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, rows)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    losses = []
    for i in range(steps):
        rows = text.batch(i, mesh, global_batch_size=batch, seed=seed, batch_axis=None)
        model, opt_state, loss = train_step(model, opt_state, rows)
        losses.append(float(loss))
    val_rows, counts = text.val_batch(mesh)
    val = text.val_metrics(float(eqx.filter_jit(loss_fn)(model, val_rows)), counts)
    return {
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "final_loss_mean10": float(np.mean(losses[-10:])),
        **val,
    }


def gpt_reference_losses(
    model: GPT, *, seq: int, batch: int, steps: int, seed: int, lr: float, val_batch: int = 64
) -> dict[str, float]:
    """Train `model` as the recipes did before they trained on packed token rows (long_context
    still does, until it is converted; then this goes): `text_windows` batches of the first
    nine tenths of the Python source text (per seed and step), AdamW(`lr`); then the held-out loss of
    `val_batch` windows of the last tenth (seed 1234). Returns the first and final losses,
    their mean (`final_loss_mean10`: the recipes' mean of the last ten, all of them here)
    and the held-out loss."""
    text = python_source_text()
    split = int(0.9 * len(text.ids))
    mesh = eqxpar.make_mesh(model=1)  # the GPT's layers need their axis bound; size 1 runs densely
    specs = eqxpar.nn.partition_specs(model, mesh)

    def loss_fn(model, tokens):
        return eqxpar.filter_shard_map(
            lambda m, b: next_token_loss(m, b), mesh=mesh, in_specs=(specs, P()), out_specs=P()
        )(model, tokens)

    optimizer = optax.adamw(lr)

    @eqx.filter_jit
    def train_step(model, opt_state, tokens):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    losses = []
    for i in range(steps):
        tokens = jnp.asarray(text_windows(text.ids[:split], batch, seq, seed=seed, step=i))
        model, opt_state, loss = train_step(model, opt_state, tokens)
        losses.append(float(loss))
    val = eqx.filter_jit(loss_fn)(model, jnp.asarray(text_windows(text.ids[split:], val_batch, seq, seed=1234, step=0)))
    return {
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "final_loss_mean10": float(np.mean(losses[-10:])),
        "val_loss": float(val),
    }


def assert_reference_losses(metrics: dict, reference: dict, keys=None) -> None:
    """The recipe's metrics equal the reference's, key by key (`keys`: default all of
    the reference's), to float32 rounding (rtol 1e-5)."""
    for key in reference if keys is None else keys:
        np.testing.assert_allclose(metrics[key], reference[key], rtol=1e-5, err_msg=key)
