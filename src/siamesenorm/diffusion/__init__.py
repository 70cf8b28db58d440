"""Gaussian diffusion for class-conditional DiTs (arXiv 2212.09748; improved DDPM, arXiv 2102.09672).

A typical run::

    diffusion = create_diffusion()                         # linear betas 1e-4..0.02, 1000 steps
    objective = DiffusionObjective(dit, diffusion)         # objective(x, y).loss for the training loop
    images = sample(dit, labels, diffusion, method="ddim", steps=50, cfg_scale=4.0,
                    generator=torch.Generator().manual_seed(0))    # (B, C, H, W) in [-1, 1]
    save_image_grid(images, "samples.png", nrow=8)

The DiT contract: ``dit(x, t, y) -> (B, C or 2C, H, W)`` (``2C``: learned variance), the null
class for guidance is ``num_classes``, ``dit.forward_with_cfg(x, t, y, scale)`` guides a doubled
batch. Images live in [-1, 1].
"""

from .gaussian import FIXED_VARIANCES, GaussianDiffusion, PMeanVariance, create_diffusion
from .grid import image_grid, save_image_grid
from .guidance import guided_output, null_label_of
from .likelihood import discretized_gaussian_log_likelihood, mean_flat, normal_kl
from .objective import DiffusionObjective, DiffusionOutput, training_losses, vb_terms
from .sampling import METHODS, ddim_sample, ddpm_sample, sample
from .schedule import SCHEDULES, cosine_betas, linear_betas, make_betas, space_timesteps

__all__ = ["FIXED_VARIANCES", "METHODS", "SCHEDULES", "DiffusionObjective", "DiffusionOutput",
           "GaussianDiffusion", "PMeanVariance", "cosine_betas", "create_diffusion", "ddim_sample",
           "ddpm_sample", "discretized_gaussian_log_likelihood", "guided_output", "image_grid",
           "linear_betas", "make_betas", "mean_flat", "normal_kl", "null_label_of", "sample",
           "save_image_grid", "space_timesteps", "training_losses", "vb_terms"]
