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
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from torch import Tensor, nn

from ..errors import UserError
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
# :class:`UserError` when it is refused; a configuration can run them without building a scheme.
@dataclass(frozen=True)
class OneOf:
    """The value must be one of ``choices``."""

    choices: tuple

    def __call__(self, scheme: str, option: str, value: Any) -> Any:
        if value not in self.choices:
            raise UserError(f"scheme {scheme!r}: option {option}={value!r} is not one of "
                              f"{', '.join(map(repr, self.choices))}")
        return value


@dataclass(frozen=True)
class Flag:
    """The value must be ``True`` or ``False``."""

    def __call__(self, scheme: str, option: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise UserError(f"scheme {scheme!r}: option {option} must be true or false, got {value!r}")
        return value


def is_finite(value: Any) -> bool:
    """Whether the number ``value`` is finite as a float: not NaN, not infinite, and not an
    integer too large for a float (``10**400``)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


@dataclass(frozen=True)
class Number:
    """A number (an integer with ``integer=True``; not a bool) in ``[low, high]``; ``None`` too when
    ``optional``. A number that is not an integer is always finite (never NaN nor infinite), and
    its ``high`` is declared: the largest value with which the scheme's model stays finite, at
    least (a test builds every scheme at each of its bounds)."""

    low: float | None = None
    high: float | None = None
    integer: bool = False
    optional: bool = False

    def __call__(self, scheme: str, option: str, value: Any) -> Any:
        if value is None and self.optional:
            return value
        kind = int if self.integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kind):
            raise UserError(f"scheme {scheme!r}: option {option} must be "
                              f"{'an integer' if self.integer else 'a number'}, got {value!r}")
        if not self.integer and not is_finite(value):
            raise UserError(f"scheme {scheme!r}: option {option} must be a finite number, got {value!r}")
        low, high = self.low, self.high
        if (low is not None and value < low) or (high is not None and value > high):
            rng = f"[{'-inf' if low is None else format(low, 'g')}, " \
                  f"{'inf' if high is None else format(high, 'g')}]"
            raise UserError(f"scheme {scheme!r}: option {option}={value!r} is outside {rng}")
        return value


OptionCheck = Callable[[str, str, Any], Any]

# The largest weight a scheme's option may put on the skip path (Keel's and DeepNorm's alpha: the
# papers' are 2L and (2L)^(1/4)): the post-norm after it squares the stream, and from 1e19 on that
# is infinite in float32 and bfloat16.
MAX_SKIP_WEIGHT = 1e6
# The largest gain an option may put on the initialisation of the branch weights (DeepNorm's beta,
# (8L)^(-1/4) in the paper): a SwiGLU's three weights raise it to the third power.
MAX_BRANCH_GAIN = 10.0


@dataclass(frozen=True)
class Option:
    """One option of a scheme: its default, its check (:class:`OneOf`, :class:`Flag`,
    :class:`Number`) and the attribute the constructor stores its value in: the option's own name
    unless ``attr`` names another (``None``: not stored)."""

    default: Any
    check: OptionCheck
    attr: str | None = ""


class ResidualScheme(nn.Module, ABC):
    """Base class: owns every norm and mixing parameter of the residual path of one model.

    Args:
        dim: model width.
        n_layers: number of blocks; the scheme serves ``2 * n_layers`` sublayers.
        norm: ``"layernorm"``, ``"rmsnorm"``, ``"dyt"`` or ``"derf"``, used for every norm the scheme owns.
        eps: epsilon of those norms.
        device, dtype: factory kwargs for the parameters.
        **options: the scheme's options, declared in :attr:`options` (undeclared: refused; missing:
            the default); every scheme has ``branch_affine`` and ``final_norm`` (docs/schemes.md,
            "Options every scheme has").

    A subclass declares its options in its ``options`` table (name -> :class:`Option`), takes
    ``(dim, n_layers, **kwargs)``, calls ``super().__init__`` first and builds its parameters from the
    attributes that hold the options. Attributes: ``dim``, ``n_layers``, ``eps``, ``norm_kind``,
    ``branch_affine``, ``use_final_norm``, ``requires`` (:class:`SchemeRequirements`), and the class's
    ``options`` (:meth:`all_options` merges them over the hierarchy).
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""  # one-line equation, shown by ``siamesenorm schemes``
    paper: ClassVar[str] = ""  # citation, e.g. "SiameseNorm, arXiv 2602.08064"
    options: ClassVar[dict[str, Option]] = {
        "branch_affine": Option(True, Flag()),
        "final_norm": Option(True, Flag(), attr="use_final_norm"),
    }
    dim: int
    n_layers: int
    norm_kind: str
    eps: float
    branch_affine: bool
    use_final_norm: bool
    requires: SchemeRequirements
    # The attributes holding the norms in a Pre-Norm model's norms' roles (adapting a pretrained
    # model starts them as copies): the norm of the stream into each sublayer (or one module: block
    # 0's), and the norm feeding the head; None where the scheme has no such norm.
    role_norm_names: ClassVar[tuple[str | None, str | None]] = (None, None)
    # The attribute holding one norm per sublayer on its output inside the branch (Peri-LN's), the
    # role of OLMo2's and Gemma's post-sublayer norms; None where the scheme has none.
    role_output_norm_name: ClassVar[str | None] = None

    def __init__(self, dim: int, n_layers: int, *, norm: str = "layernorm", eps: float = 1e-5,
                 device=None, dtype=None, **options: Any) -> None:
        super().__init__()
        declared = self.all_options()
        _refuse_unknown(self.name, options, declared)
        if not isinstance(dim, int) or isinstance(dim, bool) or dim <= 0:
            raise UserError(f"scheme {self.name!r}: dim must be a positive integer, got {dim!r}")
        if not isinstance(n_layers, int) or isinstance(n_layers, bool) or n_layers <= 0:
            raise UserError(
                f"scheme {self.name!r}: n_layers must be a positive integer, got {n_layers!r}")
        if norm not in NORM_KINDS:
            raise UserError(f"scheme {self.name!r}: unknown norm {norm!r}; "
                              f"choose one of {', '.join(NORM_KINDS)}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not is_finite(eps) \
                or not eps > 0:
            raise UserError(f"scheme {self.name!r}: eps must be a positive finite number, got {eps!r}")
        values = {k: o.check(self.name, k, options[k]) if k in options else o.default
                  for k, o in declared.items()}
        self.check_together(values, dim)
        self.dim, self.n_layers, self.norm_kind, self.eps = dim, n_layers, norm, float(eps)
        for k, o in declared.items():
            if o.attr is not None:
                setattr(self, o.attr or k, values[k])
        self._factory = {"device": device, "dtype": dtype}
        self.requires = SchemeRequirements()

    @classmethod
    def all_options(cls) -> dict[str, Option]:
        """Every option: the base class's first, then each subclass's own (a subclass redeclaring
        an option, as ``post`` does ``final_norm``, replaces it in place)."""
        out: dict[str, Option] = {}
        for klass in reversed(cls.__mro__):
            out.update(vars(klass).get("options", {}))
        return out

    @classmethod
    def check_together(cls, options: Mapping[str, Any], dim: int | None = None) -> None:
        """Refuse options that pass their own checks but not together (or not with the model width
        ``dim``, when known); ``options`` holds the options given (the constructor gives them all,
        defaults filled in). Default: nothing to refuse."""

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

    def role_norms(self) -> tuple[dict[int, nn.Module], nn.Module | None]:
        """The norms in a Pre-Norm model's norms' roles (:attr:`role_norm_names`): by sublayer,
        and the one feeding the head (a norm the built scheme lacks is left out)."""
        per, final = self.role_norm_names
        held = getattr(self, per, None) if per else None
        norms: dict[int, nn.Module] = {}
        if isinstance(held, nn.ModuleList) and len(held) == self.n_sublayers:
            norms = dict(enumerate(held))
        elif isinstance(held, nn.Module):
            norms = {0: held}
        head = getattr(self, final, None) if final else None
        return norms, head if isinstance(head, nn.Module) else None

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
    _declare_signature_options(cls)
    _REGISTRY[cls.name] = cls
    return cls


def _declare_signature_options(cls: type[ResidualScheme]) -> None:
    """Declare the options a scheme written before option tables takes as keyword-only arguments
    of its ``__init__``, so that :func:`build_scheme` and :func:`scheme_options` know them: a new
    one unchecked and not stored (its ``__init__`` keeps it), a declared one with the default the
    signature gives it."""
    declared = cls.all_options()
    found = {}
    for k, p in inspect.signature(cls.__init__).parameters.items():
        if p.kind is not p.KEYWORD_ONLY or k in _HOST_ARGS:
            continue
        if k not in declared:
            found[k] = Option(p.default, _unchecked, attr=None)
        elif p.default != declared[k].default:
            found[k] = replace(declared[k], default=p.default)
    if found:
        cls.options = {**vars(cls).get("options", {}), **found}


def _unchecked(scheme: str, option: str, value: Any) -> Any:
    """An option without a declared check: any value, but a float is finite (never NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"scheme {scheme!r}: option {option} must be a finite number, got {value!r}")
    return value


def list_schemes() -> list[str]:
    """Names of every registered scheme, in registration order."""
    return list(_REGISTRY)


def get_scheme_class(name: str) -> type[ResidualScheme]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UserError(f"unknown scheme {name!r}; choose one of {', '.join(_REGISTRY)}") from None


# Constructor arguments every scheme has. ``dim``, ``n_layers``, ``norm``, ``eps``, ``device`` and
# ``dtype`` come from the host model's own configuration; the two head options below are declared
# by :class:`ResidualScheme` and set through ``scheme_options`` like a scheme's own options, so
# :func:`scheme_options` lists them (after the scheme's own, with that scheme's defaults: ``post``
# has ``final_norm=False``).
COMMON_OPTIONS = ("branch_affine", "final_norm")
_HOST_ARGS = ("norm", "eps", "device", "dtype")


def scheme_options(name: str) -> dict[str, Any]:
    """The options of ``name`` and their defaults: its own, then ``branch_affine``, ``final_norm``."""
    options = get_scheme_class(name).all_options()
    own = {k: o.default for k, o in options.items() if k not in COMMON_OPTIONS}
    return own | {k: options[k].default for k in COMMON_OPTIONS}


def _refuse_unknown(name: str, options: Mapping[str, Any], declared: Mapping[str, Any]) -> None:
    """Raise :class:`UserError` naming the ``options`` not in ``declared`` and the valid ones."""
    unknown = sorted(set(options) - set(declared))
    if unknown:
        raise UserError(f"scheme {name!r} has no option {', '.join(map(repr, unknown))}; "
                          f"its options are: {', '.join(sorted(declared)) or 'none'} (and norm, eps)")


def build_scheme(name: str, dim: int, n_layers: int, **options: Any) -> ResidualScheme:
    """Build the scheme ``name``; an option it does not have is refused with its valid options."""
    cls = get_scheme_class(name)
    _refuse_unknown(name, {k: v for k, v in options.items() if k not in _HOST_ARGS}, cls.all_options())
    return cls(dim, n_layers, **options)


def check_scheme_options(name: str, options: Mapping[str, Any], dim: int | None = None) -> None:
    """Check ``options`` (a configuration's ``scheme_options``) against the scheme ``name``'s
    declared checks and :meth:`~ResidualScheme.check_together` (with the model width ``dim`` when
    given), without building it: an unknown scheme, an unknown option or a bad value raises
    :class:`UserError`."""
    cls = get_scheme_class(name)
    declared = cls.all_options()
    unknown = sorted(set(options) - set(declared))
    if unknown:
        raise UserError(f"model.scheme_options.{unknown[0]}: scheme {name!r} has no option "
                          f"{unknown[0]!r}; its options are: {', '.join(sorted(declared)) or 'none'}")
    for option, spec in declared.items():  # the order the constructor checks in
        if option in options:
            spec.check(name, option, options[option])
    cls.check_together(options, dim)
