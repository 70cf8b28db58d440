"""The RMS-normalised projection kernel (siamesenorm::rms_project) against its equation written out
in float64 (mHC with the kernel against mHC without it: tests/test_kernels_mix.py).

Without CUDA the kernel runs under Triton's interpreter on the CPU (tests/triton_interpreter.py).
"""


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
)

triton = import_triton()

from siamesenorm.kernels.rms_project import MAX_COLUMNS, rms_project, rms_project_kernel_runs  # noqa: E402

IN_PROCESS = CUDA or interpreted("siamesenorm.kernels._triton_rms_project", "_rms_project_fwd")
test_in_fresh_process = fresh_process_test(__file__)
EPS = 1e-6


# ---- the reference: z_t = (x_t @ w) / sqrt(mean_k x_tk^2 + eps), per row t (float64) -----------------
def ref(x, w):
    return (x @ w) / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS)


def check(lead, k, m, dtype=torch.float32, dot=None, seed=0, scale=3.0):
    """Value and both gradients against the reference: float32 to 1e-5, bf16 and fp16 inputs (and
    TF32 products, ``dot`` bf16) to their rounding; gradients in the inputs' dtypes."""
    gen = torch.Generator().manual_seed(seed)
    x = (scale * torch.randn(*lead, k, generator=gen, dtype=torch.float64)).to(DEVICE, dtype).requires_grad_()
    w = torch.randn(k, m, generator=gen, dtype=torch.float64).to(DEVICE, dtype).requires_grad_()
    assert rms_project_kernel_runs(x, w)
    z = rms_project(x, w, EPS, dot)
    assert z.dtype == torch.float32 and z.shape == (*lead, m)
    up = torch.randn(z.shape, generator=gen, dtype=torch.float64)
    dx, dw = torch.autograd.grad(z, (x, w), up.to(DEVICE, torch.float32))
    assert dx.dtype == dtype and dw.dtype == dtype
    xr, wr = (t.detach().cpu().double().requires_grad_() for t in (x, w))
    zr = ref(xr, wr)
    dxr, dwr = torch.autograd.grad(zr, (xr, wr), up)
    exact = dtype == torch.float32 and dot in (None, torch.float32)
    tol = 1e-5 if exact else {torch.float32: 2**-10, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    for got, want in ((z, zr), (dx, dxr), (dw, dwr)):
        # relative to the largest entry: a sum over the width of terms of either sign
        torch.testing.assert_close(got.cpu().double(), want.detach(), rtol=tol,
                                   atol=tol * max(1.0, want.abs().max().item()))


@pytest.mark.parametrize("lead, k, m", [((5,), 37, 24), ((70,), 130, 24), ((2, 3), 1, 3), ((4,), 200, 130),
                                        ((33,), 64, MAX_COLUMNS), ((1,), 3, 1)])
def test_float32_shapes_with_masked_tails(lead, k, m):
    """Widths and column counts off and on the tiles (64 wide, 16 to 256 columns), one to three
    blocks of 32 rows; (70, 130): three tiles of width, two splits of rows in backward."""
    check(lead, k, m, seed=k + m)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision(dtype):
    check((3, 11), 96, 24, dtype=dtype, seed=2)


def test_tf32_products_under_autocast_dtype():
    """``dot`` bf16 (what autocast's matmul would take) gives TF32 products: within bf16 rounding."""
    check((40,), 80, 24, dot=torch.bfloat16, seed=3)


def test_large_mean_rows():
    """Rows whose mean is 100x their spread: the statistic is of the raw row, not a centred one."""
    gen = torch.Generator().manual_seed(4)
    x = (100 + torch.randn(6, 50, generator=gen, dtype=torch.float64)).to(DEVICE, torch.float32)
    w = torch.randn(50, 8, generator=gen, dtype=torch.float64).to(DEVICE, torch.float32)
    torch.testing.assert_close(rms_project(x, w, EPS).cpu().double(), ref(x.cpu().double(), w.cpu().double()),
                               rtol=1e-5, atol=1e-5)


def test_one_input_needs_a_gradient_and_no_rows():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, 20, generator=gen).to(DEVICE)
    w = torch.randn(20, 6, generator=gen).to(DEVICE)
    for needs in ((True, False), (False, True)):
        xi, wi = x.clone().requires_grad_(needs[0]), w.clone().requires_grad_(needs[1])
        (g,) = torch.autograd.grad(rms_project(xi, wi, EPS).sum(), [xi if needs[0] else wi])
        xr, wr = x.double().cpu().requires_grad_(needs[0]), w.double().cpu().requires_grad_(needs[1])
        (want,) = torch.autograd.grad(ref(xr, wr).sum(), [xr if needs[0] else wr])
        torch.testing.assert_close(g.cpu().double(), want, rtol=1e-5, atol=1e-5)
    x0, w0 = torch.zeros(0, 20, device=DEVICE, requires_grad=True), w.clone().requires_grad_()
    z = rms_project(x0, w0, EPS)
    assert z.shape == (0, 6)
    dx, dw = torch.autograd.grad(z.sum(), (x0, w0))
    assert dx.shape == (0, 20) and torch.equal(dw, torch.zeros_like(dw))


def test_keeps_its_inputs_and_per_token_outputs_only():
    """Saved for backward: ``x`` and ``w`` themselves, and the float32 ``z`` and ``rstd`` (no
    normalised copy of ``x``)."""
    x = torch.randn(10, 40, device=DEVICE, requires_grad=True)
    w = torch.randn(40, 5, device=DEVICE, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        rms_project(x, w, EPS)
    shapes = sorted(tuple(t.shape) for t in saved)
    assert shapes == [(10,), (10, 5), (10, 40), (40, 5)]
    assert any(t is x for t in saved) and any(t is w for t in saved)


# ---- registration: opcheck and torch.compile --------------------------------------------------------
def test_opcheck():
    x = torch.randn(2, 3, 20, device=DEVICE, requires_grad=True)
    w = torch.randn(20, 7, device=DEVICE, requires_grad=True)
    op = torch.ops.siamesenorm
    torch.library.opcheck(op.rms_project.default, (x, w, EPS, False))
    torch.library.opcheck(op.rms_project.default, (x.detach().bfloat16(), w.detach(), EPS, True))
    z, rstd = op.rms_project(x, w, EPS, False)
    for need_w in (True, False):      # without dw, its empty result too in the fake's dtype
        torch.library.opcheck(op.rms_project_backward.default,
                              (torch.randn_like(z), x.detach(), w.detach().bfloat16(), z.detach(), rstd,
                               EPS, False, True, need_w))


def test_compile_traces_one_call():
    """Under ``torch.compile`` (one graph) the projection is one call of its op each way, with
    eager's values and gradients."""
    def f(x, w):
        return (rms_project(x * 2, w.tanh(), EPS).sigmoid() * x[..., :6]).sum()

    gen = torch.Generator().manual_seed(6)
    ins = [torch.randn(3, 4, 30, generator=gen).to(DEVICE).requires_grad_(),
           torch.randn(30, 6, generator=gen).to(DEVICE).requires_grad_()]
    compiles_to_one_call_each(f, ins, [torch.ops.siamesenorm.rms_project])


# ---- dispatch and arguments -------------------------------------------------------------------------
def test_pytorch_path_where_the_kernel_does_not_run(monkeypatch):
    """float64 and more than 256 columns take plain ops, with the same value; so do the CPU
    without the interpreter and SIAMESENORM_PATH=lean."""
    gen = torch.Generator().manual_seed(7)
    for dt, m in ((torch.float64, 5), (torch.float32, MAX_COLUMNS + 1)):
        x = torch.randn(4, 12, generator=gen, dtype=dt).to(DEVICE)
        w = torch.randn(12, m, generator=gen, dtype=dt).to(DEVICE)
        assert not rms_project_kernel_runs(x, w)
        z = rms_project(x, w, EPS)
        assert z.dtype == torch.promote_types(dt, torch.float32)
        torch.testing.assert_close(z.cpu().double(), ref(x.cpu().double(), w.cpu().double()), rtol=1e-5,
                                   atol=1e-5)
    x, w = torch.randn(4, 12, device=DEVICE), torch.randn(12, 3, device=DEVICE)
    monkeypatch.setenv("SIAMESENORM_PATH", "lean")
    assert not rms_project_kernel_runs(x, w)
    monkeypatch.delenv("SIAMESENORM_PATH")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert rms_project_kernel_runs(x, w) == CUDA


def test_bad_arguments():
    op = torch.ops.siamesenorm.rms_project
    x = torch.randn(4, 12, device=DEVICE)
    with pytest.raises(ValueError, match=r"w \(K, M\) with 0 < M <= 256"):
        op(x, torch.randn(11, 3, device=DEVICE), EPS, False)
    with pytest.raises(ValueError, match="0 < M <= 256"):
        op(x, torch.randn(12, MAX_COLUMNS + 1, device=DEVICE), EPS, False)
    assert not rms_project_kernel_runs(x, torch.randn(11, 3, device=DEVICE))


# Collect what can run here: the tests, or (no GPU, Triton loaded without its interpreter) the test
# that runs them in a fresh process.
collect(globals(), IN_PROCESS)
