"""The losses of seeded short runs, one process and two, are bit-identical to those recorded in
``data/pinned_losses.json`` before the redesign of issue 23 (one resolved configuration, one run
object, one checkpoint contract, a thin ``--nproc`` launcher), so no refactoring may change what a
run computes.

Floats are compared exactly (``==``) on a machine like one that recorded them (the same torch
version and CPU instruction set, from ``torch.backends.cpu.get_cpu_capability``): a run must equal,
bit for bit, one of the records made on such machines. Two CPUs of one instruction set may still
sum in another order (seen: an AVX512 machine with AMX gave losses one ulp off an earlier AVX512
machine's, with the same code), so the file keeps a record per kind of machine seen; where no
record's machine is like this one, the losses are compared to 1e-5. Each run goes through the
command line as a user's does, in a fresh process of its own (forked from one that imported torch
and the package once: tests/forked.py). To record new figures after an intended change of the
numbers: ``python tests/test_pinned_losses.py --record`` (this machine's record replaces them all);
to add another kind of machine's record for unchanged code: ``--add-machine`` (refused unless its
losses are within 1e-5 of the first record's).
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from forked import Commands

PINNED = Path(__file__).parent / "data" / "pinned_losses.json"
_LM = ["tiny", "train.steps=6", "train.eval_every=3", "train.checkpoint_every=3", "train.warmup=1",
       "data.max_bytes=60000", "train.lr=3e-3", "data.batch_size=4", "data.val_batches=2"]
_VIT = ["vit-digits", "model.dim=32", "model.n_layers=2", "train.steps=4", "train.eval_every=2",
        "train.warmup=1", "data.batch_size=32", "data.val_batches=2", "model.drop_path=0.1"]
_DIT = ["dit-digits", "model.dim=32", "model.n_layers=2", "train.steps=4", "train.eval_every=4",
        "train.warmup=1", "data.batch_size=32", "data.val_batches=2", "diffusion.eval_samples=20",
        "diffusion.sample_steps=4", "diffusion.grid_per_class=1"]
# name -> (processes, command-line arguments after ``train``)
CASES = {
    "lm-siamese": (1, _LM + ["model.scheme=siamese"]),
    "lm-moe-mhc": (1, ["moe-tiny"] + _LM[1:] + ["model.scheme=mhc", "model.n_layers=2"]),
    "vit-siamese": (1, _VIT + ["model.scheme=siamese"]),
    "dit-hybrid_pre": (1, _DIT + ["model.scheme=siamese", "model.scheme_options.form=hybrid_pre"]),
    "lm-siamese-fsdp-2proc": (2, _LM + ["model.scheme=siamese", "--nproc", "2"]),
    "lm-pre-ddp-accum-2proc": (2, _LM + ["model.scheme=pre", "train.parallel=ddp", "train.grad_accum=2",
                                         "--nproc", "2"]),
}


def machine() -> dict:
    return {"torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability()}


def one_thread_commands(folder: Path) -> Commands:
    """Where the runs start: each in a process of its own, with one thread."""
    return Commands(folder, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def commands(tmp_path_factory):
    runner = one_thread_commands(tmp_path_factory.mktemp("commands"))
    yield runner
    runner.close()


def run_losses(commands: Commands, name: str, out: Path) -> dict:
    """``loss`` and ``val_loss`` of every row of the ``metrics.jsonl`` the run ``name`` writes."""
    _, args = CASES[name]
    res = commands("train", *args, "--out", str(out))
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"loss": [r["loss"] for r in rows if "loss" in r],
            "val_loss": [r["val_loss"] for r in rows if "val_loss" in r]}


def close(got: dict, want: dict) -> bool:
    return all(len(got[k]) == len(want[k]) > 0 and
               all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6) for a, b in zip(got[k], want[k]))
               for k in ("loss", "val_loss"))


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_losses_of_a_seeded_run_are_bit_identical_to_the_pinned_ones(name, tmp_path, commands):
    records = json.loads(PINNED.read_text())["records"]
    got = run_losses(commands, name, tmp_path / "run")
    here = [r["runs"][name] for r in records if r["machine"] == machine()]
    if here:
        assert any(got == want for want in here), (got, here)
    else:
        assert close(got, records[0]["runs"][name]), (got, records[0]["runs"][name])


def record_here() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        runner = one_thread_commands(Path(tmp))
        record = {"machine": machine(),
                  "runs": {name: run_losses(runner, name, Path(tmp) / name) for name in sorted(CASES)}}
        runner.close()
    return record


if __name__ == "__main__" and sys.argv[1:] in (["--record"], ["--add-machine"]):
    new = record_here()
    records = [new]
    if sys.argv[1] == "--add-machine":
        records = json.loads(PINNED.read_text())["records"]
        far = [n for n in CASES if not close(new["runs"][n], records[0]["runs"][n])]
        if far:
            sys.exit(f"error: {', '.join(far)} differ from the first record by more than 1e-5: "
                     f"the code changed the numbers (use --record if it meant to)")
        records = [r for r in records if r["runs"] != new["runs"]] + [new]
    PINNED.write_text(json.dumps({"records": records}, indent=1) + "\n")
    print(f"wrote {PINNED} ({len(records)} record(s))")
