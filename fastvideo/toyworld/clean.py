"""Cleanliness of a toy-world image: how much it looks like a ground-truth render (flat palette objects with hard
edges on a plain background), whatever the prompt. The ``toyworld`` reward (``verify``) reads only which objects are
there; this score sees what it ignores -- specks below its object size, a tinted or noisy background, blurred or
colour-mixed edges -- so a run that raises ``toyworld`` by making dirtier images shows here (a reward-hacking watch;
the ``toyworld_clean`` reward, meant for ``--eval_reward``). No weights; numpy on the host.

Pixels are RGB 0..255. Objects are ``verify``'s: 8-connected components of ``verify.classify_pixels`` of at least
``verify.min_area`` px; their *region* is them grown by ``EDGE_RING`` px (8-neighbourhood), so that edge pixels belong
to it. Three components, each in [0, 1] (1 = clean), and ``score`` = their mean:

- ``background``: the mean over the pixels outside every object region of ``1 - (d - BACKGROUND_TOLERANCE) /
  BACKGROUND_SCALE`` clipped to [0, 1], with d the RGB distance to ``scenes.BACKGROUND``: 1 for the plain background,
  0.75 for one tinted by 14 units;
- ``stray``: ``1 / (1 + n / (STRAY_HALF_FRAC * H * W))`` with n the pixels outside every object region that are more
  than ``STRAY_DISTANCE`` from the background (specks, blobs below object size, halos past an object's edge, strong
  noise): 1 without any, 0.5 when ``STRAY_HALF_FRAC`` (1%) of the image is stray;
- ``purity``: the share of object-region pixels within ``PURITY_DISTANCE`` of a palette colour (``scenes.COLORS``) or
  of the background: 1 for hard edges, lower for blurred or colour-mixed edges and tinted or noisy objects.

An image without objects (plain background) is clean (every component 1): cleanliness is not prompt following. Images
with non-finite pixels score NaN. Ground-truth renders (``scenes.render_batch``) score exactly 1 (all 2628 prompts
at 32, 48 and 64 px); corruptions that leave ``toyworld``'s strict check at 1 score 0.67-0.94 (specks, a tinted
background, blur, mixed edges, noise: tests/test_toyworld_clean.py); the shipped toy FLUX's samples of held-out
prompts score about 0.52 (background 0.83, stray 0.42, purity 0.32).
"""
from __future__ import annotations

import numpy as np
import torch

from fastvideo.toyworld.scenes import BACKGROUND, COLOR_NAMES, COLORS
from fastvideo.toyworld.verify import _as_batch, _label_components, classify_pixels, min_area

CLEAN_KEYS: tuple[str, ...] = ("score", "background", "stray", "purity")
EDGE_RING = 1  # px an object's region extends past its pixels (its edge)
BACKGROUND_TOLERANCE = 4.0  # RGB distance to the background that costs nothing (8-bit rounding, faint dither)
BACKGROUND_SCALE = 40.0  # RGB distance beyond the tolerance at which a background pixel scores 0
STRAY_DISTANCE = 30.0  # RGB distance to the background beyond which a pixel outside the objects is stray (white: 34.6)
STRAY_HALF_FRAC = 0.01  # share of the image's pixels that, stray, halves the stray score
PURITY_DISTANCE = 30.0  # RGB distance to the nearest palette or background colour within which a pixel is pure

_BACKGROUND = np.array(BACKGROUND, dtype=np.float32)
_PURE = np.array([COLORS[c] for c in COLOR_NAMES] + [BACKGROUND], dtype=np.float32)  # (5, 3)


def _dilate(mask: np.ndarray, steps: int) -> np.ndarray:
    """(B,H,W) bool grown by ``steps`` px in the 8-neighbourhood."""
    H, W = mask.shape[1:]
    for _ in range(steps):
        pad = np.pad(mask, ((0, 0), (1, 1), (1, 1)))
        grown = np.zeros_like(mask)
        for dy in range(3):
            for dx in range(3):
                grown |= pad[:, dy:dy + H, dx:dx + W]
        mask = grown
    return mask


def _clean(x: np.ndarray) -> dict[str, np.ndarray]:
    """(B,H,W,3) finite float 0..255 -> ``{key: (B,) float64}`` for ``CLEAN_KEYS``."""
    B, H, W, _ = x.shape
    labels = _label_components(classify_pixels(x))  # (B,H,W): component root per object-colour pixel, -1 elsewhere
    flat = labels.reshape(-1)
    area = np.bincount(flat[flat >= 0], minlength=flat.size)  # pixels per component, indexed by root
    objects = np.zeros(flat.size, dtype=bool)
    objects[flat >= 0] = area[flat[flat >= 0]] >= min_area(min(H, W))
    region = _dilate(objects.reshape(B, H, W), EDGE_RING)  # (B,H,W)
    outside = ~region

    d_bg = np.sqrt(((x - _BACKGROUND) ** 2).sum(-1))  # (B,H,W)
    fidelity = np.clip(1.0 - (d_bg - BACKGROUND_TOLERANCE) / BACKGROUND_SCALE, 0.0, 1.0)
    n_out = outside.sum((1, 2))
    background = np.where(n_out > 0, (fidelity * outside).sum((1, 2)) / np.maximum(n_out, 1), 1.0)

    stray_px = (outside & (d_bg > STRAY_DISTANCE)).sum((1, 2))
    stray = 1.0 / (1.0 + stray_px / (STRAY_HALF_FRAC * H * W))

    b_idx = np.nonzero(region)[0]  # the image of each region pixel (a small share of all pixels)
    d_pure_sq = ((x[region][:, None, :] - _PURE) ** 2).sum(-1).min(-1)  # (N,): to the nearest pure colour
    n_region = np.bincount(b_idx, minlength=B)
    pure = np.bincount(b_idx, d_pure_sq <= PURITY_DISTANCE ** 2, minlength=B)
    purity = np.where(n_region > 0, pure / np.maximum(n_region, 1), 1.0)

    parts = {"background": background.astype(np.float64), "stray": stray.astype(np.float64),
             "purity": purity.astype(np.float64)}
    return {"score": np.mean(list(parts.values()), axis=0), **parts}


def clean_batch(images: torch.Tensor | np.ndarray) -> dict[str, np.ndarray]:
    """Cleanliness of a batch ((B,3,H,W) float in [0,1] or (B,H,W,3) uint8): ``{key: (B,) float64}`` for
    ``CLEAN_KEYS`` (module docstring); NaN for images with non-finite pixels."""
    x = _as_batch(images)  # (B,H,W,3) 0..255
    finite = np.isfinite(x.reshape(x.shape[0], -1)).all(axis=1)
    if not finite.all():
        x = np.nan_to_num(x, nan=0.0, posinf=255.0, neginf=0.0)
    out = _clean(np.clip(x, 0.0, 255.0, out=x))
    return {key: np.where(finite, value, np.nan) for key, value in out.items()}


def clean_image(image: torch.Tensor | np.ndarray) -> dict[str, float]:
    """Cleanliness of one image ((3,H,W) float in [0,1] or (H,W,3) uint8); keys ``CLEAN_KEYS``."""
    if image.ndim != 3:
        raise ValueError(f"clean_image takes one image, (3, H, W) float or (H, W, 3) uint8; got {tuple(image.shape)}; "
                         "use clean_batch for batches")
    return {key: float(value[0]) for key, value in clean_batch(image).items()}
