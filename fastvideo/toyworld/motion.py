"""The toy world in time: prompts of moving objects, a train / held-out split, a deterministic video renderer and a
verifier that checks every frame and the motion.

Grammar (lower case, single spaces)::

    prompt := group " " motion | single " moving toward " single
    group  := "a" colour shape | ("two" | "three") colour shape "s"      (scenes' groups)
    single := "a" colour shape
    motion := "moving left" | "moving right" | "rising" | "falling"

e.g. "a red circle moving right", "two blue squares falling", "a green triangle moving toward a yellow circle" (the
two objects of a "toward" prompt differ in colour: colour identifies them). A directional group moves as one, every
object by the same displacement; in a "toward" video the second object stays put and the first moves straight at it.

Held out (``is_heldout``): a directional prompt whose object (colour, shape) is one of the 12 of ``HELDOUT_MOTIONS``
paired with that motion (each object has one held-out motion, each motion three held-out objects), and a "toward"
prompt whose two objects form one of the image world's held-out pairs (``scenes.HELDOUT_OBJECT_PAIRS``, either
order). Every object, every motion and every other pairing is in training: a held-out prompt asks for a motion of
a known object never seen together.

Verifier (``score_videos``): the image world's detector (``verify.detect_objects``) on every frame; on each frame
every group must be there in its colour, its shape and its count (``color``, ``shape``, ``count`` = the share of
frames where all groups pass); ``motion`` (0 or 1): a directional group's centroid (the mean of its objects') moves
from the first frame to the last by at least ``min_travel(size)`` px within ``ANGLE_TOLERANCE_DEG`` of the
direction; a "toward" mover moves at least that far, within the tolerance of the direction to where the target was
at the first frame, and ends nearer to the target by at least that much. ``strict`` = every frame right and the
motion right; ``score`` = the mean of the four checks.
"""
from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from fastvideo.seeding import derive_seed
from fastvideo.toyworld import scenes, verify
from fastvideo.toyworld.scenes import COLOR_NAMES, COUNT_WORDS, MARGIN, SHAPES, PlacedObject, format_group

MOTIONS: dict[str, tuple[int, int]] = {"moving left": (-1, 0), "moving right": (1, 0), "rising": (0, -1),
                                       "falling": (0, 1)}
TOWARD = "moving toward"
OBJECTS: tuple[tuple[str, str], ...] = tuple(itertools.product(COLOR_NAMES, SHAPES))  # 12 (colour, shape)
# (object, motion) pairs held out: object i with motion (i mod 4) of MOTIONS' order
HELDOUT_MOTIONS: frozenset[tuple[tuple[str, str], str]] = frozenset(
    (obj, list(MOTIONS)[i % len(MOTIONS)]) for i, obj in enumerate(OBJECTS))
TRAVEL_FRAC = 0.3  # a video's directional travel, first to last frame, as a share of the image side
ANGLE_TOLERANCE_DEG = 30.0
MIN_TRAVEL_FRAC = 0.15  # of the side: half the rendered travel, far above a static object's centroid jitter
SCORE_KEYS: tuple[str, ...] = ("score", "strict", "color", "shape", "count", "motion")
MIN_FRAMES = 2
GRAMMAR = ('"<group> moving left|moving right|rising|falling" or "a <colour> <shape> moving toward a <colour> '
           '<shape>", <group> as the image world\'s ("a red circle", "two blue squares"); e.g. "a green triangle '
           'moving toward a yellow circle"')


@dataclass(frozen=True)
class MotionSpec:
    """What a motion prompt asks for: ``groups`` ((count, colour, shape), ...): one group and a ``MOTIONS`` key, or
    two single objects and ``TOWARD`` (the first moves toward the second)."""

    groups: tuple[tuple[int, str, str], ...]
    motion: str

    def __post_init__(self) -> None:
        groups = tuple(tuple(g) for g in self.groups)
        object.__setattr__(self, "groups", groups)
        for count, color, shape in groups:
            if count not in COUNT_WORDS or color not in COLOR_NAMES or shape not in SHAPES:
                raise ValueError(f"bad group {(count, color, shape)}: counts 1..3, colours {COLOR_NAMES}, shapes "
                                 f"{SHAPES}")
        if self.motion == TOWARD:
            if len(groups) != 2 or any(g[0] != 1 for g in groups) or groups[0][1] == groups[1][1]:
                raise ValueError(f"'{TOWARD}' takes two single objects of different colours, got {groups}")
        elif self.motion not in MOTIONS or len(groups) != 1:
            raise ValueError(f"a motion prompt has one group and a motion of {tuple(MOTIONS)}, got {groups} "
                             f"{self.motion!r}")


def format_motion_prompt(spec: MotionSpec) -> str:
    """The canonical prompt of ``spec`` (the inverse of ``parse_motion_prompt``)."""
    if spec.motion == TOWARD:
        return f"{format_group(*spec.groups[0])} {TOWARD} {format_group(*spec.groups[1])}"
    return f"{format_group(*spec.groups[0])} {spec.motion}"


_GROUP = r"(a|an|one|two|three) (red|green|blue|yellow) (circles?|squares?|triangles?)"
_PROMPT = re.compile(rf"{_GROUP} (?:(moving left|moving right|rising|falling)|{TOWARD} {_GROUP})")


def parse_motion_prompt(text: str) -> MotionSpec:
    """``"two red circles falling"`` -> ``MotionSpec(((2, "red", "circle"),), "falling")``; ValueError naming the
    grammar for anything else (plural agreement included)."""
    match = _PROMPT.fullmatch(" ".join(str(text).lower().split()))
    if match is None:
        raise ValueError(f"not a toy-world motion prompt: {text!r}; the grammar: {GRAMMAR}")
    words = match.groups()

    def group(count_word: str, color: str, shape_word: str) -> tuple[int, str, str]:
        count = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3}[count_word]
        shape = shape_word[:-1] if shape_word.endswith("s") else shape_word
        if (count == 1) == shape_word.endswith("s"):
            raise ValueError(f"{text!r}: '{count_word} {shape_word}' (say 'a {shape}' or 'two {shape}s')")
        return count, color, shape

    if words[3] is not None:
        return MotionSpec((group(*words[:3]),), words[3])
    return MotionSpec((group(*words[:3]), group(*words[4:7])), TOWARD)


def all_motion_prompts() -> tuple[str, ...]:
    """Every prompt of the grammar in a fixed order: 144 directional, then 108 "toward"."""
    directional = [format_motion_prompt(MotionSpec(((n, c, s),), m))
                   for (c, s) in OBJECTS for n in COUNT_WORDS for m in MOTIONS]
    toward = [format_motion_prompt(MotionSpec(((1, c1, s1), (1, c2, s2)), TOWARD))
              for (c1, s1) in OBJECTS for (c2, s2) in OBJECTS if c1 != c2]
    return tuple(directional + toward)


def is_heldout(prompt: str | MotionSpec) -> bool:
    """Whether a prompt belongs to the held-out split (module docstring)."""
    spec = parse_motion_prompt(prompt) if isinstance(prompt, str) else prompt
    if spec.motion == TOWARD:
        return frozenset(g[1:] for g in spec.groups) in scenes.HELDOUT_OBJECT_PAIRS
    return (spec.groups[0][1:], spec.motion) in HELDOUT_MOTIONS


def split_motion_prompts() -> tuple[list[str], list[str]]:
    """(train, held-out) prompts, each in ``all_motion_prompts`` order."""
    prompts = all_motion_prompts()
    return [p for p in prompts if not is_heldout(p)], [p for p in prompts if is_heldout(p)]


def write_motion_prompt_files(out_dir: str | Path) -> dict[str, Path]:
    """``motion_train.txt`` and ``motion_heldout.txt`` (one prompt per line, grammar order) in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, prompts in zip(("motion_train", "motion_heldout"), split_motion_prompts()):
        paths[name] = out / f"{name}.txt"
        paths[name].write_text("\n".join(prompts) + "\n")
    return paths


# ------------------------------------------------------------------------------------------------- rendering
def min_travel(size: int) -> float:
    """The least centroid travel (px, first to last frame) the verifier counts as motion in a ``size`` px video."""
    return MIN_TRAVEL_FRAC * size


def trajectories(spec: MotionSpec | str, size: int = 32, frames: int = 5, seed: int = 0
                 ) -> list[list[PlacedObject]]:
    """Each frame's placed objects (deterministic for (prompt, size, frames, seed)). A directional group's objects
    (one side for all) start where the whole travel (``TRAVEL_FRAC`` of the side) stays inside the frame and move
    together, linearly; a "toward" target stays put and its mover starts at least twice the travel away and moves
    straight at it by the travel (never reaching it)."""
    spec = parse_motion_prompt(spec) if isinstance(spec, str) else spec
    if frames < MIN_FRAMES:
        raise ValueError(f"a motion video needs at least {MIN_FRAMES} frames, got {frames}")
    rng = np.random.default_rng(derive_seed(seed, "toyworld-motion", format_motion_prompt(spec), size, frames))
    lo, hi = scenes.side_range(size)
    side = int(rng.integers(lo, hi + 1))
    travel = TRAVEL_FRAC * size
    inner = size - MARGIN - side  # the largest top-left coordinate
    if spec.motion != TOWARD:
        (count, color, shape), = spec.groups
        dx, dy = MOTIONS[spec.motion]
        t = int(math.ceil(travel))
        lo_par, hi_par = MARGIN + (t if dx + dy < 0 else 0), inner - (t if dx + dy > 0 else 0)  # along the motion
        # across the motion: evenly spaced (a row of movers never overlaps), a single one anywhere
        across = [int(rng.integers(MARGIN, inner + 1))] if count == 1 else \
            [int(round(v)) for v in np.linspace(MARGIN, inner, count)]
        if count > 1 and across[1] - across[0] < side + MARGIN:
            raise ValueError(f"no room for {format_motion_prompt(spec)!r} at {size} px; use a larger --h/--w")
        along = [int(rng.integers(lo_par, hi_par + 1)) for _ in range(count)]
        starts = [(a, c) if dx else (c, a) for a, c in zip(along, across)]  # (x, y) top-left
        return [[PlacedObject(0, color, shape, int(round(x + dx * travel * f / (frames - 1))),
                              int(round(y + dy * travel * f / (frames - 1))), side) for x, y in starts]
                for f in range(frames)]
    (_, c1, s1), (_, c2, s2) = spec.groups
    for _ in range(2000):
        tx, ty = (int(v) for v in rng.integers(MARGIN, inner + 1, size=2))
        mx, my = (int(v) for v in rng.integers(MARGIN, inner + 1, size=2))
        gap = math.hypot(mx - tx, my - ty)
        if gap >= 2 * travel and gap - travel >= side * math.sqrt(2) + MARGIN:
            break
    else:
        raise ValueError(f"no room for {format_motion_prompt(spec)!r} at {size} px; use a larger --h/--w")
    ux, uy = (tx - mx) / gap, (ty - my) / gap
    return [[PlacedObject(0, c1, s1, int(round(mx + ux * travel * f / (frames - 1))),
                          int(round(my + uy * travel * f / (frames - 1))), side),
             PlacedObject(1, c2, s2, tx, ty, side)] for f in range(frames)]


def render_video(spec: MotionSpec | str, size: int = 32, frames: int = 5, seed: int = 0) -> np.ndarray:
    """(frames, size, size, 3) uint8: ``trajectories`` drawn frame by frame (hard edges)."""
    return np.stack([scenes.draw(objects, size) for objects in trajectories(spec, size, frames, seed)])


def render_videos(prompts: Sequence[str], size: int = 32, frames: int = 5, seeds: int | Sequence[int] = 0
                  ) -> torch.Tensor:
    """(B, frames, 3, size, size) float32 in [0, 1], the trainers' video format; one seed per prompt or one int."""
    prompts = list(prompts)
    seeds = [int(seeds)] * len(prompts) if isinstance(seeds, (int, np.integer)) else [int(s) for s in seeds]
    if len(seeds) != len(prompts):
        raise ValueError(f"got {len(prompts)} prompts but {len(seeds)} seeds; pass one seed per prompt or one int")
    videos = [torch.from_numpy(render_video(p, size, frames, s)).permute(0, 3, 1, 2) for p, s in zip(prompts, seeds)]
    return torch.stack(videos).float().div_(255.0) if videos else torch.zeros(0, frames, 3, size, size)


# ------------------------------------------------------------------------------------------------ verifying
def _centroid(objects: list[verify.DetectedObject]) -> np.ndarray | None:
    return np.mean([o.centroid for o in objects], axis=0) if objects else None


def _within(move: np.ndarray, direction: np.ndarray, size: int) -> bool:
    """``move`` is at least ``min_travel`` long and within ``ANGLE_TOLERANCE_DEG`` of ``direction``."""
    length = float(np.hypot(*move))
    if length < min_travel(size):
        return False
    cos = float(move @ direction) / (length * float(np.hypot(*direction)))
    return cos >= math.cos(math.radians(ANGLE_TOLERANCE_DEG))


def score_spec(frames_objects: list[list[verify.DetectedObject]], spec: MotionSpec, size: int) -> dict[str, float]:
    """The checks (``SCORE_KEYS``) of one video's detected objects per frame against its spec."""
    per_frame = {"color": [], "shape": [], "count": []}
    tracks: list[list[np.ndarray | None]] = [[] for _ in spec.groups]
    for objects in frames_objects:
        by_group = [[o for o in objects if o.color == color] for _, color, _ in spec.groups]
        per_frame["color"].append(all(by_group))
        per_frame["shape"].append(all(g and all(o.shape == s for o in g)
                                      for g, (_, _, s) in zip(by_group, spec.groups)))
        per_frame["count"].append(all(len(g) == n for g, (n, _, _) in zip(by_group, spec.groups)))
        for track, group in zip(tracks, by_group):
            track.append(_centroid(group))
    motion = False
    ends = [(track[0], track[-1]) for track in tracks]
    if all(a is not None and b is not None for a, b in ends):
        (start, end) = ends[0]
        if spec.motion == TOWARD:
            target = ends[1][0]
            nearer = np.hypot(*(start - target)) - np.hypot(*(end - ends[1][1]))
            motion = _within(end - start, target - start, size) and nearer >= min_travel(size)
        else:
            motion = _within(end - start, np.array(MOTIONS[spec.motion], dtype=np.float64), size)
    scores = {key: float(np.mean(values)) for key, values in per_frame.items()}
    scores["motion"] = float(motion)
    strict = all(all(values) for values in per_frame.values()) and motion
    return {"score": float(np.mean([scores[k] for k in ("color", "shape", "count", "motion")])),
            "strict": float(strict), **scores}


def score_videos(videos: torch.Tensor, prompts: Sequence[str]) -> dict[str, np.ndarray]:
    """Scores of videos (B, F, 3, H, W) in [0, 1] against their motion prompts: ``{key: (B,) float64}`` for
    ``SCORE_KEYS``; NaN for a video with non-finite pixels. The prompts are parsed (bad ones fail) first."""
    prompts = list(prompts)
    if not torch.is_tensor(videos) or videos.ndim != 5 or videos.shape[2] != 3:
        shape = tuple(videos.shape) if torch.is_tensor(videos) else type(videos).__name__
        raise ValueError(f"motion scores take videos (B, F, 3, H, W) in [0, 1], got {shape}")
    B, F = videos.shape[:2]
    if len(prompts) != B:
        raise ValueError(f"got {B} videos but {len(prompts)} prompts; pass one prompt per video")
    if F < MIN_FRAMES:
        raise ValueError(f"motion needs at least {MIN_FRAMES} frames per video, got {F}")
    specs = [parse_motion_prompt(p) for p in prompts]
    flat = videos.detach().to("cpu", torch.float32).flatten(0, 1)
    finite = torch.isfinite(flat.reshape(B, -1)).all(dim=1).tolist()
    detected = verify.detect_objects(torch.nan_to_num(flat, nan=0.0, posinf=1.0, neginf=0.0).clamp(0, 1))
    out = {key: np.full(B, np.nan) for key in SCORE_KEYS}
    for i, spec in enumerate(specs):
        if finite[i]:
            scores = score_spec(detected[i * F:(i + 1) * F], spec, int(videos.shape[-1]))
            for key in SCORE_KEYS:
                out[key][i] = scores[key]
    return out
