"""The FLUX.1-Kontext edit family (fastvideo/models/flux_kontext.py) against the stock diffusers FluxKontextPipeline
on the seeded tiny Kontext folder: the folder and auto-detection, the stored rows (prompt embeddings and the packed
source latents), the source tokens' position ids, one velocity, the ODE end point with and without true CFG, the
geometry's refusals and the LoRA export in the stock pipeline. Default tier, ~15 s."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fastvideo import models
from fastvideo.lora import save_lora_for_diffusers
from fastvideo.models import flux_kontext
from fastvideo.models.common import EditGeometry
from fastvideo.rollout import guided_velocity
from helpers import random_lora

PROMPTS = ["make the red circle blue", "remove the square"]
T5_TOKENS = 16
SIZE = 64  # the tiny preset's size; the sources are 32 x 48 (another grid than the target's)
SOURCE_HW = (32, 48)


@pytest.fixture(scope="module")
def folder(tiny_preset) -> Path:
    return tiny_preset("flux-kontext-tiny")


@pytest.fixture(scope="module")
def family() -> flux_kontext.FluxKontext:
    return models.resolve("flux-kontext")


@pytest.fixture(scope="module")
def pipe(folder):
    from diffusers import FluxKontextPipeline

    pipeline = FluxKontextPipeline.from_pretrained(folder, local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


@pytest.fixture(scope="module")
def parts(folder, family):
    vae = family.load_vae(folder)
    return {"enc": family.load_text_encoders(folder), "transformer": family.load_transformer(folder), "vae": vae,
            "geometry": models.geometry_for(family, vae, SIZE, SIZE, condition=SOURCE_HW)}


@pytest.fixture(scope="module")
def sources() -> list[Image.Image]:
    """Two 48 x 32 RGB sources with structure (a gradient and a block), not noise."""
    h, w = SOURCE_HW
    out = []
    for k in range(2):
        a = np.zeros((h, w, 3), dtype=np.uint8)
        a[..., 0] = np.linspace(0, 255, w)[None, :].astype(np.uint8)
        a[..., 1] = 60 + 100 * k
        a[8:20, 10 + 12 * k:26 + 12 * k, 2] = 230
        out.append(Image.fromarray(a))
    return out


def _tensor(images: list[Image.Image]) -> torch.Tensor:
    return torch.stack([torch.from_numpy(np.asarray(i, dtype=np.float32) / 255).permute(2, 0, 1) for i in images])


def _files(folder: Path) -> dict[str, bytes]:
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file()}


def test_stock_pipeline_loads_the_tiny_folder_and_auto_finds_kontext(folder, pipe, family, tmp_path):
    assert type(pipe).__name__ == "FluxKontextPipeline"
    assert models.resolve("auto", folder) is family and family.edit and family.condition_keys == ("image_latents",)
    assert _files(flux_kontext.build_tiny(tmp_path / "again", seed=0)) == _files(folder)
    transformer = family.load_transformer(folder)
    assert models.family_of(transformer) is family  # the tag, not the (FLUX.1) class


def test_stored_rows_and_source_ids_equal_the_pipelines(pipe, parts, family, sources):
    images = _tensor(sources)
    rows, truncated = family.encode_edits(parts["enc"], parts["vae"], images, PROMPTS, T5_TOKENS)
    assert set(rows) == set(family.embedding_keys) and truncated == [False, False]
    with torch.no_grad():
        pe, pooled, text_ids = pipe.encode_prompt(PROMPTS, None, max_sequence_length=T5_TOKENS)
        pixels = pipe.image_processor.preprocess(sources, *SOURCE_HW)
        _, image_latents, latent_ids, image_ids = pipe.prepare_latents(
            pixels, 2, 4, SIZE, SIZE, torch.float32, torch.device("cpu"), torch.Generator().manual_seed(0))
    assert torch.equal(rows["prompt_embeds"], pe) and torch.equal(rows["pooled_prompt_embeds"], pooled)
    geometry = parts["geometry"]
    assert isinstance(geometry, EditGeometry) and geometry.condition_tokens == (32 // 8) * (48 // 8) == 24
    assert rows["image_latents"].shape == image_latents.shape == (2, 24, 16)
    assert torch.allclose(rows["image_latents"], image_latents, atol=1e-6)
    shared = family.conditioning(geometry, rows, 3.5, torch.device("cpu"))
    assert torch.equal(shared["img_ids"], torch.cat([latent_ids, image_ids]))
    assert shared["img_ids"].shape == (geometry.seq_len + 24, 3) and set(image_ids[:, 0].tolist()) == {1.0}


def test_velocity_is_the_target_rows_of_one_call_and_sees_the_source(parts, family, sources):
    geometry, model = parts["geometry"], parts["transformer"]
    rows, _ = family.encode_edits(parts["enc"], parts["vae"], _tensor(sources), PROMPTS, T5_TOKENS)
    x = torch.randn(2, *geometry.packed_shape, generator=torch.Generator().manual_seed(1))
    shared = family.conditioning(geometry, rows, 3.5, torch.device("cpu"))
    with torch.no_grad():
        v = family.predict_velocity(model, x, torch.tensor(0.6), rows, shared)
        full = model(hidden_states=torch.cat([x, rows["image_latents"]], 1), timestep=torch.full((2,), 0.6),
                     guidance=torch.full((2,), 3.5), pooled_projections=rows["pooled_prompt_embeds"],
                     encoder_hidden_states=rows["prompt_embeds"], txt_ids=shared["txt_ids"],
                     img_ids=shared["img_ids"], return_dict=False)[0]
        swapped = family.predict_velocity(model, x, torch.tensor(0.6),
                                          {**rows, "image_latents": rows["image_latents"].flip(0)}, shared)
    assert v.shape == (2, *geometry.packed_shape) and v.dtype == torch.float32
    assert torch.equal(v, full[:, :geometry.seq_len])
    assert (v - swapped).abs().mean() > 1e-3 * v.abs().mean()  # the source changes it (rounding: ~1e-7)


@pytest.mark.parametrize("cfg_scale", [1.0, 2.5])
def test_adapter_euler_loop_equals_the_stock_pipeline(pipe, parts, family, sources, cfg_scale):
    geometry, steps = parts["geometry"], 3
    noise = torch.randn(2, *geometry.packed_shape, generator=torch.Generator().manual_seed(0))
    negative = {"negative_prompt": "", "true_cfg_scale": cfg_scale} if cfg_scale > 1 else {}
    with torch.no_grad():
        images = pipe(image=sources, prompt=PROMPTS, latents=noise, num_inference_steps=steps, guidance_scale=3.5,
                      output_type="pt", height=SIZE, width=SIZE, max_area=SIZE * SIZE, _auto_resize=False,
                      max_sequence_length=T5_TOKENS, **negative).images
        rows, _ = family.encode_edits(parts["enc"], parts["vae"], _tensor(sources), PROMPTS, T5_TOKENS)
        if cfg_scale > 1:
            uncond, _ = family.encode_prompts(parts["enc"], ["", ""], T5_TOKENS)
            rows.update({f"negative_{k}": v for k, v in uncond.items()})
        shared = family.conditioning(geometry, rows, 3.5, torch.device("cpu"))
        sigmas, x = family.sigmas(steps, geometry.seq_len), noise
        for i in range(steps):
            v = guided_velocity(family, parts["transformer"], x, sigmas[i], rows, shared, cfg_scale)
            x = x + (sigmas[i + 1] - sigmas[i]) * v
        ours = family.decode(parts["vae"], x, geometry)
    diff = (ours - images).abs().max().item() * 255
    print(f"cfg {cfg_scale}: sampling max |diff| x 255 = {diff:.3g}")
    assert ours.shape == images.shape == (2, 3, SIZE, SIZE)
    assert diff < 1
    assert (images[0] - images[1]).abs().mean() > 0.01  # another source and instruction, another edit


def test_geometry_refusals(parts, family, folder):
    with pytest.raises(ValueError, match="source images of 36 x 48.*--edit_size.*multiple of 8"):  # tiny VAE: 4x
        models.geometry_for(family, folder, SIZE, SIZE, condition=(36, 48))
    assert models.geometry_for(family, folder, SIZE, SIZE).condition_tokens == parts["geometry"].seq_len  # planner
    with pytest.raises(ValueError, match="takes no source image.*flux-kontext"):
        models.geometry_for(models.resolve("flux1"), folder, SIZE, SIZE, condition=SOURCE_HW)
    plain = models.resolve("flux1").latent_geometry(folder, SIZE, SIZE)
    with pytest.raises(ValueError, match="condition=.*condition_size"):
        family.conditioning(plain, {"prompt_embeds": torch.zeros(1, 4, 32)}, 3.5, torch.device("cpu"))


def test_lora_export_loads_in_the_stock_pipeline_and_changes_the_edit(folder, parts, family, sources, tmp_path):
    from diffusers import FluxKontextPipeline

    model = random_lora(family, folder)
    out = save_lora_for_diffusers(model, tmp_path / "lora", family=family)
    pipeline = FluxKontextPipeline.from_pretrained(folder, local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    call = dict(image=sources[0], prompt=PROMPTS[0], num_inference_steps=2, output_type="pt", height=SIZE, width=SIZE,
                max_area=SIZE * SIZE, _auto_resize=False, max_sequence_length=T5_TOKENS)
    latents = torch.randn(1, *parts["geometry"].packed_shape, generator=torch.Generator().manual_seed(3))
    before = pipeline(latents=latents, **call).images
    pipeline.load_lora_weights(out)
    after = pipeline(latents=latents, **call).images
    assert (after - before).abs().max() > 0.02
    with torch.no_grad():
        rows, _ = family.encode_edits(parts["enc"], parts["vae"], _tensor(sources[:1]), PROMPTS[:1], T5_TOKENS)
        shared = family.conditioning(parts["geometry"], rows, 3.5, torch.device("cpu"))
        ours = family.predict_velocity(model, latents, torch.tensor(0.7), rows, shared)
        stock = family.predict_velocity(pipeline.transformer, latents, torch.tensor(0.7), rows, shared)
    assert torch.allclose(stock, ours, atol=1e-5)  # the export restores the trained adapter in the edit pipeline


def test_flops_count_the_source_tokens(parts, family, sources):
    """One velocity call's FLOPs (torch's counter) = the FLUX.1 formula at L + Ls image tokens: the FLOP meter's
    ``forward_tokens`` sees the joined sequence."""
    from fastvideo import flops

    geometry, model = parts["geometry"], parts["transformer"]
    rows, _ = family.encode_edits(parts["enc"], parts["vae"], _tensor(sources), PROMPTS, T5_TOKENS)
    shared = family.conditioning(geometry, rows, 3.5, torch.device("cpu"))
    x = torch.zeros(2, *geometry.packed_shape)
    seen = []
    hook = model.register_forward_pre_hook(lambda m, a, k: seen.append(family.forward_tokens(a, k)), with_kwargs=True)
    try:
        with torch.no_grad():
            counted = flops.counted_flops(lambda: family.predict_velocity(model, x, torch.tensor(0.5), rows, shared))
    finally:
        hook.remove()
    tokens = geometry.seq_len + geometry.condition_tokens
    assert seen == [(2, tokens, T5_TOKENS)]
    assert counted == family.transformer_flops(model.config, tokens, T5_TOKENS, 2)
    assert counted > family.transformer_flops(model.config, geometry.seq_len, T5_TOKENS, 2)


# slow: a --dry_run subprocess (~15 s); the planner's arithmetic is the default tier's on FLUX.1-dev
@pytest.mark.slow(cover="test_memory.py::test_plan_arithmetic_for_flux_dev", cost_s=15)
def test_dry_run_plans_the_source_tokens(tmp_path):
    """--dry_run on FLUX.1-Kontext-dev's real configs reads the edit store's source size: the transformer's sequence
    is the target's and the source's tokens, and the source latents are planned beside the rollout buffers."""
    import json
    import subprocess
    import sys

    from helpers import REPO

    model = flux_kontext.write_config(tmp_path / "kontext")
    store = tmp_path / "store"
    store.mkdir()
    (store / "manifest.json").write_text(json.dumps({
        "format_version": 2, "max_sequence_length": 512, "dtype": "bf16", "num_prompts": 0, "prompts": [],
        "embedding_keys": list(flux_kontext.FluxKontext.embedding_keys), "condition_keys": ["image_latents"],
        "edit": {"height": 512, "width": 768}, "negative": None, "shards": []}))
    proc = subprocess.run([sys.executable, "train_grpo_flux.py", "--pretrained_model_name_or_path", str(model),
                           "--data_json_path", str(store), "--output_dir", str(tmp_path / "out"), "--device", "cuda",
                           "--dry_run", "--dry_run_world_size", "8", "--h", "512", "--w", "512", "--mixed_precision",
                           "bf16", "--sampling_steps", "6", "--num_generations", "8", "--prompts_per_step", "16",
                           "--train_batch_size", "2", "--rollout_batch_size", "4", "--reward",
                           "jpeg_compressibility:1.0", "--lora_rank", "32"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    target, source = (512 // 16) ** 2, (512 // 16) * (768 // 16)
    assert f"micro-batch 2 x ({target + source} image ({source} of them the source's) + 512 text tokens)" in proc.stdout
    assert f"B x Lc x C, Lc={source}" in proc.stdout, proc.stdout[-3000:]
