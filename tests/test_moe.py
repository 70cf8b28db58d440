"""The mixture-of-experts feed-forward (OLMoE-style, arXiv 2409.02060) against references written
here from the equations: a dense SwiGLU (one expert), a loop over tokens (routing and combination),
and hand-computed auxiliary losses."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from siamesenorm.errors import ConfigError
from siamesenorm.nn.mlp import SwiGLUMLP
from siamesenorm.nn.moe import MoE

D = torch.float64


def make(n_experts=8, top_k=2, hidden=12, shared=0, normalize=True, dim=10, seed=0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(dim, n_experts, top_k, hidden, shared_hidden=shared, normalize=normalize, dtype=D)
    with torch.no_grad():       # a router that prefers some experts, so routing is not uniform
        moe.router.weight.mul_(4)
    return moe


def slow_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax over experts, the k largest, their (renormalised) weights, each
    chosen expert's SwiGLU on the token, summed; plus the shared expert."""
    flat = x.reshape(-1, moe.dim)
    rows = []
    for t in range(flat.shape[0]):
        xt = flat[t]
        logits = moe.router.weight @ xt
        p = torch.exp(logits - logits.max())
        p = p / p.sum()
        ranked = sorted(range(moe.n_experts), key=lambda i: -float(p[i].detach()))[: moe.top_k]
        total = sum(p[i] for i in ranked) if moe.normalize else 1.0
        out = torch.zeros(moe.dim, dtype=x.dtype)
        for i in ranked:
            gate = xt @ moe.w_gate[i]
            up = xt @ moe.w_up[i]
            h = gate / (1 + torch.exp(-gate)) * up
            out = out + (p[i] / total) * (h @ moe.w_down[i])
        if moe.shared is not None:
            s = moe.shared
            out = out + s.down_proj.weight @ (F.silu(s.gate_proj.weight @ xt) * (s.up_proj.weight @ xt))
        rows.append(out)
    return torch.stack(rows).reshape(x.shape)


def test_one_expert_top_1_is_the_dense_swiglu_with_the_same_weights():
    moe = make(n_experts=1, top_k=1)
    dense = SwiGLUMLP(10, 12, dtype=D)
    with torch.no_grad():
        dense.gate_proj.weight.copy_(moe.w_gate[0].t())
        dense.up_proj.weight.copy_(moe.w_up[0].t())
        dense.down_proj.weight.copy_(moe.w_down[0].t())
    x = torch.randn(3, 5, 10, dtype=D, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    a, b = moe(x), dense(x2)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    g = torch.randn_like(a)
    a.backward(g)
    b.backward(g)
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(moe.w_gate.grad[0], dense.gate_proj.weight.grad.t(), rtol=0, atol=1e-12)
    torch.testing.assert_close(moe.w_up.grad[0], dense.up_proj.weight.grad.t(), rtol=0, atol=1e-12)
    torch.testing.assert_close(moe.w_down.grad[0], dense.down_proj.weight.grad.t(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("shared", [0, 7])
@pytest.mark.parametrize("normalize", [True, False])
def test_routing_and_combination_match_a_loop_over_tokens(top_k, shared, normalize):
    moe = make(top_k=top_k, shared=shared, normalize=normalize, seed=top_k + shared)
    x = torch.randn(4, 6, 10, dtype=D)
    torch.testing.assert_close(moe(x), slow_reference(moe, x), rtol=0, atol=1e-12)


def test_gradients_match_the_loop_over_tokens():
    moe = make(top_k=2, shared=5)
    x = torch.randn(2, 7, 10, dtype=D, requires_grad=True)
    moe(x).square().sum().backward()
    fast = {n: p.grad.clone() for n, p in moe.named_parameters()} | {"x": x.grad.clone()}
    moe.zero_grad()
    x.grad = None
    slow_reference(moe, x).square().sum().backward()
    slow = {n: p.grad for n, p in moe.named_parameters()} | {"x": x.grad}
    for name in fast:
        torch.testing.assert_close(fast[name], slow[name], rtol=0, atol=1e-10, msg=name)
    assert moe.router.weight.grad.abs().sum() > 0        # the router learns through the weights


def test_every_token_reaches_its_k_experts_even_when_all_choose_one():
    moe = make(n_experts=4, top_k=2)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[1].fill_(5.0)        # every token prefers expert 1, then 3: nothing is
        moe.router.weight[3].fill_(2.0)        # dropped however crowded an expert is
    x = torch.rand(32, 10, dtype=D)
    torch.testing.assert_close(moe(x), slow_reference(moe, x), rtol=0, atol=1e-12)
    assert moe.load.tolist() == [0.0, 0.5, 0.0, 0.5]


def test_auxiliary_losses_by_hand():
    moe = make(n_experts=3, top_k=1, dim=2)
    with torch.no_grad():
        moe.router.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], dtype=D))
    x = torch.tensor([[2.0, 0.0], [0.0, 3.0], [1.0, 1.0], [-1.0, -1.0]], dtype=D,
                     requires_grad=True)
    moe(x)
    logits = [[2, 0, 0], [0, 3, 0], [1, 1, 0], [-1, -1, 0]]
    probs = [[math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in logits]
    chosen = [0, 1, 0, 2]           # the first of equal logits (row 3) is expert 0, as topk gives
    f = [chosen.count(i) / 4 for i in range(3)]
    p_mean = [sum(p[i] for p in probs) / 4 for i in range(3)]
    aux = 3 * sum(f[i] * p_mean[i] for i in range(3))
    z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits) / 4
    assert moe.aux_loss.item() == pytest.approx(aux, abs=1e-12)
    assert moe.z_loss.item() == pytest.approx(z, abs=1e-12)
    assert moe.load.tolist() == pytest.approx(f)
    entropy = -sum(sum(q * math.log(q) for q in p) for p in probs) / 4
    assert moe.entropy.item() == pytest.approx(entropy, abs=1e-12)
    (moe.aux_loss + moe.z_loss).backward()
    assert moe.router.weight.grad.abs().sum() > 0 and x.grad is not None


def test_a_uniform_router_has_a_balance_loss_of_k():
    moe = make(n_experts=4, top_k=2)
    with torch.no_grad():
        moe.router.weight.zero_()
    moe(torch.randn(8, 10, dtype=D))
    # uniform probabilities 1/4; topk of ties picks experts 0 and 1 for every token: f = (1, 1, 0, 0)
    assert moe.aux_loss.item() == pytest.approx(4 * (1 + 1) * 0.25)


def test_active_parameters_count_k_experts():
    moe = make(n_experts=8, top_k=2, hidden=12, shared=5, dim=10)
    per_expert = 3 * 10 * 12
    shared = 3 * 10 * 5
    assert moe.active_parameters() == 10 * 8 + 2 * per_expert + shared
    assert sum(p.numel() for p in moe.parameters()) == 10 * 8 + 8 * per_expert + shared


@pytest.mark.parametrize("kwargs, fragment", [
    ({"n_experts": 0, "top_k": 1}, "at least one expert"),
    ({"n_experts": 4, "top_k": 5}, "top_k must be between 1 and the number of experts (4)"),
    ({"n_experts": 4, "top_k": 0}, "top_k must be between"),
])
def test_bad_settings_are_config_errors(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        MoE(10, hidden=12, **kwargs)


def test_bfloat16_routes_in_float32_and_runs():
    moe = MoE(16, 4, 2, 8, dtype=torch.bfloat16)
    out = moe(torch.randn(5, 16, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and moe.aux_loss.dtype == torch.float32


# ---- in the language model, with every scheme -------------------------------------------------------
from helpers import cli_in_process  # noqa: E402
from siamesenorm.models import LanguageModel, LMConfig, MoEConfig  # noqa: E402
from siamesenorm.schemes import list_schemes  # noqa: E402


def moe_lm(scheme: str, every: int = 1, **moe) -> LanguageModel:
    torch.manual_seed(0)
    options = {"n_streams": 2} if scheme in ("hyper", "mhc") else {}
    cfg = LMConfig(vocab_size=32, dim=32, n_layers=2, n_heads=2, max_seq_len=32, scheme=scheme,
                   scheme_options=options,
                   moe=MoEConfig(every=every, **{"n_experts": 4, "top_k": 2, "hidden": 16, **moe}))
    return LanguageModel(cfg)


@pytest.mark.parametrize("scheme", list_schemes())
def test_every_scheme_trains_an_moe_model_and_generates_the_same_with_and_without_cache(scheme):
    model = moe_lm(scheme)
    assert len(model.moe_layers()) == 2
    seq = torch.arange(33) % 8                        # a repeating sequence: learnable
    x, y = seq[:-1].unsqueeze(0).repeat(4, 1), seq[1:].unsqueeze(0).repeat(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        out = model(x, y)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(model.loss_parts["ce_loss"].item())
    assert losses[-1] < 0.7 * losses[0], losses
    parts = model.loss_parts
    total = parts["ce_loss"] + 0.01 * parts["aux_loss"] + 0.001 * parts["z_loss"]
    assert out.loss.item() == pytest.approx(total.item(), rel=1e-5)
    assert all(m.router.weight.grad is not None for m in model.moe_layers())
    model.eval()
    with torch.no_grad():
        assert model(x, y).loss.item() == pytest.approx(
            F.cross_entropy(model(x).logits.reshape(-1, 32), y.reshape(-1)).item())  # eval: CE only
    prompt = seq[:5].unsqueeze(0)
    cached = model.generate(prompt, 10, greedy=True, use_cache=True)
    plain = model.generate(prompt, 10, greedy=True, use_cache=False)
    assert torch.equal(cached, plain)


def test_every_nth_block_and_active_parameters():
    model = moe_lm("siamese", every=2, n_experts=8, top_k=2, hidden=16, shared_hidden=8)
    kinds = [type(m).__name__ for m in model.sublayers]
    assert kinds == ["Attention", "SwiGLUMLP", "Attention", "MoE"]
    moe = model.moe_layers()[0]
    per_expert = 3 * 32 * 16
    assert model.num_parameters() - model.active_parameters() == 6 * per_expert
    assert moe.active_parameters() == 32 * 8 + 2 * per_expert + 3 * 32 * 8
    dense = LanguageModel(LMConfig(vocab_size=32, dim=32, n_layers=2, n_heads=2, max_seq_len=32))
    assert dense.active_parameters() == dense.num_parameters()
    # FLOPs per token count the active experts only
    assert model.flops_per_token(32) - 6 * model.active_parameters(non_embedding=True) \
        == pytest.approx(dense.flops_per_token(32) - 6 * dense.num_parameters(non_embedding=True))


@pytest.mark.parametrize("scheme", ["pre", "siamese"])
@pytest.mark.parametrize("moe", [{"every": 1, "n_experts": 8, "top_k": 2},
                                 {"every": 2, "n_experts": 5, "top_k": 3, "shared_hidden": 16}])
def test_the_dry_runs_activation_bytes_equal_a_real_forwards(scheme, moe):
    """On the meta device routing has no data, so the dry run splits tokens evenly; dropless routing
    processes tokens x top_k rows whatever the split, so the bytes equal a real routed forward's."""
    from siamesenorm.models.checkpointing import activation_memory

    found = {}
    for device in ("cpu", "meta"):
        torch.manual_seed(0)
        cfg = LMConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, max_seq_len=16, scheme=scheme,
                       moe=MoEConfig(**moe))
        model = LanguageModel(cfg, device=device)
        x, y = torch.randint(0, 64, (2, 3, 16)).to(device)
        found[device] = {mode: activation_memory(model, x, y, mode)
                         for mode in ("none", "selective", "sublayer")}
    assert found["meta"] == found["cpu"]
    assert found["cpu"]["none"] > found["cpu"]["selective"] > found["cpu"]["sublayer"] > 0


def test_the_olmoe_preset_fits_an_80gb_gpu_per_rank():
    from siamesenorm.tasks import load_config
    from siamesenorm.tasks.dryrun import dry_run

    r = dry_run(load_config("olmoe-15b-a2b"), 8)
    assert r["activations"]["none"] is not None
    fsdp = next(c for c in r["memory"] if c["engine"] == "fsdp")
    assert r["configured"]["activation_checkpointing"] == "sublayer"
    assert r["configured"]["total"] == fsdp["total"]["sublayer"] < 60 * 2**30 < fsdp["total"]["none"]


@pytest.mark.parametrize("moe, fragment", [
    ({"every": 1, "n_experts": 0}, "model.moe.n_experts must be a positive integer"),
    ({"every": 1, "n_experts": 4, "top_k": 5}, "model.moe.top_k (5) exceeds model.moe.n_experts (4)"),
    ({"every": 1, "aux_loss": -0.1}, "model.moe.aux_loss must be a finite number >= 0"),
    ({"every": 1, "z_loss": float("nan")}, "model.moe.z_loss must be a finite number >= 0"),
    ({"every": -1}, "model.moe.every must be 0"),
])
def test_bad_moe_settings_are_config_errors(moe, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        MoEConfig(**moe)


def test_bad_moe_settings_on_the_command_line_are_one_line(tmp_path):
    res = cli_in_process("train", "tiny", "model.moe.every=1", "model.moe.n_experts=2", "model.moe.top_k=3",
                         "--out", str(tmp_path / "r"))
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "siamesenorm train: error: model.moe.top_k (3) exceeds model.moe.n_experts (2)"]
    assert not (tmp_path / "r").exists()


def test_a_run_logs_the_loss_parts_of_an_moe_model(tmp_path):
    import json

    run_dir = tmp_path / "run"
    res = cli_in_process("train", "tiny", "model.moe.every=1", "model.moe.n_experts=4", "model.moe.top_k=2",
                         "train.steps=3", "train.eval_every=3", "data.max_bytes=40000", "--out", str(run_dir))
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    for row in rows:
        want = row["ce_loss"] + 0.01 * row["aux_loss"] + 0.001 * row["z_loss"]
        assert row["loss"] == pytest.approx(want, rel=1e-5)
        assert row["aux_loss"] > 0 and row["z_loss"] > 0
    evaluated = [row for row in rows if "val_loss" in row]
    assert evaluated
    for row in evaluated:               # at every evaluation: each layer's expert shares
        assert len(row["expert_load"]) == 2 and all(len(layer) == 4 for layer in row["expert_load"])
        assert all(sum(layer) == pytest.approx(1.0) for layer in row["expert_load"])
        assert row["expert_load_max"] == max(max(layer) for layer in row["expert_load"])
        assert 0 < row["router_entropy"] <= math.log(4) + 1e-6


def test_torch_compile_of_an_moe_model_matches_eager():
    """Traced by torch.compile (aot_eager: no C compiler needed); the per-expert split by counts
    breaks the graph there, which compile handles. Values and gradients as eager."""
    import torch._dynamo

    torch._dynamo.reset()
    model = moe_lm("siamese")
    x = (torch.arange(32) % 8).unsqueeze(0).repeat(2, 1)
    eager = model(x, x)
    eager.loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    compiled = torch.compile(model, backend="aot_eager")
    out = compiled(x, x)
    out.loss.backward()
    torch.testing.assert_close(out.loss, eager.loss)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], msg=name)


def test_compare_reports_expert_load_per_scheme(tmp_path):
    out = tmp_path / "exp"
    res = cli_in_process("compare", "tiny", "model.moe.every=1", "model.moe.n_experts=4", "model.moe.top_k=2",
                         "train.steps=4", "train.eval_every=2", "data.max_bytes=40000", "--schemes",
                         "pre,siamese", "--out", str(out))
    assert res.returncode == 0, res.stderr
    report = (out / "report.md").read_text()
    for name in ("expert_load.png", "expert_load_max.png", "router_entropy.png"):
        assert f"({name})" in report and (out / name).stat().st_size > 0
