"""The run directory: its layout, the "already holds a run" check, the output-folder check, and the
one policy for reading JSON-lines files (and reopening them for a resumed writer)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from siamesenorm.errors import ConfigError
from siamesenorm.experiments.compare import grad_norm_peak
from siamesenorm.rundir import RunDir, check_out_dir, open_jsonl, read_jsonl
from test_train import RandomWindows, make_model, rows, settings, train

ROWS = [{"step": 1, "loss": 2.5, "grad_norm": 1.0}, {"step": 2, "loss": 2.25, "grad_norm": 4.0},
        {"step": 3, "loss": 2.0, "grad_norm": 0.5}]


def jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


# ---- layout ------------------------------------------------------------------------------------
def test_the_layout_names_the_files_users_and_scripts_read(tmp_path):
    run = RunDir(str(tmp_path / "r"))          # a str is accepted, kept as a Path
    base = tmp_path / "r"
    assert run.path == base and str(run) == str(base) and Path(run) == base
    assert (run.config, run.metrics, run.summary) == \
        (base / "config.yaml", base / "metrics.jsonl", base / "summary.json")
    assert (run.checkpoints, run.last_checkpoint) == (base / "checkpoints", base / "checkpoints" / "last")
    assert (run.tokenizer, run.probes, run.analysis, run.plots, run.samples, run.tensorboard) == \
        (base / "tokenizer", base / "probes.jsonl", base / "analysis.json", base / "analysis",
         base / "samples", base / "tb")
    assert run.sample_grid(30) == base / "samples" / "step_30.png"
    assert run.sample_grids() == []
    for step in (100, 5, 30):
        run.sample_grid(step).parent.mkdir(parents=True, exist_ok=True)
        run.sample_grid(step).write_bytes(b"png")
    (run.samples / "step_x.png").write_bytes(b"not one of ours")
    assert run.sample_grids() == [run.sample_grid(5), run.sample_grid(30), run.sample_grid(100)]


def test_a_trained_run_is_where_the_layout_says(tmp_path):
    train(make_model(), RandomWindows(), settings(steps=2, eval_every=0, checkpoint_every=0), tmp_path)
    run = RunDir(tmp_path)
    assert [r["step"] for r in read_jsonl(run.metrics)] == [1, 2] == [r["step"] for r in rows(tmp_path)]
    assert json.loads(run.summary.read_text())["steps"] == 2
    assert {p.name for p in run.last_checkpoint.iterdir()} == {"model.safetensors", "state.pt",
                                                                "checksums.json"}
    assert run.holds_run()


# ---- holds a run -----------------------------------------------------------------------------------
def test_the_run_folder_names_checkpoint_files_as_the_checkpoints_own_names_do(tmp_path, monkeypatch):
    from siamesenorm.train.checkpoint import names

    run = RunDir(tmp_path)
    kept = run.checkpoints / f"{names.KEPT_PREFIX}7"
    kept.mkdir(parents=True)
    (kept / names.STATE_FILE).write_bytes(b"")
    assert run.has_checkpoints()
    monkeypatch.setattr(names, "STATE_FILE", "renamed.pt")      # one home: renamed there, seen here
    assert not run.has_checkpoints()


def test_a_folder_holds_a_run_once_it_has_metrics_or_checkpoints(tmp_path):
    run = RunDir(tmp_path / "r")
    assert not run.holds_run()                    # missing
    run.refuse_existing_run()
    run.path.mkdir()
    run.refuse_existing_run()                     # empty
    run.config.write_text("seed: 0\n")            # not marked by a run of ours: a user's file
    with pytest.raises(ConfigError, match="holds other files .config.yaml. and no run of siamesenorm"):
        run.refuse_existing_run()
    run.mark()                                    # a run of ours, written before training starts
    assert not run.holds_run() and run.stopped_before_first_checkpoint()
    run.refuse_existing_run()
    run.metrics.write_text("")
    assert run.holds_run()
    run.metrics.unlink()
    (run.checkpoints / ".last.tmp-abc").mkdir(parents=True)   # a run killed in its first save
    assert run.holds_run() and run.stopped_before_first_checkpoint()
    run.refuse_existing_run()           # nothing to resume: a fresh run starts it again
    (run.checkpoints / "last").mkdir()
    (run.checkpoints / "last" / "state.pt").write_bytes(b"")
    assert not run.stopped_before_first_checkpoint()
    with pytest.raises(ConfigError) as error:
        run.refuse_existing_run()
    assert str(error.value) == (f"{tmp_path / 'r'} already holds a run; resume it with --resume or "
                                "choose another --out")
    shutil.rmtree(run.checkpoints)
    run.summary.write_text("{}")        # a run that ended (diverged) before its first checkpoint
    assert run.holds_run() or run.summary.exists()
    run.metrics.write_text("")
    with pytest.raises(ConfigError):
        run.refuse_existing_run()
    run.summary.unlink()
    run.tokenizer.mkdir()
    assert run.stopped_before_first_checkpoint()
    run.clear_run_files()               # only the run's own files go, the marker last
    assert not run.path.exists() or sorted(p.name for p in run.path.iterdir()) == []
    run.mark()
    (run.path / "notes.txt").write_text("mine")
    run.clear_run_files()
    assert sorted(p.name for p in run.path.iterdir()) == ["notes.txt"]


def test_the_run_folder_knows_each_entry_a_checkpoint_save_leaves(tmp_path, monkeypatch):
    """rundir sits below the checkpoint package and cannot import its names, so it spells them:
    made by the package itself, a cut-short save, a cut-short swap, a kept, a damaged and the last
    checkpoint are each told apart (a checkpoint to resume or not) and deleted as the run's own."""
    from siamesenorm.train.checkpoint import STATE_FILE, Checkpoints, atomic, kept_name

    run = RunDir(tmp_path / "r")
    run.path.mkdir()
    run.mark()
    last = run.last_checkpoint

    def written(folder: Path) -> Path:
        (folder / STATE_FILE).write_bytes(b"")
        return folder

    cut_short = written(atomic.new_temporary(last))             # killed before its swap
    assert not run.has_checkpoints()
    with monkeypatch.context() as m:                            # killed between the swap's renames
        m.setattr(atomic.shutil, "rmtree", lambda *args, **kwargs: None)
        atomic.install(written(atomic.new_temporary(last)), last)
        atomic.install(written(atomic.new_temporary(last)), last)
    shutil.rmtree(last)
    (old,) = set(run.checkpoints.iterdir()) - {cut_short}
    assert run.has_checkpoints()
    os.replace(old, kept_name(last, 3))
    assert run.has_checkpoints()
    os.replace(kept_name(last, 3), last)
    assert run.has_checkpoints()
    Checkpoints(last, keep=1)._move_aside()                     # damaged: not one to resume
    assert not run.has_checkpoints() and len(list(run.checkpoints.iterdir())) == 2
    run.clear_run_files()
    assert not run.checkpoints.exists()


def test_a_run_refuses_a_used_folder_with_the_one_message(tmp_path):
    from siamesenorm.tasks import Run

    train(make_model(), RandomWindows(), settings(steps=1), tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError) as error, Run(tmp_path).claimed():
        pass
    assert str(error.value) == (f"{tmp_path} already holds a run; resume it with --resume or choose "
                                "another --out")
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_an_output_folder_may_not_be_or_lie_inside_a_file(tmp_path):
    check_out_dir(tmp_path)                        # a folder
    check_out_dir(tmp_path / "new" / "deeper")     # not there yet
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match=r"^--out .*f is a file, not a folder; remove it or choose "
                                          r"another --out$"):
        check_out_dir(tmp_path / "f")
    with pytest.raises(ConfigError, match=r"^--dir .*f/sub lies inside .*f, which is a file"):
        check_out_dir(tmp_path / "f" / "sub", flag="--dir")
    assert not (tmp_path / "new").exists()


# ---- reading JSON lines ------------------------------------------------------------------------
def test_a_missing_file_reads_as_no_rows(tmp_path):
    assert read_jsonl(tmp_path / "metrics.jsonl") == []
    assert read_jsonl(tmp_path / "no-folder" / "probes.jsonl") == []


def test_a_last_line_cut_short_by_a_killed_writer_is_skipped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(jsonl(ROWS[:2]) + '{"step": 3, "loss": 2.0, "grad_')
    assert read_jsonl(path) == ROWS[:2]
    path.write_bytes(jsonl(ROWS[:2]).encode() + b'{"step": 3, "s": "\xe2\x82')  # cut inside a character
    assert read_jsonl(path) == ROWS[:2]
    path.write_text(jsonl(ROWS[:2]) + json.dumps(ROWS[2]))                 # whole, only its newline missing
    assert read_jsonl(path) == ROWS
    path.write_text(jsonl(ROWS[:1]) + "\n  \n" + jsonl(ROWS[1:]))            # blank lines carry nothing
    assert read_jsonl(path) == ROWS


@pytest.mark.parametrize("text, line, why", [
    (jsonl(ROWS[:1]) + '{"step": 2, "loss": \n' + jsonl(ROWS[1:]), 2, "not valid JSON"),  # torn, rows after
    (jsonl(ROWS[:1]) + "[1, 2]\n" + jsonl(ROWS[1:]), 2, "a JSON list, not an object"),
    (jsonl(ROWS[:2]) + "NaN-garbage\n", 3, "not valid JSON"),   # last, but whole: it has its newline
])
def test_a_damaged_line_is_a_one_line_error_naming_file_and_line(tmp_path, text, line, why):
    path = tmp_path / "probes.jsonl"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        read_jsonl(path)
    message = str(error.value)
    assert message.startswith(f"{path}, line {line}: {why}") and "\n" not in message
    assert message.endswith("the file is damaged: delete or repair that line")


def test_bytes_that_are_not_text_in_the_middle_are_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(jsonl(ROWS[:1]).encode() + b"\xff\xfe\n" + jsonl(ROWS[1:]).encode())
    with pytest.raises(ConfigError, match=r"metrics.jsonl, line 2: not valid JSON \(not UTF-8 text\)"):
        read_jsonl(path)


def test_a_folder_in_place_of_the_file_is_a_one_line_error(tmp_path):
    (tmp_path / "metrics.jsonl").mkdir()
    with pytest.raises(ConfigError, match="^cannot read .*metrics.jsonl"):
        read_jsonl(tmp_path / "metrics.jsonl")


def test_every_reader_follows_the_policy(tmp_path):
    from siamesenorm.analysis import read_probes
    from siamesenorm.analysis.report_section import collect
    from siamesenorm.experiments.report import _curve

    run = RunDir(tmp_path / "r")
    run.path.mkdir()
    torn = '{"step": 4, "grad_norm": 99'
    run.metrics.write_text(jsonl([{**r, "val_loss": r["loss"]} for r in ROWS]) + torn)
    run.probes.write_text(jsonl([{"step": 2, "rms": {"h": [1.0, 2.0]}}]) + torn)
    assert grad_norm_peak(run.path) == (4.0, 2)
    assert _curve(run.path) == ([1, 2, 3], [2.5, 2.25, 2.0])
    assert [r["step"] for r in read_probes(run.path)] == [2]
    (got,) = collect(tmp_path, [{"run": "r"}])
    assert got["grads"] == [(1, 1.0), (2, 4.0), (3, 0.5)] and got["rms"] == {"h": [1.0, 2.0]}

    run.metrics.write_text(jsonl(ROWS[:1]) + "oops\n" + jsonl(ROWS[1:]))
    for reader in (grad_norm_peak, _curve, lambda p: collect(tmp_path, [{"run": "r"}])):
        with pytest.raises(ConfigError, match="metrics.jsonl, line 2: not valid JSON"):
            reader(run.path)
    run.probes.write_text("{}\n[]\n")
    with pytest.raises(ConfigError, match="probes.jsonl, line 2: a JSON list"):
        read_probes(run.path)


# ---- reopening for a (resumed) writer ----------------------------------------------------------
def test_open_keeps_the_rows_up_to_a_step_byte_for_byte_and_appends(tmp_path):
    path = tmp_path / "metrics.jsonl"
    odd = '{"loss":1.0,   "step": 2}'                   # spacing no json.dumps would write
    path.write_text(jsonl(ROWS[:1]) + odd + "\n" + jsonl(ROWS[2:]) + '{"no_step": 1}\n{"step": 4, "lo')
    with open_jsonl(path, keep_until=2) as f:
        f.write('{"step": 3}\n')
    assert path.read_text() == jsonl(ROWS[:1]) + odd + "\n" + '{"step": 3}\n'
    with open_jsonl(path) as f:                      # a fresh log
        pass
    assert path.read_text() == "" and [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]
    with open_jsonl(tmp_path / "new.jsonl", keep_until=5) as f:
        f.write(jsonl(ROWS[:1]))
    assert read_jsonl(tmp_path / "new.jsonl") == ROWS[:1]


def test_open_refuses_a_damaged_file_and_leaves_it_as_it_was(tmp_path):
    path = tmp_path / "probes.jsonl"
    damaged = jsonl(ROWS[:1]) + "garbage\n" + jsonl(ROWS[1:])
    path.write_text(damaged)
    with pytest.raises(ConfigError, match="probes.jsonl, line 2"):
        open_jsonl(path, keep_until=3)
    assert path.read_text() == damaged and [p.name for p in tmp_path.iterdir()] == ["probes.jsonl"]


def test_a_run_killed_mid_line_resumes_without_the_torn_line(tmp_path):
    opts = dict(steps=6, checkpoint_every=3, eval_every=0)
    train(make_model(), RandomWindows(), settings(**opts), tmp_path / "a")
    with pytest.raises(RuntimeError):             # crash at step 5: checkpoint at 3, rows to 4
        train(make_model(), RandomWindows(fail_at=5, error=RuntimeError), settings(**opts), tmp_path / "b")
    with open(RunDir(tmp_path / "b").metrics, "a") as f:
        f.write('{"step": 5, "loss": 1.')          # what kill -9 in the middle of a write leaves
    assert [r["step"] for r in read_jsonl(RunDir(tmp_path / "b").metrics)] == [1, 2, 3, 4]
    train(make_model(seed=3), RandomWindows(seed=77), settings(**opts), tmp_path / "b", resume=True)
    assert [r["loss"] for r in rows(tmp_path / "b")] == [r["loss"] for r in rows(tmp_path / "a")]
