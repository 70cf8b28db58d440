"""Checkpoint time in one process: the safetensors writer against torch.distributed.checkpoint.

One process writes ``model.safetensors`` + ``state.pt`` (format 1, with the optimizer); several
write ``dcp/`` through ``torch.distributed.checkpoint`` (DCP). This measures what one process would
pay for either: for each model, an AdamW after one step is saved and loaded back by

    safetensors   the writer of :func:`~siamesenorm.train.checkpoint.save_checkpoint` in one
                  process (model.safetensors + state.pt, both fsynced) and its reader (the file
                  checked against the model, the optimizer's state_dict loaded)
    dcp           ``dcp.save``/``dcp.load`` of ``{"model": ..., "optim": ...}`` from
                  ``get_state_dict`` (into ``set_state_dict`` on load), plus the small state.pt
                  (format 2) that the sharded layout writes beside it

into a fresh folder each time. What both layouts share (checksums.json, written last and verified
first, and the renames of the swap) is timed once per round and printed on its own line. The two
writers are interleaved, round after round, the first of each round alternating, so machine noise
falls on both alike; the figures are medians over the rounds (after ``--warmup`` rounds).

    python benchmarks/checkpoint.py                      # dim 64 x 12 layers, dim 256 x 6 layers
    python benchmarks/checkpoint.py --rounds 21 --dir /mnt/disk
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from siamesenorm.models import LanguageModel, LMConfig
from siamesenorm.train.checkpoint import (
    DCP_DIR,
    MODEL_FILE,
    SHARDED_FORMAT,
    STATE_FILE,
    _write_dcp,
    _write_model,
    _write_state,
    load_dcp_into,
    read_model,
    read_state,
    verify_checksums,
    write_checksums,
)
from siamesenorm.train.optim import build_optimizer

MODELS = {"dim64-L12": dict(dim=64, n_layers=12, n_heads=4),
          "dim256-L6": dict(dim=256, n_layers=6, n_heads=4)}
SEQ = 64


def trained(shape: dict, seed: int) -> tuple[LanguageModel, torch.optim.Optimizer]:
    """The model of ``shape`` (vocabulary 256) and an AdamW after one step."""
    torch.manual_seed(seed)
    model = LanguageModel(LMConfig(vocab_size=256, max_seq_len=SEQ, **shape))
    opt = build_optimizer(model, 1e-3)
    x = torch.randint(0, 256, (4, SEQ + 1))
    model(x[:, :-1], x[:, 1:]).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


EXTRA = {"run": {"step": 1}, "rng": {"torch": torch.get_rng_state()}}


def save_safetensors(folder: Path, model, opt) -> None:
    _write_model(folder / MODEL_FILE, model)
    _write_state(folder / STATE_FILE, opt, EXTRA)


def load_safetensors(folder: Path, model, opt) -> None:
    tensors = read_model(folder / MODEL_FILE, model)
    state = read_state(folder / STATE_FILE)
    opt.load_state_dict(state["optimizer"])
    model.load_state_dict(tensors, strict=True)


def save_dcp(folder: Path, model, opt) -> None:
    _write_dcp(folder / DCP_DIR, model, opt)
    _write_state(folder / STATE_FILE, None, EXTRA)


def load_dcp(folder: Path, model, opt) -> None:
    read_state(folder / STATE_FILE, SHARDED_FORMAT)
    load_dcp_into(folder, model, opt)


WRITERS: dict[str, tuple[Callable, Callable]] = {"safetensors": (save_safetensors, load_safetensors),
                                                 "dcp": (save_dcp, load_dcp)}


def timed(fn: Callable, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def checksums(folder: Path) -> None:
    write_checksums(folder)
    verify_checksums(folder)


def nbytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dir", default=None, help="where the checkpoints are written (default: the "
                                               "system's temporary folder)")
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
    root = Path(tempfile.mkdtemp(prefix="siamesenorm-ckpt-bench-", dir=args.dir))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, one process; "
          f"{args.rounds} rounds after {args.warmup} warm-up, writers interleaved; folder {root}")
    try:
        for name, shape in MODELS.items():
            model, opt = trained(shape, 0)
            fresh, fresh_opt = trained(shape, 1)      # what each load overwrites
            times = {w: {"save": [], "load": []} for w in WRITERS}
            common, sizes = [], {}
            for r in range(args.warmup + args.rounds):
                order = list(WRITERS) if r % 2 == 0 else list(WRITERS)[::-1]
                for writer in order:
                    save, load = WRITERS[writer]
                    folder = root / f"{name}-{writer}-{r}"
                    folder.mkdir()
                    t_save = timed(save, folder, model, opt)
                    t_load = timed(load, folder, fresh, fresh_opt)
                    sizes[writer] = nbytes(folder)
                    if writer == "safetensors":       # what both layouts pay alike: the checksums
                        t_common = timed(checksums, folder)
                    shutil.rmtree(folder)
                    if r >= args.warmup:
                        times[writer]["save"].append(t_save)
                        times[writer]["load"].append(t_load)
                if r >= args.warmup:
                    common.append(t_common)
            for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
                assert torch.equal(a, b), k      # the last load restored the saved weights
            params = sum(p.numel() for p in model.parameters())
            print(f"\n{name}: {params / 1e6:.2f}M parameters; files: safetensors layout "
                  f"{sizes['safetensors'] / 1e6:.1f} MB, dcp layout {sizes['dcp'] / 1e6:.1f} MB")
            print(f"  {'median ms':<12}{'save':>9}{'load':>9}{'total':>9}")
            med = {w: {k: statistics.median(v) * 1e3 for k, v in t.items()} for w, t in times.items()}
            for w in WRITERS:
                m = med[w]
                print(f"  {w:<12}{m['save']:9.1f}{m['load']:9.1f}{m['save'] + m['load']:9.1f}")
            s, d = med["safetensors"], med["dcp"]
            print(f"  {'dcp/safet.':<12}{d['save'] / s['save']:9.2f}{d['load'] / s['load']:9.2f}"
                  f"{(d['save'] + d['load']) / (s['save'] + s['load']):9.2f}")
            print(f"  common to both (checksums written and verified, safetensors layout): "
                  f"{statistics.median(common) * 1e3:.1f} ms")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
