"""Per-block views of a residual scheme, so that OLMo-core's per-block ``torch.compile`` traces
one graph for all blocks of one kind instead of one graph per block.

A block runs ``scheme.step(state, i, branch)``. With ``i`` a plain int, dynamo specialises on it
(``scheme.pre_norm[i]`` picks a module by a constant, ``scale(i)`` is a constant), so every block
is a graph of its own. A block runs its view instead: the scheme's own ``step`` code, on

- ``i`` as a ``DynamicInt``: dynamo makes it a symbol, so what the scheme computes from it (a
  depth scale, a row of a stacked parameter) is data, and what it decides from it (``b == 0``,
  Mix-LN's Post-Norm blocks, AttnRes's block boundaries) becomes a guard on the symbol: blocks that
  decide alike share a graph, which is what a *kind* of block is;
- the scheme's per-sublayer and per-block lists (norms, HybridNorm's ``x_gain``) replaced by
  :class:`BlockEntries`, which hold this block's entries only and index them relative to the
  block's first sublayer: ``view.pre_norm[i]`` is ``scheme.pre_norm[i]``, reached at the same
  place (``entries[0]`` or ``[1]``) in every block, so the graph does not name a block.

The view is a shallow copy of the scheme (same class, same ``step``), sharing its parameter,
buffer and module dicts, so FSDP's and TP's parameter swaps reach it, and it is not a submodule:
state-dict keys do not change. :meth:`SchemeBlockView.refresh` re-reads what a copy would hold
stale (``training``, a ``ParameterList``'s parameters after FSDP or TP swapped them); the model
calls it at the start of every forward, outside the compiled blocks.
"""

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
    """The entries of one of a scheme's lists that belong to one block: a list with one entry per
    sublayer (``per=1``: the block's two) or one per block (``per=2``: its one). ``entries[k]`` is
    ``source[k]`` for the block's indices ``k``: the index minus the block's first index, computed
    from the block's symbolic first sublayer ``first``, is a constant for dynamo."""

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
    :class:`BlockEntries` in place of its per-sublayer and per-block lists, and ``view.first``
    (``2 * block`` as a ``DynamicInt``) is the index of the block's first sublayer. A list of any
    other length (AttnRes's key norms, one per sublayer but the first) stays the scheme's own: a
    block indexing it specialises on the index, correct but a graph of its own."""

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
        """Copy the scheme's attributes again (``training``, and any replaced since), and re-read
        the entries of its parameter lists (FSDP and TP swap those parameters)."""
        for entries in self.entries.values():
            if isinstance(entries.source, nn.ParameterList):
                entries.refresh()
        self.scheme.__class__ = type(self.source)
        self.scheme.__dict__ = {**self.source.__dict__, **self.entries}


def like_a_block_output(state: Any) -> Any:
    """The state ``enter`` made, laid out as a block's output is, for the compiled first block:
    streams that are one tensor (SiameseNorm's ``X = Y = h``) become distinct (a copy: a view
    would differ from a block's output by its ``_base``), and an expanded one (hyper-connections'
    copies of ``h``) contiguous. Dynamo guards on aliasing, views and strides, so without this the
    first block would be a graph of its own. Values and gradients are unchanged; the cost is one
    write of the state per step."""
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
