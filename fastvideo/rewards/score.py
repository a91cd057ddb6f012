"""Score a fixed image set with a reward model, batched, on any device: for checking a reward model across devices.

    python -m fastvideo.rewards.score --reward hpsv2 --hps_checkpoint HPS_v2.1_compressed.pt \
        --images DIR_OR_RECORD [--prompts FILE] --out scores.jsonl [--device npu] [--batch_size 16]
    python -m fastvideo.rewards.score --run_dir OUT [--images DIR --out scores.jsonl] [--device npu]

``--images`` is a folder of images (PNG/JPEG/WebP, sorted by path; ``--prompts`` then gives one prompt per line in
that order, or JSON lines ``{"image": relative path, "prompt": ...}``), a ``sample.py --output_dir`` (its index.jsonl
gives each image's prompt) or a ``--record_dir`` recording (its images with their prompts); ``--prompts`` is not
needed for the last two. ``--run_dir OUT`` (a trainer's --output_dir) takes the reward, its path flags and --device from
the run's OUT/config.json (flags given here win); without --images it scores ``OUT/sampled/final`` (what
``sample.py --run_dir OUT`` wrote) into ``OUT/sampled/final/scores.jsonl`` unless --out is given. Each output line is
``{"image", "prompt", "total", <component>: ...}``; ``python -m fastvideo.compare A.jsonl B.jsonl`` compares two such
files.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

from fastvideo import runs
from fastvideo.config import build_parser, parse_with_config
from fastvideo.distributed import pick_device_type
from fastvideo.record import load_image, read_jsonl
from fastvideo.rewards import REWARD_PATH_FLAGS, RewardOptions, build_reward, parse_reward_spec
from fastvideo.rewards.http import RewardServerError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")


def _all_there(images: Path, found: list[tuple[str, Path, str]], listing: str, empty: str
               ) -> list[tuple[str, Path, str]]:
    """``found`` (the images ``listing`` names) when every file is there and there is one (FileNotFoundError /
    ValueError naming the folder otherwise)."""
    missing = [name for name, path, _ in found if not path.is_file()]
    if missing:
        raise FileNotFoundError(f"--images {images}: {listing} lists {len(missing)} image(s) that are not there, e.g. "
                                f"{missing[0]}")
    if not found:
        raise ValueError(f"--images {images}: {listing} {empty}")
    return found


def image_set(images: Path, prompts: Path | None) -> list[tuple[str, Path, str]]:
    """``(name, path, prompt)`` of every image to score, in a fixed order (FileNotFoundError / ValueError naming the
    fix when images or prompts are missing or their counts differ)."""
    if not images.is_dir():
        raise FileNotFoundError(f"--images {images}: no such folder; pass a folder of images, a sample.py "
                                "--output_dir or a --record_dir")
    if (images / "index.jsonl").is_file() and (images / "config.json").is_file():  # a sample.py --output_dir
        found = [(r["path"], images / r["path"], r["prompt"]) for r in read_jsonl(images / "index.jsonl")]
        return _all_there(images, found, "its index.jsonl", "lists no images")
    if (images / "manifest.json").is_file() and any(images.glob("samples-rank*.jsonl")):  # a recording
        rows = sorted((r for path in images.glob("samples-rank*.jsonl") for r in read_jsonl(path)),
                      key=lambda r: (r["step"], r["prompt_id"], r["sample_index"]))
        found = [(r["image"], images / r["image"], r["prompt"]) for r in rows]
        return _all_there(images, found, "the recording", "holds no images (record a run that samples)")
    files = sorted(p for p in images.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise FileNotFoundError(f"--images {images}: no {'/'.join(IMAGE_SUFFIXES)} files there")
    if prompts is None:
        raise ValueError(f"--images {images} is a plain folder: pass --prompts FILE (one prompt per image)")
    if not prompts.is_file():
        raise FileNotFoundError(f"--prompts {prompts}: no such file")
    names = [p.relative_to(images).as_posix() for p in files]
    if prompts.suffix == ".jsonl":
        by_name = {r["image"]: r["prompt"] for r in read_jsonl(prompts)}
        lacking = [n for n in names if n not in by_name]
        if lacking:
            raise ValueError(f"--prompts {prompts} gives no prompt for {len(lacking)} image(s), e.g. {lacking[0]}; "
                             "add a line {\"image\": ..., \"prompt\": ...} for each")
        return [(n, p, by_name[n]) for n, p in zip(names, files)]
    lines = [line for line in prompts.read_text().splitlines() if line.strip()]
    if len(lines) != len(files):
        raise ValueError(f"--prompts {prompts} has {len(lines)} prompts but --images {images} has {len(files)} images; "
                         "give one prompt per image, in the images' sorted order (or JSON lines with 'image')")
    return [(n, p, text) for n, p, text in zip(names, files, lines)]


def score_images(reward_fn, items: list[tuple[str, Path, str]], batch_size: int,
                 device: torch.device) -> list[dict]:
    """Score ``items`` in batches of up to ``batch_size`` images of one size; rows in the order of ``items``."""
    rows: list[dict | None] = [None] * len(items)
    start = 0
    while start < len(items):
        first = load_image(items[start][1])
        batch, index = [first], [start]
        end = start + 1
        while end < len(items) and len(batch) < batch_size:
            image = load_image(items[end][1])
            if image.shape != first.shape:
                break
            batch.append(image)
            index.append(end)
            end += 1
        scores = reward_fn(torch.stack(batch).to(device), [items[i][2] for i in index])
        for j, i in enumerate(index):
            name, _, prompt = items[i]
            rows[i] = {"image": name, "prompt": prompt, **{k: float(v[j]) for k, v in scores.items()}}
        start = end
    return rows  # type: ignore[return-value]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The flags, with --run_dir's reward, reward paths, device and default images filled in where no flag was given
    (``runs.apply_to_score``; its line in ``args.run_line``); ValueError / FileNotFoundError naming the fix."""
    parser = build_parser((RewardOptions,), "Score a fixed image set with a reward model (batched).",
                          exclude=("nonfinite_reward", "eval_reward"))  # a trainer's policy / evaluation; this tool
    # scores with --reward only
    parser.prog = "python -m fastvideo.rewards.score"
    parser.add_argument("--run_dir", default=None,
                        help="a training run's --output_dir: take its --reward, reward path flags and --device (flags "
                             "given here win); without --images, score OUT/sampled/final (sample.py --run_dir OUT's "
                             "output) into OUT/sampled/final/scores.jsonl")
    parser.add_argument("--images", type=Path, default=None,
                        help="a folder of images, a sample.py --output_dir or a --record_dir recording; required "
                             "unless --run_dir")
    parser.add_argument("--prompts", type=Path, default=None,
                        help="one prompt per line in the images' sorted order, or JSON lines {image, prompt} "
                             "(not needed for a sample.py folder or a recording)")
    parser.add_argument("--out", type=Path, default=None,
                        help="scores.jsonl to write; required unless --run_dir scores its OUT/sampled/final")
    parser.add_argument("--device", default=None, help="cuda | npu | cpu (default: first available in that order)")
    parser.add_argument("--batch_size", type=int, default=16, help="images per reward call (default: 16)")
    args = parse_with_config(parser, argv)
    args.run_line = None
    if args.run_dir is not None:
        args.run_line = runs.apply_to_score(args, runs.explicit_flags(parser, argv, args.config))
    if args.images is None:
        raise ValueError("--images is required (a folder of images, a sample.py --output_dir or a --record_dir), or "
                         "--run_dir OUT to score what sample.py --run_dir OUT wrote")
    if args.out is None:
        raise ValueError("--out is required: the scores.jsonl to write")
    args.images, args.out = Path(args.images), Path(args.out)
    args.path_flags = {k: getattr(args, k) for k in REWARD_PATH_FLAGS}
    return args


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        if args.run_line is not None:
            print(args.run_line, flush=True)
        if args.batch_size < 1:
            raise ValueError(f"--batch_size must be >= 1, got {args.batch_size}")
        parse_reward_spec(args.reward)
        items = image_set(args.images, args.prompts)
        device = torch.device(pick_device_type(args.device))
        reward_fn = build_reward(args.reward, device, **args.path_flags)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RewardServerError as err:  # a remote:URL / vlm_judge:URL server that does not answer: one line, not a trace
        print(f"error: {err}", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    rows = score_images(reward_fn, items, args.batch_size, device)
    seconds = time.perf_counter() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    means = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0] if k not in ("image", "prompt")}
    print(f"scored {len(rows)} images on {device} in {seconds:.1f} s ({len(rows) / max(seconds, 1e-9):.1f} images/s): "
          + ", ".join(f"{k} {v:.6g}" for k, v in means.items()) + f"\nscores: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
