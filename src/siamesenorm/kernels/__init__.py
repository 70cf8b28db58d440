"""Fused Triton kernels registered as ``torch.library`` custom ops, with a PyTorch fallback.

The kernels run on CUDA with Triton installed, and on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1``, for tests). Elsewhere the front functions compute the same math as plain
PyTorch ops and say so once on stderr (mHC's :func:`sinkhorn` and :func:`mix_write` say so only on
CUDA without Triton). ``SIAMESENORM_KERNELS=0`` turns every kernel off. Triton is imported only when
a kernel first runs. Each op checks its kernels against the PyTorch path on first use, and a kernel
that fails turns its op off with one line (:mod:`.guard`); :func:`self_check` runs every check.
"""

from .availability import (
    TRITON_RANGE,
    announce_fallback,
    kernels_available,
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
           "depth_mix_kernel_runs", "fused_depth_mix", "kernel_ops", "kernels_available",
           "kernels_switched_on", "mix_entry", "mix_entry_kernel_runs", "mix_write", "mix_write_kernel_runs",
           "rms_project", "rms_project_kernel_runs", "self_check", "siamese_update_entry", "sinkhorn",
           "sinkhorn_kernel_runs", "triton_installed", "triton_supported", "triton_version"]
