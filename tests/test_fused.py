"""The memory-lean path of ``siamesenorm.nn.fused`` against the plain composition of modules.

Every test here fails if the lean path computes something else than the reference (values or
gradients, float64 to 1e-10), if it silently stops being taken (the autograd graph is inspected
for its nodes), or if it keeps more for backward than the streams, the branch input and the row
statistics of the norms (bytes counted with ``saved_tensors_hooks``, the expected figure computed
from shapes alone).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef

from siamesenorm.compute import use_path
from siamesenorm.models import LanguageModel, LMConfig
from siamesenorm.nn import fused
from siamesenorm.nn.fused import rms_norm, stream_entry
from siamesenorm.nn.norms import build_norm
from siamesenorm.schemes import build_scheme

F64 = torch.float64
NORMS = ("layernorm", "rmsnorm")
ENTRY_NORMS = (*NORMS, "dyt")   # the stream entry also fuses DyT (alpha travels as a parameter)
EPS = 1e-3  # not the default, so a lean norm that ignores the module's eps shows up
TOL = {"rtol": 0.0, "atol": 1e-10}
LEAN_NODES = ("StreamEntry", "StreamUpdate", "_RMSNorm")  # the lean Functions' backward nodes


# ---- helpers ------------------------------------------------------------------------------------
def graph_nodes(*outputs: Tensor) -> list:
    """Every distinct autograd node behind ``outputs``."""
    seen, todo, nodes = set(), [t.grad_fn for t in outputs], []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nodes.append(node)
        todo.extend(f for f, _ in node.next_functions)
    return nodes


def count_nodes(fragment: str, *outputs: Tensor) -> int:
    return sum(fragment in type(n).__name__ for n in graph_nodes(*outputs))


def assert_plain_graph(*outputs: Tensor) -> None:
    names = {type(n).__name__ for n in graph_nodes(*outputs)}
    lean = sorted(n for n in names if any(f in n for f in LEAN_NODES))
    assert not lean, f"lean nodes on the reference path: {lean}"


def randomise(module: nn.Module, seed: int = 0, scale: float = 0.5) -> None:
    """Move every parameter away from its initial value (norm weights, biases, x_gain ...)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def rand(*shape: int, seed: int, dtype=F64, requires_grad: bool = True) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=gen, dtype=dtype) * 1.3 + 0.2
    return t.requires_grad_(requires_grad)


def assert_same_grads(lean: dict, ref: dict) -> None:
    assert lean.keys() == ref.keys()
    for name in lean:
        g, r = lean[name], ref[name]
        assert (g is None) == (r is None), f"{name}: gradient on one path only"
        if g is not None:
            torch.testing.assert_close(g, r, **TOL, msg=lambda m, name=name: f"{name}: {m}")


# ---- 1. SiameseNorm, every option, lean == reference --------------------------------------------
N_LAYERS, DIM = 2, 8

SIAMESE_GRID = list(itertools.product(
    ("post_pre", "hybrid_pre"),          # form
    (True, False),                       # input_norm
    (True, False),                       # depth_scale
    ("siamese", "single", "resi_dual"),  # topology
    ("normed_sum", "sum"),               # merge
    (True, False),                       # branch_affine
    (True, False),                       # final_norm
    NORMS))                              # norm


def drive(scheme, branches: nn.ModuleList, h: Tensor, cotangent: Tensor):
    """Run the scheme over ``tanh(Linear(u))`` sublayers; output, names of the graph's lean nodes
    (counted) and the gradients of ``h`` and of every parameter of scheme and branches."""
    named = {"h": h, **{f"scheme.{n}": p for n, p in scheme.named_parameters()},
             **{f"branch.{n}": p for n, p in branches.named_parameters()}}
    for t in named.values():
        t.grad = None
    state = scheme.enter(h)
    for i, lin in enumerate(branches):
        state = scheme.step(state, i, lambda u, lin=lin: torch.tanh(lin(u)))
    out = scheme.exit(state)
    counts = {f: count_nodes(f, out) for f in LEAN_NODES}
    (out * cotangent).sum().backward()
    grads = {n: None if t.grad is None else t.grad.clone() for n, t in named.items()}
    return out.detach(), counts, grads


def expected_entries(form: str, input_norm: bool, topology: str) -> int:
    """Sublayer entries (and the exit) that read a norm of Y or of the sum: each is one node."""
    count = 0
    for i in range(2 * N_LAYERS):
        with_y = topology == "siamese"
        with_in = input_norm and (form == "post_pre" or i % 2 == 1)
        count += with_y or with_in
    return count + (topology != "single")  # exit: LN_a(X) + LN_b(Y) (inside LN, or not)


@pytest.mark.parametrize(
    "form,input_norm,depth_scale,topology,merge,branch_affine,final_norm,norm", SIAMESE_GRID)
def test_siamese_lean_equals_reference_for_every_option(form, input_norm, depth_scale, topology,
                                                        merge, branch_affine, final_norm, norm):
    torch.manual_seed(0)
    scheme = build_scheme("siamese", DIM, N_LAYERS, form=form, input_norm=input_norm,
                          depth_scale=depth_scale, topology=topology, merge=merge,
                          branch_affine=branch_affine, final_norm=final_norm, norm=norm, eps=EPS,
                          dtype=F64)
    initial = {n: p.detach().clone() for n, p in scheme.named_parameters()}
    randomise(scheme, seed=1)
    for n, p in scheme.named_parameters():
        assert not torch.equal(p, initial[n]), f"{n} still at its initial value"
    branches = nn.ModuleList(nn.Linear(DIM, DIM, dtype=F64) for _ in range(2 * N_LAYERS))
    h = rand(2, 3, DIM, seed=2)
    h0 = h.detach().clone()
    cotangent = rand(2, 3, DIM, seed=3, requires_grad=False)

    out, counts, grads = drive(scheme, branches, h, cotangent)
    with use_path("reference"):
        ref_out, ref_counts, ref_grads = drive(scheme, branches, h, cotangent)

    # the lean path is taken: one StreamEntry per entry with a norm of Y or of the sum, one
    # StreamUpdate per sublayer writing into two streams; none of them on the reference path
    assert counts["StreamEntry"] == expected_entries(form, input_norm, topology)
    assert counts["StreamUpdate"] == (0 if topology == "single" else 2 * N_LAYERS)
    assert not any(ref_counts.values()), ref_counts
    torch.testing.assert_close(h.detach(), h0, rtol=0, atol=0)  # h not modified in place
    assert out.dtype == ref_out.dtype == F64
    torch.testing.assert_close(out, ref_out, **TOL)
    assert grads["h"] is not None
    assert_same_grads(grads, ref_grads)


# ---- 2. a whole language model -------------------------------------------------------------------
LM_SCHEMES = [("siamese", {"form": "post_pre"}), ("siamese", {"form": "hybrid_pre"}),
              ("pre", {}), ("hyper", {})]


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("scheme,options", LM_SCHEMES,
                         ids=["siamese-post_pre", "siamese-hybrid_pre", "pre", "hyper"])
def test_language_model_lean_equals_reference(scheme, options, norm):
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, max_seq_len=8, scheme=scheme,
                   scheme_options=options, norm=norm, norm_eps=EPS)
    model = LanguageModel(cfg, dtype=F64)
    randomise(model, seed=4, scale=0.2)
    tokens = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(5))
    results = {}
    for path in ("lean", "reference"):
        model.zero_grad(set_to_none=True)
        with use_path("reference" if path == "reference" else "kernels"):
            loss = model(tokens[:, :-1], tokens[:, 1:]).loss
        names = {type(n).__name__ for n in graph_nodes(loss)}
        loss.backward()
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        results[path] = loss.detach(), names, grads
    (loss, names, grads), (ref_loss, ref_names, ref_grads) = results["lean"], results["reference"]
    if scheme == "siamese":
        assert any("StreamEntry" in n for n in names)
    elif norm == "rmsnorm":  # pre and hyper: RMSNorm modules
        assert any("_RMSNorm" in n for n in names)
    assert not any(f in n for n in ref_names for f in LEAN_NODES)
    assert loss.dtype == F64
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-12)
    assert all(g is not None for g in grads.values())
    assert_same_grads(grads, ref_grads)


# ---- 3. gradcheck --------------------------------------------------------------------------------
SHAPE = (2, 3, 5)


@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_gradcheck_and_value(with_weight):
    x = rand(*SHAPE, seed=6)
    w = rand(SHAPE[-1], seed=7) if with_weight else None
    out = rms_norm(x, w, EPS)
    assert count_nodes("_RMSNorm", out) == 1  # the lean Function, not F.rms_norm
    expected = x / torch.sqrt(x.square().mean(-1, keepdim=True) + EPS)
    if w is not None:
        expected = expected * w
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-13)
    inputs = (x,) if w is None else (x, w)
    assert torch.autograd.gradcheck(lambda *a: rms_norm(a[0], w if len(a) == 1 else a[1], EPS),
                                    inputs)


def _norm(kind: str, affine: bool, seed: int) -> nn.Module:
    m = build_norm(kind, SHAPE[-1], EPS, affine=affine, dtype=F64)
    randomise(m, seed=seed)
    return m


ENTRY_VARIANTS = [v for v in itertools.product(
    ("x_norm", "x_gain", "neither"), (True, False), (True, False), ENTRY_NORMS, (True, False),
    (False, True)) if v[1] or v[2]]  # without y_norm and in_norm there is nothing to fuse


def _entry_setup(x_kind, with_y, with_in, kind, affine):
    x_norm = _norm(kind, affine, 10) if x_kind == "x_norm" else None
    gain = rand(SHAPE[-1], seed=11) if x_kind == "x_gain" else None
    y_norm = _norm(kind, affine, 12) if with_y else None
    in_norm = _norm(kind, affine, 13) if with_in else None
    params = [p for m in (x_norm, y_norm, in_norm) if m is not None for p in m.parameters()]
    if gain is not None:
        params.append(gain)
    return {"x_norm": x_norm, "x_gain": gain, "y_norm": y_norm, "in_norm": in_norm}, params


@pytest.mark.parametrize("x_kind,with_y,with_in,kind,affine,same", ENTRY_VARIANTS)
def test_stream_entry_gradcheck(x_kind, with_y, with_in, kind, affine, same):
    spec, params = _entry_setup(x_kind, with_y, with_in, kind, affine)
    x, y = rand(*SHAPE, seed=14), rand(*SHAPE, seed=15)
    per_norm = {"layernorm": 2 * affine, "rmsnorm": affine, "dyt": 1 + 2 * affine}[kind]  # DyT: alpha
    assert len(params) == (per_norm * ((x_kind == "x_norm") + with_y + with_in) + (x_kind == "x_gain"))

    if same:  # SiameseNorm's first sublayer: X = Y = h, one tensor
        def fn(x, *ps):
            return stream_entry(x, x, **spec)
        inputs = (x, *params)
    else:
        def fn(x, y, *ps):
            return stream_entry(x, y, **spec)
        inputs = (x, y, *params)

    xo, b = fn(*inputs)
    assert count_nodes("StreamEntry", xo, b) == 1  # gradcheck below checks the lean Function
    with use_path("reference"):
        ref_xo, ref_b = fn(*inputs)
    assert count_nodes("StreamEntry", ref_xo, ref_b) == 0
    torch.testing.assert_close(xo, ref_xo, rtol=0, atol=1e-13)
    torch.testing.assert_close(b, ref_b, rtol=0, atol=1e-13)
    assert torch.autograd.gradcheck(fn, inputs)


def test_stream_entry_gain_form_returns_the_same_x_out_on_both_paths():
    """``stream_entry(x, y, x_gain=g, ...)`` returns ``(x', b)`` with ``x' = x`` (the gain only
    scales what the branch reads); the two paths of the function itself must agree on it."""
    spec, _ = _entry_setup("x_gain", True, False, "rmsnorm", True)
    x, y = rand(*SHAPE, seed=40), rand(*SHAPE, seed=41)
    xo, _ = stream_entry(x, y, **spec)
    with use_path("reference"):
        ref_xo, _ = stream_entry(x, y, **spec)
    torch.testing.assert_close(ref_xo, x, rtol=0, atol=0)
    torch.testing.assert_close(xo, ref_xo, rtol=0, atol=1e-13)


@pytest.mark.parametrize("x_kind", ["x_norm", "x_gain", "neither"])
@pytest.mark.parametrize("kind", ENTRY_NORMS)
@pytest.mark.parametrize("which", ["x", "y", "params", "x+params", "y+params"])
def test_stream_entry_partial_requires_grad(x_kind, kind, which):
    """Only some of x, y and the parameters want a gradient: the others get none, and those that
    do get the reference's."""
    spec, params = _entry_setup(x_kind, True, True, kind, True)
    x = rand(*SHAPE, seed=16, requires_grad="x" in which)
    y = rand(*SHAPE, seed=17, requires_grad="y" in which)
    for p in params:
        p.requires_grad_("params" in which)
    cot_x, cot_b = rand(*SHAPE, seed=18, requires_grad=False), rand(*SHAPE, seed=19,
                                                                   requires_grad=False)
    wanted = [t for t in (x, y, *params) if t.requires_grad]
    results = []
    for ref in (False, True):
        with use_path("reference" if ref else "kernels"):
            xo, b = stream_entry(x, y, **spec)
        assert count_nodes("StreamEntry", xo, b) == (0 if ref else 1)
        loss = (b * cot_b).sum() + (xo * cot_x).sum()
        grads = torch.autograd.grad(loss, wanted, allow_unused=True)
        results.append(grads)
    for g, r in zip(*results, strict=True):
        assert (g is None) == (r is None)
        if g is not None:
            torch.testing.assert_close(g, r, **TOL)


@pytest.mark.parametrize("kind", ENTRY_NORMS)
@pytest.mark.parametrize("x_kind,with_in,used", [
    ("x_norm", True, "x_out"), ("x_norm", True, "b"), ("x_norm", False, "x_out"),
    ("x_norm", False, "b"), ("x_gain", False, "x_out"), ("x_gain", False, "b"),
    ("neither", True, "b")])
def test_stream_entry_with_one_output_unused(x_kind, with_in, kind, used):
    """Backward with a gradient for one output only (the other one feeds nothing)."""
    spec, params = _entry_setup(x_kind, True, with_in, kind, True)
    x, y = rand(*SHAPE, seed=20), rand(*SHAPE, seed=21)
    results = []
    for ref in (False, True):
        with use_path("reference" if ref else "kernels"):
            xo, b = stream_entry(x, y, **spec)
        target = xo if used == "x_out" else b
        results.append(torch.autograd.grad(target.square().sum(), [x, y, *params],
                                           allow_unused=True, materialize_grads=True))
    for g, r in zip(*results, strict=True):
        torch.testing.assert_close(g, r, **TOL)


def test_stream_entry_mixed_norms_fall_back_to_the_plain_composition():
    """Norms of different kinds or epsilons cannot share one function: plain and correct."""
    x, y = rand(*SHAPE, seed=22), rand(*SHAPE, seed=23)
    ln, rms = _norm("layernorm", True, 24), _norm("rmsnorm", True, 25)
    other_eps = build_norm("layernorm", SHAPE[-1], 1e-2, dtype=F64)
    for spec in ({"x_norm": ln, "y_norm": rms, "in_norm": ln},
                 {"x_norm": ln, "y_norm": other_eps, "in_norm": ln}):
        xo, b = stream_entry(x, y, **spec)
        assert count_nodes("StreamEntry", xo, b) == 0
        expected_xo = spec["x_norm"](x)
        torch.testing.assert_close(xo, expected_xo, rtol=0, atol=0)
        torch.testing.assert_close(b, spec["in_norm"](expected_xo + spec["y_norm"](y)), rtol=0,
                                   atol=0)


# ---- 4. autocast ---------------------------------------------------------------------------------
@pytest.mark.parametrize("x_kind,with_y,with_in", [
    ("x_norm", True, True), ("x_norm", False, True), ("x_norm", True, False),
    ("x_gain", True, False), ("neither", True, True)])
@pytest.mark.parametrize("kind", ENTRY_NORMS)
def test_stream_entry_under_cpu_autocast_matches_reference(x_kind, with_y, with_in, kind):
    spec, params = _entry_setup(x_kind, with_y, with_in, kind, True)
    for p in params:
        p.data = p.data.float()
    x = rand(4, 6, SHAPE[-1], seed=26, dtype=torch.float32)
    y = rand(4, 6, SHAPE[-1], seed=27, dtype=torch.float32)
    results = []
    for ref in (False, True):
        with use_path("reference" if ref else "kernels"), torch.autocast("cpu", dtype=torch.bfloat16):
            xo, b = stream_entry(x, y, **spec)
        assert count_nodes("StreamEntry", xo, b) == (0 if ref else 1)
        loss = b.square().sum() + (xo * 0.7).sum()
        grads = torch.autograd.grad(loss, [x, y, *params], allow_unused=True,
                                    materialize_grads=True)
        results.append((xo, b, grads))
    (xo, b, grads), (ref_xo, ref_b, ref_grads) = results
    assert xo.dtype == ref_xo.dtype and b.dtype == ref_b.dtype
    torch.testing.assert_close(xo, ref_xo, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b, ref_b, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_under_cpu_autocast_matches_reference(with_weight):
    x = rand(4, 6, 16, seed=28, dtype=torch.float32)
    w = rand(16, seed=29, dtype=torch.float32) if with_weight else None
    outs = []
    for ref in (False, True):
        with use_path("reference" if ref else "kernels"), torch.autocast("cpu", dtype=torch.bfloat16):
            out = rms_norm(x, w, EPS)
        assert count_nodes("_RMSNorm", out) == (0 if ref else 1)
        outs.append(out)
    assert outs[0].dtype == outs[1].dtype
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("form", ["post_pre", "hybrid_pre"])
def test_siamese_scheme_under_cpu_autocast_matches_reference(form, norm):
    """A whole scheme on float32 streams (element-wise branches: nothing autocast rounds)."""
    scheme = build_scheme("siamese", 16, 2, form=form, norm=norm, eps=EPS)
    randomise(scheme, seed=30)
    h = rand(4, 6, 16, seed=31, dtype=torch.float32)
    outs = []
    for ref in (False, True):
        with use_path("reference" if ref else "kernels"), torch.autocast("cpu", dtype=torch.bfloat16):
            state = scheme.enter(h)
            for i in range(scheme.n_sublayers):
                state = scheme.step(state, i, lambda u, i=i: torch.tanh(u * (0.5 + 0.1 * i)))
            out = scheme.exit(state)
        assert (count_nodes("StreamEntry", out) > 0) != ref
        outs.append(out)
    assert outs[0].dtype == outs[1].dtype == torch.float32
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
@pytest.mark.parametrize("kind", ENTRY_NORMS)
def test_stream_entry_bf16_inputs_under_cpu_autocast_same_dtype(kind):
    spec, params = _entry_setup("x_norm", True, True, kind, True)
    for p in params:  # float32 parameters, as in a model run under autocast
        p.data = p.data.float()
    x = rand(*SHAPE, seed=32, dtype=torch.bfloat16)
    y = rand(*SHAPE, seed=33, dtype=torch.bfloat16)
    dtypes = []
    for ref in (False, True):
        with use_path("reference" if ref else "kernels"), torch.autocast("cpu", dtype=torch.bfloat16):
            dtypes.append(tuple(t.dtype for t in stream_entry(x, y, **spec)))
    # the plain composition on CPU; DyT's tanh(alpha x) * w with float32 alpha and w promotes
    want = torch.float32 if kind == "dyt" else torch.bfloat16
    assert dtypes[1] == (want, want)
    assert dtypes[0] == dtypes[1]


# ---- 5. no gradient wanted: the plain path -------------------------------------------------------
@pytest.fixture
def lean_calls(monkeypatch):
    """How many times each lean Function's forward runs."""
    calls = {"entry": 0, "rms": 0}

    def counted(key, forward):
        def wrapper(*args, **kwargs):
            calls[key] += 1
            return forward(*args, **kwargs)
        return staticmethod(wrapper)

    monkeypatch.setattr(fused._StreamEntry, "forward",
                        counted("entry", fused._StreamEntry.forward))
    monkeypatch.setattr(fused._RMSNorm, "forward", counted("rms", fused._RMSNorm.forward))
    return calls


def _siamese_out(scheme, h):
    state = scheme.enter(h)
    for i in range(scheme.n_sublayers):
        state = scheme.step(state, i, lambda u, i=i: torch.tanh(u * (0.5 + 0.1 * i)))
    return scheme.exit(state)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("form", ["post_pre", "hybrid_pre"])
@pytest.mark.parametrize("how", ["no_grad", "no_requires_grad"])
def test_no_gradient_wanted_takes_the_plain_path(form, norm, how, lean_calls):
    scheme = build_scheme("siamese", DIM, N_LAYERS, form=form, norm=norm, eps=EPS, dtype=F64)
    randomise(scheme, seed=34)
    h = rand(2, 3, DIM, seed=35)
    lean = _siamese_out(scheme, h)  # the spy sees the lean path when a gradient is wanted
    assert lean_calls["entry"] > 0 and count_nodes("StreamEntry", lean) > 0
    with use_path("reference"):
        ref = _siamese_out(scheme, h)
    lean_calls.update(entry=0, rms=0)
    if how == "no_grad":
        with torch.no_grad():
            out = _siamese_out(scheme, h)
    else:
        scheme.requires_grad_(False)
        out = _siamese_out(scheme, h.detach())
    assert lean_calls == {"entry": 0, "rms": 0}
    assert out.grad_fn is None
    torch.testing.assert_close(out, ref.detach(), rtol=0, atol=0)  # bit for bit the reference
    torch.testing.assert_close(out, lean.detach(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("how", ["no_grad", "no_requires_grad"])
def test_rms_norm_without_gradient_is_plain(how, lean_calls):
    x, w = rand(*SHAPE, seed=36), rand(SHAPE[-1], seed=37)
    lean = rms_norm(x, w, EPS)
    assert lean_calls["rms"] == 1
    with use_path("reference"):
        ref = rms_norm(x, w, EPS)
    if how == "no_grad":
        with torch.no_grad():
            out = rms_norm(x, w, EPS)
    else:
        out = rms_norm(x.detach(), w.detach(), EPS)
    assert lean_calls["rms"] == 1
    assert out.grad_fn is None
    torch.testing.assert_close(out, ref.detach(), rtol=0, atol=0)
    torch.testing.assert_close(out, lean.detach(), rtol=0, atol=1e-13)


# ---- 6. what is kept for backward ----------------------------------------------------------------
def saved_storages(fn, exclude: set) -> dict:
    """``{storage: bytes}`` of the distinct storages autograd saves while ``fn`` runs."""
    seen = {}

    def pack(t):
        ref = StorageWeakRef(t.untyped_storage())
        if ref not in exclude:
            seen[ref] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return seen


class Recording(nn.Module):
    """A bias-free linear branch (saves exactly its input) that remembers its input."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim, bias=False)
        self.inputs: list[Tensor] = []

    def forward(self, u: Tensor) -> Tensor:
        self.inputs.append(u)
        return self.linear(u)


STATS_PER_NORM = {"layernorm": 2, "rmsnorm": 1}  # mean and rstd / rstd: one float32 per row


def _step_saved(scheme, i, norm, batch, seq, dim):
    branch = Recording(dim)
    x, y = rand(batch, seq, dim, seed=38, dtype=torch.float32), \
        rand(batch, seq, dim, seed=39, dtype=torch.float32)
    params = {StorageWeakRef(p.untyped_storage())
              for p in [*scheme.parameters(), *branch.parameters()]}
    saved = {}
    for path in ("lean", "reference"):
        with use_path("reference" if path == "reference" else "kernels"):
            saved[path] = saved_storages(lambda: scheme.step((x, y), i, branch), params)
    return x, y, branch.inputs[0], saved


@pytest.mark.parametrize("norm", NORMS)
def test_siamese_post_pre_step_keeps_streams_branch_input_and_row_statistics(norm):
    batch, seq, dim = 4, 16, 32
    scheme = build_scheme("siamese", dim, 2, form="post_pre", input_norm=True, norm=norm)
    x, y, u, saved = _step_saved(scheme, 1, norm, batch, seq, dim)
    rows, f32 = batch * seq, 4
    residual = rows * dim * f32
    # x, y, the branch input, and LN^X, LN^Y, LN^in's row statistics
    expected = 3 * residual + 3 * STATS_PER_NORM[norm] * rows * f32
    assert sum(saved["lean"].values()) == expected
    for t in (x, y, u):
        assert StorageWeakRef(t.untyped_storage()) in saved["lean"]
    assert sum(saved["reference"].values()) > expected  # the gain the lean path brings
    # (the plain composition keeps the sum feeding LN^in too, at least)
    assert sum(saved["reference"].values()) >= expected + residual


@pytest.mark.parametrize("norm", NORMS)
def test_siamese_hybrid_attention_step_keeps_streams_branch_input_and_one_norm(norm):
    batch, seq, dim = 4, 8, 16
    scheme = build_scheme("siamese", dim, 2, form="hybrid_pre", norm=norm)
    x, y, u, saved = _step_saved(scheme, 2, norm, batch, seq, dim)  # block 1's attention
    rows, f32 = batch * seq, 4
    # x (for x_gain's gradient), y, the branch input, LN^Y's row statistics
    expected = 3 * rows * dim * f32 + STATS_PER_NORM[norm] * rows * f32
    assert sum(saved["lean"].values()) == expected
    for t in (x, y, u):
        assert StorageWeakRef(t.untyped_storage()) in saved["lean"]
    assert sum(saved["reference"].values()) >= expected


# ---- 7. the environment switch -------------------------------------------------------------------
def test_environment_variable_turns_the_lean_path_off():
    code = (
        "import torch\n"
        "from siamesenorm.compute import use_path\n"
        "from siamesenorm.nn.fused import fused_enabled\n"
        "from siamesenorm.schemes import build_scheme\n"
        "s = build_scheme('siamese', 4, 1)\n"
        "def lean():\n"
        "    h = torch.randn(2, 4, requires_grad=True)\n"
        "    out = s.exit(s.step(s.enter(h), 0, torch.tanh))\n"
        "    return 'StreamEntry' in type(out.grad_fn).__name__\n"
        "with use_path('lean'):\n"
        "    forced = lean()\n"
        "print(fused_enabled(), lean(), forced)\n")
    env = dict(os.environ, SIAMESENORM_PATH="reference", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    # off for the process; use_path("lean") turns it back on, which shows the check works
    assert out.stdout.split() == ["False", "False", "True"]
