"""Mixture-of-experts scheme blocks in OLMo-core (``siamesenorm.olmo_core.moe``): our MoE
``LanguageModel`` and the OLMo-core model with mapped weights route every token to the same experts
and give the same logits, auxiliary losses and training steps; OLMo-core's train module logs the
router's losses; FSDP and expert parallelism over 2 processes (gloo, ``torchrun``) give the losses
of one process; the ``olmoe-15b-a2b`` and ``tiny-moe`` configs of the entry point.

Run as a script by ``torchrun --nproc_per_node 2`` it is the worker of the 2-process test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard

pytest.importorskip("olmo_core")

import olmo_core.distributed.parallel as olmo_parallel  # noqa: E402
from olmo_core.config import DType  # noqa: E402
from olmo_core.distributed.parallel import DataParallelType  # noqa: E402
from olmo_core.nn.attention import AttentionConfig  # noqa: E402
from olmo_core.nn.feed_forward import FeedForwardConfig  # noqa: E402
from olmo_core.nn.lm_head import LMHeadConfig  # noqa: E402
from olmo_core.nn.moe import DroplessMoE, MoEConfig, MoELoadBalancingLossGranularity, MoEType  # noqa: E402
from olmo_core.nn.moe.router import MoERouterGatingFunction  # noqa: E402
from olmo_core.nn.transformer import MoETransformer  # noqa: E402
from olmo_core.nn.transformer import TransformerActivationCheckpointingMode as ACMode  # noqa: E402
from olmo_core.optim import AdamWConfig  # noqa: E402
from olmo_core.train.train_module import (  # noqa: E402
    TransformerActivationCheckpointingConfig,
    TransformerDataParallelConfig,
    TransformerExpertParallelConfig,
    TransformerTrainModuleConfig,
)

from siamesenorm.errors import ConfigError  # noqa: E402
from siamesenorm.models import LanguageModel, LMConfig  # noqa: E402
from siamesenorm.nn.moe import MoE  # noqa: E402
from siamesenorm.olmo_core import (  # noqa: E402
    PortableDroplessMLP,
    SchemeBlockConfig,
    SchemeMoEBlock,
    SchemeMoETransformer,
    SchemeTransformerConfig,
    from_siamesenorm_state_dict,
    lm_config,
    olmo_config,
    to_siamesenorm_state_dict,
)
from siamesenorm.schemes import list_schemes  # noqa: E402

VOCAB, SEQ, BATCH, DIM, EXPERTS, TOP_K, HIDDEN = 64, 16, 4, 32, 4, 2, 24
SCHEMES = {name: (name, {}) for name in list_schemes()} | {
    "siamese-hybrid_pre": ("siamese", {"form": "hybrid_pre"})}


def tiny(scheme: str = "siamese", options: dict | None = None, moe: dict | None = None, **kw) -> LMConfig:
    """Three blocks, every one an MoE of 4 SwiGLU experts, 2 per token (``moe`` overrides)."""
    return LMConfig(vocab_size=VOCAB, dim=DIM, n_layers=3, n_heads=4, max_seq_len=SEQ, scheme=scheme,
                    scheme_options=options or {}, moe={"every": 1, "n_experts": EXPERTS, "top_k": TOP_K,
                                                       "hidden": HIDDEN} | (moe or {}), **kw)


def ours(cfg: LMConfig, seed: int = 0) -> LanguageModel:
    """Our model, its norms and scheme parameters off their initial values, and its routers scaled
    up so that the routing is decisive (each token's k-th and (k+1)-th experts well apart)."""
    torch.manual_seed(seed)
    lm = LanguageModel(cfg)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if name.startswith("scheme.") or "_norm." in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("router.weight"):
                p.mul_(8.0)
    return lm.eval()


def olmo(lm: LanguageModel):
    model = olmo_config(lm.config).build()
    model.load_state_dict(from_siamesenorm_state_dict(lm.state_dict()))
    return model.eval()


def batch(seed: int = 1, rows: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def moe_inputs(model: torch.nn.Module, kind: type, x: torch.Tensor) -> list[torch.Tensor]:
    """The input of every ``kind`` module during ``model(x)``, flattened to (tokens, dim)."""
    seen: list[torch.Tensor] = []
    hooks = [m.register_forward_pre_hook(lambda _, args: seen.append(args[0].reshape(-1, DIM)))
             for m in model.modules() if isinstance(m, kind)]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return seen


# ---- the same function ---------------------------------------------------------------------
@pytest.mark.parametrize("case", SCHEMES)
def test_logits_and_routing_match_our_language_model(case):
    scheme, options = SCHEMES[case]
    lm = ours(tiny(scheme, options))
    model = olmo(lm)
    assert isinstance(model, SchemeMoETransformer) and isinstance(model, MoETransformer)
    x, y = batch()
    with torch.no_grad():
        want = lm(x, y)
        got = model(x)
        got_loss = model(x, labels=y).loss
    assert (got - want.logits).abs().max() <= 1e-6, case
    assert abs(float(got_loss) - float(want.loss)) <= 1e-6
    # every MoE sees the same input and picks the same experts with the same weights
    mine, theirs = moe_inputs(lm, MoE, x), moe_inputs(model, DroplessMoE, x)
    assert len(mine) == len(theirs) == 3
    for layer, (a, b) in enumerate(zip(mine, theirs)):
        assert (a - b).abs().max() <= 1e-5
        _, experts, weights = lm.moe_layers()[layer].route(a)
        router = model.blocks[str(layer)].feed_forward_moe.router
        their_weights, their_experts, _, _ = router(b.reshape(1, -1, DIM))
        order, their_order = experts.sort(-1), their_experts.reshape(-1, TOP_K).sort(-1)
        assert torch.equal(order.values, their_order.values), f"block {layer} routes differently"
        assert torch.allclose(weights.gather(-1, order.indices),
                              their_weights.reshape(-1, TOP_K).gather(-1, their_order.indices), atol=1e-6)
        # the routing is not degenerate, and no token sits on a tie
        assert experts.unique().numel() == EXPERTS
        logits = lm.moe_layers()[layer].router(a).sort(-1, descending=True).values
        assert (logits[:, TOP_K - 1] - logits[:, TOP_K]).min() > 1e-4


def test_the_comparison_sees_swapped_experts():
    """Swapping two experts' weights moves the logits far beyond the tolerance; swapping their
    router rows as well gives the same function again (the experts' labels are arbitrary)."""
    lm = ours(tiny())
    x, _ = batch()
    with torch.no_grad():
        want = lm(x).logits
    state = from_siamesenorm_state_dict(lm.state_dict())
    prefix = "blocks.1.feed_forward_moe."
    model = olmo_config(lm.config).build().eval()

    def swap(t: torch.Tensor) -> torch.Tensor:   # experts 0 and 1, stacked along the first dim
        e = t.clone().view(EXPERTS, -1)
        e[[0, 1]] = e[[1, 0]]
        return e.view(t.shape)

    swapped = dict(state)
    for w in ("w1", "w2", "w3"):
        swapped[prefix + "experts.mlp." + w] = swap(state[prefix + "experts.mlp." + w])
    model.load_state_dict(swapped)
    with torch.no_grad():
        assert (model(x) - want).abs().max() > 1e-4
    swapped[prefix + "router.weight"] = swap(state[prefix + "router.weight"])
    model.load_state_dict(swapped)
    with torch.no_grad():
        assert (model(x) - want).abs().max() <= 1e-6


@pytest.mark.parametrize("moe", [{"every": 2}, {"normalize": False, "top_k": 1},
                                 {"aux_loss": 0.0, "z_loss": 0.0, "hidden": None}])
def test_other_moe_options_match(moe):
    lm = ours(tiny("siamese", {"form": "hybrid_pre"}, moe, qk_norm=True, n_kv_heads=2,
                   tie_embeddings=False))
    model = olmo(lm)
    x, _ = batch()
    with torch.no_grad():
        assert (model(x) - lm(x).logits).abs().max() <= 1e-6
    dense = [k for k, b in model.blocks.items() if not isinstance(b, SchemeMoEBlock)]
    assert dense == (["0", "2"] if moe.get("every") == 2 else [])


def test_auxiliary_losses_match_ours():
    """One training forward: OLMo-core's router losses of every block against our MoE's. Its
    load-balancing loss is ours / top_k (``E / k * sum f P``); the z-losses are the same."""
    lm = ours(tiny()).train()
    model = olmo(lm).train()
    x, y = batch()
    lm(x, y)
    model(x, labels=y)
    metrics = model.compute_auxiliary_metrics(reset=True)
    for b, layer in enumerate(lm.moe_layers()):
        lb = float(metrics[f"block {b:02d}/load balancing loss unscaled"][0])
        z = float(metrics[f"block {b:02d}/router Z loss unscaled"][0])
        aux, z_ours = float(layer.aux_loss.detach()), float(layer.z_loss.detach())
        assert abs(lb * TOP_K - aux) <= 1e-5 * aux and abs(z - z_ours) <= 1e-5 * z_ours
        # the weighted ones, as OLMo-core adds them to the gradient: ours
        assert abs(float(metrics[f"block {b:02d}/load balancing loss"][0])
                   - 0.01 * aux) <= 1e-7


# ---- the map -------------------------------------------------------------------------------
@pytest.mark.parametrize("moe", [{}, {"every": 2}])
def test_the_parameter_map_round_trips_exactly(moe):
    lm = ours(tiny(moe=moe, tie_embeddings=False))
    mine, theirs = lm.state_dict(), olmo(lm).state_dict()
    back = to_siamesenorm_state_dict(from_siamesenorm_state_dict(mine))
    assert list(back) == list(mine) and all(torch.equal(back[k], mine[k]) for k in mine)
    again = from_siamesenorm_state_dict(to_siamesenorm_state_dict(theirs))
    assert set(again) == set(theirs) and all(torch.equal(again[k], theirs[k]) for k in theirs)
    # our expert e's gate is OLMo-core's w1 rows e*H .. (e+1)*H, transposed; its down is w2's rows
    b = 1 if moe.get("every") == 2 else 0       # every=2: the MoE of block 1, sublayer 3
    w1 = theirs[f"blocks.{b}.feed_forward_moe.experts.mlp.w1"]
    assert torch.equal(w1[HIDDEN:2 * HIDDEN].T, mine[f"sublayers.{2 * b + 1}.w_gate"][1])
    assert torch.equal(theirs[f"blocks.{b}.feed_forward_moe.experts.mlp.w2"][HIDDEN:2 * HIDDEN],
                       mine[f"sublayers.{2 * b + 1}.w_down"][1])
    with pytest.raises(KeyError, match="shared"):
        from_siamesenorm_state_dict(mine | {"sublayers.1.shared.gate_proj.weight": torch.ones(2, 2)})
    with pytest.raises(KeyError, match="router"):
        to_siamesenorm_state_dict({k: v for k, v in theirs.items() if not k.endswith("router.weight")})


@pytest.mark.parametrize("moe", [{}, {"every": 2}, {"normalize": False, "aux_loss": 0.0, "top_k": 3},
                                 {"z_loss": 0.0, "aux_loss": 0.03, "hidden": None}])
def test_the_config_maps_both_ways(moe):
    cfg = tiny(moe=moe)
    config = olmo_config(cfg)
    assert lm_config(config, max_seq_len=SEQ) == cfg
    again = type(config).from_dict(config.as_config_dict())
    assert again == config and again.build().state_dict().keys() == config.build().state_dict().keys()
    block = config.block_overrides[1] if moe.get("every") == 2 else config.block
    assert block.feed_forward_moe.name == MoEType.dropless
    assert block.feed_forward_moe.scale_loss_by_num_layers is False


def test_configs_without_a_counterpart_are_refused():
    with pytest.raises(ConfigError, match="shared"):
        olmo_config(tiny(moe={"shared_hidden": 16}))
    config = olmo_config(tiny())
    moe = config.block.feed_forward_moe
    for bad, says in ((moe.replace(shared_mlp=FeedForwardConfig(hidden_size=16)), "shared expert"),
                      (moe.replace(name=MoEType.default), "capacity"),
                      (moe.replace(lb_loss_granularity=MoELoadBalancingLossGranularity.instance),
                       "per-instance"),
                      (moe.replace(router=moe.router.replace(
                          gating_function=MoERouterGatingFunction.sigmoid)), "router"),
                      (moe.replace(router=moe.router.replace(normalize_expert_weights=2.0)), "sum")):
        with pytest.raises(ConfigError, match=says):
            lm_config(config.replace(block=config.block.replace(feed_forward_moe=bad)))
    # OLMo-core's loss scaled by depth maps back to our per-layer weights
    scaled = config.replace(block=config.block.replace(feed_forward_moe=moe.replace(
        scale_loss_by_num_layers=True, lb_loss_weight=moe.lb_loss_weight * 3,
        z_loss_weight=moe.z_loss_weight * 3)))
    assert lm_config(scaled, max_seq_len=SEQ).moe == tiny().moe
    with pytest.raises(ConfigError, match="dropless"):
        SchemeBlockConfig(sequence_mixer=AttentionConfig(n_heads=4),
                          feed_forward_moe=MoEConfig(name=MoEType.default, num_experts=4))
    with pytest.raises(ConfigError, match="one of them"):
        SchemeBlockConfig(sequence_mixer=AttentionConfig(n_heads=4), feed_forward=None)


# ---- what the model is made of ---------------------------------------------------------------
def test_parameter_counts_and_meta_init():
    cfg = tiny("deepnorm", moe={"every": 2}, tie_embeddings=False)
    config = olmo_config(cfg)
    lm = LanguageModel(cfg)
    model = config.build(init_device="meta")
    assert config.num_params == model.num_params == lm.num_parameters()
    assert config.num_active_params == lm.active_parameters()
    model.init_weights(device=torch.device("cpu"), max_seq_len=SEQ)
    assert torch.isfinite(model(batch()[0])).all()
    # DeepNorm: every expert matrix Xavier-normal with the branch gain, as ours
    beta = model.scheme.requires.branch_gain
    w1 = model.blocks["1"].feed_forward_moe.experts.mlp.w1.detach().view(EXPERTS, HIDDEN, DIM)
    xavier = (2.0 / (HIDDEN + DIM)) ** 0.5 * beta
    assert abs(float(w1.std()) / xavier - 1) < 0.15
    assert isinstance(model.blocks["1"].feed_forward_moe.experts, PortableDroplessMLP)


def test_unsupported_parallelism_is_refused():
    model = olmo_config(tiny()).build(init_device="meta")
    with pytest.raises(NotImplementedError, match="expert parallelism"):
        model.apply_tp(None)
    with pytest.raises(ConfigError, match="whole MoE modules"):
        model.apply_activation_checkpointing(ACMode.selected_modules, modules=["blocks.*.feed_forward_moe"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="OLMo-core's Triton MoE kernels need a GPU")
def test_olmo_cores_kernels_and_the_portable_path_agree(monkeypatch):
    pytest.importorskip("triton")
    lm = ours(tiny())
    model = olmo(lm).cuda().train()
    x, y = (t.cuda() for t in batch())
    losses, grads = [], []
    for portable in (False, True):
        if portable:
            monkeypatch.setattr(PortableDroplessMLP, "kernels_run", staticmethod(lambda x: False))
        model.zero_grad()
        loss = model(x, labels=y).loss
        loss.backward()
        losses.append(float(loss))
        grads.append(model.blocks["0"].feed_forward_moe.experts.mlp.w1.grad.clone())
    assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[1])
    assert torch.allclose(grads[0], grads[1], atol=1e-5, rtol=1e-3)


# ---- training ------------------------------------------------------------------------------
def _train_module(config, ac=None):
    return TransformerTrainModuleConfig(
        rank_microbatch_size=BATCH * SEQ, max_sequence_length=SEQ, ac_config=ac,
        optim=AdamWConfig(lr=1e-2, weight_decay=0.0)).build(config.build(init_device="meta"))


def test_training_steps_with_olmo_cores_train_module_match_ours():
    """OLMo-core's train module (its init, its AdamW, the router losses attached to the
    gradient) and our LanguageModel with the same weights under the same AdamW take the same
    steps. Heavy router-loss weights make them matter: without them ours goes elsewhere."""
    cfg = tiny("siamese", {"form": "hybrid_pre"}, moe={"aux_loss": 1.0, "z_loss": 0.1})
    x, y = batch(100)

    def ours_losses(cfg, state):
        lm = LanguageModel(cfg)
        lm.load_state_dict(state)
        opt = AdamWConfig(lr=1e-2, weight_decay=0.0).build(lm)
        out = []
        for _ in range(5):
            opt.zero_grad()
            loss = lm(x, y).loss
            loss.backward()
            opt.step()
            out.append(float(lm.loss_parts["ce_loss"]))
        return out

    tm = _train_module(olmo_config(cfg))
    state = {k: v.clone() for k, v in to_siamesenorm_state_dict(tm.model.state_dict()).items()}
    got, lb = [], []
    for _ in range(5):
        tm.zero_grads()
        loss = tm.model_forward(x, labels=y).loss
        loss.backward()
        tm.optim_step()
        got.append(float(loss.detach()))
        lb.append(float(tm.model.compute_auxiliary_metrics(reset=True)["load balancing loss"][0]))
    want = ours_losses(cfg, state)
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-5 * abs(b), (got, want)
    assert got[-1] < got[0] - 0.1 and all(v > 0 for v in lb)
    without = ours_losses(tiny("siamese", {"form": "hybrid_pre"}, moe={"aux_loss": 0.0, "z_loss": 0.0}),
                          state)
    assert max(abs(a - b) / abs(b) for a, b in zip(got, without)) > 1e-4


def test_activation_checkpointing_keeps_the_losses_and_the_router_metrics():
    """Whole MoE blocks (``full``), ``selected_ops`` and the experts alone recompute the forward
    in backward: the same losses, and the router's running sums count each forward once."""
    def run(ac):
        tm = _train_module(olmo_config(tiny()), ac)
        x, y = batch(100)
        out = []
        for _ in range(2):
            tm.zero_grads()
            loss = tm.model_forward(x, labels=y).loss
            loss.backward()
            tm.optim_step()
            metrics = tm.model.compute_auxiliary_metrics(reset=True)
            out.append((float(loss.detach()), float(metrics["load balancing loss unscaled"][0]),
                        float(metrics["router Z loss unscaled"][0]), float(metrics["load imbalance"][0])))
        return out

    want = run(None)
    for ac in (TransformerActivationCheckpointingConfig(mode=ACMode.full),
               TransformerActivationCheckpointingConfig(mode=ACMode.selected_ops),
               TransformerActivationCheckpointingConfig(mode=ACMode.selected_modules,
                                                        modules=["blocks.*.feed_forward_moe.experts"])):
        assert run(ac) == want, ac.mode


# ---- two processes: FSDP and expert parallelism ------------------------------------------------
DIST_MODES = ("fsdp", "ep")
DIST_STEPS = 4
DIST_MOE = {"aux_loss": 0.1, "z_loss": 0.01}


def run_steps(mode: str | None, steps: int = DIST_STEPS) -> dict[str, list[float]]:
    """``steps`` AdamW steps of OLMo-core's train module on a fixed sequence of global batches.
    Each half of a global batch is a micro-batch: one process runs both (gradient accumulation),
    each of 2 processes its own under ``mode`` (``fsdp``; ``ep``: HSDP with the experts split over
    the 2 ranks). Returns the global CE loss and the router's unweighted losses of every step."""
    olmo_parallel._WORLD_MESH = None   # OLMo-core builds one world mesh per process
    dp = ep = None
    if mode == "fsdp":
        dp = TransformerDataParallelConfig(name=DataParallelType.fsdp, reduce_dtype=DType.float32)
    elif mode == "ep":
        dp = TransformerDataParallelConfig(name=DataParallelType.hsdp, reduce_dtype=DType.float32,
                                           num_replicas=1, shard_degree=2)
        ep = TransformerExpertParallelConfig(degree=2)
    tm = TransformerTrainModuleConfig(
        rank_microbatch_size=BATCH // 2 * SEQ, max_sequence_length=SEQ, dp_config=dp, ep_config=ep,
        optim=AdamWConfig(lr=1e-2, weight_decay=0.0),
    ).build(olmo_config(tiny(moe=DIST_MOE)).build(init_device="meta"))
    rank, world = 0, 1
    if mode is not None:
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if mode == "ep":   # each rank holds half of every block's experts, whole
        w1 = tm.model.blocks["0"].feed_forward_moe.experts.mlp.w1
        assert isinstance(w1, DTensor) and w1.to_local().shape[0] == EXPERTS // 2 * HIDDEN
        assert any(p == Shard(0) for p in w1.placements)
    out: dict[str, list[float]] = {"ce": [], "lb": [], "z": []}
    for step in range(steps):
        x, y = batch(100 + step)
        halves = [slice(0, BATCH // 2), slice(BATCH // 2, BATCH)]
        mine = halves if world == 1 else [halves[rank]]
        tokens = torch.tensor(y.numel() // (2 if world == 2 else 1))   # the loss's divisor, a rank's
        tm.zero_grads()
        ce = torch.tensor(0.0)
        for rows in mine:
            res = tm.model_forward(x[rows], labels=y[rows], loss_reduction="sum", loss_div_factor=tokens)
            res.loss.backward()
            ce += res.ce_loss.detach()
        tm.optim_step()
        metrics = tm.model.compute_auxiliary_metrics(reset=True)
        values = torch.stack([ce, metrics["load balancing loss unscaled"][0],
                              metrics["router Z loss unscaled"][0]])
        if world > 1:
            torch.distributed.all_reduce(values)
            values /= world
        for key, v in zip(("ce", "lb", "z"), values.tolist()):
            out[key].append(v)
    return out


def _token_files(folder: Path) -> Path:
    """Two OLMo-core numpy token files (raw uint16 ids): phrases of a small vocabulary in random
    order, so that every instance differs and the routing varies between them."""
    import numpy as np
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    phrases = rng.integers(0, 255, size=(16, 8), dtype=np.uint16)
    for i in range(2):
        phrases[rng.integers(0, 16, size=400)].reshape(-1).tofile(folder / f"part-{i}.npy")
    return folder


def _entry_args(data: Path, save: Path) -> list[str]:
    # one instance per micro-batch: each rank's load-balancing loss then covers the tokens it
    # covers in one process (OLMo-core's is computed per micro-batch)
    return ["tiny-moe", "--data", str(data / "*.npy"), "--save-folder", str(save), "--steps", "4",
            "--metrics-interval", "1", "--lr", "1e-2", "--warmup", "1", "--microbatch", "1"]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[1] / "src"), os.environ.get("PYTHONPATH", "")]))


def _metrics(save: Path) -> list[dict]:
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "train/CE loss" in r]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """One ``torchrun --nproc_per_node 2`` launch (the worker below): the train module under FSDP
    and under EP, then the entry point's ``tiny-moe`` with ``--ep 2``."""
    root = tmp_path_factory.mktemp("moe2")
    data = _token_files(root / "tokens")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           __file__, str(root / "losses.json"), str(data), str(root / "ep")]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return root, data, proc.stdout + proc.stderr


def test_fsdp_and_expert_parallelism_over_two_processes_match_one_process(two_processes):
    root, _, _ = two_processes
    results = json.loads((root / "losses.json").read_text())
    want = run_steps(None)
    for mode in DIST_MODES:
        for key in ("ce", "lb", "z"):
            got = results[mode][key]
            assert len(got) == DIST_STEPS
            for i, (a, b) in enumerate(zip(got, want[key])):
                assert abs(a - b) <= 1e-5 * abs(b), f"{key} under {mode}, step {i + 1}: {got} vs {want[key]}"
    assert want["ce"][-1] < want["ce"][0]


def test_the_tiny_moe_config_trains_with_expert_parallelism_and_logs_the_router(two_processes, tmp_path):
    """The entry point: ``tiny-moe`` with ``--ep 2`` over 2 processes and in one process log the
    same losses, the router's among them."""
    root, data, log = two_processes
    assert "Applied expert parallelism" in log
    proc = subprocess.run([sys.executable, "-m", "siamesenorm", "olmo-core", "train",
                           *_entry_args(data, tmp_path / "one")],
                          env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    got, want = _metrics(root / "ep"), _metrics(tmp_path / "one")
    assert len(got) == len(want) == 4
    for key in ("train/CE loss", "train/load balancing loss", "train/router Z loss",
                "train/block 01/load balancing loss unscaled"):
        for i, (a, b) in enumerate(zip(got, want)):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), f"{key}, step {i + 1}"
    assert "train/load imbalance" in got[0] and want[-1]["train/CE loss"] < want[0]["train/CE loss"]
    keys = _checkpoint_keys(root / "ep" / "step4")
    assert "model.blocks.0.feed_forward_moe.experts.mlp.w1" in keys
    assert any(k.startswith("model.scheme.") for k in keys)


def _checkpoint_keys(step: Path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader
    return set(FileSystemReader(str(step / "model_and_optim")).read_metadata().state_dict_metadata)


def _worker(out: str, data: str, save: str) -> None:
    torch.distributed.init_process_group("gloo")
    results = {mode: run_steps(mode) for mode in DIST_MODES}
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    # the entry point in the same process group: OLMo-core's prepare_training_environment keeps
    # an initialised group (initialising a destroyed one again can hang), and its teardown ends it
    olmo_parallel._WORLD_MESH = None
    from siamesenorm.cli import main
    if main(["olmo-core", "train", *_entry_args(Path(data), Path(save)), "--ep", "2"]) != 0:
        raise SystemExit("the entry point failed")


if __name__ == "__main__":
    _worker(*sys.argv[1:4])
    # as tests/test_olmo_core.py: gloo threads can abort a finished process at interpreter exit
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---- the entry point's configs ----------------------------------------------------------------
def test_dry_run_of_olmoe_15b_a2b_with_expert_parallelism(capsys):
    from test_olmo_core import olmo_train
    assert olmo_train(["olmoe-15b-a2b", "--dry-run", "--world-size", "8", "--ep", "8"]) == 0
    out = capsys.readouterr().out
    # configs/olmoe-15b-a2b.yaml (24 blocks of 96 experts, top-8): our LanguageModel's counts
    assert "parameters: 15,109,192,704 " in out
    assert "active parameters per token: 1,821,637,632 " in out
    assert "hsdp with expert parallelism 8" in out
    assert "1024 sequences x 4096 = 4,194,304 tokens per step" in out


@pytest.mark.parametrize("args, says", [
    (["tiny", "--dry-run", "--ep", "2"], "needs an MoE config"),
    (["tiny-moe", "--dry-run", "--ep", "3"], "does not divide the 8 experts"),
    (["tiny-moe", "--dry-run", "--ep", "2", "--dp", "fsdp"], "--dp hsdp"),
    (["tiny-moe", "--dry-run", "--ep", "4", "--world-size", "2"], "does not divide the 2 ranks"),
    (["tiny-moe", "--dry-run", "--ep", "0"], "at least 1"),
])
def test_bad_expert_parallel_arguments_end_with_one_line(args, says, capsys):
    from test_olmo_core import olmo_train
    assert olmo_train(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err


def test_counts_of_a_hand_built_moe_config():
    """SchemeTransformerConfig with OLMo-core's own MoEConfig, built by hand."""
    config = SchemeTransformerConfig(
        d_model=DIM, vocab_size=VOCAB, n_layers=2, scheme="siamese",
        lm_head=LMHeadConfig(layer_norm=None, bias=False),
        block=SchemeBlockConfig(sequence_mixer=AttentionConfig(n_heads=4), feed_forward_moe=MoEConfig(
            name=MoEType.dropless, num_experts=EXPERTS, hidden_size=HIDDEN)))
    model = config.build()
    assert model.num_params == config.num_params
    assert config.num_params - config.num_active_params == 2 * 3 * (EXPERTS - 1) * HIDDEN * DIM
