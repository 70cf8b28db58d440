"""Noise schedules (DDPM's linear, improved DDPM's cosine) and timestep respacing, as float64 arrays:
the products over 1,000 steps need the precision."""

from __future__ import annotations

import math

import numpy as np

from ..errors import UserError

# The step count at which a linear schedule's ``beta_start``/``beta_end`` hold unscaled (ADM, DiT).
LINEAR_REFERENCE_STEPS = 1000

__all__ = ["LINEAR_REFERENCE_STEPS", "SCHEDULES", "cosine_betas", "linear_betas", "make_betas",
           "space_timesteps"]


def linear_betas(num_timesteps: int = 1000, beta_start: float = 1e-4, beta_end: float = 0.02) -> np.ndarray:
    """``T = num_timesteps`` betas evenly spaced between the 1,000-step endpoints ``beta_start`` and
    ``beta_end`` scaled by ``1000 / T`` (ADM's and DiT's rule); refused when that reaches 1."""
    if not 0 < beta_start <= beta_end < 1:
        raise UserError(f"need 0 < beta_start <= beta_end < 1, got {beta_start} and {beta_end}")
    scale = LINEAR_REFERENCE_STEPS / num_timesteps
    start, end = beta_start * scale, beta_end * scale
    if end >= 1:
        least = math.floor(LINEAR_REFERENCE_STEPS * beta_end) + 1
        raise UserError(f"a linear schedule over {num_timesteps} steps scales beta_end {beta_end:g} by "
                          f"1000/{num_timesteps} to {end:g} >= 1; use at least {least} timesteps or a "
                          "smaller beta_end")
    return np.linspace(start, end, num_timesteps, dtype=np.float64)


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
    """The betas of a named schedule (``linear``: see :func:`linear_betas`)."""
    if not isinstance(num_timesteps, int) or num_timesteps < 1:
        raise UserError(f"num_timesteps must be a positive integer, got {num_timesteps!r}")
    if schedule == "linear":
        return linear_betas(num_timesteps, beta_start, beta_end)
    if schedule == "cosine":
        return cosine_betas(num_timesteps)
    raise UserError(f"unknown noise schedule {schedule!r}; choose {' or '.join(SCHEDULES)}")


def space_timesteps(num_timesteps: int, steps: int) -> list[int]:
    """``steps`` timesteps spread evenly over ``[0, num_timesteps)``, both ends included (at most all)."""
    if not isinstance(steps, int) or steps < 1:
        raise UserError(f"sampling steps must be a positive integer, got {steps!r}")
    if steps >= num_timesteps:
        return list(range(num_timesteps))
    if steps == 1:
        return [num_timesteps - 1]
    return sorted({int(round(v)) for v in np.linspace(0, num_timesteps - 1, steps)})
