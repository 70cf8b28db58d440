"""Faults of the files a run is made of: a checkpoint altered to run code when loaded, writes that
would escape the run folder or delete a user's files, and a real full disk.

Each refusal is one stderr line with exit status 2 and no traceback; where it applies, nothing
already written is lost and the run resumes. The code-execution cases test the mechanism (every
name outside the allow-list is refused, by either pickle opcode) as well as the example."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import cli_in_process
from siamesenorm.errors import ConfigError
from siamesenorm.locks import LOCK_NAME, folder_lock
from siamesenorm.rundir import MARKER_NAME, RunDir, open_jsonl, replacing, write_json, write_text
from siamesenorm.train.checkpoint import (
    UnsafeCheckpoint,
    read_dcp,
    read_dcp_metadata,
    read_state,
    write_checksums,
)
from test_faults import TINY, _env, cli

REPO = Path(__file__).resolve().parents[1]
# Four steps, a checkpoint every two: the second save is the one a fault hits, the first stays.
FOUR = ["train.steps=4", "train.eval_every=4", "train.warmup=0", "data.max_bytes=40000",
        "train.checkpoint_every=2"]


def error_lines(res: subprocess.CompletedProcess) -> list[str]:
    """stderr without the progress log (every line of which starts with ``[train]``)."""
    return [line for line in res.stderr.strip().splitlines() if not line.startswith("[train]")]


def refused(res: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit status 2, one line (besides the progress log), no traceback, holding ``fragments``."""
    assert res.returncode == 2, res.stderr
    lines = error_lines(res)
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def main(capsys, *args: str) -> subprocess.CompletedProcess:
    """The command run in this process (``siamesenorm.cli.main``): quicker than :func:`cli` for
    what is refused before any work. With ``capfd`` for ``capsys``, what the ranks of a ``--nproc``
    command print (processes of their own) is captured with its own, as :func:`cli` would."""
    from siamesenorm import cli as cli_module

    capsys.readouterr()
    code = cli_module.main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out, err)


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder``, relative path -> SHA-256 (what "nothing was lost" compares)."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink()}


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").open())
            if "loss" in r}


# ---- runs the cases start from (built once) ------------------------------------------------------
@pytest.fixture(scope="module")
def single_run(tmp_path_factory) -> Path:
    """A finished single-process run of four steps: checkpoints/last (step 4) and step_2."""
    run = tmp_path_factory.mktemp("single") / "run"
    res = cli("train", "tiny", *FOUR, "train.keep_checkpoints=2", "--out", str(run))
    assert res.returncode == 0, res.stderr
    return run


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory) -> Path:
    """The same run across two processes of one thread (as the real-disk cases train it):
    sharded checkpoints (dcp/), last (step 4) and step_2. Launched from this process."""
    run = tmp_path_factory.mktemp("sharded") / "run"
    res = cli_in_process("train", "tiny", *FOUR, "train.keep_checkpoints=2", "--nproc", "2", "--out",
                         str(run), env={"OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr
    return run


def copy_run(run: Path, where: Path) -> Path:
    shutil.copytree(run, where, symlinks=True)
    return where


# ---- 1. loading a checkpoint never runs code ------------------------------------------------------
class Planted:
    """Unpickling this calls ``function(*args)``: what an attacker plants in a checkpoint."""

    def __init__(self, function, *args) -> None:
        self.function, self.args = function, args

    def __reduce__(self):
        return self.function, self.args


def plant_in_metadata(ckpt: Path, payload) -> None:
    """Put ``payload`` inside the DCP metadata of ``ckpt`` (where torch's unpickler would run it)
    and rewrite checksums.json to match, as someone who rewrites both files would."""
    file = ckpt / "dcp" / ".metadata"
    metadata = pickle.loads(file.read_bytes())          # our own file: trusted here
    metadata.planner_data["planted"] = payload
    file.write_bytes(pickle.dumps(metadata))
    rewrite_checksums(ckpt)


def rewrite_checksums(ckpt: Path) -> None:
    (ckpt / "checksums.json").unlink(missing_ok=True)
    write_checksums(ckpt)


READERS = {
    "train --resume": lambda run: ("train", "--resume", "--out", str(run)),
    "train --resume --nproc 2": lambda run: ("train", "--resume", "--nproc", "2", "--out", str(run)),
    "generate": lambda run: ("generate", str(run), "--prompt", "a", "--max-new-tokens", "2"),
    "export": lambda run: ("export", str(run), "--out", str(run.parent / "w.safetensors")),
    "export --format hf": lambda run: ("export", str(run), "--format", "hf", "--out", str(run.parent / "hf")),
    "analyze": lambda run: ("analyze", str(run), "--batches", "1", "--out", str(run.parent / "an")),
}


@pytest.mark.parametrize("reader", list(READERS))
def test_a_planted_reduce_in_dcp_metadata_is_refused_by_every_reader(tmp_path, sharded_run, reader, capfd,
                                                                       monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run = copy_run(sharded_run, tmp_path / "run")
    marker = tmp_path / "ran"
    plant_in_metadata(run / "checkpoints" / "last", Planted(os.system, f"touch {marker}"))
    before = snapshot(run)
    line = refused(main(capfd, *READERS[reader](run)), "refusing checkpoint file",
                   str(run / "checkpoints" / "last" / "dcp" / ".metadata"), "posix.system")
    assert "possibly to run code" in line
    assert not marker.exists()
    assert snapshot(run) == before          # no fallback, nothing moved aside
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]      # no output written


@pytest.mark.parametrize("reader", ["train --resume", "generate", "export"])
def test_a_planted_reduce_in_state_pt_is_refused_without_falling_back(tmp_path, single_run, reader):
    run = copy_run(single_run, tmp_path / "run")
    marker = tmp_path / "ran"
    ckpt = run / "checkpoints" / "last"
    state = torch.load(ckpt / "state.pt", weights_only=True)
    state["extra"]["run"]["planted"] = Planted(os.system, f"touch {marker}")
    torch.save(state, ckpt / "state.pt")
    rewrite_checksums(ckpt)
    before = snapshot(run)
    refused(cli(*READERS[reader](run)), "refusing checkpoint file", str(ckpt / "state.pt"),
            "posix.system")
    assert not marker.exists()
    assert snapshot(run) == before          # step_2 was not used instead, nothing moved aside


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")       # one process saves, as meant
def test_a_planted_value_in_a_sharded_checkpoints_data_is_refused(tmp_path, sharded_run):
    """A non-tensor value of the DCP files (an optimizer setting), which torch's own planner
    unpickles with weights_only=False: read with weights_only here."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    run = copy_run(sharded_run, tmp_path / "run")
    marker = tmp_path / "ran"
    ckpt = run / "checkpoints" / "last"
    dcp_to_torch_save(ckpt / "dcp", tmp_path / "whole.pt")            # our own files: trusted
    state = torch.load(tmp_path / "whole.pt", weights_only=False)
    state["optim"]["param_groups"][0]["lr"] = Planted(os.system, f"touch {marker}")
    shutil.rmtree(ckpt / "dcp")
    dcp.save(state, checkpoint_id=str(ckpt / "dcp"), no_dist=True)
    rewrite_checksums(ckpt)
    refused(cli("train", "--resume", "--out", str(run)), "refusing checkpoint file",
            str(ckpt / "dcp"), "posix.system")
    assert not marker.exists()


def _global_call(module: str, name: str, argument: str) -> bytes:
    """A protocol-0 pickle that imports ``module.name`` (GLOBAL) and calls it with ``argument``."""
    return f"c{module}\n{name}\n(V{argument}\ntR.".encode("raw_unicode_escape")


def _forbidden_names() -> list[tuple[str, str]]:
    """Names a pickle could import that DCP metadata never holds: everything callable in modules an
    attacker would reach for, every torch attribute that is not a dtype or layout, and whatever
    else the modules of the allowed classes import or define."""
    import builtins
    import functools
    import importlib
    import operator
    import pathlib
    import subprocess as sp

    from torch.distributed.checkpoint import filesystem, metadata

    allowed = {("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")}
    allowed |= {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
                ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}
    allowed |= {("pathlib", n) for n in ("Path", "PosixPath", "PurePosixPath", "WindowsPath",
                                         "PureWindowsPath")}
    names = []
    for module in (builtins, os, sp, shutil, importlib, pickle, functools, operator, sys, torch,
                   metadata, filesystem, pathlib, torch.serialization):
        for name in dir(module):
            value = getattr(module, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                continue
            key = (module.__name__, name)
            if key not in allowed and (callable(value) or module in (metadata, filesystem)):
                names.append(key)
    names += [("pathlib", "Path.write_text"), ("torch", "Size.__new__"), ("posix", "system"),
              ("nt", "system"), ("torch.distributed.checkpoint.metadata", "Metadata.__setstate__")]
    return names


def test_every_name_outside_the_allow_list_is_refused_before_it_is_called(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "ran"
    names = _forbidden_names()
    assert len(names) > 1000
    file = tmp_path / ".metadata"
    for module, name in names:
        file.write_bytes(_global_call(module, name, f"touch {marker}"))
        with pytest.raises(UnsafeCheckpoint) as error:
            read_dcp_metadata(file)
        assert f"it names {module}.{name}," in str(error.value)
        assert "\n" not in str(error.value)
    # STACK_GLOBAL (protocols 4 and 5) as well as GLOBAL, nested inside real metadata or alone
    for protocol in (2, 4, 5):
        file.write_bytes(pickle.dumps([1, {"x": Planted(os.system, f"touch {marker}")}], protocol=protocol))
        with pytest.raises(UnsafeCheckpoint, match="posix.system"):
            read_dcp_metadata(file)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".metadata"]     # nothing ran


def _plain_objects(value):
    """``value`` (metadata read back) as plain data, to compare two readings."""
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return {k: _plain_objects(v) for k, v in vars(value).items() if k != "storage_meta"}
    if isinstance(value, dict):
        return {repr(_plain_objects(k)): _plain_objects(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_objects(v) for v in value]
    return repr(value)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_real_metadata_of_ours_and_of_olmo_core_style_checkpoints_reads_as_torch_reads_it(
        tmp_path, monkeypatch, sharded_run):
    """The allow-list is exactly wide enough: our sharded checkpoints (both of them) and one whose
    storage record is OLMo-core's class read as pickle reads them, and load."""
    from torch.distributed import checkpoint as dcp

    for ckpt in ("last", "step_2"):
        file = sharded_run / "checkpoints" / ckpt / "dcp" / ".metadata"
        trusted = pickle.loads(file.read_bytes())
        assert _plain_objects(read_dcp_metadata(file.parent)) == _plain_objects(trusted)
    # OLMo-core writes its own _StorageInfo (relative_path, offset, length), bfloat16 weights
    folder = tmp_path / "olmo"
    dcp.save({"model": {"w": torch.arange(6.0).reshape(2, 3).bfloat16(), "b": torch.ones(3)},
              "optim": {"param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95)}]}},
             checkpoint_id=str(folder), no_dist=True)
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    import dataclasses
    import types

    fake = types.ModuleType("olmo_core.distributed.checkpoint.filesystem")

    @dataclasses.dataclass
    class _StorageInfo:
        relative_path: str
        offset: int
        length: int

    _StorageInfo.__module__, _StorageInfo.__qualname__ = fake.__name__, "_StorageInfo"
    fake._StorageInfo = _StorageInfo
    with monkeypatch.context() as patch:        # an installed OLMo-core is put back after
        for name in ("olmo_core", "olmo_core.distributed", "olmo_core.distributed.checkpoint"):
            patch.setitem(sys.modules, name, types.ModuleType(name))
        patch.setitem(sys.modules, fake.__name__, fake)
        metadata.storage_data = {k: _StorageInfo(v.relative_path, v.offset, v.length)
                                 for k, v in metadata.storage_data.items()}
        data = pickle.dumps(metadata)
    assert b"olmo_core.distributed.checkpoint.filesystem" in data
    (folder / ".metadata").write_bytes(data)
    read = read_dcp_metadata(folder)
    assert {type(v).__module__ for v in read.storage_data.values()} == \
        {"torch.distributed.checkpoint.filesystem"}
    state = {"model": {"w": torch.zeros(2, 3, dtype=torch.bfloat16), "b": torch.zeros(3)},
             "optim": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0)}]}}
    read_dcp(folder, state)
    assert torch.equal(state["model"]["w"], torch.arange(6.0).reshape(2, 3).bfloat16())
    assert state["optim"]["param_groups"][0] == {"lr": 1e-3, "betas": (0.9, 0.95)}


def test_a_checkpoint_written_by_olmo_core_itself_reads(tmp_path):
    """OLMo-core's own writer (where it is installed): its metadata passes the allow-list and
    its model and optimizer load."""
    checkpoint = pytest.importorskip("olmo_core.distributed.checkpoint")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4, dtype=torch.bfloat16)).sum().backward()
    optimizer.step()
    checkpoint.save_model_and_optim_state(str(tmp_path / "model_and_optim"), model, optimizer)
    metadata = read_dcp_metadata(tmp_path / "model_and_optim")
    assert {"model.0.weight", "optim.param_groups.0.lr"} <= set(metadata.state_dict_metadata)
    state = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()},
             "optim": {"param_groups": [{"lr": 0.0}]}}
    read_dcp(tmp_path / "model_and_optim", state)
    assert all(torch.equal(state["model"][k], v) for k, v in model.state_dict().items())
    assert state["optim"]["param_groups"][0]["lr"] == 1e-3


@pytest.mark.parametrize("rel", ["../../etc/passwd", "/etc/passwd", "..", "sub/__0_0.distcp", ""])
def test_dcp_metadata_naming_a_data_file_outside_its_folder_is_refused(tmp_path, sharded_run, rel):
    folder = copy_run(sharded_run / "checkpoints" / "last" / "dcp", tmp_path / "dcp")
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    first = next(iter(metadata.storage_data))
    metadata.storage_data[first].relative_path = rel
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(ConfigError, match=r"outside the checkpoint's folder\); the file is damaged$"):
        read_dcp_metadata(folder)


@pytest.mark.parametrize("function", [os.system, exec, eval, getattr, subprocess.call, shutil.rmtree,
                                      __import__, open, pickle.loads, torch.load])
def test_state_pt_naming_any_callable_is_refused_unexecuted(tmp_path, function):
    import functools

    marker = tmp_path / "ran"
    payloads = {os.system: (f"touch {marker}",), exec: (f"open({str(marker)!r}, 'w')",),
                eval: (f"open({str(marker)!r}, 'w')",), getattr: ("text", "upper"),
                subprocess.call: (["touch", str(marker)],), shutil.rmtree: (str(tmp_path / "x"),),
                __import__: ("os",), open: (str(marker), "w"), pickle.loads: (b"N.",),
                torch.load: (str(marker),)}
    for value in (Planted(function, *payloads[function]),
                  Planted(functools.partial, function, *payloads[function])):
        torch.save({"format": 1, "optimizer": {}, "extra": {"run": value}}, tmp_path / "state.pt")
        with pytest.raises(UnsafeCheckpoint, match="^refusing checkpoint file .*state.pt: it names "):
            read_state(tmp_path / "state.pt")
    assert not marker.exists()


def test_no_source_file_loads_pickles_yaml_or_code_unsafely():
    """What docs/security.md lists, held: every torch.load is weights_only=True, numpy never
    unpickles, YAML is read safely, nothing unpickles with the plain unpickler (a subclass must
    restrict find_class), and there is no eval, exec, shell=True, os.system or trust_remote_code
    call in the package (the exported modelling file's exec is text it writes, not a call)."""
    import ast

    # compare's workers read the data their own compare pickled into the folder made for them
    # (mode 0700), never a file a user names (docs/security.md)
    handed_over = {"src/siamesenorm/tasks/worker.py pickle.load"}
    problems = []
    for file in sorted((REPO / "src" / "siamesenorm").rglob("*.py")):
        tree = ast.parse(file.read_text(encoding="utf-8"))
        where = file.relative_to(REPO).as_posix()
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(ast.unparse(b).endswith("Unpickler")
                                                      for b in node.bases):
                if not any(isinstance(f, ast.FunctionDef) and f.name == "find_class" for f in node.body):
                    problems.append(f"{where}:{node.lineno} an Unpickler without find_class")
            if not isinstance(node, ast.Call):
                continue
            func = ast.unparse(node.func)
            keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
            line = f"{where}:{node.lineno} {func}"
            if func == "torch.load" and keywords.get("weights_only") != "True":
                problems.append(f"{line} without weights_only=True")
            if func in ("np.load", "numpy.load") and keywords.get("allow_pickle") != "False":
                problems.append(f"{line} without allow_pickle=False")
            if func in ("pickle.load", "pickle.loads", "pickle.Unpickler", "yaml.load", "yaml.load_all",
                        "yaml.unsafe_load", "yaml.full_load", "eval", "exec", "os.system", "os.popen",
                        "marshal.loads", "shelve.open") and f"{where} {func}" not in handed_over:
                problems.append(line)
            if keywords.get("shell") == "True" or keywords.get("trust_remote_code") == "True":
                problems.append(f"{line} with shell=True or trust_remote_code=True")
    assert problems == []


# ---- 1b. writes that escape the run folder, files that are not ours ------------------------------
def _plant(path: Path, kind: str, victim: Path) -> None:
    if kind == "symlink":
        path.symlink_to(victim)
    elif kind == "dangling symlink":
        path.symlink_to(victim.with_name("created-through-the-link"))
    elif kind == "folder":
        path.mkdir()
    else:
        os.mkfifo(path)


@pytest.mark.parametrize("kind", ["symlink", "dangling symlink", "folder", "fifo"])
def test_a_lock_file_that_is_not_a_regular_file_is_refused_and_not_written_through(tmp_path, kind):
    folder = tmp_path / "run"
    folder.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    _plant(folder / LOCK_NAME, kind, victim)
    with pytest.raises(ConfigError, match=f"^{folder / LOCK_NAME} is not a regular file"):
        with folder_lock(folder, "train"):
            pass
    assert victim.read_text() == "precious\n"
    assert not (tmp_path / "created-through-the-link").exists()


def test_the_lock_symlink_of_the_issue_is_refused_in_one_line(tmp_path, capsys, single_run):
    run = copy_run(single_run, tmp_path / "r")
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (run / LOCK_NAME).symlink_to(victim)
    refused(main(capsys, "train", "--resume", "--out", str(run)), "is not a regular file")
    refused(main(capsys, "train", "tiny", *TINY, "--out", str(run)), "is not a regular file")
    assert victim.read_text() == "precious\n"


def _writers():
    return {
        "write_text": lambda p: write_text(p, "ours\n"),
        "write_json": lambda p: write_json(p, {"ours": 1}),
        "open_jsonl": lambda p: open_jsonl(p).close(),
        "replacing": lambda p: _replace(p),
    }


def _replace(path: Path) -> None:
    with replacing(path) as tmp:
        tmp.write_text("ours\n")


@pytest.mark.parametrize("writer", list(_writers()))
@pytest.mark.parametrize("where", ["the file", "its temporary file"])
def test_no_writer_follows_a_symlink_planted_under_a_name_it_writes(tmp_path, writer, where):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    target = tmp_path / "summary.json"
    if where == "the file":
        target.symlink_to(victim)
    else:           # the name a writer of this process would pick for its temporary file
        (tmp_path / f".{target.name}.tmp-{os.getpid()}").symlink_to(victim)
    _writers()[writer](target)
    assert victim.read_text() == "precious\n"
    assert target.is_file() and not target.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != f".{target.name}.tmp-{os.getpid()}") \
        == ["summary.json", "victim"]


def test_a_resumed_run_and_its_analysis_write_through_no_planted_link(tmp_path, capsys, single_run):
    run = copy_run(single_run, tmp_path / "run")
    victims = {}
    for name in ("metrics.jsonl", "summary.json", "analysis.json", "analysis/hidden_rms.png"):
        victim = tmp_path / ("victim-" + name.replace("/", "-"))
        source = run / name
        victim.write_bytes(source.read_bytes() if source.exists() else b"precious\n")
        victims[victim] = victim.read_bytes()
        source.parent.mkdir(exist_ok=True)
        source.unlink(missing_ok=True)
        source.symlink_to(victim)
    assert main(capsys, "train", "--resume", "--out", str(run)).returncode == 0
    res = main(capsys, "analyze", str(run), "--batches", "1")
    assert res.returncode == 0, res.stderr
    assert {v: v.read_bytes() for v in victims} == victims
    assert not any(p.is_symlink() for p in run.rglob("*"))


@pytest.mark.parametrize("folder", ["tb", "analysis"])
def test_a_linked_folder_inside_a_run_is_refused_and_nothing_is_written_outside(tmp_path, capsys,
                                                                                single_run, folder):
    """``tb -> outside/`` (a resumed run's events) and ``analysis -> outside/`` (the plots): one
    line naming the link, nothing written through it."""
    run = copy_run(single_run, tmp_path / "run")
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.rmtree(run / folder, ignore_errors=True)
    (run / folder).symlink_to(outside, target_is_directory=True)
    (run / "summary.json").unlink()         # a run to resume, not a finished one
    command = ("train", "--resume", "--out", str(run)) if folder == "tb" else \
        ("analyze", str(run), "--batches", "1")
    metrics = (run / "metrics.jsonl").read_bytes()
    refused(main(capsys, *command), f"{run / folder} is a link", "remove the link")
    assert list(outside.iterdir()) == [] and (run / "metrics.jsonl").read_bytes() == metrics


def test_what_a_run_writes_is_readable_as_the_umask_allows(tmp_path, capsys, single_run):
    """Plots, checkpoints and exported weights came out owner-only (mkstemp's 0600, mkdtemp's
    0700) among 0644 files: a shared results folder was unreadable to colleagues."""
    old = os.umask(0o022)
    try:
        run = copy_run(single_run, tmp_path / "run")        # copies keep their modes
        assert main(capsys, "analyze", str(run), "--batches", "1").returncode == 0
        weights = tmp_path / "model.safetensors"
        assert main(capsys, "export", str(run), "--out", str(weights)).returncode == 0
    finally:
        os.umask(old)
    modes = {p.relative_to(tmp_path).as_posix(): oct(p.stat().st_mode & 0o777)
             for p in [run, *run.rglob("*"), weights] if p.name != LOCK_NAME}
    assert any(name.endswith(".png") for name in modes) and "run/checkpoints/last" in modes
    assert {n: m for n, m in modes.items()
            if m != (oct(0o755) if (tmp_path / n).is_dir() else oct(0o644))} == {}


def test_a_folder_with_a_config_yaml_that_is_not_a_run_is_never_cleaned(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "p"
    (folder / "analysis").mkdir(parents=True)
    (folder / "config.yaml").write_text("x\n")
    (folder / "analysis" / "nb.ipynb").write_text("nb\n")
    before = snapshot(folder)
    refused(main(capsys, "train", "tiny", *TINY, "--out", str(folder)), str(folder), "no run of siamesenorm")
    assert snapshot(folder) == before and not (folder / LOCK_NAME).exists()
    # the user's own preset, trained from inside its folder into the folder itself
    exp = tmp_path / "exp"
    exp.mkdir()
    preset = (REPO / "src" / "siamesenorm" / "configs" / "tiny.yaml").read_text()
    (exp / "config.yaml").write_text(preset)
    monkeypatch.chdir(exp)
    refused(main(capsys, "train", "config.yaml", *TINY, "--out", "."), "no run of siamesenorm")
    assert sorted(p.name for p in exp.iterdir()) == ["config.yaml"]
    assert (exp / "config.yaml").read_text() == preset


def test_a_marked_run_stopped_before_its_first_checkpoint_loses_only_the_files_it_wrote(tmp_path, capsys):
    """A run of ours killed before its first checkpoint is started again by ``train``; what it
    wrote goes, a user's files put beside and inside its folders stay."""
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.mark()
    ours = [run.config, run.metrics, run.tensorboard / "events.out.tfevents.1.host.2.0",
            run.tokenizer / "tokenizer_kind.json", run.plots / "hidden_rms.png",
            run.checkpoints / ".last.tmp-abc" / "model.safetensors", run.path / ".metrics.jsonl.tmp-99"]
    users = [run.path / "notes.txt", run.plots / "nb.ipynb", run.tensorboard / "mine.txt",
             run.checkpoints / "README"]
    for file in ours + users:
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text("x\n")
    assert run.stopped_before_first_checkpoint()
    res = main(capsys, "train", "tiny", *TINY, "--out", str(run))
    assert res.returncode == 0, res.stderr
    assert all(f.read_text() == "x\n" for f in users)
    assert not (run.tensorboard / "events.out.tfevents.1.host.2.0").exists()
    assert not (run.checkpoints / ".last.tmp-abc").exists()
    assert not (run.path / ".metrics.jsonl.tmp-99").exists()
    assert sorted(losses(run.path)) == [1, 2] and run.marked()
    # unmarked, the same folder is never cleaned
    run.marker.unlink()
    shutil.rmtree(run.checkpoints)
    run.summary.unlink()
    before = snapshot(run.path)
    with pytest.raises(ConfigError, match="was not created by siamesenorm"):
        run.clear_run_files()
    refused(main(capsys, "train", "tiny", *TINY, "--out", str(run)), str(run))
    assert snapshot(run.path) == before


@pytest.mark.parametrize("out", ["/", "repository", "experiment"])
def test_train_refuses_the_root_the_repository_and_an_experiment_folder(tmp_path, capsys, out):
    if out == "experiment":
        folder = tmp_path / "exp"
        (folder / "pre-lr0.001-s0").mkdir(parents=True)
        (folder / "experiment.json").write_text("{}\n")
        (folder / "summary.json").write_text('{"runs": []}\n')
    else:
        folder = Path("/") if out == "/" else REPO
    before = {p.name for p in folder.iterdir()}
    summary = (folder / "summary.json").read_bytes() if out == "experiment" else None
    line = refused(main(capsys, "train", "tiny", *TINY, "--out", str(folder)), str(folder))
    assert ("compare experiment" in line) if out == "experiment" else ("no run of siamesenorm" in line)
    if out == "/":
        assert "the root folder" in line
    assert {p.name for p in folder.iterdir()} == before          # not even a lock file
    if summary is not None:
        assert (folder / "summary.json").read_bytes() == summary


@pytest.mark.parametrize("where", ["checkpoints", "the run", "inside checkpoints", "above the run"])
def test_export_hf_force_into_or_above_the_run_is_refused(tmp_path, capsys, single_run, where):
    run = copy_run(single_run, tmp_path / "box" / "r")
    out = {"checkpoints": run / "checkpoints", "the run": run, "above the run": run.parent,
           "inside checkpoints": run / "checkpoints" / "hf"}[where]
    before = snapshot(tmp_path)
    refused(main(capsys, "export", str(run), "--format", "hf", "--force", "--out", str(out)), f"--out {out}")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("label", ["../../x", "/tmp/siamesenorm-abs", "a\nb", "", "  ", ".", "..", "a\\b",
                                   "tab\there", "bell\x07"])
def test_a_compare_variant_label_that_is_not_a_name_is_refused(tmp_path, capsys, label):
    preset = tmp_path / "preset.yaml"
    base = (REPO / "src" / "siamesenorm" / "configs" / "tiny.yaml").read_text()
    preset.write_text(base + "compare:\n  schemes: " + json.dumps([label]) + "\n  variants:\n    "
                      + json.dumps(label) + ": {scheme: pre}\n")
    out = tmp_path / "box" / "exp"
    refused(main(capsys, "compare", str(preset), *TINY, "--out", str(out)), "compare.variants: the label")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["preset.yaml"]
    assert not Path("/tmp/siamesenorm-abs-lr0.001-s0").exists()


def test_resume_refuses_changed_data_or_keeps_both_records(tmp_path, capfd):
    corpus = tmp_path / "corpus.txt"
    text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(800))
    corpus.write_text(text)
    run = tmp_path / "run"
    data = [f"data.corpus={corpus}", "train.steps=2", "train.eval_every=2", "train.warmup=0"]
    assert main(capfd, "train", "tiny", *data, "--out", str(run)).returncode == 0
    recorded = json.loads((run / MARKER_NAME).read_text())["data"]
    assert recorded == json.loads((run / "summary.json").read_text())["data"]
    assert main(capfd, "train", "--resume", "--out", str(run)).returncode == 0      # the same data
    corpus.write_text(text.replace("lazy", "idle"))          # as many bytes: the digest tells
    before = snapshot(run)
    refused(main(capfd, "train", "--resume", "--out", str(run)), f"cannot resume {run}: its data changed",
            "data.fingerprint.sha256 was", "--allow-data-change")
    refused(main(capfd, "train", "--resume", "--nproc", "2", "--out", str(run)), "its data changed")
    assert snapshot(run) == before
    refused(main(capfd, "train", "tiny", *data, "--allow-data-change", "--out", str(tmp_path / "new")),
            "--allow-data-change goes with --resume")
    res = main(capfd, "train", "--resume", "--allow-data-change", "--out", str(run))
    assert res.returncode == 0, res.stderr
    warning = [line for line in error_lines(res) if line.startswith("warning:")]
    assert len(warning) == 1 and "the data changed since the run started" in warning[0]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["data"] != recorded and [h["data"] for h in summary["data_history"]] == [recorded]
    assert json.loads((run / MARKER_NAME).read_text())["data"] == summary["data"]
    assert main(capfd, "train", "--resume", "--out", str(run)).returncode == 0   # the new data is the run's


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_damaged_sharded_checkpoint_without_checksums_falls_back(tmp_path, sharded_run, nproc, capfd,
                                                                   monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")       # as sharded_run was trained
    run = copy_run(sharded_run, tmp_path / "run")
    want = losses(run)
    last = run / "checkpoints" / "last"
    (last / "checksums.json").unlink()
    shard = last / "dcp" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    res = main(capfd, "train", "--resume", "--nproc", "2", "--out", str(run)) if nproc == 2 else \
        cli("train", "--resume", "--out", str(run))
    assert res.returncode == 0, res.stderr
    lines = error_lines(res)
    assert len(lines) == 1 and lines[0].startswith("warning: cannot read checkpoint "), res.stderr
    assert f"resuming from {run / 'checkpoints' / 'step_2'} instead" in lines[0]
    if nproc == 2:
        assert losses(run) == want              # steps 3 and 4 again, exactly as the first time


def test_a_ranks_python_error_is_reported_as_that_error(tmp_path):
    """Rank 0 fails with a Python error; rank 1, stopped by the launcher's SIGTERM, exits 143
    through its handler without a report: the error is rank 0's, not "killed from outside"."""
    from siamesenorm.errors import RankFailed
    from siamesenorm.parallel.launch import launch

    script = tmp_path / "worker.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "from siamesenorm.parallel.launch import report_failure\n"
        "if os.environ['RANK'] == '0':\n"
        "    time.sleep(1)\n"
        "    try:\n        raise ValueError('the planted failure')\n"
        "    except ValueError as error:\n        report_failure(error, user_error=False)\n"
        "    sys.exit(1)\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))\n"
        "time.sleep(120)\n")
    with pytest.raises(RankFailed, match=r"^rank 0 of the run failed: ValueError: the planted failure"):
        launch(2, [str(script)])


# ---- 3. a full disk --------------------------------------------------------------------------------
# What safetensors' serializer raises on a full disk (its Rust I/O error, as text).
FULL_SAFETENSORS = "Error while serializing: I/O error: No space left on device (os error 28)"


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture(scope="module")
def reference(single_run) -> Path:
    """FOUR, uninterrupted: the losses a resumed run must repeat, and the sizes the real-disk cases
    size their disk by (its last checkpoint, and what lies outside checkpoints/: the step_2 that
    it also keeps counts in neither). ``single_run``, read only."""
    return single_run


def _second_save_fails(monkeypatch, writer: str) -> None:
    """Make ``writer`` fail as a full disk makes it, at the second checkpoint (step 4)."""
    from safetensors import SafetensorError

    # the module whose save_checkpoint calls save_file
    from siamesenorm.train.checkpoint import save as checkpoint

    calls = {"n": 0}
    if writer == "safetensors":
        real = checkpoint.save_file

        def save_file(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 2:
                raise SafetensorError(FULL_SAFETENSORS)
            return real(*args, **kwargs)

        monkeypatch.setattr(checkpoint, "save_file", save_file)
    else:
        real = torch.save

        def save(obj, f, *args, **kwargs):
            if "state.pt" in str(getattr(f, "name", f)):
                calls["n"] += 1
                if calls["n"] == 2:
                    try:
                        _enospc()
                    except OSError as error:     # as torch raises it: its own error on top
                        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected "
                                           "pos 704 vs 598") from error
            return real(obj, f, *args, **kwargs)

        monkeypatch.setattr(torch, "save", save)


@pytest.mark.parametrize("writer", ["safetensors", "torch.save"])
def test_a_library_writer_on_a_full_disk_is_one_line_and_the_run_resumes(tmp_path, monkeypatch, capsys,
                                                                         reference, writer):
    from siamesenorm import cli as cli_module
    from siamesenorm.train.checkpoint import checkpoint_extra, verify_checksums

    _second_save_fails(monkeypatch, writer)
    run = tmp_path / "run"
    assert cli_module.main(["train", "tiny", *FOUR, "train.keep_checkpoints=1", "--out", str(run)]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("[train]")]
    assert err == [f"siamesenorm train: error: No space left on device: {run / 'checkpoints' / 'last'}"]
    monkeypatch.undo()
    last = run / "checkpoints" / "last"
    verify_checksums(last)
    assert checkpoint_extra(last)["run"]["step"] == 2                 # the previous one, whole
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last"]   # no half-written one
    res = cli("train", "--resume", "--out", str(run))
    assert res.returncode == 0, res.stderr
    assert losses(run) == losses(reference)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_dcp_writer_on_a_full_disk_is_the_oserror(tmp_path, monkeypatch):
    """torch.distributed.checkpoint wraps its writer's OSError (every rank's) in a
    CheckpointException, which is not an Exception: the save finds the OSError behind it."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from siamesenorm.rundir import library_os_error
    from siamesenorm.train.checkpoint import _write_dcp

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    monkeypatch.setattr(FileSystemWriter, "write_data", _enospc)
    with pytest.raises(BaseException) as caught:
        _write_dcp(tmp_path / "dcp", model, optimizer)
    assert not isinstance(caught.value, Exception)          # a CheckpointException
    found = library_os_error(caught.value, tmp_path / "last")
    assert (found.errno, found.filename) == (errno.ENOSPC, str(tmp_path / "last"))
    assert library_os_error(KeyboardInterrupt(), tmp_path) is None
    assert library_os_error(RuntimeError("a bug"), tmp_path) is None


class _NearlyFullDisk(io.FileIO):
    """A file on a disk with ``room`` bytes left (None: no limit): a short write, then ENOSPC, as
    the kernel does; ``written`` counts the bytes."""

    room: int | None = None
    written = 0

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        if _NearlyFullDisk.room is not None:
            if _NearlyFullDisk.room == 0:
                _enospc()
            data = data[:_NearlyFullDisk.room]
            _NearlyFullDisk.room -= len(data)
        _NearlyFullDisk.written += len(data)
        return super().write(data)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_full_disk_in_the_dcp_writer_reaches_the_other_ranks_as_the_oserror(tmp_path, monkeypatch):
    """DCP hands a rank's failure to every rank pickled, which drops an exception's context and
    cause, and torch.save into a stream that fills midway raises a RuntimeError whose context alone
    holds the OSError. Which rank fills the disk, and at which byte, is timing: at every byte the
    disk may fill at, each rank's copy of the failure (here one pickled and read back) is still
    the full disk."""
    from contextlib import contextmanager

    from torch.distributed.checkpoint.filesystem import FileSystem

    from siamesenorm.rundir import library_os_error
    from siamesenorm.train.checkpoint import _write_dcp

    @contextmanager
    def create_stream(self, path, mode):
        with io.BufferedWriter(_NearlyFullDisk(path, mode.replace("b", ""))) as stream:
            yield stream

    monkeypatch.setattr(FileSystem, "create_stream", create_stream)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(64)).sum().backward()
    optimizer.step()
    _write_dcp(tmp_path / "whole", model, optimizer)       # how much a save writes
    total = _NearlyFullDisk.written
    torn = []
    for room in range(0, total, max(1, total // 40)):
        monkeypatch.setattr(_NearlyFullDisk, "room", room)
        with pytest.raises(BaseException) as caught:
            _write_dcp(tmp_path / f"room{room}", model, optimizer)
        assert _NearlyFullDisk.room == 0, room                # it failed as the disk filled
        for seen in (caught.value, pickle.loads(pickle.dumps(caught.value))):   # its rank's, another's
            found = library_os_error(seen, tmp_path / "last")
            assert found is not None, (room, seen)
            assert (found.errno, found.filename) == (errno.ENOSPC, str(tmp_path / "last")), room
        failure = caught.value.failures[0][0]                 # this rank's, as its writer raised it
        torn += [room] if isinstance(failure, RuntimeError) or isinstance(failure.__cause__, RuntimeError) \
            else []
    assert torn, "no room made torch.save fail midway: the case this test is for was not reached"


@pytest.mark.parametrize("fmt", ["safetensors", "hf"])
def test_an_export_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys,
                                                                 single_run, fmt):
    from safetensors import SafetensorError

    from siamesenorm import cli as cli_module
    from siamesenorm.hf import export as hf_export

    def full(*args, **kwargs):
        raise SafetensorError(FULL_SAFETENSORS)

    import safetensors.torch

    monkeypatch.setattr(safetensors.torch if fmt == "safetensors" else hf_export,
                        "save_file" if fmt == "safetensors" else "_write_folder", full)
    out = tmp_path / ("w.safetensors" if fmt == "safetensors" else "hf")
    assert cli_module.main(["export", str(single_run), "--format", fmt, "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"siamesenorm export: error: No space left on device: {out}"]
    assert list(tmp_path.iterdir()) == []


# ---- 3. a real full disk: a small tmpfs in a private mount namespace --------------------------------
# Each ``run`` step is ``siamesenorm ARGS`` in a process of its own, forked from the driver once it
# has imported torch, the package and the plan's "imports" (tests/forked.py: a command would import
# them first; a full disk meets the command, not its imports).
_DRIVER = r'''
import json, os, shutil, subprocess, sys
plan = json.load(open(sys.argv[1]))
sys.path.insert(0, plan["tests"])
import forked
forked.preload(plan["imports"])
results = {}
for step in plan["steps"]:
    if step[0] == "mount":
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={step[2]}", "tmpfs", step[1]], check=True)
    elif step[0] == "remount":
        subprocess.run(["mount", "-o", f"remount,size={step[2]}", step[1]], check=True)
    elif step[0] == "run":
        out, err = plan["results"] + ".out", plan["results"] + ".err"
        code = forked.command(step[2], out, err)
        results[step[1]] = {"returncode": code, "stderr": open(err).read(), "stdout": open(out).read()}
    elif step[0] == "list":
        results[step[1]] = sorted(os.path.relpath(os.path.join(d, f), step[2])
                                  for d, _, files in os.walk(step[2]) for f in files)
    elif step[0] == "copy":
        shutil.copytree(step[1], step[2], symlinks=True)
json.dump(results, open(plan["results"], "w"))
'''


def _mounts_work() -> bool:
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return False
    probe = Path(os.environ.get("TMPDIR", "/tmp")) / f"siamesenorm-mount-probe-{os.getpid()}"
    probe.mkdir(exist_ok=True)
    try:
        res = subprocess.run(["unshare", "-rm", "mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs",
                              str(probe)], capture_output=True, timeout=30)
        return res.returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        probe.rmdir()


needs_mount = pytest.mark.skipif(not _mounts_work(), reason="cannot mount a tmpfs here (unshare -rm)")


def in_small_disk(tmp_path: Path, steps: list, imports: tuple[str, ...] = ()) -> dict:
    """Run ``steps`` (mount, remount, run, list, copy) in a private mount namespace; returns what
    each ``run`` and ``list`` step gave. ``imports``: modules the commands import, beside torch
    and the training (imported once, before the first)."""
    plan = tmp_path / "plan.json"
    results = tmp_path / "results.json"
    plan.write_text(json.dumps({"steps": steps, "results": str(results), "imports": list(imports),
                                "tests": str(Path(__file__).parent)}))
    res = subprocess.run(["unshare", "-rm", sys.executable, "-c", _DRIVER, str(plan)], capture_output=True,
                         text=True, env=_env(), timeout=900)
    assert res.returncode == 0, res.stderr
    return json.loads(results.read_text())


def _pages(nbytes: int) -> int:
    return -(-nbytes // 4096) * 4096


def _usage(folder: Path) -> int:
    """What ``folder``'s files take on a tmpfs (whole pages)."""
    return sum(_pages(p.stat().st_size) for p in folder.rglob("*") if p.is_file())


def _completed(res: dict) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess([], res["returncode"], res["stdout"], res["stderr"])


@needs_mount
@pytest.mark.parametrize("writer", ["safetensors", "torch.save", "dcp"])
def test_a_real_full_disk_during_a_checkpoint_save(tmp_path, reference, sharded_run, writer):
    """The second save does not fit: the previous checkpoint stays loadable, and with space freed
    the run resumes and ends as the uninterrupted one."""
    nproc = ["--nproc", "2"] if writer == "dcp" else []
    sizes = sharded_run if writer == "dcp" else reference
    last = sizes / "checkpoints" / "last"
    checkpoint = _usage(last)
    rest = _usage(sizes) - _usage(sizes / "checkpoints")
    if writer == "dcp":         # room for half of the second checkpoint
        failing = checkpoint // 2
    else:                       # room for half of the failing file (after the model, for state.pt)
        model, state = (_pages((last / name).stat().st_size) for name in ("model.safetensors", "state.pt"))
        failing = model // 2 if writer == "safetensors" else model + state // 2
    size = rest + checkpoint + failing + 8 * 4096
    disk = tmp_path / "disk"
    disk.mkdir()
    run = disk / "run"
    out = in_small_disk(tmp_path, [
        ["mount", str(disk), str(size)],
        ["run", "train", ["train", "tiny", *FOUR, "train.keep_checkpoints=1", *nproc, "--out", str(run)]],
        ["list", "files", str(run)],
        ["run", "generate", ["generate", str(run), "--prompt", "a", "--max-new-tokens", "2"]],
        ["remount", str(disk), "64m"],
        ["run", "resume", ["train", "--resume", *nproc, "--out", str(run)]],
        ["copy", str(run), str(tmp_path / "after")]])
    refused(_completed(out["train"]), f"No space left on device: {run / 'checkpoints' / 'last'}")
    ckpt = ["model.safetensors", "state.pt"] if not nproc else \
        sorted(f"dcp/{p.name}" for p in (last / "dcp").iterdir()) + ["state.pt"]
    assert sorted(f[len("checkpoints/last/"):] for f in out["files"] if f.startswith("checkpoints/")) \
        == sorted([*ckpt, "checksums.json"])               # the step-2 checkpoint, nothing half-written
    assert out["generate"]["returncode"] == 0, out["generate"]["stderr"]
    assert out["resume"]["returncode"] == 0, out["resume"]["stderr"]
    assert losses(tmp_path / "after") == losses(sizes)


@needs_mount
@pytest.mark.parametrize("fmt", ["safetensors", "hf"])
def test_a_real_full_disk_during_an_export(tmp_path, single_run, fmt):
    disk = tmp_path / "disk"
    disk.mkdir()
    out = disk / ("w.safetensors" if fmt == "safetensors" else "hf")
    model = (single_run / "checkpoints" / "last" / "model.safetensors").stat().st_size
    args = ["export", str(single_run), "--format", fmt, "--out", str(out)]
    got = in_small_disk(tmp_path, [["mount", str(disk), str(_pages(model // 2))],
                                   ["run", "full", args], ["list", "left", str(disk)],
                                   ["remount", str(disk), "64m"], ["run", "freed", args],
                                   ["list", "written", str(disk)]],
                        imports=("siamesenorm.hf.export",) if fmt == "hf" else ())
    refused(_completed(got["full"]), f"No space left on device: {out}")
    assert got["left"] == []                                 # no partial file, no temporary one
    assert got["freed"]["returncode"] == 0, got["freed"]["stderr"]
    assert got["written"]


@needs_mount
def test_a_real_full_disk_at_the_start_of_a_run(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    run = disk / "run"
    args = ["train", "tiny", *TINY, "--out", str(run)]
    got = in_small_disk(tmp_path, [["mount", str(disk), "8192"], ["run", "full", args],
                                   ["remount", str(disk), "64m"], ["run", "freed", args]])
    refused(_completed(got["full"]), "No space left on device", str(run))
    assert got["freed"]["returncode"] == 0, got["freed"]["stderr"]
