"""What a hostile or careless user gives ``olmo-core train`` and ``import-olmo-core`` (issue 37):
a save folder that would run code when resumed, a config.json that would call OLMo-core functions,
bad token files and flags. Each ends with one line on stderr and status 2, runs nothing, and leaves
the user's files as they were; a sound save folder still resumes.
"""

from __future__ import annotations

import dataclasses
import io
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

from siamesenorm.cli import main as cli  # noqa: E402
from siamesenorm.errors import UserError  # noqa: E402
from siamesenorm.olmo_core.save_folder import MARKER, safe_loading  # noqa: E402
from siamesenorm.train.checkpoint import read_dcp_metadata  # noqa: E402
from test_olmo_core import ENTRY  # noqa: E402
from test_olmo_core import olmo_train as entry  # noqa: E402

STEP = 2


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[1] / "src"), os.environ.get("PYTHONPATH", "")]))


def _run_entry(*args: str, name: str = "command") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *ENTRY[name], "tiny", *args], env=_env(),
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    """Raw uint16 ids below the tiny vocabulary (OLMo-core's format), 64 sequences of 64."""
    path = tmp_path_factory.mktemp("tokens") / "good.npy"
    np.tile(np.random.default_rng(0).integers(0, 255, size=32, dtype=np.uint16), 128).tofile(path)
    return path


@pytest.fixture(scope="module")
def saved(tokens, tmp_path_factory) -> Path:
    """A save folder of the command with a checkpoint at step 2."""
    save = tmp_path_factory.mktemp("saved") / "save"
    proc = _run_entry("--data", str(tokens), "--save-folder", str(save), "--steps", str(STEP),
                      "--save-interval", str(STEP), "--metrics-interval", "1", "--lr", "1e-2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (save / MARKER).is_file() and (save / f"step{STEP}" / "train" / "rank0.pt").is_file()
    return save


def _refused(argv: list[str], says: str, capsys, run=entry, prefix="siamesenorm olmo-core train") -> str:
    capsys.readouterr()
    assert run(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"{prefix}: error:") and says in err, err
    return err


class _Command:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


# ---- a save folder that would run code -----------------------------------------------------------
def _plant(folder: Path, where: str, ran: Path) -> Path:
    """Make ``where`` of the latest checkpoint a pickle that creates ``ran`` when unpickled; returns
    the file that names it."""
    ckpt = folder / f"step{STEP}"
    command = _Command(f"touch {ran}")
    if where == "metadata":
        file = ckpt / "model_and_optim" / ".metadata"
        file.write_bytes(pickle.dumps(command))
    elif where == "train_state":
        file = ckpt / "train" / "rank0.pt"
        torch.save({"global_step": STEP, "rng": command}, file)
    else:       # one record of the data files: the metadata points at a planted torch.save
        dcp = ckpt / "model_and_optim"
        metadata = read_dcp_metadata(dcp)
        record = io.BytesIO()
        torch.save(command, record)
        file = dcp / "__9_9.distcp"
        file.write_bytes(record.getvalue())
        key = next(iter(metadata.storage_data))
        metadata.storage_data[key] = dataclasses.replace(metadata.storage_data[key], relative_path=file.name,
                                                         offset=0, length=len(record.getvalue()))
        (dcp / ".metadata").write_bytes(pickle.dumps(metadata))
    return file


@pytest.mark.parametrize("where", ["metadata", "train_state", "data_record"])
@pytest.mark.parametrize("adopt", [False, True])
def test_a_save_folder_whose_checkpoint_would_run_code_is_refused_unread(saved, tokens, tmp_path, capsys,
                                                                         where, adopt):
    """A marker proves nothing (it is copied with the folder): every file OLMo-core would load is
    read through our allow-lists first."""
    folder = tmp_path / "evil"
    shutil.copytree(saved, folder)
    if adopt:
        (folder / MARKER).unlink(missing_ok=True)
    ran = tmp_path / "ran"
    file = _plant(folder, where, ran)
    argv = ["tiny", "--data", str(tokens), "--save-folder", str(folder), "--steps", "4",
            *(["--adopt-save-folder"] if adopt else [])]
    _refused(argv, f"refusing checkpoint file {file}: it names posix.system", capsys)
    assert not ran.exists()


def test_a_folder_the_entry_did_not_write_is_refused_unless_adopted(saved, tokens, tmp_path, capsys):
    folder = tmp_path / "theirs"
    shutil.copytree(saved, folder)
    (folder / MARKER).unlink()
    before = sorted(p.relative_to(folder) for p in folder.rglob("*"))
    _refused(["tiny", "--data", str(tokens), "--save-folder", str(folder)], "--adopt-save-folder", capsys)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    _refused(["tiny", "--data", str(tokens), "--save-folder", str(mine)], "did not write (notes.txt)", capsys)
    assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == before
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


def test_olmo_cores_own_readers_load_nothing_unsafe_while_the_entry_trains(saved, tmp_path):
    """A file swapped after the check: under ``safe_loading`` OLMo-core's reader of ``.metadata``
    and its ``torch.load(weights_only=False)`` still run nothing."""
    from olmo_core.distributed.checkpoint import get_checkpoint_metadata
    folder = tmp_path / "swapped"
    shutil.copytree(saved, folder)
    ran = tmp_path / "ran"
    _plant(folder, "metadata", ran)
    state = _plant(folder, "train_state", ran)
    force = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    with safe_loading():
        with pytest.raises(UserError, match="it names posix.system"):
            get_checkpoint_metadata(str(folder / f"step{STEP}" / "model_and_optim"))
        with pytest.raises(pickle.UnpicklingError, match="posix.system"):
            torch.load(state, weights_only=False)
        sound = saved / f"step{STEP}"       # what a sound checkpoint holds still loads
        assert torch.load(sound / "train" / "rank0.pt", weights_only=False)["global_step"] == STEP
        assert get_checkpoint_metadata(str(sound / "model_and_optim")).state_dict_metadata
    assert not ran.exists()
    assert os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD") == force


def test_a_link_where_the_entry_writes_is_refused(saved, tokens, tmp_path, capsys):
    folder = tmp_path / "linked"
    shutil.copytree(saved, folder)
    victim = tmp_path / "victim.txt"
    victim.write_text("mine\n")
    (folder / "metrics.jsonl").unlink()
    (folder / "metrics.jsonl").symlink_to(victim)
    _refused(["tiny", "--data", str(tokens), "--save-folder", str(folder), "--steps", "4"],
             "metrics.jsonl is a link", capsys)
    assert victim.read_text() == "mine\n"


def test_the_command_resumes_its_own_folder_under_either_name(saved, tokens, tmp_path):
    """End to end: a sound folder of the command resumes under the checks and ``safe_loading``,
    through the old module path too."""
    folder = tmp_path / "again"
    shutil.copytree(saved, folder)
    proc = _run_entry("--data", str(tokens), "--save-folder", str(folder), "--steps", str(STEP + 1),
                      "--metrics-interval", "1", name="alias")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Checkpoint successfully loaded" in proc.stdout + proc.stderr
    steps = [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == STEP + 1 and (folder / f"step{STEP + 1}").is_dir()


# ---- token files --------------------------------------------------------------------------------
def _write(path: Path, how: str) -> Path:
    ids = np.tile(np.arange(200, dtype=np.uint16), 8)
    if how == "beyond_vocab":
        np.concatenate([ids, [300]]).astype(np.uint16).tofile(path)
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "short":
        ids[:63].tofile(path)
    elif how == "odd":
        path.write_bytes(ids.tobytes()[:-1])
    elif how == "npy":
        np.save(path, ids)
    elif how == "uint16":
        ids.tofile(path)
    elif how == "shard":
        header = np.zeros(256, dtype="<i4")
        header[:3] = (20240520, 1, ids.size)
        path.write_bytes(header.tobytes() + ids.tobytes())
    return path


@pytest.mark.parametrize("how, extra, says", [
    ("beyond_vocab", [], "holds token id 300 (token 1,600), beyond the model's vocabulary of 256"),
    ("empty", [], "is empty"),
    ("short", [], "holds 0 whole sequences of 64 tokens"),
    ("odd", [], "not whole uint16 tokens"),
    ("npy", [], "is a NumPy .npy file with a header"),
    ("shard", [], "starts with a modded-nanogpt shard header"),
    ("uint16", ["--data-dtype", "uint32"], "is it uint16 data read as uint32? set --data-dtype"),
])
def test_bad_token_files_are_refused_before_anything_is_written(tmp_path, capsys, how, extra, says):
    data = _write(tmp_path / "data.npy", how)
    save = tmp_path / "save"
    _refused(["tiny", "--data", str(data), "--save-folder", str(save), *extra], says, capsys)
    assert not save.exists()


# ---- flags ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, says", [
    (["--lr", "nan"], "--lr must be a positive finite number"),
    (["--lr", "inf"], "--lr must be a positive finite number"),
    (["--metrics-interval", "0"], "--metrics-interval must be at least 1"),
    (["--seed", "-1"], "--seed must be in 0..4294967295"),
    (["--save-interval", "0"], "--save-interval must be positive"),
    (["--dp", "hsdp"], "--dp hsdp"),
    (["--scheme-options", "form=hybrid_pre,form=post_pre"], "form is given twice"),
    (["--scheme-options", "form=hybrid_pre", "--scheme-options", "form=post_pre"], "form is given twice"),
])
def test_bad_flags_are_refused_in_one_line(tokens, tmp_path, capsys, flags, says):
    save = tmp_path / "save"
    err = _refused(["tiny", "--data", str(tokens), "--save-folder", str(save), *flags], says, capsys)
    assert "--checkpoint-every" not in err
    assert not save.exists()


def test_a_save_folder_it_cannot_write_is_one_line(tokens, tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("x")
    _refused(["tiny", "--data", str(tokens), "--save-folder", str(tmp_path / "file" / "save")],
             "is a file, not a folder", capsys)

    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))
    monkeypatch.setattr(Path, "mkdir", refuse)
    _refused(["tiny", "--data", str(tokens), "--save-folder", str(tmp_path / "ro")],
             f"cannot write --save-folder {tmp_path / 'ro'}: Permission denied", capsys)


# ---- import-olmo-core: config.json is data ---------------------------------------------------------
@pytest.mark.parametrize("call", ["clear_directory", "copy_file"])
def test_import_calls_nothing_that_config_json_names(saved, tmp_path, capsys, call):
    step = tmp_path / "save" / f"step{STEP}"
    shutil.copytree(saved / f"step{STEP}", step)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "notes.txt").write_text("mine")
    config = json.loads((step / "config.json").read_text())
    args = {"dir": str(victim), "force": True} if call == "clear_directory" else \
        {"source": str(step / "config.json"), "target": str(victim / "notes.txt"), "save_overwrite": True}
    config["model"]["zzz"] = {"_CLASS_": f"olmo_core.io.{call}", **args}
    (step / "config.json").write_text(json.dumps(config))
    _refused(["import-olmo-core", str(step), "--out", str(tmp_path / "run")],
             f"names 'olmo_core.io.{call}' as a class", capsys, run=cli,
             prefix="siamesenorm import-olmo-core")
    assert (victim / "notes.txt").read_text() == "mine" and not (tmp_path / "run").exists()


def test_resuming_an_import_without_data_says_what_works(saved, tmp_path, capsys):
    run = tmp_path / "run"
    assert cli(["import-olmo-core", str(saved), "--out", str(run)]) == 0
    err = _refused(["train", "--resume", "--out", str(run), "train.steps=4"], "cannot be resumed", capsys,
                   run=cli, prefix="siamesenorm train")
    assert "siamesenorm olmo-core train" in err and "data.corpus=PATH/TO" not in err
