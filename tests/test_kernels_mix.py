"""mHC's stream kernels, the mix and write (siamesenorm::mix_write) and the entry
(siamesenorm::mix_entry), against their equations written out in float64, and mHC with the kernels
against mHC without them.

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
    loss_and_grads,
    mhc_lm,
    without_first_use_checks,
)

triton = import_triton()

from siamesenorm.kernels import mix_write, mix_write_kernel_runs  # noqa: E402
from siamesenorm.kernels.mix import mix_entry, mix_entry_kernel_runs  # noqa: E402

IN_PROCESS = CUDA or interpreted("siamesenorm.kernels._triton_mix", "_mix_write_fwd")
test_in_fresh_process = fresh_process_test(__file__)
EPS = 1e-5


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


# ---- the entry: b = norm(sum_k pre[k] H[k]) (float64) ----------------------------------------------
def ref_entry(h, pre, w, b, kind):
    u = sum(pre[..., k, None] * h[..., k, :] for k in range(h.shape[-2]))
    if kind == "layernorm":
        u = u - u.mean(-1, keepdim=True)
    out = u / torch.sqrt((u * u).mean(-1, keepdim=True) + EPS)
    out = out if w is None else out * w
    return out if b is None else out + b


def check_entry(lead, n, d, kind, affine=True, dtypes=(torch.float32,) * 2, dtype=None, seed=0):
    """The entry's value and the gradients of ``h``, ``pre``, weight and bias against the reference's
    (``pre`` in (0.5, 1.5), as mHC's sigmoids give)."""
    gen = torch.Generator().manual_seed(seed)
    h, pre = torch.randn(*lead, n, d, generator=gen), 0.5 + torch.rand(*lead, n, generator=gen)
    exact = [h.to(dtypes[0]).double(), pre.to(dtypes[1]).double()]
    if affine:
        exact.append((1 + 0.3 * torch.randn(d, generator=gen)).to(dtypes[0]).double())
        if kind == "layernorm":
            exact.append((0.3 * torch.randn(d, generator=gen)).to(dtypes[0]).double())
    kw = [dtypes[0], dtypes[1], dtypes[0], dtypes[0]]
    got_in = [e.to(DEVICE, t).requires_grad_() for e, t in zip(exact, kw)]
    assert mix_entry_kernel_runs(got_in[0], got_in[1], kind)
    params = (got_in[2:] + [None, None])[:2]
    out = mix_entry(got_in[0], got_in[1], *params, kind=kind, eps=EPS, dtype=dtype)
    assert out.dtype == (dtype or torch.promote_types(*dtypes)) and out.shape == (*lead, d)
    up = rounded(torch.randn(out.shape, generator=gen, dtype=torch.float64), out.dtype)
    grads = torch.autograd.grad(out, got_in, up.to(DEVICE, out.dtype))
    ref_in = [e.requires_grad_() for e in exact]
    ref = ref_entry(ref_in[0], ref_in[1], *(ref_in[2:] + [None, None])[:2], kind)
    ref_grads = torch.autograd.grad(ref, ref_in, up)

    def close(got, want, dt):
        rtol = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dt]
        torch.testing.assert_close(got.cpu().double(), want.detach(), rtol=rtol, atol=1e-5)

    close(out, ref, out.dtype)
    for g, r, t in zip(grads, ref_grads, got_in, strict=True):
        assert g.dtype == t.dtype
        close(g, r, t.dtype)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8])
def test_entry_every_stream_count(n):
    check_entry((3,), n, 37, "layernorm" if n % 2 else "rmsnorm", affine=n != 4, seed=n)


@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
def test_entry_widths_with_masked_tails(kind):
    check_entry((2,), 4, 130, kind, seed=1)          # a block of 256
    check_entry((2, 3), 3, 5, kind, affine=False, seed=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_entry_low_precision(dtype):
    check_entry((5,), 4, 33, "rmsnorm", dtypes=(dtype,) * 2, seed=3)
    check_entry((5,), 3, 20, "layernorm", dtypes=(dtype,) * 2, seed=4)


def test_entry_autocast_mix_of_dtypes():
    """A float32 state and bf16 maps, the branch input in the dtype asked for."""
    check_entry((4,), 4, 24, "rmsnorm", dtypes=(torch.float32, torch.bfloat16), dtype=torch.bfloat16, seed=5)


def test_entry_keeps_the_state_the_maps_and_row_statistics():
    h, pre = torch.randn(5, 3, 8, device=DEVICE, requires_grad=True), torch.rand(5, 3, device=DEVICE)
    w = torch.ones(8, device=DEVICE, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        mix_entry(h, pre.requires_grad_(), w)
    assert saved[:3] == [h, pre, w] and len(saved) == 4 and saved[3].shape == (2, 5)


def test_entry_pytorch_path_and_bad_arguments():
    h, pre = torch.randn(3, 4, 6, device=DEVICE), torch.rand(3, 4, device=DEVICE)
    assert not mix_entry_kernel_runs(h, pre, "dyt") and not mix_entry_kernel_runs(h.double(), pre, "rmsnorm")
    assert not mix_entry_kernel_runs(torch.randn(3, 9, 6, device=DEVICE), torch.rand(3, 9), "rmsnorm")
    got = mix_entry(h.double(), pre.double(), kind="layernorm", eps=EPS)
    torch.testing.assert_close(got, ref_entry(h.double(), pre.double(), None, None, "layernorm"))
    op = torch.ops.siamesenorm.mix_entry
    with pytest.raises(ValueError, match="pre must have shape"):
        op(h, pre[:, :3], None, None, "rmsnorm", EPS, torch.float32)
    with pytest.raises(ValueError, match="no bias"):
        op(h, pre, None, torch.zeros(6), "rmsnorm", EPS, torch.float32)
    with pytest.raises(ValueError, match="norm kind"):
        op(h, pre, None, None, "dyt", EPS, torch.float32)


# ---- registration: opcheck and torch.compile --------------------------------------------------------
def test_opcheck():
    _, ins = inputs((1, 2), 4, 10, (torch.float32,) * 4)
    torch.library.opcheck(torch.ops.siamesenorm.mix_write.default, (*ins, torch.float32))
    _, low = inputs((2,), 2, 7, (torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16))
    torch.library.opcheck(torch.ops.siamesenorm.mix_write.default, (*low, torch.bfloat16))
    grad = torch.randn(1, 2, 4, 10, device=DEVICE)
    torch.library.opcheck(torch.ops.siamesenorm.mix_write_backward.default,
                          (grad, *(t.detach() for t in ins)))
    h, pre = ins[1], ins[2]
    w, b = (torch.randn(10, device=DEVICE, requires_grad=True) for _ in range(2))
    entry = torch.ops.siamesenorm.mix_entry.default
    torch.library.opcheck(entry, (h, pre, w, b, "layernorm", EPS, torch.float32))
    torch.library.opcheck(entry, (low[1], low[2], None, None, "rmsnorm", EPS, torch.bfloat16))
    _, stats = entry(h, pre, w, None, "rmsnorm", EPS, torch.float32)
    torch.library.opcheck(torch.ops.siamesenorm.mix_entry_backward.default,
                          (torch.randn(1, 2, 10, device=DEVICE), h.detach(), pre.detach(), w.detach(), None,
                           stats, "rmsnorm", EPS, True, False))


def test_compile_traces_one_call():
    """Under ``torch.compile`` (one graph) the entry and the mix and write are one call of their op
    each way, with eager's values and gradients."""
    def f(res, h, post, out):
        b = mix_entry(h, post.sigmoid(), out[0, 0], kind="rmsnorm", eps=EPS)
        return (mix_write(res.softmax(-1), h, post.sigmoid(), out * b) * h).sum()

    _, ins = inputs((2, 2), 3, 12, (torch.float32,) * 4, seed=8)
    ops = torch.ops.siamesenorm
    compiles_to_one_call_each(f, list(ins), [ops.mix_write, ops.mix_entry])


# ---- dispatch --------------------------------------------------------------------------------------
def test_pytorch_path_where_the_kernel_does_not_run(monkeypatch):
    """float64 and more than 8 streams take the autograd function; so does the CPU without the
    interpreter, and SIAMESENORM_PATH=lean."""
    from siamesenorm.functional.mixing import mix_and_write

    for lead, n, dt in (((3,), 4, torch.float64), ((3,), 9, torch.float32)):
        _, ins = inputs(lead, n, 6, (dt,) * 4)
        assert not mix_write_kernel_runs(*ins)
        torch.testing.assert_close(mix_write(*ins), mix_and_write(ins[0].transpose(-1, -2), *ins[1:]))
    _, ins = inputs((3,), 4, 6, (torch.float32,) * 4)
    monkeypatch.setenv("SIAMESENORM_PATH", "lean")
    assert not mix_write_kernel_runs(*ins)
    monkeypatch.delenv("SIAMESENORM_PATH")
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
@pytest.mark.parametrize("path, mixing", [("lean", "sinkhorn"), ("compiled", "sinkhorn"),
                                          ("lean", "deepseek_v4"), ("reference", "lite"), ("lean", "lite")])
def test_mhc_with_the_kernel_equals_mhc_without(path, mixing, monkeypatch):
    """An mHC language model whose entries and stream writes run the kernels (lean path and
    compiled; every ``mixing``; RMSNorm and LayerNorm), and whose maps' projection runs
    siamesenorm::rms_project (24, 24 and 12 columns, DeepSeek-V4's in float32), has the loss and
    gradients of the reference path, which runs no kernel."""
    without_first_use_checks(monkeypatch)
    calls = []
    for module, name in (("mix", "_kernels"), ("mix", "_entry_kernels"), ("rms_project", "_kernels")):
        kernel_module = importlib.import_module(f"siamesenorm.kernels.{module}")
        real, key = getattr(kernel_module, name), module + name
        monkeypatch.setattr(kernel_module, name, lambda real=real, key=key: calls.append(key) or real())
    model = mhc_lm("layernorm" if mixing == "deepseek_v4" else "rmsnorm", mixing=mixing,
                   n_streams=3 if mixing == "lite" else 4)
    x = torch.randint(0, 32, (2, 4), device=DEVICE)
    got = loss_and_grads(model, x, path)
    expected = ["mix_entry_kernels"] * 8 + ["mix_kernels"] * 8 + ["rms_project_kernels"] * 8
    assert sorted(calls) == ([] if path == "reference" else expected), \
        "the kernels did not run forward and backward in each sublayer"
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "0")
    else:
        monkeypatch.setenv("SIAMESENORM_PATH", "lean")
    runs = len(calls)
    want = loss_and_grads(model, x, "reference")
    assert len(calls) == runs
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_mhc_under_autocast_keeps_each_paths_dtype(monkeypatch):
    """Under bf16 autocast the kernels write the branch input and the state in the dtypes of the ops
    they stand for (the reference path's bf16 products; the lean path's), to bf16 rounding."""
    import siamesenorm as sn
    from siamesenorm.compute import use_path

    torch.manual_seed(1)
    scheme = sn.build_scheme("mhc", 16, 1, n_streams=4).to(DEVICE)
    branch = torch.nn.Linear(16, 16).to(DEVICE)
    h = torch.randn(2, 5, 16, device=DEVICE)
    results = {}
    for kernels in (True, False):
        monkeypatch.setenv("SIAMESENORM_PATH", "kernels" if kernels else "lean")
        for ref in (True, False):
            with use_path("reference" if ref else "kernels"), torch.autocast(DEVICE, dtype=torch.bfloat16):
                state = scheme.step(scheme.step(scheme.enter(h), 0, branch), 1, branch)
            results[kernels, ref] = state
    for ref in (True, False):
        got, want = results[True, ref], results[False, ref]
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-6)


# Collect what can run here: the tests, or (no GPU, Triton loaded without its interpreter) the test
# that runs them in a fresh process.
collect(globals(), IN_PROCESS)
