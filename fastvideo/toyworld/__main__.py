"""``python -m fastvideo.toyworld {build,pretrain,prompts,failures,build-video,pretrain-video,motion-prompts,edits,
build-edit,pretrain-edit}``: the toy FLUX from the shipped weights or trained from scratch, the prompt splits as files,
what the verifier's failures are in sample.py's output folders; the toy Wan of the toy world in time (shipped or
trained from scratch) and its prompt splits; the toy edit world's edit files and its toy Kontext (shipped or trained
from the toy FLUX)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from fastvideo.toyworld.edit_world import write_edit_file
from fastvideo.toyworld.motion import write_motion_prompt_files
from fastvideo.toyworld.pretrain_edit import EditPretrainConfig
from fastvideo.toyworld.pretrain_edit import build_from_shipped as build_edit_from_shipped
from fastvideo.toyworld.pretrain_edit import pretrain as pretrain_edit
from fastvideo.toyworld.pretrain import EVAL_FILE, PretrainConfig, build_from_shipped, pretrain
from fastvideo.toyworld.pretrain_video import VideoPretrainConfig
from fastvideo.toyworld.pretrain_video import build_from_shipped as build_video_from_shipped
from fastvideo.toyworld.pretrain_video import pretrain as pretrain_video
from fastvideo.toyworld.scenes import SceneSpec, is_heldout, parse_prompt, write_prompt_files
from fastvideo.toyworld.verify import FAILURE_MODES, failure_modes


def _pretrain_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pretrain", help="train the toy FLUX (VAE + transformer) on toy-world scenes from scratch")
    p.add_argument("--out", required=True, help="output FLUX folder (must not exist or be empty)")
    p.add_argument("--eval_every", type=int, default=0, help="also log a 128-prompt evaluation of the EMA every N "
                   "transformer steps (0 = only the final one; does not change the weights)")
    _config_flags(p, PretrainConfig)
    p = sub.add_parser("pretrain-video", help="train the toy Wan (video VAE + transformer) on the toy world in time "
                       "(fastvideo.toyworld.motion) from scratch (~17 min on 2 cores)")
    p.add_argument("--out", required=True, help="output WanPipeline folder (must not exist or be empty)")
    _config_flags(p, VideoPretrainConfig)
    p = sub.add_parser("pretrain-edit", help="fine-tune the toy FLUX into a toy FLUX.1-Kontext on the toy edit world "
                       "(~17 min on 2 cores)")
    p.add_argument("--out", required=True, help="output FluxKontextPipeline folder (must not exist or be empty)")
    _config_flags(p, EditPretrainConfig)


def _config_flags(p: argparse.ArgumentParser, config: type) -> None:
    """One flag per field of a pretraining config dataclass, with its default."""
    for f in dataclasses.fields(config):
        kind = type(f.default)
        if kind is bool:
            p.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, default=f.default,
                           help=f"(default {f.default})")
        elif kind is tuple:
            p.add_argument(f"--{f.name}", type=int, nargs="+", default=f.default, help=f"(default {f.default})")
        else:
            p.add_argument(f"--{f.name}", type=kind, default=f.default, help=f"(default {f.default})")


def _read_folder(folder: Path) -> tuple[list[str], list[str]]:
    """(prompts, failure modes) of the images of one sample.py output folder (its index.jsonl and 8-bit images)."""
    from PIL import Image  # heavy

    index = folder / "index.jsonl"
    if not index.is_file():
        raise FileNotFoundError(f"{index} not found: pass folders sample.py wrote (its --output_dir, e.g. "
                                f"OUT/sampled/final)")
    rows = [json.loads(line) for line in index.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{index} lists no images: sample into {folder} again")
    images = np.stack([np.asarray(Image.open(folder / r["path"]).convert("RGB")) for r in rows])
    prompts = [r["prompt"] for r in rows]
    return prompts, failure_modes(images, prompts)


def _pair_of(prompt: str) -> tuple[str, str]:
    """(the prompt's object pair as text, its kind): held-out or training pair, and for a pair of two shapes whether
    its colour-swapped pair (the same four words bound the other way) is a training pair; "one group" otherwise."""
    spec = parse_prompt(prompt)
    if len(spec.groups) == 1:
        return "one group", ""
    (n1, c1, s1), (n2, c2, s2) = spec.groups
    split = "held-out" if is_heldout(spec) else "train"
    swapped = SceneSpec(((n1, c2, s1), (n2, c1, s2)), spec.relation)
    swap = "one shape" if s1 == s2 else ("swap held-out" if is_heldout(swapped) else "swap train")
    return " + ".join(sorted(f"{c} {s}" for c, s in ((c1, s1), (c2, s2)))), f"{split}, {swap}"


def failure_table(folders: list[Path], by_pair: bool = False) -> str:
    """The share of each ``verify.FAILURE_MODES`` mode among the images of sample.py output folders (their
    index.jsonl and images), one column per folder; ``by_pair`` adds the share right per object pair of the prompts,
    which shows which pairs a run fixes and which stay wrong."""
    read = [(folder, *_read_folder(folder)) for folder in folders]
    width = max(len(m) for m in FAILURE_MODES)
    lines = ["share of images by failure mode (the toy-world verifier on the saved 8-bit images; a swap or flip: the "
             "image is exactly right for that other prompt)"]
    lines += [f"[{i}] {folder} ({len(modes)} images)" for i, (folder, _, modes) in enumerate(read, 1)]
    header = "".join(f"  {f'[{i}]':>6}" for i in range(1, len(read) + 1))
    lines.append(f"{'':{width}}" + header)
    for mode in FAILURE_MODES:
        lines.append(f"{mode:{width}}" + "".join(f"  {modes.count(mode) / len(modes):6.3f}" for _, _, modes in read))
    if by_pair:
        shares: dict[tuple[str, str], list[list[int]]] = {}  # pair -> per folder [right, images]
        for k, (_, prompts, modes) in enumerate(read):
            for prompt, mode in zip(prompts, modes):
                counts = shares.setdefault(_pair_of(prompt), [[0, 0] for _ in read])[k]
                counts[0] += mode == "right"
                counts[1] += 1
        name_w = max(len(name) for name, _ in shares)
        kind_w = max(len(kind) for _, kind in shares)
        rows = sorted(shares.items(), key=lambda kv: (kv[0][1], kv[0][0]))
        cells = [[f"{right / n:.3f} ({n})" if n else "-" for right, n in per] for _, per in rows]
        col_w = max(len(c) for row in cells for c in row)
        lines += ["", "share right by object pair (its images in brackets)",
                  f"{'pair':{name_w}}  {'kind':{kind_w}}" + "".join(f"  {f'[{i}]':>{col_w}}"
                                                                    for i in range(1, len(read) + 1))]
        for ((name, kind), _), row in zip(rows, cells):
            lines.append(f"{name:{name_w}}  {kind:{kind_w}}" + "".join(f"  {c:>{col_w}}" for c in row))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fastvideo.toyworld", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("build", help="write the toy FLUX folder from the shipped pretrained weights (seconds)")
    p.add_argument("--out", required=True, help="output FLUX folder (must not exist or be empty)")
    p = sub.add_parser("build-edit", help="write the toy Kontext folder (the toy edit world) from the shipped "
                       "pretrained weights (seconds)")
    p.add_argument("--out", required=True, help="output FluxKontextPipeline folder (must not exist or be empty)")
    p = sub.add_parser("build-video", help="write the toy Wan folder (the toy world in time) from the shipped "
                       "pretrained weights (seconds)")
    p.add_argument("--out", required=True, help="output WanPipeline folder (must not exist or be empty)")
    _pretrain_parser(sub)
    p = sub.add_parser("prompts", help="write train.txt / heldout.txt prompt files (seeded order)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--seed", type=int, default=0, help="seed of the line order")
    p = sub.add_parser("motion-prompts", help="write the toy world in time's motion_train.txt / motion_heldout.txt "
                       "(grammar order)")
    p.add_argument("--out", required=True, help="output folder")
    p = sub.add_parser("edits", help="write train.jsonl / heldout.jsonl edit files of the toy edit world (sources, "
                       "instructions, ground-truth edits) for preprocess_embeddings.py --edit_file")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--train", type=int, default=1024, help="training examples (default 1024)")
    p.add_argument("--heldout", type=int, default=256, help="held-out examples (default 256)")
    p.add_argument("--size", type=int, default=32, help="image side in px, 32..64 (default 32)")
    p.add_argument("--seed", type=int, default=0, help="seed of the scenes (default 0)")
    p = sub.add_parser("failures", help="the share of right images and of each failure mode (colour swap, shape "
                       "swap, count swap, relation flipped, other) in sample.py output folders")
    p.add_argument("folders", nargs="+", type=Path, help="sample.py --output_dir folders (index.jsonl + images)")
    p.add_argument("--by_pair", action="store_true", help="also the share right per object pair of the prompts "
                   "(held-out or training pair; whether its colour-swapped pair is a training pair)")
    args = parser.parse_args(argv)

    if args.command == "failures":
        try:
            print(failure_table(args.folders, args.by_pair))
        except (FileNotFoundError, ValueError) as err:
            sys.exit(str(err))
        return
    if args.command == "prompts":
        for name, path in write_prompt_files(args.out, args.seed).items():
            print(f"{name}: {path} ({len(path.read_text().splitlines())} prompts)")
        return
    if args.command == "edits":
        for split in ("train", "heldout"):
            try:
                path = write_edit_file(args.out, split, getattr(args, split), args.size, args.seed)
            except ValueError as err:
                sys.exit(f"--size {args.size}: {err}")
            print(f"{split}: {path} ({len(path.read_text().splitlines())} edits)")
        return
    if args.command == "motion-prompts":
        for name, path in write_motion_prompt_files(args.out).items():
            print(f"{name}: {path} ({len(path.read_text().splitlines())} prompts)")
        return

    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        sys.exit(f"--out {out} already exists and is not empty: remove it or choose another folder")
    if args.command == "build":
        path = build_from_shipped(out)
        print(f"toy FLUX: {path} (shipped weights)\neval: {json.dumps(json.loads((path / EVAL_FILE).read_text()))}")
        return
    if args.command == "build-edit":
        path = build_edit_from_shipped(out)
        print(f"toy Kontext: {path} (shipped weights)\neval: {json.dumps(json.loads((path / EVAL_FILE).read_text()))}")
        return
    if args.command == "build-video":
        path = build_video_from_shipped(out)
        print(f"toy Wan: {path} (shipped weights)\neval: {json.dumps(json.loads((path / EVAL_FILE).read_text()))}")
        return
    config = {"pretrain-video": VideoPretrainConfig, "pretrain-edit": EditPretrainConfig}.get(args.command,
                                                                                             PretrainConfig)
    fields = {f.name for f in dataclasses.fields(config)}
    try:
        cfg = config(**{k: v for k, v in vars(args).items() if k in fields})
    except ValueError as err:
        sys.exit(str(err))
    if args.command == "pretrain-edit":
        path = pretrain_edit(out, cfg, log=lambda msg: print(msg, flush=True))
        print(f"toy Kontext: {path}\neval: {json.dumps(json.loads((path / EVAL_FILE).read_text()))}")
        return
    if args.command == "pretrain-video":
        path = pretrain_video(out, cfg, log=lambda msg: print(msg, flush=True))
        print(f"toy Wan: {path}\neval: {json.dumps(json.loads((path / EVAL_FILE).read_text()))}")
        return
    path = pretrain(out, cfg, log=lambda msg: print(msg, flush=True), eval_every=args.eval_every)
    print(f"toy FLUX: {path}\neval: {json.dumps(json.loads((path / EVAL_FILE).read_text()))}")


if __name__ == "__main__":
    main()
