"""The toy edit world: edits of toy-world scenes ("make the red circle blue"), their ground truth, a held-out split of
(edit, object) combinations and a verifier that checks the instruction *and* that nothing else changed.

A source scene holds 2 or 3 single objects of different colours (the colour names the object, as in the base world),
laid out with ``scenes``' rules. Instructions (lower case, single spaces)::

    edit     := "make the" object colour          recolour: the object takes the colour (one not in the scene)
              | "remove the" object
              | "move the" object place "the" object    the first object moves; the rest stay put
              | "add a" object place "the" object       a new object (a colour not in the scene)
    object   := colour shape
    place    := "to the left of" | "to the right of" | "above" | "below"

The ground truth changes exactly what the instruction names: a recoloured object keeps its place and size, a moved
one its size (to a place where every one of its centroid's coordinates lies on the relation's side of the anchor's
with ``scenes.relation_margin`` to spare, apart from the others), an added one gets a free place on the relation's
side of the anchor. The verifier (``score_edits``) detects the objects of the source and of the edit
(``verify.detect_objects``) and checks:

- **instruction**: recolour: an object of the shape in the new colour where the named one was (centroid within
  ``position_tolerance``) and none left in the old colour; remove: none of that colour and shape; move / add:
  exactly one such object and the relation holds between its centroid and the anchor's;
- **preserve**: every other source object is still there (same colour and shape, centroid within the tolerance) and
  the edit holds no other object;
- **strict** = both; **score** = their mean.
"""
from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from fastvideo.seeding import derive_seed
from fastvideo.toyworld import scenes, verify
from fastvideo.toyworld.scenes import COLOR_NAMES, MARGIN, SHAPES, PlacedObject

EDIT_KINDS: tuple[str, ...] = ("recolour", "remove", "move", "add")
PLACES: dict[str, str] = {"left of": "to the left of", "right of": "to the right of", "above": "above",
                          "below": "below"}
SOURCE_OBJECTS: tuple[int, ...] = (2, 3)  # objects in a source scene
SCORE_KEYS: tuple[str, ...] = ("score", "strict", "instruction", "preserve")
OBJECTS: tuple[tuple[str, str], ...] = tuple(itertools.product(COLOR_NAMES, SHAPES))
# Held out: 8 of the 48 (edit kind, named object) combinations, 2 per kind on 8 different objects (random.Random(0)
# shuffles the 12 objects; kind k holds out objects 2k and 2k + 1): every kind keeps 10 training objects and every
# object keeps at least 3 training kinds, so a held-out instruction asks for an edit the model has made, on an object
# it has edited, but never that edit on that object.
_COMBOS = [(kind, obj) for kind in EDIT_KINDS for obj in OBJECTS]


def _heldout_combos() -> frozenset[tuple[str, tuple[str, str]]]:
    objects = list(OBJECTS)
    random.Random(0).shuffle(objects)
    return frozenset((kind, objects[2 * k + j]) for k, kind in enumerate(EDIT_KINDS) for j in (0, 1))


HELDOUT_COMBOS = _heldout_combos()


@dataclass(frozen=True)
class EditSpec:
    """What an instruction asks: its ``kind``, the ``obj`` (colour, shape) it names, the ``new_color`` of a recolour,
    and the ``relation`` to the ``anchor`` object of a move or an add."""

    kind: str
    obj: tuple[str, str]
    new_color: str | None = None
    relation: str | None = None
    anchor: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        placed = self.kind in ("move", "add")
        if (self.kind not in EDIT_KINDS or self.obj not in OBJECTS or (self.kind == "recolour") != (self.new_color
                is not None) or placed != (self.relation is not None) or placed != (self.anchor is not None)):
            raise ValueError(f"bad edit {self}: kinds {EDIT_KINDS}; a recolour names a new colour, a move or an add a "
                             "relation and an anchor object")
        if self.new_color is not None and (self.new_color not in COLOR_NAMES or self.new_color == self.obj[0]):
            raise ValueError(f"a recolour names another colour of {COLOR_NAMES}, got {self.new_color!r}")
        if placed and (self.relation not in PLACES or self.anchor not in OBJECTS or self.anchor[0] == self.obj[0]):
            raise ValueError(f"a {self.kind} relates the object to an anchor of another colour with one of "
                             f"{tuple(PLACES)}, got {self.relation!r} {self.anchor!r}")


def format_edit(spec: EditSpec) -> str:
    """The instruction of ``spec`` (``parse_edit``'s inverse)."""
    c, s = spec.obj
    if spec.kind == "recolour":
        return f"make the {c} {s} {spec.new_color}"
    if spec.kind == "remove":
        return f"remove the {c} {s}"
    verb = "move the" if spec.kind == "move" else "add a"
    return f"{verb} {c} {s} {PLACES[spec.relation]} the {spec.anchor[0]} {spec.anchor[1]}"


_OBJ = r"(red|green|blue|yellow) (circle|square|triangle)"
_PLACE = "|".join(PLACES.values())
_FORMS = {"recolour": re.compile(rf"make the {_OBJ} (red|green|blue|yellow)"),
          "remove": re.compile(rf"remove the {_OBJ}"),
          "move": re.compile(rf"move the {_OBJ} ({_PLACE}) the {_OBJ}"),
          "add": re.compile(rf"add an? {_OBJ} ({_PLACE}) the {_OBJ}")}
GRAMMAR = ('"make the <colour> <shape> <colour>", "remove the <colour> <shape>", "move the <colour> <shape> <place> '
           'the <colour> <shape>" or "add a <colour> <shape> <place> the <colour> <shape>", <place> in {to the left '
           'of, to the right of, above, below}; e.g. "move the red circle to the left of the blue square"')


def parse_edit(text: str) -> EditSpec:
    """A toy edit instruction (case, extra spaces and a final period ignored) -> EditSpec; ValueError naming the
    grammar."""
    norm = " ".join(str(text).lower().strip().rstrip(".").split())
    for kind, form in _FORMS.items():
        match = form.fullmatch(norm)
        if match is None:
            continue
        g = match.groups()
        try:
            if kind == "recolour":
                return EditSpec(kind, (g[0], g[1]), new_color=g[2])
            if kind == "remove":
                return EditSpec(kind, (g[0], g[1]))
            relation = {v: k for k, v in PLACES.items()}[g[2]]
            return EditSpec(kind, (g[0], g[1]), relation=relation, anchor=(g[3], g[4]))
        except ValueError as err:
            raise ValueError(f"toy edit {text!r}: {err}") from None
    raise ValueError(f"cannot parse toy edit {text!r}; grammar: {GRAMMAR}")


def is_heldout(instruction: str | EditSpec) -> bool:
    """Whether the instruction's (kind, named object) is one of ``HELDOUT_COMBOS``."""
    spec = parse_edit(instruction) if isinstance(instruction, str) else instruction
    return (spec.kind, spec.obj) in HELDOUT_COMBOS


# ------------------------------------------------------------------------------------------------ ground truth
@dataclass(frozen=True)
class EditExample:
    """A source scene, an instruction and the scene it asks for."""

    instruction: str
    source: tuple[PlacedObject, ...]
    target: tuple[PlacedObject, ...]
    size: int

    def images(self) -> tuple[np.ndarray, np.ndarray]:
        """(source, target) renders, (size, size, 3) uint8 each."""
        return scenes.draw(self.source, self.size), scenes.draw(self.target, self.size)


def _centroid(shape: str, x: np.ndarray, y: np.ndarray, side: int) -> tuple[np.ndarray, np.ndarray]:
    return x + side / 2, y + (2 * side / 3 if shape == "triangle" else side / 2)


def _free_place(rng: np.random.Generator, shape: str, side: int, others: Sequence[PlacedObject], size: int,
                relation: str | None = None, anchor: PlacedObject | None = None) -> tuple[int, int] | None:
    """A top-left (x, y) for a ``side`` px ``shape`` inside the image, ``MARGIN`` px apart from ``others``' boxes and,
    with a relation, every centroid coordinate on its side of ``anchor``'s with ``relation_margin`` to spare; None if
    2048 draws find none."""
    span = size - 2 * MARGIN - side
    xs = MARGIN + rng.integers(0, span + 1, 2048)
    ys = MARGIN + rng.integers(0, span + 1, 2048)
    ok = np.ones(len(xs), dtype=bool)
    for o in others:
        ok &= ((xs + side + MARGIN <= o.x) | (o.x + o.side + MARGIN <= xs)
               | (ys + side + MARGIN <= o.y) | (o.y + o.side + MARGIN <= ys))
    if relation is not None:
        cx, cy = _centroid(shape, xs, ys, side)
        ax, ay = anchor.centroid
        gap = scenes.relation_margin(size)
        ok &= {"left of": cx + gap <= ax, "right of": cx >= ax + gap, "above": cy + gap <= ay,
               "below": cy >= ay + gap}[relation]
    hits = np.flatnonzero(ok)
    return None if hits.size == 0 else (int(xs[hits[0]]), int(ys[hits[0]]))


def _holds(a: tuple[float, float], b: tuple[float, float], relation: str) -> bool:
    axis = 0 if relation in ("left of", "right of") else 1
    return a[axis] < b[axis] if relation in ("left of", "above") else a[axis] > b[axis]


def make_example(kind: str, obj: tuple[str, str], size: int = 32, seed: int = 0) -> EditExample:
    """A seeded example of ``kind`` naming ``obj`` (deterministic for its arguments): a 2-3 object source (``obj``
    in it, unless it is added), the instruction and its ground truth. A move's source does not yet satisfy it."""
    if (kind, obj) not in _COMBOS:
        raise ValueError(f"unknown edit {kind!r} of {obj!r}: kinds {EDIT_KINDS}, objects {OBJECTS}")
    rng = np.random.default_rng(derive_seed(seed, "toyworld-edit", kind, *obj, size))
    lo, hi = scenes.side_range(size)
    for _ in range(100):
        n = int(rng.choice(SOURCE_OBJECTS))
        free_colors = [c for c in COLOR_NAMES if c != obj[0]]
        colors = list(rng.permutation(free_colors)[:n - (kind != "add")])
        kinds = ([] if kind == "add" else [obj]) + [(str(c), str(rng.choice(SHAPES))) for c in colors]
        source: list[PlacedObject] = []
        for c, s in kinds:
            side = int(rng.integers(lo, hi + 1))
            spot = _free_place(rng, s, side, source, size)
            if spot is None:
                break
            source.append(PlacedObject(0, c, s, spot[0], spot[1], side))
        if len(source) < len(kinds):
            continue
        named = next((o for o in source if (o.color, o.shape) == obj), None)
        others = [o for o in source if o is not named]
        if kind == "recolour":
            new = str(rng.choice([c for c in COLOR_NAMES if c not in {o.color for o in source}]))
            spec = EditSpec(kind, obj, new_color=new)
            target = [PlacedObject(0, new, o.shape, o.x, o.y, o.side) if o is named else o for o in source]
        elif kind == "remove":
            spec, target = EditSpec(kind, obj), others
        else:
            anchor = others[int(rng.integers(len(others)))] if kind == "move" else source[int(rng.integers(len(source)))]
            relation = str(rng.choice(list(PLACES)))
            if kind == "move" and _holds(named.centroid, anchor.centroid, relation):
                continue  # already there: not an edit
            side = named.side if kind == "move" else int(rng.integers(lo, hi + 1))
            spot = _free_place(rng, obj[1], side, others if kind == "move" else source, size, relation, anchor)
            if spot is None:
                continue
            moved = PlacedObject(0, obj[0], obj[1], spot[0], spot[1], side)
            spec = EditSpec(kind, obj, relation=relation, anchor=(anchor.color, anchor.shape))
            target = [moved if o is named else o for o in source] if kind == "move" else source + [moved]
        return EditExample(format_edit(spec), tuple(source), tuple(target), size)
    raise ValueError(f"no {kind} example of {obj} at {size} px after 100 tries; use a larger size")


def examples(split: str, count: int, size: int = 32, seed: int = 0) -> list[EditExample]:
    """``count`` examples of the ``split`` ("train" or "heldout"), cycling through its (kind, object) combinations in
    a seeded order (so the kinds and objects are balanced), each with its own seed."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    combos = [c for c in _COMBOS if (c in HELDOUT_COMBOS) == (split == "heldout")]
    order = np.random.default_rng(derive_seed(seed, "toyworld-edit-order", split)).permutation(len(combos))
    out = []
    for i in range(count):
        kind, obj = combos[order[i % len(combos)]]
        out.append(make_example(kind, obj, size, seed=derive_seed(seed, "toyworld-edit-example", split, i)))
    return out


# ---------------------------------------------------------------------------------------------------- verifier
def position_tolerance(size: int) -> float:
    """How far (px) an object's centroid may drift and still count as in place: ``scenes.relation_margin(size)``."""
    return scenes.relation_margin(size)


def score_objects(edit: list[verify.DetectedObject], source: list[verify.DetectedObject], spec: EditSpec,
                  size: int, scale: tuple[float, float] = (1.0, 1.0)) -> dict[str, float]:
    """Scores (``SCORE_KEYS``) of the objects detected in an edit against those of its source; ``scale`` maps source
    pixel coordinates to the edit's (x, y) (a source of another size)."""
    tol = position_tolerance(size)

    def at(o: verify.DetectedObject) -> tuple[float, float]:
        return o.centroid[0] * scale[0], o.centroid[1] * scale[1]

    def near(a: tuple[float, float], b: tuple[float, float]) -> bool:
        return (a[0] - b[0]) ** 2 + (a[1] - b[1]) ** 2 <= tol * tol

    named = [o for o in source if (o.color, o.shape) == spec.obj] if spec.kind != "add" else []
    others = [o for o in source if o not in named]
    kept = all(any((e.color, e.shape) == (o.color, o.shape) and near(e.centroid, at(o)) for e in edit) for o in others)
    expected = len(others) + (spec.kind != "remove")
    preserve = kept and len(edit) == expected
    same = [e for e in edit if (e.color, e.shape) == spec.obj]
    if spec.kind == "recolour":
        done = not same and bool(named) and any((e.color, e.shape) == (spec.new_color, spec.obj[1])
                                                and near(e.centroid, at(named[0])) for e in edit)
    elif spec.kind == "remove":
        done = not same
    else:
        anchors = [e for e in edit if (e.color, e.shape) == spec.anchor]
        done = len(same) == 1 and len(anchors) == 1 and _holds(same[0].centroid, anchors[0].centroid, spec.relation)
    return {"score": (float(done) + float(preserve)) / 2, "strict": float(done and preserve),
            "instruction": float(done), "preserve": float(preserve)}


def score_edits(edits: torch.Tensor | np.ndarray, instructions: Sequence[str],
                sources: torch.Tensor | np.ndarray) -> dict[str, np.ndarray]:
    """Scores of a batch of edits ((B, 3, H, W) in [0, 1] or (B, H, W, 3) uint8) of their ``sources`` (same forms,
    any one size) against their instructions: ``{key: (B,) float64}`` for ``SCORE_KEYS``; NaN for non-finite pixels.
    The instructions are parsed (a bad one fails) before any pixel work."""
    specs = [parse_edit(t) for t in instructions]
    x, s = verify._as_batch(edits), verify._as_batch(sources)
    if not x.shape[0] == s.shape[0] == len(specs):
        raise ValueError(f"got {x.shape[0]} edits, {s.shape[0]} sources and {len(specs)} instructions; pass one "
                         "source and one instruction per edit")
    finite = np.isfinite(x.reshape(len(specs), -1)).all(axis=1)
    found = verify._detect(np.nan_to_num(x, nan=0.0, posinf=255.0, neginf=0.0))
    given = verify._detect(s)
    scale = (x.shape[2] / s.shape[2], x.shape[1] / s.shape[1])
    out = {key: np.empty(len(specs), dtype=np.float64) for key in SCORE_KEYS}
    for i, (edit, source, spec) in enumerate(zip(found, given, specs)):
        scores = score_objects(edit, source, spec, min(x.shape[1], x.shape[2]), scale)
        for key in SCORE_KEYS:
            out[key][i] = scores[key] if finite[i] else np.nan
    return out


def write_edit_file(out_dir: str | Path, split: str, count: int, size: int = 32, seed: int = 0) -> Path:
    """``out_dir/<split>.jsonl``, an edit file (``preprocess_embeddings.py --edit_file``) of ``examples(split, count,
    size, seed)``: each line's source under ``<split>/sources/``, its instruction, and the ground-truth edit under
    ``<split>/targets/`` (key ``"target"``, for reference: the trainers read ``image`` and ``prompt``)."""
    import json

    from PIL import Image  # heavy

    out = Path(out_dir)
    for part in ("sources", "targets"):
        (out / split / part).mkdir(parents=True, exist_ok=True)
    lines = []
    for i, example in enumerate(examples(split, count, size, seed)):
        source, target = example.images()
        names = [f"{split}/{part}/{i:05d}.png" for part in ("sources", "targets")]
        Image.fromarray(source).save(out / names[0])
        Image.fromarray(target).save(out / names[1])
        lines.append(json.dumps({"image": names[0], "prompt": example.instruction, "target": names[1]}))
    path = out / f"{split}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path
