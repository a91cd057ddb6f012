"""The FLUX.2 family (FLUX.2-dev and FLUX.2-klein) behind one ``ModelFamily`` adapter, ``Flux2``, plus its tiny
presets (``flux2-tiny``, the klein layout; ``flux2-dev-tiny``, dev's: Mistral3 + Pixtral processor, guidance
embedding) and its real-config preset (``flux2-klein-4b-config``).

Facts of diffusers 0.42's ``Flux2Pipeline`` / ``Flux2KleinPipeline`` this module reproduces:

- Text: one decoder LM (dev: Mistral3 with a system message; klein: Qwen3 on a chat-templated user turn with thinking
  off) run on ``max_sequence_length`` tokens padded to that length; the hidden states of three layers (dev (10, 20,
  30), klein (9, 18, 27): the pipelines' ``text_encoder_out_layers`` defaults) are stacked per token into
  ``(B, T, 3 * hidden)``. The transformer attends over all T tokens, padding included (no mask), so the store keeps
  every column and ``collate`` trims nothing.
- Latents: the VAE's 32 channels patchified 2x2 (channel ``c * 4 + dy * 2 + dx``, exactly FLUX.1's ``pack_latents``
  order) into 128-channel tokens, row-major, normalised by the VAE's batch-norm running mean / sqrt(var + eps).
- Positions: 4 rotary axes (t, h, w, l): image tokens ``(0, row, col, 0)``, text tokens ``(0, 0, 0, index)``.
- Time: the scheduler's ``timesteps = sigmas * 1000`` (float32) divided by 1000 again is fed as ``timestep`` (the
  transformer multiplies by 1000 inside); dev also feeds its distilled ``guidance`` (default 4.0). Klein base models
  use true CFG ``v_u + s (v_c - v_u)`` with the negative prompt "" (off when ``model_index.json`` says
  ``is_distilled``).
- Sigmas: ``linspace(1, 1/S, S)`` time-shifted with ``mu = compute_empirical_mu(L, S)`` (the FLUX.2 fit of mu on
  the image tokens and the step count), then a final 0.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastvideo import devices
from fastvideo.models.attention import choose_attention
from fastvideo.models.base import (ModelFamily, SamplerDefaults, build_on_meta, check_components, component_folder,
                                   config_get, model_config, model_dtype, tag, unwrap_model)
from fastvideo.models.flux import (Flux1, LatentGeometry, decode as flux_decode, encode as flux_encode,
                                   keep_attention_dtype, latent_geometry as flux_latent_geometry)

# component -> files of which one must exist (dev's tokenizer/ is a Pixtral processor folder: tokenizer.json too)
_COMPONENT_FILES: dict[str, tuple[str, ...]] = {
    "transformer": ("config.json",),
    "vae": ("config.json",),
    "text_encoder": ("config.json",),
    "tokenizer": ("tokenizer.json", "tokenizer_config.json"),
    "scheduler": ("scheduler_config.json",),
}
COMPONENTS: tuple[str, ...] = tuple(_COMPONENT_FILES)
TEXT_COMPONENTS: tuple[str, ...] = ("tokenizer", "text_encoder")
_HINT = ("pass a diffusers FLUX.2 folder (e.g. a local download of black-forest-labs/FLUX.2-klein-4B or FLUX.2-dev) "
         "or build a tiny one with `python -m fastvideo.tiny --preset flux2-tiny --out DIR`")

DEV_PIPELINE, KLEIN_PIPELINE = "Flux2Pipeline", "Flux2KleinPipeline"
KLEIN_TEXT_LAYERS = (9, 18, 27)  # Flux2KleinPipeline.__call__'s text_encoder_out_layers default
DEV_TEXT_LAYERS = (10, 20, 30)  # Flux2Pipeline.__call__'s text_encoder_out_layers default
MAX_TEXT_TOKENS = 512  # both pipelines' tokenizer_max_length / max_sequence_length default
TIMESTEP_SCALE = 1000  # FlowMatchEulerDiscreteScheduler num_train_timesteps: timesteps = sigmas * 1000

# diffusers examples/dreambooth/train_dreambooth_lora_flux2.py and train_dreambooth_lora_flux2_klein.py default
# targets: the double blocks' image-stream attention (to_q/to_k/to_v/to_out.0) and the single blocks' fused
# qkv+MLP input projection. The scripts also list ``single_transformer_blocks.{i}.attn.to_out`` for i < 48 (dev) /
# 24 (klein): those names depend on the block count (klein-4B has 20), so a default shared by every FLUX.2 size
# cannot name them, and the bare suffix ``attn.to_out`` would also hit the double blocks' to_out ModuleList.
LORA_TARGET_MODULES: tuple[str, ...] = ("to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj")


# ----------------------------------------------------------------------------------------------- loading
def check_model_folder(path: str | os.PathLike, components: tuple[str, ...] | list[str] = COMPONENTS) -> Path:
    """``path`` as a Path if it holds the given FLUX.2 components; else FileNotFoundError naming the fix."""
    return check_components(path, _COMPONENT_FILES, components, "FLUX.2", _HINT)


def pipeline_kind(path: str | os.PathLike) -> str:
    """``Flux2Pipeline`` (dev) or ``Flux2KleinPipeline`` from the folder's model_index.json (klein when absent)."""
    index = Path(path).expanduser() / "model_index.json"
    name = json.loads(index.read_text()).get("_class_name") if index.is_file() else None
    return DEV_PIPELINE if name == DEV_PIPELINE else KLEIN_PIPELINE


def is_distilled(path: str | os.PathLike) -> bool:
    """Klein's ``is_distilled`` flag (model_index.json): the step-distilled klein ignores true CFG."""
    index = Path(path).expanduser() / "model_index.json"
    return bool(index.is_file() and json.loads(index.read_text()).get("is_distilled", False))


def _transformer_cls() -> type:
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel


@dataclass
class TextEncoder:
    """The frozen LM and its tokenizer (dev: Mistral3 + Pixtral processor; klein: Qwen3 + Qwen2 tokenizer), and
    which pipeline's prompt format and hidden layers they follow."""

    kind: str  # DEV_PIPELINE or KLEIN_PIPELINE
    tokenizer: Any
    model: Any

    @property
    def layers(self) -> tuple[int, ...]:
        return DEV_TEXT_LAYERS if self.kind == DEV_PIPELINE else KLEIN_TEXT_LAYERS

    @property
    def device(self) -> torch.device:
        return self.model.device


def _tokenize(encoders: TextEncoder, prompts: list[str], max_sequence_length: int) -> tuple[dict, list[bool]]:
    """The pipeline's token ids / attention mask (padded to ``max_sequence_length``) and which prompts were cut."""
    tok = encoders.tokenizer
    if encoders.kind == DEV_PIPELINE:
        from diffusers.pipelines.flux2.pipeline_flux2 import format_input
        from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

        messages = format_input(prompts=prompts, system_message=SYSTEM_MESSAGE)
        common = dict(add_generation_prompt=False, tokenize=True, return_dict=True)
        batch = tok.apply_chat_template(messages, return_tensors="pt", padding="max_length", truncation=True,
                                        max_length=max_sequence_length, **common)
        # the Pixtral processor returns tensors by default, so unequal lengths need padding: count the mask
        full = tok.apply_chat_template(messages, return_tensors="pt", padding="longest", **common)
        lengths = full["attention_mask"].sum(-1).tolist()
    else:
        texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True,
                                         enable_thinking=False) for p in prompts]
        batch = tok(texts, return_tensors="pt", padding="max_length", truncation=True, max_length=max_sequence_length)
        lengths = [len(ids) for ids in tok(texts)["input_ids"]]
    return batch, [n > max_sequence_length for n in lengths]


@torch.no_grad()
def encode_prompts(encoders: TextEncoder, prompts: list[str], max_sequence_length: int = MAX_TEXT_TOKENS
                   ) -> tuple[torch.Tensor, list[bool]]:
    """The pipeline's ``encode_prompt``: ``(B, T, 3 * hidden)`` stacked hidden states of the three text layers (in
    the encoder's dtype, T = ``max_sequence_length``, padding included) and per prompt whether it was cut."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError("encode_prompts needs a non-empty list of prompt strings")
    if not 1 <= max_sequence_length <= MAX_TEXT_TOKENS:
        raise ValueError(f"max_sequence_length must be in [1, {MAX_TEXT_TOKENS}] (FLUX.2's text limit), "
                         f"got {max_sequence_length}")
    batch, truncated = _tokenize(encoders, list(prompts), max_sequence_length)
    device = encoders.device
    hidden = encoders.model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                            output_hidden_states=True, use_cache=False).hidden_states
    if max(encoders.layers) >= len(hidden):
        raise ValueError(f"the text encoder has {len(hidden) - 1} layers but FLUX.2 reads hidden layers "
                         f"{encoders.layers}: use the model's own text_encoder/")
    stacked = torch.stack([hidden[k] for k in encoders.layers], dim=2)  # (B, T, 3, H)
    return stacked.flatten(2).to(model_dtype(encoders.model)), truncated


# ------------------------------------------------------------------------------------------ latent geometry
def _vae_config(vae_or_config: Any) -> Any:
    """A VAE's config from the model, its config, a FLUX.2 folder or a vae folder."""
    if isinstance(vae_or_config, (str, os.PathLike)):
        folder = component_folder(vae_or_config, "vae", check_model_folder)
        return json.loads((folder / "config.json").read_text())
    if isinstance(vae_or_config, torch.nn.Module):
        return model_config(vae_or_config)
    return vae_or_config


def latent_geometry(vae_or_config: Any, height: int, width: int) -> LatentGeometry:
    """FLUX.1's packed geometry fits FLUX.2 (L = (H/16)(W/16) tokens of 4 x 32 channels); ValueError naming sizes."""
    return flux_latent_geometry(_vae_config(vae_or_config), height, width)


def _bn_stats(vae: Any, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) per packed channel from the VAE's batch norm: std = sqrt(running_var + batch_norm_eps)."""
    model = unwrap_model(vae)
    bn = model.bn
    std = torch.sqrt(bn.running_var + config_get(model.config, "batch_norm_eps"))
    return bn.running_mean.to(device, dtype), std.to(device, dtype)


def decode(vae: Any, latents: torch.Tensor, geometry: LatentGeometry, micro_batch: int | None = None
           ) -> torch.Tensor:
    """Packed latents (B, L, C) -> images (B, 3, H, W) float32 in [0, 1], as the pipeline's ``output_type="pt"``:
    de-normalised with the batch-norm statistics, then FLUX.1's unpatchify / decode / ``x / 2 + 0.5`` (the FLUX.2
    VAE has no scaling or shift factor, so that path adds nothing else)."""
    mean, std = _bn_stats(vae, latents.dtype, latents.device)
    return flux_decode(vae, latents * std + mean, geometry, micro_batch)


@torch.no_grad()
def encode(vae: Any, images: torch.Tensor, geometry: LatentGeometry, micro_batch: int | None = None) -> torch.Tensor:
    """Images (B, 3, H, W) in [0, 1] -> packed normalised latents (B, L, C) float32 (posterior mode, patchified and
    batch-norm normalised as the pipeline's ``_encode_vae_image``): ``decode``'s inverse."""
    tokens = flux_encode(vae, images, geometry, micro_batch)
    mean, std = _bn_stats(vae, tokens.dtype, tokens.device)
    return (tokens - mean) / std


def image_ids(geometry: LatentGeometry, device: str | torch.device | None = None) -> torch.Tensor:
    """(L, 4) float32 rotary ids of the packed image tokens: (t, h, w, l) = (0, row, col, 0), row-major."""
    rows, cols = geometry.latent_h // 2, geometry.latent_w // 2
    grid = torch.cartesian_prod(torch.arange(rows), torch.arange(cols)).float()
    return torch.nn.functional.pad(grid, (1, 1)).to(device)


def text_ids(num_tokens: int, device: str | torch.device | None = None) -> torch.Tensor:
    """(T, 4) float32 rotary ids of the text tokens: (0, 0, 0, index)."""
    ids = torch.zeros(num_tokens, 4)
    ids[:, 3] = torch.arange(num_tokens, dtype=ids.dtype)
    return ids.to(device)


# -------------------------------------------------------------------------------------------- model calls
def _per_row(value: torch.Tensor, batch: int) -> torch.Tensor:
    return value.expand(batch) if value.ndim == 0 else value.reshape(batch)


def predict_velocity(transformer: Any, latents: torch.Tensor, sigma: float | torch.Tensor,
                     prompt_embeds: torch.Tensor, img_ids: torch.Tensor, txt_ids: torch.Tensor,
                     guidance: torch.Tensor | None = None) -> torch.Tensor:
    """Velocity (B, L, C) float32 of the FLUX.2 transformer at ``sigma`` (device tensor, never read on the host).

    The timestep is ``(sigma * 1000) / 1000`` in float32, the value the pipeline feeds (scheduler timesteps over
    1000); ``guidance`` only reaches a transformer with ``guidance_embeds`` (dev), which requires it.
    """
    batch, device = latents.shape[0], latents.device
    if prompt_embeds.shape[0] != batch:
        raise ValueError(f"batch sizes differ: latents {batch}, prompt_embeds {prompt_embeds.shape[0]}; repeat the "
                         "embeddings per sample")
    t = torch.as_tensor(sigma, dtype=torch.float32, device=device)
    timestep = _per_row(t * TIMESTEP_SCALE / TIMESTEP_SCALE, batch)
    guidance_vec = None
    if config_get(model_config(transformer), "guidance_embeds", False):
        if guidance is None:
            raise ValueError("this FLUX.2 transformer has a guidance embedding (FLUX.2-dev): pass guidance "
                             "(4.0 is Flux2Pipeline's default)")
        guidance_vec = _per_row(torch.as_tensor(guidance, dtype=torch.float32, device=device), batch)
    if not torch.is_autocast_enabled(device.type):
        dtype = model_dtype(transformer)
        latents, prompt_embeds = latents.to(dtype), prompt_embeds.to(dtype)
    out = transformer(hidden_states=latents, encoder_hidden_states=prompt_embeds, timestep=timestep, img_ids=img_ids,
                      txt_ids=txt_ids, guidance=guidance_vec, return_dict=False)[0]
    return out[:, :latents.shape[1]].float()


def sigmas(steps: int, image_seq_len: int) -> torch.Tensor:
    """(S+1,) float32: the pipelines' ``linspace(1, 1/S, S)`` through ``set_timesteps(sigmas=..., mu=...)`` (numpy
    float32, exponential time shift with ``mu = compute_empirical_mu(L, S)``), then a final 0."""
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    from fastvideo.schedulers import time_shift

    if int(steps) < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    steps = int(steps)
    mu = compute_empirical_mu(image_seq_len=int(image_seq_len), num_steps=steps)
    t = np.linspace(1.0, 1 / steps, steps).astype(np.float32)
    shifted = torch.from_numpy(np.asarray(time_shift(mu, t, 1.0))).to(torch.float32)
    return torch.cat([shifted, torch.zeros(1, dtype=torch.float32)])


# ---------------------------------------------------------------------------------------------- FLOPs
def transformer_flops(config: Any, image_tokens: int, text_tokens: int, batch: int = 1, *,
                      backward: bool = False, weight_grads: bool = True) -> int:
    """FLOPs of one Flux2Transformer2DModel forward (2 per multiply-add; ``backward``: x3 with weight gradients, or
    2 x forward + attention once more for LoRA's input gradients only).

    Per sample, width D, MLP width M = mlp_ratio * D, N = L + T tokens: every block, double or single, costs
    8·N·D² (q, k, v, out) + 6·N·M·D (SwiGLU in 2M, out M) + 4·N²·D (QKᵀ, AV); once per sample the modulations
    (img 6D, txt 6D, single 3D: 30·D²), the time (and guidance) MLPs, the output adaLN (4·D²); and the x/context
    embedders and the output projection per token.
    """
    get = lambda key, default=None: config_get(config, key, default)  # noqa: E731
    D = get("num_attention_heads") * get("attention_head_dim")
    M = int(D * get("mlp_ratio", 3.0))
    L, T = int(image_tokens), int(text_tokens)
    N = L + T
    in_ch = get("in_channels", 128)
    out_ch = (get("out_channels") or in_ch) * get("patch_size", 1) ** 2
    channels = get("timestep_guidance_channels", 256)
    per_sample = 2 * L * in_ch * D + 2 * T * get("joint_attention_dim") * D + 2 * L * D * out_ch
    per_sample += 2 * (channels * D + D * D) * (2 if get("guidance_embeds", False) else 1) + 30 * D * D + 4 * D * D
    blocks = get("num_layers") + get("num_single_layers")
    per_sample += blocks * (8 * N * D * D + 6 * N * M * D + 4 * N * N * D)
    forward = batch * per_sample
    if not backward:
        return forward
    if weight_grads:
        return 3 * forward
    return 2 * forward + batch * blocks * 4 * N * N * D


# --------------------------------------------------------------------------------------- device adaptations
def _float32_pos_embed(current: Any) -> torch.nn.Module:
    """A ``Flux2PosEmbed`` whose rotary angles use float32 only, as accurate as the float64 path (FLUX.1's
    ``_Float32Rope``: same axes layout, pairs repeated)."""
    from diffusers.models.transformers.transformer_flux2 import Flux2PosEmbed

    from fastvideo.models.flux import _Float32Rope

    class Float32Flux2PosEmbed(Flux2PosEmbed):
        """Flux2PosEmbed computed in float32 (Ascend NPUs have no float64): ~3e-7 from the float64 angles."""

        def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self._rope(ids)

    module = Float32Flux2PosEmbed(theta=current.theta, axes_dim=list(current.axes_dim))
    module._rope = _Float32Rope(current.theta, list(current.axes_dim))
    return module


def use_float32_rope(transformer: Any) -> bool:
    """Swap the transformer's float64 rotary embedding for the float32 one; False if already swapped."""
    model = unwrap_model(transformer)
    if type(model.pos_embed).__name__ == "Float32Flux2PosEmbed":
        return False
    model.pos_embed = _float32_pos_embed(model.pos_embed)
    return True


def prepare_for_device(transformer: Any, device: torch.device | str, *, param_dtype: torch.dtype | None = None,
                       attention_backend: str = "auto") -> list[str]:
    """``--attention_backend`` (other than auto) in every attention layer; on an NPU also float32 rotary angles
    (diffusers would fall back to plain float32 angles there) and fused attention for bf16/fp16 weights."""
    model = unwrap_model(transformer)
    npu = devices.device_type(device) == "npu"
    done = ["pos_embed: Float32Flux2PosEmbed (rotary angles in float32; the NPU has no float64)"] \
        if npu and use_float32_rope(model) else []
    return done + choose_attention(model, device, param_dtype, attention_backend)


# ------------------------------------------------------------------------------------------------ the adapter
class Flux2(ModelFamily):
    """FLUX.2-dev (Mistral3 text, distilled guidance) and FLUX.2-klein (Qwen3 text, true CFG unless distilled): the
    pipeline is read from the folder at load time; the hot loop only calls the transformer."""

    name = "flux2"
    pipeline_classes = (DEV_PIPELINE, KLEIN_PIPELINE)
    transformer_classes = ("Flux2Transformer2DModel",)
    text_components = TEXT_COMPONENTS
    embedding_keys = ("prompt_embeds",)
    # Flux2KleinPipeline.__call__ defaults: 50 steps, guidance_scale 4.0 = true CFG (klein base) against "", no
    # guidance embedding, default_sample_size 128 x vae_scale_factor 8 = 1024 px, max_sequence_length 512.
    # ``sampler_defaults(path)`` gives dev's (embedded guidance 4.0, no CFG) and distilled klein's (no CFG).
    defaults = SamplerDefaults(steps=50, guidance=None, height=1024, width=1024, max_sequence_length=MAX_TEXT_TOKENS,
                               cfg_scale=4.0, negative_prompt="")
    lora_target_modules = LORA_TARGET_MODULES
    recipes = {"grpo": "scripts/recipes/flux2_klein_grpo.yaml"}  # the launchers' defaults (scripts/recipes/)
    block_lists = ("transformer_blocks", "single_transformer_blocks")
    sequence_parallel = False

    def sampler_defaults(self, path: str | os.PathLike) -> SamplerDefaults:
        """The stock defaults of this folder's pipeline: dev feeds guidance 4.0 and has no CFG; a distilled klein
        ignores CFG; klein base is ``defaults``."""
        from dataclasses import replace

        if pipeline_kind(path) == DEV_PIPELINE:
            return replace(self.defaults, guidance=4.0, cfg_scale=1.0)
        return replace(self.defaults, cfg_scale=1.0) if is_distilled(path) else self.defaults

    def check_folder(self, path, components=None):
        return check_model_folder(path, COMPONENTS if components is None else components)

    def transformer_folder(self, path):
        return component_folder(path, "transformer", check_model_folder)

    def build_transformer(self, path, dtype=torch.float32):
        model = build_on_meta(_transformer_cls(), self.transformer_folder(path), dtype)
        keep_attention_dtype(model)
        return tag(model, self)

    def load_transformer(self, path, dtype=torch.float32, device="cpu"):
        model = _transformer_cls().from_pretrained(self.transformer_folder(path), torch_dtype=dtype,
                                                   local_files_only=True).to(device)
        keep_attention_dtype(model)  # q/k norms keep the compute dtype under autocast
        return tag(model, self)

    def vae_class(self):
        from diffusers import AutoencoderKLFlux2

        return AutoencoderKLFlux2

    def load_vae(self, path, dtype=torch.float32, device="cpu"):
        from diffusers import AutoencoderKLFlux2

        vae = AutoencoderKLFlux2.from_pretrained(component_folder(path, "vae", check_model_folder),
                                                 torch_dtype=dtype, local_files_only=True)
        return vae.to(device).eval().requires_grad_(False)  # eval: the batch norm's running statistics

    def load_text_encoders(self, path, dtype=torch.float32, device="cpu"):
        folder = check_model_folder(path, TEXT_COMPONENTS)
        kind = pipeline_kind(folder)
        if kind == DEV_PIPELINE:
            from transformers import AutoProcessor as tokenizer_cls, Mistral3ForConditionalGeneration as model_cls
        else:
            from transformers import AutoTokenizer as tokenizer_cls, Qwen3ForCausalLM as model_cls
        tokenizer = tokenizer_cls.from_pretrained(folder / "tokenizer", local_files_only=True)
        model = model_cls.from_pretrained(folder / "text_encoder", dtype=dtype, local_files_only=True)
        return TextEncoder(kind, tokenizer, model.to(device).eval().requires_grad_(False))

    def encode_prompts(self, encoders, prompts, max_sequence_length):
        embeds, truncated = encode_prompts(encoders, prompts, max_sequence_length)
        return {"prompt_embeds": embeds}, truncated

    def max_sequence_length_limit(self) -> int:
        return MAX_TEXT_TOKENS

    # the module functions of the same names are the methods (no per-instance state)
    latent_geometry = staticmethod(latent_geometry)

    def conditioning(self, geometry, cond, guidance, device):
        text = cond["prompt_embeds"].shape[1]
        return {"img_ids": devices.to_device(image_ids(geometry), device),
                "txt_ids": devices.to_device(text_ids(text), device),
                "guidance": None if guidance is None else devices.to_device(torch.tensor(float(guidance)), device)}

    def predict_velocity(self, transformer, latents, sigma, cond, shared):
        return predict_velocity(transformer, latents, sigma, cond["prompt_embeds"], shared["img_ids"],
                                shared["txt_ids"], guidance=shared["guidance"])

    sigmas = staticmethod(sigmas)
    decode = staticmethod(decode)
    encode = staticmethod(encode)
    transformer_flops = staticmethod(transformer_flops)
    prepare_for_device = staticmethod(prepare_for_device)
    forward_tokens = Flux1.forward_tokens  # same keyword arguments (hidden_states, encoder_hidden_states)

    def example_inputs(self, config, batch, image_tokens, text_tokens, dtype, device):
        axes = len(config_get(config, "axes_dims_rope", (32, 32, 32, 32)))
        return dict(
            hidden_states=torch.empty(batch, image_tokens, config_get(config, "in_channels"), device=device,
                                      dtype=dtype),
            encoder_hidden_states=torch.empty(batch, text_tokens, config_get(config, "joint_attention_dim"),
                                              device=device, dtype=dtype),
            timestep=torch.empty(batch, device=device),
            guidance=torch.empty(batch, device=device) if config_get(config, "guidance_embeds") else None,
            img_ids=torch.empty(image_tokens, axes, device=device),
            txt_ids=torch.empty(text_tokens, axes, device=device), return_dict=False)

    def pipeline_class(self) -> type:
        # Both FLUX.2 pipelines read and write LoRA exports through the same Flux2LoraLoaderMixin.
        from diffusers import Flux2Pipeline

        return Flux2Pipeline

    def transformer_class(self) -> type:
        return _transformer_cls()


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
    from open_clip.tokenizer import bytes_to_unicode

    from fastvideo.tiny import _open_clip_merges

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
    from transformers import AddedToken, Qwen2TokenizerFast

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
    from tokenizers import Tokenizer, decoders, models as bpe_models, pre_tokenizers
    from transformers import PixtralImageProcessor, PixtralProcessor, PreTrainedTokenizerFast

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
    import diffusers

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
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

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
    from transformers import AutoProcessor, Mistral3Config, Mistral3ForConditionalGeneration

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
    from diffusers import AutoencoderKLFlux2

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
    from diffusers import FlowMatchEulerDiscreteScheduler

    from fastvideo.seeding import derive_seed
    from fastvideo.tiny import FLUX_SCHEDULER_CONFIG

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
    from fastvideo.tiny import write_atomically

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
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler
    from transformers import Qwen3Config

    from fastvideo.tiny import FLUX_SCHEDULER_CONFIG

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
    from fastvideo.tiny import write_atomically

    return write_atomically(out_dir, _write_config_folder)
