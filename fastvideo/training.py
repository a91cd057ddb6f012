"""Scaffolding the trainers share: policy + reference + EMA, optimizer and schedule, resume, export.

Each trainer script keeps only its algorithm; everything about *how* a transformer is loaded,
adapted, sharded, checkpointed and exported lives here (and in parallel.py / checkpoint.py / lora.py).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from fastvideo import checkpoint as ckpt
from fastvideo import distributed as D
from fastvideo import devices, errors, flops, lora, models, parallel, preemption, weights


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
    ref_snapshot: Any | None = None  # ckpt.EMA with decay 0: a sharded copy of the trained weights (updated reference)
    old: OldPolicy | None = None  # DiffusionNFT's old policy (adapter "old" or a sharded copy)

    @contextlib.contextmanager
    def reference(self) -> Iterator[torch.nn.Module]:
        """The reference policy (use under ``torch.no_grad()``, never between a forward and its backward): the
        snapshot of the trained weights if one is kept (``update_reference``), else LoRA adapters disabled, or the
        frozen copy of the base weights."""
        if self.ref_snapshot is not None:
            with self.ref_snapshot.swap_into(self.model):
                yield self.model
        elif self.is_lora:
            with lora.disable_adapters(self.model):
                yield self.model
        else:
            assert self.frozen_ref is not None, "full fine-tune reference requested but none was kept"
            yield self.frozen_ref

    def update_reference(self) -> None:
        """Copy the current trained weights into the reference snapshot (local shards only, no communication)."""
        assert self.ref_snapshot is not None, "build_policy(..., ref_snapshot=True) keeps the snapshot"
        self.ref_snapshot.capture()

    def shadows(self) -> dict[str, Any]:
        """Sharded weight copies a checkpoint must hold besides the model and EMA."""
        found = {"reference": self.ref_snapshot, "old": self.old}
        return {name: obj for name, obj in found.items() if obj is not None}

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


class OldPolicy(ckpt.EMA):
    """DiffusionNFT's old policy v_old (REFERENCE §6): it samples the rollouts and anchors the implicit v⁺/v⁻.

    LoRA: a second, frozen adapter ``old`` in the same sharded model (``active()`` switches to it without touching
    ``requires_grad``, so only ``default`` is trained and in the optimizer). Full fine-tune: a second sharded
    transformer with fp32 master weights (computed in the compute dtype through FSDP's mixed precision; fp32 because
    ``old <- d*old + (1-d)*theta`` with d up to 0.999 moves by ~1e-3 of a difference, below bf16's resolution).
    It is a ``checkpoint.EMA`` of the trained weights whose shadow *is* the old weights' local shards (FSDP2 shards
    both alike), so ``update(decay)`` is one local ``lerp`` with no communication, and the checkpoint saves and
    restores it as the shadow ``old`` exactly like the EMA.
    """

    ADAPTER = "old"

    def __init__(self, model: torch.nn.Module, old_model: torch.nn.Module | None = None) -> None:
        self.model, self.old_model = model, old_model
        named = parallel.named_trainable_parameters(model)
        source = dict(parallel.clean_named_parameters(old_model if old_model is not None else model))
        rename = (lambda n: n) if old_model is not None else (lambda n: n.replace(".default.", f".{self.ADAPTER}."))
        missing = [rename(n) for n, _ in named if rename(n) not in source]
        if missing:
            raise ValueError(f"the old policy lacks {len(missing)} of the trained parameters, e.g. {missing[:2]}")
        if old_model is not None:
            parallel.reshard(old_model)
        with torch.no_grad():
            shadow = [ckpt._local(source[rename(n)]).detach() for n, _ in named]
        super().__init__(model, decay=0.0, warmup=False, shadow=shadow)

    @contextlib.contextmanager
    def active(self) -> Iterator[torch.nn.Module]:
        """The model computing v_old (use under ``torch.no_grad()``)."""
        if self.old_model is not None:
            yield self.old_model
        else:
            with lora.use_adapter(self.model, self.ADAPTER):
                yield self.model

    def update(self, decay: float | None = None) -> None:
        """``old <- decay*old + (1-decay)*theta`` on every local shard (after resharding what forwards left
        gathered, so the next old-policy forward gathers the updated shards)."""
        parallel.reshard(self.model)
        if self.old_model is not None:
            parallel.reshard(self.old_model)
        super().update(decay)


def build_policy(args: argparse.Namespace, device: torch.device, *, need_reference: bool,
                 ref_snapshot: bool = False, old_policy: bool = False) -> Policy:
    """Build the transformer on the meta device, add LoRA (rank > 0) or train it whole, shard, load each rank's
    shards from the safetensors, keep a frozen reference if needed, EMA.

    ``ref_snapshot``: the reference is instead a sharded fp32 copy of the trained weights (adapters for LoRA), equal
    to the loaded weights until ``Policy.update_reference()`` (online DPO's ``--ref_update_interval``); swapped into
    the model for reference passes, so no second model is built. ``old_policy``: DiffusionNFT's ``OldPolicy``, equal
    to the trained weights at the start (LoRA: a frozen adapter ``old`` initialised like ``default``; full fine-tune:
    a second sharded fp32 transformer loaded from the folder).

    No rank ever holds the whole model (DESIGN principle 8): host RAM per node is ~1x the fp32 model. The reference
    of a full fine-tune is loaded the same way, in the compute dtype (bf16 on accelerators), never copied from the
    trained weights. Build the optimizer right after this (FSDP2 swaps parameters for DTensors here). On an Ascend NPU
    every transformer gets float32 rotary embeddings and the fused attention (the family's ``prepare_for_device``).
    """
    family = models.family_for(args)
    transformer = family.build_transformer(args.pretrained_model_name_or_path, dtype=torch.float32)
    config = dict(transformer.config)
    is_lora = args.lora_rank > 0
    adapter_init = {}
    if is_lora:
        lora.add_lora(transformer, rank=args.lora_rank, alpha=args.lora_alpha or args.lora_rank,
                      target_modules=args.lora_target_modules, init_seed=args.seed)
        adapter_init = lora.initial_adapter_weights(transformer, args.seed)  # shapes read before sharding
        if old_policy:  # a frozen second adapter starting equal to "default" (the same makers under its names)
            lora.add_lora(transformer, rank=args.lora_rank, alpha=args.lora_alpha or args.lora_rank,
                          target_modules=args.lora_target_modules, init_seed=args.seed,
                          adapter_name=OldPolicy.ADAPTER, trainable=False)
            adapter_init.update({k.replace(".default.", f".{OldPolicy.ADAPTER}."): make
                                 for k, make in list(adapter_init.items())})
    transformer.train()
    shard_kwargs = dict(fsdp_version=args.fsdp_version, sharding_strategy=args.fsdp_sharding_strategy,
                        mixed_precision=_fsdp_precision(args.mixed_precision, device),
                        cpu_offload=args.use_cpu_offload, compile=args.compile, sp_size=args.sp_size)
    transformer = parallel.shard_model(transformer, gradient_checkpointing=args.gradient_checkpointing,
                                       **shard_kwargs)
    folder = family.transformer_folder(args.pretrained_model_name_or_path)
    weights.load_safetensors_into(transformer, folder, skip=adapter_init.__contains__)
    if adapter_init:
        weights.fill_local_shards(transformer, adapter_init)
    frozen_ref = None
    if need_reference and not is_lora and not ref_snapshot:
        ref_dtype = compute_dtype(args.mixed_precision, device) or torch.float32
        frozen_ref = family.build_transformer(args.pretrained_model_name_or_path, dtype=ref_dtype)
        frozen_ref = parallel.shard_model(frozen_ref.requires_grad_(False).eval(), gradient_checkpointing=False,
                                          **shard_kwargs)
        weights.load_safetensors_into(frozen_ref, folder)
    old = None
    if old_policy:
        old_model = None
        if not is_lora:  # fp32 master weights like the trained copy, so both shard alike (see OldPolicy)
            old_model = family.build_transformer(args.pretrained_model_name_or_path, dtype=torch.float32)
            old_model = parallel.shard_model(old_model.requires_grad_(False).eval(), gradient_checkpointing=False,
                                             **shard_kwargs)
            weights.load_safetensors_into(old_model, folder)
        old = OldPolicy(transformer, old_model)
    param_dtype = compute_dtype(args.mixed_precision, device) or torch.float32  # FSDP's param_dtype in the forward
    for model in (transformer, frozen_ref, old.old_model if old is not None else None):
        done = family.prepare_for_device(model, device, param_dtype=param_dtype,
                                         attention_backend=args.attention_backend) if model is not None else []
        if done and D.is_main_process() and model is transformer:
            print("device adaptations: " + "; ".join(done), flush=True)
    ema = ckpt.EMA(transformer, decay=args.ema_decay, warmup=args.ema_warmup) if args.use_ema else None
    snapshot = ckpt.EMA(transformer, decay=0.0, warmup=False) if ref_snapshot else None
    return Policy(model=transformer, is_lora=is_lora, frozen_ref=frozen_ref, ema=ema, config=config,
                  ref_snapshot=snapshot, old=old)


def run_main(args: argparse.Namespace, validate: Callable[[argparse.Namespace, int], dict[str, int]],
             plan: Callable[..., Any], train: Callable[[argparse.Namespace], None]) -> None:
    """A trainer's entry point: with --dry_run print the batch arithmetic and the per-rank memory plan from the
    configs alone (``dry_run``), with --check_only check the flags and inputs (``check_only``); otherwise
    ``train(args)`` in the process group torchrun describes (``launch``). A bad flag or input found before the models
    load is one line and exit status 2 (``errors``)."""
    with errors.exit_on_usage_error():
        if args.dry_run or args.check_only:
            with errors.checking():
                return dry_run(args, validate, plan) if args.dry_run else check_only(args, validate)
        launch(args, train)


def check_only(args: argparse.Namespace, validate: Callable[[argparse.Namespace, int], dict[str, int]]) -> None:
    """``--check_only``: in one process, before torchrun starts (the launchers), what every rank would check first:
    the flags and batch arithmetic for --dry_run_world_size ranks (default: this job's), the memory flags, a writable
    --output_dir, the --reward spec, and the checkpoint --resume_from names (complete, same algorithm and run-defining
    flags). Loads nothing; the checks that need the job (the memory plan against the device, the reward's files and
    prompts, the embeddings' encoders) run at its start."""
    from fastvideo.rewards import parse_reward_spec

    _, launched_world = D.launch_env()
    world = args.dry_run_world_size or launched_world
    device = torch.device((args.device or D.pick_device_type()).split(":")[0])
    counts = with_sp_counts(validate(args, D.data_parallel_size(args.sp_size, world)), args.sp_size)
    resolve_device_defaults(args, device.type)
    check_memory_flags(args, world, device)
    if args.reward:
        parse_reward_spec(args.reward)
    check_output_dir(args.output_dir)
    resume_dir = resolve_resume(args)
    if resume_dir is not None:
        check_resume_step(resume_dir, args.max_train_steps)
        check_resume_checkpoint(resume_dir, run_config(args, counts))


def launch(args: argparse.Namespace, train: Callable[[argparse.Namespace], None]) -> None:
    """Run ``train(args)`` in the process group torchrun describes (world size 1 without torchrun); an error on one
    rank ends every rank within seconds, with its message (``distributed.fail_fast``); SIGTERM/SIGINT end the run
    after the current step with a checkpoint (``preemption``)."""
    from fastvideo.seeding import set_deterministic

    switches = set_deterministic(args.deterministic)  # before the process group and device context start (env vars)
    D.init_distributed(args.device, timeout_minutes=args.dist_timeout_minutes, cpu_collectives=args.use_cpu_offload)
    if switches and D.is_main_process():
        print("--deterministic: " + "; ".join(switches), flush=True)
    with preemption.stop_on_signals(), D.fail_fast(), errors.checking():  # checking until Run.load_models
        train(args)
    D.cleanup()


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
    counts = with_sp_counts(validate(args, D.data_parallel_size(args.sp_size, world)), args.sp_size)
    if rank != 0:
        return
    resolve_device_defaults(args, device_type)  # as the run on that device type would
    print("batch arithmetic: " + ", ".join(f"{k}={v}" for k, v in counts.items()), flush=True)
    print(plan(args, counts, world, device_type).format(args.dry_run_device_memory_gb), flush=True)


def resolve_device_defaults(args: argparse.Namespace, device_type: str) -> None:
    """Resolve, in place and once, the flags whose default depends on the device type: --gradient_checkpointing
    (auto: on for a full fine-tune on a GPU/NPU) and --decode_batch_size (auto: decode calls planned within 4 GiB on a
    GPU/NPU, a whole rollout micro-batch on the CPU); see ``memory.resolve_gradient_checkpointing`` /
    ``memory.resolve_decode_batch_size``. Called before the memory plan, so that the plan, ``build_policy``,
    ``rollout_config`` and config.json all see the resolved values (``start_run``, and ``dry_run`` for its device)."""
    from fastvideo import memory

    args.gradient_checkpointing = memory.resolve_gradient_checkpointing(args.gradient_checkpointing, args.lora_rank,
                                                                        device_type)
    args.decode_batch_size = memory.resolve_decode_batch_size(args, device_type)


def check_memory_plan(args: argparse.Namespace, counts: dict[str, int], plan: Callable[..., Any], world_size: int,
                      device_type: str, device_memory_bytes: int | None) -> None:
    """The memory gate before any model loads, a collective: on a GPU/NPU rank 0 computes the per-rank plan
    (``plan(args, counts, world_size, device_type)``, what --dry_run prints) and prints its one-line summary against
    the smallest ``device_memory_bytes`` of the job's ranks; every rank then raises the same ValueError naming the
    fixes when it does not fit (--ignore_memory_plan: a warning instead; ``memory.check_plan_fits``). Skipped on the
    CPU. A plan that cannot be computed is reported, not enforced: it is an estimate, never a reason to stop a run."""
    from fastvideo import memory

    if device_type not in devices.ACCELERATOR_TYPES:
        return
    result: Any = None
    if D.is_main_process():
        try:
            result = plan(args, counts, world_size, device_type, compare_checkpointing=False)
        except Exception as err:  # noqa: BLE001 (any planner failure: warn below, on rank 0)
            result = f"{type(err).__name__}: {err}"
    gathered = D.all_gather_object((result, device_memory_bytes))
    result = gathered[0][0]
    sizes = [size for _, size in gathered if size]
    if isinstance(result, str):
        if D.is_main_process():
            print(f"warning: the memory plan could not be computed ({result}); the run starts unchecked", flush=True)
        return
    line = memory.check_plan_fits(result, device_type, min(sizes) if sizes else None, ignore=args.ignore_memory_plan)
    if line and D.is_main_process():
        print(line, flush=True)


def with_sp_counts(counts: dict[str, int], sp_size: int) -> dict[str, int]:
    """The batch arithmetic (computed over ``dp_size`` replicas) relabelled for --sp_size > 1: ``dp_size``,
    ``sp_size`` and the real ``world_size``; the ``samples_per_rank`` are then each SP group's."""
    if sp_size == 1:
        return counts
    return {**counts, "dp_size": counts["world_size"], "sp_size": sp_size, "world_size": counts["world_size"] * sp_size}


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
                     "shuffle_micro_batches": False, "dpo_sigma_shift": None}


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
        from fastvideo.rewards import reward_identity

        try:
            value = reward_identity(value)
        except ValueError:  # a spec this version cannot parse: compared as written
            pass
    return _json_value(value)


def run_identity(config: dict) -> dict:
    """What a checkpoint's meta.json records of its run: the algorithm, the run-defining flags (``resume_keys``) and
    their fingerprint (SHA-256 of their JSON)."""
    import hashlib

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


def export_final(args: argparse.Namespace, policy: Policy) -> Path:
    """OUT/final: a diffusers LoRA (FluxPipeline.load_lora_weights) or a full transformer folder
    (FluxTransformer2DModel.from_pretrained) in ``--export_dtype`` (auto: the base model's dtype), recorded as
    ``exported_dtype`` in its training_args.json; the EMA weights when --use_ema.

    Every rank gathers, rank 0 casts and writes (minutes for a 24 GB FLUX.1-dev transformer), and the others wait
    for it in ``distributed.store_barrier``, which no collective timeout cuts short; an error on rank 0 still ends
    every rank (``distributed.fail_fast``)."""
    out = Path(args.output_dir) / "final"
    dtype = lora.export_dtype(args.export_dtype, args.pretrained_model_name_or_path, models.spec_of(args))
    swap = policy.ema.swap_into(policy.model) if policy.ema is not None else contextlib.nullcontext()
    with swap:
        if policy.is_lora:  # collective: every rank gathers, rank 0 writes (with lora_alpha as metadata)
            lora.save_lora_for_diffusers(policy.model, out, dtype=dtype)
        else:
            lora.save_transformer_for_diffusers(policy.model, policy.config, out, dtype=dtype)
    if D.is_main_process():
        name = {v: k for k, v in lora.EXPORT_DTYPES.items()}.get(dtype, str(dtype))
        record = {**vars(args), "exported_dtype": name}
        (out / "training_args.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    D.store_barrier("export")
    return out


# ------------------------------------------------------------------------------------------------ the run scaffold
REWARD_PATH_FLAGS = ("hps_checkpoint", "hps_model", "pickscore_model", "pickscore_processor", "clip_checkpoint",
                     "clip_model", "aesthetic_checkpoint", "aesthetic_clip_checkpoint", "aesthetic_clip_model",
                     # the URL rewards' options (remote:URL, vlm_judge:URL): build_reward's keywords too
                     "reward_timeout_s", "reward_retries", "remote_batch_size", "remote_max_concurrency", "judge_model",
                     "judge_template", "judge_score", "judge_max_score", "judge_max_concurrency")


def rollout_config(args: argparse.Namespace) -> Any:
    """The batched sampler's settings from the sampling flags (shared by every trainer that samples); the decode
    micro-batch is --decode_batch_size as ``resolve_device_defaults`` resolved it (``start_run``; 0 = one call per
    rollout micro-batch, the CPU's auto)."""
    from fastvideo.rollout import RolloutConfig

    return RolloutConfig(height=args.h, width=args.w, sampling_steps=args.sampling_steps, sde_type=args.sde_type,
                         eta=args.eta, shift=args.shift, guidance=args.guidance_scale,
                         cfg_scale=getattr(args, "cfg_scale", 1.0), sde_window_size=args.sde_window_size,
                         sde_window_range=tuple(args.sde_window_range),
                         sde_window_schedule=getattr(args, "sde_window_schedule", "random"),
                         sde_window_shift_interval=getattr(args, "sde_window_shift_interval", 1),
                         sde_window_stride=getattr(args, "sde_window_stride", 1),
                         init_same_noise=args.init_same_noise, decode_x0=args.decode_x0,
                         batch_size=args.rollout_batch_size, decode_batch_size=args.decode_batch_size,
                         last_step=args.last_step,
                         solver=getattr(args, "solver", "euler"))


class RewardFailed(RuntimeError):
    """The reward raised on some rank while scoring samples; raised on every rank alike (``Run.gather_rewards``), with
    the failing rank and its error in the message."""


@dataclass
class PendingRewards:
    """One rollout's scoring under --reward_overlap (``Run.pending_rewards``): ``rollout`` calls it with each decoded
    micro-batch (its positions ``mb`` in the rank's batch and its images), and it hands this rank's ``share`` of them
    with their prompts to the scorer's thread and returns at once; ``Run.score_rollout`` joins the scores."""

    scorer: Any  # rewards.overlap.OverlapScorer
    prompts: list[str]  # this rank's, in sample order
    share: slice  # the positions this rank scores (its sequence-parallel group's share; all without --sp_size)
    mine: int  # how many of the scores it sends (0: an empty share scored one image for the reward's keys)

    def __call__(self, mb: slice, images: torch.Tensor) -> None:
        """Submit the images of micro-batch ``mb`` that lie in this rank's share."""
        lo, hi = max(mb.start, self.share.start), min(mb.stop, self.share.stop)
        if lo < hi:
            self.scorer.submit(images[lo - mb.start:hi - mb.start], self.prompts[lo:hi])


@dataclass
class Run:
    """Everything a trainer sets up the same way, in the order it must happen (``start_run`` -> ``load_models`` ->
    ``resume`` -> per step ``optimizer_step`` / ``end_step`` -> ``finish``), so each script keeps only its algorithm.

    ``state`` holds the trainer's resumable objects with ``state_dict``/``load_state_dict`` (e.g. the sampler), given
    to ``resume``; they are checkpointed with the model, optimizer, schedule, EMA, step and every rank's RNG state.
    """

    args: argparse.Namespace
    dist: D.DistInfo
    counts: dict[str, int]
    config: dict
    resume_dir: Path | None
    noise: Any
    amp_dtype: torch.dtype | None
    state: dict[str, Any] = field(default_factory=dict)
    reward_fn: Callable | None = None
    scorer: Any = None  # rewards.overlap.OverlapScorer of --reward's RewardFn with --reward_overlap, else None
    eval_reward_fn: Callable | None = None  # RewardFn of --eval_reward (held-out evaluation only), or None
    policy: Policy | None = None
    optimizer: torch.optim.Optimizer | None = None
    lr_scheduler: Any = None
    vae: torch.nn.Module | None = None
    sync_every_backward: bool = True
    memory_baseline: float = 0.0
    start_step: int = 0
    skipped_updates: int = 0
    logger: Any = None
    bar: Any = None
    geometry: Any = None
    eval_dataset: Any = None  # EmbeddingDataset of --eval_prompts
    train_seconds: float = 0.0  # wall-clock of training steps so far (evaluation excluded; resumed from checkpoints)
    step_started: float = 0.0
    consecutive_skips: int = 0  # updates skipped in a row (non-finite gradient norm); see --max_consecutive_skips
    dropped_samples: int = 0  # samples dropped for a non-finite reward so far (--nonfinite_reward drop)
    preempted: tuple[int, str] | None = None  # (step, signal) when a stop signal ended the run early
    recorder: Any = None  # record.Recorder with --record_dir
    replay: Any = None  # record.Replay with --replay_dir
    step_grad_norms: list[float] = field(default_factory=list)  # this step's optimizer steps (for the recording)

    @property
    def device(self) -> torch.device:
        return self.dist.device

    @property
    def out(self) -> Path:
        return Path(self.args.output_dir)

    def sampling_inputs(self) -> tuple[Any, Any, Any]:
        """What every trainer that samples reads before any model loads: ``(latent geometry, EmbeddingDataset checked
        against the model's text encoders and the reward's prompt grammar, RolloutConfig)``; also opens and checks
        --eval_prompts (a prompt file is encoded first, with the training data's text length)."""
        from fastvideo.data import EmbeddingDataset
        from fastvideo.rewards import check_reward_prompts

        args = self.args
        family = models.family_for(args)
        geometry = family.latent_geometry(args.pretrained_model_name_or_path, args.h, args.w)
        guided = getattr(args, "cfg_scale", 1.0) > 1
        dataset = EmbeddingDataset(args.data_json_path).use(family, negative=guided)
        dataset.check_encoders(args.pretrained_model_name_or_path, models.spec_of(args))
        check_reward_prompts(args.reward, dataset.prompts, f"--data_json_path {args.data_json_path}",
                             judge_score=getattr(args, "judge_score", "yes_no"))
        sp = getattr(args, "sp_size", 1)
        if sp > 1 and dataset.max_sequence_length % sp:  # the evaluation prompts share this length (below)
            from fastvideo.models.flux import text_length_refusal

            raise ValueError(text_length_refusal(dataset.max_sequence_length, sp))
        if args.eval_prompts is not None:
            from fastvideo.evaluation import prompt_manifest
            from fastvideo.rewards import check_reward_paths

            eval_reward = getattr(args, "eval_reward", None)
            if eval_reward:  # its files, before the evaluation prompts are encoded
                check_reward_paths(eval_reward, **{k: getattr(args, k) for k in REWARD_PATH_FLAGS})

            # a prompt file is encoded once, with the training data's length and dtype; a manifest is used as it is
            manifest = prompt_manifest(args.eval_prompts, args.pretrained_model_name_or_path,
                                       self.out / "eval_embeddings", max_sequence_length=dataset.max_sequence_length,
                                       dtype=dataset.manifest["dtype"], device=self.device,
                                       model_family=models.spec_of(args),
                                       negative_prompt=dataset.negative_prompt if guided else None)
            self.eval_dataset = EmbeddingDataset(manifest).use(family, negative=guided)
            self.eval_dataset.check_encoders(args.pretrained_model_name_or_path, models.spec_of(args))
            for spec in filter(None, (args.reward, eval_reward)):
                check_reward_prompts(spec, self.eval_dataset.prompts, f"--eval_prompts {args.eval_prompts}",
                                     judge_score=getattr(args, "judge_score", "yes_no"))
            if self.eval_dataset.max_sequence_length != dataset.max_sequence_length:
                raise ValueError(f"--eval_prompts has {self.eval_dataset.max_sequence_length} text tokens but "
                                 f"--data_json_path has {dataset.max_sequence_length}: preprocess the evaluation "
                                 f"prompts with --max_sequence_length {dataset.max_sequence_length}, or pass the "
                                 "prompt file itself (it is then encoded with the training data's length)")
        self.geometry = geometry
        return geometry, dataset, rollout_config(args)

    def prompt_groups(self) -> tuple[Any, Any, Any, Any]:
        """The inputs of a trainer that samples --num_generations images for each of --prompts_per_step prompts per
        step (GRPO, NFT, online DPO), checked before any model loads: the reward spec, then ``sampling_inputs``;
        returns ``(latent geometry, EmbeddingDataset, GroupSampler, RolloutConfig)``."""
        from fastvideo.data import GroupSampler
        from fastvideo.rewards import parse_reward_spec

        args = self.args
        parse_reward_spec(args.reward)
        geometry, dataset, cfg = self.sampling_inputs()
        sampler = GroupSampler(len(dataset), args.prompts_per_step, args.num_generations, seed=args.seed,
                               rank=self.dist.dp_rank, world_size=self.dist.dp_size)
        return geometry, dataset, sampler, cfg

    def load_models(self, *, reward: bool, need_reference: bool, ref_snapshot: bool = False,
                    old_policy: bool = False, optimizer_steps: int) -> None:
        """Write OUT/config.json (rank 0, after every input check passed), then load the reward (checks its checkpoint
        paths first; also loaded without ``reward`` when --eval_prompts is set; with --eval_prompts also the
        --eval_reward rewards; with --reward_overlap its scorer thread), policy (+ reference, EMA),
        optimizer, LR schedule (``optimizer_steps`` long) and VAE (in the compute dtype: bf16 on a GPU/NPU)."""
        from fastvideo.config import save_config
        from fastvideo.logging import current_memory_gb
        from fastvideo.rewards import build_reward

        args = self.args
        errors.inputs_checked()  # from here on an error is the run's (traceback), not a bad flag's (one line)
        if self.dist.is_main:
            save_config(self.config, self.out / "config.json")
        self.memory_baseline = current_memory_gb(self.device, import_model_libraries=True)
        paths = {k: getattr(args, k) for k in REWARD_PATH_FLAGS}
        if reward or self.eval_dataset is not None:
            self.reward_fn = build_reward(args.reward, self.device, batch_size=args.reward_batch_size, **paths)
            self.reward_fn.nonfinite = "keep"  # gather_rewards handles a NaN per --nonfinite_reward, on every rank
        if reward and args.reward_overlap:
            from fastvideo.rewards.overlap import OverlapScorer

            self.scorer = OverlapScorer(self.reward_fn, self.device)
        if self.eval_dataset is not None and getattr(args, "eval_reward", None):  # built once, beside --reward's
            self.eval_reward_fn = build_reward(args.eval_reward, self.device, batch_size=args.reward_batch_size,
                                               **paths)
        self.policy = build_policy(args, self.device, need_reference=need_reference, ref_snapshot=ref_snapshot,
                                   old_policy=old_policy)
        self.sync_every_backward = parallel.resolve_gradient_sync(args.gradient_sync, self.policy.is_lora) == "backward"
        self.optimizer = build_optimizer(self.policy, args)  # right after sharding (FSDP2 swaps in DTensors)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, args, optimizer_steps)
        self.vae = models.family_for(args).load_vae(args.pretrained_model_name_or_path,
                                                    dtype=self.amp_dtype or torch.float32,
                                                    device=self.device)  # decodes in the compute dtype, as FluxPipeline
        self.flop_meter = flops.FlopMeter(self.dist.sp_size)  # model FLOPs per phase, for tflops_* and mfu
        old = self.policy.old.old_model if self.policy.old is not None else None
        for model in (self.policy.model, self.policy.frozen_ref, old):
            if model is not None:
                self.flop_meter.attach(model)
        D.barrier()  # every rank measures at once (ranks sharing a host share its cores)
        self.peak_flops, source = flops.resolve_peak(args.peak_tflops, self.device, self.amp_dtype or torch.float32)
        if self.dist.is_main:
            print(f"mfu: against {self.peak_flops / 1e12:.4g} TFLOP/s per device ({source})", flush=True)

    def resume(self, **state: Any) -> int:
        """Restore the checkpoint (if resuming) into the models and ``state`` (name -> object with
        ``state_dict``/``load_state_dict``, e.g. ``sampler=``), open the metrics logger and progress bar; returns the
        last step done (0 for a fresh run)."""
        from fastvideo.logging import MetricsLogger, progress_bar
        from fastvideo.seeding import set_rng_state

        args, rank = self.args, self.dist.rank
        self.state = state
        if self.resume_dir is not None:
            extra = load_state(self.resume_dir, self.policy, self.optimizer, self.lr_scheduler)
            self.start_step, self.skipped_updates = extra["step"], extra["skipped_updates"]
            self.train_seconds = extra.get("train_seconds", 0.0)
            self.consecutive_skips = extra.get("consecutive_skips", 0)
            self.dropped_samples = extra.get("dropped_samples", 0)
            for name, obj in self.state.items():
                obj.load_state_dict(extra[name])
            set_rng_state(extra["rng"][rank] if rank < len(extra["rng"]) else extra["rng"][0])
            if self.dist.is_main:
                print(f"resumed from {self.resume_dir} at step {self.start_step}", flush=True)
        self.logger = MetricsLogger(self.out, enabled=self.dist.is_main, sinks=args.log_to, config=self.config,
                                    wandb_project=args.wandb_project, wandb_mode=args.wandb_mode,
                                    resume_step=self.start_step if self.resume_dir else None)
        self.bar = progress_bar(args.max_train_steps, self.start_step, enabled=self.dist.is_main and args.progress_bar)
        if self.eval_dataset is not None and self.start_step == 0:
            self.logger.log(0, self.evaluate(0))
        self.step_started = time.perf_counter()
        return self.start_step

    def evaluate(self, step: int) -> dict[str, float]:
        """Sample the first --eval_max_prompts prompts of --eval_prompts --eval_num_images times each with the current
        weights (``evaluation.ode_images``: Euler ODE, the run's steps/shift/guidance, initial noise keyed by (seed,
        "eval", prompt id, image index): the same at every evaluation), score them with --reward and return
        ``evaluation.eval_metrics`` (``eval/reward_mean``, its std and 95% interval, ``eval/reward_<component>``), with
        --eval_reward its rewards' ``evaluation.extra_eval_metrics`` (``eval/<name>``, ``eval/<name>_<key>``), and
        ``time_eval`` (seconds); rank 0 saves OUT/samples/eval-step-N.png (up to 16 images: the first of each rank's
        slice) and mirrors it to TensorBoard / W&B. Images are split over ranks (padded to equal counts: FSDP needs the
        same forwards on every rank). A collective; draws no global randomness."""
        from fastvideo import evaluation
        from fastvideo.logging import save_image_grid
        from fastvideo.seeding import NoiseSource, derive_seed

        args, ds, dist = self.args, self.eval_dataset, self.dist
        t0 = time.perf_counter()
        n = min(args.eval_max_prompts or len(ds), len(ds))
        total = n * args.eval_num_images
        prompt_ids, sample_indices, real = evaluation.image_items(n, args.eval_num_images, dist.dp_rank,
                                                                  dist.dp_size)
        noise = NoiseSource(derive_seed(args.seed, "eval"), device=args.noise_device)
        with flops.phase(None):  # not training work: outside the step's tflops / mfu
            images = evaluation.ode_images(self.policy.model, self.vae, ds, prompt_ids, sample_indices,
                                           rollout_config(args), noise, self.geometry, device=self.device,
                                           amp_dtype=self.amp_dtype)
        prompts = [ds.prompts[i] for i in prompt_ids]
        rewards, _ = self.score(images, prompts)  # gathered: entries >= total are padding
        all_ids = torch.arange(total) // args.eval_num_images  # the global order of evaluation.image_items
        summary = evaluation.reward_summary({k: v[:total] for k, v in rewards.items()}, all_ids)
        metrics = evaluation.eval_metrics(summary)
        if self.eval_reward_fn is not None:  # --eval_reward: eval/<name>, eval/<name>_<key>, beside eval/reward_*
            extra, _ = self.score(images, prompts, self.eval_reward_fn)
            extra = evaluation.extra_scores({k: v[:total] for k, v in extra.items()}, rewards)
            metrics.update(evaluation.extra_eval_metrics(evaluation.reward_summary(extra, all_ids)))
        shown = D.gather_samples(images[:min(real, -(-16 // dist.dp_size))].cpu())  # (<= 16 + dp, 3, H, W)
        if dist.is_main:
            grid = save_image_grid(shown[:16], self.out / "samples" / f"eval-step-{step:06d}.png")
            self.logger.log_image("eval/samples", grid, step)
        metrics["time_eval"] = time.perf_counter() - t0
        return metrics

    def pending_rewards(self, prompts: list[str]) -> PendingRewards | None:
        """With --reward_overlap, the scoring of the coming rollout (``prompts``: this rank's, in sample order): pass it
        as ``rollout(..., on_decoded=...)`` and then to ``score_rollout``; None without it, or with --replay_images
        (the recorded images replace the rollout's after it), for the sequential path."""
        if self.scorer is None or (self.replay is not None and self.replay.use_images):
            return None
        share, mine = self._reward_share(len(prompts))
        return PendingRewards(self.scorer, list(prompts), share, mine)

    def score_rollout(self, traj: Any, prompts: list[str], pending: PendingRewards | None = None
                      ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """``score`` this rank's rollout (a ``rollout.Trajectory`` of the current step), or with ``pending``
        (``pending_rewards``, fed by the rollout) join the scores computed while it sampled and gather them the same
        way. With --replay_images the recorded images are scored instead of the decoded ones; with --record_dir the
        images, each sample's rewards (this rank's slice) and the old log-probs are recorded. Returns the gathered
        rewards and the step's ``time_reward`` (seconds the step waited for them after the rollout) and
        ``time_reward_busy`` (seconds the reward computed: equal without --reward_overlap)."""
        prompt_ids, sample_indices = traj.prompt_ids.tolist(), traj.sample_indices.tolist()
        images = traj.images
        if pending is None:
            if self.replay is not None and self.replay.use_images:
                images = self.replay.images(traj.step, prompt_ids, sample_indices, like=images)
            rewards, seconds = self.score(images, prompts)
            times = {"time_reward": seconds, "time_reward_busy": seconds}
        else:
            t0 = time.perf_counter()
            try:
                (local, busy), error = pending.scorer.join(), None
            except Exception as err:  # noqa: BLE001  (every rank raises it in gather_rewards)
                local, busy, error = None, 0.0, err
            times = {"time_reward": time.perf_counter() - t0, "time_reward_busy": busy}
            rewards = self.gather_rewards(local, error, pending.prompts[pending.share], pending.mine)
        if self.recorder is not None:
            log_probs = traj.log_probs if bool(traj.stochastic.any()) else None
            self.recorder.add_samples(traj.step, prompt_ids, sample_indices, prompts, images,
                                      {k: self.local(v) for k, v in rewards.items()}, log_probs)
        return rewards, times

    def score(self, images: torch.Tensor, prompts: list[str], reward_fn: Callable | None = None
              ) -> tuple[dict[str, torch.Tensor], float]:
        """Reward this rank's images in one batched call of ``reward_fn`` (default: --reward's), all-gathered over
        ranks (``gather_rewards``): ``name -> (P*G,)`` CPU float32 in global sample order (every component and
        "total"; a prompt group may span ranks), and the seconds the call took.
        Under --sp_size the ranks of a sequence-parallel group hold the same images: each scores its consecutive share,
        so every image is scored once and the gather is in sample order."""
        share, mine = self._reward_share(len(prompts))
        if self.dist.sp_size > 1:
            images, prompts = images[share], prompts[share]
        t0 = time.perf_counter()
        try:
            local, error = (reward_fn or self.reward_fn)(images, prompts), None
        except Exception as err:  # noqa: BLE001  (every rank raises it in gather_rewards)
            local, error = None, err
        seconds = time.perf_counter() - t0
        return self.gather_rewards(local, error, prompts, mine), seconds

    def _reward_share(self, n: int) -> tuple[slice, int]:
        """Which of this rank's ``n`` samples it scores (its sequence-parallel group's share: consecutive) and how many
        of those scores it sends; a rank whose share is empty scores one image and sends none (for the reward's
        keys)."""
        if self.dist.sp_size == 1:
            return slice(0, n), n
        share = torch.arange(n).tensor_split(self.dist.sp_size)[self.dist.sp_rank]
        return (slice(int(share[0]), int(share[-1]) + 1), len(share)) if len(share) else (slice(0, 1), 0)

    def gather_rewards(self, local: dict[str, torch.Tensor] | None, error: BaseException | None,
                       prompts: list[str], mine: int) -> dict[str, torch.Tensor]:
        """The ranks' scores of their samples (``local``: name -> (b,), the first ``mine`` sent; ``prompts`` theirs)
        all-gathered in sample order, non-finite ones handled per --nonfinite_reward. A collective that first agrees
        on failure: if the reward raised on any rank (``error``), every rank raises the same ``RewardFailed``
        instead of leaving the others waiting in the gather."""
        self._agree_on_reward_failure(error)
        stacked = torch.stack([v.float().cpu() for v in local.values()], dim=1)[:mine]  # (b, components + total)
        prompts = prompts[:mine]
        gathered = D.all_gather_tensor(stacked)
        bad = ~torch.isfinite(gathered).all(dim=1)  # the same on every rank
        if bad.any():
            gathered = self._nonfinite_rewards(gathered, bad, list(local), prompts)
        return dict(zip(local, gathered.unbind(dim=1)))

    def _agree_on_reward_failure(self, error: BaseException | None) -> None:
        """Every rank's reward outcome (one object gather); if any failed, ``RewardFailed`` on every rank, naming the
        first failing rank, its error and the checkpoint to continue from."""
        failed = [(rank, text) for rank, text in enumerate(
            D.all_gather_object(None if error is None else f"{type(error).__name__}: {error}"[:2000])) if text]
        if not failed:
            return
        rank, text = failed[0]
        also = f" (and on rank(s) {', '.join(str(r) for r, _ in failed[1:])})" if len(failed) > 1 else ""
        latest = ckpt.latest_checkpoint(self.args.output_dir)
        where = (f"; checkpoint {latest} is intact: fix the reward, then continue with --resume_from latest"
                 if latest is not None else "")
        raise RewardFailed(f"the reward failed on rank {rank}{also}: {text}{where}") from error

    def _nonfinite_rewards(self, gathered: torch.Tensor, bad: torch.Tensor, names: list[str], prompts: list[str]
                           ) -> torch.Tensor:
        """--nonfinite_reward error: raise (on every rank alike) naming the reward and the prompt; drop: set every
        component of those samples to NaN (advantages, pairs and metrics then leave them out) and count them."""
        all_prompts = [p for per_rank in D.all_gather_object(list(prompts)) for p in per_rank]
        first = int(bad.nonzero()[0])
        culprits = [n for n, v in zip(names, gathered[first].tolist()) if not math.isfinite(v)]
        name = next((n for n in culprits if n != "total"), culprits[0])
        value = gathered[first, names.index(name)].item()
        if self.args.nonfinite_reward == "error":
            raise ValueError(f"reward {name!r} returned {value} for prompt {all_prompts[first]!r} ({int(bad.sum())} of "
                             f"{len(bad)} samples non-finite); fix the reward (its checkpoint, input range or dtype) "
                             "or pass --nonfinite_reward drop to drop such samples and go on")
        self.dropped_samples += int(bad.sum())
        if self.dist.is_main:
            print(f"warning: dropped {int(bad.sum())} sample(s) with a non-finite reward (e.g. {name!r} = {value} for "
                  f"prompt {all_prompts[first]!r}); {self.dropped_samples} so far", flush=True)
        gathered = gathered.clone()
        gathered[bad] = float("nan")
        return gathered

    def local(self, values: torch.Tensor) -> torch.Tensor:
        """This rank's equal slice of a gathered per-sample tensor (e.g. rewards in global sample order): its
        data-parallel replica's (the same on every rank of a sequence-parallel group)."""
        n = len(values) // self.dist.dp_size
        return values[self.dist.dp_rank * n:(self.dist.dp_rank + 1) * n]

    def advantages(self, rewards: torch.Tensor, samples: Any, prompt_ids: torch.Tensor
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """Group advantages (REFERENCE §3) of the step's gathered ``rewards`` (P*G,) with --global_std/--adv_clip_max/
        --adv_eps/--group_std: ``(all advantages (P*G,), their metrics, this rank's slice on the device)``. ``prompt_ids``: this
        rank's samples' prompt ids (checked against the sampler's group order after gathering)."""
        from fastvideo.advantages import group_advantages

        args = self.args
        group_ids = torch.arange(args.prompts_per_step).repeat_interleave(args.num_generations)  # (P*G,)
        expected = torch.tensor(samples.group_prompt_ids).repeat_interleave(args.num_generations)
        assert torch.equal(D.gather_samples(prompt_ids.cpu()), expected), "gathered samples are not in group order"
        adv_all, metrics = group_advantages(rewards, group_ids, global_std=args.global_std,
                                            adv_clip_max=args.adv_clip_max, eps=args.adv_eps,
                                            group_std=getattr(args, "group_std", "unbiased"))
        n = len(prompt_ids)
        return adv_all, metrics, adv_all[self.dist.dp_rank * n:(self.dist.dp_rank + 1) * n].to(self.device)

    def set_gradient_sync(self, last_backward: bool) -> None:
        """Before each backward: reduce-scatter now (--gradient_sync backward) or only on a cycle's last backward."""
        parallel.set_gradient_sync(self.policy.model, self.sync_every_backward or last_backward)

    def throughput(self, metrics: dict[str, Any]) -> dict[str, float]:
        """``tflops_rollout``, ``tflops_train`` and ``mfu`` of the step (``flops.throughput_metrics`` from the FLOPs
        the meter counted since the last step and the trainer's time_rollout / time_train / time_step), the mean over
        ranks (a collective)."""
        seconds = {name: float(metrics.get(f"time_{name}", 0.0)) for name in ("rollout", "train", "step")}
        local = flops.throughput_metrics(self.flop_meter.take(), seconds, self.peak_flops)
        keys = ("tflops_rollout", "tflops_train", "mfu")
        present = torch.tensor([k in local for k in keys], dtype=torch.float32)
        values = torch.tensor([local.get(k, 0.0) for k in keys], dtype=torch.float32)
        summed = D.all_reduce_sum(torch.cat([values, present]))
        return {k: float(summed[i] / summed[3 + i]) for i, k in enumerate(keys) if summed[3 + i] > 0}

    def backward(self, loss: torch.Tensor, last_backward: bool) -> None:
        """``set_gradient_sync(last_backward)``, then back-propagate ``loss``, times --sp_size: each rank of a
        sequence-parallel group gets only its own tokens' share of the parameter gradients (they sum to the whole)
        and FSDP averages over all dp x sp ranks, so the factor makes the result the mean over data-parallel
        replicas, as without sequence parallelism."""
        self.set_gradient_sync(last_backward)
        (loss * self.dist.sp_size if self.dist.sp_size > 1 else loss).backward()

    def optimizer_step(self) -> float:
        """Clip the gradient norm, step optimizer + schedule + EMA (skipped, and counted, when the norm is not
        finite: a NaN/inf loss or gradient; ``end_step`` stops the run after more than --max_consecutive_skips in a
        row), zero the gradients; returns the norm before clipping."""
        import math

        max_norm = self.args.max_grad_norm if self.args.max_grad_norm > 0 else math.inf
        grad_norm = parallel.clip_grad_norm(self.policy.model, max_norm)
        self.step_grad_norms.append(grad_norm)
        if math.isfinite(grad_norm):
            self.optimizer.step()
            self.lr_scheduler.step()
            if self.policy.ema is not None:
                self.policy.ema.update()
            self.consecutive_skips = 0
        else:
            self.skipped_updates += 1
            self.consecutive_skips += 1
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def end_step(self, step: int, metrics: dict[str, Any], images: torch.Tensor | None,
                 postfix: dict[str, str], trace: dict[str, torch.Tensor] | None = None) -> bool:
        """Log ``metrics`` (+ lr, skipped updates, peak and baseline memory over ranks, training seconds so far;
        + ``evaluate`` every --eval_every steps and at the last step), advance the bar, save rank 0's sample grid
        every --sample_every steps (and at step 1), checkpoint every --checkpointing_steps (and at the last step).
        Returns True when this was the last step: --max_train_steps, past --max_train_seconds, or a stop signal
        (SIGTERM/SIGINT on any rank: checkpoint now, no evaluation; ``finish`` then skips the export). Raises after
        writing the checkpoint when more than --max_consecutive_skips updates in a row were skipped. A collective:
        every rank calls it, and every rank takes the same decisions (one gather of the ranks' clocks and signals).
        With --replay_dir it first checks that the ranks used every recorded draw of the step; with --record_dir it
        writes the step's recording (``trace``: this rank's per-update tensors, e.g. ``loss`` (micro-batches,
        trained timesteps), and the step's grad norms).
        """
        from fastvideo.logging import peak_memory_gb, save_image_grid
        from fastvideo.rewards import display_values
        from fastvideo.seeding import rng_state

        args = self.args
        now = time.perf_counter()
        self.train_seconds += now - self.step_started
        metrics = {**metrics, **self.throughput(metrics)}
        if self.replay is not None:
            self.replay.check_step(step)
        seconds, signals = zip(*D.all_gather_object((self.train_seconds, preemption.requested())))
        over_time = bool(args.max_train_seconds) and max(seconds) >= args.max_train_seconds
        stop_signal = next((sig for sig in signals if sig), None)
        preempted = stop_signal is not None and step < args.max_train_steps
        too_many_skips = bool(args.max_consecutive_skips) and self.consecutive_skips > args.max_consecutive_skips
        last = step == args.max_train_steps or over_time or preempted
        eval_seconds = 0.0
        if self.eval_dataset is not None and not preempted and (
                last or (args.eval_every and step % args.eval_every == 0)):
            metrics = {**metrics, **self.evaluate(step)}
            eval_seconds = metrics["time_eval"]
        metrics = {**metrics, "lr": self.lr_scheduler.get_last_lr()[0], "skipped_updates": self.skipped_updates,
                   "peak_memory_gb": D.all_reduce_max(peak_memory_gb(self.device)),
                   "memory_baseline_gb": D.all_reduce_max(self.memory_baseline), "time_elapsed": self.train_seconds}
        if args.nonfinite_reward == "drop":
            metrics["dropped_samples"] = self.dropped_samples
        self.logger.log(step, metrics)
        if self.recorder is not None:
            self.recorder.end_step(step, metrics, trace, self.step_grad_norms)
        self.step_grad_norms = []
        self.bar.update(1)
        self.bar.set_postfix(**display_values(metrics),
                             **{k: fmt.format(float(metrics[k])) for k, fmt in postfix.items()})
        if (images is not None and args.sample_every and (step % args.sample_every == 0 or step == 1)
                and self.dist.is_main):
            grid = save_image_grid(images, self.out / "samples" / f"step-{step:06d}.png")
            self.logger.log_image("samples", grid, step)
        if step % args.checkpointing_steps == 0 or last or too_many_skips:
            save_state(args, step, self.policy, self.optimizer, self.lr_scheduler, extra={
                "step": step, "skipped_updates": self.skipped_updates, "rng": D.all_gather_object(rng_state()),
                "config": self.config, "train_seconds": self.train_seconds,
                "consecutive_skips": self.consecutive_skips, "dropped_samples": self.dropped_samples,
                **{name: obj.state_dict() for name, obj in self.state.items()}},
                manifest=run_identity(self.config), resumed_from=self.resume_dir)
        if too_many_skips:
            raise RuntimeError(
                f"{self.consecutive_skips} updates in a row were skipped for a non-finite loss or gradient (more than "
                f"--max_consecutive_skips {args.max_consecutive_skips}) at step {step}; checkpoint "
                f"{ckpt.checkpoint_path(args.output_dir, step)} holds the last good weights. Lower --learning_rate, "
                "check the reward and the inputs (skipped_updates in metrics.jsonl), then --resume_from latest")
        if preempted:
            self.preempted = (step, stop_signal)
        elif over_time and step < args.max_train_steps and self.dist.is_main:
            print(f"stopping after step {step}: {self.train_seconds:.0f} s of training reached --max_train_seconds "
                  f"{args.max_train_seconds:g}", flush=True)
        end = time.perf_counter()
        self.train_seconds += end - now - eval_seconds
        self.step_started = end
        return last

    def finish(self) -> Path:
        """Close the logger and bar, export OUT/final (a collective), print where everything is; after a stop signal
        only say where the checkpoint is and how to continue (no export: the run is not done). Returns the export
        folder, or the checkpoint after a stop signal."""
        self.bar.close()
        self.logger.close()
        if self.scorer is not None:
            self.scorer.close()
        if self.preempted is not None:
            step, signal_name = self.preempted
            path = ckpt.checkpoint_path(self.args.output_dir, step)
            if self.dist.is_main:
                print(f"{signal_name}: stopped after step {step} of {self.args.max_train_steps}; checkpoint {path}; "
                      "continue with --resume_from latest (the launchers pass it)", flush=True)
            return path
        final = export_final(self.args, self.policy)
        if self.dist.is_main:
            out = self.out
            plots = write_plots(out)
            print(f"metrics: {out / 'metrics.jsonl'}\nplots:   {plots}\nsamples: {out / 'samples'}\n"
                  f"checkpoints: {out / 'checkpoints'}\nexport:  {final}", flush=True)
        return final


def write_plots(out: Path) -> Path | str:
    """OUT/plots.png: the run's curves (``fastvideo.plot``), written at the end of a run; a plot that cannot be drawn
    is reported, never fatal (the run's outputs are already written)."""
    from fastvideo.plot import plot_runs

    try:
        return plot_runs([out], out / "plots.png")
    except (ValueError, OSError) as err:
        return f"not written ({err})"


def start_run(args: argparse.Namespace, validate: Callable[[argparse.Namespace, int], dict[str, int]],
              plan: Callable[..., Any] | None = None) -> Run:
    """The checks before anything expensive, on every rank: the flags (``validate`` -> batch arithmetic, printed by
    rank 0; then the device-dependent defaults, ``resolve_device_defaults``), memory flags, a writable --output_dir
    (where interrupted saves are cleaned up), the resume checkpoint (complete, undamaged, same algorithm and config
    fingerprint), the memory plan on a GPU/NPU (``check_memory_plan`` with the trainer's ``plan``, e.g.
    ``memory.plan_grpo``; None: no plan gate), --record_dir / --replay_dir (``record.open_alignment``); then seeds and
    the noise source (recording or replaying). The trainer checks its own inputs (data, reward spec) next, before
    ``Run.load_models``."""
    from fastvideo import record
    from fastvideo.seeding import NoiseSource, seed_all

    dist = D.set_sequence_parallel(args.sp_size)  # ValueError on every rank when it does not divide the ranks
    counts = with_sp_counts(validate(args, dist.dp_size), dist.sp_size)  # samples split over the dp replicas
    resolve_device_defaults(args, dist.device.type)
    check_memory_flags(args, dist.world_size, dist.device)
    config = run_config(args, counts)
    check_output_dir(args.output_dir)
    ckpt.clean_interrupted_saves(args.output_dir)  # what a killed save left (the complete checkpoints are intact)
    resume_dir = resolve_resume(args)
    start_step = 0
    if resume_dir is not None:
        start_step = check_resume_step(resume_dir, args.max_train_steps)
        check_resume_checkpoint(resume_dir, config)
    if plan is not None:
        check_memory_plan(args, counts, plan, dist.world_size, dist.device.type,
                          devices.total_memory_bytes(dist.device))
    amp_dtype = compute_dtype(args.mixed_precision, dist.device)
    noise, recorder, replay = record.open_alignment(args, config, dist, NoiseSource(args.seed, device=args.noise_device),
                                                    amp_dtype, start_step, run_identity(config)["config_fingerprint"])
    seed_all(args.seed)
    if dist.is_main:
        print("batch arithmetic: " + ", ".join(f"{k}={v}" for k, v in counts.items()), flush=True)
    return Run(args=args, dist=dist, counts=counts, config=config, resume_dir=resume_dir, noise=noise,
               amp_dtype=amp_dtype, recorder=recorder, replay=replay)


def check_output_dir(output_dir: str | Path) -> None:
    """Every rank can create --output_dir and write a file there (ValueError on every rank alike otherwise): refused
    before any model loads rather than at the first checkpoint."""
    import os

    out, problem = Path(output_dir), None
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}-rank{D.get_rank()}"
        with open(probe, "wb") as f:
            f.write(b"ok")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as err:
        problem = f"{type(err).__name__}: {err}"
    problems = [(rank, text) for rank, text in enumerate(D.all_gather_object(problem)) if text]
    if problems:
        rank, text = problems[0]
        raise ValueError(f"--output_dir {out} is not writable on rank {rank} ({text}); choose a directory every rank "
                         "can write to (OUTPUT_DIR=... with the launchers; on a file system all nodes share)")


def batch_to(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The tensors of an ``EmbeddingDataset.get_batch`` dict moved to ``device`` (other entries kept); the prompt ids
    stay on the CPU: they are bookkeeping read on the host (noise keys), which on the device would be a host sync."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) and k != "prompt_ids" else v for k, v in batch.items()}


def reward_metrics(rewards: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``reward_<component>`` means of gathered rewards (the total is logged as reward_mean/reward_std); samples
    dropped for a non-finite reward (NaN) are left out."""
    return {f"reward_{k}": v.nanmean() for k, v in rewards.items() if k != "total"}


def rank_mean(values: torch.Tensor) -> torch.Tensor:
    """Mean of this rank's metric values (a tensor of them, e.g. from ``to_host``), averaged over ranks (every rank has
    the same count)."""
    local = values.detach().float().cpu().mean()
    return D.all_reduce_sum(local) / D.get_world_size()


def training_order(run: Run, num_samples: int, adv_all: torch.Tensor | None, step: int,
                   ) -> tuple[list[list[tuple[torch.Tensor, torch.Tensor | None]]], float]:
    """This rank's optimizer steps of the rollout (GRPO's, DiffusionNFT's and AWM's update), each a list of
    micro-batches ``(local sample indices (b,), loss weights (b,) or None)``, and the share of the step's samples
    trained.

    Default: its samples in prompt-group order, --train_batch_size at a time, --gradient_accumulation_steps micro-
    batches per optimizer step, weights None (each micro-batch's loss is its mean). --shuffle_micro_batches (a keyed
    permutation of the gathered batch) and --drop_zero_advantage (only samples with A != 0, Flow-GRPO) cut the
    step's global training order into optimizer steps with ``advantages.share_samples``: each rank trains its own
    samples of each, padded at weight 0 to the same count, real samples at weights that make the loss the mean over
    the optimizer step's samples, whatever the world size."""
    from fastvideo.advantages import nonzero_selection, share_samples, shuffle_order

    args, counts = run.args, run.counts
    tbs, accum = args.train_batch_size, counts["gradient_accumulation_steps"]
    drop = getattr(args, "drop_zero_advantage", False)  # GRPO's flag (train_nft.py has --shuffle_micro_batches only)
    if not (drop or args.shuffle_micro_batches):
        micro = [(idx, None) for idx in torch.arange(num_samples).split(tbs)]
        return [micro[c:c + accum] for c in range(0, len(micro), accum)], 1.0
    if adv_all is None:
        raise ValueError("--shuffle_micro_batches / --drop_zero_advantage order the gathered batch: pass adv_all")
    total = len(adv_all)
    selected = nonzero_selection(adv_all) if drop else torch.arange(total)
    order = shuffle_order(run.noise, step, total, selected=selected) if args.shuffle_micro_batches else selected
    rank = run.dist.dp_rank
    chunks = share_samples(order, rank, run.dist.dp_size, owners=torch.arange(total) // num_samples,
                           num_chunks=counts["optimizer_steps_per_rollout"])
    steps = [[(p - rank * num_samples, w) for p, w in zip(pos.split(tbs), weights.split(tbs)) if len(p)]
             for pos, weights in chunks]  # a chunk with no sample (every one dropped) is [] on every rank
    return steps, len(order) / total


def weighted_rank_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum(values * weights) / sum(weights)`` over every rank's entries (e.g. per-micro-batch metric means weighted
    by their real samples, when ranks pad their micro-batches); 0 when every weight is 0."""
    local = torch.stack([(values.detach().float().cpu() * weights).sum(), weights.sum()])
    total = D.all_reduce_sum(local)
    return total[0] / total[1].clamp(min=1e-12)


def to_host(tensors: dict[str, torch.Tensor | list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A step's metric tensors (each a tensor or a non-empty list of same-shaped tensors, stacked; all on one device) on
    the CPU in float32 through one device->host copy: one host sync at the end of the step instead of one per value."""
    stacked = {k: (v if torch.is_tensor(v) else torch.stack(v)).detach() for k, v in tensors.items()
               if torch.is_tensor(v) or v}  # an empty list is left out
    if not stacked:
        return {}
    sizes = [v.numel() for v in stacked.values()]
    flat = torch.cat([v.float().reshape(-1) for v in stacked.values()]).cpu()  # all on one device
    return {k: part.view(v.shape) for (k, v), part in zip(stacked.items(), flat.split(sizes))}
