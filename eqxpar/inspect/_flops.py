"""FLOPs and model FLOPs utilisation (MFU): the formula, the compiled program's count, and
accelerators' peak FLOP/s."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from ._format import unwrap

__all__ = ["transformer_flops_per_token", "compiled_flops", "PEAK_FLOPS", "peak_flops", "mfu"]


def transformer_flops_per_token(
    n_params: int,
    n_layers: int,
    dim: int,
    seq_len: int,
    *,
    backward: bool = True,
) -> int:
    """Model FLOPs per token of a decoder-only transformer (the PaLM appendix-B count).

    The formula, for `N = n_params` matmul parameters, `L = n_layers`, attention width
    `d = dim` (heads x head size) and `T = seq_len` attended positions:

    - forward: `2 N` (one multiply and one add per matmul weight and token) plus
      `4 L T d` (the `T x T` attention scores `Q K^T` and the weighted sum of the values,
      `2 T d` each per layer and token);
    - training (`backward=True`): three times the forward pass (the backward pass computes
      a gradient for both operands of every matmul: twice the forward's FLOPs):
      `6 N + 12 L T d`.

    Count as `N` only the weights that multiply activations: attention and MLP matrices
    and an untied output head; not embedding tables (a lookup, no FLOPs), layer norms or
    biases (O(d) per token). The attention term counts the whole `T x T` score matrix, as
    XLA computes it under a causal mask (a kernel that skips the masked half does about
    half of it). Element-wise work (softmax, GELU, layer norms, the optimizer) is not model
    FLOPs: see [`eqxpar.inspect.compiled_flops`][] for everything the program does.

    **Arguments:**

    - `n_params`: matmul parameters `N`.
    - `n_layers`, `dim`, `seq_len`: `L`, `d`, `T` above.
    - `backward`: count the backward pass too (training); `False` for the forward only.

    **Returns:**

    FLOPs per token, an `int`.

    **Raises:**

    - `ValueError` for a negative or non-integer size.
    """
    for name, value in (("n_params", n_params), ("n_layers", n_layers), ("dim", dim), ("seq_len", seq_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"transformer_flops_per_token: {name} must be a non-negative integer, got {value!r}.")
    forward = 2 * n_params + 4 * n_layers * seq_len * dim
    return 3 * forward if backward else forward


def compiled_flops(compiled: Any) -> float | None:
    """The FLOPs XLA counts in a compiled program (`compiled.cost_analysis()["flops"]`).

    For a program split over a mesh this is **per device** (XLA analyses the partitioned,
    per-device program). XLA counts `2 M N K` per matmul and one FLOP per element of
    element-wise arithmetic, so it sits above [`eqxpar.inspect.transformer_flops_per_token`][]
    by the element-wise work (layer norms, softmax, activations, the optimizer update).

    **Arguments:**

    - `compiled`: a `jax.stages.Compiled` (`jax.jit(f).lower(...).compile()`) or Equinox's
      wrapper of one (`eqx.filter_jit(f).lower(...).compile()`).

    **Returns:**

    The FLOP count, or `None` when the backend gives no cost analysis. Handles both forms
    JAX has returned: one dict, or a list with one dict per program.
    """
    inner = unwrap(compiled, "compiled")
    if not isinstance(inner, jax.stages.Compiled):
        raise ValueError(
            "compiled_flops: expected a compiled program (jax.jit(f).lower(...).compile()), "
            f"got {type(compiled).__name__}."
        )
    analysis = inner.cost_analysis()
    if analysis is None:
        return None
    if isinstance(analysis, dict):
        analysis = [analysis]
    values = [a.get("flops") for a in analysis if a]
    values = [v for v in values if v is not None]
    return float(sum(values)) if values else None


# Dense (no 2:4 sparsity) peak FLOP/s per chip, keyed by a lower-case substring of
# `jax.devices()[0].device_kind`; the first key found in the kind wins (longer, more
# specific keys first). Sources:
# - NVIDIA H100 SXM: 989 TFLOP/s bf16 tensor core dense, 67 TFLOP/s fp32 (CUDA cores),
#   NVIDIA H100 datasheet; H200 is the same GH100 silicon and clocks with more memory
#   (NVIDIA H200 datasheet gives the same 989 / 67). H100 PCIe: 756 / 51.
# - NVIDIA A100 (SXM and PCIe): 312 TFLOP/s bf16 dense, 19.5 TFLOP/s fp32, A100 datasheet.
# - Google Cloud TPU docs (cloud.google.com/tpu/docs/v4, v5e, v5p, v6e): peak bf16 per
#   chip 275 (v4), 197 (v5e, "v5 lite"), 459 (v5p), 918 (v6e, Trillium) TFLOP/s. TPUs have
#   no separate fp32 matmul peak (fp32 matmuls run as bf16 passes on the MXU): fp32 is
#   left unknown there, so `mfu` gives None rather than a made-up figure.
# fp32 on NVIDIA: the CUDA-core figure. XLA may run fp32 matmuls on TF32 tensor cores
# (jax_default_matmul_precision), which makes an fp32 MFU over this peak exceed 1.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "h100 pcie": {"bfloat16": 756e12, "float16": 756e12, "float32": 51e12},
    "h200": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
    "h100": {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
    "a100": {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
    "tpu v6": {"bfloat16": 918e12},  # JAX names v6e "TPU v6 lite"
    "tpu v5 lite": {"bfloat16": 197e12},  # JAX names v5e "TPU v5 lite"
    "tpu v5e": {"bfloat16": 197e12},
    "tpu v5p": {"bfloat16": 459e12},
    "tpu v5": {"bfloat16": 459e12},  # JAX names v5p "TPU v5"
    "tpu v4": {"bfloat16": 275e12},
}
"""Peak dense FLOP/s per chip by dtype name, keyed by a lower-case substring of the
device kind (first match wins): H100 SXM and H200 989e12 bf16 / 67e12 fp32, H100 PCIe
756e12 / 51e12, A100 312e12 / 19.5e12 (NVIDIA datasheets); TPU v4 275e12, v5e 197e12,
v5p 459e12, v6e 918e12 bf16 (Google Cloud TPU docs). TPUs have no fp32 entry."""


def _kind_of(device: Any) -> str:
    if device is None:
        device = jax.devices()[0]
    kind = device if isinstance(device, str) else getattr(device, "device_kind", "")
    return str(kind).lower()


def peak_flops(device: Any = None, dtype: Any = jnp.bfloat16) -> float | None:
    """The peak dense FLOP/s of one chip for matmuls in `dtype`, from [`PEAK_FLOPS`][eqxpar.inspect.PEAK_FLOPS].

    **Arguments:**

    - `device`: a `jax.Device` or its `device_kind` string (default `jax.devices()[0]`).
    - `dtype`: the matmuls' dtype (`jnp.bfloat16`, `jnp.float16` or `jnp.float32`).

    **Returns:**

    FLOP/s, or `None` for a CPU, an accelerator not in the table, or a dtype it has no
    figure for.
    """
    kind = _kind_of(device)
    name = jnp.dtype(dtype).name
    for key, peaks in PEAK_FLOPS.items():
        if key in kind:
            return peaks.get(name)
    return None


def mfu(
    tokens_per_second: float,
    flops_per_token: float,
    n_devices: int,
    device: Any = None,
    dtype: Any = jnp.bfloat16,
) -> float | None:
    """Model FLOPs utilisation: `tokens_per_second x flops_per_token / (n_devices x peak)`.

    **Arguments:**

    - `tokens_per_second`: tokens trained per second by all `n_devices` together.
    - `flops_per_token`: model FLOPs per token, e.g. from
      [`eqxpar.inspect.transformer_flops_per_token`][].
    - `n_devices`: the chips that share the work.
    - `device`, `dtype`: as in [`eqxpar.inspect.peak_flops`][].

    **Returns:**

    A fraction (0.4 = 40%), or `None` when the peak is unknown (on CPU, for instance:
    report FLOP/s instead).

    **Raises:**

    - `ValueError` for a negative rate or FLOP count, or fewer than one device.
    """
    if not isinstance(n_devices, int) or n_devices < 1:
        raise ValueError(f"mfu: n_devices must be a positive integer, got {n_devices!r}.")
    if not (math.isfinite(tokens_per_second) and tokens_per_second >= 0):
        raise ValueError(f"mfu: tokens_per_second must be a non-negative number, got {tokens_per_second!r}.")
    if not (math.isfinite(flops_per_token) and flops_per_token >= 0):
        raise ValueError(f"mfu: flops_per_token must be a non-negative number, got {flops_per_token!r}.")
    peak = peak_flops(device, dtype)
    if peak is None:
        return None
    return tokens_per_second * flops_per_token / (n_devices * peak)
