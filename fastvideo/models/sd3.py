"""The SD3 / SD3.5 family adapter (work in progress: the registry entry exists, the methods are being written)."""
from __future__ import annotations

from fastvideo.models.base import ModelFamily


class SD3(ModelFamily):
    """SD3 / SD3.5."""

    name = "sd3"
    pipeline_classes = ("StableDiffusion3Pipeline",)
    transformer_classes = ("SD3Transformer2DModel",)
