"""Every registered model family end to end on its tiny preset, through the product's commands: preprocessing on 2
ranks (stored rows = the adapter's ``encode_prompts``, negative prompt included), GRPO with LoRA and true CFG on 2
ranks (on-policy at the first update; the export loads in the stock pipeline and changes its images). The slow tier
adds sample.py of the base model = the stock pipeline on the same noise with CFG (8-bit rounding), ``--dry_run`` on
the real-config preset, online DPO, DiffusionNFT, a full fine-tune export, exact resume and record/replay.

FLUX.1 has its own, deeper tests (test_train_*, test_sample, test_preprocess); the family adapters' pieces are checked
against the stock pipelines in tests/test_family_<name>.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

from helpers import REPO, run_in_one_job, run_torchrun

MSL = 32  # text tokens stored per prompt
H = W = 64
STEPS = 3
PROMPTS = 6

# the default family run: the slow family tests' cover
FLUX2_GRPO = "test_families.py::test_grpo_lora_with_cfg_is_on_policy_and_exports_a_lora_the_pipeline_loads[flux2]"
# Wan's default-tier cover: its rollout, replay and updates traced at world size 8 (tests/test_fake_cuda.py)
WAN_TRACE = "test_fake_cuda.py::test_family_trace_covers_every_objective[wan-tiny]"
WAN_ENCODE = "test_family_wan.py::test_encode_prompts_equals_the_pipelines_encode_prompt"


@dataclass(frozen=True)
class Spec:
    """A family's presets and how its stock pipeline takes our packed noise and its true-CFG arguments."""

    name: str
    preset: str
    config_preset: str
    pipeline_latents: Callable[[torch.Tensor, object], torch.Tensor]  # packed (B, L, C), geometry -> latents=
    cfg_kwargs: Callable[[float, str], dict]  # (cfg scale, negative prompt) -> pipeline call kwargs
    flags: tuple[str, ...] = ()  # the trainers' and sample.py's extra flags (a video family: its frame count)
    call: tuple[tuple[str, object], ...] = ()  # the pipeline call's extra kwargs (a video family: num_frames)
    output: str = "images"  # the pipeline output's field (a video family: frames, (B, F, 3, H, W))

    def geometry(self, family, model) -> object:
        """The family's latent geometry at H x W (a video family: the frames of ``flags``)."""
        from fastvideo import models

        frames = int(self.flags[self.flags.index("--num_frames") + 1]) if "--num_frames" in self.flags else None
        return models.geometry_for(family, model, H, W, frames)

    def sample(self, pipe, **kwargs) -> torch.Tensor:
        """The stock pipeline's output tensor (images or videos) for ``kwargs`` plus this family's extras."""
        return getattr(pipe(**dict(self.call), **kwargs), self.output)


def _unpacked(packed: torch.Tensor, geometry) -> torch.Tensor:
    from fastvideo.models.flux import unpack_latents

    return unpack_latents(packed, geometry)


def _wan_latents(packed: torch.Tensor, geometry) -> torch.Tensor:
    from fastvideo.models.wan import unpack_video

    return unpack_video(packed, geometry)


def _flux2_latents(packed: torch.Tensor, geometry) -> torch.Tensor:
    b, length, channels = packed.shape
    return packed.transpose(1, 2).reshape(b, channels, geometry.latent_h // 2, geometry.latent_w // 2)


SPECS = {
    "sd3": Spec("sd3", "sd3-tiny", "sd3.5-medium-config", _unpacked,
                lambda s, neg: dict(guidance_scale=s, negative_prompt=neg)),
    "qwen-image": Spec("qwen-image", "qwen-image-tiny", "qwen-image-config", lambda p, g: p,
                       lambda s, neg: dict(true_cfg_scale=s, negative_prompt=neg)),
    "flux2": Spec("flux2", "flux2-tiny", "flux2-klein-4b-config", _flux2_latents,
                  lambda s, neg: dict(guidance_scale=s)),  # Flux2KleinPipeline's negative is always ""
    "wan": Spec("wan", "wan-tiny", "wan2.1-t2v-14b-config", _wan_latents,
                lambda s, neg: dict(guidance_scale=s, negative_prompt=neg), ("--num_frames", "5"),
                (("num_frames", 5),), "frames"),
}


# Wan's 2-rank preprocessing (the fixture, ~9 s) is slow-tier: its adapter's encode_prompts is checked against the
# pipeline in the default tier (WAN_ENCODE)
@pytest.fixture(scope="module", params=[pytest.param(name, marks=pytest.mark.slow(cover=WAN_ENCODE, cost_s=9))
                                        if name == "wan" else name for name in SPECS])
def fam(request, tiny_preset, built_once) -> dict:
    """The family's tiny folder and the embeddings of the first prompts of assets/prompts.txt, preprocessed on 2
    ranks in shards of 2 with the family's negative prompt; built once per session (the slow tests read it too)."""
    from fastvideo import models

    spec = SPECS[request.param]
    model = tiny_preset(spec.preset)
    family = models.resolve("auto", model)
    negative = family.defaults.negative_prompt

    def build(root: Path) -> Path:
        prompts = root / "prompts.txt"
        prompts.write_text("\n".join((REPO / "assets" / "prompts.txt").read_text().splitlines()[:PROMPTS]) + "\n")
        run_torchrun(["preprocess_embeddings.py", "--model_path", str(model), "--prompt_file", str(prompts),
                      "--output_dir", str(root / "emb"), "--max_sequence_length", str(MSL), "--shard_size", "2",
                      "--negative_prompt", negative, "--device", "cpu"])
        return root

    root = built_once(f"families-{spec.name}", build)
    return {"spec": spec, "family": family, "model": model, "manifest": root / "emb" / "manifest.json",
            "prompts": root / "prompts.txt", "root": root, "negative": negative}


def test_auto_picks_the_family_and_pipeline_defaults_use_cfg(fam):
    family, spec = fam["family"], fam["spec"]
    assert family.name == spec.name and family.defaults.cfg_scale > 1  # the tiny presets are CFG models
    assert family.sequence_parallel == family.video and family.lora_target_modules  # SP: FLUX.1's and Wan's


def test_preprocessing_on_two_ranks_equals_encode_prompts(fam):
    """Every stored row (4 shards written by 2 ranks) and the negative row equal the adapter's ``encode_prompts``
    of the same prompt in one process (the adapters' own tests tie ``encode_prompts`` to the stock pipeline)."""
    from fastvideo.data import EmbeddingDataset

    family = fam["family"]
    ds = EmbeddingDataset(fam["manifest"])
    assert ds.manifest["model_family"] == family.name and ds.embedding_keys == family.embedding_keys
    assert ds.negative_prompt == fam["negative"]
    encoders = family.load_text_encoders(fam["model"])
    with torch.no_grad():
        expected, _ = family.encode_prompts(encoders, ds.prompts, MSL)
        negative, _ = family.encode_prompts(encoders, [fam["negative"]], MSL)
    stored = ds.get_batch(list(range(len(ds))))
    for key in family.embedding_keys:
        assert stored[key].shape == expected[key].shape, key
        torch.testing.assert_close(stored[key], expected[key], rtol=0, atol=1e-5, msg=key)
        torch.testing.assert_close(ds.negative_rows()[key], negative[key], rtol=0, atol=1e-5, msg=key)


def _grpo_args(fam: dict, out: Path, *extra: str) -> list[str]:
    return ["train_grpo_flux.py", "--pretrained_model_name_or_path", str(fam["model"]), "--data_json_path",
            str(fam["manifest"]), "--output_dir", str(out), "--device", "cpu", "--h", str(H), "--w", str(W),
            "--sampling_steps", "4", "--num_generations", "4", "--prompts_per_step", "2", "--rollout_batch_size", "4",
            "--train_batch_size", "2", "--timestep_fraction", "0.7", "--reward", "jpeg_compressibility:1.0",
            "--learning_rate", "1e-3", "--seed", "3", "--no-progress_bar", "--max_train_steps", "2",
            "--checkpointing_steps", "100", *fam["spec"].flags, *extra]


def _grpo(fam: dict, out: Path, *extra: str, nproc: int = 2) -> None:
    run_torchrun(_grpo_args(fam, out, *extra), nproc=nproc)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _pipeline(model: Path, dtype: torch.dtype = torch.float32):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(model, local_files_only=True, torch_dtype=dtype)
    if type(pipe.scheduler).__name__ == "UniPCMultistepScheduler":  # Wan: our sampler is the Euler grid of its shift
        from diffusers import FlowMatchEulerDiscreteScheduler

        pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=pipe.scheduler.config.flow_shift)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# each family also trains one of GRPO's newer policy losses (two optimizer steps per rollout, so the second replays a
# moved policy): the guard's rollout means and the DPPO divergence go through the family's guided velocity
POLICY_LOSS = {"sd3": ("--policy_loss", "guard", "--clip_range", "1e-3"),
               "wan": ("--policy_loss", "guard", "--clip_range", "1e-3", "--sde_type", "dance_sde"),
               "qwen-image": ("--policy_loss", "dppo", "--timestep_selection", "first", "--timestep_fraction", "0.5"),
               "flux2": ("--policy_loss", "guard", "--clip_range", "1e-3")}


# SD3's and Qwen-Image's runs are slow (suite time, ~11 s each): FLUX.2's run keeps the CFG replay and a newer policy
# loss in the default suite, each family's guided Euler loop is checked against its stock pipeline there
# (tests/test_family_<name>.py), and the pretend-CUDA trace runs GRPO-Guard and Flow-DPPO's updates
@pytest.mark.parametrize("fam", [pytest.param("sd3", marks=pytest.mark.slow(cover=FLUX2_GRPO, cost_s=12)),
                                 pytest.param("qwen-image", marks=pytest.mark.slow(cover=FLUX2_GRPO, cost_s=12)),
                                 "flux2",
                                 pytest.param("wan", marks=pytest.mark.slow(cover=WAN_TRACE, cost_s=11))],
                         indirect=True)
def test_grpo_lora_with_cfg_is_on_policy_and_exports_a_lora_the_pipeline_loads(fam, tmp_path):
    """GRPO, LoRA rank 4, true CFG at the family's scale (one batched cond + uncond forward in the rollout and the
    replay), with the family's ``POLICY_LOSS``: the first update's ratios are 1 (the replayed guided log-prob equals
    the rollout's), the loss is finite, the policy loss's own metric is there, and the export changes the stock
    pipeline's images."""
    cfg = fam["family"].defaults.cfg_scale
    out = tmp_path / "grpo"
    flags = POLICY_LOSS[fam["family"].name]
    _grpo(fam, out, "--lora_rank", "4", "--cfg_scale", str(cfg), "--gradient_accumulation_steps", "1", *flags)
    rows = _rows(out / "metrics.jsonl")
    assert len(rows) == 2 and all(np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"]) for r in rows)
    assert rows[0]["ratio_first_update_max_dev"] < 1e-5, rows[0]
    moved = "guard_bias_mean" if flags[1] == "guard" else "dppo_divergence_mean"
    assert all(r[moved] > 0 for r in rows), rows  # the second optimizer step replays a moved policy
    assert rows[0]["grad_norm"] > 0  # the update reaches the adapter
    if fam["family"].video:  # rewarded over frames, the frame-change watch logged beside (a real change: not a still)
        assert rows[0]["reward_frame_change"] > 1e-3, sorted(rows[0])
        assert (out / "samples" / "step-000001.png").is_file()  # frame strips
    pipe = _pipeline(fam["model"])
    call = dict(prompt="a red cube on a table", height=H, width=W, num_inference_steps=2, output_type="pt",
                max_sequence_length=MSL, **fam["spec"].cfg_kwargs(cfg, fam["negative"]))
    base = fam["spec"].sample(pipe, generator=torch.Generator().manual_seed(0), **call)
    pipe.load_lora_weights(out / "final")
    tuned = fam["spec"].sample(pipe, generator=torch.Generator().manual_seed(0), **call)
    assert torch.isfinite(tuned).all() and (tuned - base).abs().max() > 1e-4


def _png(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as img:
        return np.asarray(img.convert("RGB"), dtype=np.int16)


def _sample_py(fam: dict, out: Path, max_prompts: int, *extra: str) -> Path:
    """sample.py on the family's base model (the family's CFG defaults; H x W, STEPS steps, seed 7) for the first
    ``max_prompts`` prompts, one thread: its output folder."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "sample.py", "--pretrained_model_name_or_path", str(fam["model"]),
                           "--prompts", str(fam["prompts"]), "--output_dir", str(out), "--h", str(H), "--w", str(W),
                           "--num_inference_steps", str(STEPS), "--max_prompts", str(max_prompts),
                           "--max_sequence_length", str(MSL), "--device", "cpu", "--seed", "7", *fam["spec"].flags,
                           *extra], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


# slow for the default suite's time: the default suite checks each adapter's sampling loop against its stock pipeline
# (tests/test_family_<name>.py) and sample.py's family-free path on FLUX.1 (test_sample.py)
@pytest.mark.slow(cover="test_sample.py::test_base_model_output_is_complete_deterministic_and_equals_flux_pipeline",
                  cost_s=8)
def test_sample_py_equals_the_stock_pipeline_with_cfg(fam, tmp_path):
    """sample.py on the base model with the family's defaults (CFG scale, negative prompt) but size and steps: its
    PNGs equal the stock pipeline's images from the same keyed initial noise to 8-bit rounding."""
    from fastvideo.data import EmbeddingDataset
    from fastvideo.seeding import NoiseSource

    family, spec = fam["family"], fam["spec"]
    out = _sample_py(fam, tmp_path / "samples", 2)
    config = json.loads((out / "config.json").read_text())
    assert config["cfg_scale"] == family.defaults.cfg_scale and config["negative_prompt"] == fam["negative"]
    assert EmbeddingDataset(out / "embeddings").negative_prompt == fam["negative"]
    pipe = _pipeline(fam["model"])
    geometry = spec.geometry(family, fam["model"])
    noise = NoiseSource(7)
    worst = 0
    for row in _rows(out / "index.jsonl"):
        packed = noise.randn(geometry.packed_shape, step=0, prompt_id=row["prompt_id"],
                             sample_index=row["sample_index"], purpose="init")[None]
        image = spec.sample(pipe, prompt=row["prompt"], height=H, width=W, num_inference_steps=STEPS,
                            output_type="pt", latents=spec.pipeline_latents(packed, geometry), max_sequence_length=MSL,
                            **spec.cfg_kwargs(family.defaults.cfg_scale, fam["negative"]))[0]
        ref = _eight_bit(image)
        diff = np.abs(_png(out / row["path"]) - ref)
        worst = max(worst, int(diff.max()))
        assert diff.max() <= 1 and diff.mean() < 0.01, (row["path"], diff.max(), diff.mean())
    assert len(_rows(out / "index.jsonl")) == 2, worst


def _pipeline_image(pipe, spec: Spec, family, prompt: str, packed: torch.Tensor, geometry) -> np.ndarray:
    """The stock pipeline's 8-bit image from our packed initial noise (in the pipeline's dtype), with the family's
    default CFG and negative prompt."""
    latents = spec.pipeline_latents(packed, geometry).to(pipe.transformer.dtype)
    image = spec.sample(pipe, prompt=prompt, height=H, width=W, num_inference_steps=STEPS, output_type="pt",
                        latents=latents, max_sequence_length=MSL,
                        **spec.cfg_kwargs(family.defaults.cfg_scale, family.defaults.negative_prompt))[0].float()
    return _eight_bit(image)


def _eight_bit(sample: torch.Tensor) -> np.ndarray:
    """A pipeline's image (3, H, W) as sample.py's PNG holds it (8-bit, H x W x 3); a video (F, 3, H, W) as its
    frame strip PNG (``evaluation.save_sample``)."""
    if sample.ndim == 4:
        from fastvideo.logging import strip_grid

        sample = strip_grid(sample[None])
    return sample.clamp(0, 1).mul(255).add(0.5).floor().permute(1, 2, 0).numpy().astype(np.int16)


@pytest.mark.slow(cover="test_sample.py::test_base_model_output_is_complete_deterministic_and_equals_flux_pipeline",
                  cost_s=8)
def test_sample_py_in_bf16_is_as_close_to_the_fp32_pipeline_as_the_bf16_pipeline(fam, tmp_path):
    """sample.py --mixed_precision bf16 (bf16 weights; latents, sigmas and the timestep kept in float32) and the stock
    pipeline loaded in bf16 (which also rounds its latents and the timestep to bf16 every step), same noise and CFG,
    both against the stock pipeline in fp32 (the exact reference): ours is no further from it than the stock bf16
    pipeline is, in mean and max 8-bit difference. The figures (docs/model-families.md) are printed."""
    from fastvideo.seeding import NoiseSource

    family, spec = fam["family"], fam["spec"]
    out = _sample_py(fam, tmp_path / "samples", 1, "--mixed_precision", "bf16")
    row = _rows(out / "index.jsonl")[0]
    geometry = spec.geometry(family, fam["model"])
    packed = NoiseSource(7).randn(geometry.packed_shape, step=0, prompt_id=row["prompt_id"],
                                  sample_index=row["sample_index"], purpose="init")[None]
    fp32 = _pipeline_image(_pipeline(fam["model"]), spec, family, row["prompt"], packed, geometry)
    bf16 = _pipeline_image(_pipeline(fam["model"], torch.bfloat16), spec, family, row["prompt"], packed, geometry)
    ours, stock = np.abs(_png(out / row["path"]) - fp32), np.abs(bf16 - fp32)
    print(f"{spec.name} vs the fp32 pipeline: ours in bf16 max {ours.max()} mean {ours.mean():.3f}; the bf16 pipeline "
          f"max {stock.max()} mean {stock.mean():.3f}")
    assert ours.mean() <= stock.mean() and ours.max() <= stock.max(), (ours.mean(), stock.mean(), ours.max(),
                                                                       stock.max())


@pytest.mark.slow(cover=FLUX2_GRPO, cost_s=35)
def test_dpo_nft_awm_with_lora_and_a_grpo_full_fine_tune(fam, tmp_path):
    """In one 2-rank job, 2 steps each: online DPO (CFG rollout, unguided loss), DiffusionNFT and AWM (CFG-free,
    --cfg_scale 1) with LoRA: finite losses, a moving policy, exports the stock pipeline loads and that change its
    images; and GRPO as a full fine-tune (no LoRA): OUT/final is a transformer folder the family's diffusers class
    loads, with weights that differ from the base model's."""
    common = ["--pretrained_model_name_or_path", str(fam["model"]), "--data_json_path", str(fam["manifest"]),
              "--device", "cpu", "--h", str(H), "--w", str(W), "--sampling_steps", "4", "--num_generations", "4",
              "--prompts_per_step", "2", "--rollout_batch_size", "4", "--train_batch_size", "2", "--reward",
              "jpeg_compressibility:1.0", "--learning_rate", "1e-3", "--seed", "3", "--no-progress_bar",
              "--max_train_steps", "2", "--checkpointing_steps", "100", "--lora_rank", "4", *fam["spec"].flags]
    family = fam["family"]
    full = _grpo_args(fam, tmp_path / "full", "--lora_rank", "0", "--cfg_scale", str(family.defaults.cfg_scale),
                      "--learning_rate", "1e-4")
    run_in_one_job([("train_dpo.py", [*common, "--output_dir", str(tmp_path / "dpo"), "--cfg_scale",
                                      str(family.defaults.cfg_scale)]),
                    ("train_nft.py", [*common, "--output_dir", str(tmp_path / "nft"), "--cfg_scale", "1"]),
                    ("train_nft.py", [*common, "--output_dir", str(tmp_path / "awm"), "--cfg_scale", "1",
                                      "--objective", "awm", "--awm_timesteps", "2"]),
                    (full[0], full[1:])], tmp_path)
    call = dict(prompt="a red cube on a table", height=H, width=W, num_inference_steps=2, output_type="pt",
                max_sequence_length=MSL)
    base = fam["spec"].sample(_pipeline(fam["model"]), generator=torch.Generator().manual_seed(0), **call)
    for name in ("dpo", "nft", "awm"):
        rows = _rows(tmp_path / name / "metrics.jsonl")
        assert len(rows) == 2 and all(np.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows), (name, rows)
        pipe = _pipeline(fam["model"])
        pipe.load_lora_weights(tmp_path / name / "final")  # a LoRA folder of the family's pipeline
        tuned = fam["spec"].sample(pipe, generator=torch.Generator().manual_seed(0), **call)
        assert torch.isfinite(tuned).all() and (tuned - base).abs().max() > 1e-4, name
    cls = family.transformer_class()
    tuned = cls.from_pretrained(tmp_path / "full" / "final", local_files_only=True)
    base = cls.from_pretrained(family.transformer_folder(fam["model"]), local_files_only=True)
    moved = max((a - b).abs().max().item() for a, b in zip(tuned.state_dict().values(), base.state_dict().values()))
    assert moved > 0


# one family (Wan: true CFG with a negative prompt and videos, the most state to restore, record and replay): resume
# and record/replay are the scaffold's, the same for every family; each family's guided replay is checked on-policy
# by test_grpo_lora_with_cfg_is_on_policy_and_exports_a_lora_the_pipeline_loads
@pytest.mark.parametrize("fam", ["wan"], indirect=True)
@pytest.mark.slow(cover=FLUX2_GRPO, cost_s=25)
def test_grpo_with_cfg_resumes_exactly_and_replays_its_recording(fam, tmp_path):
    """GRPO LoRA with CFG, 2 steps on 2 ranks with a checkpoint after each and a recording: continued from step 1 it
    logs the same metrics (LR schedule included); replayed on 1 rank from the recording, ``fastvideo.compare``
    finds the two runs in agreement."""
    from helpers import assert_resume_matches

    cfg = str(fam["family"].defaults.cfg_scale)
    flags = ("--lora_rank", "4", "--cfg_scale", cfg, "--checkpointing_steps", "1", "--lr_scheduler", "cosine",
             "--lr_warmup_steps", "1")
    straight, resumed, replay = tmp_path / "straight", tmp_path / "resumed", tmp_path / "replay"
    _grpo(fam, straight, *flags, "--record_dir", str(straight / "rec"))
    assert_resume_matches(straight, resumed, 1, _grpo_args(fam, resumed, *flags))
    _grpo(fam, replay, *flags, "--replay_dir", str(straight / "rec"), "--record_dir", str(replay / "rec"), nproc=1)
    out = subprocess.run([sys.executable, "-m", "fastvideo.compare", str(straight / "rec"), str(replay / "rec")],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "agree" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("fam", ["wan"], indirect=True)
@pytest.mark.slow(cover="test_sequence_parallel.py::test_sp2_equals_sp1_on_two_ranks", cost_s=15)
def test_video_sp2_on_two_ranks_equals_one_rank(fam, tmp_path):
    """Wan GRPO LoRA with CFG, Ulysses --sp_size 2 over the video tokens on 2 ranks (one data-parallel replica) against
    1 rank, one step: the same rollout (its rewards equal) and the same gradient to float rounding."""
    flags = ("--lora_rank", "4", "--cfg_scale", "5", "--fsdp_version", "2", "--max_train_steps", "1")
    _grpo(fam, tmp_path / "sp2", *flags, "--sp_size", "2")
    _grpo(fam, tmp_path / "sp1", *flags, nproc=1)
    sp2, sp1 = _rows(tmp_path / "sp2" / "metrics.jsonl"), _rows(tmp_path / "sp1" / "metrics.jsonl")
    assert sp2[0]["reward_mean"] == sp1[0]["reward_mean"]  # the rollout's videos score alike
    assert sp2[0]["grad_norm"] == pytest.approx(sp1[0]["grad_norm"], rel=1e-5) and sp2[0]["grad_norm"] > 0
