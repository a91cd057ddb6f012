"""GRPO post-training of a FLUX transformer (DanceGRPO / Flow-GRPO style), torchrun + FSDP.

One step: sample prompts -> batched SDE rollout with log-probs -> decode -> reward -> gather and
group advantages -> for every micro-batch and trained timestep, replay the step with the current
policy and back-propagate the clipped ratio loss -> clip grads -> optimizer step -> log/checkpoint.

    torchrun --nproc_per_node 8 train_grpo_flux.py --pretrained_model_name_or_path FLUX.1-dev \
        --data_json_path data/embeddings/manifest.json --output_dir outputs/grpo ...
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import torch

from fastvideo import devices, errors, training
from fastvideo import distributed as D
from fastvideo.config import parse_grpo_args, validate_grpo
from fastvideo.losses import first_update_check, grpo_loss, kl_loss
from fastvideo.memory import plan_grpo
from fastvideo.rollout import replay_log_prob, rollout, select_trained_timesteps
from fastvideo.training import rank_mean


def main(argv: list[str] | None = None) -> None:
    training.run_main(errors.parse_or_exit(parse_grpo_args, argv), validate_grpo, plan_grpo, train)


def train(args: argparse.Namespace) -> None:
    # ---- setup: flags and inputs first, before anything expensive -------------------------------
    run = training.start_run(args, validate_grpo, plan_grpo)
    counts, device, dist, noise = run.counts, run.device, run.dist, run.noise
    geometry, dataset, sampler, rollout_cfg = run.prompt_groups()  # reward spec, embeddings checked

    # ---- reward, models, optimizer; resume --------------------------------------------------------
    run.load_models(reward=True, need_reference=args.kl_beta > 0,
                    optimizer_steps=args.max_train_steps * counts["optimizer_steps_per_rollout"])
    policy, vae, amp_dtype = run.policy, run.vae, run.amp_dtype
    start_step = run.resume(sampler=sampler)
    warned_ratio = False

    for step in range(start_step + 1, args.max_train_steps + 1):
        samples = sampler.next()
        batch = training.batch_to(dataset.get_batch(samples.prompt_ids), device)

        # ---- 1. rollout with the current (= old) policy, no grad ---------------------------------
        t0 = time.perf_counter()
        policy.model.eval()
        traj = rollout(policy.model, vae, batch, samples.sample_indices, step, rollout_cfg, noise, geometry,
                       device=device, autocast_dtype=amp_dtype)
        policy.model.train()
        t_rollout = time.perf_counter() - t0

        # ---- 2. reward (batched), gathered over ranks: name -> (P*G,) -----------------------------
        all_rewards, t_reward = run.score_rollout(traj, batch["prompts"])

        # ---- 3. group advantages on the global batch; keep this rank's slice ---------------------
        adv_all, adv_metrics, advantages = run.advantages(all_rewards["total"], samples, traj.prompt_ids)

        # ---- 4. policy update: micro-batches x trained timesteps, clipped ratio loss --------------
        t0 = time.perf_counter()
        upd = update_policy(run, traj, batch, samples, advantages, step)
        t_train = time.perf_counter() - t0

        # ---- 5. metrics, samples, checkpoint ------------------------------------------------------
        host = training.to_host({"ratio": torch.cat(upd.ratios), "first": torch.cat(upd.first_ratios),
                                 "diff": torch.cat(upd.log_diffs), "loss": upd.losses, "kl": upd.kls,
                                 "clipfrac": upd.clipfracs})  # one device->host copy for the step's metrics
        ratio_all, first_all, diff_all = (D.gather_samples(host[k]) for k in ("ratio", "first", "diff"))
        first_metrics, ratio_warning = first_update_check(first_all, args.clip_range)  # on-policy check
        step_time = t_rollout + t_reward + t_train
        metrics = {
            **adv_metrics,  # reward_mean, reward_std (population), zero_std_group_frac, adv_clip_frac, ...
            **training.reward_metrics(all_rewards),
            "adv_mean": adv_all.mean(), "adv_std": adv_all.std(unbiased=False), "adv_abs_max": adv_all.abs().max(),
            "loss": rank_mean(host["loss"]), "kl": rank_mean(host["kl"]) if upd.kls else 0.0,
            "clipfrac": rank_mean(host["clipfrac"]),
            "ratio_mean": ratio_all.mean(), "ratio_std": ratio_all.std(unbiased=False), "ratio_min": ratio_all.min(),
            "ratio_max": ratio_all.max(), **first_metrics,
            "approx_kl": 0.5 * (diff_all ** 2).mean(),
            "grad_norm": sum(upd.grad_norms) / len(upd.grad_norms), "trained_timesteps": upd.timesteps.shape[1],
            "time_rollout": traj.timings.get("sample", t_rollout), "time_decode": traj.timings.get("decode", 0.0),
            "time_reward": t_reward, "time_train": t_train, "time_step": step_time,
            "samples_per_s": counts["samples_per_step"] / step_time,
        }
        if dist.is_main and ratio_warning and not warned_ratio:
            warned_ratio = True
            print(f"warning: step {step}: {ratio_warning}", flush=True)
        trace = {"loss": host["loss"].view(-1, upd.timesteps.shape[1]), "timesteps": upd.timesteps}
        if run.end_step(step, metrics, traj.images, postfix={"reward_mean": "{:.5g}", "ratio_mean": "{:.6f}"},
                        trace=trace):
            break

    run.finish()


@dataclass
class Update:
    """What one rollout's policy update produced, per (micro-batch, trained timestep) in order: the step's trained
    timesteps (B, K), detached ratios / log-ratio / loss / KL / clipfrac, the ratios before the first optimizer step
    (the on-policy check), and each optimizer step's gradient norm."""

    timesteps: torch.Tensor
    ratios: list[torch.Tensor] = field(default_factory=list)
    log_diffs: list[torch.Tensor] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)
    kls: list[torch.Tensor] = field(default_factory=list)
    clipfracs: list[torch.Tensor] = field(default_factory=list)
    first_ratios: list[torch.Tensor] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)


def update_policy(run: training.Run, traj, batch: dict, samples, advantages: torch.Tensor, step: int) -> Update:
    """For every micro-batch of --train_batch_size samples and every trained timestep: replay the step with the
    current policy, back-propagate the clipped ratio loss (+ kl_beta x KL to the reference), scaled by 1/(accumulated
    micro-batches x timesteps); an optimizer step every --gradient_accumulation_steps micro-batches."""
    args, policy, amp_dtype = run.args, run.policy, run.amp_dtype
    geometry, rollout_cfg = run.geometry, training.rollout_config(args)
    timesteps = select_trained_timesteps(traj, samples.prompt_ids, samples.sample_indices, step, run.noise,
                                         timestep_fraction=args.timestep_fraction)  # (B, K)
    num_trained = timesteps.shape[1]
    accum = run.counts["gradient_accumulation_steps"]
    scale = 1.0 / (accum * num_trained)
    out = Update(timesteps=timesteps)
    run.optimizer.zero_grad(set_to_none=True)
    timesteps_dev = devices.to_device(timesteps, run.device)  # once per step: the loop below never syncs
    micro_batches = torch.arange(len(samples.prompt_ids)).split(args.train_batch_size)
    for mb_index, idx_cpu in enumerate(micro_batches):
        idx = devices.to_device(idx_cpu, run.device)
        adv_mb = advantages[idx]
        for k in range(num_trained):
            j = timesteps_dev[idx, k]
            log_prob, mean, std = replay_log_prob(policy.model, traj, idx, j, batch, rollout_cfg, geometry,
                                                  autocast_dtype=amp_dtype)
            old_log_prob = traj.log_probs[idx, j]
            loss, m = grpo_loss(log_prob, old_log_prob, adv_mb, args.clip_range)
            if args.kl_beta > 0:
                with torch.no_grad(), policy.reference() as ref_model:
                    _, ref_mean, _ = replay_log_prob(ref_model, traj, idx, j, batch, rollout_cfg, geometry,
                                                     autocast_dtype=amp_dtype)
                kl, _ = kl_loss(mean, ref_mean, traj.noise_scale(j))
                loss = loss + args.kl_beta * kl
                out.kls.append(kl.detach())
            run.backward(loss * scale, last_backward=(mb_index + 1) % accum == 0 and k == num_trained - 1)
            ratio = torch.exp(log_prob.detach() - old_log_prob)
            out.ratios.append(ratio)
            out.log_diffs.append(log_prob.detach() - old_log_prob)
            out.losses.append(loss.detach())
            out.clipfracs.append(m["clipfrac"])
            if mb_index < accum:  # before the first optimizer step of this rollout
                out.first_ratios.append(ratio)
        if (mb_index + 1) % accum == 0:
            out.grad_norms.append(run.optimizer_step())
    return out


if __name__ == "__main__":
    main()
