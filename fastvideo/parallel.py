"""Shard the transformer for training: activation checkpointing -> FSDP per block -> root, in one place.

The trainer builds the model exactly as for a single process (load, optionally ``add_lora``), then calls
``shard_model`` once and afterwards only uses the helpers below, which accept the sharded model, an
FSDP1-wrapped model or a plain module alike:

    model = shard_model(model, fsdp_version=2, sharding_strategy="full", mixed_precision="bf16")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=...)
    with autocast("bf16"):
        loss = ...model(...)...
    loss.backward()
    grad_norm = clip_grad_norm(model, max_norm)          # total norm over all shards (may be inf/nan)
    sd = full_state_dict(model)                          # rank 0: full CPU tensors, other ranks: {}
    config = unwrap_config(model)                        # the diffusers config, whatever the wrapping

Choices (each validated up front with a ValueError that names the flag):

- ``fsdp_version`` (``--fsdp_version``): 2 = ``torch.distributed.fsdp.fully_shard`` (per-parameter DTensor
  sharding; the default), 1 = ``FullyShardedDataParallel`` with ``use_orig_params=True`` (so frozen base weights
  and LoRA adapters can share a flat parameter, and ``model.named_parameters()`` keeps the original names).
- ``sharding_strategy`` (``--fsdp_sharding_strategy``):
  ``full`` shard params, grads and optimizer state over all ranks (ZeRO-3);
  ``shard_grad_op`` keep parameters gathered between forward and backward (ZeRO-2; FSDP2:
  ``reshard_after_forward=False``);
  ``hybrid_full`` shard within a node (``LOCAL_WORLD_SIZE`` ranks, or ``hybrid_shard_size``) and replicate across
  nodes (2-D mesh ``("replicate", "shard")``);
  ``no_shard`` replicate everything (DDP-like; FSDP2 uses a ``(world, 1)`` mesh).
- ``mixed_precision`` (``--mixed_precision``): ``fp32``, or ``bf16`` = bf16 parameters in forward/backward with
  fp32 master weights, fp32 gradient reduction and fp32 optimizer state. Inputs are not cast by FSDP: run every
  forward under ``autocast(mixed_precision)`` (also at world size 1, where it is the only bf16 mechanism).
- ``cpu_offload`` (``--use_cpu_offload``): keep sharded params, grads and optimizer state on the CPU.
- ``gradient_checkpointing`` (``--gradient_checkpointing``): recompute each transformer block in backward.

World size 1 (no process group, e.g. ``python train.py`` without torchrun) is not a special case for the caller:
``shard_model`` returns the model itself moved to the job's device (only gradient checkpointing is applied; CPU
offload and FSDP's bf16 weights are FSDP features and do not apply: ``memory_flag_problems`` says so up front),
and every helper here works on it.

Loading at 12B (docs/design.md principle 8): build the model on the meta device and pass it here; ``shard_model`` then
materialises only this rank's shards (uninitialised; FSDP2 ``to_empty`` after sharding, FSDP1 one unit at a time
through ``param_init_fn``) and ``weights.load_safetensors_into`` fills them, each rank reading only its own bytes.
Host RAM per node stays ~1x the model instead of one fp32 copy per rank.

Gradient reduction (``--gradient_sync``), measured on FSDP2 in tests/dist_scripts/memory_checks.py:

- ``backward``: reduce-scatter after every backward (torchtitan's choice). Between backwards each rank holds only
  its fp32 gradient shard (4 bytes x params / world): the only mode that fits a FLUX.1-dev full fine-tune.
- ``step``: ``set_requires_gradient_sync(False)`` on every backward of an accumulation cycle but the last; FSDP2
  then keeps an unsharded fp32 gradient of every trainable parameter on every rank until the sync (4 bytes x
  trainable params per rank: ~48 GB for FLUX.1-dev, whatever the world size), in exchange for one reduction per
  optimizer step. Only for LoRA, where the adapters are a few hundred MB at most.
- FSDP1 always reduces per backward (its ``no_sync`` keeps unsharded gradients too).

Ranks must build identical models before sharding (same folder, same seeds): nothing is broadcast from rank 0.
Build the optimizer (and ``EMA``) right after ``shard_model``, before any forward: with ``shard_grad_op`` FSDP2
leaves the gathered (unsharded) tensors registered after a forward, and an optimizer built then would hold those
(``reshard(model)`` first if you must).
"""
from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from fastvideo import devices, distributed
from fastvideo.models.base import model_config as unwrap_config  # noqa: F401  (re-exported: config through wrappers)
from fastvideo.models.base import unwrap_model
from fastvideo.options import opt

FSDP_VERSIONS = (1, 2)
GRADIENT_SYNC_MODES = ("backward", "step")
SHARDING_STRATEGIES = ("full", "hybrid_full", "shard_grad_op", "no_shard")
MIXED_PRECISIONS = ("fp32", "bf16")

# Block classes wrapped as FSDP units when the model does not declare ``_no_split_modules``.
_DEFAULT_BLOCK_NAMES = ("FluxTransformerBlock", "FluxSingleTransformerBlock")


def validate_parallel_options(fsdp_version: int, sharding_strategy: str, mixed_precision: str) -> None:
    """Raise a ValueError naming the flag when a parallelism option is not one we support."""
    if fsdp_version not in FSDP_VERSIONS:
        raise ValueError(f"--fsdp_version {fsdp_version!r} is not supported; use 2 (fully_shard, default) or 1 "
                         "(FullyShardedDataParallel)")
    if sharding_strategy not in SHARDING_STRATEGIES:
        raise ValueError(f"--fsdp_sharding_strategy {sharding_strategy!r} is not supported; use one of "
                         f"{', '.join(SHARDING_STRATEGIES)}")
    if mixed_precision not in MIXED_PRECISIONS:
        raise ValueError(f"--mixed_precision {mixed_precision!r} is not supported; use one of "
                         f"{', '.join(MIXED_PRECISIONS)}")


def block_classes(model: nn.Module) -> tuple[type, ...]:
    """The transformer-block classes of ``model`` that become FSDP units (from ``_no_split_modules``)."""
    names = set(getattr(model, "_no_split_modules", None) or _DEFAULT_BLOCK_NAMES)
    return tuple({type(m) for m in model.modules() if type(m).__name__ in names})


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The block modules of ``model`` in forward order (FluxTransformerBlock, FluxSingleTransformerBlock...)."""
    classes = block_classes(model)
    return [m for m in model.modules() if isinstance(m, classes)]


def fsdp_version_of(model: nn.Module) -> int:
    """2 for a ``fully_shard`` model, 1 for a FullyShardedDataParallel wrapper, 0 for a plain module."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel  # heavy

    if isinstance(model, FullyShardedDataParallel):
        return 1
    if isinstance(model, FSDPModule):
        return 2
    return 0


def _enable_gradient_checkpointing(model: nn.Module) -> None:
    """Recompute each transformer block in backward (diffusers' own non-reentrant checkpoint when available)."""
    if getattr(model, "_supports_gradient_checkpointing", False) and hasattr(model, "enable_gradient_checkpointing"):
        # Keeps module names and the model's structure unchanged (state-dict keys, peft, EMA names); the
        # checkpointed call is the block's __call__, so FSDP's per-block hooks run inside the recomputation,
        # which both FSDP versions support.
        model.enable_gradient_checkpointing()
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing  # heavy

    classes = block_classes(model)
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, classes))


def _hybrid_shape(world: int, hybrid_shard_size: int | None) -> tuple[int, int]:
    shard = hybrid_shard_size or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if shard < 1 or world % shard:
        raise ValueError(f"--fsdp_sharding_strategy hybrid_full needs the world size ({world}) to be a multiple of "
                         f"the shard group size ({shard}); set hybrid_shard_size to a divisor of the world size")
    return world // shard, shard


_ANNOUNCED: set[str] = set()


def _announce_hybrid(fsdp_version: int, shape: tuple[int, int], mesh=None) -> None:
    """Rank 0 prints the hybrid_full layout once per process (the mesh as built: which ranks replicate, which shard)."""
    ranks = mesh.mesh.tolist() if mesh is not None else "NO_SHARD (one rank per shard group)"
    line = (f"hybrid_full (FSDP{fsdp_version}): {shape[0]} replica(s) x {shape[1]} shard rank(s), "
            f"mesh (replicate, shard) = {ranks}")
    if distributed.is_main_process() and line not in _ANNOUNCED:
        _ANNOUNCED.add(line)
        print(line, flush=True)


def shard_model(
    model: nn.Module,
    *,
    fsdp_version: int = 2,
    sharding_strategy: str = "full",
    mixed_precision: str = "fp32",
    cpu_offload: bool = False,
    gradient_checkpointing: bool = False,
    hybrid_shard_size: int | None = None,
    compile: bool = False,
    sp_size: int = 1,
) -> nn.Module:
    """Apply activation checkpointing, ``torch.compile`` to every transformer block (``compile``: static shapes, a
    graph per batch size and grad mode, compiled at first use), then FSDP to every block, then FSDP to the root.

    Returns the model to train, on ``distributed.info().device``: the same object for FSDP2 and world size 1, a
    ``FullyShardedDataParallel`` wrapper for FSDP1 (use ``unwrap_model`` to reach ``.config``). Pass the model on
    the CPU: FSDP moves one block at a time to the accelerator while sharding (``model.to("cuda")`` first would
    materialise the whole model on every GPU). Call it once, after ``add_lora`` (adapters must exist before
    sharding) and before building the optimizer (which must see the sharded parameters).
    ``hybrid_shard_size`` overrides the shard-group size of ``hybrid_full`` (default: ranks per node).
    ``sp_size`` > 1: Ulysses sequence parallelism over each group of ``sp_size`` consecutive ranks
    (``enable_sequence_parallel``); FSDP still shards over all ranks (dp x sp), so the trainer scales its loss by
    ``sp_size`` (``training.Run.backward``: FSDP averages the partial gradients of the SP ranks over dp x sp).

    A model on the meta device (the 12B path) comes back with this rank's shards allocated but uninitialised: fill
    them with ``weights.load_safetensors_into`` (and ``weights.fill_local_shards`` for generated ones) before use.
    """
    validate_parallel_options(fsdp_version, sharding_strategy, mixed_precision)
    if gradient_checkpointing:
        _enable_gradient_checkpointing(model)
    if compile:
        for block in transformer_blocks(model):
            block.compile(dynamic=False)
    device = distributed.info().device
    on_meta = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    if not distributed.is_distributed():
        return model.to_empty(device=device) if on_meta else model.to(device)
    world = distributed.get_world_size()
    if not transformer_blocks(model):
        raise ValueError(f"{type(model).__name__} has no transformer blocks to shard (looked for "
                         f"{getattr(model, '_no_split_modules', None) or _DEFAULT_BLOCK_NAMES}); shard_model expects "
                         "a FluxTransformer2DModel-like model")
    if fsdp_version == 2:
        model = _shard_fsdp2(model, world, device, sharding_strategy, mixed_precision, cpu_offload, hybrid_shard_size)
        if on_meta:  # allocates only the local shards (on the CPU when offloading, where FSDP2 keeps them)
            model.to_empty(device="cpu" if cpu_offload else device)
        if sp_size > 1:
            enable_sequence_parallel(model, sp_size)
        return model
    if sp_size > 1:
        raise ValueError("--sp_size > 1 needs --fsdp_version 2")
    return _shard_fsdp1(model, world, device, sharding_strategy, mixed_precision, cpu_offload, hybrid_shard_size,
                        on_meta)


def check_sequence_parallel(sp_size: int, num_heads: int, image_tokens: int) -> None:
    """ValueError naming the fix when Ulysses SP of degree ``sp_size`` cannot run: diffusers without
    ContextParallelConfig (< 0.36), attention heads not divisible by it (Ulysses splits the heads), or image tokens
    not divisible by it (diffusers splits the image sequence evenly; text tokens are padded instead)."""
    if sp_size == 1:
        return
    import diffusers  # heavy

    if not hasattr(diffusers, "ContextParallelConfig"):
        raise ValueError(f"--sp_size {sp_size} needs diffusers' ContextParallelConfig (diffusers >= 0.36; this is "
                         f"{diffusers.__version__}): pip install -U diffusers, or use --sp_size 1")
    if num_heads % sp_size:
        fits = [d for d in range(2, num_heads + 1) if num_heads % d == 0]
        raise ValueError(f"--sp_size {sp_size} must divide the transformer's {num_heads} attention heads (Ulysses "
                         f"gives each rank heads / sp_size of them); use one of {fits}")
    if image_tokens % sp_size:
        raise ValueError(f"--sp_size {sp_size} must divide the {image_tokens} image tokens of --h x --w (diffusers "
                         "splits the image sequence evenly): pick --h and --w so that (h/16) x (w/16) is a multiple of "
                         f"{sp_size} (1024 x 1024 gives 4096 tokens, 720 x 720 gives 2025)")


def enable_sequence_parallel(model: nn.Module, sp_size: int) -> None:
    """Ulysses sequence parallelism over this rank's SP group (``distributed.sequence_parallel_mesh``) through
    diffusers' ``enable_parallelism``: the model's context-parallel plan splits the image and text sequences over the
    group on the way in, all-to-alls q/k/v so each rank attends over the whole sequence with heads / sp_size heads,
    and gathers the output (its backward keeps each rank's own tokens' share: the SP ranks' parameter gradients are
    partial and sum to the whole). Text embeddings must come padded to a multiple of ``sp_size``
    (the FLUX adapter's ``predict_velocity`` does it)."""
    from diffusers import ContextParallelConfig  # heavy

    inner = unwrap_model(model)
    check_sequence_parallel(sp_size, inner.config.num_attention_heads, 0)

    @contextmanager
    def at_least_one_device():  # diffusers takes rank % torch.accelerator.device_count(): 0 on a CPU-only host
        count = torch.accelerator.device_count
        torch.accelerator.device_count = lambda: max(count(), 1)
        try:
            yield
        finally:
            torch.accelerator.device_count = count

    with at_least_one_device():
        inner.enable_parallelism(config=ContextParallelConfig(ulysses_degree=sp_size,
                                                              mesh=distributed.sequence_parallel_mesh()))
    inner._fastvideo_sp_size = sp_size


def memory_flag_problems(world_size: int, device_type: str, cpu_offload: bool, compute_bf16: bool
                         ) -> tuple[list[str], list[str]]:
    """``(errors, warnings)`` for memory flags that cannot take effect in this job, checked before loading.

    World size 1 applies no FSDP: ``--use_cpu_offload`` would do nothing on an accelerator (an error: the run would
    run out of memory where the user expects it to fit) and bf16 comes from autocast only, over fp32 weights. On a
    CPU job offloading is a no-op (a warning).
    """
    errors, warnings_ = [], []
    if world_size == 1 and cpu_offload and device_type != "cpu":
        errors.append("--use_cpu_offload has no effect at world size 1 (FSDP, which offloads, is applied only under "
                      "torchrun with >= 2 ranks): launch with torchrun --nproc_per_node >= 2, or drop the flag")
    elif cpu_offload and device_type == "cpu":
        warnings_.append("--use_cpu_offload does nothing on a CPU job (everything is on the CPU already)")
    if world_size == 1 and compute_bf16:
        warnings_.append("world size 1: no FSDP, so bf16 applies through autocast only; parameters, gradients and "
                         "AdamW state stay unsharded fp32 (16 bytes per trainable parameter): see --dry_run")
    return errors, warnings_


def _shard_fsdp2(model, world, device, sharding_strategy, mixed_precision, cpu_offload, hybrid_shard_size):
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard  # heavy

    if sharding_strategy == "hybrid_full":
        shape = _hybrid_shape(world, hybrid_shard_size)
        mesh = distributed.device_mesh(shape, ("replicate", "shard"))
        _announce_hybrid(2, shape, mesh)
    elif sharding_strategy == "no_shard":
        mesh = distributed.device_mesh((world, 1), ("replicate", "shard"))
    else:
        mesh = distributed.device_mesh()
    if mixed_precision == "bf16":
        # Inputs are not cast: the caller's ``autocast`` decides (timesteps stay float32, as at world size 1).
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    else:
        mp = MixedPrecisionPolicy()
    # Pinned host memory needs an accelerator; on a CPU-only job offloading is a no-op move anyway.
    offload = CPUOffloadPolicy(pin_memory=device.type != "cpu") if cpu_offload else OffloadPolicy()
    reshard = sharding_strategy != "shard_grad_op"
    kwargs = dict(mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)
    # fully_shard moves each unit's states to the mesh device as it shards them (peak: one block unsharded on the
    # accelerator), so the model can arrive on the CPU.
    for block in transformer_blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _shard_fsdp1(model, world, device, sharding_strategy, mixed_precision, cpu_offload, hybrid_shard_size,
                 on_meta=False):
    from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy  # heavy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # heavy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy  # heavy

    strategy = {"full": ShardingStrategy.FULL_SHARD, "shard_grad_op": ShardingStrategy.SHARD_GRAD_OP,
                "no_shard": ShardingStrategy.NO_SHARD, "hybrid_full": ShardingStrategy.HYBRID_SHARD}[sharding_strategy]
    kwargs: dict[str, Any] = {}
    if sharding_strategy == "hybrid_full":
        shape = _hybrid_shape(world, hybrid_shard_size)
        if shape[1] == 1:
            # FSDP1's HYBRID_SHARD with one rank per shard group skips the cross-replica gradient all-reduce
            # (measured: wrong gradients); replicating everything is exactly what this layout means.
            strategy = ShardingStrategy.NO_SHARD
            _announce_hybrid(1, shape)
        else:
            kwargs["device_mesh"] = distributed.device_mesh(shape, ("replicate", "shard"))
            _announce_hybrid(1, shape, kwargs["device_mesh"])
    flags = {p.requires_grad for p in model.parameters()}
    if strategy == ShardingStrategy.NO_SHARD and flags == {True, False}:
        # Measured on torch 2.14: when training, NO_SHARD unregisters a fully frozen flat parameter's original
        # params (the root's under LoRA) after the first forward/backward, so they vanish from named_parameters()
        # and state dicts. Entirely frozen models (a reference copy) are fine.
        raise ValueError("--fsdp_version 1 with --fsdp_sharding_strategy no_shard (or hybrid_full with one rank "
                         "per shard group) does not work with frozen parameters (LoRA); use --fsdp_version 2")
    if on_meta:
        # FSDP1 materialises one unit at a time (then flattens and shards it): never the whole model per rank
        init_device = torch.device("cpu") if cpu_offload and device.type != "cpu" else device
        kwargs["param_init_fn"] = lambda module: module.to_empty(device=init_device, recurse=False)
    mp = None
    if mixed_precision == "bf16":
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32,
                            cast_forward_inputs=False, cast_root_forward_inputs=False)
    return FSDP(
        model,
        sharding_strategy=strategy,
        auto_wrap_policy=ModuleWrapPolicy(set(block_classes(model))),
        mixed_precision=mp,
        # FSDP1 pins offloaded params, which needs an accelerator; on a CPU-only job they are on the CPU anyway.
        cpu_offload=CPUOffload(offload_params=cpu_offload and device.type != "cpu"),
        device_id=device,
        use_orig_params=True,
        limit_all_gathers=True,
        **kwargs,
    )


def autocast(mixed_precision: str, device: torch.device | str | None = None):
    """The context to run every forward in: ``torch.autocast(bfloat16)`` for "bf16", a null context for "fp32".

    FSDP's bf16 policy gives bf16 compute copies of the weights but leaves inputs alone, so the same autocast
    context serves world size 1 (no FSDP) and N, and both compute the same thing (e.g. float32 timesteps).
    """
    validate_parallel_options(2, "full", mixed_precision)
    if mixed_precision == "fp32":
        return nullcontext()
    return devices.autocast(device if device is not None else distributed.info().device, torch.bfloat16)


def resolve_gradient_sync(mode: str, is_lora: bool) -> str:
    """``--gradient_sync``: 'auto' -> 'step' for LoRA, 'backward' for a full fine-tune; 'step' with a full
    fine-tune is refused (it keeps an unsharded fp32 copy of every gradient on every rank; see the module doc)."""
    if mode == "auto":
        return "step" if is_lora else "backward"
    if mode not in GRADIENT_SYNC_MODES:
        raise ValueError(f"--gradient_sync {mode!r} is not supported; use auto, backward or step")
    if mode == "step" and not is_lora:
        raise ValueError("--gradient_sync step keeps unsharded fp32 gradients of the whole transformer on every rank "
                         "between backwards (4 bytes x parameters: ~48 GB for FLUX.1-dev); for a full fine-tune use "
                         "--gradient_sync backward (or auto)")
    return mode


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """FSDP2: reduce-scatter gradients in this backward (True) or keep accumulating them unsharded (False).

    ``False`` on every backward of a cycle but the last is the ``--gradient_sync step`` mode (LoRA only: see the
    module doc for what it costs). A no-op for FSDP1 (always reduces) and for plain modules.
    """
    if fsdp_version_of(model) == 2:
        model.set_requires_gradient_sync(enabled)  # type: ignore[operator]


def reshard(model: nn.Module) -> None:
    """Free gathered parameters left by a forward without backward (FSDP2 ``shard_grad_op``); no-op otherwise.

    Needed before code that edits the sharded parameters in place (EMA swap, loading weights) after a no-grad
    forward under ``reshard_after_forward=False``.
    """
    from torch.distributed.fsdp import FSDPModule  # heavy

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def clip_grad_norm(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> float:
    """Clip gradients to ``max_norm`` by their total norm over all shards; return that norm (may be inf/nan).

    Correct for FSDP2 (DTensor gradients: the norm is reduced across the mesh), FSDP1 (its own collective
    ``clip_grad_norm_``) and plain modules. A non-finite norm leaves the gradients non-finite: skip that update.
    Must be called on every rank.
    """
    version = fsdp_version_of(model)
    if version == 1:
        return float(model.clip_grad_norm_(max_norm, norm_type))
    if version == 2:
        reshard(model)  # a no-grad forward since backward would leave gathered, grad-less params registered
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite=False)
    from torch.distributed.tensor import DTensor  # heavy

    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)


def cast_floating_(state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Cast the floating tensors of ``state_dict`` to ``dtype`` in place, one at a time (each original is released
    as its copy is made: never a second full copy of the model); returns ``state_dict``."""
    if dtype is not None:
        for key, value in state_dict.items():
            if value.is_floating_point() and value.dtype != dtype:
                state_dict[key] = value.to(dtype)
    return state_dict


def _host_copy(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A CPU copy of ``tensor``, floating ones in ``dtype`` (cast while copying) when given."""
    cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
    return tensor.detach().to("cpu", dtype=cast, copy=True)


def full_state_dict(model: nn.Module, *, trainable_only: bool = False,
                    dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's complete (unsharded) state dict as CPU tensors on rank 0, ``{}`` on the other ranks.

    Keys are the original module names (no FSDP/checkpoint-wrapper prefixes). ``trainable_only`` drops parameters
    with ``requires_grad=False`` (e.g. the frozen base under LoRA; FSDP2 then never gathers them). ``dtype`` casts
    the floating tensors (an export in bf16): as each is copied (FSDP1, one process), or one at a time after FSDP2's
    gather. A collective: call it on every rank. The returned tensors are copies (safe to keep while training
    continues).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # heavy

    version = fsdp_version_of(model)
    frozen = {name for name, p in clean_named_parameters(model) if not p.requires_grad} if trainable_only else set()
    if version == 0:
        if not distributed.is_main_process():
            return {}
        return {k: _host_copy(v, dtype) for k, v in model.state_dict().items() if k not in frozen}
    if version == 2:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
        sd = get_model_state_dict(model, options=options)
    else:
        sd = _fsdp1_full_state_dict(model, frozen, dtype)
    if not distributed.is_main_process():
        return {}
    # gathered tensors are fresh CPU tensors: copy only what still aliases the live model (unsharded buffers, a
    # no_shard layout), so rank 0 holds one full copy of the model, not two
    live = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]
            if t.device.type == "cpu" and not hasattr(t, "_local_tensor")}
    live |= {t._local_tensor.untyped_storage().data_ptr() for t in model.parameters() if hasattr(t, "_local_tensor")}
    out = {k: _host_copy(v, dtype) if v.untyped_storage().data_ptr() in live else v.detach()
           for k, v in sd.items() if k not in frozen}
    del sd
    return cast_floating_(out, dtype)


def _fsdp1_full_state_dict(model: nn.Module, skip: set[str], dtype: torch.dtype | None = None
                           ) -> dict[str, torch.Tensor]:
    """FSDP1: gather one FSDP unit at a time; rank 0 keeps CPU copies, the others never hold more than one unit.

    (FSDP1's own full-state-dict gather either materialises everything on every rank, or, rank-0-only with CPU
    offload, segfaults when the parameters live on the CPU.) Units whose parameters are all in ``skip`` (frozen
    under LoRA) are not gathered.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # heavy

    main = distributed.is_main_process()
    out: dict[str, torch.Tensor] = {}
    owned: set[str] = set()
    for unit_name, unit in model.named_modules():
        if not isinstance(unit, FSDP) or unit._handle is None:
            continue
        prefix = clean_name(unit_name + ".") if unit_name else ""
        fqns = list(unit._handle.flat_param._fqns)
        owned.update(clean_name(prefix + f) for f in fqns)
        if all(clean_name(prefix + f) in skip for f in fqns):
            continue
        with FSDP.summon_full_params(unit, recurse=False, writeback=False):
            if main:
                for fqn in fqns:  # a copy: the gathered storage is freed when the context exits
                    out[clean_name(prefix + fqn)] = _host_copy(unit.module.get_parameter(fqn), dtype)
    if main:
        for name, buf in model.named_buffers():
            if clean_name(name) not in owned:
                out[clean_name(name)] = _host_copy(buf, dtype)
    return out


_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    """A parameter name without FSDP1/checkpoint-wrapper/compile prefixes (matches state-dict keys)."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def clean_named_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``named_parameters()`` with FSDP1 wrapper prefixes removed (the names of the unwrapped model)."""
    for name, p in model.named_parameters():
        yield clean_name(name), p


def named_trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(clean name, parameter)`` for every parameter with ``requires_grad`` (local shards under FSDP)."""
    return [(n, p) for n, p in clean_named_parameters(model) if p.requires_grad]


@dataclass
class ParallelOptions:
    fsdp_version: int = opt(2, "FSDP implementation: 2 (fully_shard, default) or 1", choices=(2, 1), type=int)
    fsdp_sharding_strategy: str = opt("full", "how FSDP shards the transformer",
                                      choices=("full", "hybrid_full", "shard_grad_op", "no_shard"))
    mixed_precision: str = opt("auto", "compute dtype: bf16 | fp32 | auto (bf16 on GPU/NPU, fp32 on CPU)",
                               choices=("auto", "bf16", "fp32"))
    use_cpu_offload: bool = opt(False, "offload FSDP parameters, gradients and optimizer state to the CPU (needs "
                                       ">= 2 ranks; adds a gloo backend for CPU collectives)")
    gradient_checkpointing: bool | None = opt(
        None, "recompute transformer blocks in backward to save activation memory (~1/3 more update compute); unset = "
        "auto: on for a full fine-tune (--lora_rank 0) on a GPU/NPU, off for LoRA and on the CPU; "
        "--gradient_checkpointing / --no-gradient_checkpointing choose explicitly")
    compile: bool = opt(False, "torch.compile every transformer block (fused kernels; the first rollout and update "
                               "of each batch size compile, minutes at 12B). See docs/performance.md for when it pays")
    gradient_sync: str = opt(
        "auto", "when FSDP2 reduce-scatters gradients: backward = after every backward (each rank keeps only its "
        "fp32 gradient shard, 4 B/param/world; more communication) | step = once per optimizer step (every rank "
        "keeps unsharded fp32 gradients of all trainable params until then, 4 B/param: ~48 GB for a FLUX.1-dev full "
        "fine-tune, so LoRA only) | auto = step for LoRA, backward for full fine-tuning",
        choices=("auto", *GRADIENT_SYNC_MODES))
    sp_size: int = opt(1, "Ulysses sequence parallelism: each group of N consecutive ranks shares its samples and "
                          "splits their image and text tokens (attention heads / N per rank); FSDP still shards over "
                          "all ranks. Must divide the ranks, the attention heads (FLUX.1-dev: 24) and the image "
                          "tokens ((h/16) x (w/16)); text is padded to a multiple of N. See "
                          "docs/sequence-parallel.md", type=int)
    attention_backend: str = opt("auto", "diffusers attention kernel for every forward (rollout and replay alike): "
                                         "auto (torch SDPA; the fused _native_npu kernel on an NPU in bf16) | native | "
                                         "flash | _native_flash | _native_cudnn | _native_npu | sage | ... (any "
                                         "diffusers AttentionBackendName); an unavailable one falls back to native "
                                         "with one warning (always on a CPU job)")
    dist_timeout_minutes: float = opt(30.0, "minutes a collective (NCCL/HCCL/gloo) may wait for a peer before the "
                                            "job fails; waits on rank 0's file writes (export, checkpoint renames) "
                                            "go through the TCP store and are not bound by it", type=float)


# -------------------------------------------------------------------------------------------- model calls
def text_length_refusal(text_tokens: int, sp_size: int) -> str:
    """Why --sp_size ``sp_size`` cannot run ``text_tokens`` text tokens, and the fix: Ulysses splits the text sequence
    evenly over the group, and padding it with zero embeddings would add tokens that attention reads (no mask), so the
    trained function would differ from the base model's."""
    fits = [d for d in (1, 2, 4, 8) if text_tokens % d == 0]
    return (f"--sp_size {sp_size} does not divide the embeddings' {text_tokens} text tokens: Ulysses splits the text "
            "evenly over the group, and padding it would add tokens that attention reads (the trained model would "
            f"differ from the base model); preprocess with a --max_sequence_length that is a multiple of {sp_size} "
            f"(e.g. {text_tokens - text_tokens % sp_size}), or use --sp_size {' / '.join(map(str, fits))}")
