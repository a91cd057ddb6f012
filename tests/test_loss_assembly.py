"""The trainers' loss assembly against an independent one: one optimizer step's gradient as each trainer's own
``update_policy`` produces it (GRPO, Diffusion-DPO, DiffusionNFT; LoRA and full fine-tune) equals the gradient of a
loss this test assembles by hand from the float64-tested loss functions of ``fastvideo.losses`` and the trainers'
inputs, with the scale docs/algorithms.md and the trainers' docstrings document:

- GRPO / NFT: each (micro-batch, trained timestep) loss times ``1 / (gradient_accumulation_steps x trained
  timesteps)``, summed over the accumulation cycle; GRPO adds ``--kl_beta`` x the KL to the reference;
- DPO: per (pair, draw) item the weight ``pair weight / --timesteps_per_pair``, summed over the step's items.

Other gradient comparisons in the suite compare two configurations of the same code, so a wrong scale or weight
would agree with itself there. Before the update the trainable weights are perturbed (after the rollout), so the
policy differs from the rollout / old policy and from the reference: ratios are not 1 and some clip, and the KL
gradient is not zero. One CPU process, fp32, a tiny FLUX: agreement to 1e-6 (max |difference| / max |gradient|).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

import pytest
import torch

from fake_cuda import trainer
from helpers import build_run

from fastvideo import objectives, rollout, training
from fastvideo.rollout import RolloutConfig
from fastvideo.models import flux
from fastvideo.prompt_groups import GroupSampler
from fastvideo.losses import dpo_loss, flow_matching_error, grpo_loss, kl_loss, nft_advantages, nft_loss
from fastvideo.rollout import forward_noise, model_velocity, pair_noise, replay_log_prob

STEP = 1  # the training step the update pretends to be at (it keys the trained timesteps and the noise)
SIZE = 32  # pixels: 16 image tokens of the tiny preset
TOLERANCE = 1e-6  # max |trainer - hand| / max |hand| over every trainable parameter, fp32 on the CPU
# 2 prompts x 2 samples in micro-batches of 2 (DPO: of 2 (pair, draw) items): two micro-batches, one optimizer step
COMMON = ("--h", str(SIZE), "--w", str(SIZE), "--device", "cpu", "--mixed_precision", "fp32", "--seed", "0",
          "--prompts_per_step", "2", "--num_generations", "2", "--train_batch_size", "2", "--rollout_batch_size", "4")
VARIANTS = {"lora": ("--lora_rank", "4"), "full": ("--lora_rank", "0")}
PERTURB = {"lora": 0.05, "full": 0.001}  # std of the random change of the perturbed weights


def _run(model_dir: Path, tmp_path: Path, parse: Callable[[list[str]], argparse.Namespace],
         validate: Callable[[argparse.Namespace, int], dict[str, int]], flags: tuple[str, ...],
         **build: bool) -> training.Run:
    """A trainer's CPU ``Run`` (``helpers.build_run``) with the fp32 VAE and latent geometry set."""
    (tmp_path / "manifest.json").write_text("{}")  # flag validation only checks that it exists
    args = parse(["--pretrained_model_name_or_path", str(model_dir), "--data_json_path",
                  str(tmp_path / "manifest.json"), "--output_dir", str(tmp_path / "out"), *COMMON, *flags])
    run = build_run(args, validate, **build)
    run.vae = flux.load_vae(model_dir, dtype=torch.float32, device=run.device)
    run.geometry = flux.latent_geometry(model_dir, SIZE, SIZE)
    run.rollout_cfg = RolloutConfig.from_args(args)  # as Run.sampling_inputs builds it
    return run


def _rollout(run: training.Run, model: torch.nn.Module, keep_latents: bool = True) -> tuple:
    """The step's samples, a batch of random embeddings (8 text tokens), and ``model``'s rollout of it."""
    args, model_config = run.args, run.policy.config
    samples = GroupSampler(4, args.prompts_per_step, args.num_generations, seed=args.seed).next()
    g = torch.Generator().manual_seed(1)
    b = len(samples.prompt_ids)
    batch = {"prompt_ids": torch.tensor(samples.prompt_ids), "prompts": ["a prompt"] * b,
             "prompt_embeds": torch.randn(b, 8, model_config["joint_attention_dim"], generator=g),
             "pooled_prompt_embeds": torch.randn(b, model_config["pooled_projection_dim"], generator=g)}
    run.policy.model.eval()
    with torch.no_grad():
        traj = rollout.rollout(model, run.vae, batch, samples.sample_indices, STEP, RolloutConfig.from_args(args),
                               run.noise, run.geometry, device=run.device, keep_latents=keep_latents)
    run.policy.model.train()
    return samples, batch, traj


def _perturb(model: torch.nn.Module, variant: str, seed: int, adapter: str = "default") -> None:
    """Add seeded noise to ``model``'s weights: LoRA: the ``adapter``'s B matrices; full fine-tune: every weight."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if variant == "full" or f"lora_B.{adapter}." in name:
                p.add_(torch.randn(p.shape, generator=g) * PERTURB[variant])


def _trainable(run: training.Run) -> dict[str, torch.nn.Parameter]:
    """The policy's trainable parameters by name (what the optimizer steps)."""
    return {name: p for name, p in run.policy.model.named_parameters() if p.requires_grad}


def _hand_gradient(run: training.Run, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    """``d loss / d trainable`` by ``torch.autograd.grad`` (zeros where a parameter takes no part)."""
    params = _trainable(run)
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True, retain_graph=True)
    return {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(params.items(), grads)}


def _trainer_gradient(run: training.Run, update: Callable[[], object]) -> dict[str, torch.Tensor]:
    """The gradient the trainer's ``update`` hands its one optimizer step (recorded before clipping), which then
    runs as usual."""
    params, seen = _trainable(run), []
    real_step = run.optimizer_step

    def optimizer_step() -> float:
        seen.append({n: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for n, p in params.items()})
        return real_step()

    run.optimizer_step = optimizer_step
    update()
    assert len(seen) == 1, f"expected one optimizer step, the update made {len(seen)}"
    return seen[0]


def _relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """max |got - want| / max |want| over all parameters."""
    scale = max(float(w.abs().max()) for w in want.values())
    assert scale > 0, "the hand-assembled gradient is zero"
    return max(float((got[n] - w).abs().max()) for n, w in want.items()) / scale


def _micro_batches(n: int, size: int) -> list[torch.Tensor]:
    """Consecutive index blocks of ``size`` (the documented micro-batches of a step's samples)."""
    return [torch.arange(start, start + size) for start in range(0, n, size)]


def _reference_forward(run: training.Run, fn: Callable[[torch.nn.Module], torch.Tensor]) -> torch.Tensor:
    """``fn(reference model)`` without grad."""
    with torch.no_grad(), run.policy.reference() as ref_model:
        return fn(ref_model)


# ------------------------------------------------------------------------------------------------ GRPO
GRPO_FLAGS = ("--sampling_steps", "3", "--timestep_fraction", "1.0", "--gradient_accumulation_steps", "2",
              "--kl_beta", "0.5", "--clip_range", "3e-4", "--max_grad_norm", "1.0")


def _grpo_hand_loss(run: training.Run, samples, batch: dict, traj, advantages: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """GRPO's documented assembly: ``(sum of clipped ratio losses, sum of KLs, clipped fraction)``, each
    (micro-batch, trained timestep) term times ``1 / (gradient_accumulation_steps x trained timesteps)``."""
    args, cfg, policy = run.args, RolloutConfig.from_args(run.args), run.policy.model
    timesteps = rollout.select_trained_timesteps(traj, samples.prompt_ids, samples.sample_indices, STEP, run.noise,
                                                 timestep_fraction=args.timestep_fraction)  # (B, K)
    trained = timesteps.shape[1]
    assert trained >= 2
    scale = 1.0 / (args.gradient_accumulation_steps * trained)
    policy_loss, kl_total, clipped = torch.zeros(()), torch.zeros(()), []
    for idx in _micro_batches(len(samples.prompt_ids), args.train_batch_size):
        for k in range(trained):
            j = timesteps[idx, k]
            ref_mean = _reference_forward(
                run, lambda ref: replay_log_prob(ref, traj, idx, j, batch, cfg, run.geometry)[1])
            log_prob, mean, _ = replay_log_prob(policy, traj, idx, j, batch, cfg, run.geometry)
            loss, metrics = grpo_loss(log_prob, traj.log_probs[idx, j], advantages[idx], args.clip_range)
            kl, _ = kl_loss(mean, ref_mean, traj.noise_scale(j))
            policy_loss, kl_total = policy_loss + scale * loss, kl_total + scale * kl
            clipped.append(metrics["clipfrac"])
    return policy_loss, kl_total, float(torch.stack(clipped).mean())


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_grpo_update_matches_hand_assembled_loss(tiny_flux_dir, tmp_path, variant):
    """``train_grpo_flux.update_policy``'s gradient = that of sum over (micro-batch, timestep) of (clipped ratio loss
    + kl_beta x KL) / (accumulation x timesteps), with ratios off 1 (some clipped) and a non-negligible KL gradient."""
    run = _run(tiny_flux_dir, tmp_path, objectives.parse_grpo_args, objectives.validate_grpo, (*GRPO_FLAGS, *VARIANTS[variant]),
               need_reference=True)
    assert run.counts["micro_batches_per_rank"] == 2 and run.counts["optimizer_steps_per_rollout"] == 1
    samples, batch, traj = _rollout(run, run.policy.model)
    _perturb(run.policy.model, variant, seed=2)  # the policy is no longer the rollout's (nor the reference)
    advantages = torch.randn(len(samples.prompt_ids), generator=torch.Generator().manual_seed(3))

    policy_loss, kl, clipfrac = _grpo_hand_loss(run, samples, batch, traj, advantages)
    g_policy, g_kl = _hand_gradient(run, policy_loss), _hand_gradient(run, kl)
    want = {n: g_policy[n] + run.args.kl_beta * g_kl[n] for n in g_policy}
    got = _trainer_gradient(run, lambda: trainer("train_grpo_flux").update_policy(run, traj, batch, samples,
                                                                                  advantages, STEP))
    assert 0 < clipfrac < 1, f"clipped fraction {clipfrac}: choose --clip_range so that some but not all clip"
    kl_share = _relative_error({n: g_policy[n] for n in want}, want)  # = max |kl_beta g_kl| / max |g|
    assert kl_share > 1e3 * TOLERANCE, f"the KL gradient is too small ({kl_share:.2e}) to check its weight"
    error = _relative_error(got, want)
    print(f"grpo/{variant}: relative error {error:.2e} (clipfrac {clipfrac:.2f}, KL share {kl_share:.2e})")
    assert error <= TOLERANCE, f"grpo/{variant}: trainer vs hand-assembled gradient: relative error {error:.2e}"


# ------------------------------------------------------------------------------------------------ DPO
DPO_FLAGS = ("--sampling_steps", "2", "--timesteps_per_pair", "2", "--beta_dpo", "500")
PAIR_WEIGHTS = (0.75, 0.25)  # the caller's loss weights of this rank's two pairs (unequal, to see each one's)


def _dpo_hand_loss(run: training.Run, pair_batch: dict, x0_w: torch.Tensor, x0_l: torch.Tensor, keys: list[int],
                   weights: torch.Tensor) -> torch.Tensor:
    """Diffusion-DPO's documented assembly: for every pair and draw d < --timesteps_per_pair, the pair's shared
    ``(eps, sigma)``; the flow-matching errors of the policy and the reference on the true winner and loser;
    ``dpo_loss`` with item weight ``pair weight / timesteps_per_pair``, summed over the items."""
    args = run.args
    draws = args.timesteps_per_pair
    pairs = [(p, d) for p in range(len(keys)) for d in range(draws)]
    rows = torch.tensor([p for p, _ in pairs])
    noise = [pair_noise(run.noise, tuple(x0_w.shape[1:]), STEP, [keys[p]], draws=[d]) for p, d in pairs]
    eps, sigma = torch.cat([e for e, _ in noise]), torch.cat([s for _, s in noise])
    cond = {k: pair_batch[k][rows] for k in ("prompt_embeds", "pooled_prompt_embeds")}

    def errors(model: torch.nn.Module, x0: torch.Tensor) -> torch.Tensor:
        x_t = forward_noise(x0[rows], eps, sigma)
        v = model_velocity(model, x_t, sigma, cond, run.geometry, guidance=args.guidance_scale)
        return flow_matching_error(v, eps - x0[rows])

    ref_w, ref_l = (_reference_forward(run, lambda ref, x0=x0: errors(ref, x0)) for x0 in (x0_w, x0_l))
    err_w, err_l = errors(run.policy.model, x0_w), errors(run.policy.model, x0_l)
    item_weights = weights[rows] / draws
    loss, _ = dpo_loss(err_w, err_l, ref_w, ref_l, beta=args.beta_dpo, weights=item_weights)
    return loss


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_dpo_update_matches_hand_assembled_loss(tiny_flux_dir, tmp_path, variant):
    """``train_dpo.update_policy``'s gradient = that of sum over (pair, draw) items of pair weight /
    timesteps_per_pair x DPO loss (winner and loser in their true roles), with the policy off the reference."""
    run = _run(tiny_flux_dir, tmp_path, objectives.parse_dpo_args, objectives.validate_dpo, (*DPO_FLAGS, *VARIANTS[variant]),
               need_reference=True, ref_snapshot=False)
    samples, batch, traj = _rollout(run, run.policy.model)
    _perturb(run.policy.model, variant, seed=2)  # the policy is no longer the reference
    x0 = traj.clean_latents.cpu()
    keys = samples.prompt_ids[0::2]  # one pair per prompt: its first sample wins, its second loses
    pair_batch = {k: batch[k][0::2] for k in ("prompt_embeds", "pooled_prompt_embeds")}
    weights = torch.tensor(PAIR_WEIGHTS)
    assert len(keys) * run.args.timesteps_per_pair > run.args.train_batch_size  # more than one micro-batch

    want = _hand_gradient(run, _dpo_hand_loss(run, pair_batch, x0[0::2], x0[1::2], keys, weights))
    got = _trainer_gradient(run, lambda: trainer("train_dpo").update_policy(run, pair_batch, x0[0::2], x0[1::2], keys,
                                                                            weights, STEP))
    error = _relative_error(got, want)
    print(f"dpo/{variant}: relative error {error:.2e}")
    assert error <= TOLERANCE, f"dpo/{variant}: trainer vs hand-assembled gradient: relative error {error:.2e}"


# ------------------------------------------------------------------------------------------------ NFT
NFT_FLAGS = ("--sampling_steps", "4", "--timestep_fraction", "0.5", "--gradient_accumulation_steps", "2",
             "--kl_beta", "0.1", "--nft_beta", "0.5")


def _old_model(run: training.Run, variant: str) -> torch.nn.Module:
    """The module holding NFT's old policy weights: the model itself (adapter ``old``) or the separate copy."""
    return run.policy.model if variant == "lora" else run.policy.old.old_model


def _nft_hand_loss(run: training.Run, samples, batch: dict, traj, advantages: torch.Tensor, keep: torch.Tensor
                   ) -> torch.Tensor:
    """DiffusionNFT's documented assembly: for every micro-batch and trained sigma, the keyed forward-process noise,
    v_old / v_ref without grad and v_theta; ``nft_loss`` times ``1 / (gradient_accumulation_steps x trained
    timesteps)``, summed."""
    args, policy, old = run.args, run.policy.model, run.policy.old
    velocity = dict(geometry=run.geometry, guidance=args.guidance_scale)
    timesteps = rollout.nft_timesteps(run.noise, STEP, samples.prompt_ids, samples.sample_indices,
                                      args.sampling_steps, args.timestep_fraction)  # (B, K)
    trained = timesteps.shape[1]
    assert trained >= 2
    scale = 1.0 / (args.gradient_accumulation_steps * trained)
    x0, total, kls = traj.clean_latents, torch.zeros(()), []
    for idx in _micro_batches(len(samples.prompt_ids), args.train_batch_size):
        cond = {k: batch[k][idx] for k in ("prompt_embeds", "pooled_prompt_embeds")}
        for k in range(trained):
            t = traj.sigmas[timesteps[idx, k]]
            eps = torch.stack([run.noise.randn(tuple(x0.shape[1:]), step=STEP, prompt_id=samples.prompt_ids[i],
                                               sample_index=samples.sample_indices[i], purpose=f"nft_eps/{k}")
                               for i in idx.tolist()])
            x_t = forward_noise(x0[idx], eps, t)
            with torch.no_grad(), old.active() as old_model:
                v_old = model_velocity(old_model, x_t, t, cond, **velocity)
            v_ref = _reference_forward(run, lambda ref: model_velocity(ref, x_t, t, cond, **velocity))
            v_theta = model_velocity(policy, x_t, t, cond, **velocity)
            loss, metrics = nft_loss(v_theta, v_old, x_t, x0[idx], t, advantages[idx], beta=args.nft_beta,
                                     adv_clip_max=args.adv_clip_max, v_ref=v_ref, kl_beta=args.kl_beta,
                                     keep=keep[idx])
            total = total + scale * loss
            kls.append(metrics["kl_loss"])
    assert float(torch.stack(kls).min()) > 0, "the policy equals the reference: the KL term is degenerate"
    return total


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_nft_update_matches_hand_assembled_loss(tiny_flux_dir, tmp_path, variant):
    """``train_nft.update_policy``'s gradient = that of sum over (micro-batch, sigma) of NFT loss (+ kl_beta x KL) /
    (accumulation x timesteps), with the policy, the old policy and the reference all different and one sample
    dropped (a non-finite reward)."""
    run = _run(tiny_flux_dir, tmp_path, objectives.parse_nft_args, objectives.validate_nft, (*NFT_FLAGS, *VARIANTS[variant]),
               need_reference=True, old_policy=True)
    assert run.counts["micro_batches_per_rank"] == 2 and run.counts["optimizer_steps_per_rollout"] == 1
    _perturb(_old_model(run, variant), variant, seed=4, adapter="old")  # the old policy is not the reference
    with run.policy.old.active() as old_model:
        samples, batch, traj = _rollout(run, old_model, keep_latents=False)
    _perturb(run.policy.model, variant, seed=2)  # the policy is not the old one
    raw = 3 * torch.randn(len(samples.prompt_ids), generator=torch.Generator().manual_seed(3))
    advantages = nft_advantages(raw, run.args.adv_mode, run.args.adv_clip_max)
    keep = torch.tensor([True, True, False, True])

    want = _hand_gradient(run, _nft_hand_loss(run, samples, batch, traj, advantages, keep))
    got = _trainer_gradient(run, lambda: trainer("train_nft").update_policy(run, traj, batch, samples, advantages,
                                                                            keep, STEP))
    error = _relative_error(got, want)
    print(f"nft/{variant}: relative error {error:.2e}")
    assert error <= TOLERANCE, f"nft/{variant}: trainer vs hand-assembled gradient: relative error {error:.2e}"
