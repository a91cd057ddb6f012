"""GRPO-Guard and Flow-DPPO policy losses (fastvideo.losses): float64 re-derivations, gradients, on-policy values,
hand-made mask cases, the published reference formulas (verl-omni, Flow-Factory, UniRL) and the SDE-type table."""
from __future__ import annotations

import math

import pytest
import torch

from fastvideo.losses import (POLICY_LOSS_TABLE, flow_dppo_loss, grpo_guard_loss, grpo_loss,
                              policy_loss_sde_refusal)
from fastvideo.schedulers import SDE_TYPES, sde_step_with_logprob

GUARD_SDE_TYPES = POLICY_LOSS_TABLE["guard"].sde_types
GUARD_SDE_REASONS = POLICY_LOSS_TABLE["guard"].refusals
DPPO_SDE_TYPES = POLICY_LOSS_TABLE["dppo"].sde_types

SHAPES = [(6,), (5, 4, 3, 3), (4, 7, 5)]  # (B,) is a degenerate 1-element latent; (B,C,H,W); (B,L,D) packed tokens


def _check_metrics(metrics, names):
    assert set(metrics) == set(names)
    for name, v in metrics.items():
        assert isinstance(v, torch.Tensor) and v.ndim == 0 and not v.requires_grad, name
        assert v.dtype == torch.float32 and torch.isfinite(v), name


GUARD_METRICS = ("policy_loss", "clipfrac", "approx_kl", "ratio_mean", "ratio_std", "ratio_min", "ratio_max",
                 "guard_bias_mean")
DPPO_METRICS = ("policy_loss", "clipfrac", "approx_kl", "ratio_mean", "ratio_std", "ratio_min", "ratio_max",
                "dppo_divergence_mean", "dppo_masked_frac")


def _gauss_lp64(x_next, mean, std):
    """float64 Gaussian log-density of x' averaged over the latent dims (docs/algorithms.md §2.1), std (B,)."""
    s = std.reshape(-1, *([1] * (mean.ndim - 1)))
    lp = -(x_next - mean) ** 2 / (2 * s**2) - torch.log(s) - 0.5 * math.log(2 * math.pi)
    return lp.reshape(lp.shape[0], -1).mean(1)


def _case(shape, seed, drift=1e-3):
    """A replayed Gaussian step in float64: x' drawn from the rollout mean, the policy's mean moved by ``drift``."""
    g = torch.Generator().manual_seed(seed)
    b = shape[0]
    std = (0.05 + 0.5 * torch.rand(b, generator=g)).double()
    sqdt = (0.05 + 0.3 * torch.rand(b, generator=g)).double()
    old_mean = torch.randn(shape, generator=g).double()
    eps = torch.randn(shape, generator=g).double()
    x_next = old_mean + std.reshape(-1, *([1] * (len(shape) - 1))) * eps
    mean = old_mean + drift * torch.randn(shape, generator=g).double()
    adv = torch.randn(b, generator=g).double()
    return dict(std=std, sqdt=sqdt, old_mean=old_mean, eps=eps, x_next=x_next, mean=mean, adv=adv)


def _guard64(lp, old, adv, mean, old_mean, std, sqdt, clip):
    """GRPO-Guard written out in float64 (docs/algorithms.md-style, per sample)."""
    b = ((mean - old_mean) ** 2).reshape(mean.shape[0], -1).mean(1) / (2 * std**2)
    rho = torch.exp((lp - old + b) * std)
    per = torch.maximum(-adv * rho, -adv * rho.clamp(1 - clip, 1 + clip)) / sqdt**2
    return per.mean(), rho, b


def _dppo64(lp, old, adv, mean, old_mean, std, thr):
    """Flow-DPPO written out in float64: returns loss, ratio, divergence, mask."""
    d = ((mean - old_mean) ** 2).reshape(mean.shape[0], -1).mean(1) / (2 * std**2)
    rho = torch.exp(lp - old)
    mask = (d >= thr) & (((adv > 0) & (rho > 1)) | ((adv < 0) & (rho < 1)))
    per = torch.where(mask, torch.zeros_like(rho), -adv * rho)
    return per.mean(), rho, d, mask


# ---------------------------------------------------------------- GRPO-Guard
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_guard_matches_float64_value_and_grad(shape, seed):
    c = _case(shape, seed)
    clip = 1e-4
    old64 = _gauss_lp64(c["x_next"], c["old_mean"], c["std"])
    # float32 path, as a trainer runs it: log_prob recomputed from the float32 mean that carries the graph
    mean32 = c["mean"].float().requires_grad_(True)
    lp32 = _gauss_lp64(c["x_next"].float(), mean32, c["std"].float())
    loss, m = grpo_guard_loss(lp32, old64.float(), c["adv"].float(), mean32, c["old_mean"].float(), c["std"].float(),
                              c["sqdt"].float(), clip)
    loss.backward()
    # float64 re-derivation
    mean64 = c["mean"].clone().requires_grad_(True)
    lp64 = _gauss_lp64(c["x_next"], mean64, c["std"])
    ref, rho, b = _guard64(lp64, old64, c["adv"], mean64, c["old_mean"], c["std"], c["sqdt"], clip)
    ref.backward()
    r = rho.detach()
    clipped = (r - 1).abs() > clip
    assert 0 < clipped.sum() < len(r) or shape == (6,)  # a mix of clipped and unclipped samples where it matters
    assert ((r - 1).abs() - clip).abs().min() > 1e-6  # no sample sits on the clip edge (float32 noise ~1e-7)
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mean32.grad.double(), mean64.grad, rtol=1e-3, atol=1e-6 * mean64.grad.abs().max())
    assert mean64.grad.abs().max() > 0
    torch.testing.assert_close(m["policy_loss"].double(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m["clipfrac"].double(), clipped.double().mean())
    torch.testing.assert_close(m["ratio_mean"].double(), r.mean(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m["ratio_min"].double(), r.min(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m["ratio_max"].double(), r.max(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m["ratio_std"].double(), r.std(correction=0), rtol=2e-2, atol=1e-7)
    torch.testing.assert_close(m["guard_bias_mean"].double(), b.detach().mean(), rtol=1e-4, atol=1e-9)
    torch.testing.assert_close(m["approx_kl"].double(), 0.5 * ((lp64.detach() - old64) ** 2).mean(), rtol=1e-2,
                               atol=1e-9)
    _check_metrics(m, GUARD_METRICS)


@pytest.mark.parametrize("shape", SHAPES[1:])
def test_guard_log_ratio_is_mean_of_noise_times_drift(shape):
    """Independent derivation: for x' = old_mean + std·ε, (lp - old + b)·std = mean_dims(ε·(mean - old_mean)), so with
    no clipping the loss is mean(-A·exp(mean_dims(ε·Δ)) / sqrt_neg_dt²)."""
    c = _case(shape, 3, drift=0.05)
    lp = _gauss_lp64(c["x_next"], c["mean"], c["std"])
    old = _gauss_lp64(c["x_next"], c["old_mean"], c["std"])
    loss, m = grpo_guard_loss(lp.float(), old.float(), c["adv"].float(), c["mean"].float(), c["old_mean"].float(),
                              c["std"].float(), c["sqdt"].float(), clip_range=1e3)
    log_rho = (c["eps"] * (c["mean"] - c["old_mean"])).reshape(shape[0], -1).mean(1)
    assert log_rho.abs().max() > 1e-3  # the ratio really moves
    expected = (-c["adv"] * torch.exp(log_rho) / c["sqdt"] ** 2).mean()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m["ratio_max"].double(), torch.exp(log_rho).max(), rtol=1e-5, atol=1e-6)
    assert float(m["clipfrac"]) == 0.0


@pytest.mark.parametrize("sde_type", GUARD_SDE_TYPES)
def test_guard_identity_holds_on_the_project_sde_step(sde_type):
    """The same identity on fastvideo.schedulers.sde_step_with_logprob (per-sample sigmas), for each supported type."""
    g = torch.Generator().manual_seed(7)
    b = 4
    x = torch.randn(b, 3, 4, 4, generator=g)
    v_old = torch.randn(b, 3, 4, 4, generator=g)
    v_new = v_old + 0.05 * torch.randn(b, 3, 4, 4, generator=g)
    sigma = torch.tensor([0.9, 0.7, 0.5, 0.3])
    sigma_next = sigma - torch.tensor([0.05, 0.1, 0.08, 0.02])
    eps = torch.randn(b, 3, 4, 4, generator=g)
    x_next, old, old_mean, std = sde_step_with_logprob(v_old, x, sigma, sigma_next, sde_type=sde_type, eta=0.7,
                                                       noise=eps)
    _, lp, mean, std_new = sde_step_with_logprob(v_new, x, sigma, sigma_next, sde_type=sde_type, eta=0.7,
                                                 prev_sample=x_next)
    torch.testing.assert_close(std_new, std)
    sqdt = torch.sqrt(sigma - sigma_next)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5])
    loss, _ = grpo_guard_loss(lp, old, adv, mean, old_mean, std, sqdt, clip_range=1e3)
    log_rho = (eps.double() * (mean.double() - old_mean.double())).flatten(1).mean(1)
    expected = (-adv.double() * torch.exp(log_rho) / sqdt.double() ** 2).mean()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-4, atol=1e-4)


def test_guard_identity_fails_for_cps():
    """Why cps is refused: its log_prob drops 1/(2·std²), so the bias does not cancel and the ratio is off-centre."""
    assert "cps" not in GUARD_SDE_TYPES and "cps" in GUARD_SDE_REASONS
    g = torch.Generator().manual_seed(8)
    x, v_old = torch.randn(4, 3, 4, 4, generator=g), torch.randn(4, 3, 4, 4, generator=g)
    v_new = v_old + 0.05 * torch.randn(4, 3, 4, 4, generator=g)
    eps = torch.randn(4, 3, 4, 4, generator=g)
    x_next, old, old_mean, std = sde_step_with_logprob(v_old, x, 0.3, 0.2, sde_type="cps", eta=0.7, noise=eps)
    _, lp, mean, _ = sde_step_with_logprob(v_new, x, 0.3, 0.2, sde_type="cps", eta=0.7, prev_sample=x_next)
    drift = ((mean - old_mean) ** 2).flatten(1).mean(1)
    guard_log_rho = (lp - old + drift / (2 * std**2)) * std
    log_rho = (eps * (mean - old_mean)).flatten(1).mean(1)
    assert log_rho.abs().max() > 1e-4
    assert (guard_log_rho - log_rho).abs().max() > 0.5 * log_rho.abs().max()


def test_guard_on_policy_is_minus_mean_advantage_rescaled():
    g = torch.Generator().manual_seed(4)
    adv = torch.randn(8, generator=g)
    lp = torch.randn(8, generator=g)
    mean = torch.randn(8, 2, 3, generator=g)
    sqdt = 0.05 + 0.3 * torch.rand(8, generator=g)
    std = 0.1 + torch.rand(8, generator=g)
    loss, m = grpo_guard_loss(lp, lp.clone(), adv, mean, mean.clone(), std, sqdt, 2e-6)
    torch.testing.assert_close(loss, (-adv / sqdt**2).mean())
    assert float(m["guard_bias_mean"]) == 0.0 and float(m["clipfrac"]) == 0.0 and float(m["approx_kl"]) == 0.0
    assert float(m["ratio_min"]) == 1.0 == float(m["ratio_max"])
    # one shared step: -mean(A) times the rescale 1/sqrt(-dt)²
    loss, _ = grpo_guard_loss(lp, lp.clone(), adv, mean, mean.clone(), 0.3, 0.2, 2e-6)
    torch.testing.assert_close(loss, -adv.mean() / 0.04)


def test_guard_bias_keeps_the_graph_and_inputs_are_float32():
    """The bias is not detached (both references keep it); bf16 inputs are computed in float32."""
    g = torch.Generator().manual_seed(5)
    old_mean = torch.randn(4, 8, generator=g)
    mean = (old_mean + 0.01 * torch.randn(4, 8, generator=g)).requires_grad_(True)
    lp = torch.zeros(4)  # no log-prob path: any gradient on mean comes from the bias
    loss, _ = grpo_guard_loss(lp, lp.clone(), torch.ones(4), mean, old_mean, 0.2, 0.3, 1.0)
    loss.backward()
    # d/dmean of mean_i(-exp(b_i·std)/dt) with b = mean_dims(Δ²)/(2std²): -exp(.)·Δ/(D·std·dt)
    delta = (mean - old_mean).detach()
    expected = -torch.exp(delta.pow(2).mean(1, keepdim=True) / (2 * 0.2)) * delta / (8 * 0.2 * 0.09) / 4
    torch.testing.assert_close(mean.grad, expected, rtol=1e-4, atol=1e-7)
    loss16, m16 = grpo_guard_loss(lp.bfloat16(), lp.bfloat16(), torch.ones(4).bfloat16(), mean.detach().bfloat16(),
                                  old_mean.bfloat16(), 0.2, 0.3, 1.0)
    assert loss16.dtype == torch.float32
    _check_metrics(m16, GUARD_METRICS)


def test_guard_rejects_bad_clip_range():
    z = torch.zeros(2)
    for bad in (0.0, -1e-6):
        with pytest.raises(ValueError, match="clip_range"):
            grpo_guard_loss(z, z, z, z, z, 1.0, 1.0, bad)


def test_guard_matches_verl_omni_and_flow_factory_formulas():
    """Compact re-statements of the published formulas on one shared step (fixed inputs):
    verl-omni verl_omni/trainer/diffusion/diffusion_algos.py GRPOGuardLoss.compute_loss (L520-549):
      scale = sqrt_dt.mean()·std_dev_t.mean(); b = mean_dims(Δ²)/(2·scale²); ratio = exp((lp-old+b)·scale);
      loss = mean(max(-A·ratio, -A·clamp(ratio, 1±clip))) / sqrt_dt.mean()²  (A clamped to ±adv_clip_max)
    Flow-Factory src/flow_factory/trainers/grpo.py GRPOGuardTrainer.optimize (L501-510):
      c = sqrt(-dt)·std_dev_t; ratio = exp((lp-old)·c + mse/(2c)); loss = mean(max(...)) (no 1/(-dt))."""
    g = torch.Generator().manual_seed(11)
    b = 8
    lp_old = 0.1 * torch.randn(b, generator=g).double()
    old_mean = torch.randn(b, 4, 6, 6, generator=g).double()
    mean = old_mean + 1e-3 * torch.randn(b, 4, 6, 6, generator=g).double()
    lp = lp_old + 1.5e-5 * torch.randn(b, generator=g).double()  # |log ratio|·scale ~ clip_ratio 2e-6
    adv = torch.randn(b, generator=g).double() * 2  # |A| < 5: the references' adv clamp is inactive
    std_dev_t = torch.full((b, 1, 1, 1), 0.5, dtype=torch.float64)  # verl-omni's noise scale without sqrt(-dt)
    sqrt_dt = torch.full((b,), 0.3, dtype=torch.float64)
    clip = 2e-6
    assert adv.abs().max() < 5
    # verl-omni
    scale = sqrt_dt.mean() * std_dev_t.mean()
    bias = ((mean - old_mean) ** 2).flatten(1).mean(1) / (2 * scale**2)
    ratio_v = torch.exp((lp - lp_old + bias) * scale)
    loss_v = torch.maximum(-adv * ratio_v, -adv * ratio_v.clamp(1 - clip, 1 + clip)).mean() / sqrt_dt.mean() ** 2
    # Flow-Factory
    c = sqrt_dt * std_dev_t.reshape(b)
    ratio_f = torch.exp((lp - lp_old) * c + ((mean - old_mean) ** 2).flatten(1).mean(1) / (2 * c))
    torch.testing.assert_close(ratio_f, ratio_v)
    loss, m = grpo_guard_loss(lp.float(), lp_old.float(), adv.float(), mean.float(), old_mean.float(),
                              (std_dev_t.reshape(b) * sqrt_dt).float(), sqrt_dt.float(), clip)
    assert 0 < float(m["clipfrac"]) < 1
    torch.testing.assert_close(loss.double(), loss_v, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m["ratio_mean"].double(), ratio_v.mean(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m["clipfrac"].double(), ((ratio_v - 1).abs() > clip).double().mean())


# ---------------------------------------------------------------- Flow-DPPO
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_dppo_matches_float64_value_and_grad(shape, seed):
    c = _case(shape, seed, drift=2e-3)
    c["mean"][0] = c["old_mean"][0] + 5 * (c["mean"][0] - c["old_mean"][0])  # the first sample drifts far
    old64 = _gauss_lp64(c["x_next"], c["old_mean"], c["std"])
    lr64 = _gauss_lp64(c["x_next"], c["mean"], c["std"]) - old64
    # every sample but the first moves away from the rollout policy (sign(A) = sign(log ρ)); the first is corrective
    c["adv"] = c["adv"].abs() * torch.sign(lr64) * torch.tensor([-1.0] + [1.0] * (shape[0] - 1), dtype=torch.float64)
    d64 = ((c["mean"] - c["old_mean"]) ** 2).reshape(shape[0], -1).mean(1) / (2 * c["std"] ** 2)
    thr = float(d64.median())  # about half the samples above the bound
    mean32 = c["mean"].float().requires_grad_(True)
    lp32 = _gauss_lp64(c["x_next"].float(), mean32, c["std"].float())
    loss, m = flow_dppo_loss(lp32, old64.float(), c["adv"].float(), mean32, c["old_mean"].float(), c["std"].float(),
                             threshold=thr * (1 + 1e-3))
    loss.backward()
    mean64 = c["mean"].clone().requires_grad_(True)
    lp64 = _gauss_lp64(c["x_next"], mean64, c["std"])
    ref, rho, d, mask = _dppo64(lp64, old64, c["adv"], mean64, c["old_mean"], c["std"], thr * (1 + 1e-3))
    ref.backward()
    assert 0 < mask.sum() < len(mask)  # some samples masked, some kept
    assert not mask[0] and d[0] >= thr * (1 + 1e-3)  # the corrective sample stays although far
    assert (lp64.detach() - old64).abs().min() > 1e-5  # no ratio sits on 1 (float32 noise ~1e-7)
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mean32.grad.double(), mean64.grad, rtol=1e-4, atol=1e-6 * mean64.grad.abs().max())
    masked_rows = mask.nonzero().flatten()
    assert float(mean32.grad[masked_rows].abs().max()) == 0.0  # a masked sample gets exactly no gradient
    torch.testing.assert_close(m["dppo_masked_frac"].double(), mask.double().mean())
    torch.testing.assert_close(m["clipfrac"], m["dppo_masked_frac"])
    torch.testing.assert_close(m["dppo_divergence_mean"].double(), d.detach().mean(), rtol=1e-4, atol=1e-12)
    r = rho.detach()
    torch.testing.assert_close(m["ratio_mean"].double(), r.mean(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m["ratio_min"].double(), r.min(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m["ratio_max"].double(), r.max(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m["ratio_std"].double(), r.std(correction=0), rtol=1e-3, atol=1e-7)
    torch.testing.assert_close(m["approx_kl"].double(), 0.5 * ((lp64.detach() - old64) ** 2).mean(), rtol=1e-3,
                               atol=1e-12)
    _check_metrics(m, DPPO_METRICS)


def test_dppo_on_policy_masks_nothing():
    g = torch.Generator().manual_seed(2)
    adv = torch.randn(8, generator=g)
    lp = torch.randn(8, generator=g)
    mean = torch.randn(8, 3, 5, generator=g)
    loss, m = flow_dppo_loss(lp, lp.clone(), adv, mean, mean.clone(), 0.1 + torch.rand(8, generator=g), 1e-5)
    torch.testing.assert_close(loss, -adv.mean())
    assert float(m["dppo_masked_frac"]) == 0.0 == float(m["clipfrac"]) == float(m["dppo_divergence_mean"])


def test_dppo_hand_cases_each_asymmetric_condition():
    """std = 0.5, Δ = 0.5 everywhere: D = 0.25 / (2·0.25) = 0.5 exactly (float32). Rows:
    0 A>0 ρ>1 (masked), 1 A<0 ρ<1 (masked), 2 A>0 ρ<1 (corrective, kept), 3 A<0 ρ>1 (kept), 4 A=0 ρ>1 (kept),
    5 A>0 ρ=1 (kept), 6 A<0 ρ=1 (kept)."""
    ratio = torch.tensor([1.2, 0.8, 0.8, 1.2, 1.2, 1.0, 1.0])
    lp = torch.log(ratio).requires_grad_(True)
    old = torch.zeros(7)
    adv = torch.tensor([2.0, -3.0, 1.5, -0.5, 0.0, 1.0, -1.0])
    old_mean = torch.zeros(7, 2, 2)
    mean = torch.full((7, 2, 2), 0.5)
    loss, m = flow_dppo_loss(lp, old, adv, mean, old_mean, 0.5, threshold=0.5)  # D == threshold: masked (>=)
    masked = torch.tensor([1, 1, 0, 0, 0, 0, 0], dtype=torch.bool)
    keep = ~masked
    torch.testing.assert_close(loss, (-adv * ratio * keep).sum() / 7)
    torch.testing.assert_close(m["dppo_masked_frac"], torch.tensor(2 / 7))
    torch.testing.assert_close(m["dppo_divergence_mean"], torch.tensor(0.5))
    loss.backward()
    torch.testing.assert_close(lp.grad, -adv * ratio * keep / 7)  # d(-A·exp(lp))/dlp / B where kept, 0 where masked
    # just under the bound: nothing is masked, the loss is plain -mean(A·ρ)
    loss, m = flow_dppo_loss(lp.detach(), old, adv, mean, old_mean, 0.5, threshold=0.5000001)
    torch.testing.assert_close(loss, (-adv * ratio).mean())
    assert float(m["dppo_masked_frac"]) == 0.0
    # per-sample std: only the rows whose D clears the bound are candidates
    std = torch.tensor([0.5, 5.0, 0.5, 0.5, 0.5, 0.5, 0.5])  # row 1: D = 0.005
    loss, m = flow_dppo_loss(lp.detach(), old, adv, mean, old_mean, std, threshold=0.1)
    torch.testing.assert_close(m["dppo_masked_frac"], torch.tensor(1 / 7))
    torch.testing.assert_close(loss, (-adv * ratio * torch.tensor([0, 1, 1, 1, 1, 1, 1.0])).mean())


def test_dppo_matches_verl_omni_and_unirl():
    """The inputs of verl-omni's tests/trainer/diffusion/test_diffusion_core_algos_on_cpu.py
    (test_compute_policy_loss_flow_dppo_applies_asymmetric_kl_mask, L200-270) through a compact re-statement of
    verl_omni/trainer/diffusion/diffusion_algos.py FlowDPPOLoss.compute_loss (L396-424) / UniRL
    unirl/algorithms/flowdppo.py _flowdppo_kl_adv_loss: sigma = std_dev_t·sqrt_dt, D = mean_dims(Δ²/(2σ²)),
    masked = D >= thr & ((ρ>1 & A>0) | (ρ<1 & A<0)), loss = mean(where(masked, 0, -A·ρ)), A not clamped."""
    old = torch.zeros(4)
    lp = torch.log(torch.tensor([1.2, 0.8, 1.2, 0.8]))
    adv = torch.tensor([10.0, -10.0, -8.0, 8.0])
    old_mean = torch.zeros(4, 2, 2, 2)
    mean = torch.full_like(old_mean, 0.2)
    std_dev_t = torch.full((4, 1, 1, 1), 0.5)
    sqrt_dt = torch.full((4,), 0.5)
    sigma = std_dev_t * sqrt_dt.reshape(4, 1, 1, 1)
    d = ((mean - old_mean) ** 2 / (2 * sigma**2)).flatten(1).mean(1)
    rho = torch.exp(lp - old)
    masked = (d >= 1e-5) & (((rho > 1) & (adv > 0)) | ((rho < 1) & (adv < 0)))
    ref = torch.where(masked, torch.zeros(()), -adv * rho).mean()
    assert masked.tolist() == [True, True, False, False]
    loss, m = flow_dppo_loss(lp, old, adv, mean, old_mean, sigma.reshape(4), threshold=1e-5)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(loss, torch.tensor((8.0 * 1.2 - 8.0 * 0.8) / 4))
    assert float(m["dppo_masked_frac"]) == pytest.approx(0.5)
    torch.testing.assert_close(m["dppo_divergence_mean"], d.mean())


def test_dppo_rejects_bad_threshold():
    z = torch.zeros(2)
    for bad in (0.0, -1e-5):
        with pytest.raises(ValueError, match="threshold"):
            flow_dppo_loss(z, z, z, z, z, 1.0, threshold=bad)


# ---------------------------------------------------------------- SDE types
def test_sde_type_tables():
    assert set(GUARD_SDE_TYPES) <= set(SDE_TYPES) and set(DPPO_SDE_TYPES) <= set(SDE_TYPES)
    assert set(GUARD_SDE_TYPES) | set(GUARD_SDE_REASONS) == set(SDE_TYPES)
    assert set(DPPO_SDE_TYPES) == set(SDE_TYPES)
    for t in GUARD_SDE_TYPES:
        assert policy_loss_sde_refusal("guard", t) is None
    for t in DPPO_SDE_TYPES:
        assert policy_loss_sde_refusal("dppo", t) is None
    why = policy_loss_sde_refusal("guard", "cps")
    assert why is not None and "cps" in why and "1/(2·std²)" in why
    assert "not a Gaussian SDE step" in policy_loss_sde_refusal("dppo", "ode")
    assert policy_loss_sde_refusal("clip", "cps") is None
    with pytest.raises(ValueError, match="unknown policy loss"):
        policy_loss_sde_refusal("ppo", "flow_sde")


def test_padded_rows_leave_the_metrics_of_every_policy_loss():
    """A padded micro-batch (--shuffle_micro_batches / --drop_zero_advantage: rows at weight 0, advantage 0) passes
    ``valid``: clipfrac, approx_kl and each loss's own metrics are those of its real rows alone, equal to the loss on
    the real rows only, and the loss itself is unchanged; ``valid=None`` keeps the plain means (today's values)."""
    g = torch.Generator().manual_seed(3)
    real, pad = 3, 2
    lp = torch.randn(real + pad, generator=g) * 1e-3
    old = torch.zeros(real + pad)
    adv = torch.tensor([1.0, -0.5, 2.0, 0.0, 0.0])  # padding at advantage 0 (weight 0)
    lp[real:] = lp[0]  # a padded row repeats a real sample (here its large ratio would count twice)
    mean = torch.randn(real + pad, 4, generator=g) * 1e-3
    old_mean, std = torch.zeros(real + pad, 4), torch.full((real + pad,), 0.1)
    valid = torch.arange(real + pad) < real
    cases = {"clip": lambda s, v: grpo_loss(lp[s], old[s], adv[s], 5e-4, v),
             "guard": lambda s, v: grpo_guard_loss(lp[s], old[s], adv[s], mean[s], old_mean[s], std[s], 0.3, 5e-5, v),
             "dppo": lambda s, v: flow_dppo_loss(lp[s], old[s], adv[s], mean[s], old_mean[s], std[s], 1e-5, v)}
    keys = {"clip": ("clipfrac", "approx_kl"), "guard": ("clipfrac", "approx_kl", "guard_bias_mean"),
            "dppo": ("clipfrac", "approx_kl", "dppo_divergence_mean", "dppo_masked_frac")}
    for name, fn in cases.items():
        everything = slice(None)
        padded_loss, padded = fn(everything, valid)
        plain_loss, plain = fn(everything, None)
        _, alone = fn(slice(0, real), None)
        assert torch.equal(padded_loss, plain_loss), name
        for key in keys[name]:
            assert padded[key].item() == pytest.approx(alone[key].item(), rel=1e-6, abs=1e-12), (name, key)
        assert any(plain[k].item() != pytest.approx(alone[k].item(), rel=1e-6, abs=1e-12) for k in keys[name]), name
