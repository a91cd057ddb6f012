"""Qwen-Image-Edit: Qwen-Image conditioned on a source image (image editing), as ``QwenImageEditPipeline`` runs it.

The source enters twice (diffusers 0.42 ``pipeline_qwenimage_edit.py``):

- the Qwen2.5-VL text encoder *sees* it: the instruction is wrapped in an edit chat template holding
  ``<|vision_start|><|image_pad|><|vision_end|>``, which ``Qwen2VLProcessor`` expands to the source's vision tokens
  (1,369 for a 1024² source), and the template's first 64 tokens are dropped from the last hidden state. The prompt
  embeddings therefore depend on the image, and so do the negative prompt's: the pipeline encodes the negative prompt
  *with the same source*, so an edit store keeps a negative row per example (``negative_sees_source``);
- its VAE latents (posterior mode, normalised per channel) are packed like the target's and appended to the image
  sequence; ``img_shapes`` lists the target's grid and then the source's, and the velocity of the target tokens is
  the first ``L`` rows of the output.

Everything else (true CFG rescaled to the conditional norm, the sigma grid on the target's token count, the VAE) is
Qwen-Image's: ``QwenImageEdit`` subclasses ``QwenImage`` and adds the condition (``ModelFamily.edit``). The stock
pipeline resizes every source to a 1024² area (multiples of 32); an edit store holds one source size
(``preprocess_embeddings.py --edit_size 1024x1024`` for the pipeline's).

``QwenImageEditPlus`` serves ``QwenImageEditPlusPipeline`` (Qwen-Image-Edit-2509/2511): its template names each
image (``Picture k: <|vision_start|><|image_pad|><|vision_end|>`` before the instruction), its VLM sees each source
resized (Lanczos) to a 384² area (196 vision tokens for a square source instead of 1,369), and an edit may have
several sources (``multi_source``: their latents one after another in the sequence, one ``img_shapes`` entry each);
the VAE latents and everything after are Qwen-Image-Edit's.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fastvideo.models import qwen_image as qi
from fastvideo.models.base import check_components, condition_geometry_of

PIPELINE_CLASS = "QwenImageEditPipeline"
SOURCE_KEY = "image_latents"  # the stored packed source latents (N, Ls, C): the pipeline's name for them
# QwenImageEditPipeline.prompt_template_encode / prompt_template_encode_start_idx.
EDIT_TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, "
                 "objects, background), then explain how the user's text instruction should alter or modify the "
                 "image. Generate a new image that meets the user's requirements while maintaining consistency with "
                 "the original input where appropriate.<|im_end|>\n<|im_start|>user\n"
                 "<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n")
EDIT_TEMPLATE_DROP = 64  # the system turn and "<|im_start|>user\n": the kept rows start at <|vision_start|>
# Qwen/Qwen-Image-Edit processor/preprocessor_config.json (Qwen2.5-VL's image processor).
PROCESSOR_CONFIG: dict[str, Any] = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2,
                                    "min_pixels": 56 * 56, "max_pixels": 28 * 28 * 16384}
SOURCE_AREA = 1024 * 1024  # QwenImageEditPipeline resizes every source to this area (calculate_dimensions)
PLUS_PIPELINE_CLASS = "QwenImageEditPlusPipeline"
# QwenImageEditPlusPipeline.prompt_template_encode (the same system turn: 64 tokens dropped) and its
# img_prompt_template, numbered from 1 and written before the instruction.
PLUS_TEMPLATE = EDIT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>{}", "{}")
PICTURE_TEMPLATE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
PLUS_VLM_AREA = 384 * 384  # pipeline_qwenimage_edit_plus.CONDITION_IMAGE_SIZE: the VLM's source area
TINY_PROCESSOR_CONFIG: dict[str, Any] = {**PROCESSOR_CONFIG, "max_pixels": 112 * 112}  # <= 16 vision tokens
_COMPONENT_FILES = {**qi._COMPONENT_FILES, "processor": ("tokenizer_config.json", "processor_config.json")}
TEXT_COMPONENTS = ("tokenizer", "text_encoder", "processor")
_BUILD_HINT = ("pass a diffusers Qwen-Image-Edit folder (e.g. a local download of Qwen/Qwen-Image-Edit) or build a "
               "tiny one with `python -m fastvideo.tiny --preset qwen-image-edit-tiny --out DIR`")


def vision_tokens(height: int, width: int, processor: dict[str, Any] | None = None) -> int:
    """Vision tokens ``Qwen2VLProcessor`` makes of one ``height`` x ``width`` image (its ``smart_resize`` to
    multiples of patch x merge within [min_pixels, max_pixels], then merge² patches per token); ``processor``:
    its settings (default Qwen-Image-Edit's)."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize  # heavy

    c = {**PROCESSOR_CONFIG, **(processor or {})}
    factor = c["patch_size"] * c["merge_size"]
    h, w = smart_resize(int(height), int(width), factor, c["min_pixels"], c["max_pixels"])
    return (h // factor) * (w // factor)


def calculate_dimensions(area: int, ratio: float) -> tuple[int, int]:
    """(height, width) of ``area`` pixels at ``ratio`` = width / height, each rounded to a multiple of 32:
    ``pipeline_qwenimage_edit.calculate_dimensions`` (which returns (width, height, None))."""
    width = math.sqrt(area * ratio)
    return int(round(width / ratio / 32) * 32), int(round(width / 32) * 32)


@dataclass
class EditTextEncoders(qi.TextEncoders):
    """Qwen-Image-Edit's frozen Qwen2.5-VL (text and vision towers), its tokenizer and its ``Qwen2VLProcessor``."""

    processor: Any = None


class QwenImageEdit(qi.QwenImage):
    """Qwen-Image-Edit: Qwen-Image whose VLM prompt embeddings see the source image (and so do the negative
    prompt's) and whose sequence holds the source's packed latents; 50 steps, true CFG 4.0 with negative " "."""

    name = "qwen-image-edit"
    pipeline_classes = (PIPELINE_CLASS,)
    transformer_classes = ()  # Qwen-Image's class: ``family_of`` finds the edit family by its tag, never by class
    text_components = TEXT_COMPONENTS
    embedding_keys = ("prompt_embeds", "prompt_embeds_mask", SOURCE_KEY)
    condition_keys = (SOURCE_KEY,)
    edit = True
    negative_sees_source = True  # the pipeline encodes the negative prompt with the source: one row per example
    recipes = {"grpo": "scripts/recipes/flow_grpo_qwen_image_edit.yaml"}

    def check_folder(self, path, components=None):
        """``path`` as a Path if it holds the Qwen-Image-Edit ``components`` (default: all); else FileNotFoundError."""
        wanted = tuple(_COMPONENT_FILES) if components is None else components
        return check_components(path, _COMPONENT_FILES, wanted, "Qwen-Image-Edit", _BUILD_HINT)

    def load_text_encoders(self, path, dtype=torch.float32, device="cpu"):
        """The frozen Qwen2.5-VL, its tokenizer and its processor (``EditTextEncoders``)."""
        from transformers import Qwen2VLProcessor  # heavy

        base = super().load_text_encoders(path, dtype, device)
        processor = Qwen2VLProcessor.from_pretrained(self.check_folder(path, ("processor",)) / "processor",
                                                     local_files_only=True)
        return EditTextEncoders(tokenizer=base.tokenizer, text_encoder=base.text_encoder, processor=processor)

    def text_tokens(self, max_sequence_length, condition=None):
        """The stored text rows: the vision tokens of the source the VLM sees (a ``condition`` = (height, width)
        source, default 1024², the pipeline's area, at Qwen-Image-Edit's processor settings; several: each's) +
        ``max_sequence_length``."""
        h, w, *count = condition or (self.defaults.height, self.defaults.width)
        return (count[0] if count else 1) * vision_tokens(*self.vlm_size(h, w)) + int(max_sequence_length)

    def vlm_size(self, height: int, width: int) -> tuple[int, int]:
        """The (height, width) the VLM sees a ``height`` x ``width`` source at: its own (QwenImageEditPipeline hands
        the processor the source it encodes)."""
        return int(height), int(width)

    def instruction_text(self, prompt: str, sources: int = 1) -> str:
        """The chat text of one instruction: the edit template, the source's image pad in it."""
        return EDIT_TEMPLATE.format(prompt)

    def default_condition_size(self, height, width):
        """The pipeline's source size: a 1024² area at the source's aspect ratio (taken as the edit's), sides rounded
        to multiples of 32 (``calculate_dimensions``)."""
        return calculate_dimensions(SOURCE_AREA, width / height)

    @torch.no_grad()
    def encode_edits(self, encoders, vae, images, prompts, max_sequence_length):
        """``QwenImageEditPipeline.encode_prompt`` with each source (the processor sees the uint8 pixels the pipeline
        hands it, at ``vlm_size``; the 64 template tokens and the padding cut), rows padded with zeros to the source's
        vision tokens + ``max_sequence_length`` (longer rows cut there and flagged), beside the source's packed
        latents. ``images``: (B, 3, H, W), or (B, K, 3, H, W) for K sources per edit (``multi_source``: their vision
        tokens in order in the text, their latents one after another)."""
        from PIL import Image  # heavy

        from fastvideo import edits

        if isinstance(prompts, str):
            prompts = [prompts]
        if not prompts or len(prompts) != images.shape[0] or not all(isinstance(p, str) for p in prompts):
            raise ValueError(f"encode_edits needs one instruction string per source image, got {len(prompts)} for "
                             f"{images.shape[0]} images")
        if not 1 <= max_sequence_length <= qi.MAX_TEXT_TOKENS:
            raise ValueError(f"max_sequence_length must be in [1, {qi.MAX_TEXT_TOKENS}] (the pipeline's limit), got "
                             f"{max_sequence_length}")
        every = images.unsqueeze(1) if images.dim() == 4 else images  # (B, K, 3, H, W)
        count = every.shape[1]
        if count > 1 and not self.multi_source:
            raise ValueError(f"the {self.name} family takes one source per edit, got {count}")
        pictures = [Image.fromarray(a) for a in edits.to_uint8(every.flatten(0, 1).float().cpu())]  # example-major
        h, w = self.vlm_size(images.shape[-2], images.shape[-1])
        if (h, w) != tuple(images.shape[-2:]):  # VaeImageProcessor.resize of a PIL image: Lanczos
            pictures = [p.resize((w, h), resample=Image.LANCZOS) for p in pictures]
        inputs = encoders.processor(text=[self.instruction_text(p, count) for p in prompts], images=pictures,
                                    padding=True, return_tensors="pt")
        device = encoders.device
        hidden = encoders.text_encoder(input_ids=inputs["input_ids"].to(device),
                                       attention_mask=inputs["attention_mask"].to(device),
                                       pixel_values=inputs["pixel_values"].to(device),
                                       image_grid_thw=inputs["image_grid_thw"].to(device),
                                       output_hidden_states=True).hidden_states[-1]
        merge = int(encoders.processor.image_processor.merge_size)
        width = count * int(inputs["image_grid_thw"][0].prod()) // merge ** 2 + int(max_sequence_length)
        embeds = hidden.new_zeros(len(prompts), width, hidden.shape[-1])
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        truncated = []
        for row, keep in enumerate(inputs["attention_mask"].bool()):
            kept = hidden[row][keep.to(device)][EDIT_TEMPLATE_DROP:]
            truncated.append(kept.shape[0] > width)
            kept = kept[:width]
            embeds[row, :kept.shape[0]] = kept
            mask[row, :kept.shape[0]] = 1
        source = self.latent_geometry(vae, images.shape[-2], images.shape[-1])
        # posterior mode, normalised per channel (_encode_vae_image); several sources: packed one after another
        latents = torch.cat([self.encode(vae, every[:, k], source) for k in range(count)], dim=1)
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask.to(device), SOURCE_KEY: latents}, truncated

    def conditioning(self, geometry, cond, guidance, device):
        """The packed grid of each source (python ints): the pipeline's ``img_shapes`` entries after the target's."""
        source = condition_geometry_of(geometry, self)
        return {**super().conditioning(geometry, cond, guidance, device),
                "source_shapes": [(1, source.latent_h // 2, source.latent_w // 2)] * geometry.condition_count}

    def predict_velocity(self, transformer, latents, sigma, cond, shared):
        """One call on the target tokens followed by the sources'; the target rows of its output."""
        both = torch.cat([latents, cond[SOURCE_KEY].to(latents.dtype)], dim=1)
        out = self.transformer_call(transformer, both, sigma, cond, [shared["img_shape"], *shared["source_shapes"]])
        return out[:, :latents.shape[1]]

    def pipeline_class(self) -> type:
        """``QwenImageEditPipeline`` (its QwenImageLoraLoaderMixin writes and reads LoRA exports)."""
        from diffusers import QwenImageEditPipeline  # heavy

        return QwenImageEditPipeline


class QwenImageEditPlus(QwenImageEdit):
    """Qwen-Image-Edit-2509/2511 (``QwenImageEditPlusPipeline``): the template names each picture, the VLM sees
    each source at a 384² area, an edit may have several sources; the sequence, CFG and losses are
    Qwen-Image-Edit's."""

    name = "qwen-image-edit-plus"
    pipeline_classes = (PLUS_PIPELINE_CLASS,)
    multi_source = True  # "Picture 1: ... Picture 2: ..." in the text, every source's latents in the sequence
    recipes: dict[str, str] = {}

    def vlm_size(self, height, width):
        """The pipeline's condition image: a 384² area at the source's aspect ratio, sides multiples of 32."""
        return calculate_dimensions(PLUS_VLM_AREA, width / height)

    def instruction_text(self, prompt, sources=1):
        """``Picture 1: <image pad>`` (and ``Picture 2: ...`` for each further source) and the instruction in the
        chat template (the pipeline's ``_get_qwen_prompt_embeds``)."""
        return PLUS_TEMPLATE.format("".join(PICTURE_TEMPLATE.format(k + 1) for k in range(sources)) + prompt)

    def pipeline_class(self) -> type:
        """``QwenImageEditPlusPipeline`` (its QwenImageLoraLoaderMixin writes and reads LoRA exports)."""
        from diffusers import QwenImageEditPlusPipeline  # heavy

        return QwenImageEditPlusPipeline


# ------------------------------------------------------------------------------------------------- presets
def _edit_index(folder: Path, pipeline: str = PIPELINE_CLASS) -> None:
    """Turn a Qwen-Image folder's model_index.json into an edit pipeline's (the same components + processor)."""
    index_file = folder / "model_index.json"
    index = json.loads(index_file.read_text())
    index.update({"_class_name": pipeline, "processor": ["transformers", "Qwen2VLProcessor"]})
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _write_processor(folder: Path, settings: dict[str, Any]) -> None:
    """``folder/processor``: a ``Qwen2VLProcessor`` over the folder's tokenizer with the image processor ``settings``."""
    from transformers import Qwen2Tokenizer, Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor  # heavy

    image = Qwen2VLImageProcessor(**{k: settings[k] for k in ("patch_size", "merge_size", "temporal_patch_size",
                                                              "min_pixels", "max_pixels")})
    tokenizer = Qwen2Tokenizer.from_pretrained(folder / "tokenizer", local_files_only=True)
    Qwen2VLProcessor(image_processor=image, tokenizer=tokenizer,
                     video_processor=Qwen2VLVideoProcessor()).save_pretrained(folder / "processor")


def _templates(pipeline: str) -> tuple[str, ...]:
    """The chat templates the tiny tokenizer learns for ``pipeline`` (its system turn then splits into the 64 tokens
    the pipeline drops, as with Qwen2.5's vocabulary)."""
    if pipeline == PLUS_PIPELINE_CLASS:
        return qi.PROMPT_TEMPLATE, EDIT_TEMPLATE, PLUS_TEMPLATE.format(PICTURE_TEMPLATE.format(1) + "{}")
    return qi.PROMPT_TEMPLATE, EDIT_TEMPLATE


def _retokenize(folder: Path, pipeline: str) -> None:
    """Replace the folder's stand-in tokenizer by one that also learned ``pipeline``'s edit template."""
    import shutil

    shutil.rmtree(folder / "tokenizer")
    qi.save_tiny_tokenizer(folder / "tokenizer", _templates(pipeline))


def build_tiny(out_dir: str | os.PathLike, seed: int = 0, pipeline: str = PIPELINE_CLASS) -> Path:
    """A seeded tiny Qwen-Image-Edit folder that the stock ``pipeline`` (``QwenImageEditPipeline`` or the Plus one)
    loads: the tiny Qwen-Image models (64 px targets), a tokenizer that learned the edit template, and a processor
    making <= 16 vision tokens per source; same seed => byte-identical files."""
    from fastvideo import tiny

    preset = "qwen-image-edit-plus-tiny" if pipeline == PLUS_PIPELINE_CLASS else "qwen-image-edit-tiny"

    def write(tmp: Path) -> None:
        qi.save_tiny_tokenizer(tmp / "tokenizer", _templates(pipeline))
        vocab_size = len(json.loads((tmp / "tokenizer" / "tokenizer.json").read_text())["model"]["vocab"])
        with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG untouched
            parts = qi._tiny_components(seed, vocab_size)
        for name, module in parts.items():
            module.save_pretrained(tmp / name)
        (tmp / "model_index.json").write_text(json.dumps(qi._model_index(), indent=2, sort_keys=True) + "\n")
        _edit_index(tmp, pipeline)
        _write_processor(tmp, TINY_PROCESSOR_CONFIG)
        info = {"preset": preset, "seed": seed, "height": qi.TINY_HEIGHT, "width": qi.TINY_WIDTH,
                "vae_scale_factor": 2 ** len(qi.TINY_VAE_CONFIG["temperal_downsample"])}
        (tmp / tiny.INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")

    return tiny.write_atomically(out_dir, write)


def build_tiny_plus(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """The tiny folder under ``QwenImageEditPlusPipeline`` (``build_tiny``'s models, the Plus template learned)."""
    return build_tiny(out_dir, seed, PLUS_PIPELINE_CLASS)


def write_config(out_dir: str | os.PathLike, seed: int = 0, pipeline: str = PIPELINE_CLASS) -> Path:
    """Qwen-Image-Edit's (or, ``pipeline`` the Plus one, Qwen-Image-Edit-2509's) diffusers layout with its real
    configs and no weights (its transformer, VAE and text encoder are Qwen-Image's architecture; a stand-in
    tokenizer; the real processor settings); ``seed`` is ignored."""
    from fastvideo import tiny

    plus = pipeline == PLUS_PIPELINE_CLASS

    def write(tmp: Path) -> None:
        qi._write_config_folder(tmp)
        _retokenize(tmp, pipeline)
        _edit_index(tmp, pipeline)
        _write_processor(tmp, PROCESSOR_CONFIG)
        info_file = tmp / tiny.INFO_FILE
        info = json.loads(info_file.read_text())
        info.update({"preset": "qwen-image-edit-plus-config" if plus else "qwen-image-edit-config",
                     "source": f"Qwen/Qwen-Image-Edit{'-2509' if plus else ''} (configs only)"})
        info_file.write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")

    return tiny.write_atomically(out_dir, write)


def write_config_plus(out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Qwen-Image-Edit-2509's configs under ``QwenImageEditPlusPipeline`` (``write_config``)."""
    return write_config(out_dir, seed, PLUS_PIPELINE_CLASS)
