"""LAION aesthetic predictor v2: an MLP on L2-normalised CLIP ViT-L/14 image embeddings (~1-10 scale).

``--aesthetic_checkpoint`` is LAION's ``sac+logos+ava1-l14-linearMSE.pth`` (keys ``layers.{0,2,4,6,7}``).
``--aesthetic_clip_checkpoint`` is either a transformers CLIPModel folder (e.g. a local copy of
``openai/clip-vit-large-patch14`` with its preprocessor_config.json, as ddpo-pytorch uses) or an open_clip
state-dict file, whose architecture is ``--aesthetic_clip_model`` (default ``ViT-L-14-quickgelu``: OpenAI's
weights use QuickGELU). The prompt is ignored.
"""
from __future__ import annotations

from ._common import HFClipTransform, clip_pixels, features, load_open_clip, quantize_uint8, require_path
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

DEFAULT_CLIP_MODEL = "ViT-L-14-quickgelu"


class AestheticMLP(nn.Module):
    """LAION's improved-aesthetic-predictor head; the layer indices match its checkpoint keys."""

    def __init__(self, input_size: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(input_size, 1024), nn.Dropout(0.2),
            nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        """(B, D) normalised embeddings -> (B, 1) scores."""
        return self.layers(embeddings)


def load_aesthetic_mlp(path: str | Path) -> AestheticMLP:
    """Load LAION's MLP state dict (plain, ``{'state_dict': ...}`` or Lightning-prefixed) into an eval MLP."""
    from ._common import read_checkpoint

    state = read_checkpoint(path, "--aesthetic_checkpoint", "aesthetic")
    state = state.get("state_dict", state) if isinstance(state, dict) else {}
    state = {k.removeprefix("model.").removeprefix("module."): v for k, v in state.items()}
    if "layers.0.weight" not in state:
        raise ValueError(f"reward 'aesthetic': --aesthetic_checkpoint {str(path)!r} has no 'layers.0.weight'; "
                         f"expected LAION's sac+logos+ava1-l14-linearMSE.pth")
    mlp = AestheticMLP(int(state["layers.0.weight"].shape[1]))
    try:
        mlp.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ValueError(f"reward 'aesthetic': --aesthetic_checkpoint {str(path)!r} does not fit LAION's aesthetic "
                         f"MLP ({str(err).splitlines()[0][:200]}); pass sac+logos+ava1-l14-linearMSE.pth") from err
    return mlp.eval().requires_grad_(False)


class AestheticScorer:
    """LAION aesthetic score of each image; CLIP + MLP loaded once, eval, no grad, on ``device``."""

    def __init__(self, checkpoint: str | Path, clip_checkpoint: str | Path, clip_model: str = DEFAULT_CLIP_MODEL,
                 device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.mlp = load_aesthetic_mlp(checkpoint).to(self.device)
        clip_path = Path(clip_checkpoint)
        if clip_path.is_dir():
            from transformers import CLIPImageProcessor, CLIPModel  # heavy

            self.hf_model = CLIPModel.from_pretrained(clip_path, local_files_only=True)
            self.hf_model = self.hf_model.to(self.device).eval().requires_grad_(False)
            self.transform = HFClipTransform.from_processor(
                CLIPImageProcessor.from_pretrained(clip_path, local_files_only=True))  # torch ops on the device
            embed_dim = self.hf_model.config.projection_dim
            self.model = None
        else:
            self.model, _, self.preprocess = load_open_clip(
                clip_model, clip_path, self.device, model_flag="--aesthetic_clip_model",
                checkpoint_flag="--aesthetic_clip_checkpoint", reward="aesthetic")
            embed_dim = getattr(self.model.visual, "output_dim", None)
        expected = self.mlp.layers[0].in_features
        if embed_dim is not None and embed_dim != expected:
            raise ValueError(f"reward 'aesthetic': the CLIP from --aesthetic_clip_checkpoint embeds to {embed_dim} "
                             f"dims but the MLP expects {expected} (LAION's MLP needs CLIP ViT-L/14: 768)")

    def image_embeddings(self, images: torch.Tensor) -> torch.Tensor:
        """(B,3,H,W) in [0,1] -> (B, D) L2-normalised CLIP image embeddings, float32."""
        images = images.to(self.device)
        if self.model is None:
            pixels = self.transform(quantize_uint8(images))
            emb = features(self.hf_model.get_image_features(pixel_values=pixels))
        else:
            p = self.preprocess
            emb = self.model.encode_image(clip_pixels(images, p["size"], p["mean"], p["std"], pad=False))
        emb = emb.float()
        return emb / emb.norm(dim=-1, keepdim=True)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """(B,3,H,W) in [0,1] -> (B,) float32 aesthetic scores on ``device``; prompts are ignored."""
        return self.mlp(self.image_embeddings(images)).squeeze(-1).float()


def build(device: torch.device, *, aesthetic_checkpoint: str | None = None,
          aesthetic_clip_checkpoint: str | None = None, aesthetic_clip_model: str = DEFAULT_CLIP_MODEL,
          **_: object) -> AestheticScorer:
    """Registry factory: --aesthetic_checkpoint, --aesthetic_clip_checkpoint (required), --aesthetic_clip_model."""
    mlp = require_path(aesthetic_checkpoint, "--aesthetic_checkpoint", "aesthetic",
                       "LAION's sac+logos+ava1-l14-linearMSE.pth")
    clip = require_path(aesthetic_clip_checkpoint, "--aesthetic_clip_checkpoint", "aesthetic",
                        "a CLIP ViT-L/14 transformers folder or open_clip state-dict file", kind="any")
    return AestheticScorer(mlp, clip, aesthetic_clip_model or DEFAULT_CLIP_MODEL, device)
