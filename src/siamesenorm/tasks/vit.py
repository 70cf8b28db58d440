"""``task: vit``: a DeiT-style vision transformer learns to classify an image set.

Training batches carry the augmentations of ``data.augment`` (soft targets under mixup/cutmix,
smoothed by ``data.augment.smoothing`` or, when that is 0, by ``model.label_smoothing``);
every evaluation reports the validation cross-entropy (``val_loss``) and top-1 accuracy
(``val_acc``) on the fixed validation batches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..analysis.adapters import vit_head
from ..config import AnalysisConfig, TrainConfig, check_seed, derive
from ..data import ImageAugment, check_image_options
from ..errors import UserError
from ..models import config_checks as check
from ..models.vit import VisionTransformer, ViTConfig
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


def _digits_vit() -> ViTConfig:
    return ViTConfig.from_size("digits")


@dataclass(frozen=True)
class ViTRunConfig:
    """One image-classification run (``task: vit``): a DeiT-style ViT on an image set."""

    task: str = "vit"
    model: ViTConfig = field(default_factory=_digits_vit)
    data: ImageDataConfig = field(default_factory=ImageDataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    seed: int = 0
    analysis: AnalysisConfig = field(default_factory=AnalysisConfig)

    def __post_init__(self) -> None:
        check_seed(self.seed)
        # Under mixup/cutmix the targets are smoothed by data.augment.smoothing, else by
        # model.label_smoothing (training_augment); two different values contradict.
        a, smoothing = self.data.augment, self.model.label_smoothing
        if a.smoothing > 0 and not a.mixes:
            raise UserError(f"data.augment.smoothing={a.smoothing} only smooths mixup/cutmix targets, and "
                              "both are off; set model.label_smoothing instead")
        if a.smoothing > 0 and smoothing > 0 and a.smoothing != smoothing:
            raise UserError(f"data.augment.smoothing={a.smoothing} and model.label_smoothing={smoothing} "
                              "disagree; under mixup/cutmix one smoothing applies: set one of them (or both "
                              "to the same value)")
        check_image_options(self.data.dataset, self.data.dataset_options)


def training_augment(cfg: ViTRunConfig) -> ImageAugment:
    """``data.augment`` with the label smoothing folded into the mixup/cutmix targets.

    Under mixup or cutmix the model gets soft targets and cannot smooth them itself, so, as DeiT's
    ``Mixup(label_smoothing=...)`` does, the targets are smoothed before mixing: by
    ``data.augment.smoothing`` when it is set, else by ``model.label_smoothing`` (the config refuses
    two different non-zero values).
    """
    augment = cfg.data.augment
    if not augment.mixes or augment.smoothing > 0:
        return augment
    return dataclasses.replace(augment, smoothing=cfg.model.label_smoothing)


def load_vit_data(cfg: ViTRunConfig, run_dir: Path | None = None, resume: bool = False) -> ImageData:
    """The image set of ``cfg``, checked and split, with :func:`training_augment` on its batches."""
    return load_image_data(cfg, augment=training_augment)


def _fit(cfg: ViTRunConfig, data: ImageData) -> ViTRunConfig:
    """The image size, channels and classes from the data; the size must split into patches."""
    check.divisible("ViTConfig", "image_size", data.image_size, "ViTConfig.patch_size", cfg.model.patch_size)
    return derive(cfg, {"model.image_size": data.image_size, "model.in_chans": data.in_chans,
                        "model.num_classes": data.num_classes})


def _build_model(cfg: ViTRunConfig, device=None) -> nn.Module:
    return VisionTransformer(cfg.model, device=device)


@torch.no_grad()
def top1_accuracy(model: nn.Module, batches: list, device: torch.device) -> float:
    """Share of the images in ``batches`` whose largest logit is their label."""
    correct = total = 0
    for x, y in batches:
        logits = model(x.to(device)).logits
        correct += int((logits.argmax(dim=-1).cpu() == y).sum())
        total += len(y)
    return correct / max(total, 1)


class AccuracyEvaluation(Evaluation):
    """``val_acc``: top-1 accuracy on the validation batches."""

    def __init__(self, cfg: ViTRunConfig, data: ImageData, run_dir: Path, device: torch.device) -> None:
        self.batches, self.device = data.val_batches, device

    def __call__(self, model: nn.Module, step: int) -> dict:
        return {"val_acc": top1_accuracy(model, self.batches, self.device)}


def _analysis_batches(cfg: ViTRunConfig, run_dir: Path, data: str | None, n: int) -> list:
    return image_analysis_batches(cfg, run_dir, data, n, size=cfg.model.image_size, load=load_vit_data)


TASK = Task(
    name="vit",
    config_class=ViTRunConfig,
    load_data=load_vit_data,
    fit=_fit,
    build_model=_build_model,
    evaluation=AccuracyEvaluation,
    analysis_batches=_analysis_batches,
    headline=("final_val_acc", "final validation top-1 accuracy"),
    columns=("final_val_acc",),
    higher_is_better=("final_val_acc",),
    titles={"final_val_acc": "val top-1"},
    head_fn=vit_head,  # the lens reads the class token
    kind="ViT image-classification",
    micro_batch=image_micro_batch("image_size"),
    tokens_per_sample=image_tokens_per_sample,
)
