"""The Wan family adapter (fastvideo/models/wan.py) against the stock diffusers WanPipeline on the seeded tiny Wan2.1
folder (64 x 64 x 5 frames): loading, prompt embeddings (the pipeline's prompt cleaning included), the Euler sigma
grid from the folder's flow_shift, a full CFG sampling run against the pipeline with the Euler scheduler, the video
VAE round trip, the FLOP formula against torch's counter, the meta-device path (rotary tables rebuilt after
``to_empty``), the 14B config's parameter count, and LoRA exports that the stock pipeline loads."""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from fastvideo import flops, models, weights
from fastvideo.lora import add_lora, save_lora_for_diffusers
from fastvideo.models import wan, wan_presets

PROMPTS = ["a red cube rolling on a wooden table", "a cat   jumping\n over a fence "]  # the 2nd needs cleaning
LONG = " ".join(["a very long prompt about many small moving things"] * 12)  # > 32 tokens
TEXT_TOKENS = 32
H = W = 64
FRAMES = 5


@pytest.fixture(scope="module")
def tiny_wan(tiny_preset) -> Path:
    """The tiny Wan folder (seed 0), built once per session."""
    return tiny_preset("wan-tiny")


@pytest.fixture(scope="module")
def family() -> wan.Wan:
    return models.resolve("wan")


@pytest.fixture(scope="module")
def pipe(tiny_wan):
    """The stock WanPipeline with the Euler scheduler on the folder's flow_shift (our sampler's ODE)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    pipeline = WanPipeline.from_pretrained(tiny_wan, local_files_only=True)
    pipeline.scheduler = FlowMatchEulerDiscreteScheduler(shift=pipeline.scheduler.config.flow_shift)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


@pytest.fixture(scope="module")
def parts(tiny_wan, family):
    """The adapter's own loads: text encoder, transformer, VAE and the 64 x 64 x 5 geometry."""
    return {"enc": family.load_text_encoders(tiny_wan), "transformer": family.load_transformer(tiny_wan),
            "vae": family.load_vae(tiny_wan), "geometry": family.latent_geometry(tiny_wan, H, W, FRAMES)}


def _files(folder: Path) -> dict[str, bytes]:
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file()}


def test_stock_pipeline_loads_the_tiny_folder_and_auto_finds_wan(tiny_wan, pipe, family, tmp_path):
    assert type(pipe).__name__ == "WanPipeline" and pipe.transformer_2 is None
    assert sum(p.numel() for p in pipe.transformer.parameters()) < 200_000
    assert pipe.vae.config.z_dim == 16 and len(pipe.vae.config.latents_std) == 16
    assert models.resolve("auto", tiny_wan) is family and isinstance(family, wan.Wan)
    assert family.check_folder(tiny_wan) == tiny_wan
    assert _files(wan_presets.build_tiny(tmp_path / "again", seed=0)) == _files(tiny_wan)  # same seed: same bytes
    broken = tmp_path / "broken"
    (broken / "transformer").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="wan-tiny"):
        family.check_folder(broken)
    half = tmp_path / "half-a14b"  # boundary_ratio without transformer_2/: refused, not trained as one expert
    shutil.copytree(tiny_wan, half)
    index = json.loads((half / "model_index.json").read_text())
    (half / "model_index.json").write_text(json.dumps({**index, "boundary_ratio": 0.875}))
    with pytest.raises(ValueError, match="boundary_ratio is 0.875 but transformer_2/ is missing"):
        family.check_folder(half)


def test_encode_prompts_equals_the_pipelines_encode_prompt(pipe, parts, family):
    embeds, truncated = family.encode_prompts(parts["enc"], PROMPTS + [LONG], TEXT_TOKENS)
    negative, _ = family.encode_prompts(parts["enc"], ["", "blurry, static"], TEXT_TOKENS)
    with torch.no_grad():  # as WanPipeline.__call__ runs it
        pe, ne = pipe.encode_prompt(PROMPTS + [LONG], ["", "blurry, static", ""], do_classifier_free_guidance=True,
                                    max_sequence_length=TEXT_TOKENS, device=torch.device("cpu"))
    assert embeds["prompt_embeds"].shape == (3, TEXT_TOKENS, 32)
    assert torch.equal(embeds["prompt_embeds"], pe) and torch.equal(negative["prompt_embeds"], ne[:2])
    assert truncated == [False, False, True]
    lengths = (embeds["prompt_embeds"].abs().sum(-1) > 0).sum(-1)  # the rows after each prompt's tokens are zero
    assert 0 < lengths[0] < TEXT_TOKENS and lengths[2] == TEXT_TOKENS
    assert (embeds["prompt_embeds"][0, lengths[0]:] == 0).all()
    assert family.collate(embeds) is embeds  # no mask: every token is attended, as in the pipeline


def test_sigmas_are_the_euler_grid_of_the_folders_flow_shift(pipe, tiny_wan, family):
    from diffusers import FlowMatchEulerDiscreteScheduler

    config = models.read_scheduler_config(tiny_wan)
    assert type(pipe).__name__ == "WanPipeline" and config["_class_name"] == "UniPCMultistepScheduler"
    for steps in (1, 3, 10, 50):
        pipe.scheduler.set_timesteps(steps)
        ours = family.sigmas(steps, 32, config)
        assert torch.equal(ours, pipe.scheduler.sigmas), steps
        assert torch.equal(ours[:-1] * 1000, pipe.scheduler.timesteps)  # the transformer's timestep
    shifted = FlowMatchEulerDiscreteScheduler(shift=5.0)
    shifted.set_timesteps(10)
    assert torch.equal(family.sigmas(10, 32, {**config, "flow_shift": 5.0}), shifted.sigmas)  # a 720p folder
    assert torch.equal(family.sigmas(10, 32, None), family.sigmas(10, 32, config))  # stock: flow_shift 3
    with pytest.raises(ValueError, match="use_flow_sigmas"):
        family.sigmas(10, 32, {**config, "use_flow_sigmas": False})


def test_adapter_euler_cfg_loop_equals_the_stock_pipeline(pipe, parts, family):
    geometry, steps, scale = parts["geometry"], 3, 5.0
    assert geometry.packed_shape == (2 * 4 * 4, 64) and geometry.latent_shape == (16, 2, 8, 8)
    noise = torch.randn(2, *geometry.packed_shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        videos = pipe(PROMPTS, negative_prompt="", latents=wan.unpack_video(noise, geometry),
                      num_inference_steps=steps, guidance_scale=scale, output_type="pt", height=H, width=W,
                      num_frames=FRAMES, max_sequence_length=TEXT_TOKENS).frames
        cond, _ = family.encode_prompts(parts["enc"], PROMPTS, TEXT_TOKENS)
        uncond, _ = family.encode_prompts(parts["enc"], [family.defaults.negative_prompt] * 2, TEXT_TOKENS)
        rows = {"prompt_embeds": torch.cat([cond["prompt_embeds"], uncond["prompt_embeds"]])}
        shared = family.conditioning(geometry, rows, None, torch.device("cpu"))
        sigmas, x = family.sigmas(steps, geometry.seq_len), noise
        for i in range(steps):
            v_cond, v_uncond = family.predict_velocity(parts["transformer"], torch.cat([x, x]), sigmas[i], rows,
                                                       shared).chunk(2)
            x = x + (sigmas[i + 1] - sigmas[i]) * family.combine_guidance(v_cond, v_uncond, scale)
        ours = family.decode(parts["vae"], x, geometry, micro_batch=2)
    diff = (ours - videos).abs().max().item() * 255
    print(f"sampling max |diff| x 255 = {diff:.3g}")
    assert ours.shape == videos.shape == (2, FRAMES, 3, H, W)
    assert diff < 1
    assert (videos[0] - videos[1]).abs().mean() > 0.02  # the prompt changes the video
    assert (videos[:, 1:] - videos[:, :-1]).abs().mean() > 1e-3  # the frames differ: a video, not a still
    assert 0.1 < v_cond.std() < 10 and (v_cond - v_uncond).abs().mean() > 0.1 * v_cond.abs().mean()


def test_encode_decode_round_trip_and_bad_sizes(tiny_wan, pipe, parts, family):
    geometry = parts["geometry"]
    videos = torch.rand(2, FRAMES, 3, H, W, generator=torch.Generator().manual_seed(1))
    latents = family.encode(parts["vae"], videos, geometry)
    assert latents.shape == (2, 32, 64) and latents.dtype == torch.float32
    vae = parts["vae"]
    with torch.no_grad():
        z = vae.encode(videos.permute(0, 2, 1, 3, 4) * 2 - 1).latent_dist.mode()
    mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
    assert torch.allclose(wan.unpack_video(latents, geometry), (z - mean) / std, atol=1e-5)
    assert torch.equal(wan.pack_video(wan.unpack_video(latents, geometry)), latents)
    decoded = family.decode(vae, latents, geometry)
    assert decoded.shape == (2, FRAMES, 3, H, W) and 0 <= decoded.min() and decoded.max() <= 1
    with pytest.raises(ValueError, match=r"multiple of 16 .*--h 48 or 64"):
        family.latent_geometry(tiny_wan, 56, 64, FRAMES)
    with pytest.raises(ValueError, match=r"--num_frames 6 must be 4 k \+ 1.*--num_frames 5 or 9"):
        family.latent_geometry(tiny_wan, H, W, 6)
    assert family.latent_geometry(tiny_wan, 480, 832).seq_len == 21 * 30 * 52  # 81 frames: 32,760 tokens


def _velocity_call(family, model, geometry, batch, text_tokens):
    x = torch.randn(batch, *geometry.packed_shape)
    cond = {"prompt_embeds": torch.randn(batch, text_tokens, 32)}
    shared = family.conditioning(geometry, cond, None, torch.device("cpu"))
    return lambda: family.predict_velocity(model, x, torch.tensor(0.5), cond, shared)


@pytest.mark.parametrize("batch,text_tokens", [(1, 7), (2, TEXT_TOKENS)])
def test_transformer_flops_equal_the_counter(parts, family, batch, text_tokens):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model, geometry = copy.deepcopy(parts["transformer"]).requires_grad_(True), parts["geometry"]
    config, L = model.config, geometry.seq_len
    forward = _velocity_call(family, model, geometry, batch, text_tokens)
    seen = []
    model.register_forward_pre_hook(lambda m, a, k: seen.append(family.forward_tokens(a, k)), with_kwargs=True)
    with torch.no_grad():
        assert flops.counted_flops(forward) == family.transformer_flops(config, L, text_tokens, batch)
    assert seen == [(batch, L, text_tokens)]
    with sdpa_kernel([SDPBackend.MATH]):  # attention as plain matmuls: torch counts its backward too
        trained = flops.counted_flops(lambda: forward().sum().backward())
        assert trained == family.transformer_flops(config, L, text_tokens, batch, backward=True)
        counts = []  # LoRA: the counter includes the rank-r adapters, linear in r: r = 0 is 2 count(1) - count(2)
        for rank in (1, 2):
            lora = add_lora(copy.deepcopy(parts["transformer"]), rank=rank, alpha=rank,
                            target_modules=list(family.lora_target_modules))
            call = _velocity_call(family, lora, geometry, batch, text_tokens)
            counts.append(flops.counted_flops(lambda: call().sum().backward()))
    lora_flops = family.transformer_flops(config, L, text_tokens, batch, backward=True, weight_grads=False)
    assert 2 * counts[0] - counts[1] == lora_flops
    assert family.transformer_flops(config, L, text_tokens, batch) < lora_flops < trained


def test_meta_build_refills_the_rotary_tables_and_counts_the_14b(tiny_wan, parts, family, tmp_path):
    model = family.build_transformer(tiny_wan)
    assert models.family_of(model) is family and all(p.is_meta for p in model.parameters())
    kwargs = family.example_inputs(model.config, 2, 32, TEXT_TOKENS, torch.float32, "meta")
    assert family.forward_tokens((), kwargs) == (2, 32, TEXT_TOKENS)
    assert model(**kwargs)[0].shape == (2, 16, 1, 8, 16)  # 32 patches: a 4 x 8 grid of one frame
    model = model.to_empty(device="cpu")  # the sharded-loading path: buffers come back uninitialised too
    weights.load_safetensors_into(model, family.transformer_folder(tiny_wan))
    model.rope.freqs_cos.fill_(7.0)  # what an uninitialised non-persistent buffer may hold
    assert family.prepare_for_device(model, "cpu") == []
    assert model.rope.freqs_cos.dtype == torch.float32  # float64 angles on the CPU, float32 tables: as the stock model
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(1, *parts["geometry"].packed_shape, generator=generator)
    cond = {"prompt_embeds": torch.randn(1, TEXT_TOKENS, 32, generator=generator)}
    shared = family.conditioning(parts["geometry"], cond, None, torch.device("cpu"))
    with torch.no_grad():
        ours = family.predict_velocity(model, x, torch.tensor(0.5), cond, shared)
        reference = family.predict_velocity(parts["transformer"], x, torch.tensor(0.5), cond, shared)
    # equal weights and tables; a CPU matmul may round differently on differently aligned storage (~1e-6)
    assert torch.allclose(ours, reference, rtol=0, atol=1e-5), (ours - reference).abs().max()

    folder = wan_presets.write_config(tmp_path / "wan14b")
    assert not list(folder.rglob("*.safetensors"))
    real = family.build_transformer(folder, torch.bfloat16)
    assert sum(p.numel() for p in real.parameters()) == wan_presets.WAN21_T2V_14B_TRANSFORMER_PARAMETERS
    assert len([m for m in real.modules() if type(m).__name__ == "ComputeDtypeRMSNorm"]) == 40 * 4  # q/k norms
    geometry = family.latent_geometry(folder, 480, 832, 81)
    assert geometry.packed_shape == (32_760, 64) and geometry.latent_shape == (16, 21, 60, 104)


def test_lora_targets_match_and_the_export_loads_in_the_stock_pipeline(tiny_wan, parts, family, tmp_path):
    from diffusers import WanPipeline

    model = add_lora(family.load_transformer(tiny_wan), rank=4, alpha=8, target_modules=list(family.lora_target_modules),
                     init_seed=0)
    adapted = {n.rsplit(".", 1)[0] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert len(adapted) == 2 * 10  # q/k/v/o of both attentions and the FFN's two layers, in each of 2 blocks
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    out = save_lora_for_diffusers(model, tmp_path / "lora", family=family)
    pipeline = WanPipeline.from_pretrained(tiny_wan, local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    geometry = parts["geometry"]
    call = dict(prompt=PROMPTS[0], negative_prompt="", num_inference_steps=2, guidance_scale=5.0, output_type="pt",
                height=H, width=W, num_frames=FRAMES, max_sequence_length=TEXT_TOKENS)
    latents = torch.randn(1, *geometry.latent_shape, generator=torch.Generator().manual_seed(3))
    before = pipeline(latents=latents, **call).frames
    pipeline.load_lora_weights(out)
    after = pipeline(latents=latents, **call).frames
    assert (after - before).abs().max() > 0.02
    x = wan.pack_video(latents)
    with torch.no_grad():
        cond, _ = family.encode_prompts(parts["enc"], PROMPTS[:1], TEXT_TOKENS)
        shared = family.conditioning(geometry, cond, None, torch.device("cpu"))
        ours = family.predict_velocity(model, x, torch.tensor(0.7), cond, shared)
        stock = family.predict_velocity(pipeline.transformer, x, torch.tensor(0.7), cond, shared)
        base = family.predict_velocity(parts["transformer"], x, torch.tensor(0.7), cond, shared)
    assert (ours - base).abs().max() > 0.05
    assert torch.allclose(stock, ours, atol=1e-5)  # the export restores the trained adapter, alpha included
