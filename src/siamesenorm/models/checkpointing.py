"""Activation checkpointing of one scheme step at a time (``none``, ``sublayer``, ``selective``;
docs/scaling.md), and the bytes a forward pass keeps for backward."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..config import CHECKPOINTING_MODES
from ..nn.carrier import LayerCarrier
from .host import SchemeHost

__all__ = ["activation_checkpointing", "activation_memory", "carrying_step", "saved_activation_bytes",
           "set_activation_checkpointing", "set_scheme_checkpointing"]

_aten = torch.ops.aten
# What ``selective`` keeps: matrix products and attention kernels (whatever SDPA dispatches to; the
# composite ones, ``linear`` and the math attention, only show where an op is not decomposed).
_SAVED_OPS = frozenset(
    getattr(_aten, name).default for name in (
        "mm", "addmm", "bmm", "baddbmm", "linear",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_fused_attention_overrideable", "_scaled_dot_product_attention_math")
    if hasattr(_aten, name))


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class _KeepSaved(TorchDispatchMode):
    """The forward of an eager ``selective`` step: keeps the outputs of :data:`_SAVED_OPS`, in call order."""

    def __init__(self, kept: dict) -> None:
        super().__init__()
        self.kept = kept

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _SAVED_OPS:
            detached = tree_map_only(Tensor, lambda t: t.detach(), out)
            versions = [t._version for t in tree_flatten(detached)[0] if isinstance(t, Tensor)]
            self.kept[func].append((detached, versions))
        return out


class _ReuseSaved(TorchDispatchMode):
    """The recompute of an eager ``selective`` step: the n-th call of a kept op returns the forward's
    n-th output, once. Only kept ops are counted, so FSDP2's hooks do not matter."""

    def __init__(self, kept: dict) -> None:
        super().__init__()
        self.kept, self.calls = kept, Counter()

    def __enter__(self):
        self.calls.clear()                  # each recompute (another backward) starts again
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _SAVED_OPS:
            entries, n = self.kept.get(func, []), self.calls[func]
            self.calls[func] += 1
            if n < len(entries) and entries[n] is not None:
                (out, versions), entries[n] = entries[n], None
                now = [t._version for t in tree_flatten(out)[0] if isinstance(t, Tensor)]
                if now != versions:
                    raise RuntimeError(f"selective activation checkpointing: the output of {func} "
                                       f"was modified in place after the forward kept it")
                return out
        return func(*args, **(kwargs or {}))


def _selective_contexts():
    """PyTorch's contexts under ``torch.compile``, this module's pair in eager mode."""
    if torch.compiler.is_compiling():
        return create_selective_checkpoint_contexts(_keep_matmuls)
    kept: dict = defaultdict(list)
    return _KeepSaved(kept), _ReuseSaved(kept)


class _CheckpointedStep:
    def __init__(self, scheme: nn.Module, mode: str) -> None:
        self.scheme, self.mode = scheme, mode

    def active(self) -> bool:
        return self.scheme.training and torch.is_grad_enabled()

    def _checkpoint(self, fn: Callable[..., Any], *args: Any) -> Any:
        extra = {"context_fn": _selective_contexts} if self.mode == "selective" else {}
        return checkpoint(fn, *args, use_reentrant=False, **extra)

    def __call__(self, state: Any, i: int, branch: Callable[[Tensor], Tensor]) -> Any:
        plain = type(self.scheme).step
        if not self.active():
            return plain(self.scheme, state, i, branch)
        return self._checkpoint(plain, self.scheme, state, i, branch)

    def carrying(self, state: Any, i: int, branch: Callable[..., Tensor],
                 carriers: dict[str, LayerCarrier]) -> Any:
        """The checkpointed step of a sublayer that reads and adds to ``carriers``: the region runs on
        copies and returns what they gained."""
        plain = type(self.scheme).step

        def region(state: Any) -> tuple[Any, dict[str, dict]]:
            copies = {name: carrier.copy() for name, carrier in carriers.items()}
            out = plain(self.scheme, state, i, partial(branch, **copies))
            return out, {name: copies[name].added_since(carrier) for name, carrier in carriers.items()}

        out, added = self._checkpoint(region, state)
        for name, carrier in carriers.items():
            carrier.merge(added[name])
        return out


def carrying_step(scheme: nn.Module, state: Any, i: int, branch: Callable[..., Tensor],
                  carriers: dict[str, LayerCarrier]) -> Any:
    """``scheme.step(state, i, branch)``, ``branch`` taking ``carriers`` as keyword arguments (under
    checkpointing, what the step adds flows out as the region's output)."""
    step = vars(scheme).get("step")
    if isinstance(step, _CheckpointedStep) and step.active():
        return step.carrying(state, i, branch, carriers)
    return scheme.step(state, i, partial(branch, **carriers))


def _host(model: nn.Module) -> SchemeHost:
    if not isinstance(model, SchemeHost):
        raise ValueError(f"activation checkpointing needs a model that runs a residual scheme "
                         f"(a SchemeHost), got {type(model).__name__}")
    return model


def activation_checkpointing(model: nn.Module) -> str:
    step = vars(_host(model).scheme).get("step")
    return step.mode if isinstance(step, _CheckpointedStep) else "none"


def set_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Run each scheme step of ``model`` (a scheme host) with activation checkpointing ``mode``; ``none``
    restores the plain step. Set it before DDP or FSDP2 wrap the model."""
    set_scheme_checkpointing(_host(model).scheme, mode)


def set_scheme_checkpointing(scheme: nn.Module, mode: str) -> None:
    if mode not in CHECKPOINTING_MODES:
        raise ValueError(f"activation checkpointing must be one of {', '.join(CHECKPOINTING_MODES)}, "
                         f"got {mode!r}")
    vars(scheme).pop("step", None)
    if mode != "none":
        vars(scheme)["step"] = _CheckpointedStep(scheme, mode)


# ---- measuring ----------------------------------------------------------------------------------
def _storage(t: Tensor):
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):      # sparse and other storage-less tensors
        return None


class _LiveStorages(TorchDispatchMode):
    """Every storage an op creates while active, weakly referenced (autograd may keep a storage alone)."""

    def __init__(self) -> None:
        super().__init__()
        self.created: dict[int, tuple[StorageWeakRef, int]] = {}
        self.before: set[int] = set()

    def _fresh(self, key: int) -> bool:
        entry = self.created.get(key)
        return entry is not None and not entry[0].expired()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, Tensor) and (s := _storage(t)) is not None and not self._fresh(s._cdata):
                self.before.add(s._cdata)         # a parameter, buffer or input: not the forward's
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor) and (s := _storage(t)) is not None:
                key = s._cdata
                if key not in self.before and not self._fresh(key):
                    self.created[key] = (StorageWeakRef(s), s.nbytes())
        return out

    def live_bytes(self) -> int:
        return sum(n for ref, n in self.created.values() if not ref.expired())


class _FusedAttentionOnMeta(TorchFunctionMode):
    """Sends attention on the meta device to a fused kernel's meta function (which keeps output and
    log-sum-exp, not the math path's weights), so that an estimate is the fused figure."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        if q.device.type != "meta":
            return func(*args, **kwargs)
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
        causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
        if kwargs.get("enable_gqa") and k.shape[-3] != q.shape[-3]:
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        out, _ = _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout, causal, attn_mask=mask, scale=kwargs.get("scale"))
        return out


def saved_activation_bytes(fn: Callable[[], Tensor]) -> int:
    """The bytes ``fn()`` (a forward returning its loss) leaves allocated for backward, each storage
    once; works on the meta device."""
    with torch.enable_grad(), _FusedAttentionOnMeta():
        mode = _LiveStorages()
        with mode:
            loss = fn()
        total = mode.live_bytes()
        del loss
    return total


def activation_memory(model: nn.Module, x: Tensor, y: Tensor, mode: str) -> int:
    """:func:`saved_activation_bytes` of ``model(x, y).loss`` in training mode under checkpointing
    ``mode``; the model's mode and checkpointing are restored."""
    before, training = activation_checkpointing(model), model.training
    set_activation_checkpointing(model, mode)
    model.train()
    try:
        return saved_activation_bytes(lambda: model(x, y).loss)
    finally:
        set_activation_checkpointing(model, before)
        model.train(training)
