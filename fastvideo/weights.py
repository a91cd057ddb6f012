"""Load weights straight into sharded parameters: every rank reads only the bytes of its own shards.

The trainers build the transformer on the meta device, shard it (``parallel.shard_model`` materialises each rank's
shards, uninitialised), then call ``load_safetensors_into``. A parameter's local part is a contiguous range of its
row-major flattened elements — FSDP2 keeps a dim-0 chunk (rows ``[r0, r1)``), FSDP1 a flat slice of its
FlatParameter, an unsharded model everything — so it is a contiguous byte range of the safetensors file, read
with ``pread`` (no mmap: file pages never count against a rank's RSS). Host RAM per node is therefore the
sharded model plus one read buffer, ~1x the model for any number of ranks, instead of one full copy per rank.

    with torch.device("meta"):
        model = FluxTransformer2DModel.from_config(config)
    model = shard_model(model, ...)                              # shards materialised on the device
    load_safetensors_into(model, "FLUX.1-dev/transformer")     # each rank: its rows of every tensor
    fill_local_shards(model, {"x.lora_A.default.weight": full_tensor_fn})   # generated weights (LoRA init)
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch
from torch import nn

from fastvideo.parallel import clean_name, fsdp_version_of

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor lives in a safetensors file: its dtype, shape and the byte offset of its first element."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


MODEL_FIX = "re-download the model (or re-save it with diffusers' save_pretrained(safe_serialization=True))"
_MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit


def read_safetensors_header(file: str | os.PathLike, fix: str = MODEL_FIX) -> tuple[dict, int]:
    """The JSON header of a safetensors file and the byte offset of its tensor data, checked without reading any
    tensor: ValueError naming ``file`` and ``fix`` for a file that is cut short, not safetensors, or whose data is
    shorter than its header records (an interrupted download or copy)."""
    file = Path(file)

    def bad(why: str) -> ValueError:
        return ValueError(f"{file} is not a complete safetensors file ({why}): {fix}")

    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad(f"{size} bytes, shorter than the 8-byte header length")
        (length,) = struct.unpack("<Q", head)
        if length > min(size - 8, _MAX_HEADER_BYTES):
            raise bad(f"its header length {length} exceeds the file's {size} bytes")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise bad("its header is not JSON") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                or not isinstance(entry.get("shape"), list) or "dtype" not in entry):
            raise bad(f"tensor {name!r} has a malformed header entry")
        end = max(end, offsets[1])
    if 8 + length + end > size:
        raise bad(f"truncated: its header records {8 + length + end} bytes but the file has {size}")
    return header, 8 + length


def _read_header(file: Path) -> dict[str, TensorRecord]:
    header, base = read_safetensors_header(file)
    records = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in _DTYPES:
            raise ValueError(f"{file}: tensor {name} has dtype {entry['dtype']}, which this loader does not read; "
                             "convert the checkpoint to bf16/fp32 safetensors")
        records[name] = TensorRecord(file, _DTYPES[entry["dtype"]], tuple(entry["shape"]),
                                     base + entry["data_offsets"][0])
    return records


def path_inside(root: Path, value: object, where: str) -> tuple[Path | None, str]:
    """``(root / value resolved, "")`` for a relative path that stays inside ``root`` (``where`` names that folder in
    messages); ``(None, what is wrong)`` for a non-string, an absolute path or one that leaves ``root`` (``..``, a
    symlink). The one rule for paths read from our files (manifests, weight indexes, pair files)."""
    if not isinstance(value, str) or not value.strip():
        return None, f"must be a non-empty path string, got {value!r}"
    root = Path(root).resolve()
    if Path(value).is_absolute():
        return None, f"is an absolute path; write it relative to {where} {root}"
    path = (root / value).resolve()
    if not path.is_relative_to(root):
        return None, f"resolves to {path}, outside {where} {root}; keep it inside that folder"
    return path, ""


def resolve_inside(root: Path, value: object, source: str) -> Path:
    """``path_inside`` for an entry of the file ``source`` (in ``root``), raising ValueError naming ``source`` and the
    entry instead of returning the problem."""
    path, problem = path_inside(root, value, f"the folder of {Path(source).name}")
    if path is None:
        raise ValueError(f"{source}: entry {value!r} {problem}: rewrite {source} (or re-create it)")
    return path


def safetensors_index(folder: str | os.PathLike) -> dict[str, TensorRecord]:
    """Every tensor of a diffusers component folder: one ``*.safetensors`` file, or the files its
    ``*.safetensors.index.json`` names (FLUX.1-dev's transformer is three; they must lie in ``folder``). Reads and
    checks headers only (ValueError naming the file for a corrupt or truncated one)."""
    folder = Path(folder)
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        try:
            weight_map = json.loads(indexes[0].read_text())["weight_map"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{indexes[0]} is not a safetensors index (JSON with a 'weight_map'): "
                             f"{MODEL_FIX}") from None
        files = sorted({resolve_inside(folder, f, str(indexes[0])) for f in weight_map.values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors weights (only safetensors are read, shard by shard); "
                                "convert .bin weights with diffusers' save_pretrained(safe_serialization=True)")
    records: dict[str, TensorRecord] = {}
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"{file} is named by {indexes[0].name} but missing: re-download the model")
        records.update(_read_header(file))
    return records


def stored_dtype(folder: str | os.PathLike) -> torch.dtype:
    """The floating-point dtype a component folder's safetensors store its weights in (the one holding most elements:
    bf16 for FLUX.1-dev, fp32 for the tiny test models), read from the headers only; ``--export_dtype auto``."""
    totals: dict[torch.dtype, int] = {}
    for record in safetensors_index(folder).values():
        if record.dtype.is_floating_point:
            totals[record.dtype] = totals.get(record.dtype, 0) + record.numel
    if not totals:
        raise ValueError(f"{folder} stores no floating-point weights; pass --export_dtype bf16|fp16|fp32")
    return max(totals, key=totals.__getitem__)


def check_weight_files(folder: str | os.PathLike) -> None:
    """Header-check every ``*.safetensors`` file of a component folder (and the files its index names) before any
    model is built: ValueError naming a corrupt or truncated file, FileNotFoundError for one the index names but
    that is missing. A folder without safetensors passes (its loader reports that)."""
    folder = Path(folder)
    if any(folder.glob("*.safetensors.index.json")) or any(folder.glob("*.safetensors")):
        safetensors_index(folder)


def read_flat(record: TensorRecord, start: int, stop: int) -> torch.Tensor:
    """Elements ``[start, stop)`` of the row-major flattened tensor, as a 1-D CPU tensor in the file's dtype."""
    itemsize = torch.empty((), dtype=record.dtype).element_size()
    count = max(0, stop - start)
    out = torch.empty(count, dtype=record.dtype)
    if count:
        raw = out.view(torch.uint8).numpy()
        with open(record.file, "rb", buffering=0) as f:
            f.seek(record.offset + start * itemsize)
            if f.readinto(memoryview(raw)) != raw.nbytes:
                raise ValueError(f"{record.file} is truncated (reading a tensor at byte {record.offset}): "
                                 "re-download the model")
    return out


@dataclass
class LocalPiece:
    """This rank's part of one parameter: elements ``[start, stop)`` of the flattened full tensor go to ``dest``."""

    name: str
    shape: tuple[int, ...]
    dest: torch.Tensor  # 1-D view of the local storage (stop - start elements)
    start: int
    stop: int


def persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``model.named_buffers()`` without the non-persistent ones (``register_buffer(..., persistent=False)``, e.g.
    Wan's rotary tables): those are in no state dict or weight file; their module recomputes them."""
    for module_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{name}" if module_name else name), buf


def local_pieces(model: nn.Module) -> Iterator[LocalPiece]:
    """Each parameter's and persistent buffer's local part (clean names, as in the diffusers state dict) on this
    rank."""
    if fsdp_version_of(model) == 1:
        yield from _fsdp1_pieces(model)
        return
    from torch.distributed.tensor import DTensor  # heavy
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # heavy

    named = [*model.named_parameters(), *persistent_buffers(model)]
    for name, tensor in named:
        name = clean_name(name)
        if isinstance(tensor, DTensor):
            local = tensor._local_tensor
            shape = tuple(tensor.shape)
            local_shape, offset = compute_local_shape_and_global_offset(shape, tensor.device_mesh, tensor.placements)
            if tuple(local_shape[1:]) != shape[1:] or any(offset[1:]):
                raise NotImplementedError(f"{name}: only dim-0 sharding is supported (placements "
                                          f"{tensor.placements})")
            row = 1
            for s in shape[1:]:
                row *= s
            start = offset[0] * row if local.numel() else 0
            yield LocalPiece(name, shape, local.view(-1), start, start + local.numel())
        else:
            yield LocalPiece(name, tuple(tensor.shape), tensor.data.view(-1), 0, tensor.numel())


def _fsdp1_pieces(model: nn.Module) -> Iterator[LocalPiece]:
    """FSDP1 (use_orig_params): each FlatParameter shard holds flat slices of its original parameters."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # heavy

    owned: set[str] = set()
    for module_name, module in model.named_modules():
        if not isinstance(module, FSDP) or module._handle is None:
            continue
        flat = module._handle.flat_param
        prefix = clean_name(module_name + ".") if module_name else ""
        for fqn, shape, info in zip(flat._fqns, flat._shapes, flat._shard_param_infos):
            name = clean_name(prefix + fqn)
            owned.add(name)
            if info.in_shard:
                dest = flat.data[info.offset_in_shard:info.offset_in_shard + info.numel_in_shard]
                yield LocalPiece(name, tuple(shape), dest, info.intra_param_start_idx, info.intra_param_end_idx + 1)
            else:
                yield LocalPiece(name, tuple(shape), flat.data[:0], 0, 0)
    for name, buf in persistent_buffers(model):
        if clean_name(name) not in owned:
            yield LocalPiece(clean_name(name), tuple(buf.shape), buf.data.view(-1), 0, buf.numel())


@torch.no_grad()
def load_safetensors_into(model: nn.Module, folder: str | os.PathLike | Mapping[str, str | os.PathLike],
                          skip: Callable[[str], bool] = lambda name: False) -> int:
    """Fill this rank's part of every parameter and buffer from the safetensors of ``folder``; returns the bytes read.
    ``folder`` may map state-dict key prefixes to folders (a model of several parts: ``ModelFamily.weight_folders``).

    Strict like ``from_pretrained``: every tensor not ``skip``-ped (e.g. LoRA adapters, which the file lacks) must be
    in the files with the same shape, and every tensor of the files must belong to the model. Values are cast to the
    model's dtype (bf16 file -> fp32 master weights is exact). Works on a plain, FSDP2 or FSDP1 model.
    """
    folders = folder if isinstance(folder, Mapping) else {"": folder}
    index = {prefix + name: record for prefix, part in folders.items()
             for name, record in safetensors_index(part).items()}
    pieces = [p for p in local_pieces(model) if not skip(p.name)]
    for piece in pieces:  # peft wraps adapted layers: "x.to_q.base_layer.weight" is the file's "x.to_q.weight"
        piece.name = piece.name.replace(".base_layer.", ".")
    names = {p.name for p in pieces}
    missing, unexpected = sorted(names - set(index)), sorted(set(index) - names)
    if missing or unexpected:
        raise ValueError(f"the weights in {folder} do not match the model built from its config.json (missing "
                         f"{missing[:3]}{'...' if len(missing) > 3 else ''}, unexpected {unexpected[:3]}"
                         f"{'...' if len(unexpected) > 3 else ''}): point --pretrained_model_name_or_path at an "
                         "unmodified diffusers FLUX folder")
    total = 0
    for piece in pieces:
        record = index[piece.name]
        if record.shape != piece.shape:
            raise ValueError(f"{piece.name}: file shape {record.shape} but the model expects {piece.shape}; the "
                             f"config.json and weights of {folder} disagree")
        data = read_flat(record, piece.start, piece.stop)
        piece.dest.copy_(data)
        total += data.numel() * data.element_size()
    return total


@torch.no_grad()
def fill_local_shards(model: nn.Module, make: dict[str, Callable[[], torch.Tensor]]) -> None:
    """Write generated full tensors (``name -> fn() -> full CPU tensor``) into this rank's part of those parameters.

    Every rank calls ``fn`` and keeps its own slice, so the values do not depend on the sharding (used for the
    seeded LoRA initialisation of a meta-built model). Raises if a name is not a parameter of the model.
    """
    found = set()
    for piece in local_pieces(model):
        if piece.name in make:
            full = make[piece.name]()
            if tuple(full.shape) != piece.shape:
                raise ValueError(f"{piece.name}: generated shape {tuple(full.shape)} != parameter {piece.shape}")
            piece.dest.copy_(full.reshape(-1)[piece.start:piece.stop])
            found.add(piece.name)
    if set(make) - found:
        raise ValueError(f"fill_local_shards: no parameters named {sorted(set(make) - found)[:3]}")
