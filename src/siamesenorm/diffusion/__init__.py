"""Gaussian diffusion for class-conditional DiTs (arXiv 2212.09748, 2102.09672). A DiT maps ``(x, t, y)``
to ``(B, C or 2C, H, W)`` (``2C``: learned variance), its null class is ``num_classes``, and images
live in [-1, 1]."""

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
