"""LMConfig is described once: every field declares its check, how a Hugging Face family and
OLMo-core carry it (or why they do not), and what they refuse; the hosts follow the declarations."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from siamesenorm.errors import UserError
from siamesenorm.models.lm_config import (
    HOSTS,
    Elsewhere,
    LMConfig,
    LMField,
    MoEConfig,
    Refused,
    To,
    carried,
    description,
    help_lines,
)

FIELDS = list(description(LMConfig))
NAMES = [name for name, _, _ in FIELDS]

# A value of each field other than its default that LMConfig accepts, for the round trips below
# (a small dense model; the MoE fields set on every second block).
SAMPLES = {
    "vocab_size": 300, "dim": 96, "n_layers": 4, "n_heads": 8, "n_kv_heads": 4, "mlp_hidden": 80,
    "max_seq_len": 64, "rope_theta": 5e5, "qk_norm": True, "qk_norm_per_head": False, "head_size": 24,
    "tie_embeddings": False, "bias": True, "norm": "layernorm", "norm_eps": 1e-6, "scheme": "siamese",
    "scheme_options": {"form": "hybrid_pre"}, "init": "mitchell", "init_std": 0.01, "dropout": 0.1,
    "value_residual": True, "value_residual_mix": "learned", "value_residual_own": 0.3,
    "value_residual_first": 0.7, "depth_attention": True, "depth_attention_stride": 2,
    "embed_scale": 2.0, "family_options": {"sliding_window": 8}, "family": "qwen3", "mlp": "gelu",
    "moe.every": 2, "moe.n_experts": 6, "moe.top_k": 3, "moe.hidden": 40, "moe.shared_hidden": 8,
    "moe.normalize": False, "moe.aux_loss": 0.02, "moe.z_loss": 0.003,
}
BAD = object()      # a value every field's check refuses


def _config(name: str, value, **others) -> LMConfig:
    if name == "scheme_options":
        others["scheme"] = SAMPLES["scheme"]
    if name.startswith("moe."):
        moe = {"every": 1, "n_experts": 8, "top_k": 2, name[4:]: value}
        return LMConfig(**others, moe=moe)
    needs = next(s for n, _, s in FIELDS if n == name).needs
    return LMConfig(**({needs: True} if needs else {}), **others, **{name: value})


@pytest.mark.parametrize("name, f, spec", FIELDS, ids=NAMES)
def test_every_field_is_declared_for_every_host(name, f, spec):
    assert isinstance(spec, LMField) and callable(spec.check)
    for host in HOSTS:
        carriages = getattr(spec, host)
        assert carriages, f"{name}: says nothing of {host} (map it, refuse it or say where it goes)"
        for c in carriages:
            assert isinstance(c, (To, Refused, Elsewhere)), (name, host, c)
            assert (c.where if isinstance(c, To) else c.why), (name, host, c)
        kinds = [type(c) for c in carriages]
        assert len(set(kinds)) == len(kinds) and not (Elsewhere in kinds and len(kinds) > 1)


@pytest.mark.parametrize("name", [n for n in NAMES if n != "moe"])
def test_every_fields_check_refuses_a_bad_value_naming_it(name):
    with pytest.raises(UserError, match=rf"{name.split('.')[-1]}\b") as err:
        _config(name, BAD)
    assert "\n" not in str(err.value)


def test_every_sample_is_a_value_other_than_the_default_that_the_config_takes():
    assert set(SAMPLES) == set(NAMES) - {"moe"}
    for name, f, _ in FIELDS:
        if name in SAMPLES:
            assert SAMPLES[name] != (f.default_factory() if f.default_factory is not dataclasses.MISSING
                                     else f.default), name
            assert _get(_config(name, SAMPLES[name]), name) == SAMPLES[name]


# a value each host refuses of the fields that allow some values only
REFUSED = {"norm": "dyt", "mlp": "gelu"}


@pytest.mark.parametrize("host", list(HOSTS))
def test_each_refusal_is_one_line_naming_the_field_or_its_flag(host):
    where, fix = HOSTS[host]
    refusals = [(n, s, c) for n, _, s in FIELDS for c in getattr(s, host) if isinstance(c, Refused)]
    assert refusals
    for name, spec, rule in refusals:
        cfg = _config(name, REFUSED.get(name, SAMPLES[name]))
        assert rule.allowed is None or _get(cfg, name) not in rule.allowed, name
        with pytest.raises(UserError) as err:
            cfg.check_host(host)
        message = str(err.value)
        assert "\n" not in message and message.endswith(fix), message
        if spec.needs and message.startswith(f"model.{spec.needs}="):
            continue        # the flag it needs is refused first
        assert message.startswith(f"model.{name}=") and rule.why in message, message


def _get(cfg, name):
    for part in name.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_the_family_config_is_what_the_fields_declare():
    pytest.importorskip("transformers")
    from siamesenorm.hf.family_lm import OWN_FIELDS, family_config

    mapped = dict(carried("family"))
    assert OWN_FIELDS == {to.where: f"model.{name}" for name, to in mapped.items()}
    cfg = LMConfig(family="qwen3_moe", vocab_size=300, dim=96, n_layers=4, n_heads=8, n_kv_heads=4,
                   mlp_hidden=80, max_seq_len=64, rope_theta=5e5, tie_embeddings=False, bias=True,
                   norm_eps=1e-6, init_std=0.01, dropout=0.1,
                   moe={"every": 2, "n_experts": 6, "top_k": 3, "hidden": 40, "aux_loss": 0.02})
    hf = family_config(cfg)
    takes = set(inspect.signature(type(hf).__init__).parameters) | {"rope_theta"}
    assert len(set(OWN_FIELDS) & takes) >= 18
    for name, to in mapped.items():
        if to.where not in takes:       # a field this family does not have
            continue
        want = to.value(cfg) if to.value is not None else _get(cfg, name)
        # transformers 5 keeps rope_theta among the rope_parameters
        got = hf.rope_parameters["rope_theta"] if to.where == "rope_theta" else getattr(hf, to.where)
        assert got == want, name


def test_the_olmo_core_conversion_carries_every_declared_field_both_ways():
    pytest.importorskip("olmo_core")
    from siamesenorm.olmo_core import lm_config, olmo_config

    def olmo_takes(name: str) -> bool:
        spec = next(s for m, _, s in FIELDS if m == name)
        refused = next((c for c in spec.olmo_core if isinstance(c, Refused)), None)
        return any(isinstance(c, To) for c in spec.olmo_core) and (
            refused is None or refused.allowed is not None and SAMPLES[name] in refused.allowed)

    dense = {n: v for n, v in SAMPLES.items() if not n.startswith("moe.") and olmo_takes(n)}
    assert {"dim", "n_heads", "head_size", "qk_norm", "bias", "norm", "scheme_options"} <= set(dense)
    moe = {n[4:]: v for n, v in SAMPLES.items() if n.startswith("moe.") and n != "moe.shared_hidden"}
    for cfg in (LMConfig(**dense, max_seq_len=64), LMConfig(**dense, moe=moe)):
        assert lm_config(olmo_config(cfg), max_seq_len=cfg.max_seq_len) == cfg


def test_the_help_names_each_field_that_has_some():
    text = help_lines()
    with_help = [n for n, _, s in FIELDS if s.help]
    assert with_help and all(f"  model.{n}:" in text for n in with_help)
    assert all(len(line) <= 100 for line in text.splitlines())


def test_the_moe_section_is_described_field_by_field():
    assert [n for n in NAMES if n.startswith("moe.")] == \
        [f"moe.{f.name}" for f in dataclasses.fields(MoEConfig)]
