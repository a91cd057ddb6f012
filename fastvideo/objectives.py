"""The three trainers' objectives as flags: each objective's options (``GRPOOptions``, ``DPOOptions``, ``NFTOptions``),
the option groups of its trainer, its parser, and its validation (the flags of every component it uses, then its own
and the batch arithmetic)."""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from fastvideo.advantages import AdvantageOptions, GroupOptions
from fastvideo.config import DPO_ONLINE_ONLY, build_parser, field_defaults, parse_with_config, validate_common
from fastvideo.evaluation import EvalOptions
from fastvideo.logging import LoggingOptions
from fastvideo.losses import (AWM_ADVANTAGE_WEIGHTS, AWM_OLD_KL, POLICY_LOSS_TABLE, POLICY_LOSSES,
                              policy_loss_sde_refusal)
from fastvideo.memory import PlanOptions
from fastvideo.models import ModelOptions
from fastvideo.options import need, note_default, opt
from fastvideo.parallel import ParallelOptions
from fastvideo.policy import LoRAOptions, OptimOptions, nft_uses_old_policy
from fastvideo.record import AlignmentOptions
from fastvideo.resume import CheckpointOptions
from fastvideo.rewards import RewardOptions
from fastvideo.rollout import (AWM_STRATA, AWM_TIME_TYPES, TIMESTEP_SELECTIONS, SamplingOptions, changed_flags,
                               validate_sampling)
from fastvideo.schedulers import KL_FORMS


@dataclass
class GRPOOptions:
    timestep_fraction: float | None = opt(
        None, "fraction of the S-1 non-final steps trained per sample (DanceGRPO; default 0.6); not with "
        "--sde_window_size, where the window's steps are trained")
    timestep_selection: str = opt(
        "random", "which steps are trained without an SDE window: random = the first K of a keyed per-sample "
        "permutation of steps 0..S-2, K = int((S-1) x --timestep_fraction) (DanceGRPO) | first = steps 0..K-1 in "
        "order for every sample, K = int(S x --timestep_fraction) (Flow-GRPO's train_sd3.py)",
        choices=TIMESTEP_SELECTIONS)
    policy_loss: str = opt(
        "clip", "the per-step policy loss: clip = PPO-clipped ratio (Flow-GRPO / DanceGRPO) | guard = GRPO-Guard "
        "(arXiv 2510.22319, verl-omni GRPOGuardLoss): the ratio exp((lp - lp_old + b) sqrt(-dt) s) with the mean "
        "bias b = mean((mu - mu_old)^2) / (2 std^2), clipped, the step's loss times 1/(-dt) (--clip_range unset: "
        "1e-4, verl-omni's and Flow-Factory's default; verl-omni's Qwen-Image OCR script sets 2e-6); flow_sde / "
        "dance_sde only | dppo = Flow-DPPO "
        "(arXiv 2606.11025, verl-omni FlowDPPOLoss): no clipping; a sample's -A ratio is masked when the step's "
        "Gaussian divergence D = mean((mu - mu_old)^2) / (2 std^2) >= --dppo_threshold and the ratio already moved "
        "in the advantage's direction. guard/dppo keep each stochastic step's rollout mean (B x S x L x C fp32)",
        choices=POLICY_LOSSES)
    dppo_threshold: float = opt(1e-5, "--policy_loss dppo: divergence threshold eps_D of the mask (verl-omni "
                                      "FlowDPPOLoss default and recipes: 1e-5)")
    clip_range: float | None = opt(None, "PPO clip range on the probability ratio (--policy_loss clip and guard); "
                                         "unset: the policy loss's reference default (clip: 1e-4, Flow-GRPO / "
                                         "DanceGRPO; guard: 1e-4, verl-omni / Flow-Factory), printed at start-up; "
                                         "dppo does not clip (it is only the first update's on-policy check)")
    kl_beta: float = opt(0.0, "weight of the KL to the reference policy, mean((mu - mu_ref)^2) / (2 s^2) per "
                              "trained step (0 = off; Flow-GRPO uses 0.04). s is set by --kl_form")
    kl_form: str = opt(
        "reference", "the KL's noise scale s: reference = the std the reference code divides by (Flow-GRPO, "
        "verl-omni): a sqrt(sigma / (1 - sigma)) for flow_sde, the step's std eta sqrt(sigma - sigma') for dance_sde "
        "and sigma' sin(a pi / 2) for cps, so a beta from their configs means the same here | per_unit_time = that "
        "std / sqrt(sigma - sigma') for every type (this project's form before; equal for flow_sde, and for dance_sde "
        "and cps the KL is (sigma - sigma') times smaller, ~S times on an S-step grid)", choices=KL_FORMS)
    drop_zero_advantage: bool = opt(
        False, "drop the samples whose advantage is exactly 0 before building micro-batches (Flow-GRPO's "
        "train_sd3.py), so the loss is the mean over the samples that carry a signal (default: they stay, as zeros "
        "that shrink the gradient by the step's share of them); each rank trains its own kept samples, ranks with "
        "fewer padded at weight 0")


@dataclass
class DPOOptions:
    beta_dpo: float = opt(2000.0, "DPO temperature beta (docs/algorithms.md §5): 5000 = Diffusion-DPO on SD1.5, 2000 = verl-omni's "
                                  "default, recommended for FLUX, 100 = SD3 / Qwen-Image")
    sampler: str = opt("ode", "online sampling: ode = deterministic Euler steps (verl-omni's default) | sde = the "
                              "stochastic sampler of --sde_type/--eta", choices=("ode", "sde"))
    timesteps_per_pair: int = opt(1, "(noise, sigma) draws per pair and step, each one forward/backward of the pair "
                                     "into the step's single optimizer step (verl-omni: 1; Flow-GRPO's DPO: 39)")
    min_reward_gap: float = opt(0.0, "online: skip (and count) a prompt's pair when best minus worst reward is below "
                                     "this, in reward units; a pair with equal rewards is always skipped")
    ref_update_interval: int = opt(0, "copy the policy into the reference every N training steps (0 = never: the "
                                      "reference stays the base model)")
    dpo_sigma_shift: float | None = opt(
        None, "the forward-process sigma of a pair: unset = the logit-normal sigma = sigmoid(u), u ~ N(0, 1) "
        "(docs/algorithms.md §5, verl-omni) | a shift S = Flow-GRPO's SD3 DPO (scripts/train_sd3_dpo.py): that u read through the training "
        "scheduler's 1000-entry sigma table shifted by S, sigma = shift_S(1 - floor(1000 sigmoid(u)) / 1000) (SD3.5: 3)")
    preference_file: str | None = opt(
        None, "offline DPO: JSON lines {\"prompt\", \"chosen\", \"rejected\"} with image paths relative to the file "
        "(no sampling, no reward; --prompts_per_step = pairs per step); prompts must be in --data_json_path")
    latent_cache_dir: str | None = opt(
        None, "offline: where the VAE latents of the pair images are cached (default OUTPUT_DIR/preference_latents; "
        "share one folder between runs on the same pairs, VAE and size)")


@dataclass
class NFTOptions:
    objective: str = opt("nft", "forward-process objective on the rollouts' clean latents: nft = DiffusionNFT "
                                "(docs/algorithms.md §6) | awm = Advantage Weighted Matching (Xue et al., arXiv:2509.25050): "
                                "the flow-matching loss ||v_theta(x_t, t) - (eps - x0)||^2 weighted by the group "
                                "advantages, PPO-clipped; the trained policy samples (--awm_off_policy: the old one)",
                         choices=("nft", "awm"))
    nft_beta: float = opt(1.0, "DiffusionNFT mixing coefficient beta of the implicit policies v+ = beta*v_theta + "
                               "(1-beta)*v_old and v- = (1+beta)*v_old - beta*v_theta (docs/algorithms.md §6): 1.0 default, 0.1 "
                               "for OCR / multi-reward; not the KL weight (--kl_beta)")
    kl_beta: float = opt(1e-4, "weight of mean((v_theta - v_ref)^2), the velocity distance to the reference "
                               "policy (base model: LoRA disabled / frozen copy), added to the loss (0 = off; "
                               "DiffusionNFT 1e-4)")
    adv_mode: str = opt("all", "advantages -> optimality r = clamp(A/adv_clip_max/2 + 1/2, 0, 1): all = as they "
                               "are | positive_only = A clamped to >= 0 | negative_only = A clamped to <= 0 | binary "
                               "= sign(A) (r in {0.4, 0.5, 0.6} with adv_clip_max 5, as DiffusionNFT's code)",
                        choices=("all", "positive_only", "negative_only", "binary"))
    timestep_fraction: float = opt(0.99, "fraction of the S sampling-grid sigmas trained per sample: the first "
                                         "int(S x fraction) of a per-sample random order, fresh noise at each "
                                         "(DiffusionNFT 0.99)")
    old_decay_schedule: str = opt(
        "linear", "old policy update old <- d*old + (1-d)*theta after training: copy = d 0 | linear = d min(0.001 n, "
        "0.5) | delayed = d 0 for n < 75, then min(0.0075 (n-75), 0.999) | awm = d min(0.001 n, 0.3); n = optimizer "
        "steps so far (DiffusionNFT decay_type 0/1/2, its default linear; awm = AWM's KL-anchor kl_ema_decay 0.3)",
        choices=("copy", "linear", "delayed", "awm"))
    old_update_interval: int = opt(1, "update the old policy every N training steps (1 = after every step)")
    solver: str = opt("euler", "deterministic sampler of the old-policy rollouts: euler (first order, as FluxPipeline) "
                               "| dpm2 (DPM-Solver++(2M): second order at no extra model call; DiffusionNFT's)",
                      choices=("euler", "dpm2"))
    # --objective awm only (Xue et al., arXiv:2509.25050; scxue/advantage_weighted_matching, X-GenGroup/Flow-Factory)
    awm_timesteps: int = opt(0, "AWM: sigmas trained per sample, one from each of K equal strata of the first int(S x "
                                "--timestep_fraction) sampling-grid sigmas, fresh noise at each (0 = all of them; AWM "
                                "train_timesteps 6 for SD3.5, Flow-Factory num_train_timesteps 4 for FLUX.1-dev)")
    awm_weighting: str = opt("ghuber", "AWM: weight w(l, t) of the per-sample flow-matching loss l whose negative is "
                                       "the log-likelihood proxy: uniform = l | t = t l | t2 = t^2 l | huber = t "
                                       "(sqrt(l + 1e-10) - 1e-5) | ghuber = t/p ((l + 1e-10)^p - 1e-10^p) with p "
                                       "--ghuber_power (every published AWM run: ghuber)",
                             choices=("uniform", "t", "t2", "huber", "ghuber"))
    ghuber_power: float = opt(0.25, "AWM: power p of --awm_weighting ghuber (published runs: 0.25)")
    awm_clip_range: float = opt(1.0, "AWM: PPO clip of the ratio exp(lp - lp_old) to [1 - c, 1 + c] (published runs: "
                                     "1; the ratio is exactly 1 for on-policy micro-batches before the rollout's first "
                                     "optimizer step)")
    awm_advantage_max: float = opt(1.0, "AWM: advantage weight a = clamp(A, +-adv_clip_max) / adv_clip_max x this "
                                        "(AWM config.train.advantage_max 1: a in [-1, 1])")
    awm_advantage_weight: str = opt(
        "official", "AWM: the advantage weight's form: official = clamp(A, +-adv_clip_max) / adv_clip_max x "
        "--awm_advantage_max (scxue/advantage_weighted_matching train_sd3_awm.py, adv_clip_max 5) | flow_factory = "
        "clamp(A, +-adv_clip_max), no division (Flow-Factory trainers/awm.py adv_clip_range; its examples: 1)",
        choices=AWM_ADVANTAGE_WEIGHTS)
    awm_time_type: str = opt(
        "discrete", "AWM: which grid indices the --awm_timesteps strata cover: discrete = from the first (sigma 1) | "
        "discrete_wo_init = from the second (the official GenEval/OCR configs' time_type)", choices=AWM_TIME_TYPES)
    awm_strata: str = opt(
        "official", "AWM: the index span the strata cut: official = [0 or 1, int(S x --timestep_fraction)] (the "
        "official code) | flow_factory = the grid indices whose timestep 1000 sigma >= 1000 (1 - "
        "--timestep_fraction), last one included (Flow-Factory TimeSampler.discrete)", choices=AWM_STRATA)
    awm_old_kl: str = opt(
        "official", "AWM: where the --old_kl_beta term applies: official = only with --kl_beta > 0 (train_sd3_awm.py "
        "adds ema_beta's term inside `if beta > 0`) | flow_factory = on its own (Flow-Factory's ema_kl_beta)",
        choices=AWM_OLD_KL)
    old_kl_beta: float = opt(0.0, "AWM: weight of mean((v_theta - v_old)^2), the velocity distance to the old policy "
                                  "(a slow EMA of theta, --old_decay_schedule; AWM's ema_beta 1 for SD3.5, "
                                  "Flow-Factory ema_kl_beta 0.1 for FLUX.1-dev; 0 = off)")
    awm_off_policy: bool = opt(False, "AWM: sample the rollouts with the old policy and clip the ratio against its "
                                      "log-likelihood proxy (AWM/Flow-Factory off_policy; default: the trained policy "
                                      "samples, as every published run)")


GRPO_GROUPS = (ModelOptions, SamplingOptions, GroupOptions, AdvantageOptions, GRPOOptions, OptimOptions, LoRAOptions,
               ParallelOptions, RewardOptions, EvalOptions, LoggingOptions, CheckpointOptions, AlignmentOptions,
               PlanOptions)


NFT_GROUPS = (ModelOptions, SamplingOptions, GroupOptions, AdvantageOptions, NFTOptions, OptimOptions, LoRAOptions,
              ParallelOptions, RewardOptions, EvalOptions, LoggingOptions, CheckpointOptions, AlignmentOptions,
              PlanOptions)


# NFT reads these shared flags in its own units / with DiffusionNFT's defaults
NFT_DEFAULTS = {"output_dir": "outputs/nft", "wandb_project": "flux-nft", "global_std": True,
                "group_std": "population"}


NFT_HELP = {
    "num_generations": "images sampled per prompt by the old policy (group size G of the advantages)",
    "train_batch_size": "samples per forward/backward micro-batch (per rank); each is trained at int(S x "
                        "--timestep_fraction) sigmas (--objective awm: --awm_timesteps of them)",
    "global_std": "normalise advantages by the whole batch's reward std (DiffusionNFT / Flow-GRPO; the NFT default) "
                  "instead of each group's (--no-global_std)",
    "rollout_batch_size": "samples per transformer call during the old-policy rollout (per rank)",
    "guidance_scale": "distilled guidance value fed to the model (unset: the family's pipeline default, FLUX.1-dev "
                      "3.5, FLUX.2-dev 4.0); ignored by models without a guidance embedding (true CFG is --cfg_scale: > 1 guides only the rollout's sampling, the NFT / AWM "
                      "losses stay on the conditional velocity; the published DiffusionNFT and AWM runs are "
                      "CFG-free, --cfg_scale 1)",
}


DPO_GROUPS = (ModelOptions, SamplingOptions, GroupOptions, DPOOptions, OptimOptions, LoRAOptions, ParallelOptions,
              RewardOptions, EvalOptions, LoggingOptions, CheckpointOptions, AlignmentOptions, PlanOptions)


# DPO reads these shared flags in its own units
DPO_DEFAULTS = {"output_dir": "outputs/dpo", "wandb_project": "flux-dpo"}


DPO_HELP = {
    "num_generations": "online: images sampled per prompt; its best and worst form the prompt's pair",
    "prompts_per_step": "prompts (online) or preference pairs (offline) per training step over all ranks; one "
                        "optimizer step per training step",
    "train_batch_size": "(pair, noise draw) items per forward/backward micro-batch (per rank; 2 images each)",
    "gradient_accumulation_steps": "not used by DPO (all of a step's pairs make one optimizer step); leave at 0",
    "rollout_batch_size": "online: samples per transformer call during sampling (per rank)",
    "output_dir": "run folder: config.json, metrics.jsonl, samples/, checkpoints/, final/, preference_latents/",
}


def resolve_clip_range(args: argparse.Namespace) -> None:
    """--clip_range unset -> the --policy_loss's reference default (``PolicyLoss.clip_range``), said at start-up with
    its source (``options.note_default``). Flow-DPPO never clips: there --clip_range is only the first update's on-policy check tolerance (1e-4)."""
    entry = POLICY_LOSS_TABLE[args.policy_loss]
    if entry.clip_range is None:
        args.clip_range = 1e-4 if args.clip_range is None else args.clip_range
    elif args.clip_range is None:
        args.clip_range = entry.clip_range
        note_default(f"--clip_range {entry.clip_range:g}: --policy_loss {args.policy_loss}'s reference default "
                     f"({entry.clip_source})")


def validate_grpo(args: argparse.Namespace, world_size: int) -> dict[str, int]:
    """GRPO flags and the batch arithmetic; returns the derived counts printed before step 1."""
    validate_common(args)
    validate_sampling(args)
    need(args.num_generations >= 2, f"--num_generations must be >= 2 (a group needs two samples to compare), "
                                     f"got {args.num_generations}")
    need(args.prompts_per_step >= 1, f"--prompts_per_step must be >= 1, got {args.prompts_per_step}")
    if args.sde_window_size:
        need(args.timestep_fraction is None,
             f"--timestep_fraction {args.timestep_fraction} does nothing with --sde_window_size "
             f"{args.sde_window_size} (the window's steps are the trained ones); drop one of them")
    elif args.timestep_fraction is None:
        args.timestep_fraction = 0.6
    need(args.timestep_fraction is None or 0.0 < args.timestep_fraction <= 1.0,
         f"--timestep_fraction must be in (0, 1], got {args.timestep_fraction}")
    resolve_clip_range(args)
    need(args.clip_range > 0, f"--clip_range must be > 0, got {args.clip_range}")
    need(args.adv_clip_max > 0, f"--adv_clip_max must be > 0, got {args.adv_clip_max}")
    need(args.adv_eps > 0, f"--adv_eps must be > 0, got {args.adv_eps}")
    need(args.kl_beta >= 0, f"--kl_beta must be >= 0, got {args.kl_beta}")
    need(args.eta > 0, f"--eta {args.eta}: GRPO needs stochastic steps (log-prob ratios); use --eta > 0")
    if args.sde_type == "cps" and args.kl_beta > 0 and args.sde_window_size:
        need(args.sde_window_range[1] < args.sampling_steps,
             "--sde_type cps with --kl_beta > 0: the last step has zero noise (sigma' = 0), where the KL is "
             f"undefined; keep the window before it (--sde_window_range ... {args.sampling_steps - 1})")
    _validate_policy_loss(args)
    S = args.sampling_steps
    if args.sde_window_size:
        trained = args.sde_window_size
    elif args.timestep_selection == "first":
        trained = int(S * args.timestep_fraction)
        need(trained >= 1, f"--timestep_fraction {args.timestep_fraction} x --sampling_steps {S} trains no "
                            "timestep (--timestep_selection first); raise one of them")
        if trained == S:  # the last step (sigma' = 0) is trained
            need(args.last_step == "sde", f"--timestep_selection first with --timestep_fraction "
                                           f"{args.timestep_fraction} trains the last step, which --last_step ode "
                                           "makes deterministic: use a fraction below 1 (Flow-GRPO's 0.99)")
            need(args.sde_type != "cps", "--timestep_selection first with --timestep_fraction "
                                          f"{args.timestep_fraction} trains the last step, where cps has no noise "
                                          "(sigma' = 0): use a fraction below 1 (Flow-GRPO's 0.99)")
    else:
        trained = int((S - 1) * args.timestep_fraction)
        need(trained >= 1, f"--timestep_fraction {args.timestep_fraction} x (--sampling_steps - 1 = "
                            f"{S - 1}) trains no timestep; raise one of them")
    return _group_arithmetic(args, world_size, trained)


def _validate_policy_loss(args: argparse.Namespace) -> None:
    """--policy_loss guard/dppo: the SDE types they are defined for, and their thresholds."""
    loss = args.policy_loss
    why = policy_loss_sde_refusal(loss, args.sde_type)
    need(why is None, f"{why}; use --sde_type flow_sde or --policy_loss clip")
    need(args.dppo_threshold > 0, f"--dppo_threshold must be > 0 (verl-omni: 1e-5), got "
                                                     f"{args.dppo_threshold}")
    if loss == "dppo" and args.sde_type == "cps" and args.sde_window_size:
        need(args.sde_window_range[1] < args.sampling_steps,
             "--policy_loss dppo with --sde_type cps: the last step has zero noise (sigma' = 0), where the "
             f"divergence is undefined; keep the window before it (--sde_window_range ... {args.sampling_steps - 1})")


def _divisors(n: int) -> str:
    """``n``'s divisors as "1, 2, 3 or 6" (the values a flag that must divide ``n`` may take)."""
    found = [str(d) for d in range(1, n + 1) if n % d == 0]
    return found[0] if len(found) == 1 else f"{', '.join(found[:-1])} or {found[-1]}"


def _ranks_fix(prompts_per_step: int, num_generations: int, world_size: int) -> str:
    """The nearest --prompts_per_step (keeping --num_generations) whose samples split evenly over the ranks."""
    step = world_size // math.gcd(num_generations, world_size)
    fit = -(-prompts_per_step // step) * step
    return f"e.g. --prompts_per_step {fit} (or a --num_generations that makes the product a multiple of {world_size})"


def _group_arithmetic(args: argparse.Namespace, world_size: int, trained: int) -> dict[str, int]:
    """Batch arithmetic of a trainer that samples P x G images per step and trains each at ``trained`` timesteps in
    micro-batches of --train_batch_size (GRPO, NFT); ValueError for layouts that do not divide."""
    total = args.prompts_per_step * args.num_generations
    need(total % world_size == 0,
         f"samples per step = --prompts_per_step ({args.prompts_per_step}) x --num_generations "
         f"({args.num_generations}) = {total} must be divisible by the number of ranks ({world_size}); "
         f"{_ranks_fix(args.prompts_per_step, args.num_generations, world_size)}")
    local = total // world_size
    need(local % args.train_batch_size == 0,
         f"samples per rank ({local}) must be divisible by --train_batch_size ({args.train_batch_size}); use "
         f"--train_batch_size {_divisors(local)}")
    micro_batches = local // args.train_batch_size
    accum = args.gradient_accumulation_steps or micro_batches
    need(micro_batches % accum == 0,
         f"micro-batches per rank ({micro_batches} = {local} samples / --train_batch_size "
         f"{args.train_batch_size}) must be divisible by --gradient_accumulation_steps ({accum}); use "
         f"--gradient_accumulation_steps {_divisors(micro_batches)} (0 = all)")
    return {"prompts_per_step": args.prompts_per_step, "samples_per_step": total, "samples_per_rank": local,
            "trained_timesteps": trained, "micro_batches_per_rank": micro_batches,
            "gradient_accumulation_steps": accum, "optimizer_steps_per_rollout": micro_batches // accum,
            "world_size": world_size}


def _trainer_parser(algorithm: str, groups: Sequence[type], description: str, **overrides: Any
                    ) -> argparse.ArgumentParser:
    """A trainer's parser over its option groups; ``algorithm`` is recorded in config.json and every checkpoint's
    meta.json."""
    parser = build_parser(groups, description, **overrides)
    parser.set_defaults(algorithm=algorithm)
    return parser


def grpo_parser() -> argparse.ArgumentParser:
    """The GRPO trainer's flags."""
    return _trainer_parser("grpo", GRPO_GROUPS, "GRPO post-training of a flow-matching transformer (torchrun + FSDP).")


def parse_grpo_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the GRPO trainer's flags (validation happens in ``validate_grpo``)."""
    return parse_with_config(grpo_parser(), argv)


def validate_dpo(args: argparse.Namespace, world_size: int) -> dict[str, int]:
    """DPO flags (online or offline) and the batch arithmetic; returns the derived counts printed before step 1."""
    validate_common(args)
    offline = args.preference_file is not None
    defaults = {**field_defaults(DPO_GROUPS), **DPO_DEFAULTS}
    need(args.beta_dpo > 0, f"--beta_dpo must be > 0 (2000 is the FLUX default), got {args.beta_dpo}")
    need(args.min_reward_gap >= 0, f"--min_reward_gap must be >= 0, got {args.min_reward_gap}")
    need(args.timesteps_per_pair >= 1, f"--timesteps_per_pair must be >= 1, got {args.timesteps_per_pair}")
    need(args.dpo_sigma_shift is None or args.dpo_sigma_shift > 0,
         f"--dpo_sigma_shift must be > 0 (Flow-GRPO's SD3 DPO: 3), got {args.dpo_sigma_shift}")
    need(args.ref_update_interval >= 0, f"--ref_update_interval must be >= 0 (0 = never), got "
                                         f"{args.ref_update_interval}")
    need(args.gradient_accumulation_steps == 0,
         f"--gradient_accumulation_steps {args.gradient_accumulation_steps}: DPO makes one optimizer step per "
         "training step from all of its pairs; set the pairs per step with --prompts_per_step and drop the flag")
    need(args.prompts_per_step >= 1, f"--prompts_per_step must be >= 1, got {args.prompts_per_step}")
    if offline:
        path = Path(args.preference_file)
        if not path.is_file():
            raise FileNotFoundError(f"--preference_file {path}: no such file; write JSON lines {{\"prompt\": ..., "
                                    "\"chosen\": IMAGE, \"rejected\": IMAGE}} (python -m fastvideo.preference makes "
                                    "one from sampled images)")
        online_only = tuple(k for k in DPO_ONLINE_ONLY if k != "replay_images")  # that one has its own message
        changed = changed_flags(args, online_only, defaults)
        need(not args.replay_images, "offline DPO (--preference_file) scores no images: --replay_images would do "
                                      "nothing; drop it (--replay_dir alone replays the recorded noise)")
        need(not changed, "offline DPO (--preference_file) samples nothing and scores nothing: "
                           f"{', '.join('--' + k for k in changed)} would do nothing; drop them")
        need(args.h > 0 and args.w > 0, f"--h/--w must be positive, got {args.h}x{args.w}")
        need(args.prompts_per_step % world_size == 0,
             f"--prompts_per_step {args.prompts_per_step} pairs per step must be divisible by the number of ranks "
             f"({world_size}); e.g. --prompts_per_step {-(-args.prompts_per_step // world_size) * world_size}")
        per_rank = args.prompts_per_step // world_size
        args.eta = 0.0  # sample grids of offline runs use the ODE sampler
        validate_sampling(args)
        return {"pairs_per_step": args.prompts_per_step, "pairs_per_rank": per_rank,
                "micro_batches_per_rank": -(-per_rank * args.timesteps_per_pair // args.train_batch_size),
                "world_size": world_size}
    if args.sampler == "ode":
        need(args.eta in (None, 0.0), f"--eta {args.eta} does nothing with --sampler ode; pass --sampler sde to "
                                       "sample with the SDE, or drop --eta")
        need(args.sde_window_size == 0, "--sde_window_size needs --sampler sde (ODE sampling has no noise window)")
        args.eta = 0.0
    validate_sampling(args)
    need(args.sampler == "ode" or args.eta > 0, "--sampler sde needs --eta > 0 (or use --sampler ode)")
    need(not (args.init_same_noise and args.sampler == "ode"),
         "--init_same_noise with --sampler ode samples the same image for every member of a prompt group (equal "
         "rewards: every pair would be skipped); drop --init_same_noise or pass --sampler sde")
    need(args.num_generations >= 2, f"--num_generations must be >= 2 (a pair is the best and the worst image of "
                                     f"a prompt), got {args.num_generations}")
    total = args.prompts_per_step * args.num_generations
    need(total % world_size == 0,
         f"samples per step = --prompts_per_step ({args.prompts_per_step}) x --num_generations "
         f"({args.num_generations}) = {total} must be divisible by the number of ranks ({world_size}); "
         f"{_ranks_fix(args.prompts_per_step, args.num_generations, world_size)}")
    max_per_rank = -(-args.prompts_per_step // world_size)
    return {"prompts_per_step": args.prompts_per_step, "samples_per_step": total, "samples_per_rank": total // world_size,
            "pairs_per_step": args.prompts_per_step, "pairs_per_rank": max_per_rank,
            "micro_batches_per_rank": -(-max_per_rank * args.timesteps_per_pair // args.train_batch_size),
            "world_size": world_size}


def dpo_parser() -> argparse.ArgumentParser:
    """The DPO trainer's flags."""
    return _trainer_parser("dpo", DPO_GROUPS, "Online or offline Diffusion-DPO of a flow-matching transformer "
                           "(torchrun + FSDP).", help_overrides=DPO_HELP, default_overrides=DPO_DEFAULTS)


def parse_dpo_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the DPO trainer's flags (validation happens in ``validate_dpo``)."""
    return parse_with_config(dpo_parser(), argv)


# sampling flags an ODE (old-policy) rollout has no use for
SDE_ONLY_FLAGS = ("eta", "sde_type", "sde_window_size", "sde_window_range", "sde_window_schedule",
                  "sde_window_shift_interval", "sde_window_stride", "last_step")


# flags of train_nft.py's --objective awm (NFTOptions)
AWM_FLAGS = ("awm_timesteps", "awm_weighting", "ghuber_power", "awm_clip_range", "awm_advantage_max", "old_kl_beta",
             "awm_off_policy", "awm_advantage_weight", "awm_time_type", "awm_strata", "awm_old_kl")


def _validate_objective(args: argparse.Namespace, defaults: dict[str, Any], grid: int) -> int:
    """--objective and its own flags (``grid`` = int(S x --timestep_fraction)); returns the sigmas trained per
    sample."""
    def drop(keys: Sequence[str], why: str) -> None:
        changed = changed_flags(args, keys, defaults)
        need(not changed, f"{', '.join('--' + k for k in changed)} {why}")

    if args.objective == "nft":
        drop(AWM_FLAGS, "only apply to --objective awm (Advantage Weighted Matching): add --objective awm or drop them")
        return grid
    drop(("nft_beta", "adv_mode"), "shape DiffusionNFT's implicit policies v+/v- and optimality r; --objective awm "
                                   "weights its matching loss by the clipped advantage itself (--awm_advantage_max): "
                                   "drop them or use --objective nft")
    if not nft_uses_old_policy(args):
        drop(("old_decay_schedule", "old_update_interval"),
             "move the old policy, which --objective awm keeps only as the --old_kl_beta anchor or the "
             "--awm_off_policy sampler: set --old_kl_beta > 0 (Flow-Factory's FLUX.1-dev value: 0.1) or drop them")
    if args.awm_weighting != "ghuber":
        drop(("ghuber_power",), f"only shapes --awm_weighting ghuber (not {args.awm_weighting}): drop it")
    need(args.ghuber_power > 0, f"--ghuber_power must be > 0 (published runs: 0.25), got {args.ghuber_power}")
    need(args.awm_clip_range > 0, f"--awm_clip_range must be > 0 (published runs: 1), got {args.awm_clip_range}")
    need(args.awm_advantage_max > 0, f"--awm_advantage_max must be > 0 (AWM: 1), got {args.awm_advantage_max}")
    if args.awm_advantage_weight == "flow_factory":
        drop(("awm_advantage_max",), "rescales the official weight only: --awm_advantage_weight flow_factory is "
                                     "clamp(A, +-adv_clip_max) itself; drop it")
    need(args.old_kl_beta >= 0, f"--old_kl_beta must be >= 0 (0 = no old-policy term), got {args.old_kl_beta}")
    need(not (args.old_kl_beta > 0 and args.kl_beta == 0 and args.awm_old_kl == "official"),
         f"--old_kl_beta {args.old_kl_beta} does nothing with --kl_beta 0 under --awm_old_kl official (the official "
         "code adds it only with a reference term): set --kl_beta > 0, or --awm_old_kl flow_factory (Flow-Factory's "
         "ema_kl_beta, on its own)")
    need(args.awm_timesteps >= 0, f"--awm_timesteps must be >= 0 (0 = all {grid}), got {args.awm_timesteps}")
    start = 1 if args.awm_time_type == "discrete_wo_init" else 0
    span = grid - start
    if args.awm_strata == "flow_factory":  # its span follows the sigma grid: checked against it at the first draw
        need(args.awm_timesteps > 0, "--awm_strata flow_factory needs --awm_timesteps K (Flow-Factory's "
                                     "num_train_timesteps; its FLUX.1 example: 4)")
        return args.awm_timesteps
    trained = args.awm_timesteps or span
    need(1 <= trained <= span,
         f"--awm_timesteps {trained} exceeds the {span} grid sigmas [{start}, int(--sampling_steps "
         f"{args.sampling_steps} x --timestep_fraction {args.timestep_fraction}) = {grid}) it draws one per stratum "
         f"from (--awm_time_type {args.awm_time_type}): use --awm_timesteps <= {span} or raise --timestep_fraction")
    return trained


def validate_nft(args: argparse.Namespace, world_size: int) -> dict[str, int]:
    """DiffusionNFT / AWM flags and the batch arithmetic; returns the derived counts printed before step 1."""
    validate_common(args)
    defaults = {**field_defaults(NFT_GROUPS), **NFT_DEFAULTS}
    changed = changed_flags(args, SDE_ONLY_FLAGS, defaults)
    need(not changed, "DiffusionNFT samples with a deterministic ODE solver (--solver euler|dpm2): "
                       f"{', '.join('--' + k for k in changed)} would do nothing; drop them")
    need(args.fsdp_version == 2,
         "train_nft.py needs --fsdp_version 2 (the default): under FSDP1 the old adapter's shards do not line up with "
         "the trained adapter's inside a flat parameter, so the old-policy update would need a gather of every unit "
         "each step")
    need(not args.init_same_noise, "--init_same_noise with a deterministic rollout samples the same image for every "
                                    "member of a prompt group (zero advantages: nothing to learn); drop it")
    args.eta = 0.0
    validate_sampling(args)
    need(args.num_generations >= 2, f"--num_generations must be >= 2 (a group needs two samples to compare), "
                                     f"got {args.num_generations}")
    need(args.prompts_per_step >= 1, f"--prompts_per_step must be >= 1, got {args.prompts_per_step}")
    need(args.nft_beta > 0, f"--nft_beta (the v+/v- mixing coefficient) must be > 0 (1.0 default, 0.1 for "
                             f"OCR / multi-reward), got {args.nft_beta}")
    need(args.kl_beta >= 0, f"--kl_beta must be >= 0 (0 = no reference term), got {args.kl_beta}")
    need(args.adv_clip_max > 0, f"--adv_clip_max must be > 0, got {args.adv_clip_max}")
    need(args.adv_eps > 0, f"--adv_eps must be > 0, got {args.adv_eps}")
    need(0.0 < args.timestep_fraction <= 1.0, f"--timestep_fraction must be in (0, 1], got {args.timestep_fraction}")
    need(args.old_update_interval >= 1, f"--old_update_interval must be >= 1, got {args.old_update_interval}")
    grid = int(args.sampling_steps * args.timestep_fraction)
    need(grid >= 1, f"--timestep_fraction {args.timestep_fraction} x --sampling_steps {args.sampling_steps} "
                     "trains no timestep; raise one of them")
    return _group_arithmetic(args, world_size, _validate_objective(args, defaults, grid))


def nft_parser() -> argparse.ArgumentParser:
    """The DiffusionNFT trainer's flags."""
    return _trainer_parser("nft", NFT_GROUPS, "DiffusionNFT (or --objective awm: Advantage Weighted Matching) "
                           "post-training of a flow-matching transformer (torchrun + FSDP).", help_overrides=NFT_HELP,
                           default_overrides=NFT_DEFAULTS)


def parse_nft_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the DiffusionNFT trainer's flags (validation happens in ``validate_nft``)."""
    return parse_with_config(nft_parser(), argv)
