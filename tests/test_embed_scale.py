"""The learnable embedding scale (``model.embed_scale``) of the DyT paper's language models.

arXiv 2503.10622's LLaMA models multiply the token embedding, and only the input embedding, by one
learnable scalar started at sqrt(d). Written out here independently of the library:
``h_0 = s * E[ids]``, the stack as before, ``logits = final(h) @ W_head^T`` where ``W_head`` is the
unscaled ``E`` when tied.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import cli_in_process
from siamesenorm.config import dump_config
from siamesenorm.errors import ConfigError
from siamesenorm.models import LanguageModel, LMConfig
from siamesenorm.nn.norms import DyT
from siamesenorm.tasks import load_config
from siamesenorm.train import build_optimizer

F64 = torch.float64
SRC = str(Path(__file__).resolve().parents[1] / "src")


def tiny(**overrides) -> LMConfig:
    options = dict(vocab_size=31, dim=16, n_layers=2, n_heads=2, max_seq_len=16, embed_scale=2.5)
    options.update(overrides)
    return LMConfig(**options)


def ids(b: int = 2, t: int = 7, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 31, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tied", [True, False])
def test_scaled_model_equals_the_unscaled_one_fed_a_scaled_embedding(tied: bool) -> None:
    """Values and gradients, float64: a model with scale s equals one without a scale whose input
    embedding is s * E, while the head keeps E (tied) or its own matrix; d loss / d s is the sum of
    the embedding-gradient and E[ids] products."""
    torch.manual_seed(0)
    scaled = LanguageModel(tiny(tie_embeddings=tied), dtype=F64)
    with torch.no_grad():
        scaled.embed_scale.fill_(1.7)
    plain = LanguageModel(tiny(tie_embeddings=tied, embed_scale=None), dtype=F64)
    state = {k: v for k, v in scaled.state_dict().items() if k != "embed_scale"}
    plain.load_state_dict(state)
    tokens, targets = ids(), ids(seed=2)

    # the reference: the plain model's stack on 1.7 * E[ids], then the unscaled head
    x = (1.7 * plain.embed.weight[tokens]).detach().requires_grad_(True)
    hidden = plain.run(x, attention_kwargs={"cache": None, "pos": 0, "positions": None, "key_mask": None})
    head = plain.embed.weight if tied else plain.lm_head.weight
    ref_logits = hidden @ head.T
    ref_loss = torch.nn.functional.cross_entropy(ref_logits.reshape(-1, 31), targets.reshape(-1))
    ref_loss.backward()
    ref_scale_grad = (x.grad * plain.embed.weight[tokens].detach()).sum()

    out = scaled(tokens, targets)
    out.loss.backward()
    torch.testing.assert_close(out.logits, ref_logits, rtol=0, atol=1e-12)
    torch.testing.assert_close(scaled.embed_scale.grad[0], ref_scale_grad, rtol=1e-10, atol=1e-12)
    assert ((scaled.embed_scale - 1.7).abs() < 1e-15).all()


def test_sqrt_dim_starts_at_sqrt_d_and_reset_restores_the_start() -> None:
    model = LanguageModel(tiny(embed_scale="sqrt_dim", dim=36, n_heads=3))
    assert model.embed_scale.shape == (1,) and model.embed_scale.item() == pytest.approx(6.0)
    with torch.no_grad():
        model.embed_scale.fill_(0.1)
    model.reset_parameters()
    assert model.embed_scale.item() == pytest.approx(6.0)
    assert LanguageModel(tiny(embed_scale=None)).embed_scale is None
    assert "embed_scale" not in LanguageModel(tiny(embed_scale=None)).state_dict()


def test_the_scale_is_learned_without_weight_decay() -> None:
    model = LanguageModel(tiny())
    opt = build_optimizer(model, 1e-3, weight_decay=0.1)
    group = next(g for g in opt.param_groups if any(p is model.embed_scale for p in g["params"]))
    assert group["weight_decay"] == 0.0


def test_with_dyt_and_mitchell_init_the_stream_enters_the_first_norm_at_unit_scale() -> None:
    """What the scale is for: with the embedding at std 1/sqrt(d) (OLMo's init), sqrt(d) brings the
    residual stream to RMS 1 where the first DyT reads it, as a norm would; without it, RMS 1/sqrt(d)
    (the regime where the topologies preset's DyT model once stalled at the unigram loss)."""
    seen = {}

    def first_norm_input(model: LanguageModel) -> float:
        norm = next(m for m in model.modules() if isinstance(m, DyT))
        handle = norm.register_forward_hook(lambda m, args, out: seen.setdefault("x", args[0]))
        with torch.no_grad():
            model(torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0)))
        handle.remove()
        return seen.pop("x").pow(2).mean().sqrt().item()

    torch.manual_seed(0)
    config = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, max_seq_len=64, norm="dyt", init="mitchell")
    assert first_norm_input(LanguageModel(LMConfig(**config, embed_scale="sqrt_dim"))) \
        == pytest.approx(1.0, rel=0.1)
    assert first_norm_input(LanguageModel(LMConfig(**config))) == pytest.approx(1 / 8, rel=0.1)


@pytest.mark.parametrize("value, fragment", [
    (-1.0, "model.embed_scale must be a positive number, sqrt_dim or null, got -1.0"),
    (0, "model.embed_scale must be a positive number, sqrt_dim or null, got 0"),
    (float("inf"), "model.embed_scale must be a positive number"),
    (True, "model.embed_scale must be a positive number"),
    ("sqrt", "model.embed_scale must be a positive number, sqrt_dim or null, got 'sqrt'"),
])
def test_bad_values_are_one_line_config_errors(value, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        tiny(embed_scale=value)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_families_refuse_it_in_one_line() -> None:
    with pytest.raises(ConfigError) as err:
        tiny(family="qwen3")
    assert "model.embed_scale=2.5 is not available with model.family=qwen3" in str(err.value)
    assert "\n" not in str(err.value)


def test_overrides_reach_the_config_and_the_dump_round_trips(tmp_path: Path) -> None:
    for text, value in [("sqrt_dim", "sqrt_dim"), ("8", 8.0), ("null", None)]:
        cfg = load_config("tiny", [f"model.embed_scale={text}"])
        assert cfg.model.embed_scale == value
        path = tmp_path / "config.yaml"
        path.write_text(dump_config(cfg))
        assert load_config(str(path)) == cfg
    with pytest.raises(ConfigError, match="model.embed_scale must be a number or a string, got True"):
        load_config("tiny", ["model.embed_scale=true"])


def test_the_vision_models_have_no_such_option() -> None:
    with pytest.raises(ConfigError, match="unknown key 'model.embed_scale'"):
        load_config("vit-digits", ["model.embed_scale=2"])


def test_the_cli_refuses_a_bad_value_in_one_line(tmp_path: Path) -> None:
    out = cli_in_process("train", "tiny", "model.embed_scale=-2", "--out", str(tmp_path / "run"))
    assert out.returncode == 2 and "model.embed_scale must be a positive number" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_hugging_face_model_carries_it(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    import siamesenorm.hf as H

    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(
        H.SiameseNormConfig.from_lm_config(tiny(embed_scale="sqrt_dim", norm="dyt"))).eval()
    with torch.no_grad():
        m.model.embed_scale.fill_(3.25)
    m.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.embed_scale == "sqrt_dim" and loaded.model.embed_scale.item() == 3.25
    tokens = ids()
    torch.testing.assert_close(loaded(tokens).logits, m.model(tokens).logits, rtol=0, atol=1e-6)


# OLMo-core's refusal: tests/test_olmo_core.py (where the olmo extra is installed, as in CI)
