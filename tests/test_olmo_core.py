"""The OLMo-core integration (``siamesenorm.olmo_core``): every scheme as an OLMo-core Transformer
gives our LanguageModel's logits with the mapped weights, the parameter map round-trips, a tiny
model trains with OLMo-core's optimizer and train module, and ``siamesenorm olmo-core train`` trains
under FSDP and under tensor parallelism over 2 processes (gloo, ``torchrun``) as one process does.
FSDP, DDP, TP and CP of the train module itself: tests/test_olmo_core_parallel.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("olmo_core")

import olmo_core.distributed.parallel as olmo_parallel  # noqa: E402
from olmo_core.config import DType  # noqa: E402
from olmo_core.nn.attention import Attention  # noqa: E402
from olmo_core.nn.transformer import TransformerActivationCheckpointingMode as ACMode  # noqa: E402
from olmo_core.nn.transformer import TransformerBlockConfig, TransformerConfig  # noqa: E402
from olmo_core.optim import AdamWConfig  # noqa: E402
from olmo_core.train.train_module import (  # noqa: E402
    TransformerActivationCheckpointingConfig,
    TransformerTrainModuleConfig,
)

from siamesenorm.errors import ConfigError  # noqa: E402
from siamesenorm.models import LanguageModel, LMConfig  # noqa: E402
from siamesenorm.olmo_core import (  # noqa: E402
    QKVNormAttention,
    SchemeTransformer,
    from_language_model,
    from_siamesenorm_state_dict,
    head_norm_config,
    lm_config,
    olmo_config,
    to_language_model,
    to_siamesenorm_state_dict,
)
from siamesenorm.schemes import build_scheme, list_schemes  # noqa: E402

VOCAB, SEQ, BATCH = 64, 16, 4
# every registered scheme with its defaults (SiameseNorm: post_pre), and SiameseNorm's OLMo form
SCHEMES = {name: (name, {}) for name in list_schemes()} | {
    "siamese-hybrid_pre": ("siamese", {"form": "hybrid_pre"})}
# model options around the scheme: rmsnorm, tied, no QK-norm, MHA / layernorm, untied, QK-norm, GQA
# with biases
SHAPES = {"plain": {}, "qk-gqa-untied": {"qk_norm": True, "n_kv_heads": 2, "tie_embeddings": False,
                                         "norm": "layernorm", "bias": True, "rope_theta": 500000.0}}


def tiny(scheme: str, options: dict | None = None, **kw) -> LMConfig:
    return LMConfig(vocab_size=VOCAB, dim=32, n_layers=3, n_heads=4, max_seq_len=SEQ, scheme=scheme,
                    scheme_options=options or {}, **kw)


def ours(cfg: LMConfig, seed: int = 0) -> LanguageModel:
    """Our model with its norms and scheme parameters moved off their initial values (ones and
    zeros hide a swapped norm) and its biases nonzero."""
    torch.manual_seed(seed)
    lm = LanguageModel(cfg)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if name.startswith("scheme.") or "_norm." in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    return lm.eval()


def olmo(lm: LanguageModel) -> SchemeTransformer:
    model = olmo_config(lm.config).build()
    model.load_state_dict(from_siamesenorm_state_dict(lm.state_dict()))
    return model.eval()


def batch(seed: int = 1, rows: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


# ---- the same function ---------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("case", SCHEMES)
def test_logits_and_loss_match_our_language_model(case, shape):
    scheme, options = SCHEMES[case]
    lm = ours(tiny(scheme, options, **SHAPES[shape]))
    model = olmo(lm)
    x, y = batch()
    with torch.no_grad():
        want = lm(x, y)
        got = model(x)
        got_loss = model(x, labels=y).loss
    assert got.shape == want.logits.shape
    assert (got - want.logits).abs().max() <= 1e-6, case
    assert abs(float(got_loss) - float(want.loss)) <= 1e-6


# OLMo2's attention: a QK-norm over all heads at once, a head size of its own (not dim // n_heads)
OLMO2_SHAPE = {"qk_norm": True, "qk_norm_per_head": False, "head_size": 6, "n_kv_heads": 2}


@pytest.mark.parametrize("case", ["pre", "siamese", "hybridnorm"])
def test_olmo2s_whole_width_qk_norm_and_head_size_match_ours(case):
    """Both carry it (hybridnorm's per-head QKV-norm takes the QK-norm's place); the config maps
    both ways; the QK-norm's weights span all heads."""
    scheme, options = SCHEMES[case]
    cfg = tiny(scheme, options, **OLMO2_SHAPE)
    lm = ours(cfg)
    model = olmo(lm)
    att = model.blocks["0"].attention
    assert att.head_dim == 6 and att.w_q.weight.shape == (24, 32) and att.w_out.weight.shape == (32, 24)
    assert att.q_norm.weight.shape == ((24,) if case != "hybridnorm" else (6,))
    assert att.k_norm.weight.shape == ((12,) if case != "hybridnorm" else (6,))
    x, _ = batch()
    with torch.no_grad():
        assert (model(x) - lm(x).logits).abs().max() <= 1e-6
    assert lm_config(olmo_config(cfg), max_seq_len=SEQ) == cfg
    assert olmo_config(cfg).num_params == LanguageModel(cfg).num_parameters()


def test_the_comparison_sees_a_wrong_map():
    """Swapping two maps of the feed-forward, or two of the scheme's norms, moves the logits far
    beyond the tolerance: the comparison above is not vacuous."""
    lm = ours(tiny("siamese"))
    x, _ = batch()
    with torch.no_grad():
        want = lm(x).logits
        for a, b in (("blocks.0.feed_forward.w1.weight", "blocks.0.feed_forward.w3.weight"),
                     ("scheme.pre_norm.0.weight", "scheme.post_norm.0.weight")):
            state = from_siamesenorm_state_dict(lm.state_dict())
            state[a], state[b] = state[b], state[a]
            model = olmo_config(lm.config).build()
            model.load_state_dict(state)
            assert (model.eval()(x) - want).abs().max() > 1e-4, (a, b)


def test_whole_models_move_both_ways():
    lm = ours(tiny("siamese", {"form": "hybrid_pre"}, tie_embeddings=False))
    model, config = from_language_model(lm)
    back = to_language_model(model, config, max_seq_len=SEQ).eval()
    x, _ = batch()
    with torch.no_grad():
        assert torch.equal(back(x).logits, lm(x).logits)
    assert back.config == lm.config


# ---- the map -------------------------------------------------------------------------------
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("case", ["pre", "siamese-hybrid_pre", "hyper"])
def test_the_parameter_map_round_trips_exactly(case, tied):
    scheme, options = SCHEMES[case]
    lm = ours(tiny(scheme, options, tie_embeddings=tied, qk_norm=True, bias=True))
    mine = lm.state_dict()
    theirs = olmo(lm).state_dict()
    # ours -> OLMo-core -> ours
    back = to_siamesenorm_state_dict(from_siamesenorm_state_dict(mine))
    assert list(back) == list(mine) and all(torch.equal(back[k], mine[k]) for k in mine)
    # OLMo-core -> ours -> OLMo-core (its own state dict, the tied head included)
    again = from_siamesenorm_state_dict(to_siamesenorm_state_dict(theirs))
    assert set(again) == set(theirs) and all(torch.equal(again[k], theirs[k]) for k in theirs)
    assert ("lm_head.weight" in to_siamesenorm_state_dict(theirs)) == (not tied)
    assert ("lm_head.w_out.weight" in theirs) and set(theirs) == set(olmo_config(lm.config).build()
                                                                      .state_dict())


def test_the_map_names_every_parameter_and_refuses_unknown_ones():
    lm = ours(tiny("siamese", {"form": "hybrid_pre"}, qk_norm=True, tie_embeddings=False))
    theirs = olmo(lm).state_dict()
    assert sorted(to_siamesenorm_state_dict(theirs)) == sorted(lm.state_dict())
    with pytest.raises(KeyError, match="blocks.0.attention_norm.weight"):
        to_siamesenorm_state_dict(theirs | {"blocks.0.attention_norm.weight": torch.ones(32)})
    shared = "sublayers.1.shared.gate_proj.weight"   # an MoE's shared expert (MoE: test_olmo_core_moe)
    with pytest.raises(KeyError, match=shared):
        from_siamesenorm_state_dict(lm.state_dict() | {shared: torch.ones(2, 32)})


@pytest.mark.parametrize("shape", SHAPES)
def test_the_config_maps_both_ways(shape):
    cfg = tiny("siamese", {"form": "hybrid_pre"}, **SHAPES[shape])
    config = olmo_config(cfg)
    assert lm_config(config, max_seq_len=SEQ) == cfg
    # the serialised config (OLMo-core's own format) builds the same model
    again = type(config).from_dict(config.as_config_dict())
    assert again == config


def test_configs_without_a_counterpart_are_refused():
    with pytest.raises(ConfigError, match="swiglu"):
        olmo_config(tiny("pre", mlp="gelu"))
    with pytest.raises(ConfigError, match="dropout"):
        olmo_config(tiny("pre", dropout=0.1))
    with pytest.raises(ConfigError, match="shared"):   # the MoE map: tests/test_olmo_core_moe.py
        olmo_config(tiny("pre", moe={"every": 1, "n_experts": 4, "top_k": 2, "shared_hidden": 8}))
    if "family" in LMConfig.__dataclass_fields__:
        with pytest.raises(ConfigError, match="family"):
            olmo_config(tiny("pre", family="qwen3"))
    with pytest.raises(ConfigError, match="model.value_residual=true is not available with the OLMo-core"):
        olmo_config(tiny("pre", value_residual=True))
    with pytest.raises(ConfigError, match="model.embed_scale=sqrt_dim is not available with the OLMo-core"):
        olmo_config(tiny("pre", embed_scale="sqrt_dim"))
    config = olmo_config(tiny("pre", qk_norm=True))
    gains = replace(config.block.sequence_mixer, qk_norm_per_head_gains=True)
    with pytest.raises(ConfigError, match="no LMConfig counterpart: a QK-norm gain per head"):
        lm_config(replace(config, block=replace(config.block, sequence_mixer=gains)))


def test_a_qk_norm_that_differs_only_in_its_parameters_dtype_converts_and_others_name_the_field():
    """OLMo-2-style configs give their per-head QK-norm dtype=float32 where ours leaves None; the
    parameters are float32 either way, so it converts. Any other difference is named, field by field."""
    config = olmo_config(tiny("siamese", qk_norm=True))
    att = config.block.sequence_mixer

    def with_norm(**change):
        norm = replace(att.qk_norm, **change)
        return replace(config, block=replace(config.block, sequence_mixer=replace(att, qk_norm=norm)))

    assert lm_config(with_norm(dtype=DType.float32)).qk_norm
    refusal = r"a QK-norm other than the scheme's norm: eps=1e-06 \(ours: 1e-05\)$"
    with pytest.raises(ConfigError, match=refusal):
        lm_config(with_norm(eps=1e-6))


# ---- what the model is made of ---------------------------------------------------------------
def test_blocks_are_olmo_core_modules_and_honour_the_schemes_qkv_norm():
    for case, want_qkv in (("pre", False), ("hybridnorm", True), ("siamese-hybrid_pre", True)):
        scheme, options = SCHEMES[case]
        model = olmo_config(tiny(scheme, options)).build()
        for block in model.blocks.values():
            assert isinstance(block.attention, Attention)
            assert isinstance(block.attention, QKVNormAttention) == want_qkv
            assert block.scheme is model.scheme
        # the scheme is the model's alone: no block holds its parameters
        names = [n for n, _ in model.named_parameters()]
        assert not any(n.startswith("blocks.") and ".scheme." in n for n in names)


@pytest.mark.parametrize("case", SCHEMES)
def test_parameter_and_flop_counts(case):
    scheme, options = SCHEMES[case]
    cfg = tiny(scheme, options, qk_norm=True, tie_embeddings=False)
    config = olmo_config(cfg)
    model = config.build(init_device="meta")
    assert config.num_params == model.num_params == LanguageModel(cfg).num_parameters()
    # attention, feed-forward and head FLOPs are OLMo-core's: those of its stock Transformer
    stock = TransformerConfig(
        d_model=config.d_model, vocab_size=VOCAB, n_layers=config.n_layers, lm_head=config.lm_head,
        block=TransformerBlockConfig(sequence_mixer=config.block.sequence_mixer,
                                     feed_forward=config.block.feed_forward,
                                     layer_norm=head_norm_config("rmsnorm", 1e-5)),
    ).build(init_device="meta")
    if not model.scheme.requires.qkv_norm_blocks:   # QKV-norm adds v_norm's few parameters
        assert model.num_flops_per_token(SEQ) == stock.num_flops_per_token(SEQ)


@pytest.mark.parametrize("case", SCHEMES)
def test_meta_init_materialises_every_scheme(case):
    """OLMo-core's ``init_weights`` (``to_empty`` + ``reset_parameters``) leaves the scheme as a
    freshly built one; the model then runs."""
    scheme, options = SCHEMES[case]
    config = olmo_config(tiny(scheme, options))
    model = config.build(init_device="meta")
    model.init_weights(device=torch.device("cpu"), max_seq_len=SEQ)
    fresh = build_scheme(scheme, 32, 3, norm="rmsnorm", eps=1e-5, **options).state_dict()
    got = model.scheme.state_dict()
    assert got.keys() == fresh.keys() and all(torch.equal(got[k], fresh[k]) for k in fresh)
    assert torch.isfinite(model(batch()[0])).all()


def test_deepnorm_branch_weights_are_xavier_with_its_gain():
    model = olmo_config(tiny("deepnorm", mlp_hidden=256)).build(init_device="meta")
    model.init_weights(device=torch.device("cpu"))
    beta = model.scheme.requires.branch_gain
    att = model.blocks["0"].attention
    xavier = (2.0 / (32 + 32)) ** 0.5
    assert abs(float(att.w_q.weight.detach().std()) / xavier - 1) < 0.15
    assert abs(float(att.w_v.weight.detach().std()) / (beta * xavier) - 1) < 0.15


# Kinds of block at 12 blocks: blocks whose step decides alike (views.py) and so share a graph.
# Mix-LN: its Post-Norm blocks (floor(0.25 * 12) = 3) and its Pre-Norm ones; SpanNorm and
# HybridNorm*: block 0 and the rest; AttnRes: each block receives one more source than the last
# (full form: 1 + 2 b; block_size=4: 1, 2, 2, 3, 3, ...) and its own boundaries, so every block is
# a kind of its own, as before.
KIND_CASES = SCHEMES | {"hybridnorm-first_layer_pre": ("hybridnorm", {"first_layer_pre": True}),
                        "attn_res-block": ("attn_res", {"block_size": 4}),
                        "hyper-static": ("hyper", {"dynamic": False}),
                        "siamese-no_depth_scale": ("siamese", {"depth_scale": False})}
BLOCK_KINDS = {case: 1 for case in KIND_CASES} | {
    "mix_ln": 2, "spannorm": 2, "hybridnorm-first_layer_pre": 2, "attn_res": 12, "attn_res-block": 12}


def _compile_blocks(case: str, blocks: int, monkeypatch, limit: int | None = None,
                    backend: str = "eager", prior_limit: int = 8,
                    extra_options: dict | None = None) -> tuple[int, float, float]:
    """Graphs of one training step of ``case`` with OLMo-core's per-block compile (dynamo with
    ``backend``, ``fullgraph``: a graph break fails), and the largest differences of its loss and
    gradients from the uncompiled model's. A recompile over the limit fails: the limit is
    ``prior_limit`` (dynamo's default of 8) before ``apply_compile`` raises it, or ``limit`` from
    then on. ``extra_options`` join the case's scheme options."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters

    original = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile",
                        lambda self, **kw: original(self, backend=backend, fullgraph=True))
    scheme, options = KIND_CASES[case]
    options = {**options, **(extra_options or {})}
    cfg = replace(tiny(scheme, options, qk_norm=True, tie_embeddings=False), n_layers=blocks)
    model = olmo_config(cfg).build()
    x, y = batch()
    model(x, labels=y).loss.backward()      # eager, which also fills OLMo-core's RoPE cache
    want = {n: p.grad for n, p in model.named_parameters()}
    want_loss = model(x, labels=y).loss.detach()
    model.zero_grad(set_to_none=True)
    dynamo.reset()
    counters.clear()
    with dynamo.config.patch(recompile_limit=prior_limit, fail_on_recompile_limit_hit=True):
        model.apply_compile()
        assert dynamo.config.recompile_limit >= blocks
        with dynamo.config.patch(recompile_limit=limit or dynamo.config.recompile_limit):
            loss = model(x, labels=y).loss
            loss.backward()
    dynamo.reset()
    grad_error = max(float((p.grad - want[n]).abs().max()) for n, p in model.named_parameters())
    return counters["stats"]["unique_graphs"], abs(float(loss) - float(want_loss)), grad_error


# A graph per block: past the recompile limit in force before ``apply_compile`` only the limit it
# raises keeps every block compiled; the other schemes' blocks share graphs under a limit of their
# kinds. The limit is set to 2 and the model has 3 blocks, one past it: the same code as dynamo's
# default of 8 at 12 blocks (``max(limit, recompile_limit_for(blocks))``), at a quarter of the
# graphs. In AttnRes with block_size=4 (4 sublayers, 2 blocks) block 2 opens a second AttnRes block.
PER_BLOCK = [case for case, kinds in BLOCK_KINDS.items() if kinds == 12]
PRIOR_LIMIT = 2


@pytest.mark.parametrize("case", PER_BLOCK)
def test_the_per_block_compile_compiles_every_block(case, monkeypatch):
    """Past the recompile limit in force before ``apply_compile`` no block falls back to eager:
    AttnRes, whose every block is a kind of its own, needs the raised limit; one graph a block and
    the LM head's, and the loss and every gradient are the uncompiled model's."""
    blocks = PRIOR_LIMIT + 1
    graphs, loss_error, grad_error = _compile_blocks(case, blocks, monkeypatch, prior_limit=PRIOR_LIMIT)
    assert graphs == blocks + 1
    assert loss_error <= 1e-6 and grad_error <= 1e-6, (loss_error, grad_error)


# These cases' blocks share one graph; the test below compiles them with AOTAutograd, whose
# dynamo trace is the one backend="eager" makes: one compile checks both.
AOT_BLOCK_CASES = ["siamese", "siamese-hybrid_pre", "lns", "hyper", "mhc"]


@pytest.mark.parametrize("case", [case for case in KIND_CASES
                                  if case not in PER_BLOCK and case not in AOT_BLOCK_CASES])
def test_the_per_block_compile_traces_one_graph_per_kind_of_block(case, monkeypatch):
    """At 12 blocks and a recompile limit of the number of kinds of block, every block compiles
    (a block past the limit would fail) with no graph break (``fullgraph``), as at most that many
    graphs (and the LM head's), and the loss and every gradient are the uncompiled model's."""
    kinds = BLOCK_KINDS[case]
    graphs, loss_error, grad_error = _compile_blocks(case, 12, monkeypatch, limit=kinds)
    assert graphs - 1 <= kinds, (graphs, kinds)
    assert loss_error <= 1e-6 and grad_error <= 1e-6, (loss_error, grad_error)


@pytest.mark.parametrize("case", AOT_BLOCK_CASES)
def test_one_graph_for_every_block_through_aot_autograd(case, monkeypatch):
    """The depth scale, the layer scale and the rows of stacked parameters, which the block's
    sublayer index selects, stay symbolic through AOTAutograd: at 12 blocks and a recompile limit
    of 1 (one kind of block), one graph and the LM head's, and the eager loss and gradients.
    mHC's Sinkhorn iterations unroll in the graph: 2, the same code as its 20 (every loop body
    runs)."""
    extra = {"sinkhorn_iters": 2} if case == "mhc" else None
    graphs, loss_error, grad_error = _compile_blocks(case, 12, monkeypatch, limit=1,
                                                     backend="aot_eager", extra_options=extra)
    assert graphs == 1 + 1
    assert loss_error <= 1e-6 and grad_error <= 1e-6, (loss_error, grad_error)


def test_a_block_view_is_the_schemes_step_on_the_blocks_entries():
    """Block b's view indexes the scheme's lists as the scheme does, holds only the block's
    entries, follows the scheme's training flag and a swapped ParameterList entry, and is no
    submodule: the state dict is the scheme's."""
    model = olmo_config(tiny("siamese", {"form": "hybrid_pre"})).build()
    scheme, view = model.scheme, model.blocks["2"].view
    assert view.first == 4 and type(view.scheme) is type(scheme)
    assert view.scheme.pre_norm[4] is scheme.pre_norm[4] and view.scheme.pre_norm[5] is scheme.pre_norm[5]
    assert view.scheme.post_norm[2] is scheme.post_norm[2] and len(view.scheme.pre_norm) == 2
    assert view.scheme.x_gain[2] is scheme.x_gain[2]
    for outside in (3, 6):       # the blocks before and after: refused, not wrapped round
        with pytest.raises(IndexError, match=r"pre_norm\[4:6\]"):
            view.scheme.pre_norm[outside]
    model.eval()
    scheme.x_gain[2] = torch.nn.Parameter(torch.full((32,), 2.0))
    model(batch()[0])
    assert not view.scheme.training and view.scheme.x_gain[2] is scheme.x_gain[2]
    assert all(not k.startswith("blocks.") or ".view" not in k for k in model.state_dict())
    assert {k for k in model.state_dict() if k.startswith("scheme.")} == {
        f"scheme.{k}" for k in scheme.state_dict()}


def test_pipeline_parallelism_is_refused():   # tensor parallelism: test_olmo_core_parallel.py
    model = olmo_config(tiny("siamese")).build(init_device="meta")
    with pytest.raises(NotImplementedError, match="pipeline"):
        model.apply_pp(None)


# ---- training ------------------------------------------------------------------------------
def _train_module(config):
    olmo_parallel._WORLD_MESH = None   # OLMo-core builds one world mesh per process
    return TransformerTrainModuleConfig(
        rank_microbatch_size=BATCH * SEQ, max_sequence_length=SEQ,
        optim=AdamWConfig(lr=1e-2, weight_decay=0.0),
    ).build(config.build(init_device="meta"))


def test_training_steps_with_olmo_cores_optimizer_match_ours():
    """One process: OLMo-core's train module (meta build, its init, its AdamW) trains; our
    LanguageModel with the same weights under the same AdamW takes the same losses (one batch,
    memorised)."""
    config = olmo_config(tiny("siamese", {"form": "hybrid_pre"}))
    tm = _train_module(config)
    lm = LanguageModel(lm_config(config, max_seq_len=SEQ))
    lm.load_state_dict(to_siamesenorm_state_dict(tm.model.state_dict()))
    opt = AdamWConfig(lr=1e-2, weight_decay=0.0).build(lm)
    got, want = [], []
    x, y = batch(100)
    for _ in range(5):
        tm.zero_grads()
        loss = tm.model_forward(x, labels=y).loss
        loss.backward()
        tm.optim_step()
        got.append(float(loss.detach()))
        opt.zero_grad()
        mine = lm(x, y).loss
        mine.backward()
        opt.step()
        want.append(float(mine.detach()))
    assert got[-1] < got[0] - 0.1
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-5 * abs(b), (got, want)


def test_olmo_cores_activation_checkpointing_carries_the_state():
    """OLMo-core wraps whole blocks (or chosen modules) for activation checkpointing; the scheme's
    state (two streams here) goes through the wrapper and the losses do not change."""
    def losses(ac):
        config = olmo_config(tiny("siamese"))
        tm = TransformerTrainModuleConfig(
            rank_microbatch_size=BATCH * SEQ, max_sequence_length=SEQ, ac_config=ac,
            optim=AdamWConfig(lr=1e-2, weight_decay=0.0)).build(config.build(init_device="meta"))
        x, y = batch(100)
        out = []
        for _ in range(3):
            tm.zero_grads()
            loss = tm.model_forward(x, labels=y).loss
            loss.backward()
            tm.optim_step()
            out.append(float(loss.detach()))
        return out

    want = losses(None)
    for mode in (ACMode.full, ACMode.selected_ops):
        assert losses(TransformerActivationCheckpointingConfig(mode=mode)) == want, mode


# ---- the training command: siamesenorm olmo-core train ----------------------------------------
TRAIN_STEPS = 4
# python's arguments for the command: its name, and the old module path that forwards to it
ENTRY = {"command": ["-m", "siamesenorm", "olmo-core", "train"],
         "alias": ["-m", "siamesenorm.olmo_core.train"]}


def olmo_train(argv: list[str]) -> int:
    """``siamesenorm olmo-core train ARGV`` in this process: its exit status (2 for a usage error)."""
    from siamesenorm.cli import main
    try:
        return main(["olmo-core", "train", *argv])
    except SystemExit as done:          # argparse's usage errors
        return done.code


def _entry_env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[1] / "src"), os.environ.get("PYTHONPATH", "")]))


def _entry(args: list[str], nproc: int = 1, name: str = "command") -> subprocess.CompletedProcess:
    """The command in a process of its own, or under torchrun in ``nproc`` (as ``train`` runs)."""
    launch = [] if nproc == 1 else ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                    str(nproc)]
    cmd = [sys.executable, *launch, *ENTRY[name], *args]
    return subprocess.run(cmd, env=_entry_env(), capture_output=True, text=True, timeout=600)


def _losses(save_folder: Path) -> list[float]:
    rows = [json.loads(line) for line in (save_folder / "metrics.jsonl").read_text().splitlines()]
    return [r["train/CE loss"] for r in rows if "train/CE loss" in r]


@pytest.fixture(scope="module")
def token_files(tmp_path_factory):
    """Two OLMo-core numpy token files: raw uint16 token ids (no header), as OLMo's data."""
    import numpy as np
    folder = tmp_path_factory.mktemp("tokens")
    rng = np.random.default_rng(0)
    for i in range(2):   # a learnable stream: repeated runs of ids below the tiny vocabulary
        ids = np.tile(rng.integers(0, 255, size=32, dtype=np.uint16), 96)
        ids.tofile(folder / f"part-{i}.npy")
    return folder


@pytest.fixture(scope="module")
def one_process_run(token_files, tmp_path_factory):
    """One process through the old module path: the runs of the command below match it."""
    save = tmp_path_factory.mktemp("run1") / "run"
    proc = _entry(["tiny", "--data", str(token_files / "*.npy"), "--save-folder", str(save),
                   "--steps", str(TRAIN_STEPS), "--metrics-interval", "1", "--lr", "1e-2", "--warmup", "1"],
                  name="alias")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return save


def test_the_tiny_config_trains_and_writes_olmo_core_checkpoints(one_process_run):
    losses = _losses(one_process_run)
    assert len(losses) == TRAIN_STEPS and all(map(torch.isfinite, torch.tensor(losses)))
    assert losses[-1] < losses[0]
    final = one_process_run / f"step{TRAIN_STEPS}"
    assert (final / "model_and_optim" / ".metadata").is_file()
    assert (final / "train" / "rank0.pt").is_file()
    saved = json.loads((final / "config.json").read_text())
    assert saved["siamesenorm"] == {"config": "tiny", "scheme": "siamese",
                                    "scheme_options": {"form": "hybrid_pre"}}
    # the checkpoint holds our model's parameters under OLMo-core's names
    from torch.distributed.checkpoint import FileSystemReader
    keys = FileSystemReader(str(final / "model_and_optim")).read_metadata().state_dict_metadata
    assert any(k.startswith("model.scheme.") for k in keys)
    assert "model.blocks.0.attention.v_norm.weight" in keys


def test_fsdp_over_two_processes_matches_one_process_and_its_checkpoint_converts(token_files, one_process_run,
                                                                                 tmp_path):
    """Two processes under FSDP log the one-process run's losses; their sharded checkpoint (each
    rank's shards) converts to our run directory with OLMo-core's own reading of its weights and
    the run's losses (``import-olmo-core``: tests/test_olmo_core_export.py, one process)."""
    save = tmp_path / "run"
    proc = _entry(["tiny", "--data", str(token_files / "*.npy"), "--save-folder", str(save),
                   "--steps", str(TRAIN_STEPS), "--metrics-interval", "1", "--lr", "1e-2", "--warmup", "1"],
                  nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "Applied FSDP" in proc.stdout + proc.stderr
    assert (save / f"step{TRAIN_STEPS}" / "model_and_optim" / "__1_0.distcp").is_file()  # rank 1's shard
    got, want = _losses(save), _losses(one_process_run)
    assert len(got) == len(want) == TRAIN_STEPS
    for i, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {i + 1}: {got} vs {want}"

    from safetensors.torch import load_file

    from siamesenorm.cli import main
    from siamesenorm.rundir import RunDir, read_jsonl
    from test_olmo_core_export import olmo_losses, olmo_weights_as_ours
    run = tmp_path / "imported"
    assert main(["import-olmo-core", str(save), "--out", str(run)]) == 0
    ours = load_file(str(RunDir(run).last_checkpoint / "model.safetensors"))
    theirs = olmo_weights_as_ours(save / f"step{TRAIN_STEPS}")
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert [r["loss"] for r in read_jsonl(RunDir(run).metrics)] == list(olmo_losses(save).values())


def test_the_entry_trains_with_tensor_parallelism_as_one_process(token_files, one_process_run, tmp_path):
    """``--tp 2`` (FSDP as the data-parallel config, one data-parallel rank: both ranks read the
    same batch) logs the one-process run's losses; the tiny config has QKV-norm and clipping."""
    save = tmp_path / "run"
    proc = _entry(["tiny", "--data", str(token_files / "*.npy"), "--save-folder", str(save),
                   "--steps", str(TRAIN_STEPS), "--metrics-interval", "1", "--lr", "1e-2", "--warmup", "1",
                   "--tp", "2"], nproc=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "Applied tensor parallelism" in proc.stdout + proc.stderr
    got, want = _losses(save), _losses(one_process_run)
    assert len(got) == len(want) == TRAIN_STEPS
    for i, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= 1e-5 * abs(b) + 1e-9, f"step {i + 1}: {got} vs {want}"


def test_dry_run_of_olmo_1b_needs_no_data(capsys):
    assert olmo_train(["olmo-1b", "--dry-run", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "parameters: 1,279,963,136 " in out
    assert "scheme siamese {\"form\": \"hybrid_pre\"}" in out
    assert "2048 sequences x 2048 = 4,194,304 tokens per step" in out
    assert "8 ranks x micro-batch 8 x 32 accumulation" in out
    assert "total: 2.38 GiB" in out and "not counted" in out
    assert olmo_train(["olmo-1b", "--dry-run", "--scheme", "pre"]) == 0
    assert "scheme pre {}" in capsys.readouterr().out
    assert olmo_train(["olmo-400m", "--dry-run", "--world-size", "8"]) == 0
    assert "parameters: 388,328,640 " in capsys.readouterr().out


@pytest.mark.parametrize("args, says", [
    (["olmo-1b", "--scheme", "nope"], "unknown scheme"),
    (["olmo-1b", "--scheme", "siamese", "--scheme-options", "form=bogus"], "form='bogus'"),
    (["olmo-1b", "--scheme-options", "nonsense"], "KEY=VALUE"),
    (["olmo-1b", "--tp", "2"], "tensor parallelism"),
    (["olmo-1b", "--pp", "2"], "pipeline parallelism"),
    (["olmo-2b"], "invalid choice"),
    (["tiny", "--save-folder", "x"], "--data is required"),
    (["olmo-1b", "--dry-run", "--world-size", "3"], "not a multiple"),
])
def test_bad_inputs_end_with_one_line_and_status_2(args, says, capsys):
    assert olmo_train(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and err.startswith("siamesenorm olmo-core train: error:"), err


@pytest.mark.parametrize("name", sorted(ENTRY))
def test_a_bad_input_from_the_command_line_prints_one_line(name):
    proc = _entry(["olmo-1b", "--dry-run", "--tp", "2"], name=name)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "tensor parallelism" in proc.stderr, proc.stderr


def test_the_old_module_path_is_the_command(tmp_path):
    """``python -m siamesenorm.olmo_core.train`` forwards to ``siamesenorm olmo-core train``: the same
    output and status, nothing more on stderr; --help names the command."""
    args = ["tiny-moe", "--dry-run", "--scheme", "pre", "--world-size", "2"]
    new, old = _entry(args), _entry(args, name="alias")
    assert (old.returncode, old.stdout, old.stderr) == (new.returncode, new.stdout, new.stderr) == \
        (0, new.stdout, "")
    assert "scheme pre {}" in new.stdout and "active parameters per token" in new.stdout
    helped = _entry(["--help"], name="alias")
    assert helped.returncode == 0 and helped.stdout.startswith("usage: siamesenorm olmo-core train")


@pytest.mark.parametrize("name, precision, peak", [
    ("NVIDIA H200", "bf16", 989_500_000_000_000),       # OLMo-core 3.0 takes it for an A100 (312e12)
    ("NVIDIA H100 PCIe", "bf16", 756_500_000_000_000),
    ("NVIDIA H200", "fp32", 67_000_000_000_000),
    ("Some Future GPU", "bf16", None),                  # not in our table: OLMo-core's own guess
    (None, "fp32", None),                               # a CPU
])
def test_the_speed_monitor_measures_mfu_against_our_peak_of_the_device(name, precision, peak):
    from siamesenorm.olmo_core.train import speed_monitor
    callback = speed_monitor(12345, name, precision)
    assert callback.num_flops_per_token == 12345
    assert callback.device_peak_flops_per_second == peak


@pytest.mark.parametrize("name, peak", [("NVIDIA H200", 989_500_000_000_000), ("Some Future GPU", None)])
def test_the_commands_trainer_gets_the_peak_of_the_gpu_it_runs_on(name, peak, token_files, tmp_path,
                                                                   monkeypatch):
    from siamesenorm.cli import build_parser
    from siamesenorm.commands.olmo_train import resolve
    from siamesenorm.olmo_core.train import build_experiment
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    args = build_parser().parse_args(["olmo-core", "train", "tiny", "--data", str(token_files / "*.npy"),
                                      "--save-folder", str(tmp_path)])
    parts = build_experiment(args, resolve(args), world=1)
    assert parts["trainer"].callbacks["speed_monitor"].device_peak_flops_per_second == peak
    assert parts["train_module"].autocast_precision is not None      # bf16, the GPU default
