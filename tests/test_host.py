"""The contract of a model that hosts a residual scheme (``models/host.py``), held by every host:
the :class:`SchemeHost` protocol, and what a scheme ``requires`` honoured the same way over each
model's own initialisation."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

import siamesenorm
from siamesenorm.diffusion import DiffusionObjective
from siamesenorm.models import DiT, DiTConfig, LanguageModel, LMConfig, VisionTransformer, ViTConfig
from siamesenorm.models.host import BranchWeight, SchemeHost, honour_requirements
from siamesenorm.schemes import SUBLAYERS_PER_BLOCK
from siamesenorm.schemes.base import SchemeRequirements
from siamesenorm.train.optim import decay_groups
from test_lm import with_temp_scheme

GAIN = 0.5


def lm(scheme: str = "pre") -> LanguageModel:
    return LanguageModel(LMConfig(vocab_size=32, dim=16, n_layers=3, n_heads=2, max_seq_len=8,
                                  scheme=scheme))


def vit(scheme: str = "pre") -> VisionTransformer:
    return VisionTransformer(ViTConfig(image_size=8, patch_size=4, in_chans=1, num_classes=3, dim=16,
                                       n_layers=3, n_heads=2, scheme=scheme))


def dit(scheme: str = "pre") -> DiT:
    return DiT(DiTConfig(input_size=4, patch_size=2, in_chans=1, num_classes=3, dim=16, n_layers=3,
                         n_heads=2, frequency_dim=16, scheme=scheme))


BUILDERS = {"lm": lm, "vit": vit, "dit": dit}


def seeded(build, scheme: str) -> nn.Module:
    torch.manual_seed(0)
    return build(scheme)


def test_every_model_hosts_its_scheme_by_the_protocol():
    ids, images = torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 1, 8, 8)
    hosts = {"lm": lm(), "vit": vit(), "dit": dit()}
    objective = DiffusionObjective(hosts["dit"])
    for host in [*hosts.values(), objective]:
        assert isinstance(host, SchemeHost)
        assert len(host.sublayers) == SUBLAYERS_PER_BLOCK * host.scheme.n_layers == 6
        assert host.num_parameters() == sum(p.numel() for p in host.parameters())
    assert not isinstance(nn.Linear(2, 2), SchemeHost)
    assert hosts["lm"].tokens_in(ids) == 10 and hosts["lm"].flops_per_token() > 0
    assert hosts["vit"].tokens_in(images) == 2 * (1 + 4) and hosts["vit"].flops_per_token() is None
    assert objective.tokens_in(torch.zeros(2, 1, 4, 4)) == 2 * 4 and objective.flops_per_token() is None
    hyper = DiffusionObjective(dit("hyper"))   # a scheme with matrices: kept out of the decay
    decayed, plain = decay_groups(hyper)
    scheme = {id(p) for p in hyper.scheme.parameters() if p.dim() >= 2}
    assert scheme and scheme <= {id(p) for p in plain} and not scheme & {id(p) for p in decayed}


@pytest.mark.parametrize("model", sorted(BUILDERS))
def test_a_branch_gain_multiplies_the_same_draws_on_v_out_and_mlp(model, monkeypatch):
    with_temp_scheme(monkeypatch, "_test_gain", SchemeRequirements(branch_gain=GAIN))
    plain, gained = seeded(BUILDERS[model], "pre"), seeded(BUILDERS[model], "_test_gain")
    for a, b in zip(plain.sublayers, gained.sublayers):
        for name, linear in a.named_children():
            if isinstance(linear, nn.Linear):
                scale = 1.0 if name in ("q_proj", "k_proj") else GAIN
                assert torch.equal(getattr(b, name).weight, scale * linear.weight), name
    rest = {k: v for k, v in plain.state_dict().items() if not k.startswith("sublayers.")}
    assert all(torch.equal(v, gained.state_dict()[k]) for k, v in rest.items())


def test_required_xavier_replaces_the_native_init_unless_it_is_xavier_already(monkeypatch):
    with_temp_scheme(monkeypatch, "_test_gain", SchemeRequirements(branch_gain=GAIN))
    with_temp_scheme(monkeypatch, "_test_xavier", SchemeRequirements(init="xavier", branch_gain=GAIN))
    for build in (lm, vit):   # their own inits are N(0, 0.02)-like: Xavier-normal (std 0.25) instead
        attn = seeded(build, "_test_xavier").sublayers[0]
        assert attn.q_proj.weight.std().item() == pytest.approx((2 / 32) ** 0.5, rel=0.3)
        assert attn.v_proj.weight.std().item() == pytest.approx(GAIN * (2 / 32) ** 0.5, rel=0.3)
    # DiT's init is Xavier(-uniform) already: the requirement adds only the gain
    xavier, gain_only = seeded(dit, "_test_xavier").state_dict(), seeded(dit, "_test_gain").state_dict()
    assert all(torch.equal(v, gain_only[k]) for k, v in xavier.items())


@pytest.mark.parametrize("model", sorted(BUILDERS))
def test_qkv_norm_goes_to_the_required_blocks_only(model, monkeypatch):
    with_temp_scheme(monkeypatch, "_test_qkv", SchemeRequirements(qkv_norm_blocks=frozenset({1})))
    host = BUILDERS[model]("_test_qkv")
    assert [host.sublayers[2 * b].v_norm is not None for b in range(3)] == [False, True, False]


def test_honour_requirements_over_plain_records():
    """Each matrix of a stacked weight is drawn on its own, from the generator given; biases become
    zero; with nothing required and no native init the weights are left as they are."""
    stack, bias, flat = torch.ones(3, 4, 5), torch.ones(4), torch.ones(2 * 6)
    records = [BranchWeight(stack, bias, True), BranchWeight(flat, None, False, matrix=(2, 6))]
    honour_requirements(records, SchemeRequirements(), generator=torch.Generator())
    assert stack.eq(1).all() and bias.eq(1).all() and flat.eq(1).all()
    honour_requirements(records, SchemeRequirements(init="xavier", branch_gain=GAIN),
                        generator=torch.Generator().manual_seed(3))
    g, want = torch.Generator().manual_seed(3), torch.empty(3, 4, 5)
    for m in want:
        nn.init.xavier_normal_(m, gain=GAIN, generator=g)
    assert torch.equal(stack, want) and bias.eq(0).all()
    assert torch.equal(flat, nn.init.xavier_normal_(torch.empty(2, 6), generator=g).flatten())
    calls = []
    honour_requirements(records, SchemeRequirements(branch_gain=GAIN), native=calls.append)
    assert [r.weight for r in calls] == [stack, flat] and torch.equal(stack, GAIN * want)


# Where a scheme's requirements may be read: the schemes that declare them, and models/host.py,
# which applies them for every host (our models, the Hugging Face adaptation, OLMo-core).
REQUIREMENT_ATTRIBUTES = {"branch_gain", "qkv_norm_blocks"}


def _reads_of_requirements(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in REQUIREMENT_ATTRIBUTES:
            found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Attribute) and node.attr == "init" and (
                isinstance(node.value, ast.Name) and node.value.id == "requires"
                or isinstance(node.value, ast.Attribute) and node.value.attr == "requires"):
            found.append(f"line {node.lineno}: requires.init")
        elif isinstance(node, ast.Compare) and any(
                isinstance(c, ast.Constant) and c.value == "xavier"
                for c in (node.left, *node.comparators)):
            found.append(f"line {node.lineno}: == 'xavier'")
    return found


def test_the_requirements_are_read_in_host_alone():
    """One place applies what a scheme requires of its host's weights and attention: no other
    module reads ``branch_gain``, ``qkv_norm_blocks`` or ``requires.init``, or compares with
    ``"xavier"`` (they build :class:`BranchWeight` records and ask ``needs_qkv_norm``)."""
    root = Path(siamesenorm.__file__).parent
    host = root / "models" / "host.py"
    readers = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] == "schemes":
            continue
        found = _reads_of_requirements(ast.parse(path.read_text(), str(path)))
        if found:
            readers[str(rel)] = found
    assert set(readers) == {str(host.relative_to(root))}, readers
    # and host.py reads each of them (the scan is not vacuous)
    assert {r.split(": ")[1] for r in readers["models/host.py"]} == {
        ".branch_gain", ".qkv_norm_blocks", "requires.init", "== 'xavier'"}
