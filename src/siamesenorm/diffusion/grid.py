"""Write a batch of images as one PNG grid, to look at what a diffusion model samples."""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..errors import UserError
from ..rundir import replacing

__all__ = ["class_labels", "image_grid", "save_image_grid"]

PadValue = int | Sequence[int]      # a grey level, or an RGB colour, 0 to 255


def _pad_colour(pad_value: PadValue) -> tuple[int, ...]:
    colour = (pad_value,) if isinstance(pad_value, int) else tuple(pad_value)
    if len(colour) not in (1, 3) or not all(isinstance(v, int) and 0 <= v <= 255 for v in colour):
        raise UserError(f"pad_value must be a grey level or an RGB colour in 0..255, got {pad_value!r}")
    return colour


def image_grid(images: Tensor, nrow: int = 8, padding: int = 1, upscale: int = 1,
               pad_value: PadValue = 0) -> np.ndarray:
    """``(B, C, H, W)`` images in [-1, 1] tiled ``nrow`` per row as uint8 ``(rows, cols, C)``, ``padding``
    pixels of ``pad_value`` apart (an RGB colour makes grey images RGB), each pixel repeated
    ``upscale`` times per axis."""
    if images.ndim != 4 or images.shape[1] not in (1, 3) or len(images) == 0:
        raise UserError(f"an image grid needs a non-empty (B, 1 or 3, H, W) batch, "
                          f"got {tuple(images.shape)}")
    if nrow < 1 or padding < 0 or upscale < 1:
        raise UserError(f"need nrow >= 1, padding >= 0, upscale >= 1; got {nrow}, {padding}, {upscale}")
    colour = _pad_colour(pad_value)
    x = ((images.detach().float().cpu().clamp(-1, 1) + 1.0) * 127.5).round().to(torch.uint8)
    if upscale > 1:
        x = x.repeat_interleave(upscale, dim=2).repeat_interleave(upscale, dim=3)
    if len(colour) == 3 and x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    b, c, h, w = x.shape
    cols, rows = min(nrow, b), math.ceil(b / nrow)
    grid = torch.tensor(colour if len(colour) == c else colour * c, dtype=torch.uint8).view(c, 1, 1)
    grid = grid.expand(c, rows * (h + padding) + padding, cols * (w + padding) + padding).clone()
    for i in range(b):
        top, left = padding + (i // cols) * (h + padding), padding + (i % cols) * (w + padding)
        grid[:, top:top + h, left:left + w] = x[i]
    return grid.permute(1, 2, 0).numpy()


def class_labels(names: Sequence[str]) -> list[str]:
    """Row labels of a class-per-row grid: ``class 3`` for a class named by its index, else its name."""
    return [f"class {i}" if str(name) == str(i) else str(name) for i, name in enumerate(names)]


def _label_column(labels: Sequence[str], height: int, row: int, padding: int,
                  background: tuple[int, ...]) -> np.ndarray:
    """A ``(height, width, 3)`` uint8 strip of ``background`` with ``labels`` right-aligned, one
    centred on each grid row of ``row`` pixels ``padding`` apart (matplotlib draws the text)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rgb = background * 3 if len(background) == 1 else background
    ink = "black" if sum(rgb) / 3 >= 128 else "white"
    dpi, font = 100.0, max(8, min(16, row // 3))          # font size in pixels
    margin = max(3, font // 2)
    fig = Figure(figsize=(1.0, height / dpi), dpi=dpi, facecolor=[v / 255 for v in rgb])
    canvas = FigureCanvasAgg(fig)
    texts = [fig.text(0, (height - padding - i * (row + padding) - row / 2) / dpi,
                      text if len(text) <= 16 else text[:15] + "…", ha="right", va="center",
                      fontsize=font * 72 / dpi, color=ink, transform=fig.dpi_scale_trans)
             for i, text in enumerate(labels)]
    renderer = canvas.get_renderer()
    width = margin * 2 + math.ceil(max(t.get_window_extent(renderer).width for t in texts))
    fig.set_size_inches(width / dpi, height / dpi)
    for t in texts:
        t.set_x((width - margin) / dpi)
    canvas.draw()
    strip = np.asarray(canvas.buffer_rgba())[..., :3]
    out = np.empty((height, width, 3), dtype=np.uint8)
    out[:] = rgb
    h, w = min(height, strip.shape[0]), min(width, strip.shape[1])
    out[:h, :w] = strip[:h, :w]
    return out


def labelled_grid(images: Tensor, row_labels: Sequence[str], nrow: int = 8, padding: int = 1,
                  upscale: int = 1, pad_value: PadValue = 0) -> np.ndarray:
    """:func:`image_grid` with a strip left of it naming each row (``row_labels``, one per row)."""
    grid = image_grid(images, nrow, padding, upscale, pad_value)
    rows = math.ceil(len(images) / nrow)
    if len(row_labels) != rows:
        raise UserError(f"{len(row_labels)} row labels for a grid of {rows} rows")
    colour = _pad_colour(pad_value)
    strip = _label_column(row_labels, grid.shape[0], images.shape[2] * upscale, padding, colour)
    if grid.shape[2] == 1:
        strip = strip.mean(axis=2, keepdims=True).round().astype(np.uint8)
    return np.concatenate([strip, grid], axis=1)


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
                    upscale: int = 1, pad_value: PadValue = 0,
                    row_labels: Sequence[str] | None = None) -> Path:
    """Write :func:`image_grid` of ``images`` to the PNG ``path`` atomically (Pillow, else matplotlib);
    ``row_labels`` (one per row) are written left of the rows."""
    path = Path(path)
    array = image_grid(images, nrow, padding, upscale, pad_value) if row_labels is None else \
        labelled_grid(images, row_labels, nrow, padding, upscale, pad_value)
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp:
        _write_png(array, tmp)
    return path
