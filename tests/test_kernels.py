"""The fused Triton kernels (siamesenorm.kernels) against references written here from the equations.

Without CUDA the kernels run under Triton's interpreter on the CPU (tests/triton_interpreter.py:
run alone, the module chooses it; in the whole suite, one test runs the module again in a fresh
process that does).
"""

import itertools
import os
import subprocess
import sys
import textwrap

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

from siamesenorm.compute import use_path  # noqa: E402
from siamesenorm.kernels import (  # noqa: E402
    add_norm,
    kernels_available,
    siamese_update_entry,
)

IN_PROCESS = CUDA or interpreted("siamesenorm.kernels._triton", "_add_norm_fwd")
test_in_fresh_process = fresh_process_test(__file__)


EPS = 1e-5


# ---- references, from the equations (float64) ------------------------------------------------------
def ref_norm(t, w, b, kind):
    if kind == "layernorm":
        c = t - t.mean(-1, keepdim=True)
        out = c / torch.sqrt((c * c).mean(-1, keepdim=True) + EPS)
    else:
        out = t / torch.sqrt((t * t).mean(-1, keepdim=True) + EPS)
    out = out if w is None else out * w
    return out if b is None else out + b


def rounded(t, dtype):
    """``t`` rounded to ``dtype`` as the kernels round: to nearest on a GPU; Triton 3.9's interpreter
    truncates float32 to bf16 (drops the low 16 bits)."""
    if dtype == torch.bfloat16 and not CUDA:
        bits = t.float().view(torch.int32) & -65536
        return bits.view(torch.float32).double()
    return t.to(dtype).double()


def stored(dtype):
    """A tensor the op writes in ``dtype`` and reads back (the identity for gradients): the ops
    normalise the sums they store, rounded to the inputs' dtype."""
    if dtype == torch.float32:
        return lambda t: t
    return lambda t: t + (rounded(t, dtype) - t).detach()


def ref_add_norm(h, z, w, b, kind, rnd=lambda t: t):
    s = rnd(h + z)
    return s, ref_norm(s, w, b, kind)


def ref_entry(x, y, o, scale, x_mode, xw, xb, y_norm, yw, yb, in_norm, iw, ib, kind, rnd=lambda t: t):
    x1, y1 = (rnd(x + scale * o), rnd(y + o)) if o is not None else (x, y)
    xo = ref_norm(x1, xw, xb, kind) if x_mode == "norm" else x1
    r = x1 * xw if x_mode == "gain" else xo
    u = r + ref_norm(y1, yw, yb, kind) if y_norm else r
    return xo, y1, (ref_norm(u, iw, ib, kind) if in_norm else u)


# ---- helpers ----------------------------------------------------------------------------------------
def leaf(*shape, dtype=torch.float32, gen=None):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(DEVICE, dtype).requires_grad_()


def param(d, dtype, gen, present=True):
    if not present:
        return None
    return (1 + 0.5 * torch.randn(d, generator=gen, dtype=torch.float64)).to(DEVICE, dtype).requires_grad_()


def as_ref(t):
    """A float64 leaf with the same values (the reference's input)."""
    return None if t is None else t.detach().double().requires_grad_()


def outputs_and_grads(outs, inputs, seed, dtype):
    """Outputs and the gradients of ``inputs`` for random upstream gradients of every output (values
    of ``dtype``, so that the op and the reference get the same)."""
    gen = torch.Generator().manual_seed(seed)
    outs = [t for t in outs if t is not None]
    ups = [torch.randn(t.shape, generator=gen, dtype=torch.float64).to(dtype).to(t.device, t.dtype)
           for t in outs]
    live = [t for t in inputs if t is not None]
    grads = torch.autograd.grad(outs, live, ups, allow_unused=True)
    return outs, list(grads)


def assert_matches(got, want, tol):
    for a, b in zip(got, want, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a.double().cpu(), b.double().cpu(), rtol=tol[0], atol=tol[1])


# Low precision: the reference rounds the sums the op stores as the op does (``stored``) and gets the
# same upstream gradients, so what is left is one rounding of each output and gradient (bf16 keeps 8
# significant bits: a relative error below 2^-7 = 0.0078 truncated, half that rounded to nearest;
# fp16 11) and float32 arithmetic inside the kernels: relative 1e-2 (absolute 1e-3 near zero).
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1e-3), torch.float16: (1e-2, 1e-3)}


# ---- add_norm ---------------------------------------------------------------------------------------
AFFINE = [("rmsnorm", False, False), ("rmsnorm", True, False), ("layernorm", False, False),
          ("layernorm", True, False), ("layernorm", True, True), ("layernorm", False, True)]


def check_add_norm(kind, has_w, has_b, rows, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h, z = leaf(rows, d, dtype=dtype, gen=gen), leaf(rows, d, dtype=dtype, gen=gen)
    w, b = param(d, dtype, gen, has_w), param(d, dtype, gen, has_b)
    inputs = [h, z, w, b]
    got = outputs_and_grads(add_norm(h, z, w, b, kind=kind, eps=EPS), inputs, seed, dtype)
    ref_inputs = [as_ref(t) for t in inputs]
    want = outputs_and_grads(ref_add_norm(*ref_inputs, kind, stored(dtype)), ref_inputs, seed, dtype)
    assert got[0][0].dtype == dtype and got[0][1].dtype == dtype
    assert_matches(got[0] + got[1], want[0] + want[1], TOL[dtype])


# Rows: one; 7 make the backward's 4 programs walk 2, 2, 2 and 1 rows (CUDA: one row each); the cost
# under the interpreter grows with the rows, not the width. Widths: 33 and 100 leave a masked tail of
# the block (64, 128), 64 none.
@pytest.mark.parametrize("kind,has_w,has_b", AFFINE)
def test_add_norm_float32(kind, has_w, has_b):
    check_add_norm(kind, has_w, has_b, 7, 33, torch.float32)


@pytest.mark.parametrize("kind,has_w,has_b", [("rmsnorm", True, False), ("layernorm", True, True)])
@pytest.mark.parametrize("rows,d", [(1, 33), (7, 100), (7, 64)])
def test_add_norm_shapes(kind, has_w, has_b, rows, d):
    check_add_norm(kind, has_w, has_b, rows, d, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
def test_add_norm_low_precision(kind, dtype):
    check_add_norm(kind, True, kind == "layernorm", 5, 100, dtype)


def test_add_norm_partial_gradients():
    """Only ``s`` used downstream, or only ``n``; weights frozen."""
    gen = torch.Generator().manual_seed(3)
    h, z = leaf(7, 33, gen=gen), leaf(7, 33, gen=gen)
    w = param(33, torch.float32, gen).requires_grad_(False)
    s, n = add_norm(h, z, w, kind="rmsnorm", eps=EPS)
    gh, gz = torch.autograd.grad(s.sum(), [h, z])
    torch.testing.assert_close(gh, torch.ones_like(h))
    s, n = add_norm(h, z, w, kind="rmsnorm", eps=EPS)
    (gh,) = torch.autograd.grad((n * n).sum(), [h])
    hr, zr = as_ref(h), as_ref(z)
    (want,) = torch.autograd.grad((ref_add_norm(hr, zr, w.double(), None, "rmsnorm")[1] ** 2).sum(), [hr])
    torch.testing.assert_close(gh.double(), want, rtol=1e-5, atol=1e-5)


# ---- siamese_update_entry ---------------------------------------------------------------------------
def entry_case(kind, x_mode, has_o, y_norm, in_norm, affine, rows, d, dtype, seed=0, same_xy=False):
    """Runs the op and the reference; ``affine``: "none", "weight" or "both" (biases: LayerNorm)."""
    gen = torch.Generator().manual_seed(seed)
    x = leaf(rows, d, dtype=dtype, gen=gen)
    y = x if same_xy else leaf(rows, d, dtype=dtype, gen=gen)
    o = leaf(rows, d, dtype=dtype, gen=gen) if has_o else None
    w_on = affine != "none"
    b_on = affine == "both" and kind == "layernorm"
    xw = param(d, dtype, gen, x_mode == "gain" or (x_mode == "norm" and w_on))
    xb = param(d, dtype, gen, x_mode == "norm" and b_on)
    yw, yb = param(d, dtype, gen, y_norm and w_on), param(d, dtype, gen, y_norm and b_on)
    iw, ib = param(d, dtype, gen, in_norm and w_on), param(d, dtype, gen, in_norm and b_on)
    scale = 0.375
    out = siamese_update_entry(x, y, o, scale, x_mode=x_mode, x_weight=xw, x_bias=xb, y_norm=y_norm,
                               y_weight=yw, y_bias=yb, in_norm=in_norm, in_weight=iw, in_bias=ib,
                               kind=kind, eps=EPS)
    inputs = [x, y, o, xw, xb, yw, yb, iw, ib]
    if same_xy:
        inputs[1] = None
    # x' and y1 are x and y themselves where the op leaves them unchanged: count each output once.
    outs = [out[0] if out[0] is not x else None, out[1] if out[1] is not y else None, out[2]]
    got = outputs_and_grads(outs, inputs, seed, dtype)
    r = [as_ref(t) for t in inputs]
    ry = r[0] if same_xy else r[1]
    ref = ref_entry(r[0], ry, r[2], scale, x_mode, r[3], r[4], y_norm, r[5], r[6], in_norm, r[7], r[8],
                    kind, stored(dtype))
    ref = [ref[0] if outs[0] is not None else None, ref[1] if outs[1] is not None else None, ref[2]]
    want = outputs_and_grads(ref, r, seed, dtype)
    assert out[2].dtype == dtype
    assert_matches(got[0] + got[1], want[0] + want[1], TOL[dtype])
    return out, (x, y)


CASES = list(itertools.product(["rmsnorm", "layernorm"], ["norm", "gain", "none"], [False, True],
                               [False, True], [False, True]))


def present(kind, x_mode, y_norm, in_norm, affine):
    """Which of the six parameters ``entry_case`` passes (the kernel's HAS_* constexprs)."""
    w_on, b_on = affine != "none", affine == "both" and kind == "layernorm"
    return (x_mode == "gain" or (x_mode == "norm" and w_on), x_mode == "norm" and b_on, y_norm and w_on,
            y_norm and b_on, in_norm and w_on, in_norm and b_on)


@pytest.mark.parametrize("kind,x_mode,has_o,y_norm,in_norm", CASES)
def test_update_entry_float32(kind, x_mode, has_o, y_norm, in_norm):
    """Every combination of options and, for each, every set of parameters the options use (where
    no norm has parameters to take, the affine settings pass the same ones: one run)."""
    runs = {}
    for affine in ["none", "weight", "both"]:
        runs.setdefault(present(kind, x_mode, y_norm, in_norm, affine), affine)
    for seed, affine in enumerate(runs.values()):
        out, (x, y) = entry_case(kind, x_mode, has_o, y_norm, in_norm, affine, 5, 33, torch.float32, seed)
        # Without o the streams pass through as themselves.
        assert (out[1] is y) == (not has_o)
        assert (out[0] is x) == (not has_o and x_mode != "norm")


@pytest.mark.parametrize("kind", ["rmsnorm", "layernorm"])
@pytest.mark.parametrize("rows,d", [(1, 100), (9, 33), (7, 128), (3, 5)])
def test_update_entry_shapes(kind, rows, d):
    entry_case(kind, "norm", True, True, True, "both", rows, d, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind,x_mode", [("rmsnorm", "norm"), ("layernorm", "norm"), ("layernorm", "gain")])
def test_update_entry_low_precision(kind, x_mode, dtype):
    entry_case(kind, x_mode, True, True, True, "both", 5, 100, dtype)


@pytest.mark.parametrize("x_mode", ["norm", "gain"])
def test_update_entry_writes_the_branch_input_in_out_dtype(x_mode):
    """float32 streams, a bf16 branch output and ``out_dtype=bf16``: b is the float32 result rounded
    once to bf16 (what autocast's next matrix product would read), and every gradient is the float32
    op's for the same upstream gradients."""
    gen = torch.Generator().manual_seed(12)
    x, y = leaf(7, 100, gen=gen), leaf(7, 100, gen=gen)
    o = leaf(7, 100, dtype=torch.bfloat16, gen=gen)
    w = param(100, torch.float32, gen)
    kw = {"x_mode": x_mode, "x_weight": w, "y_weight": w, "in_norm": x_mode == "norm",
          "in_weight": w if x_mode == "norm" else None, "kind": "rmsnorm", "eps": EPS}
    outs = siamese_update_entry(x, y, o, 0.5, out_dtype=torch.bfloat16, **kw)
    assert [t.dtype for t in outs] == [torch.float32, torch.float32, torch.bfloat16]
    full = siamese_update_entry(x, y, o, 0.5, **kw)
    assert torch.equal(outs[2].double(), rounded(full[2].detach(), torch.bfloat16))
    inputs = [x, y, o, w]
    got = outputs_and_grads(outs, inputs, 3, torch.bfloat16)[1]
    want = outputs_and_grads(full, inputs, 3, torch.bfloat16)[1]
    assert_matches(got, want, (1e-5, 1e-5))


def test_update_entry_first_sublayer():
    """The first sublayer reads one tensor as both streams (X = Y = h)."""
    entry_case("layernorm", "norm", False, True, True, "both", 7, 33, torch.float32, same_xy=True)


def test_update_entry_only_x_stream_used():
    """Gradients reach x and o when only x' is used downstream (b's gradient is absent)."""
    gen = torch.Generator().manual_seed(5)
    x, y, o = (leaf(7, 33, gen=gen) for _ in range(3))
    xo, y1, b = siamese_update_entry(x, y, o, 0.5, x_mode="none", y_norm=True, in_norm=True)
    gx, gy, go = torch.autograd.grad(xo.sum(), [x, y, o], allow_unused=True)
    torch.testing.assert_close(gx, torch.ones_like(x))
    torch.testing.assert_close(go, torch.full_like(o, 0.5))
    assert gy is None or not gy.any()


@pytest.mark.parametrize("x_mode", ["norm", "gain"])
@pytest.mark.parametrize("has_o", [False, True])
def test_entry_saves_what_the_norms_read_and_statistics_only(x_mode, has_o):
    """Backward keeps x1 (x itself without o; x' in "gain" mode), y1 (y itself without o), the
    parameters and the (6, rows) statistics: no sum, no normalised value."""
    gen = torch.Generator().manual_seed(6)
    x, y, o = (leaf(7, 33, gen=gen) for _ in range(3))
    w = [param(33, torch.float32, gen) for _ in range(3)]
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        xo, y1, b = siamese_update_entry(x, y, o if has_o else None, 0.5, x_mode=x_mode, x_weight=w[0],
                                         y_weight=w[1], in_weight=w[2])
    big = [t for t in saved if t.numel() >= x.numel()]
    assert len(big) == 2 and big[1] is y1
    if not has_o:
        assert big[0] is x
    elif x_mode == "gain":
        assert big[0] is xo
    else:   # x1 = x + o / 2, written by the forward for backward alone
        assert all(t is not x and t is not o and t is not xo for t in big)
        torch.testing.assert_close(big[0], x + 0.5 * o)
    assert sum(t.numel() for t in saved) == 2 * x.numel() + 3 * 33 + 6 * 7


# ---- registration: opcheck and torch.compile --------------------------------------------------------
def test_opcheck_add_norm():
    gen = torch.Generator().manual_seed(7)
    for kind, b_on in (("layernorm", True), ("rmsnorm", False)):
        h, z = leaf(2, 33, gen=gen), leaf(2, 33, gen=gen)
        w, b = param(33, torch.float32, gen), param(33, torch.float32, gen, b_on)
        torch.library.opcheck(torch.ops.siamesenorm.add_norm.default, (h, z, w, b, kind, EPS))
    s, n, stats = torch.ops.siamesenorm.add_norm(h.detach(), z.detach(), w.detach(), None, "rmsnorm", EPS)
    torch.library.opcheck(torch.ops.siamesenorm.add_norm_backward.default,
                          (None, torch.randn_like(n), s, w.detach(), None, stats, "rmsnorm", EPS, True,
                           False))


def test_opcheck_update_entry():
    gen = torch.Generator().manual_seed(8)
    x, y, o = (leaf(2, 33, gen=gen) for _ in range(3))
    p = [param(33, torch.float32, gen) for _ in range(6)]
    op = torch.ops.siamesenorm.update_entry.default
    torch.library.opcheck(op, (x, y, o, 0.5, *p, "layernorm", EPS, "norm", True, True))
    torch.library.opcheck(op, (x, y, None, 1.0, p[0], None, p[2], None, None, None, "rmsnorm", EPS, "gain",
                               True, False))
    with torch.no_grad():
        xo, y1, b, x1, stats = op(x, y, o, 0.5, *p, "layernorm", EPS, "norm", True, True)
    g = torch.randn_like(b)
    torch.library.opcheck(torch.ops.siamesenorm.update_entry_backward.default,
                          (g, g, g, x1, y1, *(t.detach() for t in p), stats, True, 0.5, "layernorm", EPS,
                           "norm", True, True))


def test_compile_matches_eager():
    gen = torch.Generator().manual_seed(9)
    h, z, o = (leaf(3, 33, gen=gen) for _ in range(3))
    w, b = param(33, torch.float32, gen), param(33, torch.float32, gen)

    def step(h, z, o, w, b):
        s, n = add_norm(h, z, w, b, kind="layernorm", eps=EPS)
        xo, y1, inp = siamese_update_entry(s, n, o, 0.25, x_weight=w, y_weight=w, in_weight=w, kind="rmsnorm",
                                           eps=EPS)
        return (xo * y1).sum() + (inp * inp).sum()

    args = (h, z, o, w, b)
    eager = step(*args)
    want = torch.autograd.grad(eager, args)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(*args)
    got = torch.autograd.grad(compiled, args)
    torch.testing.assert_close(compiled, eager)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e)


# ---- dispatch and the PyTorch fallback --------------------------------------------------------------
def test_fallback_matches_kernels(monkeypatch):
    """The PyTorch path (no kernels) and the kernels agree."""
    gen = torch.Generator().manual_seed(10)
    x, y, o = (leaf(7, 33, gen=gen) for _ in range(3))
    w = param(33, torch.float32, gen)
    kw = {"x_weight": w, "y_weight": w, "in_weight": w, "kind": "rmsnorm", "eps": EPS}
    fused = siamese_update_entry(x, y, o, 0.5, **kw) + add_norm(x, y, w, eps=EPS)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert CUDA or not kernels_available(x)
    if not CUDA:
        plain = siamese_update_entry(x, y, o, 0.5, **kw) + add_norm(x, y, w, eps=EPS)
        for a, b in zip(fused, plain):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_cpu_takes_the_pytorch_path_without_a_word():
    """Without CUDA (and without the interpreter) the PyTorch path runs, and nothing is said: the
    kernels were never expected there (a CPU model calls the ops on every step); Triton is not
    imported."""
    code = textwrap.dedent("""
        import sys, torch
        from siamesenorm.kernels import add_norm, kernels_available, siamese_update_entry
        x = torch.randn(3, 8)
        assert not kernels_available(x)
        for _ in range(2):
            add_norm(x, x)
            siamese_update_entry(x, x, x, 0.5, kind="layernorm")
        assert "triton" not in sys.modules
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""


def test_bad_arguments():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="no bias"):
        add_norm(x, x, None, torch.ones(8), kind="rmsnorm")
    with pytest.raises(ValueError, match="gain"):
        siamese_update_entry(x, x, x_mode="gain")
    with pytest.raises(ValueError, match="x_mode"):
        siamese_update_entry(x, x, x_mode="scale")


def test_siamesenorm_kernels_0_turns_every_kernel_off_without_a_word(monkeypatch, capsys):
    from siamesenorm.kernels import availability
    x = torch.randn(3, 8, device=DEVICE)
    assert kernels_available(x)
    monkeypatch.setenv("SIAMESENORM_PATH", "lean")
    monkeypatch.setattr(availability, "_announced", False)
    assert not kernels_available(x)
    availability.announce_fallback()
    assert capsys.readouterr().err == ""


# ---- the kernel inside SiameseNorm's lean entry ----------------------------------------------------
@pytest.mark.parametrize("scheme,form,norm,checkpointing", [
    ("siamese", "post_pre", "rmsnorm", "none"), ("siamese", "hybrid_pre", "layernorm", "none"),
    ("siamese", "post_pre", "layernorm", "none"), ("siamese", "post_pre", "rmsnorm", "sublayer"),
    ("pre", None, "rmsnorm", "none"), ("pre", None, "layernorm", "sublayer")])
def test_models_with_the_fused_kernels_equal_the_reference(scheme, form, norm, checkpointing, monkeypatch):
    """A SiameseNorm (Pre-Norm) language model whose sublayers hand their stream writes (residual
    add) to the next entry (norm) and run both in one kernel (on the CPU here, through the
    interpreter): loss, every gradient and the streams a tap records equal the reference path's
    (float32, width 30: a masked tail)."""
    from siamesenorm.analysis.tap import StreamTap
    from siamesenorm.models import LanguageModel, LMConfig
    from siamesenorm.models.checkpointing import set_activation_checkpointing
    from siamesenorm.nn import fused

    calls = []
    entry, add = fused._kernel_entry, fused.add_norm
    monkeypatch.setattr(fused, "_kernel_entry", lambda *a: calls.append(len(a) > 7) or entry(*a))
    monkeypatch.setattr(fused, "add_norm", lambda *a, **k: calls.append(True) or add(*a, **k))
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=32, dim=30, n_layers=2, n_heads=1, max_seq_len=8, norm=norm,
                   scheme=scheme, scheme_options={"form": form} if form else {})
    model = LanguageModel(cfg).to(DEVICE)
    set_activation_checkpointing(model, checkpointing)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("scheme."):
                p.add_(0.1 * torch.randn_like(p))
    x = torch.randint(0, 32, (2, 4), device=DEVICE)

    def run():
        with StreamTap(model) as tap:
            loss = model(x[:, :-1], x[:, 1:]).loss
        grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
        streams = [t for state in tap.states for t in state.values()]
        return [loss, *(g for g in grads if g is not None), *streams]

    got = run()
    # forward: 4 sublayers and the exit, every one after the first taking the previous sublayer's
    # writes (a checkpointed backward runs the steps again); Pre-Norm's first norm is its own
    expected = ([] if scheme == "pre" else [False]) + [True] * 4
    assert calls[:len(expected)] == expected, calls
    with use_path("reference"):
        want = run()
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme,calls_asked", [("siamese", 5), ("pre", 4)])
def test_compiled_graphs_call_the_fused_kernel_when_asked(scheme, calls_asked, monkeypatch):
    """Under ``kernels_in_compiled_graphs`` a compiled SiameseNorm (Pre-Norm) step is one graph that
    calls the fused op (the handed-over writes included) in place of the plain composition, with
    the reference path's loss and gradients; without it the graph has no such call."""
    import torch._dynamo as dynamo

    from siamesenorm.models import LanguageModel, LMConfig

    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=32, dim=30, n_layers=2, n_heads=1, max_seq_len=8, scheme=scheme)
    model = LanguageModel(cfg).to(DEVICE)
    x = torch.randint(0, 32, (2, 4), device=DEVICE)
    params = list(model.parameters())

    def run(fn):
        loss = fn(x[:, :-1], x[:, 1:]).loss
        return [loss, *torch.autograd.grad(loss, params)]

    with use_path("reference"):
        want = run(model)
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    for asked in (True, False):
        graphs.clear()
        dynamo.reset()
        with use_path("kernels", compiled_graphs=asked):
            got = run(torch.compile(model, backend=backend, fullgraph=True))
        calls = [n for g in graphs for n in g.graph.nodes if "siamesenorm" in str(n.target)]
        assert len(graphs) == 1 and len(calls) == (calls_asked if asked else 0), (len(graphs), calls)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    dynamo.reset()


# Collect what can run here: the tests, or (no GPU, Triton loaded without its interpreter) the test
# that runs them in a fresh process.
collect(globals(), IN_PROCESS)
