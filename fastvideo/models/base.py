"""The interface every model family implements (``ModelFamily``), and the family-independent helpers its adapters
share (model unwrapping, configs through wrappers, folder digests).

A family adapter is what the trainers, the rollout, evaluation, ``sample.py``, preprocessing and the planner need
from a model and nothing else: loading its components (meta build for sharded loading, or a plain load), encoding
prompts into the embeddings stored on disk, the latent geometry and the position inputs, one velocity call, VAE
decoding/encoding, the sampler defaults, the LoRA targets, the export classes and the device adaptations. The
SDE/log-prob maths, the losses, sharding and checkpointing never see a family: they work on packed latents
``(B, L, C)`` and on whatever ``predict_velocity`` returns.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, Mapping

import torch


@dataclass(frozen=True)
class SamplerDefaults:
    """A family's stock sampling settings (its diffusers pipeline's defaults): steps, the distilled guidance value
    fed to the model (None: the model takes none), the image size, the text length, and the static sigma shift
    (None: the family's resolution-dependent dynamic shift)."""

    steps: int
    guidance: float | None
    height: int
    width: int
    max_sequence_length: int
    shift: float | None = None
    cfg_scale: float = 1.0  # true classifier-free guidance of the stock pipeline (1 = none: FLUX.1's distilled guidance)
    negative_prompt: str = ""  # the negative prompt --cfg_scale > 1 guides away from (stock pipelines: "")
    num_frames: int = 1  # frames per sample (a video family's pipeline default; 1: images)
    fps: int | None = None  # a video family's frame rate (its MP4s; None: images)

    def fill(self, args: Any, flags: Mapping[str, str], unused_guidance: float) -> list[str]:
        """Set each of ``flags`` (flag name -> field name here) that ``args`` leaves unset (None) to this default;
        a family without a guidance input fills ``guidance`` with ``unused_guidance`` (a value its model never reads).
        Returns "--flag value" for each value filled from the family (not the unused guidance): what the start-up
        line says. The one place sample.py's and the trainers' sampler defaults come from."""
        filled = []
        for flag, field in flags.items():
            if getattr(args, flag, None) is not None:
                continue
            value = getattr(self, field)
            if field == "guidance" and value is None:
                setattr(args, flag, unused_guidance)
                continue
            setattr(args, flag, value)
            filled.append(f"--{flag} {value:g}" if isinstance(value, float) else f"--{flag} {value!r}"
                          if isinstance(value, str) else f"--{flag} {value}")
        return filled


def read_scheduler_config(model_path: str | os.PathLike | None) -> dict[str, Any] | None:
    """A model folder's ``scheduler/scheduler_config.json`` (the sigma grid's shift and its dynamic-shift constants),
    or None where the folder has none (the family's stock config then applies)."""
    if model_path is None:
        return None
    path = Path(model_path) / "scheduler" / "scheduler_config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def scheduler_settings(scheduler: Mapping[str, Any] | None, stock: Mapping[str, Any], family: str,
                       required: Mapping[str, Any]) -> dict[str, Any]:
    """The sigma-grid settings of a model folder's scheduler config: the family's ``stock`` values overridden by the
    folder's. A setting the family's grid does not implement (``required`` key -> the only value it supports, e.g.
    ``use_dynamic_shifting``; Karras / exponential / beta sigmas; inverted sigmas) is a ValueError naming the key and
    the way out (--shift N: a static grid), not a silently different grid."""
    merged = {**stock, **(scheduler or {})}
    unsupported = {"use_karras_sigmas": False, "use_exponential_sigmas": False, "use_beta_sigmas": False,
                   "invert_sigmas": False, **required}
    for key, value in unsupported.items():
        if merged.get(key, value) != value:
            raise ValueError(f"the model folder's scheduler/scheduler_config.json sets {key}={merged[key]!r}, which "
                             f"{family}'s sigma grid does not implement (it needs {key}={value!r}); sample on a static "
                             "grid with --shift N, or use a folder with the stock scheduler config")
    return merged

class ModelFamily:
    """One model family's adapter (FLUX.1 is ``fastvideo.models.flux.Flux1``). Subclass it, set the class
    attributes, implement every method that raises ``NotImplementedError`` here, and pass
    ``--model_family package.module:Class`` (docs/model-families.md walks through one).

    Shapes the rest of the code relies on: latents are packed tokens ``(B, L, C)`` with ``L, C =
    latent_geometry(...).packed_shape``; the stored text embeddings are a dict of tensors named by
    ``embedding_keys``, each ``(N, ...)`` per prompt; ``predict_velocity`` returns float32 ``(B, L, C)``.
    """

    name: ClassVar[str] = ""  # the --model_family name
    pipeline_classes: ClassVar[tuple[str, ...]] = ()  # model_index.json ``_class_name`` values this family serves
    transformer_classes: ClassVar[tuple[str, ...]] = ()  # diffusers transformer class names (family_of fallback)
    text_components: ClassVar[tuple[str, ...]] = ()  # the folders preprocessing loads (tokenizers, text encoders)
    embedding_keys: ClassVar[tuple[str, ...]] = ()  # the per-prompt tensors preprocessing stores, in file order
    defaults: ClassVar[SamplerDefaults]
    lora_target_modules: ClassVar[tuple[str, ...]] = ()  # default --lora_target_modules
    block_lists: ClassVar[tuple[str, ...]] = ("transformer_blocks",)  # the transformer's repeated-block ModuleLists
    sequence_parallel: ClassVar[bool] = False  # whether --sp_size > 1 (Ulysses) is implemented for this family
    video: ClassVar[bool] = False  # samples are videos: latent_geometry takes frames, decode returns (B, F, 3, H, W)
    # Image editing (docs/editing.md): the model is conditioned on a source image. Its ``embedding_keys`` then include
    # ``condition_keys``, the per-example tensors made from the source (e.g. its packed latents), which
    # ``encode_edits`` writes beside the prompt embeddings; both CFG branches see the same condition rows, and the
    # geometry carries the source's (``edit_geometry``), so the rollout, replay and losses see the target tokens only.
    edit: ClassVar[bool] = False
    condition_keys: ClassVar[tuple[str, ...]] = ()
    # Whether the pipeline encodes the negative prompt with the source (Qwen-Image-Edit's VLM sees it): the store then
    # keeps a negative row per example in the shards instead of one ``negative.safetensors`` row.
    negative_sees_source: ClassVar[bool] = False
    # Whether one edit may have several sources (an edit file's "images": [...]; ``encode_edits`` then gets
    # (B, K, 3, H, W) and the geometry's ``condition_count`` is K).
    multi_source: ClassVar[bool] = False

    recipes: ClassVar[dict[str, str]] = {}  # trainer (grpo, dpo, nft) -> the launchers' default recipe for it

    def sampler_defaults(self, path: str | os.PathLike) -> SamplerDefaults:
        """The stock pipeline defaults of the model folder ``path`` (a family whose variants differ, e.g. FLUX.2 dev
        vs klein, reads the folder); default: ``defaults``."""
        return self.defaults

    def __repr__(self) -> str:
        return f"{type(self).__module__}:{type(self).__qualname__}"

    def _missing(self, what: str) -> NotImplementedError:
        return NotImplementedError(f"model family {self!r} does not implement {what}: add it to the adapter "
                                   "(docs/model-families.md lists what each method must do)")

    # -------------------------------------------------------------------------------------------- loading
    def check_folder(self, path: str | os.PathLike, components: tuple[str, ...] | None = None) -> Path:
        """``path`` as a Path if it holds ``components`` (default: all); else FileNotFoundError naming the fix."""
        raise self._missing("check_folder")

    def transformer_folder(self, path: str | os.PathLike) -> Path:
        """The transformer component folder of a model folder (or ``path`` itself if it is one)."""
        raise self._missing("transformer_folder")

    def build_transformer(self, path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        """The transformer from its config on the meta device (no weights read): the sharded-loading path."""
        raise self._missing("build_transformer")

    def load_transformer(self, path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                         device: str | torch.device = "cpu") -> torch.nn.Module:
        """The transformer with its weights, on ``device`` (sampling, small models)."""
        raise self._missing("load_transformer")

    # A "transformer" may hold several diffusers transformers (Wan2.2-A14B's two experts): each is a *part*, saved as
    # its own diffusers folder. The three hooks below say where each part's weights are, how its state-dict keys
    # start, and which module the planner traces; a one-transformer family keeps the defaults.
    def weight_folders(self, path: str | os.PathLike) -> dict[str, Path]:
        """State-dict key prefix -> the folder of that part's safetensors (default: the one transformer folder)."""
        return {"": self.transformer_folder(path)}

    def transformer_parts(self, model: Any) -> dict[str, str]:
        """Export subfolder ("" = the export folder itself) -> state-dict key prefix of each part of ``model``."""
        return {"": ""}

    def traced_transformer(self, model: Any) -> Any:
        """The module whose forward the memory planner traces for one velocity call (default: ``model``)."""
        return model

    def load_vae(self, path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> torch.nn.Module:
        """The frozen VAE (eval mode, no grad)."""
        raise self._missing("load_vae")

    def load_text_encoders(self, path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                           device: str | torch.device = "cpu") -> Any:
        """The frozen text encoders and tokenizers, in whatever object ``encode_prompts`` takes."""
        raise self._missing("load_text_encoders")

    def encode_prompts(self, encoders: Any, prompts: list[str], max_sequence_length: int
                       ) -> tuple[dict[str, torch.Tensor], list[bool]]:
        """The stock pipeline's ``encode_prompt``: ``({key: (N, ...) tensor for key in embedding_keys}, per prompt
        whether a tokenizer cut it)``."""
        raise self._missing("encode_prompts")

    def encode_edits(self, encoders: Any, vae: Any, images: torch.Tensor, prompts: list[str],
                     max_sequence_length: int) -> tuple[dict[str, torch.Tensor], list[bool]]:
        """An edit family's stored rows for source ``images`` (B, 3, H, W) in [0, 1] and their instructions: every
        key of ``embedding_keys`` (the prompt embeddings, which may see the image, and the ``condition_keys``), and
        per example whether a tokenizer cut the instruction."""
        raise self._missing("encode_edits (image editing)")

    def max_sequence_length_limit(self) -> int:
        """The longest text length the family's text encoder takes (--max_sequence_length's upper bound)."""
        raise self._missing("max_sequence_length_limit")

    def encoders_fingerprint(self, path: str | os.PathLike) -> str:
        """A digest of the text encoders' files: stored embeddings are checked against it."""
        return folder_digest(self.check_folder(path, self.text_components), self.text_components)

    def vae_fingerprint(self, path: str | os.PathLike) -> str:
        """A digest of the VAE's files: cached latents are checked against it."""
        return folder_digest(self.check_folder(path, ("vae",)), ("vae",))

    def collate(self, cond: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A stacked batch of stored embeddings (CPU, ``(B, ...)`` per key) as the transformer takes it: e.g. cut the
        padding columns that no row's attention mask keeps. Runs on the CPU before the batch goes to the device;
        default: unchanged."""
        return cond

    def text_tokens(self, max_sequence_length: int, condition: tuple[int, int] | None = None) -> int:
        """Text tokens per prompt the transformer attends over for a store of ``max_sequence_length`` (the planner's
        and FLOP meter's T; an edit family's may grow with the (height, width) of its ``condition`` source, None: the
        family's default size); default: ``max_sequence_length``."""
        return int(max_sequence_length)

    # ------------------------------------------------------------------------------------------- latents
    def latent_geometry(self, vae_or_config: Any, height: int, width: int) -> Any:
        """The latent layout for ``height`` x ``width`` images (``.height .width .seq_len .packed_channels
        .packed_shape``); ValueError naming valid sizes."""
        raise self._missing("latent_geometry")

    def default_condition_size(self, height: int, width: int) -> tuple[int, int]:
        """The (height, width) an edit family's pipeline gives a source when no edit store says (the planner's
        assumption for ``height`` x ``width`` edits); default: the target's."""
        return int(height), int(width)

    def edit_geometry(self, geometry: Any, vae_or_config: Any, height: int, width: int, count: int = 1) -> Any:
        """``geometry`` (the target's) with the source image's latent geometry for ``height`` x ``width`` sources
        attached (``.condition``, ``count`` of them per edit; ``.condition_tokens`` counts their packed tokens);
        ValueError naming valid sizes."""
        from fastvideo.models.common import EditGeometry  # the geometry module imports this one

        try:
            source = self.latent_geometry(vae_or_config, height, width)
        except ValueError as err:
            raise ValueError(f"source images of {height} x {width} (the edit store's size; preprocess_embeddings.py "
                             f"--edit_size resizes them): {err}") from None
        return EditGeometry(**{f.name: getattr(geometry, f.name) for f in fields(geometry)}, condition=source,
                            condition_count=int(count))

    def conditioning(self, geometry: Any, cond: Mapping[str, torch.Tensor], guidance: float | None,
                     device: torch.device) -> dict[str, Any]:
        """What every velocity call of a rollout shares (position ids, the guidance value), on ``device``, made once
        without a blocking copy; ``cond`` holds the batch's embeddings (for their length and dtype)."""
        raise self._missing("conditioning")

    def combine_guidance(self, v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float) -> torch.Tensor:
        """True classifier-free guidance of the stock pipeline from the conditional and unconditional velocities
        (B, L, C) float32: ``v_u + s (v_c - v_u)``; a family whose pipeline rescales (Qwen-Image) overrides it."""
        return v_uncond + scale * (v_cond - v_uncond)

    def predict_velocity(self, transformer: Any, latents: torch.Tensor, sigma: float | torch.Tensor,
                         cond: Mapping[str, torch.Tensor], shared: Mapping[str, Any]) -> torch.Tensor:
        """Velocity (B, L, C) float32 at noise level ``sigma`` (0-d or (B,)) for packed ``latents``; ``cond``: the
        rows' embeddings (``embedding_keys``) on the model's device; ``shared``: ``conditioning``'s result."""
        raise self._missing("predict_velocity")

    def sigmas(self, steps: int, image_seq_len: int, scheduler: Mapping[str, Any] | None = None) -> torch.Tensor:
        """The stock pipeline's (S+1,) float32 sigma grid, 1 down to a final 0, for ``steps`` steps at
        ``image_seq_len`` packed tokens (the default when --shift is unset; --shift gives DanceGRPO's static grid).
        ``scheduler``: the model folder's ``scheduler/scheduler_config.json`` (``read_scheduler_config``); None: the
        family's stock config. A config the family cannot reproduce is a ValueError naming the key."""
        raise self._missing("sigmas")

    def decode(self, vae: Any, latents: torch.Tensor, geometry: Any, micro_batch: int | None = None
               ) -> torch.Tensor:
        """Packed latents (B, L, C) -> images (B, 3, H, W) float32 in [0, 1], as the stock pipeline decodes."""
        raise self._missing("decode")

    def encode(self, vae: Any, images: torch.Tensor, geometry: Any, micro_batch: int | None = None
               ) -> torch.Tensor:
        """Images (B, 3, H, W) in [0, 1] -> packed latents (B, L, C) float32 (posterior mode): ``decode``'s inverse."""
        raise self._missing("encode")

    # ------------------------------------------------------------------------------- FLOPs and memory plan
    def transformer_flops(self, config: Any, image_tokens: int, text_tokens: int, batch: int = 1, *,
                          backward: bool = False, weight_grads: bool = True) -> int:
        """FLOPs of one transformer forward (``backward``: + its backward; ``weight_grads=False``: LoRA, input
        gradients only) as ``torch.utils.flop_counter`` counts them (2 per multiply-add)."""
        raise self._missing("transformer_flops")

    def forward_tokens(self, args: tuple, kwargs: Mapping[str, Any]) -> tuple[int, int, int] | None:
        """``(batch, image tokens, text tokens)`` of one transformer call's arguments (the FLOP meter's hook), None
        when they are not there."""
        raise self._missing("forward_tokens")

    def example_inputs(self, config: Any, batch: int, image_tokens: int, text_tokens: int, dtype: torch.dtype,
                       device: torch.device | str) -> dict[str, Any]:
        """Keyword arguments of one transformer forward on empty tensors (the planner traces it on meta)."""
        raise self._missing("example_inputs")

    # ------------------------------------------------------------------------------------- device, export
    def prepare_for_device(self, transformer: Any, device: torch.device | str, *, param_dtype: torch.dtype | None
                           = None, attention_backend: str = "auto") -> list[str]:
        """Adapt a loaded or sharded transformer to ``device`` (e.g. float32 rotary angles on an NPU, the
        --attention_backend); returns what changed, for the start-up log."""
        raise self._missing("prepare_for_device")

    def pipeline_class(self) -> type:
        """The diffusers pipeline class whose ``save_lora_weights`` / ``lora_state_dict`` /
        ``load_lora_into_transformer`` write and read this family's LoRA exports."""
        raise self._missing("pipeline_class")

    def vae_class(self) -> type:
        """The diffusers VAE class of the family's ``vae/`` folder (the planner builds it on meta from its config)."""
        from diffusers import AutoencoderKL  # heavy

        return AutoencoderKL

    def transformer_class(self) -> type:
        """The diffusers transformer class a full fine-tune's export is a folder of."""
        raise self._missing("transformer_class")


# ------------------------------------------------------------------------------------ shared helpers
def condition_geometry_of(geometry: Any, family: ModelFamily) -> Any:
    """The source image's latent geometry that ``family.edit_geometry`` attached to ``geometry``; ValueError naming
    the fix when the geometry has none (an edit family built it from --h/--w alone)."""
    source = getattr(geometry, "condition", None)
    if source is None:
        raise ValueError(f"the {family.name} family edits a source image, but this latent geometry has none: build it "
                         "with fastvideo.models.geometry_for(..., condition=(height, width)) from the edit store "
                         "(EmbeddingDataset.condition_size)")
    return source


FAMILY_ATTRIBUTE = "_fastvideo_family"  # set by ``tag`` on the unwrapped transformer


def tag(transformer: Any, family: ModelFamily) -> Any:
    """Record ``family`` on the (unwrapped) transformer, so ``models.family_of`` finds it through FSDP/peft/compile;
    returns ``transformer``. Adapters call it on every transformer they build or load."""
    setattr(unwrap_model(transformer), FAMILY_ATTRIBUTE, family)
    return transformer


def check_components(path: str | os.PathLike, component_files: Mapping[str, tuple[str, ...]],
                     components: tuple[str, ...] | list[str], what: str, hint: str) -> Path:
    """``path`` as a Path if every component folder in ``components`` holds one of its ``component_files``; else
    FileNotFoundError naming what is missing and ``hint`` (how to get the folder). ``what``: e.g. "FLUX"."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"{what} model folder {str(folder)!r} does not exist: {hint}")
    missing = []
    for name in components:
        if name not in component_files:
            raise ValueError(f"unknown {what} component {name!r}: choose from {list(component_files)}")
        if not any((folder / name / f).is_file() for f in component_files[name]):
            missing.append(f"{name}/ ({' or '.join(component_files[name])})")
    if missing:
        raise FileNotFoundError(f"{what} model folder {str(folder)!r} is missing {', '.join(missing)}: {hint}")
    return folder


def component_folder(path: str | os.PathLike, name: str, check: Any) -> Path:
    """``path/name`` if ``path`` is a pipeline folder (checked with ``check(path, (name,))``), ``path`` itself if it
    already is the component folder (holds a config.json and no ``name/``)."""
    folder = Path(path).expanduser()
    if (folder / "config.json").is_file() and not (folder / name).is_dir():
        return folder
    return check(folder, (name,)) / name


def build_on_meta(cls: type, folder: str | os.PathLike, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A diffusers model class built from ``folder``'s config.json on the meta device, parameters in ``dtype``:
    shapes only, no memory, no weights read (the sharded-loading path: shard it, then load each rank's shards)."""
    config = cls.load_config(folder, local_files_only=True)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are created in ``dtype`` (no cast afterwards)
    try:
        with torch.device("meta"):
            return cls.from_config(config)
    finally:
        torch.set_default_dtype(default)


def unwrap_model(model: Any) -> Any:
    """The innermost model under DDP/FSDP1 (``.module``), torch.compile (``._orig_mod``) or peft wrappers.

    FSDP2's ``fully_shard`` and diffusers' ``add_adapter`` keep the module class, so those need no unwrapping.
    """
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif type(model).__name__.startswith("Peft") and hasattr(model, "get_base_model"):
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), torch.nn.Module):  # DDP, FSDP1
            model = model.module
        else:
            break
    return model


def model_config(model: Any) -> Any:
    """A model's diffusers/transformers config, read through wrappers (FSDP1/DDP, torch.compile, peft)."""
    config = getattr(unwrap_model(model), "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no .config: pass a diffusers/transformers model")
    return config


def config_get(config: Any, key: str, default: Any = None) -> Any:
    """``config[key]`` for a dict, ``config.key`` for a config object; ``default`` when absent."""
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def model_dtype(model: Any) -> torch.dtype:
    """The dtype of the model's first floating-point parameter (float32 if it has none)."""
    for p in unwrap_model(model).parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _weight_digest(file: Path) -> bytes:
    """A cheap digest of a (possibly multi-GB) weight file: name, size, safetensors header, first and last MiB."""
    h = hashlib.sha256()
    size = file.stat().st_size
    h.update(f"{file.name}:{size}".encode())
    chunk = 1 << 20
    with open(file, "rb") as f:
        h.update(f.read(chunk))
        if size > chunk:
            f.seek(max(chunk, size - chunk))
            h.update(f.read(chunk))
    return h.digest()


def folder_digest(folder: Path, names: tuple[str, ...]) -> str:
    """sha256 over the files of ``folder/name`` for each name: relative paths, other files in full, weights sampled."""
    h = hashlib.sha256()
    for name in names:
        for file in sorted((folder / name).rglob("*")):
            if not file.is_file() or file.name.startswith("."):
                continue
            h.update(str(file.relative_to(folder)).encode() + b"\0")
            if file.suffix in (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5"):
                h.update(_weight_digest(file))
            else:
                h.update(file.read_bytes())
    return h.hexdigest()
