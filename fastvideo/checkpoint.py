"""Atomic, sharded save/resume of the whole training state, and a sharded EMA of the trainable weights.

Layout of one checkpoint (``output_dir/checkpoints/step-N``):

    state/     model + optimizer, torch.distributed.checkpoint (DCP) format: each rank writes its own shards
    ema/       the EMA weights in the same format (only when an EMA is passed)
    shadow-NAME/  other sharded shadows of the trainable weights (e.g. DPO's updated reference), same format
    trainer_state_rank{r}.pt   rank r's ``extra`` (step, sampler position, that rank's RNG states, config...),
                               plus the LR-scheduler state and EMA counters
    meta.json  written last; its presence is what makes the directory a checkpoint

Everything is first written to ``step-N.tmp-<id>`` and renamed to ``step-N`` by rank 0 after a barrier, so a
crash mid-save leaves a ``.tmp-`` directory that ``latest_checkpoint`` ignores (and ``prune_checkpoints`` removes).
Multi-node jobs need ``output_dir`` on a shared filesystem (as DCP does).

Model state: when any parameter is frozen (LoRA: the base is frozen) only the trainable parameters are saved
(``trainable_only`` in meta.json) — the frozen weights are reloaded from the model folder when the trainer
rebuilds the model before ``load_checkpoint``. Otherwise the full model is saved. DCP reshards on load, so a run
may resume with a different world size or FSDP version (per-rank ``extra`` then falls back to rank 0's file).

Resume order in a trainer: build model -> add_lora -> shard_model -> optimizer/scheduler -> EMA -> load_checkpoint.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import uuid
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from fastvideo import distributed
from fastvideo.parallel import named_trainable_parameters, reshard

CHECKPOINTS_SUBDIR = "checkpoints"
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step-(\d+)$")
_TMP_RE = re.compile(r"^step-\d+\.tmp-")


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


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints under ``output_dir/checkpoints``, oldest step first."""
    root = Path(output_dir) / CHECKPOINTS_SUBDIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _is_complete(p)]
    return sorted(found, key=lambda p: int(_STEP_RE.match(p.name).group(1)))


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under ``output_dir/checkpoints``, or None."""
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def prune_checkpoints(output_dir: str | Path, total_limit: int | None) -> list[Path]:
    """Keep the newest ``total_limit`` checkpoints (None or <= 0 keeps all); also drop stale ``.tmp-`` dirs.

    Call after ``save_checkpoint`` returned (on every rank; rank 0 deletes). Returns the removed paths.
    """
    removed: list[Path] = []
    if distributed.is_main_process():
        root = Path(output_dir) / CHECKPOINTS_SUBDIR
        found = list_checkpoints(output_dir)
        doomed = found[:-total_limit] if total_limit and total_limit > 0 else []
        if root.is_dir():
            doomed += [p for p in root.iterdir() if p.is_dir() and _TMP_RE.match(p.name)]
        for path in doomed:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    distributed.barrier()
    return removed


def _trainable_only(model: nn.Module) -> bool:
    return any(not p.requires_grad for p in model.parameters())


def _options(trainable_only: bool, strict: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=trainable_only, strict=strict)


def save_checkpoint(
    ckpt_dir: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any = None,
    extra: dict,
    ema: EMA | None = None,
    shadows: dict[str, EMA] | None = None,
) -> Path:
    """Save model (trainable params if any are frozen), optimizer, scheduler, EMA, named ``shadows`` (EMA objects
    holding other copies of the trainable weights, e.g. a reference snapshot) and this rank's ``extra``.

    A collective: call on every rank with the same ``ckpt_dir`` (use ``checkpoint_path(output_dir, step)``) and
    each rank's own ``extra`` (e.g. ``{"step": s, "sampler": ..., "rng": seeding.rng_state(), "config": ...}``;
    anything ``torch.save`` can pickle). Atomic (see module docstring); an existing ``ckpt_dir`` is replaced.
    Returns ``ckpt_dir``. (Saving before the first ``optimizer.step()`` makes DCP initialise the optimizer state
    with a zero-lr step, which advances Adam's step counter: save after stepping.)
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    ckpt_dir = Path(ckpt_dir)
    if not _STEP_RE.match(ckpt_dir.name):
        raise ValueError(f"checkpoint directory {ckpt_dir} must be named step-<N>; use checkpoint_path(output_dir, "
                         "step)")
    rank, world = distributed.get_rank(), distributed.get_world_size()
    tmp = ckpt_dir.parent / distributed.broadcast_object(f"{ckpt_dir.name}.tmp-{uuid.uuid4().hex[:8]}")
    if rank == 0:
        tmp.mkdir(parents=True, exist_ok=False)
    distributed.barrier()

    trainable_only = _trainable_only(model)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(trainable_only))
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp / "state"))
    del model_sd, optim_sd
    for key, folder, average in _averages(ema, shadows):
        with average.swap_into(model):
            sd = get_model_state_dict(model, options=_options(True))
            dcp.save({key: sd}, checkpoint_id=str(tmp / folder))
            del sd

    trainer_state = {
        "extra": extra,
        "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
        "ema": ema.counters() if ema is not None else None,
        "shadows": {name: sh.counters() for name, sh in (shadows or {}).items()},
    }
    torch.save(trainer_state, tmp / f"trainer_state_rank{rank}.pt")
    distributed.barrier()
    if rank == 0:
        meta = {"format_version": FORMAT_VERSION, "world_size": world, "trainable_only": trainable_only,
                "has_ema": ema is not None, "has_lr_scheduler": lr_scheduler is not None,
                "shadows": sorted(shadows or {}),
                "step": extra.get("step") if isinstance(extra, dict) else None}
        _write_json(tmp / "meta.json", meta)
        old = None
        if ckpt_dir.exists():
            old = ckpt_dir.parent / f"{ckpt_dir.name}.tmp-old-{uuid.uuid4().hex[:8]}"
            os.replace(ckpt_dir, old)
        os.replace(tmp, ckpt_dir)
        _fsync_dir(ckpt_dir.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    distributed.barrier()
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
    FileNotFoundError when ``ckpt_dir`` is missing or incomplete; ValueError when the checkpoint does not match
    the model (e.g. a LoRA checkpoint into a full fine-tune).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                         set_state_dict)

    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / "meta.json").is_file():
        parent = ckpt_dir.parent.parent if ckpt_dir.parent.name == CHECKPOINTS_SUBDIR else ckpt_dir
        raise FileNotFoundError(
            f"no complete checkpoint at {ckpt_dir} (missing meta.json: never written or interrupted mid-save); "
            f"pass a step-N directory from {parent / CHECKPOINTS_SUBDIR} or use latest_checkpoint(output_dir)")
    meta = json.loads((ckpt_dir / "meta.json").read_text())
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
        dcp.load(state, checkpoint_id=str(ckpt_dir / "state"))
    except CheckpointException as err:  # (a BaseException) e.g. "Missing key in checkpoint state_dict: ..."
        missing = re.findall(r"Missing key in checkpoint state_dict: (\S+?)\.?$", str(err), re.M)
        raise ValueError(f"{ckpt_dir} does not match this model/optimizer (missing {missing[:3] or str(err)[-300:]}); "
                         "resume with the model, LoRA and optimizer settings of that run") from err
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=_options(trainable_only, strict=not trainable_only))
    del state, model_sd, optim_sd

    rank = distributed.get_rank()
    state_file = ckpt_dir / f"trainer_state_rank{rank}.pt"
    if not state_file.is_file():
        warnings.warn(f"{state_file.name} missing (checkpoint from world size {meta['world_size']}); using rank 0's "
                      "extra state", stacklevel=2)
        state_file = ckpt_dir / "trainer_state_rank0.pt"
    trainer_state = torch.load(state_file, map_location="cpu", weights_only=False)
    if lr_scheduler is not None and trainer_state["lr_scheduler"] is not None:
        lr_scheduler.load_state_dict(trainer_state["lr_scheduler"])
    for key, folder, average in _averages(ema, shadows):
        with average.swap_into(model):
            sd = get_model_state_dict(model, options=_options(True))
            dcp.load({key: sd}, checkpoint_id=str(ckpt_dir / folder))
            set_model_state_dict(model, sd, options=_options(True, strict=False))
            average.capture()
        average.load_counters(trainer_state["ema"] if key == "ema" else trainer_state["shadows"][key])
    distributed.barrier()
    return trainer_state["extra"]


def _averages(ema: EMA | None, shadows: dict[str, EMA] | None) -> list[tuple[str, str, EMA]]:
    """(state key, folder, object) of the EMA (folder ema/) and every named shadow (folder shadow-NAME/)."""
    items = [("ema", "ema", ema)] if ema is not None else []
    return items + [(name, f"shadow-{name}", sh) for name, sh in sorted((shadows or {}).items())]


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
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


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (an alias, under no_grad), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


class EMA:
    """Exponential moving average of the trainable parameters, kept sharded like the model.

    Holds a copy of this rank's shards of the trainable parameters (FSDP2 DTensor shards, FSDP1 flat-param
    views, or whole tensors for a plain module) — no gather, ever, during training. Create it after
    ``shard_model`` (and after loading the initial weights); call ``update()`` after each ``optimizer.step()``.

        ema = EMA(model, decay=0.995)       # warm-up: the decay of update t is min(0.995, (1 + t) / (10 + t))
        ...optimizer.step(); ema.update()
        with ema.swap_into(model):        # evaluate / export the EMA weights
            sd = full_state_dict(model)

    ``state_dict()`` / ``load_state_dict()`` hold local shards, so they round-trip only with the same sharding;
    ``save_checkpoint(..., ema=ema)`` stores the EMA resharding-safely (DCP) and is what trainers use.
    """

    def __init__(self, model: nn.Module, decay: float, warmup: bool = True,
                 shadow: list[torch.Tensor] | None = None) -> None:
        """``shadow``: tensors, one per trainable parameter's local shard, to hold the average in place of fresh
        clones (aliases of another sharded copy, e.g. DiffusionNFT's old policy); default: clones of the shards."""
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"--ema_decay must be in [0, 1), got {decay}")
        named = named_trainable_parameters(model)
        if not named:
            raise ValueError("EMA: the model has no trainable parameters")
        self.decay = float(decay)
        self.warmup = bool(warmup)
        self.names = [n for n, _ in named]
        self._params = [p for _, p in named]
        reshard(model)
        with torch.no_grad():
            self.shadow = [_local(p).detach().clone() for p in self._params] if shadow is None else list(shadow)
        self.num_updates = 0
        self._locals()  # the shadow must match the local shards (checks the shapes)

    def _locals(self) -> list[torch.Tensor]:
        locals_ = [_local(p).detach() for p in self._params]
        for name, loc, sh in zip(self.names, locals_, self.shadow):
            if loc.shape != sh.shape:
                raise RuntimeError(f"EMA: parameter {name} is not in its sharded state ({tuple(loc.shape)} vs "
                                   f"{tuple(sh.shape)}); call update()/swap_into() after optimizer.step(), not "
                                   "between forward and backward")
        return locals_

    def current_decay(self) -> float:
        """The decay the next ``update()`` uses: with warm-up ``min(decay, (1 + t) / (10 + t))`` for the t-th update
        (t = 0, 1, ...; Flow-GRPO's and diffusers' EMAModel schedule), so early updates follow the trained weights
        instead of keeping ~decay^t of the base; without warm-up the constant ``decay``."""
        t = self.num_updates
        return min(self.decay, (1 + t) / (10 + t)) if self.warmup else self.decay

    @torch.no_grad()
    def update(self, decay: float | None = None) -> None:
        """``shadow = d * shadow + (1 - d) * param`` for every local shard (one fused foreach op), with
        ``d = current_decay()`` unless ``decay`` is given."""
        d = self.current_decay() if decay is None else float(decay)
        torch._foreach_lerp_(self.shadow, self._locals(), 1.0 - d)
        self.num_updates += 1

    @torch.no_grad()
    def capture(self) -> None:
        """Set the EMA to the model's current trainable weights."""
        torch._foreach_copy_(self.shadow, self._locals())

    @contextmanager
    def swap_into(self, model: nn.Module) -> Iterator[nn.Module]:
        """Temporarily load the EMA weights into ``model`` (the model the EMA was built on); restored on exit."""
        reshard(model)
        ids = {id(p) for _, p in named_trainable_parameters(model)}
        if any(id(p) not in ids for p in self._params):
            raise ValueError("EMA.swap_into: this EMA was built on a different model (or before shard_model)")
        with torch.no_grad():
            locals_ = self._locals()
            backup = [t.clone() for t in locals_]
            torch._foreach_copy_(locals_, self.shadow)
        try:
            yield model
        finally:
            reshard(model)
            with torch.no_grad():
                torch._foreach_copy_(self._locals(), backup)

    def counters(self) -> dict:
        """The EMA's scalars (decay, number of updates), stored by save_checkpoint next to the DCP weights."""
        return {"decay": self.decay, "num_updates": self.num_updates}

    def load_counters(self, counters: dict | None) -> None:
        """Restore ``counters()`` (the decay stays the one this EMA was built with)."""
        if counters:
            self.num_updates = int(counters["num_updates"])

    def state_dict(self) -> dict:
        """``{"decay", "num_updates", "shadow": {name: local shard}}`` (valid for the same sharding only)."""
        return {**self.counters(), "shadow": dict(zip(self.names, self.shadow))}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Inverse of ``state_dict`` (same model, same sharding)."""
        missing = set(self.names) - set(state["shadow"])
        if missing:
            raise ValueError(f"EMA state is missing {len(missing)} parameters, e.g. {sorted(missing)[:3]}")
        for name, sh in zip(self.names, self.shadow):
            sh.copy_(_local(state["shadow"][name]))
        self.load_counters(state)
