"""A short seeded run of each task reproduces the losses recorded in ``data/seeded_losses.json``.

The figures were recorded before the package was reorganised (issue 10), so the reorganisation
(and any later one) that changes a run's initialisation, data order or arithmetic fails here. To
record new figures after an intended change of the numbers:
``python tests/test_seeded_losses.py --record``.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from siamesenorm.run import run_training
from siamesenorm.tasks import load_config

GOLDEN = Path(__file__).parent / "data" / "seeded_losses.json"
_LM = ["tiny", "train.steps=6", "train.eval_every=3", "train.checkpoint_every=6", "train.warmup=1",
       "data.max_bytes=60000", "train.lr=3e-3"]
_VIT = ["vit-digits", "model.dim=32", "model.n_layers=2", "train.steps=6", "train.eval_every=3",
        "train.checkpoint_every=6", "train.warmup=1", "data.batch_size=32", "data.val_batches=2",
        "model.drop_path=0.1"]
_DIT = ["dit-digits", "model.dim=32", "model.n_layers=2", "train.steps=6", "train.eval_every=6",
        "train.checkpoint_every=6", "train.warmup=1", "data.batch_size=32", "data.val_batches=2",
        "diffusion.eval_samples=20", "diffusion.sample_steps=4", "diffusion.grid_per_class=1"]
CASES = {
    "lm-siamese": _LM + ["model.scheme=siamese"],
    "lm-deepnorm": _LM + ["model.scheme=deepnorm"],
    "lm-hybridnorm-mitchell": _LM + ["model.scheme=hybridnorm", "model.init=mitchell"],
    "lm-hyper-probes": _LM + ["model.scheme=hyper", "analysis.every=3"],
    "vit-siamese": _VIT + ["model.scheme=siamese"],
    "vit-deepnorm": _VIT + ["model.scheme=deepnorm"],
    "dit-siamese": _DIT + ["model.scheme=siamese"],
    "dit-deepnorm": _DIT + ["model.scheme=deepnorm"],
}


def _losses(name: str, out: Path) -> dict:
    """Training and validation losses of the run ``name`` trained into ``out``."""
    preset, *overrides = CASES[name]
    run_training(load_config(preset, overrides), out, progress=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"loss": [r["loss"] for r in rows if "loss" in r],
            "val_loss": [r["val_loss"] for r in rows if "val_loss" in r]}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_seeded_run_repeats_the_recorded_losses(name, tmp_path):
    want = json.loads(GOLDEN.read_text())[name]
    got = _losses(name, tmp_path / name)
    for key in ("loss", "val_loss"):
        assert len(got[key]) == len(want[key]), key
        for a, b in zip(got[key], want[key]):
            assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6), (key, got[key], want[key])


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        record = {name: _losses(name, Path(tmp) / name) for name in sorted(CASES)}
    GOLDEN.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {GOLDEN}")
