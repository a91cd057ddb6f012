"""Helpers shared by the reward families: path checks, batched CLIP preprocessing, open_clip loading.

Only torch and the standard library are imported at module level; open_clip and transformers are
imported inside the functions that need them, so ``import fastvideo.rewards`` stays light.
"""
from __future__ import annotations

import contextlib
import copy
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

# CLIP's normalisation constants (open_clip.constants.OPENAI_DATASET_MEAN/STD), used by HPS, CLIP score, aesthetic.
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def require_path(path: str | Path | None, flag: str, reward: str, what: str, kind: str = "file") -> Path:
    """Return ``path`` as a Path, or raise FileNotFoundError naming the flag that must point at it."""
    if path is None or str(path) == "":
        raise FileNotFoundError(f"reward '{reward}' needs {flag} ({what}); pass {flag} /path/to/it "
                                f"(nothing is downloaded)")
    p = Path(path).expanduser()
    ok = p.is_file() if kind == "file" else p.is_dir() if kind == "dir" else p.exists()
    if not ok:
        expected = {"file": "a file", "dir": "a directory"}.get(kind, "a file or directory")
        raise FileNotFoundError(f"reward '{reward}': {flag} {str(path)!r} is not {expected} ({what}); "
                                f"fix the path given to {flag}")
    return p


def looks_like_path(value: str) -> bool:
    """True when a model argument is meant as a config-file path rather than a registered model name."""
    return value.endswith(".json") or "/" in value or "\\" in value or Path(value).is_file()


def quantize_uint8(images: torch.Tensor) -> torch.Tensor:
    """Round [0,1] images to the 1/255 grid, as converting to a PIL image (what the references score) does."""
    return images.float().clamp(0.0, 1.0).mul_(255.0).round_().div_(255.0)  # one new tensor, then in place


def to_grey_levels(images: torch.Tensor) -> torch.Tensor:
    """[0,1] images -> float32 grey levels 0..255 rounded to integers (a uint8 PIL image's values)."""
    return images.float().clamp(0.0, 1.0).mul_(255.0).round_()


def normalize_grey_levels(levels: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """(levels/255 - mean) / std per channel in one fused op: (B,3,H,W) grey levels -> CLIP input."""
    std_t = torch.tensor(std, dtype=torch.float32, device=levels.device).view(1, -1, 1, 1)
    mean_t = torch.tensor(mean, dtype=torch.float32, device=levels.device).view(1, -1, 1, 1)
    return torch.addcmul(-mean_t / std_t, levels, 1.0 / (255.0 * std_t))


def pil_bicubic_resize(levels: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Resize a batch of 0..255 grey levels as PIL's BICUBIC resizes a uint8 image, to within 1-2 levels.

    PIL resamples 8-bit images separably, width first, rounding and clipping to 0..255 after each pass
    (the clip matters: bicubic overshoots on sharp content); its kernel (a=-0.5, widened when
    downscaling) is torch's antialiased bicubic, also when upsampling.
    """
    h, w = levels.shape[-2:]
    new_h, new_w = size
    x = levels
    if new_w != w:
        x = F.interpolate(x, size=(h, new_w), mode="bicubic", align_corners=False, antialias=True)
        x = x.clamp_(0.0, 255.0).round_()
    if new_h != h:
        x = F.interpolate(x, size=(new_h, new_w), mode="bicubic", align_corners=False, antialias=True)
        x = x.clamp_(0.0, 255.0).round_()
    return x


def resize_longest_and_pad(images: torch.Tensor, size: int) -> torch.Tensor:
    """open_clip's ``resize_mode="longest"`` on a uint8 PIL image, batched: PIL-bicubic the longer side, zero-pad.

    (B,3,H,W) grey levels -> (B,3,size,size); left/top get ``pad // 2``, right/bottom the rest. Not HPS v2's
    own transform, which resizes the float tensor once without rounding: see ``fastvideo.rewards.hpsv2``.
    """
    h, w = images.shape[-2:]
    scale = size / max(h, w)
    new_h, new_w = round(h * scale), round(w * scale)
    x = pil_bicubic_resize(images, (new_h, new_w))
    pad_h, pad_w = size - new_h, size - new_w
    if pad_h or pad_w:
        x = F.pad(x, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2), value=0.0)
    return x


def resize_shortest_and_center_crop(images: torch.Tensor, size: int) -> torch.Tensor:
    """CLIP's eval transform on grey levels, batched: Resize(size) of the shorter side, CenterCrop(size)."""
    h, w = images.shape[-2:]
    short, long = (h, w) if h <= w else (w, h)
    new_short, new_long = size, int(size * long / short)
    new_h, new_w = (new_short, new_long) if h <= w else (new_long, new_short)
    x = pil_bicubic_resize(images, (new_h, new_w))
    top = int(round((new_h - size) / 2.0))
    left = int(round((new_w - size) / 2.0))
    return x[..., top:top + size, left:left + size]


def clip_pixels(images: torch.Tensor, size: int, mean: Sequence[float], std: Sequence[float], *,
                pad: bool) -> torch.Tensor:
    """(B,3,H,W) [0,1] -> (B,3,size,size) CLIP input built as the references' PIL pipeline builds it.

    Round to uint8 levels, PIL-bicubic resize, then ``pad=True``: longer side to ``size`` + centre zero-pad
    (open_clip's "longest" mode; HPS v2 uses ``hpsv2.hps_preprocess`` instead) or ``pad=False``: shorter side
    to ``size`` + centre crop (CLIP), then normalise.
    """
    levels = to_grey_levels(images)
    levels = resize_longest_and_pad(levels, size) if pad else resize_shortest_and_center_crop(levels, size)
    return normalize_grey_levels(levels, mean, std)


def encode_unique(prompts: Sequence[str], encode: Callable[[list[str]], torch.Tensor]) -> torch.Tensor:
    """Encode each distinct prompt once (GRPO batches repeat every prompt G times) and expand to (B, D)."""
    unique = list(dict.fromkeys(prompts))
    feats = encode(unique)  # (U, D)
    where = {p: i for i, p in enumerate(unique)}
    index = torch.tensor([where[p] for p in prompts], device=feats.device)
    return feats.index_select(0, index)


def features(output: Any) -> torch.Tensor:
    """A transformers get_*_features result as a tensor (v5 returns a ModelOutput with pooler_output)."""
    if torch.is_tensor(output):
        return output
    pooled = getattr(output, "pooler_output", None)
    if torch.is_tensor(pooled):
        return pooled
    raise TypeError(f"cannot read features from {type(output).__name__}")


# PIL resample codes (a processor config's "resample") -> torchvision modes, as transformers' torchvision backend maps
# them; the filters CLIP processors do not use (LANCZOS 1, BOX 4, HAMMING 5) are refused.
_RESAMPLE_MODES = {0: "NEAREST_EXACT", 2: "BILINEAR", 3: "BICUBIC"}


def _size_entries(size: Any) -> dict:
    """A processor's ``size``/``crop_size`` (transformers 5's SizeDict, 4's dict, or a bare int) as a plain dict."""
    if size is None:
        return {}
    if isinstance(size, int):
        return {"shortest_edge": size}
    return {k: v for k, v in dict(size).items() if v is not None}


@dataclass(frozen=True)
class HFClipTransform:
    """A transformers CLIP image processor's eval transform (resize, centre crop, normalise) as batched torch ops on
    the images' device, with the math of transformers' torchvision backend (``CLIPImageProcessor`` in transformers
    5; equal to it bit for bit on the CPU): torchvision's antialiased resize of the float image (shorter side to
    ``shortest_edge``, the longer ``int(size * long / short)``, or to ``height`` x ``width``), a centre crop at
    ``int((dim - crop) / 2)`` (zero padding where the crop is larger), ``(x - mean) / std``. Inputs are [0, 1] images
    (rescaling is never applied). Built from the processor's settings only, so no image goes through numpy or PIL,
    whatever transformers version (4.x's PIL/numpy ``CLIPImageProcessor`` included) is installed."""

    resize: dict
    interpolation: str
    crop: tuple[int, int] | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None

    @classmethod
    def from_processor(cls, processor: Any) -> HFClipTransform:
        """Read the transform off a transformers image processor (or a processor holding one)."""
        processor = getattr(processor, "image_processor", processor)
        resize = _size_entries(processor.size) if getattr(processor, "do_resize", True) else {}
        if resize and not ({"shortest_edge"} == set(resize) or {"height", "width"} == set(resize)):
            raise ValueError(f"image processor size {resize} is not supported (expected shortest_edge, or height and "
                             "width, as CLIP processors use); fix the preprocessor_config.json")
        resample = int(getattr(processor, "resample", 3))
        if resample not in _RESAMPLE_MODES:
            raise ValueError(f"image processor resample={resample} is not supported on the device; CLIP processors "
                             "use 3 (bicubic): fix the preprocessor_config.json")
        crop = _size_entries(processor.crop_size) if getattr(processor, "do_center_crop", False) else {}
        normalize = getattr(processor, "do_normalize", True)
        return cls(resize=resize, interpolation=_RESAMPLE_MODES[resample],
                   crop=(int(crop["height"]), int(crop["width"])) if crop else None,
                   mean=tuple(processor.image_mean) if normalize else None,
                   std=tuple(processor.image_std) if normalize else None)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """(B,3,H,W) float [0,1] -> (B,3,h,w) float32 model input, on the images' device."""
        from torchvision.transforms.v2 import InterpolationMode  # heavy
        from torchvision.transforms.v2 import functional as tvF  # heavy

        x = images
        if self.resize:
            h, w = x.shape[-2:]
            if "shortest_edge" in self.resize:
                size = int(self.resize["shortest_edge"])
                short, long = (w, h) if w <= h else (h, w)
                new_short, new_long = size, int(size * long / short)
                new = (new_long, new_short) if w <= h else (new_short, new_long)
            else:
                new = (int(self.resize["height"]), int(self.resize["width"]))
            x = tvF.resize(x, list(new), interpolation=getattr(InterpolationMode, self.interpolation), antialias=True)
        if self.crop is not None:
            (ch, cw), (h, w) = self.crop, x.shape[-2:]
            if ch > h or cw > w:
                pad = [max(cw - w, 0) // 2, max(ch - h, 0) // 2, (max(cw - w, 0) + 1) // 2, (max(ch - h, 0) + 1) // 2]
                x = tvF.pad(x, pad, fill=0)
                h, w = x.shape[-2:]
            x = tvF.crop(x, int((h - ch) / 2.0), int((w - cw) / 2.0), ch, cw)
        x = x.to(torch.float32)
        if self.mean is not None:
            x = tvF.normalize(x, list(self.mean), list(self.std))
        return x


# ----------------------------------------------------------------------------------------------- open_clip
def open_clip_config(model: str, flag: str, reward: str) -> dict:
    """An open_clip model config from a registered name (e.g. "ViT-H-14") or a config JSON path."""
    if looks_like_path(model):
        path = require_path(model, flag, reward, "an open_clip model-config JSON")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"reward '{reward}': {flag} {model!r} is not valid JSON ({e})") from e
        cfg = cfg.get("model_cfg", cfg)  # also accept open_clip_config.json from a hub folder
    else:
        import open_clip  # optional

        cfg = open_clip.get_model_config(model)
        if cfg is None:
            raise ValueError(f"reward '{reward}': {flag} {model!r} is neither an open_clip model name nor a config "
                             f"JSON path; names include {', '.join(open_clip.list_models()[:8])}, ...")
    missing = [k for k in ("embed_dim", "vision_cfg", "text_cfg") if k not in cfg]
    if missing:
        raise ValueError(f"reward '{reward}': {flag} {model!r} lacks {missing}; expected an open_clip model config "
                         f"with embed_dim, vision_cfg and text_cfg")
    return copy.deepcopy(cfg)


def unreadable_checkpoint(path: str | Path, flag: str, reward: str, err: BaseException) -> ValueError:
    """The error for a reward checkpoint that torch.load (weights only) or safetensors cannot read."""
    first = (str(err).splitlines() or [type(err).__name__])[0][:200]
    return ValueError(f"reward '{reward}': {flag} {str(path)!r} cannot be read as a weights-only checkpoint "
                      f"({type(err).__name__}: {first}); re-download it (a truncated or corrupt file), or convert a "
                      "pickled model object / TorchScript file to a plain state dict (.pt, .bin or .safetensors)")


def read_checkpoint(path: str | Path, flag: str, reward: str) -> Any:
    """A reward checkpoint's contents, read safely: safetensors, or ``torch.load(weights_only=True)`` (memory-mapped
    where the file allows, so a second read costs little); ValueError naming ``flag`` and the fix if it cannot be."""
    try:
        if str(path).endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(str(path))
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):  # files of the legacy (non-zip) format cannot be memory-mapped
                raise
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch.load/safetensors raise many kinds for a broken or foreign file
        raise unreadable_checkpoint(path, flag, reward, err) from err


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built inside get every ``nn.Parameter`` on the meta device (init runs on shapes only, nothing is
    allocated); their buffers, e.g. the text tower's causal ``attn_mask`` (non-persistent: not in checkpoints),
    are built for real. Uses torch's global parameter-registration hook, limited to the calling thread."""
    owner = threading.get_ident()

    def to_meta(module: torch.nn.Module, name: str, param: Any) -> torch.nn.Parameter | None:
        if type(param) is not torch.nn.Parameter or threading.get_ident() != owner:
            return None  # keep it: another thread's module, or a special parameter (lazy, ...)
        return torch.nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(to_meta)
    try:
        yield
    finally:
        handle.remove()


def _load_checkpoint_assigning(net: torch.nn.Module, checkpoint: str | Path, device: torch.device) -> None:
    """``open_clip.load_checkpoint(net, checkpoint, strict=True, weights_only=True)``, the checkpoint's tensors
    becoming ``net``'s (``load_state_dict(assign=True)``) instead of being copied into them, so ``net`` may hold
    meta parameters. open_clip's own massaging (``state_dict``/``module.`` unwrapping, ``logit_scale`` reshape,
    position-embedding resizing) runs unchanged; each tensor is then cast to the dtype of the model's tensor it
    replaces, contiguous on ``device`` -- what copying it in would have made -- and the source dropped at once (a
    fp32 checkpoint loaded to the CPU is used in place: one copy of the weights in memory). Strict: a checkpoint that
    does not fit raises load_state_dict's RuntimeError, as copying would."""
    import open_clip  # optional

    targets = net.state_dict(keep_vars=True)

    def load_state_dict(state_dict: dict, strict: bool = True, assign: bool = False) -> Any:
        fitted = {}
        for key in list(state_dict):
            value = state_dict.pop(key)
            target = targets.get(key)
            if target is not None and torch.is_tensor(value):
                value = value.to(device=device if target.is_meta else target.device, dtype=target.dtype)
                if not value.is_contiguous():  # e.g. open_clip's resized text positions, a transposed view
                    value = value.contiguous()
                elif value.untyped_storage().nbytes() != value.numel() * value.element_size():
                    value = value.clone()  # a view into a larger storage: keep only its own elements
            fitted[key] = value
        return type(net).load_state_dict(net, fitted, strict=strict, assign=True)

    net.load_state_dict = load_state_dict  # the instance's, for open_clip.load_checkpoint's one call
    try:
        open_clip.load_checkpoint(net, str(checkpoint), strict=True, weights_only=True)
    finally:
        del net.load_state_dict
    left = [name for name, t in [*net.named_parameters(), *net.named_buffers()] if t.is_meta]
    if left:  # cannot happen with strict loading; guards against a tensor silently left unloaded
        raise RuntimeError(f"open_clip model tensors not loaded from the checkpoint: {left[:5]}")


def _build_uninitialised(model_class: type, cfg: dict, device: torch.device) -> torch.nn.Module:
    """``model_class(**cfg)`` on ``device`` with its parameters on the meta device, to be assigned from a checkpoint:
    no random init. Towers that cannot be built so (some timm ones run their layers in ``__init__``, or derive a
    buffer from parameters, as Swin's ``attn_mask``) are built and randomly initialised for real, as before."""
    try:
        with torch.device(device), _parameters_on_meta():  # buffers (attn_mask) are built for real, on the device
            net = model_class(**copy.deepcopy(cfg))
        meta_state = any(t.is_meta for t in net.buffers()) or any(
            torch.is_tensor(v) and v.is_meta for m in net.modules() for v in vars(m).values())
        if not meta_state:
            return net
    except Exception:  # noqa: BLE001 - whatever a tower's __init__ raises on meta tensors
        pass
    with torch.device(device):
        return model_class(**cfg)


def load_open_clip(model: str, checkpoint: str | Path, device: torch.device, *, model_flag: str,
                   checkpoint_flag: str, reward: str) -> tuple[torch.nn.Module, Callable, dict]:
    """Build an open_clip CLIP from ``model`` (name or JSON), load ``checkpoint`` strictly, eval/no-grad on device.

    Returns (model, tokenizer, preprocess) where preprocess holds ``size``, ``mean`` and ``std``.
    The checkpoint may be a plain state dict, ``{'state_dict': ...}`` (HPS format), ``module.``-prefixed
    (DDP-trained) or safetensors: open_clip's ``load_checkpoint`` handles them all (weights_only loading, so
    OpenAI's TorchScript ``ViT-L-14.pt`` is refused; use open_clip's ``open_clip_pytorch_model.bin`` instead).
    """
    import open_clip  # optional
    from open_clip.model import CLIP, CustomTextCLIP  # optional

    cfg = open_clip_config(model, model_flag, reward)
    preprocess = dict(cfg.pop("preprocess_cfg", {}) or {})
    if "hf_model_name" in cfg["text_cfg"] or "multimodal_cfg" in cfg:
        raise ValueError(f"reward '{reward}': {model_flag} {model!r} needs a Hugging Face text tower or is a CoCa "
                         f"model; only plain CLIP configs (like ViT-H-14) load offline")
    if "timm_model_name" in cfg["vision_cfg"]:
        cfg["vision_cfg"]["timm_model_pretrained"] = False  # never download tower weights
    model_class = CustomTextCLIP if cfg.pop("custom_text", False) else CLIP
    # Read it weights-only ourselves first: an unreadable file fails before the model is built, and open_clip's own
    # read of it below then succeeds, so its fallback to an unrestricted torch.load (on a TypeError) never runs.
    read_checkpoint(checkpoint, checkpoint_flag, reward)
    net = _build_uninitialised(model_class, cfg, device)
    try:
        _load_checkpoint_assigning(net, checkpoint, device)
    except RuntimeError as e:
        if "loading state_dict" not in str(e):
            raise
        raise ValueError(f"reward '{reward}': {checkpoint_flag} {str(checkpoint)!r} does not fit the architecture "
                         f"{model_flag} {model!r}; pass the matching model name or config JSON to {model_flag} "
                         f"({str(e).splitlines()[0][:300]})") from e
    net = net.to(device).eval().requires_grad_(False)

    image_size = net.visual.image_size
    size = image_size[0] if isinstance(image_size, (tuple, list)) else int(image_size)
    text_cfg = cfg["text_cfg"]
    text_cfg = text_cfg if isinstance(text_cfg, dict) else {}
    if text_cfg.get("hf_tokenizer_name"):
        raise ValueError(f"reward '{reward}': {model_flag} {model!r} uses a Hugging Face tokenizer; "
                         f"use a model with open_clip's own BPE tokenizer")
    tokenizer = open_clip.SimpleTokenizer(context_length=text_cfg.get("context_length", 77),
                                          **text_cfg.get("tokenizer_kwargs", {}))
    preprocess = {"size": size, "mean": tuple(preprocess.get("mean", OPENAI_CLIP_MEAN)),
                  "std": tuple(preprocess.get("std", OPENAI_CLIP_STD))}
    return net, tokenizer, preprocess
