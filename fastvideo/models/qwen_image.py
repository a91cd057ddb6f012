"""The Qwen-Image family adapter (work in progress: the registry entry exists, the methods are being written)."""
from __future__ import annotations

from fastvideo.models.base import ModelFamily


class QwenImage(ModelFamily):
    """Qwen-Image."""

    name = "qwen-image"
    pipeline_classes = ("QwenImagePipeline",)
    transformer_classes = ("QwenImageTransformer2DModel",)
