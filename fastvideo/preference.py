"""Offline Diffusion-DPO inputs: the preference-pair file, its VAE latent cache, and a demo pair maker.

Pair file (``--preference_file``): JSON lines ``{"prompt": str, "chosen": path, "rejected": path}``, blank
lines skipped, other keys ignored; on an edit store (``--edit_file``) each line also names the edit's source,
``"image": path``, as the edit file does (the pair is of two edits of that source). Image paths are relative to
the file's folder and may not leave it; every prompt must be in the embedding manifest (``preprocess_embeddings.py``),
since DPO reads its embeddings there.
The whole file is checked before anything is loaded, and every problem is reported in one error.

Latent cache layout (derived data; the only thing this module ever deletes)::

    CACHE/cache.json               fingerprint record: vae_fingerprint, height, width, chunk_size, num_pairs and a
                                   sha256 over the pairs' (chosen, rejected, size, mtime_ns) in order
    CACHE/chunk-00000.safetensors  pairs [0, chunk_size): tensors "chosen" and "rejected" (n, L, C) float32; the
    CACHE/chunk-00001.safetensors  header names the record's digest, so a chunk of another record is never used
    ...

CLI (a pair file without downloads, scored by a weight-free reward)::

    python -m fastvideo.preference --model_path M --data_json_path D --output_dir O [--num_pairs N ...]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fastvideo import distributed, models
from fastvideo.data import EmbeddingDataset, atomic_write_text, publish_file
from fastvideo.record import load_image
from fastvideo.rewards import build_reward
from fastvideo.rollout import RolloutConfig, rollout
from fastvideo.seeding import NoiseSource
from fastvideo.weights import path_inside

FORMAT_VERSION = 1
CACHE_RECORD = "cache.json"
PAIR_KEYS = ("prompt", "chosen", "rejected")
IMAGE_KEYS = ("chosen", "rejected")
MAX_LISTED_PROBLEMS = 50
MAX_LISTED_PROMPTS = 20
DEFAULT_CHUNK_SIZE = 64


@dataclass(frozen=True)
class PreferencePair:
    """One line of a pair file, checked: its prompt's manifest row and the two images' resolved paths."""

    line: int  # 1-based line number in the pair file
    prompt: str
    prompt_id: int  # row in the embedding manifest (EmbeddingDataset.prompts index)
    chosen: Path  # resolved absolute path
    rejected: Path


# ------------------------------------------------------------------------------------------- pair file
def _check_image(root: Path, value: Any, height: int, width: int) -> tuple[Path | None, str]:
    """(resolved path, "") for a readable image of ``width`` x ``height`` inside ``root``; else (None, problem)."""
    from PIL import Image  # heavy

    path, problem = path_inside(root, value, "the pair file's folder")
    if path is None:
        return None, problem
    if not path.exists():
        return None, "not found"
    if not path.is_file():
        return None, "is not a file"
    try:
        with Image.open(path) as image:
            image.verify()
        with Image.open(path) as image:
            w, h = image.size
    except Exception as err:  # noqa: BLE001 - PIL raises many kinds for a broken or foreign file
        return None, f"unreadable ({err})"
    if (w, h) != (width, height):
        return None, f"is {w}x{h}, expected --w x --h = {width}x{height}"
    return path, ""


def _problem_message(path: Path, problems: list[str], missing_prompts: list[str]) -> str:
    """The one error text for every problem of a pair file, capped, with the fix for missing prompts."""
    lines = [f"--preference_file {path}: {len(problems)} problem{'s' * (len(problems) != 1)} "
             "(fix them, then re-run):"]
    lines += [f"  {p}" for p in problems[:MAX_LISTED_PROBLEMS]]
    if len(problems) > MAX_LISTED_PROBLEMS:
        lines.append(f"  ... and {len(problems) - MAX_LISTED_PROBLEMS} more")
    n = len(missing_prompts)
    if n:
        listed = ", ".join(repr(p) for p in missing_prompts[:MAX_LISTED_PROMPTS])
        more = f" and {n - MAX_LISTED_PROMPTS} more" if n > MAX_LISTED_PROMPTS else ""
        lines.append(f"{n} prompt{'s are' if n != 1 else ' is'} not in the embedding manifest: re-run "
                     f"preprocess_embeddings.py with a --prompt_file that includes {'them' if n != 1 else 'it'} and "
                     f"pass its --output_dir as --data_json_path. Missing: {listed}{more}")
    return "\n".join(lines)


def read_preference_file(path: str | os.PathLike, prompts: list[str], height: int, width: int,
                         sources: list[str] | None = None) -> list[PreferencePair]:
    """Parse and check a pair file against the manifest prompts and the image size; one ValueError lists all problems.

    Prompts are matched after stripping surrounding whitespace (as preprocess_embeddings.py stores them); a
    prompt that appears several times in the manifest maps to its first id. ``sources`` (an edit store: each id's
    source image path): a line is matched by its prompt and its ``"image"``, resolved against the pair file's folder.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"--preference_file {path} is a folder; pass the .jsonl pair file inside it")
    if not path.is_file():
        raise FileNotFoundError(f"--preference_file {path} does not exist; write a JSON-lines file with one "
                                '{"prompt": ..., "chosen": ..., "rejected": ...} per line (image paths relative to '
                                "its folder), or make a demo one with `python -m fastvideo.preference`")
    root = path.parent.resolve()
    prompt_ids: dict[Any, int] = {}
    for i, prompt in enumerate(prompts):
        prompt_ids.setdefault(prompt if sources is None else (prompt, str(Path(sources[i]).resolve())), i)
    checked: dict[str, tuple[Path | None, str]] = {}  # the same image may be in many pairs: check it once
    problems: list[str] = []
    missing_prompts: list[str] = []
    pairs: list[PreferencePair] = []
    for lineno, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        where = f"{path.name}:{lineno}"
        try:
            text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8").strip()
        except UnicodeDecodeError as err:
            problems.append(f"{where}: not valid UTF-8 ({err.reason}); re-save the file as UTF-8")
            continue
        if not text:
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as err:
            problems.append(f"{where}: not valid JSON ({err.msg}: column {err.colno})")
            continue
        if not isinstance(record, dict):
            problems.append(f"{where}: not a JSON object (got {type(record).__name__})")
            continue
        absent = [key for key in PAIR_KEYS if key not in record]
        problems += [f"{where}: missing key {key!r}" for key in absent]
        prompt_id = None
        prompt = record.get("prompt")
        if "prompt" in record:
            if not isinstance(prompt, str) or not prompt.strip():
                problems.append(f"{where}: prompt must be a non-empty string, got {prompt!r}")
            else:
                prompt = prompt.strip()
                key: Any = prompt
                if sources is not None:  # an edit: the instruction and its source image
                    image = record.get("image")
                    if not isinstance(image, str):
                        problems.append(f"{where}: missing key 'image' (the source image these two edits start "
                                        "from: the store holds edits)")
                        continue
                    key = (prompt, str((root / image).resolve()))
                prompt_id = prompt_ids.get(key)
                if prompt_id is None and sources is not None:
                    problems.append(f"{where}: the edit ({prompt!r}, image {record['image']}) is not in the edit store")
                elif prompt_id is None:
                    problems.append(f"{where}: prompt {prompt!r} is not in the embedding manifest")
                    if prompt not in missing_prompts:
                        missing_prompts.append(prompt)
        images: dict[str, Path | None] = {}
        for key in IMAGE_KEYS:
            if key not in record:
                continue
            value = record[key]
            cache_key = value if isinstance(value, str) else repr(value)
            if cache_key not in checked:
                checked[cache_key] = _check_image(root, value, height, width)
            images[key], problem = checked[cache_key]
            if problem:
                problems.append(f"{where}: {key} {value}: {problem}")
        chosen, rejected = images.get("chosen"), images.get("rejected")
        if chosen is not None and chosen == rejected:
            problems.append(f"{where}: chosen and rejected are the same image {record['chosen']}: a pair needs two")
        if prompt_id is not None and chosen is not None and rejected is not None and chosen != rejected:
            pairs.append(PreferencePair(lineno, prompt, prompt_id, chosen, rejected))
    if problems:
        raise ValueError(_problem_message(path, problems, missing_prompts))
    if not pairs:
        raise ValueError(f"--preference_file {path} contains no pairs; write one JSON object "
                         '{"prompt": ..., "chosen": ..., "rejected": ...} per line')
    return pairs


# ---------------------------------------------------------------------------------------- latent cache
def load_images(paths: Sequence[Path], height: int, width: int) -> torch.Tensor:
    """Images at ``paths`` as RGB float32 (B, 3, H, W) in [0, 1]; ValueError if one is not ``width`` x ``height``."""
    images = []
    for path in paths:
        image = load_image(path)
        if tuple(image.shape[1:]) != (height, width):
            raise ValueError(f"{path} is {image.shape[2]}x{image.shape[1]}, expected {width}x{height}; it changed "
                             "after the pair file was checked: fix it and re-run")
        images.append(image)
    return torch.stack(images)


def _sha256_json(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode("utf-8")).hexdigest()


def _pairs_digest(pairs: Sequence[PreferencePair]) -> str:
    """sha256 over the ordered (chosen, rejected, size, mtime_ns) of every pair: changes when an image does."""
    rows = []
    for pair in pairs:
        for image in (pair.chosen, pair.rejected):
            stat = image.stat()
            rows.append([str(image), stat.st_size, stat.st_mtime_ns])
    return _sha256_json(rows)


class LatentCache:
    """VAE latents of every pair's chosen/rejected image, encoded once in batches and stored next to the run.

    Chunk ``i`` holds pairs ``[i*chunk_size, (i+1)*chunk_size)`` and is written by rank ``i % world_size``.
    A chunk whose header names the current record is kept (resumable); a record of another VAE, image size,
    pair list or changed images makes rank 0 delete the stale chunks (the cache is derived data). Under
    torchrun the trainer runs exactly::

        cache = LatentCache(cache_dir, pairs, vae_fingerprint=family.vae_fingerprint(model), height=h, width=w)
        if rank == 0:
            cache.prepare()          # only rank 0 writes cache.json and deletes stale chunks
        barrier()
        cache.build(vae, geometry, device=device, rank=rank, world_size=world_size, family=family)
        barrier()
        chosen, rejected = cache.load(pair_indices)

    With one process ``build`` calls ``prepare`` itself.
    """

    def __init__(self, cache_dir: str | os.PathLike, pairs: list[PreferencePair], *, vae_fingerprint: str,
                 height: int, width: int, chunk_size: int = DEFAULT_CHUNK_SIZE):
        if not pairs:
            raise ValueError("LatentCache needs at least one pair; check the --preference_file")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.cache_dir = Path(cache_dir)
        self.pairs = list(pairs)
        self.height, self.width, self.chunk_size = int(height), int(width), int(chunk_size)
        self.record: dict[str, Any] = {
            "format_version": FORMAT_VERSION, "vae_fingerprint": vae_fingerprint, "height": self.height,
            "width": self.width, "chunk_size": self.chunk_size, "num_pairs": len(self.pairs),
            "pairs_sha256": _pairs_digest(self.pairs)}
        self.digest = _sha256_json(self.record)
        self.num_chunks = -(-len(self.pairs) // self.chunk_size)
        self._handles: dict[int, Any] = {}

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_handles"] = {}
        return state

    # -- layout ------------------------------------------------------------------------------------
    def chunk_path(self, chunk: int) -> Path:
        """File of chunk ``chunk``."""
        return self.cache_dir / f"chunk-{chunk:05d}.safetensors"

    def chunk_pairs(self, chunk: int) -> range:
        """Indices into ``pairs`` that chunk ``chunk`` holds."""
        start = chunk * self.chunk_size
        return range(start, min(start + self.chunk_size, len(self.pairs)))

    def _header(self, chunk: int) -> dict[str, str]:
        rows = self.chunk_pairs(chunk)
        return {"cache_sha256": self.digest, "chunk": str(chunk), "first_pair": str(rows.start),
                "num_pairs": str(len(rows))}

    def _read_record(self) -> dict | None:
        try:
            return json.loads((self.cache_dir / CACHE_RECORD).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def is_complete(self, chunk: int) -> bool:
        """True when the chunk file exists and its header names this record and this chunk's rows."""
        try:
            with safe_open(str(self.chunk_path(chunk)), framework="pt") as fh:
                header = dict(fh.metadata() or {})
        except Exception:  # noqa: BLE001 - absent, torn or foreign file: not a finished chunk
            return False
        return all(header.get(k) == v for k, v in self._header(chunk).items())

    def missing_chunks(self) -> list[int]:
        """Chunks still to encode (absent, or written for another record)."""
        return [i for i in range(self.num_chunks) if not self.is_complete(i)]

    # -- writing -----------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Rank 0, before any rank builds: drop chunks of a stale record (saying why) and write cache.json."""
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        old = self._read_record()
        if old is not None and old != self.record:  # without a record, the chunk headers alone decide
            changed = [k for k in self.record if old.get(k) != self.record[k]]
            why = ", ".join("pairs_sha256 (the pair list or an image changed)" if k == "pairs_sha256" else k
                            for k in changed)
            print(f"[preference] latent cache {self.cache_dir} was made with another {why}: re-encoding "
                  f"all {self.num_chunks} chunks", flush=True)
            for path in self.cache_dir.glob("chunk-*.safetensors"):
                path.unlink(missing_ok=True)
        for path in self.cache_dir.glob(".*.tmp.*"):  # leftovers of an interrupted write
            path.unlink(missing_ok=True)
        self._handles.clear()
        if old != self.record:
            atomic_write_text(self.cache_dir / CACHE_RECORD, json.dumps(self.record, indent=1) + "\n")

    def _write_chunk(self, chunk: int, chosen: torch.Tensor, rejected: torch.Tensor) -> None:
        path = self.chunk_path(chunk)
        tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
        save_file({"chosen": chosen.contiguous(), "rejected": rejected.contiguous()}, str(tmp),
                  metadata=self._header(chunk))
        publish_file(tmp, path)
        self._handles.pop(chunk, None)

    def build(self, vae: Any, geometry: Any, *, device: str | torch.device, rank: int = 0,
              world_size: int = 1, batch_size: int = 8, family: models.ModelFamily | None = None) -> int:
        """Encode this rank's share of the missing chunks (chunk i -> rank i % world_size); returns chunks written.

        ``batch_size`` images go through the VAE at once (``family.encode``; default: FLUX.1, the folder-less
        ``--model_family auto``). The caller barriers afterwards (see the class docstring).
        """
        family = family or models.resolve("auto")
        if (geometry.height, geometry.width) != (self.height, self.width):
            raise ValueError(f"geometry is {geometry.height}x{geometry.width} but the cache is for "
                             f"{self.height}x{self.width}; build both from the same --h/--w")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if world_size == 1:
            self.prepare()
        elif self._read_record() != self.record:
            raise RuntimeError(f"{self.cache_dir / CACHE_RECORD} is missing or stale: call prepare() on rank 0 and "
                               "barrier before build() (internal error)")
        written = 0
        for chunk in self.missing_chunks():
            if chunk % world_size != rank:
                continue
            pairs = [self.pairs[i] for i in self.chunk_pairs(chunk)]
            paths = [p.chosen for p in pairs] + [p.rejected for p in pairs]
            latents = []
            for start in range(0, len(paths), batch_size):
                images = load_images(paths[start:start + batch_size], self.height, self.width).to(device)
                latents.append(family.encode(vae, images, geometry).cpu())
            both = torch.cat(latents)  # (2n, L, C): chosen rows, then rejected rows
            self._write_chunk(chunk, both[:len(pairs)], both[len(pairs):])
            written += 1
        return written

    # -- reading -----------------------------------------------------------------------------------
    def _handle(self, chunk: int) -> Any:
        handle = self._handles.get(chunk)
        if handle is None:
            if not self.is_complete(chunk):
                raise RuntimeError(f"latent cache chunk {self.chunk_path(chunk)} is missing or stale: run "
                                   "prepare()/build() before load() (internal error)")
            handle = safe_open(str(self.chunk_path(chunk)), framework="pt")
            self._handles[chunk] = handle
        return handle

    def load(self, pair_indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents of ``pairs[i]`` per index (repeats allowed): chosen (b, L, C), rejected (b, L, C) float32 CPU."""
        if not len(pair_indices):
            raise ValueError("load needs at least one pair index")
        chosen, rejected = [], []
        for index in pair_indices:
            i = int(index)
            if not 0 <= i < len(self.pairs):
                raise IndexError(f"pair index {index} out of range [0, {len(self.pairs)})")
            chunk, row = divmod(i, self.chunk_size)
            handle = self._handle(chunk)
            chosen.append(handle.get_slice("chosen")[row:row + 1])  # (1, L, C)
            rejected.append(handle.get_slice("rejected")[row:row + 1])
        return torch.cat(chosen), torch.cat(rejected)


# ------------------------------------------------------------------------------------------- demo pairs
def _save_png(image: torch.Tensor, path: Path) -> None:
    """(3, H, W) in [0, 1] -> 8-bit RGB PNG, rounded as the rewards quantise (so a re-scored PNG scores the same)."""
    from PIL import Image  # heavy

    pixels = image.float().mul(255.0).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    Image.fromarray(pixels).save(path)


def make_demo_pairs(model_path: str | os.PathLike, data_json_path: str | os.PathLike, output_dir: str | os.PathLike,
                    *, num_pairs: int, num_generations: int = 4, height: int = 64, width: int = 64,
                    sampling_steps: int = 8, reward: str = "jpeg_compressibility:1.0", seed: int = 0,
                    device: str | torch.device = "cpu", model_family: str = "auto") -> Path:
    """Sample ``num_generations`` ODE images for each of the manifest's first ``num_pairs`` prompts, keep the best
    and worst by ``reward`` as chosen/rejected PNGs, and write ``output_dir/pairs.jsonl``; returns its path.

    Gives offline DPO a pair file without downloads. Each line also records ``chosen_reward``/``rejected_reward``.
    """
    dataset = EmbeddingDataset(data_json_path)
    if not 1 <= num_pairs <= len(dataset):
        raise ValueError(f"--num_pairs {num_pairs} must be in [1, {len(dataset)}] (the prompts in "
                         f"{dataset.manifest_path}); lower it or preprocess more prompts")
    if num_generations < 2:
        raise ValueError(f"--num_generations must be >= 2 to pick a best and a worst image, got {num_generations}")
    family = models.resolve(model_family, model_path)
    dataset.check_encoders(model_path, model_family)
    dataset.use(family)
    cfg = RolloutConfig(height=height, width=width, sampling_steps=sampling_steps, eta=0.0, batch_size=32,
                        scheduler=models.read_scheduler_config(model_path))
    reward_fn = build_reward(reward, device)  # fails on a bad spec before the models load
    transformer = family.load_transformer(model_path, device=device).eval().requires_grad_(False)
    vae = family.load_vae(model_path, device=device)
    geometry = models.geometry_for(family, vae, height, width, condition=dataset.condition_size)

    G = num_generations
    prompt_ids = [p for p in range(num_pairs) for _ in range(G)]  # [p0 g0..gG-1, p1 ...]
    batch = dataset.get_batch(prompt_ids)
    traj = rollout(transformer, vae, batch, [g for _ in range(num_pairs) for g in range(G)], 0, cfg,
                   NoiseSource(seed), geometry, device=device)
    sources = dataset.source_images(prompt_ids)  # an edit store: the rewards compare each edit with its source
    scores = reward_fn(traj.images, batch["prompts"], sources)["total"].view(num_pairs, G)

    out = Path(output_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for p in range(num_pairs):
        order = torch.argsort(scores[p], descending=True, stable=True).tolist()  # distinct ends even on ties
        record: dict[str, Any] = {"prompt": dataset.prompts[p]}
        if dataset.source_paths is not None:  # an edit: its source, as the edit file named it (resolved)
            record["image"] = dataset.source_paths[p]
        for key, g in (("chosen", order[0]), ("rejected", order[-1])):
            relative = f"images/{p:05d}-{key}.png"
            _save_png(traj.images[p * G + g], out / relative)
            record[key] = relative
            record[f"{key}_reward"] = float(scores[p, g])
        lines.append(json.dumps(record, ensure_ascii=False))
    path = out / "pairs.jsonl"
    atomic_write_text(path, "\n".join(lines) + "\n")
    margin = float((scores.max(dim=1).values - scores.min(dim=1).values).mean())
    print(f"[preference] wrote {num_pairs} pairs to {path} (best vs worst of {G} by {reward}; mean reward "
          f"margin {margin:.4g})", flush=True)
    return path


def main(argv: list[str] | None = None) -> Path:
    """CLI of ``make_demo_pairs``."""
    parser = argparse.ArgumentParser(
        prog="python -m fastvideo.preference",
        description="Write a demo Diffusion-DPO pair file: best vs worst of N ODE samples per prompt by a reward.")
    parser.add_argument("--model_path", required=True, help="diffusers model folder (or a fastvideo.tiny one)")
    parser.add_argument("--model_family", default="auto",
                        help="model family adapter: auto (from model_index.json) | flux1 | sd3 | qwen-image | flux2 | "
                             "package.module:Class")
    parser.add_argument("--data_json_path", required=True,
                        help="embedding manifest.json (or its folder) written by preprocess_embeddings.py")
    parser.add_argument("--output_dir", required=True, help="folder for pairs.jsonl and images/")
    parser.add_argument("--num_pairs", type=int, default=16, help="pairs to write: the manifest's first N prompts")
    parser.add_argument("--num_generations", type=int, default=4, help="images sampled per prompt (>= 2)")
    parser.add_argument("--h", type=int, default=64, help="image height in pixels")
    parser.add_argument("--w", type=int, default=64, help="image width in pixels")
    parser.add_argument("--sampling_steps", type=int, default=8, help="ODE sampling steps per image")
    parser.add_argument("--reward", default="jpeg_compressibility:1.0",
                        help="reward spec name:weight[,name:weight] ranking the samples (weight-free by default)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial noise")
    parser.add_argument("--device", default=None,
                        help="device to sample on (default: the first available of cuda, npu, cpu)")
    args = parser.parse_args(argv)
    device = args.device or distributed.pick_device_type()
    return make_demo_pairs(args.model_path, args.data_json_path, args.output_dir, num_pairs=args.num_pairs,
                           num_generations=args.num_generations, height=args.h, width=args.w,
                           sampling_steps=args.sampling_steps, reward=args.reward, seed=args.seed, device=device,
                           model_family=args.model_family)


if __name__ == "__main__":
    main()
