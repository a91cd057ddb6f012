"""benchmarks/algorithms.py, the study of every objective on the toy world: its flag sets are valid trainer flags, its
summary arithmetic (t-intervals, cumulative TFLOPs from metrics.jsonl, the efficiency ratios against GRPO) on
synthetic curves with known answers, and its --smoke mode end to end through the demo launchers."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from helpers import REPO, toy_data_dir, validate_flags

sys.path.insert(0, str(REPO / "benchmarks"))
import algorithms as A  # noqa: E402


def test_every_objective_flag_set_is_accepted(tmp_path):
    """Each objective's published flags and each tuning candidate, over the toy-world demo's config files as its
    launcher passes them (with the study's --eval_reward), pass the trainer's validation; every objective has the same
    number of candidates (an equal tuning budget)."""
    from fastvideo import objectives as O

    trainers = {"grpo": (O.parse_grpo_args, O.validate_grpo), "dpo": (O.parse_dpo_args, O.validate_dpo),
                "nft": (O.parse_nft_args, O.validate_nft)}
    assert set(A.OBJECTIVES) == {"grpo", "grpo_guard", "grpo_dppo", "mixgrpo", "dpo", "nft", "awm"}
    assert len({len(A.candidates(n)) for n in A.OBJECTIVES}) == 1
    heldout = tmp_path / "heldout.json"
    heldout.write_text("{}")
    published = {}
    for name, objective in A.OBJECTIVES.items():
        parse, validate = trainers[objective.trainer]
        demo = ["--config", str(REPO / "scripts/demos/toyworld.yaml"),
                "--config", str(REPO / f"scripts/demos/{objective.trainer}_toyworld.yaml"),
                "--eval_prompts", str(heldout), "--eval_reward", A.EVAL_REWARD]
        for flags in (objective.published, *A.candidates(name)):
            argv = [*demo, *A.flag_list({**A.TRAIN_REWARD, **flags})]  # as the study launches them
            counts = validate_flags(tmp_path, parse, validate, *argv)
            assert counts["samples_per_step"] > 0, (name, flags)
            # the settings the study was measured with, whatever the demos' own (the GRPO and NFT demos train on
            # the strict check, the NFT demo 2 of 8 sigmas): the mean of the checks; tuned NFT and AWM 7 of 8 sigmas
            args = parse(["--pretrained_model_name_or_path", str(tmp_path / "model"), "--data_json_path",
                          str(tmp_path / "manifest.json"), *argv])
            assert args.reward == "toyworld:1.0", (name, flags)
            if objective.trainer == "nft" and flags is not objective.published:
                assert args.timestep_fraction == 0.99, (name, flags)
        published[name] = validate_flags(tmp_path, parse, validate, *demo, *A.flag_list(objective.published))
        assert "--learning_rate" in objective.published, name
    # the GRPO loss variants differ from clip only with more than one optimizer step per rollout
    assert all(published[n]["optimizer_steps_per_rollout"] >= 2 for n in ("grpo", "grpo_guard", "grpo_dppo"))
    assert published["mixgrpo"]["trained_timesteps"] == 2  # the window's steps
    assert {c["samples_per_step"] for c in published.values()} == {48}  # the published settings' common batch


def test_interval_is_the_student_t_one():
    mean, half = A.interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and half == pytest.approx(4.303 * 1.0 / math.sqrt(3))
    mean, half = A.interval([0.5])
    assert mean == 0.5 and math.isnan(half)


def _write_run(folder, rows, samples_per_step=10, nproc=2):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"batch_arithmetic": {"samples_per_step": samples_per_step}}))
    (folder / "run.json").write_text(json.dumps({"flags": {"--learning_rate": "1e-4"}, "nproc": nproc}))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_curve_accumulates_model_tflops_over_every_step(tmp_path):
    """TFLOPs = sum over steps of (tflops_rollout x time_rollout + tflops_train x time_train) x ranks, steps without an
    evaluation included; a step logged twice (a resumed run) counts once, its last row winning."""
    s, st = A.METRICS["strict"], A.METRICS["score"]
    rows = [{"step": 0, s: 0.0, st: 0.4, "eval/toyworld_clean": 0.5},
            {"step": 1, "tflops_rollout": 2.0, "time_rollout": 1.5, "tflops_train": 4.0, "time_train": 0.5,
             "time_elapsed": 2.0, s: 0.1, st: 0.5, "eval/toyworld_clean": 0.6},
            {"step": 2, "tflops_rollout": 9.0, "time_rollout": 9.0, "time_elapsed": 3.0},  # replaced below
            {"step": 2, "tflops_rollout": 2.0, "time_rollout": 1.0, "tflops_train": 4.0, "time_train": 1.0,
             "time_elapsed": 4.0},
            {"step": 3, "tflops_rollout": 1.0, "time_rollout": 2.0, "time_train": 0.3,  # no train FLOPs: no rate
             "time_elapsed": 6.0, s: 0.2, st: 0.6}]
    _write_run(tmp_path / "run", rows)
    c = A.curve(tmp_path / "run")
    assert c["step"] == [0, 1, 3] and c["samples"] == [0, 10, 30] and c["seconds"] == [0.0, 2.0, 6.0]
    # step 1: (3 + 2) x 2 ranks = 10; step 2: (2 + 4) x 2 = 12; step 3: 2 x 2 = 4
    assert c["tflops"] == pytest.approx([0.0, 10.0, 26.0])
    assert c["strict"] == [0.0, 0.1, 0.2] and c["clean"][:2] == [0.5, 0.6] and math.isnan(c["clean"][2])


def _curves(samples, *strict_per_seed, seconds_per_point=10.0, tflops_per_point=2.0):
    return [{"step": list(range(len(samples))), "samples": list(samples),
             "seconds": [i * seconds_per_point for i in range(len(samples))],
             "tflops": [i * tflops_per_point for i in range(len(samples))], "strict": list(y), "score": list(y)}
            for y in strict_per_seed]


def test_efficiency_against_grpo_on_known_curves():
    """GRPO reaches +0.02 at 200 samples, NFT at 100: 2x fewer samples; NFT's points take twice GRPO's seconds (20 s
    to the target either way: 1x) and a quarter of its TFLOPs (0.5 vs 4: 8x); gain per 1k samples 0.2 vs 0.1: 2x
    (every seed alike, so the bootstrap interval is [2, 2]); AWM never reaches it: a bound ("<"); step time ratio."""
    samples = [0, 100, 200, 300]
    summary = {
        "grpo/published": {"step_seconds": 2.0, "curves": _curves(samples, [0.0, 0.01, 0.02, 0.03],
                                                                 [0.1, 0.11, 0.12, 0.13])},
        "nft/published": {"step_seconds": 3.0, "curves": _curves(samples, [0.0, 0.03, 0.05, 0.06],
                                                                [0.0, 0.02, 0.04, 0.06], seconds_per_point=20.0,
                                                                tflops_per_point=0.5)},
        "awm/published": {"step_seconds": 1.0, "curves": _curves(samples, [0.0, 0.0, 0.01, 0.01],
                                                                [0.0, 0.0, 0.0, 0.01])},
    }
    eff = A.efficiency(summary, "strict", 0.02)
    nft, awm, grpo = eff["nft/published"], eff["awm/published"], eff["grpo/published"]
    assert grpo["reach"]["samples"]["x"] == 200 and nft["reach"]["samples"]["x"] == 100
    assert nft["reach"]["samples"]["speedup"] == {"kind": "=", "value": 2.0}
    assert nft["reach"]["seconds"]["speedup"] == {"kind": "=", "value": 1.0}  # 20 s vs 20 s
    assert nft["reach"]["tflops"]["speedup"]["value"] == pytest.approx(8.0)  # 4 TFLOP vs 0.5
    assert nft["rate"]["samples"]["mean"] == pytest.approx(0.2) and nft["rate"]["samples"]["ci95"] == 0.0
    assert nft["rate"]["samples"]["vs_ref"] == pytest.approx(2.0)
    assert (nft["rate"]["samples"]["vs_ref_low"], nft["rate"]["samples"]["vs_ref_high"]) == pytest.approx((2, 2))
    assert nft["step_seconds_vs_ref"] == 1.5
    # AWM: not reached in its 300 samples while GRPO needed 200: fewer than 200/300 times GRPO's speed
    assert awm["reach"]["samples"]["x"] is None
    assert awm["reach"]["samples"]["speedup"]["kind"] == "<"
    assert awm["reach"]["samples"]["speedup"]["value"] == pytest.approx(200 / 300)
    # a reference that never gains: no ratio of rates, and a lower bound where the other one reaches the target
    flat = {"grpo/tuned": {"step_seconds": 1.0, "curves": _curves(samples, [0.1] * 4, [0.1] * 4)},
            "nft/tuned": summary["nft/published"]}
    eff = A.efficiency(flat, "strict", 0.02)["nft/tuned"]
    assert math.isnan(eff["rate"]["samples"]["vs_ref"])
    assert eff["reach"]["samples"]["speedup"] == {"kind": ">", "value": 3.0}  # GRPO needs > 300, NFT 100


def test_ratio_interval_bootstraps_over_seeds():
    ratio, lo, hi = A.ratio_interval([2.0, 4.0], [1.0, 1.0])
    assert ratio == 3.0 and 2.0 <= lo <= 3.0 <= hi <= 4.0
    assert all(math.isnan(v) for v in A.ratio_interval([1.0], [0.0, -1.0]))


def _smoke(toy_world, tmp_path, objectives):
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "algorithms.py"), "--smoke", "--out", str(out),
                           "--data_dir", str(toy_data_dir(toy_world, tmp_path)), "--objectives", *objectives],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert sorted(results["runs"]) == sorted(f"{n}/published" for n in objectives)
    for key, r in results["runs"].items():
        assert r["steps"] == 2 and r["samples"] > 0 and r["seconds"] > 0 and r["tflops"] > 0, key
        assert [c["step"] for c in r["curves"]] == [[0, 1, 2]], key
        # every objective trains on one reward, the mean of the checks, whatever its demo's own (GRPO's: strict)
        run = out / "runs" / f"{key.split('/')[0]}-published-seed0"
        assert json.loads((run / "config.json").read_text())["reward"] == "toyworld:1.0", key
        for value in ("strict_end", "score_end", "clean_end", "score_gain"):
            assert math.isfinite(r[value]), (key, value)
        for metric in ("strict", "score"):
            e = results["efficiency"][metric][key]
            assert all(math.isfinite(e["rate"][axis]["mean"]) for axis in A.AXES), (key, metric)
    table = (out / "table.md").read_text()
    assert all(f"| {n} | published |" in table for n in objectives) and "### Efficiency" in table
    assert (out / "algorithms.png").stat().st_size > 10_000
    # --plot_only redraws the same table from the runs
    (out / "table.md").unlink()
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "algorithms.py"), "--smoke", "--plot_only", "--out",
                    str(out), "--objectives", *objectives], cwd=REPO, env=env, check=True, capture_output=True)
    assert (out / "table.md").read_text() == table


def test_smoke_runs_grpo_and_awm(toy_world, tmp_path):
    """--smoke for GRPO (the reference) and AWM: two launchers, end to end (~30 s on 2 cores)."""
    _smoke(toy_world, tmp_path, ["grpo", "awm"])
