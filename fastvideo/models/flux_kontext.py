"""FLUX.1-Kontext: FLUX.1 conditioned on a source image (image editing), as ``FluxKontextPipeline`` runs it.

The source image's VAE latents are packed like the target's and appended to the transformer's image sequence with
their own position ids (index axis 1 instead of 0, rows and columns of the source grid); the velocity of the
target tokens is the first ``L`` rows of the output. Everything else (text encoders, the guidance embedding, the
dynamic shift on the target's token count, VAE decode) is FLUX.1's: ``FluxKontext`` subclasses ``Flux1`` and adds
only the condition (``ModelFamily.edit``). The source latents are stored per example beside the prompt embeddings
(``preprocess_embeddings.py --edit_file``), so the rollout, replay and losses see the target tokens only.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from fastvideo import devices
from fastvideo.models import flux
from fastvideo.models.base import SamplerDefaults, condition_geometry_of
from fastvideo.models.common import LatentGeometry, encode

PIPELINE_CLASS = "FluxKontextPipeline"
SOURCE_KEY = "image_latents"  # the stored packed source latents (N, Ls, C): the pipeline's name for them


def source_image_ids(source: LatentGeometry, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(Ls, 3) position ids of the packed source tokens: [1, row, col] (``FluxKontextPipeline.prepare_latents``)."""
    ids = flux.image_ids(source, dtype=dtype)
    ids[:, 0] = 1
    return ids


class FluxKontext(flux.Flux1):
    """FLUX.1-Kontext-dev: FLUX.1 with the source image's packed latents as extra tokens (ids index 1); guidance
    embedding 3.5 (the pipeline default; the model card samples at 2.5), 28 steps, 1024 x 1024."""

    name = "flux-kontext"
    pipeline_classes = (PIPELINE_CLASS,)
    transformer_classes = ()  # the FLUX.1 class: ``family_of`` finds Kontext by its tag, never by class
    embedding_keys = ("prompt_embeds", "pooled_prompt_embeds", SOURCE_KEY)
    condition_keys = (SOURCE_KEY,)
    edit = True
    defaults = SamplerDefaults(steps=28, guidance=3.5, height=1024, width=1024, max_sequence_length=flux.MAX_T5_TOKENS)
    # --sp_size > 1: diffusers' FluxTransformer2DModel._cp_plan splits the joined target + source tokens and their
    # ids alike (L + Ls must divide by it) and gathers the output, whose first L rows are the target's
    sequence_parallel = True
    recipes = {"grpo": "scripts/recipes/flow_grpo_kontext.yaml"}

    def encode_edits(self, encoders, vae, images, prompts, max_sequence_length):
        cond, truncated = self.encode_prompts(encoders, prompts, max_sequence_length)
        source = self.latent_geometry(vae, images.shape[-2], images.shape[-1])
        cond[SOURCE_KEY] = encode(vae, images, source)  # posterior mode, as the pipeline's sample_mode="argmax"
        return cond, truncated

    def conditioning(self, geometry, cond, guidance, device):
        shared = super().conditioning(geometry, cond, guidance, device)
        source = condition_geometry_of(geometry, self)
        dtype = cond["prompt_embeds"].dtype
        ids = torch.cat([flux.image_ids(geometry, dtype=dtype), source_image_ids(source, dtype)])
        shared["img_ids"] = devices.to_device(ids, device)  # target then source rows, as the pipeline's latent_ids
        return shared

    def predict_velocity(self, transformer, latents, sigma, cond, shared):
        length = latents.shape[1]
        both = torch.cat([latents, cond[SOURCE_KEY].to(latents.dtype)], dim=1)
        v = flux.predict_velocity(transformer, both, sigma, cond["prompt_embeds"], cond["pooled_prompt_embeds"],
                                  shared["img_ids"], shared["txt_ids"], guidance=shared["guidance"])
        return v[:, :length]

    def pipeline_class(self) -> type:
        from diffusers import FluxKontextPipeline  # heavy

        return FluxKontextPipeline


def _kontext_index(folder: Path) -> None:
    """Turn a FLUX.1 folder's model_index.json into FluxKontextPipeline's (same components; no IP-adapter)."""
    import json

    index_file = folder / "model_index.json"
    index = json.loads(index_file.read_text())
    index.update({"_class_name": PIPELINE_CLASS, "image_encoder": [None, None], "feature_extractor": [None, None]})
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def build_tiny(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """A seeded tiny FLUX.1-Kontext folder (the tiny FLUX.1 preset's components under FluxKontextPipeline's
    model_index.json) that the stock ``FluxKontextPipeline`` loads; same seed => byte-identical files."""
    from fastvideo import tiny

    def write(tmp: Path) -> None:
        tiny.build_tiny_flux(tmp / "flux", preset="tiny", seed=seed)
        for part in (tmp / "flux").iterdir():
            part.rename(tmp / part.name)
        (tmp / "flux").rmdir()
        _kontext_index(tmp)

    return tiny.write_atomically(out_dir, write)


def write_config(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """FLUX.1-Kontext-dev's diffusers layout with its real configs and no weights (its transformer is FLUX.1-dev's
    architecture; ``seed`` is ignored): for meta-device planning of the 11.9B transformer without the download."""
    from fastvideo import tiny

    def write(tmp: Path) -> None:
        tiny.write_flux_dev_config(tmp / "flux")
        for part in (tmp / "flux").iterdir():
            part.rename(tmp / part.name)
        (tmp / "flux").rmdir()
        _kontext_index(tmp)

    return tiny.write_atomically(out_dir, write)
