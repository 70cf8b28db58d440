"""``train.loggers``: TensorBoard's tags grouped as ``train/``, ``val/`` and ``throughput/``, no
logger at all, and Weights & Biases (offline, ``WANDB_MODE=offline``), each with what
``metrics.jsonl`` holds."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from helpers import cli_in_process
from siamesenorm.run import run_training
from siamesenorm.tasks import load_config
from siamesenorm.train.metrics import MetricsLog, tag

TINY = ["train.steps=4", "train.eval_every=2", "train.warmup=1", "train.checkpoint_every=2",
        "data.max_bytes=40000"]


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_rows_keys_are_grouped_as_the_loggers_show_them():
    evaluated = {"val_loss", "val_ppl", "arith_acc"}
    assert [tag(k, evaluated) for k in ("loss", "lr", "grad_norm", "aux_loss")] == \
        ["train/loss", "train/lr", "train/grad_norm", "train/aux_loss"]
    assert [tag(k, evaluated) for k in ("val_loss", "val_ppl", "arith_acc")] == \
        ["val/loss", "val/ppl", "val/arith_acc"]
    assert [tag(k) for k in ("tokens_per_s", "tflops", "mfu")] == \
        ["throughput/tokens_per_s", "throughput/tflops", "throughput/mfu"]


def test_tensorboard_gets_every_scalar_of_the_log_under_its_group(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    run_training(load_config("tiny", TINY), run, progress=False)
    events = EventAccumulator(str(run / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "val/loss", "val/ppl",
            "throughput/tokens_per_s"} <= tags
    assert not {t for t in tags if t.split("/")[0] not in ("train", "val", "throughput")}
    for name, key in (("train/loss", "loss"), ("val/loss", "val_loss")):
        want = {r["step"]: r[key] for r in rows(run) if key in r}
        got = {e.step: e.value for e in events.Scalars(name)}
        assert got.keys() == want.keys()
        assert all(math.isclose(got[s], want[s], rel_tol=1e-6) for s in want)    # float32 there


def test_no_logger_leaves_metrics_jsonl_alone(tmp_path):
    run = tmp_path / "run"
    run_training(load_config("tiny", TINY + ["train.loggers=[]"]), run, progress=False)
    assert not (run / "tb").exists() and not (run / "wandb").exists()
    assert len(rows(run)) == 4


def test_wandb_without_its_package_is_refused_in_one_line_before_anything_is_written(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "wandb" else real(name, *args))
    res = cli_in_process("train", "tiny", *TINY, "train.loggers=[wandb]", "--out", str(tmp_path / "run"))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "train.loggers names wandb, which is not installed: pip install 'siamesenorm[wandb]'" in res.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value, fragment", [
    ("[mlflow]", "unknown logger 'mlflow'"),
    ("[tensorboard,tensorboard]", "names a logger twice"),
    ("tensorboard", "must be a list"),
])
def test_bad_loggers_are_one_line(tmp_path, value, fragment):
    res = cli_in_process("train", "tiny", f"train.loggers={value}", "--out", str(tmp_path / "run"))
    assert res.returncode == 2 and fragment in res.stderr, res.stderr
    assert not (tmp_path / "run").exists()


def test_wandb_offline_gets_the_config_and_every_row_and_a_resume_logs_to_the_same_run(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    inits, logged = [], []
    real_init = wandb.init

    def init(**kwargs):
        inits.append(kwargs)
        run = real_init(**kwargs)
        real_log = run.log

        def log(data, step=None, **more):
            logged.append((step, dict(data)))
            return real_log(data, step=step, **more)

        run.log = log
        return run

    monkeypatch.setattr(wandb, "init", init)
    run = tmp_path / "run"
    run_training(load_config("tiny", TINY + ["train.loggers=[wandb]", "train.lr=0.002"]), run, progress=False)
    assert len(inits) == 1 and inits[0]["config"]["train"]["lr"] == 0.002
    assert inits[0]["name"] == "run" and inits[0]["dir"] == str(run) and inits[0]["resume"] == "allow"
    assert list((run / "wandb").glob("offline-run-*"))               # W&B's own offline record
    assert not (run / "tb").exists()
    assert [step for step, _ in logged] == [r["step"] for r in rows(run)]
    for (_, data), row in zip(logged, rows(run)):
        assert data["train/loss"] == row["loss"] and data.get("val/loss") == row.get("val_loss")
    # a resumed run's log continues the W&B run it started
    MetricsLog(run, keep_until=4, loggers=("wandb",)).close()
    assert inits[1]["id"] == inits[0]["id"]
