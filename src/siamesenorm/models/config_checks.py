"""Value checks shared by the vision model configurations (ViTConfig, DiTConfig).

Each raises :class:`UserError` with one line naming the field (``ViTConfig.dim``), what is wrong
and the accepted values.
"""

from __future__ import annotations

from typing import Any

from ..errors import UserError
from ..nn.norms import NORM_KINDS


def positive_int(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UserError(f"{owner}.{name} must be a positive integer, got {value!r}")


def positive_number(owner: str, name: str, value: Any) -> None:
    """A finite number above 0 (NaN and inf refused: issue 48)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise UserError(f"{owner}.{name} must be a positive number, and finite, got {value!r}")


def probability(owner: str, name: str, value: Any) -> None:
    """A rate in ``[0, 1)`` (dropout, drop-path, label smoothing)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise UserError(f"{owner}.{name} must be in [0, 1), got {value!r}")


def boolean(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise UserError(f"{owner}.{name} must be true or false, got {value!r}")


def divisible(owner: str, name: str, value: int, by_name: str, by: int) -> None:
    if value % by:
        raise UserError(f"{owner}.{name} ({value}) must be divisible by {by_name} ({by})")


def mlp_hidden(owner: str, dim: int, mlp_ratio: float) -> None:
    if int(dim * mlp_ratio) < 1:
        raise UserError(f"{owner}.mlp_ratio={mlp_ratio!r} gives an empty MLP (int(dim * mlp_ratio) "
                          f"= {int(dim * mlp_ratio)}); raise mlp_ratio")


def norm_and_scheme(owner: str, norm: Any, scheme: Any, scheme_options: Any) -> None:
    """The norm kind, and the scheme's name and options (their values are checked when built)."""
    if norm not in NORM_KINDS:
        raise UserError(f"{owner}.norm: unknown value {norm!r}; choose one of {', '.join(NORM_KINDS)}")
    if not isinstance(scheme, str) or not scheme:
        raise UserError(f"{owner}.scheme must be a scheme name, got {scheme!r}")
    if not isinstance(scheme_options, dict):
        raise UserError(f"{owner}.scheme_options must be a mapping of option names to values, "
                          f"got {scheme_options!r}")


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
    """Refuse a model no machine builds: more than :data:`MAX_LAYERS` blocks, or an estimate of
    more than :data:`MAX_PARAMETERS` parameters (``parameters``, from the sizes alone)."""
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
