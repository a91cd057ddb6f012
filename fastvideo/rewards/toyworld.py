"""Toy-world prompt following (GenEval-style, verifiable): colour, shape, count and relative position of the objects
a toy-world prompt asks for, checked by pixel analysis (``fastvideo.toyworld.verify``). No weights.

The scorer returns a dict of (B,) float32 CPU tensors: ``"score"`` (the mean of the four checks, the training signal)
plus ``"strict"`` (1 only when every check passes, GenEval's per-prompt accuracy) and ``"color"``, ``"shape"``,
``"count"``, ``"position"``; RewardFn logs the extras as ``toyworld_<key>``. Images with non-finite pixels score NaN.

``toyworld_clean`` (``fastvideo.toyworld.clean``) scores what ``toyworld`` does not see, whatever the prompt: how
clean the image is (plain background, no stray specks, pure object colours with hard edges). It returns ``"score"``
(the mean of the three) plus ``"background"``, ``"stray"``, ``"purity"``, logged as ``toyworld_clean_<key>``; meant
for ``--eval_reward``, to watch a run that trains on ``toyworld`` for reward hacking.

``toyworld_motion`` / ``toyworld_motion_strict`` score videos of the toy world in time (``fastvideo.toyworld.motion``:
"a red circle moving right"): every frame's colour, shape and count and the motion, on whole videos.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from fastvideo.toyworld.clean import clean_batch
from fastvideo.toyworld.motion import GRAMMAR as MOTION_GRAMMAR
from fastvideo.toyworld.motion import parse_motion_prompt
from fastvideo.toyworld.motion import score_videos as score_motion
from fastvideo.toyworld.scenes import GRAMMAR, parse_prompt
from fastvideo.toyworld.verify import score_batch


class ToyWorldScorer:
    """``(images (B,3,H,W) in [0,1], toy-world prompts) -> {key: (B,) float32}`` for the keys of ``SCORE_KEYS``."""

    reward = "toyworld"  # the name its errors give

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        try:
            scores = score_batch(images, prompts)
        except ValueError as err:
            raise ValueError(f"reward '{self.reward}' scores toy-world prompts only (fastvideo.toyworld.scenes."
                             f"all_prompts() lists them; train on a prompts file written from them): {err}") from None
        return {key: torch.from_numpy(value).float() for key, value in scores.items()}


class StrictScorer(ToyWorldScorer):
    """``(images, toy-world prompts) -> (B,) float32``: 1 when every check passes, else 0 (the ``"strict"`` entry of
    ``ToyWorldScorer``, GenEval's per-prompt correctness) as a training signal of its own."""

    reward = "toyworld_strict"

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        return super().__call__(images, prompts)["strict"]


class CleanScorer:
    """``(images (B,3,H,W) in [0,1], prompts (unused)) -> {key: (B,) float32}`` for ``clean.CLEAN_KEYS``."""

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        return {key: torch.from_numpy(value).float() for key, value in clean_batch(images).items()}


class MotionScorer:
    """``toyworld_motion``: videos (B, N, 3, H, W) of motion prompts -> ``{key: (B,) float32}`` for
    ``motion.SCORE_KEYS`` (every frame's colour / shape / count and the motion; ``fastvideo.toyworld.motion``). A
    whole-video scorer: ``RewardFn.score_video`` hands it every frame (``video_frames`` 0) unless --reward_frames."""

    reward = "toyworld_motion"
    scores_videos = True
    video_frames = 0

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        raise ValueError(f"reward '{self.reward}' scores videos (motion): train a video model (--num_frames), not "
                         f"images of shape {tuple(images.shape)}")

    @torch.no_grad()
    def score_videos(self, videos: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        try:
            scores = score_motion(videos, prompts)
        except ValueError as err:
            raise ValueError(f"reward '{self.reward}' scores toy-world motion prompts only "
                             f"(fastvideo.toyworld.motion.all_motion_prompts()): {err}") from None
        return {key: torch.from_numpy(value).float() for key, value in scores.items()}


class MotionStrictScorer(MotionScorer):
    """``toyworld_motion_strict``: 1 when every frame and the motion are right, else 0, as a reward of its own."""

    reward = "toyworld_motion_strict"

    def score_videos(self, videos: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        return super().score_videos(videos, prompts)["strict"]


def check_motion_prompts(prompts: Sequence[str], reward: str = "toyworld_motion") -> None:
    """ValueError listing (up to 3 of) the prompts outside the motion grammar, with their line numbers."""
    _refuse_unparsed(prompts, parse_motion_prompt, reward, "toy-world motion",
                     f"follow the grammar: {MOTION_GRAMMAR}")


def _refuse_unparsed(prompts: Sequence[str], parse: Callable[[str], object], reward: str, kind: str,
                     fix: str) -> None:
    """ValueError naming ``reward`` and (up to 3 of) the prompts ``parse`` refuses, with their line numbers, then
    ``fix``."""
    bad = []
    for i, prompt in enumerate(prompts):
        try:
            parse(prompt)
        except ValueError:
            bad.append(f"line {i + 1}: {prompt!r}")
    if bad:
        raise ValueError(f"reward '{reward}' scores {kind} prompts only, and {len(bad)} of {len(prompts)} prompts are "
                         f"not ({'; '.join(bad[:3])}{'; ...' if len(bad) > 3 else ''}); {fix}")


def build_motion(device: torch.device, **_: object) -> MotionScorer:
    """Registry factory for ``toyworld_motion`` (CPU pixel analysis of every frame)."""
    return MotionScorer()


def build_motion_strict(device: torch.device, **_: object) -> MotionStrictScorer:
    """Registry factory for ``toyworld_motion_strict``."""
    return MotionStrictScorer()


def check_prompts(prompts: Sequence[str], reward: str = "toyworld") -> None:
    """ValueError listing (up to 3 of) the prompts outside the toy-world grammar, with their line numbers, naming
    ``reward`` (toyworld or toyworld_strict)."""
    _refuse_unparsed(prompts, parse_prompt, reward, "toy-world", "train on the prompt files of `python -m "
                     f"fastvideo.toyworld prompts` or follow the grammar: {GRAMMAR}")


def build(device: torch.device, **_: object) -> ToyWorldScorer:
    """Registry factory for ``toyworld`` (CPU pixel analysis whatever ``device`` is; batches of 64 at 64 px take
    tens of milliseconds)."""
    return ToyWorldScorer()


def build_strict(device: torch.device, **_: object) -> StrictScorer:
    """Registry factory for ``toyworld_strict`` (the same CPU pixel analysis as ``toyworld``)."""
    return StrictScorer()


def build_clean(device: torch.device, **_: object) -> CleanScorer:
    """Registry factory for ``toyworld_clean`` (CPU pixel analysis whatever ``device`` is; a batch of 64 at 64 px takes
    tens of milliseconds)."""
    return CleanScorer()
