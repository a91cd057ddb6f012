"""Command-line options as dataclass groups -> argparse, with validation and config.json.

Each trainer picks the groups it needs; flag names follow DanceGRPO where the concept exists
(DESIGN principle 8). Every flag has a help text with its unit. ``validate_*`` functions raise
``ValueError`` naming the flag and the fix, and run before any model is loaded.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from fastvideo.parallel import GRADIENT_SYNC_MODES
from fastvideo.advantages import GROUP_STD_MODES
from fastvideo.losses import POLICY_LOSSES
from fastvideo.rollout import LAST_STEP_MODES, TIMESTEP_SELECTIONS, WINDOW_SCHEDULES
from fastvideo.schedulers import KL_FORMS, SDE_TYPES

DEFAULT_ETA = {"flow_sde": 0.9, "dance_sde": 0.3, "cps": 0.8}


def opt(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field that carries its argparse help (and choices/nargs/action) in metadata."""
    return field(default=default, metadata={"help": help, **kwargs})


@dataclass
class ModelOptions:
    pretrained_model_name_or_path: str | None = opt(
        None, "local diffusers FLUX folder (model_index.json, transformer/, vae/, ...); required")
    model_family: str = opt("auto", "model family adapter: auto (from the folder's model_index.json) | flux1 | sd3 | "
                                    "qwen-image | flux2 | "
                                    "package.module:Class, your own fastvideo.models.ModelFamily (docs/model-families.md)")
    data_json_path: str | None = opt(
        None, "manifest.json (or its folder) written by preprocess_embeddings.py; required")
    output_dir: str = opt("outputs/grpo", "run folder: config.json, metrics.jsonl, samples/, checkpoints/, final/")
    device: str | None = opt(None, "cuda | npu | cpu (default: first available in that order)")
    seed: int = opt(42, "run seed; all noise derives from (seed, step, prompt id, sample index, purpose)")
    deterministic: bool = opt(False, "use deterministic kernels and full-float32 math (slower on GPU: "
                                     "deterministic algorithms, cuBLAS workspace, no TF32/HF32; "
                                     "docs/alignment.md, Determinism). Uninitialised memory is not filled (torch's "
                                     "fill_uninitialized_memory is turned off: filling would write every torch.empty, "
                                     "e.g. each FSDP all-gather buffer, and this code reads no memory before writing "
                                     "it)")
    noise_device: str = opt("cpu", "device noise is drawn on (cpu makes CUDA/NPU/CPU runs identical)")


@dataclass
class SamplingOptions:
    h: int = opt(720, "image height in pixels")
    w: int = opt(720, "image width in pixels")
    sampling_steps: int = opt(16, "denoising steps per rollout (S)")
    sde_type: str = opt("flow_sde", "stochastic sampler: flow_sde (Flow-GRPO) | dance_sde (DanceGRPO) | cps",
                        choices=SDE_TYPES)
    eta: float | None = opt(None, "SDE noise level (default by --sde_type: flow_sde 0.9, dance_sde 0.3, cps 0.8)")
    shift: float | None = opt(None, "static sigma shift (DanceGRPO: 3); unset = FLUX dynamic shift like FluxPipeline")
    guidance_scale: float = opt(3.5, "FLUX.1-dev distilled guidance value (ignored by models without it)")
    cfg_scale: float = opt(1.0, "true classifier-free guidance scale, 1 = off (FLUX.1 uses --guidance_scale instead): "
                                "> 1 samples, replays and evaluates with the guided velocity v_u + s(v_c - v_u) from "
                                "one batched forward of prompt + negative prompt (Flow-GRPO trains SD3.5-M with 4.5; "
                                "GRPO's ratios are those of the guided step); DPO's and NFT's losses stay on the "
                                "conditional velocity (their papers train CFG-free). Needs embeddings preprocessed "
                                "with --negative_prompt")
    sde_window_size: int = opt(0, "noise only on this many consecutive steps (0 = every step is stochastic)")
    sde_window_range: tuple[int, int] | None = opt(
        None, "two step indices LO HI: the window lies in steps [LO, HI) (default: 0 S-1, never the last step)",
        nargs=2, type=int)
    sde_window_schedule: str = opt(
        "random", "where the --sde_window_size window lies at each training step: random = a keyed draw per prompt "
        "group and step (Flow-GRPO-Fast) | sliding = MixGRPO's sliding window (arXiv 2507.21802): every sample of a "
        "step shares it; it starts at LO of --sde_window_range, moves by --sde_window_stride every "
        "--sde_window_shift_interval steps and rolls back to LO after the last full position (MixGRPO's --roll_back) "
        "| progressive = the same, but it stays at the last position (verl-omni's progressive)",
        choices=WINDOW_SCHEDULES)
    sde_window_shift_interval: int = opt(
        25, "--sde_window_schedule sliding|progressive: training steps the window stays at one position (MixGRPO's "
        "shift interval tau, iters_per_group: 25 in its FLUX script)")
    sde_window_stride: int = opt(
        1, "--sde_window_schedule sliding|progressive: steps the window moves at each shift (MixGRPO's stride, "
        "prog_overlap_step: 1 in its FLUX script; = --sde_window_size for non-overlapping positions)")
    init_same_noise: bool = opt(False, "share the initial noise within a prompt group")
    decode_x0: bool = opt(False, "score the last predicted clean latent x0_hat (DanceGRPO) instead of the final latent")
    rollout_batch_size: int = opt(8, "samples per transformer call during rollout (per rank)")
    decode_batch_size: int = opt(0, "latents per VAE decode call (the VAE decodes in the compute dtype); 0 = auto: on "
                                    "a GPU/NPU the largest batch whose planned decode peak is <= 4 GiB (at most "
                                    "--rollout_batch_size; 2 at 1024^2 in bf16), on the CPU a whole rollout "
                                    "micro-batch; lower it when the decode, not the transformer, runs out of memory "
                                    "(the images do not change)")
    last_step: str = opt(
        "sde", "the last sampling step (sigma' = 0), never trained: sde = stochastic like the others (Flow-GRPO's "
        "code; chosen by measurement on the demo, see docs/reproducing.md) | ode = the deterministic Euler step, "
        "which is exactly its x0_hat, so the scored image carries no noise the policy cannot influence (the image "
        "DanceGRPO scores, as --decode_x0 does)", choices=LAST_STEP_MODES)


@dataclass
class GroupOptions:
    num_generations: int = opt(12, "samples per prompt (group size G)")
    prompts_per_step: int = opt(2, "prompts per training step over all ranks (P); samples per step = P*G")


@dataclass
class AdvantageOptions:
    adv_clip_max: float = opt(5.0, "advantages (in reward-std units) are clamped to [-adv_clip_max, adv_clip_max]")
    global_std: bool = opt(False, "normalise advantages by the whole batch's reward std (Flow-GRPO) "
                                  "instead of each group's (DanceGRPO)")
    adv_eps: float = opt(1e-4, "added to the reward std before dividing (Flow-GRPO 1e-4); DanceGRPO's 1e-8 turns "
                               "near-constant groups into +-adv_clip_max noise (pass it only to reproduce DanceGRPO)")
    group_std: str = opt("unbiased", "the group std of per-group normalisation (--no-global_std): unbiased (n - 1: "
                                     "DanceGRPO, torch.std) | population (n: Flow-GRPO's and DiffusionNFT's per-prompt "
                                     "stat_tracking.py, np.std; the NFT default)", choices=GROUP_STD_MODES)
    shuffle_micro_batches: bool = opt(
        False, "shuffle the step's samples before cutting them into optimizer steps and micro-batches (Flow-GRPO, "
        "DiffusionNFT): a permutation of the gathered batch keyed by (seed, step), the same for every world size; "
        "each rank trains its own samples in that order, padded at loss weight 0 to the longest rank's count (GRPO, "
        "DiffusionNFT and AWM)")


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
        "bias b = mean((mu - mu_old)^2) / (2 std^2), clipped, the step's loss times 1/(-dt); its recommended "
        "--clip_range is 2e-6 (verl-omni's Qwen-Image recipe); flow_sde / dance_sde only | dppo = Flow-DPPO "
        "(arXiv 2606.11025, verl-omni FlowDPPOLoss): no clipping; a sample's -A ratio is masked when the step's "
        "Gaussian divergence D = mean((mu - mu_old)^2) / (2 std^2) >= --dppo_threshold and the ratio already moved "
        "in the advantage's direction. guard/dppo keep each stochastic step's rollout mean (B x S x L x C fp32)",
        choices=POLICY_LOSSES)
    dppo_threshold: float = opt(1e-5, "--policy_loss dppo: divergence threshold eps_D of the mask (verl-omni "
                                      "FlowDPPOLoss default and recipes: 1e-5)")
    clip_range: float = opt(1e-4, "PPO clip range on the probability ratio (--policy_loss clip and guard)")
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
class OptimOptions:
    learning_rate: float = opt(1e-5, "AdamW peak learning rate")
    weight_decay: float = opt(1e-4, "AdamW weight decay")
    adam_beta1: float = opt(0.9, "AdamW beta1")
    adam_beta2: float = opt(0.999, "AdamW beta2")
    adam_epsilon: float = opt(1e-8, "AdamW epsilon")
    max_grad_norm: float = opt(1.0, "clip the global L2 norm of the gradients to this (<= 0 disables clipping)")
    lr_scheduler: str = opt("constant_with_warmup", "learning-rate schedule",
                            choices=("constant_with_warmup", "cosine", "constant"))
    lr_warmup_steps: int = opt(0, "warm-up length in optimizer steps")
    max_train_steps: int = opt(300, "training steps (one rollout + its updates each)")
    max_train_seconds: float = opt(
        0.0, "also stop after the first step that ends past this many seconds of training (slowest rank; evaluation "
        "excluded; 0 = no limit): checkpoint, last evaluation and export as at --max_train_steps (the run's length "
        "then depends on the machine's speed)")
    train_batch_size: int = opt(4, "samples per replay micro-batch (per rank)")
    gradient_accumulation_steps: int = opt(
        0, "micro-batches per optimizer step (0 = all of a rank's samples -> one optimizer step per rollout)")
    max_consecutive_skips: int = opt(
        10, "stop with an error (after writing a checkpoint of the last good weights) when more than N updates in a "
        "row were skipped for a non-finite loss or gradient (0 = never stop)")
    use_ema: bool = opt(False, "keep an EMA of the trained weights (sharded); exported instead of the raw weights")
    ema_decay: float = opt(0.995, "EMA decay per optimizer step (the upper bound of the warm-up)")
    ema_warmup: bool = opt(True, "EMA warm-up: the decay of update t is min(ema_decay, (1+t)/(10+t)) (Flow-GRPO); "
                                 "--no-ema_warmup = constant decay (the exported EMA then keeps ~ema_decay^t of the base)")


@dataclass
class LoRAOptions:
    lora_rank: int = opt(0, "LoRA rank (0 = full fine-tune of the transformer)")
    lora_alpha: float | None = opt(None, "LoRA alpha (default: equal to the rank)")
    lora_target_modules: list[str] | None = opt(
        None, "module names to adapt (default: FLUX attention + feed-forward projections)", nargs="+")


@dataclass
class ParallelOptions:
    fsdp_version: int = opt(2, "FSDP implementation: 2 (fully_shard, default) or 1", choices=(2, 1), type=int)
    fsdp_sharding_strategy: str = opt("full", "how FSDP shards the transformer",
                                      choices=("full", "hybrid_full", "shard_grad_op", "no_shard"))
    mixed_precision: str = opt("auto", "compute dtype: bf16 | fp32 | auto (bf16 on GPU/NPU, fp32 on CPU)",
                               choices=("auto", "bf16", "fp32"))
    use_cpu_offload: bool = opt(False, "offload FSDP parameters, gradients and optimizer state to the CPU (needs "
                                       ">= 2 ranks; adds a gloo backend for CPU collectives)")
    gradient_checkpointing: bool | None = opt(
        None, "recompute transformer blocks in backward to save activation memory (~1/3 more update compute); unset = "
        "auto: on for a full fine-tune (--lora_rank 0) on a GPU/NPU, off for LoRA and on the CPU; "
        "--gradient_checkpointing / --no-gradient_checkpointing choose explicitly")
    compile: bool = opt(False, "torch.compile every transformer block (fused kernels; the first rollout and update "
                               "of each batch size compile, minutes at 12B). See docs/performance.md for when it pays")
    gradient_sync: str = opt(
        "auto", "when FSDP2 reduce-scatters gradients: backward = after every backward (each rank keeps only its "
        "fp32 gradient shard, 4 B/param/world; more communication) | step = once per optimizer step (every rank "
        "keeps unsharded fp32 gradients of all trainable params until then, 4 B/param: ~48 GB for a FLUX.1-dev full "
        "fine-tune, so LoRA only) | auto = step for LoRA, backward for full fine-tuning",
        choices=("auto", *GRADIENT_SYNC_MODES))
    sp_size: int = opt(1, "Ulysses sequence parallelism: each group of N consecutive ranks shares its samples and "
                          "splits their image and text tokens (attention heads / N per rank); FSDP still shards over "
                          "all ranks. Must divide the ranks, the attention heads (FLUX.1-dev: 24) and the image "
                          "tokens ((h/16) x (w/16)); text is padded to a multiple of N. See "
                          "docs/sequence-parallel.md", type=int)
    attention_backend: str = opt("auto", "diffusers attention kernel for every forward (rollout and replay alike): "
                                         "auto (torch SDPA; the fused _native_npu kernel on an NPU in bf16) | native | "
                                         "flash | _native_flash | _native_cudnn | _native_npu | sage | ... (any "
                                         "diffusers AttentionBackendName); an unavailable one falls back to native "
                                         "with one warning (always on a CPU job)")
    dist_timeout_minutes: float = opt(30.0, "minutes a collective (NCCL/HCCL/gloo) may wait for a peer before the "
                                            "job fails; waits on rank 0's file writes (export, checkpoint renames) "
                                            "go through the TCP store and are not bound by it", type=float)


@dataclass
class PlanOptions:
    dry_run: bool = opt(False, "validate the flags, print the batch arithmetic and a per-rank memory plan (from the "
                               "model folder's configs, on the meta device: no weights are read), then exit")
    dry_run_world_size: int | None = opt(None, "with --dry_run / --check_only: plan or check for this many ranks "
                                               "(default: this job's)")
    check_only: bool = opt(False, "check the flags and inputs (paths, batch arithmetic for --dry_run_world_size "
                                  "ranks, the reward spec, the output folder and the checkpoint --resume_from "
                                  "names), then exit: 0 "
                                  "when they pass, 2 with one line naming the fix otherwise. The launchers run it "
                                  "before starting torchrun")
    dry_run_device_memory_gb: float = opt(80.0, "with --dry_run: memory per device (GiB) to check the plan against")
    ignore_memory_plan: bool = opt(False, "start even when the per-rank memory plan (--dry_run's peak) exceeds the "
                                          "device's memory: a warning instead of the error that a GPU/NPU run gets "
                                          "before any model loads (not checked on the CPU)")


@dataclass
class RewardOptions:
    reward: str = opt("hpsv2:1.0", "weighted rewards, e.g. 'hpsv2:1.0,jpeg_compressibility:0.5' "
                                   "(hpsv2, pickscore, clipscore, aesthetic, jpeg_compressibility, "
                                   "jpeg_incompressibility, toyworld, toyworld_strict, toyworld_clean; weight 0 "
                                   "logs a reward without training on it; over HTTP: "
                                   "remote:http://HOST:PORT[:WEIGHT], a reward server (python -m "
                                   "fastvideo.rewards.serve), and vlm_judge:http://HOST:PORT[:WEIGHT], a chat model "
                                   "as judge; replicas http://A:PORT|http://B:PORT, a second server of one kind "
                                   "remote.LABEL:URL; token: the FASTVIDEO_REWARD_TOKEN variable; "
                                   "docs/reward-serving.md)")
    eval_reward: str | None = opt(None, "extra rewards the held-out evaluation (--eval_prompts) also scores, beside "
                                        "--reward, to watch what the training reward does not see (e.g. "
                                        "'toyworld_clean:1.0' under --reward toyworld): same syntax as --reward, "
                                        "rewards --reward does not hold; each is logged on its own (weights do not "
                                        "matter) as eval/<name> and eval/<name>_<check>. Evaluation only: no "
                                        "training number, checkpoint or recording changes (default: none)")
    reward_batch_size: int = opt(0, "images per reward-model call (0 = all of a rank's images in one call); lower it "
                                    "when a large reward model (HPS ViT-H) runs out of memory (scores do not change)")
    reward_timeout_s: float = opt(120.0, "seconds a remote:URL / vlm_judge:URL reward waits for a server's reply, per "
                                         "attempt (connection and each wait for bytes)")
    reward_retries: int = opt(2, "retries of a remote:URL / vlm_judge:URL request that got no reply (refused, timed "
                                 "out, HTTP 429/502/503/504), 0.5 s backoff doubling; then the next replica, then the "
                                 "run stops naming the URL")
    remote_batch_size: int = opt(0, "images per request of a remote:URL reward (0 = a reward call's images in one "
                                    "request, split only to fit the server's --max_request_mb); a call's requests "
                                    "run concurrently, spread over the URL's replicas")
    remote_max_concurrency: int = opt(4, "requests of a remote:URL reward in flight at once, per process")
    judge_model: str | None = opt(None, "model name a vlm_judge:URL reward asks for in its chat requests (default: the "
                                        "server's first /v1/models entry)")
    judge_template: str | None = opt(None, "text file with the question a vlm_judge:URL reward asks about each image, "
                                           "{prompt} marking the prompt (default: a built-in question)")
    judge_score: str = opt("yes_no", "how a vlm_judge:URL reward reads the answer: yes_no (P(yes)), number (a score "
                                     "out of --judge_max_score, scaled to [0, 1]) or ocr (the prompt's quoted text "
                                     "found in the image)", choices=("yes_no", "number", "ocr"))
    judge_max_score: float = opt(10.0, "top of the scale a vlm_judge:URL reward's --judge_score number asks for")
    judge_max_concurrency: int = opt(8, "chat requests of a vlm_judge:URL reward in flight at once, per process")
    hps_checkpoint: str | None = opt(None, "HPS v2/v2.1 checkpoint (.pt with 'state_dict') for the hpsv2 reward")
    hps_model: str = opt("ViT-H-14", "open_clip architecture name or model-config JSON for the HPS checkpoint")
    pickscore_model: str | None = opt(None, "local PickScore CLIPModel folder for the pickscore reward")
    pickscore_processor: str | None = opt(None, "local CLIP-H processor folder for the pickscore reward")
    clip_checkpoint: str | None = opt(None, "open_clip checkpoint for the clipscore reward")
    clip_model: str = opt("ViT-H-14", "open_clip architecture name or model-config JSON for clipscore")
    aesthetic_checkpoint: str | None = opt(None, "LAION aesthetic MLP weights for the aesthetic reward")
    aesthetic_clip_checkpoint: str | None = opt(
        None, "CLIP ViT-L/14 for the aesthetic reward: a transformers CLIP folder or an open_clip checkpoint")
    nonfinite_reward: str = opt(
        "error", "a NaN/inf reward: 'error' stops the run naming the reward and prompt; 'drop' drops the sample (its "
        "group's advantages are computed without it, it trains nothing) and counts it (dropped_samples)",
        choices=("error", "drop"))
    aesthetic_clip_model: str = opt("ViT-L-14-quickgelu", "open_clip architecture of --aesthetic_clip_checkpoint "
                                                          "(when it is an open_clip file)")
    reward_overlap: bool = opt(
        False, "score each rollout micro-batch (--rollout_batch_size images) on a reward thread (on a GPU/NPU on its "
        "own stream) as soon as it is decoded, while the next one samples: the step waits only for what is left "
        "after the rollout (time_reward; the scorer's own seconds: time_reward_busy). Scores are computed per "
        "micro-batch (each split by --reward_batch_size), so they equal a sequential run's with --reward_batch_size "
        "= --rollout_batch_size: identical for rewards that score each image alone (toyworld, jpeg_*, a remote "
        "server), within the kernels' batch-size effects for reward models. Sequential anyway with --replay_images "
        "(the recorded images exist only after the rollout)")


@dataclass
class EvalOptions:
    eval_prompts: str | None = opt(
        None, "held-out evaluation prompts: a prompt file (one per line; encoded once into OUTPUT_DIR/eval_embeddings "
        "with the model's text encoders, before the policy loads) or an embeddings manifest with the training "
        "data's --max_sequence_length. Each prompt is sampled --eval_num_images times with the deterministic Euler "
        "sampler at --sampling_steps from fixed noise (the same at every evaluation), scored with --reward and "
        "logged as eval/reward_* before step 1 (the baseline), every --eval_every steps and at the last step; "
        "OUTPUT_DIR/samples/eval-step-N.png shows up to 16 of them (off if unset)")
    eval_every: int = opt(0, "evaluate every N training steps (0 = only before step 1 and after the last step)")
    eval_max_prompts: int = opt(0, "evaluate the first N prompts of --eval_prompts (0 = all)")
    eval_num_images: int = opt(1, "images per evaluation prompt, each with its own fixed noise (sample index k)")


@dataclass
class LoggingOptions:
    sample_every: int = opt(50, "save a grid of rank 0's samples every N training steps (0 = never)")
    log_to: tuple[str, ...] = opt(("jsonl",), "metric sinks: jsonl (always) tensorboard wandb", nargs="+",
                            choices=("jsonl", "tensorboard", "wandb"))
    wandb_project: str = opt("flux-grpo", "W&B project when --log_to wandb")
    wandb_mode: str | None = opt(None, "W&B mode: online | offline (logs under OUTPUT_DIR/wandb; `wandb sync` "
                                       "uploads them) | disabled (default: the WANDB_MODE variable, else online)",
                                 choices=("online", "offline", "disabled"))
    progress_bar: bool = opt(True, "show a tqdm progress bar on rank 0 (--no-progress_bar to hide)")
    peak_tflops: float = opt(0.0, "peak dense TFLOP/s per device that the logged mfu divides by; bf16 datasheet "
                                  "values: H100 SXM / H200 / H800 989, A100 / A800 312, Ascend 910B ~313 (by SKU). "
                                  "0 = auto: that table by device name in a bf16 run, else a measured large-matmul "
                                  "peak in the compute dtype (always on a CPU)", type=float)


@dataclass
class SampleOptions:
    run_dir: str | None = opt(
        None, "a training run's folder OUT (its --output_dir): sample its OUT/final export (LoRA or full fine-tune, "
        "detected) with the run's base model, --h/--w, sampler (--sampling_steps, --shift, --guidance_scale, "
        "--noise_device), text length, --eval_prompts (first --eval_max_prompts, --eval_num_images each), --reward "
        "and its paths, --device and --mixed_precision, into OUT/sampled/final; flags given here win (not "
        "--lora_path/--transformer_path). Named --run_dir, not --run: torchrun refuses --run (its --run_path)")
    base: bool = opt(False, "with --run_dir: sample the run's base model with the run's settings (into "
                            "OUT/sampled/base), for --compare")
    pretrained_model_name_or_path: str | None = opt(
        None, "local diffusers FLUX folder (text encoders, VAE, and the transformer unless --transformer_path); "
        "required unless --run_dir")
    model_family: str = opt("auto", "model family adapter: auto (from the folder's model_index.json) | flux1 | sd3 | "
                                    "qwen-image | flux2 | "
                                    "package.module:Class, your own fastvideo.models.ModelFamily (docs/model-families.md)")
    lora_path: str | None = opt(None, "LoRA folder applied to the base transformer: a trainer's OUTPUT_DIR/final "
                                      "(--lora_rank > 0) or any folder FluxPipeline.load_lora_weights loads")
    transformer_path: str | None = opt(None, "full transformer folder used instead of the base one: a trainer's "
                                             "OUTPUT_DIR/final of a full fine-tune")
    prompts: str | None = opt(None, "a prompt file (one per line; encoded into OUTPUT_DIR/embeddings) or an "
                                    "embeddings manifest written by preprocess_embeddings.py; required unless "
                                    "--run_dir had --eval_prompts")
    output_dir: str = opt("outputs/samples", "folder for images/, index.jsonl, summary.json, config.json and "
                                             "compare.png; must not hold another sampling (with --run_dir: "
                                             "OUT/sampled/final, or OUT/sampled/base with --base)")
    num_inference_steps: int | None = opt(None, "Euler ODE steps (default: the family's pipeline default; FLUX.1: 28)")
    guidance_scale: float | None = opt(None, "distilled guidance value fed to models with a guidance embedding "
                                             "(default: the family's; FLUX.1-dev: 3.5; ignored by models without it)")
    cfg_scale: float | None = opt(None, "true classifier-free guidance scale, 1 = off (default: the family's pipeline "
                                        "default; FLUX.1: 1, it uses --guidance_scale)")
    negative_prompt: str | None = opt(None, "the negative prompt of --cfg_scale > 1 when --prompts is a prompt file "
                                            "(default: the family's; a manifest brings its own)")
    h: int | None = opt(None, "image height in pixels (default: the family's pipeline default; FLUX.1: 1024)")
    w: int | None = opt(None, "image width in pixels (default: the family's pipeline default; FLUX.1: 1024)")
    shift: float | None = opt(None, "static sigma shift; unset = the family pipeline's schedule (FLUX.1: dynamic "
                                    "shift, as FluxPipeline)")
    seed: int = opt(42, "image k of prompt p starts from the noise keyed (seed, p, k): same seed, same images")
    num_images_per_prompt: int = opt(1, "images per prompt (sample indices 0..N-1)")
    max_prompts: int = opt(0, "sample the first N prompts (0 = all)")
    batch_size: int = opt(4, "images per transformer call (per rank)")
    compare: str | None = opt(None, "BASE_DIR: the --output_dir of an earlier sample.py run (e.g. the base model) "
                                    "with the same prompts, --seed, steps, guidance and size: writes "
                                    "OUTPUT_DIR/compare.png, base | this model side by side on the same noise")
    compare_max_prompts: int = opt(8, "prompts (rows) in the --compare grid")
    device: str | None = opt(None, "cuda | npu | cpu (default: first available in that order)")
    mixed_precision: str = opt("auto", "transformer dtype: bf16 | fp32 | auto (bf16 on GPU/NPU, fp32 on CPU)",
                               choices=("auto", "bf16", "fp32"))
    noise_device: str = opt("cpu", "device noise is drawn on (cpu makes CUDA/NPU/CPU runs identical)")
    max_sequence_length: int | None = opt(None, "text tokens per prompt when --prompts is a prompt file (default: the "
                                                "family's; FLUX.1: 512 T5 tokens)")
    embedding_dtype: str = opt("fp32", "text-encoder dtype when --prompts is a prompt file", choices=("fp32", "bf16"))


@dataclass
class AlignmentOptions:
    record_dir: str | None = opt(
        None, "write what the run draws and computes, per step and rank, to this empty folder: every random draw by "
        "key and old log-probs (safetensors), decoded images (PNG), per-sample rewards, per-update losses and grad "
        "norms (JSONL), a manifest (versions, device, dtype, flags); for `python -m fastvideo.compare`. Draws take "
        "~4*S*L*C bytes per sample and step (8 MB at 720x720, 16 steps)")
    record_every: int = opt(1, "with --record_dir: record step 1 and every N-th step (a replay needs every step)")
    replay_dir: str | None = opt(
        None, "a --record_dir of another run (another device, dtype or code version): take its random draws instead of "
        "drawing them; keys, shapes and counts are checked every step")
    replay_images: bool = opt(False, "with --replay_dir: score the recorded images instead of this run's decoded ones "
                                     "(isolates the reward stage; the images are the recording's 8-bit PNGs)")


@dataclass
class CheckpointOptions:
    checkpointing_steps: int = opt(100, "save the full training state every N training steps (and at the end)")
    checkpoints_total_limit: int | None = opt(None, "keep only the newest N checkpoints")
    resume_from: str | None = opt(None, "'latest' (newest in OUTPUT_DIR/checkpoints) or a checkpoint folder")
    export_dtype: str = opt("auto", "dtype of the OUTPUT_DIR/final export (full transformer or LoRA): auto = the "
                                    "base model's stored dtype (bf16 for FLUX.1-dev: 2 bytes/param, 24 GB) | bf16 | "
                                    "fp16 | fp32 (the fp32 master weights: 4 bytes/param, 48 GB)",
                            choices=("auto", "bf16", "fp16", "fp32"))


@dataclass
class DPOOptions:
    beta_dpo: float = opt(2000.0, "DPO temperature beta (REFERENCE 5): 5000 = Diffusion-DPO on SD1.5, 2000 = verl-omni's "
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
        None, "the forward-process sigma of a pair: unset = the logit-normal sigma = sigmoid(u), u ~ N(0, 1) (REFERENCE "
        "5, verl-omni) | a shift S = Flow-GRPO's SD3 DPO (scripts/train_sd3_dpo.py): that u read through the training "
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
                                "(REFERENCE 6) | awm = Advantage Weighted Matching (Xue et al., arXiv:2509.25050): "
                                "the flow-matching loss ||v_theta(x_t, t) - (eps - x0)||^2 weighted by the group "
                                "advantages, PPO-clipped; the trained policy samples (--awm_off_policy: the old one)",
                         choices=("nft", "awm"))
    nft_beta: float = opt(1.0, "DiffusionNFT mixing coefficient beta of the implicit policies v+ = beta*v_theta + "
                               "(1-beta)*v_old and v- = (1+beta)*v_old - beta*v_theta (REFERENCE 6): 1.0 default, 0.1 "
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
    "guidance_scale": "FLUX.1-dev distilled guidance value fed to the model (no classifier-free guidance is ever "
                      "run: DiffusionNFT is CFG-free); ignored by models without a guidance embedding",
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


def _add_group(parser: argparse.ArgumentParser, cls: type, help_overrides: dict[str, str] | None = None,
               default_overrides: dict[str, Any] | None = None, exclude: Sequence[str] = ()) -> None:
    group = parser.add_argument_group(cls.__name__.replace("Options", "").lower())
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        meta = dict(f.metadata)
        help_text = (help_overrides or {}).get(f.name, meta["help"])
        meta.pop("help")
        flag = f"--{f.name}"
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        default = (default_overrides or {}).get(f.name, default)
        if f.type in ("bool", bool, "bool | None"):  # a switch; "bool | None": unset (None) means auto
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
            continue
        if "type" not in meta and "nargs" not in meta:
            meta["type"] = _scalar_type(f.type)
        elif "nargs" in meta and "type" not in meta:
            meta["type"] = str
        group.add_argument(flag, default=default, help=f"{help_text} (default: {default})", **meta)


def _scalar_type(annotation: Any):
    text = str(annotation)
    if "int" in text and "float" not in text:
        return int
    if "float" in text:
        return float
    return str


class FlagParser(argparse.ArgumentParser):
    """argparse, with a bad flag reported in one line (``PROG: error: ...``, exit status 2) instead of the usage text
    (hundreds of flags for a trainer), printed by rank 0 only under torchrun."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if os.environ.get("RANK", "0") == "0":
            print(f"{self.prog}: error: {message} (--help lists the flags)", file=sys.stderr, flush=True)
        raise SystemExit(2)


def build_parser(groups: Sequence[type], description: str, help_overrides: dict[str, str] | None = None,
                 default_overrides: dict[str, Any] | None = None, exclude: Sequence[str] = ()
                 ) -> argparse.ArgumentParser:
    """An argparse parser with one argument group per dataclass in ``groups`` (``help_overrides`` /
    ``default_overrides``: flag -> the help text / default a trainer needs instead of the shared one; ``exclude``:
    flags of those groups a tool does not read) and ``--config FILE`` (read by ``parse_with_config``)."""
    parser = FlagParser(description=description)
    add_config_flag(parser)
    for cls in groups:
        _add_group(parser, cls, help_overrides, default_overrides, exclude)
    return parser


# ------------------------------------------------------------------------------------------------ config files
# keys a trainer's OUT/config.json holds besides its flags (so that the file can be passed back with --config)
RECORDED_KEYS = ("algorithm", "batch_arithmetic", "config")


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    """``--config FILE``: flag values from a YAML or JSON file; flags on the command line override them."""
    parser.add_argument("--config", default=None, metavar="FILE", action="append",
                        help="YAML or JSON file of flag values (keys are flag names without --, e.g. learning_rate: "
                             "1.0e-5; lists for multi-value flags, true/false for switches, null for the default); "
                             "flags given on the command line override it. Repeatable: a later file overrides an "
                             "earlier one, and a value that conflicts with a later layer's flag (e.g. "
                             "--timestep_fraction under --sde_window_size) is dropped with a note. A run's "
                             "OUT/config.json reproduces the run; scripts/recipes/ holds the recipes (FLUX.1-dev, SD3.5-M, "
                             "Qwen-Image, FLUX.2-klein), "
                             "scripts/demos/ the demos' values")


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML (.yaml/.yml, or anything not .json) or JSON file (FileNotFoundError / ValueError)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--config {path}: no such file; pass a YAML or JSON file of flag values (a run's "
                                "OUT/config.json, or one of scripts/recipes/*.yaml)")
    text = path.read_text()
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as err:  # json.JSONDecodeError or yaml.YAMLError: both name the line
        raise ValueError(f"--config {path} does not parse: {err}") from err
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ValueError(f"--config {path} must hold a mapping of flag name -> value, got a {type(data).__name__}")
    return data


def config_tokens(parser: argparse.ArgumentParser, data: dict[str, Any], source: str) -> list[str]:
    """Command-line tokens equivalent to the config mapping ``data`` (so argparse applies its types and choices);
    ``null`` values become parser defaults. ValueError for keys that are no flag of this parser (with the nearest
    flag names), for a config written by another trainer, and for values of the wrong shape."""
    import difflib

    mine = parser.get_default("algorithm")
    if data.get("algorithm") not in (None, mine):
        raise ValueError(f"--config {source} was written by the {str(data['algorithm']).upper()} trainer; pass it to "
                         f"that trainer, or remove its 'algorithm' key to reuse its flags here")
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest not in ("help", "config")}
    unknown = [k for k in data if k.lstrip("-") not in actions and k not in RECORDED_KEYS]
    if unknown:
        hints = [f"{k} (did you mean {', '.join(m)}?)" if (m := difflib.get_close_matches(k, actions, n=2)) else k
                 for k in unknown]
        raise ValueError(f"--config {source}: unknown flag name(s) {'; '.join(hints)}; fix or remove them (keys are "
                         "this script's flag names without --: see --help)")
    tokens: list[str] = []
    for key, value in data.items():
        key = key.lstrip("-")
        if key in RECORDED_KEYS:
            continue
        action = actions[key]
        flag = action.option_strings[0]
        if value is None:
            parser.set_defaults(**{key: None})
        elif isinstance(action, argparse.BooleanOptionalAction):
            if not isinstance(value, bool):
                raise ValueError(f"--config {source}: {key} is a switch; give true or false, not {value!r}")
            tokens.append(flag if value else f"--no-{key}")
        elif action.nargs is not None:
            values = list(value) if isinstance(value, (list, tuple)) else [value]
            if not values:
                raise ValueError(f"--config {source}: {key} needs at least one value (or null for the default)")
            tokens += [flag, *(str(v) for v in values)]
        else:
            if isinstance(value, (list, tuple, dict)):
                raise ValueError(f"--config {source}: {key} takes one value, got {value!r}")
            tokens.append(f"{flag}={value}")
    return tokens


def parse_with_config(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` (default: sys.argv) with the flags of each ``--config FILE`` in front, in order, so that a later
    file overrides an earlier one and the command line overrides them all; the file paths stay in ``args.config`` (a
    list). Where a lower layer's value conflicts with a higher layer's flag (``EXCLUSIONS``), the lower one yields:
    it is reset to its default and a note says so (``resolve_layer_conflicts``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None, action="append")
    known, _ = pre.parse_known_args(argv)
    if not known.config:
        return parser.parse_args(argv)
    layers = [(f"--config {path}", config_tokens(parser, read_config_file(path), path)) for path in known.config]
    layers.append(("the command line", argv))
    args = parser.parse_args([token for _, tokens in layers for token in tokens])
    for note in resolve_layer_conflicts(parser, args, layers):
        if os.environ.get("RANK", "0") == "0":
            print(f"note: {note}", file=sys.stderr, flush=True)
    return args


def flags_given(parser: argparse.ArgumentParser, tokens: Sequence[str]) -> set[str]:
    """The flag names (dests) that ``tokens`` set explicitly, however spelled (``--h 64``, ``--h=64``, a prefix) and
    whatever their values: parsed into a namespace that already holds a marker for every flag, where argparse leaves
    the marker for each flag not given (it only fills in defaults of attributes the namespace lacks)."""
    unset = object()
    dests = {a.dest for a in parser._actions if a.dest not in ("help", "config")}  # --config appends: no marker
    given, _ = parser.parse_known_args(list(tokens), argparse.Namespace(**dict.fromkeys(dests, unset)))
    return {k for k in dests if getattr(given, k) is not unset}


@dataclass(frozen=True)
class Exclusion:
    """Two flags a validator refuses together: ``clash(args, defaults)`` says whether their values do."""

    a: str
    b: str
    clash: Callable[[argparse.Namespace, dict[str, Any]], bool]


# Every pair of flags that validate_common / validate_sampling / validate_grpo / validate_dpo / validate_nft /
# validate_sample refuse together (tests/test_flag_layers.py checks each is refused on one command line and yields
# across layers). DPO's offline mode (--preference_file) excludes each of its online-only flags.
DPO_ONLINE_ONLY = ("num_generations", "reward", "min_reward_gap", "sampler", "eta", "sde_type", "sde_window_size",
                   "sde_window_range", "sde_window_schedule", "sde_window_shift_interval", "sde_window_stride",
                   "init_same_noise", "decode_x0", "last_step", "replay_images", "reward_overlap")
EXCLUSIONS: tuple[Exclusion, ...] = (
    Exclusion("sde_window_size", "timestep_fraction",
              lambda a, d: a.sde_window_size > 0 and a.timestep_fraction is not None),
    Exclusion("sde_window_size", "sde_window_range",
              lambda a, d: a.sde_window_size == 0 and bool(changed_flags(a, ("sde_window_range",), d))),
    Exclusion("last_step", "sde_window_range",
              lambda a, d: a.last_step == "ode" and a.sde_window_size > 0 and a.sde_window_range is not None
              and a.sde_window_range[1] == a.sampling_steps),
    Exclusion("kl_beta", "sde_window_range",  # GRPO: CPS has no KL at its last step (sigma' = 0)
              lambda a, d: getattr(a, "sde_type", None) == "cps" and a.kl_beta > 0 and a.sde_window_size > 0
              and a.sde_window_range is not None and a.sde_window_range[1] == a.sampling_steps),
    Exclusion("lr_scheduler", "lr_warmup_steps", lambda a, d: a.lr_scheduler == "constant" and a.lr_warmup_steps > 0),
    Exclusion("fsdp_version", "gradient_sync", lambda a, d: a.fsdp_version == 1 and a.gradient_sync == "step"),
    Exclusion("fsdp_version", "sp_size", lambda a, d: a.fsdp_version == 1 and a.sp_size > 1),
    Exclusion("sampler", "eta", lambda a, d: a.sampler == "ode" and a.eta not in (None, 0.0)),
    Exclusion("sampler", "sde_window_size", lambda a, d: a.sampler == "ode" and a.sde_window_size > 0),
    Exclusion("sampler", "init_same_noise", lambda a, d: a.sampler == "ode" and a.init_same_noise),
    *(Exclusion("preference_file", key, lambda a, d, key=key: a.preference_file is not None
                and bool(changed_flags(a, (key,), d)))
      for key in DPO_ONLINE_ONLY),
    Exclusion("lora_path", "transformer_path", lambda a, d: a.lora_path is not None and a.transformer_path is not None),
)


def _shown(args: argparse.Namespace, key: str) -> str:
    value = getattr(args, key)
    if isinstance(value, bool):
        return f"--{key}" if value else f"--no-{key}"
    if isinstance(value, (list, tuple)):
        return f"--{key} {' '.join(map(str, value))}"
    return f"--{key} {value}"


def resolve_layer_conflicts(parser: argparse.ArgumentParser, args: argparse.Namespace,
                            layers: Sequence[tuple[str, Sequence[str]]]) -> list[str]:
    """Let a lower layer's value yield where it conflicts with a higher layer's flag (``EXCLUSIONS``): e.g. a demo's
    ``--sde_window_size 2`` (its --config file) under the user's ``--timestep_fraction 0.5`` is reset to its default,
    and then the demo's ``--sde_window_range``, which needs a size. Conflicts within one layer are left to the
    validators (an error naming both flags). Returns the notes to print."""
    dests = {a.dest for a in parser._actions}
    origin: dict[str, int] = {}  # flag -> index of the highest layer that sets it
    for index, (_, tokens) in enumerate(layers):
        for key in flags_given(parser, tokens):
            origin[key] = index
    defaults = {key: parser.get_default(key) for key in dests}
    notes = []
    reset: set[str] = set()  # values reset by a drop: they count as the dropping layer's, so a lower layer's value
    changed = True           # that clashes with the reset one is dropped too (a demo's --sde_window_range once its
    while changed:           # --sde_window_size yields to the user's --timestep_fraction)
        changed = False
        for ex in EXCLUSIONS:
            if ex.a not in dests or ex.b not in dests or ex.a not in origin or ex.b not in origin:
                continue
            if origin[ex.a] == origin[ex.b] or not ex.clash(args, defaults):
                continue
            low, high = (ex.a, ex.b) if origin[ex.a] < origin[ex.b] else (ex.b, ex.a)
            if low in reset:  # already at its default: the validators name what still clashes
                continue
            by = "reset above" if high in reset else f"from {layers[origin[high]][0]}"
            notes.append(f"{_shown(args, low)} (from {layers[origin[low]][0]}) dropped: {_shown(args, high)} ({by}) "
                         f"excludes it")
            setattr(args, low, defaults[low])
            origin[low] = origin[high]
            reset.add(low)
            changed = True
    return notes


def field_defaults(groups: Sequence[type]) -> dict[str, Any]:
    """flag name -> default value over ``groups`` (to tell which flags a user changed)."""
    return {f.name: f.default for cls in groups for f in dataclasses.fields(cls)}


def save_config(config: argparse.Namespace | dict, path: str | Path) -> None:
    """Write every flag (a Namespace or dict) to ``path`` as JSON: what the run actually used."""
    config = vars(config) if isinstance(config, argparse.Namespace) else config
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")


def changed_flags(args: argparse.Namespace, keys: Sequence[str], defaults: dict[str, Any]) -> list[str]:
    """Those of ``keys`` whose value differs from ``defaults``, counting the values validation resolves an unset flag
    to (--eta 0 of a deterministic sampler, the default --sde_window_range) as unset: a run's config.json, which holds
    resolved values, passes validation again."""
    from fastvideo.rollout import default_window_range

    def resolved_default(key: str) -> bool:
        value = getattr(args, key)
        if key == "eta":
            return value == 0.0
        if key == "sde_window_range":
            return value is not None and tuple(value) == default_window_range(args.sampling_steps)
        return False

    return [k for k in keys if getattr(args, k) != defaults[k] and not resolved_default(k)]


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _check_url_reward_options(args: argparse.Namespace) -> None:
    """--reward_timeout_s, --reward_retries, --remote_* and --judge_* in range (ValueError naming the flag)."""
    from fastvideo.rewards import check_reward_options
    from fastvideo.training import REWARD_PATH_FLAGS

    check_reward_options(**{k: getattr(args, k) for k in REWARD_PATH_FLAGS if hasattr(args, k)})


def _check_manifest(flag: str, path: str | None, model: Path, prompts: str) -> None:
    """FileNotFoundError naming the preprocessing command when ``path`` (a manifest or its folder) has no manifest."""
    if path is None:
        return
    data = Path(path)
    manifest = data / "manifest.json" if data.is_dir() else data
    if not manifest.is_file():
        raise FileNotFoundError(f"{flag} {data}: no manifest.json; run preprocess_embeddings.py --model_path {model} "
                                f"--prompt_file {prompts} --output_dir {data} first")


def check_parallel_inputs(args: argparse.Namespace) -> None:
    """--sp_size (diffusers support, heads and image tokens divisible; FSDP2), --attention_backend (a diffusers
    backend name) and --peak_tflops, from the configs alone; the world size is checked at launch."""
    from fastvideo import models, parallel
    from fastvideo.models.attention import check_attention_backend

    check_attention_backend(args.attention_backend)
    _need(args.peak_tflops >= 0, f"--peak_tflops must be >= 0 (0 = auto), got {args.peak_tflops}")
    _need(args.dist_timeout_minutes > 0, f"--dist_timeout_minutes must be > 0, got {args.dist_timeout_minutes}")
    _need(args.sp_size >= 1, f"--sp_size must be >= 1 (1 = no sequence parallelism), got {args.sp_size}")
    if args.sp_size == 1:
        return
    _need(args.fsdp_version == 2, f"--sp_size {args.sp_size} needs --fsdp_version 2 (FSDP2 shards over the dp x sp "
                                  "ranks under diffusers' context-parallel hooks)")
    model = Path(args.pretrained_model_name_or_path)
    family = models.family_for(args)
    config = json.loads((family.transformer_folder(model) / "config.json").read_text())
    geometry = family.latent_geometry(model, args.h, args.w)
    parallel.check_sequence_parallel(args.sp_size, config["num_attention_heads"], geometry.seq_len)


def check_model_inputs(args: argparse.Namespace) -> None:
    """What the model folder must hold for these flags, read from headers and configs only (no weights): the
    transformer's and VAE's safetensors are complete (ValueError naming a corrupt or truncated file), and every
    --lora_target_modules entry names a layer of the transformer (checked on a meta-device build). A component
    folder that is absent is left to its loader."""
    from fastvideo import weights

    model = Path(args.pretrained_model_name_or_path)
    for component in ("transformer", "vae"):
        if (model / component).is_dir():
            weights.check_weight_files(model / component)
    if args.lora_rank > 0 and args.lora_target_modules and (model / "transformer" / "config.json").is_file():
        from fastvideo import lora, models

        lora.check_target_modules(models.family_for(args).build_transformer(model), args.lora_target_modules)


def validate_common(args: argparse.Namespace) -> None:
    """Checks shared by all trainers: paths exist, numbers are in range."""
    _need(args.pretrained_model_name_or_path is not None,
          "--pretrained_model_name_or_path is required: a local diffusers FLUX folder "
          "(or run scripts/finetune_flux_grpo.sh without MODEL_PATH for the tiny demo)")
    model = Path(args.pretrained_model_name_or_path)
    if not (model / "model_index.json").is_file():
        raise FileNotFoundError(f"--pretrained_model_name_or_path {model}: no model_index.json there; point it at "
                                "a local diffusers FLUX folder (e.g. a FLUX.1-dev snapshot)")
    from fastvideo import models

    family = models.family_for(args)  # --model_family: ValueError naming the choices, before anything reads the folder
    _need(getattr(args, "sp_size", 1) == 1 or family.sequence_parallel,
          f"--sp_size {getattr(args, 'sp_size', 1)}: sequence parallelism is not implemented for the {family.name} "
          "family (FLUX.1 has it); run it with --sp_size 1 and shard with FSDP")
    dry_run = getattr(args, "dry_run", False)  # a plan needs no embeddings (512 text tokens are assumed)
    _need(args.data_json_path is not None or dry_run,
          "--data_json_path is required: the manifest.json written by preprocess_embeddings.py")
    if not dry_run:
        _check_manifest("--data_json_path", args.data_json_path, model, "PROMPTS")
        from fastvideo.evaluation import check_prompts_path

        check_prompts_path("--eval_prompts", args.eval_prompts)
    _need(args.reward_batch_size >= 0, f"--reward_batch_size must be >= 0 (0 = one call), got {args.reward_batch_size}")
    _check_url_reward_options(args)
    _need(getattr(args, "dry_run_world_size", None) is None or args.dry_run_world_size >= 1,
          f"--dry_run_world_size must be >= 1, got {getattr(args, 'dry_run_world_size', None)}")
    _need(args.max_train_steps >= 1, f"--max_train_steps must be >= 1, got {args.max_train_steps}")
    _need(args.max_train_seconds >= 0, f"--max_train_seconds must be >= 0 (0 = no limit), got {args.max_train_seconds}")
    _need(args.learning_rate >= 0, f"--learning_rate must be >= 0, got {args.learning_rate}")
    _need(args.lr_warmup_steps >= 0, f"--lr_warmup_steps must be >= 0, got {args.lr_warmup_steps}")
    _need(not (args.lr_warmup_steps and args.lr_scheduler == "constant"),
          f"--lr_warmup_steps {args.lr_warmup_steps} does nothing with --lr_scheduler constant; use "
          "--lr_scheduler constant_with_warmup (the default) or drop --lr_warmup_steps")
    _need(args.lora_rank >= 0, f"--lora_rank must be >= 0 (0 = full fine-tune), got {args.lora_rank}")
    check_model_inputs(args)
    check_parallel_inputs(args)
    if hasattr(args, "gradient_sync"):
        from fastvideo.parallel import resolve_gradient_sync

        resolve_gradient_sync(args.gradient_sync, args.lora_rank > 0)
        _need(not (args.gradient_sync == "step" and args.fsdp_version == 1),
              "--gradient_sync step does nothing with --fsdp_version 1 (FSDP1 reduces after every backward); use "
              "--fsdp_version 2 or drop the flag")
    _need(args.checkpointing_steps >= 1, f"--checkpointing_steps must be >= 1, got {args.checkpointing_steps}")
    _need(args.checkpoints_total_limit is None or args.checkpoints_total_limit >= 1,
          f"--checkpoints_total_limit must be >= 1, got {args.checkpoints_total_limit}")
    _need(args.max_consecutive_skips >= 0,
          f"--max_consecutive_skips must be >= 0 (0 = never stop), got {args.max_consecutive_skips}")
    _need(args.sample_every >= 0, f"--sample_every must be >= 0, got {args.sample_every}")
    _need(args.eval_every >= 0, f"--eval_every must be >= 0 (0 = first and last step only), got {args.eval_every}")
    _need(args.eval_max_prompts >= 0, f"--eval_max_prompts must be >= 0 (0 = all), got {args.eval_max_prompts}")
    _need(args.eval_num_images >= 1, f"--eval_num_images must be >= 1, got {args.eval_num_images}")
    if args.eval_reward:
        from fastvideo.rewards import parse_eval_reward_spec

        parse_eval_reward_spec(args.eval_reward, args.reward)
        _need(args.eval_prompts is not None, f"--eval_reward {args.eval_reward} scores the held-out evaluation: pass "
                                             "--eval_prompts too, or drop --eval_reward")
    _need(0.0 < args.ema_decay < 1.0, f"--ema_decay must be in (0, 1), got {args.ema_decay}")
    _need(args.train_batch_size >= 1, f"--train_batch_size must be >= 1, got {args.train_batch_size}")
    _need(args.gradient_accumulation_steps >= 0,
          f"--gradient_accumulation_steps must be >= 0, got {args.gradient_accumulation_steps}")
    _need(args.record_every >= 1, f"--record_every must be >= 1, got {args.record_every}")
    _need(not args.replay_images or args.replay_dir is not None,
          "--replay_images takes the images of a recording: pass --replay_dir DIR too")
    if args.resume_from not in (None, "latest"):
        path = Path(args.resume_from)
        if not path.is_dir():
            raise FileNotFoundError(f"--resume_from {path}: no such checkpoint folder; use 'latest' or a path "
                                    "like OUTPUT_DIR/checkpoints/step-N")


def validate_sampling(args: argparse.Namespace) -> None:
    """Sampler flags: steps, eta, window, sizes."""
    _need(args.sampling_steps >= 2, f"--sampling_steps must be >= 2, got {args.sampling_steps}")
    _need(args.h > 0 and args.w > 0, f"--h/--w must be positive, got {args.h}x{args.w}")
    if args.eta is None:
        args.eta = DEFAULT_ETA[args.sde_type]
    _need(args.eta >= 0, f"--eta must be >= 0, got {args.eta}")
    _need(args.shift is None or args.shift > 0, f"--shift must be > 0, got {args.shift}")
    _need(getattr(args, "cfg_scale", 1.0) >= 1,
          f"--cfg_scale must be >= 1 (1 = no classifier-free guidance), got {getattr(args, 'cfg_scale', 1.0)}")
    _need(args.rollout_batch_size >= 1, f"--rollout_batch_size must be >= 1, got {args.rollout_batch_size}")
    _need(args.decode_batch_size >= 0, f"--decode_batch_size must be >= 0 (0 = auto), got {args.decode_batch_size}")
    S = args.sampling_steps
    _need(0 <= args.sde_window_size <= S, f"--sde_window_size must be in [0, --sampling_steps={S}], "
                                          f"got {args.sde_window_size}")
    from fastvideo.rollout import default_window_range

    _need(args.sde_window_size > 0 or not changed_flags(args, ("sde_window_range",), {"sde_window_range": None}),
          "--sde_window_range does nothing without --sde_window_size (every step is stochastic); set "
          "--sde_window_size W or drop --sde_window_range")
    if args.sde_window_range is None:
        args.sde_window_range = default_window_range(S)
    lo, hi = args.sde_window_range
    if args.sde_window_size:
        _need(0 <= lo and hi <= S and hi - lo >= args.sde_window_size,
              f"--sde_window_range {lo} {hi} must satisfy 0 <= LO, HI <= --sampling_steps ({S}) and "
              f"HI - LO >= --sde_window_size ({args.sde_window_size})")
        _need(not (hi == S and getattr(args, "last_step", "sde") == "ode"),
              f"--sde_window_range {lo} {hi} includes the last step, which --last_step ode makes deterministic; end "
              f"the range at {S - 1} or pass --last_step sde")
    schedule = getattr(args, "sde_window_schedule", "random")
    if schedule != "random":
        _need(args.sde_window_size > 0, f"--sde_window_schedule {schedule} moves the SDE window: set --sde_window_size "
                                        "W (MixGRPO: 4 of 25 steps) or use --sde_window_schedule random")
        _need(args.sde_window_shift_interval >= 1,
              f"--sde_window_shift_interval must be >= 1 (steps per window position), got "
              f"{args.sde_window_shift_interval}")
        _need(args.sde_window_stride >= 1, f"--sde_window_stride must be >= 1, got {args.sde_window_stride}")


def validate_grpo(args: argparse.Namespace, world_size: int) -> dict[str, int]:
    """GRPO flags and the batch arithmetic; returns the derived counts printed before step 1."""
    validate_common(args)
    validate_sampling(args)
    _need(args.num_generations >= 2, f"--num_generations must be >= 2 (a group needs two samples to compare), "
                                     f"got {args.num_generations}")
    _need(args.prompts_per_step >= 1, f"--prompts_per_step must be >= 1, got {args.prompts_per_step}")
    if args.sde_window_size:
        _need(args.timestep_fraction is None,
              f"--timestep_fraction {args.timestep_fraction} does nothing with --sde_window_size "
              f"{args.sde_window_size} (the window's steps are the trained ones); drop one of them")
    elif args.timestep_fraction is None:
        args.timestep_fraction = 0.6
    _need(args.timestep_fraction is None or 0.0 < args.timestep_fraction <= 1.0,
          f"--timestep_fraction must be in (0, 1], got {args.timestep_fraction}")
    _need(args.clip_range > 0, f"--clip_range must be > 0, got {args.clip_range}")
    _need(args.adv_clip_max > 0, f"--adv_clip_max must be > 0, got {args.adv_clip_max}")
    _need(args.adv_eps > 0, f"--adv_eps must be > 0, got {args.adv_eps}")
    _need(args.kl_beta >= 0, f"--kl_beta must be >= 0, got {args.kl_beta}")
    _need(args.eta > 0, f"--eta {args.eta}: GRPO needs stochastic steps (log-prob ratios); use --eta > 0")
    if args.sde_type == "cps" and args.kl_beta > 0 and args.sde_window_size:
        _need(args.sde_window_range[1] < args.sampling_steps,
              "--sde_type cps with --kl_beta > 0: the last step has zero noise (sigma' = 0), where the KL is "
              f"undefined; keep the window before it (--sde_window_range ... {args.sampling_steps - 1})")
    _validate_policy_loss(args)
    S = args.sampling_steps
    if args.sde_window_size:
        trained = args.sde_window_size
    elif getattr(args, "timestep_selection", "random") == "first":
        trained = int(S * args.timestep_fraction)
        _need(trained >= 1, f"--timestep_fraction {args.timestep_fraction} x --sampling_steps {S} trains no "
                            "timestep (--timestep_selection first); raise one of them")
        if trained == S:  # the last step (sigma' = 0) is trained
            _need(args.last_step == "sde", f"--timestep_selection first with --timestep_fraction "
                                           f"{args.timestep_fraction} trains the last step, which --last_step ode "
                                           "makes deterministic: use a fraction below 1 (Flow-GRPO's 0.99)")
            _need(args.sde_type != "cps", "--timestep_selection first with --timestep_fraction "
                                          f"{args.timestep_fraction} trains the last step, where cps has no noise "
                                          "(sigma' = 0): use a fraction below 1 (Flow-GRPO's 0.99)")
    else:
        trained = int((S - 1) * args.timestep_fraction)
        _need(trained >= 1, f"--timestep_fraction {args.timestep_fraction} x (--sampling_steps - 1 = "
                            f"{S - 1}) trains no timestep; raise one of them")
    return _group_arithmetic(args, world_size, trained)


def _validate_policy_loss(args: argparse.Namespace) -> None:
    """--policy_loss guard/dppo: the SDE types they are defined for, and their thresholds."""
    from fastvideo.losses import policy_loss_sde_refusal

    loss = getattr(args, "policy_loss", "clip")
    why = policy_loss_sde_refusal(loss, args.sde_type)
    _need(why is None, f"{why}; use --sde_type flow_sde or --policy_loss clip")
    _need(getattr(args, "dppo_threshold", 1e-5) > 0, f"--dppo_threshold must be > 0 (verl-omni: 1e-5), got "
                                                     f"{getattr(args, 'dppo_threshold', None)}")
    if loss == "dppo" and args.sde_type == "cps" and args.sde_window_size:
        _need(args.sde_window_range[1] < args.sampling_steps,
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
    _need(total % world_size == 0,
          f"samples per step = --prompts_per_step ({args.prompts_per_step}) x --num_generations "
          f"({args.num_generations}) = {total} must be divisible by the number of ranks ({world_size}); "
          f"{_ranks_fix(args.prompts_per_step, args.num_generations, world_size)}")
    local = total // world_size
    _need(local % args.train_batch_size == 0,
          f"samples per rank ({local}) must be divisible by --train_batch_size ({args.train_batch_size}); use "
          f"--train_batch_size {_divisors(local)}")
    micro_batches = local // args.train_batch_size
    accum = args.gradient_accumulation_steps or micro_batches
    _need(micro_batches % accum == 0,
          f"micro-batches per rank ({micro_batches} = {local} samples / --train_batch_size "
          f"{args.train_batch_size}) must be divisible by --gradient_accumulation_steps ({accum}); use "
          f"--gradient_accumulation_steps {_divisors(micro_batches)} (0 = all)")
    return {"prompts_per_step": args.prompts_per_step, "samples_per_step": total, "samples_per_rank": local,
            "trained_timesteps": trained, "micro_batches_per_rank": micro_batches,
            "gradient_accumulation_steps": accum, "optimizer_steps_per_rollout": micro_batches // accum,
            "world_size": world_size}


def grpo_parser() -> argparse.ArgumentParser:
    """The GRPO trainer's flags."""
    parser = build_parser(GRPO_GROUPS, "GRPO post-training of a FLUX transformer (torchrun + FSDP).")
    parser.set_defaults(algorithm="grpo")  # recorded in config.json and every checkpoint's meta.json
    return parser


def parse_grpo_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the GRPO trainer's flags (validation happens in ``validate_grpo``)."""
    return parse_with_config(grpo_parser(), argv)


def validate_dpo(args: argparse.Namespace, world_size: int) -> dict[str, int]:
    """DPO flags (online or offline) and the batch arithmetic; returns the derived counts printed before step 1."""
    validate_common(args)
    offline = args.preference_file is not None
    defaults = {**field_defaults(DPO_GROUPS), **DPO_DEFAULTS}
    _need(args.beta_dpo > 0, f"--beta_dpo must be > 0 (2000 is the FLUX default), got {args.beta_dpo}")
    _need(args.min_reward_gap >= 0, f"--min_reward_gap must be >= 0, got {args.min_reward_gap}")
    _need(args.timesteps_per_pair >= 1, f"--timesteps_per_pair must be >= 1, got {args.timesteps_per_pair}")
    _need(args.dpo_sigma_shift is None or args.dpo_sigma_shift > 0,
          f"--dpo_sigma_shift must be > 0 (Flow-GRPO's SD3 DPO: 3), got {args.dpo_sigma_shift}")
    _need(args.ref_update_interval >= 0, f"--ref_update_interval must be >= 0 (0 = never), got "
                                         f"{args.ref_update_interval}")
    _need(args.gradient_accumulation_steps == 0,
          f"--gradient_accumulation_steps {args.gradient_accumulation_steps}: DPO makes one optimizer step per "
          "training step from all of its pairs; set the pairs per step with --prompts_per_step and drop the flag")
    _need(args.prompts_per_step >= 1, f"--prompts_per_step must be >= 1, got {args.prompts_per_step}")
    if offline:
        path = Path(args.preference_file)
        if not path.is_file():
            raise FileNotFoundError(f"--preference_file {path}: no such file; write JSON lines {{\"prompt\": ..., "
                                    "\"chosen\": IMAGE, \"rejected\": IMAGE}} (python -m fastvideo.preference makes "
                                    "one from sampled images)")
        online_only = tuple(k for k in DPO_ONLINE_ONLY if k != "replay_images")  # that one has its own message
        changed = changed_flags(args, online_only, defaults)
        _need(not args.replay_images, "offline DPO (--preference_file) scores no images: --replay_images would do "
                                      "nothing; drop it (--replay_dir alone replays the recorded noise)")
        _need(not changed, "offline DPO (--preference_file) samples nothing and scores nothing: "
                           f"{', '.join('--' + k for k in changed)} would do nothing; drop them")
        _need(args.h > 0 and args.w > 0, f"--h/--w must be positive, got {args.h}x{args.w}")
        _need(args.prompts_per_step % world_size == 0,
              f"--prompts_per_step {args.prompts_per_step} pairs per step must be divisible by the number of ranks "
              f"({world_size}); e.g. --prompts_per_step {-(-args.prompts_per_step // world_size) * world_size}")
        per_rank = args.prompts_per_step // world_size
        args.eta = 0.0  # sample grids of offline runs use the ODE sampler
        validate_sampling(args)
        return {"pairs_per_step": args.prompts_per_step, "pairs_per_rank": per_rank,
                "micro_batches_per_rank": -(-per_rank * args.timesteps_per_pair // args.train_batch_size),
                "world_size": world_size}
    if args.sampler == "ode":
        _need(args.eta in (None, 0.0), f"--eta {args.eta} does nothing with --sampler ode; pass --sampler sde to "
                                       "sample with the SDE, or drop --eta")
        _need(args.sde_window_size == 0, "--sde_window_size needs --sampler sde (ODE sampling has no noise window)")
        args.eta = 0.0
    validate_sampling(args)
    _need(args.sampler == "ode" or args.eta > 0, "--sampler sde needs --eta > 0 (or use --sampler ode)")
    _need(not (args.init_same_noise and args.sampler == "ode"),
          "--init_same_noise with --sampler ode samples the same image for every member of a prompt group (equal "
          "rewards: every pair would be skipped); drop --init_same_noise or pass --sampler sde")
    _need(args.num_generations >= 2, f"--num_generations must be >= 2 (a pair is the best and the worst image of "
                                     f"a prompt), got {args.num_generations}")
    total = args.prompts_per_step * args.num_generations
    _need(total % world_size == 0,
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
    parser = build_parser(DPO_GROUPS, "Online or offline Diffusion-DPO of a FLUX transformer (torchrun + FSDP).",
                          help_overrides=DPO_HELP, default_overrides=DPO_DEFAULTS)
    parser.set_defaults(algorithm="dpo")  # recorded in config.json and every checkpoint's meta.json
    return parser


def parse_dpo_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the DPO trainer's flags (validation happens in ``validate_dpo``)."""
    return parse_with_config(dpo_parser(), argv)


# sampling flags an ODE (old-policy) rollout has no use for
SDE_ONLY_FLAGS = ("eta", "sde_type", "sde_window_size", "sde_window_range", "sde_window_schedule",
                  "sde_window_shift_interval", "sde_window_stride", "last_step")


# flags of train_nft.py's --objective awm (NFTOptions)
AWM_FLAGS = ("awm_timesteps", "awm_weighting", "ghuber_power", "awm_clip_range", "awm_advantage_max", "old_kl_beta",
             "awm_off_policy")


def nft_uses_old_policy(args: argparse.Namespace) -> bool:
    """Whether train_nft.py keeps an old policy: always for DiffusionNFT (it samples the rollouts and anchors v+/v-),
    for AWM only as the --awm_off_policy sampler or the --old_kl_beta anchor."""
    return args.objective == "nft" or args.awm_off_policy or args.old_kl_beta > 0


def _validate_objective(args: argparse.Namespace, defaults: dict[str, Any], grid: int) -> int:
    """--objective and its own flags (``grid`` = int(S x --timestep_fraction)); returns the sigmas trained per
    sample."""
    def drop(keys: Sequence[str], why: str) -> None:
        changed = changed_flags(args, keys, defaults)
        _need(not changed, f"{', '.join('--' + k for k in changed)} {why}")

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
    _need(args.ghuber_power > 0, f"--ghuber_power must be > 0 (published runs: 0.25), got {args.ghuber_power}")
    _need(args.awm_clip_range > 0, f"--awm_clip_range must be > 0 (published runs: 1), got {args.awm_clip_range}")
    _need(args.awm_advantage_max > 0, f"--awm_advantage_max must be > 0 (AWM: 1), got {args.awm_advantage_max}")
    _need(args.old_kl_beta >= 0, f"--old_kl_beta must be >= 0 (0 = no old-policy term), got {args.old_kl_beta}")
    _need(args.awm_timesteps >= 0, f"--awm_timesteps must be >= 0 (0 = all {grid}), got {args.awm_timesteps}")
    trained = args.awm_timesteps or grid
    _need(trained <= grid, f"--awm_timesteps {trained} exceeds the int(--sampling_steps {args.sampling_steps} x "
                           f"--timestep_fraction {args.timestep_fraction}) = {grid} grid sigmas it draws one per "
                           f"stratum from: use --awm_timesteps <= {grid} or raise --timestep_fraction")
    return trained


def validate_nft(args: argparse.Namespace, world_size: int) -> dict[str, int]:
    """DiffusionNFT / AWM flags and the batch arithmetic; returns the derived counts printed before step 1."""
    validate_common(args)
    defaults = {**field_defaults(NFT_GROUPS), **NFT_DEFAULTS}
    changed = changed_flags(args, SDE_ONLY_FLAGS, defaults)
    _need(not changed, "DiffusionNFT samples with a deterministic ODE solver (--solver euler|dpm2): "
                       f"{', '.join('--' + k for k in changed)} would do nothing; drop them")
    _need(args.fsdp_version == 2,
          "train_nft.py needs --fsdp_version 2 (the default): under FSDP1 the old adapter's shards do not line up with "
          "the trained adapter's inside a flat parameter, so the old-policy update would need a gather of every unit "
          "each step")
    _need(not args.init_same_noise, "--init_same_noise with a deterministic rollout samples the same image for every "
                                    "member of a prompt group (zero advantages: nothing to learn); drop it")
    args.eta = 0.0
    validate_sampling(args)
    _need(args.num_generations >= 2, f"--num_generations must be >= 2 (a group needs two samples to compare), "
                                     f"got {args.num_generations}")
    _need(args.prompts_per_step >= 1, f"--prompts_per_step must be >= 1, got {args.prompts_per_step}")
    _need(args.nft_beta > 0, f"--nft_beta (the v+/v- mixing coefficient) must be > 0 (1.0 default, 0.1 for "
                             f"OCR / multi-reward), got {args.nft_beta}")
    _need(args.kl_beta >= 0, f"--kl_beta must be >= 0 (0 = no reference term), got {args.kl_beta}")
    _need(args.adv_clip_max > 0, f"--adv_clip_max must be > 0, got {args.adv_clip_max}")
    _need(args.adv_eps > 0, f"--adv_eps must be > 0, got {args.adv_eps}")
    _need(0.0 < args.timestep_fraction <= 1.0, f"--timestep_fraction must be in (0, 1], got {args.timestep_fraction}")
    _need(args.old_update_interval >= 1, f"--old_update_interval must be >= 1, got {args.old_update_interval}")
    grid = int(args.sampling_steps * args.timestep_fraction)
    _need(grid >= 1, f"--timestep_fraction {args.timestep_fraction} x --sampling_steps {args.sampling_steps} "
                     "trains no timestep; raise one of them")
    return _group_arithmetic(args, world_size, _validate_objective(args, defaults, grid))


def nft_parser() -> argparse.ArgumentParser:
    """The DiffusionNFT trainer's flags."""
    parser = build_parser(NFT_GROUPS, "DiffusionNFT (or --objective awm: Advantage Weighted Matching) post-training "
                                      "of a FLUX transformer (torchrun + FSDP).",
                          help_overrides=NFT_HELP, default_overrides=NFT_DEFAULTS)
    parser.set_defaults(algorithm="nft")  # recorded in config.json and every checkpoint's meta.json
    return parser


def parse_nft_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the DiffusionNFT trainer's flags (validation happens in ``validate_nft``)."""
    return parse_with_config(nft_parser(), argv)


# sample.py flags that must equal the --compare folder's (the same noise and sampler, or the grid compares nothing)
COMPARE_KEYS = ("seed", "num_inference_steps", "guidance_scale", "cfg_scale", "h", "w", "shift", "noise_device")


def fill_family_defaults(args: argparse.Namespace, family: Any) -> None:
    """sample.py's unset sampler flags (None) from the model family's pipeline defaults (``SamplerDefaults``)."""
    d = family.sampler_defaults(args.pretrained_model_name_or_path)
    for flag, value in (("num_inference_steps", d.steps), ("h", d.height), ("w", d.width),
                        ("max_sequence_length", d.max_sequence_length), ("cfg_scale", d.cfg_scale),
                        ("guidance_scale", d.guidance if d.guidance is not None else 1.0)):
        if getattr(args, flag, None) is None:
            setattr(args, flag, value)
    if getattr(args, "negative_prompt", None) is None and args.cfg_scale > 1:
        args.negative_prompt = d.negative_prompt


def validate_sample(args: argparse.Namespace) -> dict | None:
    """sample.py's flags, paths and output folder, before anything loads (ValueError / FileNotFoundError naming the
    fix); returns the --compare folder (``evaluation.read_sample_dir``) or None."""
    from fastvideo import models, weights
    from fastvideo.evaluation import check_prompts_path, read_sample_dir
    from fastvideo.rewards import parse_eval_reward_spec, parse_reward_spec

    _need(getattr(args, "run_dir", None) is not None or not getattr(args, "base", False),
          "--base samples a training run's base model: pass --run_dir OUT too (without --run_dir, leave out "
          "--lora_path and --transformer_path to sample a base model)")
    _need(args.pretrained_model_name_or_path is not None,
          "--pretrained_model_name_or_path is required (a local diffusers FLUX folder), or --run_dir OUT (a training "
          "run)")
    model = Path(args.pretrained_model_name_or_path)
    if not (model / "model_index.json").is_file():
        raise FileNotFoundError(f"--pretrained_model_name_or_path {model}: no model_index.json there; point it at a "
                                "local diffusers FLUX folder")
    family = models.family_for(args)
    fill_family_defaults(args, family)
    _need(args.prompts is not None, "--prompts is required: a prompt file (one per line) or an embeddings manifest")
    check_prompts_path("--prompts", args.prompts)
    _need(args.lora_path is None or args.transformer_path is None,
          "--lora_path and --transformer_path exclude each other: a LoRA adapts the base transformer, "
          "--transformer_path replaces it; pass one")
    if args.lora_path is not None and not any(Path(args.lora_path).glob("*.safetensors")):
        raise FileNotFoundError(f"--lora_path {args.lora_path}: no .safetensors LoRA there; pass a trainer's "
                                "OUTPUT_DIR/final written with --lora_rank > 0")
    transformer = Path(args.transformer_path or family.transformer_folder(model))
    if not (transformer / "config.json").is_file():
        raise FileNotFoundError(f"--transformer_path {transformer}: no config.json there; pass a trainer's "
                                "OUTPUT_DIR/final written by a full fine-tune (--lora_rank 0)")
    for folder in (transformer, model / "vae"):
        weights.check_weight_files(folder)
    for flag in ("num_inference_steps", "num_images_per_prompt", "batch_size", "compare_max_prompts"):
        _need(getattr(args, flag) >= 1, f"--{flag} must be >= 1, got {getattr(args, flag)}")
    _need(args.max_prompts >= 0, f"--max_prompts must be >= 0 (0 = all), got {args.max_prompts}")
    limit = family.max_sequence_length_limit()
    _need(1 <= args.max_sequence_length <= limit, f"--max_sequence_length must be in [1, {limit}], got "
                                                  f"{args.max_sequence_length}")
    _need(args.shift is None or args.shift > 0, f"--shift must be > 0, got {args.shift}")
    _need(args.cfg_scale >= 1, f"--cfg_scale must be >= 1 (1 = no classifier-free guidance), got {args.cfg_scale}")
    family.latent_geometry(model, args.h, args.w)  # ValueError naming --h/--w
    if args.reward:
        parse_reward_spec(args.reward)
    parse_eval_reward_spec(args.eval_reward, args.reward)
    _check_url_reward_options(args)
    out = Path(args.output_dir)
    if (out / "index.jsonl").exists():
        raise ValueError(f"--output_dir {out} already holds a sampling (index.jsonl); choose a new --output_dir (or "
                         "delete that one)")
    if args.compare is None:
        return None
    base = read_sample_dir(args.compare)
    diffs = {k: (base["config"].get(k), getattr(args, k)) for k in COMPARE_KEYS
             if base["config"].get(k) != getattr(args, k)}
    _need(not diffs, f"--compare {args.compare} was sampled with other settings ("
                     + "; ".join(f"--{k} {a!r} there vs {b!r} here" for k, (a, b) in diffs.items())
                     + "): pass the same values, so that both sides start from the same noise")
    _need(Path(args.compare).resolve() != out.resolve(), "--compare must name another sample.py --output_dir")
    return base
