"""HPS v2 / v2.1 (Human Preference Score): open_clip ViT-H-14 fine-tuned on human preferences.

Score = cos(image, prompt) of the HPS-tuned CLIP, i.e. the diagonal of
normalize(img_feat) @ normalize(txt_feat)^T, no logit scale (~0.25-0.38 for FLUX images).

Preprocessing is HPS's own ``preprocess_val``, not open_clip's: ``hpsv2.img_score`` builds it with
``create_model_and_transforms(..., light_augmentation=True)``, i.e. ``image_transform(224, is_train=False,
resize_longest_max=True)`` from hpsv2/src/open_clip/transform.py, which is
``Compose([convert RGB, ToTensor(), ResizeMaxSize(224, fill=0), Normalize(OPENAI_DATASET_MEAN/STD)])``.
So the PIL image becomes a float tensor *first*, then one ``torchvision.transforms.functional.resize`` of
that tensor (bicubic, antialiased by torchvision >= 0.17's default, no clamp, no rounding) brings the
longer side to 224 with ``new = round(dim * 224 / max(h, w))``, then a centred zero pad (left/top get
``pad // 2``) makes it 224x224, then CLIP normalisation. (open_clip's ``resize_mode="longest"`` instead
resizes the uint8 PIL image, rounding and clipping after each of PIL's two passes: over 40 grey levels
apart on upscaled noise, scores ~5e-4 apart.)

``hps_preprocess`` does exactly this on the whole batch, on the images' device: round to the 1/255 grid
(the uint8 image HPS's ``ToTensor`` reads), one ``F.interpolate(mode="bicubic", antialias=True,
align_corners=False)`` (what torchvision's tensor resize calls), ``F.pad``, ``(x - mean) / std``; it equals
HPS's transform bit for bit on CPU. One deliberate difference: HPS's ResizeMaxSize skips resize *and* pad
when the longer side is already 224 (``if scale != 1.0``), so e.g. a 224x150 image reaches its ViT
unpadded and non-square; we always pad to 224x224. The model runs in float32 (HPS's script uses fp16
autocast on CUDA, which moves scores by ~1e-3).
"""
from __future__ import annotations

import json
from ._common import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, quantize_uint8, require_path
from .clipscore import ClipScorer
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

DEFAULT_MODEL = "ViT-H-14"
TINY_CHECKPOINT = "hps-tiny.pt"
TINY_CONFIG = "hps-tiny-config.json"

# ViT-H-14's layout (open_clip model_configs/ViT-H-14.json) at toy width; 224 input with 32px patches (7x7 grid).
TINY_MODEL_CONFIG = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 224, "layers": 2, "width": 32, "head_width": 16, "patch_size": 32},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
}


def hps_resize_max_size(images: torch.Tensor, size: int = 224) -> torch.Tensor:
    """HPS's ``ResizeMaxSize(size, fill=0)`` on a (B,C,H,W) float batch -> (B,C,size,size), same dtype/device.

    One bicubic antialiased resize of the longer side to ``size`` (HPS: ``F.resize(img, new_size, BICUBIC)``
    on the ToTensor'd image; for float tensors torchvision calls exactly this ``F.interpolate``, without
    clamping), sizes rounded as HPS rounds them, then zero padding split like HPS's
    ``F.pad(img, [pad_w//2, pad_h//2, pad_w - pad_w//2, pad_h - pad_h//2])``. Unlike HPS, an image whose
    longer side is already ``size`` is still padded to a square (HPS returns it unpadded).
    """
    h, w = images.shape[-2:]
    scale = size / float(max(h, w))
    new_h, new_w = (max(1, round(dim * scale)) for dim in (h, w))  # max(1, .): HPS would fail on a 0 side
    x = images
    if (new_h, new_w) != (h, w):  # equal only when scale == 1.0, where HPS (and torchvision) skip the resize
        x = F.interpolate(x, size=(new_h, new_w), mode="bicubic", align_corners=False, antialias=True)
    pad_h, pad_w = size - new_h, size - new_w
    if pad_h or pad_w:
        x = F.pad(x, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2), value=0.0)
    return x


def hps_preprocess(images: torch.Tensor, size: int = 224, mean: Sequence[float] = OPENAI_CLIP_MEAN,
                   std: Sequence[float] = OPENAI_CLIP_STD) -> torch.Tensor:
    """HPS v2's ``preprocess_val`` on a (B,3,H,W) [0,1] batch -> (B,3,size,size) normalised float32, same device.

    Rounds to the 1/255 grid first (HPS scores a uint8 PIL image; ``ToTensor`` gives exactly these values),
    then ``hps_resize_max_size`` (always padded to square) and ``Normalize(mean, std)`` as torchvision
    computes it, ``(x - mean) / std``.
    """
    x = hps_resize_max_size(quantize_uint8(images), size)
    mean_t = torch.tensor(mean, dtype=torch.float32, device=x.device).view(1, -1, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32, device=x.device).view(1, -1, 1, 1)
    return x.sub_(mean_t).div_(std_t)


class HPSv2Scorer(ClipScorer):
    """Scores (images, prompts) with an HPS v2 checkpoint: CLIP cosine with HPS's own ``preprocess_val``."""

    pad = True  # HPS pads rather than crops
    flags = ("--hps_model", "--hps_checkpoint", "hpsv2")

    def pixels(self, images: torch.Tensor) -> torch.Tensor:
        """HPS's own ``preprocess_val`` (``hps_preprocess``), batched on ``device``."""
        p = self.preprocess
        return hps_preprocess(images, p["size"], p["mean"], p["std"])


def build(device: torch.device, *, hps_checkpoint: str | None = None, hps_model: str = DEFAULT_MODEL,
          **_: object) -> HPSv2Scorer:
    """Registry factory: ``--hps_checkpoint`` (required) and ``--hps_model`` (name or config JSON)."""
    checkpoint = require_path(hps_checkpoint, "--hps_checkpoint", "hpsv2",
                              "HPS_v2_compressed.pt or HPS_v2.1_compressed.pt")
    return HPSv2Scorer(checkpoint, hps_model or DEFAULT_MODEL, device)


def build_tiny_hps(out_dir: str | Path, seed: int = 0) -> Path:
    """Write a tiny random HPS-format checkpoint + its open_clip config into ``out_dir``; returns ``out_dir``.

    Files: ``hps-tiny.pt`` (``{'state_dict': ...}``, fp16 like HPS's compressed releases, ~3 MB) and
    ``hps-tiny-config.json`` (pass it as ``--hps_model``). Same key layout as ViT-H-14 (full CLIP
    vocabulary, so open_clip's tokenizer applies); identical bytes for identical seeds.
    """
    from open_clip.model import CLIP  # optional

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CLIP(**json.loads(json.dumps(TINY_MODEL_CONFIG)))
    state_dict = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()}
    torch.save({"state_dict": state_dict}, out / TINY_CHECKPOINT)
    (out / TINY_CONFIG).write_text(json.dumps(TINY_MODEL_CONFIG, indent=2) + "\n")
    return out
