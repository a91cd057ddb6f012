"""The Wan 2.1 / 2.2 text-to-video family (diffusers ``WanPipeline`` + ``WanTransformer3DModel`` +
``AutoencoderKLWan``): one UMT5 text encoder, a (1, 2, 2)-patch video DiT, a causal video VAE (4x in time, 8x in
space, per-channel latent mean/std) and, in the stock pipeline, UniPC with Wan's ``flow_shift``.

Layouts the rest of the project sees (``Wan``, the ``ModelFamily`` adapter):

- text: ``prompt_embeds`` ``(N, T, D)``: UMT5's last hidden state of the cleaned prompt (``prompt_clean``), zeroed
  after each prompt's own tokens, as ``WanPipeline._get_t5_prompt_embeds``; the transformer attends over all ``T``
  (no mask), so nothing is trimmed on collate.
- latents: a video's ``(C, F', h, w)`` latents packed into ``(L, 4C)`` tokens of 1x2x2 patches, frame-major then
  row-major (``VideoGeometry``, ``pack_video`` / ``unpack_video``): the frame axis lives inside ``L``, in the order
  the transformer's own patch embedding flattens, so a sequence-parallel split of ``L`` keeps frames contiguous.
- time: the transformer gets ``sigma * 1000``, computed on the device.
- sampling: the flow-matching Euler grid with the folder's ``flow_shift`` (``common.static_shift_sigmas``): the
  stock pipeline samples with UniPC on the same shifted grid; RL needs the per-step Euler/SDE transition, so the
  ODE end point equals ``WanPipeline`` with ``FlowMatchEulerDiscreteScheduler(shift=flow_shift)``, not with UniPC.
- decode: ``latents / (1 / std) + mean`` per channel, the VAE's decode, ``(x / 2 + 0.5).clamp(0, 1)``: videos
  ``(B, F, 3, H, W)`` float32 in [0, 1] (``WanPipeline(output_type="pt")``'s layout), a sample at a time or in
  micro-batches.

Presets (``wan_presets.py``): ``wan-tiny`` (random weights the stock pipeline loads) and the real configs of
Wan2.1-T2V-14B for the planner.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fastvideo.models import common
from fastvideo.models.attention import choose_attention
from fastvideo.models.base import (ModelFamily, SamplerDefaults, build_on_meta, check_components, component_folder,
                                   config_get, model_config, model_dtype, scheduler_settings, tag, unwrap_model)
from fastvideo.models.common import keep_attention_dtype

_COMPONENT_FILES: dict[str, tuple[str, ...]] = {
    "transformer": ("config.json",),
    "vae": ("config.json",),
    "text_encoder": ("config.json",),
    "tokenizer": ("tokenizer.json", "spiece.model"),
    "scheduler": ("scheduler_config.json",),
}
COMPONENTS: tuple[str, ...] = tuple(_COMPONENT_FILES)
TEXT_COMPONENTS: tuple[str, ...] = ("tokenizer", "text_encoder")
_HINT = ("pass a diffusers Wan folder (e.g. a local download of Wan-AI/Wan2.1-T2V-14B-Diffusers) or build a tiny one "
         "with `python -m fastvideo.tiny --preset wan-tiny --out DIR`")

MAX_TEXT_TOKENS = 512  # WanPipeline.__call__(max_sequence_length=512); UMT5's relative positions take longer, but
DEFAULT_TEXT_TOKENS = 512  # the Wan models were trained at 512 (and the I2V attention hardcodes 512 text tokens)
NUM_TRAIN_TIMESTEPS = 1000
FLOW_SHIFT = 3.0  # Wan2.1's scheduler_config.json flow_shift (480p; diffusers' docs: 5.0 for 720p)
PATCH = (1, 2, 2)  # WanTransformer3DModel.patch_size of every released Wan2.1 / Wan2.2 checkpoint

# Default LoRA targets: the self- and cross-attention projections and the FFN of every block, as DiffSynth-Studio's
# and Flow-GRPO's Wan2.1 LoRA training target (q, k, v, o, ffn.0, ffn.2 in Wan's own naming; diffusers' names here).
LORA_TARGET_MODULES: tuple[str, ...] = (
    "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
    "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
    "ffn.net.0.proj", "ffn.net.2",
)
WAN_SCHEDULER_CONFIG = {"num_train_timesteps": NUM_TRAIN_TIMESTEPS, "flow_shift": FLOW_SHIFT,
                        "use_flow_sigmas": True, "prediction_type": "flow_prediction"}


@dataclass
class TextEncoder:
    """Wan's frozen UMT5 encoder and its tokenizer."""

    tokenizer: Any
    encoder: Any

    @property
    def device(self) -> torch.device:
        return self.encoder.device


# ------------------------------------------------------------------------------------------ latent geometry
@dataclass(frozen=True)
class VideoGeometry(common.LatentGeometry):
    """A video's size and the VAE facts that fix its latent and packed-token shapes: ``frames`` pixel frames become
    ``(frames - 1) / temporal + 1`` latent frames of ``(height / spatial) x (width / spatial)``, packed 1x2x2 (the
    image geometry's rows, columns and channels, with the frame axis in front)."""

    frames: int = 1
    temporal_scale_factor: int = 4

    @property
    def latent_frames(self) -> int:
        return (self.frames - 1) // self.temporal_scale_factor + 1

    @property
    def seq_len(self) -> int:
        """Packed video tokens L (latent frames x rows x cols of 2x2 patches)."""
        return self.latent_frames * (self.latent_h // 2) * (self.latent_w // 2)

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        """Unpacked latent shape (channels, frames, h, w) without the batch."""
        return (self.latent_channels, self.latent_frames, self.latent_h, self.latent_w)


def _vae_facts(vae_or_config: Any) -> tuple[int, int, int]:
    """(spatial factor, temporal factor, latent channels) of an AutoencoderKLWan, its config or a folder."""
    config = common._vae_config(vae_or_config)
    spatial = config_get(config, "scale_factor_spatial", 8) or 8
    temporal = config_get(config, "scale_factor_temporal", 4) or 4
    return int(spatial), int(temporal), int(config_get(config, "z_dim", 16))


def latent_geometry(vae_or_config: Any, height: int, width: int, frames: int) -> VideoGeometry:
    """``VideoGeometry`` for ``frames`` x ``height`` x ``width`` videos; ValueError naming valid sizes (the pipeline
    rounds them with a warning; a trainer must not silently train another size)."""
    spatial, temporal, channels = _vae_facts(vae_or_config)
    multiple = spatial * PATCH[1]
    for name, flag, value in (("height", "--h", height), ("width", "--w", width)):
        if int(value) != value or value < multiple or value % multiple:
            lower = max(multiple, int(value) // multiple * multiple)
            raise ValueError(f"video {name} {value} ({flag}) must be a positive multiple of {multiple} (VAE scale "
                             f"factor {spatial} x patch 2): pass e.g. {flag} {lower} or {lower + multiple}")
    if int(frames) != frames or frames < 1 or (frames - 1) % temporal:
        lower = max(1, (int(frames) - 1) // temporal * temporal + 1)
        raise ValueError(f"--num_frames {frames} must be {temporal} k + 1 (the VAE compresses time {temporal}x after "
                         f"the first frame): pass e.g. --num_frames {lower} or {lower + temporal}")
    return VideoGeometry(int(height), int(width), spatial, channels, frames=int(frames),
                         temporal_scale_factor=temporal)


def pack_video(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, F, h, w) latents -> (B, F (h/2)(w/2), 4C) tokens of 1x2x2 patches, frame-major then row-major."""
    b, c, f, h, w = latents.shape
    if h % 2 or w % 2:
        raise ValueError(f"latent height/width must be even to pack 2x2 patches, got {h}x{w}")
    x = latents.view(b, c, f, h // 2, 2, w // 2, 2)  # B C F h2 2 w2 2
    return x.permute(0, 2, 3, 5, 1, 4, 6).reshape(b, f * (h // 2) * (w // 2), c * 4)


def unpack_video(tokens: torch.Tensor, geometry: VideoGeometry) -> torch.Tensor:
    """(B, L, 4C) packed tokens -> (B, C, F, h, w) latents; the inverse of ``pack_video``."""
    b, length, channels = tokens.shape
    if (length, channels) != geometry.packed_shape:
        raise ValueError(f"packed latents have shape (L, C) = {(length, channels)} but the geometry "
                         f"{geometry.frames}x{geometry.height}x{geometry.width} expects {geometry.packed_shape}")
    c, f, h, w = geometry.latent_shape
    x = tokens.view(b, f, h // 2, w // 2, c, 2, 2)  # B F h2 w2 C 2 2
    return x.permute(0, 4, 1, 2, 5, 3, 6).reshape(b, c, f, h, w)


def _latent_stats(vae: Any, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE's per-channel ``latents_mean`` and ``1 / latents_std`` as ``(1, C, 1, 1, 1)`` tensors like ``z``,
    computed as ``WanPipeline`` does (the reciprocal in float32, then cast)."""
    config = model_config(vae)
    channels = int(config_get(config, "z_dim"))
    mean = torch.tensor(config_get(config, "latents_mean")).view(1, channels, 1, 1, 1).to(z.device, z.dtype)
    inv_std = 1.0 / torch.tensor(config_get(config, "latents_std")).view(1, channels, 1, 1, 1).to(z.device, z.dtype)
    return mean, inv_std


@torch.no_grad()
def decode(vae: Any, latents: torch.Tensor, geometry: VideoGeometry, micro_batch: int | None = None) -> torch.Tensor:
    """Packed latents (B, L, C) -> videos (B, F, 3, H, W) float32 in [0, 1], as ``WanPipeline`` decodes them
    (``latents / (1 / std) + mean`` in the VAE's dtype, then ``(x / 2 + 0.5).clamp(0, 1)``); ``micro_batch``
    videos per VAE call (default: one, the pipeline's causal decoder caches features per video anyway)."""
    z = unpack_video(latents, geometry).to(model_dtype(vae))
    mean, inv_std = _latent_stats(vae, z)
    z = z / inv_std + mean
    step = max(1, int(micro_batch or 1))
    videos = torch.cat([vae.decode(chunk, return_dict=False)[0] for chunk in z.split(step)])  # (B, 3, F, H, W)
    return (videos.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4).contiguous()


@torch.no_grad()
def encode(vae: Any, videos: torch.Tensor, geometry: VideoGeometry, micro_batch: int | None = None) -> torch.Tensor:
    """Videos (B, F, 3, H, W) in [0, 1] -> packed latents (B, L, C) float32 (posterior mode, ``(z - mean) / std``):
    ``decode``'s inverse, for offline preference pairs and reference videos."""
    expected = (geometry.frames, 3, geometry.height, geometry.width)
    if videos.ndim != 5 or tuple(videos.shape[1:]) != expected:
        raise ValueError(f"encode takes videos of shape (B, {', '.join(map(str, expected))}) for the geometry "
                         f"{geometry.frames}x{geometry.height}x{geometry.width}, got {tuple(videos.shape)}")
    x = (videos.permute(0, 2, 1, 3, 4) * 2 - 1).to(model_dtype(vae))
    step = max(1, int(micro_batch or 1))
    z = torch.cat([vae.encode(chunk).latent_dist.mode() for chunk in x.split(step)])
    mean, inv_std = _latent_stats(vae, z)
    return pack_video((z - mean) * inv_std).float()


# ------------------------------------------------------------------------------------------------- FLOPs
def transformer_flops(config: Any, image_tokens: int, text_tokens: int, batch: int = 1, *,
                      backward: bool = False, weight_grads: bool = True) -> int:
    """FLOPs of one WanTransformer3DModel forward (2 per multiply-add, as ``torch.utils.flop_counter`` counts) on
    ``batch`` videos of ``image_tokens`` patches and ``text_tokens`` text tokens; ``backward`` adds autograd's
    backward (weight and input gradients; ``weight_grads=False``, LoRA: input gradients only, and none into the
    text and time embedders, which see no trained input).

    Per sample, width D, FFN width F, L video and T text tokens: a block 8·L·D² (self-attention q/k/v/o) + 4·L·D²
    (cross-attention q/o) + 4·T·D² (cross k/v) + 4·L·D·F (FFN) + 4·L²·D + 4·L·T·D (attention); the time MLP runs
    once per sample, or once per token under TI2V's ``expand_timesteps``."""
    D = int(config_get(config, "num_attention_heads")) * int(config_get(config, "attention_head_dim"))
    F = int(config_get(config, "ffn_dim"))
    L, T = int(image_tokens), int(text_tokens)
    layers = int(config_get(config, "num_layers"))
    patch = config_get(config, "patch_size", PATCH)
    p = int(patch[0]) * int(patch[1]) * int(patch[2])
    in_ch = int(config_get(config, "in_channels"))
    out_ch = int(config_get(config, "out_channels") or in_ch)
    freq = int(config_get(config, "freq_dim", 256))
    text_dim = int(config_get(config, "text_dim"))
    times = L if expands_timesteps(config) else 1  # TI2V embeds a timestep per video token
    inputs = 2 * L * in_ch * p * D + 2 * T * text_dim * D + 2 * times * freq * D  # patch conv, text, time MLP inputs
    embed = inputs + 2 * T * D * D + times * (2 * D * D + 2 * D * 6 * D)  # second layers, the 6D time projection
    blocks = layers * (12 * L * D * D + 4 * T * D * D + 4 * L * D * F)
    attention = layers * (4 * L * L * D + 4 * L * T * D)
    output = 2 * L * D * p * out_ch
    forward = embed + blocks + attention + output
    if not backward:
        return batch * forward
    if weight_grads:
        return batch * (3 * forward - inputs)
    cross_kv = layers * 4 * T * D * D  # the text keys/values carry no gradient
    return batch * (forward + (blocks - cross_kv - 6 * L * D * D) + output + 2 * attention)


# ------------------------------------------------------------------------------------------------ the adapter
class Wan(ModelFamily):
    """Wan 2.1 / 2.2 text-to-video: UMT5 prompt embeddings (T tokens, zero after the prompt, no mask), 1x2x2-packed
    video latents with the frame axis inside L, timestep ``sigma * 1000``, the folder's ``flow_shift`` on an Euler
    grid, true CFG ``v_u + s (v_c - v_u)`` against the negative prompt, videos decoded through the VAE's per-channel
    latent statistics."""

    name = "wan"
    pipeline_classes = ("WanPipeline",)
    transformer_classes = ("WanTransformer3DModel",)
    text_components = TEXT_COMPONENTS
    embedding_keys = ("prompt_embeds",)
    # WanPipeline.__call__ defaults: 480 x 832, 81 frames (16 fps), 50 steps, guidance_scale 5.0, 512 text tokens,
    # negative prompt "" (encode_prompt's `negative_prompt or ""`); the shift is the folder's flow_shift (3.0)
    defaults = SamplerDefaults(steps=50, guidance=None, height=480, width=832, max_sequence_length=DEFAULT_TEXT_TOKENS,
                               shift=FLOW_SHIFT, cfg_scale=5.0, negative_prompt="", num_frames=81, fps=16)
    lora_target_modules = LORA_TARGET_MODULES
    recipes = {"grpo": "scripts/recipes/flow_grpo_wan.yaml"}  # the launchers' default (scripts/recipes/)
    block_lists = ("blocks",)
    sequence_parallel = True  # diffusers' WanTransformer3DModel._cp_plan: video tokens split, text kept whole
    video = True

    # ------------------------------------------------------------------------------------------- loading
    def check_folder(self, path, components=None):
        """The folder as a Path if it holds ``components``; a Wan2.2 folder this adapter does not serve yet (two
        experts, or TI2V's per-token timesteps) is a ValueError rather than a silently different model."""
        folder = check_components(path, _COMPONENT_FILES, COMPONENTS if components is None else components, "Wan",
                                  _HINT)
        config = _pipeline_config(folder)
        two = (folder / "transformer_2" / "config.json").is_file()
        if (config.get("boundary_ratio") is not None) != two and (folder / "model_index.json").is_file():
            raise ValueError(f"{folder}: model_index.json's boundary_ratio is {config.get('boundary_ratio')} but "
                             f"transformer_2/ is {'there' if two else 'missing'}; a Wan2.2-A14B folder has both, a "
                             "Wan2.1 or TI2V-5B folder neither: re-download the model folder")
        if two and config.get("expand_timesteps"):
            raise ValueError(f"{folder} has two experts and expand_timesteps: not a text-to-video Wan pipeline the "
                             "wan family knows (Wan2.1 T2V, Wan2.2-TI2V-5B, Wan2.2-T2V-A14B)")
        return folder

    def transformer_folder(self, path):
        return component_folder(path, "transformer", self.check_folder)

    def build_transformer(self, path, dtype=torch.float32):
        """WanTransformer3DModel from its config on the meta device (its rotary tables are non-persistent buffers
        computed at build: ``prepare_for_device`` rebuilds them on the device after sharded loading)."""
        from diffusers import WanTransformer3DModel  # heavy

        return self._adapted(lambda folder: build_on_meta(WanTransformer3DModel, folder, dtype), path)

    def load_transformer(self, path, dtype=torch.float32, device="cpu"):
        from diffusers import WanTransformer3DModel  # heavy

        return self._adapted(lambda folder: WanTransformer3DModel.from_pretrained(
            folder, torch_dtype=dtype, local_files_only=True).to(device), path)

    def _adapted(self, make: Any, path: Any) -> Any:
        """The transformer(s) of ``path`` made by ``make(folder)``, each kept in one attention dtype and tagged with
        this family. Wan2.2-A14B: both experts as one ``WanExperts`` (routed at ``boundary_ratio * 1000``);
        Wan2.2-TI2V-5B: the pipeline's ``expand_timesteps`` (a timestep per video token) recorded as the private
        config key ``_expand_timesteps`` (diffusers drops ``_`` keys when loading a config; exports strip them)."""
        pipeline = _pipeline_config(_pipeline_folder(path))
        parts = []
        for folder in self.weight_folders(path).values():
            model = make(folder)
            keep_attention_dtype(model)
            if pipeline.get("expand_timesteps"):
                model.register_to_config(_expand_timesteps=True)
            parts.append(tag(model, self))
        if len(parts) == 1:
            return parts[0]
        from fastvideo.models.wan_experts import WanExperts  # heavy (diffusers)

        return tag(WanExperts(*parts, pipeline["boundary_ratio"] * NUM_TRAIN_TIMESTEPS), self)

    def weight_folders(self, path):
        """The transformer folder, and Wan2.2-A14B's second expert's under the ``transformer_2.`` keys."""
        if _pipeline_config(_pipeline_folder(path)).get("boundary_ratio") is None:
            return {"": self.transformer_folder(path)}
        return {"transformer.": self.transformer_folder(path),
                "transformer_2.": Path(path).expanduser() / "transformer_2"}

    def transformer_parts(self, model):
        """Wan2.2-A14B's experts export as ``final/`` (the high-noise ``transformer``, what ``load_lora_weights``
        and ``from_pretrained`` take) and ``final/transformer_2/`` (``load_lora_weights(...,
        load_into_transformer_2=True)``)."""
        if not hasattr(unwrap_model(model), "experts"):
            return {"": ""}
        return {"": "transformer.", "transformer_2": "transformer_2."}

    def traced_transformer(self, model):
        """One expert of Wan2.2-A14B (each velocity call runs one expert per row; both have the same activations)."""
        inner = unwrap_model(model)
        return inner.transformer if hasattr(inner, "experts") else model

    def vae_class(self):
        from diffusers import AutoencoderKLWan  # heavy

        return AutoencoderKLWan

    def load_vae(self, path, dtype=torch.float32, device="cpu"):
        """The video VAE (float32 by default: diffusers' docs recommend it for decoding quality)."""
        vae = self.vae_class().from_pretrained(component_folder(path, "vae", self.check_folder), torch_dtype=dtype,
                                               local_files_only=True)
        return vae.to(device).eval().requires_grad_(False)

    def load_text_encoders(self, path, dtype=torch.float32, device="cpu") -> TextEncoder:
        from transformers import AutoTokenizer, UMT5EncoderModel  # heavy

        folder = self.check_folder(path, TEXT_COMPONENTS)
        encoder = UMT5EncoderModel.from_pretrained(folder / "text_encoder", dtype=dtype, local_files_only=True)
        return TextEncoder(tokenizer=AutoTokenizer.from_pretrained(folder / "tokenizer", local_files_only=True),
                           encoder=encoder.to(device).eval().requires_grad_(False))

    @torch.no_grad()
    def encode_prompts(self, encoders, prompts, max_sequence_length):
        """``WanPipeline.encode_prompt`` (one video per prompt): each prompt cleaned by the pipeline's own
        ``prompt_clean``, padded to ``max_sequence_length`` ids with its attention mask, UMT5's last hidden state
        zeroed after the prompt's tokens; ``({"prompt_embeds": (N, T, D)}, per prompt whether it was cut)``."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean  # heavy; the pipeline's cleaning, not a copy

        if isinstance(prompts, str):
            prompts = [prompts]
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise ValueError("encode_prompts needs a non-empty list of prompt strings")
        if not 1 <= max_sequence_length <= MAX_TEXT_TOKENS:
            raise ValueError(f"max_sequence_length must be in [1, {MAX_TEXT_TOKENS}] (WanPipeline's text length), "
                             f"got {max_sequence_length}")
        cleaned = [prompt_clean(p) for p in prompts]
        tokens = encoders.tokenizer(cleaned, padding="max_length", max_length=max_sequence_length, truncation=True,
                                    add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
        ids, mask = tokens.input_ids.to(encoders.device), tokens.attention_mask.to(encoders.device)
        hidden = encoders.encoder(ids, mask).last_hidden_state
        keep = (torch.arange(max_sequence_length, device=hidden.device)[None, :]
                < mask.gt(0).sum(dim=1, keepdim=True))  # the pipeline keeps u[:seq_len] and pads zeros
        embeds = torch.where(keep[..., None], hidden, torch.zeros((), dtype=hidden.dtype, device=hidden.device))
        cut = [len(full) > max_sequence_length for full in encoders.tokenizer(cleaned).input_ids]
        return {"prompt_embeds": embeds}, cut

    def max_sequence_length_limit(self) -> int:
        return MAX_TEXT_TOKENS

    # ------------------------------------------------------------------------------------------- latents
    def latent_geometry(self, vae_or_config, height, width, frames=None):
        """``VideoGeometry`` of ``frames`` (default: the pipeline's 81) x ``height`` x ``width``."""
        if isinstance(vae_or_config, (str, os.PathLike)):
            folder = Path(vae_or_config).expanduser()
            if not (folder / "config.json").is_file():
                self.check_folder(folder, ("vae",))  # Wan's message for a folder without vae/
        return latent_geometry(vae_or_config, height, width, self.defaults.num_frames if frames is None else frames)

    def conditioning(self, geometry, cond, guidance, device):
        """The unpacking layout only: no position ids (the transformer's rotary tables) or distilled guidance."""
        return {"geometry": geometry}

    def predict_velocity(self, transformer, latents, sigma, cond, shared):
        """The transformer on the unpacked ``(B, C, F, h, w)`` latents at timestep ``sigma * 1000`` (float32, on the
        device); inputs in the model's dtype unless autocast is
        on; float32 packed output."""
        embeds = cond["prompt_embeds"]
        batch = latents.shape[0]
        if embeds.shape[0] != batch:
            raise ValueError(f"batch sizes differ: latents {batch}, prompt_embeds {embeds.shape[0]}; repeat the "
                             "embeddings per sample")
        geometry = shared["geometry"]
        timestep = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device) * NUM_TRAIN_TIMESTEPS
        timestep = timestep.expand(batch) if timestep.ndim == 0 else timestep.reshape(batch)
        if expands_timesteps(unwrap_model(transformer).config):  # TI2V: every video token at its sample's t
            timestep = timestep[:, None].expand(batch, latents.shape[1])
        x = unpack_video(latents, geometry)
        if not torch.is_autocast_enabled(latents.device.type):
            dtype = model_dtype(transformer)
            x, embeds = x.to(dtype), embeds.to(dtype)
        out = transformer(hidden_states=x, timestep=timestep, encoder_hidden_states=embeds, return_dict=False)[0]
        return pack_video(out).float()

    def sigmas(self, steps, image_seq_len, scheduler=None):
        """The Euler grid with the folder's ``flow_shift`` (a static shift, the same at every size): the sigmas
        ``FlowMatchEulerDiscreteScheduler(shift=flow_shift)`` samples, on which the stock UniPC also steps."""
        c = scheduler_settings(scheduler, WAN_SCHEDULER_CONFIG, "Wan",
                               {"use_dynamic_shifting": False, "use_flow_sigmas": True})
        shift = c.get("flow_shift", c.get("shift", FLOW_SHIFT))
        return common.static_shift_sigmas(steps, float(shift), int(c["num_train_timesteps"]))

    def decode(self, vae, latents, geometry, micro_batch=None):
        return decode(vae, latents, geometry, micro_batch)

    def encode(self, vae, images, geometry, micro_batch=None):
        return encode(vae, images, geometry, micro_batch)

    # ---------------------------------------------------------------------------------- FLOPs and plan
    def transformer_flops(self, config, image_tokens, text_tokens, batch=1, *, backward=False, weight_grads=True):
        return transformer_flops(config, image_tokens, text_tokens, batch, backward=backward,
                                 weight_grads=weight_grads)

    def forward_tokens(self, args, kwargs):
        x = kwargs.get("hidden_states", args[0] if args else None)  # (B, C, F, H, W) latents
        text = kwargs.get("encoder_hidden_states")
        if x is None or text is None or x.ndim != 5:
            return None
        return x.shape[0], x.shape[2] * (x.shape[3] // PATCH[1]) * (x.shape[4] // PATCH[2]), text.shape[1]

    def example_inputs(self, config, batch, image_tokens, text_tokens, dtype, device):
        """One latent frame of the squarest patch grid with ``image_tokens`` patches (attention is over all tokens,
        so the plan depends on the count, not on how it splits into frames)."""
        rows, cols = common_image_size(image_tokens)
        return dict(hidden_states=torch.empty(batch, config_get(config, "in_channels"), 1, rows * 2, cols * 2,
                                              device=device, dtype=dtype),
                    encoder_hidden_states=torch.empty(batch, text_tokens, config_get(config, "text_dim"),
                                                      device=device, dtype=dtype),
                    timestep=torch.empty((batch, image_tokens) if expands_timesteps(config) else (batch,),
                                         device=device, dtype=torch.float32), return_dict=False)

    # ------------------------------------------------------------------------------------ device, export
    def prepare_for_device(self, transformer, device, *, param_dtype=None, attention_backend="auto"):
        """Rebuild the rotary tables (non-persistent buffers: a meta build sharded with ``to_empty`` holds garbage
        there) on the CPU, as the stock model builds them (float64 angles, float32 tables: nothing float64 reaches
        the device, so an NPU needs no change), then the attention kernel (``choose_attention``)."""
        model = unwrap_model(transformer)
        for expert in model.experts() if hasattr(model, "experts") else (model,):
            _fresh_rope_tables(expert, device)
        return choose_attention(model, device, param_dtype, attention_backend)

    def pipeline_class(self) -> type:
        """``WanPipeline`` (its WanLoraLoaderMixin writes and reads LoRA exports)."""
        from diffusers import WanPipeline  # heavy

        return WanPipeline

    def transformer_class(self) -> type:
        from diffusers import WanTransformer3DModel  # heavy

        return WanTransformer3DModel


def _pipeline_config(folder: Path) -> dict:
    """The folder's ``model_index.json`` (the pipeline's config: ``boundary_ratio``, ``expand_timesteps``), or {}."""
    index = Path(folder) / "model_index.json"
    return json.loads(index.read_text()) if index.is_file() else {}


def _pipeline_folder(path: Any) -> Path:
    """The pipeline folder a transformer path belongs to: the path itself, the pipeline around a ``transformer/``
    folder, or, for a trainer's full fine-tune export (``OUT/final``), the base model its ``training_args.json``
    names."""
    folder = Path(path).expanduser()
    if (folder / "model_index.json").is_file() or not (folder / "config.json").is_file():
        return folder
    if (folder.parent / "model_index.json").is_file():
        return folder.parent
    args = folder / "training_args.json"
    base = json.loads(args.read_text()).get("pretrained_model_name_or_path") if args.is_file() else None
    return Path(base).expanduser() if base else folder


def expands_timesteps(config: Any) -> bool:
    """Whether the transformer of this config takes one timestep per video token (Wan2.2-TI2V-5B's pipeline:
    ``expand_timesteps``; ``Wan._adapted`` records it in the config)."""
    return bool(config_get(config, "_expand_timesteps", False))


def _fresh_rope_tables(model: Any, device: torch.device | str) -> None:
    """Recompute ``model.rope``'s cos/sin tables on the CPU (diffusers' own ``WanRotaryPosEmbed``) and put them on
    ``device`` (the forward's; a device type this torch lacks: where the model's parameters are)."""
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed  # heavy

    rope = getattr(model, "rope", None)
    if rope is None:
        return
    with torch.device("cpu"):
        fresh = WanRotaryPosEmbed(rope.attention_head_dim, rope.patch_size, rope.max_seq_len)
    try:
        target = torch.device(device)
    except RuntimeError:  # e.g. "npu" without torch_npu: nothing runs there
        target = next((p.device for p in model.parameters() if not p.is_meta), rope.freqs_cos.device)
    rope.freqs_cos, rope.freqs_sin = fresh.freqs_cos.to(target), fresh.freqs_sin.to(target)


def common_image_size(tokens: int) -> tuple[int, int]:
    """Patch grid (rows, cols) with rows * cols = ``tokens``, as square as possible (rows <= cols)."""
    import math

    rows = math.isqrt(int(tokens))
    while tokens % rows:
        rows -= 1
    return rows, int(tokens) // rows
