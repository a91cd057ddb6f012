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

``toyworld_edit`` / ``toyworld_edit_strict`` score edits of toy-world scenes (``fastvideo.toyworld.edit_world``: "make
the red circle blue") against their sources: the instruction carried out, and nothing else changed.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from fastvideo.toyworld.clean import clean_batch
from fastvideo.toyworld.edit_world import GRAMMAR as EDIT_GRAMMAR
from fastvideo.toyworld.edit_world import parse_edit, score_edits
from fastvideo.toyworld.motion import GRAMMAR as MOTION_GRAMMAR
from fastvideo.toyworld.motion import parse_motion_prompt
from fastvideo.toyworld.motion import score_videos as score_motion
from fastvideo.toyworld.scenes import GRAMMAR, parse_prompt
from fastvideo.toyworld.verify import score_batch


def _tensors(score: Callable[[], dict], reward: str, what: str) -> dict[str, torch.Tensor]:
    """``score()``'s (B,) numpy scores as float32 tensors; its ValueError (a prompt outside the grammar) as one naming
    ``reward`` and ``what`` it scores."""
    try:
        scores = score()
    except ValueError as err:
        raise ValueError(f"reward '{reward}' scores {what}: {err}") from None
    return {key: torch.from_numpy(value).float() for key, value in scores.items()}


class ToyWorldScorer:
    """``(images (B,3,H,W) in [0,1], toy-world prompts) -> {key: (B,) float32}`` for the keys of ``SCORE_KEYS``."""

    reward = "toyworld"  # the name its errors give

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        return _tensors(lambda: score_batch(images, prompts), self.reward, "toy-world prompts only (fastvideo."
                        "toyworld.scenes.all_prompts() lists them; train on a prompts file written from them)")


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
        return _tensors(lambda: score_motion(videos, prompts), self.reward,
                        "toy-world motion prompts only (fastvideo.toyworld.motion.all_motion_prompts())")


class MotionStrictScorer(MotionScorer):
    """``toyworld_motion_strict``: 1 when every frame and the motion are right, else 0, as a reward of its own."""

    reward = "toyworld_motion_strict"

    def score_videos(self, videos: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        return super().score_videos(videos, prompts)["strict"]


class EditScorer:
    """``toyworld_edit``: ``(edits (B,3,H,W) in [0,1], instructions, sources=(B,3,h,w)) -> {key: (B,) float32}`` for
    ``edit_world.SCORE_KEYS`` (the instruction check, the preservation check, strict = both, score = their mean)."""

    reward = "toyworld_edit"
    takes_sources = needs_sources = True  # it compares each edit with its source (an edit run)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str], sources: torch.Tensor | None = None
                 ) -> dict[str, torch.Tensor]:
        if sources is None:
            raise ValueError(f"reward '{self.reward}' compares each edit with its source image: train an edit model "
                             "on an edit store (docs/editing.md)")
        return _tensors(lambda: score_edits(images, prompts, sources), self.reward,
                        "toy edit instructions only (`python -m fastvideo.toyworld edits` writes edit files of them)")


class EditStrictScorer(EditScorer):
    """``toyworld_edit_strict``: 1 when the instruction is carried out and nothing else changed, else 0."""

    reward = "toyworld_edit_strict"

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], sources: torch.Tensor | None = None
                 ) -> torch.Tensor:
        return super().__call__(images, prompts, sources)["strict"]


def check_edit_prompts(prompts: Sequence[str], reward: str = "toyworld_edit") -> None:
    """ValueError listing (up to 3 of) the instructions outside the toy edit grammar, with their line numbers."""
    _refuse_unparsed(prompts, parse_edit, reward, "toy edit", f"follow the grammar: {EDIT_GRAMMAR}")


def build_edit(device: torch.device, **_: object) -> EditScorer:
    """Registry factory for ``toyworld_edit`` (CPU pixel analysis of each edit and its source)."""
    return EditScorer()


def build_edit_strict(device: torch.device, **_: object) -> EditStrictScorer:
    """Registry factory for ``toyworld_edit_strict``."""
    return EditStrictScorer()


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
