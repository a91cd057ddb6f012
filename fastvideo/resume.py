"""Resuming a run: which checkpoint (``resolve_resume``), whether it may be resumed by this run (the same algorithm
and run-defining flags: ``RESUME_KEYS``, the fingerprint ``run_identity``), what config.json records
(``run_config``), and saving / loading the trainer's state."""
from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastvideo import checkpoint as ckpt
from fastvideo import distributed as D
from fastvideo.options import opt
from fastvideo.rewards import reward_identity

if TYPE_CHECKING:  # annotations only
    from fastvideo.policy import Policy


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
RESUME_KEYS = ("algorithm", "pretrained_model_name_or_path", "lora_rank", "lora_alpha", "lora_target_modules", "seed",
               "num_generations", "prompts_per_step", "sampling_steps", "sde_type", "eta", "shift", "h", "w",
               "guidance_scale", "sde_window_size", "sde_window_range", "init_same_noise", "decode_x0", "last_step",
               "timestep_fraction", "clip_range", "adv_clip_max", "global_std", "adv_eps", "kl_beta", "reward",
               "learning_rate", "lr_scheduler", "lr_warmup_steps", "use_ema", "ema_decay", "ema_warmup", "batch_arithmetic",
               "beta_dpo", "sampler", "min_reward_gap", "timesteps_per_pair", "ref_update_interval", "preference_file",
               "nft_beta", "adv_mode", "old_decay_schedule", "old_update_interval", "solver")
# Run-defining flags added later, with the value every earlier run had: at that value (or where the flag does not act,
# ``_inert``) a flag stays out of the checkpoint's fingerprint, so checkpoints written before it existed still resume.
LATER_RESUME_KEYS = {"sde_window_schedule": "random", "sde_window_shift_interval": 25, "sde_window_stride": 1,
                     "objective": "nft", "awm_timesteps": 0, "awm_weighting": "ghuber", "ghuber_power": 0.25,
                     "awm_clip_range": 1.0, "awm_advantage_max": 1.0, "old_kl_beta": 0.0, "awm_off_policy": False,
                     "group_std": "unbiased", "timestep_selection": "random", "policy_loss": "clip",
                     "dppo_threshold": 1e-5, "kl_form": "per_unit_time", "drop_zero_advantage": False,
                     "shuffle_micro_batches": False, "dpo_sigma_shift": None, "reward_options": None,
                     "awm_advantage_weight": "official", "awm_time_type": "discrete", "awm_strata": "official",
                     "awm_old_kl": "flow_factory", "num_frames": None, "frame_reduce": "mean", "reward_frames": 0}


def _inert(key: str, config: dict) -> bool:
    """A later run-defining flag that changes nothing in this run (its earlier value, or a setting it does not act in):
    left out of the fingerprint."""
    if config.get(key, LATER_RESUME_KEYS[key]) == LATER_RESUME_KEYS[key]:
        return True
    if key in ("sde_window_shift_interval", "sde_window_stride"):
        return config.get("sde_window_schedule", "random") == "random"
    if key == "group_std":
        return bool(config.get("global_std"))
    if key == "dppo_threshold":
        return config.get("policy_loss", "clip") != "dppo"
    if key == "kl_form":  # the two forms are equal for flow_sde
        return not config.get("kl_beta") or config.get("sde_type") == "flow_sde"
    if key.startswith("awm_") and config.get("objective", "nft") != "awm":
        return True
    if key == "awm_old_kl":  # the placements differ only for an old-policy term without a reference term
        return not (config.get("old_kl_beta", 0.0) > 0 and not config.get("kl_beta"))
    return False


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


def resume_keys(config: dict) -> tuple[str, ...]:
    """The flags a resumed run must share with its checkpoint: ``RESUME_KEYS``, ``LATER_RESUME_KEYS``, and
    --max_train_steps under a cosine schedule (its length)."""
    return RESUME_KEYS + tuple(LATER_RESUME_KEYS) + (("max_train_steps",) if config.get("lr_scheduler") == "cosine"
                                                      else ())


def _json_value(value: Any) -> Any:
    """``value`` as it reads back from JSON (tuples become lists, paths strings)."""
    return json.loads(json.dumps(list(value) if isinstance(value, tuple) else value, default=str))


def _flag_value(key: str, value: Any) -> Any:
    """A run-defining flag's value as the fingerprint compares it: ``_json_value``, and --reward without the
    addresses of its reward servers (``rewards.reward_identity``: servers may move between restarts)."""
    if key == "reward" and isinstance(value, str):
        try:
            value = reward_identity(value)
        except ValueError:  # a spec this version cannot parse: compared as written
            pass
    return _json_value(value)


def run_identity(config: dict) -> dict:
    """What a checkpoint's meta.json records of its run: the algorithm, the run-defining flags (``resume_keys``) and
    their fingerprint (SHA-256 of their JSON)."""
    flags = {k: _flag_value(k, config.get(k)) for k in resume_keys(config)
             if not (k in LATER_RESUME_KEYS and _inert(k, config))}
    digest = hashlib.sha256(json.dumps(flags, sort_keys=True).encode()).hexdigest()
    return {"algorithm": config.get("algorithm"), "config_fingerprint": digest, "run_flags": flags}


def check_resume_checkpoint(resume_dir: Path, config: dict) -> None:
    """Before anything loads: ``resume_dir`` is a complete, undamaged checkpoint (FileNotFoundError / ValueError
    otherwise), written by this trainer's algorithm with the same run-defining flags (its fingerprint, then the
    flags themselves for the message; checkpoints of format 1 carry none: the run's config.json is compared)."""
    meta = ckpt.read_meta(resume_dir)
    algorithm, mine = meta.get("algorithm"), config.get("algorithm")
    if algorithm is not None and mine is not None and algorithm != mine:
        script = {"grpo": "train_grpo_flux.py", "dpo": "train_dpo.py", "nft": "train_nft.py"}
        raise ValueError(f"{resume_dir} is a {algorithm.upper()} checkpoint but this is the {mine.upper()} trainer: "
                         f"resume it with {script.get(algorithm, algorithm)}, or start a new --output_dir")
    if "config_fingerprint" not in meta:
        check_resume_config(config, saved_run_config(resume_dir))
        return
    if meta["config_fingerprint"] != run_identity(config)["config_fingerprint"]:
        check_resume_config(config, meta.get("run_flags"))
        raise ValueError(f"cannot resume {resume_dir}: its config fingerprint differs from this run's (the flags "
                         "that define a run changed); use the original flags, or a new --output_dir")


def check_resume_config(config: dict, saved: dict | None) -> None:
    """Refuse to resume a checkpoint made with different run-defining flags (a silent mismatch loses work).

    ``config`` is what ``run_config`` returns for this run. A cosine schedule also pins --max_train_steps
    (its length); a different world size is fine as long as the batch arithmetic is the same.
    """
    if not saved:
        return
    def value(cfg: dict, k: str) -> Any:  # a later flag absent from an older run's record had its earlier value
        return _flag_value(k, cfg.get(k, LATER_RESUME_KEYS.get(k)))

    diffs = {k: (value(saved, k), value(config, k)) for k in resume_keys(config)
             if (k in saved or k in LATER_RESUME_KEYS) and value(saved, k) != value(config, k)
             and not (k in LATER_RESUME_KEYS and _inert(k, config) and _inert(k, saved))}
    if diffs:
        text = "; ".join(f"--{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diffs.items())
        raise ValueError(f"cannot resume: flags differ from the checkpoint's run ({text}); use the original "
                         "values, or a new --output_dir (OUTPUT_DIR=... with the launchers) for a new run")


def run_config(args: argparse.Namespace, counts: dict[str, int]) -> dict:
    """What config.json records: every flag plus the derived batch arithmetic (world size and its dp x sp split
    excluded: a checkpoint resumes on another layout)."""
    per_rank = ("world_size", "dp_size", "sp_size", "samples_per_rank", "pairs_per_rank", "micro_batches_per_rank",
                "gradient_accumulation_steps")
    arithmetic = {k: v for k, v in counts.items() if k not in per_rank}
    return {**vars(args), "batch_arithmetic": arithmetic}


def save_state(args: argparse.Namespace, step: int, policy: Policy, optimizer, lr_scheduler, extra: dict,
               manifest: dict | None = None, resumed_from: Path | None = None) -> Path:
    """Write OUT/checkpoints/step-N atomically (``manifest``: more meta.json entries) and prune old ones, never the
    one just written nor ``resumed_from``."""
    path = ckpt.checkpoint_path(args.output_dir, step)
    ckpt.save_checkpoint(path, model=policy.model, optimizer=optimizer, lr_scheduler=lr_scheduler,
                         extra=extra, ema=policy.ema, shadows=policy.shadows(), manifest=manifest)
    if args.checkpoints_total_limit:
        ckpt.prune_checkpoints(args.output_dir, args.checkpoints_total_limit, protect=(path, resumed_from))
    return path


def load_state(path: Path, policy: Policy, optimizer, lr_scheduler) -> dict:
    """Restore model/adapters, optimizer, LR schedule and EMA from ``path``; returns the saved extras."""
    return ckpt.load_checkpoint(path, model=policy.model, optimizer=optimizer, lr_scheduler=lr_scheduler,
                                ema=policy.ema, shadows=policy.shadows())


@dataclass
class CheckpointOptions:
    checkpointing_steps: int = opt(100, "save the full training state every N training steps (and at the end)")
    checkpoints_total_limit: int | None = opt(None, "keep only the newest N checkpoints")
    resume_from: str | None = opt(None, "'latest' (newest in OUTPUT_DIR/checkpoints) or a checkpoint folder")
    export_dtype: str = opt("auto", "dtype of the OUTPUT_DIR/final export (full transformer or LoRA): auto = the "
                                    "base model's stored dtype (bf16 for FLUX.1-dev: 2 bytes/param, 24 GB) | bf16 | "
                                    "fp16 | fp32 (the fp32 master weights: 4 bytes/param, 48 GB)",
                            choices=("auto", "bf16", "fp16", "fp32"))
