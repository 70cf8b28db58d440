"""Every scheme's training step compiles as one graph: no graph breaks, no recompiles.

``fullgraph=True`` turns any graph break into an error and a recompile limit of 1 (with
``fail_on_recompile_limit_hit``) turns any recompile into one; two steps run, so a guard that
fails on the second step (a counter, a changed flag) shows too. Every scheme's model has 12
blocks: a block index that made dynamo specialise would show as a break or a recompile there.
Each option with a code path of its own runs at 4 blocks, where every part of that path is
present (mix_ln's Post-LN and Pre-LN blocks, two AttnRes blocks of 4 sublayers, blocks after the
first): tracing costs about 2 s a block, and the options' paths differ from block to block no
more than the schemes' do. Dynamo alone (``backend="eager"``) covers those; AOTAutograd
(``aot_eager``, which traces the backward and applies selective checkpointing's policy) runs the
cases with a code path of their own at 2 blocks, where tracing is cheap.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo as dynamo
from torch import Tensor
from torch._dynamo.utils import counters

from siamesenorm.compute import use_path
from siamesenorm.models import LanguageModel, LMConfig
from siamesenorm.models.checkpointing import set_activation_checkpointing
from siamesenorm.nn.fused import fused_enabled
from siamesenorm.schemes import list_schemes

# mHC's Sinkhorn iterations unroll in the graph; 2 keep tracing short (the code path is the same:
# every loop body runs, deepseek_v4's ``iters - 1`` one too).
SCHEME_OPTIONS = {"mhc": {"sinkhorn_iters": 2}}
# (scheme, scheme options, model options, activation checkpointing): every option that changes
# the code a step runs
OPTION_CASES = [
    ("siamese", {"form": "hybrid_pre"}, {}, "none"),
    ("siamese", {"topology": "single"}, {}, "none"),
    ("attn_res", {"block_size": 4}, {}, "none"),
    ("hyper", {"n_streams": 1, "fracs": 2}, {}, "none"),
    ("hyper", {"dynamic": False}, {}, "none"),
    ("pre", {}, {"norm": "dyt"}, "none"),
    ("siamese", {}, {"norm": "dyt"}, "none"),
    ("pre", {}, {"norm": "derf"}, "none"),
    ("siamese", {}, {"norm": "derf"}, "none"),
    ("siamese", {"form": "hybrid_pre"}, {"norm": "layernorm"}, "none"),
    ("pre", {}, {"value_residual": True}, "none"),
    ("siamese", {}, {"value_residual": True, "value_residual_mix": "learned"}, "none"),
    ("pre", {}, {"depth_attention": True, "n_kv_heads": 1}, "none"),
    ("siamese", {}, {"depth_attention": True, "depth_attention_stride": 1}, "none"),
    ("pre", {}, {"qk_norm": True}, "none"),
    # the tensors attention hands to later layers flow through each checkpointed region
    ("pre", {}, {"value_residual": True}, "sublayer"),
    ("siamese", {}, {"value_residual": True}, "selective"),
    ("siamese", {}, {"value_residual": True, "value_residual_mix": "learned"}, "sublayer"),
    ("pre", {}, {"value_residual": True, "value_residual_mix": "learned"}, "selective"),
    ("siamese", {}, {"depth_attention": True, "depth_attention_stride": 1}, "sublayer"),
    ("pre", {}, {"depth_attention": True, "n_kv_heads": 1}, "selective"),
    ("siamese", {}, {}, "sublayer"),
    ("siamese", {}, {}, "selective"),
    ("siamese", {"form": "hybrid_pre"}, {}, "selective"),
    ("mhc", {}, {}, "sublayer"),
    ("mhc", {"mixing": "deepseek_v4"}, {}, "none"),
    ("mhc", {"mixing": "lite"}, {}, "none"),
    ("attn_res", {}, {}, "selective"),
]
SCHEME_CASES = [(name, SCHEME_OPTIONS.get(name, {}), {}, "none") for name in list_schemes()]
OPTION_CASES = [(name, {**SCHEME_OPTIONS.get(name, {}), **options}, model, ac)
                for name, options, model, ac in OPTION_CASES]
CASES = SCHEME_CASES + OPTION_CASES


def _id(case) -> str:
    name, options, model, ac = case
    parts = [name, *(f"{k}={v}" for k, v in {**options, **model}.items() if k != "sinkhorn_iters")]
    return "-".join(parts + ([f"ac={ac}"] if ac != "none" else []))


@pytest.fixture
def strict_dynamo():
    """A clean dynamo with a recompile limit of 1 that fails instead of falling back to eager."""
    dynamo.reset()
    counters.clear()
    with dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        yield
    dynamo.reset()


def _model(name, options, model_options, ac, layers):
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=64, dim=32, n_layers=layers, n_heads=2, max_seq_len=16, scheme=name,
                   scheme_options=dict(options), **model_options)
    model = LanguageModel(cfg).train()
    set_activation_checkpointing(model, ac)
    return model


def _steps(model, fn, n=2) -> list[Tensor]:
    gen = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(n):
        x = torch.randint(0, 64, (2, 17), generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fn(x[:, :-1], x[:, 1:]).loss
        loss.backward()
        losses.append(loss.detach())
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return [*losses, *grads]



def test_the_lean_path_is_off_while_compiling():
    """Under compile the plain composition runs (Inductor fuses and recomputes it), so the lean
    and reference paths are one graph."""
    def pick(x):
        return x + 1 if fused_enabled() else x - 1

    x = torch.zeros(3)
    assert fused_enabled() and torch.equal(pick(x), x + 1)
    dynamo.reset()
    assert torch.equal(torch.compile(pick, backend="eager", fullgraph=True)(x), x - 1)
    dynamo.reset()


def _one_graph(case, layers: int) -> None:
    """The lean path (the default, whatever ``SIAMESENORM_PATH`` says); the reference path:
    :func:`test_the_reference_path_compiles_as_one_graph`."""
    model = _model(*case, layers=layers)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with use_path("kernels"):
        _steps(model, compiled)
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("case", SCHEME_CASES, ids=_id)
def test_the_training_step_is_one_graph_at_12_blocks(case, strict_dynamo):
    _one_graph(case, layers=12)


@pytest.mark.parametrize("case", OPTION_CASES, ids=_id)
def test_each_option_s_training_step_is_one_graph(case, strict_dynamo):
    _one_graph(case, layers=4)


def test_the_reference_path_compiles_as_one_graph(strict_dynamo):
    """As the lean path does (every case above, siamese-form=hybrid_pre's among them)."""
    model = _model("siamese", {"form": "hybrid_pre"}, {}, "none", layers=4)
    with use_path("reference"):
        _steps(model, torch.compile(model, backend="eager", fullgraph=True))
    assert counters["stats"]["unique_graphs"] == 1


AOT_CASES = [c for c in CASES if c[0] in ("siamese", "mhc", "attn_res", "hyper") or c[3] != "none"]


@pytest.mark.parametrize("case", AOT_CASES, ids=_id)
def test_forward_and_backward_trace_through_aot_autograd(case, strict_dynamo):
    """The backward traces too, and the compiled step's loss and gradients are those of eager
    without checkpointing."""
    model = _model(*case, layers=2)
    set_activation_checkpointing(model, "none")
    eager = _steps(model, model)
    set_activation_checkpointing(model, case[3])
    compiled = _steps(model, torch.compile(model, backend="aot_eager", fullgraph=True))
    assert counters["stats"]["unique_graphs"] == 1
    for a, b in zip(compiled, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)
