"""The launchers as a user runs them: env vars in, "$@" passed through to the scripts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import REPO, free_port


def test_grpo_launcher_builds_the_demo_and_trains(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "DATA_DIR": str(tmp_path / "data"),
           "OUTPUT_DIR": str(tmp_path / "out"), "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "2"}
    env.pop("MODEL_PATH", None)
    proc = subprocess.run(["bash", "scripts/finetune_flux_grpo.sh", "--max_train_steps", "2", "--sample_every", "1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the embedded default was built where DATA_DIR points, not in the source tree
    assert (tmp_path / "data" / "tiny-flux" / "model_index.json").is_file()
    manifest = json.loads((tmp_path / "data" / "tiny-flux-embeddings" / "manifest.json").read_text())
    assert manifest["num_prompts"] == len([l for l in (REPO / "assets" / "prompts.txt").read_text().splitlines()
                                            if l.strip()])
    rows = [json.loads(l) for l in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # the appended flag won over the launcher's default (250)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["reward"] == "jpeg_compressibility:1.0" and config["device"] == "cpu"
    assert (tmp_path / "out" / "final" / "diffusion_pytorch_model.safetensors").is_file()
    assert "metrics: " in proc.stdout and "export: " in proc.stdout


def test_grpo_launcher_with_model_path_needs_embeddings(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "MODEL_PATH": str(tmp_path / "FLUX.1-dev"),
           "DATA_DIR": str(tmp_path / "data")}
    proc = subprocess.run(["bash", "scripts/finetune_flux_grpo.sh"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0
    assert "preprocess_flux_embeddings.sh" in proc.stderr


def test_grpo_launcher_dry_run_plans_the_flux_recipe(tmp_path):
    """`MODEL_PATH=... bash scripts/finetune_flux_grpo.sh --dry_run --device cuda` on a folder of FLUX.1-dev configs:
    the recipe's plan for 8 ranks, without embeddings, weights, torchrun or a GPU, within 80 GiB per GPU."""
    from fastvideo.tiny import write_flux_dev_config

    folder = write_flux_dev_config(tmp_path / "flux-dev")
    env = {**os.environ, "PYTHON": sys.executable, "MODEL_PATH": str(folder), "DATA_DIR": str(tmp_path / "data"),
           "OUTPUT_DIR": str(tmp_path / "out")}
    proc = subprocess.run(["bash", "scripts/finetune_flux_grpo.sh", "--dry_run", "--device", "cuda"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "world_size=8" in proc.stdout and "samples_per_rank=12" in proc.stdout
    assert "world size 8" in proc.stdout and "fits in 80 GiB" in proc.stdout
    assert not (tmp_path / "out").exists()
