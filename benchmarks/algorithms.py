"""Every objective of the trainers on the toy world: held-out prompt following vs samples, seconds and model FLOPs.

    python benchmarks/algorithms.py --out outputs/algorithms               # tune, then 7 objectives x 2 x 3 seeds
    python benchmarks/algorithms.py --out outputs/algorithms --plot_only   # redraw tables and plot from the runs
    python benchmarks/algorithms.py --out outputs/algorithms-smoke --smoke # every objective, 2 steps: does it run?

Objectives (``OBJECTIVES``): each is a launcher plus flags. ``grpo`` (the clipped PPO loss), ``grpo_guard``
(``--policy_loss guard``), ``grpo_dppo`` (``--policy_loss dppo``), ``mixgrpo`` (MixGRPO's sliding SDE window), ``dpo``
(online Diffusion-DPO), ``nft`` (DiffusionNFT) and ``awm`` (``train_nft.py --objective awm``). Every run starts from
the same pretrained toy FLUX and goes through the demo launchers (``scripts/finetune_flux_{grpo,dpo,nft}.sh``,
toy-world default) with flags added, so it trains exactly what a user runs (with one reward for all: ``--reward
toyworld:1.0``, the mean of the four checks, ``TRAIN_REWARD``, where the GRPO and NFT demos train on the strict check);
every run is a full fine-tune (the toy model's layers are 64 wide: a rank-32/64 LoRA of the papers would not be
low-rank). Each objective has two settings:

- ``published``: its paper's / reference code's defaults (the repository's recipe for it, scripts/recipes/), scaled
  only where the toy world forces it: 8 sampling steps at shift 1 and 64 px (the toy model's), 48 samples per step
  on one CPU process (the paper's group size, fewer prompts), and what follows from those (MixGRPO's window);
- ``tuned``: the best of ``len(LEARNING_RATES)`` candidates, the same number for every objective so the tuning budget
  is equal: the toy-world demo's settings plus the objective's defining flags (``OBJECTIVES[...].base``; NFT's and
  AWM's ``NFT_SIGMAS`` and DPO's ``DPO_DEMO_THEN`` pin the demos' values the study was measured with) at each
  learning rate, each run once for ``--tune_budget_s`` on a tuning seed and judged by the final mean score on the first
  ``--eval_prompts`` *training* prompts (EVAL_JSON = the train manifest; the held-out prompts are only for the tables).

Each final run trains for ``--budget_s`` seconds (``--max_train_seconds``; evaluation excluded) and is evaluated on
``--eval_prompts`` held-out prompts every ``--eval_every`` steps (Euler ODE, fixed noise), scoring the training reward
(``eval/reward_toyworld``, its ``_strict`` all-checks-right accuracy) and ``--eval_reward toyworld_clean:1.0`` (image
cleanliness, which the training reward does not see). Axes: samples generated (steps x samples per step), training
seconds (``time_elapsed``) and model TFLOPs (the trainers' FlopMeter: the sum over steps of ``tflops_rollout x
time_rollout + tflops_train x time_train``, times the ranks; every trainer logs these four). Runs that finished are
reused (each run folder has a ``run.json`` of what made it; a finished folder made otherwise stops the script), so it
can be re-run after an interruption. ``--parallel N`` runs N processes at once, each with OMP_NUM_THREADS threads
(default 1): absolute seconds are those of one such process on this machine, so compare runs made alike.

Writes to ``--out``: ``results.json`` (every run's curve, per-setting means and 95% t-intervals over seeds, the
efficiency summary), ``table.md`` (the per-setting table, then for held-out strict accuracy and score: what each
objective needs to reach a target gain and its gain per 1k samples / 100 s / TFLOP, each relative to ``grpo`` of the
same setting, beside the papers' claims) and ``algorithms.png`` (strict accuracy and score vs samples, seconds and
TFLOPs; seed mean, min-max band; one colour per objective, dashed = published).

Default budget: ``--budget_s 90 --tune_budget_s 30 --seeds 0 1 2 --parallel 2`` (1 thread per process). Measured on
this 2-core machine with 1 thread per run while other work kept both cores busy (an idle machine, one core per
process, should need 1/2 to 2/3 of these; not measured idle): per run ~12 s of start-up (flag check, torchrun, model
load) and export, ~3 s per evaluation of 128 prompts; seconds per step at the published settings (48 samples) grpo /
grpo_guard / grpo_dppo 4.8, mixgrpo 2.8, dpo 1.6, nft 6.3, awm 2.6; the demo-based candidates (64 samples) e.g. grpo
4.2. Idle machine: tuning 7 objectives x 2 candidates x (30 + 12 + 2 evaluations x 2) s = ~650 process-seconds; final
runs 7 x 2 settings x 3 seeds = 42 x (90 + 12 + ~12 evaluations x 2) s = ~5300 process-seconds; (650 + 5300) / 2
processes = ~50 minutes, plus ~30 s to build the toy data on first use; about 1.5x that on a machine shared as ours
was. Measured with nothing else running (the default budget, current split): 49 minutes.
``--budget_s``, ``--seeds`` and ``--objectives`` scale the final runs linearly, ``--tune_budget_s`` the tuning.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # fastvideo (the statistics), without an install
LAUNCHERS = {"grpo": "scripts/finetune_flux_grpo.sh", "dpo": "scripts/finetune_flux_dpo.sh",
             "nft": "scripts/finetune_flux_nft.sh"}
METRICS = {"strict": "eval/reward_toyworld_strict", "score": "eval/reward_toyworld", "clean": "eval/toyworld_clean"}
METRIC, SCORE = METRICS["strict"], METRICS["score"]  # the old module's names
EVAL_REWARD = "toyworld_clean:1.0"
# every objective trains on the mean of the four checks, the reward the study was measured with: one reward for all
# (the GRPO and NFT demos' own is the strict check alone; DPO's best-vs-worst pairs did not gain from it on 3 seeds)
TRAIN_REWARD = {"--reward": "toyworld:1.0"}
# the tuned NFT and AWM runs (and benchmarks/objectives.py's AWM) train 7 of the 8 sigmas per sample (train_nft.py's
# default, DiffusionNFT's 0.99), as the NFT demo did when they were measured; the demo now trains 2
# (scripts/demos/nft_toyworld.yaml)
NFT_SIGMAS = {"--timestep_fraction": "0.99"}
# the tuned DPO runs sample and pair as the DPO demo did when they were measured: 8 prompts x 8 samples, noise on every
# step at eta 0.7, independent initial noise, one (noise, sigma) draw per pair, rollouts of 64; the demo now pairs
# 32 x 4 samples differing in the noise of steps 0-1, 4 draws each (scripts/demos/dpo_toyworld.yaml). The published
# run's --sampler ode sets these aside by itself (its flags yield the demo's SDE ones)
DPO_DEMO_THEN = {"--eta": "0.7", "--num_generations": "8", "--prompts_per_step": "8", "--timesteps_per_pair": "1",
                 "--sde_window_size": "0", "--no-init_same_noise": "", "--rollout_batch_size": "64"}
SETTINGS = ("published", "tuned")
REFERENCE = "grpo"  # the efficiency summary's baseline
LEARNING_RATES = ("1e-4", "3e-4")  # the tuning candidates: every objective's base flags at each learning rate
TUNE_SEED = 100
_PRINT = threading.Lock()


@dataclass(frozen=True)
class Objective:
    """One objective: which launcher, its published flags (over the toy-world demo's), the flags its tuning
    candidates share (over the same demo), and the paper's efficiency claim."""
    trainer: str
    label: str
    published: dict[str, str]
    base: dict[str, str] = field(default_factory=dict)
    claim: str = ""


# Flow-GRPO's FLUX run (scripts/recipes/flow_grpo.yaml: yifan123/flow_grpo config/grpo.py:pickscore_flux_8gpu and
# config/base.py); the base of grpo_guard and grpo_dppo too, whose papers (verl-omni's GRPOGuardLoss / FlowDPPOLoss)
# change only the policy loss of this Flow-GRPO objective.
_FLOW_GRPO = {
    "--sde_type": "flow_sde",  # sde_step_with_logprob (Flow-GRPO's SDE)
    "--eta": "0.9",  # config.sample.noise_level = 0.9 (pickscore_flux)
    "--last_step": "sde",  # every step, the last included, is an SDE step there
    "--no-init_same_noise": "",  # config.sample.same_latent = False (the demo shares it: off here)
    "--num_generations": "24",  # config.sample.num_image_per_prompt = 24
    "--prompts_per_step": "2",  # 48 prompts per epoch there; 2 here: 48 samples per step (forced: one CPU)
    "--rollout_batch_size": "48",  # ours: samples per rollout forward (speed only)
    "--train_batch_size": "12",  # ours: 4 micro-batches of the step's 48 samples (speed only)
    "--gradient_accumulation_steps": "2",  # 2 optimizer steps per epoch (train.gradient_accumulation_steps = half)
    "--timestep_fraction": "1.0",  # train.timestep_fraction 0.99 of all S steps = all S-1 non-final ones (recipe)
    "--global_std": "",  # config.sample.global_std = True
    "--adv_eps": "1e-4",  # flow_grpo/stat_tracking.py: std + 1e-4
    "--adv_clip_max": "5",  # config.train.adv_clip_max = 5
    "--clip_range": "1e-4",  # config.train.clip_range = 1e-4
    "--kl_beta": "0",  # config.train.beta = 0 (pickscore_flux)
    "--learning_rate": "3e-4",  # config.train.learning_rate = 3e-4 (theirs on a LoRA 64; here full fine-tune)
    "--lr_scheduler": "constant",  # scripts/train_flux.py builds no LR scheduler
    "--weight_decay": "1e-4",  # config.train.adam_weight_decay = 1e-4
    "--max_grad_norm": "1.0",  # config.train.max_grad_norm = 1.0
}  # not here: its EMA (decay 0.9 every 8 steps) acts on the exported weights only; LoRA 64 (see the docstring)
# the defining flags of the loss variants and MixGRPO's window on the demo (their tuning candidates' base); the
# variants take two optimizer steps per rollout: with one, every replay is on-policy and GRPO-Guard's bias and
# Flow-DPPO's divergence are 0 (docs/algorithms.md)
_GUARD = {"--policy_loss": "guard"}
_DPPO = {"--policy_loss": "dppo", "--dppo_threshold": "1e-5"}
_WINDOW = {"--sde_window_size": "2", "--sde_window_range": "0 6", "--sde_window_schedule": "sliding",
           "--sde_window_shift_interval": "20", "--sde_window_stride": "1"}

OBJECTIVES: dict[str, Objective] = {
    "grpo": Objective("grpo", "GRPO (clip)", _FLOW_GRPO, {}),
    "grpo_guard": Objective("grpo", "GRPO-Guard", {
        **_FLOW_GRPO, **_GUARD,
        "--clip_range": "2e-6",  # verl-omni's Qwen-Image OCR example script (clip_ratio=2e-6; its default is 1e-4)
        # its log-ratio is the plain one times the step's std: the demo's clip 1e-3 x the median flow_sde std of the
        # trained steps (0.46 at eta 1, shift 1, 8 steps) for the candidates
    }, {**_GUARD, "--clip_range": "5e-4", "--gradient_accumulation_steps": "2"}),
    "grpo_dppo": Objective("grpo", "Flow-DPPO", {
        **_FLOW_GRPO, **_DPPO,  # --dppo_threshold 1e-5: verl-omni FlowDPPOLoss default and recipes (UniRL's too)
    }, {**_DPPO, "--gradient_accumulation_steps": "2"}),
    # MixGRPO's FLUX script (scripts/recipes/mixgrpo.yaml: Tencent-Hunyuan/MixGRPO
    # scripts/finetune/finetune_flux_grpo_MixGRPO.sh, fastvideo/utils/grpo_states.py), DanceGRPO-based
    "mixgrpo": Objective("grpo", "MixGRPO", {
        "--sde_type": "flow_sde",  # --flow_grpo_sampling (Flow-GRPO's SDE inside the window)
        "--eta": "0.7",  # eta=0.7 (noise_level None)
        "--init_same_noise": "",  # --init_same_noise
        "--sde_window_size": "2",  # window 4 of 25 steps there; 4 x 8 / 25 = 1.3 -> 2 of our 8 (forced)
        "--sde_window_range": "0 6",  # GRPOTrainingStates(max_timesteps = sampling_steps - 2): [0, S - 2)
        "--sde_window_schedule": "sliding",  # --sample_strategy progressive with --roll_back
        # --iters_per_group 25: in its 300 steps the window moves 12 of its 19 possible shifts (~60% of the range);
        # ours has 4 possible shifts ([0, 6), window 2, stride 1) and a default-budget run takes ~40-50 steps, so a
        # shift every 20 steps covers about half the range too (forced: 25 would barely move it)
        "--sde_window_shift_interval": "20",
        "--sde_window_stride": "1",  # --prog_overlap --prog_overlap_step 1
        "--num_generations": "12",  # --num_generations 12
        "--prompts_per_step": "4",  # 32 prompts per step there; 4 here: 48 samples (forced)
        "--rollout_batch_size": "48",  # ours (speed only)
        "--train_batch_size": "12",  # 12 samples per optimizer step (3 per micro-batch there)
        "--gradient_accumulation_steps": "1",  # -> 4 optimizer steps per rollout, as theirs
        "--no-global_std": "",  # --use_group: (r - group mean) / group std
        "--adv_eps": "1e-8",  # group_rewards.std() + 1e-8
        "--adv_clip_max": "5",  # --adv_clip_max 5.0
        "--clip_range": "1e-4",  # --clip_range 1e-4
        "--kl_beta": "0",  # kl_coeff=0.0
        "--learning_rate": "1e-5",  # --learning_rate 1e-5 (full fine-tune there too)
        "--lr_scheduler": "constant_with_warmup",  # trainer default, --lr_warmup_steps 0
        "--lr_warmup_steps": "0",
        "--weight_decay": "1e-4",  # --weight_decay 0.0001
        "--max_grad_norm": "1.0",  # --max_grad_norm 1.0
    }, _WINDOW, claim="MixGRPO: nearly 50% lower training time than DanceGRPO (arXiv 2507.21802; the reference "
                       "here is Flow-GRPO-style: compare s/step and seconds)"),
    # online Diffusion-DPO (scripts/recipes/dpo.yaml: verl-omni's online DPO recipe run_qwen_image_online_dpo_lora_v1.sh
    # and its trainer defaults; the loss is SalesforceAIResearch/DiffusionDPO's)
    "dpo": Objective("dpo", "Diffusion-DPO (online)", {
        "--sampler": "ode",  # ours/recipe: deterministic Euler samples (verl-omni's rollout)
        "--num_generations": "16",  # actor_rollout_ref.rollout.n=16 candidates, best vs worst
        "--prompts_per_step": "3",  # 32 prompts (pairs) per step there; 3 here: 48 samples (forced)
        "--rollout_batch_size": "48",  # ours (speed only)
        "--train_batch_size": "3",  # ppo_micro_batch_size_per_gpu=8 images = 4 pairs; all 3 pairs here
        "--timesteps_per_pair": "1",  # one (noise, sigma) draw per pair and step
        "--min_reward_gap": "0",  # verl-omni keeps every top-vs-bottom pair (ours skips only equal rewards)
        "--ref_update_interval": "0",  # the reference is the frozen base model
        "--beta_dpo": "2000",  # DiffusionLossConfig dpo_beta: 2000.0
        "--learning_rate": "3e-4",  # actor.optim.lr=3e-4 (theirs on a LoRA 64; here full fine-tune)
        "--lr_scheduler": "constant",  # lr_scheduler_type: constant
        "--weight_decay": "1e-4",  # actor.optim.weight_decay=0.0001
        "--max_grad_norm": "1.0",  # optim clip_grad: 1.0
    }, DPO_DEMO_THEN),
    # DiffusionNFT (scripts/recipes/nft.yaml: NVlabs/DiffusionNFT config/nft.py sd3_hpsv2, config/base.py,
    # scripts/train_nft_sd3.py)
    "nft": Objective("nft", "DiffusionNFT", {
        "--solver": "dpm2",  # config.sample.solver = "dpm2", deterministic
        "--num_generations": "24",  # config.sample.num_image_per_prompt = 24
        "--prompts_per_step": "2",  # 48 groups per epoch there; 2 here: 48 samples (forced)
        "--rollout_batch_size": "48",  # ours (speed only)
        "--train_batch_size": "16",  # 9 per micro-batch there; one optimizer step per epoch either way (speed only)
        "--gradient_accumulation_steps": "0",  # gradient_step_per_epoch=1
        "--nft_beta": "1.0",  # config.beta = 1.0
        "--kl_beta": "1e-4",  # config.train.beta = 0.0001
        "--adv_mode": "all",  # config.train.adv_mode = "all"
        "--adv_clip_max": "5",  # config.train.adv_clip_max = 5
        "--global_std": "",  # config.sample.global_std = True
        "--adv_eps": "1e-4",  # stat_tracking.py: std + 1e-4
        "--timestep_fraction": "0.99",  # config.train.timestep_fraction = 0.99: int(8 x 0.99) = 7 sigmas here
        "--old_decay_schedule": "linear",  # config.decay_type = 1: min(0.001 step, 0.5)
        "--old_update_interval": "1",  # the old adapter is updated after every epoch
        "--learning_rate": "3e-4",  # config.train.learning_rate = 3e-4 (theirs on a LoRA 32; here full fine-tune)
        "--lr_scheduler": "constant",  # train_nft_sd3.py builds no LR scheduler
        "--weight_decay": "1e-4",  # config.train.adam_weight_decay = 1e-4
        "--max_grad_norm": "1.0",  # config.train.max_grad_norm = 1.0
    }, NFT_SIGMAS, claim="DiffusionNFT: up to 25x more efficient than Flow-GRPO (arXiv 2509.16117; GenEval 0.98 in ~1k "
                 "steps vs Flow-GRPO's 0.95 in >5k)"),
    # Advantage Weighted Matching (scripts/recipes/awm_flux.yaml: X-GenGroup/Flow-Factory
    # examples/awm/lora/flux1/default.yaml with src/flow_factory/trainers/awm.py; the loss agrees with
    # scxue/advantage_weighted_matching)
    "awm": Objective("nft", "AWM", {
        "--objective": "awm",  # train.trainer_type: 'awm'
        "--solver": "euler",  # scheduler.dynamics_type: "ODE"
        "--num_generations": "16",  # train.group_size: 16
        "--prompts_per_step": "3",  # unique_sample_num_per_epoch 48 there; 3 here: 48 samples (forced)
        "--rollout_batch_size": "48",  # ours (speed only)
        "--train_batch_size": "16",  # 2 per device there; one optimizer step per epoch either way (speed only)
        "--gradient_accumulation_steps": "0",  # train.gradient_step_per_epoch: 1
        "--awm_weighting": "ghuber",  # train.awm_weighting: 'ghuber'
        "--ghuber_power": "0.25",  # train.ghuber_power: 0.25
        "--awm_timesteps": "4",  # train.num_train_timesteps: 4
        # train.timestep_range: 0.7: 4 strata of the first int(8 x 0.7) = 5 sigmas (the official span, as measured;
        # Flow-Factory's own span is --awm_strata flow_factory)
        "--timestep_fraction": "0.7",
        "--awm_clip_range": "1.0",  # train.clip_range: 1
        "--adv_clip_max": "1.0",  # train.adv_clip_range: 1.0
        "--awm_advantage_max": "1.0",  # advantages in [-1, 1]
        "--global_std": "",  # train.global_std: true
        "--kl_beta": "0",  # train.kl_beta: 0
        "--old_kl_beta": "0.1",  # train.ema_kl_beta: 0.1
        "--awm_old_kl": "flow_factory",  # trainers/awm.py: the ema_kl_beta term on its own (kl_beta 0)
        "--old_decay_schedule": "awm",  # ema_decay_schedule linear to ema_decay 0.3
        "--old_update_interval": "1",  # train.ema_update_interval: 1
        "--learning_rate": "3e-4",  # train.learning_rate: 3.0e-4 (theirs on a LoRA 64; here full fine-tune)
        "--lr_scheduler": "constant",  # trainers/abc.py builds no LR scheduler
        "--weight_decay": "1e-4",  # train.adam_weight_decay: 1.0e-4
        "--max_grad_norm": "1.0",  # train.max_grad_norm: 1.0
    }, {"--objective": "awm", "--awm_timesteps": "4", **NFT_SIGMAS},
        claim="AWM: up to 24x speedup over Flow-GRPO (arXiv 2509.25050; GenEval, OCR, PickScore)"),
}
# the old module's names: every objective's published flags (and below, its candidates)
PUBLISHED = {name: o.published for name, o in OBJECTIVES.items()}


def candidates(name: str) -> list[dict[str, str]]:
    """The tuning candidates of objective ``name``: its base flags at each of ``LEARNING_RATES`` (equal count)."""
    return [{**OBJECTIVES[name].base, "--learning_rate": lr} for lr in LEARNING_RATES]


CANDIDATES = {name: candidates(name) for name in OBJECTIVES}


def flag_list(flags: dict[str, str]) -> list[str]:
    """``{"--flag": "a b", "--switch": ""}`` -> ``["--flag", "a", "b", "--switch"]``."""
    return [x for k, v in flags.items() for x in (k, *v.split())]


def run_dir(out: Path, name: str, setting: str, seed: int) -> Path:
    """Where a final run of (objective, setting, seed) lives."""
    return out / "runs" / f"{name}-{setting}-seed{seed}"


def say(text: str) -> None:
    with _PRINT:
        print(text, flush=True)


def launch(algo: str, flags: dict[str, str], output_dir: Path, *, seed: int, budget_s: float, eval_every: int,
           eval_prompts: int, data_dir: Path, eval_json: Path | None = None, max_steps: int | None = None,
           nproc: int = 1, demo: str = "toyworld", eval_reward: str | None = None, strict: bool = False) -> Path:
    """One training run through launcher ``algo`` (grpo, dpo, nft) with ``flags`` over the demo's; skipped if it
    already finished; returns its folder. ``max_steps``: a fixed number of steps instead of the ``budget_s`` seconds;
    ``nproc``: ranks (torchrun); ``demo``: the launchers' DEMO (toyworld, jpeg; only toyworld evaluates);
    ``eval_reward``: --eval_reward of the held-out evaluation. What made the run is written to ``<folder>/run.json``
    (launcher, flags, seed, length, evaluation, ranks); ``strict``: a finished folder whose ``run.json`` is missing or
    differs is an error instead of being reused."""
    length = (["--max_train_steps", str(max_steps)] if max_steps else
              ["--max_train_seconds", str(budget_s), "--max_train_steps", "100000"])
    evaluation = ((["--eval_every", str(eval_every), "--eval_max_prompts", str(eval_prompts)]
                   + (["--eval_reward", eval_reward] if eval_reward else [])) if demo == "toyworld"
                  else [])  # the JPEG demo has no held-out prompts
    record = {"launcher": algo, "flags": flags, "seed": seed, "length": length, "evaluation": evaluation,
              "eval_json": str(eval_json) if eval_json else None, "nproc": nproc, "demo": demo}
    if (output_dir / "final").exists():
        made = output_dir / "run.json"
        if strict and (not made.exists() or json.loads(made.read_text()) != record):
            raise RuntimeError(f"{output_dir} finished with other settings than this run's (or before run.json was "
                               f"written): delete it, or pass another --out")
        return output_dir
    args = [*flag_list(flags), "--seed", str(seed), *length, *evaluation, "--sample_every", "0",
            "--checkpointing_steps", "100000", "--no-progress_bar"]
    env = {**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable), "DATA_DIR": str(data_dir),
           "OUTPUT_DIR": str(output_dir), "DEMO": demo,
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), "NPROC_PER_NODE": str(nproc)}
    env.pop("MODEL_PATH", None)
    env.pop("EVAL_JSON", None)
    if eval_json is not None:
        env["EVAL_JSON"] = str(eval_json)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "run.json").write_text(json.dumps(record, indent=1) + "\n")
    log = output_dir.parent / f"{output_dir.name}.log"
    what = f"{max_steps} steps" if max_steps else f"{budget_s:g} s"
    say(f"[{algo}] {output_dir.name}: {' '.join(flag_list(flags))} ({what})")
    with open(log, "w") as fh:
        proc = subprocess.run(["bash", LAUNCHERS[algo], *args], cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"{algo} run {output_dir} failed (exit {proc.returncode}); see {log}")
    return output_dir


def ensure_data(data_dir: Path) -> None:
    """Build the toy model, prompt files and embeddings in ``data_dir`` (the launchers' ``toy_data``) if absent, once,
    before runs start in parallel (two first launches would both build them)."""
    needed = [data_dir / "toy-flux" / "model_index.json", data_dir / "toyworld-prompts" / "heldout.txt",
              data_dir / "toyworld-train" / "manifest.json", data_dir / "toyworld-heldout" / "manifest.json"]
    if all(p.exists() for p in needed):
        return
    say(f"building the toy world in {data_dir} (once)")
    env = {**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable), "DATA_DIR": str(data_dir)}
    for key in ("MODEL_PATH", "DATA_JSON", "EVAL_JSON"):
        env.pop(key, None)
    subprocess.run(["bash", "-c", ". scripts/_training_common.sh && toy_data"], cwd=REPO, env=env, check=True)


def run_all(jobs: list[dict], parallel: int) -> None:
    """``launch(**job)`` for every job, ``parallel`` at a time; raises after all have ended if any failed."""
    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        futures = [pool.submit(launch, **job) for job in jobs]
    failed = [str(f.exception()) for f in futures if f.exception() is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(jobs)} runs failed:\n" + "\n".join(failed))


# ----------------------------------------------------------------------------------------------- reading the runs
def read_rows(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl, one per step (the last one logged for a step wins: a resumed run repeats steps)."""
    by_step: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            by_step[int(row["step"])] = row
    return [by_step[s] for s in sorted(by_step)]


def step_tflops(row: dict, ranks: int = 1) -> float:
    """The model TFLOPs of one step's row: (tflops_rollout x time_rollout + tflops_train x time_train) x ranks (the
    rates are per rank, the mean over ranks; a phase without FLOPs logs no rate)."""
    return ranks * sum(float(row.get(f"tflops_{p}", 0.0)) * float(row.get(f"time_{p}", 0.0))
                       for p in ("rollout", "train"))


def curve(output_dir: Path) -> dict[str, list[float]]:
    """Evaluation points of a run: step, training seconds, samples drawn, cumulative model TFLOPs, held-out strict
    accuracy, mean score and (if evaluated) cleanliness (NaN where absent)."""
    config = json.loads((output_dir / "config.json").read_text())
    per_step = config["batch_arithmetic"]["samples_per_step"]
    made = output_dir / "run.json"
    ranks = int(json.loads(made.read_text()).get("nproc", 1)) if made.exists() else 1
    out: dict[str, list[float]] = {k: [] for k in ("step", "seconds", "samples", "tflops", "strict", "score",
                                                   "clean")}
    total = 0.0
    for row in read_rows(output_dir / "metrics.jsonl"):
        total += step_tflops(row, ranks)
        if METRICS["strict"] not in row:
            continue
        out["step"].append(row["step"])
        out["seconds"].append(float(row.get("time_elapsed", 0.0)))
        out["samples"].append(row["step"] * per_step)
        out["tflops"].append(total)
        for key, name in METRICS.items():
            out[key].append(float(row.get(name, float("nan"))))
    return out


# ------------------------------------------------------------------------------------------------- statistics
def interval(values) -> tuple[float, float]:
    """``(mean, half width of its 95% Student-t interval)`` over ``values`` (seeds); half is NaN with fewer than 2."""
    from fastvideo.evaluation import t_quantile_975

    v = np.asarray(values, dtype=float)
    if len(v) < 2:
        return float(v.mean()) if len(v) else float("nan"), float("nan")
    return float(v.mean()), t_quantile_975(len(v) - 1) * float(v.std(ddof=1)) / math.sqrt(len(v))


def aligned(curves: list[dict], xkey: str, ykey: str) -> tuple[np.ndarray, np.ndarray]:
    """``(x, ys)``: the seeds' evaluation points index by index up to the shortest run (the same steps except a
    time-budgeted run's last), x the seed mean, ``ys`` (seeds, points)."""
    n = min(len(c[xkey]) for c in curves)
    return (np.mean([c[xkey][:n] for c in curves], axis=0), np.array([c[ykey][:n] for c in curves], dtype=float))


def reach(curves: list[dict], xkey: str, ykey: str, target: float) -> dict:
    """Where the seed-mean gain of ``ykey`` over its first evaluation first reaches ``target``: ``{"x": seed-mean
    ``xkey`` there or None, "last": the last aligned x}``."""
    x, ys = aligned(curves, xkey, ykey)
    gain = (ys - ys[:, :1]).mean(0)
    hit = np.nonzero(gain >= target - 1e-12)[0]
    hit = hit[hit > 0]
    return {"x": float(x[hit[0]]) if len(hit) else None, "last": float(x[-1])}


def rates(curves: list[dict], xkey: str, ykey: str, per: float) -> np.ndarray:
    """Each seed's gain of ``ykey`` (last minus first evaluation) per ``per`` units of ``xkey`` at its end."""
    return np.array([(c[ykey][-1] - c[ykey][0]) / c[xkey][-1] * per if c[xkey][-1] > 0 else float("nan")
                     for c in curves])


def ratio_interval(a, b, draws: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """``mean(a) / mean(b)`` and a 95% percentile-bootstrap interval (the seeds of each resampled independently);
    NaN where ``mean(b) <= 0`` (no gain to compare against)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if not len(a) or not len(b) or not b.mean() > 0:
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    num = a[rng.integers(0, len(a), (draws, len(a)))].mean(1)
    den = b[rng.integers(0, len(b), (draws, len(b)))].mean(1)
    ok = den > 0
    boot = num[ok] / den[ok]
    lo, hi = (np.percentile(boot, [2.5, 97.5]) if len(boot) else (float("nan"), float("nan")))
    return float(a.mean() / b.mean()), float(lo), float(hi)


def speedup(ref: dict, mine: dict) -> dict:
    """How many times less of an axis ``mine`` needs than ``ref`` to reach the target (``reach`` results): a value,
    or a bound when one of them did not reach it in its run ("kind": "=", ">" or "<"; None when neither did)."""
    if mine["x"] is not None and ref["x"] is not None:
        return {"kind": "=", "value": ref["x"] / mine["x"] if mine["x"] > 0 else float("inf")}
    if mine["x"] is not None:  # the reference needs more than its whole run
        return {"kind": ">", "value": ref["last"] / mine["x"] if mine["x"] > 0 else float("inf")}
    if ref["x"] is not None:
        return {"kind": "<", "value": ref["x"] / mine["last"] if mine["last"] > 0 else float("nan")}
    return {"kind": None, "value": float("nan")}


AXES = {"samples": ("samples", 1000.0, "1k samples"), "seconds": ("seconds", 100.0, "100 s"),
        "tflops": ("tflops", 1.0, "TFLOP")}


def efficiency(summary: dict, metric: str, target: float, reference: str = REFERENCE) -> dict:
    """Per "objective/setting": samples, seconds and TFLOPs to reach a seed-mean ``metric`` gain of ``target``, the
    gain per 1k samples / 100 s / TFLOP (mean, 95% t-interval over seeds), seconds per step, and each relative to
    ``reference`` of the same setting (speed-ups: > 1 = better than the reference)."""
    out: dict = {}
    for key, r in summary.items():
        name, setting = key.split("/")
        ref = summary.get(f"{reference}/{setting}")
        entry: dict = {"reach": {}, "rate": {}, "step_seconds": r["step_seconds"]}
        if ref is not None and ref["step_seconds"] > 0:
            entry["step_seconds_vs_ref"] = r["step_seconds"] / ref["step_seconds"]
        for axis, (xkey, per, _) in AXES.items():
            mine = reach(r["curves"], xkey, metric, target)
            entry["reach"][axis] = mine
            if ref is not None:
                mine["speedup"] = speedup(reach(ref["curves"], xkey, metric, target), mine)
            values = rates(r["curves"], xkey, metric, per)
            mean, half = interval(values)
            entry["rate"][axis] = {"per_seed": values.tolist(), "mean": mean, "ci95": half}
            if ref is not None:
                ratio, lo, hi = ratio_interval(values, rates(ref["curves"], xkey, metric, per))
                entry["rate"][axis].update(vs_ref=ratio, vs_ref_low=lo, vs_ref_high=hi)
        out[key] = entry
    return out


def summarise(out: Path, names: list[str], seeds: list[int], settings=SETTINGS) -> dict:
    """Per "objective/setting": its flags, every seed's curve, end-of-run means of steps / samples / TFLOPs / seconds,
    seconds per step, and for strict accuracy, score and cleanliness the start and end means with 95% t-intervals
    over seeds (and of the gain)."""
    summary: dict = {}
    for name in names:
        for setting in settings:
            dirs = [run_dir(out, name, setting, s) for s in seeds]
            dirs = [d for d in dirs if (d / "metrics.jsonl").exists() and (d / "config.json").exists()]
            curves = [c for c in (curve(d) for d in dirs) if c["step"]]
            if not curves:
                continue
            made = dirs[0] / "run.json"
            flags = json.loads(made.read_text())["flags"] if made.exists() else {}
            r = {"flags": flags, "trainer": OBJECTIVES[name].trainer if name in OBJECTIVES else "?",
                 "seeds": len(curves), "curves": curves}
            for axis in ("step", "samples", "tflops", "seconds"):
                r[axis] = float(np.mean([c[axis][-1] for c in curves]))
            r["steps"] = r.pop("step")
            r["step_seconds"] = r["seconds"] / r["steps"] if r["steps"] else float("nan")
            for key in ("strict", "score", "clean"):
                r[f"{key}_start"], r[f"{key}_start_ci95"] = interval([c[key][0] for c in curves])
                r[f"{key}_end"], r[f"{key}_end_ci95"] = interval([c[key][-1] for c in curves])
                r[f"{key}_gain"], r[f"{key}_gain_ci95"] = interval([c[key][-1] - c[key][0] for c in curves])
                r[f"{key}_end_min"] = float(min(c[key][-1] for c in curves))
                r[f"{key}_end_max"] = float(max(c[key][-1] for c in curves))
            summary[f"{name}/{setting}"] = r
    return summary


# ------------------------------------------------------------------------------------------------------ output
def _pm(mean: float, half: float, digits: int = 3) -> str:
    return f"{mean:.{digits}f}" + ("" if math.isnan(half) else f" ± {half:.{digits}f}")


def _times(s: dict) -> str:
    if s["kind"] is None or not math.isfinite(s["value"]):
        return "n/a"
    return f"{'' if s['kind'] == '=' else s['kind']}{s['value']:.2g}×"


def write_table(summary: dict, path: Path, budget_s: float, eff: dict | None = None, targets: dict | None = None,
                note: str = "") -> str:
    """The markdown tables of ``summary`` and its efficiency summary ``eff`` ({metric: efficiency(...)}), written to
    ``path`` and returned."""
    seeds = max((r["seeds"] for r in summary.values()), default=0)
    lines = ["| objective | setting | steps | samples | TFLOPs | seconds | held-out strict: start → end "
             "(± 95% CI) | strict gain (± 95% CI) | held-out score: start → end | score gain | clean: start → end "
             "| flags |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, r in summary.items():
        name, setting = key.split("/")
        flags = " ".join(flag_list(r["flags"]))
        lines.append(
            f"| {name} | {setting} | {r['steps']:.0f} | {r['samples']:.0f} | {r['tflops']:.3g} | {r['seconds']:.0f} | "
            f"{r['strict_start']:.3f} → **{_pm(r['strict_end'], r['strict_end_ci95'])}** | "
            f"{_pm(r['strict_gain'], r['strict_gain_ci95'])} | {r['score_start']:.3f} → "
            f"{_pm(r['score_end'], r['score_end_ci95'])} | {_pm(r['score_gain'], r['score_gain_ci95'])} | "
            f"{r['clean_start']:.3f} → {_pm(r['clean_end'], r['clean_end_ci95'])} | `{flags}` |")
    what = f"{budget_s:g} s of training per run" if budget_s else "fixed-length runs"
    text = (f"Held-out evaluation after {what}; mean over {seeds} seed(s), ± the 95% t-interval over seeds "
            f"(TFLOPs: model FLOPs of rollout and training). {note}\n\n" + "\n".join(lines) + "\n")
    for metric, per_key in (eff or {}).items():
        target = (targets or {}).get(metric, float("nan"))
        rows = [f"\n### Efficiency: held-out {metric} relative to `{REFERENCE}` of the same setting\n",
                f"Columns 4-6: samples / training seconds / TFLOPs until the seed-mean gain first reaches "
                f"+{target:g} (× = {REFERENCE}'s need over this one's: > 1 is faster; `>`/`<` a bound where one of "
                f"the two never reached it; — not reached). Columns 7-9: gain per 1k samples / 100 s / TFLOP at the "
                f"end (mean ± 95% t-interval over seeds; × = the ratio of mean rates to {REFERENCE}'s with a bootstrap "
                f"95% interval; n/a where {REFERENCE} did not gain).\n",
                f"| objective | setting | s/step (× {REFERENCE}) | samples to +{target:g} | seconds to +{target:g} | "
                f"TFLOPs to +{target:g} | gain / 1k samples | gain / 100 s | gain / TFLOP | paper's claim |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for key, e in per_key.items():
            name, setting = key.split("/")
            cells = []
            for axis in AXES:
                got = e["reach"][axis]
                value = "—" if got["x"] is None else f"{got['x']:.3g}"
                cells.append(f"{value} ({_times(got['speedup'])})" if "speedup" in got else value)
            for axis in AXES:
                rate = e["rate"][axis]
                cell = _pm(rate["mean"], rate["ci95"], 4)
                if "vs_ref" in rate:
                    cell += (" (n/a)" if math.isnan(rate["vs_ref"]) else
                             f" ({rate['vs_ref']:.2g}× [{rate['vs_ref_low']:.2g}, {rate['vs_ref_high']:.2g}])")
                cells.append(cell)
            step = f"{e['step_seconds']:.2f}" + (f" ({e['step_seconds_vs_ref']:.2f}×)" if "step_seconds_vs_ref" in e
                                                  else "")
            claim = OBJECTIVES[name].claim if name in OBJECTIVES and setting == "published" else ""
            rows.append(f"| {name} | {setting} | {step} | " + " | ".join(cells) + f" | {claim} |")
        text += "\n".join(rows) + "\n"
    path.write_text(text)
    return text


def plot(summary: dict, path: Path) -> None:
    """2 x 3 PNG: held-out strict accuracy and score vs samples, training seconds and TFLOPs; seed mean and min-max
    band; one colour per objective, solid = tuned, dashed = published."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys([*OBJECTIVES, *(k.split("/")[0] for k in summary)]))
    colors = {n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(names)}
    fig, axes = plt.subplots(2, 3, figsize=(15, 8), sharey="row")
    for key, r in summary.items():
        name, setting = key.split("/")
        style = "-" if setting == "tuned" else "--"
        for row, ykey in enumerate(("strict", "score")):
            for col, xkey in enumerate(("samples", "seconds", "tflops")):
                ax = axes[row, col]
                x, ys = aligned(r["curves"], xkey, ykey)
                ax.plot(x, ys.mean(0), style, color=colors[name], label=f"{name} {setting}")
                ax.fill_between(x, ys.min(0), ys.max(0), color=colors[name], alpha=0.08)
    for col, label in enumerate(("samples generated", "training seconds (one process)", "model TFLOPs")):
        axes[1, col].set_xlabel(label)
    axes[0, 0].set_ylabel("held-out strict accuracy")
    axes[1, 0].set_ylabel("held-out score (mean of the 4 checks)")
    axes[0, 2].legend(fontsize=7, ncol=2)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    fig.suptitle("Toy world: every objective from the same pretrained toy FLUX (dashed = published, solid = tuned)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(out: Path, names: list[str], seeds: list[int], budget_s: float, targets: dict[str, float],
           settings=SETTINGS, note: str = "") -> dict:
    """Summarise the runs in ``out``; write results.json, table.md, algorithms.png; return the results."""
    summary = summarise(out, names, seeds, settings)
    eff = {metric: efficiency(summary, metric, target) for metric, target in targets.items()}
    results = {"budget_s": budget_s, "targets": targets, "reference": REFERENCE, "runs": summary, "efficiency": eff}
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(write_table(summary, out / "table.md", budget_s, eff, targets, note))
    if summary:
        plot(summary, out / "algorithms.png")
    print(f"table: {out / 'table.md'}\nplot:  {out / 'algorithms.png'}")
    return results


def tune(names: list[str], args: argparse.Namespace, train_eval: Path) -> dict[str, dict[str, str]]:
    """Every objective's candidates, run once each (in parallel) for --tune_budget_s on the tuning seed; per objective
    the candidate with the best final mean score on the training prompts (written to tune/<objective>.json)."""
    def job(name: str, i: int, cand: dict) -> dict:
        return dict(algo=OBJECTIVES[name].trainer, flags={**TRAIN_REWARD, **cand},
                    output_dir=args.out / "tune" / f"{name}-cand{i}",
                    seed=TUNE_SEED, budget_s=args.tune_budget_s, eval_every=0, eval_prompts=args.eval_prompts,
                    data_dir=args.data_dir, eval_json=train_eval, eval_reward=EVAL_REWARD, strict=True)

    run_all([job(n, i, c) for n in names for i, c in enumerate(candidates(n))], args.parallel)
    chosen = {}
    for name in names:
        results = [{"flags": c, "train_score": curve(args.out / "tune" / f"{name}-cand{i}")["score"][-1]}
                   for i, c in enumerate(candidates(name))]
        (args.out / "tune" / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
        chosen[name] = max(results, key=lambda r: r["train_score"])["flags"]  # first on a tie
    return chosen


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("outputs/algorithms"), help="results folder")
    p.add_argument("--data_dir", type=Path, default=Path("data"), help="DATA_DIR of the launchers (toy model, data)")
    p.add_argument("--objectives", nargs="+", default=list(OBJECTIVES), choices=list(OBJECTIVES),
                   help="which objectives (default: all)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="seeds of the final runs")
    p.add_argument("--budget_s", type=float, default=90.0, help="training seconds per final run")
    p.add_argument("--tune_budget_s", type=float, default=30.0, help="training seconds per tuning candidate")
    p.add_argument("--eval_every", type=int, default=5, help="steps between held-out evaluations")
    p.add_argument("--eval_prompts", type=int, default=128, help="held-out (tuning: training) prompts per evaluation")
    p.add_argument("--parallel", type=int, default=2, help="runs at once (each one process, OMP_NUM_THREADS threads, "
                                                           "default 1)")
    p.add_argument("--target_strict", type=float, default=0.02,
                   help="the efficiency summary's target gain of held-out strict accuracy")
    p.add_argument("--target_score", type=float, default=0.02,
                   help="the efficiency summary's target gain of the held-out score")
    p.add_argument("--smoke", action="store_true",
                   help="does everything run: the published setting of each objective, the first seed, 2 steps, 4 "
                        "evaluation prompts evaluated every step, no tuning (the test suite's mode)")
    p.add_argument("--plot_only", action="store_true", help="only redraw the tables and plot from existing runs")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    settings = ("published",) if args.smoke else SETTINGS
    seeds = args.seeds[:1] if args.smoke else args.seeds
    max_steps = 2 if args.smoke else None
    eval_every, eval_prompts = (1, 4) if args.smoke else (args.eval_every, args.eval_prompts)

    if not args.plot_only:
        ensure_data(args.data_dir)
        chosen = {} if args.smoke else tune(args.objectives, args, args.data_dir / "toyworld-train" / "manifest.json")
        flags = {name: {"published": OBJECTIVES[name].published, **({"tuned": chosen[name]} if name in chosen else {})}
                 for name in args.objectives}
        (args.out / "settings.json").write_text(json.dumps(flags, indent=2) + "\n")
        run_all([dict(algo=OBJECTIVES[name].trainer, flags={**TRAIN_REWARD, **flags[name][setting]},
                      output_dir=run_dir(args.out, name, setting, seed), seed=seed, budget_s=args.budget_s,
                      eval_every=eval_every, eval_prompts=eval_prompts, data_dir=args.data_dir, max_steps=max_steps,
                      eval_reward=EVAL_REWARD, strict=True)
                 for name in args.objectives for setting in settings for seed in seeds], args.parallel)
    note = "Smoke run: 2 steps, 4 evaluation prompts; the numbers only show that everything runs." if args.smoke else ""
    return report(args.out, args.objectives, seeds, 0.0 if args.smoke else args.budget_s,
                  {"strict": args.target_strict, "score": args.target_score}, settings, note)


if __name__ == "__main__":
    main()
    sys.exit(0)
