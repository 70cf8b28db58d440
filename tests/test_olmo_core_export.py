"""From an OLMo-core run to ours: ``siamesenorm import-olmo-core`` turns a checkpoint of
``siamesenorm olmo-core train`` into a run directory, whose Hugging Face export gives the OLMo-core
model's logits and which ``analyze`` reads.

The OLMo-core side is read by OLMo-core itself (``load_model_and_optim_state`` into its model), the
converter by torch's DCP alone: the two readings must agree.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("olmo_core")

from olmo_core.distributed.checkpoint import load_model_and_optim_state  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from siamesenorm.cli import main  # noqa: E402
from siamesenorm.olmo_core import SchemeTransformerConfig, to_siamesenorm_state_dict  # noqa: E402
from siamesenorm.rundir import RunDir, read_json, read_jsonl  # noqa: E402
from siamesenorm.tasks.registry import saved_config  # noqa: E402
from siamesenorm.train.checkpoint import checkpoint_extra, layout  # noqa: E402

STEPS = 3
SEQ = 64            # the tiny config's context
GLOBAL_TOKENS = 4 * SEQ


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[1] / "src"), os.environ.get("PYTHONPATH", "")]))


def _train(data: Path, save: Path, steps: int, *extra: str) -> None:
    cmd = [sys.executable, "-m", "siamesenorm", "olmo-core", "train", "tiny", "--data",
           str(data / "*.npy"), "--save-folder", str(save), "--steps", str(steps), "--metrics-interval",
           "1", "--lr", "1e-2", "--warmup", "1", *extra]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    """OLMo-core's token files (raw uint16 ids, ``.npy``), and the same ids as our ``tokens.bin``."""
    folder = tmp_path_factory.mktemp("tokens")
    rng = np.random.default_rng(0)
    parts = [np.tile(rng.integers(0, 255, size=32, dtype=np.uint16), 96) for _ in range(2)]
    for i, ids in enumerate(parts):
        ids.tofile(folder / f"part-{i}.npy")
    np.concatenate(parts).tofile(folder / "tokens.bin")
    return folder


@pytest.fixture(scope="module")
def olmo_run(tokens, tmp_path_factory) -> Path:
    """A one-process OLMo-core run of ``tiny``: checkpoints at steps 0, 2 and 3."""
    save = tmp_path_factory.mktemp("olmo") / "save"
    _train(tokens, save, STEPS, "--save-interval", "2")
    assert (save / "step2").is_dir() and (save / f"step{STEPS}").is_dir()
    return save


@pytest.fixture(scope="module")
def imported(olmo_run, tokens, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("ours") / "run"
    data = str(tokens / "tokens.bin")
    assert main(["import-olmo-core", str(olmo_run), "--out", str(run), "--data", data]) == 0
    return run


def olmo_model(step: Path):
    """The OLMo-core model of checkpoint ``step``, loaded by OLMo-core."""
    config = SchemeTransformerConfig.from_dict(json.loads((step / "config.json").read_text())["model"])
    model = config.build(init_device="cpu")
    load_model_and_optim_state(str(step / "model_and_optim"), model)
    return model.eval(), config


def olmo_weights_as_ours(step: Path) -> dict[str, torch.Tensor]:
    model, config = olmo_model(step)
    return to_siamesenorm_state_dict(model.state_dict(), tie_embeddings=config.tie_word_embeddings)


def olmo_losses(save: Path) -> dict[int, float]:
    return {r["step"]: r["train/CE loss"] for r in read_jsonl(save / "metrics.jsonl") if "train/CE loss" in r}


def test_the_latest_checkpoint_becomes_a_run_directory(imported, olmo_run):
    run = RunDir(imported)
    cfg = saved_config(imported, "no config")
    m = cfg.model
    assert (m.scheme, m.scheme_options, m.vocab_size, m.dim, m.n_layers, m.n_heads, m.mlp_hidden) == \
        ("siamese", {"form": "hybrid_pre"}, 256, 64, 2, 4, 128)
    assert (m.max_seq_len, m.qk_norm, m.tie_embeddings) == (SEQ, True, False)
    assert (cfg.data.seq_len, cfg.data.batch_size, cfg.train.grad_accum) == (SEQ, 2, 2)
    assert (cfg.train.lr, cfg.train.warmup, cfg.train.steps) == (1e-2, 1, STEPS)
    # the weights: those OLMo-core itself reads from the latest checkpoint, exactly
    assert layout(run.last_checkpoint) == "single"
    assert checkpoint_extra(run.last_checkpoint)["run"]["step"] == STEPS
    ours = load_file(str(run.last_checkpoint / "model.safetensors"))
    theirs = olmo_weights_as_ours(olmo_run / f"step{STEPS}")
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    earlier = olmo_weights_as_ours(olmo_run / "step2")
    assert not torch.equal(ours["scheme.x_gain.0"], earlier["scheme.x_gain.0"])   # the latest step's
    # the metrics: one row per step with our names, OLMo-core's losses
    rows = read_jsonl(run.metrics)
    want = olmo_losses(olmo_run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in rows] == [want[s] for s in range(1, STEPS + 1)]
    assert all(r["lr"] > 0 and r["grad_norm"] > 0 for r in rows)
    summary = read_json(run.summary)
    assert summary["steps"] == STEPS and summary["final_loss"] == want[STEPS]
    assert summary["tokens_seen"] == STEPS * GLOBAL_TOKENS and not summary["diverged"]
    assert summary["num_parameters"] == sum(t.numel() for t in ours.values())
    assert summary["imported_from"]["olmo_core_checkpoint"] == str((olmo_run / f"step{STEPS}").resolve())


def test_the_hf_export_gives_the_olmo_core_models_logits(imported, olmo_run, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    assert main(["export", str(imported), "--format", "hf", "--out", str(out)]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True).eval()
    ids = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(3))
    model, _ = olmo_model(olmo_run / f"step{STEPS}")
    earlier, _ = olmo_model(olmo_run / "step2")
    with torch.no_grad():
        got, want, other = exported(ids).logits, model(ids), earlier(ids)
    assert got.shape == want.shape == (2, SEQ, 256)
    assert (got - want).abs().max() <= 1e-5
    assert (other - want).abs().max() > 1e-3        # another step's model: the check can fail


def test_analyze_reads_the_data_named_at_import(imported, capsys):
    assert main(["analyze", str(imported), "--batches", "1"]) == 0
    result = read_json(RunDir(imported).analysis)
    assert result["scheme"] == "siamese" and result["n_layers"] == 2
    assert np.isfinite(result["loss"])
    assert "loss" in capsys.readouterr().out


def test_a_step_folder_without_data(olmo_run, tokens, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["import-olmo-core", str(olmo_run / "step2"), "--out", str(run)]) == 0
    assert read_json(RunDir(run).summary)["steps"] == 2
    assert [r["step"] for r in read_jsonl(RunDir(run).metrics)] == [1, 2]
    ours = load_file(str(RunDir(run).last_checkpoint / "model.safetensors"))
    theirs = olmo_weights_as_ours(olmo_run / "step2")
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    capsys.readouterr()
    assert main(["analyze", str(run)]) == 2                     # no data named: one line
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "names no data to analyse" in err and "--data" in err
    assert main(["analyze", str(run), "--data", str(tokens / "tokens.bin"), "--batches", "1"]) == 0


def test_an_imported_run_refuses_to_resume_and_stays_as_it_was(imported, capsys):
    files = {p: p.read_bytes() for p in Path(imported).rglob("*") if p.is_file()}
    capsys.readouterr()
    for further in ([], [f"train.steps={STEPS + 2}"]):
        assert main(["train", "--resume", "--out", str(imported), *further]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "siamesenorm train: error:" in err and "cannot be resumed" in err, err
    assert {p: p.read_bytes() for p in Path(imported).rglob("*") if p.is_file()} == files


# ---- what is refused, in one line -------------------------------------------------------------
def _copy(olmo_run: Path, tmp_path: Path, edit=None) -> Path:
    """A copy of the run's last checkpoint as ``save/step3``; ``edit(config)`` changes its
    config.json."""
    step = tmp_path / "save" / f"step{STEPS}"
    shutil.copytree(olmo_run / f"step{STEPS}", step)
    if edit is not None:
        config = json.loads((step / "config.json").read_text())
        edit(config)
        (step / "config.json").write_text(json.dumps(config))
    return step


def _refused(args: list[str], says: str, capsys) -> None:
    capsys.readouterr()
    assert main(["import-olmo-core", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("siamesenorm import-olmo-core: error:"), err
    assert says in err, err


def _per_head_qk_norm_gains(config):
    config["model"]["block"]["sequence_mixer"]["qk_norm_per_head_gains"] = True


def _stock_transformer(config):
    config["model"]["_CLASS_"] = "olmo_core.nn.transformer.config.TransformerConfig"


def _foreign_class(config):
    config["model"]["block"]["feed_forward"]["_CLASS_"] = "os.system"


@pytest.mark.parametrize("edit, says", [
    (_per_head_qk_norm_gains, "no LMConfig counterpart: a QK-norm gain per head"),
    (_stock_transformer, "not a residual scheme model"),
    (_foreign_class, "names 'os.system' as a class"),
])
def test_a_model_we_cannot_express_is_refused(olmo_run, tmp_path, capsys, edit, says):
    step = _copy(olmo_run, tmp_path, edit)
    _refused([str(step), "--out", str(tmp_path / "run")], says, capsys)
    assert not (tmp_path / "run").exists()


def test_bad_inputs_are_refused_and_leave_nothing(olmo_run, tokens, tmp_path, capsys):
    out = str(tmp_path / "run")
    _refused([str(tmp_path / "missing"), "--out", out], "does not exist", capsys)
    (tmp_path / "empty").mkdir()
    _refused([str(tmp_path / "empty"), "--out", out], "is not an OLMo-core checkpoint", capsys)
    _refused([str(olmo_run), "--out", out, "--data", str(tokens / "part-0.npy")], "ln -s X.npy X.bin", capsys)
    big = tmp_path / "big.bin"
    np.full(4096, 300, dtype=np.uint16).tofile(big)
    _refused([str(olmo_run), "--out", out, "--data", str(big)], "token id 300, beyond the model's vocabulary",
             capsys)
    assert not Path(out).exists() and not list(tmp_path.glob(".run.tmp-*"))
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    _refused([str(olmo_run), "--out", str(taken)], "is a folder that is not empty", capsys)
    assert [p.name for p in taken.iterdir()] == ["notes.txt"]


def test_a_damaged_checkpoint_is_refused(olmo_run, tmp_path, capsys):
    step = _copy(olmo_run, tmp_path)
    shard = sorted((step / "model_and_optim").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    where = step / "model_and_optim"
    _refused([str(step), "--out", str(tmp_path / "run")], f"cannot read checkpoint {where}", capsys)
    # a .metadata that would run a command when unpickled is refused, not unpickled
    marker = tmp_path / "ran"
    (step / "model_and_optim" / ".metadata").write_bytes(pickle.dumps(_Command(f"touch {marker}")))
    _refused([str(step), "--out", str(tmp_path / "run")], "it names posix.system", capsys)
    assert not marker.exists() and not (tmp_path / "run").exists()


class _Command:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_the_command_says_when_olmo_core_is_missing(olmo_run, tmp_path, capsys, monkeypatch):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "olmo_core" else find(name, *a))
    _refused([str(olmo_run), "--out", str(tmp_path / "run")], "pip install 'siamesenorm[olmo]'", capsys)


# An FSDP checkpoint of two processes (each rank's shards) converts: tests/test_olmo_core.py's FSDP
# test, in the same two-process run that it compares with one process.


def test_a_tied_model_saved_without_a_trainer(tmp_path):
    """Another shape (tied embeddings, GQA, LayerNorm, biases, QK-norm, hyper-connections' several
    streams), saved by OLMo-core's ``save_model_and_optim_state`` with no trainer and no metrics:
    our model of the imported run gives the OLMo-core model's logits."""
    from olmo_core.distributed.checkpoint import save_model_and_optim_state

    from siamesenorm.models import LanguageModel, LMConfig
    from siamesenorm.olmo_core import from_language_model
    from siamesenorm.tasks.finished import load_trained

    torch.manual_seed(0)
    lm = LanguageModel(LMConfig(vocab_size=96, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=16,
                                norm="layernorm", bias=True, qk_norm=True, tie_embeddings=True,
                                scheme="hyper"))
    with torch.no_grad():       # norms and biases off their initial ones and zeros
        for name, p in lm.named_parameters():
            if name.startswith("scheme.") or "_norm." in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    model, config = from_language_model(lm)
    step = tmp_path / "save" / "step7"
    save_model_and_optim_state(str(step / "model_and_optim"), model)
    (step / "config.json").write_text(json.dumps({"model": config.as_config_dict(),
                                                  "train_module": {"max_sequence_length": 16}}))
    run = tmp_path / "run"
    assert main(["import-olmo-core", str(step), "--out", str(run)]) == 0
    ours, cfg = load_trained(run)
    assert cfg.model.tie_embeddings and cfg.model.scheme == "hyper" and cfg.model.n_kv_heads == 2
    assert "lm_head.weight" not in load_file(str(RunDir(run).last_checkpoint / "model.safetensors"))
    assert read_jsonl(RunDir(run).metrics) == [] and read_json(RunDir(run).summary)["steps"] == 7
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = ours(ids).logits, model.eval()(ids)
    assert (got - want).abs().max() <= 1e-5


def test_an_olmo2_shaped_users_model_without_a_data_loader_imports_and_exports(tmp_path, capsys, monkeypatch):
    """A user's OLMo2-shaped config (QK-norm over all heads, a head_dim of its own) under
    SiameseNorm, saved with no trainer and no data loader: the import's summary.json is one
    ``read_summary`` takes (tokens seen: null), ``export --format hf`` of the run and
    ``save_hf_model`` of the model both give the OLMo-core model's logits."""
    transformers = pytest.importorskip("transformers")
    from olmo_core.distributed.checkpoint import save_model_and_optim_state
    from olmo_core.nn.transformer import TransformerConfig
    from olmo_core.nn.transformer.config import TransformerBlockType

    from siamesenorm.errors import UserError
    from siamesenorm.olmo_core import from_transformer_config, save_hf_model
    from siamesenorm.shapes import read_summary

    user = TransformerConfig.llama_like(
        d_model=32, vocab_size=96, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=12, qk_norm=True,
        layer_norm_eps=1e-6, block_name=TransformerBlockType.reordered_norm)
    config = from_transformer_config(user, "siamese")
    torch.manual_seed(0)
    model = config.build(init_device="cpu")
    with torch.no_grad():       # norms off their initial ones
        for name, p in model.named_parameters():
            if "norm" in name or name.startswith("scheme."):
                p.add_(0.1 * torch.randn_like(p))
    assert model.blocks["0"].attention.q_norm.weight.shape == (48,)
    step = tmp_path / "save" / "step5"
    save_model_and_optim_state(str(step / "model_and_optim"), model)
    (step / "config.json").write_text(json.dumps({"model": config.as_config_dict(),
                                                  "train_module": {"max_sequence_length": 16}}))
    run, hf, direct = tmp_path / "run", tmp_path / "hf", tmp_path / "direct"
    assert main(["import-olmo-core", str(step), "--out", str(run)]) == 0
    summary = read_summary(RunDir(run).summary)
    assert summary["steps"] == 5 and summary["tokens_seen"] is None
    cfg = saved_config(run, "no config")
    assert (cfg.model.qk_norm_per_head, cfg.model.head_size, cfg.model.norm_eps) == (False, 12, 1e-6)
    assert main(["export", str(run), "--format", "hf", "--out", str(hf)]) == 0
    assert save_hf_model(direct, model, config, max_seq_len=16) == direct
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model.eval()(ids)
        for folder in (hf, direct):
            got = transformers.AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True)
            assert (got.eval()(ids).logits - want).abs().max() <= 1e-5, folder
    with pytest.raises(UserError, match="not empty"):
        save_hf_model(direct, model, config)
    assert save_hf_model(direct, model, config, max_seq_len=16, overwrite=True) == direct   # ours: replaced
    (direct / "mine.txt").write_text("keep")
    with pytest.raises(UserError, match="did not write"):       # never what we did not write (issue 48)
        save_hf_model(direct, model, config, overwrite=True)
    monkeypatch.chdir(direct)
    with pytest.raises(UserError, match="current folder"):
        save_hf_model(direct.parent, model, config, overwrite=True)
    assert (direct / "mine.txt").read_text() == "keep"
