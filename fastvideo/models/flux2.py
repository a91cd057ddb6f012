"""The FLUX.2 (dev and klein) family adapter (work in progress: the registry entry exists, the methods are being written)."""
from __future__ import annotations

from fastvideo.models.base import ModelFamily


class Flux2(ModelFamily):
    """FLUX.2 (dev and klein)."""

    name = "flux2"
    pipeline_classes = ("Flux2Pipeline", "Flux2KleinPipeline",)
    transformer_classes = ("Flux2Transformer2DModel",)
