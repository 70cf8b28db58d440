"""The memory-lean path (siamesenorm.nn.fused) against the plain composition of modules.

Values and gradients must agree (float64, 1e-10) for every form and option of SiameseNorm and for
the other schemes the lean path touches; the lean functions pass gradcheck; and what they keep for
backward is counted, so the memory gain cannot silently disappear.
"""

from __future__ import annotations

import functools
import itertools
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from siamesenorm.compute import use_path
from siamesenorm.models import LanguageModel, LMConfig
from siamesenorm.models.checkpointing import saved_activation_bytes
from siamesenorm.nn.fused import (
    fused_enabled,
    rms_norm,
    stream_entry,
    stream_update,
)
from siamesenorm.nn.norms import LayerNorm, RMSNorm, build_norm
from siamesenorm.schemes import build_scheme

F64 = torch.float64


def _graph_names(t: torch.Tensor) -> set[str]:
    """Names of every autograd node behind ``t``."""
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo.extend(f for f, _ in node.next_functions)
    return names


def _randomise(module: nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def _run(scheme, branches, h):
    """Drive ``scheme`` over toy branches; return output and every gradient."""
    params = [h, *scheme.parameters(), *branches.parameters()]
    for p in params:
        p.grad = None
    state = scheme.enter(h)
    for i, br in enumerate(branches):
        state = scheme.step(state, i, lambda u, br=br: torch.tanh(br(u)))
    out = scheme.exit(state)
    out.square().sum().backward()
    return out.detach(), [None if p.grad is None else p.grad.clone() for p in params]


SIAMESE_OPTIONS = list(itertools.product(
    ("post_pre", "hybrid_pre"), (True, False), (True, False), ("siamese", "single", "resi_dual"),
    ("normed_sum", "sum"), (True, False), (True, False), ("layernorm", "rmsnorm")))


@pytest.mark.parametrize("form,input_norm,depth_scale,topology,merge,branch_affine,final_norm,norm",
                         SIAMESE_OPTIONS)
def test_siamese_lean_equals_reference_for_every_option(form, input_norm, depth_scale, topology,
                                                        merge, branch_affine, final_norm, norm):
    torch.manual_seed(0)
    scheme = build_scheme("siamese", 8, 2, form=form, input_norm=input_norm,
                          depth_scale=depth_scale, topology=topology, merge=merge,
                          branch_affine=branch_affine, final_norm=final_norm, norm=norm,
                          dtype=F64)
    _randomise(scheme)
    branches = nn.ModuleList(nn.Linear(8, 8, dtype=F64) for _ in range(4))
    h = torch.randn(3, 5, 8, dtype=F64, requires_grad=True)
    out, grads = _run(scheme, branches, h)
    with use_path("reference"):
        ref_out, ref_grads = _run(scheme, branches, h)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-10)
    for g, r in zip(grads, ref_grads, strict=True):
        assert (g is None) == (r is None)
        if g is not None:
            torch.testing.assert_close(g, r, rtol=0, atol=1e-10)


def test_lean_path_is_taken_and_reference_path_is_plain() -> None:
    scheme = build_scheme("siamese", 8, 1, dtype=F64)
    h = torch.randn(2, 8, dtype=F64, requires_grad=True)
    out = scheme.exit(scheme.step(scheme.enter(h), 0, torch.tanh))
    assert "_StreamEntryBackward" in _graph_names(out)
    assert "_StreamUpdateBackward" in _graph_names(out)
    with use_path("reference"):
        plain = scheme.exit(scheme.step(scheme.enter(h), 0, torch.tanh))
    assert not {"_StreamEntryBackward", "_StreamUpdateBackward"} & _graph_names(plain)
    with torch.no_grad():
        nograd = scheme.exit(scheme.step(scheme.enter(h), 0, torch.tanh))
    assert nograd.grad_fn is None
    torch.testing.assert_close(nograd, plain.detach(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("scheme,options", [
    ("pre", {}), ("siamese", {}), ("siamese", {"form": "hybrid_pre"}), ("hyper", {}),
    ("hyper", {"n_streams": 1, "fracs": 4}), ("mhc", {}), ("hybridnorm", {}), ("peri_ln", {}),
    ("attn_res", {}), ("attn_res", {"block_size": 3})])
@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
def test_language_model_lean_equals_reference(scheme, options, norm) -> None:
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, max_seq_len=12, scheme=scheme,
                   scheme_options=options, norm=norm)
    model = LanguageModel(cfg, dtype=F64)
    _randomise(model, seed=1)
    x = torch.randint(0, 32, (2, 13))
    results = []
    for ref in (False, True):
        model.zero_grad(set_to_none=True)
        with use_path("reference" if ref else "kernels"):
            loss = model(x[:, :-1], x[:, 1:]).loss
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=1e-12)
    for g, r in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-10)


# ---- gradcheck ----------------------------------------------------------------------------------
def _norm(kind: str, affine: bool) -> nn.Module:
    m = build_norm(kind, 5, 1e-5, affine=affine, dtype=F64)
    _randomise(m)
    return m


@pytest.mark.parametrize("affine", [True, False])
def test_rms_norm_gradcheck(affine) -> None:
    x = torch.randn(2, 3, 5, dtype=F64, requires_grad=True)
    w = torch.randn(5, dtype=F64, requires_grad=True) if affine else None
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, 1e-5), (x, w))
    expected = x / torch.sqrt(x.square().mean(-1, keepdim=True) + 1e-5) * (1 if w is None else w)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), expected, rtol=0, atol=1e-12)


ENTRY_VARIANTS = list(itertools.product(("norm", "gain", "none"), (True, False), (True, False),
                                        ("layernorm", "rmsnorm", "dyt"), (True, False)))


@pytest.mark.parametrize("x_kind,with_y,with_in,kind,affine", ENTRY_VARIANTS)
def test_stream_entry_gradcheck(x_kind, with_y, with_in, kind, affine) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, dtype=F64, requires_grad=True)
    y = torch.randn(2, 3, 5, dtype=F64, requires_grad=True)
    x_norm = _norm(kind, affine) if x_kind == "norm" else None
    gain = torch.randn(5, dtype=F64, requires_grad=True) if x_kind == "gain" else None
    y_norm, in_norm = (_norm(kind, affine) if with_y else None), (_norm(kind, affine) if with_in else None)
    params = [p for m in (x_norm, y_norm, in_norm) if m is not None for p in m.parameters()]

    def fn(x, y, *ps):
        return stream_entry(x, y, x_norm=x_norm, x_gain=gain, y_norm=y_norm, in_norm=in_norm)

    inputs = (x, y, *params, *([gain] if gain is not None else []))
    assert torch.autograd.gradcheck(fn, inputs)
    # the same tensor as both streams (SiameseNorm's first sublayer)
    assert torch.autograd.gradcheck(lambda h: fn(h, h), (x,))


def test_stream_update_gradcheck_and_value() -> None:
    x, y, o = (torch.randn(2, 4, dtype=F64, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradcheck(lambda x, y, o: stream_update(x, y, o, 3.0), (x, y, o))
    nx, ny = stream_update(x, y, o, 2.0)
    torch.testing.assert_close(nx, x + o / 2.0, rtol=0, atol=1e-15)
    torch.testing.assert_close(ny, y + o, rtol=0, atol=0)


# ---- what is kept for backward ------------------------------------------------------------------
def _hooked_bytes(fn, exclude: set) -> int:
    """Bytes of the distinct storages autograd saves while ``fn`` runs (parameters excluded)."""
    seen: dict = {}

    def pack(t):
        ref = StorageWeakRef(t.untyped_storage())
        if ref not in exclude:
            seen[ref] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm", "dyt"])
def test_siamese_step_keeps_only_streams_branch_input_and_row_statistics(norm) -> None:
    rows, dim = 4 * 16, 32
    scheme = build_scheme("siamese", dim, 2, norm=norm)
    branch = nn.Linear(dim, dim, bias=False)          # saves exactly its input, the branch input
    x = torch.randn(4, 16, dim, requires_grad=True)
    y = torch.randn(4, 16, dim, requires_grad=True)
    params = {StorageWeakRef(p.untyped_storage()) for p in [*scheme.parameters(), *branch.parameters()]}
    # mean and rstd, or rstd (float32 per row); DyT none (its backward reads its input)
    stats_per_norm = {"layernorm": 2, "rmsnorm": 1, "dyt": 0}[norm]
    residual = rows * dim * 4
    expected = 3 * residual + 3 * stats_per_norm * rows * 4
    lean = _hooked_bytes(lambda: scheme.step((x, y), 1, branch), params)
    assert lean == expected
    with use_path("reference"):
        plain = _hooked_bytes(lambda: scheme.step((x, y), 1, branch), params)
    assert plain >= lean + residual                    # the sum feeding LN^in, at least


def test_hybrid_attention_entry_keeps_streams_and_one_norm_statistics() -> None:
    rows, dim = 8 * 4, 16
    scheme = build_scheme("siamese", dim, 1, form="hybrid_pre", norm="rmsnorm")
    branch = nn.Linear(dim, dim, bias=False)
    x, y = (torch.randn(8, 4, dim, requires_grad=True) for _ in range(2))
    params = {StorageWeakRef(p.untyped_storage()) for p in [*scheme.parameters(), *branch.parameters()]}
    lean = _hooked_bytes(lambda: scheme.step((x, y), 0, branch), params)
    assert lean == 3 * rows * dim * 4 + rows * 4


@pytest.mark.parametrize("scheme,options,norm,most", [
    ("siamese", {}, "rmsnorm", 1.10), ("siamese", {"form": "hybrid_pre"}, "rmsnorm", 1.12),
    ("hyper", {}, "rmsnorm", 1.25), ("attn_res", {}, "rmsnorm", 1.02),
    ("attn_res", {"block_size": 4}, "rmsnorm", 1.02), ("siamese", {}, "dyt", 1.10),
    ("keel", {}, "rmsnorm", 1.05)])
def test_saved_activation_ratio_to_pre_on_meta(scheme, options, norm, most) -> None:
    """The issue's targets at dim 256 / 12 blocks / 8 x 256 tokens, counted on the meta device
    (no memory used; meta figures equal CPU ones), and the plain path above them; with DyT against
    Pre-Norm with DyT."""
    pre, pre_ref = _saved_on_meta("pre", (), norm, False), _saved_on_meta("pre", (), norm, True)
    assert pre < pre_ref
    options = tuple(sorted(options.items()))
    assert _saved_on_meta(scheme, options, norm, False) / pre <= most
    assert _saved_on_meta(scheme, options, norm, True) / pre_ref > most


@functools.cache
def _saved_on_meta(name: str, options: tuple, norm: str, ref: bool) -> int:
    """The bytes a training forward of the test's model keeps, on the meta device: a count that
    depends on its arguments alone (Pre-Norm's, each case's baseline, is counted once a norm)."""
    cfg = LMConfig(vocab_size=256, dim=256, n_layers=12, n_heads=4, max_seq_len=256,
                   scheme=name, scheme_options=dict(options), norm=norm)
    model = LanguageModel(cfg, device="meta")
    x = torch.zeros(8, 257, dtype=torch.long, device="meta")
    with use_path("reference" if ref else "kernels"):
        return saved_activation_bytes(lambda: model(x[:, :-1], x[:, 1:]).loss)


def test_qkv_norm_outputs_are_recomputed_not_kept() -> None:
    # HybridNorm asks for QKV-norm in every attention sublayer
    cfg = LMConfig(vocab_size=32, dim=32, n_layers=2, n_heads=2, max_seq_len=16,
                   scheme="hybridnorm")
    model = LanguageModel(cfg)
    x = torch.randint(0, 32, (2, 17))
    lean = saved_activation_bytes(lambda: model(x[:, :-1], x[:, 1:]).loss)
    with use_path("reference"):
        plain = saved_activation_bytes(lambda: model(x[:, :-1], x[:, 1:]).loss)
    # q, k and v after their norms: three (2 x 16 x 32) float32 tensors per attention sublayer
    assert plain - lean >= 2 * 3 * (2 * 16 * 32 * 4)


# ---- switches, autocast, compile ----------------------------------------------------------------
def test_environment_variable_turns_the_lean_path_off() -> None:
    code = "from siamesenorm.nn.fused import fused_enabled; print(fused_enabled())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"SIAMESENORM_PATH": "reference", "PATH": ""})
    assert out.stdout.strip() == "False"
    assert fused_enabled()


def test_autocast_lean_matches_reference() -> None:
    """Under bf16 autocast both paths agree to bf16 precision (the lean norms compute in float32,
    as autocast does for PyTorch's norms; PyTorch's RMSNorm of a bf16 q under autocast does not)."""
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=32, dim=32, n_layers=2, n_heads=2, max_seq_len=16,
                   scheme="siamese", scheme_options={"form": "hybrid_pre"})
    model = LanguageModel(cfg)
    x = torch.randint(0, 32, (2, 17))
    losses = []
    for ref in (False, True):
        with use_path("reference" if ref else "kernels"), torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x[:, :-1], x[:, 1:])
        losses.append(out.loss)
    assert losses[0].dtype == losses[1].dtype
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-3, atol=1e-3)


def test_torch_compile_runs_the_lean_path() -> None:
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, max_seq_len=8, scheme="siamese")
    model = LanguageModel(cfg)
    x = torch.randint(0, 32, (2, 9))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    loss = compiled(x[:, :-1], x[:, 1:]).loss
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with use_path("reference"):
        ref = model(x[:, :-1], x[:, 1:]).loss
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    for g, p in zip(grads, model.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)


def test_norm_modules_use_lean_rms_norm() -> None:
    x = torch.randn(3, 8, requires_grad=True)
    assert "_RMSNormBackward" in _graph_names(RMSNorm(8)(x))
    assert "NativeLayerNormBackward0" in _graph_names(LayerNorm(8)(x))


def test_readme_benchmark_command_runs() -> None:
    """The README's benchmark command works as shown (with fewer rounds, to stay quick)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    lines = re.findall(r"^python (benchmarks/memory\.py.*)$", readme, flags=re.M)
    assert lines
    for line in lines:
        args = line.split() + ["--rounds", "1", "--warmup", "0"]
        out = subprocess.run([sys.executable, *args], cwd=root, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, out.stderr
        table = [row.split() for row in out.stdout.splitlines()]
        assert any(row[:2] == ["siamese", "lean"] for row in table), out.stdout
        if "--reference" in args:
            assert any(row[:2] == ["siamese", "plain"] for row in table), out.stdout
