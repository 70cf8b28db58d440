"""Hugging Face decoder families in our own commands (``model.family``): train, compare, analyze,
generate and the dry run on a family model with any scheme."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.masking_utils", reason="model.family needs transformers 5")

from helpers import HIDE_SIAMESENORM  # noqa: E402
from siamesenorm.hf.families import FAMILIES, FAMILY_NAMES  # noqa: E402
from siamesenorm.hf.family_lm import FamilyLM, family_config  # noqa: E402
from siamesenorm.models.lm import lm_flops_per_token  # noqa: E402
from siamesenorm.run import run_training  # noqa: E402
from siamesenorm.tasks import load_config  # noqa: E402
from test_cli import run  # noqa: E402

SHORT = ["train.steps=3", "train.eval_every=3", "train.checkpoint_every=3", "data.max_bytes=60000"]


def test_the_model_section_gives_the_family_configuration():
    cfg = load_config("tiny", ["model.family=qwen3", "model.n_kv_heads=1", "model.mlp_hidden=48",
                               "model.family_options={sliding_window: 16, use_sliding_window: true}"])
    c = family_config(cfg.model)
    assert isinstance(c, transformers.Qwen3Config)
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.intermediate_size, c.max_position_embeddings, c.vocab_size) == \
        (32, 2, 2, 1, 16, 48, 32, 256)
    assert c.tie_word_embeddings and c.sliding_window == 16 and c.rms_norm_eps == cfg.model.norm_eps
    gemma = family_config(load_config("tiny", ["model.family=gemma3_text"]).model)
    assert isinstance(gemma, transformers.Gemma3TextConfig)
    assert (gemma.hidden_activation, gemma.query_pre_attn_scalar) == ("gelu_pytorch_tanh", gemma.head_dim)
    moe = family_config(load_config("moe-tiny", ["model.family=qwen3_moe"]).model)
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (8, 2, 64)


@pytest.mark.parametrize("family", ["qwen3", "olmo2", "olmo3", "gemma3_text"])
def test_with_its_native_scheme_the_family_model_is_the_familys_own(family):
    """``pre`` for Qwen3; OLMo2 and OLMo3 norm the sublayers' outputs (``peri_ln`` without input
    norms), Gemma3 both sides (``peri_ln``)."""
    scheme, options = FAMILIES[family].native
    cfg = load_config("tiny", [f"model.family={family}", f"model.scheme={scheme}",
                               f"model.scheme_options={json.dumps(dict(options))}"]).model
    torch.manual_seed(0)
    ours = FamilyLM(cfg).eval()
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(family_config(cfg)).eval()
    assert type(theirs).__name__ == FAMILIES[family].causal_lm
    x = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(ours(x).logits, theirs(x).logits, rtol=0, atol=1e-6)
    assert ours.num_parameters() == sum(p.numel() for p in theirs.parameters())


def test_the_families_said_to_have_a_qk_norm_are_those_whose_attention_has_one():
    """Read from the family's own model on the meta device (what refuses ``model.qk_norm=true``)."""
    for family in FAMILY_NAMES:
        config = family_config(load_config("moe-tiny" if FAMILIES[family].moe else "tiny",
                                           [f"model.family={family}"]).model)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        has = any(name.endswith(("q_norm", "k_norm")) for name, _ in model.named_modules())
        assert has == FAMILIES[family].qk_norm, family


def test_the_family_models_loss_and_flops_are_our_language_models():
    """One loss (cross-entropy over shifted targets, -100 ignored, plus the router's weighted
    auxiliary loss) and one FLOP formula (``models.lm``) for our model and a family's."""
    cfg = load_config("moe-tiny", ["model.family=qwen3_moe", "model.moe.aux_loss=0.25"]).model
    torch.manual_seed(0)
    model = FamilyLM(cfg).train()
    x = torch.randint(0, 256, (2, 16))
    y = x.roll(-1, 1)
    y[:, -1] = -100
    out = model(x, y)
    parts = model.loss_parts
    ce = torch.nn.functional.cross_entropy(out.logits.reshape(-1, 256), y.reshape(-1))
    assert torch.equal(parts["ce_loss"], ce.detach()) and set(parts) == {"ce_loss", "aux_loss"}
    assert torch.equal(out.loss.detach(), ce.detach() + 0.25 * parts["aux_loss"])
    n = model.num_parameters() - model.embed.weight.numel()
    head = 256 * cfg.dim if cfg.tie_embeddings else 0       # a tied head counts once
    assert model.flops_per_token(8) == lm_flops_per_token(cfg, n, 8) \
        == 6 * (n + head) + 12 * cfg.n_layers * cfg.dim * 8


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_every_family_trains_with_siamesenorm_in_our_engine(family, tmp_path):
    cfg = load_config("tiny", ["model.scheme=siamese", f"model.family={family}", "model.moe.n_experts=4",
                               "model.moe.top_k=2", *SHORT])
    summary = run_training(cfg, tmp_path / "run", progress=False)
    assert summary["steps"] == 3 and summary["final_val_loss"] is not None and not summary["failed"]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    moe = FAMILIES[family].moe
    assert all(("aux_loss" in r) == moe for r in rows)       # the router's loss is logged
    saved = yaml_of(tmp_path / "run" / "config.yaml")
    assert saved["model"]["family"] == family and saved["model"]["scheme"] == "siamese"


def yaml_of(path):
    import yaml

    return yaml.safe_load(path.read_text())


def test_train_analyze_generate_and_dry_run_from_the_command_line(tmp_path):
    args = ("tiny", "model.family=llama", "model.scheme=siamese", "analysis.every=2", *SHORT)
    res = run("train", *args, "--out", str(tmp_path / "full"))
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "full" / "probes.jsonl").exists() and (tmp_path / "full" / "analysis.json").exists()
    res = run("analyze", str(tmp_path / "full"))
    assert res.returncode == 0 and "logit lens agrees" in res.stdout, res.stderr
    res = run("generate", str(tmp_path / "full"), "--prompt", "def ", "--max-new-tokens", "5", "--greedy")
    assert res.returncode == 0 and res.stdout.startswith("def "), res.stderr
    res = run("train", "tiny", "model.family=qwen3", "--dry-run")
    assert res.returncode == 0 and "parameters" in res.stdout, res.stderr
    res = run("export", str(tmp_path / "full"), "--out", str(tmp_path / "weights.safetensors"))
    assert res.returncode == 0, res.stderr


def test_compare_on_the_qwen3_preset(tmp_path):
    out = tmp_path / "exp"
    res = run("compare", "qwen3-tiny", "train.steps=4", "train.eval_every=2", "train.checkpoint_every=4",
              "data.max_bytes=60000", "--seeds", "0", "--out", str(out))
    assert res.returncode == 0, res.stderr
    rows = json.loads((out / "summary.json").read_text())["runs"]
    assert [r["scheme"] for r in rows] == ["pre", "siamese"] and all(r["steps"] == 4 for r in rows)
    assert "siamese" in res.stdout and (out / "report.md").exists()


def test_the_gpu_preset_is_the_papers_shape_through_the_olmo_family():
    res = run("train", "olmo-1b-hf", "--dry-run", "--nproc", "8")
    assert res.returncode == 0, res.stderr
    assert "16 layers x 2048" in res.stdout and "1,279,819,776" in res.stdout


@pytest.mark.parametrize("override, message", [
    ("model.family_options={}", "model.family: unknown value 'qwen4'; choose one of llama, mistral"),
    ("model.family_options.nope=1", "model.family_options.nope: Qwen3Config has no field 'nope'"),
    ("model.mlp=gelu", "model.mlp=gelu is not available with model.family=qwen3 (it has its own gated"),
    # a QK-norm the family does not have was dropped without a word
    ("model.qk_norm=true", "model.qk_norm=true is not available with model.family=llama (its attention "
                           "has no QK-norm; qwen3, qwen3_moe, olmoe, olmo2, olmo3, gemma3_text have"),
    ("model.scheme=nosuch", "unknown scheme 'nosuch'"),
    ("model.scheme_options.form=x", "scheme 'pre' has no option 'form'"),
    # restating a model.* field trained one size under another's name (issue 37)
    ("model.family_options.hidden_size=64", "model.family_options.hidden_size restates model.dim: set "
                                            "model.dim instead"),
    ("model.family_options.num_hidden_layers=5", "restates model.n_layers"),
    ("model.family_options.vocab_size=99", "restates model.vocab_size"),
    # values the family rejects were a traceback once the folder was made
    ("model.family_options.attn_implementation=flash_attention_2",
     "model.family_options.attn_implementation=flash_attention_2: FlashAttention2 has been toggled on"),
    ("model.family_options.attn_implementation=bogus", "attn_implementation=\"bogus\"` is not supported"),
    ("model.family_options.attn_implementation=kernels-community/flash-attn", "is not fetched"),
    ("model.family_options={layer_types: [full_attention]}",
     "model.family_options: Qwen3Config refuses them: ValueError: `num_hidden_layers` (2) must be equal"),
])
def test_bad_family_settings_are_one_line_and_exit_2(override, message, tmp_path):
    family = next((f for f in ("qwen4", "llama") if f"family={f}" in message or f"'{f}'" in message), "qwen3")
    res = run("train", "tiny", f"model.family={family}", override, "--out", str(tmp_path / "run"))
    assert res.returncode == 2 and message in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_fsdp2_across_two_processes_trains_a_qwen3_to_the_losses_of_one_with_accumulation(tmp_path):
    args = ("tiny", "model.family=qwen3", "model.scheme=siamese", "train.steps=3", "train.eval_every=3",
            "data.max_bytes=60000")
    one = run("train", *args, "train.grad_accum=2", "--out", str(tmp_path / "one"))    # one thread each
    two = run("train", *args, "train.parallel=fsdp", "--nproc", "2", "--out", str(tmp_path / "two"))
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr

    def losses(run_dir):
        return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-5)


_REMOTE = HIDE_SIAMESENORM + r'''
import torch
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(sys.argv[2], trust_remote_code=True).eval()
with torch.no_grad():
    logits = model(torch.tensor(json.loads(sys.argv[3]))).logits
model.save_pretrained(sys.argv[2] + "-resaved")
again = AutoModelForCausalLM.from_pretrained(sys.argv[2] + "-resaved", trust_remote_code=True).eval()
with torch.no_grad():
    resaved = (again(torch.tensor(json.loads(sys.argv[3]))).logits - logits).abs().max().item()
print(json.dumps({"logits": logits.tolist(), "scheme": model.config.siamesenorm, "resaved": resaved,
                  "class": type(model).__name__}))
'''


def test_a_family_run_exports_as_a_folder_that_loads_where_siamesenorm_cannot_be_imported(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    from siamesenorm.run import load_trained

    run_dir = tmp_path / "run"
    res = run("train", "tiny", "model.family=qwen3", "model.scheme=siamese", *SHORT, "--out", str(run_dir))
    assert res.returncode == 0, res.stderr
    res = run("export", str(run_dir), "--format", "hf", "--out", str(tmp_path / "hf"))
    assert res.returncode == 0, res.stderr
    ids = [[1, 5, 9, 33, 70, 2], [4, 4, 8, 100, 3, 7]]
    model, _ = load_trained(run_dir)
    with torch.no_grad():
        ours = model(torch.tensor(ids)).logits
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf-home"), HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", _REMOTE, src, str(tmp_path / "hf"), json.dumps(ids)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["scheme"] == {"scheme": "siamese", "scheme_options": {}}
    assert got["class"] == "Qwen3SchemeForCausalLM" and got["resaved"] <= 1e-6
    torch.testing.assert_close(torch.tensor(got["logits"]), ours, rtol=0, atol=1e-5)
