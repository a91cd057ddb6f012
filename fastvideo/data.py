"""Prompt embeddings on disk (writer + lazy reader) and the prompt-group sampler.

The on-disk format lives here only. ``preprocess_embeddings.py`` writes it through
:class:`EmbeddingWriter`; the trainers read it through :class:`EmbeddingDataset`.

Layout of an output directory::

    OUT/manifest.json            what was encoded, with which encoders (format below)
    OUT/shard-00000.safetensors  prompts [0, shard_size), one tensor per key of the model family's
    OUT/shard-00001.safetensors  ``embedding_keys`` (FLUX.1: "prompt_embeds" (n, T, D) and "pooled_prompt_embeds"
    ...                          (n, Dp)); header metadata records the encoder fingerprint, max_sequence_length,
                                 dtype, id range and a hash of the prompt texts, so a re-run keeps finished shards.
    OUT/negative.safetensors     the negative prompt's embeddings (one row per key; --negative_prompt), read by
                                 --cfg_scale > 1

Shard ``k`` always holds the consecutive prompt ids ``[k*shard_size, (k+1)*shard_size)`` whatever the
number of ranks, so one rank and many ranks write identical files. Position ids are never stored (the family
derives them). Variable-length text (Qwen-Image) is stored padded to ``max_sequence_length`` beside its mask; the
family's ``collate`` trims a batch's unused padding.

Manifest (``format_version`` 2)::

    {"format_version": 2, "model_path": str, "model_family": str, "encoders_fingerprint": str,
     "max_sequence_length": int, "dtype": "fp32" | "bf16", "num_prompts": int, "num_truncated": int,
     "shard_size": int, "embedding_keys": [str, ...], "shapes": {key: row shape}, "tensor_dtypes": {key: "F32"...},
     "negative": {"prompt": str, "file": "negative.safetensors"} | null, "prompt_file": str,
     "shards": [{"file": "shard-00000.safetensors", "first_id": 0, "num_prompts": n}, ...],
     "prompts": [{"id": 0, "prompt": str, "truncated": bool}, ...]}      # ids in prompt-file order

Version 1 (FLUX.1 only, before model families) is still read: its keys are FLUX.1's and its row shapes are
``prompt_embeds_shape`` / ``pooled_prompt_embeds_shape``.

The reader refuses a shard name that leaves OUT (absolute, ``..``, a symlink out) and checks every shard's header
against the manifest (complete file, rows, row shapes, dtypes, encoders) before any tensor is read.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fastvideo import devices, distributed, edits, models
from fastvideo.weights import check_weight_files, read_safetensors_header, resolve_inside

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
FLUX1_KEYS = ("prompt_embeds", "pooled_prompt_embeds")  # the keys of a version-1 store
NEGATIVE_FILE = "negative.safetensors"
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
                       torch.int32: "I32", torch.bool: "BOOL"}
MANIFEST_NAME = "manifest.json"
DEFAULT_SHARD_SIZE = 64
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
_SHARD_RE = re.compile(r"^shard-(\d{5,})\.safetensors$")
_PREPROCESS_HINT = ("create it with `torchrun --nproc_per_node N preprocess_embeddings.py --model_path MODEL "
                    "--prompt_file PROMPTS --output_dir {out}`")


# --------------------------------------------------------------------------------------------- prompts
def read_prompt_file(path: str | os.PathLike) -> list[str]:
    """Prompts of a UTF-8 file, one per line, blank lines skipped; prompt id = index in the result."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--prompt_file {path} does not exist; pass a text file with one prompt per line")
    raw = path.read_bytes()
    if raw.startswith(b"\xef\xbb\xbf"):  # UTF-8 byte-order mark written by some editors
        raw = raw[3:]
    prompts: list[str] = []
    for lineno, line in enumerate(raw.split(b"\n"), start=1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"--prompt_file {path}, line {lineno}: not valid UTF-8 ({err.reason} at byte "
                             f"{err.start}); re-save the file as UTF-8") from None
        text = text.strip()
        if text:
            prompts.append(text)
    if not prompts:
        raise ValueError(f"--prompt_file {path} contains no prompts; write one prompt per line")
    return prompts


# ---------------------------------------------------------------------------------------------- shards
@dataclass(frozen=True)
class ShardSpec:
    """One shard: file name and the consecutive prompt ids it holds."""

    index: int
    first_id: int
    num_prompts: int

    @property
    def file(self) -> str:
        return f"shard-{self.index:05d}.safetensors"

    @property
    def ids(self) -> range:
        return range(self.first_id, self.first_id + self.num_prompts)


def plan_shards(num_prompts: int, shard_size: int) -> list[ShardSpec]:
    """Fixed-size shards of consecutive ids (the last may be shorter): a function of the ids only."""
    if shard_size < 1:
        raise ValueError(f"--shard_size must be >= 1, got {shard_size}")
    return [ShardSpec(k, start, min(shard_size, num_prompts - start))
            for k, start in enumerate(range(0, num_prompts, shard_size))]


def _prompts_hash(prompts: list[str]) -> str:
    return hashlib.sha256(json.dumps(prompts, ensure_ascii=False).encode("utf-8")).hexdigest()


def _read_json(path: Path) -> dict:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed into place (readers never see half a file)."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def publish_file(tmp: Path, path: Path) -> None:
    """Rename a finished temporary file onto ``path``, readable as the umask allows (safetensors creates 0600 files;
    others on a cluster must read them)."""
    os.chmod(tmp, 0o666 & ~_umask())
    os.replace(tmp, path)


@dataclass(frozen=True)
class StoreSpec:
    """What identifies an embedding store: the encoders, the sequence length, the dtype, the sharding."""

    model_path: str
    encoders_fingerprint: str
    max_sequence_length: int
    dtype: str = "fp32"
    shard_size: int = DEFAULT_SHARD_SIZE
    embedding_keys: tuple[str, ...] = FLUX1_KEYS  # the family's per-prompt tensors, in file order
    model_family: str = "flux1"  # the family's --model_family name (informational; encoders_fingerprint decides)
    negative_prompt: str | None = None  # also store this prompt's embeddings (--cfg_scale's unconditional branch)
    condition_keys: tuple[str, ...] = ()  # an edit store's keys made from the source image (not in the negative row)
    negative_sees_source: bool = False  # the negative prompt is encoded with each source: its rows live in the shards

    @property
    def shard_keys(self) -> tuple[str, ...]:
        """A shard's tensors: the embedding keys, and ``negative_<key>`` rows where the negative sees the source."""
        per_example = self.negative_sees_source and self.negative_prompt is not None
        return self.embedding_keys + (tuple(f"negative_{k}" for k in self.text_keys) if per_example else ())

    @property
    def text_keys(self) -> tuple[str, ...]:
        """The keys a text alone gives (the negative prompt's row holds these)."""
        return tuple(k for k in self.embedding_keys if k not in self.condition_keys)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.max_sequence_length < 1:
            raise ValueError(f"--max_sequence_length must be >= 1, got {self.max_sequence_length}")


@dataclass
class EmbeddingWriter:
    """Writes shards atomically (tmp file + rename) and, on rank 0 at the end, the manifest.

    A shard is *complete* when its file exists and its header matches what would be written now
    (same encoders, length, dtype, ids and prompt texts); complete shards are kept on re-runs.
    """

    output_dir: Path
    prompts: list[str]
    spec: StoreSpec
    prompt_file: str = ""
    family: Any = None  # the model family's adapter that encodes (None: from the model folder, --model_family auto)
    sources: Any = None  # an edit store's ``edits.EditSources`` (None: a prompt store)
    shards: list[ShardSpec] = field(init=False)

    def __post_init__(self) -> None:
        self.output_dir = Path(self.output_dir)
        if not self.prompts:
            raise ValueError("no prompts to write; pass a --prompt_file with at least one prompt")
        self.shards = plan_shards(len(self.prompts), self.spec.shard_size)

    # -- identity checks ---------------------------------------------------------------------------
    def check_existing(self) -> None:
        """Refuse an output directory made with other encoders / max_sequence_length / dtype."""
        out = self.output_dir
        if out.exists() and not out.is_dir():
            raise ValueError(f"--output_dir {out} is a file; pass a directory")
        manifest_path = out / MANIFEST_NAME
        if manifest_path.is_file():
            try:
                old = _read_json(manifest_path)
            except (OSError, json.JSONDecodeError) as err:
                raise ValueError(f"--output_dir {out} holds an unreadable {MANIFEST_NAME} ({err}); delete it "
                                 "(finished shards are kept) or pass a new --output_dir") from None
            self._compare(old, f"{manifest_path}")
        if out.is_dir():
            for path in sorted(out.iterdir()):
                if _SHARD_RE.match(path.name):
                    self._compare(self._shard_header(path), str(path))

    def _compare(self, old: dict, where: str) -> None:
        # model_path is informational: the same encoders may live at another path (or in FLUX.1-schnell)
        mine = {"encoders_fingerprint": self.spec.encoders_fingerprint,
                "max_sequence_length": self.spec.max_sequence_length, "dtype": self.spec.dtype}
        for key, value in mine.items():
            theirs = old.get(key)
            if theirs is not None and str(theirs) != str(value):
                raise ValueError(
                    f"--output_dir {self.output_dir} already holds embeddings made with {key}={theirs} "
                    f"({where}), but this run uses {key}={value}; pass a new --output_dir or delete the old one")

    @staticmethod
    def _shard_header(path: Path) -> dict:
        try:
            with safe_open(str(path), framework="pt") as fh:
                return dict(fh.metadata() or {})
        except Exception:  # noqa: BLE001 - a torn/foreign file is simply not a finished shard
            return {}

    def _expected_header(self, shard: ShardSpec) -> dict[str, str]:
        return {
            "format_version": str(FORMAT_VERSION),
            "encoders_fingerprint": self.spec.encoders_fingerprint,
            "max_sequence_length": str(self.spec.max_sequence_length),
            "dtype": self.spec.dtype,
            "first_id": str(shard.first_id),
            "num_prompts": str(shard.num_prompts),
            "prompts_sha256": _prompts_hash(self.prompts[shard.first_id:shard.first_id + shard.num_prompts]),
            **({"sources_sha256": self.sources.identity(shard.first_id, shard.num_prompts)} if self.sources else {}),
            **({"negative_prompt": json.dumps(self.spec.negative_prompt)} if self.spec.negative_sees_source else {}),
        }

    def is_complete(self, shard: ShardSpec) -> bool:
        """True when the shard file exists and was written for exactly these prompts and encoders."""
        path = self.output_dir / shard.file
        if not path.is_file():
            return False
        header = self._shard_header(path)
        if self.sources is not None and not edits.sources_written(self.output_dir, shard.ids, self.sources.count):
            return False
        return all(header.get(k) == v for k, v in self._expected_header(shard).items())

    # -- writing ----------------------------------------------------------------------------------
    def shards_for_rank(self, rank: int, world_size: int) -> list[ShardSpec]:
        """Round-robin assignment: shard k is written by rank k % world_size."""
        return self.shards[rank::world_size]

    def prompts_of(self, shard: ShardSpec) -> list[str]:
        """The prompt texts of one shard, in id order."""
        return self.prompts[shard.first_id:shard.first_id + shard.num_prompts]

    def _tensors(self, tensors: dict[str, torch.Tensor], rows: int, where: str,
                 keys: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
        """``tensors`` checked against the store's keys (or ``keys``) and ``rows``, floating ones cast to the store
        dtype, on the CPU and contiguous (masks keep their integer dtype)."""
        keys = self.spec.embedding_keys if keys is None else keys
        if set(tensors) != set(keys):
            raise ValueError(f"{where} expects the tensors {list(keys)}, got {sorted(tensors)}: the family's "
                             "encode_prompts / encode_edits must return one tensor per embedding key")
        dtype = DTYPES[self.spec.dtype]
        out = {}
        for key in keys:
            t = tensors[key].detach()
            if t.shape[0] != rows:
                raise ValueError(f"{where} expects {rows} rows, got {key} {tuple(t.shape)}")
            out[key] = t.to("cpu", dtype if t.is_floating_point() else t.dtype).contiguous()
        return out

    def write_shard(self, shard: ShardSpec, tensors: dict[str, torch.Tensor], truncated: list[bool]) -> Path:
        """Write one shard: one ``(n, ...)`` tensor per embedding key (floating ones in the store dtype); atomic."""
        n = shard.num_prompts
        if len(truncated) != n:
            raise ValueError(f"shard {shard.file} expects {n} truncation flags, got {len(truncated)}")
        tensors = self._tensors(tensors, n, f"shard {shard.file}", self.spec.shard_keys)
        header = self._expected_header(shard)
        header["model_path"] = self.spec.model_path
        header["truncated_ids"] = json.dumps([i for i, t in zip(shard.ids, truncated) if t])
        self.output_dir.mkdir(parents=True, exist_ok=True)
        path = self.output_dir / shard.file
        tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
        save_file(tensors, str(tmp), metadata=header)
        publish_file(tmp, path)
        return path

    def _negative_header(self) -> dict[str, str]:
        return {"format_version": str(FORMAT_VERSION), "encoders_fingerprint": self.spec.encoders_fingerprint,
                "max_sequence_length": str(self.spec.max_sequence_length), "dtype": self.spec.dtype,
                "negative_prompt": self.spec.negative_prompt or ""}

    def negative_complete(self) -> bool:
        """True when no negative prompt is asked for, or ``negative.safetensors`` holds exactly this one (the shards
        hold it where it sees the source)."""
        if self.spec.negative_prompt is None or self.spec.negative_sees_source:
            return True
        header = self._shard_header(self.output_dir / NEGATIVE_FILE)
        return all(header.get(k) == v for k, v in self._negative_header().items())

    def write_negative(self, tensors: dict[str, torch.Tensor]) -> Path:
        """Write the negative prompt's embeddings (one row per key) to ``negative.safetensors``; atomic."""
        tensors = self._tensors(tensors, 1, NEGATIVE_FILE, self.spec.text_keys)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        path = self.output_dir / NEGATIVE_FILE
        tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
        save_file(tensors, str(tmp), metadata=self._negative_header())
        publish_file(tmp, path)
        return path

    def finalize(self) -> dict[str, Any]:
        """Rank 0, after every shard is written: check them, drop stale files, write the manifest."""
        missing = [s.file for s in self.shards if not self.is_complete(s)]
        if missing:
            raise RuntimeError(f"shards {missing[:5]} are missing or stale after encoding (internal error)")
        truncated: set[int] = set()
        shapes: dict[str, list[int]] = {}
        tensor_dtypes: dict[str, str] = {}
        for shard in self.shards:
            with safe_open(str(self.output_dir / shard.file), framework="pt") as fh:
                truncated.update(json.loads(fh.metadata().get("truncated_ids", "[]")))
                if not shapes:
                    for key in self.spec.embedding_keys:
                        shapes[key] = list(fh.get_slice(key).get_shape()[1:])
                        tensor_dtypes[key] = fh.get_slice(key).get_dtype()
        if not self.negative_complete():
            raise RuntimeError(f"{NEGATIVE_FILE} is missing or stale after encoding (internal error)")
        keep = {s.file for s in self.shards}
        for path in self.output_dir.iterdir():
            stale_shard = _SHARD_RE.match(path.name) and path.name not in keep
            leftover_tmp = (path.name.startswith((".shard-", f".{MANIFEST_NAME}", f".{NEGATIVE_FILE}"))
                            and ".tmp." in path.name)
            if path.name == edits.SOURCES_DIR and self.sources is not None:
                for stale in path.glob(".*.tmp.*"):
                    stale.unlink(missing_ok=True)
            stale_negative = path.name == NEGATIVE_FILE and (self.spec.negative_prompt is None
                                                             or self.spec.negative_sees_source)
            if stale_shard or leftover_tmp or stale_negative:
                path.unlink(missing_ok=True)
        manifest = {
            "format_version": FORMAT_VERSION,
            "model_path": self.spec.model_path,
            "model_family": self.spec.model_family,
            "encoders_fingerprint": self.spec.encoders_fingerprint,
            "max_sequence_length": self.spec.max_sequence_length,
            "dtype": self.spec.dtype,
            "num_prompts": len(self.prompts),
            "num_truncated": len(truncated),
            "shard_size": self.spec.shard_size,
            "embedding_keys": list(self.spec.embedding_keys),
            "shapes": shapes,
            "tensor_dtypes": tensor_dtypes,
            "negative": None if self.spec.negative_prompt is None else (
                {"prompt": self.spec.negative_prompt, "per_example": True} if self.spec.negative_sees_source
                else {"prompt": self.spec.negative_prompt, "file": NEGATIVE_FILE}),
            "prompt_file": self.prompt_file,
            "condition_keys": list(self.spec.condition_keys),
            "edit": None if self.sources is None else self.sources.manifest_entry(),
            "shards": [{"file": s.file, "first_id": s.first_id, "num_prompts": s.num_prompts} for s in self.shards],
            "prompts": [{"id": i, "prompt": p, "truncated": i in truncated,
                         **(self.sources.prompt_entry(i) if self.sources else {})}
                        for i, p in enumerate(self.prompts)],
        }
        atomic_write_text(self.output_dir / MANIFEST_NAME, json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
        return manifest


def open_prompt_store(prompt_file: str | os.PathLike | None, model_path: str | os.PathLike,
                      output_dir: str | os.PathLike, *, max_sequence_length: int = 512, dtype: str = "fp32",
                      shard_size: int = DEFAULT_SHARD_SIZE, model_family: str = "auto",
                      negative_prompt: str | None = None, edit_file: str | os.PathLike | None = None,
                      edit_size: tuple[int, int] | None = None) -> EmbeddingWriter:
    """The writer of ``prompt_file``'s embeddings under ``output_dir``, checked before any encoder loads: the prompt
    file reads, the model folder has the family's text encoders (``--model_family``) with complete weight files, and
    an existing store there was made the same way (its finished shards are kept). ``negative_prompt``: also store
    that prompt's embeddings (the unconditional branch of --cfg_scale > 1). ``edit_file`` (instead of
    ``prompt_file``; an edit family): (source image, instruction) pairs, every line and image header checked here,
    the sources at ``edit_size`` (height, width) or their own one size (``edits.EditSources``)."""
    family = models.resolve(model_family, model_path)
    sources = None
    if family.edit:
        if edit_file is None:
            raise ValueError(f"the {family.name} family edits a source image: pass --edit_file pairs.jsonl "
                             "({\"image\": ..., \"prompt\": ...} per line) instead of --prompt_file (docs/editing.md)")
        sources = edits.EditSources.open(edit_file, edit_size)
        if sources.count > 1 and not family.multi_source:
            raise ValueError(f"--edit_file {edit_file} names {sources.count} source images per edit, but the "
                             f"{family.name} family takes one: write one \"image\" per line, or use a model that "
                             "takes several (qwen-image-edit-plus, docs/editing.md)")
        prompts, prompt_file = sources.prompts, edit_file
    elif edit_file is not None:
        raise ValueError(f"--edit_file needs an edit model family (flux-kontext, qwen-image-edit); {model_path} is "
                         f"{family.name}: pass --prompt_file, or an edit model (docs/editing.md)")
    else:
        prompts = read_prompt_file(prompt_file)
    needed = family.text_components + (("vae",) if family.edit else ())
    model_path = family.check_folder(model_path, needed).resolve()
    for component in needed:  # headers only: a corrupt file fails here, not mid-load
        if component.startswith("text_encoder") or component == "vae":
            check_weight_files(model_path / component)
    if sources is not None:  # the size the family's VAE and packing take, before anything loads
        models.geometry_for(family, model_path, family.defaults.height, family.defaults.width,
                            condition=sources.condition)
    limit = family.max_sequence_length_limit()
    if not 1 <= max_sequence_length <= limit:
        raise ValueError(f"--max_sequence_length must be in [1, {limit}] (the {family.name} text encoder's limit), "
                         f"got {max_sequence_length}")
    spec = StoreSpec(model_path=str(model_path), encoders_fingerprint=family.encoders_fingerprint(model_path),
                     max_sequence_length=max_sequence_length, dtype=dtype, shard_size=shard_size,
                     embedding_keys=tuple(family.embedding_keys), model_family=family.name or repr(family),
                     negative_prompt=negative_prompt, condition_keys=tuple(family.condition_keys),
                     negative_sees_source=bool(family.edit and family.negative_sees_source))
    writer = EmbeddingWriter(Path(output_dir), prompts, spec, prompt_file=str(Path(prompt_file).resolve()),
                             family=family, sources=sources)
    writer.check_existing()
    return writer


def write_prompt_store(writer: EmbeddingWriter, *, device: torch.device, batch_size: int = 8) -> dict[str, Any]:
    """Encode this rank's unfinished shards (only the text encoders are loaded, and freed after), then rank 0 checks
    every shard and writes the manifest. A collective (every rank calls it, in a process group or alone); returns
    ``{"encoded": shards, "kept": shards, "manifest": dict (rank 0) or None}``."""
    family = writer.family or models.resolve("auto", writer.spec.model_path)
    rank, world_size = distributed.get_rank(), distributed.get_world_size()
    mine = writer.shards_for_rank(rank, world_size)
    todo = [s for s in mine if not writer.is_complete(s)]
    negative = rank == 0 and not writer.negative_complete()  # one row: rank 0 encodes it
    if todo or negative:
        encoders = family.load_text_encoders(writer.spec.model_path, dtype=DTYPES[writer.spec.dtype], device=device)
        vae = None if writer.sources is None else family.load_vae(writer.spec.model_path, device=device)
        msl = writer.spec.max_sequence_length
        for shard in todo:
            texts = writer.prompts_of(shard)
            parts: dict[str, list[torch.Tensor]] = {k: [] for k in writer.spec.shard_keys}
            truncated: list[bool] = []
            for i in range(0, len(texts), batch_size):
                with torch.no_grad():
                    if vae is None:
                        cond, t = family.encode_prompts(encoders, texts[i:i + batch_size], max_sequence_length=msl)
                    else:  # an edit: each source and its instruction (and the negative prompt with it)
                        cond, t = edits.encode_batch(family, encoders, vae, writer, list(shard.ids)[i:i + batch_size],
                                                     texts[i:i + batch_size], device)
                for key in parts:
                    parts[key].append(cond[key].cpu())
                truncated.extend(bool(x) for x in t)
            writer.write_shard(shard, {k: torch.cat(v) for k, v in parts.items()}, truncated)
        if negative:
            with torch.no_grad():
                cond, _ = family.encode_prompts(encoders, [writer.spec.negative_prompt], max_sequence_length=msl)
            writer.write_negative({k: v.cpu() for k, v in cond.items()})
        del encoders, vae  # T5-XXL is 4.7B parameters: give its memory back before the caller loads the transformer
        devices.empty_cache(device)
    counts = distributed.all_gather_object((len(todo), len(mine) - len(todo)))
    distributed.barrier()
    manifest = writer.finalize() if rank == 0 else None
    distributed.barrier()  # the manifest exists for every rank
    return {"encoded": sum(c[0] for c in counts), "kept": sum(c[1] for c in counts), "manifest": manifest}


def is_manifest(path: str | os.PathLike) -> bool:
    """Whether ``path`` names an embedding store (its manifest.json, or a folder holding one) rather than a prompt
    file."""
    path = Path(path)
    return (path / MANIFEST_NAME).is_file() if path.is_dir() else path.suffix == ".json"


# ---------------------------------------------------------------------------------------------- reader
class EmbeddingDataset:
    """Prompt embeddings written by preprocess_embeddings.py, read lazily from memory-mapped shards.

    ``ds[i]`` -> {"prompt_id", "prompt", and one row per embedding key (FLUX.1: "prompt_embeds" (T, D),
    "pooled_prompt_embeds" (Dp,))};
    ``get_batch(ids)`` stacks rows (ids may repeat). Shards are opened on first use and only the
    requested rows are read. Picklable (open handles are dropped), so DataLoader workers work.
    """

    def __init__(self, manifest_path: str | os.PathLike):
        path = Path(manifest_path)
        if path.is_dir() or path.suffix != ".json":
            path = path / MANIFEST_NAME
        if not path.is_file():
            raise FileNotFoundError(f"no embedding manifest at {path}; "
                                    + _PREPROCESS_HINT.format(out=path.parent))
        self.manifest_path = path
        self.root = path.parent
        try:
            self.manifest: dict[str, Any] = _read_json(path)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path} is not valid JSON ({err}); re-run preprocess_embeddings.py into a new "
                             "--output_dir") from None
        version = self.manifest.get("format_version") if isinstance(self.manifest, dict) else None
        if version not in READABLE_VERSIONS:
            raise ValueError(f"{path} has format_version {version!r} but this code reads versions "
                             f"{list(READABLE_VERSIONS)}; re-run preprocess_embeddings.py into a new --output_dir "
                             "with this version of the code")
        m = self.manifest
        self.embedding_keys: tuple[str, ...] = tuple(m.get("embedding_keys") or FLUX1_KEYS)
        self.shapes: dict[str, list[int]] = m.get("shapes") or {k: m.get(f"{k}_shape") for k in FLUX1_KEYS
                                                                 if m.get(f"{k}_shape")}
        self.model_family: str = m.get("model_family", "flux1")
        self.condition_keys: tuple[str, ...] = tuple(m.get("condition_keys") or ())  # an edit store's source rows
        self.family: Any = None  # the model family whose ``collate`` shapes a batch (``use``)
        self.with_negative = False  # whether ``get_batch`` adds the negative prompt's rows (``use``)
        self._negative: dict[str, torch.Tensor] | None = None  # ``negative_rows``, once read
        self.negative_in_shards = bool((m.get("negative") or {}).get("per_example"))  # a row per example (edits)
        self.prompts: list[str] = [p["prompt"] for p in self.manifest["prompts"]]
        if len(self.prompts) != self.manifest["num_prompts"]:
            raise ValueError(f"{path} is inconsistent (num_prompts != len(prompts)); re-run preprocess_embeddings.py")
        self._shard_of: list[tuple[str, int] | None] = [None] * len(self.prompts)  # id -> (file, row)
        for shard in self.manifest["shards"]:
            file = shard["file"]
            full = resolve_inside(self.root, file, str(path))  # a manifest names files in its own folder only
            if not full.is_file():
                raise FileNotFoundError(f"shard {full} listed in {path} is missing; re-run "
                                        "preprocess_embeddings.py with the same --output_dir to rewrite it")
            self._check_shard(full, shard)
            for row in range(shard["num_prompts"]):
                i = shard["first_id"] + row
                if not 0 <= i < len(self.prompts) or self._shard_of[i] is not None:
                    raise ValueError(f"{path} is inconsistent (shard {file} holds prompt id {i}, outside [0, "
                                     f"{len(self.prompts)}) or also in another shard); re-run "
                                     "preprocess_embeddings.py into a new --output_dir")
                self._shard_of[i] = (file, row)
        uncovered = [i for i, where in enumerate(self._shard_of) if where is None]
        if uncovered:
            raise ValueError(f"{path} lists no shard for prompt ids {uncovered[:5]}{'...' * (len(uncovered) > 5)}; "
                             "re-run preprocess_embeddings.py with the same --output_dir")
        self._handles: dict[str, Any] = {}

    def _check_shard(self, file: Path, shard: dict[str, Any]) -> None:
        """Header-only check that ``file`` is the complete shard the manifest records (no tensor is read): ValueError
        naming the file for a corrupt or truncated one, or one written by another preprocessing run."""
        header, _ = read_safetensors_header(file, "re-run preprocess_embeddings.py with the same --output_dir to "
                                                  "rewrite it")
        m, n = self.manifest, shard["num_prompts"]
        meta = header.get("__metadata__") or {}
        found: dict[str, Any] = {key: meta[key] for key in ("encoders_fingerprint", "max_sequence_length", "dtype",
                                                            "first_id", "num_prompts") if key in meta}
        expected: dict[str, Any] = {"encoders_fingerprint": m.get("encoders_fingerprint"),
                                    "max_sequence_length": m["max_sequence_length"], "dtype": m["dtype"],
                                    "first_id": shard["first_id"], "num_prompts": n}
        store_dtype = {"fp32": "F32", "bf16": "BF16"}.get(m["dtype"], m["dtype"])
        for name in self.embedding_keys:
            tensor = header.get(name) or {}
            found[f"{name} rows"] = tensor.get("shape", [None])[:1]
            expected[f"{name} rows"] = [n]
            if name in self.shapes:
                found[f"{name} row shape"] = tensor.get("shape", [None])[1:]
                expected[f"{name} row shape"] = self.shapes[name]
            found[f"{name} dtype"] = tensor.get("dtype")
            expected[f"{name} dtype"] = (m.get("tensor_dtypes") or {}).get(name, store_dtype)
        differ = [f"{key} {found[key]} (manifest: {expected[key]})" for key in found
                  if str(found[key]) != str(expected[key])]
        if differ:
            raise ValueError(f"{file} is not the shard {self.manifest_path} records ({'; '.join(differ[:3])}): it "
                             "is damaged or from another preprocessing run (another model or --max_sequence_length); "
                             "re-run preprocess_embeddings.py into a new --output_dir, or delete the shard and re-run "
                             "with the same one")

    def __len__(self) -> int:
        return len(self.prompts)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_handles"] = {}
        return state

    @property
    def max_sequence_length(self) -> int:
        return int(self.manifest["max_sequence_length"])

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.manifest["dtype"]]

    @property
    def condition_size(self) -> tuple[int, ...] | None:
        """An edit store's source size (height, width), with the sources per edit when several ((height, width,
        count)): ``models.geometry_for(..., condition=)``; None: prompts."""
        return edits.condition_of(self.manifest.get("edit"))

    @property
    def source_paths(self) -> list[str] | None:
        """An edit store's source image per id, as preprocessing read it (its edit file's paths, resolved); None for
        a prompt store."""
        return None if self.condition_size is None else [p["image"] for p in self.manifest["prompts"]]

    def source_images(self, prompt_ids: Any) -> torch.Tensor | None:
        """An edit store's sources of ``prompt_ids`` (a list or tensor; repeats read once) as (B, 3, H, W) float32 in
        [0, 1] on the CPU: the pixels the VAE encoded, what edit rewards compare the edits with; None for a prompt
        store."""
        if self.condition_size is None:
            return None
        ids = [self._check_id(i) for i in (prompt_ids.tolist() if torch.is_tensor(prompt_ids) else prompt_ids)]
        unique = sorted(set(ids))
        images = edits.read_sources(self.root, unique)
        return images[[unique.index(i) for i in ids]]

    @property
    def negative_prompt(self) -> str | None:
        """The negative prompt stored beside the prompts (``--negative_prompt``), None when there is none."""
        negative = self.manifest.get("negative")
        return negative["prompt"] if negative else None

    def _handle(self, file: str):
        handle = self._handles.get(file)
        if handle is None:
            handle = safe_open(str(self.root / file), framework="pt")
            self._handles[file] = handle
        return handle

    def _check_id(self, prompt_id: int) -> int:
        i = int(prompt_id)
        if not 0 <= i < len(self.prompts):
            raise IndexError(f"prompt id {prompt_id} out of range [0, {len(self.prompts)})")
        return i

    def _rows(self, prompt_id: int, keys: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
        file, row = self._shard_of[prompt_id]
        handle = self._handle(file)
        return {key: handle.get_slice(key)[row:row + 1] for key in keys or self.embedding_keys}  # (1, ...) each

    def __getitem__(self, prompt_id: int) -> dict[str, Any]:
        i = self._check_id(prompt_id)
        return {"prompt_id": i, "prompt": self.prompts[i], **{k: v[0] for k, v in self._rows(i).items()}}

    def use(self, family: Any, negative: bool = False) -> "EmbeddingDataset":
        """Shape ``get_batch`` for ``family`` (its ``collate``) and, with ``negative`` (--cfg_scale > 1), add the
        negative prompt's rows under ``negative_<key>``; ValueError naming the fix when the store has none."""
        if family is not None and bool(family.edit) != (self.condition_size is not None):
            raise ValueError(f"{self.root} holds {'edits' if self.condition_size else 'prompts'} but the {family.name} "
                             f"family {'edits a source image' if family.edit else 'takes no source image'}: "
                             + ("preprocess an --edit_file with this model" if family.edit else
                                "train an edit family (flux-kontext, qwen-image-edit) on it") + " (docs/editing.md)")
        if negative and not self.manifest.get("negative"):
            raise ValueError(f"--cfg_scale > 1 needs the negative prompt's embeddings, which {self.root} does not "
                             "hold: re-run preprocess_embeddings.py with --negative_prompt \"\" (or the family's "
                             "negative prompt) into the same --output_dir (finished shards are kept), or pass --cfg_scale 1")
        if negative and not self.negative_in_shards:
            negative_file = resolve_inside(self.root, self.manifest["negative"]["file"], str(self.manifest_path))
            if not negative_file.is_file():
                raise FileNotFoundError(f"{negative_file} listed in {self.manifest_path} is missing; re-run "
                                        "preprocess_embeddings.py with --negative_prompt into the same --output_dir")
        self.family, self.with_negative = family, bool(negative)
        return self

    def negative_rows(self) -> dict[str, torch.Tensor]:
        """The negative prompt's embeddings, ``(1, ...)`` per key (``negative.safetensors``), read from disk once and
        kept (every ``get_batch`` of a --cfg_scale run needs them)."""
        if self._negative is None:
            info = self.manifest.get("negative")
            if info and info.get("per_example"):
                raise ValueError(f"{self.root} keeps a negative row per example in its shards (an edit family whose "
                                 "negative prompt sees the source): read them with use(family, negative=True)")
            if not info:
                raise ValueError(f"{self.root} holds no negative prompt; re-run preprocess_embeddings.py with "
                                 "--negative_prompt")
            self._negative = load_file(str(resolve_inside(self.root, info["file"], str(self.manifest_path))))
        return self._negative

    def get_batch(self, prompt_ids: list[int]) -> dict[str, Any]:
        """Rows for ``prompt_ids`` (repeats allowed): one ``(B, ...)`` tensor per embedding key (FLUX.1:
        prompt_embeds (B, T, D), pooled_prompt_embeds (B, Dp)), plus ``negative_<key>`` rows after ``use(family,
        negative=True)``; the family's ``collate`` trims both together (one text length)."""
        ids = [self._check_id(i) for i in prompt_ids]
        if not ids:
            raise ValueError("get_batch needs at least one prompt id")
        text = [k for k in self.embedding_keys if k not in self.condition_keys]  # the negative row's keys
        in_shards = self.with_negative and self.negative_in_shards
        keys = self.embedding_keys + (tuple(f"negative_{k}" for k in text) if in_shards else ())
        cache: dict[int, dict[str, torch.Tensor]] = {}
        for i in ids:
            if i not in cache:
                cache[i] = self._rows(i, keys)
        cond = {k: torch.cat([cache[i][k] for i in ids]) for k in keys}  # (B, ...) each
        if self.with_negative and not in_shards:
            negative = self.negative_rows()
            cond.update({f"negative_{k}": negative[k].expand(len(ids), *negative[k].shape[1:]).clone() for k in text})
        if self.family is not None:
            n = len(ids)
            joined = self.family.collate({k: torch.cat([cond[k], cond[f"negative_{k}"]])
                                          if self.with_negative and k in text else cond[k]
                                          for k in self.embedding_keys})
            cond = {k: v[:n] for k, v in joined.items()}
            if self.with_negative:
                cond.update({f"negative_{k}": v[n:] for k, v in joined.items() if k in text})
        return {"prompt_ids": torch.tensor(ids, dtype=torch.long), "prompts": [self.prompts[i] for i in ids],
                **cond}

    def check_encoders(self, model_path: str | os.PathLike, model_family: str = "auto") -> None:
        """Raise ValueError if these embeddings were made with other text encoders than ``model_path``'s."""
        theirs = self.manifest.get("encoders_fingerprint")
        if models.resolve(model_family, model_path).encoders_fingerprint(model_path) != theirs:
            raise ValueError(f"embeddings in {self.root} were made with other text encoders "
                             f"({self.manifest.get('model_path')}) than {model_path}; re-run "
                             "preprocess_embeddings.py with this --model_path")


