"""LoRA adapters on a model family's transformer (peft, as diffusers does), the reference policy, and standard exports.

Typical use (the adapter is added before ``shard_model``; every rank adds it with the same ``init_seed``):

    transformer = add_lora(transformer, rank=32, alpha=32, init_seed=seed)   # base frozen, adapter "default"
    model = shard_model(transformer, ...)
    with torch.no_grad(), disable_adapters(model):
        ref_velocity = predict_velocity(model, ...)                           # reference policy = base model
    save_lora_for_diffusers(model, out_dir)     # every rank; rank 0 writes; FluxPipeline.load_lora_weights(out_dir)
    save_transformer_for_diffusers(model, None, out_dir)  # full fine-tune: FluxTransformer2DModel.from_pretrained
"""
from __future__ import annotations

import functools
import inspect
import math
import re
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from fastvideo import distributed, models
from fastvideo.parallel import cast_floating_, clean_name, full_state_dict, named_trainable_parameters, unwrap_model
from fastvideo.seeding import generator
from fastvideo.weights import fill_local_shards, stored_dtype


def default_target_modules(model: nn.Module) -> list[str]:
    """The model family's default ``--lora_target_modules`` (``ModelFamily.lora_target_modules``; FLUX.1: the diffusers
    DreamBooth-LoRA set)."""
    return list(models.family_of(model).lora_target_modules)


EXPORT_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def export_dtype(choice: str, model_path: str | Path, model_family: str = "auto") -> torch.dtype:
    """``--export_dtype``: bf16 | fp16 | fp32, or auto = the dtype the base model's transformer safetensors store
    (bf16 for FLUX.1-dev: a 24 GB export instead of 48 GB in the fp32 master weights' dtype)."""
    if choice == "auto":
        return stored_dtype(models.resolve(model_family, model_path).transformer_folder(model_path))
    if choice not in EXPORT_DTYPES:
        raise ValueError(f"--export_dtype {choice!r} is not one of auto, {', '.join(EXPORT_DTYPES)}")
    return EXPORT_DTYPES[choice]


def check_target_modules(model: nn.Module, target_modules: list[str]) -> None:
    """ValueError (listing module names that do exist) if a ``--lora_target_modules`` entry matches no linear layer of
    ``model``; matched as peft matches a list: a module name equal to the entry or ending in ``.entry``. Works on a
    meta-device model, so it runs before any weight is read."""
    from peft.tuners.tuners_utils import BaseTunerLayer  # heavy

    modules = dict(model.named_modules())
    adapted = [name for name, module in modules.items() if isinstance(module, BaseTunerLayer)]  # a second adapter
    linear = [name for name, module in modules.items() if name in adapted or (
        isinstance(module, nn.Linear) and not any(name.startswith(f"{a}.") for a in adapted))]
    unmatched = [t for t in target_modules if not any(n == t or n.endswith(f".{t}") for n in linear)]
    if not unmatched:
        return
    in_blocks = [re.sub(r"^\w*blocks\.\d+\.", "", n) for n in linear if re.match(r"^\w*blocks\.\d+\.", n)]
    suffixes = list(dict.fromkeys(in_blocks + linear))  # block layers without "transformer_blocks.<i>." first
    raise ValueError(f"--lora_target_modules {' '.join(unmatched)} match{'es' * (len(unmatched) == 1)} no linear "
                     f"layer of {type(model).__name__}; pass names of layers that exist, e.g. "
                     f"{' '.join(suffixes[:12])}{' ...' * (len(suffixes) > 12)} (or drop the flag for the default "
                     f"{' '.join(default_target_modules(model)[:4])} ...)")


def add_lora(
    transformer: nn.Module,
    *,
    rank: int,
    alpha: float,
    target_modules: list[str] | None = None,
    init_seed: int | None = None,
    adapter_name: str = "default",
    trainable: bool = True,
) -> nn.Module:
    """Add a peft LoRA adapter (``transformer.add_adapter(LoraConfig(...))``) and freeze everything else.

    ``trainable=False`` adds a frozen adapter next to the existing ones (DiffusionNFT's ``old`` policy): the
    adapters already there keep their ``requires_grad`` and the active adapter stays the one active before (peft
    would make the new one active and trainable).

    ``target_modules`` defaults to the model family's (``default_target_modules``). With ``init_seed`` the adapter starts from
    ``initial_adapter_weights(model, init_seed)`` (peft's init, each lora_A from a generator keyed by its name); without
    it from peft's own init on the global RNG (then all ranks must share its state). lora_B is zero, so the adapted
    model starts equal to the base. Adapter weights are float32. On a meta-device model the values are left to
    ``weights.fill_local_shards`` after ``shard_model``. Call before ``shard_model``. Returns ``transformer``
    (modified in place).
    """
    from peft import LoraConfig  # heavy

    if rank < 1:
        raise ValueError(f"--lora_rank must be a positive integer, got {rank}")
    if alpha <= 0:
        raise ValueError(f"--lora_alpha must be positive, got {alpha}")
    if not hasattr(transformer, "add_adapter"):
        raise ValueError(f"{type(transformer).__name__} has no add_adapter(); add_lora expects an unwrapped diffusers "
                         "model (call it before shard_model)")
    targets = list(target_modules or default_target_modules(transformer))
    check_target_modules(transformer, targets)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=True)
    trainable_before = {n for n, p in transformer.named_parameters() if p.requires_grad}
    active_before = [(layer, layer._active_adapter) for layer in _tuner_layers(transformer)]
    try:
        with warnings.catch_warnings():  # a second adapter (NFT's "old") is what we mean
            warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
            if init_seed is None:
                transformer.add_adapter(config, adapter_name=adapter_name)
            else:
                with torch.random.fork_rng(devices=[]):  # peft's own init draws are overwritten below
                    transformer.add_adapter(config, adapter_name=adapter_name)
    except ValueError as err:
        if "Target modules" in str(err) or "not found" in str(err):
            raise ValueError(f"--lora_target_modules {targets} matched no layer of {type(transformer).__name__}: "
                             f"{err}") from err
        raise
    for name, param in transformer.named_parameters():
        is_adapter = f".{adapter_name}." in name and "lora_" in name
        other_adapter = "lora_" in name and not is_adapter
        param.requires_grad_(trainable if is_adapter else other_adapter and name in trainable_before)
        if is_adapter and param.dtype != torch.float32:
            param.data = param.data.float()
    for layer, active in active_before:  # peft activated the new adapter; keep the previous choice
        layer._active_adapter = active
    if init_seed is not None and not any(p.is_meta for p in transformer.parameters()):
        # the same values a meta-built, sharded model gets from fill_local_shards(initial_adapter_weights(...))

        fill_local_shards(transformer, initial_adapter_weights(transformer, init_seed, adapter_name))
    return transformer


def initial_adapter_weights(model: nn.Module, seed: int, adapter_name: str = "default"
                            ) -> dict[str, Callable[[], torch.Tensor]]:
    """``name -> fn() -> full tensor`` of the adapter's initial weights: peft's LoRA init (lora_A Kaiming-uniform
    with a = sqrt(5), i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in)); lora_B zero), each lora_A drawn from its own generator
    seeded by ``(seed, name)``, so the values depend neither on the sharding nor on the order of creation.

    Works on a meta-device model (shapes only): ``weights.fill_local_shards(model, initial_adapter_weights(...))``
    writes each rank's part after ``shard_model``.
    """
    makers: dict[str, Callable[[], torch.Tensor]] = {}
    marker = f".{adapter_name}."
    for raw_name, param in model.named_parameters():
        name = clean_name(raw_name)
        if marker not in name or "lora_" not in name:
            continue
        shape = tuple(param.shape)
        if ".lora_A." in name:
            bound = 1.0 / math.sqrt(shape[1])
            makers[name] = functools.partial(_uniform, shape, bound, seed, name)
        else:
            makers[name] = functools.partial(torch.zeros, shape)
    if not makers:
        raise ValueError(f"the model has no LoRA adapter named {adapter_name!r}; call add_lora first")
    return makers


def _uniform(shape: tuple[int, ...], bound: float, seed: int, name: str) -> torch.Tensor:
    return torch.empty(shape).uniform_(-bound, bound, generator=generator(seed, "lora_init", name))


def _tuner_layers(model: nn.Module) -> list[nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer  # heavy

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


@contextmanager
def disable_adapters(model: nn.Module) -> Iterator[nn.Module]:
    """Run ``model`` without its LoRA adapters (the reference policy) inside the ``with`` block.

    Only flips peft's per-layer switch; unlike ``model.disable_adapters()`` it never touches ``requires_grad``, so
    it is safe under FSDP1/FSDP2 (use it under ``torch.no_grad()`` for reference passes). Restores the previous
    state on exit, even on error.
    """
    layers = _tuner_layers(model)
    if not layers:
        raise ValueError("disable_adapters: the model has no LoRA adapters; for a full fine-tune keep a frozen copy "
                         "of the base model as the reference instead")
    previous = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield model
    finally:
        for layer, state in zip(layers, previous):
            layer._disable_adapters = state


@contextmanager
def use_adapter(model: nn.Module, adapter_name: str) -> Iterator[nn.Module]:
    """Run ``model`` with only the LoRA adapter ``adapter_name`` active inside the ``with`` block (e.g. DiffusionNFT's
    frozen ``old`` adapter, under ``torch.no_grad()``).

    Like ``disable_adapters`` it only flips peft's per-layer switch and never touches ``requires_grad`` (peft's
    ``set_adapter`` would make the adapter trainable and freeze the others), so it is safe under FSDP1/FSDP2 and
    leaves the optimizer's parameters as they are. Restores the previous adapters on exit, even on error.
    """
    layers = _tuner_layers(model)
    if not any(adapter_name in getattr(layer, "lora_A", {}) for layer in layers):
        raise ValueError(f"the model has no LoRA adapter named {adapter_name!r}; add it with add_lora(..., "
                         f"adapter_name={adapter_name!r})")
    previous = [layer._active_adapter for layer in layers]
    for layer in layers:
        layer._active_adapter = [adapter_name]
    try:
        yield model
    finally:
        for layer, state in zip(layers, previous):
            layer._active_adapter = state


def lora_config(model: nn.Module, adapter_name: str = "default") -> Any:
    """The peft ``LoraConfig`` of ``adapter_name`` on a possibly wrapped model."""
    configs = getattr(unwrap_model(model), "peft_config", None) or {}
    if adapter_name not in configs:
        raise ValueError(f"the model has no LoRA adapter named {adapter_name!r} (adapters: {sorted(configs)}); "
                         "add one with add_lora")
    return configs[adapter_name]


def lora_state_dict(model: nn.Module, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """The adapter's weights with peft's key format (``...to_q.lora_A.weight``), full CPU tensors on rank 0.

    Same keys and values as ``peft.get_peft_model_state_dict(model, adapter_name=...)`` on the unsharded model (for
    the plain LoRA that ``add_lora`` creates); sharded weights are gathered first (peft's own function cannot be
    used on an FSDP1-wrapped model: it matches module names). A collective: call it on every rank; ranks other than
    0 get ``{}``.
    """
    config = lora_config(model, adapter_name)
    if getattr(config, "use_dora", False) or getattr(config, "bias", "none") != "none":
        raise ValueError("lora_state_dict supports plain LoRA adapters (no DoRA, bias='none'), as add_lora creates")
    marker = f".{adapter_name}."
    adapter_params = [p for n, p in named_trainable_parameters(model) if "lora_" in n and marker in n]
    all_adapter_trainable = all(
        p.requires_grad for n, p in unwrap_model(model).named_parameters() if "lora_" in n and marker in n
    )
    # Gather only the trainable params when they are exactly this adapter's (the usual case: cheap under FSDP2).
    sd = full_state_dict(model, trainable_only=bool(adapter_params) and all_adapter_trainable)
    if not distributed.is_main_process():
        return {}
    return {k.replace(marker, "."): v for k, v in sd.items() if ".lora_" in k and marker in k}


def save_lora_for_diffusers(
    state_dict_or_model: dict[str, torch.Tensor] | nn.Module,
    out_dir: str | Path,
    *,
    config: Any = None,
    adapter_name: str = "default",
    dtype: torch.dtype | None = None,
    family: Any = None,
) -> Path:
    """Write a LoRA folder that the family's stock pipeline loads with ``load_lora_weights(out_dir)`` (FLUX.1:
    ``FluxPipeline``), through that pipeline class's ``save_lora_weights``. ``family``: the ``ModelFamily`` (default:
    the model's, ``models.family_of``; FLUX.1 for a state dict).

    Pass the (possibly sharded) model, on every rank, or a ``lora_state_dict`` result plus its ``config``
    (``LoraConfig`` or its dict; stored as adapter metadata so diffusers restores ``lora_alpha``; without it
    diffusers assumes alpha == rank). ``dtype`` casts the weights on export (``export_dtype``; default: as trained,
    fp32). Rank 0 writes ``pytorch_lora_weights.safetensors``; returns ``out_dir``.
    """
    out_dir = Path(out_dir)
    parts = {"": ""}
    if isinstance(state_dict_or_model, nn.Module):
        family = family or models.family_of(state_dict_or_model)
        parts = family.transformer_parts(state_dict_or_model)
        config = lora_config(state_dict_or_model, adapter_name) if config is None else config
        state_dict = lora_state_dict(state_dict_or_model, adapter_name)
    else:
        state_dict = dict(state_dict_or_model)  # cast below without touching the caller's dict
    if not distributed.is_main_process():
        return out_dir
    if not state_dict:
        raise ValueError("save_lora_for_diffusers got an empty LoRA state dict; pass the model or the rank-0 "
                         "result of lora_state_dict(model)")
    if any(".lora_" not in k for k in state_dict):
        raise ValueError("save_lora_for_diffusers expects only LoRA weights (keys with .lora_A/.lora_B); use "
                         "lora_state_dict(model), or save_transformer_for_diffusers for a full fine-tune")
    metadata = None
    if config is None:
        warnings.warn("save_lora_for_diffusers: no LoraConfig given, so diffusers will load the adapter with "
                      "lora_alpha == rank; pass config=lora_config(model) (or the model itself) if alpha != rank",
                      stacklevel=2)
    else:
        metadata = dict(config.to_dict() if hasattr(config, "to_dict") else config)
        metadata = {k: (sorted(v) if isinstance(v, set) else v) for k, v in metadata.items()}
    cast_floating_(state_dict, dtype)
    pipeline = (family or models.resolve("auto")).pipeline_class()
    for folder, part in _split_parts(state_dict, parts, out_dir).items():  # Wan2.2-A14B: final/ and final/transformer_2
        pipeline.save_lora_weights(folder, transformer_lora_layers={k: v.contiguous() for k, v in part.items()},
                                   transformer_lora_adapter_metadata=metadata, safe_serialization=True)
    return out_dir


def _split_parts(state_dict: dict[str, torch.Tensor], parts: dict[str, str], out_dir: Path
                 ) -> dict[Path, dict[str, torch.Tensor]]:
    """The export folder of each part of a model (``ModelFamily.transformer_parts``: subfolder -> key prefix) with
    its tensors, the prefix removed; parts without tensors are left out."""
    split = {}
    for sub, prefix in parts.items():
        part = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        if part:
            split[out_dir / sub if sub else out_dir] = part
    return split


def load_lora_from_diffusers(model: nn.Module, lora_dir: str | Path, adapter_name: str = "default") -> nn.Module:
    """Add the LoRA of a diffusers LoRA folder (``save_lora_for_diffusers``'s, or any folder the family's pipeline
    ``load_lora_weights`` takes) to the transformer the way that pipeline's ``load_lora_weights`` does (alpha from its
    metadata); ValueError for LoRA weights of other components (prompts are encoded without them)."""
    family = models.family_of(model)
    pipeline = family.pipeline_class()
    # FLUX.1's loader also returns network alphas; SD3's, Qwen-Image's and FLUX.2's keep alpha in the metadata only
    with_alphas = "return_alphas" in inspect.signature(pipeline.lora_state_dict).parameters
    for sub, prefix in family.transformer_parts(model).items():  # Wan2.2-A14B: each expert from its folder
        folder = Path(lora_dir) / sub if sub else Path(lora_dir)
        loaded = pipeline.lora_state_dict(str(folder), return_lora_metadata=True,
                                          **({"return_alphas": True} if with_alphas else {}))
        state_dict, alphas, metadata = loaded if with_alphas else (loaded[0], None, loaded[1])
        others = sorted({k.split(".")[0] for k in state_dict if not k.startswith("transformer.")})
        if others:
            raise ValueError(f"{folder} also holds LoRA weights for {', '.join(others)}; sample.py applies only a "
                             "transformer LoRA (the trainers' export)")
        extra = {"network_alphas": alphas} if with_alphas else {}
        part = model.get_submodule(prefix[:-1]) if prefix else model
        pipeline.load_lora_into_transformer(state_dict, transformer=part, adapter_name=adapter_name,
                                            metadata=metadata, **extra)
    return model


def save_transformer_for_diffusers(
    state_dict_or_model: dict[str, torch.Tensor] | nn.Module,
    config: Any,
    out_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    family: Any = None,
) -> Path:
    """Write a full transformer folder loadable by the family's transformer class's ``from_pretrained(out_dir)``
    (FLUX.1: ``FluxTransformer2DModel``; ``family`` as for ``save_lora_for_diffusers``).

    Pass the (possibly sharded) model on every rank (``config=None`` reads its config), or a full state dict (the
    rank-0 result of ``full_state_dict``) with the model's ``config``. ``dtype`` casts floating weights on export
    (e.g. ``torch.bfloat16`` halves the size; ``export_dtype``), one tensor at a time on rank 0, so its host memory
    peaks at the gathered model plus one tensor. Rank 0 writes config.json + safetensors; returns ``out_dir``.
    """
    out_dir = Path(out_dir)
    parts = {"": ""}
    if isinstance(state_dict_or_model, nn.Module):
        family = family or models.family_of(state_dict_or_model)
        parts = family.transformer_parts(state_dict_or_model)
        config = unwrap_model(state_dict_or_model).config if config is None else config
        state_dict = full_state_dict(state_dict_or_model, dtype=dtype)
    else:
        state_dict = dict(state_dict_or_model)  # cast below without touching the caller's dict
    if not distributed.is_main_process():
        return out_dir
    if config is None:
        raise ValueError("save_transformer_for_diffusers needs the transformer config when given a state dict; "
                         "pass unwrap_config(model)")
    if any(".lora_" in k for k in state_dict):
        raise ValueError("the transformer has LoRA adapters; export them with save_lora_for_diffusers (a full "
                         "transformer export expects a model without adapters)")
    cast_floating_(state_dict, dtype)
    config = {k: v for k, v in dict(config).items() if not k.startswith("_")}
    for folder, part in _split_parts(state_dict, parts, out_dir).items():  # Wan2.2-A14B: one folder per expert
        with torch.device("meta"):
            model = (family or models.resolve("auto")).transformer_class().from_config(config)
        model.load_state_dict(part, strict=True, assign=True)
        model.save_pretrained(folder, safe_serialization=True)
    return out_dir
