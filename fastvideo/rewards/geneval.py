"""``geneval`` and ``geneval_vqa:URL``: GenEval as a reward, on prompts written by GenEval's templates.

``geneval`` is Flow-GRPO's GenEval reward (yifan123/reward-server ``gen_eval.py``) on an open-vocabulary detector
from ``transformers`` instead of mmdet's Mask2Former: score = the partial score (the mean of each group's count,
colour and position terms; counts are exact), logged beside it ``geneval_strict`` (all exact) and ``geneval_correct``
(GenEval's benchmark check). Flags: ``--geneval_detector_path`` (OWLv2 or Grounding DINO folder, the kind read from
its config.json) and ``--geneval_clip_path`` (the colour head's CLIP folder). ``geneval_vqa:URL`` asks a VLM the
prompt's atom questions (GenEval 2's Soft-TIFA, through the ``vlm_judge`` client and its --judge_* flags): score =
the mean probability of the atoms' right answers (Soft-TIFA AM), logged beside it ``geneval_vqa_gm`` (their
geometric mean, GM). Both refuse a prompt that GenEval's templates did not write before any model loads. The rules
and their sources: fastvideo.bench.geneval_rules and fastvideo.bench.geneval.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from fastvideo.bench import geneval as G
from fastvideo.bench.geneval import check_prompts  # the registry's prompt check

_DETECTOR = "an OWLv2 or Grounding DINO transformers folder"


class GenEvalReward:
    """``reward(images, prompts) -> {"score": partial, "strict", "correct"}`` through ``bench.geneval``'s scorer."""

    def __init__(self, scorer: Any, name: str, keys: tuple[str, ...]):
        self.scorer, self.name, self.keys = scorer, name, keys

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        rows = self.scorer.score(images, G.records_for(prompts, f"reward {self.name!r}"))
        score, *extra = self.keys
        out = {"score": torch.tensor([r[score] for r in rows], dtype=torch.float32)}
        for key in extra:
            out[key.removeprefix("soft_tifa_")] = torch.tensor([r[key] for r in rows], dtype=torch.float32)
        return out


def build(device: torch.device, *, geneval_detector_path: str | None = None, geneval_clip_path: str | None = None,
          **_: object) -> GenEvalReward:
    """Registry factory of ``geneval``: the detector and the colour head on ``device``, GenEval's thresholds."""
    from fastvideo.bench.detect import ClipColours, check_clip_path, load_detector
    from fastvideo.rewards._common import require_path

    detector = require_path(geneval_detector_path, "--geneval_detector_path", "geneval", _DETECTOR, kind="dir")
    clip = check_clip_path(geneval_clip_path, "--geneval_clip_path")
    scorer = G.DetectorScorer(load_detector(detector, device, flag="--geneval_detector_path"),
                              ClipColours(clip, device))
    return GenEvalReward(scorer, "geneval", ("partial", "strict", "correct"))


def build_vqa(url: str, device: Any = None, **judge_options: Any) -> GenEvalReward:
    """URL factory of ``geneval_vqa:URL``: the ``vlm_judge`` client (its --judge_model, timeouts, retries and
    concurrency; --judge_score and --judge_template do not apply: the atom questions are yes/no)."""
    from fastvideo.rewards import vlm_judge

    options = {k: v for k, v in judge_options.items() if k not in ("judge_score", "judge_template")}
    return GenEvalReward(G.SoftTifaScorer(vlm_judge.build(url, device, **options)), "geneval_vqa",
                         ("soft_tifa", "soft_tifa_gm"))


__all__ = ["GenEvalReward", "build", "build_vqa", "check_prompts"]
