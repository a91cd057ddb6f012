"""Issue #12: non-finite rewards and gradients, an unwritable --output_dir, resume checks, and the signal handler.

(SIGTERM and SIGKILL of running trainings: tests/test_train_grpo.py; SIGKILL at each point of a save, a full
disk and safe loading: tests/test_checkpoint_safety.py; the bad-input matrix: tests/test_bad_inputs.py.)
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import REPO, free_port

from fastvideo.logging import read_metrics
from test_train_dpo import dpo_args
from test_train_grpo import LORA_FLAGS, common_args
from test_train_nft import nft_args


def torchrun(args: list[str], nproc: int, fault: str | None = None, timeout: float = 300
             ) -> subprocess.CompletedProcess:
    """``args`` under torchrun (through tests/dist_scripts/faulty_train.py when ``fault`` is set), output kept,
    failure allowed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"FAULT": fault} if fault else {})}
    script = ["tests/dist_scripts/faulty_train.py"] if fault else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), *script, *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_a_nan_reward_stops_every_rank_naming_the_reward_and_prompt(tiny_flux_dir, tiny_data, tmp_path):
    out = tmp_path / "run"
    proc = torchrun(common_args(tiny_flux_dir, tiny_data, out, "--max_train_steps", "2", "--lora_rank", "4"), 2,
                    fault="nan_reward")
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "ValueError: reward 'jpeg_compressibility' returned nan for prompt '" in output
    assert "(2 of 8 samples non-finite)" in output and "--nonfinite_reward drop" in output
    assert not (out / "metrics.jsonl").exists() or not read_metrics(out / "metrics.jsonl")  # stopped in step 1


# DPO's and NFT's are slow (suite time): the drop is the shared Run.score_rollout path GRPO's case runs by default
SLOW_DROP = pytest.mark.slow(cover="test_reliability.py::test_nonfinite_reward_drop_trains_on_without_the_sample[grpo]",
                             cost_s=8)


@pytest.mark.parametrize("trainer", ["grpo", pytest.param("dpo", marks=SLOW_DROP), pytest.param("nft", marks=SLOW_DROP)])
def test_nonfinite_reward_drop_trains_on_without_the_sample(tiny_flux_dir, tiny_data, tmp_path, trainer):
    """--nonfinite_reward drop: the NaN sample of every step is dropped and counted; every other metric stays
    finite and no update is skipped (GRPO: advantage 0; DPO: never in a pair; NFT: masked out of the loss)."""
    out = tmp_path / trainer
    flags = ("--max_train_steps", "2", "--lora_rank", "4", "--nonfinite_reward", "drop")
    args = {"grpo": lambda: common_args(tiny_flux_dir, tiny_data, out, *flags),
            "dpo": lambda: dpo_args(tiny_flux_dir, tiny_data, out, *flags, "--prompts_per_step", "2",
                                    "--num_generations", "3", "--reward", "jpeg_compressibility:1.0"),
            "nft": lambda: nft_args(tiny_flux_dir, tiny_data, out, *flags, "--prompts_per_step", "2",
                                    "--num_generations", "2", "--reward", "jpeg_compressibility:1.0")}[trainer]()
    proc = torchrun(args, 1, fault="nan_reward")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["dropped_samples"] for r in rows] == [1, 2]
    assert "warning: dropped 1 sample(s) with a non-finite reward" in proc.stdout
    for row in rows:
        assert row["skipped_updates"] == 0
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        if trainer == "dpo":  # a step whose every pair was skipped logs NaN pair metrics by design: not here
            assert row["trained_pairs"] >= 1
        assert not bad, bad
    assert (out / "final").is_dir()


def test_too_many_skipped_updates_checkpoint_and_stop(tiny_flux_dir, tiny_data, tmp_path):
    out = tmp_path / "run"
    proc = torchrun(common_args(tiny_flux_dir, tiny_data, out, "--max_train_steps", "5", "--lora_rank", "4",
                                "--max_consecutive_skips", "1", "--checkpointing_steps", "100"), 1, fault="inf_grad")
    assert proc.returncode != 0
    assert "RuntimeError: 2 updates in a row were skipped for a non-finite loss or gradient (more than " \
           "--max_consecutive_skips 1) at step 2" in proc.stderr, proc.stderr[-3000:]
    assert [r["skipped_updates"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]  # one update a rollout
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2"]
    meta = json.loads((out / "checkpoints" / "step-2" / "meta.json").read_text())
    assert meta["algorithm"] == "grpo" and meta["step"] == 2


def test_an_unwritable_output_dir_is_refused_before_loading(tiny_flux_dir, tiny_data, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    proc = subprocess.run([sys.executable, *common_args(tiny_flux_dir, tiny_data, blocker / "run", *LORA_FLAGS)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f"--output_dir {blocker / 'run'} is not writable on rank 0 (FileExistsError" in proc.stderr or \
           f"--output_dir {blocker / 'run'} is not writable on rank 0 (NotADirectoryError" in proc.stderr, proc.stderr
    assert "choose a directory every rank can write to" in proc.stderr
    assert "loading" not in proc.stdout.lower()


def _fake_checkpoint(root: Path, step: int, meta: dict | None) -> Path:
    path = root / "checkpoints" / f"step-{step}"
    path.mkdir(parents=True)
    if meta is not None:
        (path / "meta.json").write_text(json.dumps(meta))
    return path


def test_resume_checks_completeness_algorithm_and_fingerprint(tmp_path):
    from fastvideo.resume import check_resume_checkpoint, run_identity

    config = {"algorithm": "grpo", "lora_rank": 4, "learning_rate": 1e-3, "sde_window_range": (0, 5)}
    with pytest.raises(FileNotFoundError, match="missing meta.json: not a checkpoint, or interrupted mid-save"):
        check_resume_checkpoint(_fake_checkpoint(tmp_path / "a", 3, None), config)
    same = run_identity(config)
    check_resume_checkpoint(_fake_checkpoint(tmp_path / "b", 3, same), config)  # JSON lists == tuples: accepted
    with pytest.raises(ValueError, match=r"is a DPO checkpoint but this is the GRPO trainer: resume it with "
                                         r"train_dpo.py"):
        check_resume_checkpoint(_fake_checkpoint(tmp_path / "c", 3, run_identity({**config, "algorithm": "dpo"})),
                                config)
    with pytest.raises(ValueError, match="--lora_rank: checkpoint 8 vs now 4"):
        check_resume_checkpoint(_fake_checkpoint(tmp_path / "d", 3, run_identity({**config, "lora_rank": 8})),
                                config)
    tampered = {**same, "config_fingerprint": "0" * 64}
    with pytest.raises(ValueError, match="config fingerprint differs"):
        check_resume_checkpoint(_fake_checkpoint(tmp_path / "e", 3, tampered), config)
    legacy = _fake_checkpoint(tmp_path / "f", 3, {"format_version": 1})  # format 1: the run's config.json decides
    (tmp_path / "f" / "config.json").write_text(json.dumps({**config, "learning_rate": 5e-4}))
    with pytest.raises(ValueError, match="--learning_rate: checkpoint 0.0005 vs now 0.001"):
        check_resume_checkpoint(legacy, config)


def test_a_second_signal_exits_at_once_and_a_duplicate_does_not(tmp_path):
    """The first SIGTERM only asks for a stop; a copy within REPEAT_AFTER_S (torchrun forwarding what every process
    already got) is ignored; a later one exits at once with 128 + 15."""
    code = textwrap.dedent("""
        import os, signal, time
        from fastvideo import preemption
        with preemption.stop_on_signals():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)  # within REPEAT_AFTER_S: the same request
            print("requested", preemption.requested(), flush=True)
            time.sleep(preemption.REPEAT_AFTER_S + 0.2)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
            print("still running", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 128 + 15, proc.stderr
    assert proc.stdout == "requested SIGTERM\n"
    assert "second SIGTERM: exiting now" in proc.stderr
