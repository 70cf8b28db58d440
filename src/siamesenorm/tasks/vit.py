"""``task: vit``: a DeiT-style vision transformer learns to classify an image set.

Training batches carry the augmentations of ``data.augment`` (soft targets under mixup/cutmix,
smoothed by ``data.augment.smoothing`` or, when that is 0, by ``model.label_smoothing``);
every evaluation reports the validation cross-entropy (``val_loss``) and top-1 accuracy
(``val_acc``) on the fixed validation batches.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from ..analysis.adapters import vit_head
from ..devices import resolve_device
from ..models.vit import VisionTransformer
from ..train import train
from .common import (
    analyze_at_end,
    load_image_data,
    make_probe,
    open_run_dir,
    train_settings,
    write_config,
)


@torch.no_grad()
def top1_accuracy(model: nn.Module, batches: list, device: torch.device) -> float:
    """Share of the images in ``batches`` whose largest logit is their label."""
    correct = total = 0
    for x, y in batches:
        logits = model(x.to(device)).logits
        correct += int((logits.argmax(dim=-1).cpu() == y).sum())
        total += len(y)
    return correct / max(total, 1)


def run_vit(cfg, run_dir: str | Path, *, resume: bool = False, progress: bool | None = None) -> dict:
    """Train the ViT of ``cfg`` (a :class:`~siamesenorm.config.ViTRunConfig`) into ``run_dir``."""
    run_dir = Path(run_dir)
    cfg = open_run_dir(cfg, run_dir, resume)
    device = resolve_device(cfg.train.device)
    data = load_image_data(cfg)
    model_cfg = dataclasses.replace(cfg.model, image_size=data.image_size, in_chans=data.in_chans,
                                    num_classes=data.num_classes)
    cfg = dataclasses.replace(cfg, model=model_cfg)
    write_config(cfg, run_dir, resume)
    torch.manual_seed(cfg.seed)
    model = VisionTransformer(model_cfg, device=device)

    def extra_eval(m: nn.Module) -> dict:
        return {"val_acc": top1_accuracy(m, data.val_batches, device)}

    probe = make_probe(cfg, data.val_batches)
    summary = train(model, data.sampler, train_settings(cfg, data.val_batches), run_dir, resume=resume,
                    device=device, extra_eval=extra_eval, progress=progress, probe=probe)
    analyze_at_end(cfg, model, data.val_batches, run_dir, summary, device, head_fn=vit_head)
    return summary
