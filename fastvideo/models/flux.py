"""The FLUX.1 family (dev, schnell, and the tiny folders of ``fastvideo.tiny``): load parts of a diffusers FLUX
folder, encode prompts, position ids, one transformer velocity call, the float32 rotary embedding of the NPU, and
``Flux1``, the ``ModelFamily`` adapter that the trainers reach through ``fastvideo.models``. The latent geometry,
packing and VAE decode it shares with other families live in ``models/common.py``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fastvideo import devices
from fastvideo.models.attention import (FALLBACK_ATTENTION_BACKEND, NPU_ATTENTION_BACKEND,  # noqa: F401
                                         choose_attention,
                                         attention_backend_names, attention_backend_of, check_attention_backend,
                                         set_attention_backend, set_npu_attention)
from fastvideo.models.base import (ModelFamily, SamplerDefaults, build_on_meta, check_components,  # noqa: F401
                                    component_folder, config_get, model_config, model_dtype, scheduler_settings, tag,
                                    unwrap_model)
from fastvideo.models.common import (LatentGeometry, _Float32Rope, decode, encode,  # noqa: F401
                                     hidden_and_text_tokens, keep_attention_dtype, latent_geometry, pack_latents, unpack_latents, vae_scale_factor)  # FLUX.1's too
from fastvideo.parallel import text_length_refusal
from fastvideo.tiny import FLUX_SCHEDULER_CONFIG as SCHEDULER_CONFIG  # FLUX.1-dev's: the grid of a folder without one

# component -> files of which at least one must exist for the component to count as present
_COMPONENT_FILES: dict[str, tuple[str, ...]] = {
    "transformer": ("config.json",),
    "vae": ("config.json",),
    "text_encoder": ("config.json",),
    "text_encoder_2": ("config.json",),
    "tokenizer": ("tokenizer.json", "vocab.json"),
    "tokenizer_2": ("tokenizer.json", "spiece.model"),
    "scheduler": ("scheduler_config.json",),
}
COMPONENTS: tuple[str, ...] = tuple(_COMPONENT_FILES)
TEXT_COMPONENTS: tuple[str, ...] = ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2")

_BUILD_HINT = ("pass a diffusers FLUX folder (e.g. a local download of black-forest-labs/FLUX.1-dev) "
               "or build a tiny one with `python -m fastvideo.tiny --preset tiny --out DIR`")


# ----------------------------------------------------------------------------------------------- loading
def check_model_folder(path: str | os.PathLike, components: tuple[str, ...] | list[str] = COMPONENTS) -> Path:
    """Return ``path`` as a Path if it holds the given FLUX components; else FileNotFoundError naming the fix."""
    return check_components(path, _COMPONENT_FILES, components, "FLUX", _BUILD_HINT)


def _subfolder(path: str | os.PathLike, name: str) -> Path:
    """``path/name`` if ``path`` is a pipeline folder, ``path`` itself if it already is the component folder."""
    return component_folder(path, name, check_model_folder)


def load_transformer(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu"):
    """Load the FluxTransformer2DModel of a FLUX folder (or a bare transformer folder) for training/sampling, adapted
    to ``device`` (``prepare_for_device``: float32 rotary embeddings and fused attention on an NPU)."""
    from diffusers import FluxTransformer2DModel  # heavy

    model = FluxTransformer2DModel.from_pretrained(_subfolder(path, "transformer"), torch_dtype=dtype,
                                                   local_files_only=True)
    model = model.to(device)
    keep_attention_dtype(model)
    prepare_for_device(model, device)
    return model


def transformer_folder(path: str | os.PathLike) -> Path:
    """The transformer component folder of a FLUX folder (or ``path`` itself if it is one)."""
    return _subfolder(path, "transformer")


def build_transformer(path: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """The FluxTransformer2DModel of a FLUX folder's config.json on the meta device: shapes only, no memory, no
    weights read (the 12B path: shard it, then ``weights.load_safetensors_into``; or count its parameters)."""
    from diffusers import FluxTransformer2DModel  # heavy

    model = build_on_meta(FluxTransformer2DModel, transformer_folder(path), dtype)
    keep_attention_dtype(model)
    return model


def load_vae(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Load the frozen AutoencoderKL of a FLUX folder (eval mode, no grad)."""
    from diffusers import AutoencoderKL  # heavy

    vae = AutoencoderKL.from_pretrained(_subfolder(path, "vae"), torch_dtype=dtype, local_files_only=True)
    return vae.to(device).eval().requires_grad_(False)


@dataclass
class TextEncoders:
    """FLUX's two frozen text encoders and their tokenizers (CLIP gives the pooled vector, T5 the sequence)."""

    clip_tokenizer: Any
    clip: Any
    t5_tokenizer: Any
    t5: Any

    @property
    def device(self) -> torch.device:
        return self.t5.device


def load_text_encoders(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                       device: str | torch.device = "cpu") -> TextEncoders:
    """Load only the tokenizers and text encoders of a FLUX folder (eval mode, no grad)."""
    from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast  # heavy

    folder = check_model_folder(path, TEXT_COMPONENTS)
    clip = CLIPTextModel.from_pretrained(folder / "text_encoder", dtype=dtype, local_files_only=True)
    t5 = T5EncoderModel.from_pretrained(folder / "text_encoder_2", dtype=dtype, local_files_only=True)
    return TextEncoders(
        clip_tokenizer=CLIPTokenizer.from_pretrained(folder / "tokenizer", local_files_only=True),
        clip=clip.to(device).eval().requires_grad_(False),
        t5_tokenizer=T5TokenizerFast.from_pretrained(folder / "tokenizer_2", local_files_only=True),
        t5=t5.to(device).eval().requires_grad_(False),
    )


def encoders_fingerprint(path: str | os.PathLike) -> str:
    """sha256 over the text encoders' and tokenizers' files: configs and tokenizer files in full, weights sampled.

    Used to tell whether stored prompt embeddings were made by the same text encoders.
    """
    return Flux1().encoders_fingerprint(path)


@torch.no_grad()
def encode_prompts(encoders: TextEncoders, prompts: list[str], max_sequence_length: int = 512
                   ) -> tuple[torch.Tensor, torch.Tensor, list[bool]]:
    """Encode prompts as ``FluxPipeline.encode_prompt`` does: T5 sequence ``(B, T, D)``, CLIP pooled ``(B, Dp)``,
    and per prompt whether the T5 or CLIP tokens were cut (T = ``max_sequence_length``, CLIP keeps 77)."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError("encode_prompts needs a non-empty list of prompt strings")
    if not 1 <= max_sequence_length <= 512:
        raise ValueError(f"max_sequence_length must be in [1, 512] (FLUX's T5 limit), got {max_sequence_length}")
    prompts = list(prompts)

    clip_tok, t5_tok = encoders.clip_tokenizer, encoders.t5_tokenizer
    clip_len = clip_tok.model_max_length
    clip_ids = clip_tok(prompts, padding="max_length", max_length=clip_len, truncation=True,
                        return_tensors="pt").input_ids
    pooled = encoders.clip(clip_ids.to(encoders.clip.device), output_hidden_states=False).pooler_output

    t5_ids = t5_tok(prompts, padding="max_length", max_length=max_sequence_length, truncation=True,
                    return_tensors="pt").input_ids
    prompt_embeds = encoders.t5(t5_ids.to(encoders.t5.device), output_hidden_states=False)[0]

    clip_full = clip_tok(prompts, verbose=False).input_ids
    t5_full = t5_tok(prompts, verbose=False).input_ids
    truncated = [len(c) > clip_len or len(t) > max_sequence_length for c, t in zip(clip_full, t5_full)]
    return prompt_embeds, pooled, truncated


def image_ids(geometry: LatentGeometry, device: str | torch.device | None = None,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(L, 3) rotary position ids of the packed image tokens: [0, row, col]."""
    rows, cols = geometry.latent_h // 2, geometry.latent_w // 2
    ids = torch.zeros(rows, cols, 3)
    ids[..., 1] = torch.arange(rows, dtype=ids.dtype)[:, None]
    ids[..., 2] = torch.arange(cols, dtype=ids.dtype)[None, :]
    return ids.reshape(rows * cols, 3).to(device=device, dtype=dtype)


def text_ids(num_tokens: int, device: str | torch.device | None = None,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(T, 3) rotary position ids of the text tokens: all zeros."""
    return torch.zeros(num_tokens, 3, device=device, dtype=dtype)


def predict_velocity(transformer: Any, latents: torch.Tensor, sigma: float | torch.Tensor,
                     prompt_embeds: torch.Tensor, pooled: torch.Tensor, img_ids: torch.Tensor,
                     txt_ids: torch.Tensor, guidance: float | torch.Tensor | None = 3.5) -> torch.Tensor:
    """Velocity (B, L, C) of the FLUX transformer at noise level ``sigma`` (fed unquantised as the timestep).

    The guidance embedding is fed only if ``transformer.config.guidance_embeds`` (FLUX.1-dev); works on the
    bare model and on FSDP2/FSDP1/peft/compiled wrappers. Inputs are cast to the model's dtype unless autocast
    is active; the output is float32.
    """
    batch = latents.shape[0]
    device = latents.device
    if prompt_embeds.shape[0] != batch or pooled.shape[0] != batch:
        raise ValueError(f"batch sizes differ: latents {batch}, prompt_embeds {prompt_embeds.shape[0]}, "
                         f"pooled {pooled.shape[0]}; repeat the embeddings per sample")
    timestep = torch.as_tensor(sigma, dtype=torch.float32, device=device)
    timestep = timestep.expand(batch) if timestep.ndim == 0 else timestep.reshape(batch)

    guidance_vec = None
    if config_get(model_config(transformer), "guidance_embeds", False):
        if guidance is None:
            raise ValueError("this transformer has a guidance embedding (FLUX.1-dev style): pass guidance "
                             "(3.5 is FLUX.1-dev's default)")
        guidance_vec = torch.as_tensor(guidance, dtype=torch.float32, device=device)
        guidance_vec = guidance_vec.expand(batch) if guidance_vec.ndim == 0 else guidance_vec.reshape(batch)

    if not torch.is_autocast_enabled(device.type):
        dtype = model_dtype(transformer)
        latents, prompt_embeds, pooled = latents.to(dtype), prompt_embeds.to(dtype), pooled.to(dtype)
    sp = sequence_parallel_size(transformer)
    if prompt_embeds.shape[1] % sp:  # Ulysses splits the text evenly; padding it would add tokens attention reads
        raise ValueError(text_length_refusal(prompt_embeds.shape[1], sp))
    out = transformer(
        hidden_states=latents,
        timestep=timestep,
        guidance=guidance_vec,
        pooled_projections=pooled,
        encoder_hidden_states=prompt_embeds,
        txt_ids=txt_ids,
        img_ids=img_ids,
        return_dict=False,
    )[0]
    return out.float()


def sequence_parallel_size(transformer: Any) -> int:
    """The Ulysses degree ``parallel.enable_sequence_parallel`` gave the transformer (1 without)."""
    return getattr(unwrap_model(transformer), "_fastvideo_sp_size", 1)


def vae_fingerprint(path: str | os.PathLike) -> str:
    """sha256 over a FLUX folder's ``vae/`` files (configs in full, weights sampled): tells whether cached
    latents were made by the same VAE."""
    return Flux1().vae_fingerprint(path)


def _make_float32_pos_embed_class() -> type:
    """Define ``Float32FluxPosEmbed`` (diffusers is imported only when it is first asked for)."""
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed  # heavy

    class Float32FluxPosEmbed(FluxPosEmbed):
        """diffusers' ``FluxPosEmbed`` computed in float32 only (Ascend NPUs have no float64), matching its float64
        result to ~3e-7 (see ``_Float32Rope``); no parameters or buffers, so checkpoints are unchanged."""

        def __init__(self, theta: int, axes_dim: list[int]):
            super().__init__(theta=theta, axes_dim=axes_dim)
            self._rope = _Float32Rope(theta, axes_dim)

        def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """ids (N, n_axes) -> (freqs_cos, freqs_sin), each (N, sum(axes_dim)) float32 on ids' device."""
            return self._rope(ids)

        def extra_repr(self) -> str:
            return f"theta={self.theta}, axes_dim={list(self.axes_dim)}, float32"

    Float32FluxPosEmbed.__module__ = __name__
    Float32FluxPosEmbed.__qualname__ = "Float32FluxPosEmbed"
    return Float32FluxPosEmbed


def _float32_pos_embed_class() -> type:
    """``Float32FluxPosEmbed``, defined on first use and then a module attribute like any other."""
    if "Float32FluxPosEmbed" not in globals():
        globals()["Float32FluxPosEmbed"] = _make_float32_pos_embed_class()
    return globals()["Float32FluxPosEmbed"]


def __getattr__(name: str) -> Any:
    """Lazy module attribute ``Float32FluxPosEmbed`` (keeps ``import fastvideo.flux`` free of diffusers)."""
    if name == "Float32FluxPosEmbed":
        return _float32_pos_embed_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def use_float32_rope(transformer: Any) -> bool:
    """Replace the FLUX transformer's ``pos_embed`` (through wrappers) by ``Float32FluxPosEmbed``, for devices
    without float64; True if it swapped, False if it already was one."""
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed  # heavy

    cls = _float32_pos_embed_class()
    model = unwrap_model(transformer)
    current = getattr(model, "pos_embed", None)
    if isinstance(current, cls):
        return False
    if not isinstance(current, FluxPosEmbed):
        raise ValueError(f"{type(model).__name__} has no FluxPosEmbed `pos_embed`: pass a FluxTransformer2DModel")
    model.pos_embed = cls(theta=current.theta, axes_dim=list(current.axes_dim))
    return True


def prepare_for_device(transformer: Any, device: torch.device | str, *,
                       param_dtype: torch.dtype | None = None, attention_backend: str = "auto") -> list[str]:
    """Adapt a FLUX transformer to ``device``'s type; returns what it changed (print it). On "npu": float32
    rotary embedding (``use_float32_rope``) and, where diffusers offers it, the ``_native_npu`` fused attention.
    cuda / cpu: nothing. ``attention_backend`` other than "auto" (--attention_backend): that diffusers backend in
    every attention layer, or ``native`` with one warning when unavailable (``set_attention_backend``).

    ``param_dtype``: the dtype of the weights during the forward (FSDP mixed precision's ``param_dtype``; default:
    the stored weights' dtype), which is the dtype of q, k and v at every attention call (``ComputeDtypeRMSNorm``).
    NPU fused attention takes only bf16/fp16 q, k and v, so with float32 compute SDPA is kept.
    """
    model = unwrap_model(transformer)
    npu = devices.device_type(device) == "npu"
    done = ["pos_embed: Float32FluxPosEmbed (rotary angles in float32; the NPU has no float64)"] \
        if npu and use_float32_rope(model) else []
    return done + choose_attention(model, device, param_dtype, attention_backend)


def transformer_flops(config: Any, image_tokens: int, text_tokens: int, batch: int = 1, *,
                      backward: bool = False, weight_grads: bool = True) -> int:
    """FLOPs of one FLUX.1 transformer forward (``backward``: forward + backward = 3x, input and weight gradients) on
    ``batch`` samples of ``image_tokens`` packed image tokens and ``text_tokens`` T5 tokens. ``weight_grads=False``
    (LoRA: frozen base weights) counts the backward's input gradients only: the matmuls once more, attention twice.

    Per sample, with width D, N = L + T tokens: each double block 24·N·D² (img and txt q/k/v/out and 4x MLPs)
    + 4·N²·D (QKᵀ and AV) + 24·D² (two adaLN D->6D), each single block 24·N·D² + 4·N²·D + 6·D², plus the
    embedders (x, context, timestep/guidance/pooled MLPs) and the output adaLN and projection.
    """
    D = config_get(config, "num_attention_heads") * config_get(config, "attention_head_dim")
    L, T = int(image_tokens), int(text_tokens)
    N = L + T
    in_ch = config_get(config, "in_channels", 64)
    out_ch = (config_get(config, "out_channels") or in_ch) * config_get(config, "patch_size", 1) ** 2
    joint, pooled = config_get(config, "joint_attention_dim"), config_get(config, "pooled_projection_dim")
    embedders = 2 * L * in_ch * D + 2 * T * joint * D
    embedders += 2 * (256 * D + D * D) * (2 if config_get(config, "guidance_embeds", False) else 1)  # timestep (+ guidance)
    embedders += 2 * (pooled * D + D * D)  # pooled text
    double = config_get(config, "num_layers") * (24 * N * D * D + 4 * N * N * D + 24 * D * D)
    single = config_get(config, "num_single_layers") * (24 * N * D * D + 4 * N * N * D + 6 * D * D)
    output = 2 * D * 2 * D + 2 * L * D * out_ch
    forward = batch * (embedders + double + single + output)
    if not backward:
        return forward
    if weight_grads:
        return 3 * forward
    attention = batch * (config_get(config, "num_layers") + config_get(config, "num_single_layers")) * 4 * N * N * D
    return 2 * forward + attention


# ------------------------------------------------------------------------------------------------ the adapter
# The diffusers FLUX DreamBooth-LoRA default: every attention projection of the double-stream blocks (image
# stream to_q/to_k/to_v/to_out.0, text stream add_q/k/v_proj/to_add_out), the single-stream blocks' attention
# to_q/to_k/to_v (peft matches name suffixes, so "attn.to_q" covers both block kinds), and both feed-forward
# networks of the double-stream blocks. Single blocks' proj_mlp/proj_out are left out (as in diffusers).
LORA_TARGET_MODULES: tuple[str, ...] = (
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
)
MAX_T5_TOKENS = 512  # FluxPipeline's max_sequence_length limit


class Flux1(ModelFamily):
    """FLUX.1: T5 sequence + CLIP pooled prompt embeddings, 2x2-packed latents with rotary position ids (text ids
    zero), the distilled guidance embedding where the transformer has one (dev; schnell has none), and
    FluxPipeline's resolution-dependent dynamic shift. Every method is the module function of the same name."""

    name = "flux1"
    pipeline_classes = ("FluxPipeline",)
    transformer_classes = ("FluxTransformer2DModel",)
    text_components = TEXT_COMPONENTS
    embedding_keys = ("prompt_embeds", "pooled_prompt_embeds")
    defaults = SamplerDefaults(steps=28, guidance=3.5, height=1024, width=1024, max_sequence_length=MAX_T5_TOKENS)
    lora_target_modules = LORA_TARGET_MODULES
    block_lists = ("transformer_blocks", "single_transformer_blocks")
    sequence_parallel = True
    recipes = {"grpo": "scripts/recipes/dancegrpo_hps.yaml", "dpo": "scripts/recipes/dpo.yaml",
               "dpo_offline": "scripts/recipes/dpo_offline.yaml", "nft": "scripts/recipes/nft.yaml"}

    def check_folder(self, path, components=None):
        return check_model_folder(path, COMPONENTS if components is None else components)

    def transformer_folder(self, path):
        return transformer_folder(path)

    def build_transformer(self, path, dtype=torch.float32):
        return tag(build_transformer(path, dtype), self)

    def load_transformer(self, path, dtype=torch.float32, device="cpu"):
        return tag(load_transformer(path, dtype, device), self)

    def load_vae(self, path, dtype=torch.float32, device="cpu"):
        return load_vae(path, dtype, device)

    def load_text_encoders(self, path, dtype=torch.float32, device="cpu"):
        return load_text_encoders(path, dtype, device)

    def encode_prompts(self, encoders, prompts, max_sequence_length):
        prompt_embeds, pooled, truncated = encode_prompts(encoders, prompts, max_sequence_length)
        return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}, truncated

    def max_sequence_length_limit(self) -> int:
        return MAX_T5_TOKENS

    def latent_geometry(self, vae_or_config, height, width):
        return latent_geometry(vae_or_config, height, width)

    def conditioning(self, geometry, cond, guidance, device):
        embeds = cond["prompt_embeds"]
        return {"img_ids": devices.to_device(image_ids(geometry, dtype=embeds.dtype), device),
                "txt_ids": text_ids(embeds.shape[1], device, embeds.dtype),
                "guidance": None if guidance is None else devices.to_device(torch.tensor(float(guidance)), device)}

    def predict_velocity(self, transformer, latents, sigma, cond, shared):
        return predict_velocity(transformer, latents, sigma, cond["prompt_embeds"], cond["pooled_prompt_embeds"],
                                shared["img_ids"], shared["txt_ids"], guidance=shared["guidance"])

    def sigmas(self, steps, image_seq_len, scheduler=None):
        """FluxPipeline's dynamic shift with the folder's constants (base/max shift over base/max sequence length:
        FLUX.1-dev's 0.5/1.15 over 256..4096 tokens where the folder has no scheduler config)."""
        from fastvideo.schedulers import get_sigmas

        c = scheduler_settings(scheduler, SCHEDULER_CONFIG, "FLUX.1",
                               {"use_dynamic_shifting": True, "time_shift_type": "exponential", "shift_terminal": None})
        return get_sigmas(steps, image_seq_len=image_seq_len, base_seq_len=c["base_image_seq_len"],
                          max_seq_len=c["max_image_seq_len"], base_shift=c["base_shift"], max_shift=c["max_shift"])

    def decode(self, vae, latents, geometry, micro_batch=None):
        return decode(vae, latents, geometry, micro_batch)

    def encode(self, vae, images, geometry, micro_batch=None):
        return encode(vae, images, geometry, micro_batch)

    transformer_flops = staticmethod(transformer_flops)

    def forward_tokens(self, args, kwargs):
        return hidden_and_text_tokens(args, kwargs)

    def example_inputs(self, config, batch, image_tokens, text_tokens, dtype, device):
        return dict(
            hidden_states=torch.empty(batch, image_tokens, config_get(config, "in_channels"), device=device,
                                      dtype=dtype),
            encoder_hidden_states=torch.empty(batch, text_tokens, config_get(config, "joint_attention_dim"),
                                              device=device, dtype=dtype),
            pooled_projections=torch.empty(batch, config_get(config, "pooled_projection_dim"), device=device,
                                           dtype=dtype),
            timestep=torch.empty(batch, device=device),
            guidance=torch.empty(batch, device=device) if config_get(config, "guidance_embeds") else None,
            img_ids=torch.empty(image_tokens, 3, device=device), txt_ids=torch.empty(text_tokens, 3, device=device),
            return_dict=False)

    def prepare_for_device(self, transformer, device, *, param_dtype=None, attention_backend="auto"):
        return prepare_for_device(transformer, device, param_dtype=param_dtype, attention_backend=attention_backend)

    def pipeline_class(self) -> type:
        from diffusers import FluxPipeline  # heavy

        return FluxPipeline

    def transformer_class(self) -> type:
        from diffusers import FluxTransformer2DModel  # heavy

        return FluxTransformer2DModel
