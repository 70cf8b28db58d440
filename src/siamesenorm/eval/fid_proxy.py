"""FD-proxy: an offline sample-quality score, the Frechet distance in a small classifier's feature space.

NOT Inception FID: its values compare runs on the same image set, proxy settings and sample counts
only. The trained proxy is cached under :func:`cache_root`; an unreadable entry is retrained.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from ..data.images.imageset import ImageSet, to_model_range
from ..data.images.split import stratified_split_indices
from ..errors import UserError
from ..rundir import replacing
from .frechet import frechet_distance
from .proxy_net import ProxyNet, ProxySettings

__all__ = ["CACHE_ENV", "FORMAT", "ProxyClassifier", "cache_root", "get_proxy", "proxy_cache_key",
           "sample_quality", "train_proxy"]

CACHE_ENV = "SIAMESENORM_CACHE"
FORMAT = 1
_IDENTITY = ("sha256", "labels_sha256", "shape", "dtype", "count", "num_classes")


@dataclass
class ProxyClassifier:
    """A trained FD-proxy classifier (``source``: ``"trained"`` or ``"cache"``). It takes float images in
    [-1, 1], or data in the loaders' convention (an :class:`ImageSet`, numpy, uint8), mapped first."""

    net: ProxyNet
    settings: ProxySettings
    val_accuracy: float
    key: str
    source: str

    @property
    def device(self) -> torch.device:
        return next(self.net.parameters()).device

    def _batches(self, x: Tensor | ImageSet, batch_size: int):
        if isinstance(x, ImageSet):
            images = to_model_range(x.images)
        elif isinstance(x, np.ndarray) or (isinstance(x, Tensor) and x.dtype == torch.uint8):
            images = to_model_range(x)          # the data convention: uint8 0..255, float 0..1
        else:
            images = torch.as_tensor(x)         # float tensors: already in [-1, 1]
        if images.ndim != 4 or images.shape[1:] != (self.net.in_chans, self.net.image_size,
                                                    self.net.image_size):
            raise UserError(f"the FD-proxy classifier takes ({self.net.in_chans}, {self.net.image_size}, "
                              f"{self.net.image_size}) images, got {tuple(images.shape)}")
        self.net.eval()
        for part in images.split(batch_size):
            yield part.to(self.device, torch.float32)

    @torch.no_grad()
    def features(self, x: Tensor | ImageSet, batch_size: int = 512) -> Tensor:
        """Pooled features ``(B, feature_dim)``, float32 on the CPU."""
        return torch.cat([self.net.features(b).float().cpu() for b in self._batches(x, batch_size)])

    @torch.no_grad()
    def predict(self, x: Tensor | ImageSet, batch_size: int = 512) -> Tensor:
        """Predicted classes ``(B,)``, int64 on the CPU."""
        return torch.cat([self.net(b).argmax(dim=1).cpu() for b in self._batches(x, batch_size)])


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir``, else ``$SIAMESENORM_CACHE``, else ``~/.cache/siamesenorm``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "siamesenorm"


def proxy_cache_key(train: ImageSet, settings: ProxySettings) -> str:
    """A hex digest of the training set's fingerprint and the settings (and this file's format)."""
    if any(train.meta.get(k) is None for k in _IDENTITY):
        raise UserError("the FD-proxy needs an ImageSet with a fingerprint (sha256, labels_sha256, ...); "
                          "load it with load_images")
    blob = json.dumps({"format": FORMAT, "data": {k: train.meta[k] for k in _IDENTITY},
                       "settings": settings.to_dict()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _fit(net: nn.Module, optimizer, schedule, x: Tensor, y: Tensor, fit: Tensor,
         order: torch.Generator, settings: ProxySettings) -> None:
    for _ in range(settings.epochs):
        for batch in fit[torch.randperm(len(fit), generator=order)].split(settings.batch_size):
            batch = batch.to(x.device)
            loss = F.cross_entropy(net(x[batch]), y[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()


def train_proxy(train: ImageSet, settings: ProxySettings | None = None, *,
                device: str | torch.device = "cpu", key: str = "") -> ProxyClassifier:
    """Train a :class:`ProxyNet` on ``train``, deterministically: the seed fixes the initialisation (made on
    the CPU) and the batch order on every device."""
    settings = settings or ProxySettings()
    c, h, w = train.shape
    if h != w:
        raise UserError(f"the FD-proxy classifier takes square images, got {h}x{w}")
    fit_idx, val_idx = stratified_split_indices(train.labels, settings.val_fraction, settings.seed)
    device = torch.device(device)
    x = to_model_range(train.images).to(device)
    y = torch.from_numpy(np.asarray(train.labels, dtype=np.int64)).to(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        net = ProxyNet(c, h, train.num_classes, settings.width)
    net.to(device).train()
    order = torch.Generator().manual_seed(settings.seed)
    optimizer = torch.optim.AdamW(net.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    per_epoch = math.ceil(len(fit_idx) / settings.batch_size)
    total = settings.epochs * per_epoch
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / total)))
    fit = torch.from_numpy(fit_idx)
    with torch.enable_grad():  # callers may sit inside no_grad (e.g. a training run's evaluation)
        _fit(net, optimizer, schedule, x, y, fit, order, settings)
    proxy = ProxyClassifier(net.eval(), settings, 0.0, key, "trained")
    val = torch.from_numpy(val_idx).to(device)
    proxy.val_accuracy = float((proxy.predict(x[val]) == y[val].cpu()).double().mean())
    return proxy


def _save(proxy: ProxyClassifier, path: Path, train: ImageSet) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": str(FORMAT), "key": proxy.key, "settings": json.dumps(proxy.settings.to_dict()),
            "val_accuracy": repr(proxy.val_accuracy), "in_chans": str(proxy.net.in_chans),
            "image_size": str(proxy.net.image_size), "num_classes": str(proxy.net.num_classes),
            "data": json.dumps({k: train.meta[k] for k in _IDENTITY}),
            "note": "FD-proxy classifier (not Inception); see siamesenorm.eval.fid_proxy"}
    state = {k: v.detach().cpu().contiguous() for k, v in proxy.net.state_dict().items()}
    with replacing(path) as tmp:
        save_file(state, str(tmp), metadata=meta)


def _load(path: Path, key: str, settings: ProxySettings, device: torch.device) -> ProxyClassifier:
    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata() or {}
    if meta.get("key") != key or meta.get("format") != str(FORMAT):
        raise ValueError(f"cache entry {path} belongs to another key or format")
    net = ProxyNet(int(meta["in_chans"]), int(meta["image_size"]), int(meta["num_classes"]), settings.width)
    net.load_state_dict(load_file(str(path)))
    return ProxyClassifier(net.to(device).eval(), settings, float(meta["val_accuracy"]), key, "cache")


def get_proxy(imageset_train: ImageSet, cache_dir: str | Path | None = None, *,
              settings: ProxySettings | None = None, device: str | torch.device = "cpu") -> ProxyClassifier:
    """The FD-proxy classifier of ``imageset_train`` (the generator's training split), from the cache or
    trained and cached; the key never depends on ``device``."""
    settings = settings or ProxySettings()
    key = proxy_cache_key(imageset_train, settings)
    path = cache_root(cache_dir) / "fd_proxy" / f"{key}.safetensors"
    if path.exists():
        try:
            return _load(path, key, settings, torch.device(device))
        except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as error:
            print(f"warning: FD-proxy cache entry {path} is unreadable ({error}); retraining it",
                  file=sys.stderr, flush=True)
    proxy = train_proxy(imageset_train, settings, device=device, key=key)
    try:
        _save(proxy, path, imageset_train)
    except OSError as error:
        print(f"warning: cannot write the FD-proxy cache {path} ({error}); it will be retrained next "
              f"time (set {CACHE_ENV} to a writable folder)", file=sys.stderr, flush=True)
    return proxy


def sample_quality(proxy: ProxyClassifier, real: Tensor | ImageSet, generated: Tensor,
                   labels: Tensor | np.ndarray) -> dict[str, Any]:
    """FD-proxy and class accuracy of class-conditional samples ``generated`` ``(B, C, H, W)`` in [-1, 1].

    ``real``: reference images (an :class:`ImageSet` or a tensor in [-1, 1]). Returns ``fd_proxy``
    (lower is better), ``class_accuracy``, ``proxy_val_accuracy`` (the proxy's own held-out accuracy, a
    ceiling on what class accuracy can mean), ``n_real`` and ``n_generated``.
    """
    labels = torch.as_tensor(labels).long().cpu()
    if labels.shape != (len(generated),):
        raise UserError(f"{len(generated)} generated images but labels of shape {tuple(labels.shape)}")
    generated_features = proxy.features(generated)
    real_features = proxy.features(real)
    accuracy = float((proxy.predict(generated) == labels).double().mean())
    return {"fd_proxy": frechet_distance(real_features, generated_features), "class_accuracy": accuracy,
            "proxy_val_accuracy": proxy.val_accuracy, "n_real": len(real_features),
            "n_generated": len(generated_features)}
