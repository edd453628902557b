"""The GPT recipes' training run written out plainly on one device, for the recipe tests to
compare against: no eqxpar step builder, no planner, just Equinox and optax."""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import eqxpar
import eqxpar.nn
from eqxpar.datasets import python_source_text, text_windows
from eqxpar.models import GPT, next_token_loss


def gpt_reference_losses(
    model: GPT, *, seq: int, batch: int, steps: int, seed: int, lr: float, val_batch: int = 64
) -> dict[str, float]:
    """Train `model` as the recipes do: `text_windows` batches of the first nine tenths of
    the Python source text (per seed and step), AdamW(`lr`); then the held-out loss of
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
