"""The grid of ``compare``: the preset's ``compare`` section, variants, and what the command line replaces."""

from __future__ import annotations

import pytest
import yaml

from siamesenorm.config import read_preset
from siamesenorm.errors import ConfigError
from siamesenorm.experiments.grid import build_grid, check_section
from siamesenorm.tasks import load_config


def _preset(tmp_path, compare: dict, **sections) -> str:
    data = {"model": {"dim": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 32},
            "train": {"steps": 3, "lr": 1e-3}, **sections, "compare": compare}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_section_supplies_schemes_lrs_seeds_and_variants(tmp_path):
    preset = _preset(tmp_path, {
        "schemes": ["pre", "siamese-noscale", "deep-pre"], "lrs": [1e-3, "4e-3"], "seeds": [0, 1],
        "variants": {"siamese-noscale": {"scheme": "siamese", "options": {"depth_scale": False}},
                     "deep-pre": {"scheme": "pre", "overrides": {"model.n_layers": 4, "model.dim": 16}}}})
    base, spec, cells = build_grid(preset, ["train.steps=5"])
    assert spec["schemes"] == ["pre", "siamese-noscale", "deep-pre"] and spec["lrs"] == [1e-3, 4e-3]
    assert len(cells) == 3 * 2 * 2
    by_name = {c.name: c.config for c in cells}
    noscale = by_name["siamese-noscale-lr0.004-s1"]
    assert noscale.model.scheme == "siamese" and noscale.model.scheme_options == {"depth_scale": False}
    assert noscale.train.lr == 4e-3 and noscale.seed == 1 and noscale.train.steps == 5
    deep = by_name["deep-pre-lr0.001-s0"]
    assert (deep.model.scheme, deep.model.n_layers, deep.model.dim) == ("pre", 4, 16)
    assert by_name["pre-lr0.001-s0"].model.n_layers == 2  # the variant's overrides stay its own
    # The section is not part of a run's configuration.
    assert load_config(preset).model.dim == 32


def test_command_line_replaces_the_section_and_may_name_variants(tmp_path):
    preset = _preset(tmp_path, {"schemes": ["pre"], "lrs": [1e-3],
                                "variants": {"s2": {"scheme": "siamese", "options": {"merge": "sum"}}}})
    _, spec, cells = build_grid(preset, [], schemes=["s2", "post"], lrs=[2e-3], seeds=[7])
    assert [c.name for c in cells] == ["s2-lr0.002-s7", "post-lr0.002-s7"]
    assert cells[0].config.model.scheme_options == {"merge": "sum"}


def test_bare_scheme_gets_its_defaults_but_the_preset_scheme_keeps_its_options(tmp_path):
    preset = _preset(tmp_path, {}, )
    path = tmp_path / "p.yaml"
    data = yaml.safe_load(path.read_text())
    data["model"].update(scheme="siamese", scheme_options={"merge": "sum"})
    path.write_text(yaml.safe_dump(data))
    _, _, cells = build_grid(preset, [], schemes=["siamese", "hyper"])
    assert cells[0].config.model.scheme_options == {"merge": "sum"}
    assert cells[1].config.model.scheme_options == {}


def test_no_section_means_pre_post_siamese_at_train_lr(tmp_path):
    _, spec, cells = build_grid("tiny", ["train.lr=3e-3", "seed=4"])
    assert spec["schemes"] == ["pre", "post", "siamese"]
    assert [(c.lr, c.seed) for c in cells] == [(3e-3, 4)] * 3


@pytest.mark.parametrize("compare, message", [
    ({"scheme": ["pre"]}, "unknown key 'compare.scheme'"),
    ({"lrs": []}, "compare.lrs must be a non-empty list"),
    ({"lrs": ["fast"]}, "compare.lrs: 'fast' is not a number"),
    ({"seeds": [0.5]}, "compare.seeds: 0.5 is not int"),
    ({"variants": {"v": {"options": {}}}}, "compare.variants.v must be a mapping with a 'scheme' key"),
    ({"variants": {"v": {"scheme": "pre", "option": {}}}}, "unknown key 'compare.variants.v.option'"),
    ({"schemes": ["pre", "nosuch"]}, "unknown scheme 'nosuch'"),
    ({"schemes": ["pre", "pre"]}, "names a scheme twice"),
    ({"schemes": ["v"], "variants": {"v": {"scheme": "siamese", "options": {"nosuch": 1}}}},
     "has no option 'nosuch'"),
    ({"schemes": ["v"], "variants": {"v": {"scheme": "pre", "overrides": {"model.nosuch": 1}}}},
     "unknown key 'model.nosuch'"),
    ({"schemes": ["v"], "variants": {"v": {"scheme": "nosuch"}}}, "unknown scheme 'nosuch'"),
])
def test_bad_sections_are_refused_with_one_line(tmp_path, compare, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        build_grid(_preset(tmp_path, compare), [])
    assert "\n" not in str(err.value)


def test_packaged_presets_have_valid_sections():
    from siamesenorm.config import PRESET_DIR

    for path in sorted(PRESET_DIR.glob("*.yaml")):
        check_section(read_preset(str(path)), str(path))
        build_grid(str(path), [])
