"""Folders of adapted Hugging Face models load as what they are (issue 36): ``save_pretrained``
(what ``Trainer`` calls), ``siamesenorm.hf.save`` and ``export`` of a family run write our own model
type and the modelling code. References: the in-memory model's logits and greedy generation, and
transformers loading each folder in a process where siamesenorm cannot be imported."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.masking_utils", reason="adapt needs transformers 5")
peft = pytest.importorskip("peft")

import siamesenorm.hf as H  # noqa: E402
from helpers import HIDE_SIAMESENORM, cli_in_process  # noqa: E402
from siamesenorm.data import ByteTokenizer  # noqa: E402
from siamesenorm.errors import UserError  # noqa: E402
from siamesenorm.hf.export import hf_tokenizer  # noqa: E402
from siamesenorm.hf.families import FAMILIES  # noqa: E402
from siamesenorm.tasks.finished import load_trained  # noqa: E402

SRC = str(Path(__file__).resolve().parents[1] / "src")
V = 256                                     # the byte tokenizer's ids
IDS = [[72, 101, 108, 108, 111, 32, 119, 0, 255], [1, 2, 3, 97, 98, 99, 200, 201, 202]]
CASES = [(f, s) for f in ("qwen3", "llama", "olmo") for s in ("siamese", "pre")]
PROMPT = "Hello"


pytestmark = pytest.mark.usefixtures("one_thread")


def family_model(family: str, seed: int = 0):
    """The family's own tiny causal LM (2 layers, width 32), its norms randomised."""
    extra = {"qwen3": dict(head_dim=8, use_sliding_window=True, sliding_window=4, max_window_layers=1),
             "llama": dict(head_dim=8, tie_word_embeddings=True), "olmo": dict()}[family]
    cls = getattr(transformers, FAMILIES[family].config_class)
    config = cls(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64, **extra)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    return model.eval()


def adapted(family: str, scheme: str):
    """``adapt`` of :func:`family_model`, the scheme's own norms randomised too (a fresh norm on
    load would show)."""
    model = H.adapt(family_model(family), scheme)
    with torch.no_grad():
        for p in model.scheme.parameters():
            p.normal_(1.0, 0.3)
    return model


def logits(model) -> list:
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.tolist()


def close(got, want, tol: float = 1e-5) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=tol)


def greedy(generate) -> str:
    return generate(PROMPT, max_new_tokens=6, do_sample=False)[0]["generated_text"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """Every case of :data:`CASES` saved (qwen3/siamese by ``siamesenorm.hf.save`` with a tokenizer,
    llama/pre by ``Trainer.save_model``, the rest by ``save_pretrained``), a LoRA adapter on an
    adapted qwen3, an export of a ``model.family=qwen3`` run; the logits each should give."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)                # as the tests compute: exact comparisons need one order
    try:
        return _save_every_case(tmp_path_factory.mktemp("standalone"))
    finally:
        torch.set_num_threads(before)


def _save_every_case(root: Path) -> dict:
    tok = hf_tokenizer(ByteTokenizer(), 64)
    out: dict = {"folders": {}, "logits": {}}
    for family, scheme in CASES:
        model, folder = adapted(family, scheme), root / f"{family}-{scheme}"
        if (family, scheme) == ("qwen3", "siamese"):
            assert H.save(model, folder, tokenizer=tok) == folder
            out["generated"] = greedy(transformers.pipeline("text-generation", model=model, tokenizer=tok))
        elif (family, scheme) == ("llama", "pre"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                args = transformers.TrainingArguments(output_dir=str(root / "trainer"), report_to=[],
                                                      use_cpu=True, disable_tqdm=True)
                transformers.Trainer(model=model, args=args).save_model(str(folder))
        else:
            model.save_pretrained(folder)
        out["folders"][(family, scheme)], out["logits"][str(folder)] = folder, logits(model)
        out.setdefault("models", {})[(family, scheme)] = model

    # LoRA on an adapted model saved first (its name is now the folder: the adapter's base)
    base = adapted("qwen3", "siamese")
    base.save_pretrained(root / "lora-base")
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                     task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)         # not the identity that LoRA starts as
    lora.save_pretrained(root / "adapter")
    out["adapter"], out["peft"] = root / "adapter", logits(lora)

    # a family run and its export
    run = root / "run"
    for args in (("train", "tiny", "model.family=qwen3", "model.scheme=siamese", "train.steps=1",
                  "train.eval_every=1", "data.max_bytes=20000", "--out", str(run)),
                 ("export", str(run), "--format", "hf", "--out", str(root / "exported"))):
        res = cli_in_process(*args)
        assert res.returncode == 0, res.stderr
    out["exported"], out["logits"][str(root / "exported")] = root / "exported", logits(load_trained(run)[0])
    return out


# ---- the folder, with siamesenorm -----------------------------------------------------------------
def test_a_saved_folder_has_our_model_type_the_familys_fields_and_the_code(saved):
    for (family, scheme), folder in saved["folders"].items():
        config = json.loads((folder / "config.json").read_text())
        own = saved["models"][(family, scheme)].config
        assert config["model_type"] == f"siamesenorm_{family}" and own.model_type == config["model_type"]
        assert config["siamesenorm"] == {"scheme": scheme, "scheme_options": {}}
        assert (config["hidden_size"], config["num_key_value_heads"]) == (32, 2)
        names = {"Config": type(own).__name__, "Model": f"{type(saved['models'][(family, scheme)]).__name__}"}
        assert config["auto_map"] == {"AutoConfig": f"modeling_siamesenorm.{names['Config']}",
                                      "AutoModel": f"modeling_siamesenorm.{names['Model']}",
                                      "AutoModelForCausalLM": f"modeling_siamesenorm.{names['Model']}"}
        code = (folder / "modeling_siamesenorm.py").read_text()
        assert code.startswith('"""Generated by siamesenorm.hf, saving a model adapted')
        assert f"class {names['Config']}(" in code and "siamesenorm/hf/adapted.py" in code
        assert "siamesenorm/hf/vendoring.py" not in code      # the generator is not shipped
    exported = json.loads((saved["exported"] / "config.json").read_text())
    assert exported["model_type"] == "siamesenorm_qwen3" and "AutoConfig" in exported["auto_map"]


def test_with_siamesenorm_the_auto_classes_load_the_installed_classes(saved):
    for (family, scheme), folder in saved["folders"].items():
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
        assert type(model) is type(saved["models"][(family, scheme)])
        close(logits(model), saved["logits"][str(folder)], 0)
        again = H.adapt_from_pretrained(folder)
        assert type(again) is type(model) and again.config.siamesenorm["scheme"] == scheme
    model = transformers.AutoModelForCausalLM.from_pretrained(saved["exported"])
    close(logits(model), saved["logits"][str(saved["exported"])])


def test_folders_of_the_previous_version_still_load_with_adapt_from_pretrained(saved, tmp_path):
    """The previous format: the family's model type, no auto_map (save_pretrained) or one without
    AutoConfig (export), no or another modelling file."""
    src = saved["folders"][("qwen3", "siamese")]
    for name, auto_map in (("saved", None), ("exported", {"AutoModelForCausalLM": "modeling_siamesenorm.X"})):
        old = tmp_path / name
        old.mkdir()
        for file in ("model.safetensors", "generation_config.json"):
            (old / file).write_bytes((src / file).read_bytes())
        config = json.loads((src / "config.json").read_text())
        config["model_type"] = "qwen3"
        config.pop("auto_map")
        if auto_map:
            config["auto_map"] = auto_map
        (old / "config.json").write_text(json.dumps(config))
        model = H.adapt_from_pretrained(old)
        assert type(model) is type(saved["models"][("qwen3", "siamese")])
        assert model.config.model_type == "siamesenorm_qwen3" and model.name_or_path == str(old)
        close(logits(model), saved["logits"][str(src)], 0)


def test_hf_save_writes_the_tokenizer_and_a_card_and_names_the_model_by_the_folder(saved):
    folder = saved["folders"][("qwen3", "siamese")]
    assert saved["models"][("qwen3", "siamese")].name_or_path == str(folder)
    assert {"tokenizer.json", "tokenizer_config.json", "README.md", "model.safetensors"} <= \
        {p.name for p in folder.iterdir()}
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]     # no temporary left
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert tok.encode("héllo") == ByteTokenizer().encode("héllo")
    card = (folder / "README.md").read_text()
    for fragment in ("`siamese`", "arXiv 2602.08064", "X = LN(X); O = F(LN(X + LN(Y)))",
                     "`siamesenorm_qwen3`", "trust_remote_code=True", 'pipeline("text-generation"',
                     f"{sum(p.numel() for p in saved['models'][('qwen3', 'siamese')].parameters()):,}"):
        assert fragment in card, fragment


def test_hf_save_refusals_are_one_line_and_leave_the_folder(saved, tmp_path):
    model = saved["models"][("olmo", "pre")]
    lora = peft.get_peft_model(adapted("olmo", "pre"), peft.LoraConfig(target_modules=["q_proj"]))
    for bad, match in ((family_model("olmo"), "build it with siamesenorm.hf.adapt"),
                       (lora, "merge_and_unload")):
        with pytest.raises(UserError, match=match) as error:
            H.save(bad, tmp_path / "a")
        assert "\n" not in str(error.value)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("keep")
    with pytest.raises(UserError, match="force=True"):
        H.save(model, tmp_path / "full")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        H.save(model, tmp_path / "file")
    with pytest.raises(UserError, match="tokenizer"):
        H.save(model, tmp_path / "b", tokenizer="gpt2")
    with pytest.raises(UserError, match="upload_folder"):
        model.save_pretrained(tmp_path / "c", push_to_hub=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "full"]
    with pytest.raises(UserError, match="did not write"):        # never what we did not write
        H.save(model, tmp_path / "full", force=True)
    (tmp_path / "full" / "mine.txt").unlink()
    H.save(model, tmp_path / "full")
    H.save(model, tmp_path / "full", force=True)                 # our own folder: replaced
    assert (tmp_path / "full" / "config.json").is_file()


def test_an_adapted_model_is_named_by_its_folder_never_by_its_source(tmp_path):
    """A PEFT adapter names its base by the model's name: the source's would be the bare family."""
    family_model("llama").save_pretrained(tmp_path / "plain")
    source = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain")
    model = H.adapt(source, "pre")
    assert model.name_or_path == model.config.name_or_path == ""
    assert source.name_or_path == str(tmp_path / "plain")
    for folder, base in ((tmp_path / "before", None), (tmp_path / "after", str(tmp_path / "saved"))):
        if base is not None:
            model.save_pretrained(base)
        lora = peft.get_peft_model(model, peft.LoraConfig(target_modules=["q_proj"]))
        lora.save_pretrained(folder)
        model = lora.unload()
        assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] == base


def test_a_pipeline_takes_an_adapted_model_object_without_the_not_supported_line(saved):
    model, tok = saved["models"][("llama", "siamese")], hf_tokenizer(ByteTokenizer(), 64)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    transformers.utils.logging.add_handler(handler)
    try:
        transformers.pipeline("text-generation", model=model, tokenizer=tok)
        ours = [r.getMessage() for r in records]
        model.__class__ = type("Unregistered", (type(model),), {})     # the check is live
        transformers.pipeline("text-generation", model=model, tokenizer=tok)
    finally:
        model.__class__ = type(model).__mro__[1]
        transformers.utils.logging.remove_handler(handler)
    assert not [m for m in ours if "not supported" in m], ours
    assert any("'Unregistered' is not supported" in r.getMessage() for r in records)


# ---- the folder, without siamesenorm --------------------------------------------------------------
_HIDDEN = HIDE_SIAMESENORM + r'''
import io, logging
import torch, transformers
from peft import AutoPeftModelForCausalLM
from transformers import AutoModelForCausalLM, pipeline

spec, out = json.loads(sys.argv[2]), {}
ids = torch.tensor(spec["ids"])
for folder in spec["folders"]:
    try:
        AutoModelForCausalLM.from_pretrained(folder)
        refused = None
    except ValueError as error:
        refused = str(error)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    with torch.no_grad():
        out[folder] = {"refused": refused, "logits": model(ids).logits.tolist(),
                       "model_type": model.config.model_type, "scheme": model.config.siamesenorm}
log = io.StringIO()
transformers.utils.logging.add_handler(logging.StreamHandler(log))
generate = pipeline("text-generation", model=spec["pipeline"], trust_remote_code=True)
out["generated"] = generate(spec["prompt"], max_new_tokens=6, do_sample=False)[0]["generated_text"]
out["log"] = log.getvalue()
lora = AutoPeftModelForCausalLM.from_pretrained(spec["adapter"], trust_remote_code=True)
with torch.no_grad():
    out["peft"] = lora(ids).logits.tolist()
out["modules"] = sorted(m for m in sys.modules if "siamesenorm" in m.split(".")[0])
print("\n" + json.dumps(out))         # on a line of its own (transformers' prompts end in none)
'''


def test_every_folder_loads_as_what_it_is_where_siamesenorm_cannot_be_imported(saved, tmp_path):
    folders = [*map(str, saved["folders"].values()), str(saved["exported"])]
    spec = {"ids": IDS, "folders": folders, "prompt": PROMPT, "adapter": str(saved["adapter"]),
            "pipeline": str(saved["folders"][("qwen3", "siamese")])}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", _HIDDEN, SRC, json.dumps(spec)], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(m.startswith("_siamesenorm_export_") for m in got["modules"]) and got["modules"]
    for folder in folders:
        one = got[folder]
        assert "trust_remote_code=True" in one["refused"], folder          # never the bare family
        assert one["model_type"].startswith("siamesenorm_") and one["scheme"]["scheme"] in ("siamese", "pre")
        close(one["logits"], saved["logits"][folder])
    assert got["generated"] == saved["generated"] and got["generated"].startswith(PROMPT)
    assert "not supported" not in got["log"], got["log"]
    close(got["peft"], saved["peft"])
