"""The toy world in time (fastvideo/toyworld/motion.py): the grammar and its split, the renderer, and the motion
verifier on rendered ground truth and on corruptions (the frames reversed, a static video, the colours swapped, an
object missing from a frame), then the ``toyworld_motion`` reward through ``RewardFn`` on videos (~3 s)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fastvideo.rewards import build_reward
from fastvideo.toyworld import motion as M
from fastvideo.toyworld import scenes


def test_grammar_round_trips_and_refuses_clearly():
    prompts = M.all_motion_prompts()
    assert len(prompts) == len(set(prompts)) == 12 * 3 * 4 + 12 * 9
    assert "a red circle moving right" in prompts and "two blue squares falling" in prompts
    assert "a green triangle moving toward a yellow circle" in prompts
    for prompt in prompts:
        assert M.format_motion_prompt(M.parse_motion_prompt(prompt)) == prompt
    assert M.parse_motion_prompt("  Three RED circles   rising ") == M.MotionSpec(((3, "red", "circle"),), "rising")
    for bad, match in (("a red circles falling", "say 'a circle'"), ("a red circle dancing", "grammar"),
                       ("two red circles moving toward a blue square", "two single objects"),
                       ("a red circle moving toward a red square", "different colours")):
        with pytest.raises(ValueError, match=match):
            M.parse_motion_prompt(bad)


def test_the_heldout_split_pairs_known_objects_with_known_motions():
    """Held out: each object with one motion (each motion with three objects), and the image world's held-out object
    pairs as mover and target: every object, motion and other pairing is trained on."""
    train, held = M.split_motion_prompts()
    assert (len(train), len(held)) == (188, 64) and not set(train) & set(held)
    specs = [M.parse_motion_prompt(p) for p in train]
    seen_objects = {g[1:] for s in specs if s.motion != M.TOWARD for g in s.groups}
    seen_motions = {s.motion for s in specs}
    assert seen_objects == set(M.OBJECTS) and seen_motions == {*M.MOTIONS, M.TOWARD}
    for prompt in held:
        spec = M.parse_motion_prompt(prompt)
        if spec.motion == M.TOWARD:
            assert frozenset(g[1:] for g in spec.groups) in scenes.HELDOUT_OBJECT_PAIRS
        else:
            obj = spec.groups[0][1:]
            assert (obj, spec.motion) in M.HELDOUT_MOTIONS
            assert any(s.motion != spec.motion and s.groups[0][1:] == obj for s in specs)  # the object moves in train
    assert sum(1 for p in held if M.TOWARD in p) == 2 * len(scenes.HELDOUT_OBJECT_PAIRS)


def _recoloured(videos: torch.Tensor, swap: dict[str, str]) -> torch.Tensor:
    """Every pixel of a prototype colour painted in its ``swap`` partner (the renders have hard edges)."""
    out = videos.clone()
    for src, dst in swap.items():
        old = torch.tensor(scenes.COLORS[src], dtype=torch.float32).view(1, 1, 3, 1, 1) / 255
        new = torch.tensor(scenes.COLORS[dst], dtype=torch.float32).view(1, 1, 3, 1, 1) / 255
        out = torch.where((videos - old).abs().amax(dim=2, keepdim=True) < 1e-6, new, out)
    return out


# every prompt at the trainers' 32 px x 5 frames; a quarter of them at 64 px x 9 frames (~1 s each)
@pytest.mark.parametrize("size,frames,stride", [(32, 5, 1), (64, 9, 4)])
def test_rendered_ground_truth_passes_and_corruptions_fail(size, frames, stride):
    """Every prompt rendered (one seed each) is strictly right; reversed in time its motion fails (every frame still
    right); frozen at the first frame its motion fails; with the colours swapped (red <-> blue, green <-> yellow)
    nothing is right; with the middle frame blanked that frame fails, and only it."""
    prompts = list(M.all_motion_prompts())[::stride]
    videos = M.render_videos(prompts, size, frames, seeds=list(range(len(prompts))))
    assert videos.shape == (len(prompts), frames, 3, size, size) and videos.dtype == torch.float32
    truth = M.score_videos(videos, prompts)
    assert truth["strict"].tolist() == [1.0] * len(prompts)
    reverse = M.score_videos(videos.flip(1), prompts)
    assert reverse["motion"].max() == 0 and reverse["color"].min() == reverse["count"].min() == 1
    static = M.score_videos(videos[:, :1].expand_as(videos).contiguous(), prompts)
    assert static["strict"].max() == 0 and static["motion"].max() == 0
    swapped = M.score_videos(_recoloured(videos, {"red": "blue", "blue": "red", "green": "yellow",
                                                  "yellow": "green"}), prompts)
    assert swapped["strict"].max() == 0
    toward = np.array([M.TOWARD in p for p in prompts])
    assert swapped["color"][~toward].max() == 0  # a directional group's colour is gone from every frame
    # red toward blue became blue toward red: both colours there, but the red object now stands still
    assert swapped["motion"][toward & (swapped["color"] == 1)].max() == 0
    holed = videos.clone()
    holed[:, frames // 2] = torch.tensor(scenes.BACKGROUND, dtype=torch.float32).view(3, 1, 1) / 255
    hole = M.score_videos(holed, prompts)
    assert hole["strict"].max() == 0
    assert hole["color"].tolist() == pytest.approx([(frames - 1) / frames] * len(prompts))
    assert hole["motion"].min() == 1  # first and last frames still carry the motion


def test_toward_checks_the_mover_not_the_target():
    """In a "toward" video, the target coming to the mover is not the mover moving: the colours of the two objects
    exchanged (the static one now has the mover's colour) fail the motion check."""
    prompt = "a red circle moving toward a blue square"
    video = M.render_videos([prompt], 64, 5, seeds=3)
    assert M.score_videos(video, [prompt])["strict"][0] == 1
    assert M.score_videos(video, ["a blue square moving toward a red circle"])["motion"][0] == 0
    trajectory = M.trajectories(prompt, 64, 5, 3)
    assert trajectory[0][1] == trajectory[-1][1]  # the target stays put
    assert trajectory[0][0] != trajectory[-1][0]


def test_toyworld_motion_reward_scores_whole_videos():
    """Through RewardFn: the scorer gets every frame of each video (not --reward_frames' per-frame reduction), logs
    its checks, and refuses images and prompts outside the grammar before any pixel work."""
    prompts = ["a red circle moving right", "two green triangles falling"]
    videos = M.render_videos(prompts, 32, 5, seeds=[0, 1])
    videos[1] = videos[1].flip(0)  # the second falls upward
    reward = build_reward("toyworld_motion:1.0,toyworld_motion_strict:0", "cpu")
    out = reward(videos, prompts)
    assert out["toyworld_motion_strict"].tolist() == [1.0, 0.0]
    assert out["toyworld_motion_motion"].tolist() == [1.0, 0.0] and out["total"].tolist() == [1.0, 0.75]
    assert out["frame_change"].min() > 0
    with pytest.raises(ValueError, match="scores videos"):
        reward(videos[:, 0], prompts)
    with pytest.raises(ValueError, match="motion prompts only"):
        reward(videos, ["a red circle", "x"])
    from fastvideo.rewards.toyworld import check_motion_prompts

    with pytest.raises(ValueError, match=r"1 of 2 prompts .*line 2: 'a red circle left of a blue square'"):
        check_motion_prompts(["a red circle rising", "a red circle left of a blue square"])
