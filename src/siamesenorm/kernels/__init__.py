"""Fused Triton kernels as ``torch.library`` custom ops, with the PyTorch path as fallback.

They run where :func:`.availability.kernels_run_on` says (CUDA, or the CPU under Triton's
interpreter for tests; ``SIAMESENORM_PATH=lean`` turns them off). Each op checks its kernels on
first use and turns itself off with one line where they fail (:mod:`.guard`).
"""

from .availability import (
    TRITON_RANGE,
    announce_fallback,
    kernels_available,
    kernels_run_on,
    kernels_switched_on,
    triton_installed,
    triton_supported,
    triton_version,
)
from .depth_mix import depth_mix_kernel_runs, fused_depth_mix
from .guard import KernelCheck, kernel_ops, self_check
from .mix import mix_entry, mix_entry_kernel_runs, mix_write, mix_write_kernel_runs
from .ops import MAX_WIDTH, add_norm, add_rms_norm, siamese_update_entry
from .rms_project import rms_project, rms_project_kernel_runs
from .sinkhorn import sinkhorn, sinkhorn_kernel_runs

__all__ = ["MAX_WIDTH", "TRITON_RANGE", "KernelCheck", "add_norm", "add_rms_norm", "announce_fallback",
           "depth_mix_kernel_runs", "fused_depth_mix", "kernel_ops", "kernels_available", "kernels_run_on",
           "kernels_switched_on", "mix_entry", "mix_entry_kernel_runs", "mix_write", "mix_write_kernel_runs",
           "rms_project", "rms_project_kernel_runs", "self_check", "siamese_update_entry", "sinkhorn",
           "sinkhorn_kernel_runs", "triton_installed", "triton_supported", "triton_version"]
