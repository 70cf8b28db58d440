"""One language-model run through ``run_training``: the data it records, its vocabulary, arithmetic
accuracy, a BPE tokenizer saved and reloaded, and bit-exact resume with the real batch sampler."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

import siamesenorm.tasks.lm as lm_task
from siamesenorm.data import BatchSampler, BPETokenizer, load_corpus
from siamesenorm.errors import ConfigError
from siamesenorm.run import generate_text, run_training
from siamesenorm.tasks import load_config
from siamesenorm.tasks.lm import run_tokenizer

TINY = ["train.steps=2", "train.eval_every=2", "train.warmup=0", "data.max_bytes=40000"]


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def saved_config(run_dir: Path) -> dict:
    return yaml.safe_load((run_dir / "config.yaml").read_text())


class CrashingSampler(BatchSampler):
    """The real sampler, raising RuntimeError on its ``crash_at``-th batch (a crash mid-run)."""

    crash_at = 0

    def next_batch(self):
        if self.batches_drawn + 1 == self.crash_at:
            raise RuntimeError("simulated crash")
        return super().next_batch()


def crash_at(monkeypatch, batch: int) -> None:
    monkeypatch.setattr(CrashingSampler, "crash_at", batch)
    monkeypatch.setattr(lm_task, "BatchSampler", CrashingSampler)


# ---- what the run records -------------------------------------------------------------------------
def test_summary_records_the_pystdlib_fingerprint(tmp_path):
    summary = run_training(load_config("tiny", TINY), tmp_path / "run", progress=False)
    expected = load_corpus("pystdlib", max_bytes=40000).meta["fingerprint"]
    assert summary["data"] == {"name": "pystdlib", "fingerprint": expected}
    assert summary_of(tmp_path / "run")["data"] == summary["data"]
    assert set(expected) == {"files", "bytes", "sha256", "python"}


def test_arithmetic_run_logs_exact_match_accuracy(tmp_path):
    cfg = load_config("tiny", TINY + ["data.corpus=arithmetic", "data.corpus_options.max_digits=2",
                                      "data.corpus_options.n_train=300", "data.corpus_options.n_heldout=30",
                                      "data.eval_problems=10", "data.batch_size=2", "data.val_batches=1"])
    summary = run_training(cfg, tmp_path / "run", progress=False)
    last = rows(tmp_path / "run")[-1]
    assert last["step"] == 2 and 0.0 <= last["arith_acc"] <= 1.0
    assert summary["final_arith_acc"] == last["arith_acc"]
    assert summary_of(tmp_path / "run")["final_arith_acc"] == last["arith_acc"]
    assert summary["data"]["name"] == "arithmetic" and "sha256" in summary["data"]["fingerprint"]


# ---- vocabulary of token files --------------------------------------------------------------------
def _bin_corpus(tmp_path: Path) -> list[str]:
    """A train.bin with ids below 50 and a val.bin reaching id 99; the overrides that name them."""
    rng = np.random.default_rng(0)
    rng.integers(0, 50, 400).astype("<u2").tofile(tmp_path / "train.bin")
    val = rng.integers(0, 50, 300).astype("<u2")
    val[7] = 99
    val.tofile(tmp_path / "val.bin")
    return [f"data.corpus={tmp_path / 'train.bin'}", f"data.corpus_options.val={tmp_path / 'val.bin'}"]


def test_token_vocabulary_covers_the_validation_file(tmp_path):
    data = _bin_corpus(tmp_path)
    summary = run_training(load_config("tiny", TINY + data), tmp_path / "run", progress=False)
    assert summary["steps"] == 2 and np.isfinite(summary["final_val_loss"])
    assert saved_config(tmp_path / "run")["model"]["vocab_size"] == 100


def test_an_explicit_larger_vocabulary_stands_and_a_smaller_one_is_refused(tmp_path):
    data = _bin_corpus(tmp_path)
    big = load_config("tiny", TINY + data + ["model.vocab_size=128"])
    run_training(big, tmp_path / "big", progress=False)
    assert saved_config(tmp_path / "big")["model"]["vocab_size"] == 128
    with pytest.raises(ConfigError, match=r"model.vocab_size=60 is too small: .* needs 100 ids"):
        run_training(load_config("tiny", TINY + data + ["model.vocab_size=60"]), tmp_path / "small")
    assert not (tmp_path / "small").exists()
    with pytest.raises(ConfigError, match="BPE tokenizer .* needs 512 ids"):
        run_training(load_config("tiny", TINY + ["data.tokenizer=bpe", "data.vocab_size=512",
                                                 "model.vocab_size=300"]), tmp_path / "bpe")
    assert not (tmp_path / "bpe").exists()


# ---- BPE: saved beside the run, reloaded by resume and generate ---------------------------------
def test_bpe_run_saves_its_tokenizer_and_resume_and_generate_reload_it(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    out = tmp_path / "run"
    cfg = load_config("tiny", ["train.steps=4", "train.checkpoint_every=2", "train.eval_every=2",
                               "data.max_bytes=40000", "data.tokenizer=bpe", "data.vocab_size=300"])
    crash_at(monkeypatch, 3)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_training(cfg, out, progress=False)
    descriptor = json.loads((out / "tokenizer" / "tokenizer_kind.json").read_text())
    assert descriptor["kind"] == "bpe" and 256 < descriptor["vocab_size"] <= 300
    assert saved_config(out)["model"]["vocab_size"] == descriptor["vocab_size"]
    saved = (out / "tokenizer" / "bpe.json").read_text()

    monkeypatch.setattr(lm_task, "BatchSampler", BatchSampler)

    def no_training(*args, **kwargs):
        raise AssertionError("resume must reload the saved tokenizer, not train a new one")

    monkeypatch.setattr(BPETokenizer, "train", no_training)
    summary = run_training(None, out, resume=True, progress=False)
    assert summary["steps"] == 4 and [r["step"] for r in rows(out)] == [1, 2, 3, 4]
    assert (out / "tokenizer" / "bpe.json").read_text() == saved

    tokenizer = run_tokenizer(out)
    assert isinstance(tokenizer, BPETokenizer) and tokenizer.vocab_size == descriptor["vocab_size"]
    text = generate_text(out, "def main(", max_new_tokens=5, greedy=True)
    assert text.startswith("def main(") and len(text) > len("def main(")


# ---- bit-exact resume with the real sampler --------------------------------------------------------
def test_run_training_resume_repeats_the_uninterrupted_run_bit_for_bit(tmp_path, monkeypatch):
    # dropout makes the global torch generator part of the state that must be restored
    overrides = ["train.steps=6", "train.checkpoint_every=3", "train.eval_every=3", "train.warmup=1",
                 "model.dropout=0.1", "data.max_bytes=40000"]
    run_training(load_config("tiny", overrides), tmp_path / "a", progress=False)
    crash_at(monkeypatch, 5)                          # checkpoint at step 3, rows up to 4
    with pytest.raises(RuntimeError):
        run_training(load_config("tiny", overrides), tmp_path / "b", progress=False)
    assert [r["step"] for r in rows(tmp_path / "b")] == [1, 2, 3, 4]
    monkeypatch.setattr(lm_task, "BatchSampler", BatchSampler)
    run_training(None, tmp_path / "b", resume=True, progress=False)
    a, b = rows(tmp_path / "a"), rows(tmp_path / "b")
    assert [r["step"] for r in b] == list(range(1, 7))
    for key in ("loss", "grad_norm", "lr", "val_loss"):
        assert [r.get(key) for r in b] == [r.get(key) for r in a], key
    sa, sb = summary_of(tmp_path / "a"), summary_of(tmp_path / "b")
    for key in ("steps", "tokens_seen", "best_val_loss", "final_val_loss", "best_loss", "data"):
        assert sa[key] == sb[key], key


def test_summary_records_the_environment_and_deterministic_runs_repeat(tmp_path):
    import platform

    import torch

    before = torch.are_deterministic_algorithms_enabled()
    runs = [tmp_path / "a", tmp_path / "b"]
    for run in runs:
        run_training(load_config("tiny", [*TINY, "train.deterministic=true"]), run)
    env = summary_of(runs[0])["environment"]
    assert env["torch"] == torch.__version__ and env["python"] == platform.python_version()
    assert env["device"] == "cpu" and env["device_name"] and env["world_size"] == 1
    assert env["threads"] == torch.get_num_threads() and env["deterministic"] is True
    # the setting is the run's: the process's own state is restored afterwards
    assert torch.are_deterministic_algorithms_enabled() is before
    losses = [[r["loss"] for r in rows(run) if "loss" in r] for run in runs]
    assert losses[0] == losses[1] and losses[0]
    run_training(load_config("tiny", TINY), tmp_path / "c")
    assert summary_of(tmp_path / "c")["environment"]["deterministic"] is before


def test_a_finished_run_trains_further_to_the_same_losses_as_one_trained_straight(tmp_path):
    """``train --resume --out R train.steps=8`` after 4 steps: with a constant rate the rows equal
    a run trained 8 steps at once (the data, the generators and the optimizer go on); the run's
    config.yaml and summary say 8. A plain ``--resume`` of a finished run says it finished."""
    from tests.helpers import cli_in_process

    flat = ["train.eval_every=2", "train.warmup=0", "train.min_lr_ratio=1", "data.max_bytes=40000"]
    straight, extended = tmp_path / "straight", tmp_path / "extended"
    assert cli_in_process("train", "tiny", "train.steps=8", *flat, "--out", str(straight)).returncode == 0
    assert cli_in_process("train", "tiny", "train.steps=4", *flat, "--out", str(extended)).returncode == 0
    again = cli_in_process("train", "--resume", "--out", str(extended))
    assert again.returncode == 0 and f"{extended}: already finished (4 steps)" in again.stdout
    assert "train.steps=N (N > 4)" in again.stdout
    for bad, fragment in ((["train.steps=3"], "planned 4 steps; give at least that many"),
                          (["model.dim=8"], "--resume takes the run's own config.yaml, not model.dim=8: "
                                            "it takes only train.steps, train.eval_every"),
                          (["tiny"], "not the preset tiny"),
                          (["train.steps=two"], "train.steps"),
                          (["train.steps=8", "train.steps=9"], "train.steps is given twice")):
        res = cli_in_process("train", "--resume", "--out", str(extended), *bad)
        assert res.returncode == 2 and fragment in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1
    assert yaml.safe_load((extended / "config.yaml").read_text())["train"]["steps"] == 4    # untouched
    assert cli_in_process("train", "--resume", "--out", str(extended), "train.steps=8").returncode == 0

    def rows(run):
        return [(r["step"], r.get("loss"), r.get("grad_norm"), r.get("val_loss"))
                for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]

    assert rows(extended) == rows(straight) and len(rows(straight)) == 8
    assert json.loads((extended / "summary.json").read_text())["steps"] == 8
    assert yaml.safe_load((extended / "config.yaml").read_text())["train"]["steps"] == 8
    # the run records what changed, when, and how the schedule goes on
    [entry] = json.loads((extended / ".siamesenorm-run.json").read_text())["extensions"]
    assert entry["changes"] == ["train.steps=8"] and entry["at_step"] == 4
    assert entry["schedule"] == ("warm-up and cosine decay over 8 steps (was 4), followed from the step "
                                 "the run resumes at")
