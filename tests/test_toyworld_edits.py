"""The toy edit world (fastvideo/toyworld/edit_world.py): the instruction grammar, the held-out split of (edit,
object) combinations, the ground truth passing the verifier at every size (sharp and blurred), each corruption
failing it (the source unchanged, the wrong object edited, an extra change, an extra object, a move to the wrong
side), the ``toyworld_edit`` rewards through ``RewardFn`` with sources, and ``python -m fastvideo.toyworld edits``
writing an edit file the store reads. Default tier, ~6 s."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from fastvideo.toyworld import edit_world as ew
from fastvideo.toyworld import scenes
from helpers import REPO


def test_grammar_round_trips_and_refuses_other_text():
    specs = [ew.EditSpec("recolour", ("red", "circle"), new_color="blue"), ew.EditSpec("remove", ("green", "square")),
             ew.EditSpec("move", ("blue", "triangle"), relation="left of", anchor=("yellow", "circle")),
             ew.EditSpec("add", ("yellow", "square"), relation="below", anchor=("red", "circle"))]
    texts = [ew.format_edit(s) for s in specs]
    assert texts == ["make the red circle blue", "remove the green square",
                     "move the blue triangle to the left of the yellow circle", "add a yellow square below the red circle"]
    assert [ew.parse_edit(t.upper() + ".") for t in texts] == specs
    for bad in ("make the red circle red", "paint the red circle blue", "move the red circle left of the red square",
                "two red circles"):
        with pytest.raises(ValueError, match="toy edit"):
            ew.parse_edit(bad)


def test_heldout_split_holds_out_combinations_of_known_edits_and_objects():
    combos = {(kind, obj) for kind in ew.EDIT_KINDS for obj in ew.OBJECTS}
    train = combos - ew.HELDOUT_COMBOS
    assert len(ew.HELDOUT_COMBOS) == 8 and ew.HELDOUT_COMBOS < combos
    assert {k for k, _ in train} == set(ew.EDIT_KINDS) and {o for _, o in train} == set(ew.OBJECTS)
    held = ew.examples("heldout", 16)
    assert all(ew.is_heldout(e.instruction) for e in held)
    assert not any(ew.is_heldout(e.instruction) for e in ew.examples("train", 48))
    assert {(ew.parse_edit(e.instruction).kind, ew.parse_edit(e.instruction).obj) for e in held} == ew.HELDOUT_COMBOS
    assert ew.examples("train", 5, seed=3) == ew.examples("train", 5, seed=3) != ew.examples("train", 5, seed=4)


def _batch(examples: list[ew.EditExample]) -> tuple[np.ndarray, np.ndarray, list[str]]:
    sources, targets = zip(*(e.images() for e in examples))
    return np.stack(sources), np.stack(targets), [e.instruction for e in examples]


def _blur(images: np.ndarray, sigma: float) -> torch.Tensor:
    """A separable Gaussian blur plus noise of std 0.03 (a decoded image's softness)."""
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255
    k = torch.exp(-torch.arange(-3, 4).float() ** 2 / (2 * sigma ** 2))
    k = (k / k.sum()).view(1, 1, 1, 7).repeat(3, 1, 1, 1)
    x = torch.nn.functional.conv2d(torch.nn.functional.pad(x, (3, 3, 0, 0), mode="replicate"), k, groups=3)
    x = torch.nn.functional.conv2d(torch.nn.functional.pad(x, (0, 0, 3, 3), mode="replicate"), k.transpose(2, 3),
                                   groups=3)
    return (x + 0.03 * torch.randn(x.shape, generator=torch.Generator().manual_seed(0))).clamp(0, 1)


@pytest.mark.parametrize("size", [32, 48, 64])
def test_ground_truth_passes_and_the_unchanged_source_fails(size):
    sources, targets, instructions = _batch(ew.examples("train", 96, size) + ew.examples("heldout", 32, size))
    truth = ew.score_edits(targets, instructions, sources)
    assert truth["strict"].min() == 1.0 and truth["score"].min() == 1.0
    assert ew.score_edits(_blur(targets, 0.7), instructions, sources)["strict"].mean() == 1.0
    unchanged = ew.score_edits(sources, instructions, sources)
    assert unchanged["instruction"].max() == 0.0 and unchanged["strict"].max() == 0.0


def _corrupt(example: ew.EditExample, how: str) -> np.ndarray | None:
    """The ground truth with one corruption: another object than the named one edited instead, another object removed,
    reshaped or moved besides the edit, an object added besides it, or a move / add to the other side of the anchor
    (None where the scene leaves no room for it)."""
    spec = ew.parse_edit(example.instruction)
    size, target = example.size, list(example.target)
    other = next(o for o in example.source if (o.color, o.shape) not in (spec.obj, spec.anchor))
    if how == "wrong object":  # the edit applied to another object: the source with that one changed instead
        new = next(c for c in scenes.COLOR_NAMES if c not in {o.color for o in example.source})
        return scenes.draw([dataclasses.replace(o, color=new) if o == other else o for o in example.source], size)
    if how == "extra change":
        return scenes.draw([o for o in target if o != other], size)
    if how == "other reshaped":  # another object redrawn as another shape, same colour, same place
        shape = next(s for s in scenes.SHAPES if s != other.shape)
        return scenes.draw([dataclasses.replace(o, shape=shape) if o == other else o for o in target], size)
    if how == "other moved":  # another object moved (same colour and shape) further than the position tolerance
        rest = [o for o in target if o != other]
        tol = ew.position_tolerance(size)
        for seed in range(64):
            spot = ew._free_place(np.random.default_rng(seed), other.shape, other.side, rest, size)
            if spot is not None and (spot[0] - other.x) ** 2 + (spot[1] - other.y) ** 2 > (2 * tol) ** 2:
                return scenes.draw(rest + [dataclasses.replace(other, x=spot[0], y=spot[1])], size)
        return None
    if how == "extra object":  # a second object of another object's colour (every colour may be in use)
        shape = next(s for s in scenes.SHAPES if s != other.shape)
        spot = ew._free_place(np.random.default_rng(0), shape, 7, target, size)
        if spot is None:
            return None
        return scenes.draw(target + [scenes.PlacedObject(0, other.color, shape, spot[0], spot[1], 7)], size)
    assert how == "wrong side"
    flipped = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}[spec.relation]
    anchor = next(o for o in example.source if (o.color, o.shape) == spec.anchor)
    moved = next(o for o in target if (o.color, o.shape) == spec.obj)
    rest = [o for o in target if o != moved]
    spot = ew._free_place(np.random.default_rng(0), moved.shape, moved.side, rest, size, flipped, anchor)
    if spot is None:
        return None
    return scenes.draw(rest + [dataclasses.replace(moved, x=spot[0], y=spot[1])], size)


@pytest.mark.parametrize("how,fails", [("wrong object", ("instruction", "preserve")), ("extra change", ("preserve",)),
                                       ("other reshaped", ("preserve",)), ("other moved", ("preserve",)),
                                       ("extra object", ("preserve",)), ("wrong side", ("instruction",))])
def test_each_corruption_fails_the_strict_check(how, fails):
    """On 3-object sources (so another object than the named one and its anchor exists); recolours and removes have no
    side (the wrong side applies to moves and adds), and a remove cannot edit another object by mistake without
    leaving its own in place (also a failure of both checks)."""
    candidates = [e for e in ew.examples("train", 400) if len(e.source) == 3]
    kinds = ("move", "add") if how == "wrong side" else ew.EDIT_KINDS
    chosen, edits = [], []
    for kind in kinds:  # the first example of each kind that has room for the corruption
        example, corrupted = next((e, c) for e in candidates if ew.parse_edit(e.instruction).kind == kind
                                  and (c := _corrupt(e, how)) is not None)
        chosen.append(example)
        edits.append(corrupted)
    edits = np.stack(edits)
    scores = ew.score_edits(edits, [e.instruction for e in chosen], np.stack([e.images()[0] for e in chosen]))
    assert scores["strict"].max() == 0.0, (how, scores)
    for key in ("instruction", "preserve"):  # the corrupted check fails on every kind, the other still passes
        assert scores[key].tolist() == [0.0 if key in fails else 1.0] * len(chosen), (how, key, scores)


def test_edit_rewards_score_edits_against_their_sources():
    from fastvideo.rewards import build_reward, check_reward_prompts

    sources, targets, instructions = _batch(ew.examples("train", 8))
    to_tensor = lambda a: torch.from_numpy(a).permute(0, 3, 1, 2).float() / 255  # noqa: E731
    fn = build_reward("toyworld_edit_strict:1.0,toyworld_edit:0", torch.device("cpu"))
    right = fn(to_tensor(targets), instructions, to_tensor(sources))
    assert right["total"].tolist() == [1.0] * 8 and right["toyworld_edit_preserve"].tolist() == [1.0] * 8
    unchanged = fn(to_tensor(sources), instructions, to_tensor(sources))
    assert unchanged["total"].tolist() == [0.0] * 8 and unchanged["source_distance"].max() == 0
    big = torch.nn.functional.interpolate(to_tensor(sources), size=(64, 64), mode="nearest")  # sources of 64 px
    assert fn(to_tensor(targets), instructions, big)["total"].tolist() == [1.0] * 8  # mapped to the edit's pixels
    with pytest.raises(ValueError, match="compares an edit with its source image"):
        fn(to_tensor(targets), instructions)
    with pytest.raises(ValueError, match="toy edit prompts only.*line 2: 'a red circle'"):
        check_reward_prompts("toyworld_edit:1.0", [instructions[0], "a red circle"], "pairs.jsonl")


def test_the_edits_command_writes_an_edit_file_the_store_reads(tmp_path):
    from fastvideo.edits import EditSources

    proc = subprocess.run([sys.executable, "-m", "fastvideo.toyworld", "edits", "--out", str(tmp_path), "--train",
                           "6", "--heldout", "3"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    expected = ew.examples("train", 6)
    assert [r["prompt"] for r in rows] == [e.instruction for e in expected]
    sources = EditSources.open(tmp_path / "train.jsonl")
    assert (sources.height, sources.width) == (32, 32)
    pixels = np.stack([e.images()[0] for e in expected]).transpose(0, 3, 1, 2) / 255
    assert torch.equal(sources.load(range(6)), torch.from_numpy(pixels).float())
    bad = subprocess.run([sys.executable, "-m", "fastvideo.toyworld", "edits", "--out", str(tmp_path / "x"),
                          "--size", "20"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--size 20" in bad.stderr and "[32, 64]" in bad.stderr
