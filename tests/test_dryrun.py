"""``train --dry-run``: the paper's presets sized on the meta device, against formulas written from
the architecture (not from the code that counts), and the command's output and errors."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from helpers import cli_in_process
from siamesenorm.config import CHECKPOINTING_MODES
from siamesenorm.errors import ConfigError
from siamesenorm.schemes import build_scheme
from siamesenorm.tasks.dryrun import dry_run, format_dry_run
from siamesenorm.tasks.registry import load_config

SRC = str(Path(__file__).resolve().parents[1] / "src")

# The paper's shapes (arXiv 2602.08064: 1.3B dense; depth sweep at ~390M), OLMo's vocabulary.
V, T = 50304, 2048
OLMO_1B = (16, 2048, 16)                 # layers, width, heads (FFN = 4 x width, SwiGLU)
DEPTH_SWEEP = [(10, 1280, 20), (17, 1024, 16), (33, 768, 12), (80, 512, 8)]


def _pre(preset: str, *extra: str):
    return load_config(preset, ["model.scheme=pre", "model.scheme_options={}", *extra])


def _block(d: int, heads: int) -> int:
    """One Pre-Norm block of the OLMo recipe: q, k, v, out (no bias), SwiGLU of 4d (three
    matrices), RMSNorm q- and k-norms of one head's width."""
    return 4 * d * d + 3 * d * 4 * d + 2 * (d // heads)


def _pre_total(layers: int, d: int, heads: int) -> tuple[int, int, int]:
    """(total, root, block) of a Pre-Norm OLMo model with untied embeddings: the embedding and the
    head (V x d each) and the 2L + 1 RMSNorm weights (two per block and the final one) sit outside
    the sublayers (FSDP2's root group); the sublayers hold the rest."""
    root = 2 * V * d + (2 * layers + 1) * d
    return root + layers * _block(d, heads), root, _block(d, heads)


def test_olmo_1b_has_the_papers_size_flops_and_tokens_per_step():
    r = dry_run(_pre("olmo-1b"), 8)
    layers, d, heads = OLMO_1B
    total, root, block = _pre_total(layers, d, heads)
    p = r["parameters"]
    assert p["total"] == total == 1_279_858_688          # "1.3B" (untied; tied it is 1.18B)
    assert p["embedding"] == 2 * V * d and p["non_embedding"] == total - 2 * V * d
    assert r["shard_groups"] == {"root": root, "block": block}
    # 6 N (every matmul weight once: the head is one, the input embedding is a lookup) + attention
    assert r["flops_per_token"] == 6 * (total - V * d) + 12 * layers * d * T
    assert r["tokens_per_step"] == 2048 * T                # 8 ranks x 8 x 32 accumulation x 2048
    assert r["tokens"] == 23842 * 2048 * T                  # ~100B tokens
    assert r["precision"] == "bf16"


@pytest.mark.parametrize("layers,d,heads", DEPTH_SWEEP)
def test_the_depth_sweep_shapes_are_about_390m(layers, d, heads):
    cfg = _pre("olmo-depth", f"model.n_layers={layers}", f"model.dim={d}", f"model.n_heads={heads}",
               f"model.mlp_hidden={4 * d}")
    total = dry_run(cfg, 1)["parameters"]["total"]
    assert total == _pre_total(layers, d, heads)[0]
    assert abs(total / 390e6 - 1) < 0.01


def test_siamese_adds_exactly_its_own_norms():
    """SiameseNorm's OLMo form adds norms and nothing else: its scheme's own parameters (built
    alone) and, its X stream being HybridNorm's, a v-norm of one head's width in every attention
    (QKV-norm instead of the preset's QK-norm)."""
    layers, d, heads = OLMO_1B
    pre = dry_run(_pre("olmo-1b"), 8)["parameters"]["total"]
    siamese = dry_run(load_config("olmo-1b"), 8)["parameters"]["total"]
    schemes = [build_scheme(name, d, layers, norm="rmsnorm", eps=1e-5, device="meta", **opts)
               for name, opts in (("pre", {}), ("siamese", {"form": "hybrid_pre"}))]
    extra = [sum(p.numel() for p in s.parameters()) for s in schemes]
    assert siamese - pre == extra[1] - extra[0] + layers * (d // heads)
    assert extra[1] > extra[0]


def test_fsdp_shards_parameters_gradients_and_optimizer_state_as_one_over_n():
    cfg = _pre("olmo-1b")
    total, root, block = _pre_total(*OLMO_1B)
    unsharded = root + block
    runs = {n: dry_run(cfg, n) for n in (2, 4, 8)}
    for n in (2, 8):
        cols = {c["engine"]: c for c in runs[n]["memory"]}
        ddp, fsdp = cols["ddp"], cols["fsdp"]
        assert ddp["parameters"] == ddp["gradients"] == ddp["buckets"] == 4 * total
        assert ddp["optimizer"] == 8 * total and ddp["weight_copies"] == 2 * total   # bf16 autocast
        assert fsdp["optimizer"] == 8 * total // n
        # fp32 shard plus the bf16 copy of the groups held gathered at once
        assert fsdp["parameters"] == fsdp["gradients"] == int(4 * total / n + 2 * unsharded)
        assert fsdp["buckets"] == fsdp["weight_copies"] == 0
    at = {n: {c["engine"]: c["states"] for c in run["memory"]} for n, run in runs.items()}
    assert at[2]["fsdp"] > at[4]["fsdp"] > at[8]["fsdp"]
    assert at[2]["ddp"] == at[4]["ddp"] == at[8]["ddp"]


def test_one_rank_shows_one_process_and_eight_rank_columns():
    r = dry_run(_pre("olmo-400m"), 1)
    assert [(c["engine"], c["nproc"]) for c in r["memory"]] == [("none", 1), ("ddp", 8), ("fsdp", 8)]
    assert r["configured"]["parallel"] == "none"


def test_activation_estimates_fall_with_checkpointing():
    cfg = load_config("olmo-400m", ["data.batch_size=2"])
    r = dry_run(cfg, 8)
    a = r["activations"]
    assert set(a) == set(CHECKPOINTING_MODES)
    assert all(isinstance(a[m], int) for m in CHECKPOINTING_MODES)
    assert a["none"] > a["selective"] > a["sublayer"] > 0
    # the residual streams kept at every step boundary: at least one stream of bf16 per sublayer
    layers, d = 17, 1024
    assert a["sublayer"] >= 2 * layers * 2 * T * d * 2
    fsdp = next(c for c in r["memory"] if c["engine"] == "fsdp")
    assert r["configured"]["total"] == fsdp["states"] + a["none"]


def test_no_data_is_needed_and_the_unset_corpus_is_refused_only_when_training():
    cfg = load_config("olmo-1b")
    assert cfg.data.corpus == ""
    dry_run(cfg, 8)                                         # no data needed
    from siamesenorm.tasks.registry import get_task

    with pytest.raises(ConfigError, match="data.corpus is not set"):
        get_task("lm").load_data(cfg, Path("unused"), False)


def test_parallel_none_is_refused_across_ranks():
    with pytest.raises(ConfigError, match="parallel"):
        dry_run(_pre("olmo-400m", "train.parallel=none"), 2)
    with pytest.raises(ConfigError, match="--nproc"):
        dry_run(_pre("olmo-400m"), 0)


def test_the_table_shows_every_figure():
    r = dry_run(_pre("olmo-1b"), 8)
    text = format_dry_run(r, "olmo-1b")
    assert "1,279,858,688" in text and "4,194,304" in text
    assert "DDP x8" in text and "FSDP2 x8" in text
    for mode in CHECKPOINTING_MODES:
        assert f"activations, ckpt {mode}" in text
    assert "n/a" not in text


# ---- the command --------------------------------------------------------------------------------
def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return cli_in_process(*args, cwd=cwd)


def test_dry_run_command_prints_the_table_and_writes_nothing(tmp_path):
    out = _cli(tmp_path, "train", "olmo-1b", "--dry-run", "--nproc", "8", "--out", "run")
    assert out.returncode == 0, out.stderr
    assert "FSDP2 x8" in out.stdout and "parameters" in out.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args,message", [
    (("--dry-run", "--resume"), "--dry-run"),
    (("--dry-run", "--nproc", "0"), "--nproc"),
    (("--dry-run", "model.n_heads=7"), "n_heads"),
    (("--out", "run"), "data.corpus is not set"),
])
def test_dry_run_and_preset_errors_are_one_line(tmp_path, args, message):
    out = _cli(tmp_path, "train", "olmo-400m", *args)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_the_meta_model_allocates_nothing():
    """A 1.3B model on the meta device: building and sizing it leaves the process's tensors alone."""
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    dry_run(load_config("olmo-1b"), 8)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss
    assert grown_kib < 1024 * 1024          # far below the model's 5 GB of fp32 weights


@pytest.mark.parametrize("preset", ["vit-digits", "dit-digits"])
def test_image_presets_get_every_figure_but_flops(preset):
    r = dry_run(load_config(preset), 2)
    assert r["flops_per_token"] is None and r["parameters"]["total"] > 0
    a = r["activations"]
    assert a["none"] > a["selective"] > a["sublayer"] > 0


# ---- every n/a says why ---------------------------------------------------------------------------
_TABLE_ROW = re.compile(r"^  \S.*?(\s{2,}(n/a|[\d.,]+)){2,}$")   # a label, then the columns' cells


def _unexplained_na(text: str) -> list[str]:
    """The lines of a dry run that print ``n/a`` without its reason: one in parentheses after it on
    the line, or, for a cell of the memory table, an ``n/a:`` footnote line."""
    lines = text.splitlines()
    footnote = any(line.startswith("n/a:") for line in lines)
    return [line for line in lines if "n/a" in line and not line.startswith("n/a:")
            and not re.search(r"n/a.*\(\w+[^)]*\w", line)
            and not (footnote and _TABLE_ROW.match(line))]


def test_the_hf_family_dry_run_says_why_its_activations_are_not_estimated(tmp_path):
    pytest.importorskip("transformers.masking_utils", reason="model.family needs transformers 5")
    out = _cli(tmp_path, "train", "olmo-1b-hf", "--dry-run")
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith(("  activations", "  total"))]
    assert rows and all(line.split()[-3:] == ["n/a"] * 3 for line in rows)   # still not estimated
    assert _unexplained_na(out.stdout) == [], out.stdout
    assert "meta device" in out.stdout and "causal mask" in out.stdout
    this_run = next(line for line in out.stdout.splitlines() if line.startswith("this run:"))
    total = int(out.stdout.split("parameters", 1)[1].split()[0].replace(",", ""))
    states = (4 + 2 + 4 + 8) * total / 2**30   # one process: fp32 weights, bf16 copies, grads, AdamW
    assert f"{states:.2f} without the activations" in this_run


def test_an_image_dry_run_says_why_it_has_no_flops_per_token():
    text = format_dry_run(dry_run(load_config("vit-digits"), 1), "vit-digits")
    flops = next(line for line in text.splitlines() if line.startswith("FLOPs per token"))
    assert "n/a" in flops and "per-token" in flops
    assert _unexplained_na(text) == [], text
    assert "n/a:" not in text                   # its activations are measured: no footnote


def test_a_line_with_an_unexplained_na_is_found():
    assert _unexplained_na("total (ckpt none)   n/a   n/a\nFLOPs   n/a  (no formula)") == \
        ["total (ckpt none)   n/a   n/a"]
    assert _unexplained_na("  total (ckpt none)        n/a         n/a") == \
        ["  total (ckpt none)        n/a         n/a"]
    assert _unexplained_na("  total (ckpt none)        n/a         n/a\nn/a: why") == []
    assert _unexplained_na("this run: n/a GiB per rank") == ["this run: n/a GiB per rank"]
