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
is written (:func:`~siamesenorm.tasks.common.check_training_images`, the config's checks).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from ..devices import resolve_device
from ..diffusion import DiffusionObjective, create_diffusion, sample, save_image_grid
from ..eval.fid_proxy import get_proxy, sample_quality
from ..models.dit import DiT
from ..train import train
from .common import (
    ImageData,
    analyze_at_end,
    load_image_data,
    make_probe,
    open_run_dir,
    train_settings,
    write_config,
)

SAMPLES_DIR = "samples"


class SampleEvaluation:
    """The sample grid and the FD-proxy scores of one evaluation (the proxy is loaded once)."""

    def __init__(self, cfg, data: ImageData, run_dir: Path, device: torch.device) -> None:
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
        save_image_grid(grid.cpu(), self.run_dir / SAMPLES_DIR / f"step_{step}.png",
                        nrow=d.grid_per_class, upscale=max(1, 64 // self.data.image_size))
        if self.proxy is None:
            self.proxy = get_proxy(self.data.train, device=self.device)
        labels = torch.arange(d.eval_samples) % k
        generated = self.draw(model, labels, self.cfg.seed + 1)
        q = sample_quality(self.proxy, self.data.val, generated.cpu(), labels)
        return {"fd_proxy": q["fd_proxy"], "sample_acc": q["class_accuracy"],
                "proxy_acc": q["proxy_val_accuracy"]}


def run_dit(cfg, run_dir: str | Path, *, resume: bool = False, progress: bool | None = None) -> dict:
    """Train the DiT of ``cfg`` (a :class:`~siamesenorm.config.DiTRunConfig`) into ``run_dir``."""
    run_dir = Path(run_dir)
    cfg = open_run_dir(cfg, run_dir, resume)
    device = resolve_device(cfg.train.device)
    data = load_image_data(cfg)
    model_cfg = dataclasses.replace(cfg.model, input_size=data.image_size, in_chans=data.in_chans,
                                    num_classes=data.num_classes)
    cfg = dataclasses.replace(cfg, model=model_cfg)
    write_config(cfg, run_dir, resume)
    d = cfg.diffusion
    torch.manual_seed(cfg.seed)
    objective = DiffusionObjective(DiT(model_cfg, device=device),
                                   create_diffusion(d.timesteps, d.schedule, d.beta_start, d.beta_end),
                                   eval_seed=cfg.seed)
    probe = make_probe(cfg, data.val_batches)
    summary = train(objective, data.sampler, train_settings(cfg, data.val_batches), run_dir,
                    resume=resume, device=device, extra_eval=SampleEvaluation(cfg, data, run_dir, device),
                    progress=progress, probe=probe)
    analyze_at_end(cfg, objective, data.val_batches, run_dir, summary, device)  # no logits: no lens
    return summary
