"""The refactoring safety net: 2-step runs of every objective on the tiny FLUX (GRPO with the clipped, Guard and DPPO
policy losses and a sliding SDE window; DPO online and offline; DiffusionNFT; AWM) and one GRPO run per other family
(SD3, Qwen-Image, FLUX.2, with true CFG), all in one 2-rank job. Each run's metrics (timings and memory left out) and
its export (OUT/final's weight files) are hashed and compared with the digests recorded in
``tests/safety_net.json`` for this CPU (float sums round differently on other CPUs: there the test is a declared skip).

A change that moves code must leave every digest as it is. A change that means to move a number re-records them:
``FASTVIDEO_RECORD_SAFETY_NET=1 python -m pytest -m slow tests/test_safety_net.py`` (and says so in its commit).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from helpers import make_embeddings, run_in_one_job

DIGESTS = Path(__file__).with_name("safety_net.json")
RECORD = os.environ.get("FASTVIDEO_RECORD_SAFETY_NET") == "1"
# metrics that measure the machine, not the run
UNTIMED = re.compile(r"time|tflops|mfu|memory|_gb$|per_s|seconds|throughput")
H = W = 64
COMMON = ["--device", "cpu", "--h", str(H), "--w", str(W), "--sampling_steps", "4", "--prompts_per_step", "2",
          "--train_batch_size", "2", "--learning_rate", "1e-3", "--seed", "3", "--no-progress_bar",
          "--max_train_steps", "2", "--checkpointing_steps", "100", "--lora_rank", "4"]
ONLINE = ["--num_generations", "4", "--rollout_batch_size", "4", "--reward", "jpeg_compressibility:1.0"]
# name -> (trainer, flags beyond COMMON and the paths, model: "flux1" or a family preset)
RUNS: dict[str, tuple[str, list[str], str]] = {
    "grpo_clip": ("train_grpo_flux.py", [*ONLINE, "--timestep_fraction", "0.7"], "flux1"),
    "grpo_guard": ("train_grpo_flux.py", [*ONLINE, "--timestep_fraction", "0.7", "--policy_loss", "guard",
                                          "--clip_range", "1e-3", "--gradient_accumulation_steps", "1"], "flux1"),
    "grpo_dppo": ("train_grpo_flux.py", [*ONLINE, "--policy_loss", "dppo", "--timestep_selection", "first",
                                         "--timestep_fraction", "0.5", "--gradient_accumulation_steps", "1"], "flux1"),
    "grpo_sliding": ("train_grpo_flux.py", [*ONLINE, "--sde_window_size", "2", "--sde_window_schedule", "sliding",
                                            "--sde_window_shift_interval", "1"], "flux1"),
    "dpo_online": ("train_dpo.py", ONLINE, "flux1"),
    "dpo_offline": ("train_dpo.py", [], "flux1"),  # + --preference_file
    "nft": ("train_nft.py", ONLINE, "flux1"),
    "awm": ("train_nft.py", [*ONLINE, "--objective", "awm", "--awm_timesteps", "2"], "flux1"),
    "grpo_sd3": ("train_grpo_flux.py", [*ONLINE, "--timestep_fraction", "0.7"], "sd3-tiny"),
    "grpo_qwen_image": ("train_grpo_flux.py", [*ONLINE, "--timestep_fraction", "0.7"], "qwen-image-tiny"),
    "grpo_flux2": ("train_grpo_flux.py", [*ONLINE, "--timestep_fraction", "0.7"], "flux2-tiny"),
}


def _recorded() -> dict:
    return json.loads(DIGESTS.read_text()) if DIGESTS.is_file() else {}


def _cpu() -> str:
    from fastvideo.toyworld.pretrain import cpu_fingerprint

    return cpu_fingerprint()


def _pair_file(folder: Path, prompts: list[str]) -> Path:
    """Offline DPO pairs: two seeded noise images per prompt (the images' content does not matter to the digest)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    lines = []
    for i, prompt in enumerate(prompts):
        names = []
        for side in ("chosen", "rejected"):
            name = f"{i}-{side}.png"
            Image.fromarray(rng.integers(0, 256, (H, W, 3), dtype=np.uint8)).save(folder / name)
            names.append(name)
        lines.append(json.dumps({"prompt": prompt, "chosen": names[0], "rejected": names[1]}))
    path = folder / "pairs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def digests(out: Path) -> dict[str, str]:
    """SHA-256 of a run's untimed metrics (every row's keys in order, values as JSON) and of OUT/final's weight files
    (each file's header with its keys sorted, and its tensors' bytes)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    untimed = [{k: v for k, v in row.items() if not UNTIMED.search(k)} for row in rows]
    metrics = hashlib.sha256(json.dumps(untimed).encode()).hexdigest()
    export = hashlib.sha256()
    for path in sorted((out / "final").rglob("*.safetensors")):
        data = path.read_bytes()
        size = int.from_bytes(data[:8], "little")  # safetensors: header length, JSON header, the tensors' bytes
        header = json.dumps(json.loads(data[8:8 + size]), sort_keys=True)  # its metadata's key order varies by run
        export.update(path.relative_to(out / "final").as_posix().encode() + header.encode() + data[8 + size:])
    return {"metrics": metrics, "export": export.hexdigest(), "rows": str(len(rows))}


def run_everything(root: Path, flux_dir: Path, flux_data: Path) -> dict[str, dict[str, str]]:
    """Every run of ``RUNS`` in one 2-rank job under ``root``; their digests."""
    from fastvideo import models
    from fastvideo.tiny import build_preset

    data = {"flux1": (flux_dir, flux_data)}
    for preset in sorted({model for _, _, model in RUNS.values()} - {"flux1"}):
        model = build_preset(root / preset / "model", preset, seed=0)
        negative = models.resolve("auto", model).defaults.negative_prompt
        data[preset] = (model, make_embeddings(model, root / preset, 6, "--max_sequence_length", "32",
                                               "--negative_prompt", negative))
    pairs_dir = root / "pairs"
    pairs_dir.mkdir()
    pairs = _pair_file(pairs_dir, [row["prompt"] for row in json.loads(flux_data.read_text())["prompts"][:4]])
    jobs = []
    for name, (script, flags, model) in RUNS.items():
        model_dir, manifest_path = data[model]
        extra = ["--preference_file", str(pairs)] if name == "dpo_offline" else []
        if model != "flux1":
            extra += ["--cfg_scale", str(models.resolve("auto", model_dir).defaults.cfg_scale)]
        jobs.append((script, ["--pretrained_model_name_or_path", str(model_dir), "--data_json_path",
                              str(manifest_path), "--output_dir", str(root / "runs" / name), *COMMON, *flags, *extra]))
    run_in_one_job(jobs, root)
    return {name: digests(root / "runs" / name) for name in RUNS}


SAME_CPU = RECORD or _recorded().get("cpu") == _cpu()


@pytest.mark.slow(cover="test_train_grpo.py::test_short_run_writes_every_metric", cost_s=70)
@pytest.mark.skipif(not SAME_CPU, reason="the digests are bit-for-bit: recorded on another CPU (tests/safety_net.json)")
def test_every_objective_and_family_gives_the_recorded_metrics_and_exports(tiny_flux_dir, tiny_data, tmp_path):
    """Each run's metrics and export hash to the recorded digests (bit-identical numbers and weights)."""
    found = run_everything(tmp_path, tiny_flux_dir, tiny_data)
    if RECORD:
        DIGESTS.write_text(json.dumps({"cpu": _cpu(), "runs": found}, indent=1, sort_keys=True) + "\n")
        return
    recorded = _recorded()["runs"]
    moved = {name: (recorded.get(name), got) for name, got in found.items() if recorded.get(name) != got}
    assert not moved, f"runs whose numbers or exports moved: {moved}"
