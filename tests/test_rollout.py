"""Batched rollout on the tiny FLUX model: stock-pipeline parity, batch invariance, noise keys, replay."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from fastvideo.models import flux
from fastvideo.rollout import RolloutConfig, replay_log_prob, rollout, select_trained_timesteps, stochastic_mask
from fastvideo.seeding import NoiseSource

PROMPTS = ["a red cube on a table", "a cat in the snow", "two birds over the sea"]
H = W = 64  # tiny preset's default size
STEPS = 4


@pytest.fixture(scope="module")
def parts(tiny_flux_dir):
    transformer = flux.load_transformer(tiny_flux_dir).eval().requires_grad_(False)
    vae = flux.load_vae(tiny_flux_dir)
    encoders = flux.load_text_encoders(tiny_flux_dir)
    embeds, pooled, _ = flux.encode_prompts(encoders, PROMPTS, max_sequence_length=32)
    geometry = flux.latent_geometry(vae, H, W)
    return transformer, vae, embeds, pooled, geometry


def _batch(parts, prompt_ids):
    _, _, embeds, pooled, _ = parts
    ids = torch.tensor(prompt_ids)
    return {"prompt_ids": ids, "prompts": [PROMPTS[i] for i in prompt_ids], "prompt_embeds": embeds[ids],
            "pooled_prompt_embeds": pooled[ids]}


def _groups(num_prompts, group_size):
    prompt_ids = [p for p in range(num_prompts) for _ in range(group_size)]
    return prompt_ids, [g for _ in range(num_prompts) for g in range(group_size)]


def _run(parts, cfg, prompt_ids, sample_indices, step=3, seed=0, **kw):
    transformer, vae, _, _, geometry = parts
    return rollout(transformer, vae, _batch(parts, prompt_ids), sample_indices, step, cfg, NoiseSource(seed),
                   geometry, device="cpu", **kw)


def _cfg(**kw):
    base = dict(height=H, width=W, sampling_steps=STEPS, sde_type="flow_sde", eta=0.9, guidance=3.5, batch_size=8)
    return RolloutConfig(**{**base, **kw})


def test_ode_rollout_reproduces_flux_pipeline(parts, tiny_flux_dir):
    from diffusers import FluxPipeline

    _, _, embeds, pooled, _ = parts
    traj = _run(parts, _cfg(eta=0.0, sampling_steps=6), [0, 1], [0, 0])
    assert not traj.stochastic.any() and torch.all(traj.log_probs == 0)
    pipe = FluxPipeline.from_pretrained(tiny_flux_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    common = dict(prompt_embeds=embeds[:2], pooled_prompt_embeds=pooled[:2], height=H, width=W,
                  num_inference_steps=6, guidance_scale=3.5, latents=traj.latents[:, 0].clone())
    final = pipe(output_type="latent", **common).images  # packed (B, L, C)
    images = pipe(output_type="pt", **common).images
    # the pipeline feeds (1000*sigma)/1000 as the timestep, we feed sigma: equal up to float32 rounding
    torch.testing.assert_close(traj.latents[:, -1], final, rtol=0, atol=1e-5)
    torch.testing.assert_close(traj.images, images, rtol=0, atol=1e-5)
    assert traj.images.shape == (2, 3, H, W) and traj.images.dtype == torch.float32


def test_shapes_dtypes_and_no_grad(parts):
    transformer = parts[0]
    transformer.requires_grad_(True)
    try:
        traj = _run(parts, _cfg(), [0, 1, 2], [0, 1, 2])
    finally:
        transformer.requires_grad_(False)
    L, C = parts[4].packed_shape
    assert traj.latents.shape == (3, STEPS + 1, L, C) and traj.latents.dtype == torch.float32
    assert traj.log_probs.shape == (3, STEPS) and traj.log_probs.dtype == torch.float32
    assert traj.sigmas.shape == (STEPS + 1,) and traj.stochastic.shape == (3, STEPS)
    assert traj.stochastic.dtype == torch.bool and traj.stochastic.all()
    assert traj.images.min() >= 0 and traj.images.max() <= 1
    assert not traj.latents.requires_grad and not traj.log_probs.requires_grad and not traj.images.requires_grad
    assert torch.isfinite(traj.log_probs).all() and (traj.log_probs != 0).all()
    assert set(traj.timings) == {"sample", "decode"}


def test_batched_equals_per_sample_and_batch_size_invariant(parts):
    prompt_ids, sample_indices = _groups(2, 4)  # 8 samples
    ref = _run(parts, _cfg(batch_size=8), prompt_ids, sample_indices)
    for bs in (1, 4):
        other = _run(parts, _cfg(batch_size=bs), prompt_ids, sample_indices)
        for name in ("latents", "log_probs", "images"):
            torch.testing.assert_close(getattr(other, name), getattr(ref, name), rtol=0, atol=1e-5)
    chunked = _run(parts, _cfg(batch_size=8, decode_batch_size=3), prompt_ids, sample_indices)  # decode 3 + 3 + 2
    assert torch.equal(chunked.latents, ref.latents)
    torch.testing.assert_close(chunked.images, ref.images, rtol=0, atol=1e-5)
    for b in (0, 5, 7):  # one sample on its own: noise is keyed per sample, not per batch position
        single = _run(parts, _cfg(), [prompt_ids[b]], [sample_indices[b]])
        torch.testing.assert_close(single.latents[0], ref.latents[b], rtol=0, atol=1e-5)
        torch.testing.assert_close(single.log_probs[0], ref.log_probs[b], rtol=0, atol=1e-5)


def test_init_same_noise_shares_within_group_only(parts):
    prompt_ids, sample_indices = _groups(2, 3)
    shared = _run(parts, _cfg(init_same_noise=True), prompt_ids, sample_indices)
    x0 = shared.latents[:, 0]
    assert torch.equal(x0[0], x0[1]) and torch.equal(x0[0], x0[2]) and torch.equal(x0[3], x0[5])
    assert not torch.allclose(x0[0], x0[3])
    assert not torch.allclose(shared.latents[0, 1], shared.latents[1, 1])  # SDE noise stays per sample
    own = _run(parts, _cfg(init_same_noise=False), prompt_ids, sample_indices)
    assert not torch.allclose(own.latents[0, 0], own.latents[1, 0])
    assert torch.equal(own.latents[0, 0], x0[0])  # sample index 0 keeps its own noise


def test_sde_window_shared_per_group(parts):
    cfg = _cfg(sampling_steps=6, sde_window_size=2, sde_window_range=(0, 5))
    prompt_ids, sample_indices = _groups(3, 3)
    traj = _run(parts, cfg, prompt_ids, sample_indices)
    st = traj.stochastic
    assert torch.all(st.sum(1) == 2)
    for g in range(3):
        assert torch.equal(st[3 * g], st[3 * g + 1]) and torch.equal(st[3 * g], st[3 * g + 2])
    assert torch.all((traj.log_probs != 0) == st)
    masks = stochastic_mask(cfg, NoiseSource(0), 3, list(range(40)))
    assert len({tuple(m.tolist()) for m in masks}) > 1  # different groups get different windows
    starts = masks.float().argmax(1)
    assert starts.min() >= 0 and starts.max() <= 3  # start in [lo, hi - size]
    # outside the window the step is the ODE: same latents for two samples of a group sharing init noise
    same = _run(parts, dataclasses.replace(cfg, init_same_noise=True), [0, 0], [0, 1])
    first = int(same.stochastic[0].float().argmax())
    torch.testing.assert_close(same.latents[0, :first + 1], same.latents[1, :first + 1], rtol=0, atol=0)
    assert not torch.allclose(same.latents[0, first + 1], same.latents[1, first + 1])


def test_decode_x0(parts):
    ode = _run(parts, _cfg(eta=0.0), [0], [0])
    ode_x0 = _run(parts, _cfg(eta=0.0, decode_x0=True), [0], [0])
    torch.testing.assert_close(ode_x0.clean_latents, ode.latents[:, -1], rtol=0, atol=1e-6)
    sde_x0 = _run(parts, _cfg(decode_x0=True, sde_type="dance_sde", eta=0.3), [0], [0])
    assert not torch.allclose(sde_x0.clean_latents, sde_x0.latents[:, -1])
    torch.testing.assert_close(sde_x0.images, flux.decode(parts[1], sde_x0.clean_latents, parts[4]))


@pytest.mark.parametrize("sde_type,eta", [("flow_sde", 0.9), ("dance_sde", 0.3), ("cps", 0.8)])
def test_replay_reproduces_rollout_log_probs(parts, sde_type, eta):
    transformer, _, _, _, geometry = parts
    cfg = _cfg(sde_type=sde_type, eta=eta, batch_size=4)
    prompt_ids, sample_indices = _groups(2, 2)
    batch = _batch(parts, prompt_ids)
    traj = rollout(transformer, parts[1], batch, sample_indices, 3, cfg, NoiseSource(0), geometry, device="cpu")
    idx = torch.tensor([1, 2])
    for j in range(STEPS - 1):
        lp, mean, std = replay_log_prob(transformer, traj, idx, j, batch, cfg, geometry)
        torch.testing.assert_close(lp, traj.log_probs[idx, j], rtol=0, atol=1e-5)
        assert mean.shape == (2, *geometry.packed_shape) and std.shape == (2,)
    # per-sample steps (DanceGRPO order) and the KL noise scale
    j = torch.tensor([0, 2])
    lp, _, std = replay_log_prob(transformer, traj, idx, j, batch, cfg, geometry)
    torch.testing.assert_close(lp, traj.log_probs[idx, j], rtol=0, atol=1e-5)
    s = traj.noise_scale(j)
    torch.testing.assert_close(s, std / torch.sqrt(traj.sigmas[j] - traj.sigmas[j + 1]))


def test_replay_has_grad_and_rejects_ode_steps(parts):
    transformer, _, _, _, geometry = parts
    cfg = _cfg(sde_window_size=1, sde_window_range=(1, 2))
    batch = _batch(parts, [0, 1])
    traj = rollout(transformer, parts[1], batch, [0, 0], 3, cfg, NoiseSource(0), geometry, device="cpu")
    assert traj.stochastic[:, 1].all() and traj.stochastic.sum() == 2
    transformer.requires_grad_(True)
    try:
        lp, _, _ = replay_log_prob(transformer, traj, torch.arange(2), 1, batch, cfg, geometry)
        lp.sum().backward()
        grads = [p.grad for p in transformer.parameters() if p.grad is not None]
        assert grads and any(g.abs().sum() > 0 for g in grads)
    finally:
        transformer.zero_grad(set_to_none=True)
        transformer.requires_grad_(False)
    with pytest.raises(ValueError, match="not stochastic"):
        replay_log_prob(transformer, traj, torch.arange(2), 0, batch, cfg, geometry)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # torch's rms_norm under autocast
def test_autocast_keeps_float32_trajectory(parts):
    transformer, vae, _, _, geometry = parts
    cfg = _cfg()
    batch = _batch(parts, [0, 1])
    fp32 = rollout(transformer, vae, batch, [0, 1], 3, cfg, NoiseSource(0), geometry, device="cpu")
    bf16 = rollout(transformer, vae, batch, [0, 1], 3, cfg, NoiseSource(0), geometry, device="cpu",
                   autocast_dtype=torch.bfloat16)
    assert bf16.latents.dtype == torch.float32 and bf16.log_probs.dtype == torch.float32
    assert torch.isfinite(bf16.log_probs).all() and not torch.equal(bf16.latents, fp32.latents)
    # replaying under the same autocast reproduces the bf16 rollout's log-probs (ratio == 1)
    lp, _, _ = replay_log_prob(transformer, bf16, torch.arange(2), 1, batch, cfg, geometry,
                               autocast_dtype=torch.bfloat16)
    torch.testing.assert_close(lp, bf16.log_probs[:, 1], rtol=0, atol=1e-5)


def test_select_trained_timesteps(parts):
    S = 8
    prompt_ids, sample_indices = _groups(2, 3)
    traj = _run(parts, _cfg(sampling_steps=S), prompt_ids, sample_indices)
    ts = select_trained_timesteps(traj, prompt_ids, sample_indices, 3, NoiseSource(0), timestep_fraction=0.6)
    K = int((S - 1) * 0.6)
    assert ts.shape == (6, K) and ts.dtype == torch.long
    assert ts.max() < S - 1 and ts.min() >= 0  # never the last step
    assert all(len(set(row.tolist())) == K for row in ts)
    assert len({tuple(row.tolist()) for row in ts}) > 1  # per-sample order
    again = select_trained_timesteps(traj, prompt_ids, sample_indices, 3, NoiseSource(0), timestep_fraction=0.6)
    assert torch.equal(ts, again)
    with pytest.raises(ValueError, match="timestep_fraction"):
        select_trained_timesteps(traj, prompt_ids, sample_indices, 3, NoiseSource(0), timestep_fraction=0.1)

    cfg = _cfg(sampling_steps=S, sde_window_size=3, sde_window_range=(2, 8))
    win = _run(parts, cfg, prompt_ids, sample_indices)
    ws = select_trained_timesteps(win, prompt_ids, sample_indices, 3, NoiseSource(0), timestep_fraction=0.6)
    assert ws.shape == (6, 3)
    assert torch.all(win.stochastic.gather(1, ws)) and torch.all(ws[:, 1:] == ws[:, :-1] + 1)

    ode = _run(parts, _cfg(eta=0.0), [0], [0])
    with pytest.raises(ValueError, match="eta"):
        select_trained_timesteps(ode, [0], [0], 3, NoiseSource(0))


def test_config_and_input_errors(parts):
    with pytest.raises(ValueError, match="sde_window_range"):
        _cfg(sde_window_size=3, sde_window_range=(0, 2))
    with pytest.raises(ValueError, match="sde_type"):
        _cfg(sde_type="ddpm")
    with pytest.raises(ValueError, match="decode_batch_size"):
        _cfg(decode_batch_size=-1)
    with pytest.raises(ValueError, match="sample_indices"):
        _run(parts, _cfg(), [0, 1], [0])
    with pytest.raises(ValueError, match="geometry"):
        _run(parts, _cfg(height=128, width=128), [0], [0])


def test_last_step_ode_scores_a_noise_free_image(parts):
    """--last_step ode: the last step (sigma' = 0) is the Euler step, which is exactly its x0_hat, so the image is
    the same as DanceGRPO's decode_x0 and carries none of the last step's SDE noise; with sde it does."""
    prompt_ids, sample_indices = _groups(2, 2)
    ode = _run(parts, _cfg(last_step="ode"), prompt_ids, sample_indices)
    sde = _run(parts, _cfg(last_step="sde"), prompt_ids, sample_indices)
    x0 = _run(parts, _cfg(last_step="sde", decode_x0=True), prompt_ids, sample_indices)
    assert not ode.stochastic[:, -1].any() and ode.stochastic[:, :-1].all() and sde.stochastic.all()
    assert (ode.log_probs[:, -1] == 0).all()
    # identical up to the last step, whose result is x0_hat instead of a noisy sample
    torch.testing.assert_close(ode.latents[:, :-1], sde.latents[:, :-1], rtol=0, atol=0)
    torch.testing.assert_close(ode.clean_latents, x0.clean_latents, rtol=0, atol=1e-6)
    assert (ode.clean_latents - sde.clean_latents).std() > 0.01  # the noise --last_step sde leaves in the image
    with pytest.raises(ValueError, match="last_step"):
        _cfg(last_step="maybe")
    with pytest.raises(ValueError, match="last step"):
        _cfg(last_step="ode", sde_window_size=2, sde_window_range=(0, STEPS))
