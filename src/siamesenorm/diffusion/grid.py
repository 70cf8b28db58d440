"""Write a batch of images as one PNG grid, to look at what a diffusion model samples."""

from __future__ import annotations

import importlib
import math
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..errors import UserError
from ..rundir import replacing

__all__ = ["image_grid", "save_image_grid"]


def image_grid(images: Tensor, nrow: int = 8, padding: int = 1, upscale: int = 1) -> np.ndarray:
    """``(B, C, H, W)`` images in [-1, 1] tiled ``nrow`` per row as uint8 ``(rows, cols, C)``, ``padding``
    black pixels apart, each pixel repeated ``upscale`` times per axis."""
    if images.ndim != 4 or images.shape[1] not in (1, 3) or len(images) == 0:
        raise UserError(f"an image grid needs a non-empty (B, 1 or 3, H, W) batch, "
                          f"got {tuple(images.shape)}")
    if nrow < 1 or padding < 0 or upscale < 1:
        raise UserError(f"need nrow >= 1, padding >= 0, upscale >= 1; got {nrow}, {padding}, {upscale}")
    x = ((images.detach().float().cpu().clamp(-1, 1) + 1.0) * 127.5).round().to(torch.uint8)
    if upscale > 1:
        x = x.repeat_interleave(upscale, dim=2).repeat_interleave(upscale, dim=3)
    b, c, h, w = x.shape
    cols, rows = min(nrow, b), math.ceil(b / nrow)
    grid = torch.zeros(c, rows * (h + padding) + padding, cols * (w + padding) + padding, dtype=torch.uint8)
    for i in range(b):
        top, left = padding + (i // cols) * (h + padding), padding + (i % cols) * (w + padding)
        grid[:, top:top + h, left:left + w] = x[i]
    return grid.permute(1, 2, 0).numpy()


def _write_png(array: np.ndarray, path: Path) -> None:
    try:
        image = importlib.import_module("PIL.Image")
    except ImportError:
        pyplot = importlib.import_module("matplotlib.pyplot")
        pyplot.imsave(path, array[..., 0] if array.shape[-1] == 1 else array, cmap="gray", vmin=0,
                      vmax=255, format="png")
        return
    image.fromarray(array[..., 0] if array.shape[-1] == 1 else array).save(path, format="PNG")


def save_image_grid(images: Tensor, path: str | Path, nrow: int = 8, padding: int = 1,
                    upscale: int = 1) -> Path:
    """Write :func:`image_grid` of ``images`` to the PNG ``path`` atomically (Pillow, else matplotlib)."""
    path = Path(path)
    array = image_grid(images, nrow, padding, upscale)
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp:
        _write_png(array, tmp)
    return path
