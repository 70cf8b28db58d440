"""Value checks shared by the model configurations (LMConfig, ViTConfig, DiTConfig).

Each is called as ``check(owner, name, value)`` and raises :class:`UserError` with one line naming
``owner.name`` (``LMConfig.dim``, ``model.rope_theta``), what is wrong and the accepted values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import UserError
from ..schemes.base import is_finite, resolve_scheme, trusted_scheme

Check = Callable[[str, str, Any], None]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and is_finite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(owner: str, name: str, value: Any) -> None:
    if not _is_int(value) or value <= 0:
        raise UserError(f"{owner}.{name} must be a positive integer, got {value!r}")


def positive_int_or_null(owner: str, name: str, value: Any) -> None:
    if value is not None and (not _is_int(value) or value <= 0):
        raise UserError(f"{owner}.{name} must be a positive integer or null, got {value!r}")


@dataclass(frozen=True)
class Count:
    """0 (meaning ``zero``) or a positive integer."""

    zero: str

    def __call__(self, owner: str, name: str, value: Any) -> None:
        if not _is_int(value) or value < 0:
            raise UserError(f"{owner}.{name} must be 0 ({self.zero}) or a positive integer, got {value!r}")


def positive_number(owner: str, name: str, value: Any) -> None:
    if not _is_number(value) or not value > 0:
        raise UserError(f"{owner}.{name} must be a positive finite number, got {value!r}")


@dataclass(frozen=True)
class Bounded:
    """A finite number above ``low`` (or at it, unless ``low_open``) and at most ``high``; ``what``
    says what the bound protects."""

    low: float
    high: float
    low_open: bool = True
    what: str = ""

    def __call__(self, owner: str, name: str, value: Any) -> None:
        low, high = self.low, self.high
        if not _is_number(value) or not (low < value if self.low_open else low <= value) \
                or not value <= high:
            above = f"{'>' if self.low_open else '>='} {low:g}"
            raise UserError(f"{owner}.{name} must be a finite number {above} and at most {high:g}"
                            f"{self.what}, got {value!r}")


def probability(owner: str, name: str, value: Any) -> None:
    """A rate in ``[0, 1)`` (dropout, drop-path, label smoothing)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise UserError(f"{owner}.{name} must be in [0, 1), got {value!r}")


def boolean(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise UserError(f"{owner}.{name} must be true or false, got {value!r}")


@dataclass(frozen=True)
class OneOf:
    choices: tuple[str, ...]

    def __call__(self, owner: str, name: str, value: Any) -> None:
        if value not in self.choices:
            raise UserError(f"{owner}.{name}: unknown value {value!r}; choose one of "
                            f"{', '.join(self.choices)}")


def scheme_name(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise UserError(f"{owner}.{name} must be a scheme name, got {value!r}")


@dataclass(frozen=True)
class MappingOf:
    """A dict of ``what``."""

    what: str

    def __call__(self, owner: str, name: str, value: Any) -> None:
        if not isinstance(value, dict):
            raise UserError(f"{owner}.{name} must be a mapping of {self.what}, got {value!r}")


scheme_options = MappingOf("option names to values")


def divisible(owner: str, name: str, value: int, by_name: str, by: int) -> None:
    if value % by:
        raise UserError(f"{owner}.{name} ({value}) must be divisible by {by_name} ({by})")


def mlp_hidden(owner: str, dim: int, mlp_ratio: float) -> None:
    if int(dim * mlp_ratio) < 1:
        raise UserError(f"{owner}.mlp_ratio={mlp_ratio!r} gives an empty MLP (int(dim * mlp_ratio) "
                        f"= {int(dim * mlp_ratio)}); raise mlp_ratio")


def size_preset(owner: str, sizes: dict[str, dict[str, Any]], size: str) -> dict[str, Any]:
    """The fields of the named size, or a UserError listing the sizes."""
    try:
        return dict(sizes[size])
    except KeyError:
        raise UserError(f"{owner}: unknown size {size!r}; choose one of {', '.join(sizes)}") from None


# ---- sizes that are refused before anything is built -------------------------------------------
# Building a model costs time per module even on the meta device (a billion-layer ModuleList never
# finishes), so these bounds are checked from the configuration alone. The deepest Transformers
# published have about 1,000 layers (DeepNet, arXiv 2203.00555); the largest models about 2e12
# parameters; mixtures of experts at most a few hundred experts per layer.
MAX_LAYERS = 1024
MAX_PARAMETERS = 10**15
MAX_EXPERTS = 1024
MAX_EXPERT_LAYERS = 1 << 16      # MoE layers x experts: the MoE forward runs each expert in turn
MAX_SEQ_LEN = 1 << 22            # 4M positions, a Hugging Face config.json's bound (RoPE's tables are
                                 # built to it); runs are bounded by their memory estimate instead


def buildable(owner: str, n_layers: int, parameters: int) -> None:
    """Refuse more than :data:`MAX_LAYERS` blocks or an estimate of more than
    :data:`MAX_PARAMETERS` parameters (from the sizes alone)."""
    if n_layers > MAX_LAYERS:
        raise UserError(f"{owner}.n_layers={n_layers:,} is beyond what this library builds (at most "
                        f"{MAX_LAYERS:,}; the deepest published Transformers have about 1,000 layers)")
    if parameters > MAX_PARAMETERS:
        raise UserError(f"{owner}: these sizes make about {parameters:.3g} parameters, beyond what "
                        f"this library builds (at most {MAX_PARAMETERS:.0e}, 500 times the largest "
                        "models trained); check dim, n_layers and the vocabulary or class count")


def linear(n_in: int, n_out: int, bias: bool) -> int:
    """The parameters of ``nn.Linear(n_in, n_out, bias)``."""
    return n_in * n_out + (n_out if bias else 0)


def check_fields(owner: str, config: Any, checks: dict[str, Check]) -> None:
    """Run ``checks[name](owner, name, value)`` for each field ``name`` of ``config``."""
    for name, check in checks.items():
        check(owner, name, getattr(config, name))


def resolve_model_scheme(config: Any, **defaults: Any) -> None:
    """Check a model config's scheme and options once and keep what they resolve to on it
    (``config.resolved_scheme``); ``defaults`` are the model's own option defaults."""
    resolved = resolve_scheme(config.scheme, config.scheme_options, config.dim,
                              defaults=defaults, key="model.scheme_options")
    object.__setattr__(config, "_resolved_scheme", resolved)


def resolved_scheme(config: Any, **defaults: Any) -> Any:
    """The :class:`~siamesenorm.schemes.ResolvedScheme` a model config keeps (filled without
    checks for a config built from a file this tool wrote and trusts)."""
    found = config.__dict__.get("_resolved_scheme")
    if found is None:
        found = trusted_scheme(config.scheme, config.scheme_options, config.dim, defaults)
        object.__setattr__(config, "_resolved_scheme", found)
    return found
