"""Sigma grids follow the model folder's ``scheduler/scheduler_config.json``: a checkpoint with another shift is
sampled on its own grid (equal to the stock scheduler's ``set_timesteps`` as each pipeline calls it), a folder
without one on the family's stock grid, and a config the grid cannot reproduce is refused by name before loading."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from fastvideo import models
from fastvideo.rollout import RolloutConfig, rollout_sigmas, validate_sampling


def _stock(config: dict, steps: int, *, sigmas=None, mu=None) -> torch.Tensor:
    scheduler = FlowMatchEulerDiscreteScheduler(**config)
    scheduler.set_timesteps(steps, sigmas=sigmas, mu=mu)
    return scheduler.sigmas.to(torch.float32)


def _write(folder, config: dict | None) -> str:
    (folder / "scheduler").mkdir(parents=True)
    if config is not None:
        (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize("shift", [3.0, 5.0])
def test_sd3_grid_takes_the_folders_static_shift(shift, tmp_path):
    """StableDiffusion3Pipeline: ``set_timesteps(S)`` on the folder's scheduler; shift 5 is not shift 3's grid."""
    config = {"num_train_timesteps": 1000, "shift": shift}
    scheduler = models.read_scheduler_config(_write(tmp_path, config))
    ours = models.resolve("sd3").sigmas(10, 4096, scheduler)
    torch.testing.assert_close(ours, _stock(config, 10), rtol=0, atol=0)
    if shift != 3.0:
        assert not torch.equal(ours, models.resolve("sd3").sigmas(10, 4096))  # the stock (no config) grid: shift 3


@pytest.mark.parametrize("change", [{}, {"base_shift": 0.3, "max_shift": 1.4}, {"max_image_seq_len": 8192}])
def test_flux1_grid_takes_the_folders_dynamic_shift_constants(change, tmp_path):
    """FluxPipeline: ``set_timesteps(sigmas=linspace(1, 1/S, S), mu=calculate_shift(L, folder constants))``."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    from fastvideo.tiny import FLUX_SCHEDULER_CONFIG

    config = {**FLUX_SCHEDULER_CONFIG, **change}
    L, S = 1024, 8
    mu = calculate_shift(L, config["base_image_seq_len"], config["max_image_seq_len"], config["base_shift"],
                         config["max_shift"])
    stock = _stock(config, S, sigmas=np.linspace(1.0, 1 / S, S), mu=mu)
    ours = models.resolve("flux1").sigmas(S, L, models.read_scheduler_config(_write(tmp_path, config)))
    torch.testing.assert_close(ours, stock, rtol=0, atol=0)
    if not change:  # the folder's config is FLUX.1-dev's: the same grid as a folder without one
        assert torch.equal(ours, models.resolve("flux1").sigmas(S, L))


def test_qwen_image_grid_takes_the_folders_constants(tmp_path):
    """QwenImagePipeline with a changed max shift and terminal sigma: the scheduler's grid, bit for bit."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    from fastvideo.models.qwen_image import SCHEDULER_CONFIG

    config = {**SCHEDULER_CONFIG, "max_shift": 1.2, "shift_terminal": 0.05}
    L, S = 2048, 6
    mu = calculate_shift(L, config["base_image_seq_len"], config["max_image_seq_len"], config["base_shift"],
                         config["max_shift"])
    stock = _stock(config, S, sigmas=np.linspace(1.0, 1 / S, S), mu=mu)
    family = models.resolve("qwen-image")
    ours = family.sigmas(S, L, models.read_scheduler_config(_write(tmp_path, config)))
    torch.testing.assert_close(ours, stock, rtol=0, atol=0)
    assert not torch.equal(ours, family.sigmas(S, L))


def test_rollout_config_carries_the_folders_config_and_shift_overrides_it(tmp_path):
    """``RolloutConfig.from_args`` reads the folder's config once; ``--shift`` (DanceGRPO's static grid) ignores it."""
    folder = _write(tmp_path / "model", {"num_train_timesteps": 1000, "shift": 5.0})
    args = argparse.Namespace(h=64, w=64, sampling_steps=4, sde_type="flow_sde", eta=0.9, shift=None,
                              guidance_scale=3.5, cfg_scale=1.0, sde_window_size=0, sde_window_range=(0, 3),
                              sde_window_schedule="random", sde_window_shift_interval=1, sde_window_stride=1,
                              init_same_noise=False, decode_x0=False, rollout_batch_size=2, decode_batch_size=0,
                              last_step="sde", pretrained_model_name_or_path=folder)
    cfg = RolloutConfig.from_args(args)
    assert cfg.scheduler == {"num_train_timesteps": 1000, "shift": 5.0}
    sd3 = models.resolve("sd3")
    torch.testing.assert_close(rollout_sigmas(sd3, cfg, 64), _stock(cfg.scheduler, 4), rtol=0, atol=0)
    static = RolloutConfig.from_args(argparse.Namespace(**{**vars(args), "shift": 3.0}))
    from fastvideo.schedulers import get_sigmas
    assert torch.equal(rollout_sigmas(sd3, static, 64), get_sigmas(4, shift=3.0))
    args.pretrained_model_name_or_path = str(tmp_path / "no-such-folder")
    assert RolloutConfig.from_args(args).scheduler is None


@pytest.mark.parametrize("family, change, key", [
    ("flux1", {"use_dynamic_shifting": False}, "use_dynamic_shifting"),
    ("sd3", {"use_karras_sigmas": True}, "use_karras_sigmas"),
    ("qwen-image", {"time_shift_type": "linear"}, "time_shift_type"),
    ("flux2", {"shift_terminal": 0.1}, "shift_terminal"),
])
def test_a_config_the_grid_cannot_reproduce_is_refused_by_name(family, change, key, tmp_path):
    with pytest.raises(ValueError, match=rf"sets {key}=.*--shift N"):
        models.resolve(family).sigmas(4, 1024, change)


def test_validate_sampling_refuses_it_before_loading(tmp_path):
    """The trainers' flag check builds the grid once: the folder's bad config fails there, naming the key."""
    from fastvideo.tiny import FLUX_SCHEDULER_CONFIG

    folder = _write(tmp_path / "model", {**FLUX_SCHEDULER_CONFIG, "use_exponential_sigmas": True})
    args = argparse.Namespace(h=64, w=64, sampling_steps=4, sde_type="flow_sde", eta=None, shift=None,
                              guidance_scale=3.5, cfg_scale=1.0, sde_window_size=0, sde_window_range=None,
                              sde_window_schedule="random", sde_window_shift_interval=1, sde_window_stride=1,
                              init_same_noise=False, decode_x0=False, rollout_batch_size=2, decode_batch_size=0,
                              last_step="sde", pretrained_model_name_or_path=folder, model_family="flux1")
    with pytest.raises(ValueError, match="use_exponential_sigmas"):
        validate_sampling(args)
    args.shift = 3.0  # a static grid needs nothing of the folder's config
    validate_sampling(args)
