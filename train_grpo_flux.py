"""GRPO post-training of a flow-matching transformer (any model family; DanceGRPO / Flow-GRPO style), torchrun + FSDP.

One step: sample prompts -> batched SDE rollout with log-probs -> decode -> reward -> gather and
group advantages -> for every micro-batch and trained timestep, replay the step with the current
policy and back-propagate the policy loss (PPO clip, GRPO-Guard or Flow-DPPO) -> clip grads -> optimizer step ->
log/checkpoint.

    torchrun --nproc_per_node 8 train_grpo_flux.py --pretrained_model_name_or_path FLUX.1-dev \
        --data_json_path data/embeddings/manifest.json --output_dir outputs/grpo ...
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import torch

from fastvideo import devices, errors, launch, training
from fastvideo import distributed as D
from fastvideo.losses import POLICY_LOSS_TABLE, StepTerms, first_update_check, kl_loss
from fastvideo.memory import plan_grpo
from fastvideo.objectives import parse_grpo_args, validate_grpo
from fastvideo.rollout import replay_log_prob, rollout, select_trained_timesteps, window_position
from fastvideo.training import rank_mean


def main(argv: list[str] | None = None) -> None:
    launch.run_main(errors.parse_or_exit(parse_grpo_args, argv), validate_grpo, plan_grpo, train)


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
    loss_entry = POLICY_LOSS_TABLE[args.policy_loss]  # --policy_loss: its rollout data and metrics

    for step in range(start_step + 1, args.max_train_steps + 1):
        samples = sampler.next()
        batch = training.batch_to(dataset.get_batch(samples.prompt_ids), device)

        # ---- 1. rollout with the current (= old) policy, no grad (--reward_overlap: scored as decoded) ----
        t0 = time.perf_counter()
        policy.model.eval()
        pending = run.pending_rewards(batch["prompts"], batch["prompt_ids"])
        traj = rollout(policy.model, vae, batch, samples.sample_indices, step, rollout_cfg, noise, geometry,
                       device=device, autocast_dtype=amp_dtype, keep_means=loss_entry.needs_means,
                       on_decoded=pending)
        policy.model.train()
        t_rollout = time.perf_counter() - t0

        # ---- 2. reward (batched), gathered over ranks: name -> (P*G,) -----------------------------
        all_rewards, reward_times = run.score_rollout(traj, batch["prompts"], pending)

        # ---- 3. group advantages on the global batch; keep this rank's slice ---------------------
        adv_all, adv_metrics, advantages = run.advantages(all_rewards["total"], samples, traj.prompt_ids)

        # ---- 4. policy update: micro-batches x trained timesteps, --policy_loss (+ KL) --------------
        t0 = time.perf_counter()
        upd = update_policy(run, traj, batch, samples, advantages, step, adv_all)
        t_train = time.perf_counter() - t0

        # ---- 5. metrics, samples, checkpoint ------------------------------------------------------
        host = training.to_host({"ratio": cat(upd.ratios), "diff": cat(upd.log_diffs), "loss": upd.losses,
                                 "kl": upd.kls, "clipfrac": upd.clipfracs, **upd.extra})  # one device->host copy
        real, first = (D.gather_samples(cat(m).to(torch.uint8)).bool() for m in (upd.real, upd.first))
        ratio_all, diff_all = (D.gather_samples(host.get(k, torch.ones(0)))[real] for k in ("ratio", "diff"))
        first_ratios = ratio_all[first[real]]
        if not len(first_ratios):  # no update this step (every sample dropped): NaN ratio metrics
            ratio_all = diff_all = first_ratios = torch.full((1,), float("nan"))
        first_metrics, ratio_warning = first_update_check(first_ratios, args.clip_range)  # on-policy check
        for name in ("loss", "clipfrac", *loss_entry.metrics):  # no update (all samples dropped): 0
            host.setdefault(name, torch.zeros(upd.timesteps.shape[1]))
        weights = torch.tensor(upd.counts or [1] * len(host["clipfrac"]), dtype=torch.float32)

        def sample_mean(values: torch.Tensor) -> torch.Tensor:  # weighted micro-batches: over their real samples
            weighted = args.drop_zero_advantage or args.shuffle_micro_batches
            return training.weighted_rank_mean(values, weights) if weighted else rank_mean(values)
        step_time = t_rollout + reward_times["time_reward"] + t_train
        metrics = {
            **adv_metrics,  # reward_mean, reward_std (population), zero_std_group_frac, adv_clip_frac, ...
            **training.reward_metrics(all_rewards),
            "adv_mean": adv_all.mean(), "adv_std": adv_all.std(unbiased=False), "adv_abs_max": adv_all.abs().max(),
            "loss": rank_mean(host["loss"]), "kl": rank_mean(host["kl"]) if upd.kls else 0.0,
            "clipfrac": sample_mean(host["clipfrac"]),
            "ratio_mean": ratio_all.mean(), "ratio_std": ratio_all.std(unbiased=False), "ratio_min": ratio_all.min(),
            "ratio_max": ratio_all.max(), **first_metrics,
            "approx_kl": 0.5 * (diff_all ** 2).mean(),
            **{k: sample_mean(host[k]) for k in loss_entry.metrics}, **({"kept_frac": upd.kept_frac}
                                                              if args.drop_zero_advantage else {}),
            "grad_norm": sum(upd.grad_norms) / max(len(upd.grad_norms), 1),
            "trained_timesteps": upd.timesteps.shape[1],
            **({"window_start": window_position(rollout_cfg, step)} if args.sde_window_schedule != "random" else {}),
            "time_rollout": traj.timings.get("sample", t_rollout), "time_decode": traj.timings.get("decode", 0.0),
            **reward_times, "time_train": t_train, "time_step": step_time,
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


def cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` that also takes an empty list (a step whose samples --drop_zero_advantage all dropped)."""
    return torch.cat(tensors) if tensors else torch.zeros(0)


@dataclass
class Update:
    """What one rollout's policy update produced, per (micro-batch, trained timestep) in order: the step's trained
    timesteps (B, K), detached ratios / log-ratio / loss / KL / clipfrac, which entries are real samples (False for a
    rank's padding at weight 0), whether each was before the first optimizer step (the on-policy check), the policy
    loss's own metrics (GRPO-Guard's bias, Flow-DPPO's divergence and mask), each optimizer step's gradient norm and
    the share of the step's samples trained (--drop_zero_advantage)."""

    timesteps: torch.Tensor
    ratios: list[torch.Tensor] = field(default_factory=list)
    log_diffs: list[torch.Tensor] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)
    kls: list[torch.Tensor] = field(default_factory=list)
    clipfracs: list[torch.Tensor] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)  # real samples of each (micro-batch, timestep) entry
    real: list[torch.Tensor] = field(default_factory=list)
    first: list[torch.Tensor] = field(default_factory=list)
    extra: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    grad_norms: list[float] = field(default_factory=list)
    kept_frac: float = 1.0


def policy_loss(args: argparse.Namespace, traj, idx: torch.Tensor, j: torch.Tensor, log_prob: torch.Tensor,
                mean: torch.Tensor, std: torch.Tensor, adv: torch.Tensor, valid: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, dict]:
    """--policy_loss of one replayed step (``losses.POLICY_LOSS_TABLE``): the rollout's log-probabilities, and its
    step means and sqrt(-dt) for a loss that compares them; ``valid``: the real rows of a padded micro-batch."""
    entry = POLICY_LOSS_TABLE[args.policy_loss]
    terms = StepTerms(log_prob, traj.log_probs[idx, j], adv, mean, traj.means[idx, j] if entry.needs_means else None,
                      std, traj.sqrt_neg_dt(j) if entry.needs_step_size else None, valid)
    return entry.compute(terms, args)


def update_policy(run: training.Run, traj, batch: dict, samples, advantages: torch.Tensor, step: int,
                  adv_all: torch.Tensor | None = None) -> Update:
    """For every optimizer step of ``training.training_order``, every micro-batch and every trained timestep: replay the step
    with the current policy and back-propagate the policy loss (--policy_loss) + kl_beta x KL to the reference,
    scaled by 1/(accumulated micro-batches x timesteps) (weighted micro-batches: the weighted sum over 1/timesteps);
    an optimizer step after each. ``adv_all``: the gathered advantages (P*G,), needed by the two switches."""
    args, policy, amp_dtype = run.args, run.policy, run.amp_dtype
    geometry, rollout_cfg = run.geometry, run.rollout_cfg
    timesteps = select_trained_timesteps(traj, samples.prompt_ids, samples.sample_indices, step, run.noise,
                                         timestep_fraction=args.timestep_fraction,
                                         selection=args.timestep_selection)  # (B, K)
    num_trained = timesteps.shape[1]
    optimizer_steps, kept_frac = training.training_order(run, len(samples.prompt_ids), adv_all, step)
    out = Update(timesteps=timesteps, kept_frac=kept_frac)
    run.optimizer.zero_grad(set_to_none=True)
    timesteps_dev = devices.to_device(timesteps, run.device)  # once per step: the loop below never syncs
    for opt_index, micro_batches in enumerate(optimizer_steps):
        if not micro_batches:
            continue  # --drop_zero_advantage left this optimizer step no sample (on every rank): no update
        scale = 1.0 / ((len(micro_batches) if micro_batches[0][1] is None else 1) * num_trained)
        for mb_index, (idx_cpu, weights_cpu) in enumerate(micro_batches):
            idx = devices.to_device(idx_cpu, run.device)
            adv_mb = advantages[idx]
            weights = None if weights_cpu is None else devices.to_device(weights_cpu, run.device)
            if weights is not None:  # the losses are linear in A >= 0 scalings: mean(w b A ...) = sum(w A ...)
                adv_mb = adv_mb * weights * len(idx_cpu)
            real = torch.ones(len(idx_cpu), dtype=torch.bool) if weights_cpu is None else weights_cpu > 0
            valid = None if weights is None else weights > 0  # a padded micro-batch: its metrics count real rows
            for k in range(num_trained):
                j = timesteps_dev[idx, k]
                log_prob, mean, std = replay_log_prob(policy.model, traj, idx, j, batch, rollout_cfg, geometry,
                                                      autocast_dtype=amp_dtype)
                loss, m = policy_loss(args, traj, idx, j, log_prob, mean, std, adv_mb, valid)
                if args.kl_beta > 0:
                    with torch.no_grad(), policy.reference() as ref_model:
                        _, ref_mean, _ = replay_log_prob(ref_model, traj, idx, j, batch, rollout_cfg, geometry,
                                                         autocast_dtype=amp_dtype)
                    kl, _ = kl_loss(mean, ref_mean, traj.noise_scale(j, args.kl_form), weights=weights)
                    loss = loss + args.kl_beta * kl
                    out.kls.append(kl.detach())
                last = mb_index == len(micro_batches) - 1 and k == num_trained - 1
                run.backward(loss * scale, last_backward=last)
                log_diff = log_prob.detach() - traj.log_probs[idx, j]
                out.ratios.append(torch.exp(log_diff))
                out.log_diffs.append(log_diff)
                out.losses.append(loss.detach())
                out.clipfracs.append(m["clipfrac"])
                out.real.append(real)
                out.counts.append(int(real.sum()))
                out.first.append(torch.full((len(idx_cpu),), opt_index == 0))  # before the first optimizer step
                for name in POLICY_LOSS_TABLE[args.policy_loss].metrics:
                    out.extra.setdefault(name, []).append(m[name])
        out.grad_norms.append(run.optimizer_step())
    return out


if __name__ == "__main__":
    main()
