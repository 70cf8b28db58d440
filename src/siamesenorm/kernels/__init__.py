"""Fused Triton kernels registered as ``torch.library`` custom ops, with a PyTorch fallback.

The kernels run on CUDA with Triton installed, and on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1``, for tests). Elsewhere the front functions compute the same math as plain
PyTorch ops and say so once on stderr (mHC's :func:`sinkhorn` and :func:`mix_write` say so only on
CUDA without Triton). ``SIAMESENORM_KERNELS=0`` turns every kernel off. Triton is imported only when
a kernel first runs.
"""

from .availability import announce_fallback, kernels_available, kernels_switched_on, triton_installed
from .depth_mix import depth_mix_kernel_runs, fused_depth_mix
from .mix import mix_entry, mix_entry_kernel_runs, mix_write, mix_write_kernel_runs
from .ops import MAX_WIDTH, add_norm, add_rms_norm, siamese_update_entry
from .rms_project import rms_project, rms_project_kernel_runs
from .sinkhorn import sinkhorn, sinkhorn_kernel_runs

__all__ = ["MAX_WIDTH", "add_norm", "add_rms_norm", "announce_fallback", "depth_mix_kernel_runs",
           "fused_depth_mix", "kernels_available", "kernels_switched_on", "mix_entry",
           "mix_entry_kernel_runs", "mix_write", "mix_write_kernel_runs", "rms_project",
           "rms_project_kernel_runs", "siamese_update_entry", "sinkhorn", "sinkhorn_kernel_runs",
           "triton_installed"]
