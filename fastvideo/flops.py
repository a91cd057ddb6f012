"""Model FLOPs and the device's measured matmul peak: what MFU (achieved ÷ peak FLOP/s) needs.

Each family adapter has a closed formula for its transformer (``ModelFamily.transformer_flops``: matmuls and
attention, as ``torch.utils.flop_counter`` counts them, 2 FLOPs per multiply-add); ``counted_flops`` runs a function
under ``FlopCounterMode`` with this CPU's flash-attention kernels added (torch does not count them), so each formula is
checked against the counter (tests/test_performance.py, tests/test_family_*.py). Model FLOPs exclude the recomputation
gradient checkpointing adds.

In training, ``FlopMeter`` counts every forward of the transformers it is attached to by their family's formula (cached
per shape) into the phase ``phase()`` names ("rollout" inside ``rollout.rollout``, else "train"), and ``resolve_peak``
picks the peak the logged ``mfu`` divides by (--peak_tflops, a datasheet value by device name, or measured).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import time
from typing import Any, Callable, Iterator, Mapping

import torch

from fastvideo import devices, models
from fastvideo.models.base import model_config, unwrap_model


def _cpu_flash_mapping() -> dict:
    """FlopCounterMode formulas for the CPU flash-attention ops, which torch's table lacks (same count as its sdpa)."""
    from torch.utils import flop_counter as fc  # heavy

    def forward(query, key, value, *args, out_shape=None, **kwargs) -> int:
        return fc.sdpa_flop_count(query, key, value)

    def backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
        return fc.sdpa_backward_flop_count(grad_out, query, key, value)

    aten = torch.ops.aten
    return {aten._scaled_dot_product_flash_attention_for_cpu: forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: backward}


def counted_flops(fn: Callable[[], Any]) -> int:
    """FLOPs that ``fn()`` executes, by ``torch.utils.flop_counter`` (with the CPU flash-attention ops counted)."""
    from torch.utils.flop_counter import FlopCounterMode  # heavy

    with FlopCounterMode(display=False, custom_mapping=_cpu_flash_mapping()) as counter:
        fn()
    return int(counter.get_total_flops())


def peak_matmul_flops(device: torch.device | str, dtype: torch.dtype, size: int | None = None,
                      seconds: float = 1.0) -> float:
    """Sustained FLOP/s of a large ``torch.mm`` (size² @ size²: 2048 on a CPU, 8192 on an accelerator) in ``dtype``
    on ``device``, repeated for ``seconds``: the hardware limit MFU divides by. Run it on every rank at once (ranks
    sharing a host share its cores and memory, as they do during training) and sum the ranks' rates."""
    device = torch.device(device)
    n = size or (2048 if device.type == "cpu" else 8192)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.mm(a, b)
    devices.synchronize(device)
    calls, t0 = 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - t0 < seconds:
        torch.mm(a, b)
        calls += 1
        if calls % 4 == 0:
            devices.synchronize(device)
    devices.synchronize(device)
    return 2 * n ** 3 * calls / (time.perf_counter() - t0)


# ------------------------------------------------------------------------------------------------- in training
_PHASE: contextvars.ContextVar[str | None] = contextvars.ContextVar("fastvideo_flop_phase", default="train")


@contextlib.contextmanager
def phase(name: str | None) -> Iterator[None]:
    """Count the forwards inside under ``name`` ("rollout", "train"; None: not counted, e.g. evaluation, and then
    neither is anything nested inside, whatever phase it names)."""
    if _PHASE.get() is None:
        yield
        return
    token = _PHASE.set(name)
    try:
        yield
    finally:
        _PHASE.reset(token)


class FlopMeter:
    """Model FLOPs of this rank, per phase: a forward pre-hook on each attached transformer adds its forward's FLOPs
    (``transformer_flops`` of the input shapes, cached per shape; a forward under grad also counts its backward,
    which follows it in training) divided by the sequence-parallel degree (each rank of an SP group does 1/sp)."""

    def __init__(self, sp_size: int = 1) -> None:
        self.sp_size = sp_size
        self.totals: dict[str, float] = {}
        self._handles: list[Any] = []

    def attach(self, model: Any) -> None:
        """Count ``model``'s forwards (a transformer of any model family, bare or wrapped: hooked on the inner module;
        its family's ``forward_tokens`` reads the shapes and ``transformer_flops`` counts them)."""
        family = models.family_of(model)
        config = dict(model_config(model))
        inner = unwrap_model(model)
        # LoRA (frozen base weights): the backward computes input gradients only
        weight_grads = any(p.requires_grad for n, p in inner.named_parameters() if "lora_" not in n)

        @functools.lru_cache(maxsize=256)
        def flops_of(batch: int, image_tokens: int, text_tokens: int, backward: bool) -> int:
            return family.transformer_flops(config, image_tokens, text_tokens, batch, backward=backward,
                                            weight_grads=weight_grads)

        def hook(module, args, kwargs):
            name = _PHASE.get()
            if name is None:
                return
            tokens = family.forward_tokens(args, kwargs)
            if tokens is None:
                return
            flops = flops_of(*(int(t) for t in tokens), torch.is_grad_enabled())
            self.totals[name] = self.totals.get(name, 0.0) + flops / self.sp_size

        self._handles.append(inner.register_forward_pre_hook(hook, with_kwargs=True))

    def take(self) -> dict[str, float]:
        """FLOPs per phase since the last ``take`` (and reset)."""
        out, self.totals = self.totals, {}
        return out


# bf16 dense TFLOP/s per device from vendors' datasheets (no sparsity), matched against the device name
DATASHEET_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "H800": 989.4, "A100": 312.0, "A800": 312.0,
                         "910B": 313.0}


def resolve_peak(peak_tflops: float, device: torch.device | str, dtype: torch.dtype) -> tuple[float, str]:
    """``(peak FLOP/s per device, where it came from)``: --peak_tflops if > 0; in a bf16 run on an accelerator the
    datasheet value of a known device name; else a measured large-matmul rate in ``dtype`` (half a second; call it on
    every rank at once, as ranks sharing a host share its cores)."""
    device = torch.device(device)
    if peak_tflops > 0:
        return peak_tflops * 1e12, "--peak_tflops"
    if device.type != "cpu" and dtype == torch.bfloat16:
        name = devices.device_name(device)
        for key, value in DATASHEET_BF16_TFLOPS.items():
            if key in name:
                return value * 1e12, f"datasheet bf16 ({name})"
    size = 1024 if device.type == "cpu" else None
    return peak_matmul_flops(device, dtype, size=size, seconds=0.5), f"measured {str(dtype)[6:]} matmul"


def throughput_metrics(flops: Mapping[str, float], seconds: Mapping[str, float], peak: float) -> dict[str, float]:
    """``tflops_rollout``, ``tflops_train`` (this rank's model TFLOP/s in each phase: its FLOPs / the phase's seconds)
    and ``mfu`` (all of the step's model FLOPs / the step's seconds / ``peak``); ``seconds``: rollout, train, step."""
    out = {}
    for name in ("rollout", "train"):
        if flops.get(name) and seconds.get(name):
            out[f"tflops_{name}"] = flops[name] / seconds[name] / 1e12
    if seconds.get("step"):
        out["mfu"] = sum(flops.values()) / seconds["step"] / peak
    return out
