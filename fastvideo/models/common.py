"""What several model families share: the latent geometry and 2x2 token packing of a VAE latent image
(``LatentGeometry``, ``pack_latents`` / ``unpack_latents``), the standard VAE decode / encode (latents / scaling +
shift, as the diffusers pipelines), attention kept in the compute dtype (``keep_attention_dtype``), and rotary
angles in float32 only (``_Float32Rope``, for devices without float64). A family adapter imports these; no family
imports another family's module for them.

Shapes: latents are packed 2x2 into tokens ``(B, L, C)`` with ``L = (H / 2f) * (W / 2f)`` and
``C = 4 * latent_channels`` where ``f`` is the VAE scale factor (8 for the FLUX, SD3 and Qwen-Image VAEs).
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from fastvideo.models.base import check_components, config_get, model_config, model_dtype, unwrap_model


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
    from diffusers.models.normalization import RMSNorm  # heavy

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
    from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm  # heavy

    swapped = 0
    for module in unwrap_model(transformer).modules():
        if type(module) is torch.nn.RMSNorm:
            module.__class__ = ComputeDtypeRMSNorm
            swapped += 1
        elif type(module) is DiffusersRMSNorm:
            module.__class__ = _compute_dtype_diffusers_norm()
            swapped += 1
    return swapped


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
            check_components(folder, {"vae": ("config.json",)}, ("vae",), "diffusers",
                             "pass a diffusers pipeline folder (model_index.json, vae/, transformer/, ...)")
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


@dataclass(frozen=True)
class EditGeometry(LatentGeometry):
    """An edit family's geometry: the target's (every ``LatentGeometry`` property) and the source image's
    (``condition``), whose packed tokens join the transformer's sequence (``ModelFamily.edit_geometry``)."""

    condition: LatentGeometry | None = None
    condition_count: int = 1  # sources per edit (each of ``condition``'s geometry): Qwen-Image-Edit-2509's pictures

    @property
    def condition_tokens(self) -> int:
        """Packed source tokens per example, every source's (0 without a source)."""
        return 0 if self.condition is None else self.condition.seq_len * self.condition_count


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


def static_shift_sigmas(steps: int, shift: float, num_train_timesteps: int = 1000) -> torch.Tensor:
    """The (S+1,) float32 sigmas of ``FlowMatchEulerDiscreteScheduler(shift=shift)`` after ``set_timesteps(steps)``
    (a static shift: SD3's grid, Wan's Euler grid), bit for bit: the scheduler's float32 training grid gives the ends (sigma_max = 1, sigma_min = shift(1/1000)), a
    float64 linspace between them (in timestep units) is shifted once more in float64, cast to float32, then 0."""
    if int(steps) < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    n = num_train_timesteps
    ends = torch.tensor([n, 1], dtype=torch.float32) / n  # the first and last of linspace(1, n, n)[::-1] / n
    ends = shift * ends / (1 + (shift - 1) * ends)
    sigma_max, sigma_min = (float(v) for v in ends)
    grid = np.linspace(sigma_max * n, sigma_min * n, int(steps)) / n
    grid = shift * grid / (1 + (shift - 1) * grid)
    return torch.cat([torch.from_numpy(grid).to(torch.float32), torch.zeros(1, dtype=torch.float32)])


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


def check_encode_images(images: torch.Tensor, geometry: LatentGeometry) -> None:
    """ValueError unless ``images`` is (B, 3, H, W) at ``geometry``'s size (every family's VAE ``encode``)."""
    expected = (3, geometry.height, geometry.width)
    if images.ndim != 4 or tuple(images.shape[1:]) != expected:
        raise ValueError(f"encode takes images of shape (B, {expected[0]}, {expected[1]}, {expected[2]}) for the "
                         f"geometry {geometry.height}x{geometry.width}, got {tuple(images.shape)}; resize the images "
                         "or build the geometry from their --h/--w")


@torch.no_grad()
def encode(vae: Any, images: torch.Tensor, geometry: LatentGeometry, micro_batch: int | None = None) -> torch.Tensor:
    """Images (B, 3, H, W) in [0, 1] -> packed latents (B, L, C) float32: the inverse of ``decode``.

    Takes the mean of the VAE posterior (``latent_dist.mode()``), not a sample, so the same image always gives
    the same latents and a latent cache is reproducible. One VAE call, or chunks of ``micro_batch`` images.
    """
    check_encode_images(images, geometry)
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


def hidden_and_text_tokens(args: tuple, kwargs: dict) -> tuple[int, int, int] | None:
    """(batch, image tokens, text tokens) of a transformer call that takes packed ``hidden_states`` (B, L, C) and
    ``encoder_hidden_states`` (B, T, D), as FLUX.1's and FLUX.2's do; None when the call has neither."""
    x = kwargs.get("hidden_states", args[0] if args else None)
    text = kwargs.get("encoder_hidden_states")
    return None if x is None or text is None else (x.shape[0], x.shape[1], text.shape[1])

