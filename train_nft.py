"""DiffusionNFT post-training of a FLUX transformer (REFERENCE §6), torchrun + FSDP2.

One step: prompts -> batched deterministic rollout with the *old* policy (--solver euler | dpm2; no classifier-free
guidance), keeping each sample's clean latent x0 -> decode -> reward -> gather over ranks -> group advantages ->
optimality r (--adv_mode) -> for every micro-batch and trained sigma t (int(S x --timestep_fraction) of the sampling
grid, in a per-sample random order, fresh noise each): x_t = (1-t) x0 + t eps, v_old (old policy) and v_ref
(reference, with --kl_beta) without grad, v_theta with grad -> NFT loss in x0 space -> backward -> optimizer step(s)
-> every --old_update_interval steps old <- d old + (1-d) theta (--old_decay_schedule).

    torchrun --nproc_per_node 8 train_nft.py --pretrained_model_name_or_path FLUX.1-dev \
        --data_json_path data/embeddings/manifest.json --output_dir outputs/nft --lora_rank 32 ...
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import torch

from fastvideo import devices, errors, models, training
from fastvideo.config import parse_nft_args, validate_nft
from fastvideo.losses import nft_advantages, nft_loss, nft_old_decay, nft_optimality
from fastvideo.memory import plan_nft
from fastvideo.rollout import forward_noise, model_velocity, nft_timesteps, rollout
from fastvideo.training import rank_mean


def main(argv: list[str] | None = None) -> None:
    training.run_main(errors.parse_or_exit(parse_nft_args, argv), validate_nft, plan_nft, train)


def train(args: argparse.Namespace) -> None:
    # ---- setup: flags and inputs first, before anything expensive -------------------------------
    run = training.start_run(args, validate_nft, plan_nft)
    counts, device, noise, amp_dtype = run.counts, run.device, run.noise, run.amp_dtype
    geometry, dataset, sampler, rollout_cfg = run.prompt_groups()  # reward spec, embeddings checked

    # ---- reward, policy + old policy (+ reference), optimizer; resume -----------------------------
    run.load_models(reward=True, need_reference=args.kl_beta > 0, old_policy=True,
                    optimizer_steps=args.max_train_steps * counts["optimizer_steps_per_rollout"])
    policy, old = run.policy, run.policy.old
    start_step = run.resume(sampler=sampler)

    for step in range(start_step + 1, args.max_train_steps + 1):
        samples = sampler.next()
        batch = training.batch_to(dataset.get_batch(samples.prompt_ids), device)

        # ---- 1. rollout with the old policy: deterministic, no grad; keep x0 ---------------------------
        policy.model.eval()
        with old.active() as old_model:
            traj = rollout(old_model, run.vae, batch, samples.sample_indices, step, rollout_cfg, noise, geometry,
                           device=device, autocast_dtype=amp_dtype, keep_latents=False)
        policy.model.train()

        # ---- 2. reward (batched), gathered over ranks: name -> (P*G,) ---------------------------------
        all_rewards, t_reward = run.score_rollout(traj, batch["prompts"])

        # ---- 3. group advantages on the global batch -> optimality r ------------------------------------
        adv_all, adv_metrics, advantages = run.advantages(all_rewards["total"], samples, traj.prompt_ids)
        advantages = nft_advantages(advantages, args.adv_mode, args.adv_clip_max)  # (B,) this rank's
        keep = run.local(all_rewards["total"].isfinite())  # (B,) False: dropped for a non-finite reward

        # ---- 4. forward-process update: micro-batches x trained sigmas, loss in x0 space ---------------
        t0 = time.perf_counter()
        upd = update_policy(run, traj, batch, samples, advantages, keep, step)

        # ---- 5. the old policy follows: old <- d*old + (1-d)*theta -----------------------------------
        optimizer_steps = step * counts["optimizer_steps_per_rollout"]
        old_decay = nft_old_decay(optimizer_steps, args.old_decay_schedule)
        if step % args.old_update_interval == 0:
            old.update(old_decay)
        t_train = time.perf_counter() - t0

        # ---- 6. metrics, samples, checkpoint ------------------------------------------------------------
        t_rollout, t_decode = traj.timings["sample"], traj.timings["decode"]
        step_time = t_rollout + t_decode + t_reward + t_train
        host = training.to_host(upd.logs)  # one device->host copy for the step's metrics
        r_all = nft_optimality(nft_advantages(adv_all, args.adv_mode, args.adv_clip_max), args.adv_clip_max)
        metrics = {
            **adv_metrics,  # reward_mean, reward_std (population), zero_std_group_frac, adv_clip_frac, ...
            **training.reward_metrics(all_rewards),
            **{name: rank_mean(values) for name, values in host.items()},
            "r_mean": r_all.mean(), "r_std": r_all.std(unbiased=False),
            "old_decay": old_decay, "old_updates": old.num_updates,
            "grad_norm": sum(upd.grad_norms) / len(upd.grad_norms), "trained_timesteps": upd.timesteps.shape[1],
            "time_rollout": t_rollout, "time_decode": t_decode, "time_reward": t_reward, "time_train": t_train,
            "time_step": step_time, "samples_per_s": counts["samples_per_step"] / step_time,
        }
        trace = {"loss": host["loss"].view(-1, upd.timesteps.shape[1]), "timesteps": upd.timesteps}
        if run.end_step(step, metrics, traj.images, postfix={"reward_mean": "{:.5g}", "loss": "{:.4f}"}, trace=trace):
            break

    run.finish()


@dataclass
class Update:
    """What one rollout's NFT update produced: the trained timesteps (B, K), per (micro-batch, trained sigma) the
    detached loss terms (``logs``), and each optimizer step's gradient norm."""

    timesteps: torch.Tensor
    logs: dict[str, list[torch.Tensor]] = field(default_factory=lambda: {
        k: [] for k in ("loss", "policy_loss", "kl", "L_pos", "L_neg", "old_deviation")})
    grad_norms: list[float] = field(default_factory=list)


def update_policy(run: training.Run, traj, batch: dict, samples, advantages: torch.Tensor, keep: torch.Tensor,
                  step: int) -> Update:
    """For every micro-batch of --train_batch_size samples and every trained sigma: noise the old policy's clean
    latents (forward process), v_old and v_ref without grad, v_theta, back-propagate the NFT loss scaled by
    1/(accumulated micro-batches x timesteps); an optimizer step every --gradient_accumulation_steps micro-batches.
    ``advantages`` (B,) this rank's NFT advantages, ``keep`` (B,) False for samples dropped for a non-finite reward."""
    args, policy, old, device, noise = run.args, run.policy, run.policy.old, run.device, run.noise
    velocity = dict(geometry=run.geometry, guidance=args.guidance_scale, autocast_dtype=run.amp_dtype)
    x0 = traj.clean_latents  # (B, L, C) float32
    keep_dev = devices.to_device(keep, device)
    timesteps = nft_timesteps(noise, step, samples.prompt_ids, samples.sample_indices, args.sampling_steps,
                              args.timestep_fraction)  # (B, K) indices into the sampling grid
    num_trained = timesteps.shape[1]
    accum = run.counts["gradient_accumulation_steps"]
    scale = 1.0 / (accum * num_trained)
    out = Update(timesteps=timesteps)
    micro_batches = torch.arange(len(samples.prompt_ids)).split(args.train_batch_size)
    timesteps_dev = devices.to_device(timesteps, device)  # once per step: the loop below never syncs
    for mb_index, idx_cpu in enumerate(micro_batches):
        idx = devices.to_device(idx_cpu, device)
        cond = {k: batch[k][idx] for k in models.family_of(policy.model).embedding_keys}
        keys = dict(prompt_ids=[samples.prompt_ids[i] for i in idx_cpu.tolist()],
                    sample_indices=[samples.sample_indices[i] for i in idx_cpu.tolist()])
        for k in range(num_trained):
            t = traj.sigmas[timesteps_dev[idx, k]]  # (b,) per-sample sigma
            eps = noise.batch_randn(tuple(x0.shape[1:]), step=step, purpose=f"nft_eps/{k}", **keys)
            x_t = forward_noise(x0[idx], eps, t)  # (b, L, C)
            with torch.no_grad():
                with old.active() as old_model:
                    v_old = model_velocity(old_model, x_t, t, cond, **velocity)
                v_ref = None
                if args.kl_beta > 0:
                    with policy.reference() as ref_model:
                        v_ref = model_velocity(ref_model, x_t, t, cond, **velocity)
            v_theta = model_velocity(policy.model, x_t, t, cond, **velocity)
            loss, m = nft_loss(v_theta, v_old, x_t, x0[idx], t, advantages[idx], beta=args.nft_beta,
                               adv_clip_max=args.adv_clip_max, v_ref=v_ref, kl_beta=args.kl_beta,
                               keep=keep_dev[idx])
            run.backward(loss * scale, last_backward=(mb_index + 1) % accum == 0 and k == num_trained - 1)
            for name, value in (("loss", loss), ("policy_loss", m["policy_loss"]), ("kl", m["kl_loss"]),
                                ("L_pos", m["positive_loss"]), ("L_neg", m["negative_loss"]),
                                ("old_deviation", (v_theta.detach() - v_old).pow(2).mean())):
                out.logs[name].append(value.detach())
        if (mb_index + 1) % accum == 0:
            out.grad_norms.append(run.optimizer_step())
    return out


if __name__ == "__main__":
    main()
