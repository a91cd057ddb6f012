"""Performance issue: the FLOP formula against torch's counter, the peak measurement, micro-batched reward, the CPU
peak-memory reset, --compile, and the full-step benchmark's smoke run (every key finite, the loops' gradients equal) and
its --reward_delay_ms run (overlapped scoring saves step time)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import load_script

from fastvideo import devices, flops, parallel
from fastvideo.models import flux
from fastvideo.rewards import build_reward

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
@pytest.mark.parametrize("batch,text_tokens", [(1, 7), (3, 32)])
def test_transformer_flops_formula_matches_the_counter(tiny_flux_dir, batch, text_tokens):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = flux.load_transformer(tiny_flux_dir)
    geometry = flux.latent_geometry(tiny_flux_dir, 64, 64)
    L = geometry.seq_len
    x = torch.randn(batch, L, geometry.packed_channels)
    embeds = torch.randn(batch, text_tokens, model.config.joint_attention_dim)
    pooled = torch.randn(batch, model.config.pooled_projection_dim)

    def forward():
        return flux.predict_velocity(model, x, 0.5, embeds, pooled, flux.image_ids(geometry),
                                     flux.text_ids(text_tokens), guidance=3.5)

    expected = flux.transformer_flops(model.config, L, text_tokens, batch)
    with torch.no_grad():
        assert flops.counted_flops(forward) == expected  # CPU flash attention counted: exact
    with sdpa_kernel([SDPBackend.MATH]):  # attention as plain matmuls: torch counts every one itself
        with torch.no_grad():
            assert flops.counted_flops(forward) == expected
        trained = flops.counted_flops(lambda: forward().sum().backward())
    # model FLOPs are 3 forwards; the counter skips the input gradient of the first (embedding) layers
    assert trained == pytest.approx(flux.transformer_flops(model.config, L, text_tokens, batch, backward=True),
                                    rel=0.02)
    assert flux.transformer_flops(model.config, L, text_tokens, 2 * batch) == 2 * expected


def test_flux_dev_forward_flops_at_1024():
    """FLUX.1-dev's widths: of its ~12B parameters a token meets 12·D² per block (a double block's image and text
    streams each hold 12·D², but a token goes through one; the adaLN modulations run once per sample), so ~2 x 6.45e9
    FLOPs per token of a 4608-token 1024² sample, plus attention (4·N²·D per block)."""
    config = {"num_attention_heads": 24, "attention_head_dim": 128, "num_layers": 19, "num_single_layers": 38,
              "in_channels": 64, "joint_attention_dim": 4096, "pooled_projection_dim": 768, "guidance_embeds": True}
    N, D = 4096 + 512, 3072
    total = flux.transformer_flops(config, 4096, 512)
    attention = 57 * 4 * N * N * D
    per_token = 57 * 12 * D * D  # 6.45e9
    assert 2 * per_token * N < total - attention < 1.01 * 2 * per_token * N


def test_peak_matmul_flops_is_2n3_per_matmul_second(monkeypatch):
    """The rate is 2·n³ FLOPs per torch.mm over the time the timed matmuls took (the warm-up one neither counted nor
    timed), measured for ``seconds``: exact on a fake clock on which each matmul takes 0.25 s, whatever this host's
    speed (a bound on the real rate would be a bound on the host)."""
    sizes: list[int] = []
    mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: sizes.append(a.shape[0]) or mm(a, b))
    monkeypatch.setattr(flops.time, "perf_counter", lambda: 0.25 * len(sizes))
    rate = flops.peak_matmul_flops("cpu", torch.float32, size=64, seconds=1.0)
    monkeypatch.undo()
    assert sizes == [64] * 5  # the warm-up + 1.0 s / 0.25 s
    assert rate == 2 * 64 ** 3 / 0.25
    real = flops.peak_matmul_flops("cpu", torch.float32, size=64, seconds=0.01)
    assert math.isfinite(real) and real > 0


def test_reward_micro_batches_give_the_same_scores(hps_flags):
    images = torch.rand(5, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    prompts = [f"prompt {i}" for i in range(5)]
    paths = {"hps_checkpoint": hps_flags[3], "hps_model": hps_flags[5]}
    spec = "hpsv2:1.0,jpeg_compressibility:0.5"
    whole = build_reward(spec, "cpu", **paths)(images, prompts)
    for size in (1, 2):
        chunked = build_reward(spec, "cpu", batch_size=size, **paths)(images, prompts)
        assert chunked.keys() == whole.keys()
        for key in whole:
            torch.testing.assert_close(chunked[key], whole[key], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="--reward_batch_size"):
        build_reward("jpeg_compressibility", "cpu", batch_size=-1)


def _peak_before_and_after_reset() -> tuple[float, float]:
    """The CPU peak (GiB) after touching 300 MiB and freeing it, and right after ``reset_peak_memory``."""
    cpu = torch.device("cpu")
    block = torch.ones(300 * 2**20 // 4)  # 300 MiB touched
    del block
    high = devices.max_memory_allocated_gb(cpu)
    devices.reset_peak_memory(cpu)
    return high, devices.max_memory_allocated_gb(cpu)


def test_cpu_peak_memory_is_never_below_the_current_use():
    _, low = _peak_before_and_after_reset()
    assert low >= devices.memory_allocated_gb("cpu") * 0.9


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(),
                    reason="the peak RSS resets only on Linux (/proc/self/clear_refs); elsewhere it cannot go down")
def test_cpu_peak_memory_resets_on_linux():
    high, low = _peak_before_and_after_reset()
    assert low < high - 0.2  # VmHWM went back to about the current RSS


def test_compile_flag_compiles_every_block(tiny_flux_dir):
    model = flux.load_transformer(tiny_flux_dir)
    out = parallel.shard_model(model, compile=True)  # world size 1: no FSDP, the blocks compiled in place
    blocks = parallel.transformer_blocks(out)
    assert blocks and all(b._compiled_call_impl is not None for b in blocks)
    assert all(b._compiled_call_impl is None for b in parallel.transformer_blocks(
        parallel.shard_model(flux.load_transformer(tiny_flux_dir))))


# evidence: benchmarks/bench_step.py's numbers, not the trainers; the step it times runs in every trainer test
@pytest.mark.evidence(cover="test_train_grpo.py::test_short_run_writes_every_metric", cost_s=25)
def test_bench_step_smoke(tmp_path):
    """benchmarks/bench_step.py --smoke: both loops, fp32 and bf16 autocast, 2 ranks; every reported number is finite,
    the phase fractions add up, and the reference loop's first-update gradients equal ours on the same samples."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_step.py"), "--smoke", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert "step_speedup_vs_reference" in proc.stdout
    for key in ("step_speedup_vs_reference", "images_per_device_second", "mfu_rollout", "mfu_train"):
        assert math.isfinite(summary[key]) and summary[key] > 0, key
    assert summary["mfu_rollout"] < 1 and summary["mfu_train"] < 1
    assert len(summary["peak_memory_gb_per_rank"]) == 2 and all(m > 0.1 for m in summary["peak_memory_gb_per_rank"])
    assert set(summary["peak_flops"]) == {"fp32", "bf16"}
    assert summary["flops_per_step"]["train"] > 0 and summary["flops_per_step"]["rollout"] > 0
    for dtype in ("fp32", "bf16"):
        res = summary["results"][dtype]
        assert math.isfinite(res["step_speedup_vs_reference"])
        for loop in ("ours", "reference"):
            fractions = res[loop]["phase_fractions"]
            assert set(fractions) == {"rollout", "decode", "reward", "train", "communication", "ema", "checkpoint",
                                      "other"}
            assert all(f >= 0 for f in fractions.values()) and sum(fractions.values()) == pytest.approx(1, abs=1e-6)
            assert fractions["rollout"] > 0 and fractions["train"] > 0 and fractions["decode"] > 0
            assert all(math.isfinite(v) for v in res[loop]["phase_seconds"].values())
        assert res["reference"]["phase_fractions"]["ema"] > 0  # its rank-0 EMA of the gathered model
        check = res["check"]
        assert check["params_compared"] > 10 and check["grad_max_abs"] > 0
        if dtype == "fp32":  # the same samples, the same weights: batch-1 training gives our gradients
            assert check["grad_rel_diff"] < 1e-5, check
            assert res["ours"]["reward_mean_first_step"] == res["reference"]["reward_mean_first_step"]


# evidence (~30 s): the overlap's measured saving; the overlap itself is checked bit for bit in test_reward_overlap.py
@pytest.mark.evidence(
    cover="test_reward_overlap.py::test_overlapped_and_sequential_scoring_give_identical_metrics",
    cost_s=20)
def test_bench_step_reward_delay_reports_the_overlap_saving(tmp_path):
    """benchmarks/bench_step.py --reward_delay_ms 100, its smallest run (tiny preset, 1 rank, fp32, 4 images in
    rollout micro-batches of 1, 8 sampling steps: ~40 ms to sample and decode one, under the 100 ms the reward server
    sleeps per image): loops ours (sequential scoring) and overlap on the same samples; each scores 4 x 100 ms per
    step, the overlapped step waits less for it and is faster, and the table reports the JSON's numbers."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_step.py"), "--preset", "tiny", "--nproc",
                           "1", "--dtypes", "fp32", "--loops", "ours", "--steps", "2", "--warmup", "1",
                           "--sampling_steps", "8", "--num_generations", "4", "--prompts_per_step", "1",
                           "--rollout_batch_size", "1", "--max_sequence_length", "16", "--reward_delay_ms", "100",
                           "--out", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["config"]["loops"] == ["ours", "overlap"] and summary["config"]["reward_delay_ms"] == 100
    res = summary["results"]["fp32"]
    ours, overlap = res["ours"], res["overlap"]
    for loop in (ours, overlap):
        assert math.isfinite(loop["step_seconds"]) and loop["step_seconds"] > 0
        assert sum(loop["phase_fractions"].values()) == pytest.approx(1, abs=1e-6)
        assert loop["reward_busy_seconds"] >= 4 * 0.1  # the server's sleep: 4 images a step, one per request
    assert ours["reward_seconds"] == ours["reward_busy_seconds"]  # sequential: the step waits for all of it
    assert overlap["reward_mean_first_step"] == ours["reward_mean_first_step"]  # the same images, the same scores
    saving = 1 - overlap["step_seconds"] / ours["step_seconds"]
    assert res["overlap_step_saving"] == summary["overlap_step_saving"] == pytest.approx(saving, rel=1e-12)
    # the 3 later micro-batches sample while the earlier ones are scored: a part of the scoring hides behind their
    # sampling (the only work it can hide behind: at least a quarter of it, on a fast CPU ~50 ms), and most of their
    # sampling time is saved
    sampling = ours["phase_seconds"]["rollout"] + ours["phase_seconds"]["decode"]
    hidden = overlap["reward_busy_seconds"] - overlap["reward_seconds"]
    assert hidden > 0.25 * sampling > 0, (hidden, sampling)
    assert ours["step_seconds"] - overlap["step_seconds"] > 0.25 * sampling > 0, (ours, overlap)
    assert (f"overlap vs sequential scoring (100 ms per image at the reward server): step {ours['step_seconds']:.3f} "
            f"-> {overlap['step_seconds']:.3f} s, overlap_step_saving = {saving:.1%}") in proc.stdout


def _bench_step_module():
    return load_script(ROOT / "benchmarks" / "bench_step.py", "bench_step", register=True)


# slow for the default suite's time: the FLUX.1-dev widths are traced in test_fake_cuda.py and planned in
# test_memory.py (default)
@pytest.mark.slow(cover="test_fake_cuda.py::test_pretend_cuda_trace", cost_s=20)
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_flux_dev_shape_model_has_real_widths_and_random_weights(tmp_path):
    """--model flux-dev-shape --num_layers 1: FLUX.1-dev's widths with 1 double + 2 single blocks; the weights made in
    memory are seeded per name (the same on every rank and call), finite through a forward, and the stubbed text
    encoders give embeddings of the real widths, seeded per prompt."""
    from fastvideo.weights import fill_local_shards

    bench = _bench_step_module()
    folder = bench.write_flux_dev_shape(tmp_path / "model", num_layers=1)
    model = flux.build_transformer(folder)
    c = model.config
    assert (c.num_layers, c.num_single_layers, c.num_attention_heads * c.attention_head_dim) == (1, 2, 3072)
    assert (c.num_attention_heads, c.joint_attention_dim, c.pooled_projection_dim) == (24, 4096, 768)
    params = sum(p.numel() for p in model.parameters())
    assert 0.6e9 < params < 0.8e9  # ~0.69B per K (FLUX.1-dev: 11.9B at K=19 with 38 single blocks)
    assert not list(folder.rglob("*.safetensors"))

    makers = bench.random_tensor_makers(model, seed=0)
    assert set(makers) == {n for n, _ in model.named_parameters()}
    name = "transformer_blocks.0.attn.to_q.weight"
    assert torch.equal(makers[name](), bench.random_tensor_makers(model, seed=0)[name]())
    assert not torch.equal(makers[name](), bench.random_tensor_makers(model, seed=1)[name]())
    assert makers[name]().std() == pytest.approx(0.02, rel=0.01)
    assert torch.equal(makers["transformer_blocks.0.attn.norm_q.weight"](), torch.ones(128))
    model = model.to_empty(device="cpu")
    fill_local_shards(model, makers)

    geometry = flux.latent_geometry(folder, 32, 32)
    assert geometry.packed_channels == 64 and geometry.seq_len == 4
    originals = (flux.load_text_encoders, flux.encode_prompts, flux.load_vae)
    with bench.random_weights(0):
        encoders = flux.load_text_encoders(folder)
        embeds, pooled, cut = flux.encode_prompts(encoders, ["a cat", "a dog"], max_sequence_length=8)
        again, _, _ = flux.encode_prompts(encoders, ["a dog"], max_sequence_length=8)
        vae = flux.load_vae(folder)
    assert embeds.shape == (2, 8, 4096) and pooled.shape == (2, 768) and cut == [False, False]
    assert torch.equal(again[0], embeds[1])
    assert (flux.load_text_encoders, flux.encode_prompts, flux.load_vae) == originals  # restored after the block
    x = torch.randn(2, geometry.seq_len, geometry.packed_channels)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        v = flux.predict_velocity(model, x, 0.5, embeds, pooled, flux.image_ids(geometry), flux.text_ids(8),
                                  guidance=3.5)
        images = flux.decode(vae, v.float(), geometry)
    assert v.shape == x.shape and torch.isfinite(v).all() and v.float().std() > 0
    assert images.shape == (2, 3, 32, 32) and torch.isfinite(images).all()


# evidence (~1 min, ~4.5 GB per rank): the FLUX.1-dev widths are traced in test_fake_cuda.py (default)
@pytest.mark.evidence(cover="test_fake_cuda.py::test_pretend_cuda_trace", cost_s=50)
def test_bench_step_flux_dev_shape_runs(tmp_path):
    """The accelerator mode end to end on this CPU (1 double + 2 single blocks at FLUX.1-dev's widths, LoRA, 64²):
    ~1 min, ~4.5 GB per rank."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_step.py"), "--model", "flux-dev-shape",
                           "--num_layers", "1", "--lora_rank", "4", "--h", "64", "--w", "64", "--sampling_steps", "3",
                           "--num_generations", "2", "--prompts_per_step", "1", "--steps", "1", "--warmup", "0",
                           "--max_sequence_length", "8", "--dtypes", "bf16", "--loops", "ours", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert "flux-dev-shape K=1" in proc.stdout
    assert summary["config"]["model"] == "flux-dev-shape" and summary["config"]["num_layers"] == 1
    # a token meets 12·D² weights per block (3 blocks), 2 FLOPs each; 16 image + 8 text tokens; adaLN and attention
    assert 1 < summary["flops_per_step"]["forward_per_sample"] / (2 * 12 * 3072**2 * 3 * (16 + 8)) < 1.1
    for key in ("images_per_device_second", "mfu_rollout", "mfu_train"):
        assert math.isfinite(summary[key]) and summary[key] > 0, key
    assert math.isfinite(summary["results"]["bf16"]["ours"]["reward_mean_first_step"])
