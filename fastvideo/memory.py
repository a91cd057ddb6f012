"""Per-rank memory plan of a training run, computed from the model folder's configs without reading weights.

``--dry_run`` prints it; every GPU/NPU run checks it against the device's memory before loading any model
(``check_plan_fits``, via ``launch.check_memory_plan``); the defaults chosen to fit are resolved here too
(``resolve_gradient_checkpointing``, ``resolve_decode_batch_size``). Model states are counted in bytes from the
transformer built on the meta device (with its LoRA adapters); activations are measured by running the real diffusers
modules on the meta device under a dispatch mode that tracks the bytes of live tensors (saved-for-backward tensors,
transients, recomputation under gradient checkpointing), with scaled-dot-product attention accounted as a flash kernel
(the output and a log-sum-exp are kept, never the T x T matrix), as on GPUs. The plan is the persistent states plus
the largest phase (rollout, decode, train).

What it does not see: the caching allocator's fragmentation (GPU), communication buffers of NCCL, the CUDA
context (~0.5-1 GB per GPU) and the Python runtime; docs/memory.md's "what fits" table leaves headroom for them.
"""
from __future__ import annotations

import argparse
import json
import os
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from fastvideo import edits, lora, models
from fastvideo.data import EmbeddingDataset
from fastvideo.devices import ACCELERATOR_TYPES, compute_dtype
from fastvideo.losses import POLICY_LOSS_TABLE
from fastvideo.options import opt
from fastvideo.parallel import block_classes, memory_flag_problems, resolve_gradient_sync
from fastvideo.policy import nft_uses_old_policy, train_only_experts
from fastvideo.rewards import parse_eval_reward_spec, parse_reward_spec

GiB = 2**30

# Parameters of the reward models (fp32 on the device): facts of the published architectures (open_clip ViT-H-14
# image + text towers for HPS v2 / PickScore / CLIP score; CLIP ViT-L/14 + the LAION MLP 768-1024-128-64-16-1 of
# rewards/aesthetic.py for the aesthetic score).
_AESTHETIC_MLP = sum(i * o + o for i, o in ((768, 1024), (1024, 128), (128, 64), (64, 16), (16, 1)))
REWARD_PARAMS = {"hpsv2": 986_109_440, "pickscore": 986_109_440, "clipscore": 986_109_440,
                 "aesthetic": 427_616_513 + _AESTHETIC_MLP, "jpeg_compressibility": 0, "jpeg_incompressibility": 0}


@dataclass
class PlanItem:
    """One line of the plan: bytes per rank on the accelerator (or the CPU for a CPU job) and in host RAM."""

    name: str
    device: float
    host: float = 0.0
    phase: str = "persistent"  # persistent | rollout | decode | train
    note: str = ""


@dataclass
class MemoryPlan:
    """The items of one rank, and the facts they were computed from."""

    items: list[PlanItem]
    facts: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def phase_total(self, phase: str) -> float:
        return sum(i.device for i in self.items if i.phase == phase)

    @property
    def peak_phase(self) -> str:
        return max(("rollout", "decode", "train"), key=self.phase_total)

    @property
    def device_peak(self) -> float:
        """Bytes per rank at the peak: persistent states + the largest phase."""
        return self.phase_total("persistent") + self.phase_total(self.peak_phase)

    @property
    def host_per_rank(self) -> float:
        return sum(i.host for i in self.items)

    def summary(self, device_memory_bytes: float | None = None) -> str:
        """One line: the peak per rank, its phase, and (given the device's memory) whether it fits."""
        peak = self.device_peak / GiB
        line = (f"memory plan: {peak:.1f} GiB peak per rank (persistent + {self.peak_phase}; {self.facts['mode']}, "
                f"world size {self.facts['world_size']}, compute {self.facts['compute_dtype']})")
        if device_memory_bytes:
            memory = device_memory_bytes / GiB
            verdict = "fits" if self.device_peak <= device_memory_bytes else "does NOT fit"
            line += f" vs {memory:.1f} GiB per device: {verdict} ({memory - peak:+.1f} GiB headroom)"
        return line

    def format(self, device_memory_gb: float | None = None) -> str:
        """The plan as a text table (GiB per rank)."""
        f = self.facts
        lines = [f"memory plan per rank ({f['device_type']}, world size {f['world_size']}, shard group "
                 f"{f['shard_size']}, {f['mode']}, compute {f['compute_dtype']}): transformer "
                 f"{f['params'] / 1e9:.3f}B params, {f['trainable'] / 1e9:.4f}B trainable; micro-batch "
                 f"{f['train_batch_size']} x ({f['image_tokens']} image"
                 + (f" ({f['condition_tokens']} of them the source's)" if f.get("condition_tokens") else "")
                 + f" + {f['text_tokens']} text tokens)"
                 + (f"; --sp_size {f['sp_size']}: {f['image_tokens'] // f['sp_size']} + "
                    f"{-(-f['text_tokens'] // f['sp_size'])} tokens per rank" if f.get("sp_size", 1) > 1 else ""),
                 f"  {'item':<56}{'phase':<12}{'device GiB':>11}{'host GiB':>10}  note"]
        for i in self.items:
            lines.append(f"  {i.name:<56}{i.phase:<12}{i.device / GiB:>11.2f}{i.host / GiB:>10.2f}  {i.note}")
        peak = self.device_peak / GiB
        lines.append(f"  {'peak per rank = persistent + ' + self.peak_phase:<68}{peak:>11.2f}"
                     f"{self.host_per_rank / GiB:>10.2f}")
        if device_memory_gb:
            verdict = "fits" if peak <= device_memory_gb else "does NOT fit"
            lines.append(f"  {verdict} in {device_memory_gb:g} GiB per device ({device_memory_gb - peak:+.1f} GiB "
                         "headroom before allocator fragmentation, NCCL buffers and the CUDA context)")
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


# --------------------------------------------------------------------------- measuring activations on meta
class _LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Tracks the bytes of live tensor storages created while active (peak and current)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._seen:
            return
        nbytes = storage.nbytes()
        self._seen.add(key)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._free, key, nbytes)

    def _free(self, key: int, nbytes: int) -> None:
        if key in self._seen:
            self._seen.discard(key)
            self.live -= nbytes


class _FlashAttention(torch.autograd.Function):
    """Memory stand-in for a flash SDPA kernel: keeps q, k, v, out and the log-sum-exp; no T x T matrix."""

    @staticmethod
    def forward(ctx, q, k, v):  # (B, H, T, D)
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _flash_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return _FlashAttention.apply(query, key, value)


@contextmanager
def _meta_measurement() -> Iterator[_LiveBytes]:
    import torch.nn.functional as F  # heavy

    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _flash_sdpa
    try:
        with _LiveBytes() as meter:
            yield meter
    finally:
        F.scaled_dot_product_attention = original


def _block_kind(block: torch.nn.Module) -> tuple:
    """What makes two blocks hold the same activations: their class and their parameters' names and shapes (SD3.5-M:
    13 dual-attention blocks, 10 plain ones and a context-pre-only last block are three kinds)."""
    return type(block).__name__, tuple((n, tuple(p.shape)) for n, p in block.named_parameters())


# transformer_activation_bytes's results by the traced model's structure and the call's sizes: one dry run plans the
# same forward more than once (training with and without checkpointing, the rollout, evaluation), and a process that
# plans several runs of one model (the launchers' and the tests' in-process planning) repeats whole traces
_TRACE_MEMO: dict[tuple, int] = {}


def _structure(model: torch.nn.Module) -> tuple:
    """What a meta trace of ``model`` depends on: its class, config, every parameter's name, shape, dtype and
    trainability (LoRA adapters included) and whether gradient checkpointing is on."""
    config = getattr(model, "config", None)
    return (type(model).__qualname__, repr(sorted(dict(config).items())) if config is not None else None,
            bool(getattr(model, "gradient_checkpointing", False)),
            tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in model.named_parameters()))


def transformer_activation_bytes(model: torch.nn.Module, batch: int, image_tokens: int, text_tokens: int,
                                 dtype: torch.dtype, *, train: bool) -> int:
    """``_activation_bytes`` of ``model`` (the part one velocity call runs: ``ModelFamily.traced_transformer``),
    remembered by its structure and the sizes (``_TRACE_MEMO``)."""
    model = models.family_of(model).traced_transformer(model)
    key = (_structure(model), batch, image_tokens, text_tokens, dtype, train)
    if key not in _TRACE_MEMO:
        _TRACE_MEMO[key] = _activation_bytes(model, batch, image_tokens, text_tokens, dtype, train=train)
    return _TRACE_MEMO[key]


def _activation_bytes(model: torch.nn.Module, batch: int, image_tokens: int, text_tokens: int,
                      dtype: torch.dtype, *, train: bool) -> int:
    """Peak bytes of live activations for one forward (and backward when ``train``) of a meta-device transformer
    (any model family: its ``example_inputs`` and ``block_lists``) on ``batch`` samples. Parameter gradients are
    dropped as soon as they are accumulated (FSDP reduce-scatters them per unit; that unit's gradient is planned
    separately).

    Blocks of one kind (``_block_kind``) hold the same activations, so the peak is linear in each kind's count (no
    grad: flat; training without checkpointing: each block's saved tensors plus one block's backward). A deep
    model is traced with the first 2 blocks of every kind (in their order), then with a third of one kind in turn, and
    extrapolated per kind, which equals the full trace (``tests/test_memory.py``) at a fraction of its time (the
    tracer costs ~0.2 ms per op). A first, discarded trace builds what a forward allocates once and keeps (e.g. a
    cached rotary table), so no trace counts it and the per-block differences stay per block."""
    names = models.family_of(model).block_lists
    originals = {name: getattr(model, name) for name in names}
    lists = {name: list(blocks) for name, blocks in originals.items()}
    kinds = {name: [_block_kind(b) for b in blocks] for name, blocks in lists.items()}
    counts = {(name, k): ks.count(k) for name, ks in kinds.items() for k in set(ks)}
    # with gradient checkpointing the training peak is the larger of two moments (every block's saved input plus the
    # last block's recomputation, or fewer inputs plus a wider block's backward): a max, not linear in the counts,
    # so it is traced whole (~2 s for FLUX.1-dev's 57 blocks: the tracer's time is per op, not per byte)
    checkpointed = train and bool(getattr(model, "gradient_checkpointing", False))
    if checkpointed or all(c <= 3 for c in counts.values()):
        return _traced_activation_bytes(model, batch, image_tokens, text_tokens, dtype, train=train)

    def traced(extra: tuple | None) -> int:
        for name, blocks in lists.items():
            kept, seen = [], {}
            for block, kind in zip(blocks, kinds[name]):
                seen[kind] = seen.get(kind, 0) + 1
                if seen[kind] <= (3 if extra == (name, kind) else 2):
                    kept.append(block)
            setattr(model, name, torch.nn.ModuleList(kept))
        return _traced_activation_bytes(model, batch, image_tokens, text_tokens, dtype, train=train)

    try:
        traced(None)  # the one-time allocations, kept by the model, so the traces below do not count them
        base = traced(None)
        return base + sum((count - 2) * (traced(key) - base) for key, count in counts.items() if count > 2)
    finally:
        for name, blocks in originals.items():
            setattr(model, name, blocks)


def _traced_activation_bytes(model: torch.nn.Module, batch: int, image_tokens: int, text_tokens: int,
                             dtype: torch.dtype, *, train: bool) -> int:
    """``transformer_activation_bytes`` by tracing the whole model on the meta device."""
    handles = []
    if train:
        for p in model.parameters():
            if p.requires_grad:
                handles.append(p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None)))
    inputs = models.family_of(model).example_inputs(model.config, batch, image_tokens, text_tokens, dtype,
                                                    torch.device("meta"))
    try:
        with _meta_measurement() as meter, torch.set_grad_enabled(train):
            out = model(**inputs)[0].float()
            if train:
                out.square().mean().backward()
            del out
        return meter.peak
    finally:
        for h in handles:
            h.remove()


def vae_decode_bytes(vae_config: dict, batch: int, latent_h: int, latent_w: int, dtype: torch.dtype, *,
                     family: Any = None, geometry: Any = None) -> int:
    """Peak bytes of live tensors while decoding ``batch`` latents with the VAE (no grad), on the meta device: a
    FLUX.1 ``AutoencoderKL`` on ``(batch, C, latent_h, latent_w)``, or with ``family`` and ``geometry`` the family's
    VAE class through its own ``decode`` of packed latents."""
    config = {k: v for k, v in vae_config.items() if not k.startswith("_")}
    if family is None:
        from diffusers import AutoencoderKL  # heavy

        cls = AutoencoderKL
    else:
        cls = family.vae_class()
    with torch.device("meta"):
        vae = _cast_quietly(cls.from_config(config), dtype).eval()
    with _meta_measurement() as meter, torch.no_grad():
        if family is None:
            z = torch.empty(batch, config["latent_channels"], latent_h, latent_w, device="meta", dtype=dtype)
            image = vae.decode(z, return_dict=False)[0]
        else:
            image = family.decode(vae, torch.empty(batch, *geometry.packed_shape, device="meta"), geometry)
        del image
    return meter.peak


def _cast_quietly(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model.to(dtype)`` on the meta device without diffusers' warning about fp32 modules (FLUX has none)."""
    for t in [*model.parameters(), *model.buffers()]:
        t.data = t.data.to(dtype)
    return model


def _param_count(model: torch.nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def _vae_config(model_path: str | os.PathLike, model_family: str = "auto") -> dict:
    """The VAE's config.json of a model folder (no weights read)."""
    folder = models.resolve(model_family, model_path).check_folder(model_path, ("vae",))
    return json.loads((folder / "vae" / "config.json").read_text())


# ------------------------------------------------------------------------------------ defaults that fit
DECODE_BUDGET_BYTES = 4 * GiB  # the auto --decode_batch_size keeps one VAE decode call's planned peak below this


def _is_accelerator(device_type: str) -> bool:
    return device_type in ACCELERATOR_TYPES


def resolve_gradient_checkpointing(requested: bool | None, lora_rank: int, device_type: str) -> bool:
    """--gradient_checkpointing as a run on ``device_type`` uses it: as given when set; unset (auto) = on for a full
    fine-tune (``lora_rank`` 0) on a GPU/NPU, where FLUX.1-dev's activations alone outgrow 80 GB without it, and off
    for LoRA and on the CPU (where the recomputation would only cost time)."""
    if requested is not None:
        return bool(requested)
    return lora_rank == 0 and _is_accelerator(device_type)


def auto_decode_batch_size(model_path: str | os.PathLike, height: int, width: int, dtype: torch.dtype,
                           max_batch: int, budget: int = DECODE_BUDGET_BYTES, model_family: str = "auto",
                           frames: int | None = None) -> int:
    """The largest number of latents (1 to ``max_batch``) one VAE decode call of ``height`` x ``width`` images (a
    video family: ``frames``-frame videos) in ``dtype`` takes with its planned peak (``vae_decode_bytes``) within
    ``budget``; at least 1 even when a single sample exceeds it. The peak is linear in the batch: one trace at batch 1
    gives the candidate, one more checks it."""
    config = _vae_config(model_path, model_family)
    family = models.resolve(model_family, model_path)
    geometry = models.geometry_for(family, model_path, height, width, frames)

    def peak(batch: int) -> int:
        return vae_decode_bytes(config, batch, geometry.latent_h, geometry.latent_w, dtype, family=family,
                                geometry=geometry)

    batch = max(1, min(max_batch, budget // max(peak(1), 1)))
    while batch > 1 and peak(batch) > budget:
        batch -= 1
    return batch


def resolve_decode_batch_size(args: argparse.Namespace, device_type: str) -> int:
    """--decode_batch_size as a run on ``device_type`` uses it: as given when > 0; 0 (auto) = on a GPU/NPU
    ``auto_decode_batch_size`` in the compute dtype (at most --rollout_batch_size, the largest decode call), on the CPU
    0 (a whole rollout micro-batch per call). Idempotent: a resolved value resolves to itself."""
    if args.decode_batch_size or not _is_accelerator(device_type):
        return args.decode_batch_size

    dtype = compute_dtype(args.mixed_precision, torch.device(device_type)) or torch.float32
    return auto_decode_batch_size(args.pretrained_model_name_or_path, args.h, args.w, dtype, args.rollout_batch_size,
                                  model_family=models.spec_of(args), frames=getattr(args, "num_frames", None))


def check_plan_fits(plan: MemoryPlan, device_type: str, device_memory_bytes: int | None, *,
                    ignore: bool = False) -> str | None:
    """The gate before any model loads: on a GPU/NPU, the plan's one-line summary against the device's memory when it
    fits; a ValueError naming the fixes when it does not (with ``ignore``, --ignore_memory_plan: the same text as a
    warning line). None on the CPU (not checked: host RAM is shared with the OS, other jobs and swap; --dry_run
    prints the plan there)."""
    if not _is_accelerator(device_type) or not device_memory_bytes:
        return None
    summary = plan.summary(device_memory_bytes)
    if plan.device_peak <= device_memory_bytes:
        return summary
    f = plan.facts
    fixes = []
    if not f.get("gradient_checkpointing"):
        fixes.append("--gradient_checkpointing")
    if not f.get("cpu_offload"):
        fixes.append("--use_cpu_offload (with >= 2 ranks)")
    fixes.append(f"a smaller --train_batch_size ({f['train_batch_size']} images per micro-batch now) / "
                 f"--rollout_batch_size ({f.get('rollout_batch_size')}) / --decode_batch_size "
                 f"({f.get('decode_batch_size')})")
    fixes.append("more ranks (the model states are sharded over them)")
    if f.get("trainable", 0) == f.get("params"):
        fixes.append("LoRA (--lora_rank 64)")
    message = (f"{summary}. Fix it before the models load: {'; '.join(fixes)}. `--dry_run` (with --device "
               f"{device_type} and --dry_run_world_size {f['world_size']}) lists the plan item by item; "
               "--ignore_memory_plan starts anyway")
    if ignore:
        return f"warning: --ignore_memory_plan: {message}"
    raise ValueError(message)


# ------------------------------------------------------------------------------------------------ the plan
def _text_tokens(args: argparse.Namespace, family: Any) -> int:
    """Text tokens per prompt the transformer sees: from the embeddings' ``max_sequence_length``, or the family's
    default when there are none yet (FLUX.1: 512 T5 tokens; SD3: 77 CLIP + T5)."""
    length = family.defaults.max_sequence_length
    try:
        if args.data_json_path:
            length = EmbeddingDataset(args.data_json_path).max_sequence_length
    except FileNotFoundError:  # a plan may be made before preprocessing
        pass
    return family.text_tokens(length, condition=condition_size(args, family))


def _shard_size(strategy: str, world: int) -> int:
    if world == 1 or strategy == "no_shard":
        return 1
    if strategy == "hybrid_full":
        return int(os.environ.get("LOCAL_WORLD_SIZE", min(world, 8)))
    return world


def plan_grpo(args: argparse.Namespace, counts: dict[str, int], world_size: int, device_type: str,
              *, compare_checkpointing: bool = True) -> MemoryPlan:
    """The memory plan of ``train_grpo_flux.py`` with these (validated) flags on ``world_size`` ranks."""
    return _plan(args, world_size, device_type, micro_images=args.train_batch_size, reference=args.kl_beta > 0,
                 snapshot=False, samples=counts["samples_per_rank"], scored=True,
                 compare_checkpointing=compare_checkpointing, guided_update=True)


def plan_dpo(args: argparse.Namespace, counts: dict[str, int], world_size: int, device_type: str,
             *, compare_checkpointing: bool = True) -> MemoryPlan:
    """The memory plan of ``train_dpo.py`` (online or offline) with these (validated) flags on ``world_size`` ranks:
    micro-batches of 2 x --train_batch_size images, the reference pass always, the fp32 reference snapshot with
    --ref_update_interval; online: the rollout of this rank's samples and the step's gathered clean latents (host);
    offline: the sample-grid rollout of this rank's pairs, no reward model."""
    online = args.preference_file is None
    samples = counts["samples_per_rank"] if online else counts["pairs_per_rank"]
    gathered = counts["samples_per_step"] if online else 0
    return _plan(args, world_size, device_type, micro_images=2 * args.train_batch_size, reference=True,
                 snapshot=args.ref_update_interval > 0, samples=samples, scored=online, gathered_latents=gathered,
                 compare_checkpointing=compare_checkpointing)


def plan_nft(args: argparse.Namespace, counts: dict[str, int], world_size: int, device_type: str,
             *, compare_checkpointing: bool = True) -> MemoryPlan:
    """The memory plan of ``train_nft.py`` with these (validated) flags on ``world_size`` ranks: the old policy (a
    second fp32 adapter, or a second sharded fp32 transformer for a full fine-tune) and its no-grad forward next to
    each trained one where the run keeps one (``nft_uses_old_policy``: DiffusionNFT always, AWM only with
    --awm_off_policy or --old_kl_beta > 0), the reference forward with --kl_beta > 0, an ODE rollout of this rank's
    samples."""
    return _plan(args, world_size, device_type, micro_images=args.train_batch_size, reference=args.kl_beta > 0,
                 snapshot=False, samples=counts["samples_per_rank"], scored=True, old_policy=nft_uses_old_policy(args),
                 compare_checkpointing=compare_checkpointing)


def _plan(args: argparse.Namespace, world_size: int, device_type: str, *, micro_images: int, reference: bool,
          snapshot: bool, samples: int, scored: bool, gathered_latents: int = 0, old_policy: bool = False,
          compare_checkpointing: bool = True, guided_update: bool = False) -> MemoryPlan:
    """The plan of a trainer whose update runs ``micro_images`` images per forward/backward (+ a no-grad reference
    forward if ``reference``; ``snapshot``: the reference is a swapped-in fp32 copy of the trained weights; with
    ``old_policy`` a no-grad old-policy forward and its fp32 weights), whose rollout samples ``samples`` images per
    rank, scored by --reward if ``scored`` (and by --eval_reward's models with --eval_prompts).
    --gradient_checkpointing and --decode_batch_size are planned as the run resolves them on ``device_type``;
    ``compare_checkpointing`` also traces the training activations with the other checkpointing choice (a "not used"
    line; the start-up gate skips it, a second each at FLUX.1-dev's widths).
    With --cfg_scale > 1 every rollout forward runs 2x rows (prompt + negative), and the update's too when
    ``guided_update`` (GRPO replays the guided step; DPO's and NFT's losses are unguided)."""
    amp = compute_dtype(args.mixed_precision, torch.device(device_type))
    cdt = amp or torch.float32
    c = torch.empty((), dtype=cdt).element_size()  # bytes per element in compute
    family = models.family_for(args)
    model = family.build_transformer(args.pretrained_model_name_or_path, dtype=torch.float32)
    train_only_experts(model, args)  # Wan2.2-A14B's --train_experts: the frozen expert counts as parameters only
    is_lora = args.lora_rank > 0
    if is_lora:
        lora.add_lora(model, rank=args.lora_rank, alpha=args.lora_alpha or args.lora_rank,
                      target_modules=args.lora_target_modules)
    n_all, n_train = _param_count(model), _param_count(model, trainable_only=True)
    classes = block_classes(model)
    blocks = [m for m in model.modules() if isinstance(m, classes)]
    unit = max(_param_count(b) for b in blocks)
    unit_train = max(_param_count(b, trainable_only=True) for b in blocks)
    root = n_all - sum(_param_count(b) for b in blocks)

    world = world_size
    shard = _shard_size(args.fsdp_sharding_strategy, world)
    sharded = world > 1
    offload = args.use_cpu_offload and sharded and device_type != "cpu"
    sync = resolve_gradient_sync(args.gradient_sync, is_lora)
    geometry = models.geometry_for(family, args.pretrained_model_name_or_path, args.h, args.w,
                                   getattr(args, "num_frames", None), condition=condition_size(args, family))
    L, T, B, C = geometry.seq_len, _text_tokens(args, family), samples, geometry.packed_channels
    Lc = getattr(geometry, "condition_tokens", 0)  # an edit's source tokens: they join every forward's sequence
    S = args.sampling_steps
    joint = getattr(model.config, "joint_attention_dim", None) or model.config.text_dim  # Wan: text_dim
    pooled = getattr(model.config, "pooled_projection_dim", None) or 0
    guided = 2 if args.cfg_scale > 1 else 1  # true CFG: one forward of cond + uncond rows
    sp = args.sp_size
    Ls, Ts = (L + Lc) // sp, -(-T // sp)  # tokens per rank in the transformer: Ulysses splits both (text padded)
    items: list[PlanItem] = []

    def state(name: str, nbytes: float, note: str) -> None:
        items.append(PlanItem(name, 0.0 if offload else nbytes, nbytes if offload else 0.0, "persistent", note))

    state("parameters (fp32 master, sharded)", 4 * n_all / shard, f"4 B x {n_all / 1e9:.2f}B / {shard}")
    state("AdamW state (fp32 exp_avg + exp_avg_sq)", 8 * n_train / shard, "8 B x trainable / shard group")
    if args.use_ema:
        state("EMA (fp32, sharded)", 4 * n_train / shard, "4 B x trainable / shard group")
    if snapshot:
        state("reference snapshot (fp32, sharded)", 4 * n_train / shard,
              "copy of the trained weights, 4 B x trainable / shard group")
        items.append(PlanItem("trained weights set aside in the swap", 4 * n_train / shard, phase="train",
                              note="transient, while the snapshot is swapped in for the reference forward"))
    elif reference and not is_lora:
        state("reference policy (frozen, compute dtype)", c * n_all / shard,
              f"{c} B x params / shard group, loaded from the folder")
    elif reference:
        items.append(PlanItem("reference policy", 0.0, note="LoRA disabled: no extra weights"))
    if old_policy and is_lora:
        state("old policy: adapter 'old' (fp32, sharded)", 4 * n_train / shard, "4 B x trainable / shard group")
    elif old_policy:
        state("old policy: second transformer (fp32 master, sharded)", 4 * n_all / shard,
              "4 B x params / shard group (fp32: the d*old + (1-d)*theta update is below bf16's resolution)")
    # gradients live through the update phase
    items.append(PlanItem("gradients (fp32, sharded)", 0.0 if offload else 4 * n_train / shard,
                          4 * n_train / shard if offload else 0.0, "train", "4 B x trainable / shard group"))
    if sync == "step" and sharded:
        items.append(PlanItem("unsharded gradient accumulation (--gradient_sync step)", 4 * n_train, 0.0, "train",
                              "FSDP2 keeps fp32 unsharded grads between backwards"))
    if sharded:
        gathered = n_all if args.fsdp_sharding_strategy == "shard_grad_op" else root + 2 * unit
        note = "whole model between forward and backward" if args.fsdp_sharding_strategy == "shard_grad_op" \
            else "root + 2 blocks (prefetch)"
        items.append(PlanItem("gathered parameters (compute dtype)", c * gathered, phase="train", note=note))
        items.append(PlanItem("gathered parameters in rollout", c * (root + 2 * unit), phase="rollout",
                              note="root + 2 blocks"))
        items.append(PlanItem("one block's unsharded gradient + fp32 reduce copy", (c + 4) * unit_train,
                              phase="train", note="freed after its reduce-scatter"))
    elif amp is not None:
        items.append(PlanItem("autocast weight copies (world size 1)", c * n_all, phase="train",
                              note="bf16 copies cached for backward"))

    # activations, measured on the meta device in the compute dtype
    sim = model if cdt == torch.float32 else _cast_quietly(model, cdt)
    micro = micro_images * (guided if guided_update else 1)
    used = resolve_gradient_checkpointing(args.gradient_checkpointing, args.lora_rank, device_type)
    act = {}
    for ckpt in (used, not used) if compare_checkpointing else (used,):  # both: what --gradient_checkpointing changes
        sim.enable_gradient_checkpointing() if ckpt else sim.disable_gradient_checkpointing()
        act[ckpt] = transformer_activation_bytes(sim, micro, Ls, Ts, cdt, train=True)
    items.append(PlanItem(f"activations, micro-batch of {micro}", act[used], phase="train",
                          note=("with gradient checkpointing" if used else "no gradient checkpointing")
                          + (f"; 1/{sp} of the sequence (--sp_size)" if sp > 1 else "")))
    if compare_checkpointing:
        items.append(PlanItem(f"  (the same {'without' if used else 'with'} gradient checkpointing)", act[not used],
                              phase="not used", note="not counted"))
    if hasattr(model, "experts"):  # Wan2.2-A14B: a rank without rows for an expert another rank runs (a batch
        # of mixed timesteps) runs it on one stand-in row, whose graph lives beside its own rows' until the backward
        sim.enable_gradient_checkpointing() if used else sim.disable_gradient_checkpointing()  # as trained
        items.append(PlanItem("experts: one stand-in row through the other expert", transformer_activation_bytes(
            sim, 1, Ls, Ts, cdt, train=True), phase="train", note="when ranks route a micro-batch differently"))
    if reference or old_policy:
        no_grad = transformer_activation_bytes(sim, micro, Ls, Ts, cdt, train=False)
        name = " / ".join(n for n, on in (("reference", reference), ("old-policy", old_policy)) if on)
        items.append(PlanItem(f"{name} forward (no grad)", no_grad, phase="train", note="transient, one at a time"))
        if old_policy:
            items.append(PlanItem("v_old (fp32) kept through the trained forward", 4 * micro * L * C, phase="train",
                                  note="micro-batch x L x C"))
    rb = min(args.rollout_batch_size, B)
    items.append(PlanItem(f"rollout forward (no grad), batch of {rb}" + (" x 2 (CFG)" if guided > 1 else ""),
                          transformer_activation_bytes(sim, guided * rb, Ls, Ts, cdt, train=False), phase="rollout"))
    del sim, model

    # rollout buffers (kept from the rollout through the update), text embeddings of this rank's samples
    kept = 0 if old_policy else S + 1  # NFT keeps only the clean latents, GRPO/DPO the trajectory too
    buffers = 4 * B * (kept + 1) * L * C + 4 * B * getattr(geometry, "frames", 1) * 3 * args.h * args.w
    sde_noise = 4 * B * S * L * C if args.eta > 0 else 0
    what = "clean latents B x L x C" if old_policy else "latents B x (S+1) x L x C"
    items.append(PlanItem(f"rollout buffers: {what}, images", buffers, sde_noise, "persistent",
                          f"B={B} S={S} L={L} C={C}" + ("; host: SDE noise" if sde_noise else "")))
    if POLICY_LOSS_TABLE[getattr(args, "policy_loss", "clip")].needs_means:  # GRPO only (GRPO-Guard, Flow-DPPO)
        items.append(PlanItem("rollout SDE means (GRPO-Guard / Flow-DPPO)", 4 * B * S * L * C, phase="persistent",
                              note=f"B x S x L x C fp32, B={B}"))
    if sde_noise:  # the rollout copies one micro-batch's SDE noise to the device before its step loop
        items.append(PlanItem(f"SDE noise of a rollout micro-batch of {rb}", 4 * rb * S * L * C, phase="rollout",
                              note="rb x S x L x C fp32, pinned copy on the host too"))
    if gathered_latents:
        items.append(PlanItem("clean latents of the step, gathered (fp32)", 0.0, 4 * gathered_latents * L * C,
                              "persistent", f"{gathered_latents} x L x C on the host: pairs may span ranks"))
    items.append(PlanItem("text embeddings of this rank's samples (fp32)" + (" + CFG" if guided > 1 else ""),
                          4 * guided * B * (T * joint + pooled), 0.0, "persistent"))
    if Lc:  # an edit: each sample's packed source latents (both CFG halves share them), its source image on the host
        items.append(PlanItem("source latents of this rank's samples (fp32)", 4 * B * Lc * C,
                              4 * B * 3 * geometry.condition.height * geometry.condition.width, "persistent",
                              f"B x Lc x C, Lc={Lc}; host: the source images the reward compares"))
    vae_config = _vae_config(args.pretrained_model_name_or_path, models.spec_of(args))
    with torch.device("meta"):
        vae_params = _param_count(family.vae_class().from_config(
            {k: v for k, v in vae_config.items() if not k.startswith("_")}))
    short = "bf16" if cdt == torch.bfloat16 else "fp32"  # the VAE is loaded and decodes in the compute dtype
    items.append(PlanItem(f"VAE ({short}, frozen)", c * vae_params, phase="persistent",
                          note=f"{vae_params / 1e6:.1f}M params"))
    db = min(resolve_decode_batch_size(args, device_type) or rb, rb)  # 0 = the rollout micro-batch (CPU auto)
    items.append(PlanItem(f"VAE decode, batch of {db}", vae_decode_bytes(vae_config, db, geometry.latent_h,
                                                                        geometry.latent_w, cdt, family=family,
                                                                        geometry=geometry),
                          phase="decode", note=f"{short}, no grad"))

    names = [name for name, _ in parse_reward_spec(args.reward)] if scored else []
    if args.eval_prompts is not None:  # --eval_reward's models load with the evaluation
        names += [name for name, _ in parse_eval_reward_spec(args.eval_reward, args.reward)]
    for name in names:
        params = REWARD_PARAMS.get(name, 0)
        if name == "geneval":  # its detector's and colour head's parameters, from their folders' configs
            from fastvideo.bench.detect import parameter_count

            params = sum(parameter_count(p) for p in (getattr(args, "geneval_detector_path", None),
                                                      getattr(args, "geneval_clip_path", None)) if p)
        if params:
            items.append(PlanItem(f"reward model {name} (fp32, frozen)", 4 * params, phase="persistent",
                                  note=f"{params / 1e6:.0f}M params"))
    if device_type == "cpu":  # one memory: host items count on the "device"
        for item in items:
            item.device, item.host = item.device + item.host, 0.0
    errors, warnings_ = memory_flag_problems(world, device_type, args.use_cpu_offload, amp is not None)
    facts = dict(device_type=device_type, world_size=world, shard_size=shard, params=n_all, trainable=n_train,
                 mode=f"LoRA rank {args.lora_rank}" if is_lora else "full fine-tune", compute_dtype=str(cdt)[6:],
                 train_batch_size=micro, image_tokens=L + Lc, condition_tokens=Lc, text_tokens=T,
                 gradient_sync=sync, sp_size=sp,
                 gradient_checkpointing=used, cpu_offload=offload, rollout_batch_size=rb, decode_batch_size=db)
    return MemoryPlan(items, facts, errors + warnings_)


def condition_size(args: Any, family: Any) -> tuple[int, ...] | None:
    """An edit run's source size (height, width[, sources per edit]): from --data_json_path's manifest when it is
    there, else the size the family's pipeline resizes a source of the target's shape to (``default_condition_size``);
    None: no edit run."""
    if not family.edit:
        return None
    if not getattr(args, "data_json_path", None):
        return family.default_condition_size(args.h, args.w)
    path = Path(args.data_json_path)
    manifest = path / "manifest.json" if path.is_dir() else path
    try:
        edit = json.loads(manifest.read_text()).get("edit") if manifest.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None
    return (edits.condition_of(edit) if isinstance(edit, dict)
            else family.default_condition_size(args.h, args.w))


@dataclass
class PlanOptions:
    dry_run: bool = opt(False, "validate the flags, print the batch arithmetic and a per-rank memory plan (from the "
                               "model folder's configs, on the meta device: no weights are read), then exit")
    dry_run_world_size: int | None = opt(None, "with --dry_run / --check_only: plan or check for this many ranks "
                                               "(default: this job's)")
    check_only: bool = opt(False, "check the flags and inputs (paths, batch arithmetic for --dry_run_world_size "
                                  "ranks, the reward spec, the output folder and the checkpoint --resume_from "
                                  "names), then exit: 0 "
                                  "when they pass, 2 with one line naming the fix otherwise. The launchers run it "
                                  "before starting torchrun")
    dry_run_device_memory_gb: float = opt(80.0, "with --dry_run: memory per device (GiB) to check the plan against")
    ignore_memory_plan: bool = opt(False, "start even when the per-rank memory plan (--dry_run's peak) exceeds the "
                                          "device's memory: a warning instead of the error that a GPU/NPU run gets "
                                          "before any model loads (not checked on the CPU)")
