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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastvideo import devices
from fastvideo.models.attention import choose_attention
from fastvideo.models.base import (ModelFamily, SamplerDefaults, build_on_meta, check_components, component_folder,
                                   config_get, model_config, model_dtype, scheduler_settings, tag, unwrap_model)
from fastvideo.models.common import (LatentGeometry, _Float32Rope, decode as packed_decode, encode as packed_encode,
                                     hidden_and_text_tokens, keep_attention_dtype,
                                     latent_geometry as packed_latent_geometry)

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
    from diffusers import Flux2Transformer2DModel  # heavy

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
        from diffusers.pipelines.flux2.pipeline_flux2 import format_input  # heavy
        from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE  # heavy

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
    return packed_latent_geometry(_vae_config(vae_or_config), height, width)


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
    return packed_decode(vae, latents * std + mean, geometry, micro_batch)


@torch.no_grad()
def encode(vae: Any, images: torch.Tensor, geometry: LatentGeometry, micro_batch: int | None = None) -> torch.Tensor:
    """Images (B, 3, H, W) in [0, 1] -> packed normalised latents (B, L, C) float32 (posterior mode, patchified and
    batch-norm normalised as the pipeline's ``_encode_vae_image``): ``decode``'s inverse."""
    tokens = packed_encode(vae, images, geometry, micro_batch)
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


def sigmas(steps: int, image_seq_len: int, scheduler: dict[str, Any] | None = None) -> torch.Tensor:
    """(S+1,) float32: the pipelines' ``linspace(1, 1/S, S)`` through ``set_timesteps(sigmas=..., mu=...)`` (numpy
    float32, exponential time shift with ``mu = compute_empirical_mu(L, S)``: the pipeline's fit, whatever the
    folder's shift constants), then a final 0. ``scheduler``: the folder's config, checked for what would change it."""
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu  # heavy

    from fastvideo.schedulers import time_shift

    scheduler_settings(scheduler, {}, "FLUX.2", {"use_dynamic_shifting": True, "time_shift_type": "exponential",
                                                 "shift_terminal": None})
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
    from diffusers.models.transformers.transformer_flux2 import Flux2PosEmbed  # heavy

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
        from diffusers import AutoencoderKLFlux2  # heavy

        return AutoencoderKLFlux2

    def load_vae(self, path, dtype=torch.float32, device="cpu"):
        from diffusers import AutoencoderKLFlux2  # heavy

        vae = AutoencoderKLFlux2.from_pretrained(component_folder(path, "vae", check_model_folder),
                                                 torch_dtype=dtype, local_files_only=True)
        return vae.to(device).eval().requires_grad_(False)  # eval: the batch norm's running statistics

    def load_text_encoders(self, path, dtype=torch.float32, device="cpu"):
        folder = check_model_folder(path, TEXT_COMPONENTS)
        kind = pipeline_kind(folder)
        if kind == DEV_PIPELINE:
            from transformers import AutoProcessor as tokenizer_cls, Mistral3ForConditionalGeneration as model_cls  # heavy
        else:
            from transformers import AutoTokenizer as tokenizer_cls, Qwen3ForCausalLM as model_cls  # heavy
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
    def forward_tokens(self, args, kwargs):
        return hidden_and_text_tokens(args, kwargs)  # FLUX.1's keyword arguments (hidden_states, encoder_hidden_states)

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
        from diffusers import Flux2Pipeline  # heavy

        return Flux2Pipeline

    def transformer_class(self) -> type:
        return _transformer_cls()
