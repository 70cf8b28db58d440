"""Loading image sets: ``load_images(spec, **options)``, ``spec`` ``digits``, an ImageFolder directory
or an ``.npz`` file (options: docs/tasks.md). Nothing downloads; bad input is one UserError line."""

from __future__ import annotations

import importlib
import inspect
import os
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from ...errors import UserError
from .imageset import ImageSet, image_fingerprint

__all__ = ["IMAGE_SUFFIXES", "MAX_CLASSES", "check_image_options", "load_digits_set", "load_image_folder",
           "load_images", "load_npz_images"]

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm",
                            ".pgm", ".pbm"})
_VISION = 'pip install "siamesenorm[vision]"'
# The most classes an image set may have (ImageNet-21k has 21,841): a label beyond this is a mistake.
MAX_CLASSES = 100_000


def _import(module: str, what: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"{what} needs {module.split('.')[0]}: {_VISION}") from None


# ---- digits ------------------------------------------------------------------------------------

def load_digits_set() -> ImageSet:
    """scikit-learn's 1,797 grey 8x8 digits (values 0..16) as float32 ``value / 16``, 10 classes."""
    datasets = _import("sklearn.datasets", "the digits image set")
    bunch = datasets.load_digits()
    images = (np.asarray(bunch.images, dtype=np.float32) / 16.0)[:, None]   # exact: k / 16
    labels = np.asarray(bunch.target, dtype=np.int64)
    meta = image_fingerprint("digits", images, labels, 10)
    return ImageSet(np.ascontiguousarray(images), labels, 10, [str(d) for d in range(10)], meta)


# ---- ImageFolder -------------------------------------------------------------------------------

def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def _unreadable(path: Path, error: OSError) -> UserError:
    reason = error.strerror or type(error).__name__
    return UserError(f"cannot read {path} while reading an image folder: {reason}; make the folder "
                       "and everything under it readable")


def _folder_entries(root: Path) -> list[Path]:
    try:
        return [p for p in root.iterdir() if not p.name.startswith(".")]
    except OSError as error:
        raise _unreadable(root, error) from None


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError as error:
        raise _unreadable(path, error) from None


def _raise_unreadable(error: OSError) -> NoReturn:
    raise _unreadable(Path(error.filename or "?"), error)


def _class_files(folder: Path) -> list[Path]:
    """Image files under ``folder``, recursively, sorted by path; symlinked folders are not entered."""
    files = []
    for top, _, names in os.walk(folder, onerror=_raise_unreadable):
        files += [Path(top) / n for n in names if Path(n).suffix.lower() in IMAGE_SUFFIXES]
    files = [p for p in files if not _hidden(p, folder) and _is_file(p)]
    return sorted(files, key=lambda p: p.relative_to(folder).as_posix())


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError as error:
        raise _unreadable(path, error) from None


def _read_image(image_module: Any, path: Path, mode: str, size: int) -> np.ndarray:
    """One file as ``(H, W)`` or ``(H, W, 3)`` uint8: centre square crop, bicubic resize. An image over
    Pillow's ``MAX_IMAGE_PIXELS`` is refused before it is decoded."""
    resample = getattr(image_module, "Resampling", image_module).BICUBIC
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", image_module.DecompressionBombWarning)
            return _decoded(image_module, path, mode, size, resample)
    except (image_module.DecompressionBombError, image_module.DecompressionBombWarning) as error:
        raise UserError(f"image {path} is too large to read safely: {str(error).rstrip('.')}; "
                          "shrink it or remove it from the folder") from None
    except (OSError, ValueError, SyntaxError) as error:
        raise UserError(f"cannot read image {path}: {error}; remove or replace the file") from None


def _decoded(image_module: Any, path: Path, mode: str, size: int, resample: Any) -> np.ndarray:
    with image_module.open(path) as img:
        img = img.convert(mode)
        w, h = img.size
        side = min(w, h)
        left, top = (w - side) // 2, (h - side) // 2
        img = img.crop((left, top, left + side, top + side))
        if side != size:
            img = img.resize((size, size), resample)
        return np.asarray(img, dtype=np.uint8)


def load_image_folder(spec: str, *, image_size: int = 32, channels: int = 3) -> ImageSet:
    """An ImageFolder tree ``spec/<class>/**/<image>`` as uint8 ``(N, channels, size, size)``; classes are
    the non-hidden sub-folders in sorted name order."""
    if channels not in (1, 3):
        raise UserError(f"channels must be 1 (grey) or 3 (RGB), got {channels}")
    if not isinstance(image_size, int) or image_size < 1:
        raise UserError(f"image_size must be a positive integer, got {image_size!r}")
    root = Path(spec).expanduser()
    try:
        exists, is_dir = root.exists(), root.is_dir()
    except OSError as error:
        raise _unreadable(root, error) from None
    if not exists:
        raise UserError(f"image set {root} does not exist; give digits, an ImageFolder directory or "
                          "an .npz file")
    if not is_dir:
        raise UserError(f"image set {root} is a file but not .npz; give digits, an ImageFolder "
                          "directory or an .npz file")
    entries = _folder_entries(root)
    if not entries:
        raise UserError(f"image folder {root} is empty; put one sub-folder of images per class in it")
    classes = sorted((p for p in entries if _is_dir(p)), key=lambda p: p.name)
    if not classes:
        raise UserError(f"image folder {root} has no class sub-folders; put each class's images in a "
                          "sub-folder named after the class")
    pil = _import("PIL.Image", "reading an image folder")
    mode = "L" if channels == 1 else "RGB"
    images: list[np.ndarray] = []
    labels: list[int] = []
    for index, folder in enumerate(classes):
        files = _class_files(folder)
        if not files:
            raise UserError(f"class folder {folder} holds no image files "
                              f"({', '.join(sorted(IMAGE_SUFFIXES))}); remove it or add images")
        images += [_read_image(pil, f, mode, image_size) for f in files]
        labels += [index] * len(files)
    array = np.stack(images)
    array = array[:, None] if channels == 1 else array.transpose(0, 3, 1, 2)
    array = np.ascontiguousarray(array)
    label_array = np.asarray(labels, dtype=np.int64)
    meta = image_fingerprint("folder", array, label_array, len(classes))
    meta.update(path=str(root), image_size=image_size, channels=channels)
    return ImageSet(array, label_array, len(classes), [c.name for c in classes], meta)


# ---- .npz --------------------------------------------------------------------------------------

def _channel_layout(shape: tuple[int, ...], layout: str | None, name: str) -> str:
    if layout is not None:
        if layout not in ("nchw", "nhwc"):
            raise UserError(f"layout must be 'nchw' or 'nhwc', got {layout!r}")
        return layout
    first, last = shape[1] in (1, 3, 4), shape[3] in (1, 3, 4)
    if first and not last:
        return "nchw"
    if last and not first:
        return "nhwc"
    if first and last and shape[2] != shape[3] and shape[1] == shape[2]:
        return "nhwc"
    if first and last and shape[1] != shape[2] and shape[2] == shape[3]:
        return "nchw"
    raise UserError(f"{name}: cannot tell the channel axis of images {shape}; pass layout='nchw' or "
                      "'nhwc' (channels must be 1, 3 or 4)")


def _pixels(images: np.ndarray, value_range: tuple[float, float] | None, name: str) -> np.ndarray:
    """uint8 as is; float rescaled from ``value_range`` (default (0, 1)) to float32 [0, 1]."""
    if images.dtype == np.uint8:
        if value_range is not None:
            raise UserError(f"{name}: value_range applies to float images; uint8 images are 0..255")
        return images
    if not np.issubdtype(images.dtype, np.floating):
        raise UserError(f"{name}: images must be uint8 or float, got {images.dtype}; convert them")
    if not np.isfinite(images).all():
        raise UserError(f"{name}: images hold NaN or infinite values")
    lo, hi = (0.0, 1.0) if value_range is None else (float(value_range[0]), float(value_range[1]))
    if not hi > lo:
        raise UserError(f"value_range must be (low, high) with high > low, got {value_range}")
    if images.size and (images.min() < lo or images.max() > hi):
        raise UserError(f"{name}: float pixels span {images.min():g}..{images.max():g}, outside "
                          f"[{lo:g}, {hi:g}]; pass value_range=(low, high)")
    return ((images.astype(np.float64) - lo) / (hi - lo)).astype(np.float32)


def _check_class_count(labels: np.ndarray, k: int, path: Path, *, inferred: bool) -> None:
    """Refuse more than :data:`MAX_CLASSES` classes, and inferred labels ``0..max`` that leave most classes
    without an image."""
    if k > MAX_CLASSES:
        source = f"its largest label {int(labels.max())}" if inferred else f"num_classes={k}"
        raise UserError(f"{path}: {source} makes {k} classes, more than the {MAX_CLASSES} supported; "
                          "number the classes 0..K-1")
    used = len(np.unique(labels))
    if inferred and 2 * used < k:
        raise UserError(f"{path}: labels run up to {int(labels.max())} but only {used} of those {k} "
                          f"classes have an image; number the classes 0..{used - 1} (or pass "
                          f"num_classes={k} if the empty classes are meant)")


def load_npz_images(spec: str, *, value_range: tuple[float, float] | None = None, layout: str | None = None,
                    num_classes: int | None = None) -> ImageSet:
    """Arrays ``images`` and ``labels`` (and optional ``class_names``) of an ``.npz`` file."""
    path = Path(spec).expanduser()
    if not path.is_file():
        raise UserError(f"image file {path} does not exist")
    try:
        with np.load(path, allow_pickle=False) as data:
            missing = [k for k in ("images", "labels") if k not in data.files]
            if missing:
                raise UserError(f"{path} lacks the array(s) {', '.join(missing)}; an image .npz holds "
                                  f"'images' and 'labels' (it has {', '.join(data.files) or 'none'})")
            images, labels = data["images"], data["labels"]
            names = data["class_names"] if "class_names" in data.files else None
    except (OSError, ValueError, zipfile.BadZipFile) as error:
        raise UserError(f"cannot read {path} as .npz: {error}") from None
    if images.ndim == 3:
        images = images[:, None]
    elif images.ndim == 4:
        if _channel_layout(images.shape, layout, str(path)) == "nhwc":
            images = images.transpose(0, 3, 1, 2)
    else:
        raise UserError(f"{path}: images must be N,H,W or N,H,W,C or N,C,H,W, got rank {images.ndim} "
                          f"{images.shape}")
    if labels.ndim != 1 or len(labels) != len(images):
        raise UserError(f"{path}: {len(images)} images but labels of shape {labels.shape}; give one "
                          "label per image")
    if not np.issubdtype(labels.dtype, np.integer):
        raise UserError(f"{path}: labels must be integers, got {labels.dtype}")
    labels = labels.astype(np.int64)
    if len(labels) == 0:
        raise UserError(f"{path} holds no images")
    if labels.min() < 0:
        raise UserError(f"{path}: labels must be non-negative, got {labels.min()}")
    pixels = np.ascontiguousarray(_pixels(images, value_range, str(path)))
    k = int(labels.max()) + 1 if num_classes is None else int(num_classes)
    if k <= labels.max():
        raise UserError(f"num_classes={k} but {path} has label {labels.max()}")
    _check_class_count(labels, k, path, inferred=num_classes is None)
    class_names = [str(n) for n in names.tolist()] if names is not None else [str(i) for i in range(k)]
    if len(class_names) != k:
        raise UserError(f"{path}: {len(class_names)} class_names for {k} classes")
    meta = image_fingerprint("npz", pixels, labels, k)
    meta.update(path=str(path), value_range=None if value_range is None else list(value_range), layout=layout)
    return ImageSet(pixels, labels, k, class_names, meta)


def _loader(spec: str) -> tuple[Callable[..., ImageSet], bool]:
    if spec == "digits":
        return load_digits_set, False
    path = Path(spec).expanduser()
    if path.suffix.lower() == ".npz":
        return load_npz_images, True
    return load_image_folder, True


def check_image_options(spec: str | Path, options: dict) -> tuple[Callable[..., ImageSet], bool]:
    """Refuse an option the loader of ``spec`` does not take; returns the loader."""
    spec = str(spec) if isinstance(spec, Path) else spec
    if not isinstance(spec, str) or not spec:
        raise UserError(f"image set must be a non-empty string, got {spec!r}")
    loader, takes_spec = _loader(spec)
    accepted = [n for n, p in inspect.signature(loader).parameters.items() if p.kind is p.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        kind = "digits" if spec == "digits" else ("npz" if spec.lower().endswith(".npz") else "folder")
        raise UserError(f"image set {kind!r} has no option {', '.join(map(repr, unknown))}; its options: "
                          f"{', '.join(accepted) or 'none'}")
    return loader, takes_spec


def load_images(spec: str | Path, **options: Any) -> ImageSet:
    """Load the image set ``spec`` names (``digits``, a folder, an ``.npz`` file) with its options."""
    loader, takes_spec = check_image_options(spec, options)
    return loader(str(spec), **options) if takes_spec else loader(**options)
