"""GRPO post-training of a FLUX transformer (DanceGRPO / Flow-GRPO style), torchrun + FSDP.

One step: sample prompts -> batched SDE rollout with log-probs -> decode -> reward -> gather and
group advantages -> for every micro-batch and trained timestep, replay the step with the current
policy and back-propagate the clipped ratio loss -> clip grads -> optimizer step -> log/checkpoint.

    torchrun --nproc_per_node 8 train_grpo_flux.py --pretrained_model_name_or_path FLUX.1-dev \
        --data_json_path data/embeddings/manifest.json --output_dir outputs/grpo ...
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from fastvideo import distributed as D
from fastvideo import flux, training
from fastvideo.advantages import group_advantages
from fastvideo.config import parse_grpo_args, save_config, validate_grpo
from fastvideo.data import EmbeddingDataset, GroupSampler
from fastvideo.logging import MetricsLogger, current_memory_gb, peak_memory_gb, progress_bar, save_image_grid
from fastvideo.losses import first_update_check, grpo_loss, kl_loss
from fastvideo.memory import plan_grpo
from fastvideo.parallel import clip_grad_norm, resolve_gradient_sync, set_gradient_sync
from fastvideo.rewards import build_reward, parse_reward_spec
from fastvideo.rollout import RolloutConfig, replay_log_prob, rollout, select_trained_timesteps
from fastvideo.seeding import NoiseSource, rng_state, seed_all, set_deterministic, set_rng_state

REWARD_PATH_FLAGS = ("hps_checkpoint", "hps_model", "pickscore_model", "pickscore_processor", "clip_checkpoint",
                     "clip_model", "aesthetic_checkpoint", "aesthetic_clip_checkpoint", "aesthetic_clip_model")


def main(argv: list[str] | None = None) -> None:
    args = parse_grpo_args(argv)
    if args.dry_run:  # flags + batch arithmetic + per-rank memory plan, from the configs alone
        return training.dry_run(args, validate_grpo, plan_grpo)
    D.init_distributed(args.device, cpu_collectives=args.use_cpu_offload)
    with D.fail_fast():  # an error on one rank ends every rank within seconds, with its message
        train(args)
    D.cleanup()


def train(args: argparse.Namespace) -> None:
    # ---- setup: flags and inputs first, before anything expensive -------------------------------
    dist = D.info()
    counts = validate_grpo(args, dist.world_size)
    training.check_memory_flags(args, dist.world_size, dist.device)
    parse_reward_spec(args.reward)
    geometry = flux.latent_geometry(args.pretrained_model_name_or_path, args.h, args.w)
    dataset = EmbeddingDataset(args.data_json_path)
    dataset.check_encoders(args.pretrained_model_name_or_path)
    sampler = GroupSampler(len(dataset), args.prompts_per_step, args.num_generations, seed=args.seed,
                           rank=dist.rank, world_size=dist.world_size)
    rollout_cfg = RolloutConfig(height=args.h, width=args.w, sampling_steps=args.sampling_steps,
                                sde_type=args.sde_type, eta=args.eta, shift=args.shift,
                                guidance=args.guidance_scale, sde_window_size=args.sde_window_size,
                                sde_window_range=tuple(args.sde_window_range), init_same_noise=args.init_same_noise,
                                decode_x0=args.decode_x0, batch_size=args.rollout_batch_size,
                                last_step=args.last_step)
    config = training.run_config(args, counts)
    resume_dir = training.resolve_resume(args)
    if resume_dir is not None:
        training.check_resume_step(resume_dir, args.max_train_steps)
        training.check_resume_config(config, training.saved_run_config(resume_dir))
    seed_all(args.seed)
    set_deterministic(args.deterministic)
    noise = NoiseSource(args.seed, device=args.noise_device)
    device, main_rank = dist.device, dist.is_main
    amp_dtype = training.compute_dtype(args.mixed_precision, device)
    out = Path(args.output_dir)
    if main_rank:
        print("batch arithmetic: " + ", ".join(f"{k}={v}" for k, v in counts.items()), flush=True)
        save_config(config, out / "config.json")

    # ---- reward (checks its checkpoint paths first), models, optimizer --------------------------
    memory_baseline = current_memory_gb(device, import_model_libraries=True)
    reward_fn = build_reward(args.reward, device, **{k: getattr(args, k) for k in REWARD_PATH_FLAGS})
    policy = training.build_policy(args, device, need_reference=args.kl_beta > 0)
    sync_every_backward = resolve_gradient_sync(args.gradient_sync, policy.is_lora) == "backward"
    optimizer = training.build_optimizer(policy, args)  # right after sharding (FSDP2 swaps in DTensors)
    lr_scheduler = training.build_lr_scheduler(optimizer, args,
                                               args.max_train_steps * counts["optimizer_steps_per_rollout"])
    vae = flux.load_vae(args.pretrained_model_name_or_path, device=device)

    # ---- resume ----------------------------------------------------------------------------------
    start_step, skipped_updates = 0, 0
    if resume_dir is not None:
        extra = training.load_state(resume_dir, policy, optimizer, lr_scheduler)
        start_step, skipped_updates = extra["step"], extra["skipped_updates"]
        sampler.load_state_dict(extra["sampler"])
        set_rng_state(extra["rng"][dist.rank] if dist.rank < len(extra["rng"]) else extra["rng"][0])
        if main_rank:
            print(f"resumed from {resume_dir} at step {start_step}", flush=True)
    logger = MetricsLogger(out, enabled=main_rank, sinks=args.log_to, config=config,
                           wandb_project=args.wandb_project, resume_step=start_step if resume_dir else None)
    warned_ratio = False
    bar = progress_bar(args.max_train_steps, start_step, enabled=main_rank and args.progress_bar)

    for step in range(start_step + 1, args.max_train_steps + 1):
        samples = sampler.next()
        batch = dataset.get_batch(samples.prompt_ids)
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

        # ---- 1. rollout with the current (= old) policy, no grad ---------------------------------
        t0 = time.perf_counter()
        policy.model.eval()
        traj = rollout(policy.model, vae, batch, samples.sample_indices, step, rollout_cfg, noise, geometry,
                       device=device, autocast_dtype=amp_dtype)
        policy.model.train()
        t_rollout = time.perf_counter() - t0

        # ---- 2. reward (batched), gathered over ranks ---------------------------------------------
        t0 = time.perf_counter()
        rewards = reward_fn(traj.images, batch["prompts"])
        t_reward = time.perf_counter() - t0
        stacked = torch.stack([v.float().cpu() for v in rewards.values()], dim=1)  # (B, components + total)
        all_rewards = dict(zip(rewards, D.all_gather_tensor(stacked).unbind(dim=1)))  # name -> (P*G,)

        # ---- 3. group advantages on the global batch; keep this rank's slice ---------------------
        n_local = len(samples.prompt_ids)
        group_ids = torch.arange(args.prompts_per_step).repeat_interleave(args.num_generations)  # (P*G,)
        all_prompt_ids = D.all_gather_tensor(traj.prompt_ids)
        expected_ids = torch.tensor(samples.group_prompt_ids).repeat_interleave(args.num_generations)
        assert torch.equal(all_prompt_ids, expected_ids), "gathered samples are not in prompt-group order"
        adv_all, adv_metrics = group_advantages(all_rewards["total"], group_ids, global_std=args.global_std,
                                                adv_clip_max=args.adv_clip_max, eps=args.adv_eps)
        advantages = adv_all[dist.rank * n_local:(dist.rank + 1) * n_local].to(device)

        # ---- 4. policy update: micro-batches x trained timesteps, clipped ratio loss --------------
        t0 = time.perf_counter()
        timesteps = select_trained_timesteps(traj, samples.prompt_ids, samples.sample_indices, step, noise,
                                             timestep_fraction=args.timestep_fraction)  # (B, K)
        num_trained = timesteps.shape[1]
        accum = counts["gradient_accumulation_steps"]
        scale = 1.0 / (accum * num_trained)
        ratios, log_diffs, losses, kls, clipfracs, grad_norms, first_ratios = [], [], [], [], [], [], []
        optimizer.zero_grad(set_to_none=True)
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
                # --gradient_sync backward: reduce-scatter now; step (LoRA): only on the cycle's last backward
                last_backward = (mb_index + 1) % accum == 0 and k == num_trained - 1
                set_gradient_sync(policy.model, sync_every_backward or last_backward)
                (loss * scale).backward()
                ratio = torch.exp(log_prob.detach() - old_log_prob)
                ratios.append(ratio)
                log_diffs.append(log_prob.detach() - old_log_prob)
                losses.append(loss.detach())
                clipfracs.append(m["clipfrac"])
                if mb_index < accum:  # before the first optimizer step of this rollout
                    first_ratios.append(ratio)
            if (mb_index + 1) % accum == 0:
                grad_norm = clip_grad_norm(policy.model, args.max_grad_norm if args.max_grad_norm > 0 else math.inf)
                grad_norms.append(grad_norm)
                if math.isfinite(grad_norm):
                    optimizer.step()
                    lr_scheduler.step()
                    if policy.ema is not None:
                        policy.ema.update()
                else:
                    skipped_updates += 1
                optimizer.zero_grad(set_to_none=True)
        t_train = time.perf_counter() - t0

        # ---- 5. metrics, samples, checkpoint ------------------------------------------------------
        ratio_all = D.all_gather_tensor(torch.cat(ratios).float().cpu())
        first_all = D.all_gather_tensor(torch.cat(first_ratios).float().cpu())
        diff_all = D.all_gather_tensor(torch.cat(log_diffs).float().cpu())
        first_metrics, ratio_warning = first_update_check(first_all, args.clip_range)  # on-policy check
        step_time = t_rollout + t_reward + t_train
        metrics = {
            **adv_metrics,  # reward_mean, reward_std (population), zero_std_group_frac, adv_clip_frac, ...
            **{f"reward_{k}": v.mean() for k, v in all_rewards.items() if k != "total"},
            "adv_mean": adv_all.mean(), "adv_std": adv_all.std(unbiased=False), "adv_abs_max": adv_all.abs().max(),
            "loss": rank_mean(losses), "kl": rank_mean(kls) if kls else 0.0, "clipfrac": rank_mean(clipfracs),
            "ratio_mean": ratio_all.mean(), "ratio_std": ratio_all.std(unbiased=False), "ratio_min": ratio_all.min(),
            "ratio_max": ratio_all.max(), **first_metrics,
            "approx_kl": 0.5 * (diff_all ** 2).mean(),
            "grad_norm": sum(grad_norms) / len(grad_norms), "skipped_updates": skipped_updates,
            "lr": lr_scheduler.get_last_lr()[0], "trained_timesteps": num_trained,
            "time_rollout": traj.timings.get("sample", t_rollout), "time_decode": traj.timings.get("decode", 0.0),
            "time_reward": t_reward, "time_train": t_train, "time_step": step_time,
            "samples_per_s": counts["samples_per_step"] / step_time,
            "peak_memory_gb": D.all_reduce_max(peak_memory_gb(device)),
            "memory_baseline_gb": D.all_reduce_max(memory_baseline),
        }
        logger.log(step, metrics)
        if main_rank and ratio_warning and not warned_ratio:
            warned_ratio = True
            print(f"warning: step {step}: {ratio_warning}", flush=True)
        bar.update(1)
        bar.set_postfix(reward=f"{float(metrics['reward_mean']):.5g}", ratio=f"{float(metrics['ratio_mean']):.6f}")
        if args.sample_every and (step % args.sample_every == 0 or step == 1) and main_rank:
            save_image_grid(traj.images, out / "samples" / f"step-{step:06d}.png")
        if step % args.checkpointing_steps == 0 or step == args.max_train_steps:
            training.save_state(args, step, policy, optimizer, lr_scheduler, extra={
                "step": step, "skipped_updates": skipped_updates, "sampler": sampler.state_dict(),
                "rng": D.all_gather_object(rng_state()), "config": config})

    bar.close()
    logger.close()
    final = training.export_final(args, policy)
    if main_rank:
        print(f"metrics: {out / 'metrics.jsonl'}\nsamples: {out / 'samples'}\ncheckpoints: {out / 'checkpoints'}\n"
              f"export:  {final}", flush=True)


def rank_mean(values: list[torch.Tensor]) -> torch.Tensor:
    """Mean of this rank's 0-d metric tensors, averaged over ranks (every rank has the same count)."""
    local = torch.stack([v.detach().float().cpu() for v in values]).mean()
    return D.all_reduce_sum(local) / D.get_world_size()


if __name__ == "__main__":
    main()
