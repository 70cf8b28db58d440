"""``task: dit``: a class-conditional DiT learns an image set by denoising (DDPM objective).

Every evaluation reports the diffusion validation loss (``val_loss``: the training objective on the
fixed validation batches with fixed timesteps and noise), writes ``samples/step_N.png`` (one row
per class, ``diffusion.grid_per_class`` samples each) and scores ``diffusion.eval_samples``
class-conditional samples with the FD-proxy: ``fd_proxy`` is the Frechet distance between the
validation images and the samples in the feature space of a small classifier trained on the
training split (cached; it is not Inception FID and its values are not comparable to FID), and
``sample_acc`` the share of samples that classifier assigns to the class they were asked for.

The image set must have at least two classes with images and 1 (grey) or 3 (RGB) channels, and
``data.augment`` must not mix images (no soft targets); all are refused before the run directory
is written (:func:`check_dit_images`, the config's checks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..config import AnalysisConfig, TrainConfig, check_seed, derive
from ..data import ImageSet, check_image_options
from ..diffusion import DiffusionObjective, create_diffusion, sample, save_image_grid
from ..diffusion.grid import class_labels
from ..diffusion.schedule import linear_betas
from ..errors import UserError
from ..eval.fid_proxy import get_proxy, sample_quality
from ..models import config_checks as check
from ..models.dit import DiT, DiTConfig
from ..rundir import RunDir, inner_folder
from ..train import Evaluation
from .images import (
    ImageData,
    ImageDataConfig,
    image_analysis_batches,
    image_micro_batch,
    image_tokens_per_sample,
    load_image_data,
)
from .spec import Task

# Counts that make the process's tables or every evaluation's samples, bounded so that a slip of
# the keyboard is refused at once rather than filling memory or running for days.
DIFFUSION_LIMITS = {"timesteps": 100_000, "eval_samples": 100_000, "grid_per_class": 100}
DIFFUSION_LIMIT_REASONS = {"timesteps": "DDPM and DiT use 1,000",
                           "eval_samples": "FID is reported on 50,000 samples",
                           "grid_per_class": "the sample grid has that many per class"}


@dataclass(frozen=True)
class DiffusionConfig:
    """The DiT diffusion process and how a ``task: dit`` run scores its samples.

    ``timesteps`` of a ``schedule`` (linear, as DiT; or cosine). ``beta_start`` and ``beta_end``
    are the linear schedule's endpoints at 1,000 steps; for other ``timesteps`` both are scaled by
    ``1000 / timesteps`` (ADM's and DiT's rule), and a ``timesteps`` that scales ``beta_end`` to 1
    or more is refused. At every evaluation the run samples with ``sampler`` (ddim or ddpm) over
    ``sample_steps`` respaced steps with classifier-free guidance ``cfg_scale``, writes a grid of
    ``grid_per_class`` samples per class to ``samples/step_N.png``, and scores ``eval_samples``
    class-conditional samples with the FD-proxy (a Frechet distance in the feature space of a small
    classifier trained on the same data: not Inception FID) and the classifier's accuracy on them.
    """

    timesteps: int = 1000
    schedule: str = "linear"
    beta_start: float = 1e-4
    beta_end: float = 0.02
    sampler: str = "ddim"
    sample_steps: int = 50
    eta: float = 0.0
    cfg_scale: float = 1.5
    eval_samples: int = 500
    grid_per_class: int = 8

    def __post_init__(self) -> None:
        for name in ("timesteps", "sample_steps", "eval_samples", "grid_per_class"):
            if getattr(self, name) <= 0:
                raise UserError(f"diffusion.{name} must be positive, got {getattr(self, name)}")
        for name, most in DIFFUSION_LIMITS.items():
            if getattr(self, name) > most:
                raise UserError(f"diffusion.{name}={getattr(self, name):,} is more than a run uses "
                                  f"(at most {most:,}: {DIFFUSION_LIMIT_REASONS[name]})")
        if self.schedule not in ("linear", "cosine"):
            raise UserError(f"diffusion.schedule: unknown value {self.schedule!r}; choose linear or cosine")
        if self.sampler not in ("ddim", "ddpm"):
            raise UserError(f"diffusion.sampler: unknown value {self.sampler!r}; choose ddim or ddpm")
        if self.sample_steps > self.timesteps:
            raise UserError(f"diffusion.sample_steps ({self.sample_steps}) exceeds diffusion.timesteps "
                              f"({self.timesteps})")
        if not 0 < self.beta_start < self.beta_end < 1:
            raise UserError("diffusion needs 0 < beta_start < beta_end < 1, got "
                              f"{self.beta_start} and {self.beta_end}")
        if self.schedule == "linear":
            try:
                linear_betas(self.timesteps, self.beta_start, self.beta_end)
            except UserError as error:
                raise UserError(f"diffusion: {error}") from None
        if self.eta < 0 or self.cfg_scale < 0:
            raise UserError(f"diffusion.eta and diffusion.cfg_scale must not be negative, got "
                              f"{self.eta} and {self.cfg_scale}")


def _digits_dit() -> DiTConfig:
    return DiTConfig.from_size("digits", learn_sigma=False)


@dataclass(frozen=True)
class DiTRunConfig:
    """One class-conditional diffusion run (``task: dit``): a DiT on an image set."""

    task: str = "dit"
    model: DiTConfig = field(default_factory=_digits_dit)
    data: ImageDataConfig = field(default_factory=ImageDataConfig)
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    # The diffusion loss of one batch swings with its random timesteps (a batch of small t's costs
    # many times one of large t's), so "3x the best loss so far" stopped healthy runs; non-finite
    # losses still stop a run at once.
    train: TrainConfig = field(default_factory=lambda: TrainConfig(divergence_factor=20.0))
    seed: int = 0
    analysis: AnalysisConfig = field(default_factory=AnalysisConfig)

    def __post_init__(self) -> None:
        check_seed(self.seed)
        a = self.data.augment
        if a.mixes or a.smoothing > 0:
            raise UserError("data.augment.mixup_alpha, cutmix_alpha and smoothing make soft class targets, "
                              "which a DiT cannot take (it is conditioned on one label per image); set them "
                              "to 0 for task=dit")
        check_image_options(self.data.dataset, self.data.dataset_options)


def check_dit_images(cfg: DiTRunConfig, images: ImageSet) -> None:
    """A DiT needs 1 (grey) or 3 (RGB) channels: its evaluations write the samples as a PNG grid,
    and showing some channels of a 2- or 4-channel image (RGBA, latents) would misrepresent what
    the model draws."""
    chans = images.shape[0]
    if chans not in (1, 3):
        raise UserError(f"{cfg.data.dataset}: images have {chans} channels; task=dit draws its samples as "
                          "a grey (1 channel) or RGB (3 channel) PNG grid, so give 1- or 3-channel images "
                          "(e.g. drop an alpha channel)")


def load_dit_data(cfg: DiTRunConfig, run_dir: Path | None = None, resume: bool = False) -> ImageData:
    """The image set of ``cfg``, checked (:func:`check_dit_images` too) and split."""
    return load_image_data(cfg, check=check_dit_images)


def _fit(cfg: DiTRunConfig, data: ImageData) -> DiTRunConfig:
    """The image size, channels and classes from the data; the size must split into patches."""
    check.divisible("DiTConfig", "input_size", data.image_size, "DiTConfig.patch_size", cfg.model.patch_size)
    return derive(cfg, {"model.input_size": data.image_size, "model.in_chans": data.in_chans,
                        "model.num_classes": data.num_classes})


def build_objective(cfg: DiTRunConfig, device=None) -> DiffusionObjective:
    """The trained module of a DiT run: the DiT inside its diffusion objective."""
    d = cfg.diffusion
    return DiffusionObjective(DiT(cfg.model, device=device),
                              create_diffusion(d.timesteps, d.schedule, d.beta_start, d.beta_end),
                              eval_seed=cfg.seed)


class SampleEvaluation(Evaluation):
    """The sample grid and the FD-proxy scores of one evaluation (the proxy is loaded once)."""

    def __init__(self, cfg: DiTRunConfig, data: ImageData, run_dir: Path, device: torch.device) -> None:
        self.cfg, self.data, self.run_dir, self.device = cfg, data, run_dir, device
        self.proxy = None

    def draw(self, model: nn.Module, labels: torch.Tensor, seed: int) -> torch.Tensor:
        d = self.cfg.diffusion
        generator = torch.Generator(self.device).manual_seed(seed)
        return sample(model, labels, method=d.sampler, steps=d.sample_steps, cfg_scale=d.cfg_scale,
                      eta=d.eta, generator=generator)

    def __call__(self, model: nn.Module, step: int) -> dict:
        d, k = self.cfg.diffusion, self.data.num_classes
        grid_labels = torch.arange(k).repeat_interleave(d.grid_per_class)
        grid = self.draw(model, grid_labels, self.cfg.seed)
        inner_folder(RunDir(self.run_dir).samples)
        save_image_grid(grid.cpu(), RunDir(self.run_dir).sample_grid(step),
                        nrow=d.grid_per_class, upscale=max(1, 64 // self.data.image_size),
                        padding=4, pad_value=255, row_labels=class_labels(self.data.train.class_names))
        if self.proxy is None:
            self.proxy = get_proxy(self.data.train, device=self.device)
        labels = torch.arange(d.eval_samples) % k
        generated = self.draw(model, labels, self.cfg.seed + 1)
        q = sample_quality(self.proxy, self.data.val, generated.cpu(), labels)
        return {"fd_proxy": q["fd_proxy"], "sample_acc": q["class_accuracy"],
                "proxy_acc": q["proxy_val_accuracy"]}


def _analysis_batches(cfg: DiTRunConfig, run_dir: Path, data: str | None, n: int) -> list:
    return image_analysis_batches(cfg, run_dir, data, n, size=cfg.model.input_size, load=load_dit_data)


TASK = Task(
    name="dit",
    config_class=DiTRunConfig,
    load_data=load_dit_data,
    fit=_fit,
    build_model=build_objective,
    evaluation=SampleEvaluation,
    analysis_batches=_analysis_batches,
    headline=("final_fd_proxy", "final FD-proxy, lower is better (not Inception FID)"),
    columns=("final_fd_proxy", "final_sample_acc"),
    higher_is_better=("final_sample_acc",),
    titles={"final_fd_proxy": "FD-proxy", "final_sample_acc": "sample acc"},
    head_fn=None,  # a DiT has no logits: no lens
    kind="DiT image-diffusion",
    micro_batch=image_micro_batch("input_size"),
    tokens_per_sample=image_tokens_per_sample,
)
