"""Test helpers: run a script under torchrun with the current interpreter on a free port."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# metrics that depend on the machine's speed or memory, not on the computation (left out when runs are compared)
TIMING_KEYS = ("time_", "samples_per_s", "peak_memory_gb", "memory_baseline_gb", "tflops_", "mfu")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(args: list[str], nproc: int = 2, timeout: float = 600, env: dict | None = None,
                 cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node nproc args...` on CPU/gloo; raises with the output if it fails."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *args]
    proc = subprocess.run(cmd, cwd=cwd or REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}): {' '.join(cmd)}\n"
                             f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def make_embeddings(model_dir: Path, out: Path, num_prompts: int, *extra: str, prompt_file: Path | None = None) -> Path:
    """Embeddings of the first ``num_prompts`` prompts of ``prompt_file`` (default assets/prompts.txt) for
    ``model_dir``; returns the manifest."""
    prompts = out / "prompts.txt"
    lines = (prompt_file or REPO / "assets" / "prompts.txt").read_text().splitlines()[:num_prompts]
    prompts.write_text("\n".join(lines) + "\n")
    subprocess.run([sys.executable, str(REPO / "preprocess_embeddings.py"), "--model_path", str(model_dir),
                    "--prompt_file", str(prompts), "--output_dir", str(out / "emb"), "--device", "cpu", *extra],
                   check=True, cwd=REPO, capture_output=True)
    return out / "emb" / "manifest.json"


def assert_lora_changes_pipeline(model_dir: Path, lora_dir: Path) -> None:
    """A trained LoRA export loads into a stock diffusers FluxPipeline and changes its output."""
    import torch
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(model_dir, local_files_only=True)
    kwargs = dict(prompt="a red cube on a table", height=64, width=64, num_inference_steps=3, output_type="pt",
                  max_sequence_length=32)
    base = pipe(generator=torch.Generator().manual_seed(0), **kwargs).images
    pipe.load_lora_weights(lora_dir)
    tuned = pipe(generator=torch.Generator().manual_seed(0), **kwargs).images
    assert torch.isfinite(tuned).all()
    assert (tuned - base).abs().max() > 1e-4, "the trained LoRA does not change the pipeline's output"


def validate_flags(tmp_path: Path, parse, validate, *flags: str, world: int = 1) -> dict:
    """``validate(parse([...model and data flags, *flags]), world)`` with a stub model folder and manifest (flag checks
    need no real files); returns the batch arithmetic."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "model_index.json").write_text("{}")
    data = tmp_path / "manifest.json"
    data.write_text("{}")
    return validate(parse(["--pretrained_model_name_or_path", str(model), "--data_json_path", str(data), *flags]),
                    world)
