"""HPS v2 / v2.1 (Human Preference Score): open_clip ViT-H-14 fine-tuned on human preferences.

Score = cos(image, prompt) of the HPS-tuned CLIP, i.e. the diagonal of
normalize(img_feat) @ normalize(txt_feat)^T, no logit scale (~0.25-0.38 for FLUX images).
Preprocessing is HPS's ``preprocess_val`` (open_clip ``image_transform(224, resize_longest_max=True,
fill_color=0)``; ``resize_mode="longest"`` in open_clip 3.x) done on the whole batch in tensor ops:
round to uint8 (HPS scores PIL images), bicubic-resize the longer side to 224 as PIL does (two
rounded passes; within 2 grey levels of PIL), centre zero-pad to 224x224, CLIP-normalise. Unlike
plain CLIP it pads, never crops. The model runs in float32 (HPS's script uses fp16 autocast on CUDA,
which moves scores by ~1e-3).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch

from ._common import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, clip_pixels, require_path
from .clipscore import ClipScorer

DEFAULT_MODEL = "ViT-H-14"
TINY_CHECKPOINT = "hps-tiny.pt"
TINY_CONFIG = "hps-tiny-config.json"

# ViT-H-14's layout (open_clip model_configs/ViT-H-14.json) at toy width; 224 input with 32px patches (7x7 grid).
TINY_MODEL_CONFIG = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 224, "layers": 2, "width": 32, "head_width": 16, "patch_size": 32},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
}


def hps_preprocess(images: torch.Tensor, size: int = 224, mean: Sequence[float] = OPENAI_CLIP_MEAN,
                   std: Sequence[float] = OPENAI_CLIP_STD) -> torch.Tensor:
    """HPS v2's eval transform on a (B,3,H,W) [0,1] batch -> (B,3,size,size) normalised, float32."""
    return clip_pixels(images, size, mean, std, pad=True)


class HPSv2Scorer(ClipScorer):
    """Scores (images, prompts) with an HPS v2 checkpoint: CLIP cosine with HPS's padding preprocessing."""

    pad = True
    flags = ("--hps_model", "--hps_checkpoint", "hpsv2")


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
    from open_clip.model import CLIP

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CLIP(**json.loads(json.dumps(TINY_MODEL_CONFIG)))
    state_dict = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()}
    torch.save({"state_dict": state_dict}, out / TINY_CHECKPOINT)
    (out / TINY_CONFIG).write_text(json.dumps(TINY_MODEL_CONFIG, indent=2) + "\n")
    return out
