"""The Frechet distance between two sets of feature vectors, each summarised by a Gaussian: FID's
formula, both matrix square roots from float64 symmetric eigendecompositions (no scipy)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..errors import UserError

__all__ = ["feature_statistics", "frechet_distance", "frechet_distance_from_stats"]


def _as_features(features: Tensor | np.ndarray, name: str) -> Tensor:
    x = torch.as_tensor(features).detach().to("cpu", torch.float64)
    if x.ndim != 2 or len(x) < 2:
        raise UserError(f"{name} must be an (N, D) array of N >= 2 feature vectors, got {tuple(x.shape)}")
    if not torch.isfinite(x).all():
        raise UserError(f"{name} holds NaN or infinite values")
    return x


def feature_statistics(features: Tensor | np.ndarray) -> tuple[Tensor, Tensor]:
    """Mean ``(D,)`` and unbiased covariance ``(D, D)`` (divided by ``N - 1``) in float64."""
    x = _as_features(features, "features")
    mean = x.mean(dim=0)
    centred = x - mean
    return mean, centred.T @ centred / (len(x) - 1)


def _sym_sqrt(matrix: Tensor) -> Tensor:
    values, vectors = torch.linalg.eigh((matrix + matrix.T) / 2)
    return (vectors * values.clamp_min(0).sqrt()) @ vectors.T


def frechet_distance_from_stats(mean_a: Tensor, cov_a: Tensor, mean_b: Tensor, cov_b: Tensor) -> float:
    """The Frechet distance (squared, as FID reports it) between two Gaussians."""
    if mean_a.shape != mean_b.shape or cov_a.shape != cov_b.shape:
        raise UserError(f"feature dimensions differ: {tuple(mean_a.shape)} and {tuple(mean_b.shape)}")
    root_a = _sym_sqrt(cov_a)
    middle = root_a @ cov_b @ root_a
    trace_root = torch.linalg.eigvalsh((middle + middle.T) / 2).clamp_min(0).sqrt().sum()
    value = ((mean_a - mean_b) ** 2).sum() + torch.trace(cov_a) + torch.trace(cov_b) - 2 * trace_root
    return max(float(value), 0.0)


def frechet_distance(feats_a: Tensor | np.ndarray, feats_b: Tensor | np.ndarray) -> float:
    """The Frechet distance (squared, as FID reports it) of feature sets ``(N_a, D)`` and ``(N_b, D)``."""
    a, b = _as_features(feats_a, "feats_a"), _as_features(feats_b, "feats_b")
    if a.shape[1] != b.shape[1]:
        raise UserError(f"feature sets have different widths: {a.shape[1]} and {b.shape[1]}")
    return frechet_distance_from_stats(*feature_statistics(a), *feature_statistics(b))
