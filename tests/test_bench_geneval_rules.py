"""GenEval's prompt suite and scoring rules (fastvideo/bench/geneval_rules.py) on synthetic detections: the suite
equals the published metadata's counts and records, the thresholds (strictly over 0.3; 0.9 on counting prompts),
the 16-per-class cap before NMS (off at 1.0), relative positions at their threshold, colour attribution on the best
``count`` detections, counting's exclude, Flow-GRPO's strict flag and partial score (with its negative count terms
and the position term it always adds), and the summary's task means. Default tier, < 1 s."""
from __future__ import annotations

import json

import pytest

from fastvideo.bench import geneval_rules as g

D = g.Detection


def colours(mapping: dict[tuple[float, ...], str]):
    """A colour classifier that reads each detection's colour from its box (what CLIP would say of its crop)."""
    return lambda det, name: mapping[det.box]


def test_the_generated_suite_is_genevals_published_one():
    """Counts per task and the first record of each task as prompts/evaluation_metadata.jsonl (djghosh13/geneval at
    d927da8) has them: 553 prompts, 80 / 99 / 80 / 94 / 100 / 100 after de-duplication; counting 26 x 2, 28 x 3,
    26 x 4; position relations 19 left of, 27 right of, 26 above, 28 below."""
    suite = g.suite()
    assert len(suite) == 553 and len({r["prompt"] for r in suite}) == 553
    counts = {t: sum(r["tag"] == t for r in suite) for t in g.TASKS}
    assert counts == {"single_object": 80, "two_object": 99, "counting": 80, "colors": 94, "position": 100,
                      "color_attr": 100}
    first = {t: next(r for r in suite if r["tag"] == t) for t in g.TASKS}
    assert first["single_object"] == {"tag": "single_object", "include": [{"class": "bench", "count": 1}],
                                      "prompt": "a photo of a bench"}
    assert first["two_object"]["prompt"] == "a photo of a bench and a sports ball"
    assert first["counting"] == {"tag": "counting", "include": [{"class": "clock", "count": 2}],
                                 "exclude": [{"class": "clock", "count": 3}], "prompt": "a photo of two clocks"}
    assert first["colors"]["prompt"] == "a photo of a blue fire hydrant"
    assert first["position"]["include"] == [{"class": "teddy bear", "count": 1},
                                            {"class": "dog", "count": 1, "position": ["right of", 0]}]
    assert first["position"]["prompt"] == "a photo of a dog right of a teddy bear"
    assert first["color_attr"]["prompt"] == "a photo of a purple wine glass and a black apple"
    numbers = [r["include"][0]["count"] for r in suite if r["tag"] == "counting"]
    assert [numbers.count(k) for k in (2, 3, 4)] == [26, 28, 26]
    relations = [r["include"][1]["position"][0] for r in suite if r["tag"] == "position"]
    assert [relations.count(p) for p in g.POSITIONS] == [19, 27, 26, 28]
    assert not any(i.get("color") and i["class"] == "person" for r in suite for i in r["include"])
    assert g.suite() == suite and g.suite(seed=1) != suite  # seeded


def test_read_metadata_takes_the_published_format_and_names_a_bad_line(tmp_path):
    path = tmp_path / "evaluation_metadata.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in g.suite()[:3]) + "\n")
    assert g.read_metadata(path) == g.suite()[:3]
    path.write_text(json.dumps(g.suite()[0]) + "\n" + json.dumps({"tag": "colors", "prompt": "x", "include": [
        {"class": "dog", "count": 1, "color": "teal"}]}) + "\n")
    with pytest.raises(ValueError, match=r"line 2: colour 'teal' is not one of red"):
        g.read_metadata(path)
    path.write_text('{"tag": "single_object", "prompt": "x", "include": [{"class": "unicorn", "count": 1}]}\n')
    with pytest.raises(ValueError, match=r"line 1: include item .* needs a GenEval class"):
        g.read_metadata(path)


def test_thresholds_cap_and_nms():
    dets = {"dog": [D((0, 0, 10, 10), 0.3), D((20, 0, 30, 10), 0.31), D((40, 0, 50, 10), 0.95)],
            "cat": [D((0, 0, 5, 5), 0.2)]}
    kept = g.keep_detections(dets, "single_object")
    assert [d.score for d in kept["dog"]] == [0.95, 0.31] and "cat" not in kept  # strictly over 0.3, best first
    assert [d.score for d in g.keep_detections(dets, "counting")["dog"]] == [0.95]  # 0.9 on a counting prompt
    many = {"dog": [D((i, 0, i + 1, 1), 0.5 + i / 100) for i in range(20)]}
    assert len(g.keep_detections(many, "two_object")["dog"]) == 16  # MAX_OBJECTS
    twins = {"dog": [D((0, 0, 10, 10), 0.9), D((1, 0, 11, 10), 0.8), D((30, 0, 40, 10), 0.7)]}
    assert len(g.keep_detections(twins, "single_object")["dog"]) == 3  # NMS off at its default overlap 1.0
    assert len(g.keep_detections(twins, "single_object", nms_threshold=0.5)["dog"]) == 2
    assert g.iou((0, 0, 9, 9), (0, 0, 9, 9)) == 1.0 and g.iou((0, 0, 9, 9), (10, 0, 19, 9)) == 0.0
    assert g.iou((0, 0, 9, 9), (5, 0, 14, 9)) == pytest.approx(50 / 150)  # pixel-inclusive areas


def test_ties_keep_the_detectors_order_and_float32_thresholds_are_kept():
    """The two deviations from GenEval's evaluate_images.py that docs/benchmarks.md states: boxes with bit-equal
    scores keep the detector's order (GenEval's unstable argsort, reversed, may not), and a score equal to
    float32(0.3) is kept (GenEval compares in float32, where it is not over the threshold)."""
    import numpy as np

    tied = {"dog": [D((i * 10, 0, i * 10 + 5, 5), 0.5) for i in range(5)] + [D((90, 0, 95, 5), 0.7)]}
    kept = g.keep_detections(tied, "two_object")["dog"]
    assert [d.box[0] for d in kept] == [90, 0, 10, 20, 30, 40]  # the best, then the tie in the detector's order
    assert [d.box[0] for d in g.keep_detections(tied, "two_object", max_objects=3)["dog"]] == [90, 0, 10]
    f32 = float(np.float32(0.3))
    assert f32 > 0.3 and not np.float32(f32) > np.float32(0.3)  # over 0.3 in float64, not in float32 (GenEval)
    assert [d.score for d in g.keep_detections({"dog": [D((0, 0, 5, 5), f32)]}, "single_object")["dog"]] == [f32]
    f32_count = float(np.float32(0.9))  # 0.89999998: under 0.9 in both precisions, dropped by both
    assert "dog" not in g.keep_detections({"dog": [D((0, 0, 5, 5), f32_count)]}, "counting")
    assert "dog" not in g.keep_detections({"dog": [D((0, 0, 5, 5), 0.3)]}, "single_object")  # 0.3 itself: not over


def test_relative_position_at_its_threshold():
    """Two 10 x 10 boxes on one row: the x offset shrinks by 0.1 x 20 = 2 px, so "left of" needs (|o| - 2) / |o| >
    0.5, i.e. centres more than 4 px apart; a diagonal offset holds both relations; overlap within the margin none."""
    b = (20, 0, 30, 10)
    assert g.relative_position((0, 0, 10, 10), b) == {"left of"}
    assert g.relative_position((16, 0, 26, 10), b) == set()  # 4 px: exactly 0.5, not beyond
    assert g.relative_position((15.8, 0, 25.8, 10), b) == {"left of"}  # 4.2 px: 0.52
    assert g.relative_position((40, 0, 50, 10), b) == {"right of"}
    assert g.relative_position((20, 30, 30, 40), b) == {"below"}  # image rows grow downwards
    assert g.relative_position((0, -20, 10, -10), b) == {"left of", "above"}  # (-18, -18) / 28.3: both 0.64
    assert g.relative_position((21, 1, 31, 11), b) == set()


def test_evaluate_is_genevals_correct():
    pos = {"tag": "position", "include": [{"class": "teddy bear", "count": 1},
                                          {"class": "dog", "count": 1, "position": ["right of", 0]}], "prompt": ""}
    bear, right, left = D((0, 0, 10, 10), 0.9), D((30, 0, 40, 10), 0.8), D((-30, 0, -20, 10), 0.95)
    assert g.evaluate(pos, {"teddy bear": [bear], "dog": [right]}, colours({}))[0]
    ok, reason = g.evaluate(pos, {"teddy bear": [bear], "dog": [left, right]}, colours({}))
    assert not ok and "expected dog right of target, found left of" in reason  # only the best dog is placed
    ok, reason = g.evaluate(pos, {"dog": [right]}, colours({}))
    assert not ok and "no target for dog" in reason
    attr = {"tag": "color_attr", "include": [{"class": "cup", "count": 1, "color": "red"},
                                             {"class": "apple", "count": 1, "color": "green"}], "prompt": ""}
    cup, cup2, apple = D((0, 0, 5, 5), 0.9), D((9, 9, 15, 15), 0.5), D((20, 0, 25, 5), 0.7)
    paint = colours({cup.box: "red", cup2.box: "blue", apple.box: "green"})
    assert g.evaluate(attr, {"cup": [cup, cup2], "apple": [apple]}, paint)[0]  # the second cup is not asked about
    ok, reason = g.evaluate(attr, {"cup": [cup2], "apple": [apple]}, paint)
    assert not ok and reason.startswith("expected red cup>=1, found 0 red")
    count = {"tag": "counting", "include": [{"class": "clock", "count": 2}],
             "exclude": [{"class": "clock", "count": 3}], "prompt": ""}
    clocks = [D((i * 20, 0, i * 20 + 10, 10), 0.95) for i in range(3)]
    assert g.evaluate(count, {"clock": clocks[:2]}, colours({}))[0]
    assert not g.evaluate(count, {"clock": clocks}, colours({}))[0]  # exactly two: three fail the exclude
    assert not g.evaluate(count, {"clock": clocks[:1]}, colours({}))[0]


def test_flow_grpos_reward_strict_and_partial():
    single = {"tag": "single_object", "include": [{"class": "dog", "count": 1}], "prompt": ""}
    dogs = [D((i * 20, 0, i * 20 + 10, 10), 0.9) for i in range(3)]
    assert g.reward(single, {"dog": dogs[:1]}, colours({})) == (True, 1.0)
    assert g.reward(single, {"dog": dogs}, colours({})) == (False, -1.0)  # 1 - |1 - 3| / 1: below zero
    assert g.evaluate(single, {"dog": dogs}, colours({}))[0]  # GenEval's correct counts at least one
    assert g.reward(single, {}, colours({})) == (False, 0.0)
    counting = {"tag": "counting", "include": [{"class": "dog", "count": 2}],
                "exclude": [{"class": "dog", "count": 3}], "prompt": ""}
    assert g.reward(counting, {"dog": dogs}, colours({})) == (False, 0.5)
    pos = {"tag": "position", "include": [{"class": "cat", "count": 1},
                                          {"class": "dog", "count": 1, "position": ["left of", 0]}], "prompt": ""}
    cat = D((40, 0, 50, 10), 0.9)
    assert g.reward(pos, {"cat": [cat], "dog": dogs[:1]}, colours({})) == (True, 1.0)
    # the wrong relation: terms [1, 1, 0, 1] (the position term 1 is added after the check, as there)
    assert g.reward(pos, {"cat": [cat], "dog": [D((60, 0, 70, 10), 0.9)]}, colours({})) == (False, 0.75)
    assert g.reward(pos, {"dog": dogs[:1]}, colours({})) == (False, pytest.approx(1 / 3))  # [0, 1, 0]: no target
    colour = {"tag": "colors", "include": [{"class": "dog", "count": 1, "color": "blue"}], "prompt": ""}
    paint = colours({d.box: c for d, c in zip(dogs, ("red", "blue", "blue"))})
    assert g.reward(colour, {"dog": dogs[:1]}, paint) == (False, 0.5)  # [1, 0]
    assert g.reward(colour, {"dog": dogs[1:2]}, paint) == (True, 1.0)
    assert g.reward(colour, {"dog": dogs[1:]}, paint) == (False, 0.0)  # [0, 0]: count off, colour not asked


def test_summary_is_the_mean_of_task_accuracies():
    results = ([{"tag": "single_object", "correct": True}] * 3 + [{"tag": "single_object", "correct": False}]
               + [{"tag": "counting", "correct": False}] * 4)
    summary = g.summarize(results)
    assert summary["single_object"]["score"] == 0.75 and summary["counting"]["score"] == 0.0
    assert summary["overall"]["score"] == pytest.approx(0.375) and summary["overall"]["n"] == 8
    low, high = summary["single_object"]["ci95"]
    assert low < 0.75 < high and summary["counting"]["ci95"] == [0.0, 0.0]
