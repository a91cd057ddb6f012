"""Atomic, sharded save/resume of the whole training state (the EMA and other shadows: ``ema.py``).

Layout of one checkpoint (``output_dir/checkpoints/step-N``):

    state/     model + optimizer, torch.distributed.checkpoint (DCP) format: each rank writes its own shards
    ema/       the EMA weights in the same format (only when an EMA is passed)
    shadow-NAME/  other sharded shadows of the trainable weights (e.g. DPO's updated reference), same format
    trainer_state_rank{r}.json + .safetensors   rank r's ``extra`` (step, sampler position, that rank's RNG states,
                               config...), the LR-scheduler state and EMA counters: JSON for the structure,
                               safetensors for its tensors (no pickle: nothing in a checkpoint can run code on load)
    meta.json  written last, after every other file is fsynced; its presence is what makes the directory a
               checkpoint. It records the step, the algorithm, the run's config fingerprint (checked before a
               resume loads anything) and the size of every file (a damaged checkpoint is refused, not loaded)

Everything is first written to ``step-N.tmp-<id>`` and renamed to ``step-N`` by rank 0 after a barrier, so a crash
or SIGKILL at any point of a save leaves at most a ``.tmp-`` directory that ``latest_checkpoint`` ignores and
``clean_interrupted_saves`` (run at every start) removes; the newest complete checkpoint is never touched. A save
that runs out of disk space (checked before writing, and caught while writing) removes its partial directory and
raises an OSError(ENOSPC) naming the path and the bytes needed.
Multi-node jobs need ``output_dir`` on a shared filesystem (as DCP does).

Loading is pickle-safe: DCP's tensor files are read with ``torch.load(weights_only=True)``, its non-tensor entries
(optimizer hyper-parameters) through a planner that does the same, and its ``.metadata`` pickle is vetted by an
unpickler that only admits DCP's own metadata classes.

Model state: when any parameter is frozen (LoRA: the base is frozen) only the trainable parameters are saved
(``trainable_only`` in meta.json) — the frozen weights are reloaded from the model folder when the trainer
rebuilds the model before ``load_checkpoint``. Otherwise the full model is saved. DCP reshards on load, so a run
may resume with a different world size or FSDP version (per-rank ``extra`` then falls back to rank 0's file).

Resume order in a trainer: build model -> add_lora -> shard_model -> optimizer/scheduler -> EMA -> load_checkpoint.
"""
from __future__ import annotations

import contextlib
import errno
import importlib
import io
import json
import os
import pickle
import re
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from fastvideo import distributed
from fastvideo.ema import EMA, local_shard
from fastvideo.parallel import named_trainable_parameters

CHECKPOINTS_SUBDIR = "checkpoints"
FORMAT_VERSION = 2  # 2: trainer state as JSON + safetensors, files/algorithm/fingerprint in meta.json; 1 still loads
_STEP_RE = re.compile(r"^step-(\d+)$")
_TMP_RE = re.compile(r"^step-(\d+)\.tmp-")
_OLD_RE = re.compile(r"^step-(\d+)\.tmp-old-")  # a complete checkpoint moved aside while its step is re-saved
_SPACE_MARGIN = 1.05  # headroom over the estimated bytes (metadata, file system blocks)


def checkpoint_path(output_dir: str | Path, step: int) -> Path:
    """Where the checkpoint of ``step`` lives: ``output_dir/checkpoints/step-{step}``."""
    return Path(output_dir) / CHECKPOINTS_SUBDIR / f"step-{step}"


def checkpoint_step(path: str | Path) -> int:
    """N of a ``step-N`` checkpoint folder (ValueError for another name)."""
    match = _STEP_RE.match(Path(path).name)
    if match is None:
        raise ValueError(f"{path} is not a checkpoint folder (expected a name like step-N); pass "
                         "OUTPUT_DIR/checkpoints/step-N or --resume_from latest")
    return int(match.group(1))


def _is_complete(path: Path) -> bool:
    return path.is_dir() and _STEP_RE.match(path.name) is not None and (path / "meta.json").is_file()


def read_meta(path: str | Path) -> dict:
    """The ``meta.json`` of a checkpoint, checked: FileNotFoundError when it is missing (never written or interrupted
    mid-save), ValueError when it is unreadable or a file it lists is missing or has another size (damaged)."""
    path = Path(path)
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        parent = path.parent.parent if path.parent.name == CHECKPOINTS_SUBDIR else path
        raise FileNotFoundError(
            f"no complete checkpoint at {path} (missing meta.json: not a checkpoint, or interrupted mid-save); "
            f"pass a step-N directory from {parent / CHECKPOINTS_SUBDIR} or --resume_from latest "
            "(latest_checkpoint(output_dir))")
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"checkpoint {path} is damaged: meta.json is unreadable ({err}); resume from an older "
                         "checkpoint (pass its step-N folder to --resume_from)") from err
    for rel, size in (meta.get("files") or {}).items():
        file = path / rel
        actual = file.stat().st_size if file.is_file() else None
        if actual != size:
            state = "missing" if actual is None else f"{actual} bytes, {size} expected"
            raise ValueError(f"checkpoint {path} is damaged: {rel} is {state}; resume from an older checkpoint "
                             "(pass its step-N folder to --resume_from)")
    return meta


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints under ``output_dir/checkpoints``, oldest step first."""
    root = Path(output_dir) / CHECKPOINTS_SUBDIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _is_complete(p)]
    return sorted(found, key=lambda p: int(_STEP_RE.match(p.name).group(1)))


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete, undamaged checkpoint under ``output_dir/checkpoints``, or None. A damaged one (a listed
    file missing or of the wrong size) is skipped with a warning naming it."""
    for path in reversed(list_checkpoints(output_dir)):
        try:
            read_meta(path)
        except ValueError as err:
            warnings.warn(f"skipping {path}: {err}", stacklevel=2)
            continue
        return path
    return None


def clean_interrupted_saves(output_dir: str | Path) -> list[Path]:
    """Remove what interrupted saves left in ``output_dir/checkpoints`` (``step-N.tmp-*`` directories); a complete
    checkpoint that a re-save of its step had moved aside (``step-N.tmp-old-*``) is put back when ``step-N`` is gone.
    Call on every rank at the start of a run (rank 0 acts); returns the removed paths."""
    removed: list[Path] = []
    root = Path(output_dir) / CHECKPOINTS_SUBDIR
    if distributed.is_main_process() and root.is_dir():
        for path in sorted(root.iterdir()):
            if not path.is_dir() or not _TMP_RE.match(path.name):
                continue
            old = _OLD_RE.match(path.name)
            target = root / f"step-{old.group(1)}" if old else None
            if target is not None and not target.exists() and (path / "meta.json").is_file():
                os.replace(path, target)
                print(f"restored {target} (a re-save of its step was interrupted)", flush=True)
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        if removed:
            print(f"removed {len(removed)} interrupted save(s) in {root}: {', '.join(p.name for p in removed)}",
                  flush=True)
    distributed.store_barrier("clean_interrupted_saves")  # rank 0 may be deleting large folders
    return removed


def prune_checkpoints(output_dir: str | Path, total_limit: int | None,
                      protect: tuple[str | Path | None, ...] = ()) -> list[Path]:
    """Keep the newest ``total_limit`` checkpoints (None or <= 0 keeps all) and never delete those in ``protect``
    (the one just saved, the one the run resumed from); also drop stale ``.tmp-`` dirs.

    Call after ``save_checkpoint`` returned (on every rank; rank 0 deletes). Returns the removed paths.
    """
    removed: list[Path] = []
    if distributed.is_main_process():
        root = Path(output_dir) / CHECKPOINTS_SUBDIR
        keep = {Path(p).resolve() for p in protect if p is not None}
        found = list_checkpoints(output_dir)
        doomed = found[:-total_limit] if total_limit and total_limit > 0 else []
        doomed = [p for p in doomed if p.resolve() not in keep]
        if root.is_dir():
            doomed += [p for p in root.iterdir() if p.is_dir() and _TMP_RE.match(p.name)]
        for path in doomed:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    distributed.store_barrier("prune_checkpoints")  # rank 0 may be deleting a 100+ GB checkpoint
    return removed


def _trainable_only(model: nn.Module) -> bool:
    return any(not p.requires_grad for p in model.parameters())


def _options(trainable_only: bool, strict: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions  # heavy

    return StateDictOptions(ignore_frozen_params=trainable_only, strict=strict)


def _local_bytes(tree: Any) -> int:
    """Bytes of this rank's tensors (local shards of DTensors) in a nested state dict."""
    if hasattr(tree, "local_shards"):  # FSDP1's ShardedTensor
        return sum(_local_bytes(shard.tensor) for shard in tree.local_shards())
    if isinstance(tree, torch.Tensor):
        local = local_shard(tree)
        return local.numel() * local.element_size()
    if isinstance(tree, dict):
        return sum(_local_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_local_bytes(v) for v in tree)
    return 0


def _is_no_space(err: BaseException | None) -> bool:
    """True when ``err`` (or what it wraps: a DCP CheckpointException's per-rank failures, a cause) is ENOSPC."""
    seen = 0
    while err is not None and seen < 8:
        seen += 1
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        failures = getattr(err, "failures", None)
        if isinstance(failures, dict) and any(_is_no_space(f[0] if isinstance(f, tuple) else f)
                                              for f in failures.values()):
            return True
        if "No space left on device" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def _no_space_error(ckpt_dir: Path, needed: int, free: int | None) -> OSError:
    free_text = f", {free / 2**30:.2f} GiB free" if free is not None else ""
    return OSError(errno.ENOSPC, f"no space left for checkpoint {ckpt_dir}: it needs ~{needed / 2**30:.2f} GiB "
                                 f"({needed} bytes){free_text}; free space there (older checkpoints: "
                                 "--checkpoints_total_limit) or point --output_dir at a larger file system. The "
                                 "previous checkpoints are intact: rerun with --resume_from latest")


def _fail_together(error: BaseException | None, tmp: Path, ckpt_dir: Path, needed: int) -> None:
    """After a phase of a save: if any rank failed, every rank raises the same error (no rank left waiting in a
    collective) once rank 0 has removed the partial directory; out-of-space becomes ``_no_space_error``."""
    errors = distributed.all_gather_object(None if error is None else (type(error).__name__, str(error)[-1500:],
                                                                       _is_no_space(error)))
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not failed:
        return
    if distributed.is_main_process():
        shutil.rmtree(tmp, ignore_errors=True)
    distributed.store_barrier("save_failed")
    if any(e[2] for _, e in failed):
        raise _no_space_error(ckpt_dir, needed, _free_bytes(ckpt_dir.parent)) from error
    rank, (name, text, _) = failed[0]
    if error is not None:
        raise error
    raise RuntimeError(f"saving checkpoint {ckpt_dir} failed on rank {rank}: {name}: {text}")


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def fill_unstepped_adam_state(optimizer: torch.optim.Optimizer) -> int:
    """Give every parameter of an Adam/AdamW ``optimizer`` that has no state yet the state Adam would create at its
    first gradient (step 0, zero moments); returns how many were filled.

    A trainable parameter that never receives a gradient (e.g. a LoRA on Qwen-Image's last block's text output,
    which the model discards) has no optimizer state, so a checkpoint would lack it while a resumed optimizer
    (initialised for every parameter) expects it. The filled state changes nothing: Adam skips parameters without a
    gradient, and one that gets a gradient later starts from exactly this state."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 0
    filled = 0
    for group in optimizer.param_groups:
        on_device = group.get("capturable") or group.get("fused")
        for p in group["params"]:
            if not p.requires_grad or optimizer.state.get(p):
                continue
            step = (torch.zeros((), dtype=torch.float32, device=p.device) if on_device
                    else torch.tensor(0.0, dtype=torch.float32))
            state = {"step": step, "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                     "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            optimizer.state[p] = state
            filled += 1
    return filled


def save_checkpoint(
    ckpt_dir: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any = None,
    extra: dict,
    ema: EMA | None = None,
    shadows: dict[str, EMA] | None = None,
    manifest: dict | None = None,
) -> Path:
    """Save model (trainable params if any are frozen), optimizer, scheduler, EMA, named ``shadows`` (EMA objects
    holding other copies of the trainable weights, e.g. a reference snapshot) and this rank's ``extra``.

    A collective: call on every rank with the same ``ckpt_dir`` (use ``checkpoint_path(output_dir, step)``) and
    each rank's own ``extra`` (e.g. ``{"step": s, "sampler": ..., "rng": seeding.rng_state(), "config": ...}``:
    dicts, lists, tuples, numbers, strings, None, tensors and NumPy arrays). ``manifest``: more entries for
    meta.json (e.g. algorithm, config fingerprint). Atomic and crash-safe (see module docstring); free space is
    checked first; an existing ``ckpt_dir`` is replaced. Returns ``ckpt_dir``. (Saving before the first
    ``optimizer.step()`` makes DCP initialise the optimizer state with a zero-lr step, which advances Adam's step
    counter: save after stepping.)
    """
    import torch.distributed.checkpoint as dcp  # heavy
    from torch.distributed.checkpoint import FileSystemWriter  # heavy
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict  # heavy

    ckpt_dir = Path(ckpt_dir)
    if not _STEP_RE.match(ckpt_dir.name):
        raise ValueError(f"checkpoint directory {ckpt_dir} must be named step-<N>; use checkpoint_path(output_dir, "
                         "step)")
    rank, world = distributed.get_rank(), distributed.get_world_size()
    trainable_only = _trainable_only(model)
    fill_unstepped_adam_state(optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(trainable_only))
    averages = _averages(ema, shadows)
    trainable = sum(_local_bytes(local_shard(p)) for _, p in named_trainable_parameters(model))
    local = _local_bytes(model_sd) + _local_bytes(optim_sd) + len(averages) * trainable
    needed = int(sum(distributed.all_gather_object(local)) * _SPACE_MARGIN) + (1 << 20)  # (no float64 collective)
    tmp = ckpt_dir.parent / distributed.broadcast_object(f"{ckpt_dir.name}.tmp-{uuid.uuid4().hex[:8]}")
    error: BaseException | None = None
    if rank == 0:
        try:
            tmp.mkdir(parents=True, exist_ok=False)
            free = _free_bytes(tmp)
            if free is not None and free < needed:
                error = _no_space_error(ckpt_dir, needed, free)
        except OSError as err:
            error = err
    _fail_together(error, tmp, ckpt_dir, needed)

    def writer(folder: str) -> FileSystemWriter:
        return FileSystemWriter(str(tmp / folder), sync_files=True)  # every shard fsynced before DCP returns

    try:
        with _single_process_quiet():
            dcp.save({"model": model_sd, "optimizer": optim_sd}, storage_writer=writer("state"))
        del model_sd, optim_sd
        for key, folder, average in averages:
            with average.swap_into(model):
                sd = get_model_state_dict(model, options=_options(True))
                with _single_process_quiet():
                    dcp.save({key: sd}, storage_writer=writer(folder))
                del sd
    except BaseException as err:  # DCP raises CheckpointException (a BaseException) on every rank alike
        if not (_is_no_space(err) or isinstance(err, (OSError, RuntimeError))) and \
                type(err).__name__ != "CheckpointException":
            raise
        error = err
    else:
        trainer_state = {
            "extra": extra,
            "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
            "ema": ema.counters() if ema is not None else None,
            "shadows": {name: sh.counters() for name, sh in (shadows or {}).items()},
        }
        try:
            write_trainer_state(trainer_state, tmp / f"trainer_state_rank{rank}")
        except OSError as err:
            error = err
    _fail_together(error, tmp, ckpt_dir, needed)
    if rank == 0:
        try:
            for folder in ["state", *(f for _, f, _ in averages)]:
                _fsync_dir(tmp / folder)
            _fsync_dir(tmp)
            files = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()}
            meta = {"format_version": FORMAT_VERSION, "world_size": world, "trainable_only": trainable_only,
                    "has_ema": ema is not None, "has_lr_scheduler": lr_scheduler is not None,
                    "shadows": sorted(shadows or {}),
                    "step": extra.get("step") if isinstance(extra, dict) else None,
                    **(manifest or {}), "files": files}
            _write_json(tmp / "meta.json", meta)  # the completion marker: written after everything is on disk
            _fsync_dir(tmp)
        except OSError as err:
            error = err
    _fail_together(error, tmp, ckpt_dir, needed)
    if rank == 0:
        old = None
        if ckpt_dir.exists():  # re-saving a step: the old copy stays complete (as .tmp-old-) until the swap is done
            old = ckpt_dir.parent / f"{ckpt_dir.name}.tmp-old-{uuid.uuid4().hex[:8]}"
            os.replace(ckpt_dir, old)
        os.replace(tmp, ckpt_dir)
        _fsync_dir(ckpt_dir.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    distributed.store_barrier("save_checkpoint")  # rank 0 renamed it (and deleted a re-saved step's old copy)
    return ckpt_dir


def load_checkpoint(
    ckpt_dir: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any = None,
    ema: EMA | None = None,
    shadows: dict[str, EMA] | None = None,
) -> dict:
    """Restore what ``save_checkpoint`` wrote into the (already sharded) model, optimizer, scheduler and EMA.

    A collective. Returns this rank's ``extra`` (rank 0's when the checkpoint came from a smaller world).
    FileNotFoundError when ``ckpt_dir`` is missing or incomplete; ValueError when it is damaged or does not match
    the model (e.g. a LoRA checkpoint into a full fine-tune).
    """
    import torch.distributed.checkpoint as dcp  # heavy
    from torch.distributed.checkpoint.api import CheckpointException  # heavy
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                         set_state_dict)  # heavy

    ckpt_dir = Path(ckpt_dir)
    meta = read_meta(ckpt_dir)
    trainable_only = _trainable_only(model)
    if meta["trainable_only"] and not trainable_only:
        raise ValueError(f"{ckpt_dir} holds only trainable (adapter) weights but the model has no frozen "
                         "parameters; resume with the same LoRA settings the checkpoint was trained with")
    if ema is not None and not meta["has_ema"]:
        raise ValueError(f"{ckpt_dir} has no EMA state; resume without --use_ema or from a run that used it")
    absent = sorted(set(shadows or {}) - set(meta.get("shadows", [])))
    if absent:
        raise ValueError(f"{ckpt_dir} has no saved {', '.join(absent)} weights (the run that wrote it did not keep "
                         "them); resume with that run's flags")

    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(trainable_only))
    state = {"model": model_sd, "optimizer": optim_sd}
    try:
        _dcp_load(state, ckpt_dir / "state")
    except CheckpointException as err:  # (a BaseException) e.g. "Missing key in checkpoint state_dict: ..."
        missing = re.findall(r"Missing key in checkpoint state_dict: (\S+?)\.?$", str(err), re.M)
        raise ValueError(f"{ckpt_dir} does not match this model/optimizer (missing {missing[:3] or str(err)[-300:]}); "
                         "resume with the model, LoRA and optimizer settings of that run") from err
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=_options(trainable_only, strict=not trainable_only))
    del state, model_sd, optim_sd

    rank = distributed.get_rank()
    stem = ckpt_dir / f"trainer_state_rank{rank}"
    if not _trainer_state_exists(stem):
        warnings.warn(f"{stem.name} missing (checkpoint from world size {meta['world_size']}); using rank 0's "
                      "extra state", stacklevel=2)
        stem = ckpt_dir / "trainer_state_rank0"
    trainer_state = read_trainer_state(stem)
    if lr_scheduler is not None and trainer_state["lr_scheduler"] is not None:
        lr_scheduler.load_state_dict(trainer_state["lr_scheduler"])
    for key, folder, average in _averages(ema, shadows):
        with average.swap_into(model):
            sd = get_model_state_dict(model, options=_options(True))
            _dcp_load({key: sd}, ckpt_dir / folder)
            set_model_state_dict(model, sd, options=_options(True, strict=False))
            average.capture()
        average.load_counters(trainer_state["ema"] if key == "ema" else trainer_state["shadows"][key])
    distributed.barrier()
    return trainer_state["extra"]


# ------------------------------------------------------------------------- pickle-free trainer state, safe DCP reads
def _pack(obj: Any, tensors: dict[str, torch.Tensor], where: str = "extra") -> Any:
    """``obj`` as JSON-able data; tensors (and NumPy arrays, as bytes) go to ``tensors`` under generated keys."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = obj.detach().cpu().contiguous().clone()
        return {"__t__": "tensor", "key": key}
    if isinstance(obj, np.ndarray):
        key = f"t{len(tensors)}"
        tensors[key] = torch.frombuffer(bytearray(np.ascontiguousarray(obj).tobytes()), dtype=torch.uint8) \
            if obj.size else torch.zeros(0, dtype=torch.uint8)
        return {"__t__": "ndarray", "key": key, "dtype": obj.dtype.str, "shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, tuple):
        return {"__t__": "tuple", "items": [_pack(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_pack(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and k != "__t__" for k in obj):
            return {k: _pack(v, tensors, f"{where}.{k}") for k, v in obj.items()}
        return {"__t__": "dict", "items": [[_pack(k, tensors, where), _pack(v, tensors, f"{where}[{k!r}]")]
                                           for k, v in obj.items()]}
    raise TypeError(f"checkpoint trainer state: {where} is a {type(obj).__name__}; store dicts, lists, tuples, "
                    "numbers, strings, None, tensors or NumPy arrays")


def _unpack(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of ``_pack``."""
    if isinstance(obj, list):
        return [_unpack(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    kind = obj.get("__t__")
    if kind is None:
        return {k: _unpack(v, tensors) for k, v in obj.items()}
    if kind == "tensor":
        return tensors[obj["key"]]
    if kind == "ndarray":
        raw = tensors[obj["key"]].numpy().tobytes()
        return np.frombuffer(raw, dtype=np.dtype(obj["dtype"])).reshape(obj["shape"]).copy()
    if kind == "tuple":
        return tuple(_unpack(v, tensors) for v in obj["items"])
    if kind == "dict":
        return {_unpack_key(k, tensors): _unpack(v, tensors) for k, v in obj["items"]}
    raise ValueError(f"unknown entry kind {kind!r} in a checkpoint's trainer state")


def _unpack_key(key: Any, tensors: dict[str, torch.Tensor]) -> Any:
    value = _unpack(key, tensors)
    return tuple(value) if isinstance(value, list) else value


def write_trainer_state(state: dict, stem: Path) -> None:
    """Write ``state`` as ``stem.json`` (structure) + ``stem.safetensors`` (its tensors), each fsynced."""
    tensors: dict[str, torch.Tensor] = {}
    packed = _pack(state, tensors, "trainer_state")
    tensor_file = stem.with_name(stem.name + ".safetensors")
    save_file(tensors, str(tensor_file))
    _fsync_file(tensor_file)
    _write_json(stem.with_name(stem.name + ".json"), packed)


def read_trainer_state(stem: Path) -> dict:
    """Read what ``write_trainer_state`` wrote; a format-1 ``stem.pt`` (torch.save) is read with
    ``weights_only=True``, admitting only the NumPy types of a NumPy RNG state."""
    json_file = stem.with_name(stem.name + ".json")
    if json_file.is_file():
        tensors = load_file(str(stem.with_name(stem.name + ".safetensors")))
        return _unpack(json.loads(json_file.read_text()), tensors)
    legacy = stem.with_name(stem.name + ".pt")
    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(str(legacy))
    foreign = [g for g in unsafe if not g.startswith("numpy.")]
    if foreign:
        raise ValueError(f"{legacy} references {foreign[:3]}, which loading it would run; refusing (only NumPy RNG "
                         "state is admitted in a format-1 checkpoint)")
    admitted = [_import_global(g) for g in unsafe]
    if admitted:  # NumPy arrays also build their dtype's class, which the scan above does not list
        admitted += [getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith("DType")]
    with torch.serialization.safe_globals(admitted):
        return torch.load(legacy, map_location="cpu", weights_only=True)


def _import_global(qualified: str) -> Any:
    module, _, name = qualified.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _trainer_state_exists(stem: Path) -> bool:
    return stem.with_name(stem.name + ".json").is_file() or stem.with_name(stem.name + ".pt").is_file()


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only what DCP's ``.metadata`` pickle holds (its metadata classes, torch sizes/dtypes/layouts, paths)."""

    _MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
    _NAMES = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
              ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
              ("pathlib", "PureWindowsPath")}

    def find_class(self, module: str, name: str) -> Any:
        if module in self._MODULES or (module, name) in self._NAMES or (
                module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's .metadata")


def _check_dcp_metadata(folder: Path) -> None:
    """Vet ``folder/.metadata`` before DCP unpickles it (ValueError naming the file when it holds anything else)."""
    path = folder / ".metadata"
    try:
        with open(path, "rb") as f:
            _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is missing: the checkpoint is damaged; resume from an older one") from None
    except Exception as err:  # noqa: BLE001  (any failure to unpickle safely)
        raise ValueError(f"{path} is not a safe DCP metadata file ({type(err).__name__}: {err}); refusing to load "
                         "it: resume from a checkpoint this suite wrote") from err


def _safe_load_planner():
    """DCP's default load planner, but its non-tensor entries are read with ``torch.load(weights_only=True)``."""
    from torch.distributed.checkpoint import DefaultLoadPlanner  # heavy

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            checked = torch.load(value, weights_only=True)  # raises on anything but plain data
            buf = io.BytesIO()
            torch.save(checked, buf)
            buf.seek(0)
            super().load_bytes(read_item, buf)

    return SafeLoadPlanner()


def _dcp_load(state: dict, folder: Path) -> None:
    import torch.distributed.checkpoint as dcp  # heavy

    _check_dcp_metadata(folder)
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(folder), planner=_safe_load_planner())


# DCP warns on every save and load of a run without a process group (one process, no torchrun) that it assumes a
# single process, which is what such a run is: the line landed in the middle of the progress bar of the README's first
# command. Only that message is filtered, only around our own DCP calls.
_SINGLE_PROCESS = (r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming the intent is to "
                   r"(save|load) in a single process")


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Around a DCP save or load: DCP's single-process notice is not shown (every other warning is)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS, category=UserWarning)
        yield


def _averages(ema: EMA | None, shadows: dict[str, EMA] | None) -> list[tuple[str, str, EMA]]:
    """(state key, folder, object) of the EMA (folder ema/) and every named shadow (folder shadow-NAME/)."""
    items = [("ema", "ema", ema)] if ema is not None else []
    return items + [(name, f"shadow-{name}", sh) for name, sh in sorted((shadows or {}).items())]


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


