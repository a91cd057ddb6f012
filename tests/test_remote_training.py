"""Training against a real reward server (``python -m fastvideo.rewards.serve`` on 127.0.0.1): a 2-rank GRPO run that
scores through ``--reward remote:URL`` trains exactly as the same run scoring locally, and a server killed mid-run
ends the run on every rank within the client's time bound, naming the URL, with the last checkpoint intact and
resumable against a server at another address."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import REPO, comparable, free_port, run_torchrun

from fastvideo.logging import read_metrics
from fastvideo.rewards.http import request
from fastvideo.rewards.serve import launch


def _grpo_args(toy_world: dict[str, Path], out: Path, reward: str, *extra: str) -> list[str]:
    """2 prompts x 4 images of the toy world on 2 ranks, GRPO with LoRA, scored by ``reward``."""
    return ["train_grpo_flux.py", "--pretrained_model_name_or_path", str(toy_world["model"]), "--data_json_path",
            str(toy_world["train"]), "--output_dir", str(out), "--device", "cpu", "--h", "32", "--w", "32",
            "--sampling_steps", "3", "--shift", "1", "--eta", "1.0", "--timestep_fraction", "1.0", "--reward", reward,
            "--num_generations", "4", "--prompts_per_step", "2", "--rollout_batch_size", "2", "--train_batch_size", "2",
            "--lora_rank", "4", "--learning_rate", "1e-3", "--sample_every", "0", "--no-progress_bar", "--seed", "0",
            *extra]


def _without_reward_names(row: dict) -> dict:
    """A metrics row without timings and without the per-component reward entries, whose names carry the reward's
    name (``reward_toyworld_*`` locally, ``reward_remote_toyworld_*`` through the server)."""
    return {k: v for k, v in comparable(row).items() if not k.startswith(("reward_toyworld", "reward_remote"))}


# slow (suite time, ~20 s): the default suite keeps remote == local scores (test_reward_server) and a real 2-rank GRPO
# run through the server (the killed-server test below, which also resumes through a moved server)
@pytest.mark.slow(cover="test_reward_server.py::test_remote_toyworld_equals_local", cost_s=20)
def test_remote_reward_trains_exactly_as_the_local_one(toy_world, tmp_path):
    """The server's toyworld scores are the local ones bit for bit, so the same 2-step run logs the same rewards,
    advantages, losses and ratios (every metric but the timings), and each component under its remote name."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    run_torchrun(_grpo_args(toy_world, local, "toyworld:1.0", "--max_train_steps", "2"))
    with launch(["--reward", "toyworld", "--device", "cpu"]) as server:
        run_torchrun(_grpo_args(toy_world, remote, f"remote:{server.url}", "--max_train_steps", "2"))
        health = request(f"{server.url}/health")
    rows = {name: read_metrics(out / "metrics.jsonl") for name, out in (("local", local), ("remote", remote))}
    assert len(rows["local"]) == len(rows["remote"]) == 2
    for a, b in zip(rows["local"], rows["remote"]):
        assert _without_reward_names(a) == _without_reward_names(b)
        assert a["reward_toyworld_strict"] == b["reward_remote_toyworld_strict"]
        assert a["reward_toyworld"] == b["reward_remote"] == b["reward_mean"]
    assert health["counters"]["images"] == 2 * 8  # 2 steps x 8 images, each scored once on the server


# slow (suite time, ~10 s each): by default a remote reward that fails ends every rank naming its URL with an intact
# checkpoint (test_reward_overlap.py, through the same client), the client's bound and a dead server's error are
# checked in test_reward_server.py, and the fingerprint leaves server addresses out
# (test_the_fingerprint_leaves_reward_server_addresses_out)
@pytest.mark.slow(
    cover="test_reward_overlap.py::test_a_reward_failing_on_one_rank_ends_every_rank_with_its_message[overlap]",
    cost_s=12)
def test_a_server_killed_mid_run_ends_every_rank_naming_the_url(toy_world, tmp_path):
    """The server dies after the step-1 checkpoint: both ranks stop within the client's bound
    (--reward_timeout_s x (retries + 1) + backoff, plus the step in flight), each naming the URL; the newest
    checkpoint is complete, and the run resumes from it against a server at another address (the fingerprint leaves
    reward-server addresses out) and finishes."""
    from fastvideo.checkpoint import latest_checkpoint

    out = tmp_path / "run"
    flags = ("--checkpointing_steps", "1", "--reward_timeout_s", "2", "--reward_retries", "1")
    with launch(["--reward", "toyworld", "--device", "cpu"]) as server:
        url = server.url
        args = _grpo_args(toy_world, out, f"remote:{url}", "--max_train_steps", "40", *flags)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), *args]
        run = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 240
        while latest_checkpoint(out) is None and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert latest_checkpoint(out) is not None, "no checkpoint was written"
        server.proc.kill()
        killed = time.monotonic()
    try:
        output, _ = run.communicate(timeout=120)
    finally:
        run.kill()
    ended = time.monotonic() - killed
    assert run.returncode != 0, output[-3000:]
    # one step in flight (~1-2 s here) + 2 attempts x 2 s + 0.5 s backoff: ~6-7 s; without the client's bound the
    # ranks would wait out the 120 s below
    assert ended < 60, f"the run took {ended:.1f} s to stop after the server died"
    for rank in (0, 1):
        lines = [line for line in output.splitlines() if line.startswith(f"[rank {rank}]")]
        assert any(f"reward server {url}" in line for line in lines), (rank, output[-3000:])
    last = latest_checkpoint(out)
    step = int(last.name.split("-")[1])
    assert 1 <= step < 40
    with launch(["--reward", "toyworld", "--device", "cpu"]) as moved:
        assert moved.url != url
        run_torchrun(_grpo_args(toy_world, out, f"remote:{moved.url}", "--max_train_steps", str(step + 1),
                                "--resume_from", "latest", *flags))
    rows = read_metrics(out / "metrics.jsonl")
    assert rows[-1]["step"] == step + 1 and "reward_remote" in rows[-1]


# slow (suite time, ~8 s): remote == local scores and the dead-server error stay in the default suite
# (test_reward_server)
@pytest.mark.slow(cover="test_reward_server.py::test_remote_toyworld_equals_local", cost_s=8)
def test_the_score_tool_scores_remotely_as_locally_and_names_a_dead_server(tmp_path):
    """``python -m fastvideo.rewards.score --reward remote:URL`` (the client every tool shares) writes the local
    reward's scores exactly; a server that is gone is one error line naming the URL (exit 1), not a traceback."""
    import torch

    from fastvideo import record

    folder = tmp_path / "images"
    folder.mkdir()
    for i, image in enumerate(torch.rand(5, 3, 32, 48, generator=torch.Generator().manual_seed(0))):
        record.save_png(image, folder / f"img{i}.png")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"prompt {i}\n" for i in range(5)))
    cli = [sys.executable, "-m", "fastvideo.rewards.score", "--images", str(folder), "--prompts", str(prompts),
           "--batch_size", "2", "--device", "cpu", "--reward_retries", "0", "--reward_timeout_s", "5"]
    rows = {}
    with launch(["--reward", "jpeg_compressibility", "--device", "cpu"]) as server:
        for name, spec in (("local", "jpeg_compressibility"), ("remote", f"remote:{server.url}")):
            out = subprocess.run([*cli, "--reward", spec, "--out", str(tmp_path / f"{name}.jsonl")], cwd=REPO,
                                 capture_output=True, text=True)
            assert out.returncode == 0, out.stderr
            rows[name] = record.read_jsonl(tmp_path / f"{name}.jsonl")
        url = server.url
    assert [r["total"] for r in rows["local"]] == [r["total"] for r in rows["remote"]]
    assert [r["jpeg_compressibility"] for r in rows["local"]] == [r["remote_jpeg_compressibility"]
                                                                   for r in rows["remote"]]
    dead = subprocess.run([*cli, "--reward", f"remote:{url}", "--out", str(tmp_path / "dead.jsonl")], cwd=REPO,
                          capture_output=True, text=True)
    assert dead.returncode == 1 and "Traceback" not in dead.stderr and url in dead.stderr, dead.stderr
    assert not (tmp_path / "dead.jsonl").exists()


def test_the_fingerprint_leaves_reward_server_addresses_out():
    """A checkpoint's run identity (what --resume_from compares) is the same when only the reward servers' addresses
    changed (a requeued job's new nodes), and differs when a weight or the reward itself changed."""
    from fastvideo.resume import run_identity

    def identity(reward: str) -> str:
        return run_identity({"algorithm": "grpo", "reward": reward, "seed": 0})["config_fingerprint"]

    assert identity("toyworld:1.0,remote:http://a:8000:0.5") == identity("toyworld:1.0,remote:http://b:9|http://c:9:0.5")
    assert identity("toyworld:1.0,remote:http://a:8000:0.5") != identity("toyworld:1.0,remote:http://a:8000:0.25")
    assert identity("hpsv2:1.0") != identity("remote:http://a:8000")
    # a spec without servers is recorded as written: checkpoints of earlier versions keep their fingerprints
    assert run_identity({"algorithm": "grpo", "reward": "hpsv2:1.0", "seed": 0})["run_flags"]["reward"] == "hpsv2:1.0"
