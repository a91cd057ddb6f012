"""Video files: a decoded video (F, 3, H, W) in [0, 1] as an H.264 MP4 that any player opens (``write_mp4``), read
back as frames (``read_mp4``), through PyAV (the ``video`` extra: ``pip install -e .[video]``)."""
from __future__ import annotations

from pathlib import Path

import torch

CRF = 18  # x264's constant rate factor: visually lossless for previews (lower = larger files)


def _av():
    try:
        import av  # optional: the video extra
    except ImportError as err:
        raise ValueError("writing MP4 videos needs PyAV: pip install -e .[video] (or pip install av)") from err
    return av


def write_mp4(video: torch.Tensor, path: str | Path, fps: int) -> Path:
    """Write ``video`` (F, 3, H, W) in [0, 1] as an H.264 MP4 (yuv420p: H and W must be even) at ``fps`` frames
    per second; frames are rounded to 8 bits as PNGs are. Returns the path."""
    av = _av()
    if video.ndim != 4 or video.shape[1] != 3:
        raise ValueError(f"write_mp4 takes a video (F, 3, H, W), got {tuple(video.shape)}")
    height, width = int(video.shape[2]), int(video.shape[3])
    if height % 2 or width % 2:
        raise ValueError(f"H.264 (yuv420p) needs an even height and width, got {height}x{width}")
    if int(fps) < 1:
        raise ValueError(f"fps must be >= 1, got {fps}")
    frames = video.detach().float().cpu().clamp(0, 1).mul(255).add(0.5).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=int(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": str(CRF)}
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())  # flush the encoder
    return path


def read_mp4(path: str | Path) -> tuple[torch.Tensor, float]:
    """``(frames (F, 3, H, W) float32 in [0, 1], frames per second)`` of a video file, decoded with PyAV."""
    av = _av()
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        fps = float(stream.average_rate or stream.base_rate or 0)
        frames = [torch.from_numpy(f.to_ndarray(format="rgb24")) for f in container.decode(stream)]
    if not frames:
        raise ValueError(f"{path}: no video frames decoded")
    return torch.stack(frames).permute(0, 3, 1, 2).float() / 255, fps
