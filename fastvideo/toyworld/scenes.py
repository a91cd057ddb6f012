"""Toy-world scenes: a prompt grammar, a train / held-out split and a deterministic renderer.

A scene is one or two groups of identical flat objects on a plain background, e.g. "two red circles" or
"two red circles left of a blue square". Everything the verifier needs to know about the world (colour
prototypes, shapes, object sizes) is a module-level constant here, so the generator and the reward agree.

Grammar (lower case, single spaces)::

    prompt   := group | group " " relation " " group
    group    := "a" colour shape | ("two" | "three") colour shape "s"      ("an"/"one" are accepted for "a")
    colour   := red | green | blue | yellow
    shape    := circle | square | triangle
    relation := "left of" | "right of" | "above" | "below"

The two groups of a relational prompt have different colours (the colour identifies the group in the image)
and a scene holds at most 4 objects. A relation means EVERY object of group 1 lies on that side of EVERY
object of group 2, measured between pixel centroids.
"""
from __future__ import annotations

import functools
import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from fastvideo.seeding import derive_seed

BACKGROUND: tuple[int, int, int] = (235, 235, 235)
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 200, 30),
}
COLOR_NAMES: tuple[str, ...] = tuple(COLORS)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
PLURALS: dict[str, str] = {shape: shape + "s" for shape in SHAPES}
COUNT_WORDS: dict[int, str] = {1: "a", 2: "two", 3: "three"}
_PARSE_COUNTS: dict[str, int] = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3}
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
MAX_OBJECTS = 4
LAYOUT_STYLES: tuple[str, ...] = ("random", "tidy")  # see layout()
# Held out: two-group prompts whose two objects (colour, shape) form one of these 14 pairs (of the 54 pairs of
# objects of different colours: the first 14 of random.Random(0).shuffle of them). Every object, every object with
# every count, every relation and every other pair of objects appears in training, so a held-out prompt asks for a
# combination of known objects never seen together (as GenEval's two-object and position prompts do). The earlier
# split held out 3 colour-shape pairs themselves: a 0.59M-parameter model drew those at chance shape accuracy, so no
# RL on training prompts could move held-out accuracy (docs/toy-world.md).
HELDOUT_OBJECT_PAIRS: frozenset[frozenset[tuple[str, str]]] = frozenset(frozenset(pair) for pair in (
    (("blue", "triangle"), ("green", "circle")), (("blue", "circle"), ("red", "square")),
    (("blue", "square"), ("green", "triangle")), (("green", "triangle"), ("yellow", "square")),
    (("blue", "circle"), ("green", "square")), (("red", "circle"), ("yellow", "square")),
    (("blue", "triangle"), ("red", "circle")), (("green", "square"), ("yellow", "triangle")),
    (("green", "square"), ("red", "circle")), (("blue", "triangle"), ("yellow", "circle")),
    (("blue", "triangle"), ("green", "square")), (("green", "circle"), ("red", "circle")),
    (("blue", "square"), ("red", "circle")), (("green", "triangle"), ("yellow", "circle"))))

# Object side (bounding-box width = height) lies in [size * MIN_SIDE_FRAC, size * MAX_SIDE_FRAC], rounded inwards.
MIN_SIDE_FRAC = 1 / 5
MAX_SIDE_FRAC = 1 / 4
MARGIN = 2  # px of background between any two objects' bounding boxes and between an object and the border
MIN_IMAGE_SIZE = 32
MAX_IMAGE_SIZE = 64
_LAYOUT_BATCH = 2048  # candidate layouts drawn at once
_LAYOUT_ROUNDS = 50  # batches tried before giving up

GRAMMAR = ('"<group>" or "<group> <relation> <group>", where <group> is "a <colour> <shape>" or '
           '"two|three <colour> <shape>s", <colour> in {red, green, blue, yellow}, <shape> in {circle, square, '
           'triangle} and <relation> in {left of, right of, above, below}; '
           'e.g. "two red circles left of a blue square"')


@dataclass(frozen=True)
class SceneSpec:
    """What a prompt asks for: ``groups`` = ((count, colour, shape), ...) (1 or 2) and the relation between them."""

    groups: tuple[tuple[int, str, str], ...]
    relation: str | None = None

    def __post_init__(self) -> None:
        groups = tuple(tuple(g) for g in self.groups)
        object.__setattr__(self, "groups", groups)
        if len(groups) not in (1, 2) or (len(groups) == 2) != (self.relation is not None):
            raise ValueError(f"a scene has one group, or two groups and a relation; got {len(groups)} group(s) "
                             f"and relation {self.relation!r}")
        for count, color, shape in groups:
            if count not in COUNT_WORDS or color not in COLORS or shape not in SHAPES:
                raise ValueError(f"bad group {(count, color, shape)}: counts are 1..3, colours {COLOR_NAMES}, "
                                 f"shapes {SHAPES}")
        if self.relation is not None and self.relation not in RELATIONS:
            raise ValueError(f"unknown relation {self.relation!r}; use one of {RELATIONS}")
        if len(groups) == 2 and groups[0][1] == groups[1][1]:
            raise ValueError(f"the two groups must differ in colour (colour identifies the group); got {groups}")
        if self.num_objects > MAX_OBJECTS:
            raise ValueError(f"a scene holds at most {MAX_OBJECTS} objects; {groups} asks for {self.num_objects}")

    @property
    def num_objects(self) -> int:
        """Total objects in the scene."""
        return sum(count for count, _, _ in self.groups)


@dataclass(frozen=True)
class PlacedObject:
    """One drawn object: its group index, colour, shape and bounding box (top-left ``x``, ``y``; ``side`` px)."""

    group: int
    color: str
    shape: str
    x: int
    y: int
    side: int

    @property
    def centroid(self) -> tuple[float, float]:
        """(x, y) centroid of the filled shape in pixel coordinates (a triangle's lies 2/3 down from its apex)."""
        cy = self.y + (2 * self.side / 3 if self.shape == "triangle" else self.side / 2)
        return self.x + self.side / 2, cy


# ----------------------------------------------------------------------------------------------- grammar
def format_group(count: int, color: str, shape: str) -> str:
    """``(2, "red", "circle")`` -> ``"two red circles"``."""
    return f"{COUNT_WORDS[count]} {color} {shape if count == 1 else PLURALS[shape]}"


def format_prompt(spec: SceneSpec) -> str:
    """The canonical prompt of ``spec`` (the inverse of ``parse_prompt``)."""
    parts = [format_group(*spec.groups[0])]
    if spec.relation is not None:
        parts += [spec.relation, format_group(*spec.groups[1])]
    return " ".join(parts)


_GROUP_RE = r"(a|an|one|two|three) (red|green|blue|yellow) (circles?|squares?|triangles?)"
_PROMPT_RE = re.compile(rf"{_GROUP_RE}(?: (left of|right of|above|below) {_GROUP_RE})?")


def parse_prompt(text: str) -> SceneSpec:
    """Parse a toy-world prompt (case and extra spaces/final period ignored) into a SceneSpec; ValueError if invalid."""
    if not isinstance(text, str):
        raise ValueError(f"toy-world prompts are strings, got {type(text).__name__}; grammar: {GRAMMAR}")
    return _parse(text)


@functools.lru_cache(maxsize=8192)
def _parse(text: str) -> SceneSpec:
    norm = " ".join(text.lower().strip().rstrip(".").split())
    match = _PROMPT_RE.fullmatch(norm)
    if match is None:
        raise ValueError(f"cannot parse toy-world prompt {text!r}; grammar: {GRAMMAR}")
    words = match.groups()
    groups = []
    for count_word, color, shape_word in (words[0:3], words[4:7]):
        if count_word is None:
            continue
        count, plural = _PARSE_COUNTS[count_word], shape_word.endswith("s")
        if plural != (count > 1):
            raise ValueError(f"number disagreement in {text!r}: write 'a {color} {shape_word.rstrip('s')}' for one "
                             f"object and 'two/three {color} {shape_word.rstrip('s')}s' for more; grammar: {GRAMMAR}")
        groups.append((count, color, shape_word.rstrip("s")))
    return SceneSpec(tuple(groups), words[3])


@functools.lru_cache(maxsize=1)
def all_prompts() -> tuple[str, ...]:
    """Every valid prompt of the world, sorted (36 single-group + 2592 relational = 2628)."""
    groups = list(itertools.product(COUNT_WORDS, COLOR_NAMES, SHAPES))
    specs = [SceneSpec((g,)) for g in groups]
    for g1, g2, rel in itertools.product(groups, groups, RELATIONS):
        if g1[1] != g2[1] and g1[0] + g2[0] <= MAX_OBJECTS:
            specs.append(SceneSpec((g1, g2), rel))
    return tuple(sorted(format_prompt(s) for s in specs))


def is_heldout(prompt: str | SceneSpec) -> bool:
    """Whether the prompt's two objects are a pair of ``HELDOUT_OBJECT_PAIRS`` (single-group prompts never are)."""
    spec = parse_prompt(prompt) if isinstance(prompt, str) else prompt
    objects = frozenset((color, shape) for _, color, shape in spec.groups)
    return len(spec.groups) == 2 and objects in HELDOUT_OBJECT_PAIRS


def split_prompts(seed: int = 0) -> tuple[list[str], list[str]]:
    """(train, held-out) prompt lists, each sorted: held-out = prompts whose objects are a ``HELDOUT_OBJECT_PAIRS``
    pair.

    The split is by combination, not at random, so ``seed`` does not change it (kept for a future random split).
    """
    del seed
    train, heldout = [], []
    for prompt in all_prompts():
        (heldout if is_heldout(prompt) else train).append(prompt)
    return train, heldout


def write_prompt_files(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write ``train.txt`` and ``heldout.txt`` (one prompt a line) to ``out_dir``, each in a seeded random order so
    that the first N lines are a uniform sample (``--eval_max_prompts N`` evaluates on them)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, prompts in zip(("train", "heldout"), split_prompts()):
        g = torch.Generator().manual_seed(derive_seed(seed, "toyworld-prompt-order", name))
        order = torch.randperm(len(prompts), generator=g).tolist()
        path = out / f"{name}.txt"
        path.write_text("".join(prompts[i] + "\n" for i in order))
        paths[name] = path
    return paths


# ----------------------------------------------------------------------------------------------- layout + drawing
def side_range(size: int) -> tuple[int, int]:
    """Inclusive (min, max) object side in px for an image of ``size`` px."""
    _check_size(size)
    return int(np.ceil(size * MIN_SIDE_FRAC)), int(np.floor(size * MAX_SIDE_FRAC))


def relation_margin(size: int) -> float:
    """Minimum centroid gap (px) the generator leaves along a relation's axis, so blur cannot flip it."""
    return max(2.0, size / 16)


def _check_size(size: int) -> None:
    if not isinstance(size, (int, np.integer)) or not MIN_IMAGE_SIZE <= size <= MAX_IMAGE_SIZE:
        raise ValueError(f"toy-world image size must be an integer in [{MIN_IMAGE_SIZE}, {MAX_IMAGE_SIZE}] px, "
                         f"got {size!r}")


def _relation_holds(c1: np.ndarray, c2: np.ndarray, relation: str, gap: float) -> np.ndarray:
    """(N, n1, 2) and (N, n2, 2) centroids -> (N,) whether every group-1 object is ``relation`` every group-2 one."""
    axis = 0 if relation in ("left of", "right of") else 1
    a, b = c1[..., axis], c2[..., axis]
    if relation in ("left of", "above"):  # smaller coordinate
        return a.max(axis=1) + gap <= b.min(axis=1)
    return a.min(axis=1) >= b.max(axis=1) + gap


def layout(spec: SceneSpec | str, size: int = 64, seed: int = 0, style: str = "random") -> list[PlacedObject]:
    """A valid layout of ``spec`` (deterministic for (prompt, size, seed, style)): objects inside the image with
    ``MARGIN`` px to the border and between bounding boxes, sides in ``side_range(size)``, and the relation held
    by centroids with at least ``relation_margin(size)`` px to spare. ``style``: ``random`` (any valid placement,
    uniform sides) or ``tidy`` (``tidy_layout``). ValueError if no layout is found."""
    spec = parse_prompt(spec) if isinstance(spec, str) else spec
    _check_size(size)
    if style not in LAYOUT_STYLES:
        raise ValueError(f"unknown layout style {style!r}; use one of {LAYOUT_STYLES}")
    if style == "tidy":
        return tidy_layout(spec, size, seed)
    lo, hi = side_range(size)
    kinds = [(gi, color, shape) for gi, (count, color, shape) in enumerate(spec.groups) for _ in range(count)]
    n = len(kinds)
    is_triangle = np.array([shape == "triangle" for _, _, shape in kinds])
    in_group1 = np.array([gi == 0 for gi, _, _ in kinds])
    rng = np.random.default_rng(derive_seed(seed, "toyworld-layout", format_prompt(spec), size))
    for _ in range(_LAYOUT_ROUNDS):
        sides = rng.integers(lo, hi + 1, size=(_LAYOUT_BATCH, n))
        span = size - 2 * MARGIN - sides  # top-left positions in [MARGIN, MARGIN + span]
        xs = MARGIN + np.floor(rng.random((_LAYOUT_BATCH, n)) * (span + 1)).astype(np.int64)
        ys = MARGIN + np.floor(rng.random((_LAYOUT_BATCH, n)) * (span + 1)).astype(np.int64)
        hits = np.flatnonzero(_placements_ok(xs, ys, sides, is_triangle, in_group1, spec.relation, size))
        if hits.size:
            k = hits[0]
            return [PlacedObject(gi, color, shape, int(xs[k, i]), int(ys[k, i]), int(sides[k, i]))
                    for i, (gi, color, shape) in enumerate(kinds)]
    raise ValueError(f"no valid layout for {format_prompt(spec)!r} at {size} px after "
                     f"{_LAYOUT_ROUNDS * _LAYOUT_BATCH} tries; use a larger image size")


def _placements_ok(xs: np.ndarray, ys: np.ndarray, sides: np.ndarray, is_triangle: np.ndarray, in_group1: np.ndarray,
                   relation: str | None, size: int) -> np.ndarray:
    """(N,) whether each of N candidate placements (top-left ``xs``, ``ys`` and ``sides``, each (N, n); objects inside
    the border by construction) keeps every two bounding boxes ``MARGIN`` px apart on some axis and holds the relation
    by centroids with ``relation_margin(size)`` to spare: the rules of ``layout``, for both styles."""
    ok = np.ones(len(xs), dtype=bool)
    for i, j in itertools.combinations(range(xs.shape[1]), 2):
        apart_x = (xs[:, i] + sides[:, i] + MARGIN <= xs[:, j]) | (xs[:, j] + sides[:, j] + MARGIN <= xs[:, i])
        apart_y = (ys[:, i] + sides[:, i] + MARGIN <= ys[:, j]) | (ys[:, j] + sides[:, j] + MARGIN <= ys[:, i])
        ok &= apart_x | apart_y
    if relation is not None:
        cx = xs + sides / 2
        cy = ys + np.where(is_triangle, 2 * sides / 3, sides / 2)
        cent = np.stack([cx, cy], axis=-1)  # (N, n, 2)
        ok &= _relation_holds(cent[:, in_group1], cent[:, ~in_group1], relation, relation_margin(size))
    return ok


def tidy_layout(spec: SceneSpec | str, size: int = 64, seed: int = 0) -> list[PlacedObject]:
    """A canonical layout with a little jitter: one side for all objects (the middle of ``side_range``); a relation
    gives each group its half of the image (group 1 on the relation's side); a group's objects sit evenly spaced
    along its region's longer axis (a row for one group or above/below, a column for left/right), each moved by up
    to ``size // 32`` px per axis (seeded). The pretraining data's low-entropy layouts (``PretrainConfig.layout``)."""
    spec = parse_prompt(spec) if isinstance(spec, str) else spec
    lo, hi = side_range(size)
    side = lo + (hi - lo) // 2
    half = size / 2
    if spec.relation is None:
        regions = [(0.0, 0.0, float(size), float(size))]
    else:
        first = {"left of": (0.0, 0.0, half, size), "right of": (half, 0.0, half, size),
                 "above": (0.0, 0.0, size, half), "below": (0.0, half, size, half)}[spec.relation]
        other = {"left of": (half, 0.0, half, size), "right of": (0.0, 0.0, half, size),
                 "above": (0.0, half, size, half), "below": (0.0, 0.0, size, half)}[spec.relation]
        regions = [tuple(float(v) for v in first), tuple(float(v) for v in other)]
    rng = np.random.default_rng(derive_seed(seed, "toyworld-tidy-layout", format_prompt(spec), size))
    jitter = max(1, size // 32)
    centres = []
    for gi, ((count, color, shape), (x0, y0, w, h)) in enumerate(zip(spec.groups, regions)):
        for k in range(count):
            along = (k + 0.5) / count
            cx, cy = (x0 + along * w, y0 + h / 2) if w >= h else (x0 + w / 2, y0 + along * h)
            centres.append((gi, color, shape, cx, cy))
    moves = rng.integers(-jitter, jitter + 1, size=(len(centres), 2))
    for scale in (1, 0):  # jittered; if that breaks a rule (the smallest images), the unjittered layout
        objects = [PlacedObject(gi, color, shape,
                                int(np.clip(round(cx - side / 2) + scale * dx, MARGIN, size - MARGIN - side)),
                                int(np.clip(round(cy - side / 2) + scale * dy, MARGIN, size - MARGIN - side)), side)
                   for (gi, color, shape, cx, cy), (dx, dy) in zip(centres, moves)]
        xs, ys = (np.array([[getattr(o, a) for o in objects]]) for a in ("x", "y"))  # clipped inside the border
        if _placements_ok(xs, ys, np.full_like(xs, side), np.array([o.shape == "triangle" for o in objects]),
                          np.array([o.group == 0 for o in objects]), spec.relation, size)[0]:
            return objects
    raise ValueError(f"no tidy layout for {format_prompt(spec)!r} at {size} px; use a larger image size")


def shape_mask(shape: str, side: int) -> np.ndarray:
    """(side, side) bool mask of a filled shape in its bounding box (pixel centres inside the shape)."""
    c = (np.arange(side) + 0.5)  # pixel centres
    yy, xx = np.meshgrid(c, c, indexing="ij")
    if shape == "square":
        return np.ones((side, side), dtype=bool)
    if shape == "circle":
        r = side / 2
        return (xx - r) ** 2 + (yy - r) ** 2 <= r * r
    if shape == "triangle":  # upright isosceles: apex at the top centre, base along the bottom edge
        return np.abs(xx - side / 2) <= yy / 2
    raise ValueError(f"unknown shape {shape!r}; use one of {SHAPES}")


def draw(objects: Sequence[PlacedObject], size: int = 64) -> np.ndarray:
    """Draw placed objects on the background: (size, size, 3) uint8, hard edges."""
    image = np.empty((size, size, 3), dtype=np.uint8)
    image[:] = BACKGROUND
    for obj in objects:
        mask = shape_mask(obj.shape, obj.side)
        image[obj.y:obj.y + obj.side, obj.x:obj.x + obj.side][mask] = COLORS[obj.color]
    return image


def render(spec: SceneSpec | str, size: int = 64, seed: int = 0, style: str = "random") -> np.ndarray:
    """A (size, size, 3) uint8 image of ``spec`` (or a prompt) with a valid layout of ``style``, deterministic per
    seed."""
    return draw(layout(spec, size, seed, style), size)


def render_prompt(text: str, size: int = 64, seed: int = 0, style: str = "random") -> np.ndarray:
    """``render(parse_prompt(text), size, seed, style)``."""
    return render(parse_prompt(text), size, seed, style)


def to_tensor(image: np.ndarray) -> torch.Tensor:
    """(H, W, 3) uint8 -> (3, H, W) float32 in [0, 1], the trainers' image format."""
    return torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1).float().div_(255.0)


def render_batch(prompts: Sequence[str], size: int = 64, seeds: int | Sequence[int] = 0,
                 style: str = "random") -> torch.Tensor:
    """(B, 3, size, size) float32 in [0, 1]; ``seeds`` is one seed per prompt, or one int used for all; ``style``:
    the layout (``layout``)."""
    prompts = list(prompts)
    seeds = [int(seeds)] * len(prompts) if isinstance(seeds, (int, np.integer)) else [int(s) for s in seeds]
    if len(seeds) != len(prompts):
        raise ValueError(f"got {len(prompts)} prompts but {len(seeds)} seeds; pass one seed per prompt or a single int")
    _check_size(size)
    if not prompts:
        return torch.zeros(0, 3, size, size)
    return torch.stack([to_tensor(render_prompt(p, size, s, style)) for p, s in zip(prompts, seeds)])
