"""Wan presets: ``wan-tiny``, ``wan22-ti2v-tiny`` and ``wan22-a14b-tiny`` (seeded random Wan2.1-, Wan2.2-TI2V- and
Wan2.2-A14B-layout folders that the stock ``WanPipeline`` loads, built in seconds) and ``wan2.1-t2v-14b-config`` /
``wan2.2-ti2v-5b-config`` / ``wan2.2-t2v-a14b-config`` (the real models' configs without weights, for meta-device
planning at 480 x 832 x 81 frames)."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from fastvideo import tiny
from fastvideo.models.wan import FLOW_SHIFT, NUM_TRAIN_TIMESTEPS, PATCH, Wan
from fastvideo.seeding import derive_seed


@dataclass(frozen=True)
class TinyWan:
    """Sizes of the tiny Wan folder: 64 x 64 x 5 frames -> 2 latent frames of 8 x 8 (VAE 4x time, 8x space) ->
    32 packed tokens of 64 channels."""

    height: int = 64
    width: int = 64
    num_frames: int = 5
    num_layers: int = 2
    num_attention_heads: int = 2
    attention_head_dim: int = 16  # rotary split t 8 / h 4 / w 4
    ffn_dim: int = 64
    freq_dim: int = 32
    text_dim: int = 32  # the tiny UMT5's d_model
    vae_base_dim: int = 8
    time_gain: float = 5.0  # see _components
    text_gain: float = 20.0


TINY = TinyWan()
# Wan-AI/Wan2.1-T2V-14B-Diffusers' configs (diffusers layout), as constructor kwargs
WAN21_T2V_14B_TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": list(PATCH), "num_attention_heads": 40, "attention_head_dim": 128, "in_channels": 16,
    "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824, "num_layers": 40,
    "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "image_dim": None,
    "added_kv_proj_dim": None, "rope_max_seq_len": 1024,
}
WAN21_VAE_CONFIG: dict[str, Any] = {"base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
                                    "attn_scales": [], "temperal_downsample": [False, True, True], "dropout": 0.0}
UMT5_XXL_CONFIG: dict[str, Any] = {  # google/umt5-xxl's encoder
    "architectures": ["UMT5EncoderModel"], "vocab_size": 256384, "d_model": 4096, "d_kv": 64, "d_ff": 10240,
    "num_layers": 24, "num_heads": 64, "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
    "dropout_rate": 0.1, "layer_norm_epsilon": 1e-6, "feed_forward_proj": "gated-gelu", "is_encoder_decoder": True,
    "tie_word_embeddings": False, "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0,
    "scalable_attention": True, "dtype": "bfloat16",
}
# the stock folder's UniPC scheduler (WanPipeline samples with it; our Euler grid reads its flow_shift)
UNIPC_CONFIG: dict[str, Any] = {"num_train_timesteps": NUM_TRAIN_TIMESTEPS, "flow_shift": FLOW_SHIFT,
                                "use_flow_sigmas": True, "prediction_type": "flow_prediction", "solver_order": 2}
WAN21_T2V_14B_TRANSFORMER_PARAMETERS = 14_288_491_584  # build_transformer(write_config(...)) parameters

# Wan2.2-TI2V-5B (Wan-AI/Wan2.2-TI2V-5B-Diffusers; diffusers' scripts/convert_wan_to_diffusers.py "Wan2.2-TI2V-5B"
# and vae22_diffusers_config at 58eb52c): a 30-layer 3072-wide transformer on 48 latent channels, the Wan2.2 VAE
# (16x in space through its 2x2 patchify, 4x in time), flow_shift 5, and the pipeline's expand_timesteps
WAN22_TI2V_5B_TRANSFORMER_CONFIG: dict[str, Any] = {
    **WAN21_T2V_14B_TRANSFORMER_CONFIG, "num_attention_heads": 24, "in_channels": 48, "out_channels": 48,
    "ffn_dim": 14336, "num_layers": 30,
}
WAN22_VAE_LATENTS_MEAN = [
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891, 0.1570,
    -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502, -0.2055, -0.0322,
    0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520,
    0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667]
WAN22_VAE_LATENTS_STD = [
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165,
    0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659, 0.7069, 0.5338, 0.4889, 0.4917,
    0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600,
    0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744]
WAN22_VAE_CONFIG: dict[str, Any] = {
    "base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
    "attn_scales": [], "temperal_downsample": [False, True, True], "dropout": 0.0, "is_residual": True,
    "in_channels": 12, "out_channels": 12, "patch_size": 2, "scale_factor_temporal": 4, "scale_factor_spatial": 16,
    "latents_mean": WAN22_VAE_LATENTS_MEAN, "latents_std": WAN22_VAE_LATENTS_STD,
}
TI2V_FLOW_SHIFT = 5.0  # the conversion script's flow_shift for TI2V
WAN22_TI2V_5B_TRANSFORMER_PARAMETERS = 4_999_787_712  # build_transformer(write_config(..., "ti2v")) parameters

A14B_BOUNDARY_RATIO = 0.875  # the conversion script's WanPipeline(boundary_ratio=0.875) for Wan2.2-T2V-A14B

# The variants a preset can take: (pipeline flags for model_index.json, transformer config, VAE config, flow_shift)
VARIANTS: dict[str, tuple[dict, dict, dict, float]] = {
    "wan2.1": ({"boundary_ratio": None, "expand_timesteps": False}, WAN21_T2V_14B_TRANSFORMER_CONFIG,
               WAN21_VAE_CONFIG, FLOW_SHIFT),
    "ti2v": ({"boundary_ratio": None, "expand_timesteps": True}, WAN22_TI2V_5B_TRANSFORMER_CONFIG, WAN22_VAE_CONFIG,
             TI2V_FLOW_SHIFT),
    # Wan2.2-T2V-A14B: two experts of Wan2.1-14B's architecture (the conversion script's "Wan2.2-T2V-A14B" config),
    # the Wan2.1 VAE, boundary_ratio 0.875, flow_shift 3
    "a14b": ({"boundary_ratio": A14B_BOUNDARY_RATIO, "expand_timesteps": False}, WAN21_T2V_14B_TRANSFORMER_CONFIG,
             WAN21_VAE_CONFIG, FLOW_SHIFT),
}


def _model_index(variant: str = "wan2.1") -> dict:
    """WanPipeline's model_index.json (component -> (library, class)) for a ``VARIANTS`` entry; one expert."""
    import diffusers  # heavy

    return {
        "_class_name": "WanPipeline",
        "_diffusers_version": diffusers.__version__,
        **VARIANTS[variant][0],
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": ["diffusers", "WanTransformer3DModel"] if variant == "a14b" else [None, None],
        "vae": ["diffusers", "AutoencoderKLWan"],
    }


def _components(p: TinyWan, seed: int, variant: str = "wan2.1") -> dict[str, Any]:
    """Every model of the tiny folder, each from its own derived seed (eval mode); ``variant``'s latent channels
    and VAE layout (TI2V: 48 channels, the residual 2x2-patchified VAE)."""
    from diffusers import AutoencoderKLWan  # heavy
    from transformers import UMT5Config, UMT5EncoderModel  # heavy

    def seeded(name: str) -> None:
        torch.manual_seed(derive_seed(seed, "tiny-wan", name))

    experts = {}
    for name in ("transformer", "transformer_2") if variant == "a14b" else ("transformer",):
        seeded(name)
        experts[name] = _tiny_transformer(p, variant)
    seeded("vae")
    vae_config = VARIANTS[variant][2]
    vae = AutoencoderKLWan(**{**vae_config, "base_dim": p.vae_base_dim, "num_res_blocks": 1,
                              **({"decoder_base_dim": p.vae_base_dim} if "decoder_base_dim" in vae_config else {})})
    vae = vae.eval()
    seeded("text_encoder")
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=tiny.T5_VOCAB_SIZE, d_model=p.text_dim, d_kv=8, d_ff=2 * p.text_dim, num_layers=2, num_heads=4,
        relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.0,
        feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False, tie_word_embeddings=False,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)).eval()
    return {**experts, "vae": vae, "text_encoder": text_encoder}


def _tiny_transformer(p: TinyWan, variant: str) -> Any:
    """A tiny WanTransformer3DModel of ``variant``'s latent channels, on the global RNG (the caller seeds it)."""
    from diffusers import WanTransformer3DModel  # heavy

    transformer = WanTransformer3DModel(
        patch_size=PATCH, num_attention_heads=p.num_attention_heads, attention_head_dim=p.attention_head_dim,
        in_channels=VARIANTS[variant][1]["in_channels"], out_channels=VARIANTS[variant][1]["out_channels"],
        text_dim=p.text_dim, freq_dim=p.freq_dim, ffn_dim=p.ffn_dim,
        num_layers=p.num_layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
        rope_max_seq_len=1024).eval()
    # As in tiny.py: a trained model's timestep and text embeddings are large; at default init sigma and the prompt
    # would barely move the velocity, so the embedders' output layers are scaled up (the text more: the cross-attention
    # keys are RMS-normalised, so only its values carry the scale; gain 20 makes the prompt move the velocity by ~25%)
    with torch.no_grad():
        for layer, gain in ((transformer.condition_embedder.time_embedder.linear_2, p.time_gain),
                            (transformer.condition_embedder.text_embedder.linear_2, p.text_gain)):
            layer.weight.mul_(gain)
            layer.bias.mul_(gain)
    return transformer


def _write_tiny(tmp: Path, seed: int, variant: str = "wan2.1", preset: str = "wan-tiny") -> None:
    from diffusers import UniPCMultistepScheduler  # heavy

    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG untouched
        parts = _components(TINY, seed, variant)
    for name, module in parts.items():
        module.save_pretrained(tmp / name, safe_serialization=True)
    UniPCMultistepScheduler(**{**UNIPC_CONFIG, "flow_shift": VARIANTS[variant][3]}).save_pretrained(tmp / "scheduler")
    tiny.save_t5_tokenizer(tmp / "tokenizer")
    (tmp / "model_index.json").write_text(json.dumps(_model_index(variant), indent=2, sort_keys=True) + "\n")
    info = {"preset": preset, "family": Wan.name, "seed": seed, "sizes": asdict(TINY)}
    (tmp / tiny.INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def build_tiny(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Write a seeded tiny Wan2.1 folder (``WanPipeline`` layout, ~60k-parameter transformer, 64 x 64 x 5 frames)
    to ``out_dir``, atomically; same seed => byte-identical files."""
    return tiny.write_atomically(out_dir, lambda tmp: _write_tiny(tmp, int(seed)))


def build_tiny_ti2v(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """A seeded tiny Wan2.2-TI2V-layout folder: 48 latent channels, the residual VAE that patchifies 2x2 (16x in
    space: 64 x 64 x 5 frames -> 2 latent frames of 4 x 4 -> 8 tokens), ``expand_timesteps`` in the pipeline."""
    return tiny.write_atomically(out_dir, lambda tmp: _write_tiny(tmp, int(seed), "ti2v", "wan22-ti2v-tiny"))


def _write_config_folder(tmp: Path, variant: str = "wan2.1", preset: str = "wan2.1-t2v-14b-config",
                         source: str = "Wan-AI/Wan2.1-T2V-14B-Diffusers") -> None:
    """Save a real Wan model's configs (no weights) into ``tmp``; the models are instantiated on the meta device."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel  # heavy
    from transformers import UMT5Config  # heavy

    _, transformer_config, vae_config, shift = VARIANTS[variant]
    with torch.device("meta"):
        for name in ("transformer", "transformer_2") if variant == "a14b" else ("transformer",):
            WanTransformer3DModel(**transformer_config).save_config(tmp / name)
        AutoencoderKLWan(**vae_config).save_config(tmp / "vae")
    UMT5Config(**UMT5_XXL_CONFIG).save_pretrained(tmp / "text_encoder")
    UniPCMultistepScheduler(**{**UNIPC_CONFIG, "flow_shift": shift}).save_pretrained(tmp / "scheduler")
    tiny.save_t5_tokenizer(tmp / "tokenizer")
    (tmp / "tokenizer" / "README.txt").write_text(
        f"NOT Wan's UMT5 tokenizer: the small {tiny.T5_VOCAB_SIZE}-piece stand-in of fastvideo.tiny (the real one, "
        "google/umt5-xxl's, is not available offline); do not use it to encode real prompts.\n")
    (tmp / "model_index.json").write_text(json.dumps(_model_index(variant), indent=2, sort_keys=True) + "\n")
    info = {"preset": preset, "family": Wan.name, "weights": False, "source": f"{source} (configs only)",
            "tokenizer": f"stand-in: fastvideo.tiny T5 tokenizer with {tiny.T5_VOCAB_SIZE} pieces"}
    (tmp / tiny.INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def write_config(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Write Wan2.1-T2V-14B's diffusers layout with its real configs and no weights (``seed`` is ignored): for
    meta-device planning without the download. Atomic; FileExistsError if non-empty."""
    return tiny.write_atomically(out_dir, _write_config_folder)


def build_tiny_a14b(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """A seeded tiny Wan2.2-T2V-A14B-layout folder: two tiny experts (``transformer`` above the boundary,
    ``transformer_2`` below; different seeds) with ``boundary_ratio`` 0.875, the Wan2.1 VAE, 64 x 64 x 5 frames."""
    return tiny.write_atomically(out_dir, lambda tmp: _write_tiny(tmp, int(seed), "a14b", "wan22-a14b-tiny"))


def write_config_a14b(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Wan2.2-T2V-A14B's diffusers layout with its real configs (two 14B experts) and no weights."""
    return tiny.write_atomically(out_dir, lambda tmp: _write_config_folder(tmp, "a14b", "wan2.2-t2v-a14b-config",
                                                                           "Wan-AI/Wan2.2-T2V-A14B-Diffusers"))


def write_config_ti2v(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Wan2.2-TI2V-5B's diffusers layout with its real configs (the 48-channel VAE, expand_timesteps) and no
    weights, as ``write_config``."""
    return tiny.write_atomically(out_dir, lambda tmp: _write_config_folder(tmp, "ti2v", "wan2.2-ti2v-5b-config",
                                                                           "Wan-AI/Wan2.2-TI2V-5B-Diffusers"))
