"""Inputs a hostile or careless user gives (issue 27, sections 2 and 4 to 9b): sizes that would hang
or exhaust memory, prompt bytes that are not text, presets nested thousands deep, run files of the
wrong shape, bad process counts, devices and environments, a model gone non-finite, a reader that
goes away, and the noise of runs across processes. Each refusal is one stderr line with exit
status 2 and no traceback, before anything is written; where a run exists, it is left as it was."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

import siamesenorm.run  # noqa: F401  (imported once here, so that timings below are the work's own)
from siamesenorm import devices, shapes
from siamesenorm.cli import main
from siamesenorm.config import MAX_YAML_DEPTH, load_yaml
from siamesenorm.errors import ConfigError
from siamesenorm.models import config_checks

SRC = Path(__file__).resolve().parents[1] / "src"
TINY = ["train.steps=2", "train.eval_every=2", "train.warmup=0", "train.checkpoint_every=2",
        "data.max_bytes=40000"]
# A run that goes on until it is stopped (see tests/test_faults.py).
LONG = ["train.steps=100000", "train.eval_every=100000", "train.warmup=0", "data.max_bytes=40000",
        "train.checkpoint_every=100000", "train.divergence_factor=1e9"]


def _env(**extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def cli(*args: str | bytes, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "siamesenorm", *args], capture_output=True,
                          env=env or _env(), timeout=timeout)


def one_line(stderr: str | bytes, *fragments: str) -> str:
    text = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    assert "Traceback" not in text
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def refused(capsys, argv: list[str], *fragments: str, within: float | None = None) -> str:
    """Run the command in this process; assert a one-line refusal holding every fragment (and,
    with ``within``, that it came in under that many seconds)."""
    capsys.readouterr()
    start = time.perf_counter()
    code = main(argv)
    took = time.perf_counter() - start
    err = capsys.readouterr().err
    assert code == 2, err
    line = one_line(err, *fragments)
    assert line.startswith(f"siamesenorm {argv[0]}: error: "), line
    if within is not None:
        assert took < within, f"refused after {took:.2f} s"
    return line


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory) -> Path:
    """A finished two-step byte-level run (context 32 tokens)."""
    out = tmp_path_factory.mktemp("runs") / "lm"
    assert main(["train", "tiny", *TINY, "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "bpe"
    assert main(["train", "tiny", *TINY, "data.tokenizer=bpe", "data.vocab_size=300",
                 "model.vocab_size=300", "--out", str(out)]) == 0
    return out


# ---- 2. sizes that would hang or exhaust memory ------------------------------------------------------
@pytest.mark.parametrize("argv, fragment", [
    (["train", "tiny", "model.n_layers=1000000000"], "n_layers=1,000,000,000 is beyond"),
    (["train", "tiny", "model.n_layers=1000000000", "--dry-run"], "n_layers=1,000,000,000 is beyond"),
    (["train", "tiny", "model.n_layers=100000", "--dry-run"], "n_layers=100,000 is beyond"),
    (["train", "vit-digits", "model.n_layers=1000000000", "--dry-run"], "ViTConfig.n_layers"),
    (["train", "dit-digits", "model.n_layers=1000000000", "--dry-run"], "DiTConfig.n_layers"),
    (["demo", "--layers", "1000000000"], "n_layers=1,000,000,000 is beyond"),
    (["train", "tiny", "model.dim=68719476736", "--dry-run"], "parameters, beyond"),
    (["train", "tiny", "model.vocab_size=1000000000000000", "--dry-run"], "parameters, beyond"),
    (["train", "vit-digits", "model.num_classes=1000000000000000", "--dry-run"], "parameters, beyond"),
    (["train", "moe-tiny", "model.moe.n_experts=1000000", "--dry-run"], "model.moe.n_experts"),
    (["train", "moe-tiny", "model.n_layers=1024", "model.moe.n_experts=1024", "--dry-run"],
     "MoE layers of 1024 experts"),
])
def test_sizes_no_machine_builds_are_refused_at_once(tmp_path, capsys, argv, fragment):
    out = tmp_path / "run"
    refused(capsys, [*argv, *(["--out", str(out)] if argv[0] == "train" else [])], fragment, within=1.0)
    assert not out.exists()


@pytest.mark.parametrize("preset", ["tiny", "default", "moe-tiny", "qwen3-tiny", "olmo-1b", "olmoe-15b-a2b",
                                    "vit-digits", "deit-tiny", "dit-digits", "dit-b2"])
def test_the_analytic_parameter_estimate_is_a_close_lower_bound(preset):
    """The estimate that refuses sizes before building (no module is built for it) is at most the
    model's real count and within 2% of it, for every kind of model."""
    from siamesenorm.run import load_config
    from siamesenorm.tasks.dryrun import parameter_counts
    from siamesenorm.tasks.registry import get_task

    cfg = load_config(preset, ["data.corpus=x.bin"] if preset.startswith("olmo") else [])
    real = parameter_counts(get_task(cfg.task).build_model(cfg, torch.device("meta")))["total"]
    estimate = cfg.model.estimated_parameters()
    assert 0.98 * real <= estimate <= real, (estimate, real)


@pytest.mark.parametrize("key", ["n_layers", "dim"])
@pytest.mark.parametrize("preset", ["tiny", "vit-digits", "dit-digits"])
def test_every_model_refuses_a_huge_size_from_its_configuration_alone(capsys, preset, key):
    """The mechanism, for each model kind and size: no build is attempted (a build of these would
    never end), the refusal names the bound."""
    value = 10**12 if key == "n_layers" else 2**40
    refused(capsys, ["train", preset, f"model.{key}={value}", "--dry-run"], "beyond what this library builds",
            within=1.0)


def test_the_bounds_admit_the_largest_real_models():
    assert config_checks.MAX_LAYERS >= 1000 and config_checks.MAX_PARAMETERS >= 10**13
    config_checks.buildable("LMConfig", 1000, 2 * 10**12)      # DeepNet's depth, today's largest sizes


def test_a_dry_run_of_a_model_far_beyond_memory_allocates_nothing(capsys):
    """~100 GB of weights: measured on the meta device in seconds, and the table says it does not
    fit this machine (a real allocation would fail or take minutes)."""
    capsys.readouterr()
    start = time.perf_counter()
    assert main(["train", "tiny", "model.dim=16384", "model.n_heads=128", "model.n_layers=8",
                 "--dry-run"]) == 0
    assert time.perf_counter() - start < 60
    out = capsys.readouterr().out
    assert re.search(r"parameters\s+2[0-9,]{13}", out), out
    assert "this machine:" in out and "does NOT fit" in out


DRY_RUNS = [
    ["tiny", "model.dim=16384", "model.n_heads=128", "model.n_layers=8"],      # ~100 GB of weights
    ["tiny", "model.max_seq_len=10000000000"],                                # ~1 TB of rotary tables
    ["vit-digits", "model.image_size=131072", "model.patch_size=2"],          # 4e9 patches
    ["dit-digits", "model.input_size=262144"],                                # 1.7e10 patches
]


def test_a_dry_run_allocates_no_memory_of_the_model_s_size():
    """The mechanism, for each kind of model and what makes it large (weights, buffers, position
    tables): the dry runs' peak memory stays that of the interpreter and torch, well under 2 GB.
    One process makes the four dry runs in turn: its peak is at least each one's.

    The peak is the child's VmHWM (the high-water mark of its own address space), not ru_maxrss:
    Linux carries the address space's mark across exec, so a child that subprocess started (by
    vfork or fork) reports at least the peak of the pytest process that started it."""
    code = ("from siamesenorm.cli import main\n"
            f"codes = [main(['train', *argv, '--dry-run']) for argv in {DRY_RUNS!r}]\n"
            "peak = [line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM:')]\n"
            "print(*codes, *peak)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(),
                         timeout=300)
    *codes, peak_kib = res.stdout.split()[-len(DRY_RUNS) - 1:]
    assert codes == ["0"] * len(DRY_RUNS), res.stderr
    assert int(peak_kib) < 2 * 1024 * 1024, f"peak {int(peak_kib) / 1024:.0f} MiB"


def test_a_real_run_far_beyond_memory_is_refused_with_the_estimate(tmp_path, capsys):
    out = tmp_path / "run"
    line = refused(capsys, ["train", "tiny", "model.dim=65536", "model.n_layers=64", "--out", str(out)],
                   "needs at least", "TiB", "parameters", "--dry-run prints the estimate", within=5.0)
    assert "memory here is" in line
    assert not out.exists()
    refused(capsys, ["train", "tiny", "model.max_seq_len=10000000000", "--out", str(out)],
            "activations and buffers", within=5.0)


def test_the_memory_check_compares_the_floor_with_the_machine(tmp_path, capsys, monkeypatch):
    """The mechanism: the same tiny run is refused on a machine with 100 KiB, and trains on one
    with this machine's memory."""
    from siamesenorm.run import load_config
    from siamesenorm.tasks.dryrun import MEMORY_MARGIN, memory_floor

    floor = memory_floor(load_config("tiny", TINY))["total"]
    monkeypatch.setattr(devices, "machine_memory", lambda device: floor // (MEMORY_MARGIN + 1))
    out = tmp_path / "run"
    refused(capsys, ["train", "tiny", *TINY, "--out", str(out)], "needs at least")
    assert not out.exists()
    monkeypatch.setattr(devices, "machine_memory", lambda device: floor // MEMORY_MARGIN + 1)
    assert main(["train", "tiny", *TINY, "--out", str(out)]) == 0


@pytest.mark.parametrize("scheme, option", [("hyper", "n_streams=100000"), ("hyper", "fracs=100000"),
                                            ("mhc", "n_streams=100000"), ("mhc", "sinkhorn_iters=100000")])
def test_a_scheme_size_beyond_any_paper_is_refused_before_anything_is_built(tmp_path, capsys, scheme, option):
    """``n_streams=100000 --dry-run`` tried to allocate 40 GB (an identity built on the CPU even for
    the meta device): every option that sizes tensors or loops is bounded."""
    out = tmp_path / "run"
    name = option.partition("=")[0]
    for extra in (["--dry-run"], ["--out", str(out)]):
        refused(capsys, ["train", "tiny", *TINY, f"model.scheme={scheme}",
                         f"model.scheme_options.{option}", *extra], f"option {name}=100000 is outside [1, ")
    assert not out.exists()


def test_the_memory_floor_counts_the_schemes_own_parameters():
    """mHC's maps grow as n^2 per sublayer; the floor counts them, built on the meta device."""
    import torch

    from siamesenorm.run import load_config
    from siamesenorm.schemes import build_scheme
    from siamesenorm.tasks.dryrun import memory_floor

    def floor(n: int) -> int:
        return memory_floor(load_config("tiny", [*TINY, "model.scheme=mhc",
                                                 f"model.scheme_options.n_streams={n}"]))["parameters"]

    cfg = load_config("tiny", TINY)
    own = {n: sum(p.numel() for p in build_scheme("mhc", cfg.model.dim, cfg.model.n_layers,
                                                  device=torch.device("cpu"), n_streams=n).parameters())
           for n in (4, 16)}
    assert floor(16) - floor(4) == own[16] - own[4] > 0


def test_demo_refuses_models_beyond_memory(capsys):
    refused(capsys, ["demo", "--dim", "65536", "--layers", "100"], "needs at least", "--dim", within=5.0)


@pytest.mark.parametrize("argv, fragment", [
    (["train", "arithmetic", "data.corpus_options.n_train=1000000000000"], "n_train + n_heldout"),
    (["train", "dit-digits", "diffusion.eval_samples=1000000000"], "diffusion.eval_samples"),
    (["train", "dit-digits", "diffusion.timesteps=1000000000000"], "diffusion.timesteps"),
    (["train", "dit-digits", "diffusion.grid_per_class=1000000"], "diffusion.grid_per_class"),
])
def test_generated_data_counts_are_bounded(tmp_path, capsys, argv, fragment):
    out = tmp_path / "run"
    refused(capsys, [*argv, "--out", str(out)], fragment, "at most", within=2.0)
    assert not out.exists()


def test_generate_beyond_the_context_says_how_it_extends_and_how_long(lm_run):
    """100,000 tokens from a model of 32: the window slides; one line says so and how long it will
    take, before the work; Ctrl-C then stops it."""
    proc = subprocess.Popen([sys.executable, "-m", "siamesenorm", "generate", str(lm_run), "--prompt", "x",
                             "--max-new-tokens", "100000"], env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stderr], [], [], 120)
        assert ready, "no note within 120 s"
        note = proc.stderr.readline()
        assert note.startswith("siamesenorm generate: the prompt (1 token) and 100,000 new tokens exceed "
                               "the model's context of 32 tokens"), note
        assert "sliding window" in note and "about" in note and "Ctrl-C" in note
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
        assert proc.stderr.read().strip() == "siamesenorm generate: interrupted"
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()


def test_generation_past_the_context_is_the_same_whether_or_not_it_is_timed(lm_run, monkeypatch):
    """The mechanism behind the note: generating a timed first part, then the rest, draws the very
    tokens one sliding-window call draws."""
    from siamesenorm.run import load_trained
    from siamesenorm.tasks import lm

    model, _ = load_trained(lm_run)
    notes: list[str] = []
    monkeypatch.setattr(lm, "SLIDE_NOTE_SECONDS", 0.0)
    text = lm.generate_text(lm_run, model, "def f(", 60, temperature=0.9, seed=7, note=notes.append)
    ids = torch.tensor([list(b"def f(")])
    want = model.generate(ids, 60, temperature=0.9, use_cache=False,
                          generator=torch.Generator().manual_seed(7))
    assert text == lm.run_tokenizer(lm_run).decode(want[0].tolist())
    assert len(notes) == 1 and "context of 32 tokens" in notes[0]
    notes.clear()
    lm.generate_text(lm_run, model, "def f(", 20, seed=7, note=notes.append)     # fits: no note
    assert notes == []


# ---- 4. prompt bytes that are not UTF-8 ---------------------------------------------------------------
def test_a_byte_level_run_takes_any_prompt_bytes(lm_run):
    res = cli(b"generate", str(lm_run).encode(), b"--prompt", b"\xff\xfe", b"--max-new-tokens", b"4",
              b"--greedy")
    assert res.returncode == 0 and res.stderr == b"", res.stderr
    assert res.stdout.startswith("\ufffd\ufffd".encode())      # the two bytes, shown as text can


def test_a_bpe_run_refuses_prompt_bytes_that_are_not_utf8(bpe_run):
    res = cli(b"generate", str(bpe_run).encode(), b"--prompt", b"ab\xff\xfe", b"--max-new-tokens", b"4")
    assert res.returncode == 2
    one_line(res.stderr, "not UTF-8 text (byte 0xff at offset 2)", "bpe tokenizer")


def test_prompt_ids_of_every_kind_of_input():
    from siamesenorm.data import ByteTokenizer
    from siamesenorm.tasks.lm import prompt_ids

    bytes_tok = ByteTokenizer()
    assert prompt_ids(bytes_tok, b"\xff\x00a") == [255, 0, 97]
    assert prompt_ids(bytes_tok, "\udcff\udcfe") == [255, 254]       # surrogate-escaped argv
    assert prompt_ids(bytes_tok, "é") == [0xc3, 0xa9]
    with pytest.raises(ConfigError, match="no character nor byte"):
        prompt_ids(bytes_tok, "\ud800")


# ---- 5. presets nested thousands of levels deep ------------------------------------------------------
def _nested_block(depth: int) -> str:
    return "model:\n  scheme_options:\n" + "".join("  " * (i + 2) + "a:\n" for i in range(depth))


@pytest.mark.parametrize("text", [_nested_block(900),      # 0.8 MB: under the preset size limit
                                  "model: {scheme_options: " + "[" * 3000 + "]" * 3000 + "}\n",
                                  "- " * 3000 + "x\n"])
def test_a_preset_nested_thousands_deep_is_one_line(tmp_path, capsys, text):
    preset = tmp_path / "deep.yaml"
    preset.write_text(text)
    refused(capsys, ["train", str(preset), "--dry-run"], str(preset),
            f"more than {MAX_YAML_DEPTH} levels deep", within=2.0)


def test_the_depth_limit_is_exact_and_far_beyond_real_presets():
    deepest = max(_depth(yaml.safe_load(p.read_text())) for p in (SRC / "siamesenorm/configs").glob("*.yaml"))
    assert deepest * 4 <= MAX_YAML_DEPTH
    load_yaml("[" * MAX_YAML_DEPTH + "]" * MAX_YAML_DEPTH, "text")
    with pytest.raises(ConfigError, match="more than 64 levels"):
        load_yaml("[" * (MAX_YAML_DEPTH + 1) + "]" * (MAX_YAML_DEPTH + 1), "text")


def _depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


def test_overrides_nested_deep_or_containing_themselves_are_one_line(capsys):
    line = refused(capsys, ["train", "tiny", "model.scheme_options=" + "[" * 5000 + "]" * 5000, "--dry-run"],
                   "levels deep", within=2.0)
    assert len(line) < 300
    refused(capsys, ["train", "tiny", "model.scheme_options=&a {x: *a}", "--dry-run"], "contain itself")


# ---- 6. run files of the wrong shape -------------------------------------------------------------------
WRONG = [[1, 2], "text", 3, None, {"steps": "two", "diverged": False}, {"diverged": False}]


@pytest.mark.parametrize("document", WRONG)
def test_a_summary_of_the_wrong_shape_is_one_line(tmp_path, document):
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(document))
    damaged = rf"^{re.escape(str(path))} is damaged \(not what siamesenorm wrote"
    with pytest.raises(ConfigError, match=damaged):
        shapes.read_summary(path)


@pytest.mark.parametrize("row, where", [
    ({"step": "1", "loss": 2.0}, "at step"), ({"loss": 2.0}, "'step' is missing"),
    ({"step": 1, "loss": "low"}, "at loss"), ({"step": 1, "expert_load": [[0.5, "x"]]}, "expert_load[0][1]"),
    ({"step": True}, "at step"),
])
def test_a_metrics_row_of_the_wrong_shape_is_one_line(tmp_path, row, where):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 0, "loss": 1.0}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ConfigError, match=rf"\(row 2\) is damaged .*{re.escape(where)}"):
        shapes.read_rows(path, shapes.METRICS_ROW)


def _readers():
    """Every reader of a JSON document we wrote: (name, file it reads, how a document is written
    there, the call)."""
    from siamesenorm.analysis.training_probes import read_probes
    from siamesenorm.experiments import read_runs
    from siamesenorm.experiments.compare import grad_norm_peak
    from siamesenorm.experiments.report import _curve

    def lines(doc):
        return json.dumps(doc) + "\n"

    return [
        ("summary", "summary.json", json.dumps, lambda d: shapes.read_summary(d / "summary.json")),
        ("metrics", "metrics.jsonl", lines,
         lambda d: shapes.read_rows(d / "metrics.jsonl", shapes.METRICS_ROW)),
        ("grad peak", "metrics.jsonl", lines, grad_norm_peak),
        ("curve", "metrics.jsonl", lines, lambda d: _curve(d)),
        ("probes", "probes.jsonl", lines, read_probes),
        ("experiment", "summary.json", lambda doc: json.dumps({"runs": [doc]}),
         lambda d: read_runs(d / "summary.json")),
    ]


# Documents of another shape for every reader: not an object; an object without the keys every
# row or summary has; each key a reader knows of the wrong type; right keys, a wrong nested value.
KNOWN = {"step": 1, "steps": 1, "diverged": False, "run": "r", "scheme": "pre", "lr": 0.1, "seed": 0}
OTHER_SHAPES = [[1, 2], "text", 7, {},
                {"step": "1", "steps": "1", "diverged": "no", "run": 1, "scheme": 2, "lr": "fast",
                 "seed": "0"},
                {**KNOWN, "loss": "low", "final_val_loss": "low", "rms": [1]},
                {**KNOWN, "expert_load": [["x"]], "environment": [], "rms": {"h": "x"}, "diverged_at": 1.5}]


@pytest.mark.parametrize("document", OTHER_SHAPES)
@pytest.mark.parametrize("reader", range(6), ids=["summary", "metrics", "grad_peak", "curve", "probes",
                                                  "experiment"])
def test_every_reader_refuses_a_document_of_another_shape_in_one_line(tmp_path, reader, document):
    """The mechanism, for each reader and several wrong shapes: a ConfigError naming the file (or,
    for a JSON-lines file, which refuses any line that is not an object, the line), never a crash."""
    name, file, write, read = _readers()[reader]
    (tmp_path / file).write_text(write(document))
    if name in ("metrics", "grad peak", "curve", "probes") and not isinstance(document, dict):
        with pytest.raises(ConfigError, match=f"{re.escape(str(tmp_path / file))}.*line 1"):
            read(tmp_path)
        return
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(tmp_path / file))}.* is damaged \(not what"):
        read(tmp_path)


def test_an_analysis_of_another_shape_is_left_out_of_the_report(tmp_path):
    from siamesenorm.analysis.report_section import _analysis

    path = tmp_path / "analysis.json"
    for document in ([1], {"probes": {"rms": [1, 2]}}, {"lens": 3}, "x" * 10):
        path.write_text(json.dumps(document))
        assert _analysis(path) is None
    path.write_text("[" * 100_000 + "]" * 100_000)       # deeper than json's own recursion
    assert _analysis(path) is None
    path.write_text(json.dumps({"lens": None, "pruning": {"per_block": [0.1, None]}}))
    assert _analysis(path) == {"lens": None, "pruning": {"per_block": [0.1, None]}}


def test_the_shape_checker_walks_any_depth_and_admits_what_fits():
    nested = shapes.Obj({"a": shapes.ListOf(shapes.ListOf(shapes.NUMBER))})
    assert shapes.mismatch({"a": [[1, 2.0], []]}, nested) is None
    assert shapes.mismatch({"a": [[1, "2"]]}, nested) == "at a[0][1]: expected a number, got a string"
    either = (shapes.Obj({"n": shapes.INT}), type(None))
    assert shapes.mismatch(None, either) is None and shapes.mismatch({"n": 1}, either) is None
    assert shapes.mismatch({"n": "x"}, either) == "at n: expected an integer, got a string"
    assert shapes.mismatch(3, either) == "expected an object or null, got an integer"
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    assert "expected" in shapes.mismatch(deep, shapes.ListOf(shapes.ListOf(shapes.INT)))
    assert shapes.mismatch(True, shapes.INT) == "expected an integer, got true or false"
    assert shapes.mismatch(1, shapes.NUMBER) is None and shapes.mismatch(1.5, shapes.INT) is not None


def test_every_reader_of_our_json_states_a_shape():
    """Every place in src/ that reads JSON back (json.load/json.loads, read_json, read_jsonl) is one
    that checks the shape of what it reads: a new reader makes this test fail until it is audited
    and listed here."""
    audited = {
        # the shape checker, and the raw readers it builds on (rundir: read_json, read_jsonl, and
        # the run marker's readers, which take a non-object as no record)
        "shapes.py": 2, "rundir.py": None,
        # a JSON round trip of the data record just built (runner's data-change checks: before a
        # resume's changes are written, and when it trains)
        "tasks/runner.py": 2,
        # OLMo-core's config.json and metrics: isinstance checks of every field read
        "olmo_core/to_run.py": 4,
        # checked: read_json's result compared as a whole (experiment.json), or with EXPERIMENT_ROWS
        "experiments/compare.py": 2,
        # checksums.json: every entry's fields read under the check (verify_checksums, issue 27 §1)
        "train/checkpoint/atomic.py": 1,
        # checksums.json again: only its keys compared with the folder's files, a non-object taken
        # as a folder the run did not write (keep.written_here: pruning)
        "train/checkpoint/keep.py": 1,
        # an imported run's summary.json: imported_from read under isinstance, anything else taken
        # as none (tasks/lm._imported_from: the call and its .get)
        "tasks/lm.py": 2,
        # the lock's holder: a non-object is treated as no holder (locks.held_by)
        "locks.py": 1,
        # the tokenizer descriptor: isinstance(dict) and its kind checked (load_tokenizer)
        "data/text/tokenizers.py": 1,
        # analysis.json: mismatch(ANALYSIS) or ignored as absent (report_section._analysis)
        "analysis/report_section.py": 1,
        # an HF folder's config.json for analyze: refused unless a JSON object (analyze_sources)
        "commands/analyze_sources.py": 1,
        # tokenizer_config.json that transformers has just written into our temporary folder
        "hf/export.py": 1,
        # adapt_from_pretrained: config.json must be an object, every size checked (check_sizes);
        # the index's weight_map must map names to file names of the folder (issue 48)
        "hf/loading.py": 2,
        # a model folder's marker: an object whose "files" is a list of strings, else no marker
        "hf/folder.py": 1,
    }
    pattern = re.compile(r"\bjson\.loads?\(|\bread_json\(|\bread_jsonl\(")
    found = {}
    for path in (SRC / "siamesenorm").rglob("*.py"):
        tree = ast.parse(path.read_text())
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
                 and pattern.search(ast.unparse(n.func) + "(")]
        if calls:
            found[str(path.relative_to(SRC / "siamesenorm"))] = len(calls)
    unaudited = {k: v for k, v in found.items() if k not in audited or
                 (audited[k] is not None and v > audited[k])}
    assert not unaudited, f"JSON readers without an audited shape check: {unaudited}"


def test_compare_rerun_with_a_run_summary_that_is_a_list_is_one_line(tmp_path, capsys):
    out = tmp_path / "exp"
    args = ["compare", "tiny", *TINY, "--schemes", "pre", "--out", str(out)]
    assert main(args) == 0
    summary = next(out.glob("*/summary.json"))
    summary.write_text("[1, 2]")
    before = snapshot(out)
    refused(capsys, args, str(summary), "expected an object, got a list")
    assert snapshot(out) == before
    summary.write_text(json.dumps({"steps": 2, "diverged": False, "interrupted": False,
                                   "final_val_loss": "low"}))
    refused(capsys, args, str(summary), "at final_val_loss")


def test_export_hf_with_a_summary_that_is_a_list_is_one_line(lm_run, tmp_path, capsys):
    pytest.importorskip("transformers")
    summary = lm_run / "summary.json"
    good = summary.read_text()
    summary.write_text("[]")
    try:
        refused(capsys, ["export", str(lm_run), "--format", "hf", "--out", str(tmp_path / "hf")],
                str(summary), "expected an object, got a list")
        assert not (tmp_path / "hf").exists()
    finally:
        summary.write_text(good)


# ---- 7. process counts, overrides, devices, environments -----------------------------------------------
@pytest.mark.parametrize("argv", [["train", "tiny"], ["train", "tiny", "--dry-run"], ["compare", "tiny"]])
@pytest.mark.parametrize("n", ["0", "-3", "two"])
def test_nproc_below_one_is_refused_everywhere(tmp_path, capsys, argv, n):
    out = tmp_path / "out"
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main([*argv, "--nproc", n, "--out", str(out)])
    assert done.value.code == 2
    one_line(capsys.readouterr().err, "argument --nproc")
    assert not out.exists()


@pytest.mark.parametrize("typed", ["data/a #b", "data/a: b", "yes", "~", "[x]", "'quoted'", " spaced "])
def test_a_string_override_stays_the_text_typed(typed):
    from siamesenorm.run import load_config

    cfg = load_config("tiny", [f"data.corpus={typed}", "train.lr=2e-3 #x", "model.scheme=siamese",
                               "model.scheme_options.depth_scale=false"])
    assert cfg.data.corpus == typed
    assert cfg.train.lr == 2e-3 and cfg.model.scheme_options == {"depth_scale": False}


def test_a_path_with_a_hash_reaches_the_loader_whole(tmp_path, capsys):
    refused(capsys, ["train", "tiny", "data.corpus=/no/such/a #b", "--out", str(tmp_path / "r")],
            "/no/such/a #b")


@pytest.mark.parametrize("argv, fragment", [
    (["train", "tiny", "train.device=meta"], "train.device=meta: the meta device holds shapes"),
    (["train", "tiny", "train.device=meta", "--dry-run"], "train.device=meta"),
    (["train", "tiny", "train.device=xpu"], "unknown device"),
    (["train", "tiny", "train.device=cuda:99"], "train.device=cuda:99"),
])
def test_devices_are_checked_up_front(tmp_path, capsys, argv, fragment):
    out = tmp_path / "run"
    refused(capsys, [*argv, "--out", str(out)], fragment, within=2.0)
    assert not out.exists()


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="needs a machine without MPS")
def test_mps_without_mps_is_one_line(tmp_path, capsys):
    refused(capsys, ["train", "tiny", "train.device=mps", "--out", str(tmp_path / "r")],
            "train.device=mps but no MPS device")


def test_generate_and_analyze_check_the_device_before_reading_the_run(lm_run, capsys):
    before = snapshot(lm_run)
    refused(capsys, ["generate", str(lm_run), "--prompt", "x", "--device", "meta"], "--device meta: the meta")
    refused(capsys, ["analyze", str(lm_run), "--device", "meta"], "--device meta")
    assert snapshot(lm_run) == before


def test_a_world_size_without_torchrun_s_variables_says_so(tmp_path, capsys, monkeypatch):
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "run"
    refused(capsys, ["train", "tiny", *TINY, "--out", str(out)],
            "part of a torchrun world", "MASTER_ADDR", "unset WORLD_SIZE")
    assert not out.exists()
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", "29999")
    refused(capsys, ["train", "tiny", *TINY, "--out", str(out)], "RANK=5 is outside the world")
    monkeypatch.setenv("WORLD_SIZE", "0")
    refused(capsys, ["train", "tiny", *TINY, "--out", str(out)], "WORLD_SIZE=0")


def test_a_stray_rank_still_prints_the_result_line(tmp_path):
    out = tmp_path / "run"
    res = cli("train", "tiny", *TINY, "--out", str(out), env=_env(RANK="1"))
    assert res.returncode == 0, res.stderr
    assert res.stdout.decode().strip().startswith(f"{out}: 2 steps, final val loss")


# ---- 8. a model gone non-finite --------------------------------------------------------------------
def test_generate_on_non_finite_weights_says_so(lm_run, tmp_path, capsys):
    import shutil

    from siamesenorm.run import load_trained
    from siamesenorm.train import save_checkpoint
    from siamesenorm.train.checkpoint import checkpoint_extra
    from siamesenorm.train.optim import build_optimizer

    run = tmp_path / "nan"
    shutil.copytree(lm_run, run)
    model, _ = load_trained(run)
    with torch.no_grad():
        model.embed.weight[3, 0] = float("nan")
    last = run / "checkpoints" / "last"
    save_checkpoint(last, model, build_optimizer(model, 1e-3), checkpoint_extra(last))
    before = snapshot(run)
    refused(capsys, ["generate", str(run), "--prompt", "x"], str(last), "non-finite weights", "NaN")
    assert snapshot(run) == before


# ---- 9. the reader goes away ----------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["schemes", "-v"], ["schemes"], ["train", "tiny", "--dry-run"], ["--help"]])
def test_a_reader_gone_early_ends_the_command_quietly(argv):
    """A real pipe whose read end is closed before the command writes (as `| head -1` does once it
    has its line): no traceback, nothing on stderr, SIGPIPE's status or success."""
    read, write = os.pipe()
    os.close(read)
    try:
        res = subprocess.run([sys.executable, "-m", "siamesenorm", *argv], stdout=write,
                             stderr=subprocess.PIPE, env=_env(), timeout=300)
    finally:
        os.close(write)
    assert res.stderr == b"", res.stderr
    assert res.returncode in (0, 141)


def test_a_reader_of_a_few_lines_gets_them_and_the_rest_is_dropped():
    proc = subprocess.Popen([sys.executable, "-m", "siamesenorm", "schemes", "-v"], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) in (0, 141)
    proc.stderr.close()
    assert first.strip() and err == b"", err


# ---- 9b. the noise of runs across processes ----------------------------------------------------------------
def test_moe_under_nproc_2_prints_no_gradient_warning(tmp_path):
    """FSDP2's "returned a view tensor ... wrong gradients" warning is silenced for our MoE only;
    tests/test_parallel.py's DDP/FSDP2 equivalence test proves it harmless (the MoE's losses under
    FSDP2 across 2 processes equal one process's)."""
    from siamesenorm.parallel.wrap import MOE_VIEW_WARNING

    out = tmp_path / "run"
    res = cli("train", "moe-tiny", *TINY, "data.batch_size=2", "data.seq_len=32", "--nproc", "2",
              "--out", str(out))
    assert res.returncode == 0, res.stderr
    err = res.stderr.decode()
    assert "Warning" not in err and "wrong gradients" not in err, err
    assert re.search(MOE_VIEW_WARNING, "FSDP2-wrapped module (FSDPMoE) returned a view tensor. An in-place")
    assert not re.search(MOE_VIEW_WARNING, "FSDP2-wrapped module (FSDPAttention) returned a view tensor")


def test_sigterm_to_an_nproc_launcher_prints_one_line_and_leaves_no_folder(tmp_path):
    run_dir, scratch = tmp_path / "run", tmp_path / "tmp"
    scratch.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "siamesenorm", "train", "tiny", *LONG, "--nproc", "2",
                             "--out", str(run_dir)], env=_env(TMPDIR=str(scratch)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "metrics.jsonl").is_file() or not (run_dir / "metrics.jsonl").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, "the run never started"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    own = [line for line in err.splitlines() if line.strip() and not line.startswith("[train]")]
    assert own == ["siamesenorm train: terminated (SIGTERM)"], err
    assert "Traceback" not in err and out == ""
    assert list(scratch.glob("siamesenorm-ranks-*")) == []
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] and summary["checkpoint_step"] == summary["steps"] > 0
