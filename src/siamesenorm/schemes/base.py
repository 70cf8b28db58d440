"""The residual-scheme interface and its registry.

A :class:`ResidualScheme` is everything between the embedding and the head: how the residual
stream(s) carry state from sublayer to sublayer (attention at even ``i``, MLP at odd) and where
the norms sit. Every model runs the same loop over bare sublayers::

    state = scheme.enter(h)
    for i, sublayer in enumerate(sublayers):
        state = scheme.step(state, i, sublayer)
    h = scheme.exit(state)

What a scheme needs of the sublayers it declares in :attr:`ResidualScheme.requires`.
"""

from __future__ import annotations

import functools
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
    """What a scheme asks of its host: per-head QKV-norm on ``qkv_norm_blocks`` (HybridNorm),
    ``init`` ``None`` or ``"xavier"`` (DeepNorm), and a ``branch_gain`` on the initialisation of
    the value and output projections and every MLP weight (DeepNorm's beta)."""

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
    """Owns every norm and mixing parameter of one model's residual path.

    Takes the host's ``dim``, ``n_layers`` (blocks; ``2 * n_layers`` sublayers), ``norm`` (a
    :data:`~siamesenorm.nn.norms.NORM_KINDS`), ``eps``, ``device``, ``dtype``, and the options
    its ``options`` table declares (name -> :class:`Option`; undeclared: refused, missing: the
    default; ``branch_affine`` and ``final_norm`` for all). A subclass takes ``(dim, n_layers,
    **kwargs)``, calls ``super().__init__`` first, and builds from the attributes holding them.
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
        _checked = options.pop("_checked", None)    # a ResolvedScheme's options, checked there
        if _checked is None:        # built directly: check it all here
            check_host_args(self.name, dim, n_layers, norm, eps)
            _checked = _resolve(type(self), options, dim).options
        self.dim, self.n_layers, self.norm_kind, self.eps = dim, n_layers, norm, float(eps)
        for k, o in self.all_options().items():
            if o.attr is not None:
                setattr(self, o.attr or k, _checked[k])
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

    @classmethod
    def count_parameters(cls, dim: int, n_layers: int, norm: str, options: Mapping[str, Any]) -> int:
        """The parameters of the scheme at these sizes, with ``options`` already checked. Counted
        on a meta-device build; a scheme with a closed form may override it."""
        scheme = ResolvedScheme(cls, dict(options), dim).build(dim, n_layers, norm=norm, device="meta")
        return sum(p.numel() for p in scheme.parameters())

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
    """Declare the keyword-only arguments of an older scheme's ``__init__`` as options (a new one
    unchecked and not stored, a declared one with the signature's default)."""
    declared = cls.all_options()
    found = {}
    for k, p in inspect.signature(cls.__init__).parameters.items():
        if p.kind is not p.KEYWORD_ONLY or k in _NOT_OPTIONS:
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
    except (KeyError, TypeError):       # TypeError: an unhashable name
        raise UserError(f"unknown scheme {name!r}; choose one of {', '.join(_REGISTRY)}") from None


# Constructor arguments every scheme has. ``dim``, ``n_layers``, ``norm``, ``eps``, ``device`` and
# ``dtype`` come from the host model's own configuration; the two head options below are declared
# by :class:`ResidualScheme` and set through ``scheme_options`` like a scheme's own options, so
# :func:`scheme_options` lists them (after the scheme's own, with that scheme's defaults: ``post``
# has ``final_norm=False``).
COMMON_OPTIONS = ("branch_affine", "final_norm")
_HOST_ARGS = ("norm", "eps", "device", "dtype")
_NOT_OPTIONS = (*_HOST_ARGS, "_checked")


def scheme_options(name: str) -> dict[str, Any]:
    """The options of ``name`` and their defaults: its own, then ``branch_affine``, ``final_norm``."""
    options = get_scheme_class(name).all_options()
    own = {k: o.default for k, o in options.items() if k not in COMMON_OPTIONS}
    return own | {k: options[k].default for k in COMMON_OPTIONS}


def _refuse_unknown(name: str, options: Mapping[str, Any], declared: Mapping[str, Any],
                    key: str = "") -> None:
    """Name the ``options`` not in ``declared`` and the valid ones (``key``: where they were set)."""
    unknown = sorted(set(options) - set(declared))
    if not unknown:
        return
    valid = ", ".join(sorted(declared)) or "none"
    if key:
        raise UserError(f"{key}.{unknown[0]}: scheme {name!r} has no option {unknown[0]!r}; its "
                        f"options are: {valid}")
    raise UserError(f"scheme {name!r} has no option {', '.join(map(repr, unknown))}; its options "
                    f"are: {valid} (and norm, eps)")


def check_host_args(name: str, dim: Any, n_layers: Any, norm: Any, eps: Any) -> None:
    """What a scheme takes from its host: a width, a depth, a norm kind and its eps."""
    for what, value in (("dim", dim), ("n_layers", n_layers)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise UserError(f"scheme {name!r}: {what} must be a positive integer, got {value!r}")
    if norm not in NORM_KINDS:
        raise UserError(f"scheme {name!r}: unknown norm {norm!r}; choose one of {', '.join(NORM_KINDS)}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not is_finite(eps) or not eps > 0:
        raise UserError(f"scheme {name!r}: eps must be a positive finite number, got {eps!r}")


@dataclass(frozen=True, eq=False)
class ResolvedScheme:
    """A scheme's class and the value of every option (given, else the model's default, else the
    scheme's), checked once for width ``dim``. Hosts build from it without checking again."""

    cls: type[ResidualScheme]
    options: dict[str, Any]
    dim: int | None = None

    @property
    def name(self) -> str:
        return self.cls.name

    def build(self, dim: int, n_layers: int, *, norm: str = "layernorm", eps: float = 1e-5,
              device=None, dtype=None) -> ResidualScheme:
        """The scheme; ``dim``, ``n_layers``, ``norm`` and ``eps`` are the host's, checked there."""
        if dim != self.dim:
            self.cls.check_together(self.options, dim)
        named, takes_checked = _signature(self.cls)
        if takes_checked:
            options = {k: self.options[k] for k in named} | {"_checked": self.options}
        else:       # a scheme whose __init__ names every option checks them itself
            options = dict(self.options)
        return self.cls(dim, n_layers, norm=norm, eps=eps, device=device, dtype=dtype, **options)

    def num_parameters(self, dim: int, n_layers: int, norm: str = "layernorm") -> int:
        items = tuple(self.options.items())
        try:
            return _count(self.cls, dim, n_layers, norm, items)
        except TypeError:       # an unhashable option value: not cached
            return self.cls.count_parameters(dim, n_layers, norm, self.options)


@functools.lru_cache(maxsize=64)
def _count(cls: type[ResidualScheme], dim: int, n_layers: int, norm: str, items: tuple) -> int:
    return cls.count_parameters(dim, n_layers, norm, dict(items))


@functools.cache
def _signature(cls: type[ResidualScheme]) -> tuple[tuple[str, ...], bool]:
    """The options ``cls.__init__`` names as keyword-only arguments, and whether it passes other
    keywords on to the base class (so takes ``_checked``)."""
    params = inspect.signature(cls.__init__).parameters.values()
    named = tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY and p.name not in _NOT_OPTIONS)
    return named, any(p.kind is p.VAR_KEYWORD for p in params)


def _resolve(cls: type[ResidualScheme], given: Mapping[str, Any], dim: int | None,
             defaults: Mapping[str, Any] | None = None, key: str = "") -> ResolvedScheme:
    declared = cls.all_options()
    _refuse_unknown(cls.name, given, declared, key)
    given = {**(defaults or {}), **given}
    values = {k: o.check(cls.name, k, given[k]) if k in given else o.default
              for k, o in declared.items()}
    cls.check_together(values, dim)
    return ResolvedScheme(cls, values, dim)


def resolve_scheme(name: str, options: Mapping[str, Any], dim: int | None = None, *,
                   defaults: Mapping[str, Any] | None = None, key: str = "") -> ResolvedScheme:
    """Check the scheme ``name`` and its ``options`` once (over the model's ``defaults``; with
    the width ``dim`` when known): an unknown scheme, an unknown option or a bad value raises
    :class:`UserError` (``key``, e.g. ``model.scheme_options``, names where they were set)."""
    return _resolve(get_scheme_class(name), options, dim, defaults, key)


def trusted_scheme(name: str, options: Mapping[str, Any], dim: int,
                   defaults: Mapping[str, Any] | None = None) -> ResolvedScheme:
    """The :class:`ResolvedScheme` of options checked before (a ``config.yaml`` this tool wrote),
    filled with the defaults and not checked again."""
    cls = get_scheme_class(name)
    given = {**(defaults or {}), **options}
    return ResolvedScheme(cls, {k: given.get(k, o.default) for k, o in cls.all_options().items()}, dim)


def build_scheme(name: str, dim: int, n_layers: int, **options: Any) -> ResidualScheme:
    """Build the scheme ``name``, checking everything; an option it does not have is refused with
    its valid options."""
    host = {k: options.pop(k) for k in _HOST_ARGS if k in options}
    cls = get_scheme_class(name)
    check_host_args(name, dim, n_layers, host.get("norm", "layernorm"), host.get("eps", 1e-5))
    return _resolve(cls, options, dim).build(dim, n_layers, **host)


def check_scheme_options(name: str, options: Mapping[str, Any], dim: int | None = None) -> ResolvedScheme:
    """:func:`resolve_scheme` of a configuration's ``scheme_options``, nothing built."""
    return resolve_scheme(name, options, dim, key="model.scheme_options")
