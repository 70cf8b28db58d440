"""The diagnostics, each on a model whose answer is known by construction or computed here by hand.

References are written independently of :mod:`siamesenorm.analysis`: they run the scheme's own
``enter/step/exit`` loop (or build a shallower model), and compute norms, angles and agreements
in float64 with plain tensor operations.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from helpers import randomize_
from siamesenorm.analysis import (
    StreamTap,
    TrainingProbes,
    angular_distances,
    effective_depth,
    grad_norms,
    logit_lens,
    mean_loss,
    norm_gains,
    pruning_sensitivity,
    read_probes,
    sublayer_rms,
)
from siamesenorm.config import AnalysisConfig
from siamesenorm.errors import ConfigError
from siamesenorm.models import LanguageModel, LMConfig
from siamesenorm.schemes.base import ResidualScheme
from siamesenorm.tasks import load_config
from test_train import RandomWindows, make_model, rows, settings, train

VOCAB, DIM, LAYERS, SEQ = 32, 16, 3, 8
F64 = torch.float64


def lm(scheme: str = "pre", *, seed: int = 0, dtype=F64, n_layers: int = LAYERS, norm: str = "rmsnorm",
       **options) -> LanguageModel:
    torch.manual_seed(seed)
    cfg = LMConfig(vocab_size=VOCAB, dim=DIM, n_layers=n_layers, n_heads=2, max_seq_len=SEQ, scheme=scheme,
                   scheme_options=options, init_std=0.2, norm=norm)
    return LanguageModel(cfg, dtype=dtype).eval()


def batch(seed: int = 1, b: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (b, SEQ), generator=g), torch.randint(0, VOCAB, (b, SEQ), generator=g)


def reference_states(model: LanguageModel, x: torch.Tensor) -> list:
    """The scheme's own loop, outside the model: the state after 0, 1, ... sublayers."""
    scheme = model.scheme
    state = scheme.enter(model.embed(x))
    states = [state]
    for i, sub in enumerate(model.sublayers):
        state = scheme.step(state, i, sub)
        states.append(state)
    return states


def unembed(model: LanguageModel, h: torch.Tensor) -> torch.Tensor:
    return h @ model.embed.weight.T


# ---- the tap ------------------------------------------------------------------------------------
@torch.no_grad()
def test_tap_records_every_stream_after_every_sublayer_and_restores_the_scheme():
    model = lm("siamese")
    randomize_(model.scheme)
    x, y = batch()
    expected = [model.scheme.streams(s) for s in reference_states(model, x)]
    logits = model(x).logits
    with StreamTap(model) as tap:
        again = model(x).logits
    assert torch.equal(logits, again)                     # observing changes nothing
    assert len(tap.states) == 2 * LAYERS + 1 and tap.forwards == 1
    for got, want in zip(tap.states, expected):
        assert set(got) == {"x", "y"}
        for name in got:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-12)
    torch.testing.assert_close(unembed(model, tap.output), logits, rtol=0, atol=1e-12)
    assert [id(s) for s in tap.block_states()] == [id(s) for s in tap.states[::2]]
    assert not {"enter", "step", "exit"} & set(vars(model.scheme))


@torch.no_grad()
def test_tap_restores_the_scheme_after_an_error_and_nests():
    model = lm("pre")
    x, _ = batch()
    with pytest.raises(RuntimeError, match="boom"), StreamTap(model):
        raise RuntimeError("boom")
    assert not {"enter", "step", "exit"} & set(vars(model.scheme))
    with StreamTap(model) as outer, StreamTap(model, skip=range(2 * LAYERS)) as inner:
        model(x)
    assert outer.forwards == inner.forwards == 1
    # the inner tap skips everything: the outer one sees the entry state at every depth
    assert all(torch.equal(s["h"], outer.states[0]["h"]) for s in outer.states)


@torch.no_grad()
def test_skipping_every_sublayer_leaves_embedding_to_head():
    model = lm("pre")
    randomize_(model.scheme)
    x, _ = batch()
    with StreamTap(model, skip=range(2 * LAYERS), record=False) as tap:
        logits = model(x).logits
    assert tap.states == [] and tap.output is None
    expected = unembed(model, model.scheme.final_norm(model.embed(x)))
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-12)


# ---- probes -------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", ["pre", "siamese", "hyper"])
def test_sublayer_rms_matches_a_hand_computed_rms(scheme):
    model = lm(scheme)
    x, y = batch()
    with torch.no_grad():
        states = [model.scheme.streams(s) for s in reference_states(model, x)]
    got = sublayer_rms(model, (x, y))
    assert set(got) == set(states[0])
    for name, values in got.items():
        want = [math.sqrt(float((s[name].double() ** 2).sum()) / s[name].numel()) for s in states]
        assert values == pytest.approx(want, rel=1e-6, abs=0)


def test_norm_gains_report_gains_set_by_hand():
    model = lm("siamese")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        model.scheme.merge_norm_x.weight.fill_(1.05)
        model.scheme.merge_norm_y.weight.fill_(-0.42)          # the gain's size, not its sign
        model.scheme.post_norm[3].weight.copy_(torch.randn(DIM, generator=g, dtype=F64))
    gains = norm_gains(model)
    assert gains["merge_norm_x"] == pytest.approx(1.05, abs=1e-12)
    assert gains["merge_norm_y"] == pytest.approx(0.42, abs=1e-12)
    assert gains["final_norm"] == 1.0
    expected = float(model.scheme.post_norm[3].weight.detach().abs().mean())
    assert gains["post_norm"][3] == pytest.approx(expected, abs=1e-12)
    assert len(gains["post_norm"]) == len(gains["pre_norm"]) == len(gains["input_norm"]) == 2 * LAYERS
    assert [v for i, v in enumerate(gains["post_norm"]) if i != 3] == [1.0] * (2 * LAYERS - 1)


def test_norm_gains_follow_the_scheme_hybrid_pre_x_gain_per_block_and_pre_norm_alone():
    model = lm("siamese", form="hybrid_pre")
    with torch.no_grad():
        model.scheme.x_gain[1].fill_(0.25)
    gains = norm_gains(model)
    assert gains["x_gain"] == [1.0, 0.25, 1.0]
    assert len(gains["post_norm"]) == LAYERS and len(gains["pre_norm"]) == 2 * LAYERS
    assert set(norm_gains(lm("pre"))) == {"pre_norm", "final_norm"}


def test_grad_norms_split_the_total_into_embedding_scheme_and_blocks():
    model = lm("siamese")
    model.zero_grad(set_to_none=True)
    model(*batch()).loss.backward()
    got = grad_norms(model)

    def norm(params) -> float:
        return math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params if p.grad is not None))

    blocks = [norm(list(model.sublayers[2 * b].parameters()) + list(model.sublayers[2 * b + 1].parameters()))
              for b in range(LAYERS)]
    assert got["blocks"] == pytest.approx(blocks, rel=1e-9)
    assert got["scheme"] == pytest.approx(norm(model.scheme.parameters()), rel=1e-9)
    assert got["total"] == pytest.approx(norm(model.parameters()), rel=1e-9)
    # the tied embedding is the only parameter outside the scheme and the blocks
    assert got["total"] ** 2 == pytest.approx(
        norm([model.embed.weight]) ** 2 + got["scheme"] ** 2 + sum(b * b for b in blocks), rel=1e-9)


# ---- pruning ------------------------------------------------------------------------------------
def test_a_zeroed_block_has_exactly_zero_pruning_sensitivity():
    model = lm("pre")
    with torch.no_grad():   # block 1 writes nothing into the stream: skipping it changes nothing
        model.sublayers[2].out_proj.weight.zero_()
        model.sublayers[3].down_proj.weight.zero_()
    result = pruning_sensitivity(model, [batch(1), batch(2)])
    assert result["per_block"][1] == 0.0
    assert result["per_block"][0] != 0.0 and result["per_block"][2] != 0.0
    assert result["depth_curve"][-1] == 0.0 and len(result["depth_curve"]) == LAYERS + 1
    # keeping blocks 0 and 1 is the same as keeping all when block 2 is the only one after them
    assert result["depth_curve"][2] == pytest.approx(result["per_block"][2], abs=1e-12)


def test_skipping_a_block_is_the_shallower_model_without_it():
    model = lm("pre")
    randomize_(model.scheme)
    shallow = lm("pre", n_layers=2, seed=9)
    keep = [0, 1, 4, 5]                              # sublayers of blocks 0 and 2
    with torch.no_grad():
        shallow.embed.weight.copy_(model.embed.weight)
        shallow.scheme.final_norm.load_state_dict(model.scheme.final_norm.state_dict())
        for j, i in enumerate(keep):
            shallow.sublayers[j].load_state_dict(model.sublayers[i].state_dict())
            shallow.scheme.pre_norm[j].load_state_dict(model.scheme.pre_norm[i].state_dict())
    batches = [batch(1), batch(2)]
    want = sum(shallow(*b).loss.item() for b in batches) / 2
    assert mean_loss(model, batches, skip_blocks=[1]) == pytest.approx(want, abs=1e-10)
    # keeping no block: embedding, final norm, head
    x, y = batches[0]
    empty = F.cross_entropy(unembed(model, model.scheme.final_norm(model.embed(x))).reshape(-1, VOCAB),
                            y.reshape(-1)).item()
    base = mean_loss(model, batches[:1])
    assert pruning_sensitivity(model, batches[:1])["depth_curve"][0] == pytest.approx(empty - base, abs=1e-10)


def test_effective_depth_counts_the_blocks_that_matter():
    assert effective_depth([0.2, 0.2, 0.2, 0.2]) == pytest.approx(4.0)
    assert effective_depth([0.5, 0.0, -0.1]) == pytest.approx(1.0)
    assert effective_depth([0.3, 0.1]) == pytest.approx(0.16 / 0.1)
    assert effective_depth([0.0, -1.0]) == 0.0


# ---- logit lens ---------------------------------------------------------------------------------
class TwoStreams(ResidualScheme):
    """A two-stream test scheme: both streams take the Pre-Norm update of X, Y ``y_scale`` times
    it plus ``y_shift``; the exit reads X alone. ``y_scale=1, y_shift=0``: the streams are equal."""

    name = "two-streams-test"

    def __init__(self, dim: int, n_layers: int, y_scale: float = 1.0, y_shift: torch.Tensor | None = None,
                 dtype=F64) -> None:
        super().__init__(dim, n_layers, norm="rmsnorm", dtype=dtype)
        self.pre_norm = self.make_norms(self.n_sublayers)
        self.final_norm = self.make_norm()
        self.y_scale, self.y_shift = y_scale, y_shift

    def enter(self, h):
        return h, h

    def step(self, state, i, branch):
        x, y = state
        out = branch(self.pre_norm[i](x))
        return x + out, y + self.y_scale * out + (0 if self.y_shift is None else self.y_shift[i])

    def exit(self, state):
        return self.final_norm(state[0])

    def streams(self, state):
        return {"x": state[0], "y": state[1]}


def test_the_lens_of_equal_streams_agrees_everywhere():
    model = lm("pre")
    model.scheme = TwoStreams(DIM, LAYERS)
    lens = logit_lens(model, [batch(1), batch(2)])
    assert lens["positions"] == 2 * 3 * SEQ
    assert lens["agreement"] == {"x": 1.0, "y": 1.0}
    assert lens["disagree_fraction"] == 0.0 and lens["follows"] == {"x": None, "y": None}
    assert lens["by_depth"]["x"] == lens["by_depth"]["y"] and lens["by_depth"]["x"][-1] == 1.0


def test_a_model_reading_one_stream_follows_it_wherever_the_streams_disagree():
    model = lm("pre")
    shift = torch.randn(2 * LAYERS, DIM, generator=torch.Generator().manual_seed(4), dtype=F64)
    model.scheme = TwoStreams(DIM, LAYERS, y_scale=-2.0, y_shift=shift)
    lens = logit_lens(model, [batch(1)])
    assert 0.3 < lens["disagree_fraction"] <= 1.0
    assert lens["agreement"]["x"] == 1.0
    assert lens["agreement"]["y"] == pytest.approx(1 - lens["disagree_fraction"])
    assert lens["follows"] == {"x": 1.0, "y": 0.0}


@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
@torch.no_grad()
def test_siamese_lens_matches_a_hand_computed_projection_of_each_stream(norm):
    model = lm("siamese", norm=norm)
    randomize_(model.scheme, scale=0.5)
    eps = model.scheme.eps
    batches = [batch(1), batch(2)]
    agree, follows, split, total = {"x": 0, "y": 0}, {"x": 0, "y": 0}, 0, 0
    depth = {"x": [0] * (LAYERS + 1), "y": [0] * (LAYERS + 1)}
    for x, _ in batches:
        final = model(x).logits.argmax(-1)
        states = reference_states(model, x)

        def read(stream: torch.Tensor) -> torch.Tensor:
            if norm == "layernorm":
                stream = stream - stream.mean(-1, keepdim=True)
            normed = stream / torch.sqrt((stream ** 2).mean(-1, keepdim=True) + eps)
            return unembed(model, normed).argmax(-1)

        last = {"x": read(states[-1][0]), "y": read(states[-1][1])}
        differ = last["x"] != last["y"]
        split += int(differ.sum())
        total += final.numel()
        for k, s in enumerate(("x", "y")):
            agree[s] += int((last[s] == final).sum())
            follows[s] += int(((last[s] == final) & differ).sum())
            for b in range(LAYERS + 1):
                depth[s][b] += int((read(states[2 * b][k]) == final).sum())
    lens = logit_lens(model, batches)
    assert split > 0 and lens["positions"] == total
    assert lens["agreement"] == {s: v / total for s, v in agree.items()}
    assert lens["disagree_fraction"] == split / total
    assert lens["follows"] == {s: v / split for s, v in follows.items()}
    assert lens["by_depth"] == {s: [c / total for c in v] for s, v in depth.items()}


# ---- angular distance ---------------------------------------------------------------------------
@torch.no_grad()
def test_angular_distance_matches_the_arccos_of_consecutive_block_states():
    model = lm("siamese")
    randomize_(model.scheme)
    batches = [batch(1), batch(2)]
    sums = {"x": [0.0] * LAYERS, "y": [0.0] * LAYERS}
    count = 0
    for x, _ in batches:
        states = reference_states(model, x)[::2]
        for k, s in enumerate(("x", "y")):
            for b in range(LAYERS):
                u, v = states[b][k], states[b + 1][k]
                cos = (u * v).sum(-1) / (u.norm(dim=-1) * v.norm(dim=-1))
                sums[s][b] += float((torch.arccos(cos.clamp(-1, 1)) / math.pi).sum())
        count += x.numel()
    got = angular_distances(model, batches)
    for s in ("x", "y"):
        assert got[s] == pytest.approx([v / count for v in sums[s]], abs=1e-9)


def test_blocks_that_write_nothing_turn_nothing():
    model = lm("pre")
    with torch.no_grad():
        for sub in model.sublayers:
            for name in ("out_proj", "down_proj"):
                if hasattr(sub, name):
                    getattr(sub, name).weight.zero_()
    assert angular_distances(model, [batch()]) == {"h": [0.0] * LAYERS}


# ---- probes during training ---------------------------------------------------------------------
def _probe(every: int = 2) -> TrainingProbes:
    x, y = RandomWindows(seed=5).next_batch()
    return TrainingProbes(every, (x[:2], y[:2]))


def test_probes_record_unclipped_gradients_and_the_final_model(tmp_path):
    model = make_model("siamese")
    probe = _probe(every=3)
    train(model, RandomWindows(), settings(steps=9, grad_clip=0.05), tmp_path / "run", probe=probe)
    records = read_probes(tmp_path / "run")
    assert [r["step"] for r in records] == [3, 6, 9]
    logged = {r["step"]: r["grad_norm"] for r in rows(tmp_path / "run")}
    for r in records:   # the loop logs the norm before clipping; a probe after clipping would read 0.05
        assert r["grad_norm"] == pytest.approx(logged[r["step"]], rel=1e-5) and r["grad_norm"] > 0.1
        assert len(r["grad_norm_blocks"]) == 2 and set(r["rms"]) == {"x", "y"}
        assert len(r["rms"]["x"]) == 5 and "merge_norm_y" in r["gains"]
    model.eval()
    assert records[-1]["rms"] == sublayer_rms(model, probe.batch)
    assert records[-1]["gains"] == json.loads(json.dumps(norm_gains(model)))


def test_probes_change_nothing_the_run_computes_and_resume_repeats_them(tmp_path):
    opts = dict(steps=10, checkpoint_every=6, eval_every=5)
    plain_model, probed = make_model(dropout=0.1), make_model(dropout=0.1)
    train(plain_model, RandomWindows(), settings(**opts), tmp_path / "plain")
    train(probed, RandomWindows(), settings(**opts), tmp_path / "a", probe=_probe())
    for key in ("loss", "grad_norm", "val_loss"):
        assert [r.get(key) for r in rows(tmp_path / "a")] == [r.get(key) for r in rows(tmp_path / "plain")]
    for p, q in zip(plain_model.parameters(), probed.parameters()):
        assert torch.equal(p, q)

    with pytest.raises(RuntimeError):            # crash at step 8: checkpoint at 6, probes to 6
        train(make_model(dropout=0.1), RandomWindows(fail_at=8, error=RuntimeError), settings(**opts),
              tmp_path / "b", probe=_probe())
    assert [r["step"] for r in read_probes(tmp_path / "b")] == [2, 4, 6]
    train(make_model(dropout=0.1, seed=3), RandomWindows(seed=77), settings(**opts), tmp_path / "b",
          resume=True, probe=_probe())
    assert read_probes(tmp_path / "b") == read_probes(tmp_path / "a")
    assert [r["loss"] for r in rows(tmp_path / "b")] == [r["loss"] for r in rows(tmp_path / "plain")]


def test_a_diverged_step_is_probed_with_its_gradient(tmp_path):
    # a learning rate this large makes the loss explode; the probe still records that step
    train(make_model("pre"), RandomWindows(), settings(steps=10, lr=1e4, warmup=0), tmp_path,
          probe=_probe(every=1))
    records, logged = read_probes(tmp_path), rows(tmp_path)
    assert records[-1].get("diverged") is True and logged[-1].get("diverged") is True
    assert records[-1]["step"] == logged[-1]["step"]


# ---- configuration ------------------------------------------------------------------------------
def test_analysis_config_section():
    assert AnalysisConfig().every == 0 and load_config("tiny").analysis.every == 0
    cfg = load_config("tiny", ["analysis.every=10", "analysis.batches=3"])
    assert (cfg.analysis.every, cfg.analysis.batches, cfg.analysis.at_end) == (10, 3, True)
    with pytest.raises(ConfigError, match="analysis.every must not be negative"):
        load_config("tiny", ["analysis.every=-1"])
    with pytest.raises(ConfigError, match="unknown key 'analysis.evry'"):
        load_config("tiny", ["analysis.evry=1"])
    with pytest.raises(ConfigError, match="analysis.every"):
        TrainingProbes(0, None)


# ---- other hosts ----------------------------------------------------------------------------------
def test_vision_and_diffusion_models_plug_in_with_their_own_loss_and_head():
    from siamesenorm.models.dit import DiT, DiTConfig
    from siamesenorm.models.vit import VisionTransformer, ViTConfig

    torch.manual_seed(0)
    vit = VisionTransformer(ViTConfig(image_size=8, patch_size=2, in_chans=1, num_classes=10, dim=16,
                                      n_layers=3, n_heads=2, scheme="pre")).eval()
    with torch.no_grad():        # block 1 writes nothing: every weight of its two sublayers is zero
        for p in [*vit.sublayers[2].parameters(), *vit.sublayers[3].parameters()]:
            p.zero_()
    g = torch.Generator().manual_seed(0)
    images, labels = torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)

    def vit_loss(model, b):
        return F.cross_entropy(model(b[0]).logits, b[1])

    def vit_head(model, hidden):
        return model.head(hidden[:, 0])

    pruning = pruning_sensitivity(vit, [(images, labels)], vit_loss)
    assert pruning["per_block"][1] == 0.0 and pruning["per_block"][0] != 0.0
    lens = logit_lens(vit, [(images, labels)], vit_loss, vit_head)
    assert lens["positions"] == 4 and lens["agreement"]["h"] == 1.0   # one stream: the head's own input
    assert len(sublayer_rms(vit, (images, labels), vit_loss)["h"]) == 7

    # DiT's adaLN-Zero gates start at zero: at initialisation no block changes the stream.
    dit = DiT(DiTConfig(input_size=8, patch_size=2, in_chans=1, num_classes=10, dim=16, n_layers=2,
                        n_heads=2, scheme="pre", learn_sigma=False)).eval()
    t, y = torch.randint(0, 1000, (4,), generator=g), torch.randint(0, 10, (4,), generator=g)

    def dit_loss(model, b):
        x, t, y, noise = b
        return F.mse_loss(model(x + noise, t, y), noise)

    batch_ = (images, t, y, torch.randn(4, 1, 8, 8, generator=g))
    assert pruning_sensitivity(dit, [batch_], dit_loss)["per_block"] == [0.0, 0.0]
    assert "pre_norm" not in norm_gains(dit)       # DiT's branch norms are non-affine: no gain to read


def test_pruning_a_dit_compares_losses_under_the_same_noise():
    """The real diffusion objective draws timesteps and noise in eval mode from a generator that
    restarts only when eval mode is entered; every pruning pass must restart it, or the loss
    differences measure the noise. With zero gates no block writes anything: every difference is 0."""
    from siamesenorm.diffusion import DiffusionObjective
    from siamesenorm.models.dit import DiT, DiTConfig

    torch.manual_seed(0)
    dit = DiT(DiTConfig(input_size=8, patch_size=2, in_chans=1, num_classes=10, dim=16, n_layers=3,
                        n_heads=2, scheme="pre", learn_sigma=False))
    with torch.no_grad():          # a final layer that reads the stream, so the loss depends on it
        for p in dit.final_layer.parameters():
            p.normal_(0.0, 0.5)
    objective = DiffusionObjective(dit, eval_seed=3)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.rand(4, 1, 8, 8, generator=g) * 2 - 1, torch.randint(0, 10, (4,), generator=g))
               for _ in range(2)]

    def loss(model, b):
        return model(*b).loss

    result = pruning_sensitivity(objective, batches, loss)
    assert result["per_block"] == [0.0, 0.0, 0.0]
    assert result["depth_curve"] == [0.0, 0.0, 0.0, 0.0]
    assert result["effective_depth"] == 0.0
    assert objective.training           # the mode it had is restored
    with torch.no_grad():               # and a block that writes something does count
        for p in dit.modulation[1].parameters():
            p.normal_(0.0, 0.5)
    assert pruning_sensitivity(objective, batches, loss)["per_block"][1] != 0.0
