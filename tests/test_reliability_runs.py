"""What a hostile or careless user does to runs and their files (issue 48, round 5): a crafted
OLMo-core config.json, a --work-dir that is a file, a planted non-weights pickle, a corpus rewritten
under a run, a tokenizer a .bin corpus cannot use, workers killed from outside, the documented
checkpoints link, and a ResidualStack wider than its sublayers.

Each user's error ends with one line on stderr, exit status 2 and no traceback, before anything
is written; what is sound still works.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from helpers import cli_in_process
from siamesenorm.errors import UserError
from siamesenorm.rundir import MARKER_NAME, RunDir, fill_unrecorded

needs_olmo_core = pytest.mark.skipif(importlib.util.find_spec("olmo_core") is None,
                                     reason="OLMo-core is not installed")
TWO = ["train.steps=2", "train.eval_every=2", "train.warmup=0", "train.checkpoint_every=2"]


def one_line(res: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit status 2, one line on stderr besides the progress log, no traceback, with ``fragments``."""
    lines = [x for x in res.stderr.strip().splitlines() if not x.startswith("[train]")]
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@contextlib.contextmanager
def within(seconds: float):
    """Fail (rather than hang) when the block takes longer than ``seconds``."""
    def expire(signum, frame):
        raise AssertionError(f"still running after {seconds} s")

    before = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


def token_file(path: Path, seed: int = 0, count: int = 8192, top: int = 200) -> Path:
    np.random.default_rng(seed).integers(0, top, size=count, dtype=np.uint16).tofile(path)
    return path


# ---- 1. import-olmo-core of a crafted config.json ------------------------------------------------------
@pytest.fixture(scope="module")
def olmo_step(tmp_path_factory) -> Path:
    """A sound OLMo-core checkpoint folder ``step2/`` of a tiny scheme model (written here with
    torch.distributed.checkpoint, as OLMo-core writes it): its model tensors and config.json."""
    pytest.importorskip("olmo_core")
    import torch.distributed.checkpoint as dcp

    from siamesenorm.models.lm_config import LMConfig
    from siamesenorm.olmo_core.convert import olmo_config

    cfg = olmo_config(LMConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=16,
                               tie_embeddings=False))
    step = tmp_path_factory.mktemp("olmo") / "save" / "step2"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # one process without a process group: meant
        dcp.save({"model": cfg.build(init_device="cpu").state_dict()},
                 checkpoint_id=str(step / "model_and_optim"))
    (step / "config.json").write_text(json.dumps({"model": cfg.as_config_dict(),
                                                  "train_module": {"max_sequence_length": 16}}))
    return step


def _crafted(olmo_step: Path, where: Path, change) -> Path:
    step = where / "save" / "step2"
    shutil.copytree(olmo_step, step)
    config = json.loads((step / "config.json").read_text())
    text = change(config)
    (step / "config.json").write_text(text if isinstance(text, str) else json.dumps(config))
    return step


def _set(*keys, value):
    def change(config):
        node = config
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value
    return change


@needs_olmo_core
def test_a_sound_crafted_checkpoint_imports(olmo_step, tmp_path):
    res = cli_in_process("import-olmo-core", str(olmo_step), "--out", str(tmp_path / "run"))
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "run" / "checkpoints" / "last").is_dir()


# Every size config.json gives is bounded as our own configurations are, before anything is built.
CRAFTED = {
    "a billion layers": (_set("model", "n_layers", value=10**9), "model.n_layers=1,000,000,000 is beyond"),
    "layers as a float": (_set("model", "n_layers", value=1e9), "model.n_layers=1,000,000,000 is beyond"),
    "negative layers": (_set("model", "n_layers", value=-3),
                        "model.n_layers must be a positive integer, got -3"),
    "no width": (_set("model", "d_model", value=0), "model.d_model must be a positive integer, got 0"),
    "a vocabulary of 1e11": (_set("model", "vocab_size", value=10**11), "this run needs at least"),
    "a huge width": (_set("model", "d_model", value=10**9), "parameters, beyond what this library builds"),
    "a huge feed-forward": (_set("model", "block", "feed_forward", "hidden_size", value=10**14),
                            "parameters, beyond what this library builds"),
    "no heads": (_set("model", "block", "sequence_mixer", "n_heads", value=0),
                 "model.block.sequence_mixer.n_heads must be a positive integer, got 0"),
    "an override beyond the blocks": (lambda config: _set("model", "block_overrides",
                                                          value={"5": config["model"]["block"]})(config),
                                      "model.block_overrides names block 5, not one of the 2 blocks"),
    "a huge context": (_set("train_module", "max_sequence_length", value=10**13), "of rotary tables"),
    "a theta that is no number": (_set("model", "block", "sequence_mixer", "rope", "theta", value="x"),
                                  "cannot read the model of"),
    "nested 100,000 deep": (lambda config: '{"model": ' + "[" * 100_000 + "]" * 100_000 + "}",
                            "nests objects or arrays more than 64 levels deep"),
    "nested 200 deep": (_set("model", "zzz", value=json.loads("[" * 200 + "]" * 200)),
                        "nests objects or arrays more than 64 levels deep"),
}


@needs_olmo_core
@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_config_json_is_refused_in_one_line_before_anything_is_built(olmo_step, tmp_path, case,
                                                                               monkeypatch):
    from siamesenorm import devices

    monkeypatch.setattr(devices, "machine_memory", lambda device: 16 << 30)    # any machine
    change, says = CRAFTED[case]
    step = _crafted(olmo_step, tmp_path, change)
    with within(60):
        res = cli_in_process("import-olmo-core", str(step), "--out", str(tmp_path / "run"))
    one_line(res, says)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["save"]


@needs_olmo_core
def test_a_config_json_too_large_to_be_one_is_not_read(olmo_step, tmp_path, monkeypatch):
    from siamesenorm.olmo_core import to_run

    step = _crafted(olmo_step, tmp_path, lambda config: None)
    monkeypatch.setattr(to_run, "MAX_CONFIG_BYTES", 1000)
    one_line(cli_in_process("import-olmo-core", str(step), "--out", str(tmp_path / "run")),
             "more than the 1,000 this file can hold")


@needs_olmo_core
@pytest.mark.parametrize("size", [(10**12, 32), (-5, 32)])
def test_tensor_sizes_in_metadata_are_bounded_before_any_is_allocated(olmo_step, tmp_path, monkeypatch, size):
    from siamesenorm import devices
    from siamesenorm.train.checkpoint import read_dcp_metadata

    monkeypatch.setattr(devices, "machine_memory", lambda device: 16 << 30)
    step = _crafted(olmo_step, tmp_path, lambda config: None)
    dcp = step / "model_and_optim"
    metadata = read_dcp_metadata(dcp)
    entry = metadata.state_dict_metadata["model.embeddings.weight"]
    metadata.state_dict_metadata["model.embeddings.weight"] = dataclasses.replace(entry,
                                                                                  size=torch.Size(size))
    (dcp / ".metadata").write_bytes(pickle.dumps(metadata))
    says = "needs at least" if size[0] > 0 else "a malformed tensor entry"
    one_line(cli_in_process("import-olmo-core", str(step), "--out", str(tmp_path / "run")), says)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["save"]


# ---- 2. the OLMo-core entry: a --work-dir that is a file, a planted train state ----------------------
def _entry_refused(argv: list[str], capsys, says: str) -> str:
    from siamesenorm.cli import main

    def entry(argv: list[str]) -> int:
        return main(["olmo-core", "train", *argv])

    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert entry(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
    assert not [w for w in caught if "pickle protocol" in str(w.message)], [str(w.message) for w in caught]
    return err


@needs_olmo_core
def test_a_work_dir_that_is_a_file_is_refused_before_anything_is_written(tmp_path, capsys):
    data = token_file(tmp_path / "tokens.npy", top=255)
    (tmp_path / "work").write_text("mine")
    save = tmp_path / "save"
    _entry_refused(["tiny", "--data", str(data), "--save-folder", str(save), "--work-dir",
                    str(tmp_path / "work")], capsys, f"--work-dir {tmp_path / 'work'} is a file")
    assert not save.exists() and (tmp_path / "work").read_text() == "mine"
    save.mkdir()        # the default, <save-folder>/work, a file: the same
    (save / "work").write_text("mine")
    from siamesenorm.olmo_core.save_folder import MARKER
    (save / MARKER).write_text("{}")
    before = sorted(p.name for p in save.iterdir())
    _entry_refused(["tiny", "--data", str(data), "--save-folder", str(save)], capsys,
                   f"--work-dir {save / 'work'} is a file")
    assert sorted(p.name for p in save.iterdir()) == before


@needs_olmo_core
@pytest.mark.parametrize("planted", ["a plain pickle", "a set"])
def test_a_train_state_that_is_not_a_weights_file_says_why_in_one_line(tmp_path, capsys, planted):
    from siamesenorm.olmo_core.save_folder import MARKER

    data = token_file(tmp_path / "tokens.npy", top=255)
    save = tmp_path / "save"
    step = save / "step2"
    (step / "train").mkdir(parents=True)
    (step / "model_and_optim").mkdir()
    (step / "model_and_optim" / ".metadata").write_bytes(b"")
    (step / ".metadata.json").write_text("{}")
    (save / MARKER).write_text("{}")
    value = {"global_step": 2} if planted == "a plain pickle" else {1, 2}
    (step / "train" / "rank0.pt").write_bytes(pickle.dumps(value, protocol=4))
    err = _entry_refused(["tiny", "--data", str(data), "--save-folder", str(save)], capsys,
                         f"cannot read checkpoint {step / 'train' / 'rank0.pt'}: not a file of tensors")
    assert "Unsupported operand" in err and "Please file an issue" not in err


# ---- 3. --resume on a rewritten corpus -----------------------------------------------------------------
def test_the_fingerprint_of_token_files_is_their_content(tmp_path):
    from siamesenorm.data import load_corpus

    a = load_corpus(str(token_file(tmp_path / "a.bin", seed=0)))
    b = load_corpus(str(token_file(tmp_path / "b.bin", seed=1)))      # as many tokens, others
    same = tmp_path / "copy"
    same.mkdir()
    c = load_corpus(str(shutil.copy(tmp_path / "a.bin", same / "a.bin")))
    assert a.meta["fingerprint"]["tokens"] == b.meta["fingerprint"]["tokens"]
    assert a.meta["fingerprint"] != b.meta["fingerprint"] and a.meta["fingerprint"] == c.meta["fingerprint"]
    assert set(a.meta["fingerprint"]) == {"files", "tokens", "sha256"}


def test_resume_refuses_a_corpus_rewritten_with_as_many_tokens(tmp_path):
    corpus = token_file(tmp_path / "tokens.bin", seed=0)
    run = tmp_path / "run"
    res = cli_in_process("train", "tiny", *TWO, f"data.corpus={corpus}", "--out", str(run))
    assert res.returncode == 0, res.stderr
    token_file(corpus, seed=1)          # rewritten: the same size, other tokens
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    for more in ([], ["train.steps=4"]):     # trained further too: refused before its change is written
        one_line(cli_in_process("train", "--resume", "--out", str(run), *more),
                 f"cannot resume {run}: its data changed", "data.fingerprint.sha256 was",
                 "--allow-data-change")
        assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_a_resume_over_two_processes_refuses_changed_data_before_writing(tmp_path, monkeypatch):
    """--nproc's launcher compares the data before it records a resume's changes."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    corpus = token_file(tmp_path / "tokens.bin", seed=0)
    run = tmp_path / "run"
    res = cli_in_process("train", "tiny", *TWO, f"data.corpus={corpus}", "--out", str(run))
    assert res.returncode == 0, res.stderr
    token_file(corpus, seed=1)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    one_line(cli_in_process("train", "--resume", "--out", str(run), "--nproc", "2", "train.steps=4"),
             f"cannot resume {run}: its data changed")
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_a_run_recorded_without_the_hash_still_resumes_with_a_note(tmp_path):
    corpus = token_file(tmp_path / "tokens.bin", seed=0)
    run = tmp_path / "run"
    assert cli_in_process("train", "tiny", *TWO, f"data.corpus={corpus}", "--out", str(run)).returncode == 0
    for name in (MARKER_NAME, "summary.json"):      # as an older version wrote them
        record = json.loads((run / name).read_text())
        del record["data"]["fingerprint"]["sha256"]
        (run / name).write_text(json.dumps(record))
    res = cli_in_process("train", "--resume", "--out", str(run), "train.steps=4")
    assert res.returncode == 0, res.stderr
    [note] = [x for x in res.stderr.splitlines() if "data.fingerprint.sha256" in x]
    assert note.startswith("note:") and "Traceback" not in res.stderr
    assert json.loads((run / "summary.json").read_text())["steps"] == 4
    assert "sha256" in json.loads((run / MARKER_NAME).read_text())["data"]["fingerprint"]     # known now
    token_file(corpus, seed=1)
    one_line(cli_in_process("train", "--resume", "--out", str(run)), "data.fingerprint.sha256 was")


def test_an_unrecorded_hash_is_unknown_and_every_other_entry_is_compared():
    now = {"name": "x.bin", "fingerprint": {"files": 1, "tokens": 10, "sha256": "ab"}}
    old = {"name": "x.bin", "fingerprint": {"files": 1, "tokens": 10}}
    filled, unknown = fill_unrecorded(old, now)
    assert filled == now and unknown == ["data.fingerprint.sha256"] and "sha256" not in old["fingerprint"]
    other = {"name": "x.bin", "fingerprint": {"files": 1, "tokens": 11}}
    assert fill_unrecorded(other, now)[0] != now
    assert fill_unrecorded(now, now) == (now, []) and fill_unrecorded(None, now) == (None, [])
    text = {"name": "t", "fingerprint": {"files": 1, "bytes": 3, "sha256": "cd"}}
    assert fill_unrecorded(text, now) == (text, [])


# ---- 4. data.tokenizer=bpe on .bin token files ---------------------------------------------------------
def test_token_files_are_named_as_such(tmp_path, monkeypatch):
    from siamesenorm.data import names_token_files
    from siamesenorm.data.text.corpora import resolve_paths

    corpus = token_file(tmp_path / "tokens.bin")
    (tmp_path / "text.txt").write_text("some text\n" * 100)
    assert names_token_files(str(corpus))
    for spec in (str(tmp_path / "text.txt"), "pystdlib", str(tmp_path / "missing.bin"), ""):
        assert not names_token_files(spec), spec
    # a folder of nested .bin files names tokens; one text file among them does not; hidden folders
    # (a .venv, a .git) are neither read nor walked
    nested = tmp_path / "nested"
    (nested / "a").mkdir(parents=True)
    token_file(nested / "a" / "0.bin")
    (nested / ".cache").mkdir()
    (nested / ".cache" / "notes.txt").write_text("hidden\n")
    assert names_token_files(str(nested))
    (nested / "b").mkdir()
    (nested / "b" / "readme.txt").write_text("text\n")
    assert not names_token_files(str(nested))
    # an unset corpus is not the working folder (a preset's "" walked the whole tree it ran in)
    monkeypatch.chdir(tmp_path)
    assert names_token_files(".") and not names_token_files("") and not names_token_files("  ")
    with pytest.raises(UserError, match="corpus path is empty"):
        resolve_paths("")


def test_a_token_file_run_records_the_ids_it_reads_not_a_tokenizer(tmp_path):
    """A .bin corpus is read as the ids it holds: whatever a preset or override says of tokenizers,
    config.yaml says ``tokenizer: ids`` (it said bpe and vocab 1024 while the run read raw ids); ids
    on a text corpus are refused before anything is written."""
    corpus = token_file(tmp_path / "tokens.bin")
    out = tmp_path / "run"
    assert cli_in_process("train", "tiny", *TWO, f"data.corpus={corpus}", "data.tokenizer=bpe", "--out",
                          str(out)).returncode == 0
    assert "tokenizer: ids" in (out / "config.yaml").read_text()
    text = tmp_path / "text.txt"
    text.write_text("some text\n" * 100)
    one_line(cli_in_process("train", "tiny", *TWO, f"data.corpus={text}", "data.tokenizer=ids", "--out",
                            str(tmp_path / "other")),
             "data.tokenizer=ids is for a corpus of .bin token files")
    assert not (tmp_path / "other").exists()


# ---- 5. compare's workers killed from outside ----------------------------------------------------------
@pytest.fixture
def worker_temp(tmp_path, monkeypatch):
    """TMPDIR for the workers' folders, and their process a stand-in that sleeps."""
    import tempfile

    from siamesenorm.experiments import workers

    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    real = subprocess.Popen

    def sleeper(argv, **kwargs):
        return real([sys.executable, "-c", "import time; time.sleep(120)"], **kwargs)

    monkeypatch.setattr(workers.subprocess, "Popen", sleeper)
    return temp


def test_a_worker_killed_from_outside_leaves_no_folder(worker_temp, tmp_path):
    from siamesenorm.experiments.workers import Worker

    workers = [Worker(f"run{i}", tmp_path / f"run{i}", False, 1, data=b"pickled data") for i in range(2)]
    for worker in workers:
        worker.start()
    assert len(list(worker_temp.glob("siamesenorm-run-*"))) == 2
    for worker in workers:
        os.kill(worker.proc.pid, signal.SIGKILL)
    for worker in workers:
        code, failure = worker.finish()
        assert code == -signal.SIGKILL and "SIGKILL" in failure.line and not failure.user
    assert list(worker_temp.iterdir()) == []


def test_a_crashed_worker_keeps_its_traceback_and_a_failed_start_leaves_nothing(worker_temp, tmp_path,
                                                                                 monkeypatch):
    from siamesenorm.experiments import workers

    worker = workers.Worker("run", tmp_path / "run", False, 1)
    worker.start()
    (worker.errors / "rank0.error").write_text("0\tcrash\tRuntimeError: boom\n")
    (worker.errors / "rank0.traceback").write_text("Traceback ...\n")
    worker.proc.kill()
    code, failure = worker.finish()
    assert "boom" in failure.line and (worker.errors / "rank0.traceback").is_file()
    shutil.rmtree(worker.errors)

    def no_interpreter(argv, **kwargs):
        raise FileNotFoundError(2, "No such file or directory", argv[0])

    monkeypatch.setattr(workers.subprocess, "Popen", no_interpreter)
    with pytest.raises(FileNotFoundError):
        workers.Worker("run", tmp_path / "run", False, 1, data=b"pickled data").start()
    assert list(worker_temp.iterdir()) == []


# ---- 6. a new run into a folder that holds only the checkpoints link --------------------------------------
def test_the_documented_checkpoints_link_starts_a_run(tmp_path):
    scratch = tmp_path / "scratch" / "run-ckpt"
    scratch.mkdir(parents=True)
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(scratch)
    res = cli_in_process("train", "tiny", *TWO, "data.max_bytes=40000", "--out", str(run))
    assert res.returncode == 0, res.stderr
    assert (run / "checkpoints").is_symlink() and (scratch / "last" / "state.pt").is_file()
    res = cli_in_process("train", "--resume", "--out", str(run), "train.steps=3")
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("inside", ["a real empty folder", "a link to an empty folder"])
def test_an_empty_checkpoints_folder_is_no_run(tmp_path, inside):
    run = tmp_path / "run"
    run.mkdir()
    if inside == "a real empty folder":
        (run / "checkpoints").mkdir()
    else:
        (tmp_path / "empty").mkdir()
        (run / "checkpoints").symlink_to(tmp_path / "empty")
    RunDir(run).refuse_existing_run()


@pytest.mark.parametrize("what", ["the link's folder holds files", "the run folder holds another file",
                                  "a dangling link"])
def test_a_checkpoints_link_beside_other_things_is_still_refused(tmp_path, what):
    target = tmp_path / "scratch"
    target.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    if what == "the link's folder holds files":
        (target / "step_100").mkdir()
    elif what == "the run folder holds another file":
        (run / "notes.txt").write_text("mine")
    else:
        target.rmdir()
    (run / "checkpoints").symlink_to(target)
    says = {"the link's folder holds files": "already holds a run",
            "the run folder holds another file": "holds other files (notes.txt)",
            "a dangling link": "holds other files (checkpoints)"}[what]
    with pytest.raises(UserError, match=re.escape(says)):
        RunDir(run).refuse_existing_run()


# ---- 7. a ResidualStack wider than its sublayers ---------------------------------------------------------
class Block(nn.Module):
    def __init__(self, width: int, out: int | None = None) -> None:
        super().__init__()
        self.q_proj = nn.Linear(width, width)
        self.out_proj = nn.Linear(width, out or width)

    def forward(self, x):
        return self.out_proj(torch.tanh(self.q_proj(x)))


def test_a_stack_wider_than_its_sublayers_names_both_widths():
    from siamesenorm.models import ResidualStack

    stack = ResidualStack("siamese", [Block(32), Block(32)], dim=64)
    with pytest.raises(ValueError, match=r"sublayers\[0\] \(Block\) takes width 32 \(its first Linear, "
                                         r"'q_proj'\), but the scheme gives it width 64 \(dim=64\)"):
        stack(torch.randn(2, 3, 64))
    stack = ResidualStack("pre", [Block(64), Block(64, out=16)], dim=64)
    with pytest.raises(ValueError, match=r"sublayers\[1\] \(Block\) returned width 16 for an input of "
                                         r"width 64"):
        stack(torch.randn(2, 3, 64))


def test_a_stack_of_the_right_width_runs_as_before_and_other_errors_stay_theirs():
    from siamesenorm.models import ResidualStack

    torch.manual_seed(0)
    stack = ResidualStack("siamese", [Block(16), Block(16)], dim=16)
    h = torch.randn(2, 3, 16)
    torch.testing.assert_close(stack(h), stack.run(h), rtol=0, atol=0)

    def broken(x):
        raise RuntimeError("my own bug")

    with pytest.raises(RuntimeError, match="my own bug"):
        ResidualStack("pre", [broken, Block(16)], dim=16)(h)
