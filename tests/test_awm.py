"""Advantage Weighted Matching (train_nft.py --objective awm): awm_loss against a float64 re-derivation (value and
gradient, every weighting), its sign, the keep mask, the stratified timestep draw, the flags it refuses, and one
2-step run of the trainer on the tiny model (1 rank, LoRA) whose weights must move."""
from __future__ import annotations

import math

import pytest
import torch

from helpers import run_torchrun, shared_run, validate_flags
from test_train_nft import nft_args

from fastvideo import objectives as O
from fastvideo.logging import read_metrics
from fastvideo.losses import awm_loss
from fastvideo.rollout import awm_timesteps
from fastvideo.seeding import NoiseSource

B, L, C_ = 4, 6, 3


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(B, L, C_, generator=g)
    eps = torch.randn(B, L, C_, generator=g)
    t = torch.rand(B, generator=g) * 0.9 + 0.05
    v = (eps - x0) + 0.7 * torch.randn(B, L, C_, generator=g)
    return v, x0, eps, t, torch.randn(B, L, C_, generator=g), torch.randn(B, L, C_, generator=g)


def _reference(v, x0, eps, t, adv, old, keep, *, weighting, p, clip, adv_clip, adv_max, v_ref, kl_beta, v_old,
               old_kl_beta):
    """AWM (train_sd3_awm.py compute_log_prob_awm + its exp_first PPO loss) written out in float64."""
    v, x0, eps, t = v.double(), x0.double(), eps.double(), t.double()
    ell = ((v - (eps - x0)) ** 2).sum(dim=(1, 2)) / (L * C_)
    w = {"uniform": ell, "t": t * ell, "t2": t * t * ell, "huber": t * ((ell + 1e-10) ** 0.5 - 1e-5),
         "ghuber": t * ((ell + 1e-10) ** p - 1e-10 ** p) / p}[weighting]
    a = torch.minimum(torch.maximum(adv.double(), torch.tensor(-adv_clip)), torch.tensor(adv_clip)) * adv_max / adv_clip
    ratio = torch.exp(-w - old.double())
    clipped = torch.minimum(torch.maximum(ratio, torch.tensor(1 - clip)), torch.tensor(1 + clip))
    per = torch.maximum(-a * ratio, -a * clipped) * keep.double()
    kl = (((v - v_ref.double()) ** 2).sum(dim=(1, 2)) / (L * C_) * keep.double()).sum() / B
    old_kl = (((v - v_old.double()) ** 2).sum(dim=(1, 2)) / (L * C_) * keep.double()).sum() / B
    return per.sum() / B + kl_beta * kl + old_kl_beta * old_kl


@pytest.mark.parametrize("weighting", ["uniform", "t", "t2", "huber", "ghuber"])
def test_awm_loss_matches_a_float64_rederivation(weighting):
    """Value and gradient w.r.t. v_theta, with ratios inside and outside the clip, v_ref / v_old terms, a dropped
    sample and advantages beyond the clip."""
    v, x0, eps, t, v_ref, v_old = _inputs()
    adv = torch.tensor([2.0, -7.0, 0.5, -1.5])
    old = torch.tensor([-0.3, 0.2, -1.0, 0.6])  # log-prob proxies of the old policy: ratios far from and near 1
    keep = torch.tensor([True, True, False, True])
    flags = dict(weighting=weighting, clip=0.3, adv_clip=5.0, adv_max=0.8, kl_beta=0.05, old_kl_beta=0.2)
    v32 = v.clone().requires_grad_(True)
    loss, metrics = awm_loss(v32, x0, eps, t, adv, old_log_prob=old, weighting=weighting, ghuber_power=0.25,
                             clip_range=0.3, adv_clip_max=5.0, advantage_max=0.8, v_ref=v_ref, kl_beta=0.05,
                             v_old=v_old, old_kl_beta=0.2, keep=keep)
    loss.backward()
    v64 = v.double().requires_grad_(True)
    ref = _reference(v64, x0, eps, t, adv, old, keep, p=0.25, v_ref=v_ref, v_old=v_old, **flags)
    ref.backward()
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(v32.grad.double(), v64.grad, rtol=1e-4, atol=1e-7)
    assert v32.grad[2].abs().max() == 0.0  # the dropped sample
    for name, value in metrics.items():
        assert value.dtype == torch.float32 and value.ndim == 0 and not value.requires_grad, name


def test_on_policy_gradient_is_the_advantage_weighted_matching_loss():
    """Without old log-probs the ratio is exactly 1 (the loss is -mean(a)) and the gradient is that of
    mean(a * w(l, t)): AWM's advantage-weighted flow-matching loss."""
    v, x0, eps, t, _, _ = _inputs(1)
    adv = torch.tensor([1.0, -2.0, 3.0, -0.5])
    v1 = v.clone().requires_grad_(True)
    loss, metrics = awm_loss(v1, x0, eps, t, adv, weighting="t", adv_clip_max=5.0, advantage_max=1.0)
    loss.backward()
    a = adv / 5.0
    assert loss.item() == pytest.approx(-a.mean().item(), abs=1e-7)
    assert metrics["ratio_mean"].item() == 1.0 and metrics["clipfrac"].item() == 0.0
    v2 = v.clone().requires_grad_(True)
    (a * t * ((v2 - (eps - x0)) ** 2).mean(dim=(1, 2))).mean().backward()
    torch.testing.assert_close(v1.grad, v2.grad, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_positive_advantage_lowers_the_loss_as_the_prediction_nears_the_target(sign):
    v, x0, eps, t, _, _ = _inputs(2)
    target = eps - x0
    start = target + (v - target)  # the prediction at scale 1
    old = -((start - target) ** 2).mean(dim=(1, 2)) * t  # the old policy = the starting prediction (weighting t)
    adv = torch.full((B,), sign)
    losses = [awm_loss(target + s * (v - target), x0, eps, t, adv, old_log_prob=old, weighting="t",
                       clip_range=100.0)[0].item() for s in (1.0, 0.75, 0.5, 0.25, 0.0)]
    steps = [b - a for a, b in zip(losses, losses[1:])]
    assert all(d < 0 for d in steps) if sign > 0 else all(d > 0 for d in steps), losses
    # one gradient step on v: a positive advantage lowers the matching error, a negative one raises it
    v1 = v.clone().requires_grad_(True)
    awm_loss(v1, x0, eps, t, adv, weighting="uniform")[0].backward()
    error = lambda u: ((u - target) ** 2).mean().item()  # noqa: E731
    assert (error(v - 0.1 * v1.grad) < error(v)) == (sign > 0)


def test_keep_mask_drops_a_non_finite_sample_exactly():
    v, x0, eps, t, v_ref, _ = _inputs(3)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0])
    keep = torch.tensor([True, False, True, True])
    bad_v, bad_x0 = v.clone(), x0.clone()
    bad_v[1], bad_x0[1] = float("nan"), float("inf")
    v1 = bad_v.clone().requires_grad_(True)
    loss, metrics = awm_loss(v1, bad_x0, eps, t, adv, old_log_prob=torch.zeros(B), v_ref=v_ref, kl_beta=0.1,
                             keep=keep)
    loss.backward()
    assert math.isfinite(loss.item()) and all(math.isfinite(m.item()) for m in metrics.values())
    assert torch.isfinite(v1.grad).all() and v1.grad[1].abs().max() == 0.0
    sub = [0, 2, 3]  # the same three samples alone: the batch mean of the masked run still divides by B = 4
    v2 = v[sub].clone().requires_grad_(True)
    alone, _ = awm_loss(v2, x0[sub], eps[sub], t[sub], adv[sub], old_log_prob=torch.zeros(3), v_ref=v_ref[sub],
                        kl_beta=0.1)
    alone.backward()
    assert loss.item() == pytest.approx(alone.item() * 3 / 4, rel=1e-6)
    torch.testing.assert_close(v1.grad[sub], v2.grad * 3 / 4, rtol=1e-5, atol=1e-8)


def test_awm_timesteps_one_per_stratum_keyed_per_sample():
    noise = NoiseSource(7)
    draws = awm_timesteps(noise, 3, [0, 0, 5, 5], [0, 1, 0, 1], sampling_steps=10, timestep_fraction=0.9,
                          num_timesteps=3)
    assert draws.shape == (4, 3) and draws.dtype == torch.long
    bounds = torch.linspace(0, 9, 4).long()  # strata [0, 3), [3, 6), [6, 9)
    assert ((draws >= bounds[:-1]) & (draws < bounds[1:])).all()
    alone = awm_timesteps(noise, 3, [5], [1], sampling_steps=10, timestep_fraction=0.9, num_timesteps=3)
    assert torch.equal(alone[0], draws[3]), "a sample's draw depends on the batch around it"
    assert torch.equal(awm_timesteps(noise, 3, [0], [0], 4, 0.99), torch.tensor([[0, 1, 2]]))  # K = M: every sigma
    with pytest.raises(ValueError, match="1 <= K <= 3"):
        awm_timesteps(noise, 3, [0], [0], 4, 0.99, num_timesteps=4)


@pytest.mark.parametrize("flags, match", [
    (("--old_kl_beta", "0.1"), "only apply to --objective awm"),
    (("--objective", "awm", "--nft_beta", "0.1"), "--nft_beta shape DiffusionNFT"),
    (("--objective", "awm", "--old_decay_schedule", "awm"), "--old_kl_beta > 0"),
    (("--objective", "awm", "--awm_weighting", "t", "--ghuber_power", "0.5"), "only shapes --awm_weighting ghuber"),
    (("--objective", "awm", "--awm_timesteps", "5", "--sampling_steps", "4"), "--awm_timesteps <= 3"),
    (("--objective", "awm", "--awm_clip_range", "0"), "--awm_clip_range must be > 0"),
])
def test_validation_refuses_what_awm_cannot_use(tmp_path, flags, match):
    with pytest.raises(ValueError, match=match):
        validate_flags(tmp_path, O.parse_nft_args, O.validate_nft, *flags)


def test_validation_counts_awm_timesteps(tmp_path):
    counts = validate_flags(tmp_path, O.parse_nft_args, O.validate_nft, "--objective", "awm", "--sampling_steps", "10",
                            "--timestep_fraction", "0.7", "--awm_timesteps", "4", "--old_kl_beta", "0.1",
                            "--old_decay_schedule", "awm")
    assert counts["trained_timesteps"] == 4


# 2 prompts x 2 images on 1 rank, micro-batches of 2, an optimizer step after each: the second micro-batch's ratio is
# taken against theta before the first step (rollout_log_probs), so approx_kl > 0 shows that path ran
AWM = ("--objective", "awm", "--prompts_per_step", "2", "--num_generations", "2", "--train_batch_size", "2",
       "--gradient_accumulation_steps", "1", "--awm_timesteps", "2", "--old_kl_beta", "0.1", "--old_decay_schedule",
       "awm", "--lora_rank", "4", "--learning_rate", "3e-2", "--sample_every", "0", "--max_train_steps", "2")


shared_run("awm-lora", 1, lambda i, out: nft_args(i["model"], i["data"], out, *AWM, *i["hps"]))


def test_awm_run_trains_the_lora(shared_runs):
    import safetensors.torch

    out = shared_runs("awm-lora")
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in ("loss", "policy_loss", "kl", "old_kl", "matching_loss", "weighted_matching", "ratio_mean",
                    "clipfrac", "approx_kl", "grad_norm", "old_decay"):
            assert math.isfinite(row[key]), (key, row[key])
        assert row["trained_timesteps"] == 2 and "r_mean" not in row and "L_pos" not in row
    assert rows[0]["approx_kl"] > 0, "the second micro-batch's ratio must be against theta before the first step"
    assert all(r["old_kl"] > 0 for r in rows)  # old = theta at the start, then lags theta's first optimizer step
    assert [r["old_decay"] for r in rows] == pytest.approx([0.002, 0.004])  # min(0.001 n, 0.3), n optimizer steps
    weights = safetensors.torch.load_file(out / "final" / "pytorch_lora_weights.safetensors")
    lora_b = [w for k, w in weights.items() if "lora_B" in k]
    assert lora_b and max(w.abs().max().item() for w in lora_b) > 0, "LoRA B is still its zero init"


# slow for the default suite's time (~8 s, as NFT's full fine-tune); AWM's update runs by default in
# test_awm_run_trains_the_lora
@pytest.mark.slow(cover="test_awm.py::test_awm_run_trains_the_lora", cost_s=10)
def test_awm_full_finetune_off_policy(tiny_flux_dir, tiny_data, tmp_path):
    """Full fine-tune, rollouts sampled by the old policy (a second sharded transformer) and the ratio taken against
    it: the run is finite and the exported transformer differs from the base."""
    from diffusers import FluxTransformer2DModel

    out = tmp_path / "full"
    flags = [f for f in AWM if f not in ("--old_kl_beta", "0.1")]
    flags[flags.index("--lora_rank") + 1] = "0"
    flags[flags.index("--learning_rate") + 1] = "1e-4"
    run_torchrun(nft_args(tiny_flux_dir, tiny_data, out, *flags, "--awm_off_policy", "--reward",
                          "jpeg_compressibility:1.0"), nproc=1)
    rows = read_metrics(out / "metrics.jsonl")
    assert all(math.isfinite(r["loss"]) for r in rows)
    # the sampler (old) stays put during a step while theta takes two optimizer steps: the second micro-batch's ratio
    # and distance (logged; no loss term without --old_kl_beta) are taken against the old policy, not theta itself
    assert rows[0]["approx_kl"] > 0 and rows[0]["old_kl"] > 0
    tuned = FluxTransformer2DModel.from_pretrained(out / "final")
    base = FluxTransformer2DModel.from_pretrained(tiny_flux_dir, subfolder="transformer")
    assert max((p - q).abs().max().item() for p, q in zip(tuned.parameters(), base.parameters())) > 1e-6


# slow for the default suite's time; the resume machinery AWM shares (old adapter, sampler, schedule, RNG) is resumed
# by default in test_train_nft.py, and AWM's own state is that old adapter
@pytest.mark.slow(cover="test_train_nft.py::test_resume_restores_the_old_adapter_exactly", cost_s=30)
def test_awm_resumes_exactly(tiny_flux_dir, tiny_data, tmp_path):
    """4 AWM steps on 2 ranks (old-policy KL anchor, two optimizer steps per rollout) and the same run resumed from its
    step-2 checkpoint log the same metrics (old_kl and approx_kl included: the old adapter and the precomputed
    proxies must come back exactly)."""
    from helpers import assert_resume_matches

    assert AWM[-2:] == ("--max_train_steps", "2")
    flags = AWM[:-2]
    args = lambda out: nft_args(tiny_flux_dir, tiny_data, out, *flags, "--max_train_steps", "4",  # noqa: E731
                                "--checkpointing_steps", "2", "--num_generations", "4", "--reward",
                                "jpeg_compressibility:1.0")
    straight = tmp_path / "straight"
    run_torchrun(args(straight))
    rows = read_metrics(straight / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["old_kl"] > 0 for r in rows)
    assert_resume_matches(straight, tmp_path / "resumed", 2, args(tmp_path / "resumed"))


def test_loss_weights_make_the_batch_mean_a_weighted_sum():
    """--shuffle_micro_batches passes loss weights (B,): ``nft_loss`` and ``awm_loss`` (policy and every KL term)
    become ``sum(weights * per-sample term)``, linear in the weights (each sample's own term is the loss at its
    one-hot weight; their float64 weighted sum is the loss), so a padding row (weight 0, a rank's filler) adds
    nothing, and uniform weights 1/B give the plain batch mean."""
    from fastvideo.losses import nft_loss

    g = torch.Generator().manual_seed(7)
    b, shape = 4, (4, 6, 3)
    v_theta, v_old, v_ref, x0, eps = (torch.randn(shape, generator=g) for _ in range(5))
    t = torch.tensor([0.3, 0.6, 0.8, 0.45])
    adv = torch.tensor([1.5, -0.7, 0.2, 0.0])
    x_t = (1 - t.view(-1, 1, 1)) * x0 + t.view(-1, 1, 1) * eps
    weights = torch.tensor([0.5, 0.25, 0.25, 0.0])  # the last row is a rank's padding
    calls = {"nft": lambda w: nft_loss(v_theta, v_old, x_t, x0, t, adv, v_ref=v_ref, kl_beta=0.1, weights=w)[0],
             "awm": lambda w: awm_loss(v_theta, x0, eps, t, adv, v_ref=v_ref, kl_beta=0.1, v_old=v_old,
                                       old_kl_beta=0.2, weights=w)[0]}
    for name, loss in calls.items():
        per_row = torch.stack([loss(torch.eye(b)[i]) for i in range(b)])  # each sample's own term
        expected = (per_row.double() * weights.double()).sum()
        assert loss(weights).item() == pytest.approx(expected.item(), rel=1e-6), name
        assert loss(torch.full((b,), 1.0 / b)).item() == pytest.approx(loss(None).item(), rel=1e-6), name


def test_padded_rows_leave_nft_metrics():
    """A weighted micro-batch's padding rows (weight 0) leave nft_loss's per-sample metrics: they equal those of the
    real rows alone; old_deviation (velocity_deviation) does the same; unweighted (the default) keeps every row's
    mean."""
    from fastvideo.losses import nft_loss, velocity_deviation

    g = torch.Generator().manual_seed(11)
    real, pad = 3, 2
    v_theta, v_old, x0, eps = (torch.randn(real + pad, 4, 3, generator=g) for _ in range(4))
    v_theta[real:] = v_theta[0] * 5  # padding repeats a real sample (with values that would move every mean)
    t = torch.tensor([0.3, 0.6, 0.8, 0.3, 0.3])
    adv = torch.tensor([1.5, -0.7, 0.2, 0.0, 0.0])
    x_t = (1 - t.view(-1, 1, 1)) * x0 + t.view(-1, 1, 1) * eps
    weights = torch.tensor([0.5, 0.25, 0.25, 0.0, 0.0])
    _, padded = nft_loss(v_theta, v_old, x_t, x0, t, adv, weights=weights)
    _, alone = nft_loss(v_theta[:real], v_old[:real], x_t[:real], x0[:real], t[:real], adv[:real])
    _, plain = nft_loss(v_theta, v_old, x_t, x0, t, adv)
    for key in ("optimality_mean", "positive_loss", "negative_loss", "weight_pos", "weight_neg"):
        assert padded[key].item() == pytest.approx(alone[key].item(), rel=1e-6), key
    assert plain["positive_loss"].item() != pytest.approx(alone["positive_loss"].item(), rel=1e-3)
    rows = weights > 0
    assert velocity_deviation(v_theta, v_old, rows).item() == pytest.approx(
        velocity_deviation(v_theta[:real], v_old[:real], None).item(), rel=1e-6)
    assert torch.equal(velocity_deviation(v_theta, v_old, None), (v_theta - v_old).pow(2).mean())


# slow (~30 s): what makes the AWM learning test's control cheap (benchmarks/objectives.py's CONTROL["nft"])
@pytest.mark.slow(cover="test_awm.py::test_awm_run_trains_the_lora", cost_s=20)
def test_an_lr0_awm_run_training_one_sigma_samples_as_one_training_all_strata(tiny_flux_dir, tiny_data, tmp_path):
    """At lr 0 the trained sigmas do not reach the rollouts: AWM with one sigma per sample (the cheap control) samples
    the images of AWM with its strata, reward for reward, and trains fewer sigmas."""
    rows = {}
    for name, extra in (("strata", ("--awm_timesteps", "2")), ("one", ("--awm_timesteps", "1", "--timestep_fraction",
                                                                       "0.25"))):
        out = tmp_path / name
        run_torchrun(nft_args(tiny_flux_dir, tiny_data, out, *AWM, "--reward", "jpeg_compressibility:1.0",
                              "--max_train_steps", "3", "--learning_rate", "0", *extra))
        rows[name] = [r for r in read_metrics(out / "metrics.jsonl") if "reward_mean" in r]
    rewards = {name: [r["reward_mean"] for r in rows[name]] for name in rows}
    assert len(rewards["one"]) == 3 and rewards["one"] == rewards["strata"] and len(set(rewards["one"])) == 3
    assert [r["trained_timesteps"] for r in rows["one"]] == [1] * 3
    assert [r["trained_timesteps"] for r in rows["strata"]] == [2] * 3


# slow (suite time, ~20 s each): the default suite keeps the weighted losses (above), training_order's world-size
# invariance (test_grpo_objectives) and AWM with --shuffle_micro_batches in the pretend-CUDA trace (test_fake_cuda)
@pytest.mark.slow(cover="test_grpo_objectives.py::test_training_order_is_world_size_invariant", cost_s=20)
@pytest.mark.parametrize("objective", ["nft", "awm"])
def test_shuffled_micro_batches_train_every_optimizer_step(tiny_flux_dir, tiny_data, tmp_path, objective):
    """train_nft.py --shuffle_micro_batches on 2 ranks with two optimizer steps per rollout: both steps train (finite
    losses and gradient norms), the shuffle changes what the steps see (the run's losses differ from the same run in
    group order), and AWM's later micro-batches take their ratio against theta before the first step (approx_kl > 0)."""
    flags = (*(AWM if objective == "awm" else ("--solver", "dpm2")), "--prompts_per_step", "2", "--num_generations",
             "4", "--lora_rank", "4", "--learning_rate", "3e-2", "--max_train_steps", "1",
             "--gradient_accumulation_steps", "1", "--train_batch_size", "2", "--sample_every", "0")
    runs = {}
    for mode in ("order", "shuffle"):
        out = tmp_path / mode
        run_torchrun(nft_args(tiny_flux_dir, tiny_data, out, *flags, "--reward", "jpeg_compressibility:1.0",
                              *(["--shuffle_micro_batches"] if mode == "shuffle" else [])))
        runs[mode] = read_metrics(out / "metrics.jsonl")
    for rows in runs.values():
        assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    assert runs["order"][0]["reward_mean"] == runs["shuffle"][0]["reward_mean"]  # the same rollout
    assert runs["order"][0]["loss"] != runs["shuffle"][0]["loss"]
    if objective == "awm":
        assert runs["shuffle"][0]["approx_kl"] > 0
