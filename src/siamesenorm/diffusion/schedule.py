"""Noise schedules and timestep respacing for Gaussian diffusion.

DiT (arXiv 2212.09748) trains with DDPM's linear schedule, betas from 1e-4 to 0.02 over 1,000
steps (Ho et al., arXiv 2006.11239); improved DDPM (arXiv 2102.09672) adds the cosine schedule and
sampling on a respaced subset of the training timesteps. Schedules are float64 numpy arrays: the
products over 1,000 steps need the precision.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import ConfigError

__all__ = ["SCHEDULES", "cosine_betas", "linear_betas", "make_betas", "space_timesteps"]


def linear_betas(num_timesteps: int = 1000, beta_start: float = 1e-4, beta_end: float = 0.02) -> np.ndarray:
    """``num_timesteps`` betas evenly spaced from ``beta_start`` to ``beta_end`` (DDPM / DiT).

    The endpoints are the 1,000-step values; other step counts keep them (DiT's configuration).
    """
    if not 0 < beta_start <= beta_end < 1:
        raise ConfigError(f"need 0 < beta_start <= beta_end < 1, got {beta_start} and {beta_end}")
    return np.linspace(beta_start, beta_end, num_timesteps, dtype=np.float64)


def cosine_betas(num_timesteps: int = 1000, s: float = 0.008, max_beta: float = 0.999) -> np.ndarray:
    """Improved DDPM's cosine schedule: ``alpha_bar(t) = cos^2((t/T + s) / (1 + s) * pi/2)``,
    betas ``1 - alpha_bar(t+1) / alpha_bar(t)`` capped at ``max_beta``."""
    def alpha_bar(u: float) -> float:
        return math.cos((u + s) / (1 + s) * math.pi / 2) ** 2

    steps = np.arange(num_timesteps, dtype=np.float64)
    betas = [1 - alpha_bar((i + 1) / num_timesteps) / alpha_bar(i / num_timesteps) for i in steps]
    return np.minimum(np.asarray(betas, dtype=np.float64), max_beta)


SCHEDULES = ("linear", "cosine")


def make_betas(schedule: str = "linear", num_timesteps: int = 1000, beta_start: float = 1e-4,
               beta_end: float = 0.02) -> np.ndarray:
    """The betas of a named schedule (``linear`` uses ``beta_start``/``beta_end``)."""
    if not isinstance(num_timesteps, int) or num_timesteps < 1:
        raise ConfigError(f"num_timesteps must be a positive integer, got {num_timesteps!r}")
    if schedule == "linear":
        return linear_betas(num_timesteps, beta_start, beta_end)
    if schedule == "cosine":
        return cosine_betas(num_timesteps)
    raise ConfigError(f"unknown noise schedule {schedule!r}; choose {' or '.join(SCHEDULES)}")


def space_timesteps(num_timesteps: int, steps: int) -> list[int]:
    """``steps`` training timesteps spread evenly over ``[0, num_timesteps)``, both ends included.

    The subset a respaced sampler visits (ascending, distinct). ``steps >= num_timesteps`` keeps
    them all.
    """
    if not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"sampling steps must be a positive integer, got {steps!r}")
    if steps >= num_timesteps:
        return list(range(num_timesteps))
    if steps == 1:
        return [num_timesteps - 1]
    return sorted({int(round(v)) for v in np.linspace(0, num_timesteps - 1, steps)})
