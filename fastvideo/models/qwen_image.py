"""The Qwen-Image family (``QwenImagePipeline``): a 60-block dual-stream MMDiT over 2x2-packed latents of a video VAE,
conditioned on the last hidden state of a Qwen2.5-VL-7B text encoder (no pooled vector, no distilled guidance), with
true classifier-free guidance whose combined velocity is rescaled to the conditional one's norm.

What the stock pipeline (diffusers 0.42 ``pipeline_qwenimage.py``) does, and this adapter reproduces:

- prompts are wrapped in a chat template; the template's first 34 tokens (the system turn) are dropped from the
  text encoder's last hidden state, and each row keeps only its attended tokens, so the embedding length varies per
  prompt: stored here padded to ``max_sequence_length`` beside ``prompt_embeds_mask`` (1 on real tokens);
- the transformer takes the text mask as ``encoder_hidden_states_mask``, the image grid as ``img_shapes`` (python
  ints: its rotary tables are indexed by them) and the timestep as ``sigma`` (the pipeline feeds ``t / 1000`` with
  ``t = 1000 sigma``);
- latents are normalised per channel with the VAE config's ``latents_mean`` / ``latents_std`` and carry a frame
  axis ``(B, C, 1, h, w)`` that the packed tokens drop;
- the sigma grid is ``linspace(1, 1/S, S)``, exponentially time-shifted by the dynamic ``mu`` of the packed image
  length (base/max shift 0.5/0.9 over 256..8192 tokens) and stretched so its last non-zero sigma is 0.02
  (``shift_terminal``).

``build_tiny`` writes a seeded tiny folder the stock pipeline loads (``--preset qwen-image-tiny``), ``write_config``
Qwen-Image's real configs without weights (``--preset qwen-image-config``).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastvideo import devices
from fastvideo.models.attention import choose_attention
from fastvideo.models.base import (ModelFamily, SamplerDefaults, build_on_meta, check_components, component_folder,
                                   config_get, model_config, model_dtype, scheduler_settings, tag,
                                   unwrap_model)
from fastvideo.models.common import LatentGeometry, check_encode_images, keep_attention_dtype, pack_latents, unpack_latents
from fastvideo.schedulers import flux_mu, time_shift
from fastvideo.seeding import derive_seed
from fastvideo.tiny import INFO_FILE, _open_clip_merges, write_atomically

# --------------------------------------------------------------------------------------- the stock pipeline's facts
# QwenImagePipeline.prompt_template_encode / prompt_template_encode_start_idx / tokenizer_max_length.
PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                   "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
                   "<|im_end|>\n<|im_start|>assistant\n")
TEMPLATE_DROP = 34  # template tokens before the prompt, cut from the hidden states
MAX_TEXT_TOKENS = 1024  # check_inputs rejects max_sequence_length > 1024; the tokenizer keeps 1024 + 34

# Qwen/Qwen-Image scheduler/scheduler_config.json.
SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
    "invert_sigmas": False,
    "stochastic_sampling": False,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
}
# Qwen/Qwen-Image transformer/config.json (its extra "pooled_projection_dim": 768 is not a diffusers argument).
TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": 2,
    "in_channels": 64,
    "out_channels": 16,
    "num_layers": 60,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 3584,
    "guidance_embeds": False,
    "axes_dims_rope": (16, 56, 56),
}
PUBLISHED_TRANSFORMER_PARAMETERS = 20_430_401_088  # QwenImageTransformer2DModel at TRANSFORMER_CONFIG
LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
               3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)
# Qwen/Qwen-Image vae/config.json (AutoencoderKLQwenImage).
VAE_CONFIG: dict[str, Any] = {
    "base_dim": 96,
    "z_dim": 16,
    "dim_mult": [1, 2, 4, 4],  # lists: the VAE concatenates them with lists
    "num_res_blocks": 2,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "dropout": 0.0,
    "latents_mean": list(LATENTS_MEAN),
    "latents_std": list(LATENTS_STD),
}
# Qwen2.5-VL's special tokens in its id order (151643..151656 in the real vocabulary).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                  "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
# Qwen/Qwen-Image text_encoder/config.json (Qwen2.5-VL-7B-Instruct): text tower and vision tower.
TEXT_ENCODER_CONFIG: dict[str, Any] = {
    "vocab_size": 152064,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "hidden_act": "silu",
    "max_position_embeddings": 128000,
    "max_window_layers": 28,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "sliding_window": 32768,
    "use_sliding_window": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
VISION_CONFIG: dict[str, Any] = {
    "depth": 32,
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "out_hidden_size": 3584,
    "hidden_act": "silu",
    "in_channels": 3,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "tokens_per_second": 2,
    "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31],
}
VISION_TOKEN_IDS = {"vision_start_token_id": 151652, "vision_end_token_id": 151653, "image_token_id": 151655,
                    "video_token_id": 151656}

# Every attention projection of both streams and both streams' feed-forward networks: verl's Flow-GRPO Qwen-Image
# LoRA recipe (verl-project/verl examples/flowgrpo_trainer/run_flowgrpo.sh, target_modules), with the attention
# names prefixed "attn." as FLUX.1's default is; the adaLN modulations (img_mod/txt_mod) stay frozen.
LORA_TARGET_MODULES: tuple[str, ...] = (
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",
)

_COMPONENT_FILES: dict[str, tuple[str, ...]] = {
    "transformer": ("config.json",),
    "vae": ("config.json",),
    "text_encoder": ("config.json",),
    "tokenizer": ("tokenizer.json", "vocab.json"),
    "scheduler": ("scheduler_config.json",),
}
COMPONENTS: tuple[str, ...] = tuple(_COMPONENT_FILES)
TEXT_COMPONENTS: tuple[str, ...] = ("tokenizer", "text_encoder")
_BUILD_HINT = ("pass a diffusers Qwen-Image folder (e.g. a local download of Qwen/Qwen-Image) or build a tiny one "
               "with `python -m fastvideo.tiny --preset qwen-image-tiny --out DIR`")


# --------------------------------------------------------------------------------------------------- loading
def _fresh_rope(model: Any) -> None:
    """Rebuild the transformer's rotary tables on the CPU: ``QwenEmbedRope`` keeps them as plain tensors made in its
    constructor (not buffers), so a meta-device build would keep meta tables that no weight loading fills."""
    pos_embed = model.pos_embed
    if pos_embed.pos_freqs.device.type != "meta":
        return
    with torch.device("cpu"):
        model.pos_embed = type(pos_embed)(theta=pos_embed.theta, axes_dim=list(pos_embed.axes_dim),
                                          scale_rope=pos_embed.scale_rope)


def _text_len_without_copy(encoder_hidden_states: torch.Tensor, encoder_hidden_states_mask: torch.Tensor | None
                            ) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
    """diffusers' ``compute_text_seq_len_from_mask`` (same results) without its ``torch.as_tensor(int, device=...)``,
    a blocking host-to-device copy (a host sync on CUDA) in every transformer forward of the sampling and replay
    loops: the fallback length is a python scalar of ``torch.where`` instead."""
    batch_size, text_seq_len = encoder_hidden_states.shape[:2]
    if encoder_hidden_states_mask is None:
        return text_seq_len, None, None
    if encoder_hidden_states_mask.shape[:2] != (batch_size, text_seq_len):
        raise ValueError(f"`encoder_hidden_states_mask` shape {encoder_hidden_states_mask.shape} must match "
                         f"(batch_size, text_seq_len)=({batch_size}, {text_seq_len}).")
    mask = encoder_hidden_states_mask.to(torch.bool)
    positions = torch.arange(text_seq_len, device=encoder_hidden_states.device, dtype=torch.long)
    last = torch.where(mask, positions, positions.new_zeros(())).max(dim=1).values + 1
    return text_seq_len, torch.where(mask.any(dim=1), last, text_seq_len), mask


def _no_host_copies(model: Any, device: torch.device | str) -> None:
    """Keep the Qwen-Image forward free of host-to-device copies: ``_text_len_without_copy`` in diffusers' module,
    and the rotary tables put on ``device`` now (``QwenEmbedRope._get_device_freqs`` caches them per device) rather
    than by a pageable copy inside the first sampling step."""
    from diffusers.models.transformers import transformer_qwenimage  # heavy

    transformer_qwenimage.compute_text_seq_len_from_mask = _text_len_without_copy
    pos_embed = unwrap_model(model).pos_embed
    try:
        device = torch.device(device)
    except RuntimeError:  # a device type this torch build lacks (npu without torch_npu): nothing runs there
        return
    if pos_embed.pos_freqs.device.type != "meta" and hasattr(pos_embed, "_get_device_freqs"):
        pos_embed._get_device_freqs(device)


@dataclass
class TextEncoders:
    """Qwen-Image's frozen text encoder (Qwen2.5-VL, text path only) and its tokenizer."""

    tokenizer: Any
    text_encoder: Any

    @property
    def device(self) -> torch.device:
        return self.text_encoder.device


# ----------------------------------------------------------------------------------------------- geometry
def _vae_config(family: "QwenImage", vae_or_config: Any) -> Any:
    """The VAE config of a VAE module, a config (object or dict), a Qwen-Image folder or its vae folder."""
    if isinstance(vae_or_config, (str, os.PathLike)):
        folder = Path(vae_or_config).expanduser()
        file = folder / "config.json" if (folder / "config.json").is_file() else folder / "vae" / "config.json"
        if not file.is_file():
            family.check_folder(folder, ("vae",))
        return json.loads(file.read_text())
    if isinstance(vae_or_config, torch.nn.Module):
        return model_config(vae_or_config)
    return vae_or_config


def _latent_stats(vae: Any, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, 1 / std) of the VAE config, shaped (1, C, 1, 1, 1) as the pipeline builds them."""
    config = model_config(vae)
    channels = int(config_get(config, "z_dim"))
    shape = (1, channels, 1, 1, 1)
    mean = torch.tensor(config_get(config, "latents_mean")).view(shape).to(device, dtype)
    inv_std = 1.0 / torch.tensor(config_get(config, "latents_std")).view(shape).to(device, dtype)
    return mean, inv_std


def _grid(image_tokens: int) -> tuple[int, int]:
    """A (rows, cols) packed grid with ``image_tokens`` cells, as square as possible (the planner gives only L)."""
    rows = math.isqrt(int(image_tokens))
    while image_tokens % rows:
        rows -= 1
    return rows, image_tokens // rows


# --------------------------------------------------------------------------------------------- the adapter
class QwenImage(ModelFamily):
    """Qwen-Image: masked Qwen2.5-VL text embeddings (``prompt_embeds``, ``prompt_embeds_mask``), 2x2-packed video-VAE
    latents normalised per channel, the sigma fed as the timestep, no guidance embedding, and true CFG rescaled to
    the conditional velocity's per-token norm (``combine_guidance``)."""

    name = "qwen-image"
    pipeline_classes = ("QwenImagePipeline",)
    transformer_classes = ("QwenImageTransformer2DModel",)
    text_components = TEXT_COMPONENTS
    embedding_keys = ("prompt_embeds", "prompt_embeds_mask")
    # QwenImagePipeline.__call__: 50 steps, true_cfg_scale 4.0, default_sample_size 128 x vae_scale_factor 8 = 1024 px,
    # max_sequence_length 512; CFG runs only with a negative prompt, and the Qwen-Image model card passes " ".
    defaults = SamplerDefaults(steps=50, guidance=None, height=1024, width=1024, max_sequence_length=512,
                               cfg_scale=4.0, negative_prompt=" ")
    lora_target_modules = LORA_TARGET_MODULES
    recipes = {"grpo": "scripts/recipes/verl_omni_qwen_image_ocr.yaml"}  # the launchers' defaults (scripts/recipes/)
    block_lists = ("transformer_blocks",)
    sequence_parallel = False

    # ------------------------------------------------------------------------------------------- loading
    def check_folder(self, path, components=None):
        """``path`` as a Path if it holds the Qwen-Image ``components`` (default: all); else FileNotFoundError."""
        wanted = COMPONENTS if components is None else components
        return check_components(path, _COMPONENT_FILES, wanted, "Qwen-Image", _BUILD_HINT)

    def transformer_folder(self, path):
        """``path/transformer``, or ``path`` itself when it is a transformer folder."""
        return component_folder(path, "transformer", self.check_folder)

    def build_transformer(self, path, dtype=torch.float32):
        """The transformer on the meta device from its config.json, its rotary tables rebuilt on the CPU (they are
        plain tensors no weight load fills), RMSNorms kept in the compute dtype, tagged with this family."""
        from diffusers import QwenImageTransformer2DModel  # heavy

        model = build_on_meta(QwenImageTransformer2DModel, self.transformer_folder(path), dtype)
        _fresh_rope(model)
        keep_attention_dtype(model)
        return tag(model, self)

    def load_transformer(self, path, dtype=torch.float32, device="cpu"):
        """The transformer with its weights on ``device``, adapted to it (``prepare_for_device``), tagged."""
        from diffusers import QwenImageTransformer2DModel  # heavy

        model = QwenImageTransformer2DModel.from_pretrained(self.transformer_folder(path), torch_dtype=dtype,
                                                            local_files_only=True).to(device)
        keep_attention_dtype(model)
        self.prepare_for_device(model, device)
        return tag(model, self)

    def vae_class(self):
        from diffusers import AutoencoderKLQwenImage  # heavy

        return AutoencoderKLQwenImage

    def load_vae(self, path, dtype=torch.float32, device="cpu"):
        """The frozen ``AutoencoderKLQwenImage`` (eval mode, no grad)."""
        from diffusers import AutoencoderKLQwenImage  # heavy

        folder = component_folder(path, "vae", self.check_folder)
        vae = AutoencoderKLQwenImage.from_pretrained(folder, torch_dtype=dtype, local_files_only=True)
        return vae.to(device).eval().requires_grad_(False)

    def load_text_encoders(self, path, dtype=torch.float32, device="cpu"):
        """The frozen Qwen2.5-VL text encoder and its Qwen2 tokenizer (``TextEncoders``)."""
        from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer  # heavy

        folder = self.check_folder(path, TEXT_COMPONENTS)
        encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder / "text_encoder", dtype=dtype,
                                                                     local_files_only=True)
        return TextEncoders(tokenizer=Qwen2Tokenizer.from_pretrained(folder / "tokenizer", local_files_only=True),
                            text_encoder=encoder.to(device).eval().requires_grad_(False))

    @torch.no_grad()
    def encode_prompts(self, encoders, prompts, max_sequence_length):
        """``QwenImagePipeline.encode_prompt`` on the batch (template, last hidden state, the 34 template tokens and
        the padding cut, the first ``max_sequence_length`` tokens kept), each row padded with zeros to
        ``max_sequence_length`` beside its mask (1 on kept tokens, int64 as the pipeline's)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise ValueError("encode_prompts needs a non-empty list of prompt strings")
        if not 1 <= max_sequence_length <= MAX_TEXT_TOKENS:
            raise ValueError(f"max_sequence_length must be in [1, {MAX_TEXT_TOKENS}] (QwenImagePipeline's limit), got "
                             f"{max_sequence_length}")
        texts = [PROMPT_TEMPLATE.format(p) for p in prompts]
        tokens = encoders.tokenizer(texts, max_length=MAX_TEXT_TOKENS + TEMPLATE_DROP, padding=True, truncation=True,
                                    return_tensors="pt")
        device = encoders.device
        hidden = encoders.text_encoder(input_ids=tokens.input_ids.to(device),
                                       attention_mask=tokens.attention_mask.to(device),
                                       output_hidden_states=True).hidden_states[-1]
        attended = tokens.attention_mask.bool()
        embeds = hidden.new_zeros(len(prompts), max_sequence_length, hidden.shape[-1])
        mask = torch.zeros(len(prompts), max_sequence_length, dtype=torch.long)
        for row, keep in enumerate(attended):
            kept = hidden[row][keep.to(device)][TEMPLATE_DROP:TEMPLATE_DROP + max_sequence_length]
            embeds[row, :kept.shape[0]] = kept
            mask[row, :kept.shape[0]] = 1
        full = encoders.tokenizer(texts).input_ids  # untruncated, to tell which prompts were cut
        truncated = [len(ids) - TEMPLATE_DROP > max_sequence_length for ids in full]
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask.to(device)}, truncated

    def max_sequence_length_limit(self) -> int:
        """1024: the longest prompt QwenImagePipeline takes (its check_inputs)."""
        return MAX_TEXT_TOKENS

    def collate(self, cond):
        """Cut the padding columns past the last token any row of the batch keeps (CPU, before the device copy)."""
        mask = cond["prompt_embeds_mask"]
        used = mask.bool().any(0).nonzero()
        width = int(used.max()) + 1 if used.numel() else 1
        return {**cond, "prompt_embeds": cond["prompt_embeds"][:, :width], "prompt_embeds_mask": mask[:, :width]}

    # ------------------------------------------------------------------------------------------- latents
    def latent_geometry(self, vae_or_config, height, width):
        """``LatentGeometry`` with the pipeline's scale factor ``2 ** len(temperal_downsample)`` and ``z_dim``
        channels; ValueError naming valid sizes unless both sides are multiples of twice the factor."""
        config = _vae_config(self, vae_or_config)
        factor = 2 ** len(config_get(config, "temperal_downsample"))  # QwenImagePipeline.vae_scale_factor
        multiple = 2 * factor
        for name, flag, value in (("height", "--h", height), ("width", "--w", width)):
            if int(value) != value or value < multiple or value % multiple:
                lower = max(multiple, int(value) // multiple * multiple)
                raise ValueError(f"image {name} {value} ({flag}) must be a positive multiple of {multiple} for "
                                 f"Qwen-Image (VAE scale factor {factor} x 2x2 packing): pass e.g. {flag} {lower} or "
                                 f"{lower + multiple}")
        return LatentGeometry(int(height), int(width), factor, int(config_get(config, "z_dim")))

    def conditioning(self, geometry, cond, guidance, device):
        """The packed grid (1 frame, rows, cols) as python ints: every velocity call builds ``img_shapes`` for its
        own rows from it. ``guidance`` is ignored, as the pipeline ignores ``guidance_scale`` for Qwen-Image."""
        return {"img_shape": (1, geometry.latent_h // 2, geometry.latent_w // 2)}

    def combine_guidance(self, v_cond, v_uncond, scale):
        """QwenImagePipeline's true CFG: ``u + s (c - u)`` rescaled per token to the conditional velocity's norm."""
        combined = v_uncond + scale * (v_cond - v_uncond)
        return combined * (torch.norm(v_cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))

    def predict_velocity(self, transformer, latents, sigma, cond, shared):
        """One transformer call as the pipeline makes it (timestep = sigma, the text mask, ``img_shapes`` of this
        call's rows), float32 out; inputs cast to the model's dtype unless autocast is on. No host sync."""
        return self.transformer_call(transformer, latents, sigma, cond, [shared["img_shape"]])

    def transformer_call(self, transformer: Any, latents: torch.Tensor, sigma: Any, cond: dict[str, torch.Tensor],
                         img_shapes: list[tuple[int, int, int]]) -> torch.Tensor:
        """``predict_velocity``'s transformer call on ``latents`` made of the packed grids ``img_shapes`` (an edit
        family: the target's, then the source's), float32 out."""
        embeds, mask = cond["prompt_embeds"], cond["prompt_embeds_mask"]
        batch = latents.shape[0]
        if embeds.shape[0] != batch or tuple(mask.shape) != tuple(embeds.shape[:2]):
            raise ValueError(f"latents have {batch} rows but prompt_embeds {tuple(embeds.shape)} and "
                             f"prompt_embeds_mask {tuple(mask.shape)}: pass one (T, D) embedding and (T,) mask per "
                             "row (repeat them per sample)")
        timestep = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device)
        timestep = timestep.expand(batch) if timestep.ndim == 0 else timestep.reshape(batch)
        if not torch.is_autocast_enabled(latents.device.type):
            dtype = model_dtype(transformer)
            latents, embeds = latents.to(dtype), embeds.to(dtype)
        out = transformer(hidden_states=latents, timestep=timestep, encoder_hidden_states=embeds,
                          encoder_hidden_states_mask=mask, img_shapes=[list(img_shapes)] * batch,
                          return_dict=False)[0]
        return out.float()

    def sigmas(self, steps, image_seq_len, scheduler=None):
        """``FlowMatchEulerDiscreteScheduler.set_timesteps(sigmas=linspace(1, 1/S, S), mu=calculate_shift(L))`` with
        the folder's scheduler config (Qwen-Image's where it has none), in the scheduler's numpy float32 arithmetic,
        then a final 0."""
        if int(steps) < 2:  # one step: the stretch divides 1 - sigma_last = 0 by itself (the pipeline gives NaN)
            raise ValueError(f"Qwen-Image samples with >= 2 steps (its scheduler's shift_terminal stretch is NaN for "
                             f"one step), got {steps}: pass --sampling_steps 2 or more")
        c = scheduler_settings(scheduler, SCHEDULER_CONFIG, "Qwen-Image",
                               {"use_dynamic_shifting": True, "time_shift_type": "exponential"})
        mu = flux_mu(int(image_seq_len), c["base_image_seq_len"], c["max_image_seq_len"], c["base_shift"],
                     c["max_shift"])
        t = np.linspace(1.0, 1 / int(steps), int(steps)).astype(np.float32)
        shifted = time_shift(mu, t, 1.0)
        if c.get("shift_terminal"):  # stretch_shift_to_terminal: the last sigma becomes shift_terminal
            one_minus = 1 - shifted
            shifted = 1 - one_minus / (one_minus[-1] / (1 - c["shift_terminal"]))
        sigmas = torch.from_numpy(np.asarray(shifted)).to(torch.float32)
        return torch.cat([sigmas, torch.zeros(1, dtype=torch.float32)])

    def decode(self, vae, latents, geometry, micro_batch=None):
        """Packed latents -> images in [0, 1]: unpacked to one frame, de-normalised with the VAE config's
        latents_mean/std, decoded (chunks of ``micro_batch``) and mapped from [-1, 1] as the pipeline does."""
        dtype = model_dtype(vae)
        z = unpack_latents(latents, geometry).unsqueeze(2).to(dtype)  # (B, C, 1, h, w)
        mean, inv_std = _latent_stats(vae, z.device, dtype)
        z = z / inv_std + mean
        step = micro_batch or z.shape[0]
        images = torch.cat([vae.decode(chunk, return_dict=False)[0][:, :, 0] for chunk in z.split(step)])
        return (images * 0.5 + 0.5).clamp(0, 1).float()

    @torch.no_grad()
    def encode(self, vae, images, geometry, micro_batch=None):
        """Images in [0, 1] -> packed latents (posterior mode, normalised per channel): ``decode``'s inverse."""
        check_encode_images(images, geometry)
        dtype = model_dtype(vae)
        x = (images * 2 - 1).to(dtype).unsqueeze(2)  # (B, 3, 1, H, W): one frame
        step = micro_batch or x.shape[0]
        z = torch.cat([vae.encode(chunk).latent_dist.mode() for chunk in x.split(step)])
        mean, inv_std = _latent_stats(vae, z.device, z.dtype)
        z = ((z - mean) * inv_std)[:, :, 0].float()
        if tuple(z.shape[1:]) != geometry.latent_shape:
            raise ValueError(f"the VAE gives latents of shape {tuple(z.shape[1:])} but the geometry expects "
                             f"{geometry.latent_shape}; build the geometry with latent_geometry(vae, h, w)")
        return pack_latents(z)

    # ---------------------------------------------------------------------------------- FLOPs and memory plan
    def transformer_flops(self, config, image_tokens, text_tokens, batch=1, *, backward=False, weight_grads=True):
        """Per sample, width D, N = L + T tokens: each block 24·N·D² (image and text q/k/v/out and 4x MLPs)
        + 4·N²·D (QKᵀ and AV over the joint sequence) + 24·D² (the two adaLN D->6D modulations); plus img_in,
        txt_in, the timestep MLP (256->D->D), the output adaLN (D->2D) and projection (D->p²·out)."""
        D = config_get(config, "num_attention_heads") * config_get(config, "attention_head_dim")
        L, T = int(image_tokens), int(text_tokens)
        N = L + T
        in_ch = config_get(config, "in_channels")
        out = (config_get(config, "out_channels") or in_ch) * config_get(config, "patch_size") ** 2
        layers = config_get(config, "num_layers")
        embedders = 2 * L * in_ch * D + 2 * T * config_get(config, "joint_attention_dim") * D + 2 * (256 * D + D * D)
        blocks = layers * (24 * N * D * D + 4 * N * N * D + 24 * D * D)
        output = 2 * D * 2 * D + 2 * L * D * out
        forward = batch * (embedders + blocks + output)
        if not backward:
            return forward
        if weight_grads:
            return 3 * forward
        return 2 * forward + batch * layers * 4 * N * N * D

    def forward_tokens(self, args, kwargs):
        """``(batch, image tokens, text tokens)`` of one transformer call (the FLOP meter's hook)."""
        x = kwargs.get("hidden_states", args[0] if args else None)  # (B, L, C) packed
        text = kwargs.get("encoder_hidden_states", args[1] if len(args) > 1 else None)  # (B, T, D)
        return None if x is None or text is None else (x.shape[0], x.shape[1], text.shape[1])

    def example_inputs(self, config, batch, image_tokens, text_tokens, dtype, device):
        """Keyword arguments of one forward on empty tensors, ``img_shapes`` a grid of ``image_tokens`` cells."""
        rows, cols = _grid(image_tokens)
        return dict(
            hidden_states=torch.empty(batch, image_tokens, config_get(config, "in_channels"), device=device,
                                      dtype=dtype),
            encoder_hidden_states=torch.empty(batch, text_tokens, config_get(config, "joint_attention_dim"),
                                              device=device, dtype=dtype),
            encoder_hidden_states_mask=torch.ones(batch, text_tokens, device=device, dtype=torch.long),
            timestep=torch.empty(batch, device=device),
            img_shapes=[[(1, rows, cols)]] * batch,
            return_dict=False)

    # ------------------------------------------------------------------------------------- device, export
    def prepare_for_device(self, transformer, device, *, param_dtype=None, attention_backend="auto"):
        """No host-to-device copy in the forward (``_no_host_copies``), then the attention kernel
        (``choose_attention``). The rotary tables need no change on an NPU: ``QwenEmbedRope`` builds them from
        float32 angles as complex64 (no float64), though the NPU must then run complex64 products."""
        model = unwrap_model(transformer)
        _no_host_copies(model, device)
        npu = devices.device_type(device) == "npu"
        done = []
        if npu:
            done.append("pos_embed: QwenEmbedRope unchanged (complex64 tables from float32 angles, no float64 to "
                        "replace; the NPU runs its complex64 rotary products)")
        return done + choose_attention(model, device, param_dtype, attention_backend)

    def pipeline_class(self) -> type:
        """``QwenImagePipeline`` (its QwenImageLoraLoaderMixin writes and reads LoRA exports)."""
        from diffusers import QwenImagePipeline  # heavy

        return QwenImagePipeline

    def transformer_class(self) -> type:
        """``QwenImageTransformer2DModel``: what a full fine-tune's export is a folder of."""
        from diffusers import QwenImageTransformer2DModel  # heavy

        return QwenImageTransformer2DModel


# ------------------------------------------------------------------------------------------------- presets
TINY_HEIGHT = TINY_WIDTH = 64  # VAE scale factor 4: 64 px -> 16x16x16 latents -> 64 packed tokens of 64 channels
TINY_TEXT_WIDTH = 32  # the tiny text encoder's hidden size = the tiny transformer's joint_attention_dim
TINY_TRANSFORMER_CONFIG: dict[str, Any] = {**TRANSFORMER_CONFIG, "num_layers": 2, "attention_head_dim": 16,
                                           "num_attention_heads": 2, "joint_attention_dim": TINY_TEXT_WIDTH,
                                           "axes_dims_rope": (4, 6, 6)}
TINY_VAE_CONFIG: dict[str, Any] = {**VAE_CONFIG, "base_dim": 8, "dim_mult": [1, 2, 2], "num_res_blocks": 1,
                                   "temperal_downsample": [False, True]}  # Qwen-Image's 16 channels, mean and std
TINY_CONDITIONING_GAIN = 5.0  # on the timestep MLP's and the text values' outputs (see _tiny_components)
TINY_TEXT_KEY_GAIN = 1.5  # on the text keys' RMSNorm weights
TINY_VOCAB_WORDS = 3000  # whole words of CLIP's BPE vocabulary the tiny tokenizer learns as single tokens


def _tiny_vocab(templates: tuple[str, ...] = (PROMPT_TEMPLATE,)) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A small byte-level BPE in Qwen2's pre-tokenisation (its split regex + byte-level alphabet), trained by the
    ``tokenizers`` library on the chat ``templates`` and the first CLIP BPE whole words, so a template's system turn
    is exactly the tokens its pipeline drops (34 here, as with Qwen2.5's real vocabulary) and English words are one
    token each. Deterministic: the same vocabulary and merges in every process. Special tokens follow, in Qwen's order."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers  # heavy
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX  # heavy

    words: list[str] = []
    for merge in _open_clip_merges():
        token = "".join(merge.split())
        word = token[:-4] if token.endswith("</w>") else ""
        if len(word) >= 2 and word.isascii() and word.isalpha():
            words.append(word)
        if len(words) >= TINY_VOCAB_WORDS:
            break
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=1 << 20, min_frequency=0, show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([t.format("") for t in templates] + [" " + w for w in words] + words, trainer)
    model = json.loads(bpe.to_str())["model"]
    vocab = dict(model["vocab"])
    for special in SPECIAL_TOKENS:
        vocab[special] = len(vocab)
    return vocab, [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]


def save_tiny_tokenizer(out_dir: str | os.PathLike, templates: tuple[str, ...] = (PROMPT_TEMPLATE,)) -> Path:
    """Write the tiny Qwen2 tokenizer (``Qwen2Tokenizer.from_pretrained`` loads it; the pipelines' ``templates``
    split as with Qwen2.5's vocabulary)."""
    from tokenizers import AddedToken  # heavy
    from transformers import Qwen2Tokenizer  # heavy

    vocab, merges = _tiny_vocab(tuple(templates))
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=32768)
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS], special_tokens=True)
    tok.save_pretrained(Path(out_dir))
    return Path(out_dir)


def _text_encoder_config(vocab_size: int, tiny: bool) -> Any:
    """Qwen2.5-VL-7B's config, or the tiny one (2 text layers of width 32, a 1-block vision tower) whose special
    ids are the tiny tokenizer's."""
    from transformers import Qwen2_5_VLConfig  # heavy

    if not tiny:
        return Qwen2_5_VLConfig(text_config=dict(TEXT_ENCODER_CONFIG), vision_config=dict(VISION_CONFIG),
                                tie_word_embeddings=False, **VISION_TOKEN_IDS)
    first_special = vocab_size - len(SPECIAL_TOKENS)
    ids = {name: first_special + SPECIAL_TOKENS.index(token) for name, token in (
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"))}
    text = {**TEXT_ENCODER_CONFIG, "vocab_size": vocab_size, "hidden_size": TINY_TEXT_WIDTH,
            "intermediate_size": 2 * TINY_TEXT_WIDTH, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "max_window_layers": 2, "max_position_embeddings": 4096,
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},  # head_dim 16: 8 frequencies
            "bos_token_id": first_special, "eos_token_id": first_special + 2}
    vision = {**VISION_CONFIG, "depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
              "out_hidden_size": TINY_TEXT_WIDTH, "fullatt_block_indexes": [0]}
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)


def _model_index() -> dict:
    """Qwen/Qwen-Image's model_index.json (component -> (library, class))."""
    import diffusers  # heavy

    return {"_class_name": "QwenImagePipeline", "_diffusers_version": diffusers.__version__,
            "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
            "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
            "tokenizer": ["transformers", "Qwen2Tokenizer"],
            "transformer": ["diffusers", "QwenImageTransformer2DModel"],
            "vae": ["diffusers", "AutoencoderKLQwenImage"]}


def _tiny_components(seed: int, vocab_size: int) -> dict[str, Any]:
    """The tiny models, each from its own derived seed, in eval mode."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel  # heavy
    from transformers import Qwen2_5_VLForConditionalGeneration  # heavy

    def seeded(name: str) -> None:
        torch.manual_seed(derive_seed(seed, "tiny-qwen-image", name))

    seeded("transformer")
    transformer = QwenImageTransformer2DModel(**TINY_TRANSFORMER_CONFIG).eval()
    # At default init the prompt moves |v| by ~2% (the text stream is layer-normed before attention and its keys
    # RMS-normed, so it gets an even share of attention with small values); a trained model's is large. Larger text
    # values (add_v_proj) and sharper text keys (norm_added_k) make it ~18%, the timestep MLP's gain sigma's ~45%.
    with torch.no_grad():
        layers = [transformer.time_text_embed.timestep_embedder.linear_2]
        layers += [block.attn.add_v_proj for block in transformer.transformer_blocks]
        for layer in layers:
            layer.weight.mul_(TINY_CONDITIONING_GAIN)
            layer.bias.mul_(TINY_CONDITIONING_GAIN)
        for block in transformer.transformer_blocks:
            block.attn.norm_added_k.weight.mul_(TINY_TEXT_KEY_GAIN)
    seeded("vae")
    vae = AutoencoderKLQwenImage(**TINY_VAE_CONFIG).eval()
    seeded("text_encoder")
    text_encoder = Qwen2_5_VLForConditionalGeneration(_text_encoder_config(vocab_size, tiny=True)).eval()
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder,
            "scheduler": FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)}


def _write_tiny(tmp: Path, seed: int) -> None:
    """Save every tiny component into ``tmp`` in Qwen/Qwen-Image's layout."""
    save_tiny_tokenizer(tmp / "tokenizer")
    vocab_size = len(json.loads((tmp / "tokenizer" / "tokenizer.json").read_text())["model"]["vocab"])
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG untouched
        parts = _tiny_components(seed, vocab_size)
    for name, module in parts.items():
        module.save_pretrained(tmp / name)
    (tmp / "model_index.json").write_text(json.dumps(_model_index(), indent=2, sort_keys=True) + "\n")
    info = {"preset": "qwen-image-tiny", "seed": seed, "height": TINY_HEIGHT, "width": TINY_WIDTH,
            "vae_scale_factor": 2 ** len(TINY_VAE_CONFIG["temperal_downsample"]),
            "seq_len": (TINY_HEIGHT // 8) * (TINY_WIDTH // 8)}
    (tmp / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def build_tiny(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Write a seeded tiny Qwen-Image folder (``QwenImagePipeline.from_pretrained`` loads it; 64 px images; same
    seed, byte-identical files) to ``out_dir``, atomically; FileExistsError if ``out_dir`` is non-empty."""
    return write_atomically(out_dir, lambda tmp: _write_tiny(tmp, int(seed)))


def _write_config_folder(tmp: Path) -> None:
    """Save Qwen-Image's configs (models instantiated on the meta device, so no memory) into ``tmp``."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel  # heavy

    for name, cls, config in (("transformer", QwenImageTransformer2DModel, TRANSFORMER_CONFIG),
                              ("vae", AutoencoderKLQwenImage, VAE_CONFIG)):
        with torch.device("meta"):  # diffusers fills and serialises the full config, as save_pretrained would
            cls(**config).save_config(tmp / name)
    _text_encoder_config(TEXT_ENCODER_CONFIG["vocab_size"], tiny=False).save_pretrained(tmp / "text_encoder")
    FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG).save_pretrained(tmp / "scheduler")
    save_tiny_tokenizer(tmp / "tokenizer")
    (tmp / "tokenizer" / "README.txt").write_text(
        "NOT Qwen-Image's tokenizer: the small byte-level BPE stand-in of fastvideo.models.qwen_image (Qwen2.5's "
        "151k vocabulary is not available offline). Same pre-tokenisation, chat template split (34 template tokens) "
        "and special tokens, but other ids: do not use it to encode real prompts.\n")
    (tmp / "model_index.json").write_text(json.dumps(_model_index(), indent=2, sort_keys=True) + "\n")
    info = {"preset": "qwen-image-config", "weights": False, "source": "Qwen/Qwen-Image (configs only)",
            "vae_scale_factor": 2 ** len(VAE_CONFIG["temperal_downsample"]),
            "tokenizer": "stand-in, not Qwen-Image's: the fastvideo tiny byte-level BPE"}
    (tmp / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def write_config(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Write Qwen/Qwen-Image's diffusers layout with its real configs and no weights (a stand-in tokenizer) to
    ``out_dir``, for meta-device builds (memory planning); ``seed`` is ignored. Atomic like ``build_tiny``."""
    return write_atomically(out_dir, _write_config_folder)
