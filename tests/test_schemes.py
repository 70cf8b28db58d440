"""Generic properties of every registered scheme: registry, misuse, degenerate cases, init."""

from __future__ import annotations

import inspect
from dataclasses import replace

import pytest
import torch

import siamesenorm as sn
from helpers import make_branches, randomize_, run_scheme
from siamesenorm.schemes import ResidualScheme, check_scheme_options, get_scheme_class
from siamesenorm.schemes import base as scheme_base
from siamesenorm.schemes.base import Flag, Number, OneOf, Option

SCHEMES = sn.list_schemes()
DIM, LAYERS = 8, 3


def test_registry_has_every_scheme_the_paper_compares():
    expected = {"pre", "post", "siamese", "hybridnorm", "spannorm", "resi_dual", "deepnorm",
                "mix_ln", "peri_ln", "lns", "hyper", "mhc"}
    assert expected <= set(SCHEMES)
    assert SCHEMES[:3] == ["pre", "post", "siamese"]


@pytest.mark.parametrize("name", SCHEMES)
def test_every_scheme_documents_its_paper_and_equation(name):
    cls = get_scheme_class(name)
    assert "arXiv" in cls.paper and cls.summary
    assert "arXiv" in (cls.__doc__ or "")


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_output_shape_dtype_and_every_parameter_gets_a_gradient(name, norm):
    torch.manual_seed(0)
    scheme = sn.build_scheme(name, DIM, LAYERS, norm=norm, dtype=torch.float64)
    randomize_(scheme)
    h = torch.randn(2, 3, DIM, dtype=torch.float64)
    out = run_scheme(scheme, h, make_branches(scheme.n_sublayers, DIM))
    assert out.shape == h.shape and out.dtype == torch.float64
    out.pow(2).sum().backward()
    unused = [n for n, p in scheme.named_parameters() if p.grad is None or not p.grad.any()]
    assert not unused, f"parameters that never receive a gradient: {unused}"


@pytest.mark.parametrize("name", SCHEMES)
def test_eps_reaches_every_norm(name):
    scheme = sn.build_scheme(name, DIM, LAYERS, eps=1e-3)
    epss = {m.eps for m in scheme.modules() if hasattr(m, "eps") and m is not scheme}
    assert epss == {1e-3}


@pytest.mark.parametrize("name", SCHEMES)
def test_reset_parameters_restores_the_initial_state(name):
    torch.manual_seed(0)
    scheme = sn.build_scheme(name, DIM, LAYERS)
    initial = {k: v.clone() for k, v in scheme.state_dict().items()}
    randomize_(scheme)
    scheme.reset_parameters()
    for k, v in scheme.state_dict().items():
        torch.testing.assert_close(v, initial[k], msg=k)


@pytest.mark.parametrize("name", SCHEMES)
def test_meta_build_materialises_to_the_same_scheme(name):
    direct = sn.build_scheme(name, DIM, LAYERS)
    meta = sn.build_scheme(name, DIM, LAYERS, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    meta.reset_parameters()
    for (k, a), (_, b) in zip(direct.state_dict().items(), meta.state_dict().items()):
        torch.testing.assert_close(a, b, msg=k)


# ---- misuse -----------------------------------------------------------------------------------
def test_unknown_scheme_is_named_with_the_choices():
    with pytest.raises(sn.ConfigError, match=r"unknown scheme 'siamse'.*siamese"):
        sn.build_scheme("siamse", DIM, LAYERS)


def test_option_a_scheme_does_not_have_is_named_with_its_options():
    with pytest.raises(sn.ConfigError, match=r"'pre' has no option 'depth_scale'"):
        sn.build_scheme("pre", DIM, LAYERS, depth_scale=True)
    with pytest.raises(sn.ConfigError, match=r"input_norm"):
        sn.build_scheme("siamese", DIM, LAYERS, input_nrom=False)


@pytest.mark.parametrize("kwargs, fragment", [
    ({"dim": 0}, "dim must be a positive integer"),
    ({"dim": 8.5}, "dim must be a positive integer"),
    ({"n_layers": -1}, "n_layers must be a positive integer"),
    ({"norm": "batchnorm"}, "unknown norm 'batchnorm'"),
    ({"eps": 0.0}, "eps must be a positive finite number"),
])
def test_bad_dimensions_and_norms_are_refused(kwargs, fragment):
    args = {"dim": DIM, "n_layers": LAYERS} | kwargs
    with pytest.raises(sn.ConfigError, match=fragment):
        sn.build_scheme("siamese", args.pop("dim"), args.pop("n_layers"), **args)


@pytest.mark.parametrize("name, options, fragment", [
    ("siamese", {"form": "hybrid"}, "form='hybrid'"),
    ("siamese", {"merge": "mean"}, "merge='mean'"),
    ("siamese", {"input_norm": "yes"}, "input_norm must be true or false"),
    ("mix_ln", {"post_fraction": 1.5}, "post_fraction=1.5 is outside"),
    ("hyper", {"n_streams": 0}, "n_streams=0 is outside"),
    ("hyper", {"n_streams": 2.0}, "n_streams must be an integer"),
    ("deepnorm", {"arch": "seq2seq"}, "arch='seq2seq'"),
])
def test_bad_option_values_are_refused(name, options, fragment):
    with pytest.raises(sn.ConfigError, match=fragment):
        sn.build_scheme(name, DIM, LAYERS, **options)


# ---- degenerate cases -------------------------------------------------------------------------
def _copy_norms(dst_norms, src_norms):
    """Load the parameters of ``src_norms`` into ``dst_norms``, pairwise."""
    assert len(dst_norms) == len(src_norms)
    for d, s in zip(dst_norms, src_norms):
        d.load_state_dict(s.state_dict())


def _h():
    return torch.randn(2, 3, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("dynamic", [False, True])
def test_hyper_with_one_stream_is_pre_norm(dynamic):
    pre = sn.build_scheme("pre", DIM, LAYERS, dtype=torch.float64)
    randomize_(pre)
    hyper = sn.build_scheme("hyper", DIM, LAYERS, n_streams=1, dynamic=dynamic, dtype=torch.float64)
    _copy_norms(list(hyper.norm) + [hyper.final_norm], list(pre.pre_norm) + [pre.final_norm])
    branches = make_branches(2 * LAYERS, DIM)
    torch.testing.assert_close(run_scheme(hyper, _h(), branches), run_scheme(pre, _h(), branches),
                               atol=1e-12, rtol=0)


def test_hyper_at_init_is_pre_norm_on_copies():
    pre = sn.build_scheme("pre", DIM, LAYERS, eps=1e-12, dtype=torch.float64)
    randomize_(pre)
    hyper = sn.build_scheme("hyper", DIM, LAYERS, n_streams=3, dynamic=False, eps=1e-12,
                            dtype=torch.float64)
    _copy_norms(list(hyper.norm) + [hyper.final_norm], list(pre.pre_norm) + [pre.final_norm])
    branches = make_branches(2 * LAYERS, DIM)
    # Static init: all streams equal h + sum F; the final norm removes the factor n of the sum
    # (exactly, up to eps, which is why eps is tiny here).
    torch.testing.assert_close(run_scheme(hyper, _h(), branches), run_scheme(pre, _h(), branches),
                               atol=1e-9, rtol=0)


@pytest.mark.parametrize("fraction, other", [(0.0, "pre"), (1.0, "post")])
def test_mix_ln_extremes_are_pre_and_post(fraction, other):
    ref = sn.build_scheme(other, DIM, LAYERS, dtype=torch.float64)
    randomize_(ref)
    mix = sn.build_scheme("mix_ln", DIM, LAYERS, post_fraction=fraction, dtype=torch.float64)
    ref_norms = list(ref.pre_norm) + [ref.final_norm] if other == "pre" else list(ref.post_norm)
    mix_norms = list(mix.norm) + ([mix.final_norm] if mix.final_norm is not None else [])
    assert len(ref_norms) == len(mix_norms)
    _copy_norms(mix_norms, ref_norms)
    branches = make_branches(2 * LAYERS, DIM)
    torch.testing.assert_close(run_scheme(mix, _h(), branches), run_scheme(ref, _h(), branches),
                               atol=1e-12, rtol=0)


def _zero_(norm):
    with torch.no_grad():
        for p in norm.parameters():
            p.zero_()


def test_siamese_with_the_x_stream_switched_off_is_pre_norm():
    """Paper: LN^X == 0 recovers Pre-Norm (here with the Algorithm-1 merge, no LN^in)."""
    pre = sn.build_scheme("pre", DIM, LAYERS, dtype=torch.float64)
    randomize_(pre)
    siam = sn.build_scheme("siamese", DIM, LAYERS, input_norm=False, merge="sum",
                           dtype=torch.float64)
    for norm in list(siam.post_norm) + [siam.merge_norm_x]:
        _zero_(norm)
    _copy_norms(list(siam.pre_norm) + [siam.merge_norm_y],
                list(pre.pre_norm) + [pre.final_norm])
    branches = make_branches(2 * LAYERS, DIM)
    torch.testing.assert_close(run_scheme(siam, _h(), branches), run_scheme(pre, _h(), branches),
                               atol=1e-12, rtol=0)


def test_siamese_with_the_y_stream_switched_off_is_post_norm():
    """Paper: LN^Y == 0 recovers Post-Norm (without depth scaling and LN^in). The deferred form
    also normalises the embedding first, so the reference Post-Norm starts from LN(h)."""
    post = sn.build_scheme("post", DIM, LAYERS, dtype=torch.float64)
    randomize_(post)
    siam = sn.build_scheme("siamese", DIM, LAYERS, input_norm=False, depth_scale=False,
                           merge="sum", dtype=torch.float64)
    randomize_(siam)
    for norm in list(siam.pre_norm) + [siam.merge_norm_y]:
        _zero_(norm)
    # siamese post_norm[0] normalises the embedding; post_norm[i+1] plays post's post_norm[i];
    # merge_norm_x is the last one.
    _copy_norms(list(siam.post_norm[1:]) + [siam.merge_norm_x], list(post.post_norm))
    branches = make_branches(2 * LAYERS, DIM)
    h = _h()
    expected = run_scheme(post, siam.post_norm[0](h), branches)
    torch.testing.assert_close(run_scheme(siam, h, branches), expected, atol=1e-12, rtol=0)


def test_siamese_streams_start_equal_and_split():
    siam = sn.build_scheme("siamese", DIM, LAYERS, dtype=torch.float64)
    h = _h()
    state = siam.enter(h)
    assert set(siam.streams(state)) == {"x", "y"}
    assert torch.equal(state[0], h) and torch.equal(state[1], h)
    state = siam.step(state, 0, make_branches(1, DIM)[0])
    x, y = state
    assert not torch.allclose(x, y)


# ---- declared options --------------------------------------------------------------------------
HOST_ARGS = {"norm", "eps", "device", "dtype"}  # keyword-only, but set by the host model


def _declared(name):
    return get_scheme_class(name).all_options()


@pytest.mark.parametrize("name", SCHEMES)
def test_every_option_is_declared_in_the_table_and_none_in_a_signature(name):
    cls = get_scheme_class(name)
    for klass in cls.__mro__[:cls.__mro__.index(ResidualScheme) + 1]:
        params = inspect.signature(klass.__init__).parameters
        assert {k for k, p in params.items() if p.kind is p.KEYWORD_ONLY} <= HOST_ARGS
    assert list(_declared(name))[:2] == ["branch_affine", "final_norm"]
    assert set(_declared(name)) == set(sn.scheme_options(name))
    for option in _declared(name).values():
        assert isinstance(option, Option) and callable(option.check)


@pytest.mark.parametrize("name", SCHEMES)
def test_the_constructor_runs_every_declared_check_and_stores_every_option(name, monkeypatch):
    seen = []

    def recording(check):
        def run(scheme, option, value):
            seen.append(option)
            return check(scheme, option, value)
        return run

    cls = get_scheme_class(name)
    for klass in cls.__mro__:
        if "options" in vars(klass):
            monkeypatch.setattr(klass, "options", {k: replace(o, check=recording(o.check))
                                                   for k, o in vars(klass)["options"].items()})
    given = {k: good[0] for k, (_, good) in _option_values(name).items()}
    scheme = sn.build_scheme(name, 16, 2, **given)
    assert seen == list(_declared(name))                      # each once, base options first
    for k, option in _declared(name).items():
        if k not in ("alpha", "beta"):                          # deepnorm resolves None from the table
            assert getattr(scheme, option.attr or k) == given[k]


def test_an_option_not_given_takes_its_default():
    scheme = sn.build_scheme("siamese", 16, 2)
    assert (scheme.form, scheme.use_input_norm, scheme.depth_scale, scheme.merge, scheme.topology,
            scheme.branch_affine, scheme.use_final_norm) == tuple(sn.scheme_options("siamese").values())
    assert sn.build_scheme("post", 16, 2).use_final_norm is False


def test_a_declared_check_is_the_one_the_constructor_uses(monkeypatch):
    cls = get_scheme_class("mix_ln")
    monkeypatch.setattr(cls, "options", {"post_fraction": Option(0.25, Number(low=0, high=0.5))})
    with pytest.raises(sn.ConfigError, match=r"post_fraction=0.75 is outside \[0, 0.5\]"):
        sn.build_scheme("mix_ln", 16, 2, post_fraction=0.75)


def test_the_constructor_refuses_an_option_as_build_scheme_does():
    with pytest.raises(sn.ConfigError) as built:
        sn.build_scheme("siamese", DIM, LAYERS, input_nrom=False)
    with pytest.raises(sn.ConfigError) as constructed:
        get_scheme_class("siamese")(DIM, LAYERS, input_nrom=False)
    assert str(constructed.value) == str(built.value) == (
        "scheme 'siamese' has no option 'input_nrom'; its options are: branch_affine, depth_scale, "
        "final_norm, form, input_norm, merge, topology (and norm, eps)")


def test_a_scheme_written_with_keyword_arguments_keeps_working(monkeypatch):
    """A scheme with its options as keyword-only arguments, passing the common ones to the base."""
    monkeypatch.setattr(scheme_base, "_REGISTRY", dict(scheme_base._REGISTRY))

    @sn.register_scheme
    class Scaled(ResidualScheme):
        name = "scaled-test"

        def __init__(self, dim, n_layers, *, gain: float = 1.0, norm="layernorm", eps=1e-5,
                     branch_affine=True, final_norm=False, device=None, dtype=None):
            super().__init__(dim, n_layers, norm=norm, eps=eps, branch_affine=branch_affine,
                             final_norm=final_norm, device=device, dtype=dtype)
            self.scale = gain
            self.final_norm = self.make_final_norm()

        def step(self, state, i, branch):
            return state + self.scale * branch(state)

    assert sn.scheme_options("scaled-test") == {"gain": 1.0, "branch_affine": True, "final_norm": False}
    scheme = sn.build_scheme("scaled-test", DIM, LAYERS, gain=2.0, norm="rmsnorm")
    assert scheme.scale == 2.0 and scheme.final_norm is None and not hasattr(scheme, "gain")
    check_scheme_options("scaled-test", {"gain": 3.0, "final_norm": True})
    with pytest.raises(sn.ConfigError, match=r"'scaled-test' has no option 'gian'.*final_norm, gain"):
        sn.build_scheme("scaled-test", DIM, LAYERS, gian=2.0)
    with pytest.raises(sn.ConfigError, match=r"option final_norm must be true or false, got 3"):
        sn.build_scheme("scaled-test", DIM, LAYERS, final_norm=3)


# (option, bad values, valid values); the common options apply to every scheme.
COMMON_OPTION_VALUES = {
    "branch_affine": (["yes", 1, 0, None, 1.0], [True, False]),
    "final_norm": (["no", 0, None], [True, False]),
}
OWN_OPTION_VALUES = {
    "siamese": {
        "form": (["hybrid", "", None, 1, ["post_pre"]], ["post_pre", "hybrid_pre"]),
        "input_norm": (["yes", 1, None], [True, False]),
        "depth_scale": (["true", 0, None], [True, False]),
        "merge": (["mean", None, 0], ["normed_sum", "sum"]),
        "topology": (["dual", None, True], ["siamese", "single", "resi_dual"]),
    },
    "hybridnorm": {"first_layer_pre": (["yes", 1, None], [True, False])},
    "deepnorm": {
        "arch": (["seq2seq", None, 0], ["decoder", "encoder"]),
        "alpha": (["1", True, -0.5, [1.0]], [None, 0, 0.5, 2, 3.7]),
        "beta": (["x", False, -1], [None, 0.0, 0.1, 1]),
    },
    "keel": {"alpha": (["L", True, -1, [2.0]], [None, 0, 1, 2.5, 128])},
    "mix_ln": {"post_fraction": (["0.5", True, None, -0.1, 1.5, 2], [0, 0.0, 0.25, 0.5, 1, 1.0])},
    "peri_ln": {"embed_norm": (["yes", 1, None], [True, False]),
                "input_norm": (["no", 0, None], [True, False])},
    "hyper": {
        "n_streams": ([0, -1, 2.0, "2", True, None], [1, 2, 3]),
        "dynamic": (["yes", 1, None], [True, False]),
        "fracs": ([0, -2, 2.0, "4", True, None], [1]),   # fracs > 1 needs n_streams=1 (test_frac_connections)
    },
    "mhc": {
        "n_streams": ([0, 2.5, "4", False, None], [1, 2, 4]),
        "sinkhorn_iters": ([0, -3, 20.0, None, True], [1, 5, 20]),
        "mixing": (["Sinkhorn", "deepseek", None, 1], ["sinkhorn", "deepseek_v4", "lite"]),
        "mix_eps": (["1e-6", True, None, -1e-6, 2.0], [0, 1e-6, 0.01]),
    },
    "attn_res": {"block_size": ([0, -2, 2.0, "2", True], [None, 1, 2, 3, 4])},
}


def _option_values(name):
    return COMMON_OPTION_VALUES | OWN_OPTION_VALUES.get(name, {})


def _bad_cases():
    for name in SCHEMES:
        for option, (bad, _) in _option_values(name).items():
            for value in bad:
                yield pytest.param(name, option, value, id=f"{name}-{option}-{value!r}")


def _valid_cases():
    for name in SCHEMES:
        for option, (_, good) in _option_values(name).items():
            for value in good:
                yield pytest.param(name, option, value, id=f"{name}-{option}-{value!r}")


@pytest.mark.parametrize("name", SCHEMES)
def test_the_value_table_covers_every_declared_option(name):
    assert set(_option_values(name)) == set(_declared(name))


@pytest.mark.parametrize("name, option, value", list(_bad_cases()))
def test_a_bad_value_is_refused_as_building_the_scheme_refuses_it(name, option, value):
    with pytest.raises(sn.ConfigError) as built:
        sn.build_scheme(name, 16, 2, **{option: value})
    with pytest.raises(sn.ConfigError) as checked:
        check_scheme_options(name, {option: value})
    assert str(checked.value) == str(built.value)
    assert str(built.value).startswith(f"scheme {name!r}: option {option}")


@pytest.mark.parametrize("name, option, value", list(_valid_cases()))
def test_a_valid_value_passes_the_check_and_the_build(name, option, value):
    check_scheme_options(name, {option: value})
    sn.build_scheme(name, 16, 2, **{option: value})


def test_with_several_bad_values_the_check_reports_what_the_build_reports():
    options = {"topology": "dual", "form": "hybrid", "branch_affine": "yes"}
    with pytest.raises(sn.ConfigError) as built:
        sn.build_scheme("siamese", 16, 2, **options)
    with pytest.raises(sn.ConfigError) as checked:
        check_scheme_options("siamese", options)
    assert str(checked.value) == str(built.value)
    assert "branch_affine" in str(checked.value)


@pytest.mark.parametrize("name", SCHEMES)
def test_checking_options_builds_no_module(name, monkeypatch):
    calls = []

    def forbidden(self, *args, **kwargs):
        calls.append(type(self).__name__)
        raise AssertionError("check_scheme_options built a module")

    monkeypatch.setattr(torch.nn.Module, "__init__", forbidden)
    monkeypatch.setattr(ResidualScheme, "__init__", forbidden)
    check_scheme_options(name, {})
    check_scheme_options(name, sn.scheme_options(name))
    check_scheme_options(name, {k: good[-1] for k, (_, good) in _option_values(name).items()})
    with pytest.raises(sn.ConfigError):
        check_scheme_options(name, {"branch_affine": "yes"})
    assert calls == []


def test_an_unknown_option_is_named_with_the_options_of_the_scheme():
    with pytest.raises(sn.ConfigError) as err:
        check_scheme_options("pre", {"depth_scale": True, "alpha": 1.0})
    assert str(err.value) == ("model.scheme_options.alpha: scheme 'pre' has no option 'alpha'; "
                              "its options are: branch_affine, final_norm")
    with pytest.raises(sn.ConfigError) as err:
        check_scheme_options("siamese", {"input_nrom": False, "form": "nope"})
    assert str(err.value) == (
        "model.scheme_options.input_nrom: scheme 'siamese' has no option 'input_nrom'; its options "
        "are: branch_affine, depth_scale, final_norm, form, input_norm, merge, topology")


def test_an_unknown_scheme_is_refused_by_the_option_check():
    with pytest.raises(sn.ConfigError, match=r"unknown scheme 'siamse'.*siamese"):
        check_scheme_options("siamse", {})


def test_the_option_checks_keep_their_messages():
    with pytest.raises(sn.ConfigError, match=r"^scheme 's': option o='c' is not one of 'a', 'b'$"):
        OneOf(("a", "b"))("s", "o", "c")
    with pytest.raises(sn.ConfigError, match=r"^scheme 's': option o must be true or false, got 1$"):
        Flag()("s", "o", 1)
    with pytest.raises(sn.ConfigError, match=r"^scheme 's': option o must be an integer, got 1.0$"):
        Number(integer=True)("s", "o", 1.0)
    with pytest.raises(sn.ConfigError, match=r"^scheme 's': option o must be a number, got None$"):
        Number()("s", "o", None)
    with pytest.raises(sn.ConfigError, match=r"^scheme 's': option o=5 is outside \[-inf, 2\]$"):
        Number(high=2)("s", "o", 5)
    assert Number(low=2, high=2)("s", "o", 2) == 2 and Number(optional=True)("s", "o", None) is None
