"""The residual-scheme interface and its registry.

A Transformer is an embedding, a stack of sublayers ``F_i`` (attention and MLP alternate, so sublayer
``i`` belongs to block ``i // 2``) and a head. A :class:`ResidualScheme` is everything in between: how
the residual stream(s) carry state from one sublayer to the next and where the norms sit. Every model
runs the same loop and never branches on a scheme's name::

    state = scheme.enter(h)
    for i, sublayer in enumerate(sublayers):
        state = scheme.step(state, i, sublayer)
    h = scheme.exit(state)

``branch`` is the bare sublayer (attention or MLP with no norm around it); the scheme applies every
norm itself. What a scheme needs from the sublayers (QKV-norm, an initialisation gain) it declares as
data in :attr:`ResidualScheme.requires`, and the model builder honours it.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import Tensor, nn

from ..errors import ConfigError
from ..nn.norms import NORM_KINDS, build_norm

State = Tensor | tuple
Branch = Callable[[Tensor], Tensor]

# Every block has two sublayers, attention then MLP: sublayer ``i`` belongs to block ``i // 2``.
SUBLAYERS_PER_BLOCK = 2


@dataclass(frozen=True)
class SchemeRequirements:
    """What a scheme asks of the model that hosts it.

    Attributes:
        qkv_norm_blocks: blocks whose attention must normalise q, k and v per head (HybridNorm).
        init: ``None`` (the model's own initialisation) or ``"xavier"`` (DeepNorm).
        branch_gain: multiplier on the initialisation of the value and output projections of
            attention and of every MLP weight (DeepNorm's beta); 1.0 means unchanged.
    """

    qkv_norm_blocks: frozenset[int] = field(default_factory=frozenset)
    init: str | None = None
    branch_gain: float = 1.0


# ---- declared option checks ------------------------------------------------------------------
# Each is called as ``check(scheme_name, option_name, value)``, returns the value and raises
# :class:`ConfigError` when it is refused; a configuration can run them without building a scheme.
@dataclass(frozen=True)
class OneOf:
    """The value must be one of ``choices``."""

    choices: tuple

    def __call__(self, scheme: str, option: str, value: Any) -> Any:
        if value not in self.choices:
            raise ConfigError(f"scheme {scheme!r}: option {option}={value!r} is not one of "
                              f"{', '.join(map(repr, self.choices))}")
        return value


@dataclass(frozen=True)
class Flag:
    """The value must be ``True`` or ``False``."""

    def __call__(self, scheme: str, option: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise ConfigError(f"scheme {scheme!r}: option {option} must be true or false, got {value!r}")
        return value


@dataclass(frozen=True)
class Number:
    """A number (an integer with ``integer=True``; not a bool) in ``[low, high]``; ``None`` too when
    ``optional``."""

    low: float | None = None
    high: float | None = None
    integer: bool = False
    optional: bool = False

    def __call__(self, scheme: str, option: str, value: Any) -> Any:
        if value is None and self.optional:
            return value
        kind = int if self.integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ConfigError(f"scheme {scheme!r}: option {option} must be "
                              f"{'an integer' if self.integer else 'a number'}, got {value!r}")
        low, high = self.low, self.high
        if (low is not None and value < low) or (high is not None and value > high):
            rng = f"[{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
            raise ConfigError(f"scheme {scheme!r}: option {option}={value!r} is outside {rng}")
        return value


OptionCheck = Callable[[str, str, Any], Any]


class ResidualScheme(nn.Module, ABC):
    """Base class: owns every norm and mixing parameter of the residual path of one model.

    Args:
        dim: model width.
        n_layers: number of blocks; the scheme serves ``2 * n_layers`` sublayers.
        norm: ``"layernorm"``, ``"rmsnorm"`` or ``"dyt"``, used for every norm the scheme owns.
        eps: epsilon of those norms.
        branch_affine: ``False`` builds every norm whose output feeds a branch directly (and
            nothing else) without affine parameters, for hosts whose branches bring their own
            per-sample affine map (DiT's adaLN modulation). Norms on the residual path stay affine.
        final_norm: ``False`` leaves the scheme's outermost final norm out of :meth:`exit`, for
            heads that normalise themselves (DiT's final layer). Each scheme's docstring says what
            its ``exit`` returns then.
        device, dtype: factory kwargs for the parameters.

    Attributes:
        dim, n_layers, eps: as given; norm_kind: the ``norm`` given.
        requires: what the scheme asks of its host model (:class:`SchemeRequirements`).
        option_checks: (class) the check of each keyword-only option the class itself adds;
            :meth:`all_option_checks` merges them over the class hierarchy.
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""  # one-line equation, shown by ``siamesenorm schemes``
    paper: ClassVar[str] = ""  # citation, e.g. "SiameseNorm, arXiv 2602.08064"
    option_checks: ClassVar[dict[str, OptionCheck]] = {"branch_affine": Flag(), "final_norm": Flag()}
    dim: int
    n_layers: int
    norm_kind: str
    eps: float
    requires: SchemeRequirements

    def __init__(self, dim: int, n_layers: int, *, norm: str = "layernorm", eps: float = 1e-5,
                 branch_affine: bool = True, final_norm: bool = True, device=None,
                 dtype=None) -> None:
        super().__init__()
        if not isinstance(dim, int) or isinstance(dim, bool) or dim <= 0:
            raise ConfigError(f"scheme {self.name!r}: dim must be a positive integer, got {dim!r}")
        if not isinstance(n_layers, int) or isinstance(n_layers, bool) or n_layers <= 0:
            raise ConfigError(
                f"scheme {self.name!r}: n_layers must be a positive integer, got {n_layers!r}")
        if norm not in NORM_KINDS:
            raise ConfigError(f"scheme {self.name!r}: unknown norm {norm!r}; "
                              f"choose one of {', '.join(NORM_KINDS)}")
        if not eps > 0:
            raise ConfigError(f"scheme {self.name!r}: eps must be positive, got {eps!r}")
        self.dim, self.n_layers, self.norm_kind, self.eps = dim, n_layers, norm, float(eps)
        self.branch_affine = self.checked("branch_affine", branch_affine)
        self.use_final_norm = self.checked("final_norm", final_norm)
        self._factory = {"device": device, "dtype": dtype}
        self.requires = SchemeRequirements()

    @classmethod
    def all_option_checks(cls) -> dict[str, OptionCheck]:
        """The declared check of every option: the base class's first, then each subclass's own."""
        out: dict[str, OptionCheck] = {}
        for klass in reversed(cls.__mro__):
            out.update(vars(klass).get("option_checks", {}))
        return out

    @classmethod
    def check_together(cls, options: Mapping[str, Any], dim: int | None = None) -> None:
        """Refuse options that pass their own checks but not together (or not with the model width
        ``dim``, when known); ``options`` holds the options given. Default: nothing to refuse."""

    def checked(self, option: str, value: Any) -> Any:
        """``value`` passed through the declared check of ``option``."""
        return self.all_option_checks()[option](self.name, option, value)

    # ----------------------------------------------------------------------------------------
    @property
    def n_sublayers(self) -> int:
        return self.n_layers * SUBLAYERS_PER_BLOCK

    @staticmethod
    def block_of(i: int) -> int:
        """Block index of sublayer ``i``."""
        return i // SUBLAYERS_PER_BLOCK

    @staticmethod
    def is_attention(i: int) -> bool:
        """Sublayer ``i`` is attention (even) or MLP (odd)."""
        return i % SUBLAYERS_PER_BLOCK == 0

    def role(self, i: int) -> str:
        """Where a norm of sublayer ``i`` sits, for DyT's LLM ``alpha0``: ``"attention"`` or ``"other"``."""
        return "attention" if self.is_attention(i) else "other"

    def make_norm(self, affine: bool = True, role: str = "other") -> nn.Module:
        """A norm of the scheme's kind; ``role`` (``"attention"`` for a norm of an attention
        sublayer) only matters to DyT (:func:`~siamesenorm.nn.norms.set_llm_dyt_alpha0`)."""
        return build_norm(self.norm_kind, self.dim, self.eps, affine=affine, role=role, **self._factory)

    def make_norms(self, count: int) -> nn.ModuleList:
        """``count`` norms; with one per sublayer, norm ``i`` has sublayer ``i``'s role."""
        per = count == self.n_sublayers
        return nn.ModuleList(self.make_norm(role=self.role(i) if per else "other") for i in range(count))

    def make_branch_norm(self, role: str = "other") -> nn.Module:
        """A norm whose output only feeds a branch: affine unless ``branch_affine=False``."""
        return self.make_norm(affine=self.branch_affine, role=role)

    def make_branch_norms(self, count: int) -> nn.ModuleList:
        """``count`` branch norms; with one per sublayer, norm ``i`` has sublayer ``i``'s role."""
        per = count == self.n_sublayers
        return nn.ModuleList(self.make_branch_norm(self.role(i) if per else "other") for i in range(count))

    def make_final_norm(self) -> nn.Module | None:
        """The outermost final norm, or ``None`` when built with ``final_norm=False``."""
        return self.make_norm() if self.use_final_norm else None

    def reset_parameters(self) -> None:
        """Reset every parameter the scheme owns to its initial value."""
        for module in self.modules():
            if module is not self and hasattr(module, "reset_parameters"):
                module.reset_parameters()

    # ---- the interface --------------------------------------------------------------------
    def enter(self, h: Tensor) -> State:
        """Embedding output -> stream state (default: the single stream ``h``)."""
        return h

    @abstractmethod
    def step(self, state: State, i: int, branch: Branch) -> State:
        """Apply sublayer ``i`` (``branch``) to the state; every scheme defines it."""

    def exit(self, state: State) -> Tensor:
        """Stream state -> hidden state for the head (default: the single stream as it is)."""
        return state

    def streams(self, state: State) -> dict[str, Tensor]:
        """The named residual streams held in ``state`` (for diagnostics)."""
        return {"h": state}

    def extra_repr(self) -> str:
        out = f"dim={self.dim}, n_layers={self.n_layers}, norm={self.norm_kind}, eps={self.eps}"
        if not self.branch_affine:
            out += ", branch_affine=False"
        return out


# ---- registry ------------------------------------------------------------------------------
_REGISTRY: dict[str, type[ResidualScheme]] = {}


def register_scheme(cls: type[ResidualScheme]) -> type[ResidualScheme]:
    """Class decorator: add a scheme to the registry under ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"a scheme named {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


def list_schemes() -> list[str]:
    """Names of every registered scheme, in registration order."""
    return list(_REGISTRY)


def get_scheme_class(name: str) -> type[ResidualScheme]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown scheme {name!r}; choose one of {', '.join(_REGISTRY)}") from None


# Constructor arguments every scheme has. ``dim``, ``n_layers``, ``norm``, ``eps``, ``device`` and
# ``dtype`` come from the host model's own configuration; the two head options below are set
# through ``scheme_options`` like a scheme's own options, so :func:`scheme_options` lists them
# (after the scheme's own, with that scheme's defaults: ``post`` has ``final_norm=False``).
COMMON_OPTIONS = ("branch_affine", "final_norm")
_COMMON = ("dim", "n_layers", "norm", "eps", *COMMON_OPTIONS, "device", "dtype")


def scheme_options(name: str) -> dict[str, Any]:
    """The options of ``name`` and their defaults: its own, then ``branch_affine``, ``final_norm``."""
    cls = get_scheme_class(name)
    params = inspect.signature(cls.__init__).parameters
    own = {k: p.default for k, p in params.items() if k != "self" and k not in _COMMON
           and p.kind is p.KEYWORD_ONLY}
    base = inspect.signature(ResidualScheme.__init__).parameters  # for ``(*args, **kwargs)`` subclasses
    return own | {k: (params.get(k) or base[k]).default for k in COMMON_OPTIONS}


def build_scheme(name: str, dim: int, n_layers: int, **options: Any) -> ResidualScheme:
    """Build the scheme ``name``; an option it does not have is refused with its valid options."""
    cls = get_scheme_class(name)
    allowed = set(scheme_options(name)) | {"norm", "eps", "device", "dtype"}
    unknown = sorted(set(options) - allowed)
    if unknown:
        valid = ", ".join(sorted(scheme_options(name))) or "none"
        raise ConfigError(f"scheme {name!r} has no option {', '.join(map(repr, unknown))}; "
                          f"its options are: {valid} (and norm, eps)")
    return cls(dim, n_layers, **options)


def check_scheme_options(name: str, options: Mapping[str, Any], dim: int | None = None) -> None:
    """Check ``options`` (a configuration's ``scheme_options``) against the scheme ``name``'s
    declared checks and :meth:`~ResidualScheme.check_together` (with the model width ``dim`` when
    given), without building it: an unknown scheme, an unknown option or a bad value raises
    :class:`ConfigError`."""
    cls = get_scheme_class(name)
    known = scheme_options(name)
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ConfigError(f"model.scheme_options.{unknown[0]}: scheme {name!r} has no option "
                          f"{unknown[0]!r}; its options are: {', '.join(sorted(known)) or 'none'}")
    for option, check in cls.all_option_checks().items():  # the order the constructor checks in
        if option in options:
            check(name, option, options[option])
    cls.check_together(options, dim)


# ---- option checks as functions (the declared checks above, called directly) -----------------
def check_choice(scheme: str, option: str, value: Any, choices: tuple) -> Any:
    return OneOf(tuple(choices))(scheme, option, value)


def check_bool(scheme: str, option: str, value: Any) -> bool:
    return Flag()(scheme, option, value)


def check_number(scheme: str, option: str, value: Any, *, low: float | None = None,
                 high: float | None = None, integer: bool = False) -> Any:
    return Number(low, high, integer)(scheme, option, value)
