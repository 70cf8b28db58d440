"""Achieved TFLOP/s per device (``flops_per_token * tokens_per_s / devices``) and MFU, against
``train.peak_tflops`` or :data:`PEAK_TFLOPS` by the GPU's name (docs/training.md)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..models.host import SchemeHost

# Peak dense (no structured sparsity) TFLOP/s per device, as the vendors publish them:
# (name pattern, part, bf16, tf32, fp32).
#   NVIDIA: the datasheets of A100, A10, L4, L40S, H100 (SXM, PCIe, NVL), GH200, H200 (SXM, NVL),
#   HGX/DGX B200 (the 8-GPU figures / 8) and GB200 NVL72 (the rack's figures / 72). Their Tensor
#   Core figures are starred "with sparsity"; the dense figure is half of it. fp32 is the plain
#   (non-Tensor-Core) FP32 rate, what float32 matmuls get under PyTorch's default
#   ``torch.get_float32_matmul_precision() == "highest"``; with "high" or "medium" they run as
#   TF32 on the Tensor Cores, and the tf32 column is the peak (e.g. H100 SXM: 494.5 against 67).
#   AMD: the Instinct product pages of MI250X, MI250, MI300X, MI300A, MI325X, MI350X and MI355X
#   (dense "peak" figures; sparse ones are listed apart). fp32 is the FP32 *matrix* peak, what
#   rocBLAS/hipBLASLt use for float32 GEMMs (equal to the vector peak from CDNA 3 on, twice it on
#   MI250X). Their TF32 (MI300X: 653.7) is left out: whether PyTorch's float32 matmuls use it
#   depends on the ROCm build, so fp32 runs are measured against FP32. An MI250X or MI250 is two
#   graphics dies that PyTorch sees as two devices: its figures here are per die (half the card's).
# Patterns are matched as whole words against the upper-cased ``torch.cuda.get_device_name()``,
# the first match wins, so specific parts come before the general ones (H100 PCIe before H100).
PEAK_TFLOPS: tuple[tuple[str, str, float, float | None, float], ...] = (
    (r"GB200", "NVIDIA GB200", 2500.0, 1250.0, 80.0),
    (r"B200", "NVIDIA B200", 2250.0, 1125.0, 75.0),
    (r"GH200", "NVIDIA GH200", 989.5, 494.5, 67.0),
    (r"H200 NVL", "NVIDIA H200 NVL", 835.5, 417.5, 60.0),
    (r"H200", "NVIDIA H200 SXM", 989.5, 494.5, 67.0),
    (r"H100 NVL", "NVIDIA H100 NVL", 835.5, 417.5, 60.0),
    (r"H100 PCIE", "NVIDIA H100 PCIe", 756.5, 378.0, 51.0),
    (r"H100", "NVIDIA H100 SXM", 989.5, 494.5, 67.0),
    (r"A100", "NVIDIA A100", 312.0, 156.0, 19.5),
    (r"L40S", "NVIDIA L40S", 362.05, 183.0, 91.6),
    (r"L4", "NVIDIA L4", 121.0, 60.0, 30.3),
    (r"A10", "NVIDIA A10", 125.0, 62.5, 31.2),
    (r"MI355X", "AMD Instinct MI355X", 2516.6, None, 157.3),
    (r"MI350X", "AMD Instinct MI350X", 2306.9, None, 144.2),
    (r"MI325X", "AMD Instinct MI325X", 1307.4, None, 163.4),
    (r"MI300X", "AMD Instinct MI300X", 1307.4, None, 163.4),
    (r"MI300A", "AMD Instinct MI300A", 980.6, None, 122.6),
    (r"MI250X", "AMD Instinct MI250X (one die)", 191.5, None, 47.85),
    (r"MI250", "AMD Instinct MI250 (one die)", 181.05, None, 45.25),
)


@dataclass(frozen=True)
class Peak:
    """A device's peak dense TFLOP/s in a run's precision, and where the figure comes from."""

    tflops: float
    source: str         # "NVIDIA H100 SXM, bf16" (the table) or "train.peak_tflops"


def table_peak(device_name: str, precision: str, tf32: bool = False) -> Peak | None:
    """The peak of the part ``device_name`` names in ``precision`` (``bf16`` or ``fp32``; ``tf32``:
    float32 matmuls may run as TF32), or ``None`` for a part the table does not know."""
    name = device_name.upper()
    for pattern, part, bf16, tf32_peak, fp32 in PEAK_TFLOPS:
        if re.search(rf"(?<![A-Z0-9]){pattern}(?![A-Z0-9])", name):
            if precision == "bf16":
                return Peak(bf16, f"{part}, bf16")
            if tf32 and tf32_peak is not None:
                return Peak(tf32_peak, f"{part}, tf32")
            return Peak(fp32, f"{part}, fp32")
    return None


def device_name(device: torch.device) -> str | None:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def run_precision(precision: str, device: torch.device) -> str:
    """``bf16`` or ``fp32``: what the matmuls of a run with ``train.precision`` run in (the rule of
    :func:`siamesenorm.parallel.autocast_for`: ``auto`` is bf16 on CUDA)."""
    return "bf16" if precision == "bf16" or (precision == "auto" and device.type == "cuda") else "fp32"


def find_peak(device: torch.device, precision: str, override: float | None) -> Peak | None:
    """The peak a run's MFU is measured against: ``override`` (``train.peak_tflops``), else the table's."""
    if override is not None:
        return Peak(override, "train.peak_tflops")
    name = device_name(device)
    if name is None:
        return None
    tf32 = torch.get_float32_matmul_precision() != "highest"
    return table_peak(name, run_precision(precision, device), tf32)


def model_flops_per_token(model: nn.Module, seq_len: int | None) -> float | None:
    """Training FLOPs per token of ``model`` at ``seq_len`` (a scheme host's estimate; else ``None``)."""
    return model.flops_per_token(seq_len or None) if isinstance(model, SchemeHost) else None


class Throughput:
    """TFLOP/s per device and MFU from tokens/s, for one run on ``devices`` devices."""

    def __init__(self, peak: Peak | None, devices: int = 1) -> None:
        self.peak, self.devices = peak, devices
        self.flops_per_token: float | None = None      # set once the sequence length is known

    def tflops(self, tokens_per_s: float | None) -> float | None:
        """Achieved TFLOP/s per device at ``tokens_per_s`` (all devices together)."""
        if self.flops_per_token is None or tokens_per_s is None:
            return None
        return self.flops_per_token * tokens_per_s / self.devices / 1e12

    def mfu(self, tokens_per_s: float | None) -> float | None:
        """The fraction of the peak that ``tokens_per_s`` achieves; ``None`` without a peak."""
        tflops = self.tflops(tokens_per_s)
        return None if tflops is None or self.peak is None else tflops / self.peak.tflops

    def figures(self, tokens_per_s: float | None) -> dict[str, float]:
        out = {"tflops": self.tflops(tokens_per_s), "mfu": self.mfu(tokens_per_s)}
        return {k: v for k, v in out.items() if v is not None}

    def summary(self, tokens_per_s: float | None) -> dict[str, Any]:
        """The run's figures for ``summary.json``: always every key, ``None`` where unknown."""
        return {"tflops": self.tflops(tokens_per_s), "mfu": self.mfu(tokens_per_s),
                "peak_tflops": None if self.peak is None else self.peak.tflops,
                "peak_tflops_source": None if self.peak is None else self.peak.source}
