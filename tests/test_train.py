"""Tests of the training engine: schedule, optimizer groups, checkpoints, resume, divergence, Ctrl-C."""

from __future__ import annotations

import json
import math
import os
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from torch import nn

from siamesenorm.config import TrainConfig
from siamesenorm.errors import ConfigError
from siamesenorm.models import LanguageModel, LMConfig
from siamesenorm.train import (
    BatchSource,
    Evaluation,
    build_optimizer,
    load_checkpoint,
    lr_at,
    save_checkpoint,
)
from siamesenorm.train import train as train_engine
from siamesenorm.train.checkpoint import CHECKSUM_FILE, MODEL_FILE, STATE_FILE, checkpoint_extra
from siamesenorm.train.state import RunState

VOCAB, SEQ, BATCH = 32, 16, 4
ROW_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s"}
SUMMARY_KEYS = {"steps", "diverged", "diverged_at", "interrupted", "final_val_loss", "final_val_ppl",
                "best_val_loss", "best_val_ppl", "wall_time_s", "tokens_seen", "tokens_per_s",
                "num_parameters", "flops_per_token", "checkpoint_step"}


def make_model(scheme: str = "siamese", seed: int = 0, **overrides) -> LanguageModel:
    options = dict(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, max_seq_len=SEQ, scheme=scheme)
    torch.manual_seed(seed)
    return LanguageModel(LMConfig(**{**options, **overrides}))


def random_tokens(seed: int = 1000, n: int = 512) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def repeating_tokens(period: int = 8, n: int = 512) -> torch.Tensor:
    """A learnable stream: a fixed sequence of ``period`` distinct tokens, repeated."""
    cycle = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(7))[:period]
    return cycle.repeat(n // period)


class RandomWindows:
    """Batches of random windows of a fixed token tensor, drawn from the source's own generator.

    ``fail_at=k`` raises ``error`` from the k-th call of ``next_batch``; ``on_call`` is called with
    the call number before each batch.
    """

    def __init__(self, tokens: torch.Tensor | None = None, seed: int = 0, batch: int = BATCH,
                 fail_at: int | None = None, error: type[BaseException] = KeyboardInterrupt,
                 on_call=None) -> None:
        self.tokens = random_tokens() if tokens is None else tokens
        self.gen = torch.Generator().manual_seed(seed)
        self.batch, self.calls = batch, 0
        self.fail_at, self.error, self.on_call = fail_at, error, on_call

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        if self.on_call is not None:
            self.on_call(self.calls)
        if self.calls == self.fail_at:
            raise self.error()
        starts = torch.randint(0, len(self.tokens) - SEQ, (self.batch,), generator=self.gen)
        window = self.tokens[starts[:, None] + torch.arange(SEQ + 1)]
        return window[:, :-1], window[:, 1:]

    def state_dict(self) -> dict:
        return {"generator": self.gen.get_state(), "calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.gen.set_state(state["generator"])
        self.calls = state["calls"]


def val_batches(tokens: torch.Tensor | None = None, n: int = 2) -> list:
    source = RandomWindows(tokens, seed=99)
    return [source.next_batch() for _ in range(n)]


ONLY_AT_THE_END = 10**9     # eval_every / checkpoint_every that comes only at the last step


def settings(**overrides) -> TrainConfig:
    options = dict(steps=10, lr=3e-3, warmup=2, eval_every=5, checkpoint_every=5)
    options.update(overrides)
    for key in ("eval_every", "checkpoint_every"):
        options[key] = options[key] or ONLY_AT_THE_END
    return TrainConfig(**options)


def train(model, source, cfg: TrainConfig, run_dir, **kwargs) -> dict:
    """The engine with this file's validation batches and seed 0 unless given."""
    kwargs.setdefault("eval_batches", val_batches())
    kwargs.setdefault("seed", 0)
    return train_engine(model, source, cfg, run_dir, **kwargs)


class Accuracy(Evaluation):
    """A figure that tells whether the evaluation ran in eval mode."""

    def __call__(self, model, step):
        return {"accuracy": 0.25 if not model.training else -1.0}


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def saved_step(run_dir: Path, scheme: str = "siamese", **overrides) -> int:
    """Step of ``run_dir``'s checkpoint, loaded into a fresh model (which must accept it)."""
    model = make_model(scheme, seed=5, **overrides)
    extra = load_checkpoint(run_dir / "checkpoints" / "last", model, build_optimizer(model, 1e-3))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    return extra["run"]["step"]


def saved_run(run_dir: Path) -> dict:
    """The run's state in ``run_dir``'s checkpoint."""
    return checkpoint_extra(run_dir / "checkpoints" / "last")["run"]


def test_source_satisfies_protocol():
    assert isinstance(RandomWindows(), BatchSource)


# ---- learning ------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", ["pre", "siamese"])
def test_loss_falls_on_a_repeating_sequence(tmp_path, scheme):
    tokens = repeating_tokens()
    summary = train(make_model(scheme), RandomWindows(tokens),
                    settings(steps=40, lr=1e-2, warmup=4, eval_every=20, checkpoint_every=0), tmp_path,
                    eval_batches=val_batches(tokens))
    losses = [r["loss"] for r in rows(tmp_path)]
    assert len(losses) == 40
    assert losses[0] > 3.0                      # ~ln(32) at initialisation
    assert sum(losses[-5:]) / 5 < 0.3           # the next token is determined by the last one
    assert summary["final_val_loss"] < 0.3 and not summary["diverged"]


def test_grad_accumulation_matches_one_large_batch(tmp_path):
    # Two micro-batches of 4 must give the mean loss and the gradient of one batch of 8.
    a, b = RandomWindows(seed=3), RandomWindows(seed=3, batch=2 * BATCH)
    assert torch.equal(torch.cat([a.next_batch()[0], a.next_batch()[0]]), b.next_batch()[0])
    opts = dict(steps=3, checkpoint_every=0)
    train(make_model(), RandomWindows(seed=3), settings(grad_accum=2, **opts), tmp_path / "a",
          eval_batches=[])
    train(make_model(), RandomWindows(seed=3, batch=2 * BATCH), settings(**opts), tmp_path / "b",
          eval_batches=[])
    for ra, rb in zip(rows(tmp_path / "a"), rows(tmp_path / "b")):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5)
        assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=1e-4)


# ---- schedule and optimizer ----------------------------------------------------------------------
def test_lr_schedule_hand_computed():
    assert lr_at(0, 1.0, 4, 12, 0.1) == 0.0
    assert lr_at(1, 1.0, 4, 12, 0.1) == pytest.approx(0.25)
    assert lr_at(3, 1.0, 4, 12, 0.1) == pytest.approx(0.75)
    assert lr_at(4, 1.0, 4, 12, 0.1) == pytest.approx(1.0)                 # peak
    assert lr_at(8, 1.0, 4, 12, 0.1) == pytest.approx(0.55)                # cos(pi/2): the midpoint
    assert lr_at(6, 2.0, 4, 12, 0.1) == pytest.approx(0.2 + 1.8 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_at(12, 1.0, 4, 12, 0.1) == pytest.approx(0.1)                # cosine end
    assert lr_at(20, 1.0, 4, 12, 0.1) == pytest.approx(0.1)
    assert lr_at(1, 1.0, 0, 10, 0.0) == pytest.approx(0.5 * (1 + math.cos(math.pi / 10)))


def test_logged_lr_follows_the_schedule(tmp_path):
    train(make_model(), RandomWindows(), settings(steps=6, warmup=3, lr=0.01, min_lr_ratio=0.2),
          tmp_path)
    assert [r["lr"] for r in rows(tmp_path)] == [lr_at(k, 0.01, 3, 6, 0.2) for k in range(1, 7)]


@pytest.mark.parametrize("scheme", ["siamese", "hyper"])
def test_optimizer_groups(scheme):
    model = make_model(scheme, norm="layernorm", bias=True, qk_norm=True)
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.05)
    decay_of = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    names = dict(model.named_parameters())
    assert len(decay_of) == len(names)            # every parameter once
    scheme_ids = {id(p) for p in model.scheme.parameters()}
    assert any(p.dim() >= 2 for p in model.scheme.parameters()) == (scheme == "hyper")
    for name, p in names.items():
        if id(p) in scheme_ids or p.dim() < 2:
            assert decay_of[id(p)] == 0.0, name   # norm gains, biases, scheme weights
        else:
            assert decay_of[id(p)] == 0.05, name
    assert decay_of[id(model.sublayers[0].q_proj.weight)] == 0.05
    assert decay_of[id(model.embed.weight)] == 0.05
    assert decay_of[id(model.sublayers[0].q_proj.bias)] == 0.0
    if scheme == "hyper":
        assert decay_of[id(model.scheme.static_alpha)] == 0.0


# ---- resume ------------------------------------------------------------------------------------
def test_resume_repeats_the_uninterrupted_run_bit_for_bit(tmp_path):
    # dropout makes the global torch generator part of the state that must be restored
    opts = dict(steps=10, checkpoint_every=6, eval_every=5)
    straight = make_model(dropout=0.1)
    train(straight, RandomWindows(), settings(**opts), tmp_path / "a")

    with pytest.raises(RuntimeError):             # a crash at step 8: checkpoint at 6, rows to 7
        train(make_model(dropout=0.1), RandomWindows(fail_at=8, error=RuntimeError),
              settings(**opts), tmp_path / "b")
    assert [r["step"] for r in rows(tmp_path / "b")] == list(range(1, 8))
    torch.manual_seed(12345)                      # whatever happened in between
    resumed = make_model(dropout=0.1, seed=3)
    train(resumed, RandomWindows(seed=77), settings(**opts), tmp_path / "b", resume=True)

    a, b = rows(tmp_path / "a"), rows(tmp_path / "b")
    assert [r["step"] for r in b] == list(range(1, 11))
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in b] == [r[key] for r in a], key
    assert [r.get("val_loss") for r in b] == [r.get("val_loss") for r in a]
    for (name, p), q in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(p, q), name
    sa, sb = summary_of(tmp_path / "a"), summary_of(tmp_path / "b")
    for key in ("steps", "tokens_seen", "best_val_loss", "final_val_loss", "best_loss"):
        assert sa[key] == sb[key], key


def test_resume_needs_a_checkpoint(tmp_path):
    # (a fresh run into a used folder is refused by the Run that claims it: tests/test_faults.py)
    with pytest.raises(ConfigError, match="no checkpoint"):
        train(make_model(), RandomWindows(), settings(steps=2), tmp_path / "empty", resume=True)


# ---- divergence --------------------------------------------------------------------------------
def test_absurd_lr_is_divergence_and_keeps_the_last_good_checkpoint(tmp_path):
    # 1e4 is far past stable: the first update wrecks the weights, the next gradient is not finite.
    summary = train(make_model(), RandomWindows(),
                    settings(steps=10, lr=1e4, warmup=0, checkpoint_every=1, eval_every=0), tmp_path)
    assert summary["diverged"] is True and summary["diverged_at"] == 2
    assert summary["steps"] == 1 and summary["checkpoint_step"] == 1
    last = rows(tmp_path)[-1]
    assert last["step"] == 2 and last["diverged"] is True and len(rows(tmp_path)) == 2
    assert last["loss"] is None or last["grad_norm"] is None       # strict JSON: null, not NaN
    assert summary_of(tmp_path) == json.loads(json.dumps(summary))
    assert saved_step(tmp_path) == 1


def switching_source(at: int) -> RandomWindows:
    """The repeating sequence until call ``at``, random tokens from then on: a loss spike."""
    def switch(call: int) -> None:
        if call == at:
            source.tokens = random_tokens()

    source = RandomWindows(repeating_tokens(), on_call=switch)
    return source


@pytest.mark.parametrize("warmup, expected", [(4, 26), (28, 29)])
def test_loss_spike_is_divergence_after_the_warmup(tmp_path, warmup, expected):
    summary = train(make_model(), switching_source(26),
                    settings(steps=40, lr=1e-2, warmup=warmup, checkpoint_every=5, eval_every=0), tmp_path)
    logged = rows(tmp_path)
    best = min(r["loss"] for r in logged[:25])
    assert best < 1.0 and logged[25]["loss"] > 3 * best                # the spike, at step 26
    assert summary["diverged"] and summary["diverged_at"] == expected
    last = logged[-1]
    assert last["step"] == expected and last["diverged"] and last["loss"] > 3 * best
    assert saved_step(tmp_path) == summary["checkpoint_step"] == 5 * ((expected - 1) // 5)


def test_nan_loss_is_divergence_and_the_update_is_not_applied(tmp_path):
    model = make_model()
    source = RandomWindows()
    model.embed.register_forward_hook(
        lambda module, args, out: out * float("nan") if source.calls >= 4 else None)
    summary = train(model, source, settings(steps=10, checkpoint_every=3, eval_every=0, warmup=100),
                    tmp_path)
    assert summary["diverged"] and summary["diverged_at"] == 4 and summary["steps"] == 3
    last = rows(tmp_path)[-1]
    assert last == {**last, "step": 4, "loss": None, "diverged": True}   # strict JSON: NaN -> null
    assert saved_step(tmp_path) == 3
    # the NaN gradient never reached the weights: the model is still the step-3 checkpoint
    saved = make_model(seed=5)
    load_checkpoint(tmp_path / "checkpoints" / "last", saved, None)
    for (name, p), q in zip(model.state_dict().items(), saved.state_dict().values()):
        assert torch.equal(p, q), name


# ---- stall -------------------------------------------------------------------------------------
class DiesAt(nn.Module):
    """``make_model()`` until ``source`` has handed out ``at - 1`` batches; from then on its loss,
    of the same value, no longer depends on any parameter: every gradient is exactly zero."""

    def __init__(self, source: RandomWindows, at: int) -> None:
        super().__init__()
        self.model, self.source, self.at = make_model(), source, at

    def forward(self, x, y):
        loss = self.model(x, y).loss
        return SimpleNamespace(loss=loss * 0.0 + loss.detach() if self.source.calls >= self.at else loss)


def _dies_at_3(run_dir: Path, resume: bool = False, fail_at: int | None = None) -> dict:
    """Zero gradients from step 3 on; stalled after 4 of them; a checkpoint every 3 steps."""
    source = RandomWindows(fail_at=fail_at, error=RuntimeError)
    cfg = settings(steps=20, stall_steps=4, checkpoint_every=3, eval_every=0)
    return train(DiesAt(source, 3), source, cfg, run_dir, resume=resume)


def test_the_zero_gradient_count_goes_on_across_a_resume(tmp_path):
    straight = _dies_at_3(tmp_path / "a")
    assert straight["stalled"] and straight["stalled_at"] == 3 and straight["steps"] == 6
    with pytest.raises(RuntimeError):       # a crash at step 5: the checkpoint at step 3 counts one
        _dies_at_3(tmp_path / "b", fail_at=5)
    assert saved_run(tmp_path / "b")["zero_grad_steps"] == 1
    resumed = _dies_at_3(tmp_path / "b", resume=True)
    assert (resumed["stalled_at"], resumed["steps"]) == (3, 6)      # not (4, 7): the count went on
    timeless = [[{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows(tmp_path / run)]
                for run in "ab"]
    assert timeless[1] == timeless[0]   # the same losses and gradient norms, and the stalled row
    # the stalled run's checkpoint says so: resuming it trains no further and ends the same way
    again = _dies_at_3(tmp_path / "b", resume=True)
    assert (again["stalled"], again["stalled_at"], again["steps"]) == (True, 3, 6)
    assert len(rows(tmp_path / "b")) == 7 and saved_run(tmp_path / "b")["stalled_at"] == 3


def test_a_checkpoint_from_before_the_run_status_was_saved_still_resumes(tmp_path, monkeypatch):
    plain = RunState.to_dict
    new = ("zero_grad_steps", "stalled_at", "diverged_at")
    monkeypatch.setattr(RunState, "to_dict", lambda self: {k: v for k, v in plain(self).items()
                                                           if k not in new})
    with pytest.raises(RuntimeError):
        _dies_at_3(tmp_path, fail_at=5)
    monkeypatch.undo()
    assert not set(new) & set(saved_run(tmp_path))
    resumed = _dies_at_3(tmp_path, resume=True)
    # such a checkpoint knows no count: it starts again at the resumed step
    assert (resumed["stalled_at"], resumed["steps"]) == (4, 7)
    assert RunState.from_dict({"step": 3}) == RunState(step=3)


# ---- checkpoints -------------------------------------------------------------------------------
def _saved(tmp_path: Path, step: int) -> tuple[Path, LanguageModel, torch.optim.Optimizer]:
    model = make_model()
    opt = build_optimizer(model, 1e-3)
    model(*RandomWindows().next_batch()).loss.backward()
    opt.step()
    path = tmp_path / "checkpoints" / "last"
    save_checkpoint(path, model, opt, {"step": step, "note": "first"})
    return path, model, opt


def _assert_loads(path: Path, model: nn.Module, step: int) -> None:
    fresh = make_model(seed=9)
    opt = build_optimizer(fresh, 1e-3)
    assert load_checkpoint(path, fresh, opt)["step"] == step
    for (name, p), q in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(p, q), name
    assert len(opt.state) == len(list(fresh.parameters()))


def test_checkpoint_roundtrip_and_state_loads_weights_only(tmp_path):
    path, model, opt = _saved(tmp_path, 3)
    assert sorted(os.listdir(path)) == [CHECKSUM_FILE, MODEL_FILE, STATE_FILE]
    state = torch.load(path / STATE_FILE, weights_only=True)
    assert state["extra"] == {"step": 3, "note": "first"}
    _assert_loads(path, model, 3)
    with pytest.raises(TypeError, match="weights_only"):
        save_checkpoint(path, model, opt, {"bad": object()})
    _assert_loads(path, model, 3)


def test_tied_weights_are_stored_once_and_stay_tied(tmp_path):
    def tied() -> nn.Sequential:
        net = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False))
        net[1].weight = net[0].weight
        return net

    torch.manual_seed(0)
    net, fresh = tied(), tied()
    save_checkpoint(tmp_path / "c", net, build_optimizer(net, 1e-3), {})
    with safe_open(str(tmp_path / "c" / MODEL_FILE), "pt") as f:
        assert list(f.keys()) == ["0.weight"]
    load_checkpoint(tmp_path / "c", fresh, None)
    assert fresh[1].weight is fresh[0].weight and torch.equal(fresh[0].weight, net[0].weight)


def test_crash_while_writing_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path, model, opt = _saved(tmp_path, 1)

    def disk_full(obj, file, *args, **kwargs):
        written = Path(getattr(file, "name", file)).parent / MODEL_FILE     # (file: a path or an open file)
        assert written.exists()   # the new weights are already written
        raise OSError("No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space"):
        save_checkpoint(path, make_model(seed=4), opt, {"step": 2})
    monkeypatch.undo()
    assert os.listdir(path.parent) == ["last"]
    _assert_loads(path, model, 1)


def test_crash_between_the_renames_recovers_the_old_checkpoint(tmp_path, monkeypatch):
    path, model, opt = _saved(tmp_path, 1)
    real_replace, calls = os.replace, []

    def crash_on_second(src, dst):
        calls.append(dst)
        if len(calls) == 2:                  # old moved away, new not yet in place
            raise SystemExit("power cut")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_second)
    with pytest.raises(SystemExit):
        save_checkpoint(path, make_model(seed=4), opt, {"step": 2})
    monkeypatch.undo()
    left = sorted(os.listdir(path.parent))
    assert "last" not in left and len(left) == 2 and all(name.startswith(".last.") for name in left)
    _assert_loads(path, model, 1)            # the old one, moved back; the temp dir is not read
    save_checkpoint(path, model, opt, {"step": 5})
    assert os.listdir(path.parent) == ["last"]
    _assert_loads(path, model, 5)


def test_corrupt_checkpoints_raise_config_error_naming_the_file(tmp_path):
    path, model, _ = _saved(tmp_path, 1)
    fresh = make_model(seed=9)
    opt = build_optimizer(fresh, 1e-3)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}

    def expect(match: str) -> None:
        with pytest.raises(ConfigError, match=match) as info:
            load_checkpoint(path, fresh, opt)
        assert "\n" not in str(info.value)
        assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in before.items())
        assert not opt.state

    state_bytes = (path / STATE_FILE).read_bytes()
    (path / STATE_FILE).write_bytes(state_bytes[: len(state_bytes) // 2])
    expect(f"checkpoint {path} is damaged: {STATE_FILE} does not match")   # checksums.json
    (path / CHECKSUM_FILE).unlink()     # as an older checkpoint: the readers' own checks
    expect(f"cannot read checkpoint {path / STATE_FILE}")
    (path / STATE_FILE).write_bytes(state_bytes)
    model_bytes = (path / MODEL_FILE).read_bytes()
    (path / MODEL_FILE).write_bytes(model_bytes[: len(model_bytes) - 100])
    expect(f"cannot read checkpoint {path / MODEL_FILE}")
    (path / MODEL_FILE).write_bytes(b"\x00" * 64)
    expect(str(path / MODEL_FILE))
    (path / MODEL_FILE).write_bytes(model_bytes)
    other = make_model(dim=64, n_heads=2)
    with pytest.raises(ConfigError, match="does not fit this model"):
        load_checkpoint(path, other, None)
    (path / MODEL_FILE).unlink()
    expect(f"no checkpoint at {path}")


# ---- logs and summary --------------------------------------------------------------------------
def test_metric_rows_and_summary_keys(tmp_path):
    model = make_model()
    summary = train(model, RandomWindows(),
                    settings(steps=6, eval_every=3, checkpoint_every=0), tmp_path, evaluation=Accuracy())
    logged = rows(tmp_path)
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5, 6]
    for r in logged:
        assert ROW_KEYS <= set(r) and r["tokens_per_s"] > 0 and r["grad_norm"] > 0
        evaluated = r["step"] in (3, 6)
        assert ({"val_loss", "val_ppl", "accuracy"} <= set(r)) == evaluated
        if evaluated:
            assert r["val_ppl"] == pytest.approx(math.exp(r["val_loss"])) and r["accuracy"] == 0.25
    assert summary == summary_of(tmp_path) and SUMMARY_KEYS <= set(summary)
    assert summary["steps"] == 6 and not summary["diverged"] and summary["diverged_at"] is None
    assert not summary["interrupted"] and summary["checkpoint_step"] == 6
    assert summary["final_val_loss"] == logged[-1]["val_loss"]
    assert summary["best_val_loss"] == min(logged[2]["val_loss"], logged[5]["val_loss"])
    assert summary["final_accuracy"] == 0.25
    assert summary["tokens_seen"] == 6 * BATCH * SEQ
    assert summary["num_parameters"] == model.num_parameters()
    assert summary["flops_per_token"] == model.flops_per_token(SEQ)
    assert saved_step(tmp_path) == 6


def test_progress_is_a_bar_when_asked_plain_lines_off_a_terminal_and_nothing_when_off(tmp_path, capsys):
    train(make_model(), RandomWindows(), settings(steps=3), tmp_path / "quiet", progress=False)
    assert capsys.readouterr().err == ""
    train(make_model(), RandomWindows(), settings(steps=3), tmp_path / "lines")
    err = capsys.readouterr().err.splitlines()       # pytest's stderr is not a terminal
    assert [line.split(" | ")[0] for line in err[:-1]] == [f"[train] step {i}/3" for i in (1, 2, 3)]
    assert err[-1].startswith("[train] done: 3/3 steps") and "\r" not in "".join(err)
    train(make_model(), RandomWindows(), settings(steps=3), tmp_path / "shown", progress=True)
    err = capsys.readouterr().err
    assert "\r" in err and "| 3/3 [" in err and "loss " in err and "tok/s" in err
    assert err.endswith("\n") and err.splitlines()[-1].startswith("[train] done: 3/3 steps")


def test_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    train(make_model(), RandomWindows(), settings(steps=5), tmp_path)
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_failed_compile_falls_back_to_eager(tmp_path, monkeypatch, capsys):
    def broken(fn, *args, **kwargs):
        def run(*a, **k):
            raise RuntimeError("no C compiler here")
        return run

    train(make_model(), RandomWindows(), settings(steps=4), tmp_path / "eager")
    monkeypatch.setattr(torch, "compile", broken)
    train(make_model(), RandomWindows(), settings(steps=4, compile=True), tmp_path / "compiled")
    assert "torch.compile failed (no C compiler here)" in capsys.readouterr().err
    assert [r["loss"] for r in rows(tmp_path / "compiled")] == \
        [r["loss"] for r in rows(tmp_path / "eager")]


# ---- Ctrl-C ----------------------------------------------------------------------------------
def test_keyboard_interrupt_checkpoints_the_last_completed_step(tmp_path):
    # raised by the second micro-batch of step 5, after the first one drew a batch and dropout masks
    opts = dict(steps=8, checkpoint_every=0, eval_every=4, grad_accum=2)
    with pytest.raises(KeyboardInterrupt):
        train(make_model(dropout=0.1), RandomWindows(fail_at=10), settings(**opts), tmp_path / "b")
    summary = summary_of(tmp_path / "b")
    assert summary["interrupted"] and summary["steps"] == 4 and summary["checkpoint_step"] == 4
    assert not summary["diverged"]
    assert saved_step(tmp_path / "b", dropout=0.1) == 4
    # the checkpoint holds the state before step 5 began: resuming repeats the straight run
    train(make_model(dropout=0.1), RandomWindows(), settings(**opts), tmp_path / "a")
    train(make_model(dropout=0.1, seed=2), RandomWindows(), settings(**opts), tmp_path / "b",
          resume=True)
    assert [r["loss"] for r in rows(tmp_path / "b")] == [r["loss"] for r in rows(tmp_path / "a")]
    assert not summary_of(tmp_path / "b")["interrupted"]


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to oneself is POSIX")
def test_sigint_finishes_the_step_in_flight(tmp_path, capsys):
    def ctrl_c(call: int) -> None:
        if call == 3:
            os.kill(os.getpid(), signal.SIGINT)

    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        train(make_model(), RandomWindows(on_call=ctrl_c), settings(steps=8, checkpoint_every=0),
              tmp_path)
    assert signal.getsignal(signal.SIGINT) is handler
    assert "stopping after this step" in capsys.readouterr().err
    summary = summary_of(tmp_path)
    assert summary["interrupted"] and summary["steps"] == 3 and summary["checkpoint_step"] == 3
    assert [r["step"] for r in rows(tmp_path)] == [1, 2, 3]
    assert saved_step(tmp_path) == 3
