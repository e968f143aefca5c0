"""Accelerators: data-sheet presets and measured per-layer profiles the cost model prices on.

Numbers are the vendors' SXM data-sheet figures (dense bf16, no sparsity). Link bandwidths are
stored as the data sheet states them; the cost model derives what one direction of a transfer gets
(`nvlink_unidirectional`), because pipeline messages and ring collectives move data one way per link.
Sources: NVIDIA H100 / H200 Tensor Core GPU data sheets (SXM5: 989 TFLOPS bf16, 3.35 / 4.8 TB/s
HBM, 900 GB/s NVLink); H800: the export variant's 400 GB/s NVLink; NVIDIA A100 Tensor Core GPU
data sheet (SXM4 80 GB: 312 TFLOPS bf16, 2,039 GB/s HBM2e, 600 GB/s NVLink 3) with the DGX
A100's 200 Gb/s HDR InfiniBand NIC per GPU; NVIDIA DGX / HGX B200 data sheets (per GPU at
1,000 W: 2.25 PFLOPS dense bf16, i.e. 4.5 with sparsity; 180 GB HBM3e at 8 TB/s; 1.8 TB/s
NVLink 5) with 400 Gb/s ConnectX-7 per GPU. `max_efficiency` (the share of the peak a large
GEMM reaches) is our assumption, not a data-sheet number: calibrate it with a measured profile.

Host link (activation offload). Every preset's GPU hangs off a PCIe switch whose x16 uplink to
the CPU it shares with one other GPU (DGX A100 / H100 / B200 system topologies: four PCIe
switches for eight GPUs; HGX H800 baseboards are built the same way). `host_link_bandwidth` is one
direction of that uplink as the PCIe specification states it: Gen4 x16 32 GB/s (A100), Gen5 x16
64 GB/s (H100, H200, H800, B200); `host_link_gpus` = 2 GPUs share it. Host memory per node: DGX
A100 (80 GB) and DGX H100 / H200: 2 TB; DGX B200: 2 TB (4 TB optional); 8 GPUs per node. Pinned
copies reach about 80% of the PCIe line rate (`HOST_LINK_EFFICIENCY`, our assumption, measured
by `scripts/gpu_check.sh`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..parallel.shape import ParallelShape

GB = 10**9
GIB = 2**30


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator as the analytic cost model sees it.

    `peak_flops`: dense bf16 FLOP/s. `hbm_bandwidth`: bytes/s. `nvlink_bandwidth`: the data
    sheet's total (both directions) NVLink bytes/s per GPU, used for tensor-parallel collectives.
    `ib_bandwidth`: one direction of the GPU's own inter-node NIC, bytes/s, used for pipeline
    messages. `p2p_latency`: seconds per message or collective step. `max_efficiency`: the best
    fraction of `peak_flops` a large GEMM reaches. `memory_bytes`: HBM capacity.
    `host_link_bandwidth`: one direction of the PCIe link to host memory, bytes/s, shared by
    `host_link_gpus` GPUs; `host_memory_bytes`: host memory of a node of `gpus_per_node` GPUs
    (activation offload; the module docstring names the sources).
    """

    name: str
    peak_flops: float
    hbm_bandwidth: float
    nvlink_bandwidth: float
    ib_bandwidth: float
    p2p_latency: float
    max_efficiency: float
    memory_bytes: int
    host_link_bandwidth: float = 64 * 10**9
    host_link_gpus: int = 2
    host_memory_bytes: int = 2 * 10**12
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        positive = (
            self.peak_flops,
            self.hbm_bandwidth,
            self.nvlink_bandwidth,
            self.ib_bandwidth,
            self.memory_bytes,
            self.host_link_bandwidth,
            self.host_link_gpus,
            self.host_memory_bytes,
            self.gpus_per_node,
        )
        if min(positive) <= 0 or self.p2p_latency < 0:
            raise ValueError(f"device {self.name!r}: rates and sizes must be positive")
        if not 0 < self.max_efficiency <= 1:
            raise ValueError(f"device {self.name!r}: max_efficiency must lie in (0, 1]")

    @property
    def nvlink_unidirectional(self) -> float:
        """Bytes/s one direction of NVLink carries (half the data-sheet total)."""
        return self.nvlink_bandwidth / 2

    @property
    def host_link_share(self) -> float:
        """Bytes/s one direction of the host link gives one GPU when all GPUs sharing it copy
        at once (pinned copies at `HOST_LINK_EFFICIENCY` of the line rate)."""
        return self.host_link_bandwidth * HOST_LINK_EFFICIENCY / self.host_link_gpus

    @property
    def host_memory_share(self) -> float:
        """Bytes of host memory per GPU of a node."""
        return self.host_memory_bytes / self.gpus_per_node

    @property
    def host_offload_share(self) -> float:
        """Bytes of offloaded activations one GPU may keep in host memory at once: its share
        of the node's host memory, less what the rest of the run needs there
        (`HOST_MEMORY_FOR_OFFLOAD`)."""
        return self.host_memory_share * HOST_MEMORY_FOR_OFFLOAD


HOST_LINK_EFFICIENCY = 0.8
# The share of a node's host memory offloaded activations may take: the rest holds the
# processes themselves, data-loader workers, pinned communication buffers and checkpoint
# staging (our assumption, on the safe side).
HOST_MEMORY_FOR_OFFLOAD = 0.5


# 400 Gb/s ConnectX-7 per GPU (DGX/HGX H100-class nodes); ~70% of the dense bf16 peak is what
# large cuBLAS GEMMs reach on Hopper, which also bounds the achievable model FLOP/s.
_IB_400G = 50 * GB
_HOPPER_BF16 = 989e12
_P2P_LATENCY = 20e-6
_GEMM_CAP = 0.7

H100 = DeviceSpec(
    "H100", _HOPPER_BF16, 3350 * GB, 900 * GB, _IB_400G, _P2P_LATENCY, _GEMM_CAP, 80 * GIB
)
H200 = DeviceSpec(
    "H200", _HOPPER_BF16, 4800 * GB, 900 * GB, _IB_400G, _P2P_LATENCY, _GEMM_CAP, 141 * GIB
)
# The export variant: same compute and HBM as H100, NVLink cut to 400 GB/s.
H800 = DeviceSpec(
    "H800", _HOPPER_BF16, 3350 * GB, 400 * GB, _IB_400G, _P2P_LATENCY, _GEMM_CAP, 80 * GIB
)

A100 = DeviceSpec(
    "A100", 312e12, 2039 * GB, 600 * GB, 25 * GB, _P2P_LATENCY, _GEMM_CAP, 80 * GIB, 32 * GB
)
B200 = DeviceSpec(
    "B200", 2250e12, 8000 * GB, 1800 * GB, _IB_400G, _P2P_LATENCY, _GEMM_CAP, 180 * GB
)

DEVICES: dict[str, DeviceSpec] = {d.name: d for d in (A100, H100, H200, H800, B200)}
DEVICE_NAMES: tuple[str, ...] = tuple(DEVICES)


def get_device(name: str) -> DeviceSpec:
    """The preset named `name` (case-insensitive); ValueError listing the known names otherwise."""
    for key, spec in DEVICES.items():
        if key.lower() == name.strip().lower():
            return spec
    raise ValueError(f"unknown device {name!r}; known devices: {', '.join(sorted(DEVICES))}")


def match_device(full_name: str) -> str | None:
    """The preset a CUDA device name ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB") names,
    None when it names none of them."""
    upper = full_name.upper()
    return next((d for d in DEVICES if d in upper), None)


# ---------------------------------------------------------------------------------------------
# Measured per-layer profiles

PROFILE_FORMAT = "megatron-dip-profile/1"


@dataclass(frozen=True)
class ProfilePoint:
    """One measurement: one layer on `instances` instances of `tokens` tokens each."""

    tokens: int  # tokens (ViT patches, DiT latent tokens) per instance
    instances: int
    forward_ms: float
    backward_ms: float


@dataclass(frozen=True)
class CostProfile:
    """Measured per-layer times of a model's modules on one device and software stack.

    JSON schema (`load_profile`)::

        {"format": "megatron-dip-profile/1",
         "device": "H100",                       # DeviceSpec name it was measured on
         "software": {"torch": "2.6.0", "megatron_core": "0.16.1", "cuda": "12.4"},
         "attention": "flash-attn 2.7.4",        # attention implementation
         "tensor_parallel": 4,                   # TP size of the measurement
         "modules": {                            # key: module name, or kind (vit, llm, ...)
           "vit": [{"tokens": 1024, "instances": 8, "forward_ms": 1.9, "backward_ms": 3.9}]},
         # optional (absent in older profiles; defaults shown):
         "dtype": "",                            # e.g. "bfloat16"
         "tp_comm_included": true,               # false: one TP rank's shard timed alone
         "details": {}}                          # free-form provenance (grid, timing, shapes)

    Times are of one transformer layer (input/output layers excluded), forward and backward
    without recomputation. `tp_comm_included` says whether they contain the layer's
    tensor-parallel collectives: True for a profile taken on a real TP group, False for one
    that timed a TP rank's shard of the layer on a single device (`tools/profile_costs.py`),
    to which the TP communication term must still be added.
    """

    device: str
    software: dict = field(hash=False)
    attention: str
    tensor_parallel: int
    modules: dict = field(hash=False)  # str -> tuple[ProfilePoint, ...]
    source: str = ""
    dtype: str = ""
    tp_comm_included: bool = True
    details: dict = field(default_factory=dict, hash=False, compare=False)

    def points_for(self, name: str, kind: str) -> tuple[ProfilePoint, ...] | None:
        """Measurements of module `name` (by name first, else by its kind), None if absent."""
        return self.modules.get(name) or self.modules.get(kind)

    def check_compatible(self, shape: ParallelShape) -> None:
        """ValueError when the profile was measured at another tensor-parallel size than
        `shape`'s."""
        if shape.tp != self.tensor_parallel:
            raise ValueError(
                f"profile {self.source or '<memory>'}: field 'tensor_parallel' is "
                f"{self.tensor_parallel}, the cost model uses {shape.tp}"
            )

    def layer_times(
        self,
        points: tuple[ProfilePoint, ...],
        *,
        tokens_per_instance: float,
        instances: int,
        analytic: Callable[[float], float],
    ) -> tuple[float, float]:
        """(forward, backward) seconds of one layer, interpolated from `points`.

        Per-instance times are interpolated over tokens per instance within each measured
        instance count, then linearly between the two instance counts bracketing `instances`
        (clamped at the ends), and multiplied by `instances`. Outside the measured token range
        the nearest measurement is scaled by the analytic per-instance time `analytic(tokens)`.
        """
        counts = sorted({p.instances for p in points})
        lo = max((k for k in counts if k <= instances), default=counts[0])
        hi = min((k for k in counts if k >= instances), default=counts[-1])
        f_lo, b_lo = _per_instance(points, lo, tokens_per_instance, analytic)
        f_hi, b_hi = _per_instance(points, hi, tokens_per_instance, analytic)
        w = 0.0 if hi == lo else (instances - lo) / (hi - lo)
        fwd = (1 - w) * f_lo + w * f_hi
        bwd = (1 - w) * b_lo + w * b_hi
        return instances * fwd / 1e3, instances * bwd / 1e3


def _per_instance(
    points: tuple[ProfilePoint, ...], count: int, x: float, analytic: Callable[[float], float]
) -> tuple[float, float]:
    pts = sorted((p for p in points if p.instances == count), key=lambda p: p.tokens)
    xs = np.array([p.tokens for p in pts], dtype=float)
    fwd = np.array([p.forward_ms / count for p in pts])
    bwd = np.array([p.backward_ms / count for p in pts])
    edge = min(max(x, xs[0]), xs[-1])
    scale = analytic(x) / analytic(edge) if edge != x else 1.0
    return float(np.interp(edge, xs, fwd)) * scale, float(np.interp(edge, xs, bwd)) * scale


def load_profile(path: str | Path) -> CostProfile:
    """Read a `CostProfile` JSON; ValueError naming the file and the offending field."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"profile {path}: cannot read JSON ({exc})") from exc

    def bad(where: str, why: str) -> ValueError:
        return ValueError(f"profile {path}: field {where!r} {why}")

    if not isinstance(raw, dict):
        raise bad("<root>", "must be an object")
    if raw.get("format") != PROFILE_FORMAT:
        raise bad("format", f"must be {PROFILE_FORMAT!r}, got {raw.get('format')!r}")
    for key in ("device", "attention"):
        if not isinstance(raw.get(key), str) or not raw[key]:
            raise bad(key, "must be a non-empty string")
    if not isinstance(raw.get("software"), dict):
        raise bad("software", "must be an object of name: version")
    tp = raw.get("tensor_parallel")
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise bad("tensor_parallel", "must be an integer >= 1")
    mods = raw.get("modules")
    if not isinstance(mods, dict) or not mods:
        raise bad("modules", "must be a non-empty object of module: [measurements]")
    modules = {
        name: _read_points(entries, f"modules.{name}", bad) for name, entries in mods.items()
    }
    software = {str(k): str(v) for k, v in raw["software"].items()}
    dtype = raw.get("dtype", "")
    if not isinstance(dtype, str):
        raise bad("dtype", "must be a string")
    comm = raw.get("tp_comm_included", True)
    if not isinstance(comm, bool):
        raise bad("tp_comm_included", f"must be true or false, got {comm!r}")
    details = raw.get("details", {})
    if not isinstance(details, dict):
        raise bad("details", "must be an object")
    return CostProfile(
        raw["device"],
        software,
        raw["attention"],
        tp,
        modules,
        str(path),
        dtype=dtype,
        tp_comm_included=comm,
        details=details,
    )


def _read_points(
    entries: object, where: str, bad: Callable[[str, str], ValueError]
) -> tuple[ProfilePoint, ...]:
    if not isinstance(entries, list) or not entries:
        raise bad(where, "must be a non-empty list")
    points = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise bad(f"{where}[{i}]", "must be an object")
        for key in ("tokens", "instances", "forward_ms", "backward_ms"):
            v = e.get(key)
            integral = key in ("tokens", "instances")
            ok = isinstance(v, int) if integral else isinstance(v, (int, float))
            if not ok or isinstance(v, bool) or not v > 0:
                kind = "a positive integer" if integral else "a positive number"
                raise bad(f"{where}[{i}].{key}", f"must be {kind}, got {v!r}")
        points.append(
            ProfilePoint(
                e["tokens"], e["instances"], float(e["forward_ms"]), float(e["backward_ms"])
            )
        )
    return tuple(points)
