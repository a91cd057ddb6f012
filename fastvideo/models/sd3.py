"""The SD3 / SD3.5 family (diffusers ``StableDiffusion3Pipeline`` + ``SD3Transformer2DModel``): three text encoders
(CLIP-L and CLIP-G with projection, T5-XXL), a 2x2-patch MMDiT (SD3.5: q/k RMSNorm and, in SD3.5-Medium, dual
attention blocks), a 16-channel VAE with a shift, and FlowMatchEulerDiscreteScheduler's static shift 3.

Layouts the rest of the project sees (``SD3``, the ``ModelFamily`` adapter):

- text: ``prompt_embeds`` ``(N, 77 + T, D_t5)`` = [CLIP-L penultimate hidden | CLIP-G penultimate hidden] zero-padded
  to the T5 width, then the T5 sequence; ``pooled_prompt_embeds`` ``(N, P_l + P_g)`` = both CLIP projections. SD3
  attends over every token (no mask), so nothing is trimmed on collate.
- latents: packed 2x2 into ``(B, L, 4C)`` tokens exactly as FLUX.1's (``common.pack_latents``), unpacked to the
  ``(B, C, h, w)`` layout the transformer takes for each call; the VAE normalisation ``(z - shift) * scale`` is
  the pipeline's (``common.decode`` / ``common.encode``, shared with FLUX.1, do the same arithmetic).
- time: the transformer gets ``sigma * 1000`` (the scheduler's ``timesteps``), computed on the device.

``build_tiny`` writes a seeded tiny SD3.5 folder (64px, q/k RMSNorm, one dual-attention block) that the stock
pipeline loads; ``write_config`` writes stabilityai/stable-diffusion-3.5-medium's configs with no weights.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fastvideo import tiny
from fastvideo.models import common
from fastvideo.models.attention import attention_backend_of, set_attention_backend
from fastvideo.models.base import (ModelFamily, SamplerDefaults, build_on_meta, check_components, component_folder,
                                   config_get, model_dtype, scheduler_settings, tag, unwrap_model)
from fastvideo.models.common import keep_attention_dtype

_COMPONENT_FILES: dict[str, tuple[str, ...]] = {
    "transformer": ("config.json",),
    "vae": ("config.json",),
    "text_encoder": ("config.json",),
    "text_encoder_2": ("config.json",),
    "text_encoder_3": ("config.json",),
    "tokenizer": ("tokenizer.json", "vocab.json"),
    "tokenizer_2": ("tokenizer.json", "vocab.json"),
    "tokenizer_3": ("tokenizer.json", "spiece.model"),
    "scheduler": ("scheduler_config.json",),
}
COMPONENTS: tuple[str, ...] = tuple(_COMPONENT_FILES)
TEXT_COMPONENTS: tuple[str, ...] = ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2", "tokenizer_3",
                                    "text_encoder_3")
_HINT = ("pass a diffusers SD3/SD3.5 folder (e.g. a local download of stabilityai/stable-diffusion-3.5-medium) or "
         "build a tiny one with `python -m fastvideo.tiny --preset sd3-tiny --out DIR`")

CLIP_TOKENS = 77  # StableDiffusion3Pipeline.tokenizer_max_length (CLIP-L's model_max_length), for both CLIPs
MAX_T5_TOKENS = 512  # StableDiffusion3Pipeline.check_inputs: max_sequence_length <= 512
DEFAULT_T5_TOKENS = 256  # StableDiffusion3Pipeline.__call__(max_sequence_length=256)
NUM_TRAIN_TIMESTEPS = 1000  # FlowMatchEulerDiscreteScheduler: timestep = sigma * 1000
SHIFT = 3.0  # SD3 / SD3.5 scheduler_config.json: {"shift": 3.0}, no dynamic shifting
PATCH_SIZE = 2  # SD3Transformer2DModel.patch_size of every released SD3/SD3.5 checkpoint

# Default LoRA targets: the joint attention's projections of both streams, as Flow-GRPO's scripts/train_sd3.py (SD3.5-M
# GRPO) and diffusers' train_dreambooth_lora_sd3.py (no --lora_layers) choose. peft matches name suffixes, so the
# dual-attention blocks' ``attn2`` (image-only self-attention) is not adapted, as in both scripts; the last block has
# no ``to_add_out`` (context_pre_only), the other blocks have it.
LORA_TARGET_MODULES: tuple[str, ...] = (
    "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
    "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v",
)


@dataclass
class TextEncoders:
    """SD3's three frozen text encoders and their tokenizers: CLIP-L and CLIP-G (penultimate hidden states and the
    projected pooled vectors) and T5 (the sequence)."""

    clip_l_tokenizer: Any
    clip_l: Any
    clip_g_tokenizer: Any
    clip_g: Any
    t5_tokenizer: Any
    t5: Any

    @property
    def device(self) -> torch.device:
        return self.t5.device


def image_size(image_tokens: int) -> tuple[int, int]:
    """Patch grid (rows, cols) with rows * cols = ``image_tokens``, as square as possible (rows <= cols)."""
    rows = math.isqrt(int(image_tokens))
    while image_tokens % rows:
        rows -= 1
    return rows, int(image_tokens) // rows


def sigmas(steps: int, shift: float = SHIFT, num_train_timesteps: int = NUM_TRAIN_TIMESTEPS) -> torch.Tensor:
    """The (S+1,) float32 sigmas of ``FlowMatchEulerDiscreteScheduler(shift=3)`` after ``set_timesteps(steps)``, bit
    for bit (``common.static_shift_sigmas``)."""
    return common.static_shift_sigmas(steps, shift, num_train_timesteps)


# ------------------------------------------------------------------------------------------------- FLOPs
def transformer_flops(config: Any, image_tokens: int, text_tokens: int, batch: int = 1, *,
                      backward: bool = False, weight_grads: bool = True) -> int:
    """FLOPs of one SD3Transformer2DModel forward (2 per multiply-add, as ``torch.utils.flop_counter`` counts) on
    ``batch`` samples of ``image_tokens`` patches and ``text_tokens`` text tokens, and with ``backward`` its backward
    as autograd runs it: weight and input gradients of every matmul (the input layers' inputs need none) and
    attention twice; ``weight_grads=False`` (LoRA on the default targets, base frozen): input gradients only, of the
    matmuls after the first block's q/k/v projections (no gradient reaches the embedders or the adaLN modulations,
    which see only the timestep and pooled text), not counting the rank-r adapters themselves.

    Per sample, width D, N = L + T: a joint block 24·N·D² (both streams' q/k/v/out and 4x MLPs) + 4·N²·D + 24·D²
    (two adaLN D->6D); the last block (context_pre_only) has no context out-projection or MLP (18·T·D² less) and a
    D->2D context adaLN; a dual-attention block adds an image self-attention 8·L·D² + 4·L²·D and 6·D² of adaLN.
    """
    D = config_get(config, "num_attention_heads") * config_get(config, "attention_head_dim")
    L, T = int(image_tokens), int(text_tokens)
    N = L + T
    layers = int(config_get(config, "num_layers"))
    dual = {int(i) for i in config_get(config, "dual_attention_layers", ()) or () if 0 <= int(i) < layers}
    p = config_get(config, "patch_size", PATCH_SIZE)
    in_ch = config_get(config, "in_channels", 16)
    inputs = (2 * L * in_ch * p * p * D  # patch embedding (a p x p stride-p conv)
              + 2 * T * config_get(config, "joint_attention_dim") * config_get(config, "caption_projection_dim", D)
              + 2 * 256 * D + 2 * config_get(config, "pooled_projection_dim") * D)  # timestep / pooled MLPs' inputs
    embed = inputs + 2 * (2 * D * D)  # + the two MLPs' second layers
    blocks = layers * 24 * N * D * D - 18 * T * D * D + len(dual) * 8 * L * D * D  # token matmuls of the blocks
    attention = layers * 4 * N * N * D + len(dual) * 4 * L * L * D
    modulation = layers * 24 * D * D - 8 * D * D + len(dual) * 6 * D * D + 4 * D * D  # adaLNs and norm_out
    output = 2 * L * D * p * p * (config_get(config, "out_channels") or in_ch)
    forward = embed + blocks + attention + modulation + output
    if not backward:
        return batch * forward
    if weight_grads:
        return batch * (3 * forward - inputs)
    first_attn2 = 0 in dual  # the first block's image self-attention sees no gradient-carrying input either
    grads = blocks - 6 * N * D * D - first_attn2 * 8 * L * D * D + output
    return batch * (forward + grads + 2 * (attention - first_attn2 * 4 * L * L * D))


# ------------------------------------------------------------------------------------------------ the adapter
class SD3(ModelFamily):
    """SD3 / SD3.5: CLIP-L + CLIP-G + T5 prompt embeddings (77 + T tokens, no mask) and the two CLIP pooled vectors,
    2x2-packed 16-channel latents unpacked for each transformer call (timestep = sigma * 1000), the scheduler's
    static shift 3, and true CFG (``v_u + s (v_c - v_u)``, the base default) with an empty negative prompt."""

    name = "sd3"
    pipeline_classes = ("StableDiffusion3Pipeline",)
    transformer_classes = ("SD3Transformer2DModel",)
    text_components = TEXT_COMPONENTS
    embedding_keys = ("prompt_embeds", "pooled_prompt_embeds")
    # StableDiffusion3Pipeline.__call__ defaults (SD3.5-Medium: sample_size 128 x VAE factor 8 = 1024px, 28 steps,
    # guidance_scale 7.0, max_sequence_length 256, negative prompt ""). Flow-GRPO trains SD3.5-M at 512px with 10
    # sampling steps, CFG 4.5 and 128 T5 tokens (scripts/train_sd3.py, config/grpo.py): pass those as flags.
    defaults = SamplerDefaults(steps=28, guidance=None, height=1024, width=1024,
                               max_sequence_length=DEFAULT_T5_TOKENS, shift=SHIFT, cfg_scale=7.0, negative_prompt="")
    lora_target_modules = LORA_TARGET_MODULES
    # the launchers' defaults (scripts/recipes/)
    recipes = {"grpo": "scripts/recipes/flow_grpo_sd3_pickscore.yaml", "nft": "scripts/recipes/nft_sd3.yaml"}
    block_lists = ("transformer_blocks",)
    sequence_parallel = False

    # ------------------------------------------------------------------------------------------- loading
    def check_folder(self, path, components=None):
        return check_components(path, _COMPONENT_FILES, COMPONENTS if components is None else components, "SD3",
                                _HINT)

    def transformer_folder(self, path):
        return component_folder(path, "transformer", self.check_folder)

    def build_transformer(self, path, dtype=torch.float32):
        """SD3Transformer2DModel from its config on the meta device; its persistent ``pos_embed`` buffer (the
        position table) is in the checkpoint, so sharded loading fills it like a weight."""
        from diffusers import SD3Transformer2DModel  # heavy

        model = build_on_meta(SD3Transformer2DModel, self.transformer_folder(path), dtype)
        keep_attention_dtype(model)
        return tag(model, self)

    def load_transformer(self, path, dtype=torch.float32, device="cpu"):
        from diffusers import SD3Transformer2DModel  # heavy

        model = SD3Transformer2DModel.from_pretrained(self.transformer_folder(path), torch_dtype=dtype,
                                                      local_files_only=True).to(device)
        keep_attention_dtype(model)
        return tag(model, self)

    def load_vae(self, path, dtype=torch.float32, device="cpu"):
        from diffusers import AutoencoderKL  # heavy

        vae = AutoencoderKL.from_pretrained(component_folder(path, "vae", self.check_folder), torch_dtype=dtype,
                                            local_files_only=True)
        return vae.to(device).eval().requires_grad_(False)

    def load_text_encoders(self, path, dtype=torch.float32, device="cpu") -> TextEncoders:
        from transformers import CLIPTextModelWithProjection, CLIPTokenizer, T5EncoderModel, T5TokenizerFast  # heavy

        folder = self.check_folder(path, TEXT_COMPONENTS)

        def encoder(cls: Any, name: str) -> Any:
            model = cls.from_pretrained(folder / name, dtype=dtype, local_files_only=True)
            return model.to(device).eval().requires_grad_(False)

        return TextEncoders(
            clip_l_tokenizer=CLIPTokenizer.from_pretrained(folder / "tokenizer", local_files_only=True),
            clip_l=encoder(CLIPTextModelWithProjection, "text_encoder"),
            clip_g_tokenizer=CLIPTokenizer.from_pretrained(folder / "tokenizer_2", local_files_only=True),
            clip_g=encoder(CLIPTextModelWithProjection, "text_encoder_2"),
            t5_tokenizer=T5TokenizerFast.from_pretrained(folder / "tokenizer_3", local_files_only=True),
            t5=encoder(T5EncoderModel, "text_encoder_3"))

    @torch.no_grad()
    def encode_prompts(self, encoders, prompts, max_sequence_length):
        """``StableDiffusion3Pipeline.encode_prompt`` (clip_skip None, one image per prompt): ``prompt_embeds``
        ``(N, 77 + max_sequence_length, D_t5)``, ``pooled_prompt_embeds`` ``(N, P_l + P_g)``, and per prompt
        whether a tokenizer cut it. Each CLIP runs on its 77 padded ids: its penultimate hidden layer is the
        sequence, its ``text_embeds`` the pooled vector; T5 gets ``max_sequence_length`` padded ids and no attention
        mask (as in the pipeline), so the padding tokens' embeddings are part of the sequence."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise ValueError("encode_prompts needs a non-empty list of prompt strings")
        if not 1 <= max_sequence_length <= MAX_T5_TOKENS:
            raise ValueError(f"max_sequence_length must be in [1, {MAX_T5_TOKENS}] (StableDiffusion3Pipeline's T5 "
                             f"limit), got {max_sequence_length}")
        prompts = list(prompts)
        clip_len = encoders.clip_l_tokenizer.model_max_length  # the pipeline uses CLIP-L's length for both CLIPs
        hidden, pooled, cut = [], [], [False] * len(prompts)
        for tokenizer, encoder in ((encoders.clip_l_tokenizer, encoders.clip_l),
                                   (encoders.clip_g_tokenizer, encoders.clip_g)):
            ids = tokenizer(prompts, padding="max_length", max_length=clip_len, truncation=True,
                            return_tensors="pt").input_ids
            out = encoder(ids.to(encoder.device), output_hidden_states=True)
            hidden.append(out.hidden_states[-2].to(encoders.clip_l.dtype))
            pooled.append(out.text_embeds)
            cut = [c or len(full) > clip_len for c, full in zip(cut, tokenizer(prompts).input_ids)]
        t5_ids = encoders.t5_tokenizer(prompts, padding="max_length", max_length=max_sequence_length,
                                       truncation=True, add_special_tokens=True, return_tensors="pt").input_ids
        t5 = encoders.t5(t5_ids.to(encoders.t5.device))[0].to(encoders.t5.dtype)
        cut = [c or len(full) > max_sequence_length for c, full in zip(cut, encoders.t5_tokenizer(prompts).input_ids)]
        clip = torch.cat(hidden, dim=-1)
        if clip.shape[-1] > t5.shape[-1]:
            raise ValueError(f"the CLIP hidden states ({clip.shape[-1]} wide) do not fit the T5 width "
                             f"{t5.shape[-1]}: text_encoder/text_encoder_2/text_encoder_3 are not one SD3 model's")
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))  # zero columns up to T5's width
        return {"prompt_embeds": torch.cat([clip, t5], dim=-2),
                "pooled_prompt_embeds": torch.cat(pooled, dim=-1)}, cut

    def max_sequence_length_limit(self) -> int:
        return MAX_T5_TOKENS

    def text_tokens(self, max_sequence_length: int, condition: tuple[int, int] | None = None) -> int:
        return CLIP_TOKENS + int(max_sequence_length)

    # ------------------------------------------------------------------------------------------- latents
    def latent_geometry(self, vae_or_config, height, width):
        """``common.LatentGeometry``: sizes must be multiples of VAE factor x patch 2 (the pipeline's check_inputs)."""
        if isinstance(vae_or_config, (str, os.PathLike)):
            folder = Path(vae_or_config).expanduser()
            if not (folder / "config.json").is_file():
                self.check_folder(folder, ("vae",))  # SD3's message, not FLUX's, for a folder without vae/
        return common.latent_geometry(vae_or_config, height, width)

    def conditioning(self, geometry, cond, guidance, device):
        return {"geometry": geometry}  # no position ids or distilled guidance: only the unpacking layout

    def predict_velocity(self, transformer, latents, sigma, cond, shared):
        """The transformer on the unpacked ``(B, C, h, w)`` latents at timestep ``sigma * 1000`` (the scheduler's
        timesteps, computed on the device: no host read); inputs in the model's dtype unless autocast is on (the
        timestep stays float32, as in the pipeline); float32 packed output."""
        embeds, pooled = cond["prompt_embeds"], cond["pooled_prompt_embeds"]
        batch = latents.shape[0]
        if embeds.shape[0] != batch or pooled.shape[0] != batch:
            raise ValueError(f"batch sizes differ: latents {batch}, prompt_embeds {embeds.shape[0]}, pooled "
                             f"{pooled.shape[0]}; repeat the embeddings per sample")
        timestep = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device) * NUM_TRAIN_TIMESTEPS
        timestep = timestep.expand(batch) if timestep.ndim == 0 else timestep.reshape(batch)
        x = common.unpack_latents(latents, shared["geometry"])  # the transformer patchifies 2x2 itself
        if not torch.is_autocast_enabled(latents.device.type):
            dtype = model_dtype(transformer)
            x, embeds, pooled = x.to(dtype), embeds.to(dtype), pooled.to(dtype)
        out = transformer(hidden_states=x, timestep=timestep, encoder_hidden_states=embeds,
                          pooled_projections=pooled, return_dict=False)[0]
        return common.pack_latents(out).float()

    def sigmas(self, steps, image_seq_len, scheduler=None):
        """The static shift of the folder's scheduler config (SD3/SD3.5: 3.0), the same grid at every resolution."""
        c = scheduler_settings(scheduler, SD3_SCHEDULER_CONFIG, "SD3",
                               {"use_dynamic_shifting": False, "shift_terminal": None})
        return sigmas(steps, float(c["shift"]), int(c["num_train_timesteps"]))

    def decode(self, vae, latents, geometry, micro_batch=None):
        return common.decode(vae, latents, geometry, micro_batch)  # latents / scaling + shift, as the pipeline

    def encode(self, vae, images, geometry, micro_batch=None):
        return common.encode(vae, images, geometry, micro_batch)

    # ---------------------------------------------------------------------------------- FLOPs and plan
    def transformer_flops(self, config, image_tokens, text_tokens, batch=1, *, backward=False, weight_grads=True):
        return transformer_flops(config, image_tokens, text_tokens, batch, backward=backward,
                                 weight_grads=weight_grads)

    def forward_tokens(self, args, kwargs):
        x = kwargs.get("hidden_states", args[0] if args else None)  # (B, C, H, W) latents
        text = kwargs.get("encoder_hidden_states")  # (B, 77 + T, D)
        if x is None or text is None or x.ndim != 4:
            return None
        return x.shape[0], (x.shape[2] // PATCH_SIZE) * (x.shape[3] // PATCH_SIZE), text.shape[1]

    def example_inputs(self, config, batch, image_tokens, text_tokens, dtype, device):
        p = config_get(config, "patch_size", PATCH_SIZE)
        rows, cols = image_size(image_tokens)

        def empty(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
            return torch.empty(*shape, device=device, dtype=dtype)

        return dict(hidden_states=empty(batch, config_get(config, "in_channels"), rows * p, cols * p),
                    encoder_hidden_states=empty(batch, text_tokens, config_get(config, "joint_attention_dim")),
                    pooled_projections=empty(batch, config_get(config, "pooled_projection_dim")),
                    timestep=empty(batch, dtype=torch.float32), return_dict=False)

    # ------------------------------------------------------------------------------------ device, export
    def prepare_for_device(self, transformer, device, *, param_dtype=None, attention_backend="auto"):
        """SD3 needs no device rewrite: no rotary embedding (a float32 position table, a float32 timestep
        embedding), so nothing uses float64 on an NPU. diffusers' ``JointAttnProcessor2_0`` calls torch SDPA itself
        (no backend dispatch in diffusers <= 0.42): --attention_backend is applied where the processors take one,
        and reported as without effect otherwise."""
        model = unwrap_model(transformer)
        if attention_backend == "auto":
            return []
        if not attention_backend_of(model):  # no attention processor of this model reads a backend
            return [f"attention backend: torch SDPA (diffusers' SD3 attention processors do not dispatch; "
                    f"--attention_backend {attention_backend} has no effect)"]
        used = set_attention_backend(model, attention_backend, device, param_dtype or model_dtype(model))
        suffix = "" if used == attention_backend else f" (--attention_backend {attention_backend} unavailable)"
        return [f"attention backend: {used}{suffix}"]

    def pipeline_class(self) -> type:
        from diffusers import StableDiffusion3Pipeline  # heavy

        return StableDiffusion3Pipeline

    def transformer_class(self) -> type:
        from diffusers import SD3Transformer2DModel  # heavy

        return SD3Transformer2DModel


# ---------------------------------------------------------------------------------------------- presets
@dataclass(frozen=True)
class TinySD3:
    """Sizes of the tiny SD3.5 folder (64px default: VAE factor 4 -> 16x16x16 latents -> 64 packed tokens of 64)."""

    height: int = 64
    width: int = 64
    num_layers: int = 2
    dual_attention_layers: tuple[int, ...] = (0,)
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    pos_embed_max_size: int = 32  # patches per side: up to 256px at VAE factor 4
    latent_channels: int = 16
    vae_block_out_channels: tuple[int, ...] = (8, 16, 16)
    clip_l_hidden: int = 16
    clip_g_hidden: int = 32
    t5_d_model: int = 64  # > 16 + 32: the pipeline's zero padding of the CLIP columns is exercised
    conditioning_gain: float = 5.0  # see _tiny_components


TINY = TinySD3()
# stabilityai/stable-diffusion-3.5-medium's configs (diffusers layout), as constructor kwargs
SD35_MEDIUM_TRANSFORMER_CONFIG = {
    "sample_size": 128, "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 24,
    "attention_head_dim": 64, "num_attention_heads": 24, "joint_attention_dim": 4096,
    "caption_projection_dim": 1536, "pooled_projection_dim": 2048, "pos_embed_max_size": 384,
    "dual_attention_layers": tuple(range(13)), "qk_norm": "rms_norm",
}
# SD3's VAE is FLUX.1's architecture (16 latent channels, no quant convs) with its own latent normalisation
SD35_MEDIUM_VAE_CONFIG = {**tiny.FLUX_DEV_VAE_CONFIG, "scaling_factor": 1.5305, "shift_factor": 0.0609}
SD35_MEDIUM_CLIP_G_CONFIG = {  # OpenCLIP ViT-bigG/14 text tower with projection
    "architectures": ["CLIPTextModelWithProjection"], "vocab_size": 49408, "hidden_size": 1280,
    "intermediate_size": 5120, "projection_dim": 1280, "num_hidden_layers": 32, "num_attention_heads": 20,
    "max_position_embeddings": 77, "hidden_act": "gelu", "layer_norm_eps": 1e-5, "attention_dropout": 0.0,
    "dropout": 0.0, "initializer_factor": 1.0, "initializer_range": 0.02, "bos_token_id": 0, "eos_token_id": 2,
    "pad_token_id": 1, "dtype": "float16",
}
SD3_SCHEDULER_CONFIG = {"num_train_timesteps": NUM_TRAIN_TIMESTEPS, "shift": SHIFT}
SD35_MEDIUM_TRANSFORMER_PARAMETERS = 2_243_171_520  # build_transformer(write_config(...)) parameters (no pos table)


def _model_index() -> dict:
    """SD3.5's model_index.json (component -> (library, class))."""
    import diffusers  # heavy

    return {
        "_class_name": "StableDiffusion3Pipeline",
        "_diffusers_version": diffusers.__version__,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
        "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
        "text_encoder_3": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "tokenizer_2": ["transformers", "CLIPTokenizer"],
        "tokenizer_3": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "SD3Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }


def _save_tokenizers(out: Path) -> None:
    """CLIP BPE twice (tokenizer_2 pads with "!", id 0, as SD3's CLIP-G tokenizer does) and the small T5."""
    from transformers import CLIPTokenizer  # heavy

    tiny.save_clip_tokenizer(out / "tokenizer")
    clip_g = CLIPTokenizer.from_pretrained(out / "tokenizer", pad_token="!")
    clip_g.save_pretrained(out / "tokenizer_2")
    for name in ("vocab.json", "merges.txt"):  # the classic files as well, like tokenizer/
        (out / "tokenizer_2" / name).write_bytes((out / "tokenizer" / name).read_bytes())
    tiny.save_t5_tokenizer(out / "tokenizer_3")


def _tiny_clip(hidden: int, act: str) -> Any:
    """A 2-layer CLIP text encoder with projection of width ``hidden`` (tiny.py's special-token ids)."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection  # heavy

    return CLIPTextModelWithProjection(CLIPTextConfig(
        vocab_size=tiny.CLIP_VOCAB_SIZE, hidden_size=hidden, intermediate_size=4 * hidden, projection_dim=hidden,
        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=CLIP_TOKENS, hidden_act=act,
        layer_norm_eps=1e-5, attention_dropout=0.0, dropout=0.0, pad_token_id=tiny.CLIP_VOCAB_SIZE - 1,
        bos_token_id=tiny.CLIP_VOCAB_SIZE - 2, eos_token_id=tiny.CLIP_VOCAB_SIZE - 1)).eval()


def _tiny_components(p: TinySD3, seed: int) -> dict[str, Any]:
    """Every model of the tiny folder, each from its own derived seed (eval mode)."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel  # heavy
    from transformers import T5Config, T5EncoderModel  # heavy

    from fastvideo.seeding import derive_seed

    def seeded(name: str) -> None:
        torch.manual_seed(derive_seed(seed, "tiny-sd3", name))

    factor = 2 ** (len(p.vae_block_out_channels) - 1)
    seeded("transformer")
    transformer = SD3Transformer2DModel(
        sample_size=p.height // factor, patch_size=PATCH_SIZE, in_channels=p.latent_channels,
        out_channels=p.latent_channels, num_layers=p.num_layers, attention_head_dim=p.attention_head_dim,
        num_attention_heads=p.num_attention_heads, joint_attention_dim=p.t5_d_model,
        caption_projection_dim=p.num_attention_heads * p.attention_head_dim,
        pooled_projection_dim=p.clip_l_hidden + p.clip_g_hidden, pos_embed_max_size=p.pos_embed_max_size,
        dual_attention_layers=p.dual_attention_layers, qk_norm="rms_norm").eval()
    # As in tiny.py: a trained model's timestep and pooled-text embeddings are large; at default init sigma and the
    # prompt would barely move the velocity, so the embedders' output layers are scaled up.
    with torch.no_grad():
        for layer in (transformer.time_text_embed.timestep_embedder.linear_2,
                      transformer.time_text_embed.text_embedder.linear_2):
            layer.weight.mul_(p.conditioning_gain)
            layer.bias.mul_(p.conditioning_gain)
    seeded("vae")
    n = len(p.vae_block_out_channels)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n, block_out_channels=p.vae_block_out_channels, layers_per_block=1,
        act_fn="silu", latent_channels=p.latent_channels, norm_num_groups=4, sample_size=p.height,
        scaling_factor=SD35_MEDIUM_VAE_CONFIG["scaling_factor"], shift_factor=SD35_MEDIUM_VAE_CONFIG["shift_factor"],
        use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=True).eval()
    seeded("text_encoder")
    clip_l = _tiny_clip(p.clip_l_hidden, "quick_gelu")
    seeded("text_encoder_2")
    clip_g = _tiny_clip(p.clip_g_hidden, "gelu")
    seeded("text_encoder_3")
    t5 = T5EncoderModel(T5Config(
        vocab_size=tiny.T5_VOCAB_SIZE, d_model=p.t5_d_model, d_kv=16, d_ff=2 * p.t5_d_model, num_layers=2,
        num_heads=2, relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.0,
        feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False, tie_word_embeddings=False,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)).eval()
    return {"transformer": transformer, "vae": vae, "text_encoder": clip_l, "text_encoder_2": clip_g,
            "text_encoder_3": t5}


def _write_tiny(tmp: Path, seed: int) -> None:
    """Save the tiny SD3.5 folder into ``tmp``."""
    from diffusers import FlowMatchEulerDiscreteScheduler  # heavy

    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG untouched
        parts = _tiny_components(TINY, seed)
    for name, module in parts.items():
        module.save_pretrained(tmp / name, safe_serialization=True)
    FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULER_CONFIG).save_pretrained(tmp / "scheduler")
    _save_tokenizers(tmp)
    (tmp / "model_index.json").write_text(json.dumps(_model_index(), indent=2, sort_keys=True) + "\n")
    info = {"preset": "sd3-tiny", "family": SD3.name, "seed": seed, "sizes": {
        k: list(v) if isinstance(v, tuple) else v for k, v in TINY.__dict__.items()}}
    (tmp / tiny.INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def build_tiny(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Write a seeded tiny SD3.5 folder (``StableDiffusion3Pipeline`` layout, ~0.1M-param transformer with q/k
    RMSNorm and one dual-attention block, 64px) to ``out_dir``, atomically; same seed => byte-identical files."""
    return tiny.write_atomically(out_dir, lambda tmp: _write_tiny(tmp, int(seed)))


def _write_config_folder(tmp: Path) -> None:
    """Save SD3.5-Medium's configs (no weights) into ``tmp``; the models are instantiated on the meta device."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel  # heavy
    from transformers import CLIPTextConfig, T5Config  # heavy

    with torch.device("meta"):  # diffusers fills and serialises the full config, as save_pretrained would
        SD3Transformer2DModel(**SD35_MEDIUM_TRANSFORMER_CONFIG).save_config(tmp / "transformer")
        AutoencoderKL(**SD35_MEDIUM_VAE_CONFIG).save_config(tmp / "vae")
    clip_l = {**tiny.FLUX_DEV_CLIP_CONFIG, "architectures": ["CLIPTextModelWithProjection"], "dtype": "float16"}
    CLIPTextConfig(**clip_l).save_pretrained(tmp / "text_encoder")
    CLIPTextConfig(**SD35_MEDIUM_CLIP_G_CONFIG).save_pretrained(tmp / "text_encoder_2")
    T5Config(**{**tiny.FLUX_DEV_T5_CONFIG, "dtype": "float16"}).save_pretrained(tmp / "text_encoder_3")
    FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULER_CONFIG).save_pretrained(tmp / "scheduler")
    _save_tokenizers(tmp)
    (tmp / "tokenizer_3" / "README.txt").write_text(
        f"NOT SD3.5's T5 tokenizer: the small {tiny.T5_VOCAB_SIZE}-piece stand-in of fastvideo.tiny (the real one, "
        "google/t5-v1_1-xxl's spiece.model, is not available offline); do not use it to encode real prompts.\n")
    (tmp / "model_index.json").write_text(json.dumps(_model_index(), indent=2, sort_keys=True) + "\n")
    info = {"preset": "sd3.5-medium-config", "family": SD3.name, "weights": False,
            "source": "stabilityai/stable-diffusion-3.5-medium (configs only)", "vae_scale_factor": 8,
            "tokenizer_3": f"stand-in: fastvideo.tiny T5 tokenizer with {tiny.T5_VOCAB_SIZE} pieces"}
    (tmp / tiny.INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def write_config(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Write SD3.5-Medium's diffusers layout with its real configs and no weights (``seed`` is ignored): for
    meta-device planning of the 2.24B transformer without the download. Atomic; FileExistsError if non-empty."""
    return tiny.write_atomically(out_dir, _write_config_folder)
