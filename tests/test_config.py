"""Configuration: preset + dotted overrides, every value checked before any work starts."""

from __future__ import annotations

import pytest
import yaml

from siamesenorm.config import PRESET_DIR, dump_config, parse_override
from siamesenorm.errors import ConfigError
from siamesenorm.tasks import load_config


def test_overrides_reach_every_section_with_their_types():
    cfg = load_config(None, ["model.n_layers=24", "train.lr=2e-3", "model.scheme=siamese",
                             "model.scheme_options.depth_scale=false", "train.betas=[0.9, 0.99]",
                             "data.corpus=arithmetic", "seed=7"])
    assert cfg.model.n_layers == 24 and cfg.train.lr == 2e-3 and isinstance(cfg.train.lr, float)
    assert cfg.model.scheme_options == {"depth_scale": False}
    assert cfg.train.betas == (0.9, 0.99) and cfg.data.corpus == "arithmetic" and cfg.seed == 7


def test_preset_then_overrides_and_the_dump_round_trips(tmp_path):
    cfg = load_config("tiny", ["model.dim=64"])
    assert cfg.model.n_layers == 2 and cfg.model.dim == 64  # preset value, then the override
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(str(path)) == cfg
    assert yaml.safe_load(path.read_text())["model"]["dim"] == 64


def test_packaged_presets_all_load():
    presets = sorted(PRESET_DIR.glob("*.yaml"))
    assert presets
    for preset in presets:
        load_config(preset.stem)


@pytest.mark.parametrize("override, fragment", [
    ("model.n_layer=3", "unknown key 'model.n_layer'; did you mean model.n_layers?"),
    ("trian.lr=1", "unknown key 'trian.lr'; did you mean train?"),
    ("train.lr=abc", "train.lr must be a number, got 'abc'"),
    ("train.lr=nan", "train.lr must be finite"),
    ("train.steps=-1", "train.steps must be positive"),
    ("model.n_layers=2.5", "model.n_layers must be an integer"),
    ("model.qk_norm=1", "model.qk_norm must be true or false"),
    ("model=3", "model is a section"),
    ("train.betas=[1]", "train.betas must be a list of 2 values"),
    ("nokey", "is not KEY=VALUE"),
    ("model.scheme=nope", "unknown scheme 'nope'"),
    ("model.scheme_options.depth_scale=false", "scheme 'pre' has no option 'depth_scale'"),
    ("model.dim=30", "must be divisible by"),
    ("data.val_fraction=1.5", "data.val_fraction must be in (0, 1)"),
])
def test_bad_overrides_are_refused_naming_the_key(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_scheme_option_values_are_checked_up_front():
    with pytest.raises(ConfigError, match="input_norm must be true or false"):
        load_config(None, ["model.scheme=siamese", "model.scheme_options.input_norm=maybe"])


def test_missing_or_malformed_preset(tmp_path):
    with pytest.raises(ConfigError, match="preset 'nosuch' not found.*tiny"):
        load_config("nosuch")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot read preset"):
        load_config(str(bad))
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(str(listy))


def test_parse_override_reads_yaml_values():
    assert parse_override("a.b=3") == ("a.b", 3)
    assert parse_override("a=[1, 2]") == ("a", [1, 2])
    assert parse_override("a=text") == ("a", "text")


def test_corpus_options_are_checked_up_front_and_reach_the_loader():
    cfg = load_config("arithmetic", ["data.corpus_options.max_digits=2", "data.corpus_options.n_train=50"])
    assert cfg.data.corpus_options["max_digits"] == 2 and cfg.data.corpus_options["operations"] == "+"
    assert cfg.data.corpus_options["reverse_answer"] is True
    from siamesenorm.tasks.lm import corpus_options

    assert corpus_options(cfg)["max_digits"] == 2
    with pytest.raises(ConfigError, match="corpus 'arithmetic' has no option 'digits'; its options: "):
        load_config("arithmetic", ["data.corpus_options.digits=2"])
    with pytest.raises(ConfigError, match="corpus 'pystdlib' has no option"):
        load_config(None, ["data.corpus_options.n_train=2"])
    # pystdlib's max_bytes comes from data.max_bytes unless the options name it.
    assert corpus_options(load_config(None, ["data.max_bytes=1000"])) == {"max_bytes": 1000}
