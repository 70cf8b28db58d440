"""Diagnostics from the SiameseNorm paper: probes of depth behaviour."""

from .probes import block_grad_norms, stream_rms

__all__ = ["block_grad_norms", "stream_rms"]
