"""Defaults that fit the first GPU run, all checked without a GPU: the memory-plan gate before any model loads (fake
device memory sizes), --gradient_checkpointing auto, --decode_batch_size auto and the VAE in the compute dtype."""
from __future__ import annotations

import math

import pytest
import torch

from fastvideo import devices, launch, memory, training
from fastvideo.rollout import RolloutConfig
from fastvideo.models import flux
from fastvideo import distributed as D
from fastvideo.objectives import parse_grpo_args, validate_grpo
from fastvideo.memory import GiB, MemoryPlan, PlanItem


@pytest.fixture(scope="module")
def flux_dev(tmp_path_factory):
    """FLUX.1-dev's configs, no weights (``python -m fastvideo.tiny --preset flux-dev-config``)."""
    from fastvideo.tiny import write_flux_dev_config

    return write_flux_dev_config(tmp_path_factory.mktemp("flux-dev") / "flux-dev")


def _plan(peak_gib: float, **facts) -> MemoryPlan:
    """A plan of ``peak_gib`` GiB per rank (half persistent, half train) with a full fine-tune's facts."""
    base = dict(device_type="cuda", world_size=8, shard_size=8, params=100, trainable=100, mode="full fine-tune",
                compute_dtype="bfloat16", train_batch_size=2, image_tokens=1024, text_tokens=512,
                gradient_checkpointing=False, cpu_offload=False, rollout_batch_size=4, decode_batch_size=2)
    items = [PlanItem("states", peak_gib / 2 * GiB), PlanItem("activations", peak_gib / 2 * GiB, phase="train")]
    return MemoryPlan(items, {**base, **facts})


# ------------------------------------------------------------------------------------------------- the gate
def test_gate_refuses_a_plan_above_the_device_memory_naming_the_fixes():
    plan = _plan(90)
    for kind in ("cuda", "npu"):
        with pytest.raises(ValueError) as err:
            memory.check_plan_fits(plan, kind, 80 * GiB)
        text = str(err.value)
        assert "90.0 GiB peak per rank" in text and "80.0 GiB per device: does NOT fit" in text
        for fix in ("--gradient_checkpointing", "--use_cpu_offload", "--train_batch_size", "--rollout_batch_size",
                    "--decode_batch_size", "more ranks", "--lora_rank", "--dry_run", "--ignore_memory_plan"):
            assert fix in text, fix
    line = memory.check_plan_fits(plan, "cuda", 80 * GiB, ignore=True)  # --ignore_memory_plan: a warning instead
    assert line.startswith("warning: --ignore_memory_plan:") and "does NOT fit" in line
    fits = memory.check_plan_fits(plan, "cuda", 95 * GiB)
    assert fits.startswith("memory plan: 90.0 GiB peak per rank (persistent + train") and ": fits (+5.0 GiB" in fits
    assert memory.check_plan_fits(plan, "cpu", 1) is None  # the CPU is not checked
    assert memory.check_plan_fits(plan, "cuda", None) is None  # unknown memory: nothing to check against
    # fixes already in use are not proposed again
    lora = _plan(90, gradient_checkpointing=True, cpu_offload=True, trainable=1)
    with pytest.raises(ValueError) as err:
        memory.check_plan_fits(lora, "cuda", 80 * GiB)
    assert "--gradient_checkpointing" not in str(err.value) and "--use_cpu_offload" not in str(err.value)
    assert "--lora_rank" not in str(err.value) and "--train_batch_size" in str(err.value)


def _tiny_args(folder, *flags: str):
    return parse_grpo_args(["--pretrained_model_name_or_path", str(folder), "--dry_run", "--h", "64", "--w", "64",
                            "--num_generations", "2", "--prompts_per_step", "1", "--train_batch_size", "2",
                            "--reward", "jpeg_compressibility:1.0", *flags])


def test_check_memory_plan_with_the_real_planner(tiny_flux_dir, capsys):
    """``launch.check_memory_plan`` as ``start_run`` calls it (world size 1, no process group), with the trainer's
    planner on the tiny model for a "cuda" job and fake device memory sizes."""
    from fastvideo.memory import plan_grpo

    args = _tiny_args(tiny_flux_dir)
    counts = validate_grpo(args, 1)
    launch.resolve_device_defaults(args, "cuda")
    with pytest.raises(ValueError, match="does NOT fit.*--ignore_memory_plan"):
        launch.check_memory_plan(args, counts, plan_grpo, 1, "cuda", 2**20)
    launch.check_memory_plan(args, counts, plan_grpo, 1, "cuda", 80 * GiB)
    out = capsys.readouterr().out
    assert "memory plan:" in out and "vs 80.0 GiB per device: fits" in out
    args.ignore_memory_plan = True
    launch.check_memory_plan(args, counts, plan_grpo, 1, "cuda", 2**20)
    assert "warning: --ignore_memory_plan:" in capsys.readouterr().out

    def never(*a, **k):
        raise AssertionError("the CPU is not planned at start")

    launch.check_memory_plan(args, counts, never, 1, "cpu", None)

    def broken(*a, **k):
        raise KeyError("a model the planner does not know")

    launch.check_memory_plan(args, counts, broken, 1, "cuda", 2**20)  # an estimate never stops a run
    assert "could not be computed (KeyError" in capsys.readouterr().out


def test_start_run_gates_before_loading(tiny_flux_dir, tmp_path, monkeypatch):
    """A full fine-tune started on a (pretend) GPU: ``start_run`` resolves the device defaults, then refuses the plan
    against the device's memory before any model loads; the planner sees the resolved flags."""
    seen = {}

    def plan(args, counts, world, device_type, **kwargs):
        seen.update(world=world, device_type=device_type, gc=args.gradient_checkpointing,
                    decode=args.decode_batch_size, **kwargs)
        return _plan(2.0)

    cuda = D.DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cuda"), backend="nccl")
    monkeypatch.setattr(D, "set_sequence_parallel", lambda sp_size: cuda)
    monkeypatch.setattr(devices, "total_memory_bytes", lambda device: GiB)
    manifest = tmp_path / "manifest.json"
    manifest.write_text("{}")
    args = parse_grpo_args(["--pretrained_model_name_or_path", str(tiny_flux_dir), "--data_json_path", str(manifest),
                            "--output_dir", str(tmp_path / "out"), "--h", "64", "--w", "64", "--num_generations", "2",
                            "--prompts_per_step", "1", "--train_batch_size", "2", "--reward",
                            "jpeg_compressibility:1.0"])
    with pytest.raises(ValueError, match=r"2\.0 GiB peak per rank .* vs 1\.0 GiB per device: does NOT fit"):
        training.start_run(args, validate_grpo, plan)
    assert seen == dict(world=1, device_type="cuda", gc=True, decode=args.decode_batch_size,
                        compare_checkpointing=False)
    assert args.gradient_checkpointing is True and args.decode_batch_size >= 1  # resolved for cuda, in args


def test_total_memory_bytes_reads_the_accelerator(monkeypatch):
    assert devices.total_memory_bytes("cpu") is None
    props = type("Props", (), {"total_memory": 80 * GiB})
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: asked.append(index) or props)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert devices.total_memory_bytes("cuda:1") == 80 * GiB and devices.total_memory_bytes("cuda") == 80 * GiB
    assert asked == [1, 3]
    npu = type("FakeNPU", (), {"get_device_properties": staticmethod(lambda index: props),
                               "current_device": staticmethod(lambda: 0)})
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    monkeypatch.setattr(devices, "import_npu", lambda: True)
    assert devices.total_memory_bytes(torch.device("cpu")) is None
    assert devices.total_memory_bytes("npu:0") == 80 * GiB


# ----------------------------------------------------------------------------------- gradient checkpointing
def test_gradient_checkpointing_is_tri_state(tmp_path):
    """Unset = auto (None until resolved): on for a full fine-tune on cuda/npu, off for LoRA and on the CPU;
    --gradient_checkpointing / --no-gradient_checkpointing (or true/false in a --config file) are kept."""
    assert parse_grpo_args([]).gradient_checkpointing is None
    assert parse_grpo_args(["--gradient_checkpointing"]).gradient_checkpointing is True
    assert parse_grpo_args(["--no-gradient_checkpointing"]).gradient_checkpointing is False
    for value, expected in (("true", True), ("false", False), ("null", None)):
        path = tmp_path / f"{value}.yaml"
        path.write_text(f"gradient_checkpointing: {value}\n")
        assert parse_grpo_args(["--config", str(path)]).gradient_checkpointing is expected
    resolve = memory.resolve_gradient_checkpointing
    assert resolve(None, 0, "cuda") and resolve(None, 0, "npu")
    assert not resolve(None, 64, "cuda") and not resolve(None, 0, "cpu")
    assert not resolve(False, 0, "cuda") and resolve(True, 64, "cpu")


def test_dry_run_resolves_like_the_run_on_its_device(flux_dev, capsys):
    """--dry_run --device cuda on a CPU machine plans a full fine-tune with checkpointing on (auto) and a bf16 VAE
    decoding in batches of 2 at 1024^2 (auto: 1.5 GiB per image, within 4 GiB), as the run on a GPU would."""
    from fastvideo.memory import plan_grpo

    flags = ["--pretrained_model_name_or_path", str(flux_dev), "--device", "cuda", "--dry_run", "--h", "1024",
             "--w", "1024", "--num_generations", "4", "--prompts_per_step", "4", "--train_batch_size", "1",
             "--rollout_batch_size", "4", "--sampling_steps", "4", "--dry_run_world_size", "8"]
    args = parse_grpo_args(flags)
    launch.dry_run(args, validate_grpo, plan_grpo)
    out = capsys.readouterr().out
    assert args.gradient_checkpointing is True and args.decode_batch_size == 2
    assert "with gradient checkpointing" in out and "(the same without gradient checkpointing)" in out
    assert "VAE (bf16, frozen)" in out
    decode = next(line for line in out.splitlines() if "VAE decode" in line)
    assert "batch of 2" in decode and "bf16, no grad" in decode and float(decode.split()[-4]) <= 4.0, decode


# ----------------------------------------------------------------------------------------------- decoding
def test_auto_decode_batch_size(flux_dev, tiny_flux_dir):
    """FLUX.1-dev's VAE at 1024^2 plans 3.0 GiB per image in fp32 and 1.5 GiB in bf16: auto takes 1 and 2 latents per
    call within 4 GiB (never more than the rollout micro-batch, at least 1); explicit values and the CPU are kept."""
    per_image = memory.vae_decode_bytes(memory._vae_config(flux_dev), 1, 128, 128, torch.bfloat16)
    assert per_image == pytest.approx(1.5 * GiB, rel=0.01)
    assert memory.auto_decode_batch_size(flux_dev, 1024, 1024, torch.float32, 8) == 1
    assert memory.auto_decode_batch_size(flux_dev, 1024, 1024, torch.bfloat16, 8) == 2
    assert memory.auto_decode_batch_size(flux_dev, 512, 512, torch.bfloat16, 8) == 8  # capped by the micro-batch
    assert memory.auto_decode_batch_size(flux_dev, 1024, 1024, torch.bfloat16, 8, budget=GiB) == 1  # at least 1
    args = parse_grpo_args(["--pretrained_model_name_or_path", str(flux_dev), "--h", "1024", "--w", "1024"])
    assert memory.resolve_decode_batch_size(args, "cpu") == 0  # the CPU: a whole rollout micro-batch per call
    assert memory.resolve_decode_batch_size(args, "cuda") == 2  # --mixed_precision auto: bf16
    args.decode_batch_size = 5
    assert memory.resolve_decode_batch_size(args, "cuda") == 5  # explicit, and resolved values, stay
    args = _tiny_args(tiny_flux_dir)
    validate_grpo(args, 1)
    launch.resolve_device_defaults(args, "cpu")
    assert args.decode_batch_size == 0 and args.gradient_checkpointing is False
    assert RolloutConfig.from_args(args).decode_batch_size == 0


def test_bf16_vae_decode_is_close_to_fp32(tiny_flux_dir):
    """The VAE decodes in the compute dtype (bf16 on accelerators, as FluxPipeline): on the tiny VAE, 3 x 4 random
    latents at 64^2 measured max |diff| 0.016, mean 0.0017, PSNR 53 dB against the fp32 decode; bounds with ~3x
    margin, and the difference is real (not a silent fp32 decode)."""
    v32 = flux.load_vae(tiny_flux_dir)
    v16 = flux.load_vae(tiny_flux_dir, dtype=torch.bfloat16)
    geometry = flux.latent_geometry(v32, 64, 64)
    for seed in range(3):
        latents = torch.randn(4, geometry.seq_len, geometry.packed_channels,
                              generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            full, half = flux.decode(v32, latents, geometry), flux.decode(v16, latents, geometry)
        assert half.dtype == torch.float32 and half.shape == full.shape
        diff = (half - full).abs()
        psnr = 10 * math.log10(1 / diff.square().mean().item())
        assert 0 < diff.max() < 0.05 and diff.mean() < 0.006 and psnr > 45, (diff.max(), diff.mean(), psnr)
