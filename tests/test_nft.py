"""DiffusionNFT pieces: the loss's direction, the optimality modes, the old policy (a frozen second LoRA adapter) and
its update, the per-sample trained sigmas, and the flag checks."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import validate_flags

from fastvideo.objectives import parse_nft_args, validate_nft
from fastvideo.losses import nft_advantages, nft_loss, nft_old_decay, nft_optimality


# ------------------------------------------------------------------------------------------------ the loss
@pytest.mark.parametrize("advantage,target", [(5.0, "pos"), (-5.0, "neg")])
def test_a_gradient_step_moves_the_favoured_prediction_toward_x0(advantage, target):
    """r = 1 (A = +adv_clip_max): a step on v_theta brings x0+ = x_t - t v+ closer to the sample's x0; r = 0 brings
    the implicit negative x0- closer instead (so x0+ moves away: the policy is pushed off the bad sample)."""
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, 16, 8, generator=g)
    eps = torch.randn(2, 16, 8, generator=g)
    t = torch.tensor([0.3, 0.8])
    x_t = (1 - t.view(-1, 1, 1)) * x0 + t.view(-1, 1, 1) * eps
    v_old = (eps - x0) + 0.5 * torch.randn(2, 16, 8, generator=g)  # an imperfect old velocity
    v_theta = v_old.clone().requires_grad_(True)
    adv = torch.full((2,), advantage)

    def distances(v):
        v_pos, v_neg = 0.5 * v + 0.5 * v_old, 1.5 * v_old - 0.5 * v  # beta 0.5
        tt = t.view(-1, 1, 1)
        return ((x_t - tt * v_pos - x0) ** 2).mean().item(), ((x_t - tt * v_neg - x0) ** 2).mean().item()

    before = distances(v_theta.detach())
    loss, metrics = nft_loss(v_theta, v_old, x_t, x0, t, adv, beta=0.5)
    loss.backward()
    with torch.no_grad():
        after = distances(v_theta - 5.0 * v_theta.grad)
    assert metrics["optimality_mean"].item() == (1.0 if target == "pos" else 0.0)
    if target == "pos":
        assert after[0] < before[0] * 0.99 and after[1] > before[1]
    else:
        assert after[1] < before[1] * 0.99 and after[0] > before[0]


def test_adv_modes_shape_the_optimality():
    adv = torch.tensor([-7.0, -2.5, 0.0, 1.0, 5.0])
    r = {mode: nft_optimality(nft_advantages(adv, mode)) for mode in ("all", "positive_only", "negative_only",
                                                                        "binary")}
    torch.testing.assert_close(r["all"], torch.tensor([0.0, 0.25, 0.5, 0.6, 1.0]))
    torch.testing.assert_close(r["positive_only"], torch.tensor([0.5, 0.5, 0.5, 0.6, 1.0]))
    torch.testing.assert_close(r["negative_only"], torch.tensor([0.0, 0.25, 0.5, 0.5, 0.5]))
    torch.testing.assert_close(r["binary"], torch.tensor([0.4, 0.4, 0.5, 0.6, 0.6]))
    with pytest.raises(ValueError, match="adv_mode"):
        nft_advantages(adv, "one_only")


# ------------------------------------------------------------------------------------------------ the old policy
def _policy(tiny_flux_dir: Path, *flags: str):
    from fastvideo.policy import build_optimizer, build_policy

    args = parse_nft_args(["--pretrained_model_name_or_path", str(tiny_flux_dir), "--device", "cpu", "--lora_rank",
                           "4", "--seed", "3", *flags])
    policy = build_policy(args, torch.device("cpu"), need_reference=False, old_policy=True)
    return policy, build_optimizer(policy, args)


def _velocity(model, geometry) -> torch.Tensor:
    """The model's velocity on fixed random inputs (two samples at different sigmas)."""
    from fastvideo.models import flux

    config = flux.model_config(model)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, geometry.seq_len, geometry.packed_channels, generator=g)
    embeds = torch.randn(2, 8, config["joint_attention_dim"], generator=g)
    pooled = torch.randn(2, config["pooled_projection_dim"], generator=g)
    return flux.predict_velocity(model, x, torch.tensor([0.7, 0.4]), embeds, pooled, flux.image_ids(geometry),
                                 flux.text_ids(8), guidance=3.5)


def _adapter(model, name: str) -> dict[str, torch.Tensor]:
    return {k.replace(f".{name}.", "."): p.detach().clone() for k, p in model.named_parameters() if f".{name}." in k}


@pytest.mark.parametrize("schedule", ["copy", "linear", "delayed"])
def test_old_adapter_is_frozen_distinct_and_follows_the_schedule(tiny_flux_dir, schedule):
    from fastvideo.models import flux

    policy, optimizer = _policy(tiny_flux_dir, "--old_decay_schedule", schedule)
    model, old = policy.model, policy.old
    geo = flux.latent_geometry(tiny_flux_dir, 64, 64)
    default, frozen = _adapter(model, "default"), _adapter(model, "old")
    assert default.keys() == frozen.keys() and len(default) > 0
    for k in default:  # starts equal to the trained adapter (lora_A random, lora_B zero)
        assert torch.equal(default[k], frozen[k]), k
    assert any(v.abs().sum() > 0 for v in default.values())
    # only "default" is trainable and in the optimizer
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".default." in n for n in trainable)
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for n, p in model.named_parameters() if ".default." in n}

    # one optimizer step changes "default" only; the old adapter still computes the pre-step velocity
    with torch.no_grad():
        before = _velocity(model, geo)
    loss = _velocity(model, geo).square().mean() + sum(p.square().sum() for p in optimizer.param_groups[0]["params"])
    loss.backward()
    for group in optimizer.param_groups:
        group["lr"] = 0.05
    optimizer.step()
    assert all(p.requires_grad == (".default." in n) for n, p in model.named_parameters() if "lora_" in n)
    assert all(torch.equal(p, frozen[k]) for k, p in _adapter(model, "old").items()), "the old adapter moved"
    with torch.no_grad():
        trained = _velocity(model, geo)
        with old.active() as old_model:
            assert old_model is model
            old_v = _velocity(old_model, geo)
        assert (trained - before).abs().max() > 1e-4
        torch.testing.assert_close(old_v, before, rtol=0, atol=0)
        torch.testing.assert_close(_velocity(model, geo), trained, rtol=0, atol=0)  # the switch is restored
    assert all(p.requires_grad == (".default." in n) for n, p in model.named_parameters() if "lora_" in n)

    # old <- d old + (1 - d) theta, with d from the schedule
    theta = _adapter(model, "default")
    for n in (1, 80, 10_000):
        d = nft_old_decay(n, schedule)
        prev = _adapter(model, "old")
        old.update(d)
        for k, value in _adapter(model, "old").items():
            torch.testing.assert_close(value, d * prev[k] + (1 - d) * theta[k], rtol=0, atol=1e-7)
    assert old.num_updates == 3
    expected = {"copy": [0.0, 0.0, 0.0], "linear": [0.001, 0.08, 0.5], "delayed": [0.0, 0.0375, 0.999]}[schedule]
    assert [nft_old_decay(n, schedule) for n in (1, 80, 10_000)] == pytest.approx(expected)


def test_full_finetune_old_policy_is_a_separate_frozen_copy(tiny_flux_dir):
    from fastvideo.policy import build_policy

    args = parse_nft_args(["--pretrained_model_name_or_path", str(tiny_flux_dir), "--device", "cpu"])
    policy = build_policy(args, torch.device("cpu"), need_reference=True, old_policy=True)
    old = policy.old
    assert old.old_model is not None and old.old_model is not policy.model and policy.frozen_ref is not None
    assert not any(p.requires_grad for p in old.old_model.parameters())
    assert all(p.dtype == torch.float32 for p in old.old_model.parameters())
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.01)
        with old.active() as old_model:
            assert old_model is old.old_model
        old.update(0.25)
        for (name, p), q in zip(policy.model.named_parameters(), old.old_model.parameters()):
            torch.testing.assert_close(q, p - 0.25 * 0.01, rtol=0, atol=1e-6, msg=name)


def test_trained_sigmas_are_a_per_sample_random_subset_of_the_grid():
    from fastvideo.rollout import nft_timesteps
    from fastvideo.seeding import NoiseSource

    noise = NoiseSource(0)
    steps = nft_timesteps(noise, 4, [7, 7, 9], [0, 1, 0], 10, 0.99)  # int(10 x 0.99) = 9 of 10
    assert steps.shape == (3, 9) and steps.dtype == torch.long
    assert all(len(set(row.tolist())) == 9 and max(row.tolist()) <= 9 for row in steps)
    assert not torch.equal(steps[0], steps[1])  # a per-sample order
    torch.testing.assert_close(nft_timesteps(noise, 4, [7], [1], 10, 0.99)[0], steps[1])  # batch-independent
    assert nft_timesteps(noise, 4, [7], [0], 10, 0.5).shape == (1, 5)


# ------------------------------------------------------------------------------------------------ flags
def _validate(tmp_path: Path, *flags: str, world: int = 1) -> dict:
    return validate_flags(tmp_path, parse_nft_args, validate_nft, *flags, world=world)


def test_nft_flags_are_checked_with_the_fix(tmp_path):
    counts = _validate(tmp_path, "--prompts_per_step", "2", "--num_generations", "4", "--sampling_steps", "10",
                       "--train_batch_size", "2", world=2)
    assert counts["trained_timesteps"] == 9 and counts["samples_per_rank"] == 4
    assert counts["optimizer_steps_per_rollout"] == 1
    cases = {
        ("--eta", "0.5"): "deterministic ODE solver",
        ("--sde_window_size", "2"): "--sde_window_size",
        ("--nft_beta", "0"): "--nft_beta",
        ("--kl_beta", "-1"): "--kl_beta",
        ("--num_generations", "1"): "--num_generations",
        ("--old_update_interval", "0"): "--old_update_interval",
        ("--timestep_fraction", "0.01", "--sampling_steps", "4"): "trains no timestep",
        ("--init_same_noise",): "--init_same_noise",
        ("--fsdp_version", "1"): "--fsdp_version 2",
        ("--prompts_per_step", "3", "--num_generations", "3"): "divisible by the number of ranks",
    }
    for flags, message in cases.items():
        with pytest.raises(ValueError, match=message):
            _validate(tmp_path, *flags, world=2)
