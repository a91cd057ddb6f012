"""The FLUX.2 adapter (fastvideo/models/flux2.py) against the stock diffusers pipelines on the tiny klein folder:
prompt embeddings, sigmas, a full CFG sampling run, VAE round trip, FLOP formula, meta build, LoRA export."""
from __future__ import annotations

import filecmp
import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fastvideo import models
from fastvideo.models import flux2, flux2_presets
from fastvideo.schedulers import ode_step

SIZE, MSL = 64, 32  # tiny preset: 64 px -> 64 packed tokens of 16 channels; 32 text tokens
DEV_MSL = 96  # dev: its system message alone is ~70 tiny-BPE tokens, so the prompt needs room


@pytest.fixture(scope="module")
def tiny(tiny_preset) -> Path:
    """The tiny klein folder (seed 0), built once per session."""
    return tiny_preset("flux2-tiny")


@pytest.fixture(scope="module")
def pipe(tiny):
    """The stock Flux2KleinPipeline on it."""
    from diffusers import Flux2KleinPipeline

    return Flux2KleinPipeline.from_pretrained(tiny, local_files_only=True)


@pytest.fixture(scope="module")
def dev_tiny(tiny_preset) -> Path:
    """The tiny FLUX.2-dev folder (seed 0), built once per session."""
    return tiny_preset("flux2-dev-tiny")


@pytest.fixture(scope="module")
def dev_pipe(dev_tiny):
    """The stock Flux2Pipeline (Mistral3 text encoder, Pixtral processor) on it."""
    from diffusers import Flux2Pipeline

    return Flux2Pipeline.from_pretrained(dev_tiny, local_files_only=True)


@pytest.fixture(scope="module")
def family(tiny) -> flux2.Flux2:
    """The adapter ``--model_family auto`` picks for it."""
    return models.resolve("auto", tiny)


def _euler(family, transformer, vae, x, cond, uncond, steps, cfg, guidance=None):
    """A plain Euler loop through the adapter only (CFG on 2B rows: cond then uncond, as the generic code calls)."""
    geometry = family.latent_geometry(vae, SIZE, SIZE)
    rows = cond if uncond is None else torch.cat([cond, uncond])
    shared = family.conditioning(geometry, {"prompt_embeds": rows}, guidance, torch.device("cpu"))
    sig = family.sigmas(steps, geometry.seq_len)
    with torch.no_grad():
        for i in range(steps):
            if uncond is None:
                v = family.predict_velocity(transformer, x, sig[i], {"prompt_embeds": cond}, shared)
            else:
                v_c, v_u = family.predict_velocity(transformer, torch.cat([x, x]), sig[i], {"prompt_embeds": rows},
                                                   shared).chunk(2)
                v = family.combine_guidance(v_c, v_u, cfg)
            x = ode_step(v, x, sig[i], sig[i + 1])
        return family.decode(vae, x, geometry)


def _json_config(folder: Path) -> dict:
    """A component folder's config.json."""
    return json.loads((folder / "config.json").read_text())


def _pipeline_latents(packed: torch.Tensor, side: int) -> torch.Tensor:
    """Packed (B, L, C) tokens as the pipeline's ``latents=`` argument (B, C, h/2, w/2)."""
    return packed.transpose(1, 2).reshape(packed.shape[0], packed.shape[2], side, side)


def test_folder_loads_resolves_and_is_seeded(tiny, pipe, family, tmp_path):
    """The stock pipeline loads the folder, auto resolves to flux2, and the build is byte-identical per seed."""
    assert type(pipe).__name__ == "Flux2KleinPipeline" and not pipe.config.is_distilled
    assert isinstance(family, flux2.Flux2) and family.name == "flux2"
    assert sum(p.numel() for p in pipe.transformer.parameters()) < 1_000_000
    from fastvideo.tiny import build_preset

    again, other = build_preset(tmp_path / "again", "flux2-tiny", 0), flux2_presets.build_tiny(tmp_path / "other", seed=1)
    files = sorted(p.relative_to(tiny) for p in tiny.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    assert all(filecmp.cmp(tiny / f, again / f, shallow=False) for f in files)
    weights = Path("transformer/diffusion_pytorch_model.safetensors")
    assert not filecmp.cmp(tiny / weights, other / weights, shallow=False)
    assert family.sampler_defaults(tiny).cfg_scale == 4.0 and family.defaults.guidance is None
    with pytest.raises(FileNotFoundError, match="transformer/.*--preset flux2-tiny"):
        family.check_folder(tmp_path)


def test_encode_prompts_equals_pipeline(tiny, pipe, family):
    """Embeddings (incl. the empty negative prompt and a cut prompt) and rotary ids equal the pipeline's."""
    prompts = ["a photo of a cat", "", "a very long prompt " * 20]
    encoders = family.load_text_encoders(tiny)
    cond, truncated = family.encode_prompts(encoders, prompts, MSL)
    ref, ref_ids = pipe.encode_prompt(prompts, device="cpu", max_sequence_length=MSL)
    assert set(cond) == set(family.embedding_keys) and cond["prompt_embeds"].shape == (3, MSL, 48)
    diff = (cond["prompt_embeds"] - ref).abs().max().item()
    print(f"embedding max |diff| = {diff:.3g}")
    assert diff == 0.0
    assert truncated == [False, False, True]
    assert (cond["prompt_embeds"][0] - cond["prompt_embeds"][1]).abs().max() > 0.1  # the prompt matters
    geometry = family.latent_geometry(tiny, SIZE, SIZE)
    shared = family.conditioning(geometry, cond, None, torch.device("cpu"))
    assert torch.equal(shared["txt_ids"], ref_ids[0].float())
    pipe_img_ids = pipe._prepare_latent_ids(torch.zeros(1, 16, SIZE // 8, SIZE // 8))[0]
    assert torch.equal(shared["img_ids"], pipe_img_ids.float())
    with pytest.raises(ValueError, match=r"\[1, 512\]"):
        family.encode_prompts(encoders, prompts, 513)


@pytest.mark.parametrize("steps, seq_len", [(4, 64), (28, 1024), (50, 4096), (8, 4500)])
def test_sigmas_equal_pipeline_scheduler(pipe, family, steps, seq_len):
    """``sigmas`` equals the scheduler after the pipelines' ``retrieve_timesteps(sigmas=..., mu=...)``."""
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu, retrieve_timesteps

    scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
    retrieve_timesteps(scheduler, steps, "cpu", sigmas=np.linspace(1.0, 1 / steps, steps),
                       mu=compute_empirical_mu(image_seq_len=seq_len, num_steps=steps))
    ours = family.sigmas(steps, seq_len)
    assert ours.dtype == torch.float32 and ours.shape == (steps + 1,)
    assert torch.equal(ours, scheduler.sigmas)


def test_cfg_sampling_equals_pipeline(tiny, pipe, family):
    """An adapter-only Euler loop with true CFG gives the stock klein pipeline's images (8-bit)."""
    prompts, steps, cfg = ["a red cube on a table", "a blue sphere in the sky"], 4, 4.0
    transformer, vae = family.load_transformer(tiny), family.load_vae(tiny)
    encoders = family.load_text_encoders(tiny)
    cond = family.encode_prompts(encoders, prompts, MSL)[0]["prompt_embeds"]
    uncond = family.encode_prompts(encoders, [family.defaults.negative_prompt] * 2, MSL)[0]["prompt_embeds"]
    geometry = family.latent_geometry(vae, SIZE, SIZE)
    noise = torch.randn((2, *geometry.packed_shape), generator=torch.Generator().manual_seed(0))
    ours = _euler(family, transformer, vae, noise, cond, uncond, steps, cfg)
    ref = pipe(prompt=prompts, latents=_pipeline_latents(noise, SIZE // 8), num_inference_steps=steps,
               guidance_scale=cfg, height=SIZE, width=SIZE, max_sequence_length=MSL, output_type="pt").images
    diff = (ours - ref).abs().max().item()
    print(f"CFG sampling max |diff| x 255 = {diff * 255:.3g}")
    assert ours.shape == (2, 3, SIZE, SIZE) and diff * 255 < 1
    no_cfg = _euler(family, transformer, vae, noise, cond, None, steps, 1.0)
    assert (no_cfg - ours).abs().mean() > 0.01  # guidance is on and moves the images
    assert (ours[0] - ours[1]).abs().mean() > 0.01  # the prompt visibly changes the image


def test_dev_guidance_sampling_equals_flux2_pipeline(tiny, pipe, family):
    """FLUX.2-dev's transformer path (guidance embedding, no CFG) against the stock Flux2Pipeline fed prompt_embeds:
    klein's tiny transformer with ``guidance_embeds`` (the dev folder's own tests are further down)."""
    from diffusers import Flux2Pipeline

    torch.manual_seed(0)
    config = dict(pipe.transformer.config, guidance_embeds=True)
    transformer = family.transformer_class().from_config({k: v for k, v in config.items() if not k.startswith("_")})
    transformer = models.tag(transformer.eval(), family)
    dev = Flux2Pipeline(scheduler=pipe.scheduler, vae=pipe.vae, text_encoder=None, tokenizer=None,
                        transformer=transformer)
    embeds = torch.randn(1, MSL, 48, generator=torch.Generator().manual_seed(1))
    noise = torch.randn((1, SIZE * SIZE // 64, 16), generator=torch.Generator().manual_seed(2))
    ours = _euler(family, transformer, pipe.vae, noise, embeds, None, 3, 1.0, guidance=2.5)
    ref = dev(prompt_embeds=embeds, latents=_pipeline_latents(noise, SIZE // 8), num_inference_steps=3,
              guidance_scale=2.5, height=SIZE, width=SIZE, output_type="pt").images
    print(f"dev sampling max |diff| x 255 = {(ours - ref).abs().max().item() * 255:.3g}")
    assert (ours - ref).abs().max() * 255 < 1
    with pytest.raises(ValueError, match="guidance"):
        _euler(family, transformer, pipe.vae, noise, embeds, None, 1, 1.0, guidance=None)


def test_encode_decode_round_trip_and_geometry(tiny, pipe, family):
    """``encode`` equals the pipeline's normalised packed latents; decode shapes; geometry errors name sizes."""
    vae = family.load_vae(tiny)
    geometry = family.latent_geometry(vae, SIZE, SIZE)
    assert geometry.packed_shape == (64, 16) and geometry.latent_shape == (4, 16, 16)
    images = torch.rand(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(3))
    latents = family.encode(vae, images, geometry)
    with torch.no_grad():
        ref = pipe._pack_latents(pipe._encode_vae_image(images * 2 - 1, generator=None))
    assert latents.shape == (2, 64, 16) and (latents - ref).abs().max() < 1e-6
    with torch.no_grad():
        decoded = family.decode(vae, latents, geometry, micro_batch=1)
    assert decoded.shape == (2, 3, SIZE, SIZE) and 0 <= decoded.min() and decoded.max() <= 1
    with pytest.raises(ValueError, match="multiple of 8.*--h 56 or 64"):
        family.latent_geometry(vae, 60, SIZE)
    with pytest.raises(ValueError, match="shape"):
        family.encode(vae, images[:, :, :32], geometry)


def test_flops_formula_equals_counter(tiny, family):
    """The closed FLOP formula against torch's counter: forward exact, full and LoRA training within 1%."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fastvideo.flops import counted_flops
    from fastvideo.lora import add_lora

    model = family.load_transformer(tiny)
    L, T, B = 64, MSL, 2
    kwargs = family.example_inputs(model.config, B, L, T, torch.float32, "cpu")
    for key in ("hidden_states", "encoder_hidden_states", "timestep"):
        kwargs[key] = torch.rand_like(kwargs[key])
    assert family.forward_tokens((), kwargs) == (B, L, T)
    with torch.no_grad():
        counted = counted_flops(lambda: model(**kwargs))
    assert counted == family.transformer_flops(model.config, L, T, B)
    # the backward's attention as plain matmuls (the CPU flash backward counts a recomputed QKᵀ on top)
    math = functools.partial(sdpa_kernel, [SDPBackend.MATH])
    with math():
        trained = counted_flops(lambda: model(**kwargs)[0].sum().backward())
    full = family.transformer_flops(model.config, L, T, B, backward=True)
    print(f"forward {counted} (formula exact); forward+backward counted {trained} formula {full}")
    assert trained == pytest.approx(full, rel=0.01)
    add_lora(model, rank=2, alpha=2, target_modules=list(family.lora_target_modules))
    with math():
        lora = counted_flops(lambda: model(**kwargs)[0].sum().backward())
    formula = family.transformer_flops(model.config, L, T, B, backward=True, weight_grads=False)
    print(f"LoRA forward+backward counted {lora} formula {formula}")
    assert lora == pytest.approx(formula, rel=0.01)


def test_meta_build_example_inputs_and_real_parameter_count(tiny, family, tmp_path):
    """``example_inputs`` run the meta-built model; klein-4B's real config builds its ~3.9B transformer."""
    model = family.build_transformer(tiny)
    assert models.family_of(model) is family and next(model.parameters()).is_meta
    out = model(**family.example_inputs(model.config, 2, 64, MSL, torch.float32, "meta"))[0]
    assert out.shape == (2, 64, 16) and out.is_meta
    folder = flux2_presets.write_config(tmp_path / "klein4b")
    assert not list(folder.rglob("*.safetensors"))
    assert family.sampler_defaults(folder).cfg_scale == 1.0  # klein-4B is step-distilled: no true CFG
    real = family.build_transformer(folder, dtype=torch.bfloat16)
    count = sum(p.numel() for p in real.parameters())
    D, M, J = 3072, 9216, 7680  # width, MLP width, 3 x Qwen3-4B's 2560 text features
    double, single = 8 * D * D + 6 * M * D, 4 * D * D + 3 * M * D  # attention + SwiGLU MLPs (in 2M, out M)
    expected = 5 * double + 20 * single + 15 * D * D + 2 * 128 * D + J * D + 256 * D + D * D + 2 * D * D
    expected += 5 * 4 * 128 + 20 * 2 * 128  # q/k RMSNorm weights (double: q, k, added q, added k; single: q, k)
    print(f"FLUX.2-klein-4B transformer parameters: {count:,}")
    assert count == expected and 3.8e9 < count < 4.0e9  # published: a "4B" transformer
    assert real.config.joint_attention_dim == 3 * _json_config(folder / "text_encoder")["hidden_size"]


def test_float32_rope_matches_float64(tiny, family):
    """The NPU's float32 rotary embedding equals diffusers' float64 one to 1e-6."""
    model = family.load_transformer(tiny)
    geometry = family.latent_geometry(tiny, SIZE, SIZE)
    ids = torch.cat([flux2.text_ids(512), flux2.image_ids(geometry)])
    ref = model.pos_embed(ids)
    assert flux2.use_float32_rope(model) and not flux2.use_float32_rope(model)
    ours = model.pos_embed(ids)
    assert max((a - b).abs().max().item() for a, b in zip(ours, ref)) < 1e-6
    assert family.prepare_for_device(model, "cpu") == []


def test_lora_targets_and_export_load_in_stock_pipeline(tiny, family, tmp_path):
    """Every default target matches; the export loads in the stock pipeline, changes it and equals our model."""
    from diffusers import Flux2KleinPipeline

    from fastvideo.lora import add_lora, save_lora_for_diffusers

    model = family.load_transformer(tiny)
    add_lora(model, rank=4, alpha=8, target_modules=list(family.lora_target_modules), init_seed=0)
    wrapped = [n for n, m in model.named_modules() if hasattr(m, "lora_A")]
    assert len(wrapped) == 1 * 4 + 2 * 1  # to_q/k/v/out.0 of the double block, to_qkv_mlp_proj of each single
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():  # lora_B starts at zero: give the adapter an effect to export
        for p in (p for name, p in model.named_parameters() if "lora_B" in name):
            p.copy_(0.3 * torch.randn(p.shape, generator=generator))
    out = save_lora_for_diffusers(model, tmp_path / "lora", family=family)
    stock = Flux2KleinPipeline.from_pretrained(tiny, local_files_only=True)
    noise = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(5))
    call = dict(prompt="a red cube", num_inference_steps=2, guidance_scale=1.0, height=SIZE, width=SIZE,
                max_sequence_length=MSL, output_type="pt", latents=noise)
    before = stock(**call).images
    stock.load_lora_weights(out)
    after = stock(**call).images
    assert (after - before).abs().max() * 255 > 1
    geometry = family.latent_geometry(tiny, SIZE, SIZE)
    x = torch.randn((1, *geometry.packed_shape), generator=torch.Generator().manual_seed(6))
    embeds = torch.randn(1, MSL, 48, generator=torch.Generator().manual_seed(7))
    shared = family.conditioning(geometry, {"prompt_embeds": embeds}, None, torch.device("cpu"))
    with torch.no_grad():
        ours = family.predict_velocity(model, x, torch.tensor(0.7), {"prompt_embeds": embeds}, shared)
        theirs = family.predict_velocity(stock.transformer, x, torch.tensor(0.7), {"prompt_embeds": embeds}, shared)
    assert (ours - theirs).abs().max() < 1e-5


def test_dev_folder_loads_resolves_and_is_seeded(dev_tiny, dev_pipe, tiny, tmp_path):
    """The stock Flux2Pipeline loads the dev folder offline (Mistral3 + PixtralProcessor, guidance-embedded
    transformer, klein's VAE), auto resolves to flux2 with dev's defaults, and the build is byte-identical per seed."""
    from fastvideo.tiny import build_preset

    assert type(dev_pipe).__name__ == "Flux2Pipeline" and dev_pipe.transformer.config.guidance_embeds
    assert (type(dev_pipe.text_encoder).__name__, type(dev_pipe.tokenizer).__name__) == \
        ("Mistral3ForConditionalGeneration", "PixtralProcessor")
    assert dev_pipe.text_encoder.config.text_config.num_hidden_layers >= max(flux2.DEV_TEXT_LAYERS)
    family = models.resolve("auto", dev_tiny)
    assert isinstance(family, flux2.Flux2) and flux2.pipeline_kind(dev_tiny) == flux2.DEV_PIPELINE
    defaults = family.sampler_defaults(dev_tiny)
    assert (defaults.guidance, defaults.cfg_scale) == (4.0, 1.0)
    vae = Path("vae/diffusion_pytorch_model.safetensors")
    assert filecmp.cmp(dev_tiny / vae, tiny / vae, shallow=False)  # the same tiny VAE as flux2-tiny
    again, other = build_preset(tmp_path / "again", "flux2-dev-tiny", 0), flux2_presets.build_tiny_dev(tmp_path / "o", 1)
    files = sorted(p.relative_to(dev_tiny) for p in dev_tiny.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    assert all(filecmp.cmp(dev_tiny / f, again / f, shallow=False) for f in files)
    weights = Path("text_encoder/model.safetensors")
    assert not filecmp.cmp(dev_tiny / weights, other / weights, shallow=False)


def test_dev_encode_prompts_equals_pipeline(dev_tiny, dev_pipe):
    """dev's Mistral3 embeddings (system message, three stacked layers; empty and cut prompts) and text ids equal
    Flux2Pipeline.encode_prompt's; a max_sequence_length under the system message cuts every prompt."""
    family = models.resolve("auto", dev_tiny)
    encoders = family.load_text_encoders(dev_tiny)
    assert encoders.kind == flux2.DEV_PIPELINE and encoders.layers == (10, 20, 30)
    prompts = ["a photo of a cat", "", "a very long prompt " * 20]
    cond, truncated = family.encode_prompts(encoders, prompts, DEV_MSL)
    ref, ref_ids = dev_pipe.encode_prompt(prompts, device="cpu", max_sequence_length=DEV_MSL)
    assert cond["prompt_embeds"].shape == ref.shape == (3, DEV_MSL, 48)
    diff = (cond["prompt_embeds"] - ref).abs().max().item()
    print(f"dev embedding max |diff| = {diff:.3g}")
    assert diff <= 1e-6
    assert truncated == [False, False, True]
    assert (cond["prompt_embeds"][0] - cond["prompt_embeds"][1]).abs().max() > 0.1  # the prompt matters
    shared = family.conditioning(family.latent_geometry(dev_tiny, SIZE, SIZE), cond, 4.0, torch.device("cpu"))
    assert torch.equal(shared["txt_ids"], ref_ids[0].float()) and shared["guidance"].item() == 4.0
    short = family.encode_prompts(encoders, prompts[:2], 16)[1]
    assert short == [True, True]  # the system message alone is longer than 16 tokens


def test_dev_guidance_sampling_equals_pipeline(dev_tiny, dev_pipe):
    """An adapter-only Euler loop on the dev folder (Mistral3 prompts, embedded guidance 4.0, no CFG) gives the
    stock Flux2Pipeline's images (8-bit)."""
    family = models.resolve("auto", dev_tiny)
    prompts, steps = ["a red cube on a table", "a blue sphere in the sky"], 3
    transformer, vae = family.load_transformer(dev_tiny), family.load_vae(dev_tiny)
    cond = family.encode_prompts(family.load_text_encoders(dev_tiny), prompts, DEV_MSL)[0]["prompt_embeds"]
    geometry = family.latent_geometry(vae, SIZE, SIZE)
    noise = torch.randn((2, *geometry.packed_shape), generator=torch.Generator().manual_seed(0))
    ours = _euler(family, transformer, vae, noise, cond, None, steps, 1.0, guidance=4.0)
    ref = dev_pipe(prompt=prompts, latents=_pipeline_latents(noise, SIZE // 8), num_inference_steps=steps,
                   guidance_scale=4.0, height=SIZE, width=SIZE, max_sequence_length=DEV_MSL,
                   output_type="pt").images
    diff = (ours - ref).abs().max().item()
    print(f"dev sampling max |diff| x 255 = {diff * 255:.3g}")
    assert ours.shape == (2, 3, SIZE, SIZE) and diff * 255 < 1
    other_guidance = _euler(family, transformer, vae, noise, cond, None, steps, 1.0, guidance=1.0)
    print(f"guidance 4 vs 1 mean |diff| = {(other_guidance - ours).abs().mean().item():.3g}, prompt 0 vs 1 "
          f"{(ours[0] - ours[1]).abs().mean().item():.3g}")
    assert (other_guidance - ours).abs().mean() > 0.01  # the guidance value reaches the transformer
    assert (ours[0] - ours[1]).abs().mean() > 0.01  # the prompt visibly changes the image
