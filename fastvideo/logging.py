"""Rank-0 run outputs: metrics JSONL (+ TensorBoard / W&B), progress bar, sample grids, peak memory."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable

import torch

from fastvideo import devices


def plain_value(value: Any) -> Any:
    """A metric as JSON takes it: tensors become floats (one element) or lists, other values pass through."""
    if isinstance(value, torch.Tensor):
        value = value.detach().float().cpu()
        return value.item() if value.numel() == 1 else value.tolist()
    return value


def _step_of(line: str) -> int | None:
    """The step of a metrics.jsonl line, or None for a blank or torn one (a process killed mid-write)."""
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return None


def truncate_jsonl(path: str | Path, last_step: int) -> None:
    """Keep the complete lines of a per-step JSONL file whose step is <= ``last_step`` (a resumed run drops what the
    interrupted one logged after its checkpoint, and a line torn by a kill)."""
    path = Path(path)
    kept = [line for line in path.read_text(errors="replace").splitlines()
            if _step_of(line) is not None and _step_of(line) <= last_step]
    path.write_text("".join(line + "\n" for line in kept))


class MetricsLogger:
    """Appends one JSON line per step to ``OUT/metrics.jsonl`` (and mirrors to TB / W&B) on rank 0.

    On resume, lines for steps after the resumed step are dropped first, so the file always reads as one
    uninterrupted run; a fresh run moves an existing log to ``metrics.previous.jsonl``.
    """

    def __init__(self, output_dir: str | Path, *, enabled: bool, sinks: Iterable[str] = ("jsonl",),
                 config: dict | None = None, wandb_project: str = "flux", resume_step: int | None = None):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self._tb = self._wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            truncate_jsonl(self.path, resume_step)
        elif resume_step is None and self.path.exists():
            # a fresh run in a folder with a log but no checkpoint: keep the old log beside the new one
            self.path.replace(self.path.with_name("metrics.previous.jsonl"))
        sinks = set(sinks)
        if "tensorboard" in sinks:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # pragma: no cover - optional extra
                raise ValueError("--log_to tensorboard needs `pip install -e .[tensorboard]`") from e
            self._tb = SummaryWriter(str(Path(output_dir) / "tensorboard"))
        if "wandb" in sinks:
            try:
                import wandb
            except ImportError as e:  # pragma: no cover - optional extra
                raise ValueError("--log_to wandb needs `pip install -e .[wandb]`") from e
            self._wandb = wandb.init(project=wandb_project, config=config or {}, dir=str(output_dir))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Write ``metrics`` for ``step`` (tensors become floats/lists)."""
        if not self.enabled:
            return
        row = {"step": step, **{k: plain_value(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row, allow_nan=True) + "\n")
        scalars = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: str | Path) -> list[dict]:
    """All rows of a metrics.jsonl file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def save_image_grid(images: torch.Tensor, path: str | Path, nrow: int | None = None) -> Path:
    """Save images (B,3,H,W) in [0,1] as one PNG grid."""
    from torchvision.utils import save_image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    nrow = nrow or max(1, int(math.ceil(math.sqrt(images.shape[0]))))
    save_image(images.detach().float().cpu().clamp(0, 1), str(path), nrow=nrow, padding=2)
    return path


def peak_memory_gb(device: torch.device | str) -> float:
    """Peak memory of this process: accelerator allocator peak, or CPU max RSS (``devices.max_memory_allocated_gb``)."""
    return devices.max_memory_allocated_gb(device)


def current_memory_gb(device: torch.device | str, import_model_libraries: bool = False) -> float:
    """Memory in use now: accelerator allocator, or CPU resident set size. A trainer records it before loading any
    model (``memory_baseline_gb``), so that on a CPU job ``peak_memory_gb - memory_baseline_gb`` is what the run
    itself allocated (the ``--dry_run`` plan's quantity). ``import_model_libraries`` first imports diffusers and
    peft, whose code alone is ~0.25 GB of RSS, so that it lands in the baseline."""
    if import_model_libraries:
        from diffusers import AutoencoderKL, FluxTransformer2DModel  # noqa: F401
        import peft  # noqa: F401
    return devices.memory_allocated_gb(device)


def progress_bar(total: int, initial: int, enabled: bool, desc: str = "train"):
    """A tqdm bar on rank 0 (a no-op object elsewhere)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, desc=desc, dynamic_ncols=True)
