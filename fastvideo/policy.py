"""The trained policy: the transformer loaded sharded (LoRA or whole), its reference, EMA and DiffusionNFT's old
policy (``Policy``, ``build_policy``), its optimizer and LR schedule, and the export of OUT/final."""
from __future__ import annotations

import argparse
import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from fastvideo import distributed as D
from fastvideo import lora, models, parallel, weights
from fastvideo.devices import compute_dtype
from fastvideo.ema import EMA, local_shard
from fastvideo.options import opt


@dataclass
class Policy:
    """The trained transformer (sharded), how to reach the reference policy, and the EMA."""

    model: torch.nn.Module
    is_lora: bool
    frozen_ref: torch.nn.Module | None
    ema: Any | None
    config: dict
    ref_snapshot: Any | None = None  # EMA with decay 0: a sharded copy of the trained weights (updated reference)
    old: OldPolicy | None = None  # DiffusionNFT's old policy (adapter "old" or a sharded copy)

    @contextlib.contextmanager
    def reference(self) -> Iterator[torch.nn.Module]:
        """The reference policy (use under ``torch.no_grad()``, never between a forward and its backward): the
        snapshot of the trained weights if one is kept (``update_reference``), else LoRA adapters disabled, or the
        frozen copy of the base weights."""
        if self.ref_snapshot is not None:
            with self.ref_snapshot.swap_into(self.model):
                yield self.model
        elif self.is_lora:
            with lora.disable_adapters(self.model):
                yield self.model
        else:
            assert self.frozen_ref is not None, "full fine-tune reference requested but none was kept"
            yield self.frozen_ref

    def update_reference(self) -> None:
        """Copy the current trained weights into the reference snapshot (local shards only, no communication)."""
        assert self.ref_snapshot is not None, "build_policy(..., ref_snapshot=True) keeps the snapshot"
        self.ref_snapshot.capture()

    def shadows(self) -> dict[str, Any]:
        """Sharded weight copies a checkpoint must hold besides the model and EMA."""
        found = {"reference": self.ref_snapshot, "old": self.old}
        return {name: obj for name, obj in found.items() if obj is not None}

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


class OldPolicy(EMA):
    """DiffusionNFT's old policy v_old (docs/algorithms.md §6): it samples the rollouts, anchors the implicit v⁺/v⁻.

    LoRA: a second, frozen adapter ``old`` in the same sharded model (``active()`` switches to it without touching
    ``requires_grad``, so only ``default`` is trained and in the optimizer). Full fine-tune: a second sharded
    transformer with fp32 master weights (computed in the compute dtype through FSDP's mixed precision; fp32 because
    ``old <- d*old + (1-d)*theta`` with d up to 0.999 moves by ~1e-3 of a difference, below bf16's resolution).
    It is a ``ema.EMA`` of the trained weights whose shadow *is* the old weights' local shards (FSDP2 shards
    both alike), so ``update(decay)`` is one local ``lerp`` with no communication, and the checkpoint saves and
    restores it as the shadow ``old`` exactly like the EMA.
    """

    ADAPTER = "old"

    def __init__(self, model: torch.nn.Module, old_model: torch.nn.Module | None = None) -> None:
        self.model, self.old_model = model, old_model
        named = parallel.named_trainable_parameters(model)
        source = dict(parallel.clean_named_parameters(old_model if old_model is not None else model))
        rename = (lambda n: n) if old_model is not None else (lambda n: n.replace(".default.", f".{self.ADAPTER}."))
        missing = [rename(n) for n, _ in named if rename(n) not in source]
        if missing:
            raise ValueError(f"the old policy lacks {len(missing)} of the trained parameters, e.g. {missing[:2]}")
        if old_model is not None:
            parallel.reshard(old_model)
        with torch.no_grad():
            shadow = [local_shard(source[rename(n)]).detach() for n, _ in named]
        super().__init__(model, decay=0.0, warmup=False, shadow=shadow)

    @contextlib.contextmanager
    def active(self) -> Iterator[torch.nn.Module]:
        """The model computing v_old (use under ``torch.no_grad()``)."""
        if self.old_model is not None:
            yield self.old_model
        else:
            with lora.use_adapter(self.model, self.ADAPTER):
                yield self.model

    def update(self, decay: float | None = None) -> None:
        """``old <- decay*old + (1-decay)*theta`` on every local shard (after resharding what forwards left
        gathered, so the next old-policy forward gathers the updated shards)."""
        parallel.reshard(self.model)
        if self.old_model is not None:
            parallel.reshard(self.old_model)
        super().update(decay)


def build_policy(args: argparse.Namespace, device: torch.device, *, need_reference: bool,
                 ref_snapshot: bool = False, old_policy: bool = False) -> Policy:
    """Build the transformer on the meta device, add LoRA (rank > 0) or train it whole, shard, load each rank's
    shards from the safetensors, keep a frozen reference if needed, EMA.

    ``ref_snapshot``: the reference is instead a sharded fp32 copy of the trained weights (adapters for LoRA), equal
    to the loaded weights until ``Policy.update_reference()`` (online DPO's ``--ref_update_interval``); swapped into
    the model for reference passes, so no second model is built. ``old_policy``: DiffusionNFT's ``OldPolicy``, equal
    to the trained weights at the start (LoRA: a frozen adapter ``old`` initialised like ``default``; full fine-tune:
    a second sharded fp32 transformer loaded from the folder).

    No rank ever holds the whole model (docs/design.md principle 8): host RAM per node is ~1x the fp32 model. The
    reference of a full fine-tune is loaded the same way, in the compute dtype (bf16 on accelerators), never copied from the
    trained weights. Build the optimizer right after this (FSDP2 swaps parameters for DTensors here). On an Ascend NPU
    every transformer gets float32 rotary embeddings and the fused attention (the family's ``prepare_for_device``).
    """
    family = models.family_for(args)
    transformer = family.build_transformer(args.pretrained_model_name_or_path, dtype=torch.float32)
    train_only_experts(transformer, args)
    config = dict(transformer.config)
    is_lora = args.lora_rank > 0
    adapter_init = {}
    if is_lora:
        lora.add_lora(transformer, rank=args.lora_rank, alpha=args.lora_alpha or args.lora_rank,
                      target_modules=args.lora_target_modules, init_seed=args.seed)
        adapter_init = lora.initial_adapter_weights(transformer, args.seed)  # shapes read before sharding
        if old_policy:  # a frozen second adapter starting equal to "default" (the same makers under its names)
            lora.add_lora(transformer, rank=args.lora_rank, alpha=args.lora_alpha or args.lora_rank,
                          target_modules=args.lora_target_modules, init_seed=args.seed,
                          adapter_name=OldPolicy.ADAPTER, trainable=False)
            adapter_init.update({k.replace(".default.", f".{OldPolicy.ADAPTER}."): make
                                 for k, make in list(adapter_init.items())})
    transformer.train()
    shard_kwargs = dict(fsdp_version=args.fsdp_version, sharding_strategy=args.fsdp_sharding_strategy,
                        mixed_precision=_fsdp_precision(args.mixed_precision, device),
                        cpu_offload=args.use_cpu_offload, compile=args.compile, sp_size=args.sp_size)
    transformer = parallel.shard_model(transformer, gradient_checkpointing=args.gradient_checkpointing,
                                       **shard_kwargs)
    folder = family.weight_folders(args.pretrained_model_name_or_path)
    weights.load_safetensors_into(transformer, folder, skip=adapter_init.__contains__)
    if adapter_init:
        weights.fill_local_shards(transformer, adapter_init)
    frozen_ref = None
    if need_reference and not is_lora and not ref_snapshot:
        ref_dtype = compute_dtype(args.mixed_precision, device) or torch.float32
        frozen_ref = family.build_transformer(args.pretrained_model_name_or_path, dtype=ref_dtype)
        frozen_ref = parallel.shard_model(frozen_ref.requires_grad_(False).eval(), gradient_checkpointing=False,
                                          **shard_kwargs)
        weights.load_safetensors_into(frozen_ref, folder)
    old = None
    if old_policy:
        old_model = None
        if not is_lora:  # fp32 master weights like the trained copy, so both shard alike (see OldPolicy)
            old_model = family.build_transformer(args.pretrained_model_name_or_path, dtype=torch.float32)
            old_model = parallel.shard_model(old_model.requires_grad_(False).eval(), gradient_checkpointing=False,
                                             **shard_kwargs)
            weights.load_safetensors_into(old_model, folder)
        old = OldPolicy(transformer, old_model)
    param_dtype = compute_dtype(args.mixed_precision, device) or torch.float32  # FSDP's param_dtype in the forward
    for model in (transformer, frozen_ref, old.old_model if old is not None else None):
        done = family.prepare_for_device(model, device, param_dtype=param_dtype,
                                         attention_backend=args.attention_backend) if model is not None else []
        if done and D.is_main_process() and model is transformer:
            print("device adaptations: " + "; ".join(done), flush=True)
    ema = EMA(transformer, decay=args.ema_decay, warmup=args.ema_warmup) if args.use_ema else None
    snapshot = EMA(transformer, decay=0.0, warmup=False) if ref_snapshot else None
    return Policy(model=transformer, is_lora=is_lora, frozen_ref=frozen_ref, ema=ema, config=config,
                  ref_snapshot=snapshot, old=old)


def train_only_experts(transformer: torch.nn.Module, args: argparse.Namespace) -> None:
    """--train_experts high|low: freeze the other of Wan2.2-A14B's experts (``WanExperts.train_only``), before
    any adapter or optimizer sees the parameters (the planner does the same)."""
    which = getattr(args, "train_experts", "both")
    if which != "both":
        transformer.train_only(which)


def _fsdp_precision(mixed_precision: str, device: torch.device) -> str:
    return "bf16" if compute_dtype(mixed_precision, device) == torch.bfloat16 else "fp32"


def build_optimizer(policy: Policy, args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters only (LoRA adapters, or the whole transformer)."""
    params = policy.trainable_parameters()
    if not params:
        raise ValueError("no trainable parameters: check --lora_rank / --lora_target_modules")
    return torch.optim.AdamW(params, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                             eps=args.adam_epsilon, weight_decay=args.weight_decay)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, args: argparse.Namespace, total_optimizer_steps: int):
    """constant_with_warmup | cosine | constant, stepped once per optimizer step."""
    from diffusers.optimization import get_scheduler  # heavy

    return get_scheduler(args.lr_scheduler, optimizer=optimizer, num_warmup_steps=args.lr_warmup_steps,
                         num_training_steps=total_optimizer_steps)


def export_final(args: argparse.Namespace, policy: Policy) -> Path:
    """OUT/final: a diffusers LoRA (FluxPipeline.load_lora_weights) or a full transformer folder
    (FluxTransformer2DModel.from_pretrained) in ``--export_dtype`` (auto: the base model's dtype), recorded as
    ``exported_dtype`` in its training_args.json; the EMA weights when --use_ema.

    Every rank gathers, rank 0 casts and writes (minutes for a 24 GB FLUX.1-dev transformer), and the others wait
    for it in ``distributed.store_barrier``, which no collective timeout cuts short; an error on rank 0 still ends
    every rank (``distributed.fail_fast``)."""
    out = Path(args.output_dir) / "final"
    dtype = lora.export_dtype(args.export_dtype, args.pretrained_model_name_or_path, models.spec_of(args))
    swap = policy.ema.swap_into(policy.model) if policy.ema is not None else contextlib.nullcontext()
    with swap:
        if policy.is_lora:  # collective: every rank gathers, rank 0 writes (with lora_alpha as metadata)
            lora.save_lora_for_diffusers(policy.model, out, dtype=dtype)
        else:
            lora.save_transformer_for_diffusers(policy.model, policy.config, out, dtype=dtype)
    if D.is_main_process():
        name = {v: k for k, v in lora.EXPORT_DTYPES.items()}.get(dtype, str(dtype))
        record = {**vars(args), "exported_dtype": name}
        (out / "training_args.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    D.store_barrier("export")
    return out


@dataclass
class OptimOptions:
    learning_rate: float = opt(1e-5, "AdamW peak learning rate")
    weight_decay: float = opt(1e-4, "AdamW weight decay")
    adam_beta1: float = opt(0.9, "AdamW beta1")
    adam_beta2: float = opt(0.999, "AdamW beta2")
    adam_epsilon: float = opt(1e-8, "AdamW epsilon")
    max_grad_norm: float = opt(1.0, "clip the global L2 norm of the gradients to this (<= 0 disables clipping)")
    lr_scheduler: str = opt("constant_with_warmup", "learning-rate schedule",
                            choices=("constant_with_warmup", "cosine", "constant"))
    lr_warmup_steps: int = opt(0, "warm-up length in optimizer steps")
    max_train_steps: int = opt(300, "training steps (one rollout + its updates each)")
    max_train_seconds: float = opt(
        0.0, "also stop after the first step that ends past this many seconds of training (slowest rank; evaluation "
        "excluded; 0 = no limit): checkpoint, last evaluation and export as at --max_train_steps (the run's length "
        "then depends on the machine's speed)")
    train_batch_size: int = opt(4, "samples per replay micro-batch (per rank)")
    gradient_accumulation_steps: int = opt(
        0, "micro-batches per optimizer step (0 = all of a rank's samples -> one optimizer step per rollout)")
    max_consecutive_skips: int = opt(
        10, "stop with an error (after writing a checkpoint of the last good weights) when more than N updates in a "
        "row were skipped for a non-finite loss or gradient (0 = never stop)")
    use_ema: bool = opt(False, "keep an EMA of the trained weights (sharded); exported instead of the raw weights")
    ema_decay: float = opt(0.995, "EMA decay per optimizer step (the upper bound of the warm-up)")
    ema_warmup: bool = opt(True, "EMA warm-up: the decay of update t is min(ema_decay, (1+t)/(10+t)) (Flow-GRPO); "
                                 "--no-ema_warmup = constant decay (the exported EMA then keeps ~ema_decay^t of the base)")


@dataclass
class LoRAOptions:
    lora_rank: int = opt(0, "LoRA rank (0 = full fine-tune of the transformer)")
    lora_alpha: float | None = opt(None, "LoRA alpha (default: equal to the rank)")
    lora_target_modules: list[str] | None = opt(
        None, "module names to adapt (default: FLUX attention + feed-forward projections)", nargs="+")
    train_experts: str = opt("both", "Wan2.2-A14B: the experts a full fine-tune trains: both, high (transformer, "
                                     "t >= the boundary) or low (transformer_2); the other stays frozen. LoRA trains "
                                     "both", choices=("both", "high", "low"))


def nft_uses_old_policy(args: argparse.Namespace) -> bool:
    """Whether train_nft.py keeps an old policy: always for DiffusionNFT (it samples the rollouts and anchors v+/v-),
    for AWM only as the --awm_off_policy sampler or the --old_kl_beta anchor."""
    return args.objective == "nft" or args.awm_off_policy or args.old_kl_beta > 0
