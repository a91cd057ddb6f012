"""GenEval-style scoring of images against GenEval records: by a detector + CLIP colours (``DetectorScorer``, GenEval's
rules in ``geneval_rules``) or by a VLM's yes/no answers to atom questions (``SoftTifaScorer``, GenEval 2's Soft-TIFA),
and the benchmark's files: ``results.jsonl`` (a row per image), ``summary.json`` (per task and overall, 95%
intervals) and ``failures.png`` (failed images by task). The bench (``python -m fastvideo.bench geneval``) and the
``geneval`` / ``geneval_vqa`` rewards use the same scorers.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from fastvideo.bench import geneval_rules as R


@dataclass(frozen=True)
class Thresholds:
    """GenEval's detection options (evaluate_images.py l.286-290), each a bench flag: a detector other than GenEval's
    Mask2Former scores on its own scale, so these are where a user calibrates (docs/benchmarks.md)."""

    threshold: float = R.THRESHOLD
    counting_threshold: float = R.COUNTING_THRESHOLD
    position_threshold: float = R.POSITION_THRESHOLD
    max_objects: int = R.MAX_OBJECTS
    nms_threshold: float = R.NMS_THRESHOLD

    def check(self) -> "Thresholds":
        """ValueError naming the flag of a value out of range."""
        for name in ("threshold", "counting_threshold", "nms_threshold"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"--{name} must be in [0, 1], got {getattr(self, name)}")
        if not 0 <= self.position_threshold < 0.5:
            raise ValueError(f"--position_threshold must be in [0, 0.5), got {self.position_threshold}")
        if self.max_objects < 1:
            raise ValueError(f"--max_objects must be >= 1, got {self.max_objects}")
        return self


def records_for(prompts: Sequence[str], where: str) -> list[dict[str, Any]]:
    """The GenEval record of each prompt (``geneval_rules.parse_prompt``); ValueError naming ``where``, the first
    prompt that is not GenEval's and the fix."""
    records = []
    for i, prompt in enumerate(prompts):
        record = R.parse_prompt(prompt)
        if record is None:
            raise ValueError(f"{where}: prompt {i} {prompt!r} is not written by GenEval's templates (e.g. 'a photo "
                             "of two dogs', 'a photo of a red cup and a blue clock'); train on GenEval-style prompts "
                             "(python -m fastvideo.bench geneval --list_prompts prints the 553)")
        records.append(record)
    return records


def check_prompts(prompts: Sequence[str], reward: str = "geneval") -> None:
    """The reward registry's prompt check: every prompt parses as a GenEval record."""
    records_for(prompts, f"reward {reward!r}")


class DetectorScorer:
    """GenEval on ``detector`` boxes and ``colours`` (``fastvideo.bench.detect``): ``score(images, records)`` -> a row
    per image: GenEval's ``correct`` and reason, Flow-GRPO's ``strict`` and ``partial``, and the kept detections."""

    def __init__(self, detector: Any, colours: Any, thresholds: Thresholds = Thresholds()):
        self.detector, self.colours, self.thresholds = detector, colours, thresholds

    def score(self, images: torch.Tensor, records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Rows for a batch (B, 3, H, W) in [0, 1] and its B records: one detector pass, one colour pass over every
        kept box of a class that has a colour to check."""
        from fastvideo.bench.detect import cpu_images, crop

        t = self.thresholds
        pictures = cpu_images(images)  # the crops are cut from the 8-bit image, as GenEval's PIL crops are
        found = self.detector(images, [R.record_classes(r) for r in records])
        kept = [R.keep_detections(d, r["tag"], threshold=t.threshold, counting_threshold=t.counting_threshold,
                                  max_objects=t.max_objects, nms_threshold=t.nms_threshold)
                for d, r in zip(found, records)]
        wanted = [(i, item["class"], det) for i, (r, k) in enumerate(zip(records, kept)) for item in r["include"]
                  if "color" in item for det in k.get(item["class"], [])]
        named = self.colours([crop(pictures[i], det) for i, _, det in wanted], [c for _, c, _ in wanted]) \
            if wanted else []
        table = {id(det): colour for (_, _, det), colour in zip(wanted, named)}

        def colour_of(det: R.Detection, _: str) -> str:
            return table[id(det)]

        rows = []
        for record, k in zip(records, kept):
            correct, reason = R.evaluate(record, k, colour_of, t.position_threshold)
            strict, partial = R.reward(record, k, colour_of, t.position_threshold)
            detections = {name: [{"box": [round(v, 1) for v in d.box], "score": round(d.score, 4),
                                  **({"color": table[id(d)]} if id(d) in table else {})} for d in k.get(name, [])]
                          for name in R.record_classes(record)}
            rows.append({"tag": record["tag"], "correct": float(correct), "reason": reason, "strict": float(strict),
                         "partial": float(partial), "detections": detections})
        return rows


# ------------------------------------------------------------------------------------------------ Soft-TIFA
# GenEval 2's Soft-TIFA (facebookresearch/GenEval2 evaluation.py at a6e82d2, ``soft_tifa`` l.131-147 and
# ``send_message_with_image`` l.73-100; questions as its geneval2_data.jsonl writes them): per object a count question
# ("How many dogs are in the image?", answered with the number word or digit), its attribute ("Is the cup red?") and
# an object question ("Are there any dogs in the image?"); per relation a position question. Each is asked with
# " Answer in one word."; its score is the probability the VLM gives the right answer's first token (every spelling
# summed; not normalised against "no"). AM = the mean of a prompt's atom scores, GM = their geometric mean.
ATOM_TYPES = ("count", "attribute", "object", "position")  # GenEval 2's skills
QUESTION = "{prompt} Answer in one word."
_IRREGULAR = {"person": "people", "sheep": "sheep", "knife": "knives", "computer mouse": "computer mice",
              "skis": "skis", "scissors": "scissors"}
_RELATION = {"left of": "to the left of", "right of": "to the right of", "above": "above", "below": "below"}


def english_plural(name: str) -> str:
    """The English plural of a GenEval class for a question (GenEval's own prompts say "persons", "benchs")."""
    if name in _IRREGULAR:
        return _IRREGULAR[name]
    return name + ("es" if name.endswith(("s", "sh", "ch", "x")) else "s")


def atoms(record: Mapping[str, Any]) -> list[tuple[str, str, tuple[str, ...]]]:
    """A record's atoms as GenEval 2 asks them: ``(skill, question, right answers)``; per include item its count,
    colour and object questions, then its relation to the named group."""
    out = []
    for item in record["include"]:
        name, count = item["class"], item["count"]
        many = english_plural(name)
        the = f"Is the {name}" if count == 1 else f"Are the {many}"
        out.append(("count", f"How many {many} are in the image?", (R.NUMBERS[count], str(count))))
        if "color" in item:
            out.append(("attribute", f"{the} {item['color']}?", ("yes",)))
        out.append(("object", f"Are there any {many} in the image?", ("yes",)))
        if "position" in item:
            rel, group = item["position"]
            other = record["include"][group]
            target = other["class"] if other["count"] == 1 else english_plural(other["class"])
            out.append(("position", f"{the} {_RELATION[rel]} the {target}?", ("yes",)))
    return out


def _geometric_mean(values: Sequence[float]) -> float:
    return 0.0 if min(values) <= 0 else math.exp(sum(math.log(v) for v in values) / len(values))


class SoftTifaScorer:
    """Soft-TIFA through a ``vlm_judge`` client: every atom question of every image in one batch of requests, each
    atom's score the probability of its right answer among the first token's top logprobs (a server without
    logprobs: 1 when the reply's first word is right, else 0, counted in ``text_answers``), a row per image:
    ``soft_tifa`` (AM, GenEval 2's atom-level score), ``soft_tifa_gm`` (GM, its prompt-level score) and the mean per
    skill (``atom_<skill>``)."""

    def __init__(self, judge: Any):
        self.judge = dataclasses.replace(judge, template=QUESTION, mode="yes_no")  # yes_no: logprobs are asked for

    def score(self, images: torch.Tensor, records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Rows for a batch (B, 3, H, W) in [0, 1] and its B records."""
        from fastvideo.rewards._common import to_grey_levels
        from fastvideo.rewards.vlm_judge import answer_mass

        questions = [atoms(r) for r in records]
        pixels = to_grey_levels(images.detach()).to(torch.uint8).permute(0, 2, 3, 1).cpu()
        index = [i for i, q in enumerate(questions) for _ in q]
        replies = self.judge.replies(pixels[index], [text for q in questions for _, text, _ in q])
        rows, at = [], 0
        for record, q in zip(records, questions):
            p, from_text = [], 0
            for (_, _, answers), (reply, top) in zip(q, replies[at:at + len(q)]):
                if top:
                    p.append(sum(answer_mass(top, answers).values()))
                else:
                    from_text += 1
                    first = re.match(r"\W*(\w+)", reply)
                    p.append(float(first is not None and first.group(1).lower() in answers))
            at += len(q)
            by_skill = {kind: [v for (k, _, _), v in zip(q, p) if k == kind] for kind in ATOM_TYPES}
            rows.append({"tag": record["tag"], "soft_tifa": sum(p) / len(p), "soft_tifa_gm": _geometric_mean(p),
                         **{f"atom_{kind}": sum(v) / len(v) for kind, v in by_skill.items() if v},
                         "text_answers": from_text,
                         "atoms": [{"type": k, "question": text, "answer": answers[0], "p": round(v, 6)}
                                   for (k, text, answers), v in zip(q, p)]})
        return rows


# ------------------------------------------------------------------------------------------------ files
SCORE_KEYS = {"detector": ("correct", "strict", "partial"), "vqa": ("soft_tifa", "soft_tifa_gm")}


def summary(rows: Sequence[Mapping[str, Any]], scorer: str) -> dict[str, Any]:
    """summary.json: per task (``geneval_rules.TASKS`` names) and ``overall`` = the mean of the tasks, each score with
    its 95% interval; the detector's headline is GenEval's ``correct``, the VQA scorer's the prompt-level Soft-TIFA.
    The other keys follow under ``by_key``; the VQA scorer adds the mean per atom type over all atoms."""
    keys = SCORE_KEYS[scorer]
    out: dict[str, Any] = {"scorer": scorer, "num_images": len(rows), **R.summarize(rows, keys[0])}
    out["by_key"] = {key: {t: v["score"] for t, v in R.summarize(rows, key).items()} for key in keys[1:]}
    if scorer == "vqa":
        per_type = {k: [a["p"] for r in rows for a in r["atoms"] if a["type"] == k] for k in ATOM_TYPES}
        out["atoms"] = {k: {"score": sum(v) / len(v), "n": len(v)} for k, v in per_type.items() if v}
    return out


def write_results(out: Path, rows: list[dict[str, Any]], scorer: str) -> dict[str, Any]:
    """OUT/results.jsonl and OUT/summary.json (atomically); returns the summary."""
    from fastvideo.data import atomic_write_text

    result = summary(rows, scorer)
    atomic_write_text(out / "results.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    atomic_write_text(out / "summary.json", json.dumps(result, indent=2) + "\n")
    return result


def describe(result: Mapping[str, Any]) -> str:
    """The lines the bench prints: each task and overall, score [95% interval] (n images)."""
    lines = []
    for task in (*R.TASKS, "overall"):
        if task in result:
            s = result[task]
            low, high = s["ci95"]
            lines.append(f"  {task:<14} {s['score']:.4f} [95% {low:.4f}, {high:.4f}] ({s['n']} images)")
    return "\n".join(lines)


def failure_grid(out: Path, rows: Sequence[Mapping[str, Any]], samples: Path, per_task: int = 6,
                 key: str = "correct") -> Path | None:
    """OUT/failures.png: per task a row of up to ``per_task`` failed images (``key`` 0; for the VQA scorer the
    lowest-scored), each captioned with its prompt and GenEval's reason (or its weakest atom); None when none failed."""
    from PIL import Image, ImageDraw  # heavy

    chosen = []
    for task in R.TASKS:
        task_rows = [r for r in rows if r["tag"] == task]
        if key == "correct":
            bad = [r for r in task_rows if not r["correct"]][:per_task]
        else:
            bad = sorted(task_rows, key=lambda r: r[key])[:per_task]
        if bad:
            chosen.append((task, bad))
    if not chosen:
        return None
    cell, caption = 192, 64
    canvas = Image.new("RGB", (110 + per_task * (cell + 4), len(chosen) * (cell + caption + 8)), "white")
    draw = ImageDraw.Draw(canvas)
    for i, (task, bad) in enumerate(chosen):
        y = i * (cell + caption + 8)
        draw.text((4, y + 4), task, fill="black")
        for j, row in enumerate(bad):
            x = 110 + j * (cell + 4)
            with Image.open(samples / row["path"]) as img:
                canvas.paste(img.convert("RGB").resize((cell, cell), Image.LANCZOS), (x, y))
            why = row.get("reason") or min(row.get("atoms", []), key=lambda a: a["p"], default={}).get("question", "")
            text = textwrap.wrap(row["prompt"], 30)[:2] + textwrap.wrap(str(why), 30)[:3]
            for k, line in enumerate(text):
                draw.text((x, y + cell + 2 + 12 * k), line, fill="black" if k < 2 else "darkred")
    path = out / "failures.png"
    canvas.save(path)
    return path
