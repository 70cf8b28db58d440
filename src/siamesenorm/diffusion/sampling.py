"""Class-conditional sampling: DDPM ancestral steps (arXiv 2006.11239) and DDIM (arXiv 2010.02502). A
seeded CPU ``generator`` gives the same samples on every device up to the model's own arithmetic."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..errors import UserError
from ..models.dit import DiT
from .gaussian import GaussianDiffusion
from .guidance import guided_output, null_label_of
from .objective import DiffusionObjective

__all__ = ["METHODS", "ddim_sample", "ddpm_sample", "sample"]

METHODS = ("ddim", "ddpm")
Denoiser = Callable[[Tensor, Tensor, Tensor], Tensor]


def _denoiser(model: nn.Module, cfg_scale: float, null_label: int | None) -> Denoiser:
    if cfg_scale == 1.0:
        return lambda x, t, y: model(x, t, y)
    null = null_label_of(model, null_label)
    return lambda x, t, y: guided_output(model, x, t, y, cfg_scale, null)


def _noise(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> Tensor:
    gen_device = generator.device if generator is not None else device
    return torch.randn(shape, generator=generator, device=gen_device).to(device)


def _start(shape: tuple[int, ...], labels: Tensor, generator: torch.Generator | None,
           noise: Tensor | None) -> Tensor:
    if noise is not None:
        if tuple(noise.shape) != tuple(shape):
            raise UserError(f"starting noise has shape {tuple(noise.shape)}, expected {tuple(shape)}")
        return noise.to(labels.device, torch.float32)
    return _noise(shape, generator, labels.device)


def _output(denoise: Denoiser, diffusion: GaussianDiffusion, x: Tensor, step: int, y: Tensor) -> tuple:
    t = torch.full((len(x),), step, dtype=torch.int64, device=x.device)
    return t, denoise(x, diffusion.model_timesteps(t), y).to(x.dtype)


@torch.no_grad()
def ddpm_sample(model: nn.Module, diffusion: GaussianDiffusion, shape: tuple[int, ...], labels: Tensor, *,
                cfg_scale: float = 1.0, null_label: int | None = None,
                generator: torch.Generator | None = None, clip_denoised: bool = True,
                noise: Tensor | None = None) -> Tensor:
    """Ancestral DDPM sampling over every step of ``diffusion``; ``(B, C, H, W)`` in [-1, 1]."""
    denoise = _denoiser(model, cfg_scale, null_label)
    x = _start(shape, labels, generator, noise)
    for step in reversed(range(diffusion.num_timesteps)):
        t, out = _output(denoise, diffusion, x, step, labels)
        p = diffusion.p_mean_variance(out, x, t, clip_denoised=clip_denoised)
        x = p.mean
        if step > 0:
            x = x + torch.exp(0.5 * p.log_variance) * _noise(x.shape, generator, x.device)
    return x.clamp(-1.0, 1.0)


@torch.no_grad()
def ddim_sample(model: nn.Module, diffusion: GaussianDiffusion, shape: tuple[int, ...], labels: Tensor, *,
                eta: float = 0.0, cfg_scale: float = 1.0, null_label: int | None = None,
                generator: torch.Generator | None = None, clip_denoised: bool = True,
                noise: Tensor | None = None) -> Tensor:
    """DDIM sampling over every step of ``diffusion`` (respace it for fewer steps)."""
    if eta < 0:
        raise UserError(f"DDIM eta must not be negative, got {eta}")
    denoise = _denoiser(model, cfg_scale, null_label)
    x = _start(shape, labels, generator, noise)
    for step in reversed(range(diffusion.num_timesteps)):
        t, out = _output(denoise, diffusion, x, step, labels)
        p = diffusion.p_mean_variance(out, x, t, clip_denoised=clip_denoised)
        eps = diffusion.predict_eps_from_xstart(x, t, p.pred_xstart)
        abar = diffusion.coefficient("alphas_cumprod", t, x)
        abar_prev = diffusion.coefficient("alphas_cumprod_prev", t, x)
        sigma = eta * torch.sqrt((1 - abar_prev) / (1 - abar)) * torch.sqrt(1 - abar / abar_prev)
        x = torch.sqrt(abar_prev) * p.pred_xstart + torch.sqrt((1 - abar_prev - sigma**2).clamp_min(0)) * eps
        if step > 0 and eta > 0:
            x = x + sigma * _noise(x.shape, generator, x.device)
    return x.clamp(-1.0, 1.0)


def _image_shape(model: nn.Module, count: int, shape: tuple[int, int, int] | None) -> tuple[int, ...]:
    if shape is None:
        if not isinstance(model, DiT):
            raise UserError("cannot tell the image shape from the model (it is not a DiT); "
                              "pass shape=(C, H, W)")
        shape = (model.config.in_chans, model.config.input_size, model.config.input_size)
    if len(shape) != 3:
        raise UserError(f"shape must be (C, H, W), got {shape}")
    return (count, *(int(s) for s in shape))


def sample(model: nn.Module, labels: Tensor, diffusion: GaussianDiffusion | None = None,
           method: str = "ddim", steps: int | None = 50, cfg_scale: float = 1.0, *, eta: float = 0.0,
           generator: torch.Generator | None = None, shape: tuple[int, int, int] | None = None,
           null_label: int | None = None, clip_denoised: bool = True, noise: Tensor | None = None) -> Tensor:
    """Class-conditional samples, one per label: ``(len(labels), C, H, W)`` in [-1, 1], in eval mode.

    ``model`` is a DiT, a :class:`~siamesenorm.diffusion.DiffusionObjective`, or any ``model(x, t, y)``
    given ``shape`` (and ``null_label`` for guidance). ``diffusion`` defaults to the objective's, else
    DiT's linear process; ``steps`` respaces it (``None``: every step). ``noise`` fixes ``x_T``.
    """
    if method not in METHODS:
        raise UserError(f"unknown sampling method {method!r}; choose {' or '.join(METHODS)}")
    if isinstance(model, DiffusionObjective):
        diffusion = model.diffusion if diffusion is None else diffusion
        model = model.model
    diffusion = GaussianDiffusion.linear() if diffusion is None else diffusion
    process = diffusion if steps is None else diffusion.respace(steps)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    labels = torch.as_tensor(labels, dtype=torch.int64).to(device)
    full_shape = _image_shape(model, len(labels), shape)
    was_training = model.training
    model.eval()
    try:
        common = dict(cfg_scale=cfg_scale, null_label=null_label, generator=generator,
                      clip_denoised=clip_denoised, noise=noise)
        if method == "ddim":
            return ddim_sample(model, process, full_shape, labels, eta=eta, **common)
        return ddpm_sample(model, process, full_shape, labels, **common)
    finally:
        model.train(was_training)
