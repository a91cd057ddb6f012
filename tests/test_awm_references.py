"""AWM as its two references compute it: the stratified timestep indices of the official code
(scxue/advantage_weighted_matching e5137232 scripts/train_sd3_awm.py l.1172-1205, time_type "discrete" and
"discrete_wo_init") and of Flow-Factory (X-GenGroup/Flow-Factory a0b2bc5a src/flow_factory/utils/noise_schedule.py
``TimeSampler.discrete``), each transcribed here and run on its own grid with the same uniform draws as ours; the two
advantage-weight forms; the old-policy (EMA) KL term's placement; and the flags that would do nothing."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from helpers import validate_flags

from fastvideo import models
from fastvideo import objectives as O
from fastvideo.losses import awm_advantages, awm_loss
from fastvideo.rollout import awm_index_span, awm_timesteps
from fastvideo.seeding import NoiseSource


def official_indices(num_steps: int, fraction: float, K: int, time_type: str, rand_u: torch.Tensor) -> torch.Tensor:
    """train_sd3_awm.py's "discrete" / "discrete_wo_init" branch, transcribed."""
    first = 0 if time_type == "discrete" else 1
    boundaries = torch.linspace(first, int(num_steps * fraction), steps=K + 1)
    lower_bounds, upper_bounds = boundaries[:-1].long(), boundaries[1:].long()
    return lower_bounds + (rand_u * (upper_bounds - lower_bounds)).long()


def flow_factory_indices(K: int, scheduler_timesteps: torch.Tensor, timestep_range: float, include_init: bool,
                         rand_u: torch.Tensor) -> torch.Tensor:
    """TimeSampler.discrete (force_init False) with fraction_range_to_t_bounds and _stratified_sample, transcribed."""
    ts = scheduler_timesteps.float()
    t_min, t_max = 1000.0 * (1.0 - timestep_range), 1000.0 * (1.0 - 0.0)
    valid = torch.where((ts >= t_min - 1e-3) & (ts <= t_max + 1e-3))[0]
    min_idx, max_idx = int(valid.min().item()), int(valid.max().item())
    start_idx = min_idx if include_init else min_idx + 1
    boundaries = torch.linspace(start_idx, max_idx, K + 1)
    lower, upper = boundaries[:-1].long(), boundaries[1:].long()
    return (lower + (rand_u * (upper - lower)).long()).clamp(min=0, max=len(ts) - 1)


def _draws(n: int, K: int) -> list[tuple[int, torch.Tensor]]:
    """(sample index, the uniform draw ours makes for it) for n samples of prompt 0 at step 1."""
    noise = NoiseSource(11)
    return [(s, noise.rand((K,), step=1, prompt_id=0, sample_index=s, purpose="awm_timesteps")) for s in range(n)]


def _possible(indices: torch.Tensor) -> list[set[int]]:
    return [set(indices[:, k].tolist()) for k in range(indices.shape[1])]


@pytest.mark.parametrize("time_type, strata", [
    # the official GenEval/OCR configs: 14 steps, train_timesteps 6, timestep_fraction 0.9 (config/dgx_awm.py)
    ("discrete_wo_init", [{1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}]),
    ("discrete", [{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}]),  # the PickScore config
])
def test_official_strata_on_its_grid(time_type, strata):
    draws = _draws(400, 6)
    ours = awm_timesteps(NoiseSource(11), 1, [0] * 400, [s for s, _ in draws], 14, 0.9, 6, time_type=time_type)
    theirs = torch.stack([official_indices(14, 0.9, 6, time_type, u) for _, u in draws])
    assert torch.equal(ours, theirs)
    assert _possible(ours) == strata


def _flux_timesteps(steps: int = 10, seq_len: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """FluxPipeline's scheduler timesteps at 512^2 (1024 packed tokens) and our grid for the same sampler."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    from fastvideo.tiny import FLUX_SCHEDULER_CONFIG

    c = FLUX_SCHEDULER_CONFIG
    scheduler = FlowMatchEulerDiscreteScheduler(**c)
    mu = calculate_shift(seq_len, c["base_image_seq_len"], c["max_image_seq_len"], c["base_shift"], c["max_shift"])
    scheduler.set_timesteps(steps, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    return scheduler.timesteps, models.resolve("flux1").sigmas(steps, seq_len)


def _sd3_timesteps(steps: int = 14) -> tuple[torch.Tensor, torch.Tensor]:
    from fastvideo.models.sd3 import SD3_SCHEDULER_CONFIG

    scheduler = FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULER_CONFIG)
    scheduler.set_timesteps(steps)
    return scheduler.timesteps, models.resolve("sd3").sigmas(steps, 1024)


@pytest.mark.parametrize("grid, steps, fraction, K, time_type, bounds, same_as_official", [
    # examples/awm/lora/flux1/default.yaml: 10 steps, timestep_range 0.7, num_train_timesteps 4, discrete: the
    # timesteps >= 300 are indices 0..8 (1000, 944, ..., 320; the 9th is 173), so the span is [0, 8]; the official
    # span int(10 x 0.7) = 7 cuts 0, 1, 3, 5, 7 instead (sigma 1 in every draw, index 7 never)
    (_flux_timesteps, 10, 0.7, 4, "discrete", [0, 2, 4, 6, 8], False),
    # examples/awm/lora/sd3_5/default.yaml: 14 steps (shift 3), timestep_range 0.9, 6 strata, discrete_wo_init: the
    # timesteps >= 100 are indices 0..12 (1000, 973, ..., 206; the 13th is 9), the span [1, 12]: the official one too
    (_sd3_timesteps, 14, 0.9, 6, "discrete_wo_init", [1, 2, 4, 6, 8, 10, 12], True),
])
def test_flow_factory_strata_on_its_grid(grid, steps, fraction, K, time_type, bounds, same_as_official):
    timesteps, sigmas = grid()
    start, end = awm_index_span(steps, fraction, time_type, "flow_factory", sigmas)
    assert torch.linspace(start, end, K + 1).long().tolist() == bounds
    draws = _draws(300, K)
    ours = awm_timesteps(NoiseSource(11), 1, [0] * 300, [s for s, _ in draws], steps, fraction, K,
                         time_type=time_type, strata="flow_factory", sigmas=sigmas)
    theirs = torch.stack([flow_factory_indices(K, timesteps, fraction, time_type == "discrete", u) for _, u in draws])
    assert torch.equal(ours, theirs)
    official = awm_timesteps(NoiseSource(11), 1, [0] * 300, [s for s, _ in draws], steps, fraction, K,
                             time_type=time_type)
    assert torch.equal(official, ours) == same_as_official


def test_advantage_weight_forms():
    A = torch.tensor([-7.0, -2.0, -0.5, 0.0, 0.25, 0.5, 3.0, float("nan")])
    official = awm_advantages(A, 5.0, 1.0, "official")  # clamp(A, +-5) / 5 x advantage_max 1
    torch.testing.assert_close(official, torch.tensor([-1.0, -0.4, -0.1, 0.0, 0.05, 0.1, 0.6, 0.0]))
    flow_factory = awm_advantages(A, 1.0, form="flow_factory")  # clamp(A, +-1), its examples' adv_clip_range 1
    torch.testing.assert_close(flow_factory, torch.tensor([-1.0, -1.0, -0.5, 0.0, 0.25, 0.5, 1.0, 0.0]))
    small = A.abs() < 1
    torch.testing.assert_close(flow_factory[small], 5 * official[small])  # 5x larger for |A| < 1
    assert torch.equal(awm_advantages(A, 1.0, 1.0, "official"), flow_factory)  # at clip 1 the forms agree
    with pytest.raises(ValueError, match="--awm_advantage_weight"):
        awm_advantages(A, form="verl")


@pytest.mark.parametrize("kl_beta", [0.0, 0.01])
def test_old_kl_term_placement(kl_beta):
    """official: the EMA term only beside a reference term (train_sd3_awm.py's `if beta > 0`); flow_factory: alone."""
    g = torch.Generator().manual_seed(0)
    v, x0, eps, v_ref, v_old = (torch.randn(4, 6, 3, generator=g) for _ in range(5))
    t, A = torch.rand(4, generator=g), torch.randn(4, generator=g)
    common = dict(v_ref=v_ref, kl_beta=kl_beta, v_old=v_old, old_kl_beta=1.0)
    official, m_off = awm_loss(v, x0, eps, t, A, old_kl="official", **common)
    alone, m_ff = awm_loss(v, x0, eps, t, A, old_kl="flow_factory", **common)
    distance = ((v - v_old) ** 2).mean(dim=(1, 2)).mean()
    torch.testing.assert_close(m_ff["old_kl_loss"], distance)
    torch.testing.assert_close(alone, m_ff["policy_loss"] + kl_beta * m_ff["kl_loss"] + distance)
    if kl_beta == 0:
        assert m_off["old_kl_loss"].item() == 0.0 and torch.equal(official, m_off["policy_loss"])
    else:
        torch.testing.assert_close(official, alone)


@pytest.mark.parametrize("flags, match", [
    (("--old_kl_beta", "0.1", "--kl_beta", "0"), "does nothing with --kl_beta 0 under --awm_old_kl official"),
    (("--awm_advantage_weight", "flow_factory", "--awm_advantage_max", "2"), "rescales the official weight only"),
    (("--awm_strata", "flow_factory"), "--awm_strata flow_factory needs --awm_timesteps K"),
    (("--awm_time_type", "discrete_wo_init", "--sampling_steps", "4", "--awm_timesteps", "3"),
     "use --awm_timesteps <= 2"),
])
def test_flags_that_would_do_nothing_are_refused(tmp_path, flags, match):
    with pytest.raises(ValueError, match=match):
        validate_flags(tmp_path, O.parse_nft_args, O.validate_nft, "--objective", "awm", *flags)


def test_the_recipes_forms_validate(tmp_path):
    """Flow-Factory's FLUX.1 form (ema KL alone, clamp(A, +-1), its strata) and the official form both validate."""
    counts = validate_flags(tmp_path, O.parse_nft_args, O.validate_nft, "--objective", "awm", "--sampling_steps", "10",
                            "--timestep_fraction", "0.7", "--awm_timesteps", "4", "--awm_strata", "flow_factory",
                            "--awm_advantage_weight", "flow_factory", "--adv_clip_max", "1", "--kl_beta", "0",
                            "--old_kl_beta", "0.1", "--awm_old_kl", "flow_factory", "--old_decay_schedule", "awm")
    assert counts["trained_timesteps"] == 4
    counts = validate_flags(tmp_path, O.parse_nft_args, O.validate_nft, "--objective", "awm", "--sampling_steps", "14",
                            "--timestep_fraction", "0.9", "--awm_timesteps", "6", "--awm_time_type",
                            "discrete_wo_init", "--kl_beta", "0.001", "--old_kl_beta", "1", "--old_decay_schedule",
                            "awm")
    assert counts["trained_timesteps"] == 6
