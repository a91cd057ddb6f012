"""Model families: one adapter per family behind ``ModelFamily`` (``base.py``), the only way the trainers, the
rollout, evaluation, ``sample.py``, preprocessing and the planner touch a model.

``--model_family`` picks the adapter:

- ``auto`` (default): from the model folder's ``model_index.json`` ``_class_name`` (``FluxPipeline`` -> ``flux1``);
- a registered name (``names()``);
- ``package.module:Class``: a user's own ``ModelFamily`` subclass, imported from anywhere on ``sys.path`` (the
  extension point: a new family is one adapter file, never a trainer copy; docs/model-families.md).

A loaded transformer carries its adapter (``tag``), so code holding only the model finds it with ``family_of``.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastvideo.models.base import (FAMILY_ATTRIBUTE, ModelFamily, SamplerDefaults, read_scheduler_config, tag,
                                   unwrap_model)
from fastvideo.options import opt
from fastvideo.plugins import load_object

__all__ = ["ModelFamily", "SamplerDefaults", "read_scheduler_config", "FAMILIES", "names", "resolve", "family_for",
           "family_of", "tag", "spec_of", "geometry_for"]

# name -> "module:Class" of the adapters this package ships (imported on first use)
FAMILIES: dict[str, str] = {
    "flux1": "fastvideo.models.flux:Flux1",
    "sd3": "fastvideo.models.sd3:SD3",
    "qwen-image": "fastvideo.models.qwen_image:QwenImage",
    "flux2": "fastvideo.models.flux2:Flux2",
    "wan": "fastvideo.models.wan:Wan",
    "flux-kontext": "fastvideo.models.flux_kontext:FluxKontext",
    "qwen-image-edit": "fastvideo.models.qwen_image_edit:QwenImageEdit",
    "qwen-image-edit-plus": "fastvideo.models.qwen_image_edit:QwenImageEditPlus",
}
_HELP = "docs/model-families.md"
_cache: dict[str, ModelFamily] = {}


def names() -> list[str]:
    """The registered family names, for ``--model_family`` (besides ``auto`` and ``package.module:Class``)."""
    return list(FAMILIES)


def _load(target: str, flag: str) -> ModelFamily:
    """The ``ModelFamily`` instance of ``package.module:Class`` (one per target); ValueError naming what is wrong."""
    if target in _cache:
        return _cache[target]
    module_name, _, class_name = target.partition(":")
    if not module_name or not class_name:
        raise ValueError(f"{flag} {target!r} is neither 'auto', a family ({', '.join(names())}) nor "
                         f"'package.module:Class'; see {_HELP}")
    try:
        cls = load_object(target, flag, "Class", _HELP)
    except ValueError as err:
        if "defines no" not in str(err):
            raise
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, ModelFamily)):
        raise ValueError(f"{flag} {target!r}: {module_name} has no ModelFamily subclass {class_name!r}; an adapter "
                         f"subclasses fastvideo.models.ModelFamily (see {_HELP})")
    _cache[target] = family = cls()
    return family


def pipeline_class_name(model_path: str | os.PathLike) -> str | None:
    """``_class_name`` of the folder's ``model_index.json`` (None when the folder has none, e.g. a bare transformer
    folder)."""
    index = Path(model_path).expanduser() / "model_index.json"
    if not index.is_file():
        return None
    try:
        return json.loads(index.read_text()).get("_class_name")
    except (json.JSONDecodeError, AttributeError) as err:
        raise ValueError(f"{index} is not a diffusers model_index.json ({err}); re-download the model folder") from err


def resolve(spec: str = "auto", model_path: str | os.PathLike | None = None,
            flag: str = "--model_family") -> ModelFamily:
    """The adapter for ``spec`` (``auto``, a name, or ``package.module:Class``). ``auto`` reads ``model_path``'s
    model_index.json; a folder without one is FLUX.1 (the only layout this project wrote before families existed)."""
    if spec in FAMILIES:
        return _load(FAMILIES[spec], flag)
    if spec != "auto":
        return _load(spec, flag)
    pipeline = pipeline_class_name(model_path) if model_path is not None else None
    if pipeline is None:
        return _load(FAMILIES["flux1"], flag)
    loaded = {name: _load(target, flag) for name, target in FAMILIES.items()}
    for family in loaded.values():
        if pipeline in family.pipeline_classes:
            return family
    served = {name: list(family.pipeline_classes) for name, family in loaded.items()}
    raise ValueError(f"{model_path}: model_index.json names {pipeline!r}, which no model family serves "
                     f"({served}); pass {flag} NAME to force one, or {flag} package.module:Class for your own "
                     f"adapter ({_HELP})")


def spec_of(args: Any) -> str:
    """A parsed command line's ``--model_family`` (``auto`` where the namespace has none)."""
    return getattr(args, "model_family", "auto")


def family_for(args: Any) -> ModelFamily:
    """The adapter of a parsed command line: ``--model_family`` (default auto) of
    ``--pretrained_model_name_or_path``."""
    return resolve(spec_of(args), args.pretrained_model_name_or_path)


def geometry_for(family: ModelFamily, source: Any, height: int, width: int, frames: int | None = None,
                 condition: tuple[int, ...] | None = None) -> Any:
    """The latent geometry of ``height`` x ``width`` samples (a video family: of ``frames`` frames, None = its
    pipeline's default); ``frames`` other than None or 1 for an image family is a ValueError naming the flag. An edit
    family's geometry also holds its source images' (``condition``: their (height, width), or (height, width, count)
    for several per edit, the edit store's ``condition_size``; None: ``family.default_condition_size``, the planner's
    assumption)."""
    if family.video:
        geometry = family.latent_geometry(source, height, width, frames)
    elif frames not in (None, 1):
        raise ValueError(f"--num_frames {frames}: the {family.name} family samples images; drop --num_frames (video "
                         "families: wan)")
    else:
        geometry = family.latent_geometry(source, height, width)
    if not family.edit:
        if condition is not None:
            raise ValueError(f"the {family.name} family takes no source image, but the data holds edits: train an "
                             "edit family (flux-kontext, qwen-image-edit) on them, or preprocess a --prompt_file")
        return geometry
    h, w, *count = family.default_condition_size(height, width) if condition is None else condition
    count = int(count[0]) if count else 1
    if count > 1 and not family.multi_source:
        raise ValueError(f"the {family.name} family takes one source image per edit, but the data holds {count}: "
                         "preprocess an edit file with one \"image\" per line, or train a family that takes several "
                         "(qwen-image-edit-plus)")
    return family.edit_geometry(geometry, source, h, w, count)


def family_of(transformer: Any) -> ModelFamily:
    """The adapter a transformer was built or loaded with (``tag``), else the registered family whose
    ``transformer_classes`` names its class (a model built directly with diffusers)."""
    model = unwrap_model(transformer)
    family = getattr(model, FAMILY_ATTRIBUTE, None)
    if family is not None:
        return family
    classes = {c.__name__ for c in type(model).__mro__}
    for target in FAMILIES.values():
        family = _load(target, "--model_family")
        if classes & set(family.transformer_classes):
            return family
    raise ValueError(f"{type(model).__name__} belongs to no registered model family: build it through a "
                     f"ModelFamily adapter (fastvideo.models.resolve(...).build_transformer) or tag it with "
                     f"fastvideo.models.tag(model, family) ({_HELP})")


@dataclass
class ModelOptions:
    pretrained_model_name_or_path: str | None = opt(
        None, "local diffusers model folder (model_index.json, transformer/, vae/, ...); required")
    model_family: str = opt("auto", "model family adapter: auto (from the folder's model_index.json) | flux1 | sd3 | "
                                    "qwen-image | flux2 | wan | flux-kontext | qwen-image-edit | "
                                    "package.module:Class, your own fastvideo.models.ModelFamily (docs/model-families.md)")
    data_json_path: str | None = opt(
        None, "manifest.json (or its folder) written by preprocess_embeddings.py; required")
    output_dir: str = opt("outputs/grpo", "run folder: config.json, metrics.jsonl, samples/, checkpoints/, final/")
    device: str | None = opt(None, "cuda | npu | cpu (default: first available in that order)")
    seed: int = opt(42, "run seed; all noise derives from (seed, step, prompt id, sample index, purpose)")
    deterministic: bool = opt(False, "use deterministic kernels and full-float32 math (slower on GPU: "
                                     "deterministic algorithms, cuBLAS workspace, no TF32/HF32; "
                                     "docs/alignment.md, Determinism). Uninitialised memory is not filled (torch's "
                                     "fill_uninitialized_memory is turned off: filling would write every torch.empty, "
                                     "e.g. each FSDP all-gather buffer, and this code reads no memory before writing "
                                     "it)")
    noise_device: str = opt("cpu", "device noise is drawn on (cpu makes CUDA/NPU/CPU runs identical)")
