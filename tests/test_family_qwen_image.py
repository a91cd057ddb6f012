"""The Qwen-Image adapter against the stock diffusers ``QwenImagePipeline`` on a tiny seeded folder: the folder loads
in the pipeline, prompt embeddings, sigmas, a full true-CFG sampling run and LoRA exports match the pipeline's, the
FLOP formula matches torch's counter, and the real config gives Qwen-Image's published parameter counts."""
from __future__ import annotations

import filecmp
import math

import numpy as np
import pytest
import torch

from fastvideo import models
from fastvideo.flops import counted_flops
from fastvideo.models import qwen_image
from fastvideo.models.qwen_image import QwenImage

PROMPTS = ["a red cat", "a photo of a big dog sitting on a wooden table in the garden"]
NEGATIVE = " "  # the Qwen-Image model card's negative prompt (SamplerDefaults.negative_prompt)
STORE_WIDTH = 48  # the store's max_sequence_length: every row padded to it


@pytest.fixture(scope="module")
def folder(tiny_preset):
    return tiny_preset("qwen-image-tiny")


@pytest.fixture(scope="module")
def family():
    return QwenImage()


@pytest.fixture(scope="module")
def pipe(folder):
    from diffusers import QwenImagePipeline

    return QwenImagePipeline.from_pretrained(folder, local_files_only=True)


@pytest.fixture(scope="module")
def encoders(family, folder):
    return family.load_text_encoders(folder)


def _stored(family, encoders, prompts):
    """What preprocessing stores and a batch carries: rows padded to STORE_WIDTH, then ``collate``d."""
    cond, truncated = family.encode_prompts(encoders, prompts, STORE_WIDTH)
    assert cond["prompt_embeds"].shape[1] == STORE_WIDTH and not any(truncated)
    return family.collate(cond)


def test_tiny_folder_loads_in_the_stock_pipeline_resolves_and_is_reproducible(folder, pipe, family, tmp_path):
    from diffusers import QwenImagePipeline

    assert isinstance(pipe, QwenImagePipeline) and pipe.vae_scale_factor == 4
    assert isinstance(models.resolve("auto", folder), QwenImage)
    assert sum(p.numel() for p in pipe.transformer.parameters()) < 1_000_000
    assert len(pipe.text_encoder.model.language_model.layers) == 2
    # the template's system turn is exactly the 34 tokens the pipeline drops
    ids = pipe.tokenizer(qwen_image.PROMPT_TEMPLATE.format("a red cat")).input_ids
    assert pipe.tokenizer.decode(ids[qwen_image.TEMPLATE_DROP:]).startswith("a red cat<|im_end|>")
    again = qwen_image.build_tiny(tmp_path / "again", seed=0)
    other = qwen_image.build_tiny(tmp_path / "other", seed=1)
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert len(files) >= 12
    match, mismatch, errors = filecmp.cmpfiles(folder, again, files, shallow=False)
    assert not mismatch and not errors
    assert not filecmp.cmp(folder / "transformer/diffusion_pytorch_model.safetensors",
                           other / "transformer/diffusion_pytorch_model.safetensors", shallow=False)


def test_encode_prompts_equal_the_pipelines_encode_prompt(family, encoders, pipe):
    prompts = [*PROMPTS, "", NEGATIVE]
    cond, truncated = family.encode_prompts(encoders, prompts, STORE_WIDTH)
    embeds, mask = cond["prompt_embeds"], cond["prompt_embeds_mask"]
    assert embeds.shape == (4, STORE_WIDTH, qwen_image.TINY_TEXT_WIDTH) and truncated == [False] * 4
    with torch.no_grad():
        ref, ref_mask = pipe.encode_prompt(prompts, max_sequence_length=STORE_WIDTH)
    lengths = ref_mask.sum(1)
    assert mask.sum(1).tolist() == lengths.tolist() and lengths.tolist()[2] == 5  # "": <|im_end|>\n<|im_start|>...
    for row, n in enumerate(lengths.tolist()):
        assert torch.equal(embeds[row, :n], ref[row, :n])  # same batch, same kernels: bit for bit
        assert not embeds[row, n:].any() and not mask[row, n:].any()
    # one prompt alone (the pipeline then drops its all-ones mask), and the cut at max_sequence_length
    with torch.no_grad():
        alone, alone_mask = pipe.encode_prompt(PROMPTS[1], max_sequence_length=6)
    short, cut = family.encode_prompts(encoders, [PROMPTS[1]], 6)
    assert alone_mask is None and cut == [True]
    diff = (short["prompt_embeds"] - alone).abs().max().item()
    print(f"embedding max |diff| (one prompt, cut at 6): {diff:.2e}")
    assert diff <= 1e-6
    trimmed = family.collate(cond)  # the longest row keeps every column it uses, nothing more
    assert trimmed["prompt_embeds"].shape[1] == int(lengths.max()) < STORE_WIDTH


def test_sigmas_equal_the_pipelines_scheduler(family, pipe):
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

    c = pipe.scheduler.config
    assert c.shift_terminal == 0.02 and c.time_shift_type == "exponential" and c.max_image_seq_len == 8192
    for steps, seq_len in ((2, 64), (4, 64), (50, 4096), (28, 6889)):
        mu = calculate_shift(seq_len, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
        retrieve_timesteps(pipe.scheduler, steps, "cpu", sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        ours = family.sigmas(steps, seq_len)
        assert ours.dtype == torch.float32 and ours.shape == (steps + 1,)
        assert torch.equal(ours, pipe.scheduler.sigmas), (steps, seq_len)  # sigma diff 0
    assert family.sigmas(4, 64)[-2].item() == pytest.approx(0.02)
    with pytest.warns(RuntimeWarning):  # one step: the stock stretch divides 0 by 0
        retrieve_timesteps(pipe.scheduler, 1, "cpu", sigmas=np.linspace(1.0, 1.0, 1), mu=0.5)
    assert pipe.scheduler.sigmas[0].isnan()
    with pytest.raises(ValueError, match=">= 2 steps"):
        family.sigmas(1, 64)


def test_padded_masked_rows_give_the_pipelines_velocity(family, encoders, pipe, folder):
    """A row padded to the store width and masked gives the velocity the pipeline computes from the unpadded
    embedding; rows of any batch size share one ``conditioning``."""
    geometry = family.latent_geometry(folder, 64, 64)
    cond = _stored(family, encoders, PROMPTS)
    shared = family.conditioning(geometry, cond, None, torch.device("cpu"))
    x = torch.randn(2, *geometry.packed_shape, generator=torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.7, 0.3])
    with torch.no_grad():
        v = family.predict_velocity(pipe.transformer, x, sigma, cond, shared)
        assert v.dtype == torch.float32 and v.shape == x.shape and 0.3 < v.std().item() < 3
        for row, prompt in enumerate(PROMPTS):
            embeds, mask = pipe.encode_prompt(prompt)  # unpadded; mask None (all ones)
            ref = pipe.transformer(hidden_states=x[row:row + 1], timestep=sigma[row:row + 1],
                                   encoder_hidden_states=embeds, encoder_hidden_states_mask=mask,
                                   img_shapes=[[shared["img_shape"]]], return_dict=False)[0]
            diff = (v[row] - ref[0]).abs().max().item()
            print(f"velocity max |diff| padded+masked vs pipeline, row {row}: {diff:.2e}")
            assert diff < 1e-5
        other = family.predict_velocity(pipe.transformer, x[:1], sigma[:1], {k: t[1:] for k, t in cond.items()},
                                        shared)
    # the prompt moves the velocity visibly
    assert (other[0] - v[0]).abs().mean() > 0.1 * v[0].abs().mean()


def test_sampling_equals_the_stock_pipeline_with_true_cfg(family, encoders, pipe, folder):
    steps, scale = 4, family.defaults.cfg_scale
    assert scale == 4.0 and family.defaults.negative_prompt == NEGATIVE and family.defaults.steps == 50
    geometry = family.latent_geometry(folder, 64, 64)
    noise = torch.randn(len(PROMPTS), *geometry.packed_shape, generator=torch.Generator().manual_seed(0))
    # the generic CFG path: conditional and negative rows collated together (one text length), one forward of 2B rows
    cond, _ = family.encode_prompts(encoders, PROMPTS + [NEGATIVE] * len(PROMPTS), STORE_WIDTH)
    cond = family.collate(cond)
    shared = family.conditioning(geometry, cond, None, torch.device("cpu"))
    sigmas = family.sigmas(steps, geometry.seq_len)
    x = noise.clone()
    with torch.no_grad():
        for i in range(steps):
            v = family.predict_velocity(pipe.transformer, torch.cat([x, x]), sigmas[i], cond, shared)
            v_cond, v_uncond = v.chunk(2)
            x = x + (sigmas[i + 1] - sigmas[i]) * family.combine_guidance(v_cond, v_uncond, scale)
        ours = family.decode(pipe.vae, x, geometry)
        ref = pipe(prompt=PROMPTS, negative_prompt=[NEGATIVE] * len(PROMPTS), true_cfg_scale=scale, height=64,
                   width=64, num_inference_steps=steps, latents=noise.clone(), output_type="pt").images
    assert ours.shape == ref.shape == (2, 3, 64, 64)
    diff = (ours - ref).abs().max().item()
    print(f"sampling max |diff| x 255 = {diff * 255:.2e}")
    assert diff * 255 < 1
    assert (ours[0] - ours[1]).abs().max() > 0.01  # the prompts differ in the image


def test_combine_guidance_rescales_to_the_conditional_norm(family):
    g = torch.Generator().manual_seed(2)
    c, u = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    out = family.combine_guidance(c, u, 4.0)
    assert torch.allclose(out.norm(dim=-1), c.norm(dim=-1), atol=1e-5)
    plain = u + 4.0 * (c - u)
    assert torch.allclose(out / out.norm(dim=-1, keepdim=True), plain / plain.norm(dim=-1, keepdim=True), atol=1e-6)


def test_encode_decode_round_trip_shapes_and_bad_sizes(family, pipe, folder):
    geometry = family.latent_geometry(pipe.vae, 64, 96)
    assert (geometry.seq_len, geometry.packed_channels, geometry.latent_shape) == (96, 64, (16, 16, 24))
    images = torch.rand(2, 3, 64, 96, generator=torch.Generator().manual_seed(3))
    latents = family.encode(pipe.vae, images, geometry, micro_batch=1)
    assert latents.shape == (2, 96, 64) and latents.dtype == torch.float32
    with torch.no_grad():
        decoded = family.decode(pipe.vae, latents, geometry)
    assert decoded.shape == images.shape and 0 <= decoded.min() and decoded.max() <= 1
    with pytest.raises(ValueError, match=r"multiple of 8 .*--h 56 or 64"):
        family.latent_geometry(folder, 60, 64)
    with pytest.raises(ValueError, match="encode takes images"):
        family.encode(pipe.vae, images[:, :, :32], geometry)


def test_transformer_flops_equal_the_counter(family, folder):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fastvideo.lora import add_lora

    model = family.load_transformer(folder)
    config = model.config
    geometry = family.latent_geometry(folder, 64, 64)
    batch, text = 2, 11
    x = torch.randn(batch, *geometry.packed_shape)
    cond = {"prompt_embeds": torch.randn(batch, text, config.joint_attention_dim),
            "prompt_embeds_mask": torch.ones(batch, text, dtype=torch.long)}
    cond["prompt_embeds_mask"][1, 7:] = 0
    shared = family.conditioning(geometry, cond, None, torch.device("cpu"))
    forward = lambda: family.predict_velocity(model, x, torch.tensor(0.5), cond, shared)  # noqa: E731
    assert family.forward_tokens((), {"hidden_states": x, "encoder_hidden_states": cond["prompt_embeds"]}) == (
        batch, geometry.seq_len, text)
    expected = family.transformer_flops(config, geometry.seq_len, text, batch)
    with torch.no_grad():
        assert counted_flops(forward) == expected
    with sdpa_kernel([SDPBackend.MATH]):
        with torch.no_grad():
            assert counted_flops(forward) == expected
        full = counted_flops(lambda: forward().sum().backward())
        model.zero_grad(set_to_none=True)
        add_lora(model, rank=2, alpha=2, target_modules=list(family.lora_target_modules), init_seed=0)
        lora = counted_flops(lambda: forward().sum().backward())
    # Model FLOPs are 3 forwards. Autograd skips what no gradient needs: the input gradients of img_in (latents)
    # and of the timestep MLP's first layer (sinusoids), and the whole backward of the last block's text stream
    # after attention (to_add_out and txt_mlp: the output reads image tokens only). Exactly that much is missing.
    full_formula = family.transformer_flops(config, geometry.seq_len, text, batch, backward=True)
    D, L = config.num_attention_heads * config.attention_head_dim, geometry.seq_len
    skipped = batch * (2 * L * config.in_channels * D + 2 * 256 * D + 2 * (2 * text * D * D + 16 * text * D * D))
    lora_formula = family.transformer_flops(config, geometry.seq_len, text, batch, backward=True, weight_grads=False)
    print(f"FLOPs forward {expected} (counted: equal); train {full} counted vs {full_formula} formula "
          f"({full / full_formula - 1:+.2%}); LoRA {lora} counted vs {lora_formula} formula "
          f"({lora / lora_formula - 1:+.2%})")
    assert full == full_formula - skipped
    assert lora == pytest.approx(lora_formula, rel=0.03)
    assert family.transformer_flops(config, 64, text, 2 * batch) == 2 * expected


def test_meta_build_runs_example_inputs_and_real_config_has_published_sizes(family, folder, tmp_path):
    from diffusers import AutoencoderKLQwenImage
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    meta = family.build_transformer(folder)
    assert next(meta.parameters()).device.type == "meta" and models.family_of(meta) is family
    assert meta.pos_embed.pos_freqs.device.type == "cpu"  # rotary tables are rebuilt: no weight load fills them
    inputs = family.example_inputs(meta.config, 2, 64, 9, torch.float32, "meta")
    out = meta(**inputs)[0]
    assert out.shape == (2, 64, 64) and out.device.type == "meta"
    assert family.prepare_for_device(meta, "cpu") == []
    npu = family.prepare_for_device(meta, "npu", param_dtype=torch.float32)  # float32 weights: SDPA kept
    assert npu[0].startswith("pos_embed: QwenEmbedRope unchanged") and "default SDPA" in npu[1]
    config = qwen_image.write_config(tmp_path / "config")
    real = family.build_transformer(config, dtype=torch.bfloat16)
    count = sum(p.numel() for p in real.parameters())
    print(f"Qwen-Image transformer parameters (config preset): {count:,}")
    assert count == qwen_image.PUBLISHED_TRANSFORMER_PARAMETERS == 20_430_401_088
    assert family.example_inputs(real.config, 1, 4096, 512, torch.bfloat16, "meta")["img_shapes"] == [[(1, 64, 64)]]
    with torch.device("meta"):
        encoder = Qwen2_5_VLForConditionalGeneration(AutoConfig.from_pretrained(config / "text_encoder"))
        vae = AutoencoderKLQwenImage.from_config(AutoencoderKLQwenImage.load_config(config / "vae"))
    assert sum(p.numel() for p in encoder.parameters()) == 8_292_166_656  # Qwen/Qwen-Image text_encoder
    assert sum(p.numel() for p in vae.parameters()) == 126_892_531  # Qwen/Qwen-Image vae
    assert family.latent_geometry(config, 1024, 1024).seq_len == 4096 and not list(config.rglob("*.safetensors"))


def test_lora_targets_all_match_and_export_loads_in_the_pipeline(family, folder, encoders, tmp_path):
    from diffusers import QwenImagePipeline

    from fastvideo.lora import add_lora, save_lora_for_diffusers

    model = add_lora(family.load_transformer(folder), rank=4, alpha=8, init_seed=0)  # the family's default targets
    layers = qwen_image.TINY_TRANSFORMER_CONFIG["num_layers"]
    for target in family.lora_target_modules:
        adapted = [n for n, m in model.named_modules() if n.endswith("." + target) and hasattr(m, "lora_A")]
        assert len(adapted) == layers, target
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    out = save_lora_for_diffusers(model, tmp_path / "lora", family=family)
    pipe = QwenImagePipeline.from_pretrained(folder, local_files_only=True)
    geometry = family.latent_geometry(folder, 64, 64)
    noise = torch.randn(1, *geometry.packed_shape, generator=torch.Generator().manual_seed(5))
    call = dict(prompt=PROMPTS[0], true_cfg_scale=1.0, height=64, width=64, num_inference_steps=2, output_type="pt")
    with torch.no_grad():
        base = pipe(latents=noise.clone(), **call).images
        pipe.load_lora_weights(out)
        adapted = pipe(latents=noise.clone(), **call).images
        cond = _stored(family, encoders, PROMPTS[:1])
        shared = family.conditioning(geometry, cond, None, torch.device("cpu"))
        ours = family.predict_velocity(model, noise, torch.tensor(0.6), cond, shared)
        theirs = family.predict_velocity(pipe.transformer, noise, torch.tensor(0.6), cond, shared)
    assert (adapted - base).abs().max() > 0.01  # the export changes the stock pipeline's output
    assert (ours - theirs).abs().max() < 1e-5  # into the same function the trained model computes
    assert math.isfinite(adapted.sum().item())
