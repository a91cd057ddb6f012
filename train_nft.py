"""DiffusionNFT (docs/algorithms.md §6) or, with --objective awm, Advantage Weighted Matching (AWM, arXiv:2509.25050)
post-training of a flow-matching transformer (any model family), torchrun + FSDP2.

One step: prompts -> batched deterministic rollout (--solver euler | dpm2; guided only with --cfg_scale > 1) with the
*old* policy (NFT; AWM with --awm_off_policy) or the trained one (AWM), keeping each sample's clean latent x0 -> decode
-> reward -> gather over ranks -> group advantages (NFT: -> optimality r, --adv_mode) -> for every micro-batch and
trained sigma t (NFT: int(S x --timestep_fraction) of the sampling grid in a per-sample random order; AWM:
--awm_timesteps, one per stratum of that range), fresh noise each: x_t = (1-t) x0 + t eps, v_old (old policy, when kept)
and v_ref (reference, with --kl_beta) without grad, v_theta with grad -> the objective's loss (NFT: in x0 space; AWM:
the advantage-weighted flow-matching loss ||v_theta - (eps - x0)||², PPO-clipped) -> backward -> optimizer step(s) ->
every --old_update_interval steps old <- d old + (1-d) theta (--old_decay_schedule).

AWM is a flag of this script, not a script of its own: it shares every phase with DiffusionNFT (rollout, reward,
group advantages, forward-process update over micro-batches x sigmas, the old policy as a slow EMA of theta, the
checkpoint of that old policy) and differs only in the loss, the timestep draw and which policy samples.

    torchrun --nproc_per_node 8 train_nft.py --pretrained_model_name_or_path FLUX.1-dev \
        --data_json_path data/embeddings/manifest.json --output_dir outputs/nft --lora_rank 32 ...
"""
from __future__ import annotations

import argparse
import contextlib
import time
from dataclasses import dataclass, field

import torch

from fastvideo import devices, errors, launch, models, training
from fastvideo.losses import (awm_log_prob, awm_loss, nft_advantages, nft_loss, nft_old_decay, nft_optimality,
                              velocity_deviation)
from fastvideo.memory import plan_nft
from fastvideo.objectives import parse_nft_args, validate_nft
from fastvideo.policy import nft_uses_old_policy
from fastvideo.rollout import (awm_timesteps, forward_noise, model_velocity, nft_timesteps, rollout,
                               rollout_sigmas)
from fastvideo.training import rank_mean


def main(argv: list[str] | None = None) -> None:
    launch.run_main(errors.parse_or_exit(parse_nft_args, argv), validate_nft, plan_nft, train)


def train(args: argparse.Namespace) -> None:
    # ---- setup: flags and inputs first, before anything expensive -------------------------------
    run = training.start_run(args, validate_nft, plan_nft)
    counts, device, noise, amp_dtype = run.counts, run.device, run.noise, run.amp_dtype
    geometry, dataset, sampler, rollout_cfg = run.prompt_groups()  # reward spec, embeddings checked

    # ---- reward, policy + old policy (+ reference), optimizer; resume -----------------------------
    run.load_models(reward=True, need_reference=args.kl_beta > 0, old_policy=nft_uses_old_policy(args),
                    optimizer_steps=args.max_train_steps * counts["optimizer_steps_per_rollout"])
    policy, old = run.policy, run.policy.old  # old: None for AWM without --old_kl_beta / --awm_off_policy
    samples_with_old = args.objective == "nft" or args.awm_off_policy
    start_step = run.resume(sampler=sampler)

    for step in range(start_step + 1, args.max_train_steps + 1):
        samples = sampler.next()
        batch = training.batch_to(dataset.get_batch(samples.prompt_ids), device)

        # ---- 1. rollout with the old policy (AWM on-policy: theta): deterministic, no grad; keep x0 ----------
        policy.model.eval()
        pending = run.pending_rewards(batch["prompts"], batch["prompt_ids"])  # --reward_overlap: scored as decoded
        with (old.active() if samples_with_old else contextlib.nullcontext(policy.model)) as sampling_model:
            traj = rollout(sampling_model, run.vae, batch, samples.sample_indices, step, rollout_cfg, noise, geometry,
                           device=device, autocast_dtype=amp_dtype, keep_latents=False, on_decoded=pending)
        policy.model.train()

        # ---- 2. reward (batched), gathered over ranks: name -> (P*G,) ---------------------------------
        all_rewards, reward_times = run.score_rollout(traj, batch["prompts"], pending)

        # ---- 3. group advantages on the global batch (NFT: -> optimality r in its loss) --------------------
        adv_all, adv_metrics, advantages = run.advantages(all_rewards["total"], samples, traj.prompt_ids)
        advantages = nft_advantages(advantages, args.adv_mode, args.adv_clip_max)  # (B,) this rank's; AWM: mode all
        keep = run.local(all_rewards["total"].isfinite())  # (B,) False: dropped for a non-finite reward

        # ---- 4. forward-process update: micro-batches x trained sigmas, the objective's loss --------------
        t0 = time.perf_counter()
        upd = update_policy(run, traj, batch, samples, advantages, keep, step, adv_all)

        # ---- 5. the old policy follows: old <- d*old + (1-d)*theta -----------------------------------
        optimizer_steps = step * counts["optimizer_steps_per_rollout"]
        old_decay = nft_old_decay(optimizer_steps, args.old_decay_schedule)
        if old is not None and step % args.old_update_interval == 0:
            old.update(old_decay)
        t_train = time.perf_counter() - t0

        # ---- 6. metrics, samples, checkpoint ------------------------------------------------------------
        t_rollout, t_decode = traj.timings["sample"], traj.timings["decode"]
        step_time = t_rollout + t_decode + reward_times["time_reward"] + t_train
        host = training.to_host(upd.logs)  # one device->host copy for the step's metrics
        rows = torch.tensor(upd.counts, dtype=torch.float32) if upd.counts else None  # padded micro-batches' weights
        metrics = {
            **adv_metrics,  # reward_mean, reward_std (population), zero_std_group_frac, adv_clip_frac, ...
            **training.reward_metrics(all_rewards),
            **{name: (training.weighted_rank_mean(values, rows) if rows is not None and name in PER_SAMPLE_LOGS
                      else rank_mean(values)) for name, values in host.items()},
            **optimality_metrics(args, adv_all),
            **({"old_decay": old_decay, "old_updates": old.num_updates} if old is not None else {}),
            "grad_norm": sum(upd.grad_norms) / len(upd.grad_norms), "trained_timesteps": upd.timesteps.shape[1],
            "time_rollout": t_rollout, "time_decode": t_decode, **reward_times, "time_train": t_train,
            "time_step": step_time, "samples_per_s": counts["samples_per_step"] / step_time,
        }
        trace = {"loss": host["loss"].view(-1, upd.timesteps.shape[1]), "timesteps": upd.timesteps}
        if run.end_step(step, metrics, traj.images, postfix={"reward_mean": "{:.5g}", "loss": "{:.4f}"}, trace=trace):
            break

    run.finish()


# the logs that average samples (weighted by trained rows when micro-batches are padded); the rest are loss terms
PER_SAMPLE_LOGS = frozenset({"L_pos", "L_neg", "old_deviation", "matching_loss", "weighted_matching", "ratio_mean",
                             "clipfrac", "approx_kl"})


def optimality_metrics(args: argparse.Namespace, adv_all: torch.Tensor) -> dict[str, torch.Tensor]:
    """DiffusionNFT's optimality r over the global batch (mean, population std); AWM has none."""
    if args.objective != "nft":
        return {}
    r_all = nft_optimality(nft_advantages(adv_all, args.adv_mode, args.adv_clip_max), args.adv_clip_max)
    return {"r_mean": r_all.mean(), "r_std": r_all.std(unbiased=False)}


@dataclass
class Update:
    """What one rollout's update produced: the trained timesteps (B, K), per (micro-batch, trained sigma) the detached
    loss terms (``logs``: NFT's loss, policy_loss, kl, L_pos, L_neg, old_deviation; AWM's loss, policy_loss, kl,
    old_kl, matching_loss, weighted_matching, ratio_mean, clipfrac, approx_kl), each optimizer step's gradient
    norm, and (--shuffle_micro_batches) each log entry's trained rows, which weight its per-sample metrics."""

    timesteps: torch.Tensor
    logs: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    grad_norms: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)  # weighted micro-batches: trained rows per entry of ``logs``


def trained_timesteps(run: training.Run, step: int, samples) -> torch.Tensor:
    """(B, K) CPU indices into the sampling grid: DiffusionNFT's per-sample random subset, or AWM's stratified draw
    (--awm_time_type, --awm_strata; flow_factory reads the grid's timesteps: the CPU grid, no device read)."""
    args = run.args
    keys = (run.noise, step, samples.prompt_ids, samples.sample_indices, args.sampling_steps, args.timestep_fraction)
    if args.objective != "awm":
        return nft_timesteps(*keys)
    sigmas = (rollout_sigmas(models.family_of(run.policy.model), run.rollout_cfg, run.geometry.seq_len)
              if args.awm_strata == "flow_factory" else None)
    return awm_timesteps(*keys, args.awm_timesteps, time_type=args.awm_time_type, strata=args.awm_strata,
                         sigmas=sigmas)


def micro_batch_inputs(run: training.Run, batch: dict, samples, idx_cpu: torch.Tensor) -> tuple[torch.Tensor, dict,
                                                                                                   dict]:
    """A micro-batch's positions on the device, its conditioning and its noise keys."""
    idx = devices.to_device(idx_cpu, run.device)
    cond = {k: batch[k][idx] for k in models.family_of(run.policy.model).embedding_keys}
    keys = dict(prompt_ids=[samples.prompt_ids[i] for i in idx_cpu.tolist()],
                sample_indices=[samples.sample_indices[i] for i in idx_cpu.tolist()])
    return idx, cond, keys


def forward_point(run: training.Run, traj, timesteps_dev: torch.Tensor, idx: torch.Tensor, k: int, keys: dict,
                  step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The micro-batch's k-th trained sigma t (b,), its fresh noise eps and x_t = (1-t) x0 + t eps (b, L, C)."""
    x0 = traj.clean_latents
    t = traj.sigmas[timesteps_dev[idx, k]]  # (b,) per-sample sigma
    eps = run.noise.batch_randn(tuple(x0.shape[1:]), step=step, purpose=f"{run.args.objective}_eps/{k}", **keys)
    eps = devices.to_device(eps, x0.device)  # drawn on the noise device (CPU): AWM's target eps - x0 needs it here
    return t, eps, forward_noise(x0[idx], eps, t)


def velocity_kwargs(run: training.Run) -> dict:
    return dict(geometry=run.geometry, guidance=run.args.guidance_scale, autocast_dtype=run.amp_dtype)


def awm_kwargs(args: argparse.Namespace, *, weighting_only: bool = False) -> dict:
    """``awm_loss``'s flags (``weighting_only``: ``awm_log_prob``'s)."""
    weighting = dict(weighting=args.awm_weighting, ghuber_power=args.ghuber_power)
    return weighting if weighting_only else dict(
        **weighting, clip_range=args.awm_clip_range, adv_clip_max=args.adv_clip_max,
        advantage_max=args.awm_advantage_max, kl_beta=args.kl_beta, old_kl_beta=args.old_kl_beta,
        advantage_weight=args.awm_advantage_weight, old_kl=args.awm_old_kl)


def rollout_log_probs(run: training.Run, traj, batch: dict, samples, timesteps_dev: torch.Tensor, step: int,
                      later: list[torch.Tensor]) -> torch.Tensor:
    """AWM on-policy with several optimizer steps per rollout: (B, K) log-likelihood proxies of theta as it sampled
    the rollout, for the micro-batches ``later`` (their sample positions: trained after an optimizer step moved theta;
    the first optimizer step's are their own, detached), precomputed as train_sd3_awm.py does; zeros elsewhere."""
    lp = torch.zeros(timesteps_dev.shape, dtype=torch.float32, device=run.device)
    with torch.no_grad():
        for idx_cpu in later:
            idx, cond, keys = micro_batch_inputs(run, batch, samples, idx_cpu)
            for k in range(timesteps_dev.shape[1]):
                t, eps, x_t = forward_point(run, traj, timesteps_dev, idx, k, keys, step)
                v = model_velocity(run.policy.model, x_t, t, cond, **velocity_kwargs(run))
                lp[idx, k] = awm_log_prob(v, traj.clean_latents[idx], eps, t,
                                          **awm_kwargs(run.args, weighting_only=True))
    return lp


def update_policy(run: training.Run, traj, batch: dict, samples, advantages: torch.Tensor, keep: torch.Tensor,
                  step: int, adv_all: torch.Tensor | None = None) -> Update:
    """For every optimizer step of ``training.training_order`` (default: --gradient_accumulation_steps micro-batches
    of --train_batch_size samples in group order; --shuffle_micro_batches: a keyed permutation of the step's samples,
    each rank's padded at weight 0), every micro-batch and every trained sigma: noise the rollout's clean latents
    (forward process), v_old (when an old policy is kept) and v_ref (--kl_beta > 0) without grad, v_theta,
    back-propagate the objective's loss (``nft_loss`` / ``awm_loss``) scaled by 1/(accumulated micro-batches x
    timesteps) (weighted micro-batches: the weighted sum over 1/timesteps); an optimizer step after each.
    ``advantages`` (B,) this rank's (NFT-mode) advantages, ``keep`` (B,) False for samples dropped for a non-finite
    reward, ``adv_all`` the gathered advantages (needed by --shuffle_micro_batches only: the order's length)."""
    args, policy, old = run.args, run.policy, run.policy.old
    awm = args.objective == "awm"
    velocity = velocity_kwargs(run)
    x0 = traj.clean_latents  # (B, L, C) float32
    keep_dev, keep_cpu = devices.to_device(keep, run.device), keep.cpu()
    timesteps = trained_timesteps(run, step, samples)  # (B, K) indices into the sampling grid
    num_trained = timesteps.shape[1]
    out = Update(timesteps=timesteps)
    optimizer_steps, _ = training.training_order(run, len(samples.prompt_ids), adv_all, step)
    timesteps_dev = devices.to_device(timesteps, run.device)  # once per step: the loop below never syncs
    # AWM's ratio denominators: the sampling policy's log-likelihood proxies (off-policy: the old one, below; on-policy:
    # theta's own, detached, until the first optimizer step, then theta's before it, precomputed)
    later = [idx for micro in optimizer_steps[1:] for idx, _ in micro]
    before = (rollout_log_probs(run, traj, batch, samples, timesteps_dev, step, later)
              if awm and not args.awm_off_policy and later else None)
    for opt_index, micro in enumerate(optimizer_steps):
        scale = 1.0 / ((len(micro) if micro[0][1] is None else 1) * num_trained)
        for mb_index, (idx_cpu, weights_cpu) in enumerate(micro):
            idx, cond, keys = micro_batch_inputs(run, batch, samples, idx_cpu)
            weights = None if weights_cpu is None else devices.to_device(weights_cpu, run.device)
            keep_mb = keep_dev[idx] if weights is None else keep_dev[idx] & (weights > 0)  # padding: 0, no metrics
            if weights_cpu is not None:  # the micro-batch's trained rows: its metrics' weight (CPU, no sync)
                out.counts += [int((keep_cpu[idx_cpu] & (weights_cpu > 0)).sum())] * num_trained
            for k in range(num_trained):
                t, eps, x_t = forward_point(run, traj, timesteps_dev, idx, k, keys, step)
                with torch.no_grad():
                    v_old = v_ref = None
                    if old is not None:
                        with old.active() as old_model:
                            v_old = model_velocity(old_model, x_t, t, cond, **velocity)
                    if args.kl_beta > 0:
                        with policy.reference() as ref_model:
                            v_ref = model_velocity(ref_model, x_t, t, cond, **velocity)
                v_theta = model_velocity(policy.model, x_t, t, cond, **velocity)
                if awm:
                    old_lp = (awm_log_prob(v_old, x0[idx], eps, t, **awm_kwargs(args, weighting_only=True))
                              if args.awm_off_policy else before[idx, k] if opt_index >= 1 else None)
                    loss, m = awm_loss(v_theta, x0[idx], eps, t, advantages[idx], old_log_prob=old_lp, v_ref=v_ref,
                                       v_old=v_old, keep=keep_mb, weights=weights, **awm_kwargs(args))
                    logs = {"loss": loss, "policy_loss": m["policy_loss"], "kl": m["kl_loss"],
                            "old_kl": m["old_kl_loss"], **{n: m[n] for n in ("matching_loss", "weighted_matching",
                                                                             "ratio_mean", "clipfrac", "approx_kl")}}
                else:
                    loss, m = nft_loss(v_theta, v_old, x_t, x0[idx], t, advantages[idx], beta=args.nft_beta,
                                       adv_clip_max=args.adv_clip_max, v_ref=v_ref, kl_beta=args.kl_beta,
                                       keep=keep_mb, weights=weights)
                    logs = {"loss": loss, "policy_loss": m["policy_loss"], "kl": m["kl_loss"],
                            "L_pos": m["positive_loss"], "L_neg": m["negative_loss"],
                            "old_deviation": velocity_deviation(v_theta, v_old,
                                                                keep_mb if weights is not None else None)}
                run.backward(loss * scale, last_backward=mb_index == len(micro) - 1 and k == num_trained - 1)
                for name, value in logs.items():
                    out.logs.setdefault(name, []).append(value.detach())
        out.grad_norms.append(run.optimizer_step())
    return out


if __name__ == "__main__":
    main()
