"""Group advantages vs a float64 per-group re-derivation (docs/algorithms.md §3)."""
from __future__ import annotations

import math

import pytest
import torch

from fastvideo.advantages import DANCE_GRPO_EPS, group_advantages


def _reference(rewards, ids, global_std, clip, eps):
    """Plain-python float64: loop over groups, as DanceGRPO / Flow-GRPO do."""
    r = [float(x) for x in rewards]
    ids = [int(i) for i in ids]
    n = len(r)
    mean_all = sum(r) / n
    pop_std = math.sqrt(sum((x - mean_all) ** 2 for x in r) / n)
    out = [0.0] * n
    for g in set(ids):
        members = [k for k in range(n) if ids[k] == g]
        vals = [r[k] for k in members]
        m = sum(vals) / len(vals)
        if global_std:
            std = pop_std
        else:
            std = math.sqrt(sum((x - m) ** 2 for x in vals) / max(len(vals) - 1, 1))
        for k in members:
            out[k] = max(-clip, min(clip, (r[k] - m) / (std + eps)))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("global_std,eps", [(True, 1e-4), (False, 1e-8)])
def test_matches_float64_reference(global_std, eps):
    g = torch.Generator().manual_seed(0)
    ids = torch.arange(6).repeat_interleave(4)  # 6 groups of 4
    rewards = torch.rand(24, generator=g, dtype=torch.float64)
    adv, metrics = group_advantages(rewards, ids, global_std=global_std, adv_clip_max=5.0, eps=eps)
    torch.testing.assert_close(adv, _reference(rewards, ids, global_std, 5.0, eps), rtol=1e-12, atol=1e-12)
    assert adv.dtype == torch.float64
    assert metrics["num_groups"].item() == 6
    assert metrics["zero_std_group_frac"].item() == 0.0


def test_group_std_is_unbiased_like_dance_grpo():
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0])
    ids = torch.zeros(4, dtype=torch.long)
    adv, _ = group_advantages(rewards, ids, global_std=False, eps=DANCE_GRPO_EPS)
    expected = (rewards - rewards.mean()) / (rewards.std() + 1e-8)  # torch.std is unbiased
    torch.testing.assert_close(adv, expected)


def test_near_constant_groups_do_not_become_noise_advantages():
    """A saturated reward: group 0's rewards differ by float noise (std ~1e-6). DanceGRPO's eps 1e-8 turns that into
    advantages of ~±0.9; the default eps 1e-4 keeps them ~1e-2, and the group is counted in low_std_group_frac."""
    rewards = torch.tensor([0.5, 0.5 + 2e-6, 0.5 - 1e-6, 0.5, 0.1, 0.9, 0.4, 0.6], dtype=torch.float64)
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    dance, _ = group_advantages(rewards, ids, global_std=False, eps=DANCE_GRPO_EPS)
    robust, metrics = group_advantages(rewards, ids, global_std=False)
    assert dance[:4].abs().max() > 0.5
    assert robust[:4].abs().max() < 0.05
    torch.testing.assert_close(robust[4:], dance[4:], rtol=1e-3, atol=0)  # real spread: eps is negligible
    assert metrics["low_std_group_frac"].item() == 0.5


def test_global_std_is_population_std_like_flow_grpo():
    import numpy as np

    rewards = torch.tensor([0.1, 0.5, 0.2, 0.9, 0.3, 0.3])
    ids = torch.tensor([7, 7, 7, 3, 3, 3])
    adv, _ = group_advantages(rewards, ids, global_std=True)
    r = rewards.double().numpy()
    std = np.std(r) + 1e-4
    expected = np.concatenate([(r[:3] - r[:3].mean()) / std, (r[3:] - r[3:].mean()) / std])
    np.testing.assert_allclose(adv.double().numpy(), expected, rtol=1e-6)


def test_zero_std_groups_and_clipping():
    rewards = torch.tensor([0.5, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0, 100.0])
    ids = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1])
    adv, metrics = group_advantages(rewards, ids, global_std=False, adv_clip_max=1.5)
    assert torch.all(adv[:3] == 0)
    assert metrics["zero_std_group_frac"].item() == pytest.approx(0.5)
    assert adv.abs().max().item() == pytest.approx(1.5)
    assert metrics["adv_clip_frac"].item() > 0
    for v in metrics.values():
        assert isinstance(v, torch.Tensor) and v.ndim == 0 and not v.requires_grad


def test_group_of_one_gets_zero_advantage():
    adv, _ = group_advantages(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 1, 1]), global_std=False)
    assert adv[0] == 0 and torch.isfinite(adv).all()


def test_order_invariance_and_groups_split_across_ranks():
    """Groups spanning ranks: the gathered batch (any order) gives each sample the same advantage."""
    g = torch.Generator().manual_seed(1)
    P, G, world = 3, 4, 2
    ids = torch.tensor([5, 9, 2]).repeat_interleave(G)  # [p0 g0..g3, p1 .., p2 ..]
    rewards = torch.randn(P * G, generator=g)
    shards = list(torch.chunk(torch.arange(P * G), world))  # rank r takes a contiguous slice: p1 spans ranks
    gathered = torch.cat(shards)  # all_gather_tensor concatenates in rank order
    full, _ = group_advantages(rewards[gathered], ids[gathered], global_std=False)
    perm = torch.randperm(P * G, generator=g)
    shuffled, _ = group_advantages(rewards[perm], ids[perm], global_std=False)
    out = torch.empty_like(shuffled)
    out[perm] = shuffled
    torch.testing.assert_close(out, full, rtol=0, atol=1e-6)
    torch.testing.assert_close(full.double(), _reference(rewards, ids, False, 5.0, 1e-4), rtol=1e-6, atol=1e-6)


def test_errors():
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="adv_clip_max"):
        group_advantages(torch.zeros(3), torch.zeros(3, dtype=torch.long), adv_clip_max=0)


@pytest.mark.parametrize("global_std", [True, False])
def test_a_nonfinite_reward_is_a_dropped_sample(global_std):
    """NaN/inf rewards (--nonfinite_reward drop) get advantage 0; the others get exactly the advantages of the batch
    without them, and the metrics ignore them."""
    g = torch.Generator().manual_seed(3)
    rewards = torch.rand(12, generator=g, dtype=torch.float64)
    groups = torch.arange(4).repeat_interleave(3)
    dropped = torch.tensor([1, 4, 5, 6, 7, 8])  # group 1 keeps one sample, group 2 none
    with_nan = rewards.clone()
    with_nan[dropped[:-1]] = float("nan")
    with_nan[dropped[-1]] = float("inf")
    keep = torch.ones(12, dtype=torch.bool)
    keep[dropped] = False
    adv, m = group_advantages(with_nan, groups, global_std=global_std)
    ref, m_ref = group_advantages(rewards[keep], groups[keep], global_std=global_std)
    assert torch.equal(adv[~keep], torch.zeros(6, dtype=torch.float64))
    torch.testing.assert_close(adv[keep], ref, rtol=1e-12, atol=1e-12)
    for k in ("reward_mean", "reward_std", "adv_abs_mean", "adv_clip_frac"):
        torch.testing.assert_close(m[k], m_ref[k])
    assert m["zero_std_group_frac"] == pytest.approx((1 + 1) / 4)  # group 1 keeps one sample, group 2 none
    with pytest.raises(ValueError, match="every reward of the batch is non-finite"):
        group_advantages(torch.full((4,), float("nan")), torch.zeros(4))
