"""Sigma schedules and SDE/ODE steps vs float64 re-derivations of docs/algorithms.md §1-2 and vs diffusers."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fastvideo.schedulers import SDE_TYPES, flux_mu, get_sigmas, ode_step, sde_noise_scale, sde_step_with_logprob

FLUX_DEV_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                          max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
ETA = {"flow_sde": 0.9, "dance_sde": 0.3, "cps": 0.8}


def _inputs(batch=4, seq=16, ch=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, ch, generator=g)
    v = torch.randn(batch, seq, ch, generator=g)
    eps = torch.randn(batch, seq, ch, generator=g)
    return x.to(dtype), v.to(dtype), eps.to(dtype)


def _reference64(sde_type, x, v, eps, sigma, sigma_next, eta, sigma_max):
    """docs/algorithms.md §2 formulas in float64 (scalar sigmas) -> prev, mean, std (float), log_prob (B,)."""
    x, v, eps = x.double(), v.double(), eps.double()
    dt = sigma_next - sigma
    if sde_type == "flow_sde":
        den = sigma_max if sigma == 1 else sigma
        s = eta * math.sqrt(sigma / (1 - den))
        mean = x * (1 + s**2 / (2 * sigma) * dt) + v * (1 + s**2 * (1 - sigma) / (2 * sigma)) * dt
        std = s * math.sqrt(-dt)
    elif sde_type == "dance_sde":
        x0 = x - sigma * v
        score = -(x - (1 - sigma) * x0) / sigma**2
        mean = x + dt * v - 0.5 * eta**2 * score * dt
        std = eta * math.sqrt(sigma - sigma_next)
    else:
        std = sigma_next * math.sin(eta * math.pi / 2)
        x0 = x - sigma * v
        x1 = x + (1 - sigma) * v
        mean = x0 * (1 - sigma_next) + x1 * math.sqrt(sigma_next**2 - std**2)
    prev = mean + std * eps
    if sde_type == "cps":
        lp = -((prev - mean) ** 2)
    else:
        lp = -((prev - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    return prev, mean, std, lp.mean(dim=(1, 2))


@pytest.mark.parametrize("sde_type", SDE_TYPES)
@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.93), (0.7, 0.62), (0.2, 0.0)])
def test_sde_step_matches_float64(sde_type, sigma, sigma_next):
    x, v, eps = _inputs()
    sigma_max = 0.93
    prev, lp, mean, std = sde_step_with_logprob(v, x, sigma, sigma_next, sde_type=sde_type, eta=ETA[sde_type],
                                                noise=eps, sigma_max=sigma_max)
    rprev, rmean, rstd, rlp = _reference64(sde_type, x, v, eps, sigma, sigma_next, ETA[sde_type], sigma_max)
    assert prev.dtype == lp.dtype == mean.dtype == std.dtype == torch.float32
    assert lp.shape == (4,) and std.shape == (4,)
    torch.testing.assert_close(prev.double(), rprev, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mean.double(), rmean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(std.double(), torch.full((4,), rstd, dtype=torch.float64), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(lp.double(), rlp, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sde_type", ["flow_sde", "dance_sde"])
def test_log_prob_equals_torch_normal(sde_type):
    x, v, _ = _inputs(seed=1)
    prev = x + 0.05 * torch.randn_like(x)  # an arbitrary evaluated point, not the sampled one
    _, lp, mean, std = sde_step_with_logprob(v, x, 0.55, 0.48, sde_type=sde_type, eta=ETA[sde_type], prev_sample=prev)
    normal = torch.distributions.Normal(mean.double(), std.double().view(-1, 1, 1))
    expected = normal.log_prob(prev.double()).mean(dim=(1, 2))
    torch.testing.assert_close(lp.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sde_type", SDE_TYPES)
def test_replay_gives_identical_log_prob(sde_type):
    x, v, eps = _inputs(seed=2)
    kw = dict(sde_type=sde_type, eta=ETA[sde_type], sigma_max=0.9)
    prev, lp, mean, std = sde_step_with_logprob(v, x, 0.8, 0.7, noise=eps, **kw)
    prev2, lp2, mean2, std2 = sde_step_with_logprob(v, x, 0.8, 0.7, prev_sample=prev, **kw)
    assert torch.equal(prev2, prev) and torch.equal(lp2, lp) and torch.equal(mean2, mean) and torch.equal(std2, std)


@pytest.mark.parametrize("sde_type", SDE_TYPES)
def test_empirical_moments_match_mean_and_std(sde_type):
    n = 20000
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 6, generator=g).expand(n, 6).contiguous()
    v = torch.randn(1, 6, generator=g).expand(n, 6).contiguous()
    noise = torch.randn(n, 6, generator=g)
    prev, _, mean, std = sde_step_with_logprob(v, x, 0.6, 0.45, sde_type=sde_type, eta=ETA[sde_type], noise=noise)
    # standard errors: mean ~ std/sqrt(n), std ~ std/sqrt(2n); allow 5 of them
    torch.testing.assert_close(prev.mean(0), mean[0], rtol=0, atol=5 * std[0].item() / math.sqrt(n))
    torch.testing.assert_close(prev.std(0), std[:6], rtol=5 / math.sqrt(2 * n), atol=0)


def test_log_prob_gradient_flows_through_mean_only():
    x, v, eps = _inputs(seed=4)
    v = v.clone().requires_grad_(True)
    prev, _, _, _ = sde_step_with_logprob(v.detach(), x, 0.5, 0.4, eta=0.9, noise=eps)
    _, lp, _, _ = sde_step_with_logprob(v, x, 0.5, 0.4, eta=0.9, prev_sample=prev.requires_grad_(True))
    lp.sum().backward()
    assert v.grad is not None and v.grad.abs().sum() > 0
    assert prev.grad is None  # prev_sample is detached inside


def test_flow_sde_sigma_one_needs_sigma_max():
    x, v, eps = _inputs()
    with pytest.raises(ValueError, match="sigma_max"):
        sde_step_with_logprob(v, x, 1.0, 0.9, eta=0.9, noise=eps)
    with pytest.raises(ValueError, match="eta"):
        sde_step_with_logprob(v, x, 0.5, 0.4, eta=0.0, noise=eps)
    with pytest.raises(ValueError, match="sde_type"):
        sde_step_with_logprob(v, x, 0.5, 0.4, eta=0.5, sde_type="ddim", noise=eps)


@pytest.mark.parametrize("sde_type", SDE_TYPES)
def test_bf16_inputs_use_float32_arithmetic(sde_type):
    x, v, eps = _inputs(seed=5, dtype=torch.bfloat16)
    kw = dict(sde_type=sde_type, eta=ETA[sde_type], sigma_max=0.9)
    out_bf16 = sde_step_with_logprob(v, x, 0.8, 0.7, noise=eps, **kw)
    out_f32 = sde_step_with_logprob(v.float(), x.float(), 0.8, 0.7, noise=eps.float(), **kw)
    for a, b in zip(out_bf16, out_f32):
        assert a.dtype == torch.float32
        assert torch.equal(a, b)
    ode_bf16 = ode_step(v, x, 0.8, 0.7)
    assert ode_bf16.dtype == torch.float32 and torch.equal(ode_bf16, ode_step(v.float(), x.float(), 0.8, 0.7))


@pytest.mark.parametrize("sde_type", SDE_TYPES)
def test_per_sample_sigma_tensors(sde_type):
    x, v, eps = _inputs(batch=3, seed=6)
    sig = torch.tensor([1.0, 0.6, 0.3])
    sig_next = torch.tensor([0.9, 0.5, 0.0])
    kw = dict(sde_type=sde_type, eta=ETA[sde_type], sigma_max=0.9)
    prev, lp, mean, std = sde_step_with_logprob(v, x, sig, sig_next, noise=eps, **kw)
    ode = ode_step(v, x, sig, sig_next)
    for b in range(3):
        p1, l1, m1, s1 = sde_step_with_logprob(v[b:b + 1], x[b:b + 1], sig[b].item(), sig_next[b].item(),
                                               noise=eps[b:b + 1], **kw)
        torch.testing.assert_close(prev[b:b + 1], p1, rtol=0, atol=0)
        torch.testing.assert_close(lp[b:b + 1], l1, rtol=0, atol=0)
        torch.testing.assert_close(mean[b:b + 1], m1, rtol=0, atol=0)
        torch.testing.assert_close(std[b:b + 1], s1, rtol=0, atol=0)
        assert torch.equal(ode[b:b + 1], ode_step(v[b:b + 1], x[b:b + 1], sig[b].item(), sig_next[b].item()))
    with pytest.raises(ValueError, match="shape"):
        sde_step_with_logprob(v, x, torch.ones(2) * 0.5, 0.4, eta=0.5, noise=eps)


@pytest.mark.parametrize("sde_type", SDE_TYPES)
def test_noise_scale_is_std_without_sqrt_dt(sde_type):
    x, v, eps = _inputs(batch=3, seed=7)
    sig, sig_next = torch.tensor([1.0, 0.6, 0.3]), torch.tensor([0.9, 0.5, 0.1])
    _, _, _, std = sde_step_with_logprob(v, x, sig, sig_next, sde_type=sde_type, eta=ETA[sde_type], noise=eps,
                                         sigma_max=0.9)
    s = sde_noise_scale(sig, sig_next, sde_type=sde_type, eta=ETA[sde_type], sigma_max=0.9)
    torch.testing.assert_close(s, std / torch.sqrt(sig - sig_next))
    s0 = sde_noise_scale(0.6, 0.5, sde_type=sde_type, eta=ETA[sde_type])
    assert s0.ndim == 0
    torch.testing.assert_close(s0, s[1])


def _flux_scheduler_sigmas(num_steps, seq_len):
    """What FluxPipeline.__call__ does: sigmas = linspace(1, 1/S, S); mu = calculate_shift(L); set_timesteps."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    sched = FlowMatchEulerDiscreteScheduler(**FLUX_DEV_SCHEDULER)
    mu = calculate_shift(seq_len, sched.config.base_image_seq_len, sched.config.max_image_seq_len,
                         sched.config.base_shift, sched.config.max_shift)
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
    return sched


@pytest.mark.parametrize("num_steps", [1, 4, 16, 28, 50])
@pytest.mark.parametrize("seq_len", [16, 256, 1024, 4096, 5000])
def test_dynamic_sigmas_equal_flux_pipeline(num_steps, seq_len):
    sched = _flux_scheduler_sigmas(num_steps, seq_len)
    ours = get_sigmas(num_steps, image_seq_len=seq_len)
    assert ours.dtype == torch.float32 and ours.shape == (num_steps + 1,)
    assert torch.equal(ours, sched.sigmas), (ours, sched.sigmas)


def test_flux_mu_line():
    assert flux_mu(256) == pytest.approx(0.5) and flux_mu(4096) == pytest.approx(1.15)
    assert flux_mu(2176) == pytest.approx(0.825)


@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_static_shift_schedule(shift):
    S = 16
    t = np.linspace(1, 0, S + 1)
    expected = shift * t / (1 + (shift - 1) * t)
    ours = get_sigmas(S, shift=shift)
    assert ours.dtype == torch.float32 and ours[0] == 1 and ours[-1] == 0
    np.testing.assert_allclose(ours.double().numpy(), expected, rtol=1e-6, atol=1e-7)
    tt = torch.linspace(1, 0, S + 1)  # DanceGRPO: sd3_time_shift(shift, linspace) in float32
    assert torch.equal(ours, (shift * tt) / (1 + (shift - 1) * tt))


def test_get_sigmas_errors():
    with pytest.raises(ValueError, match="image_seq_len"):
        get_sigmas(8)
    with pytest.raises(ValueError, match="shift"):
        get_sigmas(8, shift=0.0)


def test_ode_step_is_diffusers_euler_step_bitwise():
    S, L = 12, 64
    sched = _flux_scheduler_sigmas(S, L)
    sigmas = get_sigmas(S, image_seq_len=L)
    g = torch.Generator().manual_seed(8)
    x_ref = torch.randn(2, L, 16, generator=g)
    x_ours = x_ref.clone()
    for i, t in enumerate(sched.timesteps):
        v = torch.randn(2, L, 16, generator=g) * 3
        x_ref = sched.step(v, t, x_ref, return_dict=False)[0]
        x_ours = ode_step(v, x_ours, sigmas[i].item(), sigmas[i + 1].item())
        assert torch.equal(x_ours, x_ref), i
        # tensor sigmas (0-d and per-sample) give the same bits
        assert torch.equal(ode_step(v, x_ours, sigmas[i], sigmas[i + 1]), ode_step(v, x_ours, sigmas[i].item(),
                                                                                   sigmas[i + 1].item()))
