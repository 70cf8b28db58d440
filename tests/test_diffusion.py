"""Gaussian diffusion: schedule, forward process, posterior, the model's reverse step, the hybrid loss,
DDPM/DDIM sampling with guidance, the training-loop wrapper and the image grid.

References are written here from the papers' formulas (DDPM arXiv 2006.11239, improved DDPM arXiv
2102.09672, DDIM arXiv 2010.02502), in float64, independently of the implementation.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from torch import nn

from helpers import raises_value_error, randomize_
from siamesenorm.diffusion import (
    DiffusionObjective,
    create_diffusion,
    ddim_sample,
    ddpm_sample,
    discretized_gaussian_log_likelihood,
    guided_output,
    linear_betas,
    null_label_of,
    sample,
    save_image_grid,
    space_timesteps,
    training_losses,
)
from siamesenorm.errors import ConfigError
from siamesenorm.models import DiT, DiTConfig
from siamesenorm.models.host import SchemeHost

T = 1000


def ref_abar(t: int, betas: np.ndarray | None = None) -> float:
    """prod_{s <= t} (1 - beta_s) for DiT's linear schedule (or ``betas``); 1 for t = -1."""
    b = np.linspace(1e-4, 0.02, T) if betas is None else betas
    return float(np.prod(1.0 - b[:t + 1]))


def ref_posterior(x0, xt, t: int):
    """q(x_{t-1} | x_t, x_0) by Bayes: N(x_{t-1}; sqrt(abar_{t-1}) x0, 1 - abar_{t-1}) times
    N(x_t; sqrt(alpha_t) x_{t-1}, beta_t), completed to a Gaussian in x_{t-1}."""
    beta = 1e-4 + (0.02 - 1e-4) * t / (T - 1)
    prev = ref_abar(t - 1)
    precision = 1.0 / (1.0 - prev) + (1.0 - beta) / beta
    mean = (math.sqrt(prev) * x0 / (1.0 - prev) + math.sqrt(1.0 - beta) * xt / beta) / precision
    return mean, 1.0 / precision


class Oracle(nn.Module):
    """A 'model' that knows x0: it returns the exact noise of x_t (and v for a learned variance)."""

    def __init__(self, x0: torch.Tensor, v: float | None = None, num_classes: int = 3) -> None:
        super().__init__()
        self.x0, self.v, self.num_classes = x0, v, num_classes
        self.calls: list[list[int]] = []
        self.inputs: list[torch.Tensor] = []
        self.weight = nn.Parameter(torch.zeros(()))   # gives the oracle a device and a mode

    def forward(self, x, t, y):
        self.calls.append(t.tolist())
        self.inputs.append(x.detach().clone())
        abar = torch.tensor([ref_abar(int(s)) for s in t], dtype=x.dtype).view(-1, 1, 1, 1)
        eps = (x - abar.sqrt() * self.x0) / (1 - abar).sqrt()
        if self.v is None:
            return eps
        return torch.cat([eps, torch.full_like(eps, self.v)], dim=1)


class CfgStandIn(nn.Module):
    """A denoiser that is not a DiT: output depends on x, t and y (labels 0..4, 4 the null class),
    with ``2 * channels`` output channels (noise, then variance)."""

    def __init__(self, channels: int = 2) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = nn.Parameter(torch.randn(5, 2 * channels, generator=g, dtype=torch.float64))
        self.channels = channels

    def forward(self, x, t, y):
        out = torch.cat([x, x.flip(1)], dim=1) * (1 + t.view(-1, 1, 1, 1) / 1000)
        return torch.tanh(out + self.embed[y][:, :, None, None])


def tiny_dit() -> DiT:
    """A small DiT on 1 x 4 x 4 images of 3 classes (learned variance), initialised from torch's
    generator, then moved off its adaLN-Zero start so that its output depends on x, t and y."""
    dit = DiT(DiTConfig(input_size=4, patch_size=2, in_chans=1, num_classes=3, dim=8, n_layers=1,
                        n_heads=2, frequency_dim=16))
    randomize_(dit)
    return dit


# ---- schedule and forward process --------------------------------------------------------------

def test_linear_schedule_and_respacing_keep_the_training_abar():
    betas = linear_betas()
    assert len(betas) == T and betas[0] == 1e-4 and betas[-1] == pytest.approx(0.02, abs=1e-15)
    d = create_diffusion()
    assert d.num_timesteps == T
    assert d.table("alphas_cumprod")[500].item() == pytest.approx(ref_abar(500), rel=1e-12)
    assert create_diffusion(num_timesteps=50, beta_end=0.01).num_timesteps == 50
    keep = space_timesteps(T, 10)
    assert len(keep) == 10 and keep[0] == 0 and keep[-1] == T - 1
    r = d.respace(10)
    assert r.timestep_map == keep
    for i, t in enumerate(keep):
        assert r.table("alphas_cumprod")[i].item() == pytest.approx(ref_abar(t), rel=1e-10)
    with pytest.raises(ConfigError, match="noise schedule"):
        create_diffusion(schedule="quadratic")
    cos = create_diffusion(schedule="cosine").table("alphas_cumprod")
    assert cos[-1] < 1e-4 and torch.all(cos[1:] < cos[:-1])


@pytest.mark.parametrize("steps", [1000, 250, 100, 4000])
def test_linear_schedule_scales_its_ends_by_1000_over_t_like_adm(steps):
    """ADM/DiT ``get_named_beta_schedule("linear", T)``: scale = 1000 / T, betas linspace from
    scale * 1e-4 to scale * 0.02 (written here from the official code, not from ours)."""
    scale = 1000 / steps
    want = np.linspace(scale * 0.0001, scale * 0.02, steps, dtype=np.float64)
    np.testing.assert_allclose(linear_betas(steps), want, rtol=1e-15, atol=0)
    got = create_diffusion(num_timesteps=steps).table("betas").numpy()
    np.testing.assert_allclose(got, want, rtol=1e-15, atol=0)
    # Configured ends are the 1,000-step values, scaled the same way.
    np.testing.assert_allclose(linear_betas(steps, 2e-4, 0.01),
                               np.linspace(scale * 2e-4, scale * 0.01, steps), rtol=1e-15, atol=0)
    # The scaling keeps the total noise of the process about the same: abar_T near 4e-5.
    assert create_diffusion(num_timesteps=steps).table("alphas_cumprod")[-1] < 1e-4


def test_linear_schedule_refuses_a_t_that_scales_beta_end_to_one():
    with pytest.raises(ConfigError, match=r"over 20 steps scales beta_end 0.02 .* at least 21 timesteps"):
        linear_betas(20)
    assert linear_betas(21)[-1] == pytest.approx(0.02 * 1000 / 21, rel=1e-14)


def test_q_sample_has_the_closed_form_mean_and_variance():
    d = create_diffusion()
    x0 = torch.tensor([[-0.7, 0.2, 0.9]], dtype=torch.float64).view(1, 3, 1, 1)
    t = torch.tensor([300])
    mean, var, log_var = d.q_mean_variance(x0, t)
    assert torch.allclose(mean, math.sqrt(ref_abar(300)) * x0, atol=1e-12, rtol=0)
    assert torch.allclose(var, torch.full_like(x0, 1 - ref_abar(300)), atol=1e-12, rtol=0)
    assert torch.allclose(log_var, var.log())
    g = torch.Generator().manual_seed(0)
    n = 200_000
    noise = torch.randn(n, 3, 1, 1, generator=g, dtype=torch.float64)
    draws = d.q_sample(x0.expand(n, -1, -1, -1), t.expand(n), noise)
    assert torch.allclose(draws.mean(0), mean[0], atol=4 * math.sqrt(var[0, 0, 0, 0].item() / n))
    assert torch.allclose(draws.var(0), var[0], rtol=0.01)


@pytest.mark.parametrize("t", [1, 10, 500, 999])
def test_posterior_matches_bayes_rule(t):
    d = create_diffusion()
    g = torch.Generator().manual_seed(t)
    x0, xt = torch.randn(2, 2, 3, 3, generator=g, dtype=torch.float64)
    tt = torch.tensor([t, t])
    mean, var, log_var = d.q_posterior_mean_variance(x0[None].expand(2, -1, -1, -1),
                                                     xt[None].expand(2, -1, -1, -1), tt)
    want_mean, want_var = ref_posterior(x0, xt, t)
    assert torch.allclose(mean[0], want_mean, atol=1e-10, rtol=0)
    assert torch.allclose(var, torch.full_like(var, want_var), rtol=1e-10, atol=0)
    assert torch.allclose(log_var, torch.full_like(var, math.log(want_var)), rtol=1e-10, atol=0)


def test_posterior_at_t0_returns_x0_and_clips_its_log_variance():
    d = create_diffusion()
    x0, xt = torch.ones(1, 1, 2, 2, dtype=torch.float64) * 0.3, torch.randn(1, 1, 2, 2, dtype=torch.float64)
    mean, var, log_var = d.q_posterior_mean_variance(x0, xt, torch.tensor([0]))
    assert torch.allclose(mean, x0) and (var == 0).all()
    assert torch.allclose(log_var, torch.full_like(x0, math.log(ref_posterior(0.0, 0.0, 1)[1])))


def test_reverse_step_variance_fixed_small_large_and_learned_range():
    x = torch.randn(2, 1, 2, 2, dtype=torch.float64)
    t = torch.tensor([40, 40])
    eps = torch.randn_like(x)
    beta = 1e-4 + (0.02 - 1e-4) * 40 / (T - 1)
    small = ref_posterior(0.0, 0.0, 40)[1]
    small_p = create_diffusion().p_mean_variance(eps, x, t)
    assert torch.allclose(small_p.variance, torch.full_like(x, small), rtol=1e-10)
    large_p = create_diffusion(fixed_variance="large").p_mean_variance(eps, x, t)
    assert torch.allclose(large_p.variance, torch.full_like(x, beta), rtol=1e-10)
    d = create_diffusion()
    middle = 0.5 * (math.log(beta) + math.log(small))
    for v, want in [(1.0, math.log(beta)), (-1.0, math.log(small)), (0.0, middle)]:
        p = d.p_mean_variance(torch.cat([eps, torch.full_like(x, v)], 1), x, t)
        assert torch.allclose(p.log_variance, torch.full_like(x, want), rtol=1e-10)
    x0 = (x - math.sqrt(1 - ref_abar(40)) * eps) / math.sqrt(ref_abar(40))
    unclipped = d.p_mean_variance(eps, x, t, clip_denoised=False)
    assert torch.allclose(unclipped.pred_xstart, x0, atol=1e-10)
    assert torch.allclose(unclipped.mean, ref_posterior(x0, x, 40)[0], atol=1e-10)
    with raises_value_error("returned 3 channels"):
        d.p_mean_variance(torch.zeros(2, 3, 2, 2), x, t)


# ---- the training loss ------------------------------------------------------------------------

def test_oracle_loss_is_zero_and_its_kl_vanishes_at_the_true_variance():
    g = torch.Generator().manual_seed(0)
    x0 = torch.rand(4, 2, 4, 4, generator=g, dtype=torch.float64) * 2 - 1
    noise = torch.randn(x0.shape, generator=g, dtype=torch.float64)
    t = torch.tensor([5, 100, 600, 999])
    d = create_diffusion()
    terms = training_losses(Oracle(x0, v=-1.0), d, x0, t, noise, torch.zeros(4, dtype=torch.long))
    assert terms["mse"].abs().max() < 1e-20
    assert terms["vb"].abs().max() < 1e-9   # v = -1 is the posterior variance: p equals q
    fixed = training_losses(Oracle(x0), d, x0, t, noise, torch.zeros(4, dtype=torch.long))
    assert fixed["loss"].abs().max() < 1e-20 and (fixed["vb"] == 0).all()


def test_vb_term_matches_a_direct_gaussian_kl():
    t_val = 250
    g = torch.Generator().manual_seed(1)
    x0 = torch.rand(3, 1, 3, 3, generator=g, dtype=torch.float64) * 2 - 1
    noise = torch.randn(x0.shape, generator=g, dtype=torch.float64)
    out = torch.randn(3, 2, 3, 3, generator=g, dtype=torch.float64) * 0.5

    class Fixed(nn.Module):
        def forward(self, x, t, y):
            return out

    t = torch.full((3,), t_val)
    terms = training_losses(Fixed(), create_diffusion(), x0, t, noise, torch.zeros(3, dtype=torch.long))
    # the reference, from the formulas
    abar, beta = ref_abar(t_val), 1e-4 + (0.02 - 1e-4) * t_val / (T - 1)
    xt = math.sqrt(abar) * x0 + math.sqrt(1 - abar) * noise
    eps, v = out[:, :1], out[:, 1:]
    x0_hat = (xt - math.sqrt(1 - abar) * eps) / math.sqrt(abar)
    mean_p, var_q = ref_posterior(x0_hat, xt, t_val)
    mean_q, _ = ref_posterior(x0, xt, t_val)
    frac = (v + 1) / 2
    var_p = torch.exp(frac * math.log(beta) + (1 - frac) * math.log(var_q))
    kl = 0.5 * (torch.log(var_p / var_q) + (var_q + (mean_q - mean_p) ** 2) / var_p - 1)
    want = kl.mean(dim=(1, 2, 3)) / math.log(2)
    assert torch.allclose(terms["vb"], want, rtol=1e-9, atol=1e-12)
    mse = ((noise - eps) ** 2).mean(dim=(1, 2, 3))
    assert torch.allclose(terms["mse"], mse) and torch.allclose(terms["loss"], mse + want)


def test_decoder_nll_at_t0_is_the_mass_of_the_pixel_bin():
    x = torch.tensor([-1.0, -0.5, 0.0, 1 / 255 * 3, 1.0], dtype=torch.float64)
    mean = torch.tensor([-0.9, -0.45, 0.3, 0.0, 0.97], dtype=torch.float64)
    log_scale = torch.tensor([-2.0, -3.0, -1.0, -5.0, -2.5], dtype=torch.float64)

    def cdf(z):
        return 0.5 * (1 + math.erf(z / math.sqrt(2)))

    want = []
    for xi, mi, si in zip(x.tolist(), mean.tolist(), log_scale.exp().tolist()):
        hi = 1.0 if xi > 0.999 else cdf((xi + 1 / 255 - mi) / si)
        lo = 0.0 if xi < -0.999 else cdf((xi - 1 / 255 - mi) / si)
        want.append(math.log(hi - lo))
    got = discretized_gaussian_log_likelihood(x, mean, log_scale)
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=1e-9)
    # a far-out-of-bin mean in the upper tail stays finite and accurate (no cancellation)
    tail = discretized_gaussian_log_likelihood(torch.tensor([0.5], dtype=torch.float64),
                                               torch.tensor([0.0], dtype=torch.float64),
                                               torch.tensor([math.log(0.08)], dtype=torch.float64))
    direct = math.log(0.5 * (math.erfc((0.5 - 1 / 255) / 0.08 / math.sqrt(2))
                             - math.erfc((0.5 + 1 / 255) / 0.08 / math.sqrt(2))))
    assert tail.item() == pytest.approx(direct, rel=1e-6)


def test_vb_term_trains_only_the_variance_channels():
    x0 = torch.rand(2, 1, 2, 2) * 2 - 1

    class Param(nn.Module):
        def __init__(self):
            super().__init__()
            self.out = nn.Parameter(torch.randn(2, 2, 2, 2) * 0.3)

        def forward(self, x, t, y):
            return self.out

    model = Param()
    terms = training_losses(model, create_diffusion(), x0, torch.tensor([3, 700]), torch.randn_like(x0),
                            torch.zeros(2, dtype=torch.long))
    terms["vb"].sum().backward()
    assert (model.out.grad[:, :1] == 0).all() and (model.out.grad[:, 1:] != 0).all()


# ---- sampling -------------------------------------------------------------------------------------

@pytest.mark.parametrize("method,steps,v", [("ddim", 25, None), ("ddim", 25, 0.3), ("ddpm", 40, 0.3),
                                            ("ddpm", None, None)])
def test_oracle_sampling_returns_x0(method, steps, v):
    g = torch.Generator().manual_seed(0)
    x0 = torch.rand(3, 1, 4, 4, generator=g, dtype=torch.float64) * 1.8 - 0.9
    oracle = Oracle(x0, v=v).double()
    noise = torch.randn(x0.shape, generator=g, dtype=torch.float64)
    out = sample(oracle, torch.tensor([0, 1, 2]), create_diffusion(), method=method, steps=steps,
                 generator=torch.Generator().manual_seed(1), shape=(1, 4, 4), noise=noise)
    assert torch.allclose(out, x0.float(), atol=1e-5)
    visited = [ts[0] for ts in oracle.calls]
    n = T if steps is None else steps
    assert len(visited) == n and visited == sorted(visited, reverse=True) and visited[0] == T - 1
    assert visited[-1] == 0 and visited == space_timesteps(T, n)[::-1]


@pytest.mark.parametrize("method,eta", [("ddpm", 0.0), ("ddim", 1.0), ("ddim", 0.5)])
def test_stochastic_samplers_keep_the_forward_marginals(method, eta):
    """With the exact noise and the posterior variance, every step draws x_{t-1} ~ q(x_{t-1} | x_t, x0)
    (DDPM; DDIM for any eta by construction), so x at each visited t is ~ N(sqrt(abar_t) x0, 1 - abar_t)."""
    x0 = torch.full((1, 1, 100, 100), 0.5, dtype=torch.float64)
    oracle = Oracle(x0).double()
    sample(oracle, torch.tensor([0]), create_diffusion(), method=method, steps=6, eta=eta,
           shape=(1, 100, 100), generator=torch.Generator().manual_seed(0))
    for ts, x in zip(oracle.calls[1:], oracle.inputs[1:]):   # the first is the N(0, I) start
        abar = ref_abar(ts[0])
        assert x.mean().item() == pytest.approx(math.sqrt(abar) * 0.5, abs=4 * math.sqrt((1 - abar) / 1e4))
        assert x.var().item() == pytest.approx(1 - abar, rel=0.05)


def test_ddim_eta0_is_deterministic_and_eta1_uses_the_generator():
    model = CfgStandIn(channels=1)
    d = create_diffusion().respace(8)
    labels = torch.tensor([0, 1])

    def run(eta, seed, noise_seed=0):
        x_t = torch.randn(2, 1, 3, 3, generator=torch.Generator().manual_seed(noise_seed))
        return ddim_sample(model.float(), d, (2, 1, 3, 3), labels, eta=eta, noise=x_t,
                           generator=torch.Generator().manual_seed(seed))

    assert torch.equal(run(0.0, 1), run(0.0, 2))
    assert not torch.equal(run(1.0, 1), run(1.0, 2)) and torch.equal(run(1.0, 1), run(1.0, 1))
    a = ddpm_sample(model, d, (2, 1, 3, 3), labels, generator=torch.Generator().manual_seed(5))
    b = ddpm_sample(model, d, (2, 1, 3, 3), labels, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b) and a.abs().max() <= 1


def test_guidance_with_scale_one_is_the_conditional_model_and_otherwise_extrapolates():
    model = CfgStandIn(channels=2)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 2, 2, generator=g, dtype=torch.float64)
    t, y = torch.tensor([10, 500, 999]), torch.tensor([0, 3, 1])
    cond = model(x, t, y)
    assert torch.allclose(guided_output(model, x, t, y, 1.0, null_label=4), cond, atol=1e-12)
    uncond = model(x, t, torch.full_like(y, 4))
    want = torch.cat([uncond[:, :2] + 4.0 * (cond[:, :2] - uncond[:, :2]), cond[:, 2:]], dim=1)
    assert torch.allclose(guided_output(model, x, t, y, 4.0, null_label=4), want, atol=1e-12)
    d = create_diffusion().respace(5)
    plain = sample(model.float(), y, d, steps=None, generator=torch.Generator().manual_seed(0),
                   shape=(2, 2, 2))
    assert torch.equal(plain, sample(model, y, d, steps=None, cfg_scale=1.0,
                                     generator=torch.Generator().manual_seed(0), shape=(2, 2, 2)))
    guided = sample(model, y, d, steps=None, cfg_scale=4.0, generator=torch.Generator().manual_seed(0),
                    shape=(2, 2, 2), null_label=4)
    assert not torch.allclose(plain, guided)
    with pytest.raises(ConfigError, match="null_label"):   # only a DiT knows its null class
        sample(model, y, d, cfg_scale=2.0, shape=(2, 2, 2))


def test_a_dit_guides_through_its_forward_with_cfg_and_names_its_null_class_and_shape():
    dit = tiny_dit().eval()
    g = torch.Generator().manual_seed(0)
    x, t, y = torch.randn(3, 1, 4, 4, generator=g), torch.tensor([10, 500, 999]), torch.tensor([0, 2, 1])
    assert null_label_of(dit) == 3 and null_label_of(dit, 7) == 7
    with torch.no_grad():
        cond, uncond = dit(x, t, y), dit(x, t, torch.full_like(y, 3))
        calls = []

        def spy(*args):
            calls.append(args)
            return DiT.forward_with_cfg(dit, *args)

        dit.forward_with_cfg = spy
        got = guided_output(dit, x, t, y, 4.0, null_label=3)
    assert len(calls) == 1
    want = torch.cat([uncond[:, :1] + 4.0 * (cond[:, :1] - uncond[:, :1]), cond[:, 1:]], dim=1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert sample(dit, y, steps=2).shape == (3, 1, 4, 4)   # the image shape from the DiT's config


def test_sample_refuses_what_it_cannot_do():
    model = CfgStandIn(channels=1)
    with pytest.raises(ConfigError, match="sampling method"):
        sample(model, torch.tensor([0]), method="euler", shape=(1, 2, 2))
    with pytest.raises(ConfigError, match="shape"):
        sample(model, torch.tensor([0]))


# ---- the training-loop wrapper -----------------------------------------------------------------

def test_objective_eval_loss_is_deterministic_and_leaves_the_global_rng_alone():
    objective = DiffusionObjective(tiny_dit())
    x, y = torch.rand(8, 1, 4, 4) * 2 - 1, torch.arange(8) % 3
    objective.eval()
    torch.manual_seed(123)
    random.seed(5)
    before, py_before = torch.get_rng_state(), random.getstate()
    with torch.no_grad():
        first = [objective(x, y).loss.item() for _ in range(3)]
    assert torch.equal(torch.get_rng_state(), before) and random.getstate() == py_before
    objective.train()
    objective.eval()   # a new validation pass repeats the same draws
    with torch.no_grad():
        second = [objective(x, y).loss.item() for _ in range(3)]
    assert first == second and len(set(first)) == 3   # successive batches get different t and noise
    objective.train()
    torch.manual_seed(0)
    a = objective(x, y)
    torch.manual_seed(0)
    b = objective(x, y)
    assert a.loss.item() == b.loss.item() and not torch.equal(torch.get_rng_state(), before)
    assert a.loss.requires_grad and torch.allclose(a.loss, a.mse + a.vb) and a.vb.item() > 0


def test_objective_wraps_the_model_state_and_counts():
    dit = tiny_dit()
    objective = DiffusionObjective(dit, create_diffusion(num_timesteps=100))
    assert isinstance(objective, SchemeHost) and isinstance(dit, SchemeHost)
    assert objective.scheme is dit.scheme and objective.sublayers is dit.sublayers
    assert list(objective.state_dict()) == [f"model.{k}" for k in dit.state_dict()]
    assert objective.num_parameters() == sum(p.numel() for p in dit.parameters())
    assert objective.tokens_in(torch.zeros(5, 1, 4, 4)) == 5 * 4
    assert objective.flops_per_token() is None
    assert objective.diffusion.num_timesteps == 100
    out = sample(objective, torch.tensor([0, 2]), steps=4, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 1, 4, 4) and objective.training and dit.training   # mode given back


# ---- image grid ------------------------------------------------------------------------------------

def test_save_image_grid_writes_the_tiles(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    images = -torch.ones(5, 1, 2, 3)
    images[1] = 1.0   # second tile white
    images[4, 0, 1, 2] = 0.0
    path = save_image_grid(images, tmp_path / "out" / "grid.png", nrow=3, padding=1, upscale=2)
    with Image.open(path) as img:
        assert img.mode == "L" and img.size == (3 * 7 + 1, 2 * 5 + 1)
        arr = np.asarray(img)
    assert (arr[1:5, 8:14] == 255).all() and (arr[1:5, 1:7] == 0).all() and (arr[0] == 0).all()
    assert (arr[8:10, 12:14] == 128).all()   # tile 4 (row 1, col 1), pixel (1, 2) at 2x
    rgb = save_image_grid(torch.zeros(2, 3, 4, 4), tmp_path / "rgb.png")
    with Image.open(rgb) as img:
        assert img.mode == "RGB" and img.size == (11, 6)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    with pytest.raises(ConfigError):
        save_image_grid(torch.zeros(2, 2, 4, 4), tmp_path / "bad.png")


# ---- with the training loop -------------------------------------------------------------------------

class FailingSource:
    """An image sampler that raises on its ``fail_at``-th batch (a crash mid-run)."""

    def __init__(self, sampler, fail_at: int | None = None) -> None:
        self.sampler, self.fail_at, self.calls = sampler, fail_at, 0

    def next_batch(self):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("crash")
        return self.sampler.next_batch()

    def state_dict(self):
        return self.sampler.state_dict()

    def load_state_dict(self, state):
        self.sampler.load_state_dict(state)


def test_a_resumed_diffusion_run_repeats_the_uninterrupted_one(tmp_path):
    import json

    from siamesenorm.config import TrainConfig
    from siamesenorm.data import ImageAugment, ImageBatchSampler, image_validation_batches
    from siamesenorm.train import train

    images = np.random.default_rng(0).integers(0, 256, (40, 1, 4, 4), dtype=np.uint8)
    labels = np.arange(40) % 3
    val = image_validation_batches(images[:16], labels[:16], batch_size=8)

    def run(directory, seed, fail_at=None, resume=False):
        torch.manual_seed(seed)
        objective = DiffusionObjective(tiny_dit(), create_diffusion(num_timesteps=50))
        sampler = ImageBatchSampler(images, labels, 8, seed=seed, augment=ImageAugment(hflip=True))
        settings = TrainConfig(steps=6, lr=1e-2, warmup=0, checkpoint_every=3, eval_every=3)
        train(objective, FailingSource(sampler, fail_at), settings, directory, resume=resume,
              eval_batches=val)
        return [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]

    straight = run(tmp_path / "a", seed=0)
    with pytest.raises(RuntimeError, match="crash"):
        run(tmp_path / "b", seed=0, fail_at=5)
    resumed = run(tmp_path / "b", seed=99, resume=True)
    assert [r["step"] for r in resumed] == list(range(1, 7))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]
    assert [r.get("val_loss") for r in resumed] == [r.get("val_loss") for r in straight]
    assert straight[2]["val_loss"] != straight[5]["val_loss"]   # the model changed, the val draws did not
