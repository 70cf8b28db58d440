"""The Gaussian diffusion process of DDPM as DiT uses it (arXiv 2212.09748, 2102.09672, 2006.11239). A
respaced process keeps a subset of the timesteps; ``timestep_map[t]`` is the one the model sees."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..errors import UserError
from .schedule import make_betas, space_timesteps

__all__ = ["FIXED_VARIANCES", "GaussianDiffusion", "PMeanVariance", "create_diffusion"]

FIXED_VARIANCES = ("small", "large")


@dataclass
class PMeanVariance:
    """The model's reverse step ``p(x_{t-1} | x_t)`` and the ``x_0`` and ``eps`` predictions it came from."""

    mean: Tensor
    variance: Tensor
    log_variance: Tensor
    pred_xstart: Tensor
    eps: Tensor


class GaussianDiffusion:
    """One diffusion process over ``betas`` (``T`` values in (0, 1)). ``fixed_variance`` is the variance
    of a model that predicts only ``eps``: ``"small"`` (the posterior's ``beta~_t``) or ``"large"``
    (``beta_t``); coefficients are float64, cast to the input's dtype when gathered."""

    def __init__(self, betas: Sequence[float] | np.ndarray, *, fixed_variance: str = "small",
                 timestep_map: Sequence[int] | None = None) -> None:
        betas = np.asarray(betas, dtype=np.float64)
        if betas.ndim != 1 or len(betas) == 0 or not ((betas > 0) & (betas < 1)).all():
            raise UserError("betas must be a non-empty 1-D sequence of values in (0, 1)")
        if fixed_variance not in FIXED_VARIANCES:
            raise UserError(f"fixed_variance must be {' or '.join(FIXED_VARIANCES)}, "
                              f"got {fixed_variance!r}")
        self.fixed_variance = fixed_variance
        self.num_timesteps = len(betas)
        self.timestep_map = [int(t) for t in (range(len(betas)) if timestep_map is None else timestep_map)]
        if len(self.timestep_map) != len(betas):
            raise UserError(f"timestep_map has {len(self.timestep_map)} entries for {len(betas)} betas")
        alphas = 1.0 - betas
        abar = np.cumprod(alphas)
        abar_prev = np.append(1.0, abar[:-1])
        post_var = betas * (1.0 - abar_prev) / (1.0 - abar)
        # beta~_0 is 0; its log is clipped to beta~_1 (or to beta_0 for a one-step process).
        first = post_var[1] if len(betas) > 1 else betas[0]
        large = np.append(first, betas[1:])
        arrays = {
            "betas": betas, "alphas_cumprod": abar, "alphas_cumprod_prev": abar_prev,
            "sqrt_alphas_cumprod": np.sqrt(abar), "sqrt_one_minus_alphas_cumprod": np.sqrt(1.0 - abar),
            "sqrt_recip_alphas_cumprod": np.sqrt(1.0 / abar),
            "sqrt_recipm1_alphas_cumprod": np.sqrt(1.0 / abar - 1.0),
            "posterior_variance": post_var,
            "posterior_log_variance_clipped": np.log(np.append(first, post_var[1:])),
            "posterior_mean_coef1": np.sqrt(abar_prev) * betas / (1.0 - abar),
            "posterior_mean_coef2": np.sqrt(alphas) * (1.0 - abar_prev) / (1.0 - abar),
            "log_betas": np.log(betas), "large_variance": large, "large_log_variance": np.log(large),
            "timestep_map": np.asarray(self.timestep_map, dtype=np.int64),
        }
        self._cpu = {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in arrays.items()}
        self._cache: dict[tuple[str, torch.device], Tensor] = {}

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def linear(cls, num_timesteps: int = 1000, beta_start: float = 1e-4, beta_end: float = 0.02,
               **kwargs) -> GaussianDiffusion:
        """DiT's process: linear betas from ``beta_start`` to ``beta_end`` (:func:`linear_betas`)."""
        return cls(make_betas("linear", num_timesteps, beta_start, beta_end), **kwargs)

    def respace(self, steps: int | Sequence[int]) -> GaussianDiffusion:
        """The process on a subset of this one's timesteps (a count, or the timesteps), ``abar`` unchanged."""
        keep = space_timesteps(self.num_timesteps, steps) if isinstance(steps, int) else sorted(set(steps))
        if not keep or keep[0] < 0 or keep[-1] >= self.num_timesteps:
            raise UserError(f"respaced timesteps must lie in [0, {self.num_timesteps}), got {steps}")
        abar = self._cpu["alphas_cumprod"].numpy()
        last, betas = 1.0, []
        for t in keep:
            betas.append(1.0 - abar[t] / last)
            last = abar[t]
        return GaussianDiffusion(betas, fixed_variance=self.fixed_variance,
                                 timestep_map=[self.timestep_map[t] for t in keep])

    # ---- coefficients ------------------------------------------------------------------------
    def coefficient(self, name: str, t: Tensor, like: Tensor) -> Tensor:
        """``name[t]`` shaped ``(B, 1, ..., 1)`` to broadcast against ``like``, in its dtype/device."""
        key = (name, like.device)
        table = self._cache.get(key)
        if table is None:
            table = self._cache[key] = self._cpu[name].to(like.device)
        out = table[t.to(like.device).long()].to(like.dtype)
        return out.reshape(len(t), *([1] * (like.ndim - 1)))

    def table(self, name: str) -> Tensor:
        return self._cpu[name]

    def model_timesteps(self, t: Tensor) -> Tensor:
        """The original timesteps the model is conditioned on at this process's steps ``t``."""
        return self._cpu["timestep_map"].to(t.device)[t.long()]

    # ---- forward process and posterior ---------------------------------------------------------
    def q_mean_variance(self, x_start: Tensor, t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        mean = self.coefficient("sqrt_alphas_cumprod", t, x_start) * x_start
        var = 1.0 - self.coefficient("alphas_cumprod", t, x_start)
        return mean, var.expand_as(x_start), torch.log(var).expand_as(x_start)

    def q_sample(self, x_start: Tensor, t: Tensor, noise: Tensor) -> Tensor:
        return (self.coefficient("sqrt_alphas_cumprod", t, x_start) * x_start
                + self.coefficient("sqrt_one_minus_alphas_cumprod", t, x_start) * noise)

    def q_posterior_mean_variance(self, x_start: Tensor, x_t: Tensor,
                                  t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Mean, variance and clipped log-variance of ``q(x_{t-1} | x_t, x_0)``."""
        mean = (self.coefficient("posterior_mean_coef1", t, x_t) * x_start
                + self.coefficient("posterior_mean_coef2", t, x_t) * x_t)
        var = self.coefficient("posterior_variance", t, x_t).expand_as(x_t)
        log_var = self.coefficient("posterior_log_variance_clipped", t, x_t).expand_as(x_t)
        return mean, var, log_var

    def predict_xstart_from_eps(self, x_t: Tensor, t: Tensor, eps: Tensor) -> Tensor:
        return (self.coefficient("sqrt_recip_alphas_cumprod", t, x_t) * x_t
                - self.coefficient("sqrt_recipm1_alphas_cumprod", t, x_t) * eps)

    def predict_eps_from_xstart(self, x_t: Tensor, t: Tensor, x_start: Tensor) -> Tensor:
        return ((self.coefficient("sqrt_recip_alphas_cumprod", t, x_t) * x_t - x_start)
                / self.coefficient("sqrt_recipm1_alphas_cumprod", t, x_t))

    # ---- the model's reverse step ----------------------------------------------------------------
    def split_output(self, output: Tensor, x_t: Tensor) -> tuple[Tensor, Tensor | None]:
        """``(eps, v)`` of a model output with ``C`` (``v`` is None) or ``2 C`` channels."""
        channels = x_t.shape[1]
        if output.shape[1] == channels:
            return output, None
        if output.shape[1] == 2 * channels:
            return output[:, :channels], output[:, channels:]
        raise ValueError(f"the model returned {output.shape[1]} channels for {channels}-channel images; "
                         f"a DiT must return {channels} (fixed variance) or {2 * channels} (learn_sigma)")

    def p_mean_variance(self, output: Tensor, x_t: Tensor, t: Tensor, *,
                        clip_denoised: bool = True) -> PMeanVariance:
        """``p(x_{t-1} | x_t)`` from the model's ``output``: the posterior mean at the predicted ``x_0``,
        clipped to [-1, 1] when ``clip_denoised`` (sampling)."""
        eps, v = self.split_output(output, x_t)
        if v is None:
            prefix = "posterior" if self.fixed_variance == "small" else "large"
            var = self.coefficient(f"{prefix}_variance", t, x_t).expand_as(x_t)
            name = "posterior_log_variance_clipped" if prefix == "posterior" else "large_log_variance"
            log_var = self.coefficient(name, t, x_t).expand_as(x_t)
        else:
            low = self.coefficient("posterior_log_variance_clipped", t, x_t)
            high = self.coefficient("log_betas", t, x_t)
            frac = (v + 1.0) / 2.0
            log_var = frac * high + (1.0 - frac) * low
            var = torch.exp(log_var)
        pred_xstart = self.predict_xstart_from_eps(x_t, t, eps)
        if clip_denoised:
            pred_xstart = pred_xstart.clamp(-1.0, 1.0)
        mean, _, _ = self.q_posterior_mean_variance(pred_xstart, x_t, t)
        return PMeanVariance(mean, var, log_var, pred_xstart, eps)


def create_diffusion(num_timesteps: int = 1000, schedule: str = "linear", beta_start: float = 1e-4,
                     beta_end: float = 0.02, fixed_variance: str = "small") -> GaussianDiffusion:
    """A :class:`GaussianDiffusion` from plain settings (DiT's defaults: linear, 1e-4..0.02, 1000 steps)."""
    return GaussianDiffusion(make_betas(schedule, num_timesteps, beta_start, beta_end),
                             fixed_variance=fixed_variance)
