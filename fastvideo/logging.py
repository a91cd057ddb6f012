"""Rank-0 run outputs: metrics JSONL (+ TensorBoard / W&B), progress bar, sample grids, peak memory."""
from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
from tqdm.auto import tqdm

from fastvideo import devices
from fastvideo.options import opt


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
    """Appends one JSON line per step to ``OUT/metrics.jsonl`` (and mirrors scalars and image grids to TensorBoard /
    W&B) on rank 0; the optional sinks are imported only when asked for, on rank 0 only.

    On resume, lines for steps after the resumed step are dropped first, so the file always reads as one
    uninterrupted run; a fresh run moves an existing log to ``metrics.previous.jsonl``. W&B: the run id is kept in
    ``OUT/wandb_run_id`` and a resumed run continues that W&B run (``resume="allow"``) instead of starting a new one.
    """

    def __init__(self, output_dir: str | Path, *, enabled: bool, sinks: Iterable[str] = ("jsonl",),
                 config: dict | None = None, wandb_project: str = "flux", resume_step: int | None = None,
                 wandb_mode: str | None = None):
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
            self._wandb = _init_wandb(Path(output_dir), wandb_project, config or {}, resume_step is not None,
                                      wandb_mode)

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

    def log_image(self, tag: str, grid: torch.Tensor, step: int) -> None:
        """Mirror an image grid (3, H, W) in [0, 1] (``save_image_grid``'s result) to TensorBoard / W&B; the PNG on
        disk is written by ``save_image_grid`` either way."""
        if not self.enabled or (self._tb is None and self._wandb is None):
            return
        if self._tb is not None:
            self._tb.add_image(tag, grid.clamp(0, 1), step)
        if self._wandb is not None:
            import wandb  # optional

            array = grid.clamp(0, 1).mul(255).add(0.5).to(torch.uint8).permute(1, 2, 0).numpy()
            self._wandb.log({tag: wandb.Image(array)}, step=step)

    def log_video(self, tag: str, videos: torch.Tensor, step: int, fps: int) -> None:
        """Mirror videos (B, F, 3, H, W) in [0, 1] to TensorBoard / W&B as one tiled video (``video_grid``):
        TensorBoard gets an animated GIF image summary (what its own ``add_video`` writes, without moviepy), W&B an
        MP4 written under ``OUT/samples/`` (``wandb.Video`` of a file needs no encoder of its own). The frame-strip
        PNG on disk is ``save_image_grid``'s either way."""
        if not self.enabled or (self._tb is None and self._wandb is None):
            return
        frames = video_grid(videos)  # (F, 3, H', W')
        if self._tb is not None:
            from tensorboard.compat.proto.summary_pb2 import Summary  # optional: the tensorboard extra

            image = Summary.Image(height=frames.shape[-2], width=frames.shape[-1], colorspace=3,
                                  encoded_image_string=gif_bytes(frames, fps))
            self._tb._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), step)
        if self._wandb is not None:
            import wandb  # optional

            from fastvideo.video import write_mp4

            path = self.path.parent / "samples" / f"{tag.replace('/', '-')}-step-{step:06d}.mp4"
            path.parent.mkdir(parents=True, exist_ok=True)
            write_mp4(frames, path, fps)
            self._wandb.log({tag: wandb.Video(str(path), format="mp4")}, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _init_wandb(output_dir: Path, project: str, config: dict, resuming: bool, mode: str | None) -> Any:
    """Start (or, when ``resuming`` and OUT/wandb_run_id exists, continue) this run's W&B run, logging under OUT."""
    try:
        import wandb
    except ImportError as e:  # pragma: no cover - optional extra
        raise ValueError("--log_to wandb needs `pip install -e .[wandb]`") from e
    id_file = output_dir / "wandb_run_id"
    run_id = id_file.read_text().strip() if resuming and id_file.is_file() else None
    if run_id is None:
        run_id = secrets.token_hex(4)  # W&B run ids are short [a-z0-9] strings
        id_file.write_text(run_id + "\n")
    kwargs = {"mode": mode} if mode else {}  # unset: W&B reads WANDB_MODE itself (offline clusters set it there)
    return wandb.init(project=project, config=config, dir=str(output_dir), id=run_id, resume="allow",
                      name=output_dir.resolve().name, **kwargs)


def read_metrics(path: str | Path) -> list[dict]:
    """All rows of a metrics.jsonl file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


STRIP_FRAMES = 8  # frames a video shows in an image grid (evenly spaced, first and last included)


def frame_strips(videos: torch.Tensor, frames: int = STRIP_FRAMES) -> torch.Tensor:
    """Videos (B, F, 3, H, W) -> (B * K, 3, H, W): K = min(``frames``, F) evenly spaced frames of each video, in
    order (a grid with K per row shows one video per row)."""
    count = videos.shape[1]
    index = torch.linspace(0, count - 1, min(frames, count)).round().long()
    return videos[:, index].flatten(0, 1)


def save_image_grid(images: torch.Tensor, path: str | Path, nrow: int | None = None) -> torch.Tensor:
    """Save images (B,3,H,W) in [0,1] as one PNG grid (``nrow`` images per row; default: a square), or videos
    (B,F,3,H,W) as one frame strip per row (``frame_strips``); returns the grid (3, H', W') for
    ``MetricsLogger.log_image``."""
    from torchvision.utils import make_grid, save_image  # heavy

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if images.ndim == 5:
        grid = strip_grid(images)
    else:
        nrow = nrow or max(1, int(math.ceil(math.sqrt(images.shape[0]))))
        grid = make_grid(images.detach().float().cpu().clamp(0, 1), nrow=nrow, padding=2)
    save_image(grid, str(path))
    return grid


def strip_grid(videos: torch.Tensor) -> torch.Tensor:
    """Videos (B, F, 3, H, W) in [0, 1] as one image (3, H', W'): each video's ``frame_strips`` as a row (padding
    2), the layout of training grids and of ``sample.py``'s strip PNGs."""
    from torchvision.utils import make_grid  # heavy

    return make_grid(frame_strips(videos).detach().float().cpu().clamp(0, 1), nrow=min(STRIP_FRAMES, videos.shape[1]),
                     padding=2)


def video_grid(videos: torch.Tensor, nrow: int | None = None) -> torch.Tensor:
    """Videos (B, F, 3, H, W) in [0, 1] -> one video (F, 3, H', W'): frame f of every video tiled as ``make_grid``
    tiles images (``nrow`` per row, default ceil(sqrt(B)))."""
    from torchvision.utils import make_grid  # heavy

    if videos.ndim != 5 or videos.shape[2] != 3:
        raise ValueError(f"video_grid takes videos (B, F, 3, H, W), got {tuple(videos.shape)}")
    nrow = nrow or max(1, math.ceil(math.sqrt(videos.shape[0])))
    return torch.stack([make_grid(videos[:, f].float().clamp(0, 1), nrow=nrow, padding=2, pad_value=1.0)
                        for f in range(videos.shape[1])])


def gif_bytes(frames: torch.Tensor, fps: int) -> bytes:
    """Frames (F, 3, H, W) in [0, 1] as an animated GIF (looping, 1/fps s per frame), PIL-encoded."""
    import io

    from PIL import Image

    arrays = frames.clamp(0, 1).mul(255).add(0.5).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    pictures = [Image.fromarray(a) for a in arrays]
    buffer = io.BytesIO()
    pictures[0].save(buffer, format="GIF", save_all=True, append_images=pictures[1:], loop=0,
                     duration=max(1, round(1000 / max(1, fps))))
    return buffer.getvalue()


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
    return tqdm(total=total, initial=initial, disable=not enabled, desc=desc, dynamic_ncols=True)


@dataclass
class LoggingOptions:
    sample_every: int = opt(50, "save a grid of rank 0's samples every N training steps (0 = never)")
    log_to: tuple[str, ...] = opt(("jsonl",), "metric sinks: jsonl (always) tensorboard wandb", nargs="+",
                            choices=("jsonl", "tensorboard", "wandb"))
    wandb_project: str = opt("flux-grpo", "W&B project when --log_to wandb")
    wandb_mode: str | None = opt(None, "W&B mode: online | offline (logs under OUTPUT_DIR/wandb; `wandb sync` "
                                       "uploads them) | disabled (default: the WANDB_MODE variable, else online)",
                                 choices=("online", "offline", "disabled"))
    progress_bar: bool = opt(True, "show a tqdm progress bar on rank 0 (--no-progress_bar to hide)")
    peak_tflops: float = opt(0.0, "peak dense TFLOP/s per device that the logged mfu divides by; bf16 datasheet "
                                  "values: H100 SXM / H200 / H800 989, A100 / A800 312, Ascend 910B ~313 (by SKU). "
                                  "0 = auto: that table by device name in a bf16 run, else a measured large-matmul "
                                  "peak in the compute dtype (always on a CPU)", type=float)
