"""Build tiny FLUX-architecture folders (the embedded default model and the test fixtures).

A built folder has the FLUX.1-dev diffusers layout (``model_index.json``, ``transformer/``, ``vae/``,
``text_encoder/`` CLIP, ``text_encoder_2/`` T5, ``tokenizer/``, ``tokenizer_2/``, ``scheduler/``) and
loads in a stock ``diffusers.FluxPipeline.from_pretrained(dir, local_files_only=True)``. Weights are
random but seeded: the same ``(preset, seed)`` gives byte-identical files.

The CLIP tokenizer is the real CLIP BPE (converted from the vocabulary file open_clip ships), so
prompts tokenize exactly as for FLUX.1-dev's CLIP. The T5 tokenizer is a small Unigram model whose
pieces come from the same BPE vocabulary (T5 layout: ``<pad>`` = 0, ``</s>`` = 1, ``<unk>`` = 2).

``--preset flux-dev-config`` (``write_flux_dev_config``) instead writes FLUX.1-dev's real component configs
with no weights at all (a few MB, no download), for tools that instantiate the full-size models on the meta
device (memory planning); its ``tokenizer_2/`` is the small T5 tokenizer above, not FLUX.1-dev's.

The other model families' presets (``FAMILY_PRESETS``: ``sd3-tiny``, ``qwen-image-tiny``, ``flux2-tiny``,
``flux2-dev-tiny`` and the real-config ``sd3.5-medium-config``, ``qwen-image-config``, ``flux2-klein-4b-config``)
are built by their adapter modules in ``fastvideo/models/``; ``build_preset`` builds any preset.

CLI: ``python -m fastvideo.tiny --preset {tiny,bench,hps-tiny,flux-dev-config,<family preset>} --out DIR [--seed N]``.
"""
from __future__ import annotations

import argparse
import functools
import gzip
import importlib
import json
import math
import os
import shutil
import string
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from fastvideo.seeding import derive_seed

# FLUX.1-dev's scheduler_config.json (dynamic shifting on the packed image sequence length).
FLUX_SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}

CLIP_VOCAB_SIZE = 49408  # 256 bytes + 256 end-of-word bytes + 48894 merges + 2 specials
CLIP_BOS, CLIP_EOS = "<|startoftext|>", "<|endoftext|>"
T5_VOCAB_SIZE = 16384

FLUX_DEV_CONFIG_PRESET = "flux-dev-config"
INFO_FILE = "tiny_flux.json"  # what a fastvideo.tiny folder is: preset, seed / "weights": false, ...

# FLUX.1-dev's component configs (black-forest-labs/FLUX.1-dev, diffusers layout), as constructor kwargs.
FLUX_DEV_TRANSFORMER_CONFIG = {
    "patch_size": 1,
    "in_channels": 64,
    "out_channels": None,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}
FLUX_DEV_VAE_CONFIG = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "block_out_channels": (128, 256, 512, 512),
    "layers_per_block": 2,
    "act_fn": "silu",
    "latent_channels": 16,
    "norm_num_groups": 32,
    "sample_size": 1024,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "latents_mean": None,
    "latents_std": None,
    "force_upcast": True,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
    "mid_block_add_attention": True,
}
# CLIP ViT-L/14 text tower; bos/eos/pad ids are the (stale) ones of openai/clip-vit-large-patch14's config.
FLUX_DEV_CLIP_CONFIG = {
    "architectures": ["CLIPTextModel"],
    "vocab_size": CLIP_VOCAB_SIZE,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "projection_dim": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": 77,
    "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
    "attention_dropout": 0.0,
    "dropout": 0.0,
    "initializer_factor": 1.0,
    "initializer_range": 0.02,
    "bos_token_id": 0,
    "eos_token_id": 2,
    "pad_token_id": 1,
    "dtype": "bfloat16",
}
# T5-v1.1-XXL (google/t5-v1_1-xxl), of which FLUX uses the encoder.
FLUX_DEV_T5_CONFIG = {
    "architectures": ["T5EncoderModel"],
    "vocab_size": 32128,
    "d_model": 4096,
    "d_kv": 64,
    "d_ff": 10240,
    "num_layers": 24,
    "num_decoder_layers": 24,
    "num_heads": 64,
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "dropout_rate": 0.1,
    "classifier_dropout": 0.0,
    "layer_norm_epsilon": 1e-6,
    "initializer_factor": 1.0,
    "feed_forward_proj": "gated-gelu",  # => dense_act_fn "gelu_new", is_gated_act true
    "is_encoder_decoder": True,
    "use_cache": True,
    "output_past": True,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "decoder_start_token_id": 0,
    "dtype": "bfloat16",
}


@dataclass(frozen=True)
class TinyPreset:
    """Sizes of one tiny FLUX folder; ``height``/``width`` are the default image size in pixels."""

    name: str
    height: int
    width: int
    # transformer (FluxTransformer2DModel)
    num_layers: int
    num_single_layers: int
    num_attention_heads: int
    attention_head_dim: int
    axes_dims_rope: tuple[int, int, int]
    guidance_embeds: bool
    # VAE (AutoencoderKL); scale factor = 2 ** (len(vae_block_out_channels) - 1)
    latent_channels: int
    vae_block_out_channels: tuple[int, ...]
    vae_layers_per_block: int
    vae_norm_num_groups: int
    # text encoders
    clip_hidden_size: int
    clip_layers: int
    clip_heads: int
    t5_d_model: int
    t5_layers: int
    t5_heads: int
    t5_d_kv: int
    t5_d_ff: int
    # FLUX.1-dev's VAE latent normalisation (kept so that forgetting the shift shows up in tests)
    scaling_factor: float = 0.3611
    shift_factor: float = 0.1159
    # gain on the output layers of the timestep/guidance/pooled-text embedders (see _build_components)
    conditioning_gain: float = 5.0

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae_block_out_channels) - 1)

    @property
    def seq_len(self) -> int:
        """Packed image tokens at the default size."""
        return (self.height // (2 * self.vae_scale_factor)) * (self.width // (2 * self.vae_scale_factor))


PRESETS: dict[str, TinyPreset] = {
    # ~0.1M-param transformer; VAE scale factor 4 so 64px -> 16x16x4 latents -> 64 packed tokens of 16 channels.
    "tiny": TinyPreset(
        name="tiny", height=64, width=64,
        num_layers=1, num_single_layers=2, num_attention_heads=2, attention_head_dim=16,
        axes_dims_rope=(4, 6, 6), guidance_embeds=True,
        latent_channels=4, vae_block_out_channels=(8, 16, 16), vae_layers_per_block=1, vae_norm_num_groups=4,
        clip_hidden_size=32, clip_layers=2, clip_heads=2,
        t5_d_model=32, t5_layers=2, t5_heads=2, t5_d_kv=16, t5_d_ff=64,
    ),
    # ~10M-param transformer; FLUX geometry: 16-channel latents, VAE scale factor 8, 256px -> 256 tokens of 64.
    "bench": TinyPreset(
        name="bench", height=256, width=256,
        num_layers=2, num_single_layers=5, num_attention_heads=4, attention_head_dim=64,
        axes_dims_rope=(8, 28, 28), guidance_embeds=True,
        latent_channels=16, vae_block_out_channels=(16, 32, 64, 64), vae_layers_per_block=1, vae_norm_num_groups=8,
        clip_hidden_size=64, clip_layers=2, clip_heads=4,
        t5_d_model=128, t5_layers=2, t5_heads=4, t5_d_kv=32, t5_d_ff=256,
    ),
}


@functools.lru_cache(maxsize=1)
def _open_clip_merges() -> tuple[str, ...]:
    """The 48894 BPE merges of open_clip's ``bpe_simple_vocab_16e6.txt.gz`` (what SimpleTokenizer uses)."""
    import open_clip  # optional

    path = Path(open_clip.__file__).parent / "bpe_simple_vocab_16e6.txt.gz"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: reinstall open_clip_torch (it ships the CLIP BPE vocabulary)")
    lines = gzip.open(path).read().decode("utf-8").split("\n")
    return tuple(lines[1 : 49152 - 256 - 2 + 1])


def _clip_vocab(merges: tuple[str, ...]) -> dict[str, int]:
    """CLIP's token -> id map, in open_clip's order (bytes, bytes+</w>, merges, bos, eos)."""
    from open_clip.tokenizer import bytes_to_unicode  # optional

    byte_chars = list(bytes_to_unicode().values())
    tokens = byte_chars + [c + "</w>" for c in byte_chars] + ["".join(m.split()) for m in merges]
    tokens += [CLIP_BOS, CLIP_EOS]
    assert len(tokens) == CLIP_VOCAB_SIZE
    return {t: i for i, t in enumerate(tokens)}


def save_clip_tokenizer(out_dir: str | os.PathLike) -> Path:
    """Write the real CLIP BPE tokenizer (vocab.json, merges.txt, tokenizer.json) built from open_clip's vocab."""
    from transformers import CLIPTokenizer  # heavy

    out = Path(out_dir)
    merges = _open_clip_merges()
    vocab = _clip_vocab(merges)
    tok = CLIPTokenizer(vocab=vocab, merges=[tuple(m.split()) for m in merges], model_max_length=77,
                        bos_token=CLIP_BOS, eos_token=CLIP_EOS, unk_token=CLIP_EOS, pad_token=CLIP_EOS)
    tok.save_pretrained(out)
    # The classic files too, so older transformers (slow CLIPTokenizer) load the folder as well.
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    return out


def _t5_pieces(vocab_size: int = T5_VOCAB_SIZE) -> list[tuple[str, float]]:
    """Unigram (piece, score) list in T5 layout: specials, single characters, then CLIP's alphabetic BPE tokens.

    Scores make fewer, longer pieces win; single characters are the fallback; unknown characters map to <unk>.
    """
    pieces: list[tuple[str, float]] = []
    seen: set[str] = set()

    def add(piece: str, score: float) -> None:
        if piece not in seen and len(pieces) < vocab_size:
            seen.add(piece)
            pieces.append((piece, score))

    for special in ("<pad>", "</s>", "<unk>"):
        add(special, 0.0)
    add("\u2581", -12.0)
    for c in string.printable:
        if not c.isspace():
            add("\u2581" + c, -20.0)
            add(c, -20.0)
    rank = 0
    for merge in _open_clip_merges():
        token = "".join(merge.split())
        word = token[:-4] if token.endswith("</w>") else token
        if len(word) < 2 or not (word.isascii() and word.isalpha()):
            continue
        score = -10.0 - math.log1p(rank) / 10.0
        add("\u2581" + word, score)  # word start
        add(word, score - 1.0)  # continuation
        rank += 1
        if len(pieces) >= vocab_size:
            break
    return pieces


def save_t5_tokenizer(out_dir: str | os.PathLike, vocab_size: int = T5_VOCAB_SIZE) -> Path:
    """Write a small T5 tokenizer (tokenizer.json; pad 0, eos </s> 1, unk 2) loadable by T5TokenizerFast."""
    from transformers import T5TokenizerFast  # heavy

    tok = T5TokenizerFast(vocab=_t5_pieces(vocab_size), extra_ids=0, model_max_length=512)
    tok.save_pretrained(Path(out_dir))
    return Path(out_dir)


def _build_components(p: TinyPreset, seed: int) -> dict:
    """Instantiate every model of the preset, each from its own derived seed, in eval mode."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel  # heavy
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel  # heavy

    def seeded(name: str) -> None:
        torch.manual_seed(derive_seed(seed, "tiny-flux", p.name, name))

    assert sum(p.axes_dims_rope) == p.attention_head_dim
    seeded("transformer")
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * p.latent_channels,
        num_layers=p.num_layers,
        num_single_layers=p.num_single_layers,
        attention_head_dim=p.attention_head_dim,
        num_attention_heads=p.num_attention_heads,
        joint_attention_dim=p.t5_d_model,
        pooled_projection_dim=p.clip_hidden_size,
        guidance_embeds=p.guidance_embeds,
        axes_dims_rope=p.axes_dims_rope,
    ).eval()
    # At default init the conditioning vector is small, so sigma and prompt barely move the velocity
    # (prompt effect ~3% of |v|). A trained FLUX has large conditioning embeddings; scaling the embedders'
    # output layers gives a prompt effect of ~15% and a sigma effect of ~45% of |v| (tiny preset).
    with torch.no_grad():
        embed = transformer.time_text_embed
        outputs = [embed.timestep_embedder.linear_2, embed.text_embedder.linear_2]
        if p.guidance_embeds:
            outputs.append(embed.guidance_embedder.linear_2)
        for layer in outputs:
            layer.weight.mul_(p.conditioning_gain)
            layer.bias.mul_(p.conditioning_gain)

    seeded("vae")
    n = len(p.vae_block_out_channels)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
        block_out_channels=p.vae_block_out_channels,
        layers_per_block=p.vae_layers_per_block,
        act_fn="silu",
        latent_channels=p.latent_channels,
        norm_num_groups=p.vae_norm_num_groups,
        sample_size=p.height,
        scaling_factor=p.scaling_factor,
        shift_factor=p.shift_factor,
        use_quant_conv=False,
        use_post_quant_conv=False,
        mid_block_add_attention=True,
    ).eval()

    seeded("text_encoder")
    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=CLIP_VOCAB_SIZE,
        hidden_size=p.clip_hidden_size,
        intermediate_size=4 * p.clip_hidden_size,
        projection_dim=p.clip_hidden_size,
        num_hidden_layers=p.clip_layers,
        num_attention_heads=p.clip_heads,
        max_position_embeddings=77,
        hidden_act="quick_gelu",
        layer_norm_eps=1e-5,
        attention_dropout=0.0,
        dropout=0.0,
        pad_token_id=CLIP_VOCAB_SIZE - 1,
        bos_token_id=CLIP_VOCAB_SIZE - 2,
        eos_token_id=CLIP_VOCAB_SIZE - 1,
    )).eval()

    seeded("text_encoder_2")
    t5 = T5EncoderModel(T5Config(
        vocab_size=T5_VOCAB_SIZE,
        d_model=p.t5_d_model,
        d_kv=p.t5_d_kv,
        d_ff=p.t5_d_ff,
        num_layers=p.t5_layers,
        num_heads=p.t5_heads,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        dropout_rate=0.0,
        feed_forward_proj="gated-gelu",
        is_encoder_decoder=False,
        use_cache=False,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )).eval()

    scheduler = FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER_CONFIG)
    return {"transformer": transformer, "vae": vae, "text_encoder": clip, "text_encoder_2": t5,
            "scheduler": scheduler}


def _model_index() -> dict:
    """FLUX.1-dev's model_index.json (component -> (library, class))."""
    import diffusers  # heavy

    return {
        "_class_name": "FluxPipeline",
        "_diffusers_version": diffusers.__version__,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "tokenizer_2": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "FluxTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }


def _write_folder(tmp: Path, p: TinyPreset, seed: int) -> None:
    """Save every component of the preset into ``tmp`` (the FLUX.1-dev layout)."""
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG untouched
        parts = _build_components(p, seed)
    for name, module in parts.items():
        if name == "scheduler":
            module.save_pretrained(tmp / name)
        else:
            module.save_pretrained(tmp / name, safe_serialization=True)
    save_clip_tokenizer(tmp / "tokenizer")
    save_t5_tokenizer(tmp / "tokenizer_2")
    (tmp / "model_index.json").write_text(json.dumps(_model_index(), indent=2, sort_keys=True) + "\n")
    info = {"preset": asdict(p), "seed": seed, "vae_scale_factor": p.vae_scale_factor, "seq_len": p.seq_len}
    (tmp / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def _write_atomically(out_dir: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Run ``write(tmp)`` on a temporary sibling of ``out_dir`` and rename it into place (no half-written folder).

    Concurrent builders (e.g. several ranks) never see a partial folder; if another one renamed first, its
    folder is kept. Raises FileExistsError if ``out_dir`` is non-empty.
    """
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} already exists and is not empty: remove it or choose another output folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)

    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    if out.exists():
        out.rmdir()  # empty (checked above)
    try:
        os.rename(tmp, out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "model_index.json").is_file():
            raise
    return out


def build_tiny_flux(out_dir: str | os.PathLike, preset: str = "tiny", seed: int = 0) -> Path:
    """Write a seeded tiny FLUX folder in the FLUX.1-dev layout to ``out_dir`` and return its path.

    The folder is written to a temporary sibling and renamed into place, so concurrent builders (e.g.
    several ranks) never see a half-written folder. Raises FileExistsError if ``out_dir`` is non-empty.
    """
    if preset == FLUX_DEV_CONFIG_PRESET:
        raise ValueError(f"preset {preset!r} has configs but no weights, so it is not a tiny FLUX folder: "
                         f"call write_flux_dev_config(out_dir) (CLI: --preset {FLUX_DEV_CONFIG_PRESET})")
    if preset not in PRESETS:
        raise ValueError(f"unknown tiny FLUX preset {preset!r}: choose one of {sorted(PRESETS)}")
    p = PRESETS[preset]
    return _write_atomically(out_dir, lambda tmp: _write_folder(tmp, p, seed))


def _write_flux_dev_config_folder(tmp: Path) -> None:
    """Save FLUX.1-dev's configs (no weights) into ``tmp``; models are built on the meta device, so no memory."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel  # heavy
    from transformers import CLIPTextConfig, T5Config  # heavy

    # Instantiating (on meta) lets diffusers fill in and serialise the config exactly as save_pretrained would.
    with torch.device("meta"):
        transformer = FluxTransformer2DModel(**FLUX_DEV_TRANSFORMER_CONFIG)
        vae = AutoencoderKL(**FLUX_DEV_VAE_CONFIG)
    transformer.save_config(tmp / "transformer")
    vae.save_config(tmp / "vae")
    del transformer, vae
    CLIPTextConfig(**FLUX_DEV_CLIP_CONFIG).save_pretrained(tmp / "text_encoder")
    # transformers >= 5 writes tie_word_embeddings true + scale_decoder_outputs false for this (same model).
    T5Config(**FLUX_DEV_T5_CONFIG).save_pretrained(tmp / "text_encoder_2")
    FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER_CONFIG).save_pretrained(tmp / "scheduler")
    save_clip_tokenizer(tmp / "tokenizer")  # the real CLIP BPE: same ids as FLUX.1-dev's tokenizer
    save_t5_tokenizer(tmp / "tokenizer_2")
    (tmp / "tokenizer_2" / "README.txt").write_text(
        f"NOT FLUX.1-dev's T5 tokenizer: the small {T5_VOCAB_SIZE}-piece stand-in of fastvideo.tiny (the real "
        "one, google/t5-v1_1-xxl's spiece.model, is not available offline). Same special ids (pad 0, </s> 1, "
        "unk 2) and every id < 32128, but other prompt token ids: do not use it to encode real prompts.\n")
    (tmp / "model_index.json").write_text(json.dumps(_model_index(), indent=2, sort_keys=True) + "\n")
    info = {
        "preset": FLUX_DEV_CONFIG_PRESET,
        "weights": False,
        "source": "black-forest-labs/FLUX.1-dev (configs only)",
        "vae_scale_factor": 2 ** (len(FLUX_DEV_VAE_CONFIG["block_out_channels"]) - 1),
        "tokenizer_2": f"stand-in, not FLUX.1-dev's: fastvideo.tiny T5 tokenizer with {T5_VOCAB_SIZE} pieces",
    }
    (tmp / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def write_flux_dev_config(out_dir: str | os.PathLike) -> Path:
    """Write FLUX.1-dev's diffusers layout with its real configs and no weights to ``out_dir``; return the path.

    For instantiating the full-size models on the meta device (memory planning) without the 24 GB download:
    every ``config.json``, ``scheduler/``, ``model_index.json`` and the real CLIP tokenizer are FLUX.1-dev's,
    there is no ``*.safetensors`` anywhere, ``tokenizer_2/`` is a stand-in (not FLUX.1-dev's T5 vocabulary;
    see its README.txt) so the layout is complete, and ``tiny_flux.json`` says ``"weights": false``.
    Written atomically like build_tiny_flux; FileExistsError if ``out_dir`` is non-empty.
    """
    return _write_atomically(out_dir, _write_flux_dev_config_folder)


# Presets of the other model families, each built by its adapter module: name -> ("module:function", help). The
# function takes ``(out_dir, seed)`` and returns the folder (written atomically with ``write_atomically``); config
# presets (no weights) ignore the seed.
FAMILY_PRESETS: dict[str, tuple[str, str]] = {
    "sd3-tiny": ("fastvideo.models.sd3:build_tiny", "a tiny SD3.5 (three text encoders) at 64px"),
    "sd3.5-medium-config": ("fastvideo.models.sd3:write_config", "SD3.5-Medium's real configs, no weights"),
    "qwen-image-tiny": ("fastvideo.models.qwen_image:build_tiny", "a tiny Qwen-Image at 64px"),
    "qwen-image-config": ("fastvideo.models.qwen_image:write_config", "Qwen-Image's real configs, no weights"),
    "flux2-tiny": ("fastvideo.models.flux2_presets:build_tiny",
                   "a tiny FLUX.2 (klein layout: Qwen3 text encoder) at 64px"),
    "flux2-dev-tiny": ("fastvideo.models.flux2_presets:build_tiny_dev",
                       "a tiny FLUX.2-dev (Mistral3 text encoder, guidance embedding) at 64px"),
    "flux2-klein-4b-config": ("fastvideo.models.flux2_presets:write_config",
                              "FLUX.2-klein-4B's real configs, no weights"),
    "flux-kontext-tiny": ("fastvideo.models.flux_kontext:build_tiny",
                          "a tiny FLUX.1-Kontext (the tiny FLUX.1 under FluxKontextPipeline) at 32-64px"),
    "flux-kontext-dev-config": ("fastvideo.models.flux_kontext:write_config",
                                "FLUX.1-Kontext-dev's real configs, no weights"),
    "qwen-image-edit-tiny": ("fastvideo.models.qwen_image_edit:build_tiny",
                             "a tiny Qwen-Image-Edit (the tiny Qwen-Image under QwenImageEditPipeline) at 64px"),
    "qwen-image-edit-config": ("fastvideo.models.qwen_image_edit:write_config",
                               "Qwen-Image-Edit's real configs, no weights"),
    "qwen-image-edit-plus-tiny": ("fastvideo.models.qwen_image_edit:build_tiny_plus",
                                  "a tiny Qwen-Image-Edit-2509 (the tiny Qwen-Image under QwenImageEditPlusPipeline) "
                                  "at 64px"),
    "qwen-image-edit-plus-config": ("fastvideo.models.qwen_image_edit:write_config_plus",
                                    "Qwen-Image-Edit-2509's real configs, no weights"),
    "wan-tiny": ("fastvideo.models.wan_presets:build_tiny", "a tiny Wan2.1 text-to-video model at 64px x 5 frames"),
    "wan2.1-t2v-14b-config": ("fastvideo.models.wan_presets:write_config",
                              "Wan2.1-T2V-14B's real configs, no weights"),
    "wan22-ti2v-tiny": ("fastvideo.models.wan_presets:build_tiny_ti2v",
                        "a tiny Wan2.2-TI2V layout (48-channel VAE, a timestep per token) at 64px x 5 frames"),
    "wan2.2-ti2v-5b-config": ("fastvideo.models.wan_presets:write_config_ti2v",
                              "Wan2.2-TI2V-5B's real configs, no weights"),
    "wan22-a14b-tiny": ("fastvideo.models.wan_presets:build_tiny_a14b",
                        "a tiny Wan2.2-T2V-A14B layout (two experts switched at the boundary) at 64px x 5 frames"),
    "wan2.2-t2v-a14b-config": ("fastvideo.models.wan_presets:write_config_a14b",
                               "Wan2.2-T2V-A14B's real configs (two 14B experts), no weights"),
    "owlv2-tiny": ("fastvideo.bench.tiny_detectors:build_owlv2_tiny",
                   "a tiny random OWLv2 detector (the GenEval bench's plumbing tests)"),
    "grounding-dino-tiny": ("fastvideo.bench.tiny_detectors:build_grounding_dino_tiny",
                            "a tiny random Grounding DINO detector (the GenEval bench's plumbing tests)"),
    "clip-tiny": ("fastvideo.bench.tiny_detectors:build_clip_tiny",
                  "a tiny random transformers CLIP (the GenEval bench's colour head, for tests)"),
}
write_atomically = _write_atomically  # the family modules' builders use it


def build_preset(out_dir: str | os.PathLike, preset: str, seed: int = 0) -> Path:
    """Write any preset's folder (FLUX.1 tiny/bench, flux-dev-config, or a family preset) to ``out_dir``."""
    if preset in FAMILY_PRESETS:
        target = FAMILY_PRESETS[preset][0]
        module, _, function = target.partition(":")
        return getattr(importlib.import_module(module), function)(out_dir, seed)
    if preset == FLUX_DEV_CONFIG_PRESET:
        return write_flux_dev_config(out_dir)
    return build_tiny_flux(out_dir, preset=preset, seed=seed)


def main(argv: list[str] | None = None) -> None:
    """CLI entry point: build a tiny FLUX folder (a tiny HPS reward model / FLUX.1-dev configs by preset)."""
    parser = argparse.ArgumentParser(description="Build a tiny, randomly initialised model folder (seeded), "
                                                 "or FLUX.1-dev's configs without weights.")
    parser.add_argument("--preset", choices=[*PRESETS, "hps-tiny", FLUX_DEV_CONFIG_PRESET, *FAMILY_PRESETS],
                        default="tiny",
                        help="tiny: ~0.1M-param FLUX at 64px; bench: ~10M-param FLUX at 256px; "
                             "hps-tiny: a tiny open_clip HPS reward checkpoint; "
                             f"{FLUX_DEV_CONFIG_PRESET}: FLUX.1-dev's real configs, no weights (for meta-device "
                             "memory planning; --seed is ignored); "
                             + "; ".join(f"{k}: {v[1]}" for k, v in FAMILY_PRESETS.items()))
    parser.add_argument("--out", required=True, help="output folder (must not exist or be empty)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (same seed => same files)")
    args = parser.parse_args(argv)
    if args.preset == "hps-tiny":
        from fastvideo.rewards.hpsv2 import build_tiny_hps  # optional: the reward package, for --preset hps-tiny

        path = build_tiny_hps(args.out, seed=args.seed)
    else:
        path = build_preset(args.out, args.preset, seed=args.seed)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
