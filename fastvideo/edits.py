"""Edit data: the ``--edit_file`` of (source image, instruction) pairs, read and checked line by line before any model
loads, its source images loaded at one size, and the store's copies of them (what rewards see as the condition).

An edit file is JSON Lines, one object per example: ``{"image": "path/to/source.png", "prompt": "make the red circle
blue"}`` (paths relative to the file; blank lines skipped); a family that takes several sources per edit
(``ModelFamily.multi_source``: Qwen-Image-Edit-2509's ``Picture 1``, ``Picture 2``, ...) reads ``{"images": [...],
"prompt": ...}``, the same number on every line. Every source of one store has one size: the images' own (all equal)
or ``--edit_size WxH``, to which each is resized with Lanczos as the diffusers edit pipelines resize theirs. The store
keeps each resized source as ``OUT/sources/<id>.png`` (the k-th of several: ``<id>.<k>.png``; lossless: exactly the
pixels the VAE encoded), so a reward that compares the edit with its (first) source reads it without the originals.
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
_HINT = ('one JSON object per line: {"image": "path/to/source.png", "prompt": "the edit instruction"} (several '
         'sources: "images": ["a.png", "b.png"])')


@dataclass(frozen=True)
class EditExample:
    """One line of an edit file: the instruction, the source images' resolved paths, the line number (errors) and the
    paths as the file writes them (relative to the file)."""

    prompt: str
    images: tuple[Path, ...]
    line: int
    names: tuple[str, ...] = ()

    @property
    def image(self) -> Path:
        """The first source (what a reward compares the edit with)."""
        return self.images[0]


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
        names = _image_names(obj)
        if names is None or not isinstance(obj.get("prompt"), str):
            raise ValueError(f"{where}: needs the string key \"prompt\" and either \"image\" (a string) or "
                             f"\"images\" (a non-empty list of strings); write {_HINT}")
        prompt = obj["prompt"].strip()
        if not prompt:
            raise ValueError(f"{where}: the instruction (\"prompt\") is empty; write what the edit should do")
        images = tuple((path.parent / name).resolve() for name in names)
        for name, image in zip(names, images):
            if not image.is_file():
                raise FileNotFoundError(f"{where}: source image {name!r} ({image}) does not exist; image paths are "
                                        "relative to the edit file")
        examples.append(EditExample(prompt, images, lineno, names))
    if not examples:
        raise ValueError(f"--edit_file {path} holds no examples; write {_HINT}")
    return examples


def _image_names(obj: Any) -> tuple[str, ...] | None:
    """A line's source paths: ``"image": str`` or ``"images": [str, ...]`` (not both); None when neither is valid."""
    if not isinstance(obj, dict) or ("image" in obj) == ("images" in obj):
        return None
    names = [obj["image"]] if "image" in obj else obj["images"]
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
        return None
    return tuple(names)


def parse_edit_size(text: str | None) -> tuple[int, int] | None:
    """``--edit_size WxH`` -> (height, width); None stays None; ValueError naming the form."""
    if text is None:
        return None
    parts = str(text).lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--edit_size {text!r} must be WIDTHxHEIGHT in pixels, e.g. --edit_size 1024x1024")
    return int(parts[1]), int(parts[0])


def _open(example: EditExample, where: str, k: int = 0):
    """The example's ``k``-th image, opened (header read, pixels not yet decoded); ValueError naming the line."""
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(example.images[k])
    except (UnidentifiedImageError, OSError) as err:
        raise ValueError(f"{where}, line {example.line}: {example.images[k]} is not a readable image ({err}); "
                         "replace it or drop the line") from None


@dataclass
class EditSources:
    """The source images of an edit store at one size (``height`` x ``width``), ``count`` per example, read on demand
    by example id."""

    examples: list[EditExample]
    height: int
    width: int
    file: str = ""  # the edit file, for errors

    @property
    def count(self) -> int:
        """Sources per example (every line names as many: ``open`` checks)."""
        return len(self.examples[0].images)

    @classmethod
    def open(cls, edit_file: str | os.PathLike, size: tuple[int, int] | None = None) -> "EditSources":
        """Read and check ``edit_file``; every image's header is read: without ``size`` they must share the first
        image's size (ValueError naming the first line that differs and --edit_size), and every line must name as
        many sources as the first (ValueError naming the line)."""
        examples = read_edit_file(edit_file)
        where = f"--edit_file {edit_file}"
        first = None
        for example in examples:
            if len(example.images) != len(examples[0].images):
                raise ValueError(f"{where}, line {example.line} names {len(example.images)} source images but line "
                                 f"{examples[0].line} names {len(examples[0].images)}; one store holds one number of "
                                 "sources per edit: split the file by that number")
            for k, path in enumerate(example.images):
                with _open(example, where, k) as image:
                    got = (image.height, image.width)
                first = first or got
                if size is None and got != first:
                    raise ValueError(f"{where}, line {example.line}: {path.name} is {got[1]}x{got[0]} but line "
                                     f"{examples[0].line}'s source is {first[1]}x{first[0]}; one store holds one "
                                     f"source size: pass --edit_size WxH (e.g. {first[1]}x{first[0]}) to resize them "
                                     "all")
        height, width = size or first
        return cls(examples, int(height), int(width), str(edit_file))

    @property
    def prompts(self) -> list[str]:
        return [e.prompt for e in self.examples]

    @property
    def condition(self) -> tuple[int, ...]:
        """(height, width) of every source, with the count when several: ``models.geometry_for``'s ``condition``."""
        return (self.height, self.width) + ((self.count,) if self.count > 1 else ())

    def manifest_entry(self) -> dict[str, Any]:
        """The manifest's ``edit`` entry (``condition_of`` reads it back)."""
        return {"file": self.file, "height": self.height, "width": self.width, "sources": SOURCES_DIR,
                **({"sources_per_edit": self.count} if self.count > 1 else {})}

    def prompt_entry(self, i: int) -> dict[str, Any]:
        """What the manifest records of example ``i``'s sources: its first image's path (and all of them, when
        several)."""
        images = self.examples[i].images
        return {"image": str(images[0]), **({"images": [str(p) for p in images]} if len(images) > 1 else {})}

    def identity(self, first_id: int, count: int) -> str:
        """What a finished shard of ids [first_id, first_id + count) was made from (its header keeps it, so a
        re-run re-encodes a shard whose images changed): the size, and each image's path as the edit file writes
        it, byte size and modification time (not its bytes: every rank computes this for its shards, and rank 0
        for all of them; a data folder copied with its times kept, e.g. ``cp -a``, keeps the finished shards)."""
        h = hashlib.sha256(f"{self.height}x{self.width}".encode())
        for example in self.examples[first_id:first_id + count]:
            for name, path in zip(example.names, example.images):
                stat = path.stat()
                h.update(f"\0{name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
        return h.hexdigest()

    def load(self, ids: Sequence[int], k: int = 0) -> torch.Tensor:
        """The ``k``-th sources of ``ids`` as (B, 3, H, W) float32 in [0, 1]: RGB, resized with Lanczos where their
        size differs (as ``VaeImageProcessor.resize``); ValueError naming the line of an image that fails to decode."""
        from PIL import Image

        out = []
        for i in ids:
            example = self.examples[i]
            try:
                with _open(example, f"--edit_file {self.file}", k) as image:
                    rgb = image.convert("RGB")
            except OSError as err:
                raise ValueError(f"--edit_file {self.file}, line {example.line}: {example.images[k]} cannot be "
                                 f"decoded ({err}); replace it or drop the line") from None
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
    ``OUT/sources``. Several sources per example reach the family as (B, K, 3, H, W)."""
    msl = writer.spec.max_sequence_length
    every = [writer.sources.load(ids, k) for k in range(writer.sources.count)]
    images = every[0] if len(every) == 1 else torch.stack(every, dim=1)
    cond, truncated = family.encode_edits(encoders, vae, images.to(device), prompts, msl)
    if len(writer.spec.shard_keys) > len(cond):
        negative, _ = family.encode_edits(encoders, vae, images.to(device), [writer.spec.negative_prompt] * len(ids),
                                          msl)
        cond.update({f"negative_{k}": negative[k] for k in writer.spec.text_keys})
    for k, some in enumerate(every):
        save_sources(writer.output_dir, ids, some, k)
    return cond, truncated


def condition_of(edit: dict[str, Any] | None) -> tuple[int, ...] | None:
    """A manifest's ``edit`` entry as ``EditSources.condition`` ((height, width[, count])); None: a prompt store."""
    if not edit:
        return None
    count = int(edit.get("sources_per_edit", 1))
    return (int(edit["height"]), int(edit["width"])) + ((count,) if count > 1 else ())


def sources_written(root: Path, ids: Sequence[int], count: int) -> bool:
    """Whether the store under ``root`` holds every one of the ``count`` sources of each of ``ids``."""
    return all(source_file(root, i, k).is_file() for i in ids for k in range(count))


def source_file(root: Path, example_id: int, k: int = 0) -> Path:
    """Where an edit store keeps example ``example_id``'s ``k``-th source."""
    return root / SOURCES_DIR / (f"{int(example_id):08d}.png" if k == 0 else f"{int(example_id):08d}.{k}.png")


def save_sources(root: Path, ids: Sequence[int], images: torch.Tensor, k: int = 0) -> None:
    """Write each ``k``-th source (B, 3, H, W in [0, 1]) as ``source_file(root, id, k)``, atomically (a temporary
    file renamed)."""
    from PIL import Image

    (root / SOURCES_DIR).mkdir(parents=True, exist_ok=True)
    for i, pixels in zip(ids, to_uint8(images)):
        path = source_file(root, i, k)
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
