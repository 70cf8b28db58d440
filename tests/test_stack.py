"""``ResidualStack``: the one residual loop, around anyone's sublayers and inside every model of ours."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import siamesenorm
from siamesenorm import ResidualStack, build_scheme, list_schemes
from siamesenorm.models import DiT, DiTConfig, LanguageModel, LMConfig, VisionTransformer, ViTConfig

DIM, LAYERS = 16, 3


class Mixer(nn.Module):
    """A user's own attention stand-in: mixes tokens, optionally under a mask."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, u, mask=None):
        w = torch.ones(u.shape[1], u.shape[1]) if mask is None else mask.float()
        return self.proj(w @ u / u.shape[1])


def blocks(seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    out = []
    for _ in range(LAYERS):
        out += [Mixer(), nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))]
    return out


def reference(scheme, h, sublayers, mask=None):
    """The loop written out, independently of the stack."""
    state = scheme.enter(h)
    for i, sub in enumerate(sublayers):
        branch = (lambda u, sub=sub: sub(u, mask=mask)) if i % 2 == 0 else sub
        state = scheme.step(state, i, branch)
    return scheme.exit(state)


@pytest.mark.parametrize("name", list_schemes())
def test_a_stack_of_my_own_blocks_runs_the_scheme_over_them(name):
    subs = blocks()
    stack = ResidualStack(name, subs, dim=DIM, norm="rmsnorm")
    assert stack.scheme.name == name and stack.scheme.n_layers == LAYERS
    h = torch.randn(2, 5, DIM)
    torch.testing.assert_close(stack(h), reference(stack.scheme, h, subs), rtol=0, atol=0)
    mask = torch.tril(torch.ones(5, 5))
    torch.testing.assert_close(stack(h, attention_kwargs={"mask": mask}),
                               reference(stack.scheme, h, subs, mask), rtol=0, atol=0)
    # every parameter is the stack's: an optimizer over it trains the blocks and the norms
    assert {id(p) for p in stack.parameters()} == \
        {id(p) for m in [*subs, stack.scheme] for p in m.parameters()}


def test_a_built_scheme_plain_callables_and_what_the_loop_hands_out():
    scheme = build_scheme("siamese", DIM, 2)
    calls: list = []

    def attention(u, **kwargs):
        calls.append(("attn", sorted(kwargs)))
        return torch.tanh(u)

    def mlp(u):
        calls.append(("mlp", []))
        return u * 0.5

    stack = ResidualStack(scheme, [attention, mlp, attention, mlp])
    seen, states = [], []

    def wrap(i, branch):
        seen.append(i)
        return branch

    out = stack(torch.randn(2, 3, DIM), attention_kwargs={"cache": None}, wrap=wrap, states=states)
    assert out.shape == (2, 3, DIM) and seen == [0, 1, 2, 3]
    assert calls == [("attn", ["cache"]), ("mlp", []), ("attn", ["cache"]), ("mlp", [])]
    assert len(states) == 3 and all(isinstance(s, tuple) for s in states)   # X and Y streams


def test_checkpointing_each_step_gives_the_same_gradients():
    grads = {}
    for mode in ("none", "sublayer", "selective"):
        stack = ResidualStack("siamese", blocks(), dim=DIM, checkpointing=mode).train()
        h = torch.randn(2, 5, DIM, generator=torch.Generator().manual_seed(1))
        stack(h).square().sum().backward()
        grads[mode] = [p.grad.clone() for p in stack.parameters()]
    for mode in ("sublayer", "selective"):
        for a, b in zip(grads["none"], grads[mode]):
            torch.testing.assert_close(a, b)


def test_bad_stacks_are_refused():
    with pytest.raises(ValueError, match="alternate attention and MLP"):
        ResidualStack("pre", blocks()[:3], dim=DIM)
    with pytest.raises(ValueError, match="needs dim="):
        ResidualStack("pre", blocks())
    with pytest.raises(ValueError, match="has 2 blocks"):
        ResidualStack(build_scheme("pre", DIM, 2), blocks())
    with pytest.raises(siamesenorm.ConfigError, match="has no option"):
        ResidualStack("pre", blocks(), dim=DIM, depth_scale=False)
    # each argument named at construction, not at the first forward (issue 37)
    with pytest.raises(TypeError, match=r"sublayers\[0\] must be a module or a callable, got int"):
        ResidualStack("pre", [1, 2, 3, 4], dim=DIM)
    with pytest.raises(TypeError, match="scheme must be a ResidualScheme or a scheme's name, got int"):
        ResidualStack(5, blocks(), dim=DIM)
    with pytest.raises(TypeError, match="sublayers must be a list of modules or callables, got Sequential"):
        ResidualStack("pre", nn.Sequential(*blocks()), dim=DIM)
    for eps in (float("inf"), float("nan"), 0.0, -1e-5, "1e-5", True):
        with pytest.raises(ValueError, match="eps must be a positive finite number"):
            ResidualStack("pre", blocks(), dim=DIM, eps=eps)
    stack = ResidualStack("siamese", blocks(), dim=2 * DIM)       # width 32 over width-16 blocks
    with pytest.raises(ValueError, match="the input's last dimension is 16, the scheme's width "
                                         r"\(dim\) is 32"):
        stack(torch.randn(2, 5, DIM))


def test_our_models_are_stacks_and_run_its_loop(monkeypatch):
    models = [LanguageModel(LMConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, max_seq_len=8)),
              VisionTransformer(ViTConfig(image_size=8, patch_size=4, in_chans=1, num_classes=3, dim=16,
                                          n_layers=2, n_heads=2)),
              DiT(DiTConfig(input_size=8, patch_size=4, in_chans=1, num_classes=3, dim=16, n_layers=2,
                            n_heads=2))]
    runs, real = [], ResidualStack.run

    def counted(self, h, **kwargs):
        runs.append(type(self))
        return real(self, h, **kwargs)
    monkeypatch.setattr(ResidualStack, "run", counted)
    models[0](torch.zeros(1, 4, dtype=torch.long))
    models[1](torch.zeros(1, 1, 8, 8))
    models[2](torch.zeros(1, 1, 8, 8), torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    assert runs == [LanguageModel, VisionTransformer, DiT]
    assert all(isinstance(m, ResidualStack) for m in models)
