"""Image data: loaders (digits, ImageFolder, .npz), the stratified split, the resumable sampler and
its augmentations, fixed validation batches."""

from __future__ import annotations

import hashlib
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from siamesenorm.data import (
    ImageAugment,
    ImageBatchSampler,
    ImageSet,
    image_validation_batches,
    load_images,
    split_images,
    stratified_split_indices,
    to_model_range,
)
from siamesenorm.data.images.augment import random_erase, translate
from siamesenorm.data.images.imageset import image_fingerprint
from siamesenorm.errors import ConfigError

Image = pytest.importorskip("PIL.Image")


@pytest.fixture(scope="module")
def digits() -> ImageSet:
    pytest.importorskip("sklearn")
    return load_images("digits")


def indexed_set(n: int = 30, classes: int = 3, size: int = 4) -> ImageSet:
    """uint8 images whose every pixel is the image's index: a batch tells which images it holds."""
    images = np.repeat(np.arange(n, dtype=np.uint8), size * size).reshape(n, 1, size, size)
    labels = np.arange(n, dtype=np.int64) % classes
    return ImageSet(images, labels, classes, [str(c) for c in range(classes)],
                    image_fingerprint("test", images, labels, classes))


def indices_of(x: torch.Tensor) -> list[int]:
    return ((x[:, 0, 0, 0] + 1.0) * 127.5).round().long().tolist()


# ---- digits ----------------------------------------------------------------------------------------

def test_digits_are_the_sklearn_set_scaled_to_unit_range(digits):
    from sklearn.datasets import load_digits

    raw = load_digits()
    assert digits.images.shape == (1797, 1, 8, 8) and digits.images.dtype == np.float32
    assert digits.num_classes == 10 and digits.class_names == [str(d) for d in range(10)]
    np.testing.assert_array_equal(digits.images[:, 0] * 16, raw.images)  # exact: values k / 16
    np.testing.assert_array_equal(digits.labels, raw.target)
    meta = digits.meta
    assert meta["source"] == "digits" and meta["count"] == 1797 and meta["shape"] == [1, 8, 8]
    assert meta["sha256"] == hashlib.sha256(np.ascontiguousarray(digits.images).tobytes()).hexdigest()
    assert load_images("digits").fingerprint == digits.fingerprint


def test_digits_without_scikit_learn_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(ConfigError, match=r'pip install "siamesenorm\[vision\]"'):
        load_images("digits")


def test_unknown_option_is_refused_with_the_accepted_ones(tmp_path):
    with pytest.raises(ConfigError, match=r"'digits' has no option 'image_size'"):
        load_images("digits", image_size=8)
    with pytest.raises(ConfigError, match=r"'folder' has no option 'size'.*image_size, channels"):
        load_images(str(tmp_path), size=8)


def test_to_model_range_maps_both_conventions_to_minus_one_one():
    assert to_model_range(np.array([0, 255], dtype=np.uint8)).tolist() == [-1.0, 1.0]
    assert to_model_range(torch.tensor([0.0, 0.5, 1.0])).tolist() == [-1.0, 0.0, 1.0]
    with pytest.raises(ConfigError):
        to_model_range(torch.tensor([1, 2]))


# ---- ImageFolder ------------------------------------------------------------------------------------

def solid(path, colour, size=(6, 10)):
    Image.new("RGB", size, colour).save(path)


def make_folder(root):
    (root / "dog").mkdir(parents=True)
    (root / "cat" / "sub").mkdir(parents=True)
    solid(root / "cat" / "b.png", (0, 0, 255))
    solid(root / "cat" / "a.png", (255, 0, 0))
    solid(root / "cat" / "sub" / "c.png", (0, 255, 0), size=(3, 3))
    solid(root / "dog" / "z.bmp", (10, 20, 30))
    (root / "dog" / "notes.txt").write_text("not an image")
    solid(root / "dog" / ".hidden.png", (1, 1, 1))
    (root / "readme.txt").write_text("top-level files are not classes")


def test_image_folder_reads_classes_and_files_in_sorted_order(tmp_path):
    make_folder(tmp_path)
    rgb = load_images(str(tmp_path), image_size=4, channels=3)
    assert rgb.images.shape == (4, 3, 4, 4) and rgb.images.dtype == np.uint8
    assert rgb.class_names == ["cat", "dog"] and rgb.labels.tolist() == [0, 0, 0, 1]
    # a.png, b.png, sub/c.png, then dog/z.bmp; solid colours survive crop and resize exactly
    expected = [(255, 0, 0), (0, 0, 255), (0, 255, 0), (10, 20, 30)]
    assert [tuple(int(v) for v in img[:, 2, 3]) for img in rgb.images] == expected
    assert (rgb.images == rgb.images[:, :, :1, :1]).all()
    grey = load_images(str(tmp_path), image_size=5, channels=1)
    assert grey.images.shape == (4, 1, 5, 5)
    assert grey.images[0, 0, 0, 0] == Image.new("RGB", (1, 1), (255, 0, 0)).convert("L").getpixel((0, 0))
    assert grey.meta["source"] == "folder" and grey.meta["sha256"] != rgb.meta["sha256"]


def test_image_folder_refusals_name_the_problem(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_images(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="is empty"):
        load_images(str(tmp_path / "empty"))
    flat = tmp_path / "flat"
    flat.mkdir()
    solid(flat / "x.png", (0, 0, 0))
    with pytest.raises(ConfigError, match="no class sub-folders"):
        load_images(str(flat))
    broken = tmp_path / "broken"
    (broken / "a").mkdir(parents=True)
    (broken / "a" / "bad.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(ConfigError, match=r"cannot read image .*bad\.png"):
        load_images(str(broken))
    lonely = tmp_path / "lonely"
    (lonely / "a").mkdir(parents=True)
    (lonely / "a" / "text.txt").write_text("x")
    with pytest.raises(ConfigError, match="holds no image files"):
        load_images(str(lonely))
    make_folder(tmp_path / "ok")
    with pytest.raises(ConfigError, match="channels must be 1"):
        load_images(str(tmp_path / "ok"), channels=2)
    plain = tmp_path / "file.txt"
    plain.write_text("x")
    with pytest.raises(ConfigError, match="not .npz"):
        load_images(str(plain))


# ---- .npz ------------------------------------------------------------------------------------------

def test_npz_layouts_are_read_as_nchw(tmp_path):
    rng = np.random.default_rng(0)
    hw = rng.integers(0, 256, (6, 5, 7), dtype=np.uint8)
    np.savez(tmp_path / "hw.npz", images=hw, labels=np.arange(6) % 2)
    got = load_images(tmp_path / "hw.npz")   # a Path works as well as a str
    assert got.images.shape == (6, 1, 5, 7) and (got.images[:, 0] == hw).all()
    assert got.num_classes == 2 and got.class_names == ["0", "1"]
    hwc = rng.integers(0, 256, (4, 5, 5, 3), dtype=np.uint8)
    np.savez(tmp_path / "hwc.npz", images=hwc, labels=np.array([0, 1, 2, 1]),
             class_names=np.array(["a", "b", "c"]))
    got = load_images(str(tmp_path / "hwc.npz"))
    assert got.images.shape == (4, 3, 5, 5) and got.images[2, 1, 3, 4] == hwc[2, 3, 4, 1]
    assert got.class_names == ["a", "b", "c"]
    chw = rng.random((3, 3, 6, 6)).astype(np.float32)
    np.savez(tmp_path / "chw.npz", images=chw, labels=np.array([0, 0, 1]))
    got = load_images(str(tmp_path / "chw.npz"))
    assert got.images.dtype == np.float32 and np.array_equal(got.images, chw)
    scaled = load_images(str(tmp_path / "chw.npz"), value_range=(-1.0, 3.0))
    np.testing.assert_allclose(scaled.images, (chw + 1.0) / 4.0, rtol=1e-6)
    assert load_images(str(tmp_path / "chw.npz"), num_classes=5).num_classes == 5


def test_npz_refusals(tmp_path):
    def write(name, **arrays):
        np.savez(tmp_path / name, **arrays)
        return str(tmp_path / name)

    good = np.zeros((3, 4, 4), dtype=np.uint8)
    with pytest.raises(ConfigError, match="does not exist"):
        load_images(str(tmp_path / "missing.npz"))
    with pytest.raises(ConfigError, match="lacks the array.*labels"):
        load_images(write("a.npz", images=good))
    with pytest.raises(ConfigError, match="3 images but labels"):
        load_images(write("b.npz", images=good, labels=np.zeros(2, dtype=np.int64)))
    with pytest.raises(ConfigError, match="labels must be integers"):
        load_images(write("c.npz", images=good, labels=np.zeros(3)))
    with pytest.raises(ConfigError, match="rank 5"):
        load_images(write("d.npz", images=np.zeros((3, 1, 4, 4, 1), np.uint8), labels=np.zeros(3, int)))
    with pytest.raises(ConfigError, match="rank 2"):
        load_images(write("e.npz", images=np.zeros((3, 16), np.uint8), labels=np.zeros(3, int)))
    with pytest.raises(ConfigError, match=r"outside \[0, 1\].*value_range"):
        load_images(write("f.npz", images=np.full((3, 4, 4), 2.0), labels=np.zeros(3, int)))
    with pytest.raises(ConfigError, match="uint8 or float"):
        load_images(write("g.npz", images=np.zeros((3, 4, 4), np.int32), labels=np.zeros(3, int)))
    ambiguous = write("h.npz", images=np.zeros((2, 3, 5, 3), np.uint8), labels=np.zeros(2, int))
    with pytest.raises(ConfigError, match="layout="):
        load_images(ambiguous)
    assert load_images(ambiguous, layout="nhwc").images.shape == (2, 3, 3, 5)
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ConfigError, match="cannot read"):
        load_images(str(tmp_path / "junk.npz"))


def test_npz_labels_must_number_the_classes(tmp_path):
    images = np.zeros((4, 4, 4), np.uint8)
    np.savez(tmp_path / "stray.npz", images=images, labels=np.array([0, 1, 2, 10**9]))
    with pytest.raises(ConfigError, match=r"largest label 1000000000 makes 1000000001 classes, more than "
                                          r"the 100000 supported"):
        load_images(str(tmp_path / "stray.npz"))
    np.savez(tmp_path / "sparse.npz", images=images, labels=np.array([0, 5, 5, 0]))
    with pytest.raises(ConfigError, match=r"labels run up to 5 but only 2 of those 6 classes have an image; "
                                          r"number the classes 0..1"):
        load_images(str(tmp_path / "sparse.npz"))
    # Stated on purpose, empty classes are kept; a huge stated count is still refused.
    assert load_images(str(tmp_path / "sparse.npz"), num_classes=6).num_classes == 6
    with pytest.raises(ConfigError, match="num_classes=200000 makes 200000 classes"):
        load_images(str(tmp_path / "sparse.npz"), num_classes=200_000)
    np.savez(tmp_path / "half.npz", images=images, labels=np.array([0, 1, 3, 3]))  # 3 of 4 used: fine
    assert load_images(str(tmp_path / "half.npz")).num_classes == 4


def test_unreadable_image_folders_are_config_errors_naming_the_path(tmp_path, monkeypatch):
    """PermissionError (root in the test machine ignores chmod, so the OS call is made to fail)."""
    make_folder(tmp_path / "set")
    root = tmp_path / "set"
    real_iterdir, real_scandir = Path.iterdir, os.scandir

    def iterdir(self):
        if self == root:
            raise PermissionError(13, "Permission denied", str(self))
        return real_iterdir(self)

    monkeypatch.setattr(Path, "iterdir", iterdir)
    with pytest.raises(ConfigError, match=rf"cannot read {re.escape(str(root))} .*Permission denied"):
        load_images(str(root))
    monkeypatch.setattr(Path, "iterdir", real_iterdir)

    def scandir(path="."):
        if str(path).endswith("sub"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)   # a class's sub-folder cannot be listed
    with pytest.raises(ConfigError, match=r"cannot read .*cat.sub .*Permission denied"):
        load_images(str(root))


# ---- split -----------------------------------------------------------------------------------------

def test_split_is_stratified_disjoint_and_fixed(digits):
    train, val = split_images(digits, val_fraction=0.2, seed=3)
    assert len(train) + len(val) == len(digits)
    for c in range(10):
        n_c = int((digits.labels == c).sum())
        assert int((val.labels == c).sum()) == round(0.2 * n_c)
    t_idx, v_idx = stratified_split_indices(digits.labels, 0.2, seed=3)
    assert not set(t_idx) & set(v_idx) and len(set(t_idx) | set(v_idx)) == len(digits)
    np.testing.assert_array_equal(val.images, digits.images[v_idx])
    again = split_images(digits, val_fraction=0.2, seed=3)[1]
    assert again.meta["sha256"] == val.meta["sha256"]
    other = split_images(digits, val_fraction=0.2, seed=4)[1]
    assert other.meta["sha256"] != val.meta["sha256"]
    assert val.meta["split"]["part"] == "val" and val.meta["split"]["parent_sha256"] == digits.meta["sha256"]
    assert train.fingerprint != digits.fingerprint != val.fingerprint


def test_split_keeps_every_class_in_training_and_refuses_an_empty_validation_set():
    labels = np.array([0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1])   # class 0 has a single image
    train, val = stratified_split_indices(labels, 0.5, seed=0)
    assert 0 in train and len(val) == 5
    with pytest.raises(ConfigError, match="no validation image"):
        stratified_split_indices(np.array([0, 1]), 0.1)
    with pytest.raises(ConfigError, match="val_fraction"):
        stratified_split_indices(labels, 1.0)


# ---- sampler ---------------------------------------------------------------------------------------

def test_sampler_epochs_visit_every_image_once():
    data = indexed_set(n=10)
    sampler = ImageBatchSampler.from_set(data, batch_size=4, seed=0)
    seen = sum((indices_of(sampler.next_batch()[0]) for _ in range(5)), [])   # 20 = two epochs
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))
    assert seen[:10] != seen[10:]  # a new permutation each epoch
    x, y = ImageBatchSampler.from_set(data, batch_size=4, seed=0).next_batch()
    assert x.dtype == torch.float32 and y.dtype == torch.int64 and x.shape == (4, 1, 4, 4)
    assert y.tolist() == [i % 3 for i in indices_of(x)]
    other = ImageBatchSampler.from_set(data, batch_size=10, seed=1).next_batch()[0]
    assert indices_of(other) != seen[:10]


EVERYTHING = ImageAugment(translate=1, hflip=True, erase_prob=0.5, mixup_alpha=0.8, cutmix_alpha=1.0)


@pytest.mark.parametrize("augment", [None, EVERYTHING])
def test_sampler_resumes_the_exact_batch_sequence(augment):
    data = indexed_set(n=13)
    first = ImageBatchSampler.from_set(data, batch_size=5, seed=7, augment=augment)
    for _ in range(4):
        first.next_batch()
    state = first.state_dict()
    saved = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    expected = [first.next_batch() for _ in range(6)]
    for key, value in saved.items():  # the snapshot did not move with later batches
        assert torch.equal(value, state[key]) if isinstance(value, torch.Tensor) else value == state[key]
    second = ImageBatchSampler.from_set(data, batch_size=5, seed=123, augment=augment)
    second.load_state_dict(state)
    for x, y in expected:
        x2, y2 = second.next_batch()
        assert torch.equal(x, x2) and torch.equal(y, y2)
    assert second.batches_drawn == 10
    with pytest.raises(ConfigError, match="batch_size=5"):
        ImageBatchSampler.from_set(data, batch_size=4).load_state_dict(state)


def test_sampler_refuses_bad_inputs():
    images = np.zeros((4, 1, 2, 2), np.uint8)
    with pytest.raises(ConfigError, match="integer"):
        ImageBatchSampler(images, np.zeros(4), 2)
    with pytest.raises(ConfigError, match="N x C x H x W"):
        ImageBatchSampler(np.zeros((4, 2, 2), np.uint8), np.zeros(4, int), 2)
    with pytest.raises(ConfigError, match="batch_size"):
        ImageBatchSampler(images, np.zeros(4, int), 0)


# ---- augmentations ---------------------------------------------------------------------------------

def shifted(img: torch.Tensor, dy: int, dx: int) -> torch.Tensor:
    """out[i, j] = img[i + dy, j + dx], black (-1) outside."""
    _, h, w = img.shape
    out = torch.full_like(img, -1.0)
    for i in range(h):
        for j in range(w):
            if 0 <= i + dy < h and 0 <= j + dx < w:
                out[:, i, j] = img[:, i + dy, j + dx]
    return out


def test_translation_shifts_each_image_by_at_most_pad_pixels():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(24, 2, 5, 5) * 2 - 1
    out = translate(x, 1, g)
    offsets = set()
    for img, res in zip(x, out):
        found = [(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1) if torch.equal(shifted(img, dy, dx), res)]
        assert len(found) == 1
        offsets.add(found[0])
    assert len(offsets) >= 5  # the offsets vary


def test_flip_erase_and_identity():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(32, 1, 6, 6) * 2 - 1
    y = torch.arange(32) % 4
    flipped, same_y = ImageAugment(translate=0, hflip=True, erase_prob=0.0)(x, y, 4, g)
    is_flip = [torch.equal(a, b.flip(-1)) for a, b in zip(flipped, x)]
    is_same = [torch.equal(a, b) for a, b in zip(flipped, x)]
    assert all(f or s for f, s in zip(is_flip, is_same)) and any(is_flip) and any(is_same)
    assert torch.equal(same_y, y)
    assert torch.equal(ImageAugment(translate=0, erase_prob=0.0)(x, y, 4, g)[0], x)
    erased = random_erase(x, 1.0, g)
    for a, b in zip(erased, x):
        rows, cols = torch.nonzero((a != b)[0], as_tuple=True)
        assert len(rows) > 0  # every image erased (the noise never equals the pixel exactly)
        box = (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)
        assert box == len(rows) and box <= 36 / 3 + 6  # one rectangle, about a third at most
        assert a.abs().max() <= 1


def test_mixup_and_cutmix_targets_match_the_mixed_pixels():
    g = torch.Generator().manual_seed(1)
    x = torch.rand(6, 1, 8, 8) * 2 - 1
    y = torch.tensor([0, 1, 2, 3, 4, 5])
    mixed, soft = ImageAugment(translate=0, erase_prob=0.0, mixup_alpha=0.8)(x, y, 6, g)
    lam = soft[0, 0].item()
    assert soft.shape == (6, 6) and torch.allclose(soft.sum(1), torch.ones(6))
    assert torch.allclose(soft[0, 5], torch.tensor(1 - lam)) and 0 < lam < 1
    assert torch.allclose(mixed, lam * x + (1 - lam) * x.flip(0), atol=1e-6)
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        mixed, soft = ImageAugment(translate=0, erase_prob=0.0, cutmix_alpha=1.0)(x, y, 6, g)
        from_partner = (mixed == x.flip(0)) & (mixed != x)
        from_self = mixed == x
        assert (from_partner | from_self).all()
        share = from_partner[0].float().mean().item()
        assert soft[0, 5].item() == pytest.approx(share) and soft[0, 0].item() == pytest.approx(1 - share)
    unmixed = ImageAugment(translate=0, erase_prob=0, mixup_alpha=0.5, mix_prob=0.0, smoothing=0.1)
    smoothed = unmixed(x, y, 6, g)[1]
    assert torch.allclose(smoothed[0], torch.tensor([0.9 + 0.1 / 6] + [0.1 / 6] * 5))


def test_augment_settings_are_checked():
    with pytest.raises(ConfigError):
        ImageAugment(erase_prob=1.5)
    with pytest.raises(ConfigError):
        ImageAugment(translate=-1)
    assert not ImageAugment().mixes and ImageAugment(cutmix_alpha=1.0).mixes
    assert not ImageAugment().hflip  # flips change digits: off by default


# ---- validation batches ----------------------------------------------------------------------------

def test_validation_batches_are_fixed_and_cover_the_set():
    data = indexed_set(n=11)
    batches = image_validation_batches(data, batch_size=4)
    assert [len(x) for x, _ in batches] == [4, 4, 3]
    assert sum((indices_of(x) for x, _ in batches), []) == list(range(11))
    assert batches[0][1].tolist() == [0, 1, 2, 0]
    spread = image_validation_batches(data.images, data.labels, batch_size=2, n_batches=3)
    assert [indices_of(x) for x, _ in spread] == [[0, 1], [3, 5], [7, 9]]
    again = image_validation_batches(data.images, data.labels, batch_size=2, n_batches=3)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(spread, again))
    with pytest.raises(ConfigError, match="fewer than batch_size"):
        image_validation_batches(data, batch_size=20, n_batches=1)
