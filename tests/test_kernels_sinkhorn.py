"""The Sinkhorn-Knopp kernel (siamesenorm::sinkhorn) against the iterations written out in float64,
and mHC with the kernel against mHC without it.

Without CUDA the kernel runs under Triton's interpreter on the CPU (tests/triton_interpreter.py).
"""

import importlib

import pytest
import torch

from triton_interpreter import (
    CUDA,
    DEVICE,
    collect,
    fresh_process_test,
    import_triton,
    interpreted,
    interpreter,  # noqa: F401  (the autouse fixture)
    loss_and_grads,
    mhc_lm,
    without_first_use_checks,
)

triton = import_triton()

from siamesenorm.kernels import sinkhorn, sinkhorn_kernel_runs  # noqa: E402
from siamesenorm.kernels.sinkhorn import MAX_ITERS  # noqa: E402

IN_PROCESS = CUDA or interpreted("siamesenorm.kernels._triton_sinkhorn", "_sinkhorn_fwd")
test_in_fresh_process = fresh_process_test(__file__)


# ---- the reference: the iterations written out, autograd through them (float64) --------------------
def ref_sinkhorn(logits, iters):
    m = torch.exp(logits)
    for _ in range(iters):
        m = m / m.sum(-1, keepdim=True)
        m = m / m.sum(-2, keepdim=True)
    return m


def check(shape, n, iters, dtype, seed=0):
    """The op's values and logits gradient (random upstream gradient) against the reference's."""
    gen = torch.Generator().manual_seed(seed)
    base = 1.5 * torch.randn(*shape, n, n, generator=gen, dtype=torch.float64)
    up = torch.randn(base.shape, generator=gen, dtype=torch.float64).to(dtype)
    logits = base.to(DEVICE, dtype).requires_grad_()
    assert sinkhorn_kernel_runs(logits, iters)
    out = sinkhorn(logits, iters)
    (grad,) = torch.autograd.grad(out, logits, up.to(DEVICE))
    ref_in = logits.detach().cpu().double().requires_grad_()     # the same (rounded) values
    ref = ref_sinkhorn(ref_in, iters)
    (ref_grad,) = torch.autograd.grad(ref, ref_in, up.double())
    assert out.dtype == dtype and grad.dtype == dtype and out.shape == logits.shape
    # One rounding of each result to ``dtype`` (to nearest on a GPU; Triton 3.9's interpreter
    # truncates to bf16), over float32 arithmetic inside.
    rtol = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    torch.testing.assert_close(out.cpu().double(), ref.detach(), rtol=rtol, atol=1e-5)
    torch.testing.assert_close(grad.cpu().double(), ref_grad, rtol=rtol, atol=1e-5)


@pytest.mark.parametrize("iters", [1, 5, 20])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_float32(n, iters):
    check((7,), n, iters, torch.float32)


@pytest.mark.parametrize("shape", [(1,), (37,), (2, 19), (2, 3, 5)])
@pytest.mark.parametrize("n", [3, 8])
def test_token_counts_and_leading_shapes(shape, n):
    """Token counts that leave a masked tail of the last program (32 tokens a program at n = 3, 8 at
    n = 8: 37 and 38 tokens take 2 and 5 programs), one or more leading axes."""
    check(shape, n, 5, torch.float32, seed=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [3, 4])
def test_low_precision(n, dtype):
    check((2, 9), n, 20, dtype, seed=2)


def test_iteration_limit_and_empty_input():
    """The most iterations the kernel unrolls; none (the start, ``exp(logits - max)``); no tokens."""
    check((5,), 4, MAX_ITERS, torch.float32, seed=3)
    x = torch.randn(5, 3, 3, device=DEVICE, dtype=torch.float64)
    got = torch.ops.siamesenorm.sinkhorn(x.float(), 0)
    torch.testing.assert_close(got.double(), torch.exp(x - x.amax((-2, -1), keepdim=True)))
    empty = torch.zeros(0, 4, 4, device=DEVICE, requires_grad=True)
    out = sinkhorn(empty, 20)
    out.sum().backward()
    assert out.shape == empty.shape and empty.grad.shape == empty.shape


def test_keeps_only_the_logits():
    """Backward keeps the logits alone (it runs the iterations again), not the output or any sum."""
    logits = torch.randn(2, 7, 4, 4, device=DEVICE, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        sinkhorn(logits, 20)
    assert len(saved) == 1 and saved[0] is logits


def test_non_contiguous_logits():
    base = torch.randn(4, 4, 6, device=DEVICE)
    logits = base.transpose(0, 2)[:5].requires_grad_()          # (5, 4, 4), not contiguous
    up = torch.randn(5, 4, 4, device=DEVICE)
    (grad,) = torch.autograd.grad(sinkhorn(logits, 5), logits, up)
    ref_in = logits.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(ref_sinkhorn(ref_in, 5), ref_in, up.double())
    torch.testing.assert_close(grad.double(), want, rtol=1e-5, atol=1e-5)


# ---- registration: opcheck and torch.compile --------------------------------------------------------
def test_opcheck():
    logits = torch.randn(2, 3, 4, 4, device=DEVICE, requires_grad=True)
    torch.library.opcheck(torch.ops.siamesenorm.sinkhorn.default, (logits, 2))
    torch.library.opcheck(torch.ops.siamesenorm.sinkhorn.default, (torch.randn(7, 3, 3, device=DEVICE), 2))
    torch.library.opcheck(torch.ops.siamesenorm.sinkhorn_backward.default,
                          (torch.randn(2, 3, 4, 4, device=DEVICE), logits.detach(), 2))


def test_compile_traces_one_call():
    """Under ``torch.compile`` (one graph) the iterations are one call of the op, with eager's values
    and gradients."""
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, inputs)

    def f(x, w):
        return (sinkhorn(x * w, 5) * w).sum()

    x = torch.randn(3, 5, 4, 4, device=DEVICE, requires_grad=True)
    w = torch.randn(4, 4, device=DEVICE, requires_grad=True)
    want = f(x, w)
    want_grads = torch.autograd.grad(want, (x, w))
    torch._dynamo.reset()
    got = torch.compile(f, backend=backend, fullgraph=True)(x, w)
    got_grads = torch.autograd.grad(got, (x, w))
    torch.testing.assert_close(got, want)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b)
    calls = [node.target for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
    op = torch.ops.siamesenorm.sinkhorn
    assert sum(t in (op, op.default) for t in calls) == 1 and torch.exp not in calls


# ---- dispatch --------------------------------------------------------------------------------------
def test_pytorch_path_where_the_kernel_does_not_run(monkeypatch):
    """float64, n > 8 and more than MAX_ITERS iterations take the autograd function; so does the
    CPU without the interpreter."""
    from siamesenorm.functional.sinkhorn import sinkhorn as function

    x = torch.randn(3, 4, 4, device=DEVICE)
    for logits, iters in ((x.double(), 5), (torch.randn(2, 9, 9, device=DEVICE), 5), (x, MAX_ITERS + 1)):
        assert not sinkhorn_kernel_runs(logits, iters)
        torch.testing.assert_close(sinkhorn(logits, iters), function(logits, iters))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert sinkhorn_kernel_runs(x, 5) == CUDA


def test_bad_arguments():
    with pytest.raises(ValueError, match="n, n"):
        torch.ops.siamesenorm.sinkhorn(torch.randn(2, 3, 4, device=DEVICE), 5)
    with pytest.raises(ValueError, match="n <= 8"):
        torch.ops.siamesenorm.sinkhorn(torch.randn(2, 9, 9, device=DEVICE), 5)
    with pytest.raises(ValueError, match="iters"):
        torch.ops.siamesenorm.sinkhorn(torch.randn(2, 3, 3, device=DEVICE), -1)


# ---- the kernel inside mHC -------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["lean", "reference", "compiled"])
def test_mhc_with_the_kernel_equals_mhc_without(path, monkeypatch):
    """An mHC language model whose Sinkhorn runs the kernel (lean path, and compiled, where the
    reference composition is traced) has the loss and gradients of the reference path, which runs
    no kernel."""
    kernel_module = importlib.import_module("siamesenorm.kernels.sinkhorn")   # the package's
    # attribute ``sinkhorn`` is the function

    without_first_use_checks(monkeypatch)
    calls = []
    real = kernel_module._kernels
    monkeypatch.setattr(kernel_module, "_kernels", lambda: calls.append(1) or real())
    model = mhc_lm(sinkhorn_iters=5)       # 20 and MAX_ITERS: the tests above
    x = torch.randint(0, 32, (2, 4), device=DEVICE)
    got = loss_and_grads(model, x, path)
    runs = 0 if path == "reference" else 2 * 4
    assert len(calls) == runs, "the kernel did not run forward and backward in each sublayer"
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert not sinkhorn_kernel_runs(torch.zeros(1, 4, 4), 20)
    else:
        monkeypatch.setattr(kernel_module, "kernels_run_on", lambda t: False)
    want = loss_and_grads(model, x, "reference")
    assert len(calls) == runs
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# Collect what can run here: the tests, or (no GPU, Triton loaded without its interpreter) the test
# that runs them in a fresh process.
collect(globals(), IN_PROCESS)
