"""A run's outputs for the user: TensorBoard holds the scalars and the sample/eval grids, W&B (offline) continues the
same run on --resume_from, OUT/plots.png is drawn, and OUT/config.json passed back with --config reproduces the run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, TIMING_KEYS


def _train(model: Path, data: Path, out: Path, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    cmd = [sys.executable, "train_grpo_flux.py", "--pretrained_model_name_or_path", str(model), "--data_json_path",
           str(data), "--output_dir", str(out), "--device", "cpu", "--h", "64", "--w", "64", "--sampling_steps", "4",
           "--num_generations", "4", "--prompts_per_step", "2", "--rollout_batch_size", "8", "--train_batch_size",
           "4", "--learning_rate", "1e-3", "--reward", "jpeg_compressibility:1.0", "--eval_prompts", str(data),
           "--eval_max_prompts", "2", "--eval_every", "2", "--sample_every", "1", "--checkpointing_steps", "2",
           "--no-progress_bar", "--seed", "3", *flags]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _rows(out: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(TIMING_KEYS)}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow(cover="test_train_grpo.py::test_short_run_writes_every_metric", cost_s=25)
def test_tensorboard_wandb_resume_plots_and_config_round_trip(tiny_flux_dir, tiny_data, tmp_path):
    import wandb  # noqa: F401  (both backends are in the test extra: a missing one fails here, it does not skip)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = tmp_path / "first"
    _train(tiny_flux_dir, tiny_data, first, "--max_train_steps", "2", "--log_to", "jsonl", "tensorboard", "wandb")
    run_id = (first / "wandb_run_id").read_text().strip()
    proc = _train(tiny_flux_dir, tiny_data, first, "--max_train_steps", "3", "--log_to", "jsonl", "tensorboard",
                  "wandb", "--resume_from", "latest")
    assert "resumed from" in proc.stdout and (first / "wandb_run_id").read_text().strip() == run_id
    runs = sorted(p.name for p in (first / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(name.endswith(f"-{run_id}") for name in runs), runs  # one W&B run, continued

    rows = [json.loads(line) for line in (first / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    events = EventAccumulator(str(first / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    tags = events.Tags()
    assert {"reward_mean", "loss", "ratio_mean", "eval/reward_mean", "eval/reward_ci95_low", "lr"} <= set(tags["scalars"])
    assert {"samples", "eval/samples"} <= set(tags["images"])
    logged = [(e.step, e.value) for e in events.Scalars("reward_mean")]
    assert logged == [(r["step"], pytest.approx(r["reward_mean"], rel=1e-6)) for r in rows if "reward_mean" in r]
    assert sorted({e.step for e in events.Scalars("eval/reward_mean")}) == [0, 2, 3]  # baseline, every 2, last
    assert sorted({e.step for e in events.Images("samples")}) == [1, 2, 3]
    assert (first / "plots.png").stat().st_size > 10_000

    # the run's config.json, passed back (with another output folder and no W&B), is the same run
    again = tmp_path / "again"
    _train(tiny_flux_dir, tiny_data, again, "--config", str(first / "config.json"), "--output_dir", str(again),
           "--log_to", "jsonl")
    config = json.loads((again / "config.json").read_text())
    assert config["max_train_steps"] == 3 and config["log_to"] == ["jsonl"] and config["seed"] == 3
    assert _rows(again) == _rows(first)


def test_progress_bar_shows_rewards_in_their_units():
    from fastvideo.rewards import display_values

    shown = display_values({"reward_mean": -0.00796, "reward_jpeg_compressibility": -3.98 / 500,
                            "reward_toyworld": 0.4219, "reward_toyworld_color": 0.9, "loss": 1.0})
    assert shown == {"jpeg_kB": "3.98", "toyworld": "0.4219"}  # JPEG size in kB, not -kB/500; checks left out
    # the strict check is a reward of its own (toyworld_strict, the GRPO toy-world demo's), so it is shown
    assert display_values({"reward_toyworld": 0.4219, "reward_toyworld_strict": 0.0078}) == {
        "toyworld": "0.4219", "toyworld_strict": "0.0078"}
    assert display_values({"reward_jpeg_incompressibility": 2.0 / 500}) == {"jpeg_kB": "2"}
