"""AttnRes's depth mix kernel (siamesenorm::depth_mix) against its equations written out in float64,
and an AttnRes model with the kernel against one without it.

Without CUDA the kernel runs under Triton's interpreter on the CPU (tests/triton_interpreter.py).
"""

import importlib

import pytest
import torch

from triton_interpreter import (
    CUDA,
    DEVICE,
    collect,
    compiles_to_one_call_each,
    fresh_process_test,
    import_triton,
    interpreted,
    interpreter,  # noqa: F401  (the autouse fixture)
    without_first_use_checks,
)

triton = import_triton()

from siamesenorm.kernels.depth_mix import MAX_SOURCES, depth_mix_kernel_runs, fused_depth_mix  # noqa: E402
from siamesenorm.nn.depth_mix import depth_mix  # noqa: E402
from siamesenorm.nn.norms import build_norm  # noqa: E402

IN_PROCESS = CUDA or interpreted("siamesenorm.kernels._triton_depth_mix", "_depth_mix_fwd")
test_in_fresh_process = fresh_process_test(__file__)
KEY_EPS, NORM_EPS = 1e-6, 1e-5


# ---- the reference: a_j = softmax_j(w . (g * v_j / rms(v_j))); x = sum_j a_j v_j; norm(x) (float64) ----
def ref_mix(sources, query, gain, weight, bias, kind):
    logits = []
    for v in sources:
        key = v / torch.sqrt((v * v).mean(-1, keepdim=True) + KEY_EPS) * gain
        logits.append((key * query).sum(-1))
    e = [torch.exp(lg - torch.stack(logits).amax(0)) for lg in logits]
    x = sum(ej.unsqueeze(-1) * v for ej, v in zip(e, sources)) / sum(e).unsqueeze(-1)
    if kind == "none":
        return x
    if kind == "layernorm":
        x = x - x.mean(-1, keepdim=True)
    x = x / torch.sqrt((x * x).mean(-1, keepdim=True) + NORM_EPS)
    x = x if weight is None else x * weight
    return x if bias is None else x + bias


def rounded(t, dtype):
    """``t`` rounded to ``dtype`` as the kernel rounds: to nearest on a GPU; Triton 3.9's interpreter
    truncates float32 to bf16 (drops the low 16 bits)."""
    if dtype == torch.bfloat16 and not CUDA:
        return (t.float().view(torch.int32) & -65536).view(torch.float32).double()
    return t.to(dtype).double()


def check(n, d, kind, affine=True, dtype=torch.float32, lead=(3,), seed=0):
    """The mix's value and the gradients of every source, the query, the key gain and the norm's
    weight and bias against the reference's: float32 to 1e-5, bf16 and fp16 to their rounding."""
    gen = torch.Generator().manual_seed(seed)
    sources = [torch.randn(*lead, d, generator=gen, dtype=torch.float64) * (1 + j % 3) for j in range(n)]
    query, gain = torch.randn(d, generator=gen, dtype=torch.float64), 1 + 0.3 * torch.randn(d, generator=gen)
    norm = None if kind == "none" else build_norm(kind, d, NORM_EPS, affine=affine).to(DEVICE)
    params = [] if norm is None else [p for p in (norm.weight, getattr(norm, "bias", None)) if p is not None]
    with torch.no_grad():
        for p in params:
            p.copy_(1 + 0.3 * torch.randn(d, generator=gen))
    got_in = [v.to(DEVICE, dtype).requires_grad_() for v in sources]
    small = [t.to(DEVICE, torch.float32).requires_grad_() for t in (query, gain)]
    assert depth_mix_kernel_runs(tuple(got_in), small[0], kind)
    out = depth_mix(tuple(got_in), small[0], small[1], KEY_EPS, norm)
    assert out.dtype == dtype and out.shape == (*lead, d)
    up = rounded(torch.randn(out.shape, generator=gen, dtype=torch.float64), dtype)
    inputs = [*got_in, *small, *params]
    grads = torch.autograd.grad(out, inputs, up.to(DEVICE, dtype))
    ref_in = [t.detach().cpu().double().requires_grad_() for t in inputs]
    weight = bias = None
    if norm is not None and affine:
        weight, bias = ref_in[n + 2], (ref_in[n + 3] if kind == "layernorm" else None)
    ref = ref_mix(ref_in[:n], ref_in[n], ref_in[n + 1], weight, bias, kind)
    ref_grads = torch.autograd.grad(ref, ref_in, up)
    rtol = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    atol = 1e-5 if dtype == torch.float32 else rtol
    torch.testing.assert_close(out.cpu().double(), ref.detach(), rtol=rtol, atol=atol)
    for g, r, t in zip(grads, ref_grads, inputs, strict=True):
        assert g.dtype == t.dtype
        torch.testing.assert_close(g.cpu().double(), r, rtol=rtol, atol=atol)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 9])
def test_float32_source_counts(n):
    check(n, 24, "none", seed=n)


@pytest.mark.parametrize("kind, affine, d", [("rmsnorm", True, 37), ("rmsnorm", False, 5),
                                             ("layernorm", True, 130), ("layernorm", False, 1)])
def test_norms_and_masked_tails(kind, affine, d):
    """Widths 37, 130 (blocks of 64 and 256), 5 and 1, each norm with and without affine parameters."""
    check(3, d, kind, affine, seed=d)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision(dtype):
    check(4, 33, "layernorm", dtype=dtype, lead=(2, 3), seed=3)
    check(2, 16, "none", dtype=dtype, seed=4)


def test_many_sources():
    check(MAX_SOURCES, 8, "rmsnorm", lead=(2,), seed=5)


def test_mixed_source_dtypes_and_leading_shapes():
    """A float32 embedding beside bf16 branch outputs (autocast's sources): each gradient in its
    source's dtype, the result in the one asked for."""
    gen = torch.Generator().manual_seed(6)
    exact = [torch.randn(2, 3, 10, generator=gen, dtype=torch.float64) for _ in range(3)]
    dtypes = (torch.float32, torch.bfloat16, torch.bfloat16)
    exact = [e.to(t).double() for e, t in zip(exact, dtypes)]
    got_in = [e.to(DEVICE, t).requires_grad_() for e, t in zip(exact, dtypes)]
    u = torch.randn(10, generator=gen).to(DEVICE).requires_grad_()
    out = fused_depth_mix(tuple(got_in), u, eps=KEY_EPS, dtype=torch.float32)
    assert out.dtype == torch.float32
    grads = torch.autograd.grad(out.square().sum(), [*got_in, u])
    ref_in = [t.detach().cpu().double().requires_grad_() for t in (*got_in, u)]
    ref = ref_mix(ref_in[:3], ref_in[3], torch.ones(10, dtype=torch.float64), None, None, "none")
    ref_grads = torch.autograd.grad(ref.square().sum(), ref_in)
    torch.testing.assert_close(out.cpu().double(), ref, rtol=1e-5, atol=1e-5)
    for g, r, t in zip(grads, ref_grads, (*got_in, u), strict=True):
        assert g.dtype == t.dtype
        tol = 1e-4 if t.dtype == torch.float32 else 2**-7
        torch.testing.assert_close(g.cpu().double(), r, rtol=tol, atol=tol)


def test_keeps_the_sources_u_and_row_statistics():
    sources = [torch.randn(5, 8, device=DEVICE, requires_grad=True) for _ in range(3)]
    u = torch.randn(8, device=DEVICE, requires_grad=True)
    w = torch.ones(8, device=DEVICE, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fused_depth_mix(tuple(sources), u, w, kind="rmsnorm")
    assert saved[:2] == [u, w] and saved[-3:] == sources and len(saved) == 6 and saved[2].shape == (2, 5)
    empty = [torch.zeros(0, 8, device=DEVICE, requires_grad=True) for _ in range(2)]
    got = fused_depth_mix(tuple(empty), u, w, kind="rmsnorm")
    got.sum().backward()
    assert got.shape == (0, 8) and all(t.grad.shape == t.shape for t in empty)
    assert torch.equal(w.grad, torch.zeros(8, device=DEVICE))


def test_pytorch_path_and_bad_arguments(monkeypatch):
    """float64, more than 32 sources and DyT take the PyTorch path, as does SIAMESENORM_PATH=lean;
    the op refuses what it cannot take."""
    sources = tuple(torch.randn(3, 6, device=DEVICE) for _ in range(2))
    u = torch.randn(6, device=DEVICE)
    assert depth_mix_kernel_runs(sources, u, "layernorm")
    assert not depth_mix_kernel_runs(tuple(v.double() for v in sources), u, "none")
    assert not depth_mix_kernel_runs(sources * 17, u, "none")
    assert not depth_mix_kernel_runs(sources, u, "dyt")
    monkeypatch.setenv("SIAMESENORM_PATH", "lean")
    assert not depth_mix_kernel_runs(sources, u, "none")
    got = fused_depth_mix(sources, u, kind="rmsnorm", eps=KEY_EPS, norm_eps=NORM_EPS)
    want = ref_mix([v.double() for v in sources], u.double(), 1.0, None, None, "rmsnorm")
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    op = torch.ops.siamesenorm.depth_mix
    with pytest.raises(ValueError, match="differ in shape"):
        op([sources[0], sources[1][:2]], u, None, None, "none", 1e-6, 1e-6, torch.float32)
    with pytest.raises(ValueError, match="u must have shape"):
        op(list(sources), u[:3], None, None, "none", 1e-6, 1e-6, torch.float32)
    with pytest.raises(ValueError, match="takes no bias"):
        op(list(sources), u, None, u, "rmsnorm", 1e-6, 1e-6, torch.float32)
    with pytest.raises(ValueError, match="1 to 32 sources"):
        op([], u, None, None, "none", 1e-6, 1e-6, torch.float32)


# ---- registration: opcheck and torch.compile --------------------------------------------------------
def test_opcheck():
    """Schema, autograd registration and fakes (compile: the two tests below)."""
    gen = torch.Generator().manual_seed(7)
    sources = [torch.randn(2, 3, 10, generator=gen).to(DEVICE).requires_grad_() for _ in range(3)]
    u, w, b = (torch.randn(10, generator=gen).to(DEVICE).requires_grad_() for _ in range(3))
    op = torch.ops.siamesenorm.depth_mix.default
    quick = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(op, (sources, u, w, b, "layernorm", KEY_EPS, NORM_EPS, torch.float32),
                          test_utils=quick)
    low = [v.detach().bfloat16().requires_grad_() for v in sources[:2]]
    torch.library.opcheck(op, (low, u, None, None, "none", KEY_EPS, NORM_EPS, torch.bfloat16),
                          test_utils=quick)
    _, stats = op(sources, u, w, None, "rmsnorm", KEY_EPS, NORM_EPS, torch.float32)
    torch.library.opcheck(torch.ops.siamesenorm.depth_mix_backward.default,
                          (torch.randn(2, 3, 10, device=DEVICE), [v.detach() for v in sources], u.detach(),
                           w.detach(), None, stats, "rmsnorm", KEY_EPS, NORM_EPS, True, False),
                          test_utils=quick)


def test_compile_traces_one_call():
    """Under ``torch.compile`` (one graph) the mix and its norm are one call of the op each way,
    with eager's values and gradients."""
    norm = build_norm("layernorm", 12, NORM_EPS).to(DEVICE)

    def f(a, b, c, query, gain):
        return depth_mix((a, b.tanh(), c), query, gain, KEY_EPS, norm).square().sum()

    gen = torch.Generator().manual_seed(8)
    ins = [torch.randn(*s, generator=gen).to(DEVICE).requires_grad_() for s in ((4, 12),) * 3 + ((12,),) * 2]
    compiles_to_one_call_each(f, ins, [torch.ops.siamesenorm.depth_mix], [norm.weight, norm.bias])


# ---- the kernel inside AttnRes -----------------------------------------------------------------------
@pytest.mark.parametrize("layers, block_size, path", [(2, None, "lean"), (1, 2, "compiled")])
def test_attn_res_with_the_kernel_equals_attn_res_without(layers, block_size, path, monkeypatch):
    """An AttnRes language model (full form, 4 sublayers; one block of 2, whose partial sum is a
    source of the exit) whose every mix runs the kernel (lean path; compiled) has the loss and
    gradients of the reference path without kernels."""
    from siamesenorm.compute import use_path
    from siamesenorm.models import LanguageModel, LMConfig

    kernel_module = importlib.import_module("siamesenorm.kernels.depth_mix")
    without_first_use_checks(monkeypatch)
    calls = []
    real = kernel_module._kernels
    monkeypatch.setattr(kernel_module, "_kernels", lambda: calls.append(1) or real())
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=32, dim=16, n_layers=layers, n_heads=2, max_seq_len=8, scheme="attn_res",
                   scheme_options={"block_size": block_size}, norm="layernorm" if block_size else "rmsnorm")
    model = LanguageModel(cfg).to(DEVICE)
    with torch.no_grad():                # pseudo-queries away from zero: weights far from uniform
        for name, p in model.named_parameters():
            if name.startswith("scheme."):
                p.add_(0.5 * torch.randn_like(p))
    x = torch.randint(0, 32, (2, 9), device=DEVICE)

    def loss_and_grads(step):
        loss = step(x[:, :-1], x[:, 1:]).loss
        grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
        return [loss, *(g for g in grads if g is not None)]

    if path == "compiled":
        torch._dynamo.reset()
        got = loss_and_grads(torch.compile(model, backend="aot_eager", fullgraph=True))
    else:
        with use_path("reference" if path == "reference" else "kernels"):
            got = loss_and_grads(model)
    mixes = 2 * layers                   # the entries of sublayers 1.. and the exit
    assert len(calls) == 2 * mixes, "the kernel did not run forward and backward in each mix"
    monkeypatch.setenv("SIAMESENORM_PATH", "lean")
    with use_path("reference"):
        want = loss_and_grads(model)
    assert len(calls) == 2 * mixes
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# Collect what can run here: the tests, or (no GPU, Triton loaded without its interpreter) the test
# that runs them in a fresh process.
collect(globals(), IN_PROCESS)
