"""Training across processes (2 CPU processes, gloo): DDP and FSDP2 against one process with the same
global batch, resumption at another world size, a save killed part-way, a failing rank, and the
``--nproc`` commands end to end. The processes are started by the library's own launcher."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import dist_worker as w
from siamesenorm.errors import ConfigError, RankFailed
from siamesenorm.parallel import RankSource
from siamesenorm.parallel.launch import launch

WORKER = str(Path(w.__file__).resolve())
TINY = ["train.steps=4", "train.eval_every=4", "train.warmup=1", "train.checkpoint_every=2",
        "data.max_bytes=40000"]


@pytest.fixture(autouse=True)
def _one_thread_each(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")   # 2 processes share 2 cores


def reference(name: str, tmp_path: Path) -> tuple[list[float], float]:
    """One process, ``grad_accum=2``: the global batch of 2 ranks with one micro-batch each."""
    scheme, options = w.SCHEMES[name]
    run_dir = tmp_path / f"ref-{name}"
    w.train(w.build(scheme, options), w.source(), w.settings(5, "none", 2), run_dir, progress=False)
    return w.losses(run_dir)


def assert_close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= 1e-5 * abs(b), f"{what}: step {i + 1}: {a} vs {b}"


def test_rank_source_splits_one_order():
    """Rank r's a-th micro-batch is the global micro-batch a * W + r; every copy stays in step."""
    def ids(source, n):
        return [int(source.next_batch()[0][0, 0]) for _ in range(n)]

    whole = ids(w.source(), 6)
    r0, r1 = RankSource(w.source(), 0, 2), RankSource(w.source(), 1, 2)
    assert ids(r0, 3) == whole[0::2] and ids(r1, 3) == whole[1::2]
    assert torch.equal(r0.state_dict()["generator"], r1.state_dict()["generator"])


def test_ddp_and_fsdp_match_one_process_with_accumulation(tmp_path):
    out = tmp_path / "results.json"
    launch(2, [WORKER, "equivalence", str(out)])
    results = json.loads(out.read_text())
    for name in w.SCHEMES:
        want, want_val = reference(name, tmp_path)
        for mode in ("ddp", "fsdp"):
            got = results[f"{name}/{mode}"]
            assert_close(got["losses"], want, f"{name} under {mode}")
            assert_close([got["val"]], [want_val], f"{name} under {mode}, validation")
            for ac in ("sublayer", "selective") if name in w.CHECKPOINTED else ():
                got = results[f"{name}/{mode}/{ac}"]
                assert_close(got["losses"], want, f"{name} under {mode} with {ac} checkpointing")


@pytest.mark.parametrize("first, then", [(2, 1), (1, 2)])
def test_resume_at_another_world_size_continues_the_same_run(tmp_path, first, then):
    ref = tmp_path / "ref"
    w.train(w.build("pre", {}), w.source(), w.settings(6, "none", 2, checkpoint_every=2), ref,
          progress=False)
    want, _ = w.losses(ref)

    run_dir = tmp_path / "run"

    def start(nproc: int, *extra: str) -> None:
        accum = str(2 // nproc)
        if nproc == 1:
            subprocess.run([sys.executable, WORKER, "run", str(run_dir), "none", accum, *extra],
                           check=False, capture_output=True)
        else:
            with pytest.raises(RankFailed) if "--crash-at-batch" in extra else _nothing():
                launch(2, [WORKER, "run", str(run_dir), "fsdp", accum, *extra])

    start(first, "--crash-at-batch", "7")         # inside step 4: the checkpoint is step 2's
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    start(then, "--resume")
    got, _ = w.losses(run_dir)
    assert_close(got, want, f"{first} then {then} processes")
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 6


def test_a_save_killed_part_way_leaves_the_previous_checkpoint(tmp_path):
    ref = tmp_path / "ref"
    w.train(w.build("pre", {}), w.source(), w.settings(6, "none", 2, checkpoint_every=2), ref,
          progress=False)
    want, _ = w.losses(ref)
    run_dir = tmp_path / "run"
    with pytest.raises(RankFailed, match="exited with status 9"):
        launch(2, [WORKER, "run", str(run_dir), "fsdp", "1", "--kill-save", "2"])   # the step-4 save
    extra = torch.load(run_dir / "checkpoints" / "last" / "state.pt", weights_only=True)["extra"]
    assert extra["run"]["step"] == 2
    assert any(p.name.startswith(".last.tmp-") for p in (run_dir / "checkpoints").iterdir())
    launch(2, [WORKER, "run", str(run_dir), "fsdp", "1", "--resume"])
    got, _ = w.losses(run_dir)
    assert_close(got, want, "resumed after a killed save")
    assert not any(p.name.startswith(".") for p in (run_dir / "checkpoints").iterdir())


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _cli(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "siamesenorm", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=cwd, timeout=300)


@pytest.mark.parametrize("joined", [False, True])
def test_exit_process_skips_the_teardown_only_after_joining_a_group(joined):
    """A process that joined a process group ends with its status and its buffered output, but
    without the interpreter's teardown (where gloo's threads, kept alive by DDP/FSDP, abort it now
    and then); any other process exits as usual."""
    script = ("import atexit, sys\n"
              "from siamesenorm.parallel import env\n"
              f"env._joined = {joined}\n"
              "atexit.register(lambda: print('teardown'))\n"
              "sys.stdout.write('buffered')\n"
              "sys.stderr.write('err')\n"
              "env.exit_process(3)\n")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 3
    assert res.stdout == ("buffered" if joined else "bufferedteardown\n")
    assert res.stderr == "err"


def test_divergence_stops_every_rank_at_the_step_one_process_stops(tmp_path):
    """The loss and gradient norm that the divergence check reads are reduced over the ranks, so
    every rank sees the same figures and stops at the same step, as one process would."""
    import dataclasses

    ref = tmp_path / "ref"
    settings = dataclasses.replace(w.settings(6, "none", 2, checkpoint_every=2), lr=50.0)
    w.train(w.build("pre", {}), w.source(), settings, ref, progress=False)
    want = json.loads((ref / "summary.json").read_text())
    assert want["diverged"], "the reference did not diverge: raise the learning rate"
    run_dir = tmp_path / "run"
    launch(2, [WORKER, "run", str(run_dir), "fsdp", "1", "--lr", "50"])     # returns: no rank hangs
    got = json.loads((run_dir / "summary.json").read_text())
    assert got["diverged"] and got["diverged_at"] == want["diverged_at"]
    assert_close(w.losses(run_dir)[0], w.losses(ref)[0], "diverging run")


def test_one_rank_raising_stops_every_rank_with_one_line(tmp_path):
    """A crash on rank 1 only (rank 0 then waits in a collective): the launcher stops both."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    from siamesenorm.data.text import batches\n"
        "    real = batches.BatchSampler.next_batch\n"
        "    def next_batch(self):\n"
        "        if self.batches_drawn >= 5:\n"
        "            raise RuntimeError('disk on fire')\n"
        "        return real(self)\n"
        "    batches.BatchSampler.next_batch = next_batch\n")
    env = {"PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])}
    began = time.monotonic()
    res = _cli("train", "tiny", *TINY, "--nproc", "2", "--out", str(tmp_path / "run"), env=env)
    assert time.monotonic() - began < 120        # not a hang (the agent stops rank 0 at once)
    assert res.returncode == 1, res.stderr
    lines = [line for line in res.stderr.strip().splitlines() if not line.startswith("[train] ")]
    assert len(lines) == 1, res.stderr
    assert "rank 1" in lines[0] and "RuntimeError: disk on fire" in lines[0]
    traceback_file = Path(lines[0].split("traceback: ")[1].rstrip(")"))
    assert "disk on fire" in traceback_file.read_text()


def test_nproc_train_end_to_end_then_export_generate_and_analyze(tmp_path):
    run_dir = tmp_path / "run"
    res = _cli("train", "tiny", *TINY, "--nproc", "2", "--out", str(run_dir))
    assert res.returncode == 0, res.stderr
    final = json.loads((run_dir / "summary.json").read_text())["final_val_loss"]
    assert res.stdout.strip().splitlines() == [
        f"{run_dir}: 4 steps (2 processes), final val loss {final:.4f}"]
    assert (run_dir / "checkpoints" / "last" / "dcp" / ".metadata").is_file()
    assert sorted(p.name for p in run_dir.iterdir()) == \
        sorted([".siamesenorm-run.json", "checkpoints", "config.yaml", "metrics.jsonl", "summary.json", "tb",
                "tokenizer"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(math.isfinite(r["loss"]) for r in rows)

    out = tmp_path / "weights.safetensors"
    res = _cli("export", str(run_dir), "--out", str(out))
    assert res.returncode == 0, res.stderr
    from safetensors import safe_open

    from siamesenorm.run import load_trained
    model, _ = load_trained(run_dir)
    with safe_open(str(out), "pt") as f:
        assert "siamesenorm_config" in f.metadata() and f.metadata()["step"] == "4"
        for name, tensor in model.state_dict().items():
            torch.testing.assert_close(f.get_tensor(name), tensor, rtol=0, atol=0)
    assert _cli("export", str(run_dir), "--out", str(out)).returncode == 2   # refuses to overwrite

    res = _cli("generate", str(run_dir), "--prompt", "def ", "--max-new-tokens", "4", "--greedy")
    assert res.returncode == 0 and res.stderr == "", res.stderr
    res = _cli("analyze", str(run_dir), "--out", str(tmp_path / "analysis"))
    assert res.returncode == 0 and "effective depth" in res.stdout, res.stderr

    res = _cli("train", "--resume", "--nproc", "2", "--out", str(run_dir))   # finished: nothing to do
    assert res.returncode == 0, res.stderr


def test_nproc_refusals_are_one_line(tmp_path):
    run_dir = tmp_path / "run"
    res = _cli("train", "tiny", *TINY, "data.corpus=/no/such.bin", "--nproc", "2", "--out", str(run_dir))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "/no/such.bin" in res.stderr and not run_dir.exists()
    res = _cli("train", "tiny", *TINY, "analysis.every=2", "--nproc", "2", "--out", str(run_dir))
    assert res.returncode == 2 and "analysis.every" in res.stderr and not run_dir.exists()
    res = _cli("train", "vit-digits", "--nproc", "2", "--out", str(run_dir))
    assert res.returncode == 2 and "task lm" in res.stderr and not run_dir.exists()
    res = _cli("train", "tiny", "train.parallel=none", "--nproc", "2", "--out", str(run_dir))
    assert res.returncode == 2 and "train.parallel=none" in res.stderr, res.stderr
    res = _cli("train", "tiny", "--nproc", "2", "--out", str(run_dir), env={"WORLD_SIZE": "2"})
    assert res.returncode == 2 and "torchrun" in res.stderr, res.stderr
    with pytest.raises(ConfigError, match="at least 1"):
        launch(0, [WORKER])


def test_nproc_compare_end_to_end(tmp_path):
    out = tmp_path / "exp"
    res = _cli("compare", "tiny", *TINY, "--schemes", "pre,siamese", "--nproc", "2", "--out", str(out))
    assert res.returncode == 0, res.stderr
    rows = json.loads((out / "summary.json").read_text())["runs"]
    assert [r["scheme"] for r in rows] == ["pre", "siamese"]
    assert all(r["steps"] == 4 and math.isfinite(r["final_val_loss"]) for r in rows)
    for r in rows:
        assert (out / r["run"] / "checkpoints" / "last" / "dcp").is_dir()
