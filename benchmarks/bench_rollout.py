"""Rollout throughput: batched micro-batches vs DanceGRPO's one-sample-at-a-time loop, and bf16 autocast.

    python benchmarks/bench_rollout.py --preset bench --samples 8 --steps 4

Builds the preset in a temp dir, encodes a few prompts, then times ``rollout`` with ``batch_size=1``,
``batch_size=samples`` and ``batch_size=samples`` under bf16 autocast (interleaved, best of ``--repeats``)
and prints the ratios. Absolute times drift on a shared machine; ratios measured in one run are what to compare.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from fastvideo.models import flux
from fastvideo.rollout import RolloutConfig, rollout
from fastvideo.seeding import NoiseSource
from fastvideo.tiny import PRESETS, build_tiny_flux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="bench", choices=("tiny", "bench"), help="tiny model preset")
    parser.add_argument("--samples", type=int, default=8, help="samples per rollout")
    parser.add_argument("--steps", type=int, default=4, help="sampling steps")
    parser.add_argument("--max_sequence_length", type=int, default=64, help="T5 tokens per prompt")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per setting (best is reported)")
    args = parser.parse_args()

    preset = PRESETS[args.preset]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_flux(Path(tmp) / "model", preset=args.preset, seed=0)
        encoders = flux.load_text_encoders(model_dir)
        prompts = [f"benchmark prompt number {i}" for i in range(args.samples)]
        embeds, pooled, _ = flux.encode_prompts(encoders, prompts, args.max_sequence_length)
        transformer = flux.load_transformer(model_dir).eval()
        vae = flux.load_vae(model_dir)
    geometry = flux.latent_geometry(vae, preset.height, preset.width)
    batch = {"prompt_ids": torch.arange(args.samples), "prompts": prompts, "prompt_embeds": embeds,
             "pooled_prompt_embeds": pooled}
    noise = NoiseSource(0)
    settings = {"per-sample fp32": (1, None), "batched fp32": (args.samples, None),
                "batched bf16": (args.samples, torch.bfloat16)}
    best = dict.fromkeys(settings, float("inf"))
    for _ in range(args.repeats):
        for name, (bs, dtype) in settings.items():
            cfg = RolloutConfig(height=preset.height, width=preset.width, sampling_steps=args.steps,
                                eta=0.9, batch_size=bs)
            t0 = time.perf_counter()
            rollout(transformer, vae, batch, [0] * args.samples, 1, cfg, noise, geometry, device="cpu",
                    autocast_dtype=dtype)
            best[name] = min(best[name], time.perf_counter() - t0)
    print(f"preset={args.preset} samples={args.samples} steps={args.steps} T={args.max_sequence_length} "
          f"threads={torch.get_num_threads()}")
    base = best["per-sample fp32"]
    print("   ".join(f"{name}: {t:.3f} s ({base / t:.2f}x)" for name, t in best.items()))


if __name__ == "__main__":
    main()
