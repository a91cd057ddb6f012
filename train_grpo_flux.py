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

import torch

from fastvideo import distributed as D
from fastvideo import training
from fastvideo.config import parse_grpo_args, validate_grpo
from fastvideo.losses import first_update_check, grpo_loss, kl_loss
from fastvideo.memory import plan_grpo
from fastvideo.rollout import replay_log_prob, rollout, select_trained_timesteps
from fastvideo.training import rank_mean


def main(argv: list[str] | None = None) -> None:
    training.run_main(parse_grpo_args(argv), validate_grpo, plan_grpo, train)


def train(args: argparse.Namespace) -> None:
    # ---- setup: flags and inputs first, before anything expensive -------------------------------
    run = training.start_run(args, validate_grpo)
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
        n_local = len(samples.prompt_ids)
        adv_all, adv_metrics, advantages = run.advantages(all_rewards["total"], samples, traj.prompt_ids)

        # ---- 4. policy update: micro-batches x trained timesteps, clipped ratio loss --------------
        t0 = time.perf_counter()
        timesteps = select_trained_timesteps(traj, samples.prompt_ids, samples.sample_indices, step, noise,
                                             timestep_fraction=args.timestep_fraction)  # (B, K)
        num_trained = timesteps.shape[1]
        accum = counts["gradient_accumulation_steps"]
        scale = 1.0 / (accum * num_trained)
        ratios, log_diffs, losses, kls, clipfracs, grad_norms, first_ratios = [], [], [], [], [], [], []
        run.optimizer.zero_grad(set_to_none=True)
        micro_batches = torch.arange(n_local).split(args.train_batch_size)
        for mb_index, idx in enumerate(micro_batches):
            adv_mb = advantages[idx]
            for k in range(num_trained):
                j = timesteps[idx, k]
                log_prob, mean, std = replay_log_prob(policy.model, traj, idx, j, batch, rollout_cfg, geometry,
                                                      autocast_dtype=amp_dtype)
                old_log_prob = traj.log_probs[idx, j].to(device)
                loss, m = grpo_loss(log_prob, old_log_prob, adv_mb, args.clip_range)
                if args.kl_beta > 0:
                    with torch.no_grad(), policy.reference() as ref_model:
                        _, ref_mean, _ = replay_log_prob(ref_model, traj, idx, j, batch, rollout_cfg, geometry,
                                                         autocast_dtype=amp_dtype)
                    kl, _ = kl_loss(mean, ref_mean, traj.noise_scale(j))
                    loss = loss + args.kl_beta * kl
                    kls.append(kl.detach())
                run.set_gradient_sync(last_backward=(mb_index + 1) % accum == 0 and k == num_trained - 1)
                (loss * scale).backward()
                ratio = torch.exp(log_prob.detach() - old_log_prob)
                ratios.append(ratio)
                log_diffs.append(log_prob.detach() - old_log_prob)
                losses.append(loss.detach())
                clipfracs.append(m["clipfrac"])
                if mb_index < accum:  # before the first optimizer step of this rollout
                    first_ratios.append(ratio)
            if (mb_index + 1) % accum == 0:
                grad_norms.append(run.optimizer_step())
        t_train = time.perf_counter() - t0

        # ---- 5. metrics, samples, checkpoint ------------------------------------------------------
        ratio_all = D.all_gather_tensor(torch.cat(ratios).float().cpu())
        first_all = D.all_gather_tensor(torch.cat(first_ratios).float().cpu())
        diff_all = D.all_gather_tensor(torch.cat(log_diffs).float().cpu())
        first_metrics, ratio_warning = first_update_check(first_all, args.clip_range)  # on-policy check
        step_time = t_rollout + t_reward + t_train
        metrics = {
            **adv_metrics,  # reward_mean, reward_std (population), zero_std_group_frac, adv_clip_frac, ...
            **training.reward_metrics(all_rewards),
            "adv_mean": adv_all.mean(), "adv_std": adv_all.std(unbiased=False), "adv_abs_max": adv_all.abs().max(),
            "loss": rank_mean(losses), "kl": rank_mean(kls) if kls else 0.0, "clipfrac": rank_mean(clipfracs),
            "ratio_mean": ratio_all.mean(), "ratio_std": ratio_all.std(unbiased=False), "ratio_min": ratio_all.min(),
            "ratio_max": ratio_all.max(), **first_metrics,
            "approx_kl": 0.5 * (diff_all ** 2).mean(),
            "grad_norm": sum(grad_norms) / len(grad_norms), "trained_timesteps": num_trained,
            "time_rollout": traj.timings.get("sample", t_rollout), "time_decode": traj.timings.get("decode", 0.0),
            "time_reward": t_reward, "time_train": t_train, "time_step": step_time,
            "samples_per_s": counts["samples_per_step"] / step_time,
        }
        if dist.is_main and ratio_warning and not warned_ratio:
            warned_ratio = True
            print(f"warning: step {step}: {ratio_warning}", flush=True)
        trace = {"loss": torch.stack(losses).view(len(micro_batches), num_trained), "timesteps": timesteps}
        if run.end_step(step, metrics, traj.images, postfix={"reward_mean": "{:.5g}", "ratio_mean": "{:.6f}"},
                        trace=trace):
            break

    run.finish()


if __name__ == "__main__":
    main()
