"""Evaluation tools. So far: FD-proxy, an offline sample-quality score for image generators.

FD-proxy is the Frechet distance in a small classifier's feature space; it is NOT Inception FID
(see :mod:`siamesenorm.eval.fid_proxy`)::

    train, val = split_images(load_images("digits"))
    proxy = get_proxy(train)                         # trained once (seconds), then from the cache
    scores = sample_quality(proxy, val, samples, labels)   # fd_proxy, class_accuracy, ...
"""

from .fid_proxy import (
           CACHE_ENV,
           ProxyClassifier,
           cache_root,
           get_proxy,
           proxy_cache_key,
           sample_quality,
           train_proxy,
)
from .frechet import feature_statistics, frechet_distance, frechet_distance_from_stats
from .proxy_net import ProxyNet, ProxySettings

__all__ = ["CACHE_ENV", "ProxyClassifier", "ProxyNet", "ProxySettings", "cache_root", "feature_statistics",
           "frechet_distance", "frechet_distance_from_stats", "get_proxy", "proxy_cache_key",
           "sample_quality", "train_proxy"]
