"""PickScore: a CLIP-H (transformers CLIPModel) fine-tuned on Pick-a-Pic preferences.

``--pickscore_model`` is a local copy of ``yuvalkirstain/PickScore_v1``, ``--pickscore_processor`` a local
copy of the processor it was trained with (``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``). Score =
``logit_scale.exp() * cos(image, prompt)`` as in PickScore's reference code (~18-24 for good images).
Flow-GRPO divides that by 26 to land near [0, 1]: reproduce it with the spec weight ``pickscore:0.03846``.
Images go through the processor's own transform, batched as torch ops on the tensors' device
(``HFClipTransform``: the math of transformers' torchvision backend, read off the processor's settings; no numpy or
PIL) after rounding to uint8 like the PIL images the reference scores; prompts are padded and truncated to 77 tokens.
"""
from __future__ import annotations

from ._common import HFClipTransform, encode_unique, features, quantize_uint8, require_path
from pathlib import Path
from typing import Sequence

import torch

MAX_LENGTH = 77


class PickScoreScorer:
    """PickScore of (image, prompt) pairs; model loaded once, eval, no grad, on ``device``."""

    def __init__(self, model: str | Path, processor: str | Path, device: str | torch.device = "cpu"):
        from transformers import CLIPModel, CLIPProcessor  # heavy

        self.device = torch.device(device)
        self.processor = CLIPProcessor.from_pretrained(processor, local_files_only=True)
        self.transform = HFClipTransform.from_processor(self.processor.image_processor)
        self.model = CLIPModel.from_pretrained(model, local_files_only=True)
        self.model = self.model.to(self.device).eval().requires_grad_(False)

    def _encode_text(self, prompts: list[str]) -> torch.Tensor:
        tokens = self.processor.tokenizer(prompts, padding=True, truncation=True, max_length=MAX_LENGTH,
                                          return_tensors="pt").to(self.device)
        emb = features(self.model.get_text_features(**tokens)).float()
        return emb / emb.norm(dim=-1, keepdim=True)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """(B,3,H,W) in [0,1] + B prompts -> (B,) float32 ``logit_scale * cos`` on ``device``."""
        pixels = self.transform(quantize_uint8(images.to(self.device)))
        emb = features(self.model.get_image_features(pixel_values=pixels)).float()
        emb = emb / emb.norm(dim=-1, keepdim=True)
        cos = (emb * encode_unique(prompts, self._encode_text)).sum(dim=-1)
        return self.model.logit_scale.exp().float() * cos


def build(device: torch.device, *, pickscore_model: str | None = None, pickscore_processor: str | None = None,
          **_: object) -> PickScoreScorer:
    """Registry factory: ``--pickscore_model`` and ``--pickscore_processor`` (local folders, both required)."""
    model = require_path(pickscore_model, "--pickscore_model", "pickscore",
                         "a local folder of yuvalkirstain/PickScore_v1", kind="dir")
    processor = require_path(pickscore_processor, "--pickscore_processor", "pickscore",
                             "a local folder of laion/CLIP-ViT-H-14-laion2B-s32B-b79K's processor", kind="dir")
    return PickScoreScorer(model, processor, device)
