"""FD-proxy: the Frechet distance against closed forms, and the small classifier it uses (trained on
digits, cached, reloaded without training)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from siamesenorm.data import load_images, split_images
from siamesenorm.errors import ConfigError
from siamesenorm.eval import (
    CACHE_ENV,
    ProxyNet,
    ProxySettings,
    cache_root,
    feature_statistics,
    frechet_distance,
    get_proxy,
    proxy_cache_key,
    sample_quality,
)
from siamesenorm.eval import fid_proxy as fid_proxy_module

# ---- Frechet distance ---------------------------------------------------------------------------


def gaussian_features(n: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=g, dtype=torch.float64)
    return torch.randn(n, d, generator=g, dtype=torch.float64) @ mix + torch.randn(d, generator=g,
                                                                                    dtype=torch.float64)


def test_distance_to_itself_is_zero_and_to_a_shift_is_the_squared_shift():
    a = gaussian_features(500, 6, seed=0)
    assert frechet_distance(a, a) == pytest.approx(0.0, abs=1e-8)
    shift = torch.tensor([0.5, -1.0, 2.0, 0.0, 0.25, 3.0], dtype=torch.float64)
    assert frechet_distance(a, a + shift) == pytest.approx(float((shift**2).sum()), rel=1e-8)
    noise = torch.randn(500, 6, generator=torch.Generator().manual_seed(9), dtype=torch.float64) * 5
    assert frechet_distance(a, noise) > 10 * frechet_distance(a, gaussian_features(500, 6, seed=0)[::2])
    b = gaussian_features(400, 6, seed=1)
    assert frechet_distance(a, b) == pytest.approx(frechet_distance(b, a), rel=1e-8)


def test_two_small_gaussians_with_diagonal_covariances_by_hand():
    # four points (mu +- a e1, mu +- b e2): mean mu, unbiased covariance diag(2a^2/3, 2b^2/3)
    def cross(mu, a, b):
        return np.array([[mu[0] + a, mu[1]], [mu[0] - a, mu[1]], [mu[0], mu[1] + b], [mu[0], mu[1] - b]])

    set_a, set_b = cross((1.0, 2.0), 3.0, 1.5), cross((-0.5, 2.5), 1.2, 0.6)
    var_a, var_b = np.array([6.0, 1.5]), np.array([0.96, 0.24])     # 2 a^2 / 3, 2 b^2 / 3
    mean, cov = feature_statistics(set_a)
    assert mean.tolist() == [1.0, 2.0] and np.allclose(cov.numpy(), np.diag(var_a))
    by_hand = (1.5**2 + 0.5**2) + ((np.sqrt(var_a) - np.sqrt(var_b)) ** 2).sum()
    assert frechet_distance(set_a, set_b) == pytest.approx(by_hand, rel=1e-10)


def test_full_covariances_match_scipy_sqrtm():
    linalg = pytest.importorskip("scipy.linalg")
    a, b = gaussian_features(300, 5, seed=2), gaussian_features(250, 5, seed=3)
    mu_a, cov_a = a.mean(0).numpy(), np.cov(a.numpy(), rowvar=False)
    mu_b, cov_b = b.mean(0).numpy(), np.cov(b.numpy(), rowvar=False)
    root = linalg.sqrtm(cov_a @ cov_b).real
    want = ((mu_a - mu_b) ** 2).sum() + np.trace(cov_a) + np.trace(cov_b) - 2 * np.trace(root)
    assert frechet_distance(a, b) == pytest.approx(want, rel=1e-8)


def test_rank_deficient_features_and_bad_inputs():
    a = gaussian_features(3, 8, seed=4)          # 3 samples in 8 dimensions: singular covariance
    assert frechet_distance(a, a) == pytest.approx(0.0, abs=1e-6)
    assert math.isfinite(frechet_distance(a, gaussian_features(4, 8, seed=5)))
    with pytest.raises(ConfigError, match="N >= 2"):
        frechet_distance(a[:1], a)
    with pytest.raises(ConfigError, match="different widths"):
        frechet_distance(a, a[:, :4])
    with pytest.raises(ConfigError, match="NaN"):
        frechet_distance(a * float("nan"), a)


# ---- the proxy classifier -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def digits_split():
    pytest.importorskip("sklearn")
    return split_images(load_images("digits"), val_fraction=0.1, seed=0)


@pytest.fixture(scope="module")
def cached(digits_split, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return get_proxy(digits_split[0], cache_dir=cache), cache


def test_proxy_classifies_digits_and_reloads_from_the_cache_without_training(cached, digits_split,
                                                                               monkeypatch):
    proxy, cache = cached
    train, val = digits_split
    assert proxy.source == "trained" and proxy.val_accuracy > 0.9
    accuracy = (proxy.predict(val) == torch.from_numpy(val.labels)).double().mean().item()
    assert accuracy > 0.9   # on the outer validation split, never seen by the proxy either
    files = list((cache / "fd_proxy").iterdir())
    assert [f.name for f in files] == [f"{proxy_cache_key(train, ProxySettings())}.safetensors"]

    def no_training(*args, **kwargs):
        raise AssertionError("the proxy was trained again")

    monkeypatch.setattr(fid_proxy_module, "train_proxy", no_training)
    again = get_proxy(train, cache_dir=cache)
    assert again.source == "cache" and again.val_accuracy == proxy.val_accuracy
    assert torch.equal(again.features(val), proxy.features(val))


CHEAP = ProxySettings(width=4, epochs=1)


def test_training_is_deterministic_and_leaves_the_global_rng(digits_split):
    before = torch.get_rng_state()
    first = fid_proxy_module.train_proxy(digits_split[0], CHEAP)
    assert torch.equal(torch.get_rng_state(), before)
    second = fid_proxy_module.train_proxy(digits_split[0], CHEAP)
    other_seed = fid_proxy_module.train_proxy(digits_split[0], ProxySettings(width=4, epochs=1, seed=1))
    for (name, p), q in zip(first.net.state_dict().items(), second.net.state_dict().values()):
        assert torch.equal(p, q), name
    assert not torch.equal(first.net.head.weight, other_seed.net.head.weight)


def test_cache_key_follows_data_and_settings_and_the_env_names_the_folder(cached, digits_split, tmp_path,
                                                                          monkeypatch):
    train, val = digits_split
    key = proxy_cache_key(train, ProxySettings())
    assert key != proxy_cache_key(val, ProxySettings()) != proxy_cache_key(train, ProxySettings(width=8))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "env-cache"))
    assert cache_root() == tmp_path / "env-cache" and cache_root(tmp_path / "x") == tmp_path / "x"
    monkeypatch.delenv(CACHE_ENV)
    assert cache_root().parts[-2:] == (".cache", "siamesenorm")


def test_an_unreadable_cache_entry_is_retrained(digits_split, tmp_path, capsys):
    train = digits_split[0]
    path = tmp_path / "fd_proxy" / f"{proxy_cache_key(train, CHEAP)}.safetensors"
    path.parent.mkdir()
    path.write_bytes(b"broken")
    rebuilt = get_proxy(train, cache_dir=tmp_path, settings=CHEAP)
    assert rebuilt.source == "trained" and "unreadable" in capsys.readouterr().err
    assert get_proxy(train, cache_dir=tmp_path, settings=CHEAP).source == "cache"
    assert [p.name for p in path.parent.iterdir()] == [path.name]   # no temporary file left behind
    (tmp_path / "a-file").write_text("not a folder")
    unwritable = get_proxy(train, cache_dir=tmp_path / "a-file", settings=CHEAP)
    assert unwritable.source == "trained" and "cannot write the FD-proxy cache" in capsys.readouterr().err


def test_sample_quality_separates_real_images_from_noise(cached, digits_split):
    proxy, _ = cached
    train, val = digits_split
    real = torch.from_numpy(val.images) * 2 - 1
    labels = torch.from_numpy(val.labels)
    held = torch.from_numpy(train.images[:400]) * 2 - 1
    good = sample_quality(proxy, val, held, torch.from_numpy(train.labels[:400]))
    g = torch.Generator().manual_seed(0)
    noise = torch.rand(real.shape, generator=g) * 2 - 1
    bad = sample_quality(proxy, val, noise, labels)
    assert good["class_accuracy"] > 0.9 and bad["class_accuracy"] < 0.4
    assert bad["fd_proxy"] > 20 * good["fd_proxy"]
    assert good["proxy_val_accuracy"] == proxy.val_accuracy and good["n_real"] == len(val)
    assert sample_quality(proxy, real, real, labels)["fd_proxy"] == pytest.approx(0.0, abs=1e-5)
    assert torch.equal(proxy.features(real), proxy.features(val))            # [-1, 1] tensor == ImageSet
    assert torch.equal(proxy.features(val.images), proxy.features(val))      # numpy: data convention
    with pytest.raises(ConfigError, match="labels of shape"):
        sample_quality(proxy, val, noise, labels[:3])
    with pytest.raises(ConfigError, match=r"takes \(1, 8, 8\) images"):
        proxy.features(torch.zeros(2, 3, 8, 8))


def test_proxy_net_scales_to_larger_images():
    for size, stages in [(8, 2), (16, 3), (32, 4), (64, 5)]:
        net = ProxyNet(3, size, 10, width=4)
        convs = [m for m in net.modules() if isinstance(m, torch.nn.Conv2d)]
        assert len(convs) == 2 * stages - 1
        assert net(torch.zeros(2, 3, size, size)).shape == (2, 10)
        assert net.body(torch.zeros(1, 3, size, size)).shape[-1] <= 4
    with pytest.raises(ConfigError):
        ProxyNet(1, 8, 1)
    with pytest.raises(ConfigError):
        ProxySettings(epochs=0)
