"""Evaluation tools: FD-proxy, an offline sample-quality score for image generators (NOT Inception FID)."""

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
