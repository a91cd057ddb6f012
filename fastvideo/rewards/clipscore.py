"""CLIP score: open_clip cosine similarity between image and prompt, from a local checkpoint.

The reward is the raw cosine in [-1, 1] (scale 1). Published "CLIP scores" rescale it: torchmetrics'
CLIPScore is 100*max(cos, 0), Hessel et al.'s CLIPScore is 2.5*max(cos, 0); reproduce a scale with
the spec weight (e.g. ``clipscore:100``). Preprocessing is CLIP's eval transform, batched: bicubic
resize of the shorter side to the model's input size, centre crop, CLIP normalise.
"""
from __future__ import annotations

from ._common import clip_pixels, encode_unique, load_open_clip, require_path
from pathlib import Path
from typing import Sequence

import torch

DEFAULT_MODEL = "ViT-H-14"


class ClipScorer:
    """cos(image, prompt) under an open_clip model; loaded once, eval, no grad, on ``device``.

    Subclasses change the preprocessing (``pixels``) and the flags named in load errors (``flags``).
    """

    pad = False  # CLIP's eval transform crops the longer side
    flags = ("--clip_model", "--clip_checkpoint", "clipscore")  # model flag, checkpoint flag, reward name

    def __init__(self, checkpoint: str | Path, model: str = DEFAULT_MODEL, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        model_flag, checkpoint_flag, reward = self.flags
        self.model, self.tokenizer, self.preprocess = load_open_clip(
            model, checkpoint, self.device, model_flag=model_flag, checkpoint_flag=checkpoint_flag, reward=reward)

    def _encode_text(self, prompts: list[str]) -> torch.Tensor:
        return self.model.encode_text(self.tokenizer(prompts).to(self.device), normalize=True).float()

    def pixels(self, images: torch.Tensor) -> torch.Tensor:
        """(B,3,H,W) in [0,1] on ``device`` -> the model's normalised input (CLIP's eval transform, batched)."""
        p = self.preprocess
        return clip_pixels(images, p["size"], p["mean"], p["std"], pad=self.pad)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """(B,3,H,W) in [0,1] + B prompts -> (B,) float32 cosine similarities on ``device``."""
        pixels = self.pixels(images.to(self.device))
        image_features = self.model.encode_image(pixels, normalize=True).float()  # (B, D)
        return (image_features * encode_unique(prompts, self._encode_text)).sum(dim=-1)


def build(device: torch.device, *, clip_checkpoint: str | None = None, clip_model: str = DEFAULT_MODEL,
          **_: object) -> ClipScorer:
    """Registry factory: ``--clip_checkpoint`` (required, an open_clip state dict) and ``--clip_model``."""
    checkpoint = require_path(clip_checkpoint, "--clip_checkpoint", "clipscore",
                              "an open_clip checkpoint, e.g. open_clip_pytorch_model.bin of ViT-H-14")
    return ClipScorer(checkpoint, clip_model or DEFAULT_MODEL, device)
