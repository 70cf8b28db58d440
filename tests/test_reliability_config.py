"""Issue 48, round 5: what a hostile or careless configuration cannot do. A YAML alias bomb is
refused before it is built and no error prints more than a line; no number option takes NaN, an
infinity or a value that makes the model non-finite (library and command line alike); the model's
scales are bounded before any folder is made; a logger that cannot start is one line before the
run claims its folder."""

from __future__ import annotations

import dataclasses
import math
import re
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import cli_in_process
from siamesenorm.config import MAX_ALIAS_EXPANSION, TrainConfig, load_yaml
from siamesenorm.errors import MAX_MESSAGE_CHARS, UserError
from siamesenorm.models.lm import LanguageModel, LMConfig
from siamesenorm.models.lm_config import (
    MAX_EMBED_SCALE,
    MAX_INIT_STD,
    MAX_LOSS_WEIGHT,
    MAX_VALUE_RESIDUAL_WEIGHT,
    MoEConfig,
)
from siamesenorm.schemes import Number, build_scheme, check_scheme_options, get_scheme_class, list_schemes

NON_FINITE = [math.nan, math.inf, -math.inf]


def one_line_error(res, *fragments: str) -> str:
    """The one line a refused command printed (exit status 2, no traceback), holding ``fragments``."""
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert len(lines[0]) <= MAX_MESSAGE_CHARS + 40, len(lines[0])     # + "siamesenorm train: error: "
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


# ---- 1. aliases that expand without end; errors that print without end ----------------------------
def bomb(levels: int, width: int = 10) -> str:
    """The "billion laughs": ``width ** levels`` strings from a few hundred bytes of YAML."""
    items = [f"&a0 [{', '.join(['lol'] * width)}]"]
    items += [f"&a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return f"[{', '.join(items)}]"


@pytest.mark.parametrize("levels", [6, 9])
def test_an_alias_bomb_in_a_preset_is_one_line_at_once(tmp_path, levels):
    preset = tmp_path / "bomb.yaml"
    preset.write_text(f"model:\n  scheme: siamese\n  scheme_options:\n    form: {bomb(levels)}\n")
    assert preset.stat().st_size < 800
    start = time.perf_counter()
    res = cli_in_process("train", str(preset), "--out", str(tmp_path / "run"))
    assert time.perf_counter() - start < 10
    one_line_error(res, f"preset {preset}", "aliases expand to more than", "*a")
    assert not (tmp_path / "run").exists()


def test_an_alias_bomb_in_an_override_is_one_line(tmp_path):
    res = cli_in_process("train", "tiny", f"model.scheme_options.form={bomb(8)}", "--dry-run")
    one_line_error(res, "override", "aliases expand to more than")


def test_a_long_scalar_named_by_many_aliases_is_refused_too():
    size = MAX_ALIAS_EXPANSION // 10          # each alias of it adds its length, and one
    under = f"a: &s {'x' * (size - 2)}\nb: [{', '.join(['*s'] * 10)}]\n"
    assert load_yaml(under, "preset p")["b"] == ["x" * (size - 2)] * 10
    with pytest.raises(UserError, match="aliases expand to more than"):
        load_yaml(under.replace("*s]", "*s, *s]"), "preset p")


def test_aliases_of_a_real_size_still_work():
    text = ("base: &base {dim: 64, n_layers: 4, scheme_options: {form: post_pre}}\n"
            "variants:\n" + "".join(f"  v{i}: {{<<: *base, n_heads: {i + 1}}}\n" for i in range(50)))
    data = load_yaml(text, "preset p")
    assert data["variants"]["v49"] == {"dim": 64, "n_layers": 4, "scheme_options": {"form": "post_pre"},
                                       "n_heads": 50}


def test_every_user_error_is_one_bounded_line_keeping_its_start_and_end():
    message = "model.scheme_options.form: " + "x" * 10**7 + " (choose post_pre)"
    text = str(UserError(message))
    assert len(text) <= MAX_MESSAGE_CHARS and "\n" not in text
    assert text.startswith("model.scheme_options.form: xxx") and text.endswith(" (choose post_pre)")
    head, rest = text.split(" ...(")
    left_out, tail = rest.split(" characters left out)... ")
    assert len(head) + int(left_out.replace(",", "")) + len(tail) == len(message)
    assert str(UserError("short")) == "short"


def test_a_long_value_without_aliases_prints_one_bounded_line(tmp_path):
    form = "[" + ",".join(["0"] * 30_000) + "]"
    res = cli_in_process("train", "tiny", "model.scheme=siamese", f"model.scheme_options.form={form}",
                         "--out", str(tmp_path / "run"))
    one_line_error(res, "option form=[0, 0", "characters left out", "post_pre")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("args", [
    ["--nproc", "x" * 5000],                       # argparse's own error, quoting the value
    ["--no-such-flag-" + "x" * 5000],              # an unknown argument
    ["train.steps=1", "--out", "x" * 5000],        # the system's: file name too long, naming it
], ids=["argparse-value", "unknown-argument", "os-error"])
def test_the_other_errors_of_the_command_line_are_bounded_too(tmp_path, args):
    res = cli_in_process("train", "tiny", *args, cwd=tmp_path)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and len(lines[0]) <= MAX_MESSAGE_CHARS + 60, res.stderr
    assert "characters left out" in lines[0]


# ---- 2. NaN, infinities and overflowing values in every bounded option -----------------------------
def number_options(integer: bool | None = None) -> list[tuple[str, str, Number]]:
    """Every registered scheme's :class:`Number` options (only the integer or the other ones)."""
    out = []
    for name in list_schemes():
        for option, spec in get_scheme_class(name).all_options().items():
            if isinstance(spec.check, Number) and (integer is None or spec.check.integer == integer):
                out.append((name, option, spec.check))
    return out


def test_every_scheme_number_that_is_not_an_integer_declares_a_finite_upper_bound():
    floats = number_options(integer=False)
    assert {(s, o) for s, o, _ in floats} >= {("keel", "alpha"), ("deepnorm", "alpha"), ("deepnorm", "beta")}
    for scheme, option, check in floats:
        assert check.high is not None and math.isfinite(check.high), (scheme, option)


# NaN and the infinities for every option; an integer too large for a float for those that are not
# integers (an integer option's largest value may depend on the model: attn_res's block_size).
NON_FINITE_CASES = [(s, o, v) for s, o, check in number_options() for v in NON_FINITE
                    + ([] if check.integer else [10**400])]


@pytest.mark.parametrize("scheme, option, value", NON_FINITE_CASES,
                         ids=[f"{s}-{o}-{v if v != 10**400 else '10**400'}" for s, o, v in NON_FINITE_CASES])
def test_no_scheme_option_takes_a_non_finite_number_built_or_checked(scheme, option, value):
    with pytest.raises(ValueError, match=rf"scheme '{scheme}': option {option}"):
        build_scheme(scheme, 16, 2, **{option: value})
    with pytest.raises(ValueError, match=rf"scheme '{scheme}': option {option}"):
        check_scheme_options(scheme, {option: value}, 16)


def finite_lm(**config) -> None:
    """A two-block model of ``config`` gives finite logits, loss and gradients."""
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=16, **config))
    x = torch.randint(0, 64, (2, 16))
    out = model(x, x)
    out.loss.backward()
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.loss), config
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None), config


@pytest.mark.parametrize("scheme, option, check", number_options(integer=False),
                         ids=[f"{s}-{o}" for s, o, _ in number_options(integer=False)])
def test_every_scheme_stays_finite_at_each_bound_of_its_options(scheme, option, check):
    for value in (check.low, check.high):
        finite_lm(scheme=scheme, scheme_options={option: value})
    with pytest.raises(ValueError, match=rf"option {option}=.* is outside"):
        build_scheme(scheme, 16, 2, **{option: check.high * 10})


@pytest.mark.parametrize("text, fragment", [
    (".nan", "option alpha must be a finite number, got nan"),
    (".inf", "option alpha must be a finite number, got inf"),
    ("1.0e+308", "option alpha=1e+308 is outside [0, 1e+06]"),
])
def test_cli_refuses_keel_alpha_before_any_folder(tmp_path, text, fragment):
    res = cli_in_process("train", "tiny", "model.scheme=keel", f"model.scheme_options.alpha={text}",
                         "--out", str(tmp_path / "run"))
    one_line_error(res, "scheme 'keel'", fragment)
    assert not (tmp_path / "run").exists()


def test_hf_adapt_refuses_what_the_command_line_refuses():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig

    from siamesenorm.hf import adapt

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2)
    for value in (math.nan, math.inf, 1e308):
        with pytest.raises(ValueError, match="scheme 'keel': option alpha"):
            adapt(cfg, "keel", alpha=value)
    with pytest.raises(ValueError, match="scheme 'deepnorm': option beta"):
        adapt(cfg, "deepnorm", beta=1e308)


@pytest.mark.parametrize("field, value, fragment", [
    ("norm_eps", math.inf, "model.norm_eps must be a positive finite number"),
    ("norm_eps", math.nan, "model.norm_eps must be a positive finite number"),
    ("rope_theta", math.inf, "model.rope_theta must be a positive finite number"),
    ("init_std", math.nan, "model.init_std must be a finite number"),
    ("init_std", 1e300, "model.init_std must be a finite number > 0 and at most 1"),
    ("dropout", math.nan, "dropout must be in [0, 1)"),
    ("embed_scale", 1e300, "model.embed_scale must be at most"),
    ("embed_scale", 10**400, "model.embed_scale must be a positive number"),
    ("embed_scale", math.nan, "model.embed_scale must be a positive number"),
])
def test_lm_config_refuses_non_finite_and_overflowing_values(field, value, fragment):
    with pytest.raises(UserError) as err:
        LMConfig(**{field: value})
    assert fragment in str(err.value)


@pytest.mark.parametrize("name", ["value_residual_own", "value_residual_first"])
def test_value_residual_weights_are_bounded(name):
    for value in (1e300, -1e300, math.nan):
        with pytest.raises(UserError, match=f"model.{name} must be a finite number"):
            LMConfig(value_residual=True, **{name: value})


@pytest.mark.parametrize("name", ["aux_loss", "z_loss"])
def test_moe_loss_weights_are_bounded(name):
    for value in (1e300, math.inf, math.nan, -0.1):
        with pytest.raises(UserError, match=rf"model.moe.{name} must be a finite number >= 0"):
            MoEConfig(every=1, **{name: value})


def test_the_model_stays_finite_at_every_upper_bound_of_its_scales():
    finite_lm(init_std=MAX_INIT_STD)
    finite_lm(embed_scale=MAX_EMBED_SCALE)
    finite_lm(embed_scale=MAX_EMBED_SCALE, norm="dyt")
    finite_lm(value_residual=True, value_residual_own=MAX_VALUE_RESIDUAL_WEIGHT,
              value_residual_first=-MAX_VALUE_RESIDUAL_WEIGHT)
    finite_lm(moe=MoEConfig(every=1, n_experts=4, top_k=2, aux_loss=MAX_LOSS_WEIGHT, z_loss=MAX_LOSS_WEIGHT))


@pytest.mark.parametrize("field, value", [
    ("lr", math.nan), ("lr", math.inf), ("weight_decay", math.nan), ("weight_decay", math.inf),
    ("grad_clip", math.nan), ("grad_clip", math.inf), ("divergence_factor", math.inf),
    ("divergence_factor", math.nan), ("min_lr_ratio", math.nan), ("peak_tflops", math.nan),
    ("betas", (math.nan, 0.95)),
])
def test_train_config_refuses_nan_and_infinities_in_the_library_too(field, value):
    with pytest.raises(UserError, match=f"train.{field}"):
        TrainConfig(**{field: value})


# ---- 3. the model's scales, bounded before any folder is made -------------------------------------
@pytest.mark.parametrize("overrides, fragment", [
    (["model.embed_scale=1e300"], "model.embed_scale must be at most"),
    (["model.embed_scale=1.0e+400"], "model.embed_scale must be a number or a string, got inf"),
    (["model.init_std=1e300"], "model.init_std must be a finite number"),
    (["model.value_residual=true", "model.value_residual_own=1e300"], "model.value_residual_own"),
    (["model.moe.every=1", "model.moe.n_experts=2", "model.moe.top_k=1", "model.moe.z_loss=1e300"],
     "model.moe.z_loss"),
    (["model.norm_eps=.inf"], "model.norm_eps must be finite"),
    (["train.lr=.nan"], "train.lr must be finite"),
    (["model.scheme=deepnorm", "model.scheme_options.beta=1.0e+300"], "option beta=1e+300 is outside"),
])
def test_cli_bounds_the_model_scales_before_any_folder(tmp_path, overrides, fragment):
    res = cli_in_process("train", "tiny", *overrides, "--out", str(tmp_path / "run"))
    one_line_error(res, fragment)
    assert not (tmp_path / "run").exists()
    assert cli_in_process("train", "tiny", *overrides, "--dry-run").returncode == 2


# ---- 4. loggers that cannot start --------------------------------------------------------------------
@pytest.mark.parametrize("variable, value", [
    ("WANDB_MODE", "bogus"), ("WANDB_INIT_TIMEOUT", "abc"), ("WANDB_BASE_URL", "notaurl"),
])
def test_wandb_settings_it_refuses_are_one_line_before_the_folder(tmp_path, monkeypatch, variable, value):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    if variable != "WANDB_MODE":
        monkeypatch.setenv("WANDB_MODE", "offline")
    res = cli_in_process("train", "tiny", "train.loggers=[wandb]", "--out", str(tmp_path / "run"),
                         env={variable: value})
    one_line_error(res, "train.loggers names wandb, which cannot start", f"{variable}={value!r}")
    assert not (tmp_path / "run").exists()


def test_wandb_failing_to_start_after_the_checks_is_one_line(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "disabled")

    def no_network(**kwargs):
        raise ConnectionError("api.wandb.ai unreachable\nmore detail")

    monkeypatch.setattr(wandb, "init", no_network)
    res = cli_in_process("train", "tiny", "train.steps=2", "train.loggers=[wandb]", "--out",
                         str(tmp_path / "run"))
    one_line_error(res, "wandb, which could not start (ConnectionError: api.wandb.ai unreachable)")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_tensorboard_installed_but_broken_is_one_line_before_the_folder(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)     # its import fails
    res = cli_in_process("train", "tiny", "--out", str(tmp_path / "run"))
    one_line_error(res, "train.loggers names tensorboard, which is installed but cannot be imported")
    assert not (tmp_path / "run").exists()


def test_tensorboard_not_installed_is_still_skipped_quietly(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "tensorboard" else real(name, *args))
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    res = cli_in_process("train", "tiny", "train.steps=1", "--out", str(tmp_path / "run"))
    assert res.returncode == 0, res.stderr
    assert (Path(tmp_path) / "run" / "metrics.jsonl").is_file()


@pytest.mark.parametrize("value", [math.inf, math.nan, -1.0])
@pytest.mark.parametrize("name", ["norm_eps", "init_std", "mlp_ratio"])
def test_vit_and_dit_configs_refuse_non_finite_numbers(name, value):
    """ViT's and DiT's positive numbers refuse NaN and inf as the language model's do."""
    from siamesenorm.models.dit_config import DiTConfig
    from siamesenorm.models.vit_config import ViTConfig

    for cls in (ViTConfig, DiTConfig):
        if name in {f.name for f in dataclasses.fields(cls)}:
            with pytest.raises(UserError, match=f"{name} must be a positive finite number"):
                cls(**{name: value})


def test_max_seq_len_is_bounded_when_read_from_a_folders_config():
    """The RoPE tables are built to max_seq_len: our HF folder's config.json naming a billion
    positions is refused in one line (a run's is bounded by its memory estimate)."""
    pytest.importorskip("transformers")
    from siamesenorm.hf.modeling import SiameseNormConfig
    from siamesenorm.models.config_checks import MAX_SEQ_LEN

    SiameseNormConfig(max_position_embeddings=MAX_SEQ_LEN)
    with pytest.raises(UserError, match="max_seq_len=1,000,000,000 is beyond what this library builds"):
        SiameseNormConfig(max_position_embeddings=10**9)


@pytest.mark.parametrize("options, key", [
    ({"initializer_range": math.nan}, "model.family_options.initializer_range"),
    ({"rms_norm_eps": math.inf}, "model.family_options.rms_norm_eps"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -math.inf}},
     "model.family_options.rope_parameters.rope_theta")])
def test_family_options_refuse_non_finite_numbers(options, key):
    pytest.importorskip("transformers")
    from siamesenorm.hf.families import check_family

    with pytest.raises(UserError, match=f"{re.escape(key)}=.* must be a finite number"):
        check_family("llama", options)
    check_family("llama", {"rms_norm_eps": 1e-6,
                           "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
