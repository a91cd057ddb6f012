"""What ``sample.py`` runs: generate (and score) images from a base FLUX model, a trained LoRA or a full fine-tune,
for a prompt set.

    python sample.py --run_dir OUT [--base] [--compare OUT/sampled/base] [--flag value ...]
    torchrun --nproc_per_node N sample.py --pretrained_model_name_or_path DIR [--lora_path OUT/final |
        --transformer_path OUT/final] --prompts FILE_OR_MANIFEST --output_dir SAMPLES [--reward SPEC]
        [--compare BASE_SAMPLES]

``--run_dir OUT`` (a trainer's --output_dir) takes every setting from the run's OUT/config.json: the base model, the
export in OUT/final (a LoRA or a full transformer, detected), --h/--w, the sampler (steps, shift, guidance, noise
device), the text length of its embeddings, its held-out --eval_prompts (the first --eval_max_prompts,
--eval_num_images images each), its --reward, --eval_reward and reward paths, --device and --mixed_precision; it
samples into OUT/sampled/final, or with ``--base`` the run's base model into OUT/sampled/base. Flags given on the
command line win (--seed stays sample.py's own: 42). After a run: ``sample.py --run_dir OUT --base``, then
``sample.py --run_dir OUT --compare OUT/sampled/base``. (The flag is --run_dir, not --run: torchrun's own parser
refuses --run, a prefix of its --run_path.)

Sampling is the deterministic Euler ODE of the family's stock pipeline (``FluxPipeline``, ``StableDiffusion3Pipeline``,
...: same sigmas, guidance and true CFG with --cfg_scale; equal images for the same initial noise); unset --h/--w,
--num_inference_steps, --guidance_scale, --cfg_scale and --max_sequence_length take the family's pipeline defaults.
Image k of prompt p starts from the noise keyed (--seed, p, k) and is written to
``SAMPLES/images/pPPPPPP-sKKK.png`` whatever the number of ranks or the batch size, so two models sampled with the
same seed see the same noise: ``--compare BASE_SAMPLES`` then puts them side by side (``SAMPLES/compare.png``).
``SAMPLES/index.jsonl`` lists every image (prompt, seed, path, reward scores: --reward's ``total`` and components,
then each --eval_reward reward and its checks) and ``SAMPLES/summary.json`` the mean, std and 95% interval of each;
with --compare, ``SAMPLES/compare.json`` holds each reward's paired difference
(this model - base, image by image) with its 95% interval.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Sequence

import torch

from fastvideo import distributed as D
from fastvideo import errors, evaluation, runs
from fastvideo.config import build_parser, parse_with_config
from fastvideo.evaluation import SampleOptions
from fastvideo.rewards import RewardOptions


def build_sample_parser() -> argparse.ArgumentParser:
    """sample.py's parser: the sampling flags and the reward flags (every one with its unit in --help)."""
    parser = build_parser((SampleOptions, RewardOptions), __doc__.split("\n\n")[0],
                          default_overrides={"reward": None},
                          help_overrides={"reward": "score every image with these weighted rewards (e.g. 'hpsv2:1.0'; "
                                                    "default: no scoring; with --run_dir: the run's)",
                                          "eval_reward": "also score every image with these rewards, each on its "
                                                         "own (not in --reward's total; e.g. 'toyworld_clean:1.0'): "
                                                         "columns <name> and <name>_<check> in index.jsonl and "
                                                         "summary.json (default: none; with --run_dir: the run's)"},
                          exclude=("nonfinite_reward",))
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__.split("\n\nSampling is")[0]
    return parser


def parse_run_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, str | None]:
    """The flags, with --run_dir's settings filled in where no flag was given (``runs.apply_to_sample``), and the line
    that tells what --run_dir took (None without --run_dir); validation happens in ``validate_sample``."""
    parser = build_sample_parser()
    args = parse_with_config(parser, argv)
    if args.run_dir is None:
        return args, None
    return args, runs.apply_to_sample(args, runs.explicit_flags(parser, argv, args.config))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``parse_run_args`` without the line."""
    return parse_run_args(argv)[0]


def load_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The transformer to sample with: the base model's, --transformer_path's, or the base with --lora_path's
    adapter (loaded the way FluxPipeline.load_lora_weights loads it), in eval mode."""
    from fastvideo import lora, models

    model = models.family_for(args).load_transformer(args.transformer_path or args.pretrained_model_name_or_path,
                                                     dtype=dtype, device=device)
    if args.lora_path is not None:
        lora.load_lora_from_diffusers(model, args.lora_path)
    return model.requires_grad_(False).eval()


def sample(args: argparse.Namespace, taken: str | None, base: dict | None) -> list[dict]:
    """Encode the prompts (and check them against the reward and --compare), load the models, sample and score this
    rank's images, then rank 0 writes the index, the summary and (--compare) the side-by-side grid. Returns every
    image's index row, on every rank; the process group stays up (the caller's ``D.cleanup()``)."""
    from fastvideo import models
    from fastvideo.config import save_config
    from fastvideo.data import EmbeddingDataset
    from fastvideo.devices import ACCELERATOR_TYPES
    from fastvideo.memory import auto_decode_batch_size
    from fastvideo.record import image_name
    from fastvideo.rewards import build_reward, check_reward_paths, check_reward_prompts
    from fastvideo.seeding import NoiseSource
    from fastvideo.devices import compute_dtype
    from fastvideo.rewards import REWARD_PATH_FLAGS
    from fastvideo.edits import source_file
    from fastvideo.rewards import source_distance

    dist = D.init_distributed(args.device)
    out = Path(args.output_dir)
    paths = {k: getattr(args, k) for k in REWARD_PATH_FLAGS}
    for spec in filter(None, (args.reward, args.eval_reward)):  # every reward's files, before anything loads
        check_reward_paths(spec, **paths)
    if dist.is_main:
        if taken is not None:
            print(taken, flush=True)
        save_config(args, out / "config.json")

    # ---- 1. prompts: a prompt file is encoded once (text encoders only), a manifest is read as it is ----------
    manifest = evaluation.prompt_manifest(args.prompts, args.pretrained_model_name_or_path, out / "embeddings",
                                          max_sequence_length=args.max_sequence_length, dtype=args.embedding_dtype,
                                          device=dist.device, model_family=models.spec_of(args),
                                          negative_prompt=args.negative_prompt if args.cfg_scale > 1 else None)
    dataset = EmbeddingDataset(manifest).use(models.family_for(args), negative=args.cfg_scale > 1)
    dataset.check_encoders(args.pretrained_model_name_or_path, models.spec_of(args))
    n = min(args.max_prompts or len(dataset), len(dataset))
    for spec in filter(None, (args.reward, args.eval_reward)):
        check_reward_prompts(spec, dataset.prompts[:n], f"--prompts {args.prompts}", judge_score=args.judge_score)
    if base is not None:
        evaluation.check_compare_prompts(base, dataset.prompts[:n], args.compare)

    # ---- 2. models: reward, transformer (+ LoRA), VAE ---------------------------------------------------------
    errors.inputs_checked()  # from here on an error is the run's (traceback), not a bad input's (one line)
    reward_fn, eval_reward_fn = (build_reward(spec, dist.device, batch_size=args.reward_batch_size, **paths)
                                 if spec else None for spec in (args.reward, args.eval_reward))
    amp_dtype = compute_dtype(args.mixed_precision, dist.device)
    model = load_model(args, dist.device, amp_dtype or torch.float32)
    family = models.family_for(args)
    vae = family.load_vae(args.pretrained_model_name_or_path, dtype=amp_dtype or torch.float32,
                          device=dist.device)  # decodes in the compute dtype, as FluxPipeline
    geometry = models.geometry_for(family, vae, args.h, args.w, getattr(args, "num_frames", None),
                                   condition=dataset.condition_size)  # an edit store: its sources' size
    decode_batch = 0  # the CPU decodes a whole batch per call; a GPU/NPU in calls planned within 4 GiB
    if dist.device.type in ACCELERATOR_TYPES:
        decode_batch = auto_decode_batch_size(args.pretrained_model_name_or_path, args.h, args.w,
                                              amp_dtype or torch.float32, args.batch_size,
                                              model_family=models.spec_of(args),
                                              frames=getattr(args, "num_frames", None))
    cfg = evaluation.ode_config(height=args.h, width=args.w, steps=args.num_inference_steps, shift=args.shift,
                                guidance=args.guidance_scale, batch_size=args.batch_size,
                                decode_batch_size=decode_batch, cfg_scale=args.cfg_scale,
                                model_path=args.pretrained_model_name_or_path)

    # ---- 3. this rank's images, in batches: sample -> PNG -> score -------------------------------------------
    prompt_ids, sample_indices, real = evaluation.image_items(n, args.num_images_per_prompt, dist.rank,
                                                              dist.world_size)
    prompt_ids, sample_indices = prompt_ids[:real], sample_indices[:real]
    noise = NoiseSource(args.seed, device=args.noise_device)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rows, t0 = [], time.perf_counter()
    for start in range(0, real, args.batch_size):
        ids, idx = prompt_ids[start:start + args.batch_size], sample_indices[start:start + args.batch_size]
        images = evaluation.ode_images(model, vae, dataset, ids, idx, cfg, noise, geometry, device=dist.device,
                                       amp_dtype=amp_dtype)  # (b, 3, H, W)
        prompts = [dataset.prompts[i] for i in ids]
        sources = dataset.source_images(ids)  # an edit store's sources, which edit rewards compare with
        scores = reward_fn(images, prompts, sources) if reward_fn is not None else {}
        if sources is not None and "source_distance" not in scores:  # the edits' watch, with or without a reward
            scores["source_distance"] = source_distance(images, sources)
        if eval_reward_fn is not None:  # each extra reward and its checks, outside --reward's total
            scores = {**scores, **evaluation.extra_scores(eval_reward_fn(images, prompts, sources), scores)}
        for j, (p, k) in enumerate(zip(ids, idx)):  # a video: videos/NAME.mp4 and its frame strip as the PNG
            files = evaluation.save_sample(images[j], out, image_name(p, k), getattr(args, "fps", None))
            if sources is not None:  # the source it edited: the store's copy
                files["source"] = str(source_file(dataset.root, p))
            rows.append({"prompt_id": p, "sample_index": k, "prompt": prompts[j], "seed": args.seed, **files,
                         **{name: float(v[j]) for name, v in scores.items()}})
    seconds = D.all_reduce_max(time.perf_counter() - t0)

    # ---- 4. rank 0: index, summary, comparison grid ----------------------------------------------------------
    rows = sorted((r for rank_rows in D.all_gather_object(rows) for r in rank_rows),
                  key=lambda r: (r["prompt_id"], r["sample_index"]))
    if dist.is_main:
        summary = evaluation.write_sample_index(out, rows, seconds)
        print(evaluation.describe_summary(summary, out), flush=True)
        if base is not None:
            grid = evaluation.compare_grid(base, Path(args.compare), rows, out, args.compare_max_prompts)
            paired = evaluation.compare_summary(base["rows"], rows)
            (out / "compare.json").write_text(json.dumps({"base": args.compare, "rewards": paired}, indent=2) + "\n")
            for name, c in paired.items():
                print(f"  {name}: base {c['base']:.6g} -> {c['this']:.6g}, difference {c['difference']:+.4g} [95% "
                      f"{c['difference_ci95_low']:+.4g}, {c['difference_ci95_high']:+.4g}] (paired by prompt and "
                      f"noise, {c['num_images']} images)", flush=True)
            print(f"comparison: {grid}\n            {out / 'compare.json'}", flush=True)
    return rows
