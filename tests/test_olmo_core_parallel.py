"""Parallel training of our schemes as OLMo-core models (``siamesenorm.olmo_core``): FSDP, DDP,
tensor parallelism (degree 2, with FSDP as OLMo-core's data-parallel config) and Ulysses context
parallelism over 2 CPU processes (gloo, ``torchrun``), each with and without activation
checkpointing, give one process's losses and gradients; a run saved at step 2 with OLMo-core's
checkpointer and resumed (under TP, and re-sharded to FSDP) continues with the uninterrupted
run's losses; the training entry hands ``--tp``/``--cp`` to OLMo-core and refuses what it cannot
run with one line (it trains under ``--tp 2`` as one process does: tests/test_olmo_core.py, beside
the one-process run it compares with).

Run as a script by ``torchrun --nproc_per_node 2`` it is the worker: one launch trains every
configuration in turn (``PLAN``) and writes what it saw to a JSON file.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("olmo_core")

import olmo_core.distributed.parallel as olmo_parallel  # noqa: E402
from olmo_core.config import DType  # noqa: E402
from olmo_core.distributed.parallel import DataParallelType  # noqa: E402
from olmo_core.nn.attention import Attention  # noqa: E402
from olmo_core.nn.feed_forward import FeedForward  # noqa: E402
from olmo_core.optim import AdamWConfig  # noqa: E402
from olmo_core.train.train_module import (  # noqa: E402
    TransformerActivationCheckpointingConfig,
    TransformerContextParallelConfig,
    TransformerDataParallelConfig,
    TransformerTensorParallelConfig,
    TransformerTrainModuleConfig,
)
from torch.distributed.tensor import DTensor, Shard  # noqa: E402

from siamesenorm.errors import ConfigError  # noqa: E402
from siamesenorm.olmo_core import olmo_config  # noqa: E402
from test_olmo_core import BATCH, SEQ, batch, tiny  # noqa: E402

CASES = {"pre": ("pre", {}), "siamese": ("siamese", {}),
         "siamese-hybrid_pre": ("siamese", {"form": "hybrid_pre"}),   # QKV-norm: v_norm under TP
         # stacked streams whose reset writes plain tensors into slices; a stream a block passes on
         "hyper": ("hyper", {}), "spannorm": ("spannorm", {}),
         "attn_res": ("attn_res", {"block_size": 2})}              # a state that grows
# TP and CP need a data-parallel config in OLMo-core: FSDP, one data-parallel rank here
LAYOUTS = {"fsdp": {"dp": "fsdp"}, "ddp": {"dp": "ddp"}, "tp": {"dp": "fsdp", "tp": 2},
           "cp": {"dp": "fsdp", "cp": 2}, "cp+ddp": {"dp": "ddp", "cp": 2}}
AC = {"none": None, "full": {"mode": "full"}, "selected_ops": {"mode": "selected_ops"},
      "selected_blocks": {"mode": "selected_blocks", "block_interval": 2},
      "selected_modules": {"mode": "selected_modules", "modules": ["blocks.*.feed_forward"]}}
PLAN = ([(case, layout, ac) for case in ("pre", "siamese") for layout in ("fsdp", "ddp", "tp", "cp")
         for ac in ("none", "full")]
        + [("siamese", "cp+ddp", "none"), ("siamese-hybrid_pre", "tp", "none"),
           ("siamese-hybrid_pre", "fsdp", "none"), ("siamese-hybrid_pre", "ddp", "none"),
           ("siamese-hybrid_pre", "tp", "selected_ops"), ("siamese-hybrid_pre", "cp", "none"),
           ("hyper", "fsdp", "none"), ("hyper", "tp", "none"), ("spannorm", "tp", "full"),
           ("attn_res", "tp", "full"), ("attn_res", "cp", "none")])
STEPS, SAVE_AT, LAYERS = 4, 2, 3     # tiny(): 3 blocks


def train_module(case: str, layout: dict | None = None, ac: str = "none", seed: int = 0):
    """OLMo-core's train module of the tiny ``case`` model under ``layout`` and ``ac``."""
    olmo_parallel._WORLD_MESH = None   # OLMo-core keeps one world mesh per process
    layout = layout or {}
    scheme, options = CASES[case]
    dp = layout.get("dp")
    return TransformerTrainModuleConfig(
        rank_microbatch_size=BATCH * SEQ, max_sequence_length=SEQ,
        optim=AdamWConfig(lr=1e-2, weight_decay=0.0),
        dp_config=None if dp is None else TransformerDataParallelConfig(
            name=DataParallelType(dp), reduce_dtype=DType.float32),
        tp_config=TransformerTensorParallelConfig(degree=layout["tp"]) if "tp" in layout else None,
        cp_config=TransformerContextParallelConfig.ulysses(layout["cp"]) if "cp" in layout else None,
        ac_config=None if AC[ac] is None else TransformerActivationCheckpointingConfig(**AC[ac]),
    ).build(olmo_config(tiny(scheme, options), init_seed=seed).build(init_device="meta"))


def _world_mean(x: torch.Tensor) -> float:
    """The mean over the ranks: data-parallel ranks hold halves of the batch, context-parallel
    ranks halves of each sequence (equal token counts), tensor-parallel ranks the same loss."""
    x = (x.full_tensor() if isinstance(x, DTensor) else x).detach().clone()
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(x)
        x /= torch.distributed.get_world_size()
    return float(x)


def _grad_norms(model: torch.nn.Module) -> dict[str, float]:
    out = {}
    for name, p in model.named_parameters():   # the same order on every rank (full_tensor is collective)
        g = p.grad
        if g is not None:
            g = g.full_tensor() if isinstance(g, DTensor) else g
            out[name.replace("_checkpoint_wrapped_module.", "")] = float(g.norm())
    return out


def steps(tm, first: int, last: int) -> dict:
    """AdamW steps ``first``..``last`` (1-based) on fixed global batches; each data-parallel rank
    takes its rows. The global losses, the gradients' norms of step ``first`` and how often the
    attentions and feed-forwards ran in that step (activation checkpointing runs them twice)."""
    group = tm.dp_process_group
    rank, world = (0, 1) if group is None else (torch.distributed.get_rank(group),
                                                torch.distributed.get_world_size(group))
    calls = {"attention": 0, "feed_forward": 0}
    # pre-hooks: a recomputation stops once it has what backward needs, inside the last sublayer
    kinds = {"attention": Attention, "feed_forward": FeedForward}
    hooks = [m.register_forward_pre_hook(lambda *_, k=key: calls.__setitem__(k, calls[k] + 1))
             for m in tm.model.modules() for key, kind in kinds.items() if isinstance(m, kind)]
    out: dict = {"losses": []}
    for step in range(first, last + 1):
        x, y = batch(100 + step)
        rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        tm.zero_grads()
        loss = tm.model_forward(x[rows], labels=y[rows]).loss
        loss.backward()
        if step == first:
            out["grad_norms"], out["calls"] = _grad_norms(tm.model), dict(calls)
            for h in hooks:
                h.remove()
        tm.optim_step()
        out["losses"].append(_world_mean(loss))
    return out


def reference(case: str, ac: str = "none") -> dict:
    return steps(train_module(case, ac=ac), 1, STEPS)


def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    return abs(a - b) <= rel * abs(b) + 1e-9


# ---- one process: activation checkpointing of tuple streams ----------------------------------
@pytest.mark.parametrize("case", ["siamese", "pre", "attn_res"])
def test_every_activation_checkpointing_mode_recomputes_and_keeps_the_losses(case):
    """OLMo-core wraps whole blocks (``full``, ``selected_blocks``), chosen modules or the ops of
    each block; the scheme's state (SiameseNorm's two streams) passes through the wrappers, the
    wrapped sublayers run again in backward, and losses and gradients do not change."""
    want = reference(case)
    assert want["calls"] == {"attention": LAYERS, "feed_forward": LAYERS}
    recomputed = {"full": (LAYERS, LAYERS), "selected_ops": (LAYERS, LAYERS),
                  "selected_blocks": (2, 2),                # blocks 0 and 2 of 3
                  "selected_modules": (0, LAYERS)}          # blocks.*.feed_forward
    for ac, (att, ff) in recomputed.items():
        got = reference(case, ac)
        assert got["losses"] == want["losses"], ac
        assert got["grad_norms"].keys() == want["grad_norms"].keys()
        assert all(_close(got["grad_norms"][k], v) for k, v in want["grad_norms"].items()), ac
        assert got["calls"] == {"attention": LAYERS + att, "feed_forward": LAYERS + ff}, ac


def test_checkpointing_the_schemes_modules_is_refused():
    """The scheme's norms are read by ``scheme.step``, not called: wrapping them would rename
    their parameters and save nothing, so a ``selected_modules`` pattern that reaches them is
    refused in one line; one that names blocks or their sublayers is not."""
    for modules in (["scheme"], ["scheme.pre_norm.*"], ["*norm*"]):
        with pytest.raises(ConfigError, match="scheme's modules") as err:
            _ac_model(modules)
        assert "\n" not in str(err.value)
    _ac_model(["blocks.1", "blocks.*.attention"])


def _ac_model(modules: list[str]):
    model = olmo_config(tiny("siamese")).build(init_device="meta")
    model.apply_activation_checkpointing(AC["selected_modules"]["mode"], modules=modules)
    return model


# ---- two processes ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def worker(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("parallel")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[1] / "src"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           __file__, str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def one_process() -> dict:
    return {case: reference(case) for case in CASES}


@pytest.mark.parametrize("case, layout, ac", PLAN)
def test_two_processes_match_one_process(worker, one_process, case, layout, ac):
    """FSDP, DDP, TP and CP over 2 processes: the global losses of one process with the same
    global batch (1e-5 relative), every parameter's gradient norm at step 1 (the replicated
    scheme parameters and v_norm under TP included), and the recomputation when checkpointing."""
    got, want = worker[f"{case}/{layout}/{ac}"], one_process[case]
    assert len(got["losses"]) == STEPS
    for i, (a, b) in enumerate(zip(got["losses"], want["losses"])):
        assert _close(a, b), f"{case} under {layout}/{ac}, step {i + 1}: {got['losses']} vs {want['losses']}"
    assert got["grad_norms"].keys() == want["grad_norms"].keys()
    for name, norm in want["grad_norms"].items():
        assert _close(got["grad_norms"][name], norm), (name, got["grad_norms"][name], norm)
    again = LAYERS if ac != "none" else 0
    assert got["calls"] == {"attention": LAYERS + again, "feed_forward": LAYERS + again}
    if layout == "fsdp":
        assert got["all_dtensor"]


def test_no_scheme_block_warns_of_returned_views(worker):
    """FSDP2 warns when a wrapped block returns a view (an in-place op on it would skip the
    all-gather). Scheme blocks return views under TP (DTensor.to_local) and with Attention
    Residuals (earlier outputs passed on); the equalities above show them harmless, so the warning
    is ignored for scheme blocks, and for them only."""
    from siamesenorm.olmo_core.model import SCHEME_BLOCK_VIEW_WARNING

    assert worker["view_warnings"] == []
    said = "FSDP2-wrapped module ({}) returned a view tensor."
    assert re.search(SCHEME_BLOCK_VIEW_WARNING, said.format("FSDPSchemeBlock"))
    assert not re.search(SCHEME_BLOCK_VIEW_WARNING, said.format("FSDPAttention"))


def test_tensor_parallelism_shards_the_sublayers_and_replicates_the_scheme(worker):
    """Under TP the q/k/v and w1/w3 weights are split by rows (Shard(0)), the output projections
    by columns (Shard(1)), and every parameter of the scheme and v_norm is a replicated DTensor."""
    layout = worker["tp_layout"]
    assert all(layout[f"blocks.0.{name}.weight"] == "S(0)"
               for name in ("attention.w_q", "attention.w_v", "feed_forward.w1", "feed_forward.w3"))
    assert all(layout[f"blocks.0.{name}.weight"] == "S(1)"
               for name in ("attention.w_out", "feed_forward.w2"))
    assert layout["blocks.0.attention.v_norm.weight"] == "R"
    scheme = {k: v for k, v in layout.items() if k.startswith("scheme.")}
    assert scheme and set(scheme.values()) == {"R"}, scheme


def test_a_checkpoint_resumes_with_the_uninterrupted_losses(worker, one_process):
    """Saved at step 2 with OLMo-core's checkpointer under TP, loaded into a model initialised
    differently (under TP again, and re-sharded under FSDP over 2 ranks), steps 3 and 4 take the
    uninterrupted run's losses; the checkpoint holds the scheme's parameters under their names."""
    uninterrupted = worker["siamese-hybrid_pre/tp/none"]["losses"]
    assert worker["resume/tp"]["losses"] == uninterrupted[SAVE_AT:]
    for a, b in zip(worker["resume/fsdp"]["losses"], uninterrupted[SAVE_AT:]):
        assert _close(a, b)
    # a model that did not load takes other losses: the comparison can fail
    assert not _close(worker["fresh/tp"]["losses"][0], uninterrupted[SAVE_AT], rel=1e-3)
    assert "model.scheme.x_gain.0" in worker["checkpoint_keys"]
    assert "model.blocks.0.attention.v_norm.weight" in worker["checkpoint_keys"]


def test_what_two_processes_cannot_do_is_refused(worker):
    """DDP of a tensor-parallel model (OLMo-core's own Transformer trains to wrong losses that
    way) is refused in one line; OLMo-core's pipeline parallelism does not run on CPU even for
    its own Transformer (its schedules need CUDA), which is why ours is refused."""
    assert worker["tp+ddp"].startswith("UserError: DDP of a tensor-parallel model")
    assert "CUDA" in worker["pp_stock"], worker["pp_stock"]


# ---- the model's own refusals ------------------------------------------------------------------
class _Mesh:
    def __init__(self, n: int) -> None:
        self.n = n

    def size(self) -> int:
        return self.n


def test_tensor_parallel_layouts_it_cannot_take_are_refused():
    model = olmo_config(tiny("siamese")).build(init_device="meta")
    block = model.blocks["0"]
    with pytest.raises(ConfigError, match="replicated over the TP group"):
        block.apply_tp(_Mesh(2), input_layout=Shard(1))
    with pytest.raises(ConfigError, match="degree 3 does not divide the 4 heads"):
        model.apply_tp(_Mesh(3))
    with pytest.raises(NotImplementedError, match="pipeline parallelism .* one tensor .* CUDA"):
        model.apply_pp(None)


# ---- the training entry --------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    import numpy as np
    folder = tmp_path_factory.mktemp("tokens")
    rng = np.random.default_rng(0)
    for i in range(2):   # raw uint16 ids below the tiny config's vocabulary, repeated runs
        np.tile(rng.integers(0, 255, size=32, dtype=np.uint16), 96).tofile(folder / f"part-{i}.npy")
    return str(folder / "*.npy")


def test_the_entry_hands_tensor_and_context_parallelism_to_olmo_core(tokens, tmp_path):
    """``--tp`` and ``--cp`` become OLMo-core's TP config and its Ulysses CP config (which the
    worker above trains with); a TP/CP group reads one micro-batch, so the batch check counts the
    data-parallel ranks only."""
    from olmo_core.nn.attention.ring import UlyssesContextParallelStyle

    from siamesenorm.cli import build_parser
    from siamesenorm.commands.olmo_train import resolve
    from siamesenorm.olmo_core.train import build_experiment
    for flags, tp, cp in ((["--tp", "2"], 2, None), (["--cp", "2"], None, 2)):
        args = build_parser().parse_args(["olmo-core", "train", "tiny", "--data", tokens, "--save-folder",
                                          str(tmp_path), *flags])
        tm = build_experiment(args, resolve(args), world=2)["train_module"]
        assert (tm.tp_config and tm.tp_config.degree) == tp and tm.dp_config.name == "fsdp"
        assert (tm.cp_config and tm.cp_config.degree) == cp
        assert cp is None or isinstance(tm.cp_config.uly, UlyssesContextParallelStyle)


@pytest.mark.parametrize("args, says", [
    (["olmo-1b", "--pp", "2"], "pipeline parallelism of a SchemeTransformer is not supported"),
    (["olmo-1b", "--dry-run", "--world-size", "8", "--tp", "3"], "does not divide the 16 heads"),
    (["olmo-1b", "--dry-run", "--world-size", "8", "--tp", "2", "--dp", "ddp"], "--dp fsdp or hsdp"),
    (["olmo-1b", "--dry-run", "--world-size", "8", "--tp", "2", "--dp", "none"], "--dp fsdp or hsdp"),
    (["olmo-1b", "--dry-run", "--world-size", "6", "--tp", "4"], "multiple of 4 ranks"),
    (["olmo-1b", "--dry-run", "--world-size", "6", "--tp", "2", "--cp", "2"], "multiple of 4 ranks"),
    (["olmo-1b", "--dry-run", "--world-size", "8", "--cp", "3"], "3 does not divide 16"),
    (["olmo-1b", "--dry-run", "--world-size", "32", "--tp", "4", "--cp", "8"], "32 does not divide 16"),
    (["olmo-1b", "--dry-run", "--world-size", "8", "--cp", "2", "--dp", "none"], "data-parallel config"),
    (["olmo-1b", "--tp", "0"], "at least 1"),
    (["tiny", "--tp", "2"], "multiple of 2 ranks"),
])
def test_unsupported_parallelism_ends_with_one_line_and_status_2(args, says, capsys):
    from test_olmo_core import olmo_train
    assert olmo_train(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err


def test_context_parallelism_on_cpu_must_span_every_rank(monkeypatch, capsys):
    """On CPU, torch's gloo all_to_all fails inside a sub-group (tried: TP 2 x CP 2 over 4
    processes), so ``--cp`` below the world size is refused before any work starts."""
    from test_olmo_core import olmo_train as main
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    assert main(["tiny", "--cp", "2", "--data", "x", "--save-folder", "y"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--cp must span every rank" in err, err


def test_the_dry_run_counts_data_parallel_ranks_under_tensor_parallelism(capsys):
    from test_olmo_core import olmo_train
    assert olmo_train(["olmo-1b", "--dry-run", "--world-size", "8", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "4 ranks x micro-batch 8 x 64 accumulation" in out
    assert "parallelism: tensor 2 x context 1 x data 4 ranks" in out


# ---- the worker --------------------------------------------------------------------------------
def _layout(model: torch.nn.Module) -> dict[str, str]:
    """Each parameter's placement over the TP mesh (the last mesh dimension; FSDP's comes first)."""
    return {n: str(w.placements[-1]) if isinstance(w, DTensor) else "local"
            for n, w in model.named_parameters()}


def _try(fn) -> str:
    try:
        fn()
    except Exception as err:   # noqa: BLE001 - the worker reports what went wrong
        return f"{type(err).__name__}: {err}".splitlines()[0]
    return "ran"


def _stock_pipeline() -> None:
    """OLMo-core's own Transformer under its pipeline parallelism (2 stages, FSDP)."""
    from olmo_core.distributed.parallel import PipelineScheduleType
    from olmo_core.nn.transformer import TransformerConfig
    from olmo_core.train.train_module import TransformerPipelineParallelConfig
    olmo_parallel._WORLD_MESH = None
    tm = TransformerTrainModuleConfig(
        rank_microbatch_size=2 * SEQ, max_sequence_length=SEQ, optim=AdamWConfig(lr=1e-2),
        dp_config=TransformerDataParallelConfig(name=DataParallelType.fsdp, reduce_dtype=DType.float32),
        pp_config=TransformerPipelineParallelConfig(
            degree=2, schedule=PipelineScheduleType.custom_interleaved_1F1B,
            use_custom_stage_implementation=True),
    ).build(TransformerConfig.llama_like(d_model=32, vocab_size=64, n_layers=4, n_heads=4)
            .build(init_device="meta"))
    tm._trainer = type("Trainer", (), {"global_batch_size": BATCH * SEQ,
                                       "dp_process_group": tm.dp_process_group})()
    tm.pre_train()   # builds the schedule


def _worker(out: str) -> None:
    from olmo_core.train.checkpoint import Checkpointer
    from torch.distributed.checkpoint import FileSystemReader
    torch.distributed.init_process_group("gloo")
    rank0 = torch.distributed.get_rank() == 0
    results: dict = {}
    try:
        results["view_warnings"] = []
        for case, layout, ac in PLAN:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                tm = train_module(case, LAYOUTS[layout], ac)
                if (case, layout, ac) == ("siamese-hybrid_pre", "tp", "none"):
                    results["tp_layout"] = _layout(tm.model)
                results[f"{case}/{layout}/{ac}"] = steps(tm, 1, STEPS)
                # FSDP shards every parameter: the blocks' and the root's (embedding, scheme, head)
                results[f"{case}/{layout}/{ac}"]["all_dtensor"] = all(
                    isinstance(p, DTensor) for p in tm.model.parameters())
            results["view_warnings"] += sorted({f"{case}/{layout}/{ac}: {str(w.message)[:45]}" for w in caught
                                                if "view tensor" in str(w.message)})
        # save at step 2 under TP; resume under TP and under FSDP, from a differently seeded init
        folder = Path(out) / "checkpoint"
        tm = train_module("siamese-hybrid_pre", LAYOUTS["tp"])
        steps(tm, 1, SAVE_AT)
        checkpointer = Checkpointer(work_dir=Path(out) / "work", save_overwrite=True)
        checkpointer.save(folder, tm, {"global_step": SAVE_AT})
        results["checkpoint_keys"] = sorted(
            FileSystemReader(str(folder / "model_and_optim")).read_metadata().state_dict_metadata)
        for layout in ("tp", "fsdp"):
            tm = train_module("siamese-hybrid_pre", LAYOUTS[layout], seed=1)
            checkpointer.load(folder, tm, load_trainer_state=False)
            results[f"resume/{layout}"] = steps(tm, SAVE_AT + 1, STEPS)
        results["fresh/tp"] = steps(train_module("siamese-hybrid_pre", LAYOUTS["tp"], seed=1),
                                    SAVE_AT + 1, STEPS)
        results["tp+ddp"] = _try(lambda: train_module("siamese", {"dp": "ddp", "tp": 2}))
        results["pp_stock"] = _try(_stock_pipeline)
        if rank0:
            (Path(out) / "results.json").write_text(json.dumps(results))
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1])
    # as test_olmo_core's worker: gloo threads that FSDP/DDP referenced can abort a finished
    # process at interpreter teardown; end without it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
