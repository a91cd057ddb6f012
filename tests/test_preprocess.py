"""preprocess_embeddings.py under torchrun: rank-count invariance, equality with FluxPipeline, resume, errors."""
from __future__ import annotations

import json
import re
import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import REPO, load_script, run_torchrun

from fastvideo.data import EmbeddingDataset

SCRIPT = str(REPO / "preprocess_embeddings.py")
LONG = " ".join(["an extremely long and winding description of a grand landscape with mountains"] * 8)
PROMPTS = ["a red apple on a wooden table", "", "a cat wearing a wizard hat", LONG, "   ",
           "a lighthouse at night, dramatic lighting", "café «sign» that says \"OPEN\" — ünïcödé",
           "three green pears"]
EXPECTED = [p.strip() for p in PROMPTS if p.strip()]  # ids = order among non-blank lines
MSL = 32


def _preprocess(model, prompt_file, out, nproc):
    """nproc ranks under torchrun, or plain ``python`` for nproc=1 (the world-size-1 case, no launcher)."""
    args = [SCRIPT, "--model_path", str(model), "--prompt_file", str(prompt_file), "--output_dir", str(out),
            "--max_sequence_length", str(MSL), "--batch_size", "2", "--shard_size", "2"]
    if nproc > 1:
        return run_torchrun(args, nproc=nproc, timeout=300)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
    return proc


def _main_in_process(argv):
    """Run preprocess_embeddings.main in this process (world size 1, no subprocess start-up)."""
    load_script(SCRIPT, "preprocess_embeddings").main([str(a) for a in argv])


def _refused(capsys, argv, pattern: str) -> None:
    """``main(argv)`` refuses its input before loading anything: one line ``PROG: error: ...`` matching
    ``pattern``, exit status 2 (the message of the ValueError / FileNotFoundError the check raised)."""
    with pytest.raises(SystemExit) as stop:
        _main_in_process(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1 and ": error: " in lines[0]
    assert re.search(pattern, lines[0]), lines[0]


def _tensors(out):
    ds = EmbeddingDataset(out)
    batch = ds.get_batch(list(range(len(ds))))
    return ds, batch["prompt_embeds"], batch["pooled_prompt_embeds"]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def runs(tiny_flux_dir, prompt_file, tmp_path_factory):
    """The same prompts preprocessed on 1 rank and on 2 ranks."""
    base = tmp_path_factory.mktemp("preprocess")
    _preprocess(tiny_flux_dir, prompt_file, base / "one", 1)
    proc = _preprocess(tiny_flux_dir, prompt_file, base / "two", 2)
    return base / "one", base / "two", proc.stdout


def test_two_ranks_equal_one_rank(runs, tiny_flux_dir):
    one, two, stdout = runs
    assert "[preprocess] 6 prompts in 3 shards (encoded 3, kept 0" in stdout
    m1 = json.loads((one / "manifest.json").read_text())
    m2 = json.loads((two / "manifest.json").read_text())
    assert m1 == m2
    assert m1["num_prompts"] == len(EXPECTED) and m1["max_sequence_length"] == MSL and m1["dtype"] == "fp32"
    assert [(p["id"], p["prompt"]) for p in m1["prompts"]] == list(enumerate(EXPECTED))
    assert m1["num_truncated"] == 1 and [p["truncated"] for p in m1["prompts"]] == [p == LONG for p in EXPECTED]
    assert m1["model_path"] == str(tiny_flux_dir.resolve())
    assert sorted(p.name for p in two.iterdir()) == ["manifest.json"] + [s["file"] for s in m1["shards"]]
    _, e1, p1 = _tensors(one)
    _, e2, p2 = _tensors(two)
    assert e1.shape[:2] == (len(EXPECTED), MSL)
    assert torch.equal(e1, e2) and torch.equal(p1, p2)


def test_matches_flux_pipeline_encode_prompt(runs, tiny_flux_dir):
    from diffusers import FluxPipeline

    ds, embeds, pooled = _tensors(runs[1])
    pipe = FluxPipeline.from_pretrained(tiny_flux_dir, local_files_only=True)
    with torch.no_grad():
        ref_embeds, ref_pooled, _ = pipe.encode_prompt(ds.prompts, prompt_2=None, max_sequence_length=MSL)
    torch.testing.assert_close(embeds, ref_embeds, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pooled, ref_pooled, rtol=1e-5, atol=1e-6)


def test_default_max_sequence_length_matches_pipeline(tiny_flux_dir, tmp_path):
    from diffusers import FluxPipeline

    prompts = tmp_path / "p.txt"
    prompts.write_text("a small blue bird\nsnow on a quiet street at night\n", encoding="utf-8")
    _main_in_process(["--model_path", tiny_flux_dir, "--prompt_file", prompts, "--output_dir", tmp_path / "out"])
    ds, embeds, pooled = _tensors(tmp_path / "out")
    assert ds.max_sequence_length == 512 and embeds.shape[1] == 512
    pipe = FluxPipeline.from_pretrained(tiny_flux_dir, local_files_only=True)
    with torch.no_grad():
        ref_embeds, ref_pooled, _ = pipe.encode_prompt(ds.prompts, prompt_2=None)
    torch.testing.assert_close(embeds, ref_embeds, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pooled, ref_pooled, rtol=1e-5, atol=1e-6)


def test_resume_rewrites_only_missing_or_broken_shards(runs, tiny_flux_dir, prompt_file, tmp_path, capsys):
    one, two, _ = runs
    out = tmp_path / "out"
    shutil.copytree(two, out)
    (out / "manifest.json").unlink()
    (out / "shard-00001.safetensors").unlink()
    (out / "shard-00002.safetensors").write_bytes(b"torn write")  # e.g. a copy interrupted by preemption
    (out / ".shard-00001.safetensors.tmp.123").write_bytes(b"left over")
    kept = (out / "shard-00000.safetensors").stat().st_mtime_ns

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the OMP_NUM_THREADS=1 subprocesses, for bit-identical rows
    try:  # in-process (world size 1) to skip a subprocess start-up; the 2-rank path ran in the fixture
        _main_in_process(_argv(tiny_flux_dir, prompt_file, out) + ["--batch_size", 2, "--shard_size", 2])
    finally:
        torch.set_num_threads(threads)
    assert "(encoded 2, kept 1 finished)" in capsys.readouterr().out
    assert (out / "shard-00000.safetensors").stat().st_mtime_ns == kept
    assert not list(out.glob(".shard-*"))
    assert json.loads((out / "manifest.json").read_text()) == json.loads((one / "manifest.json").read_text())
    _, e, p = _tensors(out)
    _, e1, p1 = _tensors(one)
    assert torch.equal(e, e1) and torch.equal(p, p1)


# ---------------------------------------------------------------------------------------- bad inputs
def _argv(model, prompt_file, out, msl=MSL):
    return ["--model_path", model, "--prompt_file", prompt_file, "--output_dir", out, "--max_sequence_length", msl]


def test_empty_prompt_file(tiny_flux_dir, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n   \n")
    _refused(capsys, _argv(tiny_flux_dir, empty, tmp_path / "out"), "contains no prompts")


def test_non_utf8_line_names_its_number(tiny_flux_dir, tmp_path, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_bytes("fine\n\nalso fine\n".encode() + "latin-1 caf\xe9\n".encode("latin-1"))
    _refused(capsys, _argv(tiny_flux_dir, bad, tmp_path / "out"), "line 4: not valid UTF-8")


def test_missing_model_folder(prompt_file, tmp_path, capsys):
    _refused(capsys, _argv(tmp_path / "nope", prompt_file, tmp_path / "out"), "nope")


def test_refuses_output_of_another_length_or_model(runs, tiny_flux_dir, prompt_file, tmp_path, capsys):
    two = runs[1]
    before = sorted((p.name, p.stat().st_mtime_ns) for p in two.iterdir())
    _refused(capsys, _argv(tiny_flux_dir, prompt_file, two, msl=MSL + 1), "max_sequence_length=32.*--output_dir")
    other = tmp_path / "other-model"
    shutil.copytree(tiny_flux_dir, other)
    config_path = other / "text_encoder_2" / "config.json"
    config = json.loads(config_path.read_text())
    config["dropout_rate"] = 0.5  # different text encoder config -> different fingerprint
    config_path.write_text(json.dumps(config))
    _refused(capsys, _argv(other, prompt_file, two), "encoders_fingerprint.*--output_dir")
    assert sorted((p.name, p.stat().st_mtime_ns) for p in two.iterdir()) == before  # nothing touched
