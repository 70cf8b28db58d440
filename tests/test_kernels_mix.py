"""mHC's stream mix-and-write kernel (siamesenorm::mix_write) against the equation written out in
float64, and mHC with the kernel against mHC without it.

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
)

triton = import_triton()

from siamesenorm.kernels import mix_write, mix_write_kernel_runs  # noqa: E402

IN_PROCESS = CUDA or interpreted("siamesenorm.kernels._triton_mix", "_mix_write_fwd")
test_in_fresh_process = fresh_process_test(__file__)


# ---- the reference: H_new[j] = sum_k R[j, k] H[k] + post[j] out, per token (float64) ----------------
def ref_mix_write(res, h, post, out):
    n = h.shape[-2]
    return torch.stack([sum(res[..., j, k, None] * h[..., k, :] for k in range(n)) + post[..., j, None] * out
                        for j in range(n)], -2)


def rounded(t, dtype):
    """``t`` rounded to ``dtype`` as the kernel rounds: to nearest on a GPU; Triton 3.9's interpreter
    truncates float32 to bf16 (drops the low 16 bits)."""
    if dtype == torch.bfloat16 and not CUDA:
        return (t.float().view(torch.int32) & -65536).view(torch.float32).double()
    return t.to(dtype).double()


def inputs(lead, n, d, dtypes, seed=0):
    """``(res, h, post, out)`` in float64 (the values rounded to ``dtypes``), and on the device in
    ``dtypes``, requiring gradients."""
    gen = torch.Generator().manual_seed(seed)
    shapes = ((*lead, n, n), (*lead, n, d), (*lead, n), (*lead, d))
    exact = [torch.randn(s, generator=gen, dtype=torch.float64).to(t).double()
             for s, t in zip(shapes, dtypes)]
    return exact, [e.to(DEVICE, t).requires_grad_() for e, t in zip(exact, dtypes)]


def check(lead, n, d, dtypes=(torch.float32,) * 4, dtype=None, seed=0):
    """The op's values and the four gradients (random upstream gradient) against the reference's:
    float32 to 1e-5, a result written in bf16 or fp16 to one rounding."""
    exact, got_in = inputs(lead, n, d, dtypes, seed)
    assert mix_write_kernel_runs(*got_in)
    out = mix_write(*got_in, dtype=dtype)
    want_dtype = dtype
    for t in dtypes if dtype is None else ():
        want_dtype = t if want_dtype is None else torch.promote_types(want_dtype, t)
    assert out.dtype == want_dtype and out.shape == got_in[1].shape
    up = rounded(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1),
                             dtype=torch.float64), out.dtype)
    grads = torch.autograd.grad(out, got_in, up.to(DEVICE, out.dtype))
    ref_in = [e.requires_grad_() for e in exact]
    ref = ref_mix_write(*ref_in)
    ref_grads = torch.autograd.grad(ref, ref_in, up)

    def close(got, want, dt):
        # One rounding to ``dt`` over float32 arithmetic inside.
        rtol = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dt]
        torch.testing.assert_close(got.cpu().double(), want.detach(), rtol=rtol, atol=1e-5)

    close(out, ref, out.dtype)
    for g, r, t in zip(grads, ref_grads, got_in, strict=True):
        assert g.dtype == t.dtype
        close(g, r, t.dtype)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8])
def test_float32_every_stream_count(n):
    check((3,), n, 37, seed=n)


@pytest.mark.parametrize("n, d", [(8, 130), (4, 520), (3, 1), (2, 5)])
def test_widths_with_masked_tails(n, d):
    """A tail in the last chunk of columns (8 streams: 128 a chunk; 4 streams: 512), a width of 1."""
    check((2,), n, d, seed=d)


def test_leading_shapes():
    check((2, 3), 4, 9)
    check((1,), 3, 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision(dtype):
    check((5,), 4, 33, (dtype,) * 4, seed=3)


def test_autocast_mix_of_dtypes():
    """Under autocast mHC's maps and branch output are bf16 and the first state float32: each gradient
    comes in its input's dtype, the result in the one asked for."""
    dtypes = (torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16)
    check((4,), 4, 24, dtypes, dtype=torch.float32, seed=5)
    check((4,), 4, 24, dtypes, dtype=torch.bfloat16, seed=6)


def test_broadcast_and_non_contiguous_inputs():
    """A state expanded over the streams (mHC's entry) and a transposed matrix (DeepSeek-V4's ``C^T``)."""
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(3, 1, 10, generator=gen, dtype=torch.float64)
    c = torch.randn(3, 4, 4, generator=gen, dtype=torch.float64)
    post, out = torch.randn(3, 4, generator=gen, dtype=torch.float64), torch.randn(3, 10, generator=gen,
                                                                                  dtype=torch.float64)
    ins = [t.float().to(DEVICE).requires_grad_() for t in (c, base, post, out)]
    got = mix_write(ins[0].transpose(-1, -2), ins[1].expand(3, 4, 10), ins[2], ins[3])
    grads = torch.autograd.grad(got.square().sum(), ins)
    ref_in = [t.detach().cpu().double().requires_grad_() for t in ins]
    want = ref_mix_write(ref_in[0].transpose(-1, -2), ref_in[1].expand(3, 4, 10), ref_in[2], ref_in[3])
    want_grads = torch.autograd.grad(want.square().sum(), ref_in)
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g.cpu().double(), r, rtol=1e-5, atol=1e-5)


def test_keeps_only_its_inputs_and_no_tokens():
    ins = [torch.randn(s, device=DEVICE, requires_grad=True) for s in ((5, 3, 3), (5, 3, 8), (5, 3), (5, 8))]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        mix_write(*ins)
    assert len(saved) == 4 and all(s is t for s, t in zip(saved, ins))
    empty = [torch.zeros(s, device=DEVICE, requires_grad=True)
             for s in ((0, 3, 3), (0, 3, 8), (0, 3), (0, 8))]
    got = mix_write(*empty)
    got.sum().backward()
    assert got.shape == (0, 3, 8) and all(t.grad.shape == t.shape for t in empty)


# ---- registration: opcheck and torch.compile --------------------------------------------------------
def test_opcheck():
    _, ins = inputs((1, 2), 4, 10, (torch.float32,) * 4)
    torch.library.opcheck(torch.ops.siamesenorm.mix_write.default, (*ins, torch.float32))
    _, low = inputs((2,), 2, 7, (torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16))
    torch.library.opcheck(torch.ops.siamesenorm.mix_write.default, (*low, torch.bfloat16))
    grad = torch.randn(1, 2, 4, 10, device=DEVICE)
    torch.library.opcheck(torch.ops.siamesenorm.mix_write_backward.default,
                          (grad, *(t.detach() for t in ins)))


def test_compile_traces_one_call():
    """Under ``torch.compile`` (one graph) the mix and write is one call of the op each way, with
    eager's values and gradients."""
    graphs = []

    def backend(gm, example):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example)

    def f(res, h, post, out):
        return (mix_write(res.softmax(-1), h, post.sigmoid(), out) * h).sum()

    _, ins = inputs((2, 5), 3, 12, (torch.float32,) * 4, seed=8)
    want = f(*ins)
    want_grads = torch.autograd.grad(want, ins)
    torch._dynamo.reset()
    got = torch.compile(f, backend=backend, fullgraph=True)(*ins)
    got_grads = torch.autograd.grad(got, ins)
    torch.testing.assert_close(got, want)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b)
    calls = [node.target for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]
    op = torch.ops.siamesenorm.mix_write
    assert sum(t in (op, op.default) for t in calls) == 1


# ---- dispatch --------------------------------------------------------------------------------------
def test_pytorch_path_where_the_kernel_does_not_run(monkeypatch):
    """float64 and more than 8 streams take the autograd function; so does the CPU without the
    interpreter, and SIAMESENORM_KERNELS=0."""
    from siamesenorm.nn.mixing import mix_and_write

    for lead, n, dt in (((3,), 4, torch.float64), ((3,), 9, torch.float32)):
        _, ins = inputs(lead, n, 6, (dt,) * 4)
        assert not mix_write_kernel_runs(*ins)
        torch.testing.assert_close(mix_write(*ins), mix_and_write(ins[0].transpose(-1, -2), *ins[1:]))
    _, ins = inputs((3,), 4, 6, (torch.float32,) * 4)
    monkeypatch.setenv("SIAMESENORM_KERNELS", "0")
    assert not mix_write_kernel_runs(*ins)
    monkeypatch.delenv("SIAMESENORM_KERNELS")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert mix_write_kernel_runs(*ins) == CUDA


def test_bad_arguments():
    _, (res, h, post, out) = inputs((3,), 4, 6, (torch.float32,) * 4)
    op = torch.ops.siamesenorm.mix_write
    with pytest.raises(ValueError, match="n <= 8"):
        op(torch.randn(3, 9, 9), torch.randn(3, 9, 6), torch.randn(3, 9), out.detach(), torch.float32)
    with pytest.raises(ValueError, match="res must have shape"):
        op(res[..., :3], h, post, out, torch.float32)
    with pytest.raises(ValueError, match="out must have shape"):
        op(res, h, post, out[:2], torch.float32)


# ---- the kernel inside mHC -------------------------------------------------------------------------
def _mhc_model(mixing):
    from siamesenorm.models import LanguageModel, LMConfig

    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, max_seq_len=8, scheme="mhc",
                   scheme_options={"mixing": mixing, "n_streams": 3 if mixing == "lite" else 4})
    model = LanguageModel(cfg).to(DEVICE)
    with torch.no_grad():               # per-token maps far from the initial near-identity
        for name, p in model.named_parameters():
            if name.startswith("scheme."):
                p.add_(0.3 * torch.randn_like(p))
    return model


def _loss_and_grads(model, x, step=None):
    loss = (model if step is None else step)(x[:, :-1], x[:, 1:]).loss
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    return [loss, *(g for g in grads if g is not None)]


@pytest.mark.parametrize("path, mixing", [("lean", "sinkhorn"), ("compiled", "sinkhorn"),
                                          ("lean", "deepseek_v4"), ("reference", "lite")])
def test_mhc_with_the_kernel_equals_mhc_without(path, mixing, monkeypatch):
    """An mHC language model whose stream writes run the kernel (lean path, reference path, and
    compiled, where the reference path is traced; every ``mixing``) has the loss and gradients of
    the reference path without kernels."""
    from siamesenorm.nn.fused import reference_path

    kernel_module = importlib.import_module("siamesenorm.kernels.mix")
    calls = []
    real = kernel_module._kernels
    monkeypatch.setattr(kernel_module, "_kernels", lambda: calls.append(1) or real())
    model = _mhc_model(mixing)
    x = torch.randint(0, 32, (2, 9), device=DEVICE)
    if path == "compiled":
        torch._dynamo.reset()
        got = _loss_and_grads(model, x, torch.compile(model, backend="aot_eager", fullgraph=True))
    else:
        with reference_path(path == "reference"):
            got = _loss_and_grads(model, x)
    assert len(calls) == 2 * 4, "the kernel did not run forward and backward in each sublayer"
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    else:
        monkeypatch.setenv("SIAMESENORM_KERNELS", "0")
    with reference_path():
        want = _loss_and_grads(model, x)
    assert len(calls) == 2 * 4
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_mhc_under_autocast_keeps_each_paths_dtype(monkeypatch):
    """Under bf16 autocast the kernel writes the state in the dtype of the ops it stands for (the
    reference path's bf16 product; the lean path's maps and branch output), to bf16 rounding."""
    import siamesenorm as sn
    from siamesenorm.nn.fused import reference_path

    torch.manual_seed(1)
    scheme = sn.build_scheme("mhc", 16, 1, n_streams=4).to(DEVICE)
    branch = torch.nn.Linear(16, 16).to(DEVICE)
    h = torch.randn(2, 5, 16, device=DEVICE)
    results = {}
    for kernels in (True, False):
        monkeypatch.setenv("SIAMESENORM_KERNELS", "1" if kernels else "0")
        for ref in (True, False):
            with reference_path(ref), torch.autocast(DEVICE, dtype=torch.bfloat16):
                state = scheme.step(scheme.step(scheme.enter(h), 0, branch), 1, branch)
            results[kernels, ref] = state
    for ref in (True, False):
        got, want = results[True, ref], results[False, ref]
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-6)


# Collect what can run here: the tests, or (no GPU, Triton loaded without its interpreter) the test
# that runs them in a fresh process.
collect(globals(), IN_PROCESS)
