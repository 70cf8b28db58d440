"""A scheme is resolved once: the configuration checks its name and options and keeps the class
with every option filled; the model, the memory floor and compare's workers take that without
checking again, and parameter counts come from the class."""

from __future__ import annotations

import pytest

import siamesenorm as sn
from siamesenorm.errors import UserError
from siamesenorm.models import DiTConfig, LMConfig, ViTConfig
from siamesenorm.schemes import base as scheme_base
from siamesenorm.schemes.base import resolve_scheme
from siamesenorm.tasks.dryrun import memory_floor
from siamesenorm.tasks.registry import get_task, load_config


@pytest.fixture
def counted(monkeypatch):
    """How often the registry is read, each option of SiameseNorm checked, its options checked
    together, and a norm kind checked against the known ones."""
    seen = {"lookup": 0, "together": 0, "norm": 0}
    lookup = scheme_base.get_scheme_class

    def counting_lookup(name):
        seen["lookup"] += 1
        return lookup(name)

    cls = scheme_base.get_scheme_class("siamese")
    together = cls.check_together.__func__

    def counting_together(klass, options, dim=None):
        seen["together"] += 1
        return together(klass, options, dim)

    for name, option in cls.all_options().items():
        def check(scheme, key, value, _check=option.check):
            seen[key] = seen.get(key, 0) + 1
            return _check(scheme, key, value)
        monkeypatch.setitem(cls.options if name in vars(cls).get("options", {}) else
                            scheme_base.ResidualScheme.options, name,
                            scheme_base.Option(option.default, check, option.attr))
    monkeypatch.setattr(scheme_base, "get_scheme_class", counting_lookup)
    monkeypatch.setattr(cls, "check_together", classmethod(counting_together))
    real_host_args = scheme_base.check_host_args

    def counting_host_args(*args):
        seen["norm"] += 1
        return real_host_args(*args)

    monkeypatch.setattr(scheme_base, "check_host_args", counting_host_args)
    return seen


def test_a_train_run_checks_its_scheme_once(counted):
    cfg = load_config("tiny", ["model.scheme=siamese", "model.scheme_options.form=hybrid_pre"])
    memory_floor(cfg)
    model = get_task(cfg.task).build_model(cfg, "cpu")
    assert model.scheme.form == "hybrid_pre" and type(model.scheme).name == "siamese"
    assert counted == {"lookup": 1, "together": 1, "norm": 0, "form": 1}


def test_building_a_scheme_directly_still_checks_everything():
    with pytest.raises(UserError, match="scheme 'siamese' has no option 'fomr'"):
        sn.build_scheme("siamese", 8, 2, fomr="post_pre")
    with pytest.raises(UserError, match="unknown norm 'batchnorm'"):
        scheme_base.get_scheme_class("siamese")(8, 2, norm="batchnorm")
    with pytest.raises(UserError, match="option form='x' is not one of"):
        resolve_scheme("siamese", {"form": "x"}, 8)


def test_a_width_the_options_were_not_checked_with_is_checked_when_built():
    resolved = resolve_scheme("hyper", {"n_streams": 1, "fracs": 4})
    with pytest.raises(UserError, match="fracs=4 must divide the model width dim=6"):
        resolved.build(6, 2)
    assert resolved.build(8, 2).fracs == 4


@pytest.mark.parametrize("name", sn.list_schemes())
@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm", "dyt"])
def test_the_class_counts_the_parameters_a_built_scheme_has(name, norm):
    resolved = resolve_scheme(name, {}, 16)
    built = sn.build_scheme(name, 16, 3, norm=norm)
    assert resolved.num_parameters(16, 3, norm) == sum(p.numel() for p in built.parameters())


def test_every_model_config_keeps_its_resolved_scheme_with_the_models_defaults():
    lm = LMConfig(scheme="siamese", scheme_options={"merge": "sum"})
    assert lm.resolved_scheme.cls is scheme_base.get_scheme_class("siamese")
    assert lm.resolved_scheme.options["merge"] == "sum" and lm.resolved_scheme.options["form"] == "post_pre"
    assert ViTConfig.from_size("digits").resolved_scheme.options["final_norm"] is True
    dit = DiTConfig.from_size("digits", scheme_options={"final_norm": True})
    assert dit.resolved_scheme.options == {"branch_affine": False, "final_norm": True}
    with pytest.raises(UserError, match="model.scheme_options.nope: scheme 'pre' has no option 'nope'"):
        ViTConfig.from_size("digits", scheme_options={"nope": 1})


def test_workers_read_the_fitted_config_without_checking_it_again(tmp_path, monkeypatch):
    from siamesenorm.config import dump_config
    from siamesenorm.rundir import RunDir
    from siamesenorm.tasks.runner import _fitted_config

    cfg = load_config("tiny", ["model.scheme=siamese", "model.scheme_options.depth_scale=false",
                               "model.vocab_size=300"])
    folder = RunDir(tmp_path)
    folder.config.write_text(dump_config(cfg))

    def refuse(self):
        raise AssertionError("checked again")

    monkeypatch.setattr(LMConfig, "__post_init__", refuse)
    again = _fitted_config(folder)
    assert again == cfg and again.train.betas == cfg.train.betas
    assert again.model.resolved_scheme.options == cfg.model.resolved_scheme.options
    with pytest.raises(UserError, match="holds no config.yaml"):
        _fitted_config(RunDir(tmp_path / "none"))


def test_olmo_core_counts_its_parameters_from_one_scheme_build(monkeypatch):
    pytest.importorskip("olmo_core")
    from siamesenorm.olmo_core import model as olmo_model
    from siamesenorm.olmo_core import olmo_config

    config = olmo_config(LMConfig(dim=64, n_layers=3, n_heads=4, scheme="siamese",
                                  scheme_options={"form": "hybrid_pre"}))
    olmo_model._cached_meta_scheme.cache_clear()
    builds = []
    real = olmo_model.build_scheme
    monkeypatch.setattr(olmo_model, "build_scheme", lambda *a, **k: builds.append(a) or real(*a, **k))
    total, active = config.num_params, config.num_active_params
    assert len(builds) == 1 and total == active
    assert total == sum(p.numel() for p in config.build(init_device="meta").parameters())
