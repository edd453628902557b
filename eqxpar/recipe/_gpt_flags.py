"""The GPT recipes' speed flags (`--model-size`, `--dtype`, `--attention`, `--remat`,
`--scan-layers`), their checks, and the speed metrics the recipes write."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, TypeVar

import jax
import jax.numpy as jnp

from ..inspect import mfu
from ..models import GPT_CONFIGS, REMAT_CHOICES, gpt_config, remat_wrapper
from ..train import Precision

__all__ = ["GPTFlags", "check_gpt_flags", "speed_metrics", "speed_text"]

C = TypeVar("C", bound="GPTFlags")

# The flags' choices as Literal types: --help lists them and tyro refuses others (one line).
# They are eqxpar.models' GPT_CONFIGS and REMAT_CHOICES (tests/test_recipe_flags.py checks it).
ModelSize = Literal["custom", "10m", "124m", "1.3b"]
Dtype = Literal["float32", "bfloat16"]
Attention = Literal["dot_product", "reference"]
Remat = Literal["none", "block", "save_matmuls", "offload"]


@dataclasses.dataclass
class GPTFlags:
    """The flags of the GPT training recipes that choose how the model computes, not what:
    derive the recipe's `Config` from it (next to [`eqxpar.recipe.CheckpointFlags`][]), and
    check them with [`eqxpar.recipe.check_gpt_flags`][].

    - `--model-size NAME`: a named size of `eqxpar.models.GPT_CONFIGS` (10m, 124m, 1.3b) sets
      the recipe's `context`, `dim`, `heads` and `layers`; `custom` (default) keeps those
      flags. (`--config NAME`, its old name, still works and says so.)
    - `--dtype`: `float32`, or `bfloat16` compute on float32 master weights (the loss and
      the gradient sums stay float32): `cfg.precision()` is the [`eqxpar.train.Precision`][].
    - `--attention`, `--remat`, `--scan-layers`: the [`eqxpar.models.GPT`][] options
      `attention_impl`, `remat` and `scan_layers`.
    """

    # The comments are the flags' --help text (eqxpar.recipe.parse_flags reads them).
    model_size: ModelSize = "custom"  # a named GPT size setting --context/--dim/--heads/--layers; custom: those flags
    dtype: Dtype = "float32"  # compute dtype; bfloat16: on float32 master weights, float32 gradient sums
    attention: Attention = "dot_product"  # dot_product: jax.nn.dot_product_attention (cuDNN flash attention on GPU)
    remat: Remat = "none"  # what backward recomputes; offload: matmul outputs kept in host memory (GPU/TPU)
    scan_layers: bool = False  # stack the blocks and run them with jax.lax.scan (one compiled block at any depth)

    def precision(self):
        """The [`eqxpar.train.Precision`][] of `--dtype`: `Precision()` (no change) for float32."""
        return Precision(compute_dtype=jnp.bfloat16 if self.dtype == "bfloat16" else None)


def check_gpt_flags(cfg: C) -> C:
    """Check a [`eqxpar.recipe.GPTFlags`][] config's flags; returns it with `--model-size` applied.

    Call it from the recipe's `validate`, after `eqxpar.simulate_cpu_devices` (`--remat
    offload` asks the backend whether it can offload) and before the checks of
    `context`, `dim`, `heads` and `layers` (a named `--model-size` sets them).

    **Arguments:**

    - `cfg`: the parsed config, an instance of a subclass of `GPTFlags` with `context`,
      `dim`, `heads` and `layers` fields.

    **Returns:**

    `cfg`, with the named size's shape in place of its own when `--model-size` is not `custom`.

    **Raises:**

    - `ValueError` naming the flag, its choices and the value given; for `--remat offload`
      on a backend without host offload, naming the backend and the other choices.
    """
    choices = {
        "model_size": ("custom", *GPT_CONFIGS),
        "dtype": ("float32", "bfloat16"),
        "attention": ("dot_product", "reference"),
        "remat": REMAT_CHOICES,
    }
    for name, allowed in choices.items():
        if getattr(cfg, name) not in allowed:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} must be one of {', '.join(allowed)}, got {getattr(cfg, name)!r}.")
    try:
        remat_wrapper(cfg.remat)  # "offload": only where the backend can move arrays to the host
    except ValueError as error:
        raise ValueError(f"--remat {cfg.remat}: {error}") from None
    if cfg.model_size != "custom":
        cfg = dataclasses.replace(cfg, **dataclasses.asdict(gpt_config(cfg.model_size)))
    return cfg


def speed_metrics(tokens_per_second: float, flops_per_token: float, n_devices: int, dtype: str) -> dict[str, Any]:
    """A training run's speed, as the GPT recipes write it to `--metrics-out`.

    **Arguments:**

    - `tokens_per_second`: tokens trained per second, by all devices together; NaN
      ([`eqxpar.recipe.Throughput`][] before a second step) when nothing was timed.
    - `flops_per_token`: model FLOPs per trained token ([`eqxpar.models.gpt_flops_per_token`][]).
    - `n_devices`: the devices that share the work (the mesh's size).
    - `dtype`: the compute dtype's name (`--dtype`), for the peak the MFU is measured against.

    **Returns:**

    `{"tokens_per_second", "flops_per_token", "flops_per_second", "mfu"}`; `mfu` is a
    fraction of the devices' peak ([`eqxpar.inspect.mfu`][]), `None` where the peak is
    unknown (on CPU). A run that timed no step (`--steps 1`: its one step included the
    compile; or a `--resume` of a finished run) has `None` for the rates and the MFU.
    """
    timed = isinstance(tokens_per_second, (int, float)) and math.isfinite(tokens_per_second)
    return {
        "tokens_per_second": tokens_per_second if timed else None,
        "flops_per_token": flops_per_token,
        "flops_per_second": tokens_per_second * flops_per_token if timed else None,
        # No rate (a one-step run: its step included the compile) and no peak: no MFU.
        "mfu": mfu(tokens_per_second, flops_per_token, n_devices, jax.devices()[0], jnp.dtype(dtype))
        if timed
        else None,
    }


def speed_text(speed: dict[str, Any]) -> str:
    """[`eqxpar.recipe.speed_metrics`][]'s numbers for a recipe's last line:
    `"1,234 tokens/s, 5.6 GFLOP/s, MFU 40.0%"` (no MFU where the peak is unknown), or a
    note that no step was timed."""
    if speed["tokens_per_second"] is None:
        return "speed not measured (the first step includes the compile; measuring takes 2 or more steps)"
    text = f"{speed['tokens_per_second']:,.0f} tokens/s, {speed['flops_per_second'] / 1e9:,.1f} GFLOP/s"
    return text if speed["mfu"] is None else f"{text}, MFU {speed['mfu']:.1%}"
