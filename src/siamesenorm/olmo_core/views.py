"""Per-block views of a residual scheme, so that OLMo-core's per-block ``torch.compile`` traces one
graph per kind of block (docs/olmo-core.md, "torch.compile: one graph per kind of block")."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

try:
    from torch.fx.experimental.sym_node import DynamicInt
except ImportError:     # a torch without it: each block specialises on its index again (a graph each)
    DynamicInt = int    # type: ignore[misc,assignment]

from ..schemes import ResidualScheme

__all__ = ["BlockEntries", "SchemeBlockView", "like_a_block_output"]

LISTS = (nn.ModuleList, nn.ParameterList)


class BlockEntries:
    """The entries of a scheme's per-sublayer (``per=1``) or per-block (``per=2``) list that belong to one
    block, indexed as the scheme indexes them: ``k`` minus the block's symbolic ``first`` is a constant
    for dynamo."""

    def __init__(self, name: str, source: nn.Module, block: int, per: int, first: DynamicInt) -> None:
        self.name, self.source, self.block, self.per, self.first = name, source, block, per, first
        self.lo, self.hi = (2 * block, 2 * block + 2) if per == 1 else (block, block + 1)
        self.refresh()

    def refresh(self) -> None:
        self.entries = tuple(self.source[k] for k in range(self.lo, self.hi))

    def __getitem__(self, k: int) -> Any:
        at = k - self.first // self.per
        if not 0 <= at < len(self.entries):    # a negative one would wrap round to one of ours
            raise IndexError(f"the scheme's step read {self.name}[{k}] in block {self.block}, which "
                             f"holds {self.name}[{self.lo}:{self.hi}]: a block's step may read only "
                             "its own entries")
        return self.entries[at]

    def __len__(self) -> int:
        return len(self.entries)


class SchemeBlockView:
    """Block ``block``'s view of ``scheme``: ``view.scheme`` runs the scheme's ``step`` with
    :class:`BlockEntries` for its lists, ``view.first`` (``2 * block``) a ``DynamicInt``. A shallow
    copy, not a submodule: state-dict keys do not change."""

    def __init__(self, scheme: ResidualScheme, block: int) -> None:
        self.source, self.block = scheme, block
        self.first = DynamicInt(2 * block)
        self.entries: dict[str, BlockEntries] = {}
        for name, module in scheme.named_children():
            if isinstance(module, LISTS) and len(module) in (scheme.n_sublayers, scheme.n_layers):
                per = 1 if len(module) == scheme.n_sublayers else 2
                self.entries[name] = BlockEntries(name, module, block, per, self.first)
        self.scheme = object.__new__(type(scheme))
        self.refresh()

    def refresh(self) -> None:
        """Copy the scheme's attributes again (``training``), and the parameters FSDP or TP swapped."""
        for entries in self.entries.values():
            if isinstance(entries.source, nn.ParameterList):
                entries.refresh()
        self.scheme.__class__ = type(self.source)
        self.scheme.__dict__ = {**self.source.__dict__, **self.entries}


def like_a_block_output(state: Any) -> Any:
    """The state ``enter`` made, laid out as a block's output (streams that are one tensor copied apart,
    an expanded one contiguous), so the compiled first block shares the others' graph."""
    if not isinstance(state, tuple):
        return state if not isinstance(state, Tensor) or state.is_contiguous() else state.contiguous()
    seen: set[int] = set()
    out = []
    for t in state:
        if isinstance(t, Tensor):
            if not t.is_contiguous():
                t = t.contiguous()
            elif id(t) in seen:
                t = t.clone()
            seen.add(id(t))
        out.append(t)
    return tuple(out)
