"""Value checks shared by the vision model configurations (ViTConfig, DiTConfig).

Each raises :class:`ConfigError` with one line naming the field (``ViTConfig.dim``), what is wrong
and the accepted values.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..nn.norms import NORM_KINDS


def positive_int(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{owner}.{name} must be a positive integer, got {value!r}")


def positive_number(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{owner}.{name} must be a positive number, got {value!r}")


def probability(owner: str, name: str, value: Any) -> None:
    """A rate in ``[0, 1)`` (dropout, drop-path, label smoothing)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ConfigError(f"{owner}.{name} must be in [0, 1), got {value!r}")


def boolean(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{owner}.{name} must be true or false, got {value!r}")


def divisible(owner: str, name: str, value: int, by_name: str, by: int) -> None:
    if value % by:
        raise ConfigError(f"{owner}.{name} ({value}) must be divisible by {by_name} ({by})")


def mlp_hidden(owner: str, dim: int, mlp_ratio: float) -> None:
    if int(dim * mlp_ratio) < 1:
        raise ConfigError(f"{owner}.mlp_ratio={mlp_ratio!r} gives an empty MLP (int(dim * mlp_ratio) "
                          f"= {int(dim * mlp_ratio)}); raise mlp_ratio")


def norm_and_scheme(owner: str, norm: Any, scheme: Any, scheme_options: Any) -> None:
    """The norm kind, and the scheme's name and options (their values are checked when built)."""
    if norm not in NORM_KINDS:
        raise ConfigError(f"{owner}.norm: unknown value {norm!r}; choose one of {', '.join(NORM_KINDS)}")
    if not isinstance(scheme, str) or not scheme:
        raise ConfigError(f"{owner}.scheme must be a scheme name, got {scheme!r}")
    if not isinstance(scheme_options, dict):
        raise ConfigError(f"{owner}.scheme_options must be a mapping of option names to values, "
                          f"got {scheme_options!r}")


def size_preset(owner: str, sizes: dict[str, dict[str, Any]], size: str) -> dict[str, Any]:
    """The fields of the named size, or a ConfigError listing the sizes."""
    try:
        return dict(sizes[size])
    except KeyError:
        raise ConfigError(f"{owner}: unknown size {size!r}; choose one of {', '.join(sizes)}") from None
