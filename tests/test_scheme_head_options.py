"""The two options every scheme has for hosts with their own head (DiT): ``branch_affine`` and
``final_norm`` (docs/schemes.md, "Options every scheme has").

Which norms feed a branch alone, and which scheme has an outer final norm, is written down here per
scheme from its equations, so a scheme registered later fails until it is listed. The hand-written
references use their own LayerNorm and never call a scheme's ``enter``/``step``/``exit``.
"""

from __future__ import annotations

import fnmatch
import math

import pytest
import torch

import siamesenorm as sn
from siamesenorm.nn.norms import LayerNorm, RMSNorm

F64 = torch.float64
DIM, LAYERS, EPS = 8, 4, 1e-3

# (scheme, options) -> name patterns of the norms whose output feeds a branch and nothing else.
BRANCH_NORMS: dict[tuple[str, tuple], list[str]] = {
    ("pre", ()): ["pre_norm.*"],
    ("post", ()): [],
    ("siamese", ()): ["input_norm.*"],
    ("siamese", (("input_norm", False),)): [],
    ("siamese", (("form", "hybrid_pre"),)): ["input_norm.*"],
    ("siamese", (("topology", "single"),)): ["input_norm.*"],
    ("siamese", (("merge", "sum"),)): ["input_norm.*"],
    ("hybridnorm", ()): [],
    ("hybridnorm", (("first_layer_pre", True),)): ["attn_norm", "ffn_norm.0"],
    ("spannorm", ()): ["initial_norm", "attn_norm.*"],
    ("resi_dual", ()): [],
    ("deepnorm", ()): [],
    ("keel", ()): ["pre_norm.*"],
    ("keel", (("alpha", 1.0),)): ["pre_norm.*"],
    ("mix_ln", ()): [f"norm.{i}" for i in range(2, 2 * LAYERS)],  # n_post = floor(0.25 * 4) = 1
    ("mix_ln", (("post_fraction", 1.0),)): [],
    ("peri_ln", ()): ["input_norm.*"],
    ("peri_ln", (("embed_norm", True),)): ["input_norm.*"],
    ("lns", ()): ["pre_norm.*"],
    ("hyper", ()): ["norm.*"],
    ("hyper", (("dynamic", False),)): ["norm.*"],
    ("mhc", ()): ["norm.*"],
    ("attn_res", ()): ["input_norm.*"],
    ("attn_res", (("block_size", 3),)): ["input_norm.*"],
}
# (scheme, options) -> whether exit applies an outer final norm by default.
HAS_FINAL = {
    ("pre", ()): True, ("post", ()): False, ("siamese", ()): True,
    ("siamese", (("input_norm", False),)): True, ("siamese", (("form", "hybrid_pre"),)): True,
    ("siamese", (("topology", "single"),)): False, ("siamese", (("merge", "sum"),)): False,
    ("hybridnorm", ()): True, ("hybridnorm", (("first_layer_pre", True),)): True,
    ("spannorm", ()): False, ("resi_dual", ()): False, ("deepnorm", ()): False,
    ("keel", ()): False, ("keel", (("alpha", 1.0),)): False,
    ("mix_ln", ()): True, ("mix_ln", (("post_fraction", 1.0),)): False, ("peri_ln", ()): True,
    ("peri_ln", (("embed_norm", True),)): True, ("lns", ()): True, ("hyper", ()): True,
    ("hyper", (("dynamic", False),)): True, ("mhc", ()): True, ("attn_res", ()): True,
    ("attn_res", (("block_size", 3),)): True,
}
CASES = list(BRANCH_NORMS)


def case_id(case):
    name, opts = case
    return name + "".join(f"-{k}={v}" for k, v in opts)


def build(case, **extra):
    name, opts = case
    return sn.build_scheme(name, DIM, LAYERS, eps=EPS, dtype=F64, **dict(opts), **extra)


def norm_modules(scheme):
    return {n: m for n, m in scheme.named_modules() if isinstance(m, LayerNorm | RMSNorm)}


def matches(name, patterns):
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def branches(n, seed=3):
    g = torch.Generator().manual_seed(seed)
    ws = [(torch.randn(DIM, 2 * DIM, generator=g, dtype=F64) / DIM**0.5,
           torch.randn(2 * DIM, DIM, generator=g, dtype=F64) / DIM**0.5) for _ in range(n)]
    return [lambda u, w=w: torch.tanh(u @ w[0]) @ w[1] for w in ws]


def run(scheme, h, fs):
    state = scheme.enter(h)
    for i in range(scheme.n_sublayers):
        state = scheme.step(state, i, fs[i])
    return scheme.exit(state)


def tokens(seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, DIM, generator=g, dtype=F64) * 1.5 + 0.3


@torch.no_grad()
def randomize(module, seed=11):
    g = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.add_(0.4 * torch.randn(p.shape, generator=g, dtype=F64))


def load_subset(dst, src):
    """Load ``src``'s parameters into ``dst``, which must hold a subset of them; returns the
    names ``dst`` lacks."""
    result = dst.load_state_dict(src.state_dict(), strict=False)
    assert not result.missing_keys
    return set(result.unexpected_keys)


def test_every_registered_scheme_is_listed():
    listed = {name for name, _ in CASES}
    assert set(sn.list_schemes()) <= listed, "list the new scheme's branch norms and final norm here"
    assert set(HAS_FINAL) == set(BRANCH_NORMS)


def test_options_are_listed_with_each_scheme_default_and_checked():
    for name in sn.list_schemes():
        opts = sn.scheme_options(name)
        assert opts["branch_affine"] is True
        # Post-Norm and Keel end on a norm of the stream: no final norm by default
        assert opts["final_norm"] is (name not in ("post", "keel"))
    with pytest.raises(sn.ConfigError, match="branch_affine must be true or false"):
        sn.build_scheme("pre", DIM, LAYERS, branch_affine="no")
    with pytest.raises(sn.ConfigError, match="final_norm must be true or false"):
        sn.build_scheme("siamese", DIM, LAYERS, final_norm=0)


# ---- branch_affine --------------------------------------------------------------------------------
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_branch_affine_false_strips_exactly_the_branch_norms(case, norm):
    patterns = BRANCH_NORMS[case]
    affine = build(case, norm=norm)
    plain = build(case, norm=norm, branch_affine=False)
    assert all(m.weight is not None for m in norm_modules(affine).values())  # default unchanged
    plain_norms = norm_modules(plain)
    assert set(plain_norms) == set(norm_modules(affine))
    stripped = {n for n, m in plain_norms.items() if m.weight is None}
    assert stripped == {n for n in plain_norms if matches(n, patterns)}
    for n in stripped:
        assert not list(plain_norms[n].parameters())
    assert bool(stripped) == bool(patterns)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_branch_affine_false_computes_the_affine_scheme_with_unit_branch_norms(case):
    patterns = BRANCH_NORMS[case]
    affine, plain = build(case), build(case, branch_affine=False)
    randomize(affine)
    with torch.no_grad():  # branch norms of the affine scheme: gain 1, bias 0
        for n, m in norm_modules(affine).items():
            if matches(n, patterns):
                m.reset_parameters()
    dropped = load_subset(plain, affine)
    assert all(matches(k.rsplit(".", 1)[0], patterns) for k in dropped)
    h, fs = tokens(), branches(2 * LAYERS)
    torch.testing.assert_close(run(plain, h, fs), run(affine, h, fs), atol=1e-12, rtol=0)
    if patterns:  # the stripped norms matter: random gains on them change the output
        randomize(affine, seed=12)
        assert not torch.allclose(run(plain, h, fs), run(affine, h, fs), atol=1e-6)


# ---- final_norm ----------------------------------------------------------------------------------
def own_layernorm(x, weight=None, bias=None, eps=EPS):
    mean = x.mean(-1, keepdim=True)
    out = (x - mean) / torch.sqrt(((x - mean) ** 2).mean(-1, keepdim=True) + eps)
    return out if weight is None else out * weight + bias


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_final_norm_false_drops_exactly_the_outer_norm(case):
    full, bare = build(case), build(case, final_norm=False)
    randomize(full)
    dropped = load_subset(bare, full)
    h, fs = tokens(), branches(2 * LAYERS)
    out_full, out_bare = run(full, h, fs), run(bare, h, fs)
    if HAS_FINAL[case]:
        assert dropped == {"final_norm.weight", "final_norm.bias"}
        fw, fb = full.final_norm.weight, full.final_norm.bias
        torch.testing.assert_close(out_full, own_layernorm(out_bare, fw, fb), atol=1e-12, rtol=0)
        assert not torch.allclose(out_full, out_bare, atol=1e-3)
    else:
        assert dropped == set()
        torch.testing.assert_close(out_bare, out_full, atol=0, rtol=0)


def test_post_final_norm_true_still_adds_one():
    post = sn.build_scheme("post", DIM, LAYERS, final_norm=True, eps=EPS, dtype=F64)
    randomize(post)
    h, fs = tokens(), branches(2 * LAYERS)
    x = h
    for i in range(2 * LAYERS):
        n = post.post_norm[i]
        x = own_layernorm(x + fs[i](x), n.weight, n.bias)
    expected = own_layernorm(x, post.final_norm.weight, post.final_norm.bias)
    torch.testing.assert_close(run(post, h, fs), expected, atol=1e-12, rtol=0)


# ---- by hand: the DiT configurations of pre and siamese ------------------------------------------
@pytest.mark.parametrize("final_norm", [True, False])
@pytest.mark.parametrize("branch_affine", [True, False])
def test_pre_by_hand(branch_affine, final_norm):
    s = sn.build_scheme("pre", DIM, LAYERS, eps=EPS, dtype=F64, branch_affine=branch_affine,
                        final_norm=final_norm)
    randomize(s)
    h, fs = tokens(), branches(2 * LAYERS)
    x = h
    for i in range(2 * LAYERS):
        n = s.pre_norm[i]
        x = x + fs[i](own_layernorm(x, n.weight, n.bias) if branch_affine else own_layernorm(x))
    if final_norm:
        x = own_layernorm(x, s.final_norm.weight, s.final_norm.bias)
    torch.testing.assert_close(run(s, h, fs), x, atol=1e-12, rtol=0)


@pytest.mark.parametrize("final_norm", [True, False])
@pytest.mark.parametrize("branch_affine", [True, False])
def test_siamese_by_hand(branch_affine, final_norm):
    """papers.md 1.3: (a) DeiT with the defaults; (b) DiT with branch_affine=final_norm=False."""
    s = sn.build_scheme("siamese", DIM, LAYERS, eps=EPS, dtype=F64, branch_affine=branch_affine,
                        final_norm=final_norm)
    randomize(s)
    h, fs = tokens(), branches(2 * LAYERS)

    def ln(x, module):
        return own_layernorm(x, module.weight, module.bias)

    x, y = h, h
    for i in range(2 * LAYERS):
        c = math.sqrt(2 * (i // 2 + 1))
        x = ln(x, s.post_norm[i])
        u = x + ln(y, s.pre_norm[i])
        o = fs[i](ln(u, s.input_norm[i]) if branch_affine else own_layernorm(u))
        x, y = x + o / c, y + o
    merged = ln(x, s.merge_norm_x) + ln(y, s.merge_norm_y)
    expected = ln(merged, s.final_norm) if final_norm else merged
    torch.testing.assert_close(run(s, h, fs), expected, atol=1e-12, rtol=0)
