"""LayerCarrier: what a checkpointed step adds to a copy is merged back, and first writes win."""

from __future__ import annotations

import torch

from siamesenorm.nn.depth_attention import DepthKeysValues
from siamesenorm.nn.value_residual import FirstValues


def test_a_copy_returns_only_what_the_step_added_and_the_merge_keeps_first_writes() -> None:
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    carrier = DepthKeysValues(2)
    carrier.keep(0, (a, a))
    copy = carrier.copy()
    assert isinstance(copy, DepthKeysValues) and copy.stride == 2 and copy.held is not carrier.held
    copy.keep(0, (c, c))            # a recompute of layer 0: ignored
    copy.keep(1, (b, b))            # not a source layer at stride 2: not held
    copy.keep(2, (b, b))
    added = copy.added_since(carrier)
    assert list(added) == [2] and added[2][0] is b and list(carrier.held) == [0]
    carrier.merge(added | {0: (c, c)})
    assert carrier.held[0][0] is a and carrier.held[2][0] is b
    assert carrier.sources(3) == ([a, b], [a, b])


def test_first_values_holds_the_first_write() -> None:
    first = FirstValues()
    assert first.values is None
    v, w = torch.zeros(2), torch.ones(2)
    first.values = v
    first.keep(0, w)
    assert first.values is v and first.copy().values is v
