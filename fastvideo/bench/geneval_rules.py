"""GenEval's prompt suite and scoring rules, without its detector: pure Python on boxes, scores and colour names.

GenEval (Ghosh et al., NeurIPS 2023; djghosh13/geneval) scores an image for its prompt from an instance detector's
boxes per class (Mask2Former in the original, any detector here) and a CLIP zero-shot colour of each object crop.
Every rule below is GenEval's, cited by file and line at commit 16f1681 (``evaluation/evaluate_images.py``,
``evaluation/summary_scores.py``) and cfaff69 (``prompts/create_prompts.py``); the reward is Flow-GRPO's reward
server's (yifan123/reward-server ``reward_server/gen_eval.py`` at 7131478), which trains on a partial score.

- ``suite``: the 553 prompts and their metadata, generated as ``create_prompts.py`` does (seed 43, 100 per task then
  de-duplicated; equal to the published ``prompts/evaluation_metadata.jsonl``).
- ``keep_detections``: per class, detections over the score threshold (0.3; 0.9 on counting prompts), at most 16,
  greedy NMS (off at its default overlap 1.0).
- ``evaluate``: GenEval's per-image ``correct`` and its reason.
- ``reward``: Flow-GRPO's strict 0/1 and partial score.
- ``summarize``: per-task accuracy over images and ``overall`` = the mean of the six tasks.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

# prompts/object_names.txt (= evaluation/object_names.txt): COCO's 80 classes in mmdet's order, three renamed
OBJECTS: tuple[str, ...] = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow",
    "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee",
    "skis", "snowboard", "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard",
    "tennis racket", "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple", "sandwich",
    "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch", "potted plant", "bed",
    "dining table", "toilet", "tv", "laptop", "computer mouse", "tv remote", "computer keyboard", "cell phone",
    "microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock", "vase", "scissors", "teddy bear",
    "hair drier", "toothbrush")
COLORS: tuple[str, ...] = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
POSITIONS: tuple[str, ...] = ("left of", "right of", "above", "below")  # create_prompts.py l.104
NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")  # l.68
TASKS: tuple[str, ...] = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
SEED = 43  # create_prompts.py --seed default (l.177)
PER_TASK = 100  # --num-prompts default (l.178); single_object takes every class once

# evaluate_images.py l.286-290 (each a --options key there)
THRESHOLD = 0.3
COUNTING_THRESHOLD = 0.9
MAX_OBJECTS = 16
NMS_THRESHOLD = 1.0  # 'max_overlap': 1.0 keeps every box (NMS off)
POSITION_THRESHOLD = 0.1


# ------------------------------------------------------------------------------------------------ prompts
def _article(name: str) -> str:
    """create_prompts.py ``with_article`` (l.19-22): "an" before a vowel letter, else "a"."""
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def _plural(name: str) -> str:
    """create_prompts.py ``make_plural`` (l.26-29): "es" after a final s, else "s" (so "persons", "sheeps")."""
    return f"{name}es" if name.endswith("s") else f"{name}s"


def suite(seed: int = SEED, per_task: int = PER_TASK) -> list[dict[str, Any]]:
    """GenEval's prompt records ``{"tag", "include", ["exclude",] "prompt"}`` in its order: every class once as a
    single object, then ``per_task`` two-object, counting, colour, position and colour-attribution prompts drawn
    from one ``numpy.random.default_rng(seed)`` in ``create_prompts.generate_suite``'s call order (l.138-163),
    exact duplicates dropped (the first kept). Seed 43, 100: the published 553."""
    rng = np.random.default_rng(seed)
    n = len(OBJECTS)
    records: list[dict[str, Any]] = []
    for i in rng.choice(n, size=n, replace=False):  # l.33-50
        records.append({"tag": "single_object", "include": [{"class": OBJECTS[i], "count": 1}],
                        "prompt": f"a photo of {_article(OBJECTS[i])}"})
    for _ in range(per_task):  # l.54-64
        a, b = rng.choice(n, size=2, replace=False)
        records.append({"tag": "two_object", "include": [{"class": OBJECTS[a], "count": 1},
                                                          {"class": OBJECTS[b], "count": 1}],
                        "prompt": f"a photo of {_article(OBJECTS[a])} and {_article(OBJECTS[b])}"})
    for _ in range(per_task):  # l.70-83: 2, 3 or 4 of one class, and not one more
        i = rng.choice(n)
        k = int(rng.integers(2, 4, endpoint=True))
        records.append({"tag": "counting", "include": [{"class": OBJECTS[i], "count": k}],
                        "exclude": [{"class": OBJECTS[i], "count": k + 1}],
                        "prompt": f"a photo of {NUMBERS[k]} {_plural(OBJECTS[i])}"})
    person = OBJECTS.index("person")
    for _ in range(per_task):  # l.89-100: never a coloured person
        i = (rng.choice(n - 1) + 1 + person) % n
        color = COLORS[rng.choice(len(COLORS))]
        records.append({"tag": "colors", "include": [{"class": OBJECTS[i], "count": 1, "color": color}],
                        "prompt": f"a photo of {_article(color)} {OBJECTS[i]}"})
    for _ in range(per_task):  # l.106-117: the second include is placed relative to group 0
        a, b = rng.choice(n, size=2, replace=False)
        rel = POSITIONS[rng.choice(len(POSITIONS))]
        records.append({"tag": "position", "include": [{"class": OBJECTS[b], "count": 1},
                                                        {"class": OBJECTS[a], "count": 1, "position": [rel, 0]}],
                        "prompt": f"a photo of {_article(OBJECTS[a])} {rel} {_article(OBJECTS[b])}"})
    for _ in range(per_task):  # l.121-133: two different colours on two different non-person classes
        a, b = (rng.choice(n - 1, size=2, replace=False) + 1 + person) % n
        ca, cb = rng.choice(len(COLORS), size=2, replace=False)
        records.append({"tag": "color_attr",
                        "include": [{"class": OBJECTS[a], "count": 1, "color": COLORS[ca]},
                                    {"class": OBJECTS[b], "count": 1, "color": COLORS[cb]}],
                        "prompt": f"a photo of {_article(COLORS[ca])} {OBJECTS[a]} and "
                                  f"{_article(COLORS[cb])} {OBJECTS[b]}"})
    seen: set[str] = set()
    unique = []
    for record in records:  # l.157-163 (a YAML dump there; the same records compare equal as sorted JSON)
        key = json.dumps(record, sort_keys=True)
        if key not in seen:
            seen.add(key)
            unique.append(record)
    return unique


def read_metadata(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a GenEval ``evaluation_metadata.jsonl`` (the user's copy of the published file, ``--prompts_
    file``); ValueError naming the line for a record the rules cannot score."""
    records = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                check_record(record)
            except (json.JSONDecodeError, ValueError) as err:
                raise ValueError(f"--prompts_file {path}, line {lineno}: {err}; pass GenEval's "
                                 "prompts/evaluation_metadata.jsonl or leave --prompts_file out (the suite is "
                                 "generated)") from None
            records.append(record)
    if not records:
        raise ValueError(f"--prompts_file {path} holds no records")
    return records


def check_record(record: Any) -> None:
    """ValueError naming what is wrong with one metadata record (tag, prompt, include/exclude items)."""
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
        raise ValueError("a record needs a \"prompt\" string")
    if record.get("tag") not in TASKS:
        raise ValueError(f"tag {record.get('tag')!r} is not one of {', '.join(TASKS)}")
    if not isinstance(record.get("include"), list) or not record["include"]:
        raise ValueError("a record needs at least one \"include\" item")
    for key in ("include", "exclude"):
        for item in record.get(key, []):
            if not isinstance(item, dict) or item.get("class") not in OBJECTS or \
                    not isinstance(item.get("count"), int) or item["count"] < 1:
                raise ValueError(f"{key} item {item!r} needs a GenEval class and a count >= 1")
            if "color" in item and item["color"] not in COLORS:
                raise ValueError(f"colour {item['color']!r} is not one of {', '.join(COLORS)}")
            if "position" in item:
                where = item["position"]
                earlier = record["include"].index(item) if key == "include" else 0
                if not (isinstance(where, list) and len(where) == 2 and where[0] in POSITIONS
                        and isinstance(where[1], int) and 0 <= where[1] < earlier):
                    raise ValueError(f"position {where!r} needs one of {POSITIONS} and an earlier include group")


def _prompt_patterns() -> list[tuple[str, Any]]:
    """Full-match regexes of the six templates, most specific first ("an orange orange" is a colour prompt)."""
    import re

    cls = "|".join(re.escape(o) for o in sorted(OBJECTS, key=len, reverse=True))
    col = "|".join(COLORS)
    plural = "|".join(re.escape(_plural(o)) for o in sorted(OBJECTS, key=len, reverse=True))
    a = "an? "
    return [("color_attr", re.compile(rf"a photo of {a}({col}) ({cls}) and {a}({col}) ({cls})")),
            ("position", re.compile(rf"a photo of {a}({cls}) ({'|'.join(POSITIONS)}) {a}({cls})")),
            ("two_object", re.compile(rf"a photo of {a}({cls}) and {a}({cls})")),
            ("counting", re.compile(rf"a photo of ({'|'.join(NUMBERS[2:])}) ({plural})")),
            ("colors", re.compile(rf"a photo of {a}({col}) ({cls})")),
            ("single_object", re.compile(rf"a photo of {a}({cls})"))]


def parse_prompt(prompt: str) -> dict[str, Any] | None:
    """The GenEval record of a prompt written by GenEval's templates (``create_prompts.py``; Flow-GRPO's GenEval
    training prompts use the same), or None for any other text: how the ``geneval`` reward knows what to check."""
    text = prompt.strip()
    for tag, pattern in _PATTERNS:
        m = pattern.fullmatch(text)
        if m is None:
            continue
        g = m.groups()
        if tag == "color_attr":
            return {"tag": tag, "include": [{"class": g[1], "count": 1, "color": g[0]},
                                            {"class": g[3], "count": 1, "color": g[2]}], "prompt": text}
        if tag == "position":
            return {"tag": tag, "include": [{"class": g[2], "count": 1},
                                            {"class": g[0], "count": 1, "position": [g[1], 0]}], "prompt": text}
        if tag == "two_object":
            return {"tag": tag, "include": [{"class": g[0], "count": 1}, {"class": g[1], "count": 1}],
                    "prompt": text}
        if tag == "counting":
            k, name = NUMBERS.index(g[0]), next(o for o in OBJECTS if _plural(o) == g[1])
            return {"tag": tag, "include": [{"class": name, "count": k}], "exclude": [{"class": name, "count": k + 1}],
                    "prompt": text}
        if tag == "colors":
            return {"tag": tag, "include": [{"class": g[1], "count": 1, "color": g[0]}], "prompt": text}
        return {"tag": tag, "include": [{"class": g[0], "count": 1}], "prompt": text}
    return None


_PATTERNS = _prompt_patterns()


def record_classes(record: Mapping[str, Any]) -> list[str]:
    """The classes a record names (include, then exclude), each once: what a detector is asked for."""
    return list(dict.fromkeys(item["class"] for key in ("include", "exclude") for item in record.get(key, [])))


# ------------------------------------------------------------------------------------------------ detections
@dataclass(frozen=True)
class Detection:
    """One detected instance: its box (x1, y1, x2, y2) in pixels, its score, and optionally its mask (H x W bool;
    the colour crop keeps only its pixels, as GenEval's ``ImageCrops``)."""

    box: tuple[float, float, float, float]
    score: float
    mask: Any = None


def iou(a: Sequence[float], b: Sequence[float]) -> float:
    """``compute_iou`` (evaluate_images.py l.130-137): pixel-inclusive areas ((x2 - x1 + 1) x (y2 - y1 + 1)); 0 for
    an empty union."""
    def area(box):
        return max(box[2] - box[0] + 1, 0) * max(box[3] - box[1] + 1, 0)

    inter = area((max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])))
    union = area(a) + area(b) - inter
    return inter / union if union > 0 else 0.0


def keep_detections(detections: Mapping[str, Iterable[Detection]], tag: str, *, threshold: float = THRESHOLD,
                    counting_threshold: float = COUNTING_THRESHOLD, max_objects: int = MAX_OBJECTS,
                    nms_threshold: float = NMS_THRESHOLD) -> dict[str, list[Detection]]:
    """evaluate_images.py l.228-244: per class, the detections scoring strictly over the threshold (``counting_
    threshold`` on a counting prompt, for every class), best first, the first ``max_objects`` of them, then greedy
    NMS dropping boxes of IoU >= ``nms_threshold`` with a kept one (1.0: none dropped); empty classes left out."""
    limit = counting_threshold if tag == "counting" else threshold
    kept: dict[str, list[Detection]] = {}
    for name, dets in detections.items():
        ranked = sorted((d for d in dets if d.score > limit), key=lambda d: -d.score)[:max_objects]
        out: list[Detection] = []
        while ranked:
            best = ranked.pop(0)
            out.append(best)
            if nms_threshold < 1:
                ranked = [d for d in ranked if iou(best.box, d.box) < nms_threshold]
        if out:
            kept[name] = out
    return kept


def relative_position(a: Sequence[float], b: Sequence[float],
                      threshold: float = POSITION_THRESHOLD) -> set[str]:
    """Where box ``a`` lies relative to box ``b`` (evaluate_images.py l.140-157): the centres' offset, each axis
    shrunk by ``threshold`` x the two boxes' summed extent on it (and kept at its sign), divided by the *unshrunk*
    offset's length; "left of" / "right of" where that x part is below -0.5 / above 0.5, "above" / "below" for y
    (image rows grow downwards); none when the shrunk offset is ~0. Both axes may hold."""
    ca = np.array([(a[0] + a[2]) / 2, (a[1] + a[3]) / 2])
    cb = np.array([(b[0] + b[2]) / 2, (b[1] + b[3]) / 2])
    dims = np.array([abs(a[2] - a[0]) + abs(b[2] - b[0]), abs(a[3] - a[1]) + abs(b[3] - b[1])])
    offset = ca - cb
    revised = np.maximum(np.abs(offset) - threshold * dims, 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    out = set()
    if dx < -0.5:
        out.add("left of")
    if dx > 0.5:
        out.add("right of")
    if dy < -0.5:
        out.add("above")
    if dy > 0.5:
        out.add("below")
    return out


ColourOf = Callable[[Detection, str], str]  # (detection, class name) -> one of COLORS (CLIP zero-shot in the bench)


def _misplaced(found: Sequence[Detection], target: Sequence[Detection], rel: str, threshold: float) -> set[str] | None:
    """The relations of the first (found, target) pair, in GenEval's loop order, that lack ``rel``; None when every
    found object is ``rel`` every target object (evaluate_images.py l.199-209)."""
    for obj in found:
        for other in target:
            got = relative_position(obj.box, other.box, threshold)
            if rel not in got:
                return got
    return None


def evaluate(record: Mapping[str, Any], kept: Mapping[str, Sequence[Detection]], colour_of: ColourOf,
             position_threshold: float = POSITION_THRESHOLD) -> tuple[bool, str]:
    """GenEval's ``evaluate`` (evaluate_images.py l.160-220) on ``keep_detections``' output: each include needs at
    least ``count`` detections; its colour, the colour of each of its ``count`` best; its position, the relation
    from each of them to each matched object of the named earlier group; an exclude fails at ``count`` or more.
    Returns (correct, reason)."""
    matched: list[Sequence[Detection] | None] = []
    correct, reasons = True, []
    for req in record["include"]:
        name, count = req["class"], req["count"]
        found = list(kept.get(name, []))[:count]
        ok = len(found) >= count
        if not ok:
            correct = False
            reasons.append(f"expected {name}>={count}, found {len(found)}")
        elif "color" in req:
            colours = [colour_of(d, name) for d in found]
            if colours.count(req["color"]) < count:
                ok = correct = False
                reasons.append(f"expected {req['color']} {name}>={count}, found "
                               f"{colours.count(req['color'])} {req['color']}; and {', '.join(colours)}")
        if ok and "position" in req:
            rel, group = req["position"]
            target = matched[group]
            if target is None:
                ok = correct = False
                reasons.append(f"no target for {name} to be {rel}")
            else:
                got = _misplaced(found, target, rel, position_threshold)
                if got is not None:
                    ok = correct = False
                    reasons.append(f"expected {name} {rel} target, found {' and '.join(sorted(got)) or 'none'}")
        matched.append(found if ok else None)
    for req in record.get("exclude", []):
        if len(kept.get(req["class"], [])) >= req["count"]:
            correct = False
            reasons.append(f"expected {req['class']}<{req['count']}, found {len(kept[req['class']])}")
    return correct, "\n".join(reasons)


def reward(record: Mapping[str, Any], kept: Mapping[str, Sequence[Detection]], colour_of: ColourOf,
           position_threshold: float = POSITION_THRESHOLD) -> tuple[bool, float]:
    """Flow-GRPO's GenEval reward (reward-server ``gen_eval.py`` ``evaluate_reward``, l.201-264): (strict, partial).
    Per include: the count term 1 - |count - found| / count over *all* kept detections (negative beyond twice the
    count); an exact count or strict fails (and a colour or position term 0); a colour term 1 - |count - matching| /
    count; a position term 0 at the first failed relation, and then, as there, a term 1 after the check whatever its
    outcome (a wrong relation scores 0.75 on a position prompt). Excludes are not read (the exact count replaces
    them). Partial = the mean of the terms; strict = every check passed."""
    terms: list[float] = []
    strict = True
    matched: list[Sequence[Detection] | None] = []
    for req in record["include"]:
        name, count = req["class"], req["count"]
        found = list(kept.get(name, []))
        terms.append(1 - abs(count - len(found)) / count)
        ok = len(found) == count
        if not ok:
            strict = False
            if "color" in req or "position" in req:
                terms.append(0.0)
        else:
            if "color" in req:
                hits = [colour_of(d, name) for d in found].count(req["color"])
                terms.append(1 - abs(count - hits) / count)
                if hits != count:
                    ok = strict = False
            if ok and "position" in req:
                rel, group = req["position"]
                target = matched[group]
                if target is None:
                    ok = strict = False
                    terms.append(0.0)
                else:
                    if _misplaced(found, target, rel, position_threshold) is not None:
                        ok = strict = False
                        terms.append(0.0)
                    terms.append(1.0)
        matched.append(found if ok else None)
    return strict, sum(terms) / len(terms)


# ------------------------------------------------------------------------------------------------ summary
def summarize(results: Iterable[Mapping[str, Any]], key: str = "correct") -> dict[str, Any]:
    """summary_scores.py l.40-45: per task the mean of ``key`` (GenEval's ``correct``, as 0/1) over its images,
    ``overall`` the unweighted mean of the task scores; each with its image count and a 95% interval (normal
    approximation over images; overall's from the tasks' variances, each task weighted 1/6)."""
    by_task: dict[str, list[float]] = {}
    for r in results:
        by_task.setdefault(r["tag"], []).append(float(r[key]))
    out: dict[str, Any] = {}
    var_sum = 0.0
    for tag in [t for t in TASKS if t in by_task]:
        x = np.array(by_task[tag])
        mean, var = float(x.mean()), float(x.var(ddof=1)) / len(x) if len(x) > 1 else 0.0
        half = 1.96 * math.sqrt(var)
        out[tag] = {"score": mean, "n": len(x), "ci95": [mean - half, mean + half]}
        var_sum += var
    if out:
        k = len(out)
        overall = float(np.mean([v["score"] for v in out.values()]))
        half = 1.96 * math.sqrt(var_sum) / k
        out["overall"] = {"score": overall, "n": sum(v["n"] for v in out.values()), "ci95": [overall - half,
                                                                                            overall + half]}
    return out
