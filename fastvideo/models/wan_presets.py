"""Wan presets: ``wan-tiny`` (a seeded random Wan2.1-layout folder that the stock ``WanPipeline`` loads, built in
seconds) and ``wan2.1-t2v-14b-config`` (Wan-AI/Wan2.1-T2V-14B-Diffusers' configs without weights, for meta-device
planning of the 14B transformer at 480 x 832 x 81 frames)."""
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


def _model_index() -> dict:
    """WanPipeline's model_index.json (component -> (library, class)); Wan2.1 has one expert."""
    import diffusers  # heavy

    return {
        "_class_name": "WanPipeline",
        "_diffusers_version": diffusers.__version__,
        "boundary_ratio": None,
        "expand_timesteps": False,
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "text_encoder": ["transformers", "UMT5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": [None, None],
        "vae": ["diffusers", "AutoencoderKLWan"],
    }


def _components(p: TinyWan, seed: int) -> dict[str, Any]:
    """Every model of the tiny folder, each from its own derived seed (eval mode)."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel  # heavy
    from transformers import UMT5Config, UMT5EncoderModel  # heavy

    def seeded(name: str) -> None:
        torch.manual_seed(derive_seed(seed, "tiny-wan", name))

    seeded("transformer")
    transformer = WanTransformer3DModel(
        patch_size=PATCH, num_attention_heads=p.num_attention_heads, attention_head_dim=p.attention_head_dim,
        in_channels=16, out_channels=16, text_dim=p.text_dim, freq_dim=p.freq_dim, ffn_dim=p.ffn_dim,
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
    seeded("vae")
    vae = AutoencoderKLWan(**{**WAN21_VAE_CONFIG, "base_dim": p.vae_base_dim, "num_res_blocks": 1}).eval()
    seeded("text_encoder")
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=tiny.T5_VOCAB_SIZE, d_model=p.text_dim, d_kv=8, d_ff=2 * p.text_dim, num_layers=2, num_heads=4,
        relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.0,
        feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False, tie_word_embeddings=False,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)).eval()
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder}


def _write_tiny(tmp: Path, seed: int) -> None:
    from diffusers import UniPCMultistepScheduler  # heavy

    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG untouched
        parts = _components(TINY, seed)
    for name, module in parts.items():
        module.save_pretrained(tmp / name, safe_serialization=True)
    UniPCMultistepScheduler(**UNIPC_CONFIG).save_pretrained(tmp / "scheduler")
    tiny.save_t5_tokenizer(tmp / "tokenizer")
    (tmp / "model_index.json").write_text(json.dumps(_model_index(), indent=2, sort_keys=True) + "\n")
    info = {"preset": "wan-tiny", "family": Wan.name, "seed": seed, "sizes": asdict(TINY)}
    (tmp / tiny.INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def build_tiny(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Write a seeded tiny Wan2.1 folder (``WanPipeline`` layout, ~60k-parameter transformer, 64 x 64 x 5 frames)
    to ``out_dir``, atomically; same seed => byte-identical files."""
    return tiny.write_atomically(out_dir, lambda tmp: _write_tiny(tmp, int(seed)))


def _write_config_folder(tmp: Path) -> None:
    """Save Wan2.1-T2V-14B's configs (no weights) into ``tmp``; the models are instantiated on the meta device."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel  # heavy
    from transformers import UMT5Config  # heavy

    with torch.device("meta"):
        WanTransformer3DModel(**WAN21_T2V_14B_TRANSFORMER_CONFIG).save_config(tmp / "transformer")
        AutoencoderKLWan(**WAN21_VAE_CONFIG).save_config(tmp / "vae")
    UMT5Config(**UMT5_XXL_CONFIG).save_pretrained(tmp / "text_encoder")
    UniPCMultistepScheduler(**UNIPC_CONFIG).save_pretrained(tmp / "scheduler")
    tiny.save_t5_tokenizer(tmp / "tokenizer")
    (tmp / "tokenizer" / "README.txt").write_text(
        f"NOT Wan's UMT5 tokenizer: the small {tiny.T5_VOCAB_SIZE}-piece stand-in of fastvideo.tiny (the real one, "
        "google/umt5-xxl's, is not available offline); do not use it to encode real prompts.\n")
    (tmp / "model_index.json").write_text(json.dumps(_model_index(), indent=2, sort_keys=True) + "\n")
    info = {"preset": "wan2.1-t2v-14b-config", "family": Wan.name, "weights": False,
            "source": "Wan-AI/Wan2.1-T2V-14B-Diffusers (configs only)",
            "tokenizer": f"stand-in: fastvideo.tiny T5 tokenizer with {tiny.T5_VOCAB_SIZE} pieces"}
    (tmp / tiny.INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def write_config(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Write Wan2.1-T2V-14B's diffusers layout with its real configs and no weights (``seed`` is ignored): for
    meta-device planning without the download. Atomic; FileExistsError if non-empty."""
    return tiny.write_atomically(out_dir, _write_config_folder)
