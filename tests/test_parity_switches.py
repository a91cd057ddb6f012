"""Switches for parity with the reference code (Flow-GRPO, DiffusionNFT, verl-omni): population group std, dropping
zero-advantage samples and spreading the rest over ranks, the keyed micro-batch shuffle, Flow-GRPO's "first K"
timesteps, the reference KL form, and Flow-GRPO's SD3 DPO sigma. Every default stays what it was."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fastvideo.advantages import (group_advantages, nonzero_selection, share_pairs, share_samples,
                                  shuffle_order)
from fastvideo.rollout import Trajectory, pair_noise, select_trained_timesteps
from fastvideo.schedulers import (get_sigmas, sde_noise_scale, sde_step_with_logprob, table_sigma,
                                  training_sigma_table)
from fastvideo.seeding import NoiseSource


# ---- 1. population vs unbiased group std -------------------------------------------------------------------------

def _flow_grpo_tracker(rewards: np.ndarray, ids: np.ndarray, eps: float, clip: float) -> np.ndarray:
    """Flow-GRPO / DiffusionNFT ``PerPromptStatTracker.update`` (global_std=False): (r - mean) / (np.std + eps)."""
    adv = np.zeros_like(rewards)
    for g in np.unique(ids):
        r = rewards[ids == g]
        adv[ids == g] = (r - r.mean()) / (np.std(r) + eps)
    return np.clip(adv, -clip, clip)


def test_population_group_std_matches_the_reference_tracker():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(30, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 5, (30,), generator=g)
    adv, m = group_advantages(rewards, ids, global_std=False, group_std="population")
    want = _flow_grpo_tracker(rewards.numpy(), ids.numpy(), 1e-4, 5.0)
    np.testing.assert_allclose(adv.numpy(), want, rtol=1e-12, atol=1e-12)
    unbiased, _ = group_advantages(rewards, ids, global_std=False)
    ratio = (unbiased / adv).numpy()  # std_pop / std_unbiased = sqrt((n-1)/n) per group (eps is tiny next to std)
    n = torch.bincount(ids)[ids].double().numpy()
    np.testing.assert_allclose(ratio, np.sqrt((n - 1) / n), rtol=1e-3)


def test_group_std_default_and_global_mode_are_unchanged():
    rewards = torch.tensor([0.1, 0.5, 0.2, 0.9, 0.3, 0.3, float("nan"), 0.7])
    ids = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    default, dm = group_advantages(rewards, ids, global_std=False)
    explicit, em = group_advantages(rewards, ids, global_std=False, group_std="unbiased")
    assert torch.equal(default, explicit) and all(torch.equal(dm[k], em[k]) for k in dm)
    for mode in ("unbiased", "population"):  # the whole-batch std is the population std either way
        a, _ = group_advantages(rewards, ids, global_std=True, group_std=mode)
        assert torch.equal(a, group_advantages(rewards, ids, global_std=True)[0])
    single, _ = group_advantages(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 1, 1]), global_std=False,
                                 group_std="population")
    assert single[0] == 0  # a group of one has std 0 and advantage 0 in both modes
    with pytest.raises(ValueError, match="group_std"):
        group_advantages(rewards, ids, group_std="sample")


# ---- 2. dropping zero advantages, spreading the rest over ranks ---------------------------------------------------

def test_nonzero_selection():
    adv = torch.tensor([0.0, 1.5, -0.0, -2.0, 1e-13, 0.0, 3.0])
    assert nonzero_selection(adv).tolist() == [1, 3, 4, 6]  # Flow-GRPO: exactly != 0
    assert nonzero_selection(adv, atol=1e-6).tolist() == [1, 3, 6]
    binary = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0])  # group 0 saturated: exact zeros
    adv, _ = group_advantages(binary, torch.arange(2).repeat_interleave(4), global_std=True)
    assert nonzero_selection(adv).tolist() == [4, 5, 6, 7]
    with pytest.raises(ValueError):
        nonzero_selection(adv.view(2, 4))
    with pytest.raises(ValueError):
        nonzero_selection(adv, atol=-1)


def _union(selected, world_size, per_rank, num_chunks, move):
    """Per chunk: the sorted (position, effective weight) pairs of the real entries over all ranks, after checking
    that every rank does the same number of forwards and pads at weight 0 with a sample it may use."""
    owners = None if move else torch.arange(world_size * per_rank) // per_rank
    shares = [share_samples(selected, r, world_size, owners=owners, num_chunks=num_chunks) for r in range(world_size)]
    chunks = []
    for c in range(num_chunks):
        sizes = {len(shares[r][c][0]) for r in range(world_size)}
        assert len(sizes) == 1  # same forwards on every rank
        items = []
        for r in range(world_size):
            idx, w = shares[r][c]
            assert len(idx) == len(w)
            if owners is not None:
                assert torch.all(owners[idx] == r)  # a rank only trains (and pads with) samples it holds
            items += [(int(i), float(x) / world_size) for i, x in zip(idx, w) if x > 0]  # FSDP averages ranks
        chunks.append(sorted(items))
    return chunks


@pytest.mark.parametrize("move", [False, True])
@pytest.mark.parametrize("num_chunks", [1, 2, 3])
def test_share_samples_is_world_size_invariant(move, num_chunks):
    N = 16
    adv = torch.tensor([0, 1, 2, 0, 0, 0, 0, 0, 3, 4, 0, 5, 6, 7, 0, 8.0])
    noise = NoiseSource(5)
    selected = shuffle_order(noise, 3, N, selected=nonzero_selection(adv))
    results = [_union(selected, ws, N // ws, num_chunks, move) for ws in (1, 2, 4)]
    assert results[0] == results[1] == results[2]
    flat = [p for chunk in results[0] for p, _ in chunk]
    assert sorted(flat) == nonzero_selection(adv).tolist()  # every kept sample once, nothing else
    for chunk, part in zip(results[0], selected.tensor_split(num_chunks)):
        assert [p for p, _ in chunk] == sorted(part.tolist())  # chunk c = c-th slice of the global order
        assert math.isclose(sum(w for _, w in chunk), 1.0, rel_tol=1e-6)  # the mean over the chunk's kept samples


def test_share_samples_padding_and_share_pairs_agreement():
    sel = torch.arange(5)
    for r in range(2):
        (idx, w), = share_samples(sel, r, 2)  # evenly: the share_pairs layout
        pos, pw = share_pairs(5, r, 2)
        assert torch.equal(idx, sel[pos]) and torch.equal(w, pw)
    owners = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    (i0, w0), = share_samples(torch.tensor([0, 1, 2, 5]), 0, 2, owners=owners)
    (i1, w1), = share_samples(torch.tensor([0, 1, 2, 5]), 1, 2, owners=owners)
    assert i0.tolist() == [0, 1, 2] and w0.tolist() == [0.5, 0.5, 0.5]
    assert i1.tolist() == [5, 4, 4] and w1.tolist() == [0.5, 0.0, 0.0]  # padded with its own first sample
    empty = share_samples(torch.zeros(0, dtype=torch.long), 1, 2, owners=owners, num_chunks=2)
    assert [len(i) for i, _ in empty] == [0, 0]  # nothing kept: every rank skips the update
    with pytest.raises(ValueError, match="rank"):
        share_samples(sel, 2, 2)
    with pytest.raises(ValueError, match="owners"):
        share_samples(sel, 0, 2, owners=torch.tensor([0, 1, 2, 0, 0]))


# ---- 3. keyed micro-batch shuffle -----------------------------------------------------------------------------------

def test_shuffle_order_is_keyed_and_reproducible():
    noise = NoiseSource(11)
    perm = shuffle_order(noise, 4, 24)
    assert sorted(perm.tolist()) == list(range(24)) and perm.dtype == torch.long
    assert torch.equal(perm, shuffle_order(NoiseSource(11), 4, 24))
    assert not torch.equal(perm, shuffle_order(noise, 5, 24))  # per step
    assert not torch.equal(perm, shuffle_order(noise, 4, 24, epoch=1))  # per pass over the rollout
    assert not torch.equal(perm, shuffle_order(NoiseSource(12), 4, 24))  # per seed
    sel = torch.tensor([3, 7, 8, 20])
    sub = shuffle_order(noise, 4, 24, selected=sel)
    assert sub.tolist() == [p for p in perm.tolist() if p in {3, 7, 8, 20}]
    with pytest.raises(ValueError):
        shuffle_order(noise, 4, 24, selected=torch.tensor([24]))


# ---- 4. Flow-GRPO's first-K timesteps ------------------------------------------------------------------------------

def _traj(B, S, stochastic=None, window=0):
    st = torch.ones(B, S, dtype=torch.bool) if stochastic is None else stochastic
    return Trajectory(latents=None, log_probs=torch.zeros(B, S), sigmas=get_sigmas(S, shift=3.0), stochastic=st,
                      images=torch.zeros(B, 3, 1, 1), clean_latents=torch.zeros(B, 1, 1),
                      prompt_ids=torch.zeros(B, dtype=torch.long), sample_indices=torch.arange(B), step=1,
                      sde_type="flow_sde", eta=0.7, sde_window_size=window)


def test_first_timesteps_like_flow_grpo():
    ids, idx = [0, 0, 1], [0, 1, 0]
    for S, f in [(10, 0.99), (10, 1.0), (10, 0.5), (16, 0.6)]:
        ts = select_trained_timesteps(_traj(3, S), ids, idx, 2, NoiseSource(0), timestep_fraction=f, selection="first")
        K = int(S * f)  # Flow-GRPO: num_train_timesteps = int(num_steps * timestep_fraction)
        assert ts.dtype == torch.long and ts.tolist() == [list(range(K))] * 3
    st = torch.ones(3, 10, dtype=torch.bool)
    st[:, -1] = False  # last_step="ode"
    with pytest.raises(ValueError, match="ODE"):
        select_trained_timesteps(_traj(3, 10, st), ids, idx, 2, NoiseSource(0), timestep_fraction=1.0,
                                 selection="first")
    assert select_trained_timesteps(_traj(3, 10, st), ids, idx, 2, NoiseSource(0), timestep_fraction=0.99,
                                    selection="first").shape == (3, 9)
    with pytest.raises(ValueError, match="trains no"):
        select_trained_timesteps(_traj(3, 10), ids, idx, 2, NoiseSource(0), timestep_fraction=0.05, selection="first")
    with pytest.raises(ValueError, match="selection"):
        select_trained_timesteps(_traj(3, 10), ids, idx, 2, NoiseSource(0), selection="last")


def test_random_selection_is_the_default_and_window_ignores_selection():
    ids, idx = [0, 0, 1], [0, 1, 0]
    a = select_trained_timesteps(_traj(3, 8), ids, idx, 2, NoiseSource(0), timestep_fraction=0.6)
    b = select_trained_timesteps(_traj(3, 8), ids, idx, 2, NoiseSource(0), timestep_fraction=0.6, selection="random")
    assert torch.equal(a, b) and a.shape == (3, int(7 * 0.6))
    st = torch.zeros(3, 8, dtype=torch.bool)
    st[:, 2:5] = True
    for sel in ("random", "first"):
        w = select_trained_timesteps(_traj(3, 8, st, window=3), ids, idx, 2, NoiseSource(0), selection=sel)
        assert w.tolist() == [[2, 3, 4]] * 3


# ---- 5. KL form ------------------------------------------------------------------------------------------------------

def _kl_scale64(sigma, sigma_next, sde_type, eta, sigma_max, form):
    s, sn = float(sigma), float(sigma_next)
    if sde_type == "flow_sde":
        return eta * math.sqrt(s / (1 - (sigma_max if s == 1 else s)))
    std = eta * math.sqrt(s - sn) if sde_type == "dance_sde" else sn * math.sin(eta * math.pi / 2)
    return std if form == "reference" else std / math.sqrt(s - sn)


@pytest.mark.parametrize("sde_type,eta", [("flow_sde", 0.7), ("dance_sde", 0.3), ("cps", 0.7)])
def test_kl_forms_against_float64(sde_type, eta):
    sig = get_sigmas(10, shift=3.0)
    s, sn = sig[:-2], sig[1:-1]  # not the last step (cps: sigma' = 0 there)
    default = sde_noise_scale(s, sn, sde_type=sde_type, eta=eta, sigma_max=sig[1])
    assert torch.equal(default, sde_noise_scale(s, sn, sde_type=sde_type, eta=eta, sigma_max=sig[1],
                                                kl_form="per_unit_time"))
    for form in ("per_unit_time", "reference"):
        got = sde_noise_scale(s, sn, sde_type=sde_type, eta=eta, sigma_max=sig[1], kl_form=form)
        want = torch.tensor([_kl_scale64(a, b, sde_type, eta, float(sig[1]), form) for a, b in zip(s, sn)],
                            dtype=torch.float64)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)
    ref = sde_noise_scale(s, sn, sde_type=sde_type, eta=eta, sigma_max=sig[1], kl_form="reference")
    # our KL / reference KL = (s_ref / s_ours)^2 = sigma - sigma' for dance_sde and cps, 1 for flow_sde
    factor = (ref.double() / default.double()) ** 2
    expect = torch.ones_like(factor) if sde_type == "flow_sde" else (s - sn).double()
    torch.testing.assert_close(factor, expect, rtol=1e-5, atol=0)
    if sde_type != "flow_sde":  # the reference divides by the step's own std, bit for bit
        x, v = torch.randn(len(s), 4, 3), torch.randn(len(s), 4, 3)
        _, _, _, std = sde_step_with_logprob(v, x, s, sn, sde_type=sde_type, eta=eta, sigma_max=sig[1])
        assert torch.equal(std, ref)
    with pytest.raises(ValueError, match="kl_form"):
        sde_noise_scale(s, sn, sde_type=sde_type, eta=eta, sigma_max=sig[1], kl_form="exact")


# ---- 6. Flow-GRPO's SD3 DPO sigma ------------------------------------------------------------------------------------

def test_training_sigma_table_is_the_diffusers_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    for shift in (3.0, 1.0):
        sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
        assert torch.equal(training_sigma_table(shift), sched.sigmas.to(torch.float32))
    dyn = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True)
    assert torch.equal(training_sigma_table(1.0), dyn.sigmas.to(torch.float32))  # dynamic: no shift in the table


def test_table_sigma_follows_flow_grpo_dpo():
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    u = torch.sigmoid(torch.randn(64, generator=torch.Generator().manual_seed(1)))
    # train_sd3_dpo.py: indices = (u * num_train_timesteps).long(); timesteps = scheduler.timesteps[indices];
    # get_sigmas: sigmas[(schedule_timesteps == t).nonzero()]
    idx = (u * 1000).long()
    ts = sched.timesteps[idx]
    want = torch.stack([sched.sigmas[(sched.timesteps == t).nonzero().item()] for t in ts])
    assert torch.equal(table_sigma(u, shift=3.0), want)
    assert table_sigma(torch.tensor([1.0]), shift=3.0).item() == pytest.approx(3 * 0.001 / (1 + 2 * 0.001))  # clamped


def test_dpo_sigma_shift_reads_pair_noise_draw_through_the_shifted_table():
    """train_dpo.py --dpo_sigma_shift S: the pair's own logit-normal draw (pair_noise, unchanged by default) read
    through the shifted 1000-entry table; keyed per (step, pair, draw) as the draw itself."""
    noise = NoiseSource(7)
    keys, draws = [4, 9, 2], [0, 1, 0]
    _, sigma = pair_noise(noise, (2, 3), 5, keys, draws)
    table = table_sigma(sigma, shift=3.0)
    _, sigma_part = pair_noise(noise, (2, 3), 5, keys[1:], draws[1:])
    assert torch.equal(table_sigma(sigma_part, shift=3.0), table[1:])  # per item
    assert torch.all(torch.isin(table, training_sigma_table(3.0)))
    t = 1 - torch.floor(sigma.double() * 1000) / 1000  # the table's descending order: u near 1 = little noise
    assert torch.allclose(table.double(), 3 * t / (1 + 2 * t), atol=1e-6)
