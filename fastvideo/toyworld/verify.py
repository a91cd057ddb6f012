"""GenEval-style verification of a toy-world image against its prompt, by pixel analysis.

Steps (batched in numpy over the whole batch, then a short python loop per image over its few objects):
1. classify every pixel (RGB 0..255) by the background->colour segment that fits it best: colour c when the pixel is
   at least half c (alpha >= 0.5 along the segment from ``BACKGROUND`` to ``COLORS[c]``) and within
   ``MAX_COLOR_DISTANCE`` of the segment; everything else (background, dark, grey, two-colour blends) is ignored.
   Half coverage is where a blurred edge crosses the sharp one, so blurred shapes keep their outline;
2. 8-connected components per colour (min-label propagation with pointer jumping); components smaller than
   ``MIN_AREA_FRAC`` of the smallest ground-truth object (a triangle of side size/5) are specks and dropped;
3. each component's shape from its bounding box: fill = area / bbox area, top = share of its area in the upper half
   of the bbox, aspect = bbox width / height. "other" if aspect is outside ``ASPECT_RANGE``, fill < ``MIN_FILL`` or
   top > ``SYMMETRIC_MAX_TOP``; else triangle if top < ``TRIANGLE_MAX_TOP``; else square if fill >= ``SQUARE_MIN_FILL``;
   else circle;
4. per prompt group: colour present (>= 1 component of that colour), shape (all of them have the prompt's shape),
   count (exactly that many); position: every group-1 centroid on the relation's side of every group-2 centroid.

Thresholds sit between the feature ranges measured on ground-truth renders of all 2628 prompts (one seed each) at
32, 48 and 64 px, sharp and after a Gaussian blur of sigma 0.7-1.0 px + noise of std 0.02-0.04 (min-max over all):

    ========  ============  ============  ======================================
    shape     fill          top           notes
    ========  ============  ============  ======================================
    square    0.918 - 1.0   0.479 - 0.521 blur rounds corners (32 px, sigma 1.0)
    circle    0.714 - 0.817 0.486 - 0.529 pixel circles of side 7-8 fill 0.76-0.81
    triangle  0.502 - 0.840 0.252 - 0.405 blur removes the apex: fill rises
    ========  ============  ============  ======================================

With these, strict accuracy on ground truth is 1.0 at 32/48/64 px, sharp and blurred (sigma <= 1.0); at sigma 1.3 it
is 0.9992 at 64 px, 0.9996 at 48 px but 0.75 at 32 px (7-8 px shapes blur into each other's feature ranges).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from fastvideo.toyworld.scenes import BACKGROUND, COLOR_NAMES, COLORS, MIN_SIDE_FRAC, SceneSpec, parse_prompt

MAX_COLOR_DISTANCE = 60.0  # RGB 0..255, from the background->colour segment
MIN_AREA_FRAC = 0.35  # of the smallest ground-truth object's area (side_min^2 / 2): 28.7 px at 64 px, 7.2 px at 32 px
TRIANGLE_MAX_TOP = 0.42  # upright triangles put ~1/4 of their area in the bbox's upper half, circles/squares 1/2
SYMMETRIC_MAX_TOP = 0.57  # above this (e.g. an upside-down triangle) the blob is no shape of the world
SQUARE_MIN_FILL = 0.85  # between circles (<= 0.817) and squares (>= 0.918, blurred corners)
MIN_FILL = 0.4  # sparser blobs (rings, strokes, scattered pixels) are no shape of the world
ASPECT_RANGE = (0.6, 1.67)
SCORE_KEYS: tuple[str, ...] = ("score", "strict", "color", "shape", "count", "position")

_BACKGROUND = np.array(BACKGROUND, dtype=np.float32)
_DIRECTIONS = np.array([COLORS[c] for c in COLOR_NAMES], dtype=np.float32) - _BACKGROUND  # (4, 3)
_DIRECTION_SQ = (_DIRECTIONS ** 2).sum(-1)  # (4,)
_NEIGHBOURS_8 = ((0, 1), (1, 0), (1, 1), (1, -1))  # each paired with its opposite below


@dataclass(frozen=True)
class DetectedObject:
    """One connected component of a prototype colour, with the features that decide its shape."""

    color: str
    shape: str  # "circle" | "square" | "triangle" | "other"
    area: int
    centroid: tuple[float, float]  # (x, y) in pixel coordinates (pixel centres at +0.5)
    bbox: tuple[int, int, int, int]  # (x0, y0, x1, y1), inclusive
    fill: float
    top: float
    aspect: float


def classify_shape(fill: float, top: float, aspect: float) -> str:
    """Shape from bounding-box fill ratio, upper-half share and aspect (thresholds in the module docstring)."""
    if not ASPECT_RANGE[0] <= aspect <= ASPECT_RANGE[1] or fill < MIN_FILL or top > SYMMETRIC_MAX_TOP:
        return "other"
    if top < TRIANGLE_MAX_TOP:
        return "triangle"
    return "square" if fill >= SQUARE_MIN_FILL else "circle"


def min_area(size: int) -> float:
    """Smallest component area (px) counted as an object in a ``size`` px image."""
    side = size * MIN_SIDE_FRAC
    return MIN_AREA_FRAC * side * side / 2


def _as_batch(images: torch.Tensor | np.ndarray) -> np.ndarray:
    """(B,3,H,W) / (3,H,W) float in [0,1] or (H,W,3) / (B,H,W,3) uint8 -> (B,H,W,3) float32 numpy in 0..255."""
    if isinstance(images, np.ndarray):
        if images.dtype != np.uint8 or images.shape[-1] != 3 or images.ndim not in (3, 4):
            raise ValueError(f"numpy images must be (H, W, 3) or (B, H, W, 3) uint8, got {images.shape} {images.dtype}")
        x = images.astype(np.float32)
        return x[None] if x.ndim == 3 else x
    if not torch.is_tensor(images) or images.ndim not in (3, 4) or images.shape[-3] != 3:
        shape = tuple(images.shape) if torch.is_tensor(images) else type(images).__name__
        raise ValueError(f"images must be (B, 3, H, W) or (3, H, W) float in [0, 1] (or uint8 HxWx3 numpy), "
                         f"got {shape}")
    x = images.detach().to("cpu", torch.float32)
    x = (x[None] if x.ndim == 3 else x).numpy()
    return np.ascontiguousarray(x.transpose(0, 2, 3, 1)) * np.float32(255.0)


def _label_components(classes: np.ndarray) -> np.ndarray:
    """(B,H,W) int classes (<= 0: not an object) -> (B,H,W) int labels: for object pixels, the flat index of the
    smallest pixel of their 8-connected same-class component; -1 elsewhere."""
    B, H, W = classes.shape
    fg = classes > 0
    big = B * H * W
    dtype = np.int32 if big < 2**31 - 1 else np.int64
    labels = np.where(fg, np.arange(big, dtype=dtype).reshape(B, H, W), dtype(big))
    # for each offset: pixel and its neighbour at that offset are objects of the same class
    pad_cls = np.pad(classes, ((0, 0), (1, 1), (1, 1)))
    offsets = [o for dy, dx in _NEIGHBOURS_8 for o in ((dy, dx), (-dy, -dx))]
    same = [fg & (pad_cls[:, 1 + dy:1 + dy + H, 1 + dx:1 + dx + W] == classes) for dy, dx in offsets]
    while True:
        pad_lab = np.pad(labels, ((0, 0), (1, 1), (1, 1)), constant_values=big)
        new = labels.copy()
        for (dy, dx), ok in zip(offsets, same):
            np.minimum(new, np.where(ok, pad_lab[:, 1 + dy:1 + dy + H, 1 + dx:1 + dx + W], dtype(big)), out=new)
        flat = np.append(new.reshape(-1), dtype(big))
        for _ in range(4):  # pointer jumping: follow each label to its own label
            flat = flat[flat]
        new = flat[:-1].reshape(B, H, W)
        if np.array_equal(new, labels):
            break
        labels = new
    return np.where(fg, labels, -1)


def detect_objects(images: torch.Tensor | np.ndarray) -> list[list[DetectedObject]]:
    """Objects of the 4 prototype colours in each image (see the module docstring), in raster order of first pixel."""
    return _detect(_as_batch(images))


def classify_pixels(x: np.ndarray) -> np.ndarray:
    """(..., 3) float RGB 0..255 -> (...) int class: 1..4 = ``COLOR_NAMES[class - 1]``, 0 = background or other.

    A pixel belongs to colour c when it is a blend of the background and c with at least half c (alpha >= 0.5 on the
    background->c segment) and lies within ``MAX_COLOR_DISTANCE`` of that segment; the best-fitting segment wins.
    Thresholding at half coverage keeps a blurred shape's outline where the sharp edge was (a fixed distance to the
    prototype would erode blurred shapes), and dark, grey or two-colour pixels fit no segment and are ignored.
    """
    v = np.asarray(x, dtype=np.float32) - _BACKGROUND  # (..., 3)
    along = sum(v[..., k, None] * _DIRECTIONS[:, k] for k in range(3))  # (..., 4) projections on the directions
    alpha = np.clip(along / _DIRECTION_SQ, 0.0, 1.0)
    resid_sq = (v * v).sum(-1, keepdims=True) - 2 * alpha * along + alpha * alpha * _DIRECTION_SQ
    best = resid_sq.argmin(-1)
    resid_sq = np.take_along_axis(resid_sq, best[..., None], -1)[..., 0]
    alpha = np.take_along_axis(alpha, best[..., None], -1)[..., 0]
    return np.where((alpha >= 0.5) & (resid_sq <= MAX_COLOR_DISTANCE ** 2), best + 1, 0)


def _detect(x: np.ndarray) -> list[list[DetectedObject]]:
    """(B,H,W,3) float 0..255 -> detected objects per image."""
    B, H, W, _ = x.shape
    classes = classify_pixels(x)  # (B,H,W)
    labels = _label_components(classes)
    b_idx, py, px = np.nonzero(labels >= 0)  # object pixels in raster order
    roots, comp = np.unique(labels[b_idx, py, px], return_inverse=True)  # comp: component index per object pixel
    n = roots.size
    out: list[list[DetectedObject]] = [[] for _ in range(B)]
    if n == 0:
        return out
    area = np.bincount(comp, minlength=n).astype(np.float64)
    cx = np.bincount(comp, px + 0.5, minlength=n) / area
    cy = np.bincount(comp, py + 0.5, minlength=n) / area
    order = np.argsort(comp, kind="stable")
    starts = np.concatenate([[0], np.cumsum(area, dtype=np.int64)[:-1]])
    x0, x1 = np.minimum.reduceat(px[order], starts), np.maximum.reduceat(px[order], starts)
    y0, y1 = np.minimum.reduceat(py[order], starts), np.maximum.reduceat(py[order], starts)
    mid = ((y0 + y1 + 1) / 2)[comp]  # bbox centre row (continuous coordinates) of each pixel's component
    centre = py + 0.5
    top = np.bincount(comp, np.where(centre < mid, 1.0, np.where(centre == mid, 0.5, 0.0)), minlength=n) / area
    width, height = x1 - x0 + 1, y1 - y0 + 1
    fill = area / (width * height)
    image_of = (roots // (H * W)).tolist()
    color_of = classes.reshape(-1)[roots].tolist()
    threshold = min_area(min(H, W))
    rows = zip(image_of, color_of, area.tolist(), cx.tolist(), cy.tolist(), x0.tolist(), y0.tolist(), x1.tolist(),
               y1.tolist(), fill.tolist(), top.tolist(), (width / height).tolist())
    for b, c, a, ccx, ccy, bx0, by0, bx1, by1, f, t, asp in rows:
        if a < threshold:
            continue
        out[b].append(DetectedObject(COLOR_NAMES[c - 1], classify_shape(f, t, asp), int(a), (ccx, ccy),
                                     (int(bx0), int(by0), int(bx1), int(by1)), f, t, asp))
    return out


def _relation_holds(objs1: list[DetectedObject], objs2: list[DetectedObject], relation: str) -> bool:
    if not objs1 or not objs2:
        return False
    axis = 0 if relation in ("left of", "right of") else 1
    a = [o.centroid[axis] for o in objs1]
    b = [o.centroid[axis] for o in objs2]
    return max(a) < min(b) if relation in ("left of", "above") else min(a) > max(b)


def score_objects(objects: list[DetectedObject], spec: SceneSpec) -> dict[str, float]:
    """GenEval-style scores of detected objects against a scene spec (keys ``SCORE_KEYS``). Objects of colours the
    prompt does not mention are ignored, as GenEval ignores unasked-for classes."""
    by_group = [[o for o in objects if o.color == color] for _, color, _ in spec.groups]
    color = [len(objs) > 0 for objs in by_group]
    shape = [len(objs) > 0 and all(o.shape == s for o in objs) for objs, (_, _, s) in zip(by_group, spec.groups)]
    count = [len(objs) == c for objs, (c, _, _) in zip(by_group, spec.groups)]
    position = True if spec.relation is None else _relation_holds(by_group[0], by_group[1], spec.relation)
    scores = {"color": float(np.mean(color)), "shape": float(np.mean(shape)), "count": float(np.mean(count)),
              "position": float(position)}
    strict = all(color) and all(shape) and all(count) and position
    return {"score": float(np.mean(list(scores.values()))), "strict": float(strict), **scores}


def _detect_for(images: torch.Tensor | np.ndarray, prompts: Sequence[str] | str
                ) -> tuple[list[list[DetectedObject]], list[SceneSpec], np.ndarray]:
    """(detected objects, parsed prompts, finite (B,) bool) of a batch, one prompt per image; the prompts are parsed
    (bad ones fail) before any pixel work, and non-finite pixels are detected as clamped values."""
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    x = _as_batch(images)  # (B,H,W,3) 0..255
    n = x.shape[0]
    if n != len(prompts):
        raise ValueError(f"got {n} images but {len(prompts)} prompts; pass one prompt per image")
    specs = [parse_prompt(p) for p in prompts]
    finite = np.isfinite(x.reshape(n, -1)).all(axis=1)
    return _detect(np.nan_to_num(x, nan=0.0, posinf=255.0, neginf=0.0)), specs, finite


def score_batch(images: torch.Tensor | np.ndarray, prompts: Sequence[str]) -> dict[str, np.ndarray]:
    """Scores of a batch: ``{key: (B,) float64}`` for ``SCORE_KEYS``; NaN for images with non-finite pixels."""
    detected, specs, finite = _detect_for(images, prompts)
    n = len(specs)
    out = {key: np.empty(n, dtype=np.float64) for key in SCORE_KEYS}
    for i, (objects, spec) in enumerate(zip(detected, specs)):
        scores = score_objects(objects, spec)
        for key in SCORE_KEYS:
            out[key][i] = scores[key] if finite[i] else np.nan
    return out


def score_image(image: torch.Tensor | np.ndarray, prompt: str) -> dict[str, float]:
    """Scores of one image ((3,H,W) float in [0,1] or (H,W,3) uint8) against its prompt; keys ``SCORE_KEYS``:
    color / shape / count = fraction of the prompt's groups right on that check, position = relation holds (1.0
    without a relation), strict = all fully right (GenEval's per-prompt correctness), score = mean of the four."""
    if (isinstance(image, np.ndarray) and image.ndim != 3) or (torch.is_tensor(image) and image.ndim != 3):
        raise ValueError(f"score_image takes one image, (3, H, W) float or (H, W, 3) uint8; got {image.shape}; "
                         f"use score_batch for batches")
    return {key: float(value[0]) for key, value in score_batch(image, [prompt]).items()}


# A wrong image that is exactly right for another prompt, in the order tried: the two groups' colours exchanged (a
# binding error), their shapes exchanged, their counts exchanged, the relation reversed; anything else is "other".
FAILURE_MODES: tuple[str, ...] = ("right", "colour swap", "shape swap", "count swap", "relation flipped", "other")
_OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}


def _near_misses(spec: SceneSpec) -> list[tuple[str, SceneSpec]]:
    if spec.relation is None:
        return []
    (n1, c1, s1), (n2, c2, s2) = spec.groups
    alternatives = [("colour swap", ((n1, c2, s1), (n2, c1, s2)), spec.relation),
                    ("shape swap", ((n1, c1, s2), (n2, c2, s1)), spec.relation),
                    ("count swap", ((n2, c1, s1), (n1, c2, s2)), spec.relation),
                    ("relation flipped", spec.groups, _OPPOSITE[spec.relation])]
    return [(mode, other) for mode, groups, relation in alternatives
            if (other := SceneSpec(groups, relation)) != spec]


def failure_modes(images: torch.Tensor | np.ndarray, prompts: Sequence[str]) -> list[str]:
    """Per image, one of ``FAILURE_MODES``: "right" (strict), the first near miss whose prompt the image satisfies
    exactly (e.g. "colour swap": the scene of the prompt with the two groups' colours exchanged), else "other". Shows
    what RL fixes: malformed scenes ("other") or a wrong binding of known objects. (Two groups of one shape and count:
    their colour swap is the reversed relation's picture, named "colour swap".)"""
    detected, specs, _ = _detect_for(images, prompts)
    modes = []
    for objects, spec in zip(detected, specs):
        if score_objects(objects, spec)["strict"]:
            modes.append("right")
            continue
        modes.append(next((mode for mode, other in _near_misses(spec) if score_objects(objects, other)["strict"]),
                          "other"))
    return modes
