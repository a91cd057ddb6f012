"""GRPO / KL / Diffusion-DPO / DiffusionNFT losses: float64 re-derivations, hand cases, gradient signs."""
from __future__ import annotations

import math

import pytest
import torch

from fastvideo.losses import (dpo_loss, dpo_pair_metrics, flow_matching_error, grpo_loss, kl_loss, nft_loss, nft_old_decay,
                              nft_optimality)


def _check_metrics(metrics):
    for name, v in metrics.items():
        assert isinstance(v, torch.Tensor) and v.ndim == 0 and not v.requires_grad, name
        assert v.dtype == torch.float32, name


# ---------------------------------------------------------------- GRPO
def test_grpo_matches_float64():
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(16, generator=g) * 1e-3
    old = lp + torch.randn(16, generator=g) * 2e-4
    adv = torch.randn(16, generator=g)
    c = 1e-4
    loss, m = grpo_loss(lp, old, adv, c)
    ratio = torch.exp(lp.double() - old.double())
    ref = torch.maximum(-adv.double() * ratio, -adv.double() * ratio.clamp(1 - c, 1 + c)).mean()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(m["clipfrac"].double(), ((ratio - 1).abs() > c).double().mean())
    torch.testing.assert_close(m["approx_kl"].double(), 0.5 * ((lp.double() - old.double()) ** 2).mean(),
                               rtol=1e-4, atol=1e-12)
    torch.testing.assert_close(m["ratio_mean"].double(), ratio.mean(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m["ratio_max"].double(), ratio.max(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m["ratio_min"].double(), ratio.min(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m["ratio_std"].double(), ratio.std(correction=0), rtol=1e-3, atol=1e-7)
    _check_metrics(m)


def test_grpo_positive_advantage_increases_log_prob():
    lp = torch.zeros(2, requires_grad=True)
    adv = torch.tensor([1.0, -1.0])
    loss, m = grpo_loss(lp, lp.detach().clone(), adv, 1e-4)
    loss.backward()
    # ratio == 1: loss = -mean(A); gradient descent moves lp along -grad = +A/B
    assert loss.item() == pytest.approx(0.0)
    assert lp.grad[0] < 0 and lp.grad[1] > 0
    torch.testing.assert_close(lp.grad, -adv / 2)
    assert m["ratio_mean"].item() == 1.0 and m["clipfrac"].item() == 0.0 and m["approx_kl"].item() == 0.0


@pytest.mark.parametrize("adv,delta,has_grad", [
    (1.0, +0.01, False),   # A>0, ratio above 1+c: clipped, no gradient
    (1.0, -0.01, True),    # A>0, ratio below 1-c: unclipped (pessimistic) branch keeps the gradient
    (-1.0, -0.01, False),  # A<0, ratio below 1-c: clipped
    (-1.0, +0.01, True),   # A<0, ratio above 1+c: unclipped
])
def test_grpo_clipping_stops_gradient_beyond_range(adv, delta, has_grad):
    lp = torch.tensor([delta], requires_grad=True)
    loss, m = grpo_loss(lp, torch.zeros(1), torch.tensor([adv]), clip_range=1e-3)
    loss.backward()
    assert (lp.grad.abs().item() > 0) == has_grad
    assert m["clipfrac"].item() == 1.0


def test_grpo_errors():
    with pytest.raises(ValueError, match="clip_range"):
        grpo_loss(torch.zeros(1), torch.zeros(1), torch.zeros(1), 0.0)


# ---------------------------------------------------------------- KL
def test_kl_loss_value_and_gradient():
    g = torch.Generator().manual_seed(1)
    mean = torch.randn(3, 5, 4, generator=g, requires_grad=True)
    ref = torch.randn(3, 5, 4, generator=g)
    s = torch.tensor([0.5, 1.0, 2.0])
    loss, m = kl_loss(mean, ref, s)
    expected = (((mean.double() - ref.double()) ** 2).mean(dim=(1, 2)) / (2 * s.double() ** 2)).mean()
    torch.testing.assert_close(loss.double(), expected.detach(), rtol=1e-6, atol=1e-8)
    loss.backward()
    assert torch.all(torch.sign(mean.grad) == torch.sign(mean.detach() - ref))  # descent pulls mean to ref
    _check_metrics(m)
    zero, _ = kl_loss(ref, ref, 0.3)
    assert zero.item() == 0.0


# ---------------------------------------------------------------- DPO
def test_dpo_matches_float64_and_metrics():
    g = torch.Generator().manual_seed(2)
    ew, el, rw, rl = (torch.rand(8, generator=g) * 0.1 for _ in range(4))
    beta = 2000.0
    loss, m = dpo_loss(ew, el, rw, rl, beta=beta)
    inside = -0.5 * beta * ((ew.double() - rw.double()) - (el.double() - rl.double()))
    torch.testing.assert_close(loss.double(), -torch.nn.functional.logsigmoid(inside).mean(), rtol=1e-5, atol=1e-6)
    assert m["implicit_acc"].item() == pytest.approx((inside > 0).double().mean().item())
    torch.testing.assert_close(m["implicit_margin"].double(), inside.mean(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(m["reward_chosen"] - m["reward_rejected"], m["implicit_margin"], rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(m["err_diff_w"].double(), (ew.double() - rw.double()).mean(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(m["err_diff_l"].double(), (el.double() - rl.double()).mean(), rtol=1e-5, atol=1e-7)
    _check_metrics(m)


def test_dpo_lower_winner_error_reduces_loss():
    ref = torch.tensor([0.2])
    ew = torch.tensor([0.2], requires_grad=True)
    el = torch.tensor([0.2], requires_grad=True)
    loss, m = dpo_loss(ew, el, ref, ref, beta=100.0)
    assert loss.item() == pytest.approx(math.log(2))  # policy == reference
    assert m["implicit_acc"].item() == 0.0
    loss.backward()
    assert ew.grad.item() > 0 and el.grad.item() < 0  # descent lowers err_w, raises err_l
    better, m2 = dpo_loss(torch.tensor([0.19]), torch.tensor([0.2]), ref, ref, beta=100.0)
    assert better.item() < loss.item() and m2["implicit_acc"].item() == 1.0


def test_dpo_weights_and_pair_metrics():
    """weights = 1/n reproduces the mean; a zero weight (a rank's padding) drops the pair from the loss and its
    gradient; the step metrics over gathered pairs match float64 and are NaN when no pair was trained."""
    g = torch.Generator().manual_seed(4)
    ew, el, rw, rl = (torch.rand(5, generator=g, dtype=torch.float64) * 0.1 for _ in range(4))
    mean, _ = dpo_loss(ew.float(), el.float(), rw.float(), rl.float(), beta=500.0)
    weighted, _ = dpo_loss(ew.float(), el.float(), rw.float(), rl.float(), beta=500.0, weights=torch.full((5,), 0.2))
    torch.testing.assert_close(weighted, mean)
    w = ew.float().clone().requires_grad_(True)
    padded, _ = dpo_loss(w, el.float(), rw.float(), rl.float(), beta=500.0,
                         weights=torch.tensor([0.25, 0.25, 0.25, 0.25, 0.0]))
    padded.backward()
    assert w.grad[4].item() == 0.0 and bool((w.grad[:4] > 0).all())
    first4, _ = dpo_loss(ew[:4].float(), el[:4].float(), rw[:4].float(), rl[:4].float(), beta=500.0)
    torch.testing.assert_close(padded.detach(), first4)
    m = dpo_pair_metrics(ew, el, rw, rl, 500.0)
    inside = -250.0 * ((ew - rw) - (el - rl))
    torch.testing.assert_close(m["loss"], -torch.nn.functional.logsigmoid(inside).mean())
    torch.testing.assert_close(m["implicit_margin"], inside.mean())
    assert m["implicit_acc"].item() == pytest.approx((inside > 0).double().mean().item())
    torch.testing.assert_close(m["err_w"], ew.mean())
    empty = dpo_pair_metrics(*(torch.zeros(0) for _ in range(4)), 500.0)
    assert all(math.isnan(v.item()) for v in empty.values())


def test_flow_matching_error():
    pred, target = torch.ones(2, 3, 4), torch.zeros(2, 3, 4)
    pred[1] *= 3
    torch.testing.assert_close(flow_matching_error(pred, target), torch.tensor([1.0, 9.0]))


# ---------------------------------------------------------------- NFT
def _nft_reference(vt, vo, xt, x0, t, adv, beta, cmax, vref, kl_beta):
    vt, vo, xt, x0, adv = (a.double() for a in (vt, vo, xt, x0, adv))
    t = torch.as_tensor(t, dtype=torch.float64).reshape(-1, 1, 1)
    r = ((adv.clamp(-cmax, cmax) / cmax) / 2 + 0.5).clamp(0, 1)
    vp = beta * vt + (1 - beta) * vo
    vn = (1 + beta) * vo - beta * vt
    xp, xn = xt - t * vp, xt - t * vn
    wp = (xp - x0).abs().mean(dim=(1, 2)).clamp(min=1e-5)
    wn = (xn - x0).abs().mean(dim=(1, 2)).clamp(min=1e-5)
    lp = ((xp - x0) ** 2).mean(dim=(1, 2)) / wp
    ln = ((xn - x0) ** 2).mean(dim=(1, 2)) / wn
    loss = ((r * lp + (1 - r) * ln) / beta).mean() * cmax
    if vref is not None:
        loss = loss + kl_beta * ((vt - vref.double()) ** 2).mean()
    return loss


@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_nft_matches_float64(beta):
    g = torch.Generator().manual_seed(3)
    shape = (4, 6, 8)
    vt, vo, xt, x0, vref = (torch.randn(shape, generator=g) for _ in range(5))
    t = torch.rand(4, generator=g)
    adv = torch.tensor([-7.0, -1.0, 0.5, 6.0])
    loss, m = nft_loss(vt, vo, xt, x0, t, adv, beta=beta, v_ref=vref, kl_beta=1e-4)
    ref = _nft_reference(vt, vo, xt, x0, t, adv, beta, 5.0, vref, 1e-4)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m["kl_loss"].double(), ((vt.double() - vref.double()) ** 2).mean(), rtol=1e-5, atol=1e-6)
    _check_metrics(m)
    scalar_t, _ = nft_loss(vt, vo, xt, x0, 0.4, adv, beta=beta)
    torch.testing.assert_close(scalar_t.double(), _nft_reference(vt, vo, xt, x0, torch.full((4,), 0.4), adv,
                                                                 beta, 5.0, None, 0.0), rtol=1e-5, atol=1e-6)


def test_nft_optimality_limits():
    r = nft_optimality(torch.tensor([-100.0, -5.0, 0.0, 2.5, 5.0, 100.0]))
    torch.testing.assert_close(r, torch.tensor([0.0, 0.0, 0.5, 0.75, 1.0, 1.0]))


def test_nft_gradient_pulls_positive_prediction_to_x0():
    """r=1 (best sample), beta=1: v+ = v_theta, so descent moves x_t - t*v_theta toward x0."""
    g = torch.Generator().manual_seed(4)
    x0, xt, vo = (torch.randn(1, 4, 3, generator=g) for _ in range(3))
    t = 0.5
    v_star = (xt - x0) / t
    vt = (v_star + 0.1 * torch.randn(1, 4, 3, generator=g)).requires_grad_(True)
    loss, m = nft_loss(vt, vo, xt, x0, t, torch.tensor([5.0]), beta=1.0)
    loss.backward()
    assert m["optimality_mean"].item() == 1.0
    assert torch.all(torch.sign(vt.grad) == torch.sign(vt.detach() - v_star))
    # r=0 (worst sample): the loss acts on the implicit negative v- = 2 v_old - v_theta instead
    vt2 = vt.detach().clone().requires_grad_(True)
    loss2, _ = nft_loss(vt2, vo, xt, x0, t, torch.tensor([-5.0]), beta=1.0)
    loss2.backward()
    v_neg = 2 * vo - vt2.detach()
    assert torch.all(torch.sign(vt2.grad) == -torch.sign(v_neg - v_star))


def test_nft_weight_floor():
    x0 = torch.zeros(1, 2, 2)
    v = torch.zeros(1, 2, 2)  # x0+ == x0 exactly: weight clamps to 1e-5, loss stays finite (0)
    loss, m = nft_loss(v, v, x0, x0, 0.5, torch.tensor([5.0]))
    assert loss.item() == 0.0 and m["weight_pos"].item() == pytest.approx(1e-5)


def test_nft_old_decay_schedules():
    assert nft_old_decay(0, "copy") == 0.0 and nft_old_decay(1000, "copy") == 0.0
    assert nft_old_decay(100, "linear") == pytest.approx(0.1)
    assert nft_old_decay(10_000, "linear") == 0.5
    assert nft_old_decay(74, "delayed") == 0.0
    assert nft_old_decay(75, "delayed") == 0.0
    assert nft_old_decay(175, "delayed") == pytest.approx(0.75)
    assert nft_old_decay(10_000, "delayed") == 0.999
    with pytest.raises(ValueError, match="copy"):
        nft_old_decay(1, "ema")


def test_first_update_check_warns_at_the_clip_scale():
    """The on-policy check fires at clip_range / 10 (not at a fixed 1e-3, 10x the default clip range) and when any
    first-update sample is already clipped; clipfrac_first_update is that share."""
    from fastvideo.losses import first_update_check

    exact, warning = first_update_check(torch.ones(8), clip_range=1e-4)
    assert warning is None and float(exact["ratio_first_update_max_dev"]) == 0.0
    assert float(exact["clipfrac_first_update"]) == 0.0 and float(exact["ratio_first_update"]) == 1.0
    noise = torch.ones(8)
    noise[0] += 5e-6  # fp32 noise-level mismatch: fine at clip 1e-4, too much at clip 1e-5
    assert first_update_check(noise, clip_range=1e-4)[1] is None
    assert first_update_check(noise, clip_range=1e-5)[1] is not None
    mismatch = torch.tensor([1.0, 1.0 + 5e-4, 1.0 - 5e-4, 1.0])  # 5e-4: below the old 1e-3 threshold
    metrics, warning = first_update_check(mismatch, clip_range=1e-4)
    assert warning is not None and "50.0% of samples clipped" in warning
    assert float(metrics["clipfrac_first_update"]) == 0.5


def test_nft_keep_masks_dropped_samples_exactly():
    """keep=False (a sample dropped for a non-finite reward): it adds 0 to the loss and 0 to the gradient, the kept
    ones weigh as before (the mean still divides by the batch)."""
    g = torch.Generator().manual_seed(5)
    shape = (4, 6, 8)
    vt, vo, xt, x0, vref = (torch.randn(shape, generator=g) for _ in range(5))
    t = torch.rand(4, generator=g)
    adv = torch.tensor([-7.0, float("nan"), 0.5, 6.0])
    keep = torch.tensor([True, False, True, True])
    vt = vt.requires_grad_(True)
    loss, _ = nft_loss(vt, vo, xt, x0, t, adv, beta=0.5, v_ref=vref, kl_beta=1e-2, keep=keep)
    loss.backward()
    kept = keep.nonzero().flatten()
    ref = _nft_reference(vt.detach()[kept], vo[kept], xt[kept], x0[kept], t[kept], adv[kept], 0.5, 5.0, vref[kept],
                         1e-2)
    torch.testing.assert_close(loss.double(), ref * 3 / 4, rtol=1e-5, atol=1e-6)
    assert torch.equal(vt.grad[1], torch.zeros(6, 8)) and vt.grad[kept].abs().sum() > 0
