"""JPEG (in)compressibility (DDPO / Flow-GRPO): the size of the image saved as JPEG at quality 95.

``jpeg_compressibility`` = -size_kB / 500 (smaller files score higher), ``jpeg_incompressibility`` =
+size_kB / 500, with kB = 1000 bytes as in the references. No weights. The batch is converted to
uint8 in one pass on its device; the per-image PIL encode (inherent) runs on a small thread pool
for images of 512x512 and more (Pillow releases the GIL while encoding; smaller ones encode faster
than a thread hop). Samples with NaN/inf pixels score NaN.
"""
from __future__ import annotations

import io
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np
import torch

QUALITY = 95
KB = 1000.0
SCALE = 500.0
_PARALLEL_MIN_PIXELS = 512 * 512  # below this a thread hop costs more than the encode itself


def _encoded_size(image_hwc: np.ndarray) -> int:
    """Bytes of one (H,W,3) uint8 image saved as JPEG at quality 95."""
    from PIL import Image  # heavy

    buffer = io.BytesIO()
    Image.fromarray(image_hwc).save(buffer, format="JPEG", quality=QUALITY)
    return buffer.tell()


class JpegSizeScorer:
    """``sign * size_kB / 500`` of each image; sign -1 rewards compressibility, +1 incompressibility."""

    def __init__(self, sign: float, max_workers: int | None = None):
        self.sign = float(sign)
        self.max_workers = max_workers or min(4, os.cpu_count() or 1)
        self._pool: ThreadPoolExecutor | None = None

    def sizes_bytes(self, images: torch.Tensor) -> torch.Tensor:
        """(B,3,H,W) in [0,1] -> (B,) float64 JPEG sizes in bytes (NaN where the image has non-finite pixels)."""
        images = images.detach()
        finite = torch.isfinite(images.flatten(1).sum(dim=1, dtype=torch.float32)).cpu()  # NaN/inf propagate
        # One fused uint8 conversion of the whole batch on its device, then one device->host copy.
        pixels = images.float().mul(255.0).round_().clamp_(0, 255).to(torch.uint8)
        arrays = pixels.permute(0, 2, 3, 1).contiguous().cpu().numpy()  # (B,H,W,3)
        if len(arrays) > 1 and self.max_workers > 1 and arrays.shape[1] * arrays.shape[2] >= _PARALLEL_MIN_PIXELS:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_workers, thread_name_prefix="jpeg-reward")
            sizes = list(self._pool.map(_encoded_size, arrays))
        else:
            sizes = [_encoded_size(a) for a in arrays]
        out = torch.tensor(sizes, dtype=torch.float64)
        return torch.where(finite, out, torch.full_like(out, float("nan")))

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """(B,3,H,W) in [0,1] -> (B,) float32 on the CPU; prompts are ignored."""
        return (self.sign * self.sizes_bytes(images) / KB / SCALE).float()


def build_compressibility(device: torch.device, **_: object) -> JpegSizeScorer:
    """Registry factory for ``jpeg_compressibility`` (-size_kB/500)."""
    return JpegSizeScorer(-1.0)


def build_incompressibility(device: torch.device, **_: object) -> JpegSizeScorer:
    """Registry factory for ``jpeg_incompressibility`` (+size_kB/500)."""
    return JpegSizeScorer(+1.0)
