"""What fits: the --dry_run memory plan of FLUX.1-dev GRPO on 8 x 80 GB for LoRA and full fine-tuning, 512^2 and
720^2, with and without gradient checkpointing and CPU offload, at the recipe's batch (2 prompts x 12 samples per
GPU, micro-batch 2, rollout batch 4, 16 steps, EMA, HPS v2.1); prints docs/memory.md's markdown table.

    python -m fastvideo.tiny --preset flux-dev-config --out data/flux-dev-config     # configs only, no weights
    python benchmarks/memory_table.py data/flux-dev-config [--world_size 8] [--gpu_gb 80]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastvideo.objectives import parse_grpo_args, validate_grpo  # noqa: E402
from fastvideo.memory import GiB, plan_grpo  # noqa: E402

# scripts/finetune_flux_grpo.sh with MODEL_PATH (DanceGRPO's FLUX recipe), less the flags varied below
RECIPE = ["--sampling_steps", "16", "--sde_type", "dance_sde", "--eta", "0.3", "--shift", "3", "--decode_x0",
          "--num_generations", "12", "--rollout_batch_size", "4", "--train_batch_size", "2",
          "--gradient_accumulation_steps", "6", "--timestep_fraction", "0.6", "--reward", "hpsv2:1.0",
          "--fsdp_sharding_strategy", "full", "--mixed_precision", "bf16", "--use_ema"]


def plan(folder: str, world: int, *flags: str):
    args = parse_grpo_args(["--pretrained_model_name_or_path", folder, "--dry_run", *RECIPE,
                            "--prompts_per_step", str(2 * world), *flags])
    return plan_grpo(args, validate_grpo(args, world), world, "cuda")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="a FLUX.1-dev folder (configs suffice)")
    parser.add_argument("--world_size", type=int, default=8)
    parser.add_argument("--gpu_gb", type=float, default=80.0)
    cli = parser.parse_args()
    print(f"| model | image | grad. ckpt | CPU offload | peak GiB/GPU | host GiB/rank | phase | fits {cli.gpu_gb:g} GB |")
    print("|---|---|---|---|---|---|---|---|")
    rows = [("recipe (full, EMA)", 720, True, False, [])]
    for mode, flags in (("LoRA r64", ["--lora_rank", "64"]), ("full", [])):
        for size in (512, 720):
            for ckpt in (False, True):
                for offload in (False, True):
                    rows.append((mode, size, ckpt, offload, flags))
    for mode, size, ckpt, offload, flags in rows:
        extra = [*flags, "--h", str(size), "--w", str(size)]
        extra += ["--gradient_checkpointing" if ckpt else "--no-gradient_checkpointing"]  # auto: on for full
        extra += ["--use_cpu_offload"] if offload else []
        p = plan(cli.folder, cli.world_size, *extra)
        peak = p.device_peak / GiB
        print(f"| {mode} | {size}² | {'yes' if ckpt else 'no'} | {'yes' if offload else 'no'} | {peak:.1f} | "
              f"{p.host_per_rank / GiB:.1f} | {p.peak_phase} | {'yes' if peak <= cli.gpu_gb else '**no**'} |",
              flush=True)


if __name__ == "__main__":
    main()
