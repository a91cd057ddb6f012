"""FLUX.1-dev must fit: gradient reduction, sharded loading, CPU-offload process groups, the memory planner and
``--dry_run`` — each measured on the CPU (2 ranks, gloo) with small models of FLUX's architecture."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import REPO, make_embeddings, run_torchrun

SCRIPT = "tests/dist_scripts/memory_checks.py"
# glibc keeps freed heap memory (its mmap threshold grows up to 32 MB), so RSS would remember every transient;
# a fixed threshold returns large blocks on free and RSS follows live tensors, like CUDA's memory_allocated.
RSS_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def results(proc: subprocess.CompletedProcess) -> dict[int, dict]:
    """Each rank's ``RESULT {...}`` (flat JSON); ranks share stdout, so lines may interleave."""
    rows = [json.loads(m) for m in re.findall(r"RESULT (\{[^{}]*\})", proc.stdout)]
    return {r["rank"]: r for r in rows}


def run_single(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **RSS_ENV}
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="session")  # once per session: the slow or evidence tier reads it too
def bench_dir(tmp_path_factory) -> Path:
    from fastvideo.tiny import build_tiny_flux

    return build_tiny_flux(tmp_path_factory.mktemp("bench") / "model", preset="bench", seed=0)


# ------------------------------------------------------------------------------------ gradient reduction
# slow for the default suite's time: the plan's gradient items: test_plan_arithmetic_for_flux_dev (default)
@pytest.mark.slow(cover="test_memory.py::test_plan_arithmetic_for_flux_dev", cost_s=15)
def test_gradient_reduction_per_backward_keeps_only_shards(bench_dir):
    """Full fine-tune, FSDP2, 2 ranks, a 4-micro-batch accumulation cycle. Measured: the gradient tensors FSDP2
    holds between backwards (unsharded accumulation buffers + sharded gradients), not RSS."""
    r = results(run_torchrun([SCRIPT, "grad_accum", str(bench_dir)], env=RSS_ENV))
    for rank in (0, 1):
        m = r[rank]
        full, world = m["full_fp32_grad_bytes"], m["world"]
        # --gradient_sync backward: nothing unsharded survives a backward; each rank holds 1/world of the gradients
        assert m["backward_peak_unsharded_bytes"] == 0
        assert m["backward_peak_grad_bytes"] <= full / world + m["unit_bytes"]
        # --gradient_sync step (what every backward did before): the whole fp32 gradient on every rank
        assert m["step_peak_unsharded_bytes"] >= 0.99 * full
    # same gradients as the one-sync mode and as one process on the whole batch
    assert r[0]["backward_max_err"] < 1e-5 and r[0]["step_max_err"] < 1e-5
    assert r[0]["step_vs_backward"] < 1e-5


def test_gradient_sync_modes():
    from fastvideo.parallel import resolve_gradient_sync

    assert resolve_gradient_sync("auto", is_lora=True) == "step"
    assert resolve_gradient_sync("auto", is_lora=False) == "backward"
    assert resolve_gradient_sync("backward", is_lora=True) == "backward"
    with pytest.raises(ValueError, match="--gradient_sync backward"):
        resolve_gradient_sync("step", is_lora=False)
    with pytest.raises(ValueError, match="--gradient_sync"):
        resolve_gradient_sync("never", is_lora=True)


# ------------------------------------------------------------------------------------------ sharded loading
@pytest.fixture(scope="session")  # once per session: the slow or evidence tier reads it too
def large_dir(tmp_path_factory) -> Path:
    """A 100M-parameter FLUX-architecture transformer (hidden 768) saved as bf16 safetensors in three files, as
    FLUX.1-dev is: loading it as fp32 master weights costs 400 MB, enough to dominate RSS noise."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(in_channels=64, num_layers=2, num_single_layers=6, attention_head_dim=64,
                                   num_attention_heads=12, joint_attention_dim=768, pooled_projection_dim=768,
                                   guidance_embeds=True, axes_dims_rope=(8, 28, 28)).to(torch.bfloat16)
    out = tmp_path_factory.mktemp("large") / "model"
    model.save_pretrained(out / "transformer", max_shard_size="80MB")
    assert len(list((out / "transformer").glob("*.safetensors"))) == 3
    return out


# evidence: the measured RSS of sharded loading against a single process; the loader runs by default in every trainer
# test and in test_safetensors_reader_matches_from_pretrained
@pytest.mark.evidence(cover="test_memory.py::test_safetensors_reader_matches_from_pretrained", cost_s=30)
@pytest.mark.parametrize("kl", [False, True], ids=["policy", "policy+reference"])
def test_sharded_loading_rss(large_dir, kl):
    """Peak RSS increase while building, sharding and loading the policy (and the frozen reference of a full
    fine-tune with --kl_beta): the sum over 2 ranks <= 1.3 x one process; the old path (every rank loads the whole
    fp32 model) measured ~2x with the same probe; weights identical to the files on every path."""
    extra = ["--kl"] if kl else []
    single = results(run_single([SCRIPT, "load", str(large_dir), "new", *extra]))[0]
    two = results(run_torchrun([SCRIPT, "load", str(large_dir), "new", *extra], env=RSS_ENV))
    old = results(run_torchrun([SCRIPT, "load", str(large_dir), "old", *extra], env=RSS_ENV))
    model_mib = 100.28e6 * 4 / 2**20 * (2 if kl else 1)
    assert single["peak_rss_increase_mib"] > 0.8 * model_mib  # the probe sees the weights
    total_new = sum(r["peak_rss_increase_mib"] for r in two.values())
    total_old = sum(r["peak_rss_increase_mib"] for r in old.values())
    assert total_new <= 1.3 * single["peak_rss_increase_mib"], (total_new, single)
    assert total_old >= 1.7 * single["peak_rss_increase_mib"], (total_old, single)  # the probe can fail
    assert single["max_abs_diff_vs_file"] == 0.0 and two[0]["max_abs_diff_vs_file"] == 0.0


# both slow for the default suite's time: sharded loading is exact in every default trainer test (e.g. the resume
# tests compare bit for bit) and in test_checkpoint.py::test_sharded_checkpoints
@pytest.mark.slow(cover="test_checkpoint.py::test_sharded_checkpoints", cost_s=15)
@pytest.mark.parametrize("flags, nproc", [(["--fsdp_version", "2", "--strategy", "hybrid_full", "--lora_rank", "4"], 3),
                                          pytest.param(["--fsdp_version", "1", "--strategy", "shard_grad_op"], 2,
                                                       marks=pytest.mark.slow(
                                                           cover="test_checkpoint.py::test_sharded_checkpoints",
                                                           cost_s=15))],  # FSDP1: slow (suite time)
                         ids=["fsdp2-hybrid-lora-3-ranks", "fsdp1-shard_grad_op"])
def test_sharded_loading_is_exact_for_other_layouts(bench_dir, flags, nproc):
    """3 ranks: uneven dim-0 shards (e.g. 64 rows -> 22/22/20), which must match FSDP2's own chunking."""
    r = results(run_torchrun([SCRIPT, "load", str(bench_dir), "new", *flags], nproc=nproc))
    assert r[0]["max_abs_diff_vs_file"] == 0.0


# evidence: measured RSS bands of the export; the export's gathering runs by default in
# test_parallel.py::test_sharded_training_matches_single_process (full_state_dict: the whole model on rank 0, {} elsewhere)
@pytest.mark.evidence(cover="test_parallel.py::test_sharded_training_matches_single_process", cost_s=12)
@pytest.mark.parametrize("version", [1, 2])
def test_export_gathers_at_most_one_unit_beside_rank_0(large_dir, version):
    """full_state_dict for the final export: rank 0 ends with the whole model; the other ranks never hold more than
    an FSDP unit or two (FSDP1 used to gather everything on every rank when the parameters were on the CPU)."""
    r = results(run_torchrun([SCRIPT, "export", str(large_dir), "--fsdp_version", str(version)], env=RSS_ENV))
    model_mib = 100.28e6 * 4 / 2**20
    assert 0.9 * model_mib <= r[0]["peak_rss_increase_mib"] <= 1.25 * model_mib  # one full copy, not two
    assert r[0]["max_abs_diff_vs_file"] == 0.0
    # before: rank 1 gathered the whole model (417 MiB measured); now at most two units (~2 x 85 MB here)
    assert r[1]["keys"] == 0 and r[1]["peak_rss_increase_mib"] <= 0.6 * model_mib, r[1]


def test_safetensors_reader_matches_from_pretrained(bench_dir):
    from fastvideo import parallel, weights
    from fastvideo.models import flux

    expected = flux.load_transformer(bench_dir).state_dict()
    model = parallel.shard_model(flux.build_transformer(bench_dir))  # world size 1: materialised, uninitialised
    read = weights.load_safetensors_into(model, flux.transformer_folder(bench_dir))
    assert read == sum(v.numel() * 4 for v in expected.values())
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    # a dim-0 range is the rows of the flattened tensor
    record = weights.safetensors_index(flux.transformer_folder(bench_dir))["proj_out.weight"]
    cols = record.shape[1]
    assert torch.equal(weights.read_flat(record, 2 * cols, 5 * cols).view(3, cols), expected["proj_out.weight"][2:5])


def test_loader_errors_name_the_fix(bench_dir, tmp_path):
    from fastvideo import weights
    from fastvideo.models import flux

    with pytest.raises(FileNotFoundError, match="safetensors"):
        weights.safetensors_index(tmp_path)
    model = flux.build_transformer(bench_dir).to_empty(device="cpu")
    with pytest.raises(ValueError, match="unmodified diffusers FLUX folder"):
        weights.load_safetensors_into(model, flux.transformer_folder(bench_dir),
                                      skip=lambda n: n.startswith("proj_out"))


def test_lora_init_is_the_same_on_meta_and_on_a_real_model(bench_dir):
    from fastvideo import lora, parallel, weights
    from fastvideo.models import flux

    real = lora.add_lora(flux.load_transformer(bench_dir), rank=4, alpha=4, init_seed=7)
    meta = lora.add_lora(flux.build_transformer(bench_dir), rank=4, alpha=4, init_seed=7)
    init = lora.initial_adapter_weights(meta, 7)
    meta = parallel.shard_model(meta)
    weights.load_safetensors_into(meta, flux.transformer_folder(bench_dir), skip=init.__contains__)
    weights.fill_local_shards(meta, init)
    real_sd, meta_sd = real.state_dict(), meta.state_dict()
    assert set(real_sd) == set(meta_sd)
    for name in real_sd:
        assert torch.equal(real_sd[name], meta_sd[name]), name
    a = [v for k, v in real_sd.items() if "lora_A" in k][0]
    assert a.abs().max() <= 1 / a.shape[1] ** 0.5 and a.std() > 0  # peft's Kaiming-uniform bound
    assert all(v.abs().max() == 0 for k, v in real_sd.items() if "lora_B" in k)


# ------------------------------------------------------------------------------------ offload process groups
def test_process_group_backend_strings():
    from fastvideo.distributed import process_group_backend

    assert process_group_backend("cuda") == "nccl"
    assert process_group_backend("cuda", cpu_collectives=True) == "cuda:nccl,cpu:gloo"
    assert process_group_backend("npu", cpu_collectives=True) == "npu:hccl,cpu:gloo"
    assert process_group_backend("cpu", cpu_collectives=True) == "gloo"
    with pytest.raises(ValueError, match="--device"):
        process_group_backend("tpu")


def test_memory_flags_that_cannot_take_effect():
    from fastvideo.parallel import memory_flag_problems

    errors, _ = memory_flag_problems(1, "cuda", cpu_offload=True, compute_bf16=True)
    assert errors and "--use_cpu_offload" in errors[0] and "torchrun" in errors[0]
    errors, warnings = memory_flag_problems(2, "cpu", cpu_offload=True, compute_bf16=False)
    assert not errors and "does nothing on a CPU job" in warnings[0]
    errors, warnings = memory_flag_problems(1, "cuda", cpu_offload=False, compute_bf16=True)
    assert not errors and "world size 1" in warnings[0]
    assert memory_flag_problems(8, "cuda", cpu_offload=True, compute_bf16=True) == ([], [])


# ------------------------------------------------------------------------------------------ planner, dry run
def _plan_lines(stdout: str) -> dict[str, float]:
    out = {}
    for line in stdout.splitlines():
        m = re.match(r"\s+(peak per rank.*?)\s+([\d.]+)\s+([\d.]+)\s*$", line)
        if m:
            out["peak"], out["host"] = float(m.group(2)), float(m.group(3))
    return out


@pytest.fixture(scope="session")  # once per session: the slow or evidence tier reads it too
def bench_data(bench_dir, tmp_path_factory) -> Path:
    return make_embeddings(bench_dir, tmp_path_factory.mktemp("bench-emb"), 8)


# evidence (~45 s each): the whole plan measured against a run. The plan's items are checked by default:
# test_plan_arithmetic_for_flux_dev (model states; LoRA's adapter state and the unsharded gradient accumulation of
# --gradient_sync step), test_activation_extrapolation_equals_the_full_trace (activations), test_nft_plan_holds_the_old_
# policy_and_its_buffers (NFT's extra copies).
@pytest.mark.evidence(cover="test_memory.py::test_activation_extrapolation_equals_the_full_trace", cost_s=45)
@pytest.mark.parametrize("script,mode", [("train_grpo_flux.py", []), ("train_grpo_flux.py", ["--lora_rank", "8"]),
                                         ("train_nft.py", ["--kl_beta", "1e-4"])], ids=["full", "lora", "nft-full"])
def test_planner_within_25_percent_of_measured_peak(bench_dir, bench_data, tmp_path, script, mode):
    """bench preset (10M params, 256 px, 512 text tokens), 2 ranks, 2 steps: the plan's peak per rank vs the
    measured peak RSS increase over the RSS before any model is built (max over ranks, glibc caching off). The NFT
    full fine-tune holds two more sharded transformers (the fp32 old policy, the frozen reference) and runs their
    forwards next to each trained one."""
    flags = ["--pretrained_model_name_or_path", str(bench_dir), "--data_json_path", str(bench_data), "--device",
             "cpu", "--h", "256", "--w", "256", "--sampling_steps", "4", "--num_generations", "4",
             "--prompts_per_step", "2", "--rollout_batch_size", "4", "--train_batch_size", "2",
             "--timestep_fraction", "0.34" if script == "train_grpo_flux.py" else "0.5", "--reward",
             "jpeg_compressibility:1.0", "--max_train_steps", "2", "--sample_every", "0", "--no-progress_bar",
             "--seed", "0", *mode]
    run_torchrun([script, *flags, "--output_dir", str(tmp_path / "run")], env=RSS_ENV)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    measured = max(r["peak_memory_gb"] - r["memory_baseline_gb"] for r in rows)
    dry = run_single([script, *flags, "--output_dir", str(tmp_path / "plan"), "--dry_run",
                      "--dry_run_world_size", "2"])
    planned = _plan_lines(dry.stdout)["peak"]
    assert abs(planned - measured) <= 0.25 * measured, (planned, measured)
    assert not (tmp_path / "plan").exists()  # a dry run writes nothing


RECIPE = ["--h", "720", "--w", "720", "--sampling_steps", "16", "--sde_type", "dance_sde", "--eta", "0.3",
          "--shift", "3", "--num_generations", "12", "--prompts_per_step", "16", "--rollout_batch_size", "4",
          "--train_batch_size", "2", "--gradient_accumulation_steps", "6", "--timestep_fraction", "0.6",
          "--reward", "hpsv2:1.0", "--gradient_checkpointing", "--fsdp_sharding_strategy", "full",
          "--mixed_precision", "bf16", "--use_ema", "--decode_x0"]


def test_plan_arithmetic_for_flux_dev(tmp_path):
    """The plan's model-state lines are the byte arithmetic of 11.9B parameters; --gradient_sync step with LoRA
    adds the unsharded adapter gradients; world size 1 keeps everything unsharded."""
    from fastvideo.objectives import parse_grpo_args, validate_grpo
    from fastvideo.memory import GiB, plan_grpo
    from fastvideo.tiny import write_flux_dev_config

    folder = write_flux_dev_config(tmp_path / "flux-dev")

    def plan(world, *extra):
        args = parse_grpo_args(["--pretrained_model_name_or_path", str(folder), *RECIPE, *extra, "--dry_run",
                                "--h", "512", "--w", "512", "--prompts_per_step", str(2 * world)])
        counts = validate_grpo(args, world)
        p = plan_grpo(args, counts, world, "cuda")
        return {i.name: i.device / GiB for i in p.items}, p

    items, p = plan(8)
    n = 11_901_408_320
    assert items["parameters (fp32 master, sharded)"] == pytest.approx(4 * n / 8 / GiB)
    assert items["AdamW state (fp32 exp_avg + exp_avg_sq)"] == pytest.approx(8 * n / 8 / GiB)
    assert items["EMA (fp32, sharded)"] == pytest.approx(4 * n / 8 / GiB)
    assert p.facts["image_tokens"] == 1024
    lora_items, lora_plan = plan(8, "--lora_rank", "64")
    assert lora_plan.facts["gradient_sync"] == "step"
    assert 0 < lora_items["unsharded gradient accumulation (--gradient_sync step)"] < 2
    assert lora_plan.device_peak < p.device_peak
    _, single = plan(1, "--num_generations", "2", "--gradient_accumulation_steps", "1")
    assert single.device_peak > 16 * n / GiB  # unsharded fp32 params + grads + Adam: cannot fit one GPU
    assert any("world size 1" in w for w in single.warnings)
    # --eval_reward's models load with the evaluation: planned with --eval_prompts
    evaluated, _ = plan(8, "--eval_prompts", "heldout.txt", "--eval_reward", "pickscore")
    assert evaluated["reward model pickscore (fp32, frozen)"] == pytest.approx(4 * 986_109_440 / GiB)
    assert "reward model pickscore (fp32, frozen)" not in items


def test_nft_plan_holds_the_old_policy_and_its_buffers(tiny_flux_dir):
    """DiffusionNFT's plan (train_nft.py --dry_run, the start-up gate) on 8 ranks, item by item against the byte
    arithmetic: a full fine-tune holds a second sharded fp32 transformer (the old policy) and the bf16 reference with
    --kl_beta; LoRA an fp32 'old' adapter; the rollout keeps only the clean latents (no trajectory), and v_old lives
    through each trained forward. The same flags' GRPO plan (no old policy, the whole trajectory) is the control.
    (The tiny preset keeps this in the default suite; FLUX.1-dev's planning is the same code, checked for GRPO in
    test_plan_arithmetic_for_flux_dev and against a measured NFT run in the slow nft-full case above.)"""
    from fastvideo.models import flux
    from fastvideo.objectives import parse_grpo_args, parse_nft_args, validate_grpo, validate_nft
    from fastvideo.memory import plan_grpo, plan_nft

    common = ["--pretrained_model_name_or_path", str(tiny_flux_dir), "--h", "64", "--w", "64", "--sampling_steps",
              "10", "--num_generations", "8", "--prompts_per_step", "16", "--rollout_batch_size", "4",
              "--train_batch_size", "2", "--reward", "hpsv2:1.0", "--mixed_precision", "bf16", "--kl_beta", "1e-4",
              "--dry_run"]

    def plan(parse, validate, planner, *extra):
        args = parse([*common, *extra])
        return {i.name: i.device for i in planner(args, validate(args, 8), 8, "cuda", compare_checkpointing=False).items}

    n = sum(t.numel() for t in flux.build_transformer(str(tiny_flux_dir), dtype=torch.float32).parameters())
    geometry = flux.latent_geometry(str(tiny_flux_dir), 64, 64)
    b, L, C = 16, geometry.seq_len, geometry.packed_channels  # samples per rank: 16 prompts x 8 / 8 ranks
    nft = plan(parse_nft_args, validate_nft, plan_nft, "--solver", "dpm2", "--eta", "0")
    grpo = plan(parse_grpo_args, validate_grpo, plan_grpo)  # eta > 0: its SDE noise is a host item
    assert nft["old policy: second transformer (fp32 master, sharded)"] == pytest.approx(4 * n / 8)
    assert nft["reference policy (frozen, compute dtype)"] == pytest.approx(2 * n / 8)
    assert not any(k.startswith("old policy") for k in grpo)
    no_grad = nft["reference / old-policy forward (no grad)"]
    assert no_grad == grpo["reference forward (no grad)"] > 0  # one at a time: the same transient
    assert nft["v_old (fp32) kept through the trained forward"] == 4 * 2 * L * C
    buffers = next(v for k, v in nft.items() if k.startswith("rollout buffers: clean latents B x L x C"))
    grpo_buffers = next(v for k, v in grpo.items() if k.startswith("rollout buffers: latents B x (S+1)"))
    assert buffers == 4 * b * L * C + 4 * b * 3 * 64 * 64  # the clean latents and the images
    assert grpo_buffers - buffers == 4 * b * 11 * L * C  # GRPO keeps all S+1 = 11 latents too
    lora = plan(parse_nft_args, validate_nft, plan_nft, "--solver", "dpm2", "--eta", "0", "--lora_rank", "4")
    old = lora["old policy: adapter 'old' (fp32, sharded)"]
    assert old == pytest.approx(lora["AdamW state (fp32 exp_avg + exp_avg_sq)"] / 2) and 0 < old < 4 * n / 8 / 10
    awm = plan(parse_nft_args, validate_nft, plan_nft, "--objective", "awm")  # on-policy AWM keeps no old policy
    assert not any(k.startswith("old policy") for k in awm) and "v_old (fp32) kept through the trained forward" not in awm
    assert any(k.startswith("old policy") for k in plan(parse_nft_args, validate_nft, plan_nft, "--objective", "awm",
                                                        "--old_kl_beta", "0.1"))


@pytest.mark.parametrize("lora", [False, True])
def test_activation_extrapolation_equals_the_full_trace(lora):
    """The planner traces 2+2, 3+2 and 2+3 blocks and extrapolates linearly in the block counts: the same bytes as
    tracing all 5+6 blocks, for training with and without gradient checkpointing and for a no-grad forward
    (measured equal at FLUX.1-dev's widths too: 69.13 GB / 2.47 GB / 0.53 GB for 2 images at 720^2)."""
    from diffusers import FluxTransformer2DModel

    from fastvideo import lora as lora_lib
    from fastvideo import memory

    with torch.device("meta"):
        model = FluxTransformer2DModel(in_channels=16, num_layers=5, num_single_layers=6, attention_head_dim=16,
                                       num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16,
                                       guidance_embeds=True, axes_dims_rope=(4, 6, 6))
    if lora:
        lora_lib.add_lora(model, rank=4, alpha=4, target_modules=None)
    model = memory._cast_quietly(model, torch.bfloat16)
    for checkpointing in (False, True):
        model.enable_gradient_checkpointing() if checkpointing else model.disable_gradient_checkpointing()
        for train in (True, False):
            args = (model, 2, 64, 8, torch.bfloat16)
            expected = memory._traced_activation_bytes(*args, train=train)
            assert memory.transformer_activation_bytes(*args, train=train) == expected, (checkpointing, train)
    assert len(model.transformer_blocks) == 5 and len(model.single_transformer_blocks) == 6  # restored
