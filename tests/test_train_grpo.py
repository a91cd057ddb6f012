"""End-to-end GRPO runs on the tiny preset under torchrun (2 ranks, gloo, CPU)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import (REPO, assert_lora_changes_pipeline, assert_resume_matches, assert_same_metrics,
                     assert_sigterm_resume_matches, run_torchrun, shared_run)

from fastvideo.logging import read_metrics

# Keys whose values are wall-clock or memory readings: they legitimately differ between runs.


def common_args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["train_grpo_flux.py", "--pretrained_model_name_or_path", str(model), "--data_json_path", str(data),
            "--output_dir", str(out), "--device", "cpu", "--h", "64", "--w", "64", "--sampling_steps", "4",
            "--num_generations", "4", "--prompts_per_step", "2", "--rollout_batch_size", "4",
            "--train_batch_size", "2", "--timestep_fraction", "0.7", "--reward", "jpeg_compressibility:1.0",
            "--learning_rate", "1e-3", "--sample_every", "2", "--seed", "3", "--no-progress_bar", *extra]


# 4 samples per rank in micro-batches of 2, an optimizer step after each: two updates per rollout
# A 3-update warm-up then a cosine decay over the 8 updates of 4 steps: the LR of updates 0..7 is (0, 1/3, 2/3, 1, .90,
# .65, .35, .10) x 3e-2, so a resume that does not restore the schedule changes the LR column and the updates.
SCHEDULE = ("--lr_scheduler", "cosine", "--lr_warmup_steps", "3")
LORA_FLAGS = ("--max_train_steps", "4", "--checkpointing_steps", "2", "--lora_rank", "4", "--learning_rate", "3e-2",
              "--kl_beta", "0.04", "--gradient_accumulation_steps", "1", *SCHEDULE)


shared_run("grpo-lora", 2, lambda i, out: common_args(i["model"], i["data"], out, *LORA_FLAGS, "--export_dtype",
                                                     "bf16"))


@pytest.fixture(scope="module")
def lora_run(shared_runs) -> Path:
    """4 LoRA steps on 2 ranks with a checkpoint every 2 steps, KL to the adapter-disabled reference (a shared run)."""
    return shared_runs("grpo-lora")


@pytest.fixture(scope="session")  # once per session: the slow or evidence tier reads it too
def full_runs(tiny_flux_dir, tiny_data, tmp_path_factory) -> dict[str, Path]:
    """2 full-fine-tune steps with KL and EMA under FSDP2 (+ checkpointing, offload) and FSDP1 (2 ranks), and
    1 rank without FSDP. The reward is the tiny HPS model: smooth in the pixels, so runs that differ only by
    reduction order (~1e-10 in the weights) still agree on step 2 (a JPEG size can jump by bytes)."""
    from fastvideo.rewards.hpsv2 import TINY_CHECKPOINT, TINY_CONFIG, build_tiny_hps

    base = tmp_path_factory.mktemp("full")
    hps = build_tiny_hps(base / "hps-tiny", seed=0)
    flags = ("--max_train_steps", "2", "--kl_beta", "0.04", "--use_ema", "--ema_decay", "0.9", "--reward", "hpsv2:1.0",
             "--hps_checkpoint", str(hps / TINY_CHECKPOINT), "--hps_model", str(hps / TINY_CONFIG))
    runs = {"fsdp2": base / "fsdp2", "fsdp1": base / "fsdp1", "single": base / "single"}
    # the FSDP2 run also recomputes blocks in backward and offloads to the CPU: neither may change the numbers
    run_torchrun(common_args(tiny_flux_dir, tiny_data, runs["fsdp2"], *flags, "--fsdp_version", "2",
                             "--gradient_checkpointing", "--use_cpu_offload"))
    run_torchrun(common_args(tiny_flux_dir, tiny_data, runs["fsdp1"], *flags, "--fsdp_version", "1", "--export_dtype",
                             "bf16"))
    run_torchrun(common_args(tiny_flux_dir, tiny_data, runs["single"], *flags), nproc=1)
    return runs


def test_short_run_writes_every_metric(lora_run):
    rows = read_metrics(lora_run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    required = {"reward_mean", "reward_std", "reward_jpeg_compressibility", "adv_mean", "adv_std", "adv_abs_max",
                "zero_std_group_frac", "loss", "ratio_mean", "ratio_min", "ratio_max", "ratio_first_update",
                "clipfrac", "approx_kl", "kl", "grad_norm", "skipped_updates", "lr", "time_rollout", "time_decode",
                "time_reward", "time_train", "samples_per_s", "peak_memory_gb", "memory_baseline_gb",
                "clipfrac_first_update", "low_std_group_frac"}
    for row in rows:
        missing = required - row.keys()
        assert not missing, f"metrics missing {missing}"
        for key, value in row.items():
            if isinstance(value, float):
                assert math.isfinite(value), f"{key} is {value} at step {row['step']}"
        # on-policy check: the first update after a rollout replays the rollout policy exactly
        assert abs(row["ratio_first_update"] - 1.0) < 1e-5
        assert row["ratio_first_update_max_dev"] < 1e-5
        assert row["skipped_updates"] == 0
    # the second optimizer step of each rollout replays a policy that the first step moved -- except in step 1,
    # whose first update is the warm-up's first, at LR 0: it replays the rollout policy exactly
    assert rows[0]["ratio_max"] - rows[0]["ratio_min"] < 1e-5
    for row in rows[1:]:
        assert row["ratio_max"] - row["ratio_min"] > 1e-5, "the update within the rollout did not move the policy"
    lrs = [r["lr"] for r in rows]  # the LR after each step's two updates: warm-up, then the cosine decay to 0
    assert lrs[0] < lrs[1] > lrs[2] > lrs[3] == 0.0, lrs
    config = json.loads((lora_run / "config.json").read_text())
    assert Path(config["pretrained_model_name_or_path"]).name == "model"
    assert config["lora_rank"] == 4
    assert sorted(p.name for p in (lora_run / "samples").glob("*.png")) == ["step-000001.png", "step-000002.png",
                                                                             "step-000004.png"]
    assert sorted(p.name for p in (lora_run / "checkpoints").iterdir()) == ["step-2", "step-4"]


# slow for the default suite's time: a killed save: test_checkpoint_safety (default); exact resume:
# test_sigterm_checkpoints_and_resume_matches_an_uninterrupted_run[ranks]
@pytest.mark.slow(
    cover="test_checkpoint_safety.py::test_sigkill_during_a_save_keeps_the_newest_complete_checkpoint[model shards]",
    cost_s=25)
def test_sigkill_during_a_save_then_resume_continues_exactly(lora_run, tiny_flux_dir, tiny_data, tmp_path):
    """Rank 0 is SIGKILLed as it completes the step-4 checkpoint (all shards written, meta.json not yet): the job
    dies, step-2 stays the newest complete checkpoint, and --resume_from latest (which first removes the partial
    save) continues from it to the same metrics as the uninterrupted run."""
    out = tmp_path / "run"
    with pytest.raises(AssertionError, match="torchrun failed"):
        run_torchrun(["tests/dist_scripts/faulty_train.py", *common_args(tiny_flux_dir, tiny_data, out, *LORA_FLAGS)],
                     env={"FAULT": "kill_at_meta:2"})
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names[0] == "step-2" and names[1].startswith("step-4.tmp-") and len(names) == 2, names
    assert not (out / "final").exists()
    proc = run_torchrun(common_args(tiny_flux_dir, tiny_data, out, *LORA_FLAGS, "--resume_from", "latest"))
    assert "removed 1 interrupted save(s)" in proc.stdout and "resumed from" in proc.stdout
    assert_same_metrics(lora_run, out)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4"]


# the torchrun variant is slow: the signal forwarding is torchrun's; the ranks' side runs in the default "ranks" case
@pytest.mark.parametrize("target", ["ranks", pytest.param("torchrun", marks=pytest.mark.slow(
    cover="test_train_grpo.py::test_sigterm_checkpoints_and_resume_matches_an_uninterrupted_run[ranks]",
    cost_s=20))])
def test_sigterm_checkpoints_and_resume_matches_an_uninterrupted_run(lora_run, tiny_flux_dir, tiny_data, tmp_path,
                                                                       target):
    """SIGTERM during step 2 or 3 -- to every rank (as Slurm sends it), or to torchrun, which forwards it to every
    rank: the ranks finish the step together, write a checkpoint, skip the export and exit 0 (torchrun then exits 0
    too, unless it was the one signalled: it then exits 1 with its own traceback); --resume_from latest then ends
    exactly like the uninterrupted ``lora_run``."""
    out = tmp_path / "run"
    assert_sigterm_resume_matches(common_args(tiny_flux_dir, tiny_data, out, *LORA_FLAGS), lora_run, out, 4, target)


def test_lora_export_loads_in_stock_pipeline(lora_run, tiny_flux_dir):
    assert_lora_changes_pipeline(tiny_flux_dir, lora_run / "final")


# slow for the default suite's time: GRPO's full fine-tune is traced in test_fake_cuda.py and trained in
# test_sample_run.py (default); exports: test_lora_export_loads_in_stock_pipeline
@pytest.mark.slow(cover="test_train_grpo.py::test_lora_export_loads_in_stock_pipeline", cost_s=45)
def test_full_finetune_export_is_the_ema(full_runs, tiny_flux_dir):
    """final/ of a --use_ema run holds the EMA weights (from the last checkpoint's ema/ state), which differ from
    both the base model and the raw trained weights."""
    from diffusers import FluxTransformer2DModel
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    run = full_runs["fsdp2"]
    exported = FluxTransformer2DModel.from_pretrained(run / "final", local_files_only=True).state_dict()
    base = FluxTransformer2DModel.from_pretrained(tiny_flux_dir / "transformer", local_files_only=True).state_dict()
    dcp_to_torch_save(run / "checkpoints" / "step-2" / "ema", run / "ema.pt")
    dcp_to_torch_save(run / "checkpoints" / "step-2" / "state", run / "state.pt")
    ema = torch.load(run / "ema.pt", weights_only=False)["ema"]
    raw = torch.load(run / "state.pt", weights_only=False)["model"]
    assert set(exported) == set(ema) == set(base)
    for name in exported:
        torch.testing.assert_close(exported[name], ema[name], rtol=0, atol=0)
    moved = max((exported[n] - base[n]).abs().max().item() for n in exported)
    behind = max((exported[n] - raw[n]).abs().max().item() for n in exported)
    assert moved > 1e-6 and behind > 1e-6, (moved, behind)
    rows = read_metrics(full_runs["fsdp2"] / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-9), "policy equals the reference before any update"
    assert rows[1]["kl"] > 0, "after one update the policy differs from the frozen reference"


# slow for the default suite's time: the exact resume under this schedule runs in the default suite in
# test_sigterm_checkpoints_and_resume_matches_an_uninterrupted_run[ranks] (LoRA); the EMA's checkpoint round trip in
# test_checkpoint.py::test_resume_continues_bit_identically_world_size_one (default)
@pytest.mark.slow(cover="test_checkpoint.py::test_resume_continues_bit_identically_world_size_one", cost_s=25)
def test_full_finetune_with_ema_resumes_exactly(tiny_flux_dir, tiny_data, tmp_path):
    """Full fine-tune with KL, EMA and a warm-up + cosine schedule on 2 ranks: 4 steps straight = 2 steps + resume +
    2 steps, in every metric (the LR column included) and bit for bit in the exported EMA transformer."""
    from diffusers import FluxTransformer2DModel

    flags = ("--max_train_steps", "4", "--checkpointing_steps", "2", "--lora_rank", "0", "--use_ema", "--ema_decay",
             "0.9", "--kl_beta", "0.04", "--gradient_accumulation_steps", "1", *SCHEDULE)
    straight = tmp_path / "straight"
    run_torchrun(common_args(tiny_flux_dir, tiny_data, straight, *flags))
    out = tmp_path / "resumed"
    assert_resume_matches(straight, out, 2, common_args(tiny_flux_dir, tiny_data, out, *flags))
    rows = read_metrics(straight / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    lrs = [r["lr"] for r in rows]
    assert lrs[0] < lrs[1] > lrs[2] > lrs[3] == 0.0, lrs
    assert rows[3]["kl"] > 0
    a, b = (FluxTransformer2DModel.from_pretrained(run / "final", local_files_only=True).state_dict()
            for run in (straight, out))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "the resumed EMA export differs"


# slow for the default suite's time: GRPO's full fine-tune is traced in test_fake_cuda.py and trained in
# test_sample_run.py (default); exports: test_lora_export_loads_in_stock_pipeline
@pytest.mark.slow(cover="test_train_grpo.py::test_lora_export_loads_in_stock_pipeline", cost_s=1)
def test_exports_are_written_in_the_export_dtype(full_runs, lora_run, tiny_flux_dir):
    """--export_dtype auto writes the base model's stored dtype (fp32 for the tiny model), bf16 half the bytes; both
    load with from_pretrained / load_lora_weights (test_lora_export_loads_in_stock_pipeline: the bf16 LoRA) and
    training_args.json records the dtype written."""
    from diffusers import FluxTransformer2DModel

    from fastvideo.weights import safetensors_index

    def written(folder: Path) -> tuple[set, int, str]:  # (dtypes, tensor bytes without the JSON header, recorded)
        records = safetensors_index(folder).values()
        size = sum(r.numel * torch.empty((), dtype=r.dtype).element_size() for r in records)
        recorded = json.loads((folder / "training_args.json").read_text())["exported_dtype"]
        return {r.dtype for r in records}, size, recorded

    fp32_dtypes, fp32_bytes, fp32_name = written(full_runs["fsdp2"] / "final")  # auto: the folder's fp32
    bf16_dtypes, bf16_bytes, bf16_name = written(full_runs["fsdp1"] / "final")
    assert (fp32_dtypes, fp32_name, bf16_dtypes, bf16_name) == ({torch.float32}, "fp32", {torch.bfloat16}, "bf16")
    assert 2 * bf16_bytes == fp32_bytes, (fp32_bytes, bf16_bytes)
    fp32 = FluxTransformer2DModel.from_pretrained(full_runs["fsdp2"] / "final", local_files_only=True).state_dict()
    bf16 = FluxTransformer2DModel.from_pretrained(full_runs["fsdp1"] / "final", local_files_only=True).state_dict()
    for name in fp32:  # the FSDP1 and FSDP2 runs agree to ~1e-6, far below bf16's rounding
        torch.testing.assert_close(bf16[name].float(), fp32[name].to(torch.bfloat16).float(), rtol=2 ** -7, atol=1e-6)
    assert written(lora_run / "final")[0::2] == ({torch.bfloat16}, "bf16")


# slow for the default suite's time: GRPO's full fine-tune is traced in test_fake_cuda.py and trained in
# test_sample_run.py (default); exports: test_lora_export_loads_in_stock_pipeline
@pytest.mark.slow(cover="test_train_grpo.py::test_short_run_writes_every_metric", cost_s=1)
def test_world_size_does_not_change_rewards(full_runs):
    two = read_metrics(full_runs["fsdp2"] / "metrics.jsonl")
    one = read_metrics(full_runs["single"] / "metrics.jsonl")
    for key in ("reward_mean", "reward_std", "reward_hpsv2"):
        assert one[0][key] == pytest.approx(two[0][key], rel=1e-6, abs=1e-7), key
    # the first update is the same too, so step 2 samples from the same policy. Its loss is the mean of zero-mean
    # advantages times ratios of 1: zero up to rounding (measured 0.0 on 1 rank vs 1.1e-8 on 2 ranks on one CPU), so
    # it is checked at that scale; the gradient norm is what tells two updates apart
    assert abs(one[0]["loss"]) < 1e-6 and abs(two[0]["loss"]) < 1e-6, (one[0]["loss"], two[0]["loss"])
    assert one[0]["grad_norm"] == pytest.approx(two[0]["grad_norm"], rel=1e-4, abs=1e-8)
    assert one[1]["reward_mean"] == pytest.approx(two[1]["reward_mean"], rel=1e-4)


# slow for the default suite's time: FSDP2 trains in every
# default trainer test, FSDP1 shards, saves and loads in test_checkpoint.py::test_sharded_checkpoints (default)
@pytest.mark.slow(cover="test_checkpoint.py::test_sharded_checkpoints", cost_s=1)
def test_fsdp1_and_fsdp2_agree(full_runs):
    a = read_metrics(full_runs["fsdp2"] / "metrics.jsonl")
    b = read_metrics(full_runs["fsdp1"] / "metrics.jsonl")
    for ra, rb in zip(a, b):
        for key in ("reward_mean", "loss", "grad_norm", "ratio_mean", "kl"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-4, abs=1e-6), (ra["step"], key)


# the plain window and dance_sde are slow (suite time): cps+window+kl runs a window in the default suite; dance_sde's
# step is checked against its float64 reference in test_schedulers.py, decode_x0 and init_same_noise in
# test_rollout.py (default)
@pytest.mark.parametrize("flags", [
    pytest.param(("--sde_window_size", "2", "--sde_type", "flow_sde"), marks=pytest.mark.slow(
        cover="test_train_grpo.py::test_short_run_writes_every_metric",
        cost_s=12)),
    pytest.param(("--sde_type", "dance_sde", "--eta", "0.3", "--decode_x0", "--init_same_noise", "--last_step", "sde"),
                 marks=pytest.mark.slow(cover="test_train_grpo.py::test_short_run_writes_every_metric", cost_s=12)),
    # slow for the default suite's time: by default a window with KL runs through update_policy in the pretend-CUDA
    # trace's GRPO-Guard path (test_fake_cuda.py), cps's step against float64 in test_schedulers.py and its KL scale
    # in test_parity_switches.py
    pytest.param(("--sde_type", "cps", "--eta", "0.8", "--sde_window_size", "2", "--sde_window_range", "0", "3",
                  "--last_step", "sde", "--kl_beta", "0.04", "--lora_rank", "4"), marks=pytest.mark.slow(
                      cover="test_train_grpo.py::test_short_run_writes_every_metric",
                      cost_s=12)),
], ids=["window", "dance_sde+decode_x0+init_same_noise", "cps+window+kl"])
def test_sampler_variants_end_to_end(tiny_flux_dir, tiny_data, tmp_path, flags):
    """2 ranks, 2 steps of each sampler variant: finite metrics and the on-policy ratio exactly 1 at the first update."""
    out = tmp_path / "run"
    args = common_args(tiny_flux_dir, tiny_data, out, "--max_train_steps", "2", *flags)
    if "--sde_window_size" in flags:  # common_args sets --timestep_fraction, which a window run must not
        i = args.index("--timestep_fraction")
        del args[i:i + 2]
    run_torchrun(args)
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float)), row
        assert row["ratio_first_update_max_dev"] < 1e-5 and row["clipfrac_first_update"] == 0.0
        assert row["trained_timesteps"] == 2  # the window's 2 steps, or int(3 x 0.7)


def test_silent_flags_are_refused(tiny_flux_dir, tiny_data, tmp_path):
    """Flags that would do nothing are errors before anything loads."""
    from fastvideo.objectives import parse_grpo_args, validate_grpo

    def check(*extra: str, drop_fraction: bool = False) -> str:
        args = common_args(tiny_flux_dir, tiny_data, tmp_path / "x", *extra)[1:]
        if drop_fraction:
            i = args.index("--timestep_fraction")
            del args[i:i + 2]
        with pytest.raises(ValueError) as err:
            validate_grpo(parse_grpo_args(args), 2)
        return str(err.value)

    # (the default range itself, 0 S-1, is what validation resolves an unset range to: accepted, so that a run's
    # config.json passes validation again)
    assert "--sde_window_size" in check("--sde_window_range", "0", "2")
    assert "--timestep_fraction" in check("--sde_window_size", "2")
    assert "--lr_scheduler constant_with_warmup" in check("--lr_scheduler", "constant", "--lr_warmup_steps", "10")
    assert "--last_step sde" in check("--sde_window_size", "2", "--sde_window_range", "0", "4", "--last_step", "ode",
                                      drop_fraction=True)
    assert "--fsdp_version 2" in check("--gradient_sync", "step", "--lora_rank", "4", "--fsdp_version", "1")
    assert "--gradient_sync backward" in check("--gradient_sync", "step")
    # the default without a window is DanceGRPO's 0.6; a window leaves it unset
    args = common_args(tiny_flux_dir, tiny_data, tmp_path / "x")[1:]
    i = args.index("--timestep_fraction")
    del args[i:i + 2]
    parsed = parse_grpo_args(args)
    validate_grpo(parsed, 2)
    assert parsed.timestep_fraction == 0.6


def test_resume_below_the_checkpoint_step_is_refused(lora_run, tiny_flux_dir, tiny_data):
    """--max_train_steps below the newest checkpoint's step: an error naming the fix, not a silent re-export."""
    final = (lora_run / "final" / "pytorch_lora_weights.safetensors").stat().st_mtime_ns
    flags = [f for f in LORA_FLAGS]
    flags[flags.index("--max_train_steps") + 1] = "3"
    proc = subprocess.run([sys.executable, *common_args(tiny_flux_dir, tiny_data, lora_run, *flags,
                                                        "--resume_from", "latest")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--max_train_steps 3 is below the step of the checkpoint" in proc.stderr
    assert (lora_run / "final" / "pytorch_lora_weights.safetensors").stat().st_mtime_ns == final


# slow for the default suite's time (six processes): by default test_flag_layers.py checks that a bad flag or input
# path is one line and exit status 2 before anything loads (an unknown reward too, via --check_only),
# test_bad_inputs.py the embeddings' and the batch flags' refusals in process, test_grpo_objectives.py GRPO's
@pytest.mark.slow(cover="test_flag_layers.py::test_a_bad_flag_is_one_line_and_exit_status_2", cost_s=15)
def test_bad_flags_fail_before_loading(tiny_flux_dir, tiny_data, tmp_path):
    def run(*extra: str) -> str:
        proc = subprocess.run([sys.executable, *common_args(tiny_flux_dir, tiny_data, tmp_path / "bad", *extra)],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0
        return proc.stderr

    assert "--num_generations" in run("--num_generations", "1")
    assert "--train_batch_size" in run("--num_generations", "3", "--prompts_per_step", "1")
    assert "--eta" in run("--eta", "0")
    assert "--pretrained_model_name_or_path" in run("--pretrained_model_name_or_path", str(tmp_path / "nope"))
    assert "preprocess_embeddings.py" in run("--data_json_path", str(tmp_path / "nothing"))
    assert "jpeg_compresibility" in run("--reward", "jpeg_compresibility:1")
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()


def test_fresh_run_refuses_to_overwrite_a_run(lora_run, tiny_flux_dir, tiny_data):
    before = (lora_run / "metrics.jsonl").read_text()
    proc = subprocess.run([sys.executable, *common_args(tiny_flux_dir, tiny_data, lora_run, "--lora_rank", "4")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--resume_from latest" in proc.stderr
    assert (lora_run / "metrics.jsonl").read_text() == before


def test_resume_with_other_flags_is_refused_before_loading(lora_run, tiny_flux_dir, tiny_data):
    config = (lora_run / "config.json").read_text()
    proc = subprocess.run([sys.executable, *common_args(tiny_flux_dir, tiny_data, lora_run, *LORA_FLAGS,
                                                        "--lora_rank", "8", "--resume_from", "latest")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--lora_rank: checkpoint 4 vs now 8" in proc.stderr
    assert (lora_run / "config.json").read_text() == config, "a refused resume must not rewrite config.json"


@pytest.mark.evidence(cover="test_train_grpo.py::test_short_run_writes_every_metric", cost_s=55)
def test_grpo_raises_a_weight_free_reward(tiny_flux_dir, tiny_data, tmp_path):
    """40 GRPO steps (2 ranks, 32 samples/step) shrink the images' JPEG size; the lr-0 control stays flat.

    Measured when choosing these settings (seeds 0/1/2, 206 prompts): -29%, -25%, -24% for lr 1e-3;
    the lr-0 control moved < 1%.
    """
    def run(name: str, lr: str) -> float:
        out = tmp_path / name
        run_torchrun(["train_grpo_flux.py", "--pretrained_model_name_or_path", str(tiny_flux_dir),
                      "--data_json_path", str(tiny_data), "--output_dir", str(out), "--device", "cpu",
                      "--h", "64", "--w", "64", "--sampling_steps", "8", "--num_generations", "8",
                      "--prompts_per_step", "4", "--rollout_batch_size", "16", "--train_batch_size", "16",
                      "--global_std", "--reward", "jpeg_compressibility:1.0", "--learning_rate", lr,
                      "--max_train_steps", "40", "--seed", "0", "--sample_every", "0", "--checkpointing_steps",
                      "1000", "--no-progress_bar"])
        size_kb = [-500 * r["reward_jpeg_compressibility"] for r in read_metrics(out / "metrics.jsonl")]
        first, last = sum(size_kb[:5]) / 5, sum(size_kb[30:40]) / 10
        print(f"{name}: JPEG size {first:.3f} kB (steps 1-5) -> {last:.3f} kB (steps 31-40)")
        return last / first - 1

    trained = run("trained", "1e-3")
    control = run("control", "0")
    assert abs(control) < 0.05, f"lr 0 moved the reward by {control:.1%}: the rise is not from learning"
    assert trained < -0.10, f"GRPO changed the JPEG size by only {trained:.1%} in 40 steps"
