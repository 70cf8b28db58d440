"""Training across processes (2 CPU processes, gloo): DDP and FSDP2 against one process with the same
global batch, resumption at another world size, a save killed part-way, a failing rank, and the
``--nproc`` commands end to end. The processes are started by the library's own launcher."""

from __future__ import annotations

import dataclasses
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
from helpers import what_a_process_would_print
from siamesenorm.errors import ConfigError, RankFailed
from siamesenorm.parallel import RankSource
from siamesenorm.parallel.launch import launch
from siamesenorm.train.progress import LOG_PREFIX
from test_logging import STEP

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


def test_ddp_and_fsdp_match_one_process_with_accumulation_and_diverge_at_its_step(tmp_path):
    """Every case's losses and validation under DDP and FSDP2 (with checkpointing where it
    applies) are one process's. In the same launch, a run that diverges: the loss and gradient
    norm that the divergence check reads are reduced over the ranks, so every rank sees the same
    figures and stops at the same step, as one process would (and the launch returns: no rank
    hangs)."""
    out, diverging = tmp_path / "results.json", tmp_path / "diverging"
    launch(2, [WORKER, "equivalence", str(out), str(diverging)])
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

    ref = tmp_path / "diverging-ref"
    settings = dataclasses.replace(w.settings(6, "none", 2, checkpoint_every=2), lr=50.0)
    w.train(w.build("pre", {}), w.source(), settings, ref, progress=False)
    want = json.loads((ref / "summary.json").read_text())
    assert want["diverged"], "the reference did not diverge: raise the learning rate"
    got = json.loads((diverging / "summary.json").read_text())
    assert got["diverged"] and got["diverged_at"] == want["diverged_at"]
    assert_close(w.losses(diverging)[0], w.losses(ref)[0], "diverging run")


def test_a_run_resumes_at_another_world_size_and_after_a_save_killed_part_way(tmp_path):
    """One run of 6 steps (a checkpoint every 2) in three sessions, each stopped by a fault, ends
    with exactly the losses of the same run never stopped (one process, ``grad_accum=2``): 2
    processes killed inside the step-4 save, then 1 process resuming their checkpoint and crashing
    in step 6, then 2 processes resuming that one. A save killed part-way leaves the previous
    checkpoint whole and its half-written folder aside, and the next save clears it."""
    ref = tmp_path / "ref"
    w.train(w.build("pre", {}), w.source(), w.settings(6, "none", 2, checkpoint_every=2), ref,
            progress=False)
    want, _ = w.losses(ref)
    run_dir, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"

    def checkpoint_step() -> int:
        return torch.load(checkpoints / "last" / "state.pt", weights_only=True)["extra"]["run"]["step"]

    def leftovers() -> list[str]:
        return [p.name for p in checkpoints.iterdir() if p.name.startswith(".last.tmp-")]

    # 2 processes: the step-4 save is killed after its shards are written, before the swap
    with pytest.raises(RankFailed, match="exited with status 9"):
        launch(2, [WORKER, "run", str(run_dir), "fsdp", "1", "--kill-save", "2"])
    assert checkpoint_step() == 2 and (checkpoints / "last" / "dcp" / ".metadata").is_file()
    assert len(leftovers()) == 1
    # 1 process (this one) resumes their sharded checkpoint (its step-4 save clears the leftover)
    # and crashes inside step 6 (its 11th micro-batch): its own checkpoint is step 4's
    with pytest.raises(RuntimeError, match="planned crash after 11 micro-batches"):
        w.train(w.build("pre", {}), w.Crashing(w.source(), 11), w.settings(6, "none", 2, checkpoint_every=2),
                run_dir, resume=True, progress=False)
    assert checkpoint_step() == 4 and not (checkpoints / "last" / "dcp").exists() and leftovers() == []
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    # 2 processes resume the one process's checkpoint and finish the run
    launch(2, [WORKER, "run", str(run_dir), "fsdp", "1", "--resume"])
    got, _ = w.losses(run_dir)
    assert_close(got, want, "2, then 1, then 2 processes")
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 6
    assert not any(p.name.startswith(".") for p in checkpoints.iterdir())


def _cli(*args: str, stderr_file: Path | None = None) -> subprocess.CompletedProcess:
    """``siamesenorm ARGS`` in a process of its own, as a user starts it; with ``stderr_file`` its
    stderr goes to that file (as under a scheduler), and the result holds what the file got."""
    cmd = [sys.executable, "-m", "siamesenorm", *args]
    if stderr_file is None:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    with open(stderr_file, "w") as stream:
        res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=stream, text=True, timeout=300)
    return subprocess.CompletedProcess(cmd, res.returncode, res.stdout, stderr_file.read_text())


def _main(capfd, *args: str) -> subprocess.CompletedProcess:
    """The command in this process (``siamesenorm.cli.main``), its ranks (``--nproc``) in their
    own: its status and what it and they printed, for what does not depend on the command's own
    process (that one is :func:`_cli`'s)."""
    from siamesenorm.cli import main

    capfd.readouterr()
    code = main(list(args))
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(list(args), code, out, err)


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


def test_one_rank_raising_stops_every_rank_with_one_line(tmp_path, capfd, monkeypatch):
    """A crash on rank 1 only (rank 0 then waits in a collective): the launcher stops both. The
    command runs in this process; the ranks are processes of their own, whose output is
    captured with its own."""
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
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]))
    began = time.monotonic()
    res = _main(capfd, "train", "tiny", *TINY, "--nproc", "2", "--out", str(tmp_path / "run"))
    assert time.monotonic() - began < 120        # not a hang (the agent stops rank 0 at once)
    assert res.returncode == 1, res.stderr
    lines = [line for line in res.stderr.strip().splitlines() if not line.startswith("[train] ")]
    assert len(lines) == 1, res.stderr
    assert "rank 1" in lines[0] and "RuntimeError: disk on fire" in lines[0]
    traceback_file = Path(lines[0].split("traceback: ")[1].rstrip(")"))
    assert "disk on fire" in traceback_file.read_text()


def test_nproc_train_end_to_end_then_export_generate_and_analyze(tmp_path, capfd):
    run_dir = tmp_path / "run"
    # as a user starts it, its stderr a file as under a scheduler
    res = _cli("train", "tiny", *TINY, "train.log_every=2", "--nproc", "2", "--out", str(run_dir),
               stderr_file=tmp_path / "stderr.log")
    assert res.returncode == 0, res.stderr
    final = json.loads((run_dir / "summary.json").read_text())["final_val_loss"]
    assert res.stdout.strip().splitlines() == [
        f"{run_dir}: 4 steps (2 processes), final val loss {final:.4f}"]
    # the threads chosen, then rank 0's plain lines alone, every 2 steps, then its final line
    lines = res.stderr.splitlines()
    assert lines[0].startswith(f"{LOG_PREFIX} threads: ") and "per process" in lines[0], lines
    lines = lines[1:]
    assert [int(STEP.match(line)[1]) for line in lines[:-1]] == [2, 4], lines
    assert lines[-1].startswith(f"{LOG_PREFIX} done: 4/4 steps"), lines
    assert (run_dir / "checkpoints" / "last" / "dcp" / ".metadata").is_file()
    assert sorted(p.name for p in run_dir.iterdir()) == \
        sorted([".siamesenorm-run.json", "checkpoints", "config.yaml", "metrics.jsonl", "summary.json", "tb",
                "tokenizer"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(math.isfinite(r["loss"]) for r in rows)

    # what reads the sharded checkpoint, in this process (which has no process group, as the
    # commands' own would not); generate prints nothing on stderr: no warning of loading it
    # without a process group, which pytest would hold back here but what_a_process_would_print
    # collects
    assert not torch.distributed.is_initialized()
    out = tmp_path / "weights.safetensors"
    res = _main(capfd, "export", str(run_dir), "--out", str(out))
    assert res.returncode == 0, res.stderr
    from safetensors import safe_open

    from siamesenorm.run import load_trained
    model, _ = load_trained(run_dir)
    with safe_open(str(out), "pt") as f:
        assert "siamesenorm_config" in f.metadata() and f.metadata()["step"] == "4"
        for name, tensor in model.state_dict().items():
            torch.testing.assert_close(f.get_tensor(name), tensor, rtol=0, atol=0)
    assert _main(capfd, "export", str(run_dir), "--out", str(out)).returncode == 2   # refuses to overwrite

    with what_a_process_would_print() as extra:
        res = _main(capfd, "generate", str(run_dir), "--prompt", "def ", "--max-new-tokens", "4", "--greedy")
    assert res.returncode == 0 and res.stderr == "" and extra == [], (res.stderr, extra)
    res = _main(capfd, "analyze", str(run_dir), "--out", str(tmp_path / "analysis"))
    assert res.returncode == 0 and "effective depth" in res.stdout, res.stderr

    res = _main(capfd, "train", "--resume", "--nproc", "2", "--out", str(run_dir))   # finished: nothing to do
    assert res.returncode == 0, res.stderr


def test_nproc_refusals_are_one_line(tmp_path, capfd, monkeypatch):
    """Refused before any process starts: in this process, with what any rank would print."""
    run_dir = tmp_path / "run"

    def refused(*args: str, writes_nothing: bool = True) -> str:
        res = _main(capfd, "train", *args, "--nproc", "2", "--out", str(run_dir))
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert not (writes_nothing and run_dir.exists())
        return res.stderr

    assert "/no/such.bin" in refused("tiny", *TINY, "data.corpus=/no/such.bin")
    assert "analysis.every" in refused("tiny", *TINY, "analysis.every=2")
    assert "task lm" in refused("vit-digits")
    assert "train.parallel=none" in refused("tiny", "train.parallel=none")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "torchrun" in refused("tiny", writes_nothing=False)    # refused by the launcher
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ConfigError, match="at least 1"):
        launch(0, [WORKER])


def test_nproc_compare_end_to_end(tmp_path, capfd):
    out = tmp_path / "exp"
    res = _main(capfd, "compare", "tiny", *TINY, "--schemes", "pre,siamese", "--nproc", "2", "--out",
                str(out))
    assert res.returncode == 0, res.stderr
    rows = json.loads((out / "summary.json").read_text())["runs"]
    assert [r["scheme"] for r in rows] == ["pre", "siamese"]
    assert all(r["steps"] == 4 and math.isfinite(r["final_val_loss"]) for r in rows)
    for r in rows:
        assert (out / r["run"] / "checkpoints" / "last" / "dcp").is_dir()
