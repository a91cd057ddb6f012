"""The GenEval bench and rewards without weights (fastvideo/bench): prompts parsed back into GenEval records, the
toy-world agreement of GenEval's rules with the toy verifier, the detectors and colour head on tiny random
transformers folders (batching, queries, box frames), ``python -m fastvideo.bench geneval`` end to end on a tiny
FLUX.1 (files, task names, the rules re-applied to the stored detections, --compare, bad input), and the ``geneval``
reward through the registry and served by fastvideo.rewards.serve. Default tier, ~40 s here (the tiny folders are built
once per module)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from fastvideo.bench import geneval as G
from fastvideo.bench import geneval_rules as R


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """owlv2-tiny, grounding-dino-tiny and clip-tiny, built by fastvideo.tiny's CLI (seed 0)."""
    from fastvideo import tiny

    root = tmp_path_factory.mktemp("bench-models")
    for preset in ("owlv2-tiny", "grounding-dino-tiny", "clip-tiny"):
        tiny.main(["--preset", preset, "--out", str(root / preset)])
    return {p: root / p for p in ("owlv2-tiny", "grounding-dino-tiny", "clip-tiny")}


def test_every_suite_prompt_parses_back_to_its_record_and_others_are_refused():
    for record in R.suite():
        assert R.parse_prompt(record["prompt"]) == record
    assert R.parse_prompt("a photo of an orange orange")["include"] == [{"class": "orange", "count": 1,
                                                                       "color": "orange"}]
    assert R.parse_prompt("a photo of a hot dog")["include"] == [{"class": "hot dog", "count": 1}]
    for text in ("a photo of a dragon", "a red cat", "a photo of one cat", "a photo of a cat left of a"):
        assert R.parse_prompt(text) is None
    with pytest.raises(ValueError, match=r"prompt 1 'a red cat' is not written by GenEval's templates"):
        G.records_for(["a photo of a cat", "a red cat"], "here")
    assert R.record_classes(R.parse_prompt("a photo of three dogs")) == ["dog"]


def test_geneval_rules_agree_with_the_toy_verifier():
    """On tidy toy scenes of GenEval's prompt shapes (324 prompts, 1,308 images): ground truth passes both checks and
    every corruption fails both, except one more object on a one-object prompt, which GenEval's colour task accepts
    (it asks for at least one) and the toy check refuses (exactly one): 12 images, and no other disagreement."""
    from fastvideo.bench import toy_check

    result = toy_check.agreement(style="tidy")
    cases = result["cases"]
    assert result["prompts"] == 324 and cases["ground truth"] == {"images": 324, "geneval_correct": 324,
                                                                  "toy_strict": 324, "agree": 324}
    for kind, c in cases.items():
        if kind not in ("ground truth", "one more"):
            assert c["geneval_correct"] == c["toy_strict"] == 0 and c["agree"] == c["images"] > 0, kind
    assert cases["one more"] == {"images": 24, "geneval_correct": 12, "toy_strict": 0, "agree": 12}
    assert result["agreement"] == pytest.approx(1296 / 1308)


def test_detectors_batch_and_query_as_documented(tiny_models):
    from fastvideo.bench.detect import ClipColours, Detection, crop, detector_kind, load_detector

    images = torch.rand(3, 3, 48, 64, generator=torch.Generator().manual_seed(0))
    classes = [["cat", "dog"], ["traffic light"], ["hot dog", "cup", "dog"]]
    for preset in ("owlv2-tiny", "grounding-dino-tiny"):
        one = load_detector(tiny_models[preset], torch.device("cpu"), batch_size=3)(images, classes)
        two = load_detector(tiny_models[preset], torch.device("cpu"), batch_size=2)(images, classes)
        assert [{k: [d.box for d in v] for k, v in x.items()} for x in one] == \
               [{k: [d.box for d in v] for k, v in x.items()} for x in two]  # batching does not change boxes
        for found, asked in zip(one, classes):
            assert found and all(0 <= d.score <= 1 for v in found.values() for d in v)
            if preset == "grounding-dino-tiny":  # only the record's classes are asked for
                assert set(found) <= set(asked)
            else:  # every box takes one of the 80 classes; boxes are in the padded square's pixels (64)
                assert set(found) <= set(R.OBJECTS)
                assert all(-64 <= c <= 128 for v in found.values() for d in v for c in d.box)
    assert detector_kind(tiny_models["owlv2-tiny"]) == "owlv2"
    with pytest.raises(ValueError, match="--detector grounding-dino but --detector_path"):
        load_detector(tiny_models["owlv2-tiny"], torch.device("cpu"), kind="grounding-dino")
    with pytest.raises(ValueError, match="holds a 'clip' model"):
        detector_kind(tiny_models["clip-tiny"])
    picture = torch.zeros(3, 20, 30)
    picture[0, 5:10, 10:20] = 1.0
    assert crop(picture, Detection((9.6, 4.6, 19.6, 10.4), 1.0)).shape == (3, 5, 10)  # PIL's rounding
    masked = crop(picture, Detection((0, 0, 30, 20), 1.0, mask=picture[0] > 0.5))
    assert masked[:, 0, 0].tolist() == pytest.approx([153 / 255] * 3) and masked[0, 6, 12] == 1.0  # #999 outside
    colours = ClipColours(tiny_models["clip-tiny"], torch.device("cpu"))
    crops = [crop(images[0], Detection((0, 0, 20, 20), 1.0)), crop(images[1], Detection((10, 5, 40, 30), 1.0))]
    named = colours(crops, ["cat", "dog"])
    assert all(c in R.COLORS for c in named) and named == colours(crops[::-1], ["dog", "cat"])[::-1]


def _bench(argv: list[str]) -> dict:
    from fastvideo.bench import cli

    return cli.main(["geneval", *argv])


def test_bench_end_to_end_on_a_tiny_flux(tiny_flux_dir, tiny_models, tiny_preset, tmp_path, capsys):
    common = ["--pretrained_model_name_or_path", str(tiny_flux_dir), "--detector_path",
              str(tiny_models["owlv2-tiny"]), "--clip_path", str(tiny_models["clip-tiny"]), "--per_task", "2",
              "--num_images_per_prompt", "2", "--num_inference_steps", "2", "--h", "64", "--w", "64",
              "--threshold", "0.05", "--counting_threshold", "0.1", "--detector_batch_size", "5"]
    summary = _bench([*common, "--output_dir", str(tmp_path / "a")])
    out = tmp_path / "a"
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 24 and [r["tag"] for r in rows[::4]] == list(R.TASKS)
    assert json.loads((out / "summary.json").read_text()) == summary
    assert set(summary) >= {*R.TASKS, "overall", "by_key"} and summary["num_images"] == 24
    for row in rows:  # the stored detections and colours give the stored scores under GenEval's rules
        record = R.parse_prompt(row["prompt"])
        kept = {k: [R.Detection(tuple(d["box"]), d["score"]) for d in v] for k, v in row["detections"].items() if v}
        colour = {(k, tuple(d["box"])): d.get("color") for k, v in row["detections"].items() for d in v}
        assert (out / "samples" / row["path"]).is_file() and row["prompt"] == record["prompt"]
        correct, reason = R.evaluate(record, kept, lambda d, name: colour[(name, d.box)])
        strict, partial = R.reward(record, kept, lambda d, name: colour[(name, d.box)])
        assert (float(correct), reason, float(strict)) == (row["correct"], row["reason"], row["strict"])
        assert partial == pytest.approx(row["partial"])
    for task in R.TASKS:
        assert summary[task]["score"] == pytest.approx(sum(r["correct"] for r in rows if r["tag"] == task) / 4)
    assert summary["overall"]["score"] == pytest.approx(sum(summary[t]["score"] for t in R.TASKS) / 6)
    assert (out / "prompts.txt").read_text().count("\n") == 12
    # compared with a base that got every image right (the same images, its results rewritten): the paired
    # difference is this - base = score - 1 per task, negative wherever this model missed (a swapped comparison would
    # read 1 - score)
    perfect = tmp_path / "perfect"
    shutil.copytree(out, perfect)
    (perfect / "results.jsonl").write_text("".join(json.dumps({**r, "correct": 1.0}) + "\n" for r in rows))
    _bench([*common, "--output_dir", str(tmp_path / "b"), "--compare", str(perfect)])
    paired = json.loads((tmp_path / "b" / "compare.json").read_text())["tasks"]
    assert set(paired) == {*R.TASKS, "overall"}
    for task in R.TASKS:
        assert (paired[task]["base"], paired[task]["this"]) == (1.0, pytest.approx(summary[task]["score"]))
        assert paired[task]["difference"] == pytest.approx(summary[task]["score"] - 1), (task, paired[task])
    assert f"base 1.0000 -> {summary['overall']['score']:.4f}" in capsys.readouterr().out
    assert paired["overall"]["difference"] == pytest.approx(summary["overall"]["score"] - 1)
    assert paired["overall"]["difference"] < 0, summary["overall"]
    # bad input: one line, exit status 2, nothing sampled
    for argv, message in ((common[:2] + ["--output_dir", str(tmp_path / "c")], "needs --detector_path"),
                          ([*common, "--output_dir", str(out)], "already holds a bench"),
                          ([*common, "--output_dir", str(tmp_path / "d"), "--detector", "grounding-dino"],
                           "--detector grounding-dino but"),
                          ([*common, "--output_dir", str(tmp_path / "e"), "--compare", str(tmp_path)],
                           "no results.jsonl there"),
                          ([*common, "--output_dir", str(tmp_path / "f"), "--threshold", "2"], "--threshold must be")):
        with pytest.raises(SystemExit) as exit_info:
            _bench(argv)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "c" / "samples").exists()
    kontext = tiny_preset("flux-kontext-tiny")
    with pytest.raises(SystemExit):
        _bench(["--pretrained_model_name_or_path", str(kontext), *common[2:], "--output_dir", str(tmp_path / "g")])
    assert "is an image-editing model; GenEval scores text-to-image models" in capsys.readouterr().err


def test_list_prompts_prints_the_553(capsys, tmp_path):
    _bench(["--list_prompts"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 553 and lines[0] == R.suite()[0]["prompt"]
    meta = tmp_path / "evaluation_metadata.jsonl"
    meta.write_text("".join(json.dumps(r) + "\n" for r in R.suite()[80:83]))
    _bench(["--list_prompts", "--prompts_file", str(meta)])
    assert capsys.readouterr().out.splitlines() == [r["prompt"] for r in R.suite()[80:83]]


def test_geneval_reward_through_the_registry(tiny_models):
    from fastvideo.rewards import build_reward, check_reward_paths, check_reward_prompts

    paths = {"geneval_detector_path": str(tiny_models["grounding-dino-tiny"]),
             "geneval_clip_path": str(tiny_models["clip-tiny"])}
    check_reward_paths("geneval:1.0", **paths)
    with pytest.raises(FileNotFoundError, match="--geneval_detector_path"):
        check_reward_paths("geneval:1.0", geneval_clip_path=paths["geneval_clip_path"])
    prompts = ["a photo of two dogs", "a photo of a red cup and a blue clock"]
    check_reward_prompts("geneval:1.0", prompts, "--prompts p.txt")
    with pytest.raises(ValueError, match="--prompts p.txt: .*'a cat' is not written by GenEval's templates"):
        check_reward_prompts("geneval:1.0", ["a cat"], "--prompts p.txt")
    with pytest.raises(ValueError, match="'a cat' is not written by GenEval's templates"):
        check_reward_prompts("geneval_vqa:http://127.0.0.1:9:1.0", ["a cat"], "--prompts p.txt")
    reward = build_reward("geneval:2.0", torch.device("cpu"), **paths)
    images = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    out = reward(images, prompts)
    assert set(out) == {"total", "geneval", "geneval_strict", "geneval_correct"}
    rows = _scorer(paths).score(images, G.records_for(prompts, "t"))  # the same folders loaded again
    assert out["geneval"].tolist() == pytest.approx([r["partial"] for r in rows])
    assert out["geneval_strict"].tolist() == [r["strict"] for r in rows]
    assert torch.equal(out["total"], 2 * out["geneval"])


def _scorer(paths: dict[str, str]) -> G.DetectorScorer:
    from fastvideo.bench.detect import ClipColours, load_detector

    return G.DetectorScorer(load_detector(paths["geneval_detector_path"], torch.device("cpu")),
                            ClipColours(paths["geneval_clip_path"], torch.device("cpu")))


def test_memory_plan_counts_the_geneval_reward_models(tiny_models, tiny_flux_dir):
    """--dry_run's plan holds the detector's and the colour head's fp32 weights, counted from their configs on the
    meta device; the count equals the loaded models' own."""
    from transformers import CLIPModel, Owlv2ForObjectDetection

    from fastvideo.memory import plan_grpo
    from fastvideo.objectives import parse_grpo_args, validate_grpo

    args = parse_grpo_args(["--pretrained_model_name_or_path", str(tiny_flux_dir), "--dry_run", "--h", "64", "--w",
                            "64", "--prompts_per_step", "16", "--num_generations", "2", "--reward", "geneval:1.0",
                            "--geneval_detector_path", str(tiny_models["owlv2-tiny"]),
                            "--geneval_clip_path", str(tiny_models["clip-tiny"])])
    plan = plan_grpo(args, validate_grpo(args, 8), 8, "cuda")
    item = next(i for i in plan.items if i.name == "reward model geneval (fp32, frozen)")
    loaded = sum(sum(p.numel() for p in cls.from_pretrained(tiny_models[name]).parameters())
                 for cls, name in ((Owlv2ForObjectDetection, "owlv2-tiny"), (CLIPModel, "clip-tiny")))
    assert item.device == 4 * loaded


def test_geneval_reward_served_equals_local(tiny_models):
    """``python -m fastvideo.rewards.serve --reward geneval ...`` (a real server process on 127.0.0.1) scores what
    the in-process reward scores, every logged key, bit for bit."""
    pytest.importorskip("fastapi")
    from fastvideo.rewards import build_reward
    from fastvideo.rewards.serve import launch

    paths = {"geneval_detector_path": str(tiny_models["owlv2-tiny"]),
             "geneval_clip_path": str(tiny_models["clip-tiny"])}
    prompts = ["a photo of a cat", "a photo of three cups", "a photo of a red cup and a blue clock",
               "a photo of a dog below a bench"]
    images = torch.rand(4, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    local = build_reward("geneval", **paths)(images, prompts)
    with launch(["--reward", "geneval", "--device", "cpu", "--max_wait_ms", "0",
                 *[f for k, v in paths.items() for f in (f"--{k}", v)]],
                env={"OMP_NUM_THREADS": str(torch.get_num_threads())}) as server:
        remote = build_reward(f"remote:{server.url}")(images, prompts)
    assert set(local) == {"total", "geneval", "geneval_strict", "geneval_correct"}
    assert torch.equal(remote["remote"], local["total"])
    for key in ("geneval", "geneval_strict", "geneval_correct"):
        assert torch.equal(remote[f"remote_{key}"], local[key]), key
