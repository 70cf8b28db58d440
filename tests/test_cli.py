"""The ``siamesenorm`` command: help, the scheme table, the demo, and one-line errors (exit 2)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import siamesenorm as sn
from helpers import cli_in_process

SRC = str(Path(__file__).resolve().parents[1] / "src")


def run_process(*args: str) -> subprocess.CompletedProcess:
    """``python -m siamesenorm ARGS`` in a process of its own."""
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "siamesenorm", *args], capture_output=True,
                          text=True, env=env, timeout=300)


# Every other test runs the command in this process: what a process adds (its exit status, its
# output streams) is checked here once.
run = cli_in_process


def test_help_lists_the_subcommands():
    out = run_process("--help")
    assert out.returncode == 0
    assert "schemes" in out.stdout and "demo" in out.stdout and "olmo-core" in out.stdout


def _arguments(parser=None, command: str = "siamesenorm"):
    """``(command, action)`` for every argument of the parser and its subcommands' but -h."""
    import argparse

    from siamesenorm.cli import build_parser

    for action in (parser or build_parser())._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _arguments(sub, name)
        elif not isinstance(action, argparse._HelpAction):
            yield command, action


def _help_problem(action) -> str | None:
    """What is wrong with an argument's help: none; an option's default not shown (a value not
    in the help as argparse prints it; an option without a value, a flag, is off by default); an
    optional value whose help does not say what it defaults to."""
    import argparse

    text = (action.help or "").strip()
    if not text or text == argparse.SUPPRESS:
        return "no help"
    shown = text % {**vars(action), "prog": "siamesenorm"}     # as argparse expands it
    takes_value = action.nargs != 0
    optional = bool(action.option_strings) and not action.required
    if takes_value and action.default is not None and str(action.default) not in shown:
        return f"its default {action.default!r} is not shown"
    if takes_value and optional and "default" not in shown:
        return "it does not say what it defaults to"
    return None


def test_every_argument_has_help_that_shows_its_default():
    problems = [f"{command} {'/'.join(a.option_strings) or a.metavar or a.dest}: {_help_problem(a)}"
                for command, a in _arguments() if _help_problem(a)]
    assert problems == []
    commands = {command for command, _ in _arguments()}
    assert {"train", "compare", "generate", "analyze", "export", "demo"} <= commands


def test_a_missing_help_or_default_is_found():
    import argparse

    parser = argparse.ArgumentParser()
    flags = [parser.add_argument("run_dir"), parser.add_argument("--seed", type=int, default=0),
             parser.add_argument("--lr", default=3e-3, help="rate (default 3e-3)"),
             parser.add_argument("--k", default=None, help="top k"),
             parser.add_argument("--lr2", default=3e-3, help="rate (default %(default)s)"),
             parser.add_argument("--greedy", action="store_true", help="greedy")]
    assert [_help_problem(a) for a in flags] == [
        "no help", "no help", "its default 0.003 is not shown", "it does not say what it defaults to",
        None, None]


def test_a_user_error_ends_the_process_with_status_2_and_one_line():
    out = run_process("demo", "--schemes", "pre,siamse")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        "siamesenorm demo: error: " + out.stderr.split("error: ", 1)[1].strip()]
    assert "unknown scheme 'siamse'" in out.stderr


def test_presets_lists_every_packaged_preset_with_its_task_and_header():
    from siamesenorm.config import PRESET_DIR

    out = run("presets")
    assert out.returncode == 0
    rows = {line.split()[0]: line.split()[1] for line in out.stdout.splitlines()[1:] if line.strip()
            and not line.startswith("Each")}
    assert set(rows) == {p.stem for p in PRESET_DIR.glob("*.yaml")}
    assert (rows["tiny"], rows["vit-digits"], rows["dit-digits"]) == ("lm", "vit", "dit")
    assert "The default comparison" in out.stdout and "presets" in run("--help").stdout


def test_train_and_compare_without_a_preset_use_the_same_one():
    """``train`` with no preset trained the built-in 6 x 256 model, ``compare`` the default preset."""
    out = run("train", "--dry-run")
    assert out.returncode == 0 and out.stdout.startswith("dry run of default: task lm, pre, 12 layers x 64")


def test_without_a_preset_a_task_starts_from_the_preset_its_registry_entry_names(monkeypatch):
    import dataclasses

    from siamesenorm.cli import DEFAULT_PRESET, _preset_or_default
    from siamesenorm.tasks.registry import DEFAULT_TASK, TASKS

    assert TASKS[DEFAULT_TASK].default_preset == DEFAULT_PRESET        # the help texts' name
    assert _preset_or_default(None, []) == DEFAULT_PRESET
    assert _preset_or_default(None, ["task=vit"]) is None              # the config class's defaults
    assert _preset_or_default("tiny", ["task=vit"]) == "tiny"
    monkeypatch.setitem(TASKS, "vit", dataclasses.replace(TASKS["vit"], default_preset="vit-digits"))
    assert _preset_or_default(None, ["model.n_layers=2", "task=vit"]) == "vit-digits"
    for value, shown in (("nope", "'nope'"), ("[1]", "[1]")):
        out = run("train", "--dry-run", f"task={value}")
        assert out.returncode == 2 and out.stderr.strip().splitlines() == [
            f"siamesenorm train: error: task: unknown value {shown}; choose one of lm, vit, dit"]


def test_olmo_core_train_says_in_one_line_what_it_needs(monkeypatch):
    import importlib.util

    out = run("olmo-core")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "ACTION" in out.stderr
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "olmo_core"
                        else found(name, *a))
    out = run("olmo-core", "train", "tiny", "--dry-run")
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "siamesenorm olmo-core train: error: olmo-core train trains with OLMo-core: "
        "pip install 'siamesenorm[olmo]'"]


def test_schemes_table_lists_every_scheme_with_its_paper():
    out = run("schemes")
    assert out.returncode == 0
    lines = out.stdout.splitlines()
    for name in sn.list_schemes():
        row = next(line for line in lines if line.split()[0] == name)
        assert "arXiv" in row
    verbose = run("schemes", "-v").stdout
    assert "depth_scale=True" in verbose and "n_streams=2" in verbose
    # the 2026 designs (issue 28): a scheme, an option, a norm kind and a model option
    assert "attn_res\n" in verbose and "block_size=None" in verbose and "fracs=1" in verbose
    assert "arXiv 2503.14125" in verbose and "arXiv 2603.15031" in verbose
    tail = verbose[verbose.index("With every scheme:"):]
    from siamesenorm.nn.norms import NORM_KINDS

    assert all(kind in tail for kind in NORM_KINDS) and "arXiv 2503.10622" in tail
    assert "model.value_residual" in tail and "arXiv 2410.17897" in tail


def test_demo_trains_every_scheme_it_is_given():
    out = run("demo", "--schemes", "pre,siamese", "--layers", "2", "--dim", "32", "--steps", "6")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("val loss") == 2
    assert "grad first/last block" in out.stdout


@pytest.mark.parametrize("args, fragment", [
    (("demo", "--schemes", "pre,siamse"), "unknown scheme 'siamse'"),
    (("demo", "--steps", "0"), "must be positive"),
    (("demo", "--steps", "ten"), "invalid int value"),
    (("frobnicate",), "invalid choice"),
])
def test_user_errors_are_one_line_with_exit_status_2(args, fragment):
    out = run(*args)
    assert out.returncode == 2
    assert fragment in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "Traceback" not in out.stderr


# ---- train ------------------------------------------------------------------------------------
def test_train_writes_the_run_directory_and_resume_continues_it(tmp_path):
    out = tmp_path / "run"
    first = run("train", "tiny", "model.scheme=siamese", "train.steps=6", "train.checkpoint_every=3",
                "--out", str(out))
    assert first.returncode == 0, first.stderr
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "checkpoints", "tokenizer"):
        assert (out / name).exists(), name
    assert yaml.safe_load((out / "config.yaml").read_text())["model"]["scheme"] == "siamese"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["diverged"] is False
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7)) and "val_loss" in rows[-1]
    again = run("train", "--resume", "--out", str(out))
    assert again.returncode == 0, again.stderr
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 6  # finished: nothing added


@pytest.mark.parametrize("args, fragment", [
    (("tiny", "model.n_layer=3"), "unknown key 'model.n_layer'"),
    (("tiny", "train.lr=fast"), "train.lr must be a number"),
    (("tiny", "train.steps=-5"), "train.steps must be positive"),
    (("tiny", "data.corpus=/no/such/data.txt"), "does not exist"),
    (("tiny", "model.scheme_options.depth_scale=false"), "has no option 'depth_scale'"),
    (("tiny", "model.scheme=hyper", "model.scheme_options.fracs=2"), "set n_streams=1"),
    (("tiny", "model.scheme=hyper", "model.scheme_options.n_streams=1", "model.scheme_options.fracs=5"),
     "fracs=5 must divide the model width"),
    (("tiny", "data.seq_len=64"), "exceeds model.max_seq_len"),
    (("nosuchpreset",), "preset 'nosuchpreset' not found"),
])
def test_train_refuses_bad_input_up_front(tmp_path, args, fragment):
    out = tmp_path / "run"
    res = run("train", *args, "--out", str(out))
    assert res.returncode == 2 and fragment in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize("args, fragment", [
    (("data.corpus=arithmetic", "data.corpus_options.max_digits=abc"), "max_digits must be an integer"),
    (("data.corpus=arithmetic", "data.corpus_options.n_train=x"), "n_train must be an integer"),
    (("data.corpus=arithmetic", "data.corpus_options.operations=5"), "operations must be a string"),
    (("data.corpus_options.max_bytes=x",), "corpus 'pystdlib': option max_bytes must be an integer"),
    (("data.corpus={here}", "data.corpus_options.max_bytes=x"), "corpus 'path': option max_bytes"),
])
def test_train_refuses_corpus_options_of_the_wrong_type(tmp_path, args, fragment):
    (tmp_path / "text.txt").write_text("some text\n" * 100)
    out = tmp_path / "run"
    res = run("train", "tiny", *(a.format(here=tmp_path / "text.txt") for a in args), "--out", str(out))
    assert res.returncode == 2 and fragment in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    assert not out.exists()


@pytest.mark.parametrize("command", ["train", "compare"])
@pytest.mark.parametrize("inside", [False, True])
def test_an_out_path_that_is_a_file_is_refused(tmp_path, command, inside):
    existing = tmp_path / "taken"
    existing.write_text("keep me")
    out = existing / "sub" if inside else existing
    res = run(command, "tiny", "train.steps=2", "--out", str(out))
    assert res.returncode == 2 and "a file, not a folder" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    assert existing.read_text() == "keep me"


def test_train_refuses_a_folder_that_holds_another_run(tmp_path):
    out = tmp_path / "run"
    assert run("train", "tiny", "train.steps=2", "--out", str(out)).returncode == 0
    before = (out / "metrics.jsonl").read_text()
    res = run("train", "tiny", "train.steps=2", "--out", str(out))
    assert res.returncode == 2 and "already holds a run" in res.stderr
    assert (out / "metrics.jsonl").read_text() == before


# ---- generate ---------------------------------------------------------------------------------
def test_generate_continues_the_prompt_of_a_trained_run(tmp_path):
    out = tmp_path / "run"
    assert run("train", "tiny", "train.steps=3", "--out", str(out)).returncode == 0
    greedy = [run("generate", str(out), "--prompt", "def f(", "--max-new-tokens", "50", "--greedy")
              for _ in range(2)]
    assert greedy[0].returncode == 0, greedy[0].stderr
    assert greedy[0].stdout.startswith("def f(") and greedy[0].stdout == greedy[1].stdout
    sampled = run("generate", str(out), "--prompt", "x", "--max-new-tokens", "5", "--seed", "3")
    assert sampled.returncode == 0 and sampled.stdout.startswith("x")


def test_generate_refuses_what_is_not_a_usable_run(tmp_path):
    res = run("generate", str(tmp_path), "--prompt", "x")
    assert res.returncode == 2 and "not a run directory" in res.stderr
    out = tmp_path / "run"
    assert run("train", "tiny", "train.steps=2", "--out", str(out)).returncode == 0
    for flag, value, fragment in (("--temperature", "-1", "--temperature must not be negative"),
                                  ("--top-k", "0", "--top-k must be positive")):
        res = run("generate", str(out), "--prompt", "x", flag, value)
        assert res.returncode == 2 and fragment in res.stderr and len(res.stderr.strip().splitlines()) == 1
    (out / "checkpoints" / "last" / "model.safetensors").write_bytes(b"garbage")
    res = run("generate", str(out), "--prompt", "x")
    assert res.returncode == 2 and "model.safetensors" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


# ---- export ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A 2-step tiny run at ROOT/runs/tiny, ROOT otherwise empty."""
    root = tmp_path_factory.mktemp("export")
    res = run("train", "tiny", "train.steps=2", "--out", "runs/tiny", cwd=root)
    assert res.returncode == 0, res.stderr
    return root / "runs" / "tiny"


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _weights(path: Path) -> tuple[dict, dict]:
    """An exported file's metadata and tensors (as bytes: comparable with ==)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.metadata(), {k: f.get_tensor(k).numpy().tobytes() for k in f.keys()}


def test_export_without_out_writes_the_weights_beside_the_run(tiny_run):
    root, inside, beside = tiny_run.parents[1], _listing(tiny_run), _listing(tiny_run.parent)
    res = run("export", "runs/tiny", cwd=root)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("runs/tiny.safetensors: ") and "step 2" in res.stdout
    assert set(_listing(tiny_run.parent)) - set(beside) == {"tiny.safetensors"}
    assert [p.name for p in root.iterdir()] == ["runs"] and _listing(tiny_run) == inside
    written = _weights(tiny_run.parent / "tiny.safetensors")
    again = run("export", "runs/tiny", cwd=root)                 # the refusals of --out hold
    assert again.returncode == 2 and "runs/tiny.safetensors already exists" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1
    assert _weights(tiny_run.parent / "tiny.safetensors") == written
    (tiny_run.parent / "tiny.safetensors").unlink()
    here = run("export", ".", cwd=tiny_run)                     # the run is the current folder
    assert here.returncode == 0, here.stderr
    assert here.stdout.startswith(f"{tiny_run.resolve()}.safetensors: ")
    assert _weights(tiny_run.parent / "tiny.safetensors") == written
    assert _listing(tiny_run) == inside
    (tiny_run.parent / "tiny.safetensors").unlink()


def test_export_hf_without_out_writes_the_model_folder_beside_the_run(tiny_run):
    pytest.importorskip("transformers")
    root, inside, beside = tiny_run.parents[1], _listing(tiny_run), _listing(tiny_run.parent)
    res = run("export", "runs/tiny", "--format", "hf", cwd=root)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("runs/tiny-hf: Hugging Face model folder")
    folder = tiny_run.parent / "tiny-hf"
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    assert {p.split("/")[0] for p in set(_listing(tiny_run.parent)) - set(beside)} == {"tiny-hf"}
    assert [p.name for p in root.iterdir()] == ["runs"] and _listing(tiny_run) == inside
    again = run("export", "runs/tiny", "--format", "hf", cwd=root)  # not empty: --force replaces
    assert again.returncode == 2 and "runs/tiny-hf is a folder that is not empty" in again.stderr
    assert run("export", "runs/tiny", "--format", "hf", "--force", cwd=root).returncode == 0
    assert (folder / "model.safetensors").is_file()
    shutil.rmtree(folder)


def test_export_of_the_root_folder_needs_out():
    res = run("export", "/")
    assert res.returncode == 2 and "give --out" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, expected", [
    (["train", "tiny", "--dry-run", "train.steps=5"], ["tiny", "train.steps=5"]),
    (["train", "tiny", "model.dim=64", "--out", "R", "train.steps=5"],
     ["tiny", "model.dim=64", "train.steps=5"]),
    (["compare", "--schemes", "pre", "tiny", "train.steps=5"], ["tiny", "train.steps=5"]),
])
def test_overrides_may_follow_the_options(argv, expected):
    from siamesenorm.cli import build_parser, parse_args

    assert parse_args(build_parser(), argv).args == expected


def test_an_unknown_option_after_the_overrides_is_still_refused():
    out = run("train", "tiny", "--dry-run", "train.steps=5", "--bogus")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "siamesenorm: error: unrecognized arguments: --bogus (see siamesenorm --help)"]
