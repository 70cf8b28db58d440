"""What the fused ops accept (issue 48): each checks its arguments at its entry, the same on the
kernel path and the PyTorch path, and refuses with a ValueError or TypeError naming the argument;
what it accepts it computes right (parameters of any stride, float64 in float64, a scale tensor's
gradient). The kernel path runs under Triton's interpreter on the CPU (tests/triton_interpreter.py).
"""

import pytest
import torch

from triton_interpreter import (
    CUDA,
    DEVICE,
    collect,
    every_kernel_module_interpreted,
    fresh_process_test,
    import_triton,
    interpreter,  # noqa: F401  (the autouse fixture)
)

triton = import_triton()

from siamesenorm import kernels  # noqa: E402
from siamesenorm.kernels import guard  # noqa: E402

IN_PROCESS = CUDA or every_kernel_module_interpreted()
test_in_fresh_process = fresh_process_test(__file__)


@pytest.fixture(params=["kernels", "pytorch"])
def path(request, monkeypatch):
    """Each test on both paths: the kernels (interpreted on the CPU), and the PyTorch path."""
    if request.param == "pytorch":
        monkeypatch.setenv("SIAMESENORM_PATH", "lean")
    return request.param


def t(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(DEVICE, dtype)


X = t(3, 16)
CALLS = {   # op: a call of its front function taking keyword overrides
    "add_norm": lambda **k: kernels.add_norm(**{"h": X, "z": X, **k}),
    "update_entry": lambda **k: kernels.siamese_update_entry(**{"x": X, "y": X, "o": X, **k}),
    "sinkhorn": lambda **k: kernels.sinkhorn(**{"logits": t(3, 4, 4), "iters": 5, **k}),
    "mix_write": lambda **k: kernels.mix_write(**{"res": t(3, 4, 4), "h": t(3, 4, 16), "post": t(3, 4),
                                                  "out": t(3, 16), **k}),
    "mix_entry": lambda **k: kernels.mix_entry(**{"h": t(3, 4, 16), "pre": t(3, 4), **k}),
    "rms_project": lambda **k: kernels.rms_project(**{"x": X, "w": t(16, 5), "eps": 1e-6, **k}),
    "depth_mix": lambda **k: kernels.fused_depth_mix(**{"sources": (X, X), "u": t(16), **k}),
}


# ---- refusals: the same on both paths ----------------------------------------------------------------------
@pytest.mark.parametrize("op, arg, value, error, message", [
    ("add_norm", "weight", t(8), ValueError, r"add_norm: weight must have shape \(16,\), not \(8,\)"),
    ("add_norm", "weight", t(4, 4), ValueError, r"add_norm: weight must have shape \(16,\), not \(4, 4\)"),
    ("add_norm", "bias", t(17), ValueError, "RMSNorm has no bias"),
    ("add_norm", "z", t(2, 16), ValueError, "h and z differ in shape"),
    ("add_norm", "kind", "batchnorm", ValueError, "norm kind must be one of"),
    ("update_entry", "in_weight", t(8), ValueError, r"in_weight must have shape \(16,\)"),
    ("update_entry", "y_weight", t(16, 1), ValueError, r"y_weight must have shape \(16,\)"),
    ("update_entry", "o", t(3, 8), ValueError, "o has shape"),
    ("update_entry", "scale", torch.ones(2), ValueError, "scale must be a number or a 0-dim tensor"),
    ("mix_entry", "bias", t(16), ValueError, "RMSNorm has no bias"),
    ("mix_entry", "kind", "none", ValueError, "norm kind must be one of"),
    ("mix_entry", "weight", t(15), ValueError, r"mix_entry: weight must have shape \(16,\)"),
    ("mix_entry", "pre", t(3, 5), ValueError, "pre must have shape"),
    ("mix_write", "out", t(3, 15), ValueError, r"out must have shape \(\.\.\., 16\)"),
    ("mix_write", "post", t(5, 4), ValueError, "leading shapes do not broadcast"),
    ("depth_mix", "weight", t(16), ValueError, "norm kind 'none' takes no weight"),
    ("depth_mix", "kind", "batchnorm", ValueError, "norm kind must be one of"),
    ("depth_mix", "sources", (), ValueError, "one or more sources, not 0"),
    ("depth_mix", "sources", (torch.tensor(1.0),), ValueError,
     r"sources\[0\] must have at least 1 dimension"),
    ("depth_mix", "u", t(8), ValueError, r"u must have shape \(16,\)"),
    ("sinkhorn", "logits", t(4), ValueError, "logits must have at least 2 dimensions"),
    ("sinkhorn", "logits", t(3, 4, 5), ValueError, r"logits must be \(\.\.\., n, n\)"),
    ("sinkhorn", "iters", -1, ValueError, "iters must be an int >= 0"),
    ("rms_project", "w", t(8, 5), ValueError, r"w must be \(16, M\)"),
    ("rms_project", "x", torch.tensor(1.0), ValueError, "x must have at least 1 dimension"),
    ("add_norm", "eps", -1e-6, ValueError, "add_norm: eps must be a finite number >= 0, not -1e-06"),
    ("update_entry", "eps", float("nan"), ValueError, "eps must be a finite number >= 0"),
    ("mix_entry", "eps", float("inf"), ValueError, "eps must be a finite number >= 0"),
    ("depth_mix", "norm_eps", -1.0, ValueError, "norm_eps must be a finite number >= 0"),
    ("rms_project", "eps", "1e-6", ValueError, "eps must be a finite number >= 0"),
    ("update_entry", "out_dtype", torch.int8, TypeError, "out_dtype must be a floating-point dtype"),
    ("mix_write", "dtype", torch.int32, TypeError, "dtype must be a floating-point dtype"),
    ("depth_mix", "dtype", torch.bool, TypeError, "dtype must be a floating-point dtype"),
])
def test_bad_arguments_are_refused_naming_the_argument(op, arg, value, error, message, path):
    with pytest.raises(error, match=message):
        CALLS[op](**{arg: value})


@pytest.mark.parametrize("op, arg", [
    ("add_norm", "h"), ("add_norm", "weight"), ("update_entry", "o"), ("update_entry", "x_weight"),
    ("sinkhorn", "logits"), ("mix_write", "res"), ("mix_entry", "pre"), ("rms_project", "w"),
    ("depth_mix", "u")])
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_integer_and_bool_tensors_are_refused(op, arg, dtype, path):
    """Never computed into truncated integers."""
    good = {"add_norm": {"h": X, "weight": t(16)}, "update_entry": {"o": X, "x_weight": t(16)},
            "sinkhorn": {"logits": t(3, 4, 4)}, "mix_write": {"res": t(3, 4, 4)},
            "mix_entry": {"pre": t(3, 4)}, "rms_project": {"w": t(16, 5)}, "depth_mix": {"u": t(16)}}[op][arg]
    with pytest.raises(TypeError, match=f"{arg} must be floating point, not {dtype}"):
        CALLS[op](**{arg: good.to(dtype)})


def test_the_ops_themselves_check_their_arguments():
    """Called directly (as a compiled graph calls them), the ops refuse what the front functions
    refuse, rather than read past a tensor's end."""
    with pytest.raises(ValueError, match="h and z differ in shape"):
        torch.ops.siamesenorm.add_norm(t(3, 16), t(2, 16), None, None, "rmsnorm", 1e-6)
    with pytest.raises(ValueError, match=r"weight must have shape \(16,\)"):
        torch.ops.siamesenorm.add_norm(X, X, t(8), None, "rmsnorm", 1e-6)
    with pytest.raises(ValueError, match=r"in_weight must have shape \(16,\)"):
        torch.ops.siamesenorm.update_entry(X, X, X, 1.0, None, None, None, None, t(8), None, "rmsnorm", 1e-6,
                                           "norm", True, True)
    with pytest.raises(ValueError, match="RMSNorm has no bias"):
        torch.ops.siamesenorm.mix_entry(t(3, 4, 16), t(3, 4), None, t(16), "rmsnorm", 1e-6, torch.float32)


def test_ops_called_where_the_kernels_cannot_run_compute_the_pytorch_path(monkeypatch, capsys):
    """An op called directly on the CPU without the interpreter (no GPU driver) computes the
    PyTorch path: no "0 active drivers", nothing turned off."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    h, z, w = t(3, 16), t(3, 16), t(16)
    s, n, _ = torch.ops.siamesenorm.add_norm(h, z, w, None, "rmsnorm", 1e-6)
    torch.testing.assert_close(n, torch.nn.functional.rms_norm(h + z, (16,), w, 1e-6))
    got = torch.ops.siamesenorm.sinkhorn(t(2, 4, 4), 3)
    torch.testing.assert_close(got.sum(-2), torch.ones(2, 4))
    assert all(op.on for op in guard.kernel_ops().values())
    assert "drivers" not in capsys.readouterr().err


# ---- what is accepted is computed right ----------------------------------------------------------------
def strided(n):
    """A weight of ``n`` values, one element in two of a longer tensor."""
    return (1 + 0.1 * torch.randn(2 * n)).to(DEVICE)[::2]


def test_weights_and_biases_of_any_stride(path):
    """Parameters that are views with a stride give what their contiguous copies give."""
    w, b = strided(16), strided(16)
    assert not w.is_contiguous()
    h, z, streams, pre = t(3, 16), t(3, 16), t(3, 4, 16), t(3, 4)
    cases = [
        (lambda w, b: kernels.add_norm(h, z, w, b, kind="layernorm")[1]),
        (lambda w, b: kernels.siamese_update_entry(h, z, h, 0.5, x_weight=w, x_bias=b, y_weight=w,
                                                   in_weight=w, in_bias=b, kind="layernorm")[2]),
        (lambda w, b: kernels.mix_entry(streams, pre, w, b, kind="layernorm")),
        (lambda w, b: kernels.fused_depth_mix((h, z), torch.zeros(16, device=DEVICE), w, b,
                                              kind="layernorm")),
    ]
    for case in cases:
        ws, bs = w.detach().requires_grad_(), b.detach().requires_grad_()
        wc, bc = w.contiguous().requires_grad_(), b.contiguous().requires_grad_()
        got, want = case(ws, bs), case(wc, bc)
        torch.testing.assert_close(got, want)
        up = torch.linspace(-1, 1, got.numel(), device=DEVICE).view(got.shape)
        torch.testing.assert_close(torch.autograd.grad(got, (ws, bs), up),
                                   torch.autograd.grad(want, (wc, bc), up))


def test_float64_is_computed_in_float64(monkeypatch):
    """float64 takes the PyTorch path (the kernels compute in float32) and its gradients pass
    gradcheck; no op is called."""
    called = []
    for name in ("add_norm", "update_entry"):
        monkeypatch.setattr(guard.kernel_ops()[name], "run", lambda *a, **k: called.append(1))
    h, z, o = (torch.randn(2, 6, dtype=torch.float64, device=DEVICE, requires_grad=True) for _ in range(3))
    w = (1 + 0.1 * torch.randn(6, dtype=torch.float64, device=DEVICE)).requires_grad_()
    torch.autograd.gradcheck(lambda h, z, w: kernels.add_norm(h, z, w), (h, z, w))
    torch.autograd.gradcheck(lambda h, z, o, w: kernels.siamese_update_entry(h, z, o, 0.5, x_weight=w,
                                                                             in_weight=w)[2], (h, z, o, w))
    assert not called


def test_a_scale_tensor_keeps_its_gradient(path):
    """``scale`` as a tensor that requires grad gets its gradient (x1 = x + scale o)."""
    x, y, o = t(3, 16), t(3, 16), t(3, 16)
    scale = torch.tensor(0.5, device=DEVICE, requires_grad=True)
    xo, _, b = kernels.siamese_update_entry(x, y, o, scale, in_norm=False)
    (got,) = torch.autograd.grad((xo.sum() + b.sum()), scale)
    s = scale.detach().double().requires_grad_()
    x1 = x.double() + s * o.double()
    ref = torch.nn.functional.rms_norm(x1, (16,), eps=1e-6)
    want = ref + torch.nn.functional.rms_norm(y.double() + o.double(), (16,), eps=1e-6)
    (expected,) = torch.autograd.grad(ref.sum() + want.sum(), s)
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4)


collect(globals(), IN_PROCESS)
