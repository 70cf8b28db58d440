"""The Gaussian KL and the discretised decoder likelihood of improved DDPM's variational bound."""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["LOG2", "discretized_gaussian_log_likelihood", "mean_flat", "normal_kl"]

LOG2 = math.log(2.0)   # nats per bit: the bound is reported in bits per dimension


def mean_flat(x: Tensor) -> Tensor:
    return x.reshape(len(x), -1).mean(dim=1)


def normal_kl(mean1: Tensor, logvar1: Tensor, mean2: Tensor, logvar2: Tensor) -> Tensor:
    """Elementwise ``KL(N(mean1, exp(logvar1)) || N(mean2, exp(logvar2)))`` in nats."""
    return 0.5 * (logvar2 - logvar1 + torch.exp(logvar1 - logvar2)
                  + (mean1 - mean2) ** 2 * torch.exp(-logvar2) - 1.0)


def _bin_mass(upper: Tensor, lower: Tensor) -> Tensor:
    """``Phi(upper) - Phi(lower)`` computed on the side of zero where it does not cancel."""
    right = (upper + lower) > 0
    return torch.where(right, torch.special.ndtr(-lower) - torch.special.ndtr(-upper),
                       torch.special.ndtr(upper) - torch.special.ndtr(lower))


def discretized_gaussian_log_likelihood(x: Tensor, means: Tensor, log_scales: Tensor) -> Tensor:
    """Elementwise log-probability (nats) of ``x``'s 8-bit bin (``x +- 1/255``; the end bins are open)
    under ``N(means, exp(log_scales)^2)``."""
    inv_std = torch.exp(-log_scales)
    upper = (x - means + 1.0 / 255.0) * inv_std
    lower = (x - means - 1.0 / 255.0) * inv_std
    log_cdf_upper = torch.special.log_ndtr(upper)
    log_sf_lower = torch.special.log_ndtr(-lower)
    log_mid = torch.log(_bin_mass(upper, lower).clamp_min(1e-12))
    return torch.where(x < -0.999, log_cdf_upper, torch.where(x > 0.999, log_sf_lower, log_mid))

