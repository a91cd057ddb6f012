"""Scaffolding the trainers share: policy + reference + EMA, optimizer and schedule, resume, export.

Each trainer script keeps only its algorithm; everything about *how* a transformer is loaded,
adapted, sharded, checkpointed and exported lives here (and in parallel.py / checkpoint.py / lora.py).
"""
from __future__ import annotations

import argparse
import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from fastvideo import checkpoint as ckpt
from fastvideo import distributed as D
from fastvideo import flux, lora, parallel, weights


def compute_dtype(mixed_precision: str, device: torch.device) -> torch.dtype | None:
    """Autocast dtype for model calls: bf16, or None for fp32 ('auto' = bf16 on GPU/NPU, fp32 on CPU)."""
    if mixed_precision == "auto":
        mixed_precision = "fp32" if device.type == "cpu" else "bf16"
    return torch.bfloat16 if mixed_precision == "bf16" else None


@dataclass
class Policy:
    """The trained transformer (sharded), how to reach the reference policy, and the EMA."""

    model: torch.nn.Module
    is_lora: bool
    frozen_ref: torch.nn.Module | None
    ema: Any | None
    config: dict

    @contextlib.contextmanager
    def reference(self) -> Iterator[torch.nn.Module]:
        """The reference policy: LoRA adapters disabled, or the frozen copy of the base weights."""
        if self.is_lora:
            with lora.disable_adapters(self.model):
                yield self.model
        else:
            assert self.frozen_ref is not None, "full fine-tune reference requested but none was kept"
            yield self.frozen_ref

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


def build_policy(args: argparse.Namespace, device: torch.device, *, need_reference: bool) -> Policy:
    """Build the transformer on the meta device, add LoRA (rank > 0) or train it whole, shard, load each rank's
    shards from the safetensors, keep a frozen reference if needed, EMA.

    No rank ever holds the whole model (DESIGN principle 8): host RAM per node is ~1x the fp32 model. The reference
    of a full fine-tune is loaded the same way, in the compute dtype (bf16 on accelerators), never copied from the
    trained weights. Build the optimizer right after this (FSDP2 swaps parameters for DTensors here).
    """
    transformer = flux.build_transformer(args.pretrained_model_name_or_path, dtype=torch.float32)
    config = dict(transformer.config)
    is_lora = args.lora_rank > 0
    adapter_init = {}
    if is_lora:
        lora.add_lora(transformer, rank=args.lora_rank, alpha=args.lora_alpha or args.lora_rank,
                      target_modules=args.lora_target_modules, init_seed=args.seed)
        adapter_init = lora.initial_adapter_weights(transformer, args.seed)  # shapes read before sharding
    transformer.train()
    shard_kwargs = dict(fsdp_version=args.fsdp_version, sharding_strategy=args.fsdp_sharding_strategy,
                        mixed_precision=_fsdp_precision(args.mixed_precision, device),
                        cpu_offload=args.use_cpu_offload)
    transformer = parallel.shard_model(transformer, gradient_checkpointing=args.gradient_checkpointing,
                                       **shard_kwargs)
    folder = flux.transformer_folder(args.pretrained_model_name_or_path)
    weights.load_safetensors_into(transformer, folder, skip=adapter_init.__contains__)
    if adapter_init:
        weights.fill_local_shards(transformer, adapter_init)
    frozen_ref = None
    if need_reference and not is_lora:
        ref_dtype = compute_dtype(args.mixed_precision, device) or torch.float32
        frozen_ref = flux.build_transformer(args.pretrained_model_name_or_path, dtype=ref_dtype)
        frozen_ref = parallel.shard_model(frozen_ref.requires_grad_(False).eval(), gradient_checkpointing=False,
                                          **shard_kwargs)
        weights.load_safetensors_into(frozen_ref, folder)
    ema = ckpt.EMA(transformer, decay=args.ema_decay, warmup=args.ema_warmup) if args.use_ema else None
    return Policy(model=transformer, is_lora=is_lora, frozen_ref=frozen_ref, ema=ema, config=config)


def check_memory_flags(args: argparse.Namespace, world_size: int, device: torch.device) -> None:
    """Refuse memory flags that cannot take effect in this job (ValueError), print those that are no-ops; on every
    rank, before any model is loaded."""
    errors, warnings_ = parallel.memory_flag_problems(world_size, device.type, args.use_cpu_offload,
                                                      compute_dtype(args.mixed_precision, device) is not None)
    if errors:
        raise ValueError("; ".join(errors))
    if D.is_main_process():
        for w in warnings_:
            print(f"warning: {w}", flush=True)


def dry_run(args: argparse.Namespace, validate: Callable[[argparse.Namespace, int], dict[str, int]],
            plan: Callable[[argparse.Namespace, dict[str, int], int, str], Any]) -> None:
    """``--dry_run``: validate the flags for the planned world size, print the batch arithmetic and the memory plan
    (``plan(args, counts, world, device_type)``), exit. Needs no process group, no GPU and no weights: a folder of
    configs (``python -m fastvideo.tiny --preset flux-dev-config``) is enough."""
    rank, launched_world = D.launch_env()
    world = args.dry_run_world_size or launched_world
    device_type = (args.device or D.pick_device_type()).split(":")[0]
    counts = validate(args, world)
    if rank != 0:
        return
    print("batch arithmetic: " + ", ".join(f"{k}={v}" for k, v in counts.items()), flush=True)
    print(plan(args, counts, world, device_type).format(args.dry_run_device_memory_gb), flush=True)


def _fsdp_precision(mixed_precision: str, device: torch.device) -> str:
    return "bf16" if compute_dtype(mixed_precision, device) == torch.bfloat16 else "fp32"


def build_optimizer(policy: Policy, args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters only (LoRA adapters, or the whole transformer)."""
    params = policy.trainable_parameters()
    if not params:
        raise ValueError("no trainable parameters: check --lora_rank / --lora_target_modules")
    return torch.optim.AdamW(params, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                             eps=args.adam_epsilon, weight_decay=args.weight_decay)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, args: argparse.Namespace, total_optimizer_steps: int):
    """constant_with_warmup | cosine | constant, stepped once per optimizer step."""
    from diffusers.optimization import get_scheduler

    return get_scheduler(args.lr_scheduler, optimizer=optimizer, num_warmup_steps=args.lr_warmup_steps,
                         num_training_steps=total_optimizer_steps)


def resolve_resume(args: argparse.Namespace) -> Path | None:
    """The checkpoint folder to resume from, or None for a fresh run.

    'latest' with no checkpoint yet is a fresh run; a fresh run (no --resume_from) into an --output_dir that
    already holds checkpoints is refused, so finished work is never overwritten by accident.
    """
    if args.resume_from is None:
        existing = ckpt.latest_checkpoint(args.output_dir)
        if existing is not None:
            raise ValueError(f"--output_dir {args.output_dir} already holds a run (checkpoint {existing.name}); "
                             "pass --resume_from latest to continue it, or choose a new --output_dir")
        return None
    if args.resume_from == "latest":
        found = ckpt.latest_checkpoint(args.output_dir)
        if found is None and D.is_main_process():
            print(f"--resume_from latest: no checkpoint in {args.output_dir}/checkpoints yet; starting fresh")
        return found
    return Path(args.resume_from)


# Flags a resumed run must share with the checkpoint's run, or it would not continue the same run.
RESUME_KEYS = ("pretrained_model_name_or_path", "lora_rank", "lora_alpha", "lora_target_modules", "seed",
               "num_generations", "prompts_per_step", "sampling_steps", "sde_type", "eta", "shift", "h", "w",
               "guidance_scale", "sde_window_size", "sde_window_range", "init_same_noise", "decode_x0", "last_step",
               "timestep_fraction", "clip_range", "adv_clip_max", "global_std", "adv_eps", "kl_beta", "reward",
               "learning_rate", "lr_scheduler", "lr_warmup_steps", "use_ema", "ema_decay", "ema_warmup", "batch_arithmetic")


def saved_run_config(resume_dir: Path) -> dict | None:
    """The config.json of the run that wrote ``resume_dir`` (OUT/checkpoints/step-N -> OUT/config.json)."""
    path = Path(resume_dir).resolve().parents[1] / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def check_resume_step(resume_dir: Path, max_train_steps: int) -> int:
    """The step of ``resume_dir`` (``step-N``); refuses a --max_train_steps below it before anything is loaded (the
    run is already past it: nothing would be trained and the old model silently re-exported)."""
    step = ckpt.checkpoint_step(resume_dir)
    if step > max_train_steps:
        raise ValueError(f"--max_train_steps {max_train_steps} is below the step of the checkpoint to resume "
                         f"({resume_dir.name}): raise --max_train_steps above {step} to train on, or use the export "
                         f"of that run in {Path(resume_dir).resolve().parents[1] / 'final'}")
    if step == max_train_steps and D.is_main_process():
        print(f"the run already reached --max_train_steps {max_train_steps} ({resume_dir.name}): nothing to train, "
              "re-exporting final/", flush=True)
    return step


def check_resume_config(config: dict, saved: dict | None) -> None:
    """Refuse to resume a checkpoint made with different run-defining flags (a silent mismatch loses work).

    ``config`` is what ``run_config`` returns for this run. A cosine schedule also pins --max_train_steps
    (its length); a different world size is fine as long as the batch arithmetic is the same.
    """
    if not saved:
        return
    keys = RESUME_KEYS + (("max_train_steps",) if config.get("lr_scheduler") == "cosine" else ())
    norm = lambda v: list(v) if isinstance(v, tuple) else v  # noqa: E731  (JSON turns tuples into lists)
    diffs = {k: (saved.get(k), config.get(k)) for k in keys
             if k in saved and json.loads(json.dumps(norm(saved.get(k)), default=str)) !=
             json.loads(json.dumps(norm(config.get(k)), default=str))}
    if diffs:
        text = "; ".join(f"--{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diffs.items())
        raise ValueError(f"cannot resume: flags differ from the checkpoint's run ({text}); use the original "
                         "values, or a new --output_dir (OUTPUT_DIR=... with the launchers) for a new run")


def run_config(args: argparse.Namespace, counts: dict[str, int]) -> dict:
    """What config.json records: every flag plus the derived batch arithmetic (world size excluded)."""
    per_rank = ("world_size", "samples_per_rank", "micro_batches_per_rank", "gradient_accumulation_steps")
    arithmetic = {k: v for k, v in counts.items() if k not in per_rank}
    return {**vars(args), "batch_arithmetic": arithmetic}


def save_state(args: argparse.Namespace, step: int, policy: Policy, optimizer, lr_scheduler, extra: dict) -> Path:
    """Write OUT/checkpoints/step-N atomically and prune old ones."""
    path = Path(args.output_dir) / "checkpoints" / f"step-{step}"
    ckpt.save_checkpoint(path, model=policy.model, optimizer=optimizer, lr_scheduler=lr_scheduler,
                         extra=extra, ema=policy.ema)
    if args.checkpoints_total_limit:
        ckpt.prune_checkpoints(args.output_dir, args.checkpoints_total_limit)
    return path


def load_state(path: Path, policy: Policy, optimizer, lr_scheduler) -> dict:
    """Restore model/adapters, optimizer, LR schedule and EMA from ``path``; returns the saved extras."""
    return ckpt.load_checkpoint(path, model=policy.model, optimizer=optimizer, lr_scheduler=lr_scheduler,
                                ema=policy.ema)


def export_final(args: argparse.Namespace, policy: Policy) -> Path:
    """OUT/final: a diffusers LoRA (FluxPipeline.load_lora_weights) or a full transformer folder
    (FluxTransformer2DModel.from_pretrained); the EMA weights when --use_ema."""
    out = Path(args.output_dir) / "final"
    swap = policy.ema.swap_into(policy.model) if policy.ema is not None else contextlib.nullcontext()
    with swap:
        if policy.is_lora:  # collective: every rank gathers, rank 0 writes (with lora_alpha as metadata)
            lora.save_lora_for_diffusers(policy.model, out)
        else:
            lora.save_transformer_for_diffusers(policy.model, policy.config, out)
    D.barrier()
    if D.is_main_process():
        (out / "training_args.json").write_text(json.dumps(vars(args), indent=2, default=str) + "\n")
    return out
