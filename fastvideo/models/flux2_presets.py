"""FLUX.2's tiny presets, written without a hub: ``flux2-tiny`` (the klein layout: a Qwen3 text encoder, CFG on),
``flux2-dev-tiny`` (dev's: a Mistral3 text encoder with a Pixtral processor, guidance embedding) and
``flux2-klein-4b-config`` (FLUX.2-klein-4B's real configs, no weights); seeded, so the same seed writes the same
bytes. Their small byte-level BPE tokenizers stand in for the real ones' layout and specials."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from fastvideo.models.flux2 import (DEV_PIPELINE, DEV_TEXT_LAYERS, KLEIN_PIPELINE, MAX_TEXT_TOKENS,
                                    _transformer_cls)
from fastvideo.seeding import derive_seed
from fastvideo.tiny import FLUX_SCHEDULER_CONFIG, _open_clip_merges, write_atomically

# ------------------------------------------------------------------------------------------------ presets
INFO_FILE = "tiny_flux.json"  # fastvideo.tiny's record of what a built folder is
TINY_PRESET = "flux2-tiny"
DEV_TINY_PRESET = "flux2-dev-tiny"
CONFIG_PRESET = "flux2-klein-4b-config"
TINY_SIZE = 64  # default image side of the tiny preset (VAE factor 4: 16x16 latents, 64 packed tokens)

# black-forest-labs/FLUX.2-klein-4B transformer/config.json (diffusers scripts/convert_flux2_to_diffusers.py,
# model_type "klein-4b"; the distilled and base 4B share it)
KLEIN_4B_TRANSFORMER_CONFIG = {
    "patch_size": 1, "in_channels": 128, "out_channels": None, "num_layers": 5, "num_single_layers": 20,
    "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 7680,
    "timestep_guidance_channels": 256, "mlp_ratio": 3.0, "axes_dims_rope": (32, 32, 32, 32), "rope_theta": 2000,
    "eps": 1e-6, "guidance_embeds": False,
}
# Qwen/Qwen3-4B's config (klein-4B's text_encoder/): 36 layers of width 2560, so 3 x 2560 = 7680 text features
QWEN3_4B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
    "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": True, "bos_token_id": 151643,
    "eos_token_id": 151645, "max_window_layers": 36, "use_sliding_window": False, "dtype": "bfloat16",
}
# A compact chat template that renders what Qwen3's does for plain text turns: "<|im_start|>{role}\n{content}
# <|im_end|>\n" per message, then "<|im_start|>assistant\n" and, with enable_thinking=False, an empty think block.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}{%- endif -%}"
)
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")


def _byte_bpe(merges: int, word_starts: int, specials: tuple[str, ...] = ()) -> tuple[dict[str, int], list]:
    """A small byte-level BPE (vocab, merges) built offline from CLIP's BPE merges (open_clip's vocabulary):
    ``specials`` first (ids 0..n-1), the 256 byte symbols, the first ``merges`` merges inside words, then
    ``word_starts`` "Ġword" merges so space-led words stay whole."""
    from open_clip.tokenizer import bytes_to_unicode  # optional

    vocab = {s: i for i, s in enumerate(specials)}
    vocab.update({c: len(specials) + i for i, c in enumerate(bytes_to_unicode().values())})
    pairs: list[tuple[str, str]] = []

    def merge(a: str, b: str) -> None:
        if a in vocab and b in vocab and a + b not in vocab:
            pairs.append((a, b))
            vocab[a + b] = len(vocab)

    words = []
    for line in _open_clip_merges():
        a, b = line.split()
        if "</w>" in a or "</w>" in b:
            continue
        merge(a, b)
        if (a + b).isalpha():
            words.append(a + b)
        if len(pairs) >= merges:
            break
    space = bytes_to_unicode()[ord(" ")]
    for word in words[:word_starts]:
        merge(space, word)
    return vocab, pairs


def save_qwen_tokenizer(out_dir: str | os.PathLike, merges: int = 3000, word_starts: int = 1000) -> Path:
    """Write a small byte-level BPE tokenizer (``_byte_bpe``) in Qwen2's layout (Qwen2TokenizerFast, Qwen's
    pre-tokenizer, the chat specials and a Qwen3-style chat template)."""
    from transformers import AddedToken, Qwen2TokenizerFast  # heavy

    vocab, pairs = _byte_bpe(merges, word_starts)
    tok = Qwen2TokenizerFast(vocab=vocab, merges=pairs, model_max_length=131072)
    tok.add_tokens([AddedToken(s, special=True, normalized=False) for s in QWEN_SPECIALS], special_tokens=True)
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    tok.save_pretrained(Path(out_dir))
    return Path(out_dir)


# A compact chat template that renders what Mistral-Small-3.x's does for text turns: bos, then
# "[SYSTEM_PROMPT]{system}[/SYSTEM_PROMPT]", "[INST]{user}[/INST]", assistant text + eos; a content list joins its
# text chunks and writes "[IMG]" per image chunk (the processor expands it).
MISTRAL3_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set text = message['content'] -%}"
    "{%- else -%}{%- set ns = namespace(text='') -%}{%- for chunk in message['content'] -%}"
    "{%- if chunk['type'] == 'text' -%}{%- set ns.text = ns.text + chunk['text'] -%}"
    "{%- else -%}{%- set ns.text = ns.text + '[IMG]' -%}{%- endif -%}"
    "{%- endfor -%}{%- set text = ns.text -%}{%- endif -%}"
    "{%- if message['role'] == 'system' -%}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' -}}"
    "{%- elif message['role'] == 'user' -%}{{- '[INST]' + text + '[/INST]' -}}"
    "{%- else -%}{{- text + eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
)
# Mistral-Small-3.x's control tokens in the order of their low ids (<unk> 0, <s> 1, </s> 2, ...)
MISTRAL_SPECIALS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]",
                    "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]")
TINY_PIXTRAL = {"image_size": TINY_SIZE, "patch_size": 16, "spatial_merge_size": 2}  # tiny vision tower/processor


def save_pixtral_processor(out_dir: str | os.PathLike, merges: int = 3000, word_starts: int = 1000) -> Path:
    """Write a ``PixtralProcessor`` folder in FLUX.2-dev's tokenizer/ layout (processor_config.json with a tiny
    Pixtral image processor, tokenizer.json, tokenizer_config.json, chat template): a small byte-level BPE
    (``_byte_bpe``) with Mistral's control tokens and a Mistral-Small-style chat template."""
    from tokenizers import Tokenizer, decoders, models as bpe_models, pre_tokenizers  # heavy
    from transformers import PixtralImageProcessor, PixtralProcessor, PreTrainedTokenizerFast  # heavy

    vocab, pairs = _byte_bpe(merges, word_starts, MISTRAL_SPECIALS)
    backend = Tokenizer(bpe_models.BPE(vocab=vocab, merges=pairs))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>", model_max_length=131072)
    tok.add_special_tokens({"additional_special_tokens": list(MISTRAL_SPECIALS[3:])})
    images = PixtralImageProcessor(size={"longest_edge": TINY_PIXTRAL["image_size"]},
                                   patch_size=TINY_PIXTRAL["patch_size"])
    processor = PixtralProcessor(image_processor=images, tokenizer=tok, patch_size=TINY_PIXTRAL["patch_size"],
                                 spatial_merge_size=TINY_PIXTRAL["spatial_merge_size"],
                                 chat_template=MISTRAL3_CHAT_TEMPLATE)
    processor.save_pretrained(Path(out_dir))
    return Path(out_dir)


def _model_index(kind: str, distilled: bool = False) -> dict:
    """Flux2KleinPipeline's / Flux2Pipeline's model_index.json."""
    import diffusers  # heavy

    text = (["transformers", "Mistral3ForConditionalGeneration"], ["transformers", "PixtralProcessor"]) \
        if kind == DEV_PIPELINE else (["transformers", "Qwen3ForCausalLM"], ["transformers", "Qwen2TokenizerFast"])
    index = {
        "_class_name": kind, "_diffusers_version": diffusers.__version__,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "text_encoder": text[0],
        "tokenizer": text[1], "transformer": ["diffusers", "Flux2Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLFlux2"],
    }
    return index if kind == DEV_PIPELINE else {**index, "is_distilled": distilled}


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


_TINY_TEXT_WIDTH, _TINY_LATENT_CHANNELS = 16, 4  # tiny LMs 16 wide (3 x 16 = 48 text features), 4-channel VAE


def _tiny_qwen3(tmp: Path) -> torch.nn.Module:
    """klein's tiny Qwen3 (28 layers: the pipeline reads hidden layer 27; 16 wide, ~0.1M parameters) and its
    tokenizer/ (written to ``tmp``)."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM  # heavy

    save_qwen_tokenizer(tmp / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(tmp / "tokenizer", local_files_only=True)
    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=_TINY_TEXT_WIDTH, intermediate_size=32, num_hidden_layers=28,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=MAX_TEXT_TOKENS + 64,
        rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.5,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))).eval()


def _tiny_mistral3(tmp: Path) -> torch.nn.Module:
    """dev's tiny Mistral3ForConditionalGeneration (a 30-layer Mistral text model: the pipeline reads hidden layer
    30; a 1-layer Pixtral vision tower) and its Pixtral processor tokenizer/ (written to ``tmp``)."""
    from transformers import AutoProcessor, Mistral3Config, Mistral3ForConditionalGeneration  # heavy

    save_pixtral_processor(tmp / "tokenizer")
    tok = AutoProcessor.from_pretrained(tmp / "tokenizer", local_files_only=True).tokenizer
    ids = {name: tok.convert_tokens_to_ids(token) for name, token in
           (("bos_token_id", "<s>"), ("eos_token_id", "</s>"), ("pad_token_id", "<pad>"))}
    text = dict(model_type="mistral", vocab_size=len(tok), hidden_size=_TINY_TEXT_WIDTH, intermediate_size=32,
                num_hidden_layers=max(DEV_TEXT_LAYERS), num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                max_position_embeddings=MAX_TEXT_TOKENS + 64, rms_norm_eps=1e-5, rope_theta=1e9, sliding_window=None,
                initializer_range=0.5, tie_word_embeddings=False, **ids)
    vision = dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, head_dim=8, image_size=TINY_PIXTRAL["image_size"],
                  patch_size=TINY_PIXTRAL["patch_size"], num_channels=3)
    return Mistral3ForConditionalGeneration(Mistral3Config(
        text_config=text, vision_config=vision, image_token_index=tok.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=TINY_PIXTRAL["spatial_merge_size"], vision_feature_layer=-1,
        tie_word_embeddings=False, **ids)).eval()


def _tiny_transformer(guidance_embeds: bool) -> torch.nn.Module:
    """The tiny FLUX.2 transformer (1 double + 2 single blocks, 32 wide), sharpened as a trained model would be."""
    transformer = _transformer_cls()(
        patch_size=1, in_channels=4 * _TINY_LATENT_CHANNELS, num_layers=1, num_single_layers=2,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=3 * _TINY_TEXT_WIDTH,
        timestep_guidance_channels=256, mlp_ratio=3.0, axes_dims_rope=(4, 4, 4, 4), rope_theta=2000,
        guidance_embeds=guidance_embeds).eval()
    # At default init attention is nearly uniform and the modulation gates small, so the prompt moves the velocity
    # by ~2% of |v|; sharper q/k norms (x3) and larger modulations (x3) make it ~14%, and a larger time (and
    # guidance) embedding (x5) lets sigma (and the guidance value) visibly move the velocity, as in a trained model.
    embed = transformer.time_guidance_embed
    with torch.no_grad():
        for embedder in (embed.timestep_embedder, embed.guidance_embedder):
            if embedder is not None:
                embedder.linear_2.weight.mul_(5.0)
        for module in transformer.modules():
            if isinstance(module, torch.nn.RMSNorm):
                module.weight.mul_(3.0)
        for module in (transformer.double_stream_modulation_img, transformer.double_stream_modulation_txt,
                       transformer.single_stream_modulation):
            module.linear.weight.mul_(3.0)
    return transformer


def _tiny_vae() -> torch.nn.Module:
    """The tiny FLUX.2 VAE (factor 4, 4 latent channels) with non-trivial batch-norm statistics, so forgetting
    them shows."""
    from diffusers import AutoencoderKLFlux2  # heavy

    vae = AutoencoderKLFlux2(
        block_out_channels=(8, 16, 16), down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3, layers_per_block=1, latent_channels=_TINY_LATENT_CHANNELS,
        norm_num_groups=4, sample_size=TINY_SIZE).eval()
    with torch.no_grad():
        vae.bn.running_mean.copy_(0.5 * torch.randn(vae.bn.num_features))
        vae.bn.running_var.copy_(torch.rand(vae.bn.num_features) * 1.5 + 0.5)
    return vae


def _write_tiny(tmp: Path, seed: int, kind: str = KLEIN_PIPELINE) -> None:
    """Every component of a tiny folder (klein base or dev layout), each from its own derived seed (see
    ``build_tiny``); dev's VAE is klein's (same seed), its transformer adds the guidance embedding."""
    from diffusers import FlowMatchEulerDiscreteScheduler  # heavy

    def seeded(name: str) -> None:
        torch.manual_seed(derive_seed(seed, "tiny-flux2", name))

    dev = kind == DEV_PIPELINE
    seeded("mistral3_text_encoder" if dev else "text_encoder")
    text_encoder = (_tiny_mistral3 if dev else _tiny_qwen3)(tmp)
    seeded("transformer")
    transformer = _tiny_transformer(guidance_embeds=dev)
    seeded("vae")
    vae = _tiny_vae()
    for name, module in (("text_encoder", text_encoder), ("transformer", transformer), ("vae", vae)):
        module.save_pretrained(tmp / name, safe_serialization=True)
    FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER_CONFIG).save_pretrained(tmp / "scheduler")
    _write_json(tmp / "model_index.json", _model_index(kind))
    _write_json(tmp / INFO_FILE, {"preset": DEV_TINY_PRESET if dev else TINY_PRESET, "seed": seed,
                                  "height": TINY_SIZE, "width": TINY_SIZE, "vae_scale_factor": 4,
                                  "seq_len": (TINY_SIZE // 8) ** 2})


def _build_tiny_folder(out_dir: str | os.PathLike, seed: int, kind: str) -> Path:
    def write(tmp: Path) -> None:
        with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG untouched
            _write_tiny(tmp, int(seed), kind)

    return write_atomically(out_dir, write)


def build_tiny(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Write the seeded tiny FLUX.2 folder (klein base layout: Qwen3 text encoder, CFG on) that
    ``Flux2KleinPipeline.from_pretrained(out_dir, local_files_only=True)`` loads; same seed => same bytes."""
    return _build_tiny_folder(out_dir, seed, KLEIN_PIPELINE)


def build_tiny_dev(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Write the seeded tiny FLUX.2-dev folder (Flux2Pipeline layout: a 30-layer tiny Mistral3 text encoder with a
    Pixtral processor, a transformer with ``guidance_embeds``, klein's tiny VAE) that
    ``Flux2Pipeline.from_pretrained(out_dir, local_files_only=True)`` loads; same seed => same bytes."""
    return _build_tiny_folder(out_dir, seed, DEV_PIPELINE)


def _write_config_folder(tmp: Path) -> None:
    """FLUX.2-klein-4B's configs, no weights (models instantiated on meta so diffusers fills every key)."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler  # heavy
    from transformers import Qwen3Config  # heavy

    with torch.device("meta"):
        _transformer_cls()(**KLEIN_4B_TRANSFORMER_CONFIG).save_config(tmp / "transformer")
        AutoencoderKLFlux2().save_config(tmp / "vae")  # the FLUX.2 VAE's config is the class defaults
    Qwen3Config(**QWEN3_4B_CONFIG).save_pretrained(tmp / "text_encoder")
    FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER_CONFIG).save_pretrained(tmp / "scheduler")
    save_qwen_tokenizer(tmp / "tokenizer")
    (tmp / "tokenizer" / "README.txt").write_text(
        "NOT Qwen3's tokenizer: a small byte-level BPE stand-in of fastvideo.models.flux2 with the same chat "
        "template shape and specials, so the layout is complete. Do not use it to encode real prompts.\n")
    _write_json(tmp / "model_index.json", _model_index(KLEIN_PIPELINE, distilled=True))
    _write_json(tmp / INFO_FILE, {"preset": CONFIG_PRESET, "weights": False, "vae_scale_factor": 8,
                                  "source": "black-forest-labs/FLUX.2-klein-4B (configs only)",
                                  "tokenizer": "stand-in, not Qwen3's (see tokenizer/README.txt)"})


def write_config(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Write FLUX.2-klein-4B's diffusers layout with its real configs and no weights (meta-device planning);
    ``seed`` is ignored. FileExistsError if ``out_dir`` is non-empty."""
    return write_atomically(out_dir, _write_config_folder)
