"""sample.py: complete, deterministic (rank- and batch-invariant) output equal to stock FluxPipeline on the same noise
for the base model, a LoRA and a full fine-tune; rewards and their summary; --compare; errors before loading."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import REPO, load_script, run_torchrun

from fastvideo.data import EmbeddingDataset
from fastvideo.seeding import NoiseSource

H = W = 64
STEPS = 4


def _sample(model: Path, prompts: Path, out: Path, *flags: str, nproc: int = 1) -> subprocess.CompletedProcess:
    args = ["sample.py", "--pretrained_model_name_or_path", str(model), "--prompts", str(prompts), "--output_dir",
            str(out), "--h", str(H), "--w", str(W), "--num_inference_steps", str(STEPS), "--device", "cpu",
            "--max_sequence_length", "32", "--seed", "7", *flags]
    if nproc > 1:
        return run_torchrun(args, nproc=nproc)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # as run_torchrun: the same kernels, the same bits
    proc = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _png(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as img:
        return np.asarray(img.convert("RGB"), dtype=np.int16)


def _pipeline_pngs(model: Path, out: Path, rows: list[dict], transformer=None, lora_dir=None) -> list[np.ndarray]:
    """Stock FluxPipeline images of ``rows`` (prompt embeddings of sample.py's store, sample.py's keyed initial
    noise), as the 8-bit values a PNG holds."""
    from diffusers import FluxPipeline

    from fastvideo.models.flux import latent_geometry

    pipe = FluxPipeline.from_pretrained(model, local_files_only=True,
                                        **({"transformer": transformer} if transformer is not None else {}))
    if lora_dir is not None:
        pipe.load_lora_weights(lora_dir)
    pipe.set_progress_bar_config(disable=True)
    ds = EmbeddingDataset(out / "embeddings")
    noise = NoiseSource(7)
    L, C = latent_geometry(model, H, W).packed_shape
    pngs = []
    for r in rows:
        latents = noise.randn((L, C), step=0, prompt_id=r["prompt_id"], sample_index=r["sample_index"],
                              purpose="init")[None]
        item = ds[r["prompt_id"]]
        image = pipe(prompt_embeds=item["prompt_embeds"][None], pooled_prompt_embeds=item["pooled_prompt_embeds"][None],
                     height=H, width=W, num_inference_steps=STEPS, guidance_scale=3.5, latents=latents,
                     output_type="pt").images[0]
        pngs.append(image.clamp(0, 1).mul(255).add(0.5).floor().permute(1, 2, 0).numpy().astype(np.int16))
    return pngs


def _assert_pipeline_equal(out: Path, pngs: list[np.ndarray], rows: list[dict]) -> None:
    for row, ref in zip(rows, pngs):
        diff = np.abs(_png(out / row["path"]) - ref)
        assert diff.max() <= 1 and diff.mean() < 0.01, (row["path"], diff.max(), diff.mean())  # 8-bit rounding only


@pytest.fixture(scope="session")  # once per session: the slow or evidence tier reads it too
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("".join(line + "\n" for line in (REPO / "assets" / "prompts.txt").read_text().splitlines()[:3]))
    return path


@pytest.fixture(scope="session")  # once per session: the slow or evidence tier reads it too
def base_run(tiny_flux_dir, prompts, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("base") / "samples"
    _sample(tiny_flux_dir, prompts, out, "--num_images_per_prompt", "2", "--reward", "jpeg_compressibility:1.0",
            "--batch_size", "4", nproc=2)
    return out


def test_base_model_output_is_complete_deterministic_and_equals_flux_pipeline(tiny_flux_dir, prompts, base_run,
                                                                                tmp_path):
    rows = [json.loads(line) for line in (base_run / "index.jsonl").read_text().splitlines()]
    assert [(r["prompt_id"], r["sample_index"]) for r in rows] == [(p, k) for p in range(3) for k in range(2)]
    prompt_lines = prompts.read_text().splitlines()
    for r in rows:
        assert r["prompt"] == prompt_lines[r["prompt_id"]] and r["seed"] == 7
        assert (base_run / r["path"]).is_file() and np.isfinite(r["total"])
        assert r["jpeg_compressibility"] == r["total"]
    summary = json.loads((base_run / "summary.json").read_text())
    totals = torch.tensor([r["total"] for r in rows], dtype=torch.float64)
    stats = summary["rewards"]["total"]
    assert summary["num_images"] == 6 and summary["num_prompts"] == 3
    assert stats["mean"] == pytest.approx(float(totals.mean()), rel=1e-12)
    prompt_means = totals.view(3, 2).mean(1)
    half = 4.303 * float(prompt_means.std()) / 3 ** 0.5  # Student t, 2 degrees of freedom, over prompt means
    assert stats["ci95_high"] - stats["mean"] == pytest.approx(half, rel=1e-9)
    assert json.loads((base_run / "config.json").read_text())["seed"] == 7
    # one rank making the two ranks' transformer calls (3 images each): byte-identical images (noise keyed by prompt
    # and image index, not by rank)
    again = tmp_path / "again"
    _sample(tiny_flux_dir, prompts, again, "--num_images_per_prompt", "2", "--batch_size", "3")
    for r in rows:
        assert (again / r["path"]).read_bytes() == (base_run / r["path"]).read_bytes()
    _assert_pipeline_equal(base_run, _pipeline_pngs(tiny_flux_dir, base_run, rows), rows)


# slow (suite time, ~13 s): the base model's output against FluxPipeline is the default tier's
@pytest.mark.slow(cover="test_sample.py::test_base_model_output_is_complete_deterministic_and_equals_flux_pipeline",
                  cost_s=13)
def test_lora_and_full_finetune_equal_flux_pipeline_and_compare_grid(tiny_flux_dir, prompts, base_run, tmp_path):
    from dist_scripts.sharding_common import randomize_lora_b
    from PIL import Image

    from fastvideo.models.flux import load_transformer
    from fastvideo.lora import add_lora, save_lora_for_diffusers, save_transformer_for_diffusers

    model = add_lora(load_transformer(tiny_flux_dir), rank=4, alpha=8, init_seed=0)
    randomize_lora_b(model, scale=0.5)
    lora_dir = save_lora_for_diffusers(model, tmp_path / "lora")
    tuned = tmp_path / "tuned"
    proc = _sample(tiny_flux_dir, prompts, tuned, "--lora_path", str(lora_dir), "--num_images_per_prompt", "2",
                   "--reward", "jpeg_compressibility:1.0", "--compare", str(base_run))
    rows = [json.loads(line) for line in (tuned / "index.jsonl").read_text().splitlines()]
    changed = [np.abs(_png(tuned / r["path"]) - _png(base_run / r["path"])).max() for r in rows]
    assert min(changed) > 10, changed  # the LoRA changes every image
    _assert_pipeline_equal(tuned, _pipeline_pngs(tiny_flux_dir, tuned, rows, lora_dir=lora_dir), rows)
    grid = tuned / "compare.png"
    assert "comparison:" in proc.stdout and grid.is_file()
    paired = json.loads((tuned / "compare.json").read_text())["rewards"]["total"]
    base_rows = [json.loads(line) for line in (base_run / "index.jsonl").read_text().splitlines()]
    diffs = torch.tensor([r["total"] - b["total"] for r, b in zip(rows, base_rows)], dtype=torch.float64)
    assert paired["difference"] == pytest.approx(float(diffs.mean()), rel=1e-9, abs=1e-15)
    assert paired["this"] - paired["base"] == pytest.approx(paired["difference"], rel=1e-9, abs=1e-15)
    half = 4.303 * float(diffs.view(3, 2).mean(1).std()) / 3 ** 0.5  # paired by prompt: 3 prompt means
    assert paired["difference_ci95_high"] - paired["difference"] == pytest.approx(half, rel=1e-9)
    with Image.open(grid) as img:
        assert img.size[0] > 2 * 2 * 192 and img.size[1] > 3 * 192  # 3 prompts x (2 base + 2 tuned), enlarged
        assert np.asarray(img.convert("L")).std() > 10

    full = load_transformer(tiny_flux_dir)
    with torch.no_grad():
        for p in full.parameters():
            p.mul_(1.05)
    full_dir = save_transformer_for_diffusers(full, None, tmp_path / "full")
    ft = tmp_path / "ft"
    _sample(tiny_flux_dir, prompts, ft, "--transformer_path", str(full_dir), "--max_prompts", "2")
    rows = [json.loads(line) for line in (ft / "index.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and "total" not in rows[0]  # no --reward: no scores
    _assert_pipeline_equal(ft, _pipeline_pngs(tiny_flux_dir, ft, rows, transformer=full.eval()), rows)


def _module():
    return load_script(REPO / "sample.py", "sample_script")


def test_errors_name_the_fix_before_loading(tiny_flux_dir, prompts, base_run, tmp_path):
    from fastvideo.evaluation import validate_sample

    sample = _module()
    common = ["--pretrained_model_name_or_path", str(tiny_flux_dir), "--prompts", str(prompts), "--h", "64", "--w",
              "64", "--num_inference_steps", str(STEPS), "--seed", "7", "--output_dir", str(tmp_path / "o")]
    assert validate_sample(sample.parse_args(common)) is None
    cases = [
        (["--prompts", str(tmp_path / "none.txt")], FileNotFoundError, "no such prompt file"),
        (["--lora_path", str(tmp_path), "--transformer_path", str(tmp_path)], ValueError, "exclude each other"),
        (["--lora_path", str(tmp_path)], FileNotFoundError, "no .safetensors LoRA"),
        (["--transformer_path", str(tmp_path)], FileNotFoundError, "full fine-tune"),
        (["--h", "60"], ValueError, "--h 56 or 64"),
        (["--output_dir", str(base_run)], ValueError, "already holds a sampling"),
        (["--compare", str(tmp_path)], FileNotFoundError, "finished sample.py run"),
        (["--compare", str(base_run), "--seed", "8"], ValueError, "--seed 7 there vs 8 here"),
        (["--compare", str(base_run), "--num_inference_steps", "5"], ValueError, "--num_inference_steps 4 there"),
        (["--num_images_per_prompt", "0"], ValueError, "--num_images_per_prompt must be >= 1"),
        (["--reward", "nope:1"], ValueError, "nope"),
    ]
    for flags, error, message in cases:
        with pytest.raises(error, match=message):
            validate_sample(sample.parse_args([*common, *flags]))
    from fastvideo.evaluation import check_compare_prompts, read_sample_dir

    base = read_sample_dir(base_run)  # sample.py checks the prompts after encoding them, before the models load
    check_compare_prompts(base, prompts.read_text().splitlines(), str(base_run))
    with pytest.raises(ValueError, match="sample both with the same --prompts"):
        check_compare_prompts(base, ["a different prompt"], str(base_run))
    with pytest.raises(ValueError, match="holds no image of this run's prompts"):
        check_compare_prompts({"rows": [r for r in base["rows"] if r["prompt_id"] > 0]}, ["x"], str(base_run))
