"""Edit data: the ``--edit_file`` of (source image, instruction) pairs, read and checked line by line before any model
loads, its source images loaded at one size, and the store's copies of them (what rewards see as the condition).

An edit file is JSON Lines, one object per example: ``{"image": "path/to/source.png", "prompt": "make the red circle
blue"}`` (paths relative to the file; blank lines skipped). Every source of one store has one size: the images' own
(all equal) or ``--edit_size WxH``, to which each is resized with Lanczos as the diffusers edit pipelines resize
theirs. The store keeps each resized source as ``OUT/sources/<id>.png`` (lossless: exactly the pixels the VAE
encoded), so a reward that compares the edit with its source reads it without the original files.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

SOURCES_DIR = "sources"
_HINT = 'one JSON object per line: {"image": "path/to/source.png", "prompt": "the edit instruction"}'


@dataclass(frozen=True)
class EditExample:
    """One line of an edit file: the instruction, the source image's resolved path, the line number (errors) and the
    path as the file writes it (relative to the file)."""

    prompt: str
    image: Path
    line: int
    name: str = ""


def read_edit_file(path: str | os.PathLike) -> list[EditExample]:
    """The examples of a JSON Lines edit file (example id = index in the result); ValueError / FileNotFoundError
    naming the line for invalid JSON, a missing key, an empty instruction, or an image path that is not a file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--edit_file {path} does not exist; pass a JSON Lines file, {_HINT}")
    examples: list[EditExample] = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8-sig").split("\n"), start=1):
        if not line.strip():
            continue
        where = f"--edit_file {path}, line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not valid JSON ({err.msg}); write {_HINT}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("image"), str) or not isinstance(obj.get("prompt"), str):
            raise ValueError(f"{where}: needs the string keys \"image\" and \"prompt\"; write {_HINT}")
        prompt = obj["prompt"].strip()
        if not prompt:
            raise ValueError(f"{where}: the instruction (\"prompt\") is empty; write what the edit should do")
        image = (path.parent / obj["image"]).resolve()
        if not image.is_file():
            raise FileNotFoundError(f"{where}: source image {obj['image']!r} ({image}) does not exist; image paths "
                                    "are relative to the edit file")
        examples.append(EditExample(prompt, image, lineno, obj["image"]))
    if not examples:
        raise ValueError(f"--edit_file {path} holds no examples; write {_HINT}")
    return examples


def parse_edit_size(text: str | None) -> tuple[int, int] | None:
    """``--edit_size WxH`` -> (height, width); None stays None; ValueError naming the form."""
    if text is None:
        return None
    parts = str(text).lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--edit_size {text!r} must be WIDTHxHEIGHT in pixels, e.g. --edit_size 1024x1024")
    return int(parts[1]), int(parts[0])


def _open(example: EditExample, where: str):
    """The example's image, opened (header read, pixels not yet decoded); ValueError naming the line."""
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(example.image)
    except (UnidentifiedImageError, OSError) as err:
        raise ValueError(f"{where}, line {example.line}: {example.image} is not a readable image ({err}); replace "
                         "it or drop the line") from None


@dataclass
class EditSources:
    """The source images of an edit store at one size (``height`` x ``width``), read on demand by example id."""

    examples: list[EditExample]
    height: int
    width: int
    file: str = ""  # the edit file, for errors

    @classmethod
    def open(cls, edit_file: str | os.PathLike, size: tuple[int, int] | None = None) -> "EditSources":
        """Read and check ``edit_file``; every image's header is read: without ``size`` they must share the first
        image's size (ValueError naming the first line that differs and --edit_size)."""
        examples = read_edit_file(edit_file)
        where = f"--edit_file {edit_file}"
        first = None
        for example in examples:
            with _open(example, where) as image:
                got = (image.height, image.width)
            first = first or got
            if size is None and got != first:
                raise ValueError(f"{where}, line {example.line}: {example.image.name} is {got[1]}x{got[0]} but line "
                                 f"{examples[0].line}'s source is {first[1]}x{first[0]}; one store holds one source "
                                 f"size: pass --edit_size WxH (e.g. {first[1]}x{first[0]}) to resize them all")
        height, width = size or first
        return cls(examples, int(height), int(width), str(edit_file))

    @property
    def prompts(self) -> list[str]:
        return [e.prompt for e in self.examples]

    def identity(self, first_id: int, count: int) -> str:
        """What a finished shard of ids [first_id, first_id + count) was made from (its header keeps it, so a
        re-run re-encodes a shard whose images changed): the size, and each image's path as the edit file writes
        it, byte size and modification time (not its bytes: every rank computes this for its shards, and rank 0
        for all of them; a data folder copied with its times kept, e.g. ``cp -a``, keeps the finished shards)."""
        h = hashlib.sha256(f"{self.height}x{self.width}".encode())
        for example in self.examples[first_id:first_id + count]:
            stat = example.image.stat()
            h.update(f"\0{example.name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
        return h.hexdigest()

    def load(self, ids: Sequence[int]) -> torch.Tensor:
        """The sources of ``ids`` as (B, 3, H, W) float32 in [0, 1]: RGB, resized with Lanczos where their size
        differs (as ``VaeImageProcessor.resize``); ValueError naming the line of an image that fails to decode."""
        from PIL import Image

        out = []
        for i in ids:
            example = self.examples[i]
            try:
                with _open(example, f"--edit_file {self.file}") as image:
                    rgb = image.convert("RGB")
            except OSError as err:
                raise ValueError(f"--edit_file {self.file}, line {example.line}: {example.image} cannot be decoded "
                                 f"({err}); replace it or drop the line") from None
            if (rgb.height, rgb.width) != (self.height, self.width):
                rgb = rgb.resize((self.width, self.height), resample=Image.LANCZOS)
            out.append(rgb)
        return to_tensor(out)


def to_tensor(images: Sequence[Any]) -> torch.Tensor:
    """RGB PIL images of one size -> (B, 3, H, W) float32 in [0, 1]: ``to_uint8``'s inverse."""
    return torch.stack([torch.from_numpy(np.asarray(i, dtype=np.uint8).copy()).permute(2, 0, 1)
                        for i in images]).float() / 255


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """(B, 3, H, W) in [0, 1] -> (B, H, W, 3) uint8, rounded (exact for images that came from uint8)."""
    return (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()


def encode_batch(family: Any, encoders: Any, vae: Any, writer: Any, ids: list[int], prompts: list[str],
                 device: Any) -> tuple[dict[str, torch.Tensor], list[bool]]:
    """An edit store's rows for examples ``ids``: the family's ``encode_edits`` of each source (float32 VAE, as the
    pipelines' posterior mode) and its instruction, plus the negative prompt's rows with each source where the
    family's negative sees it (``negative_<key>``: the writer's ``shard_keys``); the sources saved to
    ``OUT/sources``."""
    msl = writer.spec.max_sequence_length
    images = writer.sources.load(ids)
    cond, truncated = family.encode_edits(encoders, vae, images.to(device), prompts, msl)
    if len(writer.spec.shard_keys) > len(cond):
        negative, _ = family.encode_edits(encoders, vae, images.to(device), [writer.spec.negative_prompt] * len(ids),
                                          msl)
        cond.update({f"negative_{k}": negative[k] for k in writer.spec.text_keys})
    save_sources(writer.output_dir, ids, images)
    return cond, truncated


def source_file(root: Path, example_id: int) -> Path:
    return root / SOURCES_DIR / f"{int(example_id):08d}.png"


def save_sources(root: Path, ids: Sequence[int], images: torch.Tensor) -> None:
    """Write each source (B, 3, H, W in [0, 1]) as ``root/sources/<id>.png``, atomically (a temporary file renamed)."""
    from PIL import Image

    (root / SOURCES_DIR).mkdir(parents=True, exist_ok=True)
    for i, pixels in zip(ids, to_uint8(images)):
        path = source_file(root, i)
        tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
        Image.fromarray(pixels).save(tmp, format="PNG")
        os.replace(tmp, path)


def read_sources(root: Path, ids: Sequence[int]) -> torch.Tensor:
    """The stored sources of ``ids`` as (B, 3, H, W) float32 in [0, 1]; FileNotFoundError naming the fix."""
    from PIL import Image

    out = []
    for i in ids:
        path = source_file(root, i)
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing from the edit store; re-run preprocess_embeddings.py with the "
                                    "same --edit_file and --output_dir to rewrite it")
        with Image.open(path) as image:
            out.append(image.convert("RGB"))
    return to_tensor(out)
