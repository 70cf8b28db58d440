"""Device selection: the error names the setting the way the user wrote it."""

from __future__ import annotations

import pytest
import torch

from siamesenorm.devices import resolve_device
from siamesenorm.errors import ConfigError


def test_cpu_and_auto_resolve():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_an_unknown_device_names_the_setting():
    with pytest.raises(ConfigError, match=r"^train.device='tpu9': unknown device; use auto, cpu or cuda$"):
        resolve_device("tpu9")
    with pytest.raises(ConfigError, match=r"^--device 'tpu9': unknown device"):
        resolve_device("tpu9", "--device")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_an_absent_cuda_says_how_to_fix_it_in_the_users_words():
    with pytest.raises(ConfigError, match=r"^train.device=cuda but no CUDA device .*; use train.device=cpu$"):
        resolve_device("cuda")
    with pytest.raises(ConfigError, match=r"^--device cuda but no CUDA device .*; use --device cpu$"):
        resolve_device("cuda", "--device")
