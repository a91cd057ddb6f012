"""The moving SDE window (--sde_window_schedule sliding | sliding_hold | progressive): positions against a
hand-written re-statement of MixGRPO's GRPOTrainingStates (roll_back or held) and a transcription of verl-omni's
progressive strategy over 1,000 steps, the rollout's stochastic mask, and the flag checks."""
from __future__ import annotations

import argparse

import pytest
import torch

from fastvideo.rollout import validate_sampling
from fastvideo.rollout import RolloutConfig, stochastic_mask, window_position, window_starts
from fastvideo.seeding import NoiseSource


def mixgrpo_states(steps: int, lo: int, hi: int, W: int, stride: int, interval: int, roll_back: bool) -> list[int]:
    """MixGRPO's GRPOTrainingStates (fastvideo/utils/grpo_states.py, 'progressive' with prog_overlap) restated as a
    loop over training iterations, except that a position is valid only while the whole window fits in [lo, hi)
    (MixGRPO lets its last windows run short; ours never do)."""
    last = hi - W
    cur, it, out = lo, 0, []
    for _ in range(steps):
        out.append(cur)
        it += 1
        if it >= interval:
            it = 0
            cur += stride
        if cur > last:
            cur = lo if roll_back else lo + (last - lo) // stride * stride
    return out


@pytest.mark.parametrize("lo,hi,W,stride,interval", [(0, 24, 4, 1, 25), (0, 15, 2, 1, 3), (2, 11, 3, 2, 2),
                                                     (0, 9, 4, 4, 1), (1, 5, 4, 1, 2)])
@pytest.mark.parametrize("schedule", ["sliding", "sliding_hold"])
def test_window_position_follows_mixgrpo(lo, hi, W, stride, interval, schedule):
    S = hi + 1
    cfg = RolloutConfig(height=16, width=16, sampling_steps=S, sde_window_size=W, sde_window_range=(lo, hi),
                        sde_window_schedule=schedule, sde_window_shift_interval=interval, sde_window_stride=stride)
    steps = 3 * interval * ((hi - W - lo) // stride + 2)
    expected = mixgrpo_states(steps, lo, hi, W, stride, interval, roll_back=schedule == "sliding")
    got = [window_position(cfg, step) for step in range(1, steps + 1)]
    assert got == expected
    assert all(lo <= g and g + W <= hi for g in got)
    assert len(set(got)) == (hi - W - lo) // stride + 1  # every position is visited


def test_paper_schedule_moves_once_per_interval_and_rolls_back():
    # MixGRPO's FLUX script (scripts/recipes/mixgrpo.yaml): 25 steps, window 4, tau 25, stride 1, windows inside
    # steps [0, 23) (its max_timesteps = sampling_steps - 2)
    cfg = RolloutConfig(height=16, width=16, sampling_steps=25, sde_window_size=4, sde_window_range=(0, 23),
                        sde_window_schedule="sliding", sde_window_shift_interval=25, sde_window_stride=1)
    assert [window_position(cfg, s) for s in (1, 25, 26, 50, 51)] == [0, 0, 1, 1, 2]
    assert window_position(cfg, 19 * 25 + 1) == 19  # the last full window [19, 23)
    assert window_position(cfg, 20 * 25 + 1) == 0  # then back to the start
    hold = RolloutConfig(**{**cfg.__dict__, "sde_window_schedule": "sliding_hold"})
    assert window_position(hold, 20 * 25 + 1) == 19 and window_position(hold, 10_000) == 19


def verl_progressive_window(global_steps: int, size: int, envelope: tuple[int, int], iters_per_group: int) -> int:
    """verl-project/verl-omni a1139baf verl_omni/pipelines/qwen_image_mix_grpo/vllm_omni_rollout_adapter.py
    ``_maybe_make_progressive_window`` l.120-137, transcribed: the start of ``extra["sde_window_range"]``."""
    envelope_start, envelope_end = int(envelope[0]), int(envelope[1])
    max_start = envelope_end - size
    if max_start < envelope_start:
        raise ValueError("window larger than its envelope")
    iters_per_group = max(1, int(iters_per_group))
    n_advances = max(0, global_steps) // iters_per_group
    return min(envelope_start + n_advances * size, max_start)


@pytest.mark.parametrize("lo,hi,W,interval", [(0, 5, 2, 1), (0, 24, 4, 25), (2, 11, 3, 2), (0, 9, 4, 1),
                                              (1, 5, 4, 3), (0, 16, 3, 7)])
def test_progressive_is_verl_omnis_formula_over_1000_steps(lo, hi, W, interval):
    """Our training step t (1, 2, ...) is verl-omni's global step (its trainer starts at 1)."""
    cfg = RolloutConfig(height=16, width=16, sampling_steps=hi + 1, sde_window_size=W, sde_window_range=(lo, hi),
                        sde_window_schedule="progressive", sde_window_shift_interval=interval)
    got = [window_position(cfg, t) for t in range(1, 1001)]
    assert got == [verl_progressive_window(t, W, (lo, hi), interval) for t in range(1, 1001)]
    if (lo, hi, W, interval) == (0, 5, 2, 1):  # the review's example: 2, 2, 3, 3, ...
        assert got[:4] == [2, 3, 3, 3]


def test_moving_window_is_shared_by_the_step_and_random_stays_per_group():
    noise = NoiseSource(seed=3)
    base = dict(height=16, width=16, sampling_steps=8, sde_window_size=2, sde_window_range=(0, 7))
    sliding = RolloutConfig(**base, sde_window_schedule="sliding", sde_window_shift_interval=1)
    for step in (1, 2, 5):
        mask = stochastic_mask(sliding, noise, step, [0, 1, 2, 3])
        start = window_position(sliding, step)
        expected = torch.zeros(8, dtype=torch.bool)
        expected[start:start + 2] = True
        assert torch.equal(mask, expected.expand(4, 8))
    random = RolloutConfig(**base)  # default: today's keyed draw per prompt group, unchanged
    starts = [window_starts(random, noise, s, list(range(12))) for s in (1, 2)]
    assert len(set(starts[0])) > 1 and starts[0] != starts[1]
    assert starts[0] == [noise.randint(0, 6, step=1, prompt_id=p, sample_index=0, purpose="window")
                         for p in range(12)]


def _sampling_args(**kw) -> argparse.Namespace:
    base = dict(sampling_steps=8, h=16, w=16, sde_type="flow_sde", eta=0.9, shift=None, cfg_scale=1.0, rollout_batch_size=2, decode_batch_size=0,
                guidance_scale=3.5, init_same_noise=False, decode_x0=False, pretrained_model_name_or_path=None,
                sde_window_size=0, sde_window_range=None, last_step="sde", sde_window_schedule="random",
                sde_window_shift_interval=25, sde_window_stride=1)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("flags,needle", [
    (dict(sde_window_schedule="sliding"), "--sde_window_size"),
    (dict(sde_window_schedule="sliding", sde_window_size=2, sde_window_shift_interval=0), "--sde_window_shift_interval"),
    (dict(sde_window_schedule="progressive", sde_window_size=2, sde_window_stride=0), "--sde_window_stride"),
])
def test_bad_schedule_flags_name_the_fix(flags, needle):
    with pytest.raises(ValueError, match=needle):
        validate_sampling(_sampling_args(**flags))
    validate_sampling(_sampling_args(sde_window_schedule="sliding", sde_window_size=2))
