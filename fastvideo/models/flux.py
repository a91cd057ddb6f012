"""The FLUX.1 family (dev, schnell, and the tiny folders of ``fastvideo.tiny``): load parts of a diffusers FLUX
folder, encode prompts, pack/unpack latents, position ids, one transformer velocity call, VAE decoding, and
``Flux1``, the ``ModelFamily`` adapter that the trainers reach through ``fastvideo.models``.

Shapes: latents are packed 2x2 into tokens ``(B, L, C)`` with ``L = (H / 2f) * (W / 2f)`` and
``C = 4 * latent_channels`` where ``f`` is the VAE scale factor (8 for FLUX).
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from fastvideo import devices
from fastvideo.models.attention import (FALLBACK_ATTENTION_BACKEND, NPU_ATTENTION_BACKEND,  # noqa: F401
                                         choose_attention,
                                         attention_backend_names, attention_backend_of, check_attention_backend,
                                         set_attention_backend, set_npu_attention)
from fastvideo.models.base import (ModelFamily, SamplerDefaults, build_on_meta, check_components,  # noqa: F401
                                    component_folder, config_get, model_config, model_dtype, tag, unwrap_model)

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
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel.from_pretrained(_subfolder(path, "transformer"), torch_dtype=dtype,
                                                   local_files_only=True)
    model = model.to(device)
    keep_attention_dtype(model)
    prepare_for_device(model, device)
    return model


def transformer_folder(path: str | os.PathLike) -> Path:
    """The transformer component folder of a FLUX folder (or ``path`` itself if it is one)."""
    return _subfolder(path, "transformer")


class ComputeDtypeRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` whose output keeps its input's dtype, so q, k and v reach attention in one dtype.

    CUDA autocast runs ``rms_norm`` in float32 (CPU autocast does not), so FLUX's ``norm_q``/``norm_k`` would hand
    float32 q/k to attention beside a bf16 v: Ulysses' backward and the flash/sage/xformers kernels reject that, and
    the trained function would differ from FluxPipeline's (bf16 weights, no autocast: bf16 norm outputs). The norm
    itself still computes in float32 where autocast says so; only its result is rounded to the input's dtype, which
    is what FluxPipeline computes. A no-op without autocast (fp32 stays fp32 bit for bit). Same parameters and
    state-dict keys as ``torch.nn.RMSNorm``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).to(x.dtype)


@functools.lru_cache(maxsize=1)
def _compute_dtype_diffusers_norm() -> type:
    """``ComputeDtypeDiffusersRMSNorm``: diffusers' own ``RMSNorm`` (the q/k norms of SD3.5 and Qwen-Image) with the
    same rounding, defined on first use (importing this module does not import diffusers)."""
    from diffusers.models.normalization import RMSNorm

    class ComputeDtypeDiffusersRMSNorm(RMSNorm):
        """diffusers' ``RMSNorm`` rounded back to its input's dtype: its float32 variance makes a bf16 input float32
        when the weight is float32 (fp32 master weights under autocast), so q/k would reach attention as float32
        beside a bf16 v; the stock bf16 pipeline's norm returns bf16. A no-op in fp32 and for bf16 weights."""

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return super().forward(hidden_states).to(hidden_states.dtype)

    ComputeDtypeDiffusersRMSNorm.__module__ = __name__
    return ComputeDtypeDiffusersRMSNorm


def keep_attention_dtype(transformer: Any) -> int:
    """Make every ``torch.nn.RMSNorm`` a ``ComputeDtypeRMSNorm`` and every diffusers ``RMSNorm`` a
    ``ComputeDtypeDiffusersRMSNorm`` (in place: class swap, weights and names unchanged); returns how many were
    swapped. Every family's ``build_transformer`` and ``load_transformer`` call it."""
    from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm

    swapped = 0
    for module in unwrap_model(transformer).modules():
        if type(module) is torch.nn.RMSNorm:
            module.__class__ = ComputeDtypeRMSNorm
            swapped += 1
        elif type(module) is DiffusersRMSNorm:
            module.__class__ = _compute_dtype_diffusers_norm()
            swapped += 1
    return swapped


def build_transformer(path: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """The FluxTransformer2DModel of a FLUX folder's config.json on the meta device: shapes only, no memory, no
    weights read (the 12B path: shard it, then ``weights.load_safetensors_into``; or count its parameters)."""
    from diffusers import FluxTransformer2DModel

    model = build_on_meta(FluxTransformer2DModel, transformer_folder(path), dtype)
    keep_attention_dtype(model)
    return model


def load_vae(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Load the frozen AutoencoderKL of a FLUX folder (eval mode, no grad)."""
    from diffusers import AutoencoderKL

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
    from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

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


# ------------------------------------------------------------------------------------------ latent geometry
def vae_scale_factor(vae_or_config: Any) -> int:
    """Pixels per latent pixel: 2 ** (number of VAE blocks - 1) (8 for FLUX), as FluxPipeline computes it."""
    config = _vae_config(vae_or_config)
    return 2 ** (len(config_get(config, "block_out_channels")) - 1)


def _vae_config(vae_or_config: Any) -> Any:
    """Config of a VAE given the model, its config (object or dict), a FLUX folder or a vae folder."""
    if isinstance(vae_or_config, (str, os.PathLike)):
        folder = Path(vae_or_config).expanduser()
        file = folder / "config.json" if (folder / "config.json").is_file() else folder / "vae" / "config.json"
        if not file.is_file():
            check_model_folder(folder, ("vae",))
        return json.loads(file.read_text())
    if isinstance(vae_or_config, Mapping) or not isinstance(vae_or_config, torch.nn.Module):
        return vae_or_config
    return model_config(vae_or_config)


@dataclass(frozen=True)
class LatentGeometry:
    """Image size and the VAE facts that fix the latent and packed-token shapes."""

    height: int
    width: int
    vae_scale_factor: int
    latent_channels: int

    @property
    def latent_h(self) -> int:
        return self.height // self.vae_scale_factor

    @property
    def latent_w(self) -> int:
        return self.width // self.vae_scale_factor

    @property
    def seq_len(self) -> int:
        """Packed image tokens L."""
        return (self.latent_h // 2) * (self.latent_w // 2)

    @property
    def packed_channels(self) -> int:
        """Channels per packed token C (4 x latent channels)."""
        return 4 * self.latent_channels

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """Unpacked latent shape (channels, h, w) without the batch."""
        return (self.latent_channels, self.latent_h, self.latent_w)

    @property
    def packed_shape(self) -> tuple[int, int]:
        """Packed latent shape (L, C) without the batch."""
        return (self.seq_len, self.packed_channels)


def latent_geometry(vae_or_config: Any, height: int, width: int) -> LatentGeometry:
    """LatentGeometry for images of ``height`` x ``width`` pixels; ValueError if not multiples of 2 x scale factor."""
    config = _vae_config(vae_or_config)
    factor = vae_scale_factor(config)
    multiple = 2 * factor
    for name, flag, value in (("height", "--h", height), ("width", "--w", width)):
        if int(value) != value or value < multiple or value % multiple:
            lower = max(multiple, int(value) // multiple * multiple)
            raise ValueError(f"image {name} {value} ({flag}) must be a positive multiple of {multiple} (VAE scale "
                             f"factor {factor} x 2x2 packing): pass e.g. {flag} {lower} or {lower + multiple}")
    return LatentGeometry(int(height), int(width), factor, int(config_get(config, "latent_channels")))


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) latents -> (B, (h/2)(w/2), 4C) tokens of 2x2 patches, row-major (FLUX packing)."""
    b, c, h, w = latents.shape
    if h % 2 or w % 2:
        raise ValueError(f"latent height/width must be even to pack 2x2 patches, got {h}x{w}")
    x = latents.view(b, c, h // 2, 2, w // 2, 2)  # B C h2 2 w2 2
    return x.permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: torch.Tensor, geometry: LatentGeometry) -> torch.Tensor:
    """(B, L, 4C) packed tokens -> (B, C, h, w) latents; inverse of pack_latents."""
    b, length, channels = tokens.shape
    if (length, channels) != geometry.packed_shape:
        raise ValueError(f"packed latents have shape (L, C) = {(length, channels)} but the geometry "
                         f"{geometry.height}x{geometry.width} expects {geometry.packed_shape}")
    c, h, w = geometry.latent_shape
    x = tokens.view(b, h // 2, w // 2, c, 2, 2)  # B h2 w2 C 2 2
    return x.permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)


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


# -------------------------------------------------------------------------------------------- model calls
def text_length_refusal(text_tokens: int, sp_size: int) -> str:
    """Why --sp_size ``sp_size`` cannot run ``text_tokens`` text tokens, and the fix: Ulysses splits the text sequence
    evenly over the group, and padding it with zero embeddings would add tokens that attention reads (no mask), so the
    trained function would differ from the base model's."""
    fits = [d for d in (1, 2, 4, 8) if text_tokens % d == 0]
    return (f"--sp_size {sp_size} does not divide the embeddings' {text_tokens} text tokens: Ulysses splits the text "
            "evenly over the group, and padding it would add tokens that attention reads (the trained model would "
            f"differ from the base model); preprocess with a --max_sequence_length that is a multiple of {sp_size} "
            f"(e.g. {text_tokens - text_tokens % sp_size}), or use --sp_size {' / '.join(map(str, fits))}")


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


def decode(vae: Any, latents: torch.Tensor, geometry: LatentGeometry, micro_batch: int | None = None
           ) -> torch.Tensor:
    """Packed latents (B, L, C) -> images (B, 3, H, W) float32 in [0, 1], as FluxPipeline decodes them.

    Decodes the whole batch in one VAE call, or in chunks of ``micro_batch`` samples to bound memory.
    """
    config = model_config(vae)
    scaling = config_get(config, "scaling_factor", 1.0)
    shift = config_get(config, "shift_factor", None) or 0.0
    z = unpack_latents(latents, geometry) / scaling + shift
    z = z.to(model_dtype(vae))
    step = micro_batch or z.shape[0]
    images = [vae.decode(chunk, return_dict=False)[0] for chunk in z.split(step)]
    return (torch.cat(images) / 2 + 0.5).clamp(0, 1).float()


@torch.no_grad()
def encode(vae: Any, images: torch.Tensor, geometry: LatentGeometry, micro_batch: int | None = None) -> torch.Tensor:
    """Images (B, 3, H, W) in [0, 1] -> packed latents (B, L, C) float32: the inverse of ``decode``.

    Takes the mean of the VAE posterior (``latent_dist.mode()``), not a sample, so the same image always gives
    the same latents and a latent cache is reproducible. One VAE call, or chunks of ``micro_batch`` images.
    """
    expected = (3, geometry.height, geometry.width)
    if images.ndim != 4 or tuple(images.shape[1:]) != expected:
        raise ValueError(f"encode takes images of shape (B, {expected[0]}, {expected[1]}, {expected[2]}) for the "
                         f"geometry {geometry.height}x{geometry.width}, got {tuple(images.shape)}; resize the images "
                         "or build the geometry from their --h/--w")
    config = model_config(vae)
    scaling = config_get(config, "scaling_factor", 1.0)
    shift = config_get(config, "shift_factor", None) or 0.0
    x = (images * 2 - 1).to(model_dtype(vae))
    step = micro_batch or x.shape[0]
    z = torch.cat([vae.encode(chunk).latent_dist.mode() for chunk in x.split(step)]).float()
    if tuple(z.shape[1:]) != geometry.latent_shape:
        raise ValueError(f"the VAE gives latents of shape {tuple(z.shape[1:])} but the geometry expects "
                         f"{geometry.latent_shape}; build the geometry with flux.latent_geometry(vae, h, w)")
    return pack_latents((z - shift) * scaling)


def vae_fingerprint(path: str | os.PathLike) -> str:
    """sha256 over a FLUX folder's ``vae/`` files (configs in full, weights sampled): tells whether cached
    latents were made by the same VAE."""
    return Flux1().vae_fingerprint(path)


# --------------------------------------------------------------------------------------- device adaptations
_ROPE_HI_BITS = 12  # significant bits of a frequency's high part: pos * hi is exact for integer |pos| < 2**12


def _round_to_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``values`` (float64) rounded to ``bits`` significant bits, so each is exactly a float32 too."""
    mantissa, exponent = torch.frexp(values)  # values = mantissa * 2**exponent, 0.5 <= |mantissa| < 1
    return torch.ldexp(torch.round(torch.ldexp(mantissa, torch.tensor(bits))), exponent - bits)


def _split_hi_lo(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``values`` -> float32 (hi, lo) with hi of ``_ROPE_HI_BITS`` bits and hi + lo = values to ~1e-12."""
    hi = _round_to_bits(values, _ROPE_HI_BITS)
    return hi.float(), (values - hi).float()


def _two_pi_parts() -> tuple[float, float, float]:
    """2π as P1 + P2 + P3 (float32 values; P1, P2 of 12 bits) for Cody-Waite range reduction: ``k * P1`` and
    ``k * P2`` are exact in float32 for integers |k| < 2**12."""
    two_pi = torch.tensor(2 * torch.pi, dtype=torch.float64)
    p1 = _round_to_bits(two_pi, _ROPE_HI_BITS)
    p2 = _round_to_bits(two_pi - p1, _ROPE_HI_BITS)
    return float(p1), float(p2), float((two_pi - p1 - p2).float())


class _Float32Rope:
    """FLUX's rotary cos/sin computed with float32 tensors only, as accurately as diffusers' float64 path.

    The inverse frequencies ``1 / theta**(2i/d)`` of every axis are computed once in float64 on the CPU and split
    into float32 ``hi + lo`` with 12-bit ``hi``. A position is split into its integer part ``n`` and fraction
    ``f``, so ``a = n * hi`` is exact in float32 for |n| < 4096 and ``b = n * lo + f * (hi + lo)`` is small.
    ``a`` is reduced by 2π in three steps (Cody-Waite: the first is exact), so the device's cos/sin only see
    arguments in about [-π, π] (accurate whatever its large-argument handling), and
    ``cos(r + b) = cos r cos b - sin r sin b`` (likewise sin) adds ``b`` back without rounding a large angle.
    Error against diffusers' float64 path: < 3e-7 for |positions| < 4096 (integer or not); beyond that
    ``n * hi`` is no longer exact and the error grows like a plain float32 computation's (~ulp(pos * freq)).
    """

    def __init__(self, theta: float, axes_dim: list[int] | tuple[int, ...]):
        for dim in axes_dim:
            if dim % 2:
                raise ValueError(f"rotary axes dims must be even, got {list(axes_dim)}: fix axes_dims_rope")
        freqs = [1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64, device="cpu") / d)) for d in axes_dim]
        self.axes_dim = [int(d) for d in axes_dim]
        self.hi, self.lo = _split_hi_lo(torch.cat(freqs))  # (D/2,) float32 on the CPU, axes concatenated
        self.two_pi = _two_pi_parts()
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _constants(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._on_device:  # float32 copies only: no float64 tensor reaches the device
            self._on_device[device] = (self.hi.to(device), self.lo.to(device))
        return self._on_device[device]

    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids (N, n_axes) -> (cos, sin), each (N, sum(axes_dim)) float32, pairs repeated (diffusers' layout)."""
        if ids.ndim != 2 or ids.shape[-1] != len(self.axes_dim):
            raise ValueError(f"rotary ids must be (N, {len(self.axes_dim)}), got {tuple(ids.shape)}: pass "
                             "flux.image_ids / flux.text_ids")
        hi, lo = self._constants(ids.device)
        pos = ids.float()
        pos = torch.cat([pos[:, i:i + 1].expand(-1, d // 2) for i, d in enumerate(self.axes_dim)], dim=1)  # (N, D/2)
        whole = pos.floor()
        frac = pos - whole  # exact: [0, 1)
        a = whole * hi  # exact for |pos| < 4096
        b = whole * lo + frac * hi + frac * lo  # |b| <~ freq + |pos * freq| / 4096: small, so rounding it is harmless
        p1, p2, p3 = self.two_pi
        k = torch.round(a * (1 / (2 * torch.pi)))
        r = ((a - k * p1) - k * p2) - k * p3  # a - 2πk: the first subtraction is exact, |r| <~ π
        cos_r, sin_r, cos_b, sin_b = r.cos(), r.sin(), b.cos(), b.sin()
        cos = cos_r * cos_b - sin_r * sin_b
        sin = sin_r * cos_b + cos_r * sin_b
        return cos.repeat_interleave(2, dim=1), sin.repeat_interleave(2, dim=1)


def _make_float32_pos_embed_class() -> type:
    """Define ``Float32FluxPosEmbed`` (diffusers is imported only when it is first asked for)."""
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

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
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

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

    def sigmas(self, steps, image_seq_len):
        from fastvideo.schedulers import get_sigmas

        return get_sigmas(steps, image_seq_len=image_seq_len)

    def decode(self, vae, latents, geometry, micro_batch=None):
        return decode(vae, latents, geometry, micro_batch)

    def encode(self, vae, images, geometry, micro_batch=None):
        return encode(vae, images, geometry, micro_batch)

    def transformer_flops(self, config, image_tokens, text_tokens, batch=1, *, backward=False, weight_grads=True):
        from fastvideo.flops import transformer_flops

        return transformer_flops(config, image_tokens, text_tokens, batch, backward=backward,
                                 weight_grads=weight_grads)

    def forward_tokens(self, args, kwargs):
        x = kwargs.get("hidden_states", args[0] if args else None)  # (B, L, C) packed
        text = kwargs.get("encoder_hidden_states")  # (B, T, D)
        return None if x is None or text is None else (x.shape[0], x.shape[1], text.shape[1])

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
        from diffusers import FluxPipeline

        return FluxPipeline

    def transformer_class(self) -> type:
        from diffusers import FluxTransformer2DModel

        return FluxTransformer2DModel
