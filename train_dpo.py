"""Diffusion-DPO post-training of a flow-matching transformer of any model family (docs/algorithms.md §5), online or
offline, torchrun + FSDP.

Online step: prompts -> batched ODE (or SDE) rollout -> decode -> reward -> gather over ranks -> pair the best with
the worst image of each prompt group (gap >= --min_reward_gap) -> spread the pairs over ranks -> per micro-batch of
(pair, draw) items: one noise and sigma per item (--timesteps_per_pair per pair), flow-matching error of policy and
reference on winner and loser -> DPO loss -> backward -> one optimizer step -> every --ref_update_interval steps the
policy becomes the reference.
Offline step (--preference_file): the step's (chosen, rejected) pairs, VAE-encoded once into a cache -> same update.

    torchrun --nproc_per_node 8 train_dpo.py --pretrained_model_name_or_path FLUX.1-dev \
        --data_json_path data/embeddings/manifest.json --output_dir outputs/dpo ...
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fastvideo import devices, errors, flops, launch, models, training
from fastvideo import distributed as D
from fastvideo.advantages import best_worst_pairs, share_pairs
from fastvideo.data import EmbeddingDataset
from fastvideo.losses import dpo_loss, dpo_pair_metrics
from fastvideo.memory import plan_dpo
from fastvideo.objectives import parse_dpo_args, validate_dpo
from fastvideo.preference import LatentCache, read_preference_file
from fastvideo.prompt_groups import GroupSampler
from fastvideo.rollout import pair_errors, pair_noise, rollout
from fastvideo.schedulers import table_sigma


def main(argv: list[str] | None = None) -> None:
    launch.run_main(errors.parse_or_exit(parse_dpo_args, argv), validate_dpo, plan_dpo, train)


def train(args: argparse.Namespace) -> None:
    # ---- setup: flags and inputs first, before anything expensive -------------------------------
    run = training.start_run(args, validate_dpo, plan_dpo)
    dist, device, noise, amp_dtype = run.dist, run.device, run.noise, run.amp_dtype
    online = args.preference_file is None
    if online:
        geometry, dataset, sampler, rollout_cfg = run.prompt_groups()  # reward spec, embeddings checked
    else:  # every line checked (paths, prompts, image sizes) before any model is loaded
        geometry, dataset, rollout_cfg = run.sampling_inputs()
        pairs = read_preference_file(args.preference_file, dataset.prompts, args.h, args.w, dataset.source_paths)
        sampler = GroupSampler(len(pairs), args.prompts_per_step, 1, seed=args.seed, rank=dist.dp_rank,
                               world_size=dist.dp_size)

    # ---- reward, models (reference = adapters off / frozen copy / snapshot), optimizer; resume ---
    run.load_models(reward=online, need_reference=True, ref_snapshot=args.ref_update_interval > 0,
                    optimizer_steps=args.max_train_steps)
    policy = run.policy
    if not online:
        cache = encode_pairs(run, pairs, geometry)
    start_step = run.resume(sampler=sampler)

    for step in range(start_step + 1, args.max_train_steps + 1):
        samples = sampler.next()
        t_sample = t_decode = 0.0
        reward_times = {"time_reward": 0.0, "time_reward_busy": 0.0}  # offline: nothing is scored
        images, metrics = None, {}
        if online:
            # ---- 1. sample with the current policy (no grad), batched -------------------------------
            batch = training.batch_to(dataset.get_batch(samples.prompt_ids), device)
            policy.model.eval()
            pending = run.pending_rewards(batch["prompts"], batch["prompt_ids"])  # --reward_overlap: scored as decoded
            traj = rollout(policy.model, run.vae, batch, samples.sample_indices, step, rollout_cfg, noise, geometry,
                           device=device, autocast_dtype=amp_dtype, on_decoded=pending)
            policy.model.train()
            images, t_sample, t_decode = traj.images, traj.timings["sample"], traj.timings["decode"]

            # ---- 2. score, gathered over ranks (a prompt group may span ranks): name -> (P*G,) ------
            all_rewards, reward_times = run.score_rollout(traj, batch["prompts"], pending)
            all_latents = D.gather_samples(traj.clean_latents.cpu())  # (P*G, L, C)

            # ---- 3. pair: best vs worst of each group; this rank's share of the kept pairs ----------
            found = best_worst_pairs(all_rewards["total"], args.num_generations, args.min_reward_gap)
            kept = found.keep.nonzero().flatten()  # (n,) group indices
            positions, weights = share_pairs(len(kept), dist.dp_rank, dist.dp_size)
            mine = kept[positions] if len(kept) else kept
            x0_w, x0_l = all_latents[found.winner[mine]], all_latents[found.loser[mine]]  # (m, L, C) each
            pair_prompts = [samples.group_prompt_ids[g] for g in mine.tolist()]
            pair_keys = pair_prompts  # a prompt is in a step once: its id keys the pair's noise
            finite = all_rewards["total"][all_rewards["total"].isfinite()]  # without dropped samples
            metrics = {"reward_mean": finite.mean(), "reward_std": finite.std(unbiased=False),
                       **training.reward_metrics(all_rewards),
                       "reward_margin": found.gap[kept].mean() if len(kept) else 0.0,
                       "skipped_pairs": int((~found.keep).sum())}
        else:
            # ---- 1-3. the step's preference pairs, from the latent cache ------------------------------
            pair_ids = samples.prompt_ids  # indices into the pair file
            x0_w, x0_l = cache.load(pair_ids)
            pair_prompts = [pairs[i].prompt_id for i in pair_ids]
            pair_keys = pair_ids
            weights = torch.full((len(pair_ids),), 1.0 / len(pair_ids))  # FSDP averages the ranks' equal shares
            metrics = {"skipped_pairs": 0}

        # ---- 4. DPO update: winner and loser share noise and sigma; one optimizer step ----------------
        t0 = time.perf_counter()
        pair_batch = training.batch_to(dataset.get_batch(pair_prompts), device) if pair_keys else {}
        upd = update_policy(run, pair_batch, x0_w, x0_l, pair_keys, weights, step)
        if args.ref_update_interval and step % args.ref_update_interval == 0:
            policy.update_reference()
        t_train = time.perf_counter() - t0
        if not online and args.sample_every and (step % args.sample_every == 0 or step == 1):
            images = preview(run, dataset, pair_prompts, step, rollout_cfg, geometry)  # ODE samples of the policy

        # ---- 5. metrics over all pairs of the step, samples, checkpoint ------------------------------
        host = training.to_host({"items": torch.cat(upd.per_item), "loss": upd.losses} if upd.losses else {})
        local = host["items"] if upd.losses else torch.zeros(0, 4)  # (m*K, 4) err_w err_l ref_w,l: one copy
        table = D.gather_samples(torch.cat([local, upd.item_weights[:, None].cpu()], dim=1))
        table = table[table[:, 4] > 0]  # the real pairs' items (padding has weight 0)
        step_time = t_sample + t_decode + reward_times["time_reward"] + t_train
        metrics.update({
            **dpo_pair_metrics(*table[:, :4].unbind(dim=1), args.beta_dpo),  # NaN if every pair was skipped
            "trained_pairs": len(table) // args.timesteps_per_pair, "grad_norm": upd.grad_norm,
            "time_rollout": t_sample, "time_decode": t_decode, **reward_times, "time_train": t_train,
            "time_step": step_time,
            "samples_per_s": run.counts.get("samples_per_step", 2 * args.prompts_per_step) / step_time,
        })
        postfix = {"loss": "{:.4f}", **({"reward_mean": "{:.5g}"} if online else {})}
        trace = {"loss": host["loss"].view(-1, 1), "item_errors": local} if upd.losses else None
        if run.end_step(step, metrics, images, postfix=postfix, trace=trace):
            break

    run.finish()


@dataclass
class Update:
    """What one step's DPO update produced: per (pair, draw) item its weight (m*K,), per micro-batch the detached loss
    and the items' (err_w, err_l, ref_w, ref_l) (b, 4), and the optimizer step's gradient norm (0 when no pair)."""

    item_weights: torch.Tensor
    losses: list[torch.Tensor] = field(default_factory=list)
    per_item: list[torch.Tensor] = field(default_factory=list)
    grad_norm: float = 0.0


def update_policy(run: training.Run, pair_batch: dict, x0_w: torch.Tensor, x0_l: torch.Tensor, pair_keys: list[int],
                  weights: torch.Tensor, step: int) -> Update:
    """One optimizer step on this rank's m pairs (``pair_batch``: their prompts' embeddings on the device;
    winner/loser clean latents ``x0_w``/``x0_l`` (m, L, C) on the CPU; noise keys and loss weights (m,)):
    --timesteps_per_pair (eps, sigma) draws per pair, shared by winner and loser; flow-matching errors of the
    reference (no grad) and the policy; the weighted DPO loss, in micro-batches of --train_batch_size items."""
    args, policy, device = run.args, run.policy, run.device
    trained, draws = len(pair_keys), args.timesteps_per_pair
    rows = torch.arange(trained).repeat(draws)  # (m*K,) the pair of each (pair, draw) item
    out = Update(item_weights=weights[rows] / draws)
    if not trained:  # the same on every rank (0 only when no pair of the step was kept)
        return out
    # one (eps, sigma) per (pair, draw) item: (m*K, L, C), (m*K,)
    eps, sigma = pair_noise(run.noise, tuple(x0_w.shape[1:]), step, [pair_keys[i] for i in rows.tolist()],
                            draws=torch.arange(draws).repeat_interleave(trained).tolist())
    if args.dpo_sigma_shift is not None:  # Flow-GRPO's SD3 DPO: the same u through the shifted training sigma table
        sigma = table_sigma(sigma, shift=args.dpo_sigma_shift)
    velocity = dict(guidance=args.guidance_scale, autocast_dtype=run.amp_dtype)
    item_weights = devices.to_device(out.item_weights, device)  # once: the loop below never syncs
    micro_batches = torch.arange(len(rows)).split(args.train_batch_size)
    for k, items in enumerate(micro_batches):
        idx = rows[items]
        idx_dev = devices.to_device(idx, device)  # CPU draws and latents: pinned, non-blocking copies
        cond = {key: pair_batch[key][idx_dev] for key in models.family_of(policy.model).embedding_keys}
        inputs = (devices.to_device(x0_w[idx], device), devices.to_device(x0_l[idx], device), eps[items],
                  sigma[items], cond, run.geometry)
        with torch.no_grad(), policy.reference() as ref_model:
            ref_w, ref_l = pair_errors(ref_model, *inputs, **velocity)
        err_w, err_l = pair_errors(policy.model, *inputs, **velocity)
        items_dev = devices.to_device(items, device)
        loss, _ = dpo_loss(err_w, err_l, ref_w, ref_l, beta=args.beta_dpo, weights=item_weights[items_dev])
        run.backward(loss, last_backward=k == len(micro_batches) - 1)
        out.losses.append(loss.detach())
        out.per_item.append(torch.stack([err_w.detach(), err_l.detach(), ref_w, ref_l], dim=1))
    out.grad_norm = run.optimizer_step()
    return out


def encode_pairs(run: training.Run, pairs: list, geometry) -> LatentCache:
    """VAE latents of every pair image, encoded once in batches by an fp32 VAE (each rank its share of the chunks) and
    cached next to the run; a re-run or resume reuses what is there."""
    args = run.args
    family = models.family_for(args)
    cache = LatentCache(Path(args.latent_cache_dir or run.out / "preference_latents"), pairs,
                        vae_fingerprint=family.vae_fingerprint(args.pretrained_model_name_or_path), height=args.h,
                        width=args.w)
    if run.dist.is_main:
        cache.prepare()
    D.barrier()
    # the cache holds fp32 latents whatever the compute dtype (the run's VAE decodes in bf16 on accelerators)
    vae = run.vae if next(run.vae.parameters()).dtype == torch.float32 else family.load_vae(
        args.pretrained_model_name_or_path, device=run.device)
    cache.build(vae, geometry, device=run.device, rank=run.dist.rank, world_size=run.dist.world_size,
                batch_size=args.rollout_batch_size, family=family)
    del vae
    D.barrier()
    return cache


def preview(run: training.Run, dataset: EmbeddingDataset, prompt_ids: list[int], step: int, cfg, geometry
            ) -> torch.Tensor:
    """Offline runs sample nothing: an ODE sample of the policy for this rank's pair prompts, for the sample grid
    (every rank runs it: the sharded forward is a collective)."""
    batch = training.batch_to(dataset.get_batch(prompt_ids), run.device)
    run.policy.model.eval()
    with flops.phase(None):  # not part of the step's tflops / mfu
        traj = rollout(run.policy.model, run.vae, batch, [0] * len(prompt_ids), step, cfg, run.noise, geometry,
                       device=run.device, autocast_dtype=run.amp_dtype)
    run.policy.model.train()
    return traj.images


if __name__ == "__main__":
    main()
