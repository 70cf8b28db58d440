"""Attention Residuals (arXiv 2603.15031): the scheme against the paper's equations, written here.

The reference follows the paper's notation with 0-based sublayers: sources ``v_0 = h`` (the
embedding) and the sublayer outputs; ``phi(q, k) = exp(q . RMSNorm(k))`` (§3.1, no temperature);
block ``n`` sums the outputs of ``S`` consecutive sublayers (Eq. 5); sublayer ``l`` attends over
``b_0 = h``, the completed blocks and, unless it opens a block, the partial sum of its own block
(Eq. 6); the output layer over every block, the last one partial when ``S`` does not divide the
sublayers (§3.2). It never calls the scheme's ``enter``/``step``/``exit``.
"""

from __future__ import annotations

import math

import pytest
import torch

import siamesenorm as sn
from helpers import cli_in_process, make_branches, randomize_, run_scheme
from siamesenorm.compute import use_path
from siamesenorm.models import DiT, DiTConfig, LanguageModel, LMConfig, VisionTransformer, ViTConfig

F64 = torch.float64
DIM, LAYERS, EPS = 8, 3, 1e-3          # 6 sublayers


# ---- the paper's equations -------------------------------------------------------------------
def rmsnorm(x, weight, eps=EPS):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def layernorm(x, weight, bias, eps=EPS):
    mean = x.mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt((x - mean).pow(2).mean(-1, keepdim=True) + eps) * weight + bias


def scheme_norm(scheme, module, x):
    if scheme.norm_kind == "rmsnorm":
        return rmsnorm(x, module.weight)
    return layernorm(x, module.weight, module.bias)


def attend(sources, query, key_gain):
    """Eqs. 2-4: ``sum_i phi(w, k_i) v_i / sum_j phi(w, k_j)`` with ``k_i = v_i``."""
    phis = [torch.exp((query * rmsnorm(v, key_gain)).sum(-1, keepdim=True)) for v in sources]
    total = sum(phis)
    return sum(p / total * v for p, v in zip(phis, sources))


def sources_for(h, outputs, layer, block_size):
    """What sublayer ``layer`` (0-based) attends over, given the outputs of sublayers before it."""
    if block_size is None:                                           # Eq. 3
        return [h, *outputs[:layer]]
    done = layer // block_size                                       # completed blocks
    blocks = [h] + [sum(outputs[k * block_size:(k + 1) * block_size]) for k in range(done)]
    partial = outputs[done * block_size:layer]                       # b_n^{i-1}, Eq. 6
    return blocks + ([sum(partial)] if partial else [])


def paper_forward(scheme, h, branches, block_size):
    outputs, inputs = [], []
    for layer in range(scheme.n_sublayers):
        sources = sources_for(h, outputs, layer, block_size)
        if layer == 0:                   # one source, the embedding: a softmax over it is 1
            assert len(sources) == 1
            x = h
        else:
            x = attend(sources, scheme.pseudo_query[layer - 1], scheme.key_norm[layer - 1].weight)
        inputs.append(x)
        outputs.append(branches[layer](scheme_norm(scheme, scheme.input_norm[layer], x)))
    n = scheme.n_sublayers
    final = sources_for(h, outputs, n, block_size)
    if block_size is not None and n % block_size:    # the last partial sum is the last block
        final = final[:-1] + [sum(outputs[(n // block_size) * block_size:])]
        assert len(final) == 1 + math.ceil(n / block_size)
    out = attend(final, scheme.output_query, scheme.output_key_norm.weight)
    return scheme_norm(scheme, scheme.final_norm, out), inputs


# ---- helpers ---------------------------------------------------------------------------------
def build(block_size=None, norm="layernorm", layers=LAYERS, **options):
    return sn.build_scheme("attn_res", DIM, layers, norm=norm, eps=EPS, dtype=F64,
                           block_size=block_size, **options)


def tokens(seed=5):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 3, DIM, generator=g, dtype=F64) * 1.5 + 0.3).requires_grad_()


def values_and_grads(scheme, fn, h):
    out = fn()
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=F64)
    params = [p for _, p in scheme.named_parameters()]
    return out, torch.autograd.grad((out * probe).sum(), [h, *params])


BLOCKS = [None, 1, 2, 3, 4, 6]     # 4 leaves a short last block (6 sublayers), 6 one block


# ---- equations -------------------------------------------------------------------------------
@pytest.mark.parametrize("lean", [True, False], ids=["lean", "reference_path"])
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("block_size", BLOCKS)
def test_values_and_gradients_equal_the_papers_equations(block_size, norm, lean):
    scheme = build(block_size, norm)
    randomize_(scheme, scale=0.5)                       # non-zero pseudo-queries: non-uniform mixes
    h, fs = tokens(), make_branches(scheme.n_sublayers, DIM)
    with use_path("reference" if not lean else "kernels"):
        ours, ours_grads = values_and_grads(scheme, lambda: run_scheme(scheme, h, fs), h)
    ref, ref_grads = values_and_grads(scheme, lambda: paper_forward(scheme, h, fs, block_size)[0], h)
    torch.testing.assert_close(ours, ref, atol=1e-10, rtol=1e-10)
    names = ["h", *(n for n, _ in scheme.named_parameters())]
    for name, a, b in zip(names, ours_grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=name)
    assert any(g.abs().max() > 1e-3 for g in ref_grads[1:])


def test_the_reference_can_fail():
    scheme = build(2)
    randomize_(scheme, scale=0.5)
    h, fs = tokens(), make_branches(scheme.n_sublayers, DIM)
    ours = run_scheme(scheme, h, fs)
    for other in (3, 1, None):                        # other groupings give other outputs
        assert not torch.allclose(ours, paper_forward(scheme, h, fs, other)[0], atol=1e-4)
    with torch.no_grad():
        scheme.key_norm[2].weight.mul_(3.0)           # the gain of the keys' RMSNorm matters
    assert not torch.allclose(ours, paper_forward(scheme, h, fs, 2)[0], atol=1e-4)


def test_block_size_one_is_the_full_form():
    full, one = build(None), build(1)
    randomize_(full, scale=0.5)
    one.load_state_dict(full.state_dict())
    h, fs = tokens(), make_branches(full.n_sublayers, DIM)
    torch.testing.assert_close(run_scheme(one, h, fs), run_scheme(full, h, fs), atol=0, rtol=0)


@pytest.mark.parametrize("block_size, n_sources", [(None, 7), (1, 7), (2, 4), (4, 3), (6, 2)])
def test_the_state_holds_the_embedding_and_one_tensor_per_output_or_block(block_size, n_sources):
    scheme, h = build(block_size), tokens()
    state = scheme.enter(h)
    assert state == (h,)
    for i, f in enumerate(make_branches(scheme.n_sublayers, DIM)):
        state = scheme.step(state, i, f)
    assert len(state) == n_sources and state[0] is h


# ---- initialisation: uniform weights ---------------------------------------------------------
@pytest.mark.parametrize("block_size", [None, 2, 4])
def test_zero_pseudo_queries_feed_each_sublayer_the_mean_of_its_sources(block_size):
    scheme = build(block_size)
    assert not scheme.pseudo_query.any() and not scheme.output_query.any()   # §5: zero init
    with torch.no_grad():                  # keys with different gains: only the queries' zeros
        for p in [*scheme.key_norm.parameters(), *scheme.output_key_norm.parameters(),
                  *scheme.input_norm.parameters(), *scheme.final_norm.parameters()]:
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2), dtype=F64))
    h, fs = tokens(), make_branches(scheme.n_sublayers, DIM)
    seen, outputs = [], []

    def recorded(f):
        def branch(u):
            seen.append(u)
            outputs.append(f(u))
            return outputs[-1]
        return branch

    out = run_scheme(scheme, h, [recorded(f) for f in fs])
    for layer, u in enumerate(seen):
        sources = sources_for(h, outputs, layer, block_size)
        mean = torch.stack(sources).mean(0)
        torch.testing.assert_close(u, scheme_norm(scheme, scheme.input_norm[layer], mean))
    expected = torch.stack(_state_after(scheme, h, fs)).mean(0)
    torch.testing.assert_close(out, scheme_norm(scheme, scheme.final_norm, expected))
    with torch.no_grad():
        scheme.pseudo_query[2].fill_(0.7)  # a non-zero query weighs the sources unevenly
    seen.clear(), outputs.clear()
    run_scheme(scheme, h, [recorded(f) for f in fs])
    mean = torch.stack(sources_for(h, outputs, 3, block_size)).mean(0)
    assert not torch.allclose(seen[3], scheme_norm(scheme, scheme.input_norm[3], mean), atol=1e-4)


def _state_after(scheme, h, fs):
    state = scheme.enter(h)
    for i, f in enumerate(fs):
        state = scheme.step(state, i, f)
    return state



# ---- options ---------------------------------------------------------------------------------
@pytest.mark.parametrize("value, fragment", [
    (0, r"option block_size=0 is outside \[1, inf\]"),
    (-2, r"option block_size=-2 is outside"),
    (2.0, r"option block_size must be an integer, got 2.0"),
    ("2", r"option block_size must be an integer, got '2'"),
    (True, r"option block_size must be an integer, got True"),
    (7, r"option block_size=7 is more than the 6 sublayers"),
])
def test_bad_block_sizes_are_refused_in_one_line(value, fragment):
    with pytest.raises(sn.ConfigError, match=fragment) as err:
        build(value)
    assert "\n" not in str(err.value) and str(err.value).startswith("scheme 'attn_res': option block_size")


@pytest.mark.parametrize("option, fragment", [
    ("model.scheme_options.block_size=0", "option block_size=0 is outside"),
    ("model.scheme_options.block_size=5", "option block_size=5 is more than the 4 sublayers"),
    ("model.scheme_options.block_size=two", "option block_size must be an integer"),
])
def test_the_cli_refuses_a_bad_block_size_with_exit_status_2(tmp_path, option, fragment):
    """The command in this process (what its process ends with on a status 2:
    tests/test_cli.py)."""
    out = tmp_path / "run"
    res = cli_in_process("train", "tiny", "model.scheme=attn_res", option, "--out", str(out))
    assert res.returncode == 2 and fragment in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    assert not (out / "metrics.jsonl").exists()


# ---- hosts -----------------------------------------------------------------------------------
@pytest.mark.parametrize("options", [{}, {"block_size": 2}, {"block_size": 3}])
def test_language_model_trains_and_cached_generation_equals_uncached(options):
    cfg = LMConfig(vocab_size=61, dim=32, n_layers=3, n_heads=4, max_seq_len=64, scheme="attn_res",
                   scheme_options=options, tie_embeddings=False)
    torch.manual_seed(0)
    model = LanguageModel(cfg, dtype=F64)
    ids = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(4):
        loss = model(ids[:, :-1], ids[:, 1:]).loss
        opt.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    assert model.scheme.pseudo_query.abs().max() > 0      # the queries learn
    with torch.no_grad():
        model.scheme.pseudo_query.normal_(0, 1.0, generator=torch.Generator().manual_seed(3))
    prompt = ids[:2, :5]
    cached = model.generate(prompt, 12, greedy=True, use_cache=True)
    assert torch.equal(cached, model.generate(prompt, 12, greedy=True, use_cache=False))
    model.eval()
    full, cache = model(ids[:2]).logits, model.new_cache(batch_size=2)
    with torch.no_grad():
        for start, end in [(0, 6), (6, 7), (7, 16)]:
            torch.testing.assert_close(model(ids[:2, start:end], cache=cache, pos=start).logits,
                                       full[:, start:end], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("options", [{}, {"block_size": 3}])
def test_vit_and_dit_train_a_step_with_finite_gradients(options):
    torch.manual_seed(0)
    vit = VisionTransformer(ViTConfig(image_size=8, patch_size=4, in_chans=3, num_classes=5, dim=16,
                                      n_layers=2, n_heads=4, mlp_ratio=2.0, drop_path=0.1,
                                      scheme="attn_res", scheme_options=options)).train()
    images = torch.randn(4, 3, 8, 8)
    loss = vit(images, torch.tensor([0, 1, 2, 3])).loss
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in vit.parameters())
    assert vit.scheme.pseudo_query.grad.abs().max() > 0
    dit = DiT(DiTConfig(input_size=8, patch_size=2, in_chans=3, num_classes=5, dim=16, n_layers=2,
                        n_heads=4, mlp_ratio=2.0, scheme="attn_res", scheme_options=options)).train()
    with torch.no_grad():               # wake the zero-initialised adaLN so gradients reach the scheme
        for lin in [m[1] for m in dit.modulation] + [dit.final_layer.modulation[1], dit.final_layer.linear]:
            lin.weight.normal_(0, 0.1)
            lin.bias.normal_(0, 0.1)
    out = dit(images, torch.tensor([1, 10, 100, 999]), torch.tensor([0, 1, 2, 3]))
    out.pow(2).mean().backward()
    assert torch.isfinite(out).all() and all(torch.isfinite(p.grad).all() for p in dit.parameters())
    assert dit.scheme.final_norm is None           # DiT's own final layer normalises
    assert dit.scheme.pseudo_query.grad.abs().max() > 0


# ---- the lean depth mix ------------------------------------------------------------------------
@pytest.mark.parametrize("gain", [True, False])
def test_the_lean_depth_mix_equals_the_composed_one_and_passes_gradcheck(gain):
    from siamesenorm.nn.depth_mix import _DepthMix, depth_mix
    g = torch.Generator().manual_seed(4)
    sources = tuple((torch.randn(2, 3, DIM, generator=g, dtype=F64) * s).requires_grad_()
                    for s in (1.0, 3.0, 0.2, 1.5))
    query = torch.randn(DIM, generator=g, dtype=F64).requires_grad_()
    key_gain = (1 + 0.3 * torch.randn(DIM, generator=g, dtype=F64)).requires_grad_() if gain else None
    inputs = [*sources, query] + ([key_gain] if gain else [])
    calls = []
    original = _DepthMix.forward
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_DepthMix, "forward", staticmethod(lambda *a: calls.append(1) or original(*a)))
        lean, lean_grads = values_and_grads_of(lambda: depth_mix(sources, query, key_gain, EPS), inputs)
    assert calls                                                # the lean function ran
    with use_path("reference"):
        plain, plain_grads = values_and_grads_of(lambda: depth_mix(sources, query, key_gain, EPS), inputs)
    expected = attend(sources, query, key_gain if gain else torch.ones(DIM, dtype=F64))
    torch.testing.assert_close(lean, expected, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(plain, expected, atol=1e-12, rtol=1e-12)
    for a, b in zip(lean_grads, plain_grads):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    u = query.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda uu, *vs: _DepthMix.apply(uu, EPS, *vs), (u, *sources))


def values_and_grads_of(fn, inputs):
    out = fn()
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=F64)
    return out, torch.autograd.grad((out * probe).sum(), inputs)


def test_the_lean_depth_mix_in_bfloat16_is_close_to_float64():
    from siamesenorm.nn.depth_mix import depth_mix
    g = torch.Generator().manual_seed(6)
    sources = [torch.randn(4, 5, 32, generator=g, dtype=F64) for _ in range(3)]
    query = torch.randn(32, generator=g, dtype=F64)
    want = attend(sources, query, torch.ones(32, dtype=F64))
    low = tuple(s.bfloat16().requires_grad_() for s in sources)
    got = depth_mix(low, query.bfloat16().requires_grad_(), None, EPS)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, atol=0.05, rtol=0.02)
    got.float().sum().backward()
    assert all(s.grad.dtype == torch.bfloat16 and torch.isfinite(s.grad).all() for s in low)


def dyt_ref(x, norm):
    return torch.tanh(norm.alpha * x) * norm.weight + norm.bias


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm", "dyt"])
def test_the_lean_mix_with_an_input_norm_equals_the_papers_and_keeps_only_sources_and_row_stats(kind, affine):
    from siamesenorm.nn.depth_mix import _DepthMixNorm, depth_mix
    from siamesenorm.nn.norms import build_norm
    g = torch.Generator().manual_seed(7)
    sources = tuple((torch.randn(2, 3, DIM, generator=g, dtype=F64) * s + 0.2).requires_grad_()
                    for s in (1.0, 2.5, 0.3))
    query = torch.randn(DIM, generator=g, dtype=F64).requires_grad_()
    key_gain = (1 + 0.3 * torch.randn(DIM, generator=g, dtype=F64)).requires_grad_()
    norm = build_norm(kind, DIM, EPS, affine=affine or kind == "dyt", dtype=F64)
    randomize_(norm, scale=0.5)
    inputs = [*sources, query, key_gain, *norm.parameters()]
    saved, calls = [], []
    original = _DepthMixNorm.forward
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_DepthMixNorm, "forward", staticmethod(lambda *a: calls.append(1) or original(*a)))
        lean, lean_grads = values_and_grads_of(lambda: depth_mix(sources, query, key_gain, EPS, norm), inputs)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            depth_mix(sources, query, key_gain, EPS, norm)
    assert bool(calls) == (kind != "dyt")          # DyT runs after the lean mix in a lean region
    mixed = attend(sources, query, key_gain)
    if kind == "dyt":
        expected = dyt_ref(mixed, norm)
    elif kind == "rmsnorm":
        expected = rmsnorm(mixed, norm.weight if affine else 1.0)
    else:
        expected = layernorm(mixed, norm.weight, norm.bias) if affine else layernorm(mixed, 1.0, 0.0)
    ref, ref_grads = values_and_grads_of(lambda: expected, inputs)
    torch.testing.assert_close(lean, ref, atol=1e-12, rtol=1e-12)
    for a, b in zip(lean_grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    if kind == "dyt":          # lean_region runs plainly under the outer hooks that count here
        return
    # kept for backward: the sources themselves and tensors of at most one number per row
    big = [t for t in saved if t.shape[-1:] == (DIM,) and t.numel() > DIM]
    assert all(any(t is s for s in sources) for t in big), [tuple(t.shape) for t in big]
    assert sum(t.numel() for t in saved if t.numel() > DIM and t.shape[-1:] != (DIM,)) <= 2 * 2 * 3


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_the_lean_mix_with_an_input_norm_passes_gradcheck(kind):
    from siamesenorm.nn.depth_mix import _DepthMixNorm
    from siamesenorm.nn.fused import _Norm
    g = torch.Generator().manual_seed(8)
    sources = tuple(torch.randn(2, 3, DIM, generator=g, dtype=F64).requires_grad_() for _ in range(3))
    u = torch.randn(DIM, generator=g, dtype=F64).requires_grad_()
    nw = (1 + 0.3 * torch.randn(DIM, generator=g, dtype=F64)).requires_grad_()
    nb = (0.3 * torch.randn(DIM, generator=g, dtype=F64)).requires_grad_() if kind == "layernorm" else None
    spec = _Norm(kind, EPS)
    if nb is None:
        assert torch.autograd.gradcheck(lambda uu, w, *vs: _DepthMixNorm.apply(spec, uu, EPS, w, None, *vs),
                                        (u, nw, *sources))
    else:
        assert torch.autograd.gradcheck(lambda uu, w, b, *vs: _DepthMixNorm.apply(spec, uu, EPS, w, b, *vs),
                                        (u, nw, nb, *sources))


def test_the_scheme_runs_each_lean_mix_once_forward_without_a_recompute():
    """Each sublayer's entry is one lean function (no checkpoint region that reruns the mix)."""
    from siamesenorm.nn.depth_mix import _DepthMixNorm
    scheme = build(2, "rmsnorm")
    randomize_(scheme, scale=0.5)
    h, fs = tokens(), make_branches(scheme.n_sublayers, DIM)
    calls = []
    original = _DepthMixNorm.forward
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_DepthMixNorm, "forward", staticmethod(lambda *a: calls.append(1) or original(*a)))
        run_scheme(scheme, h, fs).sum().backward()
    assert len(calls) == scheme.n_sublayers - 1
