"""The SD3 / SD3.5 family adapter (fastvideo/models/sd3.py) against the stock diffusers StableDiffusion3Pipeline on
the seeded tiny SD3.5 folder (q/k RMSNorm, one dual-attention block): loading, prompt embeddings, sigmas, a full CFG
sampling run, VAE round trip, the FLOP formula against torch's counter, the meta-device paths, and LoRA exports."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from fastvideo import flops, models
from fastvideo.lora import add_lora, save_lora_for_diffusers
from fastvideo.models import sd3
from fastvideo.models.flux import pack_latents, unpack_latents

PROMPTS = ["a red cube on a wooden table", "a photo of a cat"]
LONG = " ".join(["a very long prompt about many small things"] * 12)  # > 77 CLIP tokens and > 32 T5 tokens
T5_TOKENS = 32


@pytest.fixture(scope="module")
def tiny_sd3(tiny_preset) -> Path:
    """The tiny SD3.5 folder (seed 0), built once per session."""
    return tiny_preset("sd3-tiny")


@pytest.fixture(scope="module")
def family() -> sd3.SD3:
    return models.resolve("sd3")


@pytest.fixture(scope="module")
def pipe(tiny_sd3):
    from diffusers import StableDiffusion3Pipeline

    pipeline = StableDiffusion3Pipeline.from_pretrained(tiny_sd3, local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


@pytest.fixture(scope="module")
def parts(tiny_sd3, family):
    """The adapter's own loads: text encoders, transformer, VAE and the 64px geometry."""
    return {"enc": family.load_text_encoders(tiny_sd3), "transformer": family.load_transformer(tiny_sd3),
            "vae": family.load_vae(tiny_sd3), "geometry": family.latent_geometry(tiny_sd3, 64, 64)}


def _files(folder: Path) -> dict[str, bytes]:
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file()}


def test_stock_pipeline_loads_the_tiny_folder_and_auto_finds_sd3(tiny_sd3, pipe, family, tmp_path):
    assert type(pipe).__name__ == "StableDiffusion3Pipeline"
    config = pipe.transformer.config
    assert config.qk_norm == "rms_norm" and list(config.dual_attention_layers) == [0]
    assert sum(p.numel() for p in pipe.transformer.parameters()) < 1_000_000
    assert pipe.vae.config.scaling_factor == 1.5305 and pipe.vae.config.shift_factor == 0.0609
    assert models.resolve("auto", tiny_sd3) is family and isinstance(family, sd3.SD3)
    assert family.check_folder(tiny_sd3) == tiny_sd3
    assert _files(sd3.build_tiny(tmp_path / "again", seed=0)) == _files(tiny_sd3)  # same seed: byte-identical
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "transformer").mkdir()
    with pytest.raises(FileNotFoundError, match="sd3-tiny"):
        family.check_folder(broken)


def test_encode_prompts_equals_the_pipelines_encode_prompt(pipe, parts, family):
    negatives = ["", "blurry"]
    embeds, truncated = family.encode_prompts(parts["enc"], PROMPTS + [LONG], T5_TOKENS)
    negative, _ = family.encode_prompts(parts["enc"], negatives, T5_TOKENS)
    with torch.no_grad():  # as StableDiffusion3Pipeline.__call__ runs it
        pe, ne, pp, npp = pipe.encode_prompt(PROMPTS + [LONG], None, None, do_classifier_free_guidance=True,
                                             negative_prompt=negatives + [""], max_sequence_length=T5_TOKENS)
    assert embeds["prompt_embeds"].shape == (3, 77 + T5_TOKENS, 64) == (3, family.text_tokens(T5_TOKENS), 64)
    assert embeds["pooled_prompt_embeds"].shape == (3, 16 + 32)
    assert torch.equal(embeds["prompt_embeds"], pe) and torch.equal(embeds["pooled_prompt_embeds"], pp)
    assert torch.equal(negative["prompt_embeds"], ne[:2]) and torch.equal(negative["pooled_prompt_embeds"], npp[:2])
    assert truncated == [False, False, True]
    assert (embeds["prompt_embeds"][:, :77, 48:] == 0).all()  # CLIP-L 16 + CLIP-G 32 columns, zero-padded to 64
    assert (embeds["prompt_embeds"][0] - embeds["prompt_embeds"][1]).abs().max() > 0.1
    assert family.collate(embeds) is embeds  # no mask: every token is attended


def test_sigmas_equal_the_pipelines_scheduler(pipe, family):
    from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import retrieve_timesteps

    for steps in (1, 4, 10, 28):
        timesteps, _ = retrieve_timesteps(pipe.scheduler, steps, "cpu")  # what __call__ does (no mu: static shift)
        ours = family.sigmas(steps, 4096)
        assert torch.equal(ours, pipe.scheduler.sigmas), steps
        assert torch.equal(ours[:-1] * 1000, timesteps)  # the transformer's timestep, as predict_velocity feeds it
    assert torch.equal(family.sigmas(10, 16), family.sigmas(10, 4096))  # static shift: no resolution dependence


def test_adapter_euler_cfg_loop_equals_the_stock_pipeline(pipe, parts, family):
    geometry, steps, scale = parts["geometry"], 4, 4.5
    noise = torch.randn(2, *geometry.packed_shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        images = pipe(PROMPTS, negative_prompt="", latents=unpack_latents(noise, geometry), num_inference_steps=steps,
                      guidance_scale=scale, output_type="pt", height=64, width=64,
                      max_sequence_length=T5_TOKENS).images
        cond, _ = family.encode_prompts(parts["enc"], PROMPTS, T5_TOKENS)
        uncond, _ = family.encode_prompts(parts["enc"], [family.defaults.negative_prompt] * 2, T5_TOKENS)
        rows = {k: torch.cat([cond[k], uncond[k]]) for k in family.embedding_keys}  # 2B rows: cond, then uncond
        shared = family.conditioning(geometry, rows, family.defaults.guidance, torch.device("cpu"))
        sigmas, x = family.sigmas(steps, geometry.seq_len), noise
        for i in range(steps):
            v_cond, v_uncond = family.predict_velocity(parts["transformer"], torch.cat([x, x]), sigmas[i], rows,
                                                       shared).chunk(2)
            x = x + (sigmas[i + 1] - sigmas[i]) * family.combine_guidance(v_cond, v_uncond, scale)
        ours = family.decode(parts["vae"], x, geometry)
    diff = (ours - images).abs().max().item() * 255
    print(f"sampling max |diff| x 255 = {diff:.3g}")
    assert ours.shape == images.shape == (2, 3, 64, 64)
    assert diff < 1
    assert (images[0] - images[1]).abs().mean() > 0.02  # the prompt changes the image
    assert 0.1 < v_cond.std() < 10 and (v_cond - v_uncond).abs().mean() > 0.1 * v_cond.abs().mean()


def test_encode_decode_round_trip_and_bad_sizes(tiny_sd3, pipe, parts, family):
    geometry = parts["geometry"]
    assert geometry.packed_shape == (64, 64) and geometry.latent_shape == (16, 16, 16)
    images = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    latents = family.encode(parts["vae"], images, geometry)
    assert latents.shape == (2, 64, 64) and latents.dtype == torch.float32
    with torch.no_grad():
        expected = (parts["vae"].encode(images * 2 - 1).latent_dist.mode() - 0.0609) * 1.5305
    assert torch.allclose(unpack_latents(latents, geometry), expected, atol=1e-6)
    decoded = family.decode(parts["vae"], latents, geometry)
    assert decoded.shape == (2, 3, 64, 64) and 0 <= decoded.min() and decoded.max() <= 1
    with pytest.raises(ValueError, match=r"multiple of 8 .*--h 56 or 64"):
        family.latent_geometry(tiny_sd3, 60, 64)
    with pytest.raises(ValueError, match="divisible by 8"):  # the pipeline rejects the same size
        pipe.check_inputs("x", None, None, 60, 64)


def _velocity_call(family, model, geometry, batch, text_tokens):
    x = torch.randn(batch, *geometry.packed_shape)
    cond = {"prompt_embeds": torch.randn(batch, text_tokens, 64), "pooled_prompt_embeds": torch.randn(batch, 48)}
    shared = family.conditioning(geometry, cond, None, torch.device("cpu"))
    return lambda: family.predict_velocity(model, x, torch.tensor(0.5), cond, shared)


@pytest.mark.parametrize("batch,text_tokens", [(1, 7), (2, 77 + T5_TOKENS)])
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
        # LoRA: the counter includes the rank-r adapters, linear in r, so r = 0 is 2 * count(r=1) - count(r=2)
        counts = []
        for rank in (1, 2):
            lora = add_lora(copy.deepcopy(parts["transformer"]), rank=rank, alpha=rank)
            call = _velocity_call(family, lora, geometry, batch, text_tokens)
            counts.append(flops.counted_flops(lambda: call().sum().backward()))
    lora_flops = family.transformer_flops(config, L, text_tokens, batch, backward=True, weight_grads=False)
    assert 2 * counts[0] - counts[1] == lora_flops
    assert family.transformer_flops(config, L, text_tokens, batch) < lora_flops < trained


def test_meta_build_example_inputs_and_the_real_parameter_count(tiny_sd3, family, tmp_path):
    model = family.build_transformer(tiny_sd3)
    assert models.family_of(model) is family and all(p.is_meta for p in model.parameters())
    kwargs = family.example_inputs(model.config, 2, 64, family.text_tokens(T5_TOKENS), torch.float32, "meta")
    assert family.forward_tokens((), kwargs) == (2, 64, 109)
    assert model(**kwargs)[0].shape == (2, 16, 16, 16)

    folder = sd3.write_config(tmp_path / "sd35m")
    assert not list(folder.rglob("*.safetensors"))
    real = family.build_transformer(folder, torch.bfloat16)
    # stabilityai/stable-diffusion-3.5-medium: 2.24B parameters (+ the 384² x 1536 position table, a 0.23B buffer,
    # which makes the "2.5B" of the model card)
    assert sum(p.numel() for p in real.parameters()) == sd3.SD35_MEDIUM_TRANSFORMER_PARAMETERS == 2_243_171_520
    assert sum(b.numel() for b in real.buffers()) == 384 * 384 * 1536
    norms = [m for m in real.modules() if type(m).__name__ == "ComputeDtypeDiffusersRMSNorm"]
    assert len(norms) == 24 * 4 + 13 * 2  # q/k/added q/k of every block, q/k of the 13 dual-attention blocks
    kwargs = family.example_inputs(real.config, 1, 4096, family.text_tokens(256), torch.bfloat16, "meta")
    assert real(**kwargs)[0].shape == (1, 16, 128, 128)  # 1024px
    assert family.latent_geometry(folder, 1024, 1024).packed_shape == (4096, 64)


def test_qk_norms_keep_the_compute_dtype_under_autocast(parts, family):
    model, geometry = parts["transformer"], parts["geometry"]
    dtypes = []
    hook = model.transformer_blocks[0].attn.norm_q.register_forward_hook(lambda m, a, out: dtypes.append(out.dtype))
    try:
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
            _velocity_call(family, model, geometry, 1, 7)()
    finally:
        hook.remove()
    assert dtypes == [torch.bfloat16]  # diffusers' RMSNorm alone returns float32 here (float32 weights)


def test_lora_targets_match_and_the_export_loads_in_the_stock_pipeline(tiny_sd3, parts, family, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    model = add_lora(family.load_transformer(tiny_sd3), rank=4, alpha=8, target_modules=list(family.lora_target_modules),
                     init_seed=0)
    adapted = {n.rsplit(".", 1)[0] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert len(adapted) == 2 * 8 - 1  # 8 projections per block, no to_add_out in the last (context_pre_only) block
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    out = save_lora_for_diffusers(model, tmp_path / "lora", family=family)
    pipeline = StableDiffusion3Pipeline.from_pretrained(tiny_sd3, local_files_only=True)
    pipeline.set_progress_bar_config(disable=True)
    geometry = parts["geometry"]
    call = dict(prompt=PROMPTS[0], negative_prompt="", num_inference_steps=2, guidance_scale=4.5, output_type="pt",
                height=64, width=64, max_sequence_length=T5_TOKENS)
    latents = torch.randn(1, *geometry.latent_shape, generator=torch.Generator().manual_seed(3))
    before = pipeline(latents=latents, **call).images
    pipeline.load_lora_weights(out)
    after = pipeline(latents=latents, **call).images
    assert (after - before).abs().max() > 0.02
    x = pack_latents(latents)
    with torch.no_grad():
        cond, _ = family.encode_prompts(parts["enc"], PROMPTS[:1], T5_TOKENS)
        shared = family.conditioning(geometry, cond, None, torch.device("cpu"))
        ours = family.predict_velocity(model, x, torch.tensor(0.7), cond, shared)
        stock = family.predict_velocity(pipeline.transformer, x, torch.tensor(0.7), cond, shared)
        base = family.predict_velocity(parts["transformer"], x, torch.tensor(0.7), cond, shared)
    assert (ours - base).abs().max() > 0.05
    assert torch.allclose(stock, ours, atol=1e-5)  # the export restores the trained adapter, alpha included
