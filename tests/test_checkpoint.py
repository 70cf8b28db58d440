"""The checkpoint contract (:mod:`siamesenorm.train.checkpoint`): ``save_checkpoint`` and
``load_checkpoint`` in one process (round trip, tied weights, keep_as, damage, weights only) and
across 2 CPU processes (gloo, started by the library's launcher): FSDP2 and DDP save the sharded
layout, which one process reads back; a single-process checkpoint loads into a spread model; a
damaged one is refused on every rank with the same line.

This file is also the 2-process worker: ``python test_checkpoint.py FOLDER``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from siamesenorm.errors import ConfigError
from siamesenorm.models import LanguageModel, LMConfig
from siamesenorm.train.checkpoint import (
    CHECKSUM_FILE,
    DCP_DIR,
    MODEL_FILE,
    STATE_FILE,
    checkpoint_extra,
    kept_name,
    layout,
    load_checkpoint,
    older_checkpoints,
    save_checkpoint,
)
from siamesenorm.train.optim import build_optimizer

VOCAB, SEQ, BATCH = 32, 16, 4


def lm(seed: int) -> LanguageModel:
    torch.manual_seed(seed)
    return LanguageModel(LMConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, max_seq_len=SEQ,
                                  scheme="pre"))


def tied(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False))
    net[1].weight = net[0].weight
    return net


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def stepped(model: nn.Module, seed: int = 0) -> torch.optim.Optimizer:
    """An AdamW over ``model`` after one step (so that it has state to save)."""
    opt = build_optimizer(model, 1e-2)
    if isinstance(model, nn.Sequential):
        x = torch.arange(8).view(2, 4)
        model(x).square().mean().backward()
    else:
        model(*batch(seed)).loss.backward()
    opt.step()
    opt.zero_grad()
    return opt


def optimizer_by_name(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: s for p, s in opt.state.items()}


def assert_same_state(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), what
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(got[k], v), f"{what}: {k}"
        else:
            assert got[k] == v, f"{what}: {k}"


def flip(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


# ---- one process ---------------------------------------------------------------------------------
def test_round_trip_restores_weights_optimizer_and_extra(tmp_path):
    model = lm(0)
    opt = stepped(model)
    path = tmp_path / "last"
    save_checkpoint(path, model, opt, {"step": 1, "note": "first"})
    assert sorted(os.listdir(path)) == [CHECKSUM_FILE, MODEL_FILE, STATE_FILE]
    assert layout(path) == "single" and checkpoint_extra(path) == {"step": 1, "note": "first"}
    assert torch.load(path / STATE_FILE, weights_only=True)["format"] == 1
    fresh = lm(5)
    fresh_opt = build_optimizer(fresh, 1e-2)
    assert load_checkpoint(path, fresh, fresh_opt) == {"step": 1, "note": "first"}
    assert_same_state(fresh.state_dict(), model.state_dict(), "weights")
    want, got = optimizer_by_name(model, opt), optimizer_by_name(fresh, fresh_opt)
    assert set(got) == set(want) and len(want) == len(list(model.parameters()))
    for name in want:
        assert_same_state(got[name], want[name], f"optimizer state of {name}")
    assert fresh_opt.state_dict()["param_groups"] == opt.state_dict()["param_groups"]


def test_tied_weights_are_stored_once_and_load_tied_with_their_optimizer_state(tmp_path):
    net = tied(0)
    opt = stepped(net)
    save_checkpoint(tmp_path / "c", net, opt, {})
    with safe_open(str(tmp_path / "c" / MODEL_FILE), "pt") as f:
        assert list(f.keys()) == ["0.weight"]
    fresh = tied(1)
    fresh_opt = build_optimizer(fresh, 1e-2)
    load_checkpoint(tmp_path / "c", fresh, fresh_opt)
    assert fresh[1].weight is fresh[0].weight and torch.equal(fresh[0].weight, net[0].weight)
    assert_same_state(fresh_opt.state[fresh[0].weight], opt.state[net[0].weight], "optimizer")


def test_keep_as_keeps_the_replaced_checkpoint_and_is_keyword_only(tmp_path):
    model = lm(0)
    opt = stepped(model)
    path = tmp_path / "checkpoints" / "last"
    save_checkpoint(path, model, opt, {"step": 2})
    with pytest.raises(TypeError):
        save_checkpoint(path, model, opt, {"step": 4}, kept_name(path, 2))
    save_checkpoint(path, model, opt, {"step": 4}, keep_as=kept_name(path, 2))
    assert older_checkpoints(path) == [path.parent / "step_2"]
    assert checkpoint_extra(path) == {"step": 4}
    assert checkpoint_extra(path.parent / "step_2") == {"step": 2}
    save_checkpoint(path, model, opt, {"step": 6})         # no keep_as: the step-4 one is deleted
    assert sorted(p.name for p in path.parent.iterdir()) == ["last", "step_2"]


def test_pruning_deletes_only_the_checkpoints_a_run_wrote(tmp_path):
    """A ``step_<N>`` a person made, one holding an added file, and a link to a folder elsewhere
    stay, and none counts towards ``keep``; the run's own beyond ``keep`` go."""
    from siamesenorm.train.checkpoint.keep import prune_checkpoints

    model = lm(0)
    opt = stepped(model)
    path = tmp_path / "checkpoints" / "last"
    for step, previous in ((2, None), (4, 2), (6, 4), (8, 6)):
        save_checkpoint(path, model, opt, {"step": step},
                        keep_as=kept_name(path, previous) if previous else None)
    folder = path.parent
    (folder / "step_1").mkdir()
    (folder / "step_1" / "notes.txt").write_text("mine")
    (folder / "step_4" / "notes.txt").write_text("added to a checkpoint")
    outside = tmp_path / "outside"
    (outside / "step_1").mkdir(parents=True)
    (outside / "keep.txt").write_text("x")
    (folder / "step_9").symlink_to(outside, target_is_directory=True)
    prune_checkpoints(path, keep=2)         # last + the newest one of ours: step_6
    assert sorted(p.name for p in folder.iterdir()) == ["last", "step_1", "step_4", "step_6", "step_9"]
    assert (folder / "step_1" / "notes.txt").read_text() == "mine"
    assert (outside / "keep.txt").exists() and (outside / "step_1").is_dir()
    (folder / "step_4" / "notes.txt").unlink()          # a checkpoint of ours again
    prune_checkpoints(path, keep=2)
    assert sorted(p.name for p in folder.iterdir()) == ["last", "step_1", "step_6", "step_9"]


def test_a_damaged_file_is_refused_with_one_line_and_nothing_changed(tmp_path):
    model = lm(0)
    save_checkpoint(tmp_path / "c", model, stepped(model), {"step": 1})
    flip(tmp_path / "c" / MODEL_FILE)
    fresh = lm(5)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    opt = build_optimizer(fresh, 1e-2)
    with pytest.raises(ConfigError, match=f"checkpoint {tmp_path / 'c'} is damaged: {MODEL_FILE} "
                                          "does not match") as info:
        load_checkpoint(tmp_path / "c", fresh, opt)
    assert "\n" not in str(info.value) and not opt.state
    assert_same_state(fresh.state_dict(), before, "untouched")
    with pytest.raises(ConfigError, match=f"no checkpoint at {tmp_path / 'none'}"):
        load_checkpoint(tmp_path / "none", fresh, None)


def test_the_weights_alone_load_with_no_optimizer(tmp_path):
    model = lm(0)
    save_checkpoint(tmp_path / "c", model, stepped(model), {"step": 7})
    fresh = lm(5)
    assert load_checkpoint(tmp_path / "c", fresh, None) == {"step": 7}
    assert_same_state(fresh.state_dict(), model.state_dict(), "weights")


def test_reading_a_single_process_checkpoint_imports_no_sharded_layout_library(tmp_path):
    """torch.distributed.checkpoint and torch.distributed.tensor take ~0.6 s to import, which every
    command paid at start while this module imported them at its top: they are imported where a
    sharded checkpoint is written or read. A command that reads a run's weights (generate, export)
    imports neither."""
    model = nn.Linear(2, 2)
    save_checkpoint(tmp_path / "c", model, torch.optim.AdamW(model.parameters()), {"step": 1})
    code = ("import sys, torch\n"
            "import siamesenorm.cli, siamesenorm.run\n"
            "from siamesenorm.train.checkpoint import load_checkpoint\n"
            "assert load_checkpoint(sys.argv[1], torch.nn.Linear(2, 2), None) == {'step': 1}\n"
            "libraries = ('torch.distributed.checkpoint', 'torch.distributed.tensor')\n"
            "print([m for m in libraries if m in sys.modules])")
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "c")], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ---- two processes -------------------------------------------------------------------------------
def worker(folder: Path) -> None:
    """Under 2 processes: FSDP2 and DDP each save a sharded checkpoint (``<mode>``, rank 0 also its
    full state as ``<mode>-ref.pt``), load it back into a fresh spread model and load the
    single-process checkpoints ``single`` and ``tied`` (rank 0 writes what each gave); both ranks
    try the damaged ``damaged`` and write the line they got."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from siamesenorm.parallel import init_world, leave_world, parallelize

    world, device = init_world("cpu")
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def full_state(module: nn.Module, opt: torch.optim.Optimizer | None) -> dict:
        out = {"model": get_model_state_dict(module, options=full)}
        if opt is not None:
            out["optim"] = get_optimizer_state_dict(module, opt, options=full)
        return out

    def record(name: str, state: dict) -> None:
        if world.main:
            torch.save(state, folder / name)

    try:
        for mode in ("fsdp", "ddp"):
            par = parallelize(lm(0), mode, world, device, "auto")
            opt = build_optimizer(par.model, 1e-2)
            par.module(*batch(world.rank)).loss.backward()
            opt.step()
            opt.zero_grad()
            save_checkpoint(folder / mode, par.module, opt, {"step": 1, "rank": world.rank},
                            world=world)
            record(f"{mode}-ref.pt", full_state(par.module, opt))

            again = parallelize(lm(5), mode, world, device, "auto")
            again_opt = build_optimizer(again.model, 1e-2)
            extra = load_checkpoint(folder / mode, again.module, again_opt, world=world)
            record(f"{mode}-reloaded.pt", {**full_state(again.module, again_opt), "extra": extra})

            single = parallelize(lm(5), mode, world, device, "auto")
            single_opt = build_optimizer(single.model, 1e-2)
            extra = load_checkpoint(folder / "single", single.module, single_opt, world=world)
            record(f"{mode}-from-single.pt", {**full_state(single.module, single_opt), "extra": extra})

        net = parallelize(tied(5), "fsdp", world, device, "auto")
        load_checkpoint(folder / "tied", net.module, None, world=world)
        record("tied-from-single.pt", full_state(net.module, None))

        try:
            load_checkpoint(folder / "damaged", net.module, None, world=world)
            line = "loaded"
        except ConfigError as error:
            line = str(error)
        (folder / f"damaged-rank{world.rank}.txt").write_text(line)
    finally:
        leave_world(world)


def test_two_processes_save_sharded_and_one_process_reads_it_back(tmp_path, monkeypatch):
    from siamesenorm.parallel.launch import launch

    monkeypatch.setenv("OMP_NUM_THREADS", "1")      # 2 processes share 2 cores
    model = lm(3)
    opt = stepped(model, seed=3)
    save_checkpoint(tmp_path / "single", model, opt, {"step": 9})
    net = tied(3)
    save_checkpoint(tmp_path / "tied", net, stepped(net), {"step": 9})
    shutil.copytree(tmp_path / "single", tmp_path / "damaged")
    flip(tmp_path / "damaged" / STATE_FILE)

    launch(2, [str(Path(__file__).resolve()), str(tmp_path)])

    for mode in ("fsdp", "ddp"):
        path = tmp_path / mode
        assert layout(path) == "sharded"
        assert sorted(os.listdir(path)) == [CHECKSUM_FILE, DCP_DIR, STATE_FILE]
        assert torch.load(path / STATE_FILE, weights_only=True)["format"] == 2
        assert checkpoint_extra(path) == {"step": 1, "rank": 0}             # rank 0's extra
        ref = torch.load(tmp_path / f"{mode}-ref.pt", weights_only=True)

        # the sharded checkpoint in one process, with its optimizer and without
        fresh = lm(5)
        fresh_opt = build_optimizer(fresh, 1e-2)
        assert load_checkpoint(path, fresh, fresh_opt) == {"step": 1, "rank": 0}
        assert_same_state(fresh.state_dict(), ref["model"], f"{mode} weights in one process")
        got = optimizer_by_name(fresh, fresh_opt)
        assert set(got) == set(ref["optim"]["state"])
        for name, want in ref["optim"]["state"].items():
            assert_same_state(got[name], want, f"{mode} optimizer state of {name}")
        weights_only = lm(6)
        load_checkpoint(path, weights_only, None)
        assert_same_state(weights_only.state_dict(), ref["model"], f"{mode} weights only")

        # the sharded checkpoint back into 2 processes
        reloaded = torch.load(tmp_path / f"{mode}-reloaded.pt", weights_only=True)
        assert reloaded["extra"] == {"step": 1, "rank": 0}
        assert_same_state(reloaded["model"], ref["model"], f"{mode} weights in 2 processes")
        for name, want in ref["optim"]["state"].items():
            assert_same_state(reloaded["optim"]["state"][name], want, f"{mode} optimizer {name}")

        # a single-process checkpoint into 2 processes
        spread = torch.load(tmp_path / f"{mode}-from-single.pt", weights_only=True)
        assert spread["extra"] == {"step": 9}
        assert_same_state(spread["model"], model.state_dict(), f"{mode} single into spread")
        for name, want in optimizer_by_name(model, opt).items():
            assert_same_state(spread["optim"]["state"][name], want, f"{mode} single optimizer {name}")

    spread = torch.load(tmp_path / "tied-from-single.pt", weights_only=True)
    assert torch.equal(spread["model"]["0.weight"], net[0].weight.detach())
    lines = [(tmp_path / f"damaged-rank{r}.txt").read_text() for r in (0, 1)]
    assert lines[0] == lines[1] and "\n" not in lines[0]
    assert lines[0].startswith(f"checkpoint {tmp_path / 'damaged'} is damaged: {STATE_FILE}")


if __name__ == "__main__":
    from siamesenorm.parallel import exit_process
    from siamesenorm.parallel.launch import report_failure

    try:
        worker(Path(sys.argv[1]))
    except Exception as error:
        if not report_failure(error, isinstance(error, ConfigError)):
            raise
        exit_process(2 if isinstance(error, ConfigError) else 1)
    exit_process(0)
