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
