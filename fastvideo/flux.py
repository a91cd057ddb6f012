"""Everything FLUX-specific: load parts of a diffusers FLUX folder, encode prompts, pack/unpack latents,
position ids, one transformer velocity call, and VAE decoding.

The same code serves FLUX.1-dev and the tiny folders of ``fastvideo.tiny``. Shapes: latents are packed
2x2 into tokens ``(B, L, C)`` with ``L = (H / 2f) * (W / 2f)`` and ``C = 4 * latent_channels`` where ``f``
is the VAE scale factor (8 for FLUX).
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from fastvideo import devices

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
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"FLUX model folder {str(folder)!r} does not exist: {_BUILD_HINT}")
    missing = []
    for name in components:
        if name not in _COMPONENT_FILES:
            raise ValueError(f"unknown FLUX component {name!r}: choose from {list(COMPONENTS)}")
        if not any((folder / name / f).is_file() for f in _COMPONENT_FILES[name]):
            missing.append(f"{name}/ ({' or '.join(_COMPONENT_FILES[name])})")
    if missing:
        raise FileNotFoundError(f"FLUX model folder {str(folder)!r} is missing {', '.join(missing)}: {_BUILD_HINT}")
    return folder


def unwrap_model(model: Any) -> Any:
    """The innermost model under DDP/FSDP1 (``.module``), torch.compile (``._orig_mod``) or peft wrappers.

    FSDP2's ``fully_shard`` and diffusers' ``add_adapter`` keep the module class, so those need no unwrapping.
    """
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif type(model).__name__.startswith("Peft") and hasattr(model, "get_base_model"):
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), torch.nn.Module):  # DDP, FSDP1
            model = model.module
        else:
            break
    return model


def model_config(model: Any) -> Any:
    """A model's diffusers/transformers config, read through wrappers (FSDP1/DDP, torch.compile, peft)."""
    config = getattr(unwrap_model(model), "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no .config: pass a diffusers/transformers model")
    return config


def _config_get(config: Any, key: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def _model_dtype(model: Any) -> torch.dtype:
    """The dtype of the model's first floating-point parameter (float32 if it has none)."""
    for p in unwrap_model(model).parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _subfolder(path: str | os.PathLike, name: str) -> Path:
    """``path/name`` if ``path`` is a pipeline folder, ``path`` itself if it already is the component folder."""
    folder = Path(path).expanduser()
    if (folder / "config.json").is_file() and not (folder / name).is_dir():
        return folder
    return check_model_folder(folder, (name,)) / name


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


def keep_attention_dtype(transformer: Any) -> int:
    """Make every ``torch.nn.RMSNorm`` of the transformer a ``ComputeDtypeRMSNorm`` (in place: class swap, weights and
    names unchanged); returns how many were swapped. ``build_transformer`` and ``load_transformer`` call it."""
    swapped = 0
    for module in unwrap_model(transformer).modules():
        if type(module) is torch.nn.RMSNorm:
            module.__class__ = ComputeDtypeRMSNorm
            swapped += 1
    return swapped


def build_transformer(path: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """The FluxTransformer2DModel of a FLUX folder's config.json on the meta device: shapes only, no memory, no
    weights read (the 12B path: shard it, then ``weights.load_safetensors_into``; or count its parameters)."""
    from diffusers import FluxTransformer2DModel

    folder = transformer_folder(path)
    config = FluxTransformer2DModel.load_config(folder, local_files_only=True)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are created in ``dtype`` (no cast afterwards)
    try:
        with torch.device("meta"):
            model = FluxTransformer2DModel.from_config(config)
    finally:
        torch.set_default_dtype(default)
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


def _weight_digest(file: Path) -> bytes:
    """A cheap digest of a (possibly multi-GB) weight file: name, size, safetensors header, first and last MiB."""
    h = hashlib.sha256()
    size = file.stat().st_size
    h.update(f"{file.name}:{size}".encode())
    chunk = 1 << 20
    with open(file, "rb") as f:
        h.update(f.read(chunk))
        if size > chunk:
            f.seek(max(chunk, size - chunk))
            h.update(f.read(chunk))
    return h.digest()


def encoders_fingerprint(path: str | os.PathLike) -> str:
    """sha256 over the text encoders' and tokenizers' files: configs and tokenizer files in full, weights sampled.

    Used to tell whether stored prompt embeddings were made by the same text encoders.
    """
    return _folder_digest(check_model_folder(path, TEXT_COMPONENTS), TEXT_COMPONENTS)


def _folder_digest(folder: Path, names: tuple[str, ...]) -> str:
    """sha256 over the files of ``folder/name`` for each name: relative paths, other files in full, weights sampled."""
    h = hashlib.sha256()
    for name in names:
        for file in sorted((folder / name).rglob("*")):
            if not file.is_file() or file.name.startswith("."):
                continue
            h.update(str(file.relative_to(folder)).encode() + b"\0")
            if file.suffix in (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5"):
                h.update(_weight_digest(file))
            else:
                h.update(file.read_bytes())
    return h.hexdigest()


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
    return 2 ** (len(_config_get(config, "block_out_channels")) - 1)


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
    return LatentGeometry(int(height), int(width), factor, int(_config_get(config, "latent_channels")))


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
    if _config_get(model_config(transformer), "guidance_embeds", False):
        if guidance is None:
            raise ValueError("this transformer has a guidance embedding (FLUX.1-dev style): pass guidance "
                             "(3.5 is FLUX.1-dev's default)")
        guidance_vec = torch.as_tensor(guidance, dtype=torch.float32, device=device)
        guidance_vec = guidance_vec.expand(batch) if guidance_vec.ndim == 0 else guidance_vec.reshape(batch)

    if not torch.is_autocast_enabled(device.type):
        dtype = _model_dtype(transformer)
        latents, prompt_embeds, pooled = latents.to(dtype), prompt_embeds.to(dtype), pooled.to(dtype)
    sp = sequence_parallel_size(transformer)
    if prompt_embeds.shape[1] % sp:  # Ulysses splits the text sequence evenly: zero embeddings (ids 0) appended
        pad = sp - prompt_embeds.shape[1] % sp
        prompt_embeds = torch.nn.functional.pad(prompt_embeds, (0, 0, 0, pad))
        txt_ids = torch.cat([txt_ids, txt_ids.new_zeros(pad, txt_ids.shape[1])])
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
    scaling = _config_get(config, "scaling_factor", 1.0)
    shift = _config_get(config, "shift_factor", None) or 0.0
    z = unpack_latents(latents, geometry) / scaling + shift
    z = z.to(_model_dtype(vae))
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
    scaling = _config_get(config, "scaling_factor", 1.0)
    shift = _config_get(config, "shift_factor", None) or 0.0
    x = (images * 2 - 1).to(_model_dtype(vae))
    step = micro_batch or x.shape[0]
    z = torch.cat([vae.encode(chunk).latent_dist.mode() for chunk in x.split(step)]).float()
    if tuple(z.shape[1:]) != geometry.latent_shape:
        raise ValueError(f"the VAE gives latents of shape {tuple(z.shape[1:])} but the geometry expects "
                         f"{geometry.latent_shape}; build the geometry with flux.latent_geometry(vae, h, w)")
    return pack_latents((z - shift) * scaling)


def vae_fingerprint(path: str | os.PathLike) -> str:
    """sha256 over a FLUX folder's ``vae/`` files (configs in full, weights sampled): tells whether cached
    latents were made by the same VAE."""
    return _folder_digest(check_model_folder(path, ("vae",)), ("vae",))


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


NPU_ATTENTION_BACKEND = "_native_npu"  # diffusers' AttentionBackendName._NATIVE_NPU: torch_npu.npu_fusion_attention


def _set_npu_attention(model: Any) -> str:
    """Switch the model's attention to diffusers' NPU fused-attention backend; describe what happened."""
    setter = getattr(model, "set_attention_backend", None)
    try:
        from diffusers.models.attention_dispatch import AttentionBackendName

        offered = NPU_ATTENTION_BACKEND in {b.value for b in AttentionBackendName}
    except ImportError:
        offered = False
    if setter is None or not offered:
        reason = "this diffusers has no attention backends; upgrade diffusers (>= 0.35) for NPU fused attention"
    else:
        try:
            setter(NPU_ATTENTION_BACKEND)  # raises RuntimeError when diffusers finds no torch_npu
            return f"attention backend: {NPU_ATTENTION_BACKEND} (torch_npu.npu_fusion_attention)"
        except (RuntimeError, ValueError, ImportError) as err:
            reason = str(err)
    warnings.warn(f"NPU fused attention unavailable, keeping torch SDPA: {reason}", stacklevel=3)
    return f"attention backend: default SDPA ({NPU_ATTENTION_BACKEND} unavailable: {reason})"


FALLBACK_ATTENTION_BACKEND = "native"  # torch SDPA: runs everywhere, supports Ulysses context parallelism
_warned_backends: set[str] = set()


def attention_backend_names() -> list[str]:
    """diffusers' attention backend names (``AttentionBackendName``), e.g. native, flash, _native_flash, sage."""
    try:
        from diffusers.models.attention_dispatch import AttentionBackendName
    except ImportError:
        return []
    return [b.value for b in AttentionBackendName]


def check_attention_backend(name: str) -> None:
    """ValueError naming the choices when ``--attention_backend`` is not ``auto`` or a diffusers backend name (a
    typo is an error; an unavailable kernel is a fallback, at load time)."""
    if name == "auto":
        return
    names = attention_backend_names()
    if not names:
        raise ValueError(f"--attention_backend {name!r} needs diffusers' attention dispatcher (diffusers >= 0.35); "
                         "upgrade diffusers or use --attention_backend auto")
    if name not in names:
        raise ValueError(f"--attention_backend {name!r} is not a diffusers attention backend; use auto or one of "
                         f"{', '.join(names)}")


def _probe_attention(name: str, device: torch.device, dtype: torch.dtype, head_dim: int = 64) -> None:
    """Run the backend once on a tiny (1, 8, 2, head_dim) q/k/v, all three in ``dtype``: what the model passes
    (``ComputeDtypeRMSNorm`` keeps q/k in v's dtype, the compute dtype), so kernels that load but cannot run these
    inputs here raise now."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    q, k, v = (torch.randn(1, 8, 2, head_dim, device=device, dtype=dtype) for _ in range(3))
    dispatch_attention_fn(q, k, v, backend=name)


def set_attention_backend(transformer: Any, name: str, device: torch.device | str,
                          dtype: torch.dtype = torch.bfloat16) -> str:
    """Use attention backend ``name`` in every attention layer of the transformer (all its forwards: rollout and
    replay alike); returns the backend in use. When the kernel or the hardware is unavailable (its package missing,
    not this device, not context-parallel capable under --sp_size, or a trial call fails), it falls back to
    ``native`` (torch SDPA) with one warning per process (rank 0 prints it). A CPU job always uses ``native``."""
    from fastvideo import distributed

    model = unwrap_model(transformer)
    device = torch.device(device)
    reason = None
    if name != FALLBACK_ATTENTION_BACKEND and device.type == "cpu":
        reason = "this is a CPU job, where only torch's native SDPA is used"
    elif name != FALLBACK_ATTENTION_BACKEND:
        try:
            model.set_attention_backend(name)
            _probe_attention(name, device, dtype, int(_config_get(model_config(model), "attention_head_dim", 64)))
        except (RuntimeError, ValueError, ImportError, NotImplementedError, TypeError, AssertionError) as err:
            reason = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    if reason is None and name != FALLBACK_ATTENTION_BACKEND:
        return name
    model.set_attention_backend(FALLBACK_ATTENTION_BACKEND)  # also diffusers' process-wide default
    if reason is not None and name not in _warned_backends:
        _warned_backends.add(name)
        if distributed.is_main_process():
            warnings.warn(f"--attention_backend {name} is unavailable ({reason}); using "
                          f"{FALLBACK_ATTENTION_BACKEND} (torch SDPA) for every forward instead", stacklevel=2)
    return FALLBACK_ATTENTION_BACKEND


def attention_backend_of(transformer: Any) -> set[str]:
    """The backends the transformer's attention processors use (diffusers' ``_attention_backend``; None = default)."""
    model = unwrap_model(transformer)
    found = set()
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_attention_backend"):
            backend = processor._attention_backend
            found.add(getattr(backend, "value", backend))
    return found


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
    if attention_backend != "auto":
        used = set_attention_backend(model, attention_backend, device, param_dtype or _model_dtype(model))
        done = [f"attention backend: {used}" + ("" if used == attention_backend else
                                                  f" (--attention_backend {attention_backend} unavailable)")]
        if devices.device_type(device) == "npu" and use_float32_rope(model):
            done.insert(0, "pos_embed: Float32FluxPosEmbed (rotary angles in float32; the NPU has no float64)")
        return done
    if devices.device_type(device) != "npu":
        return []
    done = []
    if use_float32_rope(model):
        done.append("pos_embed: Float32FluxPosEmbed (rotary angles in float32; the NPU has no float64)")
    dtype = param_dtype or _model_dtype(model)
    if dtype in (torch.bfloat16, torch.float16):
        done.append(_set_npu_attention(model))
    else:
        done.append(f"attention backend: default SDPA ({NPU_ATTENTION_BACKEND} needs bf16/fp16 q, k, v; the weights "
                    f"are {str(dtype).replace('torch.', '')} in the forward)")
    return done
