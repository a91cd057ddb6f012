"""Toy world: scene grammar and split, deterministic renderer, the pixel-analysis verifier and the toyworld reward."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from fastvideo.toyworld.scenes import (COLOR_NAMES, COLORS, HELDOUT_OBJECT_PAIRS, MARGIN, RELATIONS, SHAPES,
                                       PlacedObject, SceneSpec, all_prompts, draw, format_prompt, layout, parse_prompt,
                                       relation_margin, render, render_batch, render_prompt, shape_mask, side_range,
                                       split_prompts, to_tensor)
from fastvideo.toyworld.verify import SCORE_KEYS, detect_objects, score_batch, score_image

OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}


def _sample(n: int, seed: int = 0) -> list[str]:
    prompts = all_prompts()
    return [prompts[i] for i in np.random.default_rng(seed).choice(len(prompts), n, replace=False)]


def _blur_noise(images: torch.Tensor, sigma: float = 0.7, noise: float = 0.02, seed: int = 0) -> torch.Tensor:
    """Gaussian blur (sigma px, replicate padding) + additive Gaussian noise, clamped to [0, 1]."""
    r = int(np.ceil(3 * sigma))
    t = torch.arange(-r, r + 1, dtype=torch.float32)
    k = torch.exp(-t ** 2 / (2 * sigma ** 2))
    k = k / k.sum()
    B, C, H, W = images.shape
    y = torch.nn.functional.pad(images.reshape(B * C, 1, H, W), (r, r, r, r), mode="replicate")
    y = torch.nn.functional.conv2d(torch.nn.functional.conv2d(y, k.view(1, 1, 1, -1)), k.view(1, 1, -1, 1))
    y = y.view(B, C, H, W) + noise * torch.randn(images.shape, generator=torch.Generator().manual_seed(seed))
    return y.clamp(0, 1)


# ----------------------------------------------------------------------------------------------- grammar + split
def test_all_prompts_round_trip_and_count():
    prompts = all_prompts()
    assert list(prompts) == sorted(set(prompts))
    # 36 single groups + (count pairs with sum <= 4: 6) x (ordered colour pairs: 12) x (shape pairs: 9) x 4 relations
    assert len(prompts) == 36 + 6 * 12 * 9 * 4 == 2628
    for prompt in prompts:
        spec = parse_prompt(prompt)
        assert format_prompt(spec) == prompt
        assert spec.num_objects <= 4
        if spec.relation is not None:
            assert spec.groups[0][1] != spec.groups[1][1]
    assert "two red circles left of a blue square" in prompts and "a blue square" in prompts


def test_parser_accepts_variants():
    spec = SceneSpec(((1, "red", "circle"), (2, "blue", "triangle")), "above")
    for text in ("a red circle above two blue triangles", "An Red circle  above two blue triangles.",
                 "one red circle above two blue triangles"):
        assert parse_prompt(text) == spec


@pytest.mark.parametrize("text, match", [
    ("", "cannot parse"),
    ("a photo of a cat", "cannot parse"),
    ("a purple circle", "cannot parse"),
    ("four red circles", "cannot parse"),
    ("a red circle near a blue square", "cannot parse"),
    ("two red circle", "number disagreement"),
    ("a red circles", "number disagreement"),
    ("a red circle left of a red square", "differ in colour"),
    ("three red circles left of two blue squares", "at most 4 objects"),
])
def test_parser_errors(text, match):
    with pytest.raises(ValueError, match=match):
        parse_prompt(text)
    with pytest.raises(ValueError, match="grammar|differ|at most"):
        parse_prompt(text)


def test_split_holds_out_unseen_pairs_of_known_objects():
    """Held out: the two-group prompts whose two objects form a HELDOUT_OBJECT_PAIRS pair. Every object (with every
    count), every relation and every other object pair is in training; no held-out pair of objects is."""
    train, heldout = split_prompts(seed=0)
    assert train == sorted(train) and heldout == sorted(heldout)
    assert not set(train) & set(heldout) and set(train) | set(heldout) == set(all_prompts())
    assert (len(train), len(heldout)) == (1956, 672)
    objects = [(c, s) for c in COLOR_NAMES for s in SHAPES]
    all_pairs = {frozenset(p) for p in itertools.combinations(objects, 2) if p[0][0] != p[1][0]}
    assert len(all_pairs) == 54 and len(HELDOUT_OBJECT_PAIRS) == 14 and HELDOUT_OBJECT_PAIRS < all_pairs

    def pair(prompt):
        groups = parse_prompt(prompt).groups
        return frozenset((c, s) for _, c, s in groups) if len(groups) == 2 else None

    for prompt in all_prompts():
        assert (pair(prompt) in HELDOUT_OBJECT_PAIRS) == (prompt in heldout)
    assert {pair(p) for p in heldout} == HELDOUT_OBJECT_PAIRS
    assert {pair(p) for p in train} - {None} == all_pairs - HELDOUT_OBJECT_PAIRS
    groups = {g for p in train for g in parse_prompt(p).groups}
    assert groups == set(itertools.product((1, 2, 3), COLOR_NAMES, SHAPES))  # every object with every count
    assert {parse_prompt(p).relation for p in train} == set(RELATIONS) | {None}
    assert split_prompts(seed=1) == (train, heldout)


# ----------------------------------------------------------------------------------------------- renderer
def test_render_is_deterministic_per_prompt_and_seed():
    prompt = "two red circles left of a blue square"
    a, b = render_prompt(prompt, 64, seed=3), render_prompt(prompt, 64, seed=3)
    assert a.dtype == np.uint8 and a.shape == (64, 64, 3) and a.tobytes() == b.tobytes()
    layouts = {tuple(layout(prompt, 64, seed)) for seed in range(10)}
    assert len(layouts) == 10
    assert render_prompt(prompt, 64, seed=4).tobytes() != a.tobytes()
    assert render(parse_prompt(prompt), 64, 3).tobytes() == a.tobytes()


def _pixel_centroid(obj: PlacedObject) -> tuple[float, float]:
    ys, xs = np.nonzero(shape_mask(obj.shape, obj.side))
    return obj.x + xs.mean() + 0.5, obj.y + ys.mean() + 0.5


@pytest.mark.parametrize("style", ["random", "tidy"])
@pytest.mark.parametrize("size", [32, 48, 64])
def test_layouts_are_valid(size, style):
    lo, hi = side_range(size)
    for i, prompt in enumerate(_sample(150, seed=size)):
        spec = parse_prompt(prompt)
        objects = layout(spec, size, seed=i, style=style)
        assert [(o.color, o.shape) for o in objects] == [(c, s) for n, c, s in spec.groups for _ in range(n)]
        for o in objects:
            assert lo <= o.side <= hi
            assert MARGIN <= o.x and o.x + o.side <= size - MARGIN and MARGIN <= o.y and o.y + o.side <= size - MARGIN
        for a, b in itertools.combinations(objects, 2):  # bounding boxes >= MARGIN px apart on some axis
            assert (a.x + a.side + MARGIN <= b.x or b.x + b.side + MARGIN <= a.x
                    or a.y + a.side + MARGIN <= b.y or b.y + b.side + MARGIN <= a.y)
        if spec.relation is not None:
            axis = 0 if spec.relation in ("left of", "right of") else 1
            c1 = [_pixel_centroid(o)[axis] for o in objects if o.group == 0]
            c2 = [_pixel_centroid(o)[axis] for o in objects if o.group == 1]
            gap = min(c2) - max(c1) if spec.relation in ("left of", "above") else min(c1) - max(c2)
            assert gap >= relation_margin(size) - 0.5, (prompt, gap)
        image = draw(objects, size)  # exact pixel counts per colour: objects do not overlap
        for color in COLOR_NAMES:
            expected = sum(int(shape_mask(o.shape, o.side).sum()) for o in objects if o.color == color)
            assert int((image == COLORS[color]).all(-1).sum()) == expected


def test_tidy_layout_is_canonical_with_jitter():
    """Tidy layouts (the pretraining data's): one side for all objects, each group in the relation's half, a row or
    a column evenly spaced, jittered by at most size // 32 px per axis; seeded; every prompt at 32-64 px is valid."""
    from fastvideo.toyworld.scenes import LAYOUT_STYLES, tidy_layout

    assert LAYOUT_STYLES == ("random", "tidy")
    for size in (32, 48, 64):
        lo, hi = side_range(size)
        for i, prompt in enumerate(all_prompts()):
            objects = tidy_layout(prompt, size, seed=i)  # raises if a prompt has no valid tidy layout
            assert {o.side for o in objects} == {lo + (hi - lo) // 2}
    prompt = "two red circles left of a blue square"
    objects = layout(prompt, 64, seed=0, style="tidy")
    assert all(o.x + o.side / 2 < 32 for o in objects if o.group == 0)
    assert all(o.x + o.side / 2 >= 32 for o in objects if o.group == 1)
    xs = {frozenset((o.x, o.y) for o in layout(prompt, 64, seed, style="tidy")) for seed in range(20)}
    assert len(xs) > 10  # jittered
    jitter = [abs(o.y + o.side / 2 - c) for seed in range(20) for o, c in
              zip(layout(prompt, 64, seed, style="tidy")[:2], (16, 48))]
    assert max(jitter) <= 2 + 0.5  # rows at 1/4 and 3/4 of the height, +-2 px at 64 px
    assert render_prompt(prompt, 64, 3, style="tidy").tobytes() == render_prompt(prompt, 64, 3, "tidy").tobytes()
    assert render_prompt(prompt, 64, 3, style="tidy").tobytes() != render_prompt(prompt, 64, 3).tobytes()
    with pytest.raises(ValueError, match="unknown layout style 'neat'.*random"):
        layout(prompt, 64, style="neat")
    sample = _sample(200, seed=7)  # the verifier judges tidy ground truth correct, as it does random layouts
    assert score_batch(render_batch(sample, 48, list(range(200)), "tidy"), sample)["strict"].min() == 1.0


def test_render_batch_and_bad_inputs():
    prompts = ["a red circle", "two blue squares"]
    batch = render_batch(prompts, 48, seeds=[0, 1])
    assert batch.shape == (2, 3, 48, 48) and batch.dtype == torch.float32
    assert 0 <= batch.min() and batch.max() <= 1
    torch.testing.assert_close(batch[1], to_tensor(render_prompt(prompts[1], 48, 1)))
    assert torch.equal(render_batch(prompts, 48, seeds=5)[0], to_tensor(render_prompt(prompts[0], 48, 5)))
    with pytest.raises(ValueError, match="one seed per prompt"):
        render_batch(prompts, 48, seeds=[0])
    with pytest.raises(ValueError, match=r"size must be an integer in \[32, 64\]"):
        render_prompt("a red circle", 16)


def test_layout_gives_up_with_a_value_error(monkeypatch):
    from fastvideo.toyworld import scenes

    monkeypatch.setattr(scenes, "_LAYOUT_BATCH", 1)
    monkeypatch.setattr(scenes, "_LAYOUT_ROUNDS", 1)
    prompts = [p for p in all_prompts() if parse_prompt(p).num_objects == 4][:50]
    with pytest.raises(ValueError, match="no valid layout.*larger image size"):
        for seed, prompt in enumerate(prompts):
            layout(prompt, 32, seed)


# ----------------------------------------------------------------------------------------------- verifier
def _strict_accuracy(prompts: list[str], images: torch.Tensor) -> float:
    return float(score_batch(images, prompts)["strict"].mean())


@pytest.mark.parametrize("size", [32, 48, 64])
def test_ground_truth_is_judged_correct(size):
    prompts = _sample(400, seed=size)
    images = render_batch(prompts, size, seeds=list(range(len(prompts))))
    scores = score_batch(images, prompts)
    assert set(scores) == set(SCORE_KEYS)
    for key in SCORE_KEYS:  # measured: 1.0 on every one of the 2628 prompts at 32, 48 and 64 px
        assert scores[key].min() == 1.0, (key, [p for p, s in zip(prompts, scores[key]) if s < 1][:3])


@pytest.mark.parametrize("size", [32, 64])
def test_ground_truth_after_blur_and_noise(size):
    prompts = _sample(400, seed=100 + size)
    images = render_batch(prompts, size, seeds=list(range(len(prompts))))
    # measured over all 2628 prompts: strict 1.000 for sigma 0.7 (noise 0.02 or 0.04) and sigma 1.0 at 32..64 px
    assert _strict_accuracy(prompts, _blur_noise(images, 0.7, 0.02)) == 1.0
    assert _strict_accuracy(prompts, _blur_noise(images, 1.0, 0.02, seed=1)) >= 0.99


def test_score_image_formats_and_specks():
    prompt = "three green triangles above a yellow square"
    image = render_prompt(prompt, 64, seed=7)
    assert score_image(image, prompt) == score_image(to_tensor(image), prompt) == {k: 1.0 for k in SCORE_KEYS}
    specked = image.copy()
    rng = np.random.default_rng(0)
    for _ in range(20):  # 3x3 specks of a prompt colour on the background are below the minimum area
        y, x = rng.integers(0, 61, size=2)
        if (specked[y:y + 3, x:x + 3] == image[0, 0]).all():
            specked[y:y + 3, x:x + 3] = COLORS["green"]
    assert (specked != image).any()
    assert score_image(specked, prompt)["strict"] == 1.0
    blank = draw([], 64)
    assert detect_objects(blank) == [[]]
    assert score_image(blank, prompt) == {"score": 0.0, "strict": 0.0, "color": 0.0, "shape": 0.0, "count": 0.0,
                                          "position": 0.0}
    assert score_image(blank, "a red circle")["position"] == 1.0  # no relation asked
    with pytest.raises(ValueError, match="one prompt per image"):
        score_batch(to_tensor(image)[None], [prompt, prompt])
    with pytest.raises(ValueError, match="cannot parse"):
        score_image(image, "a cat")


def _corrupt(spec: SceneSpec, kind: str, rng: np.random.Generator) -> SceneSpec | None:
    """A spec that differs from ``spec`` in one way (None: render an empty image)."""
    groups = [list(g) for g in spec.groups]
    i = int(rng.integers(len(groups)))
    if kind == "color":
        used = {g[1] for g in groups}
        groups[i][1] = str(rng.choice([c for c in COLOR_NAMES if c not in used]))
    elif kind == "shape":
        groups[i][2] = str(rng.choice([s for s in SHAPES if s != groups[i][2]]))
    elif kind == "count":
        many = [j for j, g in enumerate(groups) if g[0] > 1]
        if many:
            groups[many[int(rng.integers(len(many)))]][0] -= 1
        elif len(groups) == 2:  # both single: drop one group
            return SceneSpec((tuple(groups[1 - i]),))
        else:
            return None
    elif kind == "position":
        return SceneSpec(spec.groups, OPPOSITE[spec.relation])
    return SceneSpec(tuple(tuple(g) for g in groups), spec.relation)


@pytest.mark.parametrize("kind, key", [("color", "color"), ("shape", "shape"), ("count", "count"),
                                       ("position", "position")])
def test_corruptions_are_caught(kind, key):
    rng = np.random.default_rng(0)
    prompts = [p for p in _sample(600, seed=7) if kind != "position" or parse_prompt(p).relation][:300]
    images = []
    for seed, prompt in enumerate(prompts):
        wrong = _corrupt(parse_prompt(prompt), kind, rng)
        images.append(to_tensor(draw([], 64) if wrong is None else render(wrong, 64, seed)))
    images = torch.stack(images)
    # measured on all prompts at 32 and 64 px: 0 corrupted images judged correct, sharp and blurred (sigma 0.7, 1.0)
    for batch in (images, _blur_noise(images, 0.7, 0.02)):
        scores = score_batch(batch, prompts)
        assert scores["strict"].max() == 0.0
        assert scores[key].max() < 1.0


# ----------------------------------------------------------------------------------------------- reward registry
def test_toyworld_reward_in_registry():
    from fastvideo.rewards import REWARD_NAMES, build_reward

    assert "toyworld" in REWARD_NAMES
    prompts = ["two red circles left of a blue square", "a yellow triangle", "a green circle below two red squares"]
    images = render_batch(prompts, 64, seeds=[0, 1, 2])
    images[2] = to_tensor(render_prompt("a green circle above two red squares", 64, 2))  # position wrong
    out = build_reward("toyworld:1.0", "cpu")(images, prompts)
    assert list(out) == ["total", "toyworld", "toyworld_strict", "toyworld_color", "toyworld_shape",
                         "toyworld_count", "toyworld_position"]
    for value in out.values():
        assert value.shape == (3,) and value.dtype == torch.float32 and value.device.type == "cpu"
    torch.testing.assert_close(out["total"], out["toyworld"])
    torch.testing.assert_close(out["toyworld"], torch.tensor([1.0, 1.0, 0.75]))
    torch.testing.assert_close(out["toyworld_strict"], torch.tensor([1.0, 1.0, 0.0]))
    torch.testing.assert_close(out["toyworld_position"], torch.tensor([1.0, 1.0, 0.0]))

    mixed = build_reward("toyworld:2.0,jpeg_compressibility:0.5", "cpu")(images, prompts)
    torch.testing.assert_close(mixed["total"], 2.0 * mixed["toyworld"] + 0.5 * mixed["jpeg_compressibility"])
    chunked = build_reward("toyworld:2.0,jpeg_compressibility:0.5", "cpu", batch_size=2)(images, prompts)
    assert list(chunked) == list(mixed) and all(torch.equal(chunked[k], mixed[k]) for k in mixed)  # dict scorer too
    assert "toyworld_strict" in mixed and "jpeg_compressibility" in mixed


def test_toyworld_strict_reward_trains_on_the_strict_check_alone():
    """``toyworld_strict`` (the GRPO demo's training reward, beside ``toyworld`` at weight 0) is 1 only when every
    check passes; the total is the strict check while the logs keep the mean and each check."""
    from fastvideo.rewards import REWARD_NAMES, build_reward, check_reward_prompts

    assert "toyworld_strict" in REWARD_NAMES
    prompts = ["two red circles left of a blue square", "a yellow triangle", "a green circle below two red squares",
               "a blue circle above a green square"]
    images = render_batch(prompts, 32, seeds=[0, 1, 2, 3])
    images[2] = to_tensor(render_prompt("a green circle above two red squares", 32, 2))  # position wrong
    images[3] = to_tensor(render_prompt("a blue square above a green circle", 32, 3))  # shapes swapped
    alone = build_reward("toyworld_strict:1.0", "cpu")(images, prompts)
    assert list(alone) == ["total", "toyworld_strict"]
    torch.testing.assert_close(alone["total"], torch.tensor([1.0, 1.0, 0.0, 0.0]))
    demo = build_reward("toyworld:0.0,toyworld_strict:1.0", "cpu")(images, prompts)
    assert list(demo) == ["total", "toyworld", "toyworld_strict", "toyworld_color", "toyworld_shape",
                          "toyworld_count", "toyworld_position"]
    assert torch.equal(demo["total"], alone["total"]) and torch.equal(demo["toyworld_strict"], alone["total"])
    torch.testing.assert_close(demo["toyworld"], torch.tensor([1.0, 1.0, 0.75, 0.75]))  # the mean, logged, untrained
    with pytest.raises(ValueError, match="toy-world prompts only.*line 2: 'a cat'"):
        check_reward_prompts("toyworld_strict:1.0", ["a red circle", "a cat"], "--data_json_path d")


def test_toyworld_reward_errors():
    from fastvideo.rewards import build_reward

    fn = build_reward("toyworld", "cpu")
    images = render_batch(["a red circle", "a blue square"], 32, seeds=0)
    with pytest.raises(ValueError, match="toy-world prompts only.*cannot parse toy-world prompt 'a bowl of ramen'"):
        fn(images, ["a red circle", "a bowl of ramen"])
    strict = build_reward("toyworld_strict", "cpu")  # the strict reward's errors name it
    with pytest.raises(ValueError, match="reward 'toyworld_strict' scores toy-world prompts only.*'a bowl of ramen'"):
        strict(images, ["a red circle", "a bowl of ramen"])
    images[1, 0, 3, 3] = float("nan")
    with pytest.raises(ValueError, match="'toyworld'.*'a blue square'.*NaN"):
        fn(images, ["a red circle", "a blue square"])


def test_reward_prompt_check_names_bad_lines():
    from fastvideo.rewards import check_reward_prompts

    check_reward_prompts("toyworld:1.0", list(all_prompts()[:50]), "--data_json_path d")
    check_reward_prompts("jpeg_compressibility:1.0", ["a cat"], "--data_json_path d")  # other rewards take anything
    with pytest.raises(ValueError, match=r"--data_json_path d: .* 1 of 3 prompts are not \(line 2: 'a cat'\)"):
        check_reward_prompts("jpeg_compressibility:0.5,toyworld:1.0", ["a red circle", "a cat", "two blue squares"],
                             "--data_json_path d")
    with pytest.raises(ValueError, match=r"--data_json_path d: reward 'toyworld_strict' scores toy-world prompts only"):
        check_reward_prompts("toyworld_strict:1.0", ["a red circle", "a cat"], "--data_json_path d")


# ----------------------------------------------------------------------------------------------- failure modes
def test_failure_modes_name_the_prompt_a_wrong_image_satisfies():
    """A render of each near miss (the groups' colours, shapes or counts exchanged, the relation reversed) is named
    as that failure against the original prompt, over many prompts and both layouts; the prompt's own render is
    "right", an empty image "other"; single-group prompts have no near miss."""
    from fastvideo.toyworld.verify import FAILURE_MODES, _near_misses, failure_modes

    def distinct(spec: SceneSpec) -> bool:  # two groups of one shape and count: a colour swap is the flipped scene
        return spec.relation is not None and spec.groups[0][::2] != spec.groups[1][::2]

    two_groups = [p for p in _sample(200, seed=3) if distinct(parse_prompt(p))][:40]
    images, prompts, expected = [], [], []
    for i, prompt in enumerate(two_groups):
        spec = parse_prompt(prompt)
        misses = _near_misses(spec)
        assert [m for m, _ in misses] == [m for m in FAILURE_MODES[1:-1] if m in dict(misses)]
        for mode, other in [("right", spec), *misses]:
            images.append(render(other, 32, i, "tidy" if i % 2 else "random"))
            prompts.append(prompt)
            expected.append(mode)
    images.append(np.full((32, 32, 3), 255, np.uint8))  # the background alone
    prompts.append(two_groups[0])
    expected.append("other")
    got = failure_modes(np.stack(images), prompts)
    assert got == expected
    assert {"colour swap", "shape swap", "count swap", "relation flipped"} <= set(got)
    assert _near_misses(parse_prompt("two red circles")) == []
    same = "a red circle left of a blue circle"
    assert failure_modes(render_prompt("a red circle right of a blue circle", 32), [same]) == ["colour swap"]
    assert failure_modes(render_prompt("a red circle", 32), ["a red circle"]) == ["right"]
    assert failure_modes(render_prompt("a blue circle", 32), ["a red circle"]) == ["other"]
    with pytest.raises(ValueError, match="2 images but 1 prompts"):
        failure_modes(np.stack(images[:2]), prompts[:1])


def test_pair_of_names_the_pair_its_split_and_its_colour_swap():
    """`failures --by_pair` groups images by the prompt's object pair: held-out or training pair, and whether the same
    four words bound the other way (the colour-swapped pair) are a training pair."""
    from fastvideo.toyworld.__main__ import _pair_of

    swap_train = ("blue triangle + green circle", "held-out, swap train")
    assert _pair_of("a blue triangle left of a green circle") == swap_train
    assert _pair_of("two red squares above a blue circle") == ("blue circle + red square", "held-out, swap held-out")
    assert _pair_of("a red circle below a green circle") == ("green circle + red circle", "held-out, one shape")
    assert _pair_of("a red triangle right of a blue square") == ("blue square + red triangle", "train, swap train")
    assert _pair_of("three yellow circles") == ("one group", "")


def test_failures_cli_tables_sample_folders(tmp_path):
    """`python -m fastvideo.toyworld failures A B` reads sample.py's index.jsonl and images and prints each mode's
    share per folder; a folder without index.jsonl is a one-line error naming what to pass."""
    import json
    import subprocess
    import sys

    from PIL import Image

    from helpers import REPO

    prompt = "a red circle left of two blue squares"
    swapped = "a blue circle left of two red squares"
    for name, drawn in (("base", [swapped, swapped, prompt, "a green triangle"]), ("final", [prompt] * 3 + [swapped])):
        (tmp_path / name / "images").mkdir(parents=True)
        rows = []
        for i, text in enumerate(drawn):
            path = f"images/p{i:06d}-s000.png"
            Image.fromarray(render_prompt(text, 32, i)).save(tmp_path / name / path)
            rows.append({"prompt_id": i, "sample_index": 0, "prompt": prompt, "path": path})
        (tmp_path / name / "index.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = [sys.executable, "-m", "fastvideo.toyworld", "failures", str(tmp_path / "base"), str(tmp_path / "final")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    table = {line.rsplit(None, 2)[0]: [float(v) for v in line.split()[-2:]] for line in proc.stdout.splitlines()
             if line[:1].isalpha() and not line.startswith("share")}
    assert table["right"] == [0.25, 0.75] and table["colour swap"] == [0.5, 0.25]
    assert table["other"] == [0.25, 0.0] and table["shape swap"] == [0.0, 0.0]
    assert f"[1] {tmp_path / 'base'} (4 images)" in proc.stdout
    assert "share right by object pair" not in proc.stdout
    by_pair = subprocess.run([*cmd, "--by_pair"], cwd=REPO, capture_output=True, text=True)
    assert by_pair.returncode == 0 and by_pair.stdout.startswith(proc.stdout), by_pair.stderr
    assert by_pair.stdout.splitlines()[-1].split() == ["blue", "square", "+", "red", "circle", "held-out,", "swap",
                                                       "held-out", "0.250", "(4)", "0.750", "(4)"]
    proc = subprocess.run([*cmd[:4], str(tmp_path / "missing")], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 1 and "index.jsonl not found: pass folders sample.py wrote" in proc.stderr
