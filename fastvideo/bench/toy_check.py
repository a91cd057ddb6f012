"""The GenEval rules against the toy world's verifier: with a detector adapter that reports the toy scenes' objects
(the verifier's own pixel analysis: a box per connected component, its shape as the class, its colour as CLIP's
answer, score 1), GenEval's ``evaluate`` on a toy prompt's record should agree with the toy strict check, on rendered
ground truth and on its corruptions.

A toy prompt maps to the GenEval record its template would make: one object -> ``colors`` (class = shape, with its
colour); two or three -> ``counting`` (count, colour, and the exclude of count + 1); two groups -> ``position`` (the
second group first, the first placed relative to it), as ``create_prompts.py`` orders them. Only toy prompts of
GenEval's shapes take part: GenEval never names one class twice in a prompt (``rng.choice(80, 2, replace=False)``)
and its position prompts place one object relative to one, so two-group toy prompts of one shape or with a count
above one are left out (324 of the 2,628 remain). With ``style="random"`` layouts the toy relation holds on its
axis alone, where GenEval also wants the centres' offset within about 60 degrees of that axis: the figure then
counts those disagreements too.
Corruptions, scored against the original prompt: a single group with another colour, another shape, one more or
one fewer object; two groups: the verifier's near misses (colours, shapes or counts swapped, relation flipped).
``python -m fastvideo.bench.toy_check`` prints the figure.
"""
from __future__ import annotations

import json
from typing import Any

from fastvideo.bench import geneval_rules as R
from fastvideo.toyworld import scenes, verify


def toy_record(spec: scenes.SceneSpec) -> dict[str, Any]:
    """The GenEval record of a toy scene spec (see the module docstring)."""
    items = [{"class": shape, "count": n, "color": color} for n, color, shape in spec.groups]
    if spec.relation is None:
        (n, _, shape), = spec.groups
        if n == 1:
            return {"tag": "colors", "include": items}
        return {"tag": "counting", "include": items, "exclude": [{"class": shape, "count": n + 1}]}
    return {"tag": "position", "include": [items[1], {**items[0], "position": [spec.relation, 0]}]}


def toy_detections(objects: list[verify.DetectedObject]) -> tuple[dict[str, list[R.Detection]], dict[int, str]]:
    """The adapter: per shape class its components as detections (box = pixel edges of the inclusive bbox, score 1)
    and the colour of each (by ``id``); blobs of no toy shape ("other") are not objects."""
    found: dict[str, list[R.Detection]] = {}
    colour: dict[int, str] = {}
    for o in objects:
        if o.shape == "other":
            continue
        x0, y0, x1, y1 = o.bbox
        det = R.Detection((float(x0), float(y0), float(x1 + 1), float(y1 + 1)), 1.0)
        found.setdefault(o.shape, []).append(det)
        colour[id(det)] = o.color
    return found, colour


def corruptions(spec: scenes.SceneSpec) -> list[tuple[str, scenes.SceneSpec]]:
    """Wrong scenes for ``spec`` (kind, spec), each a valid toy scene."""
    if spec.relation is not None:
        return verify._near_misses(spec)
    (n, color, shape), = spec.groups
    out = [("other colour", (n, next(c for c in scenes.COLOR_NAMES if c != color), shape)),
           ("other shape", (n, color, next(s for s in scenes.SHAPES if s != shape)))]
    out += [("one more", (n + 1, color, shape))] if n < 3 else []
    out += [("one fewer", (n - 1, color, shape))] if n > 1 else []
    return [(kind, scenes.SceneSpec((group,))) for kind, group in out]


def eligible(spec: scenes.SceneSpec) -> bool:
    """A toy prompt of GenEval's shapes: one group, or two groups of one object each, of two different shapes."""
    return spec.relation is None or all(n == 1 for n, _, _ in spec.groups) and spec.groups[0][2] != spec.groups[1][2]


def _judge(image, spec: scenes.SceneSpec) -> tuple[bool, bool]:
    """(GenEval correct, toy strict) of one rendered image against ``spec``."""
    objects = verify.detect_objects(image[None])[0]
    found, colour = toy_detections(objects)
    record = toy_record(spec)
    kept = R.keep_detections(found, record["tag"])
    correct, _ = R.evaluate(record, kept, lambda d, _: colour[id(d)])
    return correct, bool(verify.score_objects(objects, spec)["strict"])


def agreement(size: int = 64, seed: int = 0, every: int = 1, style: str = "tidy") -> dict[str, Any]:
    """Per case (ground truth; each corruption kind): images, how many GenEval and the toy check pass, and how many
    they agree on; over every ``every``-th eligible toy prompt, rendered at ``size`` px with layout seed ``seed`` and
    ``style`` (``scenes.layout``)."""
    cases: dict[str, dict[str, int]] = {}
    prompts = [p for p in scenes.all_prompts() if eligible(scenes.parse_prompt(p))][::every]
    for prompt in prompts:
        spec = scenes.parse_prompt(prompt)
        for kind, shown in [("ground truth", spec), *corruptions(spec)]:
            image = scenes.to_tensor(scenes.render(shown, size, seed, style))
            correct, strict = _judge(image, spec)
            c = cases.setdefault(kind, {"images": 0, "geneval_correct": 0, "toy_strict": 0, "agree": 0})
            c["images"] += 1
            c["geneval_correct"] += correct
            c["toy_strict"] += strict
            c["agree"] += correct == strict
    total = {k: sum(c[k] for c in cases.values()) for k in ("images", "agree")}
    return {"prompts": len(prompts), "size": size, "seed": seed, "style": style, "cases": cases,
            "agreement": total["agree"] / max(total["images"], 1), "images": total["images"]}


if __name__ == "__main__":
    print(json.dumps([agreement(style="tidy"), agreement(style="random")], indent=2))
