"""How a trainer starts: ``run_main`` dispatches to --dry_run (the batch arithmetic and memory plan from the configs
alone), --check_only (the flags and inputs, in one process before torchrun) or ``launch`` (the process group, fail-fast
and preemption around the training); plus the start-up gates every rank runs before a model loads (memory flags and
plan, a writable --output_dir, device-dependent defaults)."""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Callable

import torch

from fastvideo import devices, errors, memory, parallel, preemption
from fastvideo import distributed as D
from fastvideo.devices import compute_dtype
from fastvideo.options import take_default_notes
from fastvideo.resume import check_resume_checkpoint, check_resume_step, resolve_resume, run_config
from fastvideo.rewards import parse_reward_spec
from fastvideo.seeding import set_deterministic


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
    for line in take_default_notes():
        print(line, flush=True)
    print("batch arithmetic: " + ", ".join(f"{k}={v}" for k, v in counts.items()), flush=True)
    print(plan(args, counts, world, device_type).format(args.dry_run_device_memory_gb), flush=True)


def resolve_device_defaults(args: argparse.Namespace, device_type: str) -> None:
    """Resolve, in place and once, the flags whose default depends on the device type: --gradient_checkpointing
    (auto: on for a full fine-tune on a GPU/NPU) and --decode_batch_size (auto: decode calls planned within 4 GiB on a
    GPU/NPU, a whole rollout micro-batch on the CPU); see ``memory.resolve_gradient_checkpointing`` /
    ``memory.resolve_decode_batch_size``. Called before the memory plan, so that the plan, ``build_policy``,
    ``rollout_config`` and config.json all see the resolved values (``start_run``, and ``dry_run`` for its device)."""
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


def check_output_dir(output_dir: str | Path) -> None:
    """Every rank can create --output_dir and write a file there (ValueError on every rank alike otherwise): refused
    before any model loads rather than at the first checkpoint."""
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
