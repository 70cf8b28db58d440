"""DiT's training objective (arXiv 2212.09748, built on improved DDPM, arXiv 2102.09672).

The loss of one image at timestep ``t`` with noise ``eps``::

    x_t  = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps
    mse  = mean over pixels of (eps - eps_theta(x_t, t, y))^2
    vb   = L_t of the variational bound in bits per dimension (learn_sigma only):
           KL(q(x_{t-1} | x_t, x_0) || p(x_{t-1} | x_t)) for t > 0, the decoder NLL for t = 0,
           with p's mean built from the DETACHED eps prediction, so vb trains only the variance
    loss = mse + vb                  (improved DDPM's "hybrid" loss, as DiT trains it)

:class:`DiffusionObjective` wraps a DiT so the generic training loop can call ``model(x, y).loss``.
"""

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
    """What :class:`DiffusionObjective` returns: the batch means of ``loss``, ``mse`` and ``vb``
    (``vb`` is 0 for a fixed-variance model)."""

    loss: Tensor
    mse: Tensor
    vb: Tensor


def vb_terms(diffusion: GaussianDiffusion, output: Tensor, x_start: Tensor, x_t: Tensor,
             t: Tensor) -> Tensor:
    """Per-example ``L_t`` in bits per dimension: the KL for ``t > 0``, the decoder NLL at ``t = 0``.

    ``output`` is the model output (``eps`` or ``eps`` and ``v``) at ``(x_t, t)``; nothing is
    clipped, as in training.
    """
    true_mean, _, true_log_var = diffusion.q_posterior_mean_variance(x_start, x_t, t)
    p = diffusion.p_mean_variance(output, x_t, t, clip_denoised=False)
    kl = mean_flat(normal_kl(true_mean, true_log_var, p.mean, p.log_variance)) / LOG2
    nll = -mean_flat(discretized_gaussian_log_likelihood(x_start, p.mean, 0.5 * p.log_variance)) / LOG2
    return torch.where(t.to(kl.device) == 0, nll, kl)


def training_losses(model: nn.Module, diffusion: GaussianDiffusion, x_start: Tensor, t: Tensor,
                    noise: Tensor, y: Tensor) -> dict[str, Tensor]:
    """Per-example ``loss``, ``mse`` and ``vb`` (see the module docstring) at timesteps ``t``.

    ``model(x_t, timesteps, y)`` is called with the original timesteps of ``t`` (respaced processes
    map them); a model output of ``2 C`` channels means a learned variance and adds ``vb``.
    """
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
    """A DiT and its diffusion process as one module with ``forward(x, y) -> .loss``; it hosts the
    DiT's scheme (``scheme`` and ``sublayers`` are the DiT's), so the probes read it as a DiT.

    In training mode ``t`` (uniform over the process's steps) and the noise come from torch's
    global generator of ``x``'s device, which the training loop checkpoints. In eval mode they come
    from a private CPU generator that is reseeded with ``eval_seed`` every time the module enters
    eval mode, so each validation pass over the same batches gives the same loss and leaves the
    global generators where they were. ``state_dict`` is the DiT's under the prefix ``model.``.

    Args:
        model: the DiT, ``model(x, t, y) -> (B, C or 2C, H, W)``.
        diffusion: the process (default: DiT's linear 1,000-step schedule).
        eval_seed: the seed of the evaluation draws.
    """

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
        """Re-initialise the wrapped model."""
        self.model.reset_parameters()

    def num_parameters(self) -> int:
        """The DiT's parameter count."""
        return self.model.num_parameters()

    def tokens_in(self, x: Tensor) -> int:
        """The DiT's token count (patches) for the images ``x``."""
        return self.model.tokens_in(x)

    def flops_per_token(self, seq_len: int | None = None) -> float | None:
        """The DiT's estimate (none)."""
        return self.model.flops_per_token(seq_len)

    @property
    def scheme(self) -> ResidualScheme:
        """The DiT's residual scheme."""
        return self.model.scheme

    @property
    def sublayers(self) -> nn.ModuleList:
        """The DiT's sublayers."""
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
