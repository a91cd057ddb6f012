"""Issue 32 item 4: --reward_overlap scores each rollout micro-batch while the next one samples, with the same scores
and metrics as sequential scoring (bit for bit on the CPU); a reward that fails on one rank ends the run on every rank
with its message, without a hang."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import REPO, assert_same_metrics, free_port, run_in_one_job

from fastvideo import training
from fastvideo.rewards import RewardFn, build_reward
from fastvideo.rewards.overlap import OverlapScorer


# ------------------------------------------------------------------------------------------------ unit
def _images(n: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def _toy_prompts(n: int) -> list[str]:
    from fastvideo.toyworld.scenes import all_prompts

    return list(all_prompts()[:n])


def _scored_in_micro_batches(reward_fn, images: torch.Tensor, prompts: list[str], sizes: list[int]
                             ) -> dict[str, torch.Tensor]:
    """What the overlap scorer returns for ``images`` submitted in micro-batches of ``sizes``."""
    scorer = OverlapScorer(reward_fn, "cpu")
    try:
        start = 0
        for size in sizes:
            scorer.submit(images[start:start + size], prompts[start:start + size])
            start += size
        scores, busy = scorer.join()
    finally:
        scorer.close()
    assert busy > 0
    return scores


def _assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for key in a:
        assert a[key].dtype == b[key].dtype == torch.float32 and torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("batch_size", [0, 2])
def test_the_overlap_scorer_returns_what_one_reward_call_returns(batch_size):
    """A dict-returning scorer (toyworld: score + its checks) beside a tensor one (JPEG size), with and without
    --reward_batch_size chunking: the micro-batches' scores joined are one call's, key for key, bit for bit."""
    reward_fn = build_reward("toyworld:1.0,jpeg_compressibility:0.5", batch_size=batch_size)
    images, prompts = _images(7), _toy_prompts(7)
    _assert_identical(_scored_in_micro_batches(reward_fn, images, prompts, [3, 1, 3]), reward_fn(images, prompts))


def test_a_batch_dependent_reward_sees_the_micro_batches_as_reward_batch_size():
    """A score that depends on the batch-mates equals a sequential call with --reward_batch_size = the micro-batch
    (what the flag's help promises)."""
    def relative_brightness(images: torch.Tensor, prompts) -> dict[str, torch.Tensor]:
        mean = images.mean(dim=(1, 2, 3))
        return {"score": mean - mean.mean(), "raw": mean}

    def reward(batch_size: int) -> RewardFn:
        return RewardFn([("bright", 2.0, relative_brightness)], batch_size=batch_size)

    images, prompts = _images(6, seed=1), ["p"] * 6
    _assert_identical(_scored_in_micro_batches(reward(0), images, prompts, [3, 3]), reward(3)(images, prompts))
    assert not torch.equal(reward(0)(images, prompts)["total"], reward(3)(images, prompts)["total"])


def test_a_failed_micro_batch_skips_the_rest_and_join_raises_it():
    """The second of three micro-batches fails: the third is not scored, ``join`` raises the reward's own error once
    nothing is left running, and the next rollout scores normally."""
    calls = []

    def flaky(images: torch.Tensor, prompts) -> dict[str, torch.Tensor]:
        calls.append(len(prompts))
        if len(calls) == 2:
            raise RuntimeError("reward server http://127.0.0.1:9 failed 3 time(s), last: cannot connect")
        return {"total": images.mean(dim=(1, 2, 3))}

    scorer = OverlapScorer(flaky, "cpu")
    try:
        for n in (1, 2, 3):
            scorer.submit(_images(n), ["p"] * n)
        with pytest.raises(RuntimeError, match="http://127.0.0.1:9 failed"):
            scorer.join()
        assert calls == [1, 2]
        scorer.submit(_images(2), ["p"] * 2)
        scores, _ = scorer.join()
        assert calls == [1, 2, 2] and scores["total"].shape == (2,)
    finally:
        scorer.close()


def test_each_rank_of_a_sequence_parallel_group_scores_its_share_per_micro_batch():
    """Under --sp_size 2 a rank with 5 samples in micro-batches of 2 scores its consecutive share [3, 5) as the parts
    of micro-batches 1 and 2 that lie in it; a share left empty (1 sample, 2 ranks) scores one image, sends none."""
    share = training.Run._reward_share(SimpleNamespace(dist=SimpleNamespace(sp_size=2, sp_rank=1)), 5)
    assert share == (slice(3, 5), 2)
    assert training.Run._reward_share(SimpleNamespace(dist=SimpleNamespace(sp_size=2, sp_rank=1)), 1) == (
        slice(0, 1), 0)
    submitted = []
    scorer = SimpleNamespace(submit=lambda images, prompts: submitted.append((images[:, 0, 0, 0].tolist(), prompts)))
    pending = training.PendingRewards(scorer, list("abcde"), *share)
    images = torch.arange(5.0).view(5, 1, 1, 1).expand(5, 3, 1, 1)
    for start in range(0, 5, 2):
        mb = slice(start, min(start + 2, 5))
        pending(mb, images[mb])
    assert submitted == [([3.0], ["d"]), ([4.0], ["e"])]


def test_the_scorer_stream_waits_for_the_decode_and_holds_the_images(monkeypatch):
    """On an accelerator (a recording stand-in for torch.cuda / torch.npu) the job's work is queued on the scorer's own
    stream behind an event recorded on the caller's stream at ``submit``, with the images marked as used there; on
    the CPU there is no stream, event or wait."""
    from fastvideo import devices

    assert devices.new_stream("cpu") is None and devices.record_event("cpu") is None
    calls = []

    class Stream:
        device = "accel:0"

        def __init__(self, device=None) -> None:
            calls.append(("new stream", str(device)))

        def wait_event(self, event) -> None:
            calls.append(("stream waits", event.name))

    class Event:
        name = "decode done"

        def record(self, stream) -> None:
            calls.append(("event recorded on", stream))

    @contextlib.contextmanager
    def stream(s):
        calls.append(("enter stream", type(s).__name__))
        yield
        calls.append(("leave stream", type(s).__name__))

    module = SimpleNamespace(Stream=Stream, Event=Event, current_stream=lambda device: "sampling stream",
                             stream=stream)
    monkeypatch.setattr(devices, "device_module", lambda device: module)
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda self, s: calls.append(("images used by", type(s).__name__)), raising=False)
    scorer = OverlapScorer(lambda images, prompts: calls.append(("score", len(prompts))) or
                           {"total": torch.zeros(len(prompts))}, "accel:0")
    try:
        scorer.submit(_images(2), ["a", "b"])
        scorer.join()
    finally:
        scorer.close()
    assert calls == [("new stream", "accel:0"), ("event recorded on", "sampling stream"),
                     ("stream waits", "decode done"), ("images used by", "Stream"), ("enter stream", "Stream"),
                     ("score", 2), ("leave stream", "Stream")]


# ------------------------------------------------------------------------------------------------ end to end
def _trainer_args(script: str, toy_world: dict[str, Path], out: Path, *extra: str) -> list[str]:
    """2 prompts x 4 images of the toy world on 2 ranks: 4 per rank in rollout micro-batches of 2 (two to overlap),
    scored by the toyworld reward (per image, so overlapped scores equal sequential ones exactly)."""
    return [script, "--pretrained_model_name_or_path", str(toy_world["model"]), "--data_json_path",
            str(toy_world["train"]), "--output_dir", str(out), "--device", "cpu", "--h", "32", "--w", "32",
            "--sampling_steps", "3", "--shift", "1", "--reward", "toyworld:1.0", "--num_generations", "4",
            "--prompts_per_step", "2", "--rollout_batch_size", "2", "--train_batch_size", "2", "--lora_rank", "4",
            "--learning_rate", "1e-3", "--checkpointing_steps", "1000", "--sample_every", "0", "--no-progress_bar",
            "--seed", "0", *extra]


TRAINERS = {"grpo": ("train_grpo_flux.py", "--eta", "1.0", "--timestep_fraction", "1.0", "--max_train_steps", "2"),
            "dpo": ("train_dpo.py", "--sampler", "sde", "--eta", "1.0", "--max_train_steps", "2"),
            "nft": ("train_nft.py", "--kl_beta", "0.01", "--max_train_steps", "2")}


@pytest.fixture(scope="session")  # once per session: the slow or evidence tier reads it too
def overlap_runs(toy_world, tmp_path_factory) -> dict[str, dict[str, Path]]:
    """Each trainer's 2-step run, sequential and with --reward_overlap, in one 2-rank job (~50 s for the six runs,
    ~130 s as six jobs): ``{trainer: {"sequential": OUT, "overlap": OUT}}``."""
    root = tmp_path_factory.mktemp("overlap")
    outs = {name: {mode: root / f"{name}-{mode}" for mode in ("sequential", "overlap")} for name in TRAINERS}
    runs = []
    for name, (script, *flags) in TRAINERS.items():
        for mode, out in outs[name].items():
            args = _trainer_args(script, toy_world, out, *flags, *(["--reward_overlap"] if mode == "overlap" else []))
            runs.append((args[0], args[1:]))
    run_in_one_job(runs, root)
    return outs


@pytest.mark.parametrize("trainer", list(TRAINERS))
def test_overlapped_and_sequential_scoring_give_identical_metrics(trainer, overlap_runs):
    """The same 2-step run (2 rollout micro-batches per rank, the second sampled while the first is scored) with and
    without --reward_overlap logs the same metrics bit for bit (timings aside), and the overlapped run logs how long
    the step waited (time_reward) and how long the scorer worked (time_reward_busy)."""
    from fastvideo.logging import read_metrics

    runs = overlap_runs[trainer]
    assert_same_metrics(runs["sequential"], runs["overlap"])
    for mode, out in runs.items():
        config = json.loads((out / "config.json").read_text())
        assert config["reward_overlap"] == (mode == "overlap")
        assert config["batch_arithmetic"]["samples_per_step"] // 2 // config["rollout_batch_size"] == 2  # per rank
        rows = read_metrics(out / "metrics.jsonl")
        assert [row["step"] for row in rows] == [1, 2], (mode, rows)
        for row in rows:
            assert row["time_reward_busy"] > 0 and row["time_reward"] >= 0, (mode, row)
            if mode == "sequential":
                assert row["time_reward"] == row["time_reward_busy"]


# Rank 1's reward raises as a remote reward's client does when its server is gone, at its FAIL_AT-th call.
FAILING_REWARD = '''
import os, runpy, sys, time
sys.path.insert(0, {repo!r})
import fastvideo.rewards as rewards
from fastvideo.rewards.http import RewardServerError

build, calls = rewards.build_reward, []

def build_failing(*args, **kwargs):
    reward_fn = build(*args, **kwargs)
    def failing(images, prompts):
        calls.append(len(prompts))
        if os.environ["RANK"] == "1" and len(calls) == int(os.environ["FAIL_AT"]):
            print(f"reward fails at {{time.time()}}", flush=True)
            raise RewardServerError("reward server http://127.0.0.1:9/score failed 3 time(s), last: cannot connect "
                                    "([Errno 111] Connection refused)")
        return reward_fn(images, prompts)
    return failing

rewards.build_reward = build_failing
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


# the sequential case is slow (suite time): both paths raise through the same Run.gather_rewards agreement
@pytest.mark.parametrize("overlap", [True, pytest.param(False, marks=pytest.mark.slow(
    cover="test_reward_overlap.py::test_a_reward_failing_on_one_rank_ends_every_rank_with_its_message[overlap]",
    cost_s=10))], ids=["overlap", "sequential"])
def test_a_reward_failing_on_one_rank_ends_every_rank_with_its_message(overlap, toy_world, tmp_path):
    """Rank 1's reward fails in step 2 (step 1 checkpointed): both ranks raise the same RewardFailed naming rank 1,
    the server's URL and the intact checkpoint, and the job ends within seconds instead of rank 0 waiting in the
    reward gather; the step-1 checkpoint stays the latest complete one."""
    from fastvideo.checkpoint import latest_checkpoint

    driver = tmp_path / "failing_reward.py"
    driver.write_text(FAILING_REWARD.format(repo=str(REPO)))
    out = tmp_path / "run"
    script, *flags = TRAINERS["grpo"]
    args = _trainer_args(script, toy_world, out, *flags, "--checkpointing_steps", "1",
                         *(["--reward_overlap"] if overlap else []))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(driver), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FAIL_AT": "3" if overlap else "2"}  # step 2's first reward call
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    ended, output = time.time(), proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    failed_at = float(output.split("reward fails at ")[1].split()[0])
    # ~2-3 s here; a rank left waiting for the other would wait out the collective timeout (minutes)
    assert ended - failed_at < 60, f"the job took {ended - failed_at:.1f} s to end after the failure"
    message = "the reward failed on rank 1: RewardServerError: reward server http://127.0.0.1:9/score failed"
    for rank in (0, 1):  # each rank raised it itself, or was stopped by the other's (fail_fast)
        lines = [line for line in output.splitlines() if line.startswith(f"[rank {rank}]")]
        assert any(message in line for line in lines), (rank, lines, output[-3000:])
    assert f"checkpoint {out / 'checkpoints' / 'step-1'} is intact" in output
    assert latest_checkpoint(out) == out / "checkpoints" / "step-1"
