"""The machine a plan is for: devices, memory, FLOP/s and the links between devices.

Every preset's numbers come from the vendors' datasheets (cited beside each); FLOP/s are
[`eqxpar.inspect.peak_flops`][]'s, for the dtype the plan computes in. Bandwidths are per
device and direction (what one device can send while receiving as much), the figure a ring
collective's time depends on.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from ..inspect import peak_flops

GB = 1e9
GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Link:
    """One kind of connection between two devices: `bandwidth` bytes/s per device and
    direction, `latency` seconds per ring hop, and its `name` (for the reasons plans give)."""

    name: str
    bandwidth: float
    latency: float


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A machine of `hosts` hosts with `devices_per_host` devices each.

    - `memory_per_device`: bytes of accelerator memory a step may use. The GPU presets
      take the datasheet's, but a JAX process gets only `XLA_PYTHON_CLIENT_MEM_FRACTION`
      of it (0.75 unless set; `benchmarks/gpu.py` sets 0.92): plan with what the
      allocator gives (`device.memory_stats()["bytes_limit"]`, what `--layout auto` uses).
    - `peak_flops`: a dict from dtype name (`"bfloat16"`, `"float32"`) to dense FLOP/s per
      device, or a device kind [`eqxpar.inspect.peak_flops`][] knows (`"h100"`, `"tpu v5p"`).
    - `intra_host_bandwidth`, `inter_host_bandwidth`: bytes/s per device and direction
      inside a host (NVLink, ICI) and between hosts (InfiniBand, DCN).
    - `intra_host_latency`, `inter_host_latency`: seconds per ring hop on each.
    - `efficiency`: the fraction of the peak a matmul-bound step reaches (calibrated on
      measured steps; see docs/concepts/planner.md).
    - `fused_attention`: attention runs as a fused kernel (cuDNN's on NVIDIA GPUs, as
      `attention_impl="dot_product"` asks for in bfloat16), which keeps a log-sum-exp per
      query instead of the attention probabilities for the backward pass.
    - `parameter_overlap`: the fraction of the gradient and parameter collectives' time
      hidden behind compute, in [0, 1]. Default 0: eqxpar's steps sum the gradients in one
      all-reduce after the backward pass, and `fsdp_step` (as plans build it, without
      `units`) gathers the parameters before the forward pass, so by construction nothing
      overlaps; a step that overlaps them would set it higher.
    - `name`: for tables and reasons.

    **Which link an axis crosses.** Mesh axes are laid out inner to outer in the order
    `model, context, expert, fsdp, data, stage` (the innermost varies fastest over device
    ids; `expert` only in plans for a mixture-of-experts GPT). A
    collective over a set of axes stays inside a host when its group's devices span at most
    `devices_per_host` consecutive ids, that is when the product of the sizes of the axes
    up to the outermost one it uses is at most `devices_per_host`; otherwise it crosses
    hosts and runs at the inter-host figures. `axis_links` overrides this per axis (e.g.
    `{"data": "inter"}` for a machine whose hosts hold more than one replica but should
    not count on it).
    """

    devices_per_host: int
    hosts: int
    memory_per_device: float
    peak_flops: Any
    intra_host_bandwidth: float
    inter_host_bandwidth: float
    intra_host_latency: float = 2e-6
    inter_host_latency: float = 10e-6
    efficiency: float = 0.5
    fused_attention: bool = False
    parameter_overlap: float = 0.0
    name: str = "cluster"
    axis_links: dict[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        for field in ("devices_per_host", "hosts"):
            value = getattr(self, field)
            if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
                raise ValueError(f"Cluster: {field} must be a positive integer, got {value!r}.")
        for field in (
            "memory_per_device",
            "intra_host_bandwidth",
            "inter_host_bandwidth",
            "intra_host_latency",
            "inter_host_latency",
        ):
            value = getattr(self, field)
            if not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
                raise ValueError(f"Cluster: {field} must be a non-negative number, got {value!r}.")
        if not (isinstance(self.parameter_overlap, (int, float)) and 0 <= self.parameter_overlap <= 1):
            raise ValueError(f"Cluster: parameter_overlap must be in [0, 1], got {self.parameter_overlap!r}.")
        if not (isinstance(self.efficiency, (int, float)) and 0 < self.efficiency <= 1):
            raise ValueError(f"Cluster: efficiency must be in (0, 1], got {self.efficiency!r}.")
        for axis, link in self.axis_links.items():
            if link not in ("intra", "inter"):
                raise ValueError(f"Cluster: axis_links[{axis!r}] must be 'intra' or 'inter', got {link!r}.")
        if isinstance(self.peak_flops, str):
            self.flops(jnp.bfloat16)  # an unknown device kind fails here, not mid-plan
        elif not isinstance(self.peak_flops, (dict, int, float)) or isinstance(self.peak_flops, bool):
            raise ValueError(
                f"Cluster: peak_flops must be a device kind, a number or a dict from dtype name to FLOP/s, "
                f"got {self.peak_flops!r}."
            )

    @property
    def devices(self) -> int:
        return self.devices_per_host * self.hosts

    def flops(self, dtype: Any) -> float:
        """Peak dense FLOP/s per device for matmuls in `dtype`.

        **Raises:**

        - `ValueError` for a device kind or dtype with no known peak.
        """
        if isinstance(self.peak_flops, dict):
            name = np.dtype(dtype).name
            if name not in self.peak_flops:
                raise ValueError(
                    f"Cluster {self.name!r}: no peak FLOP/s for {name}; peak_flops has {sorted(self.peak_flops)}."
                )
            return float(self.peak_flops[name])
        if isinstance(self.peak_flops, (int, float)):
            return float(self.peak_flops)
        peak = peak_flops(str(self.peak_flops), dtype)
        if peak is None:
            raise ValueError(
                f"Cluster {self.name!r}: unknown device kind {self.peak_flops!r} for {np.dtype(dtype).name}; "
                f"give peak_flops as a number or a dict such as {{'bfloat16': 989e12}}, or a kind "
                f"eqxpar.inspect.PEAK_FLOPS knows."
            )
        return peak

    def link(self, axes: tuple[str, ...], sizes: dict[str, int]) -> Link:
        """The slowest link a collective over `axes` crosses on a mesh of `sizes` (see the
        class docs for the layout)."""
        inner = ("model", "context", "expert", "fsdp", "data", "stage")
        used = [a for a in inner if a in axes and sizes.get(a, 1) > 1]
        if any(self.axis_links.get(a) == "inter" for a in used):
            return self.inter
        if used and all(self.axis_links.get(a) == "intra" for a in used):
            return self.intra
        span = 1
        for a in inner[: inner.index(used[-1]) + 1] if used else ():
            span *= sizes.get(a, 1)
        return self.intra if span <= self.devices_per_host else self.inter

    @property
    def intra(self) -> Link:
        return Link("intra-host", self.intra_host_bandwidth, self.intra_host_latency)

    @property
    def inter(self) -> Link:
        return Link("inter-host", self.inter_host_bandwidth, self.inter_host_latency)

    def with_(self, **changes: Any) -> Cluster:
        """This cluster with some fields changed (e.g. `hosts=8`, `memory_per_device=40 * GiB`)."""
        return dataclasses.replace(self, **changes)


# --- Presets. Per-device, per-direction bandwidths. ---
# NVLink 4 (H100/H200 SXM): 900 GB/s total bidirectional per GPU through NVSwitch, i.e. 450 GB/s
# each way (NVIDIA H100 datasheet; H200 datasheet: "NVLink: 900GB/s"). NVLink 3 (A100 SXM):
# 600 GB/s bidirectional, 300 GB/s each way (NVIDIA A100 datasheet).
# InfiniBand between hosts: a DGX H100/H200 has eight ConnectX-7 NDR 400 Gb/s ports, one per
# GPU: 50 GB/s per GPU each way (NVIDIA DGX H100 user guide); a DGX A100 eight HDR 200 Gb/s
# ConnectX-6 ports: 25 GB/s per GPU (DGX A100 user guide).
# Memory: H100 SXM 80 GB HBM3, H200 141 GB HBM3e, A100 80 GB HBM2e (datasheets); TPU v5p
# 95 GiB HBM per chip (Google Cloud TPU v5p docs). Latencies: NVLink hops ~2 us, InfiniBand
# ~10 us (NCCL's own tuning tables use latencies of this order); both are rough.
# TPU v5p: ICI 4,800 Gbps per chip (Google Cloud TPU v5p docs), i.e. 600 GB/s over the 6
# links of its 3-D torus; a ring along one torus dimension sends over one link each way:
# taken as 100 GB/s per device and direction. A "host" is one 4-chip VM; the whole slice is
# ICI, so the inter-host figures are ICI's too (DCN, between slices, is not modelled).
# The fraction of the bf16 peak a GPT step's FLOPs (recomputation included) reach on one
# H200, measured on 2026-11-26 (docs/data/benchmarks/gpu_2026-11-26_h200.json): the 1.3b
# GPT 0.505 (remat none), 0.543 (save_matmuls), 0.635 (block); the 124m 0.354-0.381 (its
# matmuls are small). The presets take the 1.3b median: plans are for models of 1B and up.
# Later code (blocks in a Python loop, the loss's one-pass backward, the position gather;
# gpu_2026-11-26_h200_session3.json) measures 0.567-0.578 for the 1.3b with save_matmuls and
# 0.41-0.43 for the 124m: the presets' 0.54 predicts those steps 5-7% long.
GPU_EFFICIENCY = 0.54
_PRESETS: dict[str, dict[str, Any]] = {
    "h100": dict(
        devices_per_host=8,
        memory_per_device=80 * GB,
        peak_flops="h100",
        intra_host_bandwidth=450 * GB,
        inter_host_bandwidth=50 * GB,
        efficiency=GPU_EFFICIENCY,
        fused_attention=True,
        name="8x H100 SXM",
    ),
    "h200": dict(
        devices_per_host=8,
        memory_per_device=141 * GB,
        peak_flops="h200",
        intra_host_bandwidth=450 * GB,
        inter_host_bandwidth=50 * GB,
        efficiency=GPU_EFFICIENCY,
        fused_attention=True,
        name="8x H200 SXM",
    ),
    "a100": dict(
        devices_per_host=8,
        memory_per_device=80 * GB,
        peak_flops="a100",
        intra_host_bandwidth=300 * GB,
        inter_host_bandwidth=25 * GB,
        efficiency=GPU_EFFICIENCY,
        fused_attention=True,
        name="8x A100 SXM 80GB",
    ),
    "tpu v5p": dict(
        devices_per_host=4,
        memory_per_device=95 * GiB,
        peak_flops="tpu v5p",
        intra_host_bandwidth=100 * GB,
        inter_host_bandwidth=100 * GB,
        intra_host_latency=5e-6,
        inter_host_latency=5e-6,
        name="TPU v5p slice",
    ),
}
PRESETS = tuple(_PRESETS)
"""The device kinds [`eqxpar.plan.cluster`][] knows."""


def cluster(kind: str, hosts: int = 1, **overrides: Any) -> Cluster:
    """A preset [`eqxpar.plan.Cluster`][]: `"h100"`, `"h200"`, `"a100"` (8-GPU SXM nodes)
    or `"tpu v5p"` (4 chips per host), with `hosts` hosts.

    **Arguments:**

    - `kind`: one of `eqxpar.plan.PRESETS`.
    - `hosts`: how many hosts (nodes).
    - `**overrides`: any other `Cluster` field (e.g. `memory_per_device=40e9`).

    **Returns:**

    The `Cluster`.

    **Raises:**

    - `ValueError` for an unknown kind, listing the known ones.
    """
    key = str(kind).lower()
    if key not in _PRESETS:
        raise ValueError(
            f"cluster: unknown device kind {kind!r}; presets are {PRESETS}. For another machine build "
            f"eqxpar.plan.Cluster(devices_per_host=..., hosts=..., memory_per_device=..., peak_flops=..., "
            f"intra_host_bandwidth=..., inter_host_bandwidth=...)."
        )
    fields = {**_PRESETS[key], "hosts": hosts, **overrides}
    if hosts > 1 and "name" not in overrides:
        fields["name"] = f"{hosts} x {fields['name']}"
    return Cluster(**fields)
