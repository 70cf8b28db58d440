"""DiT's training objective (arXiv 2212.09748): improved DDPM's hybrid loss ``mse + vb``, ``vb`` built
from the detached ``eps`` prediction, so that it trains only the variance."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..models.dit import DiT
from ..models.host import SchemeHost
from ..schemes.base import ResidualScheme
from .gaussian import GaussianDiffusion
from .likelihood import LOG2, discretized_gaussian_log_likelihood, mean_flat, normal_kl

__all__ = ["DiffusionObjective", "DiffusionOutput", "training_losses", "vb_terms"]


@dataclass
class DiffusionOutput:
    """Batch means of ``loss``, ``mse`` and ``vb`` (0 for a fixed-variance model)."""

    loss: Tensor
    mse: Tensor
    vb: Tensor


def vb_terms(diffusion: GaussianDiffusion, output: Tensor, x_start: Tensor, x_t: Tensor,
             t: Tensor) -> Tensor:
    """Per-example ``L_t`` in bits per dimension (the KL for ``t > 0``, the decoder NLL at ``t = 0``)."""
    true_mean, _, true_log_var = diffusion.q_posterior_mean_variance(x_start, x_t, t)
    p = diffusion.p_mean_variance(output, x_t, t, clip_denoised=False)
    kl = mean_flat(normal_kl(true_mean, true_log_var, p.mean, p.log_variance)) / LOG2
    nll = -mean_flat(discretized_gaussian_log_likelihood(x_start, p.mean, 0.5 * p.log_variance)) / LOG2
    return torch.where(t.to(kl.device) == 0, nll, kl)


def training_losses(model: nn.Module, diffusion: GaussianDiffusion, x_start: Tensor, t: Tensor,
                    noise: Tensor, y: Tensor) -> dict[str, Tensor]:
    """Per-example ``loss``, ``mse`` and ``vb`` at ``t``; ``vb`` is 0 for a model of ``C`` output channels."""
    x_t = diffusion.q_sample(x_start, t, noise)
    output = model(x_t, diffusion.model_timesteps(t), y).to(x_start.dtype)
    eps, v = diffusion.split_output(output, x_t)
    mse = mean_flat((noise - eps) ** 2)
    if v is None:
        vb = torch.zeros_like(mse)
    else:
        frozen = torch.cat([eps.detach(), v], dim=1)
        vb = vb_terms(diffusion, frozen, x_start, x_t, t)
    return {"loss": mse + vb, "mse": mse, "vb": vb}


class DiffusionObjective(nn.Module, SchemeHost):
    """A DiT and its diffusion process as one module, ``forward(x, y).loss``, hosting the DiT's scheme.
    Training draws ``t`` and the noise from torch's global generator, eval mode from a private one reseeded
    with ``eval_seed`` on entering it, so every validation pass gives the same loss."""

    def __init__(self, model: DiT, diffusion: GaussianDiffusion | None = None, *,
                 eval_seed: int = 0) -> None:
        super().__init__()
        self.model = model
        self.diffusion = diffusion if diffusion is not None else GaussianDiffusion.linear()
        self.eval_seed = eval_seed
        self.eval_generator = torch.Generator().manual_seed(eval_seed)

    def train(self, mode: bool = True) -> DiffusionObjective:
        """Set the mode; entering eval mode restarts the evaluation draws at ``eval_seed``."""
        if not mode:
            self.eval_generator.manual_seed(self.eval_seed)
        return super().train(mode)

    def reset_parameters(self) -> None:
        self.model.reset_parameters()

    def num_parameters(self) -> int:
        return self.model.num_parameters()

    def tokens_in(self, x: Tensor) -> int:
        return self.model.tokens_in(x)

    def flops_per_token(self, seq_len: int | None = None) -> float | None:
        return self.model.flops_per_token(seq_len)

    @property
    def scheme(self) -> ResidualScheme:
        return self.model.scheme

    @property
    def sublayers(self) -> nn.ModuleList:
        return self.model.sublayers

    def draw(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(t, noise)`` for a batch ``x``: global generator in training mode, private in eval."""
        n = self.diffusion.num_timesteps
        if self.training:
            return torch.randint(0, n, (len(x),), device=x.device), torch.randn_like(x)
        t = torch.randint(0, n, (len(x),), generator=self.eval_generator)
        noise = torch.randn(x.shape, generator=self.eval_generator, dtype=torch.float32)
        return t.to(x.device), noise.to(device=x.device, dtype=x.dtype)

    def forward(self, x: Tensor, y: Tensor) -> DiffusionOutput:
        """The mean loss of the batch ``x (B, C, H, W)`` in [-1, 1] with class labels ``y (B,)``."""
        t, noise = self.draw(x)
        terms = training_losses(self.model, self.diffusion, x, t, noise, y)
        return DiffusionOutput(terms["loss"].mean(), terms["mse"].mean(), terms["vb"].mean())
