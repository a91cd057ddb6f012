"""fastvideo.flux against stock diffusers: prompt encoding, packing, ids, an Euler loop of predict_velocity
that reproduces FluxPipeline's images, and decoding."""
from __future__ import annotations

import shutil

import pytest
import torch

from fastvideo.models import common, flux
from helpers import REPO

PROMPTS = ["a photo of a cat", "An astronaut riding a horse on Mars, 4k, highly-detailed!!", "a red cube " * 40]


@pytest.fixture(scope="module")
def pipe(tiny_flux_dir):
    from diffusers import FluxPipeline

    return FluxPipeline.from_pretrained(tiny_flux_dir, local_files_only=True)


@pytest.fixture(scope="module")
def encoders(tiny_flux_dir):
    return flux.load_text_encoders(tiny_flux_dir)


def test_check_model_folder(tiny_flux_dir, tmp_path):
    assert flux.check_model_folder(tiny_flux_dir) == tiny_flux_dir
    with pytest.raises(FileNotFoundError, match="does not exist.*fastvideo.tiny"):
        flux.check_model_folder(tmp_path / "nope")
    partial = tmp_path / "partial"
    shutil.copytree(tiny_flux_dir / "transformer", partial / "transformer")
    (partial / "vae").mkdir()
    with pytest.raises(FileNotFoundError, match=r"missing vae/ \(config.json\), text_encoder/"):
        flux.check_model_folder(partial)
    assert flux.check_model_folder(partial, ("transformer",)) == partial
    with pytest.raises(FileNotFoundError, match="missing vae"):
        flux.load_vae(partial)
    with pytest.raises(FileNotFoundError, match="text_encoder"):
        flux.load_text_encoders(partial)


def test_load_parts(tiny_flux_dir):
    vae = flux.load_vae(tiny_flux_dir)
    assert not vae.training and not any(p.requires_grad for p in vae.parameters())
    transformer = flux.load_transformer(tiny_flux_dir, dtype=torch.bfloat16)
    assert transformer.dtype == torch.bfloat16
    # a bare transformer folder (e.g. an exported policy) loads too
    assert flux.load_transformer(tiny_flux_dir / "transformer").config.guidance_embeds


def test_text_encoders_load_alone_and_fingerprint(tiny_flux_dir, tmp_path, encoders):
    assert not encoders.clip.training and not encoders.t5.training
    assert not any(p.requires_grad for m in (encoders.clip, encoders.t5) for p in m.parameters())
    text_only = tmp_path / "text_only"
    for name in flux.TEXT_COMPONENTS:
        shutil.copytree(tiny_flux_dir / name, text_only / name)
    loaded = flux.load_text_encoders(text_only)
    assert isinstance(loaded, flux.TextEncoders)
    fingerprint = flux.encoders_fingerprint(tiny_flux_dir)
    assert len(fingerprint) == 64 and flux.encoders_fingerprint(text_only) == fingerprint
    config = text_only / "text_encoder_2" / "config.json"
    config.write_text(config.read_text().replace('"num_heads": 2', '"num_heads": 1'))
    assert flux.encoders_fingerprint(text_only) != fingerprint


def test_encode_prompts_equals_pipeline(pipe, encoders):
    embeds, pooled, truncated = flux.encode_prompts(encoders, PROMPTS, max_sequence_length=48)
    with torch.no_grad():
        ref_embeds, ref_pooled, ref_text_ids = pipe.encode_prompt(PROMPTS, prompt_2=None, max_sequence_length=48)
    assert embeds.shape == (3, 48, 32) and pooled.shape == (3, 32)
    assert torch.equal(embeds, ref_embeds) and torch.equal(pooled, ref_pooled)
    assert torch.equal(flux.text_ids(48), ref_text_ids)
    assert truncated == [False, False, True]
    assert not embeds.requires_grad
    with pytest.raises(ValueError, match="512"):
        flux.encode_prompts(encoders, PROMPTS, max_sequence_length=513)


def test_geometry(tiny_flux_dir, pipe):
    geometry = flux.latent_geometry(pipe.vae, 64, 96)
    assert geometry == flux.latent_geometry(tiny_flux_dir, 64, 96) == flux.latent_geometry(pipe.vae.config, 64, 96)
    assert flux.vae_scale_factor(pipe.vae) == pipe.vae_scale_factor == 4
    assert (geometry.latent_h, geometry.latent_w, geometry.seq_len, geometry.packed_channels) == (16, 24, 96, 16)
    with pytest.raises(ValueError, match="multiple of 8.*72 or 80"):
        flux.latent_geometry(pipe.vae, 76, 64)


def test_pack_unpack_and_ids_match_pipeline(pipe):
    geometry = flux.latent_geometry(pipe.vae, 64, 96)
    x = torch.randn(2, 4, 16, 24)
    packed = flux.pack_latents(x)
    assert torch.equal(packed, pipe._pack_latents(x, 2, 4, 16, 24))
    assert torch.equal(flux.unpack_latents(packed, geometry), x)
    assert torch.equal(pipe._unpack_latents(packed, 64, 96, pipe.vae_scale_factor), x)
    ids = flux.image_ids(geometry, dtype=torch.bfloat16)
    assert torch.equal(ids, pipe._prepare_latent_image_ids(2, 8, 12, "cpu", torch.bfloat16))
    with pytest.raises(ValueError, match="expects"):
        flux.unpack_latents(packed[:, 1:], geometry)


def test_euler_loop_reproduces_pipeline(pipe, encoders):
    steps, height, width = 4, 64, 64
    geometry = flux.latent_geometry(pipe.vae, height, width)
    noise = torch.randn(2, *geometry.packed_shape, generator=torch.Generator().manual_seed(0))
    common = dict(height=height, width=width, num_inference_steps=steps, guidance_scale=3.5,
                  max_sequence_length=32, latents=noise)
    captured = {}

    def grab_latents(_pipe, step, _t, kwargs):
        captured[step] = kwargs["latents"].clone()
        return {}

    ref_images = pipe(PROMPTS[:2], output_type="pt", callback_on_step_end=grab_latents, **common).images
    ref_latents = captured[steps - 1]
    sigmas = pipe.scheduler.sigmas.clone()  # (steps + 1,) incl. the final 0

    embeds, pooled, _ = flux.encode_prompts(encoders, PROMPTS[:2], max_sequence_length=32)
    img_ids, txt_ids = flux.image_ids(geometry), flux.text_ids(embeds.shape[1])
    x = noise.clone()
    with torch.no_grad():
        for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
            v = flux.predict_velocity(pipe.transformer, x, sigma.item(), embeds, pooled, img_ids, txt_ids, 3.5)
            x = x + (sigma_next - sigma) * v
        images = flux.decode(pipe.vae, x, geometry)
        chunked = flux.decode(pipe.vae, x, geometry, micro_batch=1)
    torch.testing.assert_close(x, ref_latents, rtol=0, atol=1e-5)
    torch.testing.assert_close(images, ref_images, rtol=0, atol=1e-5)
    torch.testing.assert_close(chunked, images, rtol=0, atol=1e-5)
    assert images.dtype == torch.float32 and images.shape == (2, 3, 64, 64)


def test_predict_velocity_sigma_and_guidance(pipe, encoders):
    geometry = flux.latent_geometry(pipe.vae, 64, 64)
    embeds, pooled, _ = flux.encode_prompts(encoders, PROMPTS[:2], max_sequence_length=16)
    x = torch.randn(2, *geometry.packed_shape, generator=torch.Generator().manual_seed(1))
    args = (embeds, pooled, flux.image_ids(geometry), flux.text_ids(16))
    with torch.no_grad():
        v = flux.predict_velocity(pipe.transformer, x, 0.7, *args)
        per_sample = flux.predict_velocity(pipe.transformer, x, torch.tensor([0.7, 0.3]), *args)
        assert torch.equal(per_sample[0], v[0]) and not torch.allclose(per_sample[1], v[1])
        assert not torch.allclose(flux.predict_velocity(pipe.transformer, x, 0.7, *args, guidance=1.0), v)
        per_sample = flux.predict_velocity(pipe.transformer, x, 0.7, *args, guidance=torch.tensor([3.5, 1.0]))
        assert torch.equal(per_sample[0], v[0]) and not torch.allclose(per_sample[1], v[1])
        with pytest.raises(ValueError, match="guidance"):
            flux.predict_velocity(pipe.transformer, x, 0.7, *args, guidance=None)
        # bf16 model with fp32 inputs: inputs are cast, output is float32
        bf16 = flux.load_transformer(pipe.config._name_or_path, dtype=torch.bfloat16)
        out = flux.predict_velocity(bf16, x, 0.7, *args)
        assert out.dtype == torch.float32 and torch.isfinite(out).all()
        # diffusers multiplies timestep and guidance by 1000 in the model's dtype: bf16(0.7 x 1000) = 700 but
        # bf16(3.5 x 1000) = 3504, a different guidance embedding (0.22 relative error against the fp32 forward).
        # The fp32 forward fed those same rounded values is the bf16 forward up to bf16 rounding: measured 0.0069.
        as_bf16 = lambda value: (torch.tensor(value).to(torch.bfloat16) * 1000).item() / 1000  # noqa: E731
        rounded = flux.predict_velocity(pipe.transformer, x, as_bf16(0.7), *args, guidance=as_bf16(3.5))
        assert ((out - rounded).norm() / rounded.norm()).item() < 0.02


def test_predict_velocity_without_guidance_embedding(pipe, encoders):
    from diffusers import FluxTransformer2DModel

    config = dict(pipe.transformer.config)
    config["guidance_embeds"] = False
    schnell_like = FluxTransformer2DModel.from_config(config).eval()
    geometry = flux.latent_geometry(pipe.vae, 64, 64)
    embeds, pooled, _ = flux.encode_prompts(encoders, PROMPTS[:1], max_sequence_length=16)
    x = torch.randn(1, *geometry.packed_shape)
    args = (x, 0.5, embeds, pooled, flux.image_ids(geometry), flux.text_ids(16))
    with torch.no_grad():
        assert torch.equal(flux.predict_velocity(schnell_like, *args, guidance=3.5),
                           flux.predict_velocity(schnell_like, *args, guidance=None))


def test_predict_velocity_through_wrappers(tiny_flux_dir, pipe, encoders):
    from peft import LoraConfig, get_peft_model

    geometry = flux.latent_geometry(pipe.vae, 64, 64)
    embeds, pooled, _ = flux.encode_prompts(encoders, PROMPTS[:1], max_sequence_length=16)
    args = (torch.randn(1, *geometry.packed_shape), 0.5, embeds, pooled, flux.image_ids(geometry),
            flux.text_ids(16))
    base = flux.load_transformer(tiny_flux_dir)
    with torch.no_grad():
        expected = flux.predict_velocity(base, *args)

    class DDPLike(torch.nn.Module):  # DDP/FSDP1 style: .module, no .config
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, *a, **k):
            return self.module(*a, **k)

    lora = LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_k", "to_v"])  # B is zero-initialised
    adapted = flux.load_transformer(tiny_flux_dir)
    adapted.add_adapter(lora)  # diffusers' peft integration keeps the class
    peft_wrapped = get_peft_model(flux.load_transformer(tiny_flux_dir), lora)
    for model in (DDPLike(base), adapted, peft_wrapped):
        assert flux.model_config(model).guidance_embeds
        with torch.no_grad():
            torch.testing.assert_close(flux.predict_velocity(model, *args), expected, rtol=0, atol=1e-6)


def _attention_dtypes(model, latents, embeds, pooled, geometry, **kwargs) -> set[tuple[torch.dtype, ...]]:
    """The (q, k, v) dtypes of every attention call of one ``predict_velocity``."""
    from unittest import mock

    from diffusers.models import attention_dispatch

    seen, real = set(), attention_dispatch.dispatch_attention_fn

    def spy(query, key, value, *args, **kw):
        seen.add((query.dtype, key.dtype, value.dtype))
        return real(query, key, value, *args, **kw)

    ids = flux.image_ids(geometry), flux.text_ids(embeds.shape[1])
    with mock.patch("diffusers.models.transformers.transformer_flux.dispatch_attention_fn", spy):
        flux.predict_velocity(model, latents, 0.7, embeds, pooled, *ids, **kwargs)
    return seen


def test_one_dtype_into_attention_under_cuda_rms_norm_policy(tiny_flux_dir):
    """CUDA autocast runs rms_norm in float32 (imitated on the CPU): q/k/v still reach attention in one dtype, bf16,
    as in FluxPipeline's pure-bf16 forward. Without the fix norm_q/norm_k hand float32 q/k beside a bf16 v. The fp32
    path is bit-identical to the stock norms and the CPU bf16 path unchanged (CPU autocast keeps rms_norm in bf16)."""
    import sys

    sys.path.insert(0, str(REPO / "tests" / "dist_scripts"))
    from cuda_rms_norm import float32_rms_norm

    model = flux.load_transformer(tiny_flux_dir)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.RMSNorm)]
    assert norms and all(type(m) is common.ComputeDtypeRMSNorm for m in norms)
    stock = flux.load_transformer(tiny_flux_dir)
    for m in stock.modules():
        if type(m) is common.ComputeDtypeRMSNorm:
            m.__class__ = torch.nn.RMSNorm  # diffusers' own norms
    geometry = flux.latent_geometry(tiny_flux_dir, 64, 64)
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(2, *geometry.packed_shape, generator=g)
    embeds, pooled = torch.randn(2, 8, model.config.joint_attention_dim, generator=g), torch.randn(2, 32, generator=g)
    args = (latents, 0.7, embeds, pooled, flux.image_ids(geometry), flux.text_ids(8))
    assert torch.equal(flux.predict_velocity(model, *args), flux.predict_velocity(stock, *args))  # fp32: unchanged
    with torch.autocast("cpu", torch.bfloat16):
        assert torch.equal(flux.predict_velocity(model, *args), flux.predict_velocity(stock, *args))  # CPU bf16 too
        with float32_rms_norm():
            assert _attention_dtypes(stock, latents, embeds, pooled, geometry) == {
                (torch.float32, torch.float32, torch.bfloat16)}  # what CUDA did before the fix
            assert _attention_dtypes(model, latents, embeds, pooled, geometry) == {(torch.bfloat16,) * 3}
            cuda_like = flux.predict_velocity(model, *args)
        cpu_bf16 = flux.predict_velocity(model, *args)
    assert torch.isfinite(cuda_like).all()
    assert (cuda_like - cpu_bf16).abs().max() < 0.05 * cpu_bf16.abs().max()  # only the norms' rounding differs
