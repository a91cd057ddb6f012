"""Fixed-noise ODE sampling of a prompt set and reward statistics: shared by the trainers' held-out evaluation
(``training.Run.evaluate``) and ``sample.py``.

An image is keyed by (prompt id, sample index) like every other draw (docs/design.md principle 4): its initial noise is
``NoiseSource(seed).randn(..., step=0, prompt_id=p, sample_index=k, purpose="init")``, so the same seed gives the same
images whatever the ranks, batch size or model (base vs tuned: same noise, the picture people compare).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fastvideo import models, weights
from fastvideo.data import MANIFEST_NAME, atomic_write_text, is_manifest, open_prompt_store, write_prompt_store
from fastvideo.options import need, opt
from fastvideo.record import read_jsonl
from fastvideo.rewards import WATCH_KEYS, check_url_reward_flags, parse_eval_reward_spec, parse_reward_spec
from fastvideo.rollout import VIDEO_SAMPLER_FLAGS, RolloutConfig, rollout

# two-sided 95% Student-t quantiles t(0.975, df) for df = 1..30 (beyond: the normal 1.96)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def check_prompts_path(flag: str, path: str | os.PathLike | None) -> None:
    """A prompt source flag names an embedding manifest (or its folder) or a prompt file that exists
    (FileNotFoundError naming the fix); checked before anything loads."""
    if path is None:
        return
    path = Path(path)
    if path.is_dir() and not (path / MANIFEST_NAME).is_file():
        raise FileNotFoundError(f"{flag} {path}: a folder without {MANIFEST_NAME}; pass a prompt file (one prompt per "
                                "line) or the manifest.json written by preprocess_embeddings.py")
    if not path.exists():
        kind = "embedding manifest" if is_manifest(path) else "prompt file"
        raise FileNotFoundError(f"{flag} {path}: no such {kind}; pass a prompt file (one prompt per line) or the "
                                "manifest.json written by preprocess_embeddings.py")


def prompt_manifest(prompts: str | os.PathLike, model_path: str | os.PathLike, work_dir: str | os.PathLike, *,
                    max_sequence_length: int, dtype: str, device: torch.device, model_family: str = "auto",
                    negative_prompt: str | None = None) -> Path:
    """``prompts`` as an embedding manifest: a manifest (or its folder) is used as it is; a prompt file is encoded
    into ``work_dir`` with ``model_path``'s text encoders (loaded, then freed, before any other model; a restart keeps
    the finished shards; ``negative_prompt``: also encode it, for --cfg_scale > 1); for an edit model the file is an
    edit file (``preprocess_embeddings.py --edit_file``'s JSON Lines, the VAE loaded too). A collective: every rank
    calls it."""
    if is_manifest(prompts):
        return Path(prompts)
    edit = models.resolve(model_family, model_path).edit
    writer = open_prompt_store(None if edit else prompts, model_path, work_dir,
                               max_sequence_length=max_sequence_length, dtype=dtype, model_family=model_family,
                               negative_prompt=negative_prompt, edit_file=prompts if edit else None)
    write_prompt_store(writer, device=device)
    return Path(work_dir) / MANIFEST_NAME


def image_items(num_prompts: int, per_prompt: int, rank: int, world_size: int) -> tuple[list[int], list[int], int]:
    """This rank's ``(prompt ids, sample indices, real count)`` of the ``num_prompts x per_prompt`` images in global
    order ``[p0 s0..s(K-1), p1 s0.., ...]``: a contiguous slice, padded with repeats of the last image to the same
    count on every rank (FSDP needs the same forwards everywhere), so that gathering every rank's results and keeping
    the first ``num_prompts * per_prompt`` gives the real images in order."""
    total = num_prompts * per_prompt
    per_rank = -(-total // world_size)
    flat = [min(i, total - 1) for i in range(rank * per_rank, (rank + 1) * per_rank)]
    real = max(0, min(total, (rank + 1) * per_rank) - rank * per_rank)
    return [i // per_prompt for i in flat], [i % per_prompt for i in flat], real


def ode_images(model: torch.nn.Module, vae: torch.nn.Module, dataset: Any, prompt_ids: list[int],
               sample_indices: list[int], cfg: Any, noise: Any, geometry: Any, *, device: torch.device,
               amp_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Images (B, 3, H, W) in [0, 1] of (prompt id, sample index) pairs, sampled with the deterministic Euler ODE of
    ``cfg`` (a ``rollout.RolloutConfig``; its noise settings are overridden) from ``noise``'s step-0 initial noise; the
    model runs in eval mode (restored after)."""
    cfg = dataclasses.replace(cfg, eta=0.0, solver="euler", sde_window_size=0, init_same_noise=False)
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in dataset.get_batch(prompt_ids).items()}
    was_training = model.training
    model.eval()
    try:
        traj = rollout(model, vae, batch, sample_indices, 0, cfg, noise, geometry, device=device,
                       autocast_dtype=amp_dtype, keep_latents=False)
    finally:
        model.train(was_training)
    return traj.images


def save_sample(sample: torch.Tensor, out: Path, name: str, fps: int | None = None) -> dict[str, str]:
    """One sample under ``out``: an image (3, H, W) as ``images/NAME.png``; a video (F, 3, H, W) as an MP4
    ``videos/NAME.mp4`` at ``fps`` and its frame strip ``images/NAME.png`` (evenly spaced frames, in order), which
    the PNG readers (scoring, --compare grids) take. Returns the index row's entries (paths relative to ``out``)."""
    from fastvideo.record import save_png

    (out / "images").mkdir(parents=True, exist_ok=True)
    if sample.ndim == 3:
        save_png(sample, out / "images" / name)
        return {"path": f"images/{name}"}
    from fastvideo.logging import strip_grid
    from fastvideo.video import write_mp4

    save_png(strip_grid(sample[None]), out / "images" / name)
    video = Path(name).with_suffix(".mp4").name
    write_mp4(sample, out / "videos" / video, fps or 16)
    return {"path": f"images/{name}", "video": f"videos/{video}"}


def t_quantile_975(df: int) -> float:
    """The two-sided 95% Student-t quantile for ``df`` degrees of freedom (>= 1)."""
    return _T975[df - 1] if df <= len(_T975) else 1.96


def summarize(values: torch.Tensor, prompt_ids: torch.Tensor) -> dict[str, float]:
    """Statistics of one reward over a sample set: ``mean`` and ``std`` (population) over images, and the 95%
    interval of the mean (``ci95_low``, ``ci95_high``; Student t) over prompt means: images of one prompt are not
    independent, prompts are the unit (one image per prompt: the images; NaN with fewer than two units). Non-finite
    values (samples dropped for a non-finite reward) are left out."""
    values, prompt_ids = values.double().cpu(), prompt_ids.long().cpu()
    keep = torch.isfinite(values)
    values, prompt_ids = values[keep], prompt_ids[keep]
    n = len(values)
    if n == 0:
        nan = float("nan")
        return {"mean": nan, "std": nan, "ci95_low": nan, "ci95_high": nan, "num_images": 0, "num_prompts": 0}
    ids, inverse = torch.unique(prompt_ids, return_inverse=True)
    units = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, inverse, values) / torch.bincount(inverse)
    mean = float(values.mean())
    if len(units) >= 2:
        half = t_quantile_975(len(units) - 1) * float(units.std(unbiased=True)) / math.sqrt(len(units))
    else:
        half = float("nan")
    return {"mean": mean, "std": float(values.std(unbiased=False)), "ci95_low": mean - half, "ci95_high": mean + half,
            "num_images": n, "num_prompts": len(ids)}


def reward_summary(rewards: dict[str, torch.Tensor], prompt_ids: torch.Tensor) -> dict[str, dict[str, float]]:
    """``summarize`` of every reward entry ("total" and each component), keyed by name."""
    return {name: summarize(values, prompt_ids) for name, values in rewards.items()}


def eval_metrics(summary: dict[str, dict[str, float]]) -> dict[str, float]:
    """What a training run logs of a held-out evaluation: ``eval/reward_mean``, ``eval/reward_std``,
    ``eval/reward_ci95_low|high`` of the weighted total, and ``eval/reward_<component>`` means."""
    total = summary["total"]
    metrics = {"eval/reward_mean": total["mean"], "eval/reward_std": total["std"],
               "eval/reward_ci95_low": total["ci95_low"], "eval/reward_ci95_high": total["ci95_high"]}
    metrics.update({f"eval/reward_{name}": s["mean"] for name, s in summary.items() if name != "total"})
    return metrics


def extra_scores(rewards: dict[str, torch.Tensor], taken: Any = ()) -> dict[str, torch.Tensor]:
    """The entries of an --eval_reward RewardFn's result that are logged: each reward (``<name>``) and its checks
    (``<name>_<key>``), without its weighted "total" (the extras are watched one by one, never summed) and the
    watches both RewardFns add (``WATCH_KEYS``: --reward's are the same numbers). ValueError if one would overwrite a
    name in ``taken`` (--reward's entries)."""
    extra = {k: v for k, v in rewards.items() if k != "total" and k not in WATCH_KEYS}
    clash = sorted(set(extra) & set(taken))
    if clash:
        raise ValueError(f"--eval_reward's {clash} would overwrite --reward's entries of the same names; drop those "
                         "rewards from --eval_reward")
    return extra


def extra_eval_metrics(summary: dict[str, dict[str, float]]) -> dict[str, float]:
    """What a training run logs of its --eval_reward rewards (``reward_summary`` of ``extra_scores``): ``eval/<name>``
    and ``eval/<name>_<key>`` means, e.g. ``eval/toyworld_clean``, ``eval/toyworld_clean_stray``. No reward name
    starts with "reward" (tests/test_toyworld_clean.py), so these never meet ``eval_metrics``'s ``eval/reward_*``."""
    return {f"eval/{name}": s["mean"] for name, s in summary.items() if name != "total"}


# ------------------------------------------------------------------------------------------------ sample.py outputs
def ode_config(*, height: int, width: int, steps: int, shift: float | None, guidance: float, batch_size: int,
               decode_batch_size: int = 0, cfg_scale: float = 1.0, model_path: str | None = None) -> Any:
    """The ``rollout.RolloutConfig`` of the stock pipeline's sampling: Euler ODE, ``steps`` steps, the family's sigma
    schedule (with ``model_path``'s scheduler config) unless ``shift``, distilled ``guidance``, true CFG
    ``cfg_scale``; ``batch_size`` images per transformer call, ``decode_batch_size`` latents per VAE call (0 =
    ``batch_size``)."""
    return RolloutConfig(height=height, width=width, sampling_steps=steps, sde_type="flow_sde", eta=0.0, shift=shift,
                         guidance=guidance, batch_size=batch_size, decode_batch_size=decode_batch_size,
                         cfg_scale=cfg_scale, scheduler=models.read_scheduler_config(model_path))


def read_sample_dir(path: str | os.PathLike) -> dict[str, Any]:
    """A finished sample.py --output_dir: ``{"config": its flags, "rows": index.jsonl}`` (FileNotFoundError naming the
    fix when it is not one)."""
    path = Path(path)
    if not (path / "index.jsonl").is_file() or not (path / "config.json").is_file():
        raise FileNotFoundError(f"--compare {path}: no index.jsonl and config.json there; pass the --output_dir of a "
                                "finished sample.py run (e.g. of the base model, with the same --prompts and --seed)")

    return {"config": json.loads((path / "config.json").read_text()), "rows": read_jsonl(path / "index.jsonl")}


def check_compare_prompts(base: dict[str, Any], prompts: list[str], where: str) -> None:
    """The --compare folder's images are of the same prompts (by id) as this run's, and the two share an image
    (ValueError naming the first mismatch)."""
    shared = [r for r in base["rows"] if r["prompt_id"] < len(prompts)]
    for row in shared:
        if row["prompt"] != prompts[row["prompt_id"]]:
            raise ValueError(f"--compare {where}: prompt {row['prompt_id']} there is {row['prompt']!r} but here "
                             f"{prompts[row['prompt_id']]!r}; sample both with the same --prompts")
    if not shared:
        raise ValueError(f"--compare {where} holds no image of this run's prompts; sample both with the same --prompts")


def write_sample_index(out: Path, rows: list[dict], seconds: float) -> dict[str, Any]:
    """OUT/index.jsonl (one row per image, in (prompt, image) order) and OUT/summary.json (counts, time and
    ``summarize`` of every reward); returns the summary."""
    reward_names = [k for k in rows[0] if k not in ("prompt_id", "sample_index", "prompt", "seed", "path", "video",
                                                    "source")]
    ids = torch.tensor([r["prompt_id"] for r in rows])
    summary = {"num_images": len(rows), "num_prompts": len({r["prompt_id"] for r in rows}),
               "seconds": seconds, "images_per_second": len(rows) / max(seconds, 1e-9),
               "rewards": {name: summarize(torch.tensor([r[name] for r in rows]), ids) for name in reward_names}}
    atomic_write_text(out / "index.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary


def describe_summary(summary: dict[str, Any], out: Path) -> str:
    """What sample.py prints at the end: counts, speed, each reward's mean [95% interval], and where things are."""
    lines = [f"{summary['num_images']} images of {summary['num_prompts']} prompts in {summary['seconds']:.1f} s "
             f"({summary['images_per_second']:.2f} images/s)"]
    lines += [f"  {name}: mean {s['mean']:.6g} [95% {s['ci95_low']:.6g}, {s['ci95_high']:.6g}], std {s['std']:.4g}"
              for name, s in summary["rewards"].items()]
    if (out / "videos").is_dir():  # a video family: the MP4s, and images/ holds their frame strips
        lines.append(f"videos: {out / 'videos'}")
    lines.append(f"images: {out / 'images'}\nindex:  {out / 'index.jsonl'}\nsummary: {out / 'summary.json'}")
    return "\n".join(lines)


def compare_summary(base_rows: list[dict], rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per reward scored in both runs, on the images both made (same prompt and index: the same noise): ``base`` and
    ``this`` means and the paired ``difference`` (this - base) with its 95% interval over prompts (``summarize`` of the
    per-image differences), which is far tighter than comparing two unpaired means."""
    base = {(r["prompt_id"], r["sample_index"]): r for r in base_rows}
    shared = [r for r in rows if (r["prompt_id"], r["sample_index"]) in base]
    if not shared:
        return {}
    first = base[(shared[0]["prompt_id"], shared[0]["sample_index"])]
    names = [k for k, v in shared[0].items() if isinstance(v, float) and k in first]  # the rewards both scored
    ids = torch.tensor([r["prompt_id"] for r in shared])
    out = {}
    for name in names:
        mine = torch.tensor([r[name] for r in shared], dtype=torch.float64)
        theirs = torch.tensor([base[(r["prompt_id"], r["sample_index"])][name] for r in shared], dtype=torch.float64)
        diff = summarize(mine - theirs, ids)
        out[name] = {"base": float(theirs.mean()), "this": float(mine.mean()), "difference": diff["mean"],
                     "difference_ci95_low": diff["ci95_low"], "difference_ci95_high": diff["ci95_high"],
                     "num_images": len(shared)}
    return out


def compare_grid(base: dict[str, Any], base_dir: Path, rows: list[dict], out: Path, max_prompts: int) -> Path:
    """OUT/compare.png: one row per prompt (the first ``max_prompts`` both runs sampled), its prompt, then the base
    run's images and this run's of the same (prompt, image index) -- the same noise -- with each image's total reward
    when scored; images are shown 192 to 384 px wide."""
    from PIL import Image, ImageDraw  # heavy

    mine = {(r["prompt_id"], r["sample_index"]): r for r in rows}
    theirs = {(r["prompt_id"], r["sample_index"]): r for r in base["rows"]}
    keys = sorted(set(mine) & set(theirs))
    prompt_ids = sorted({p for p, _ in keys})[:max_prompts]
    per_prompt = max(sum(1 for p, _ in keys if p == pid) for pid in prompt_ids)
    with Image.open(out / rows[0]["path"]) as first:
        w, h = first.size
    # cells of 192..384 px: small images enlarged by an integer factor (nearest), FLUX-size ones shrunk (a grid of 8
    # prompts x 2 x 4 images of 1024 px would be 8k x 8k)
    scale = max(1, -(-192 // max(w, h))) if max(w, h) <= 384 else 384 / max(w, h)
    cw, ch, text_w, label_h, gap = round(w * scale), round(h * scale), 220, 16, 12
    width = text_w + 2 * per_prompt * (cw + 4) + gap
    canvas = Image.new("RGB", (width, 22 + len(prompt_ids) * (ch + label_h + 8)), "white")
    draw = ImageDraw.Draw(canvas)
    draw.text((text_w, 4), f"base: {base_dir}", fill="black")
    draw.text((text_w + per_prompt * (cw + 4) + gap, 4), f"this run: {out}", fill="black")
    for row_i, pid in enumerate(prompt_ids):
        y = 22 + row_i * (ch + label_h + 8)
        prompt = mine.get((pid, 0), theirs.get((pid, 0), {"prompt": ""}))["prompt"]
        for line_i, line in enumerate(textwrap.wrap(prompt, 34)[:6]):
            draw.text((4, y + 12 * line_i), line, fill="black")
        for side, (source, folder) in enumerate(((theirs, base_dir), (mine, out))):
            for k in range(per_prompt):
                row = source.get((pid, k))
                if row is None:
                    continue
                x = text_w + side * (per_prompt * (cw + 4) + gap) + k * (cw + 4)
                with Image.open(folder / row["path"]) as img:
                    resample = Image.NEAREST if scale >= 1 else Image.LANCZOS
                    canvas.paste(img.convert("RGB").resize((cw, ch), resample), (x, y))
                if "total" in row:
                    draw.text((x, y + ch + 2), f"{row['total']:.4g}", fill="black")
    path = out / "compare.png"
    canvas.save(path)
    return path


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
        None, "local diffusers model folder (text encoders, VAE, and the transformer unless --transformer_path); "
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
    num_frames: int | None = opt(None, "frames per video (default: the video family's pipeline default, Wan 81; "
                                       "image families take none)")
    fps: int | None = opt(None, "frame rate of the MP4s written (default: the video family's, Wan 16)")
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


# sample.py flags that must equal the --compare folder's (the same noise and sampler, or the grid compares nothing)
COMPARE_KEYS = ("seed", "num_inference_steps", "guidance_scale", "cfg_scale", "h", "w", "num_frames", "shift",
                "noise_device")


def fill_family_defaults(args: argparse.Namespace, family: Any) -> None:
    """sample.py's unset sampler flags (None) from the model family's pipeline defaults (``SamplerDefaults.fill``)."""
    d = family.sampler_defaults(args.pretrained_model_name_or_path)
    d.fill(args, {"num_inference_steps": "steps", "h": "height", "w": "width",
                  "max_sequence_length": "max_sequence_length", "cfg_scale": "cfg_scale", "guidance_scale": "guidance"},
           unused_guidance=1.0)
    if family.video:
        d.fill(args, VIDEO_SAMPLER_FLAGS, unused_guidance=1.0)
    if getattr(args, "negative_prompt", None) is None and args.cfg_scale > 1:
        args.negative_prompt = d.negative_prompt


def validate_sample(args: argparse.Namespace) -> dict | None:
    """sample.py's flags, paths and output folder, before anything loads (ValueError / FileNotFoundError naming the
    fix); returns the --compare folder (``evaluation.read_sample_dir``) or None."""
    need(getattr(args, "run_dir", None) is not None or not getattr(args, "base", False),
         "--base samples a training run's base model: pass --run_dir OUT too (without --run_dir, leave out "
         "--lora_path and --transformer_path to sample a base model)")
    need(args.pretrained_model_name_or_path is not None,
         "--pretrained_model_name_or_path is required (a local diffusers model folder), or --run_dir OUT (a training "
         "run)")
    model = Path(args.pretrained_model_name_or_path)
    if not (model / "model_index.json").is_file():
        raise FileNotFoundError(f"--pretrained_model_name_or_path {model}: no model_index.json there; point it at a "
                                "local diffusers model folder")
    family = models.family_for(args)
    fill_family_defaults(args, family)
    need(args.prompts is not None, "--prompts is required: a prompt file (one per line) or an embeddings manifest")
    check_prompts_path("--prompts", args.prompts)
    need(args.lora_path is None or args.transformer_path is None,
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
        need(getattr(args, flag) >= 1, f"--{flag} must be >= 1, got {getattr(args, flag)}")
    need(args.max_prompts >= 0, f"--max_prompts must be >= 0 (0 = all), got {args.max_prompts}")
    limit = family.max_sequence_length_limit()
    need(1 <= args.max_sequence_length <= limit, f"--max_sequence_length must be in [1, {limit}], got "
                                                  f"{args.max_sequence_length}")
    need(args.shift is None or args.shift > 0, f"--shift must be > 0, got {args.shift}")
    need(args.cfg_scale >= 1, f"--cfg_scale must be >= 1 (1 = no classifier-free guidance), got {args.cfg_scale}")
    models.geometry_for(family, model, args.h, args.w, getattr(args, "num_frames", None))  # ValueError naming the flag
    if args.reward:
        parse_reward_spec(args.reward)
    parse_eval_reward_spec(args.eval_reward, args.reward)
    check_url_reward_flags(args)
    out = Path(args.output_dir)
    if (out / "index.jsonl").exists():
        raise ValueError(f"--output_dir {out} already holds a sampling (index.jsonl); choose a new --output_dir (or "
                         "delete that one)")
    if args.compare is None:
        return None
    base = read_sample_dir(args.compare)
    diffs = {k: (base["config"].get(k), getattr(args, k)) for k in COMPARE_KEYS
             if base["config"].get(k) != getattr(args, k)}
    need(not diffs, f"--compare {args.compare} was sampled with other settings ("
                     + "; ".join(f"--{k} {a!r} there vs {b!r} here" for k, (a, b) in diffs.items())
                     + "): pass the same values, so that both sides start from the same noise")
    need(Path(args.compare).resolve() != out.resolve(), "--compare must name another sample.py --output_dir")
    return base
