"""FLOPs of the FLUX transformer and the device's measured matmul peak: what MFU (achieved ÷ peak FLOP/s) needs.

``transformer_flops`` is a closed formula over a ``FluxTransformer2DModel`` config (matmuls and attention, as
``torch.utils.flop_counter`` counts them: 2 FLOPs per multiply-add); ``counted_flops`` runs a function under
``FlopCounterMode`` with this CPU's flash-attention kernels added (torch does not count them), so the formula is
checked against the counter (tests/test_performance.py). Model FLOPs exclude the recomputation gradient
checkpointing adds.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Mapping

import torch


def _cfg(config: Any, key: str, default: Any = None) -> Any:
    return config.get(key, default) if isinstance(config, Mapping) else getattr(config, key, default)


def transformer_flops(config: Any, image_tokens: int, text_tokens: int, batch: int = 1, *,
                      backward: bool = False) -> int:
    """FLOPs of one FLUX transformer forward (``backward``: forward + backward = 3x, input and weight gradients) on
    ``batch`` samples of ``image_tokens`` packed image tokens and ``text_tokens`` T5 tokens.

    Per sample, with width D, N = L + T tokens: each double block 24·N·D² (img and txt q/k/v/out and 4x MLPs)
    + 4·N²·D (QKᵀ and AV) + 24·D² (two adaLN D->6D), each single block 24·N·D² + 4·N²·D + 6·D², plus the
    embedders (x, context, timestep/guidance/pooled MLPs) and the output adaLN and projection.
    """
    D = _cfg(config, "num_attention_heads") * _cfg(config, "attention_head_dim")
    L, T = int(image_tokens), int(text_tokens)
    N = L + T
    in_ch = _cfg(config, "in_channels", 64)
    out_ch = (_cfg(config, "out_channels") or in_ch) * _cfg(config, "patch_size", 1) ** 2
    joint, pooled = _cfg(config, "joint_attention_dim"), _cfg(config, "pooled_projection_dim")
    embedders = 2 * L * in_ch * D + 2 * T * joint * D
    embedders += 2 * (256 * D + D * D) * (2 if _cfg(config, "guidance_embeds", False) else 1)  # timestep (+ guidance)
    embedders += 2 * (pooled * D + D * D)  # pooled text
    double = _cfg(config, "num_layers") * (24 * N * D * D + 4 * N * N * D + 24 * D * D)
    single = _cfg(config, "num_single_layers") * (24 * N * D * D + 4 * N * N * D + 6 * D * D)
    output = 2 * D * 2 * D + 2 * L * D * out_ch
    forward = batch * (embedders + double + single + output)
    return 3 * forward if backward else forward


def _cpu_flash_mapping() -> dict:
    """FlopCounterMode formulas for the CPU flash-attention ops, which torch's table lacks (same count as its sdpa)."""
    from torch.utils import flop_counter as fc

    def forward(query, key, value, *args, out_shape=None, **kwargs) -> int:
        return fc.sdpa_flop_count(query, key, value)

    def backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
        return fc.sdpa_backward_flop_count(grad_out, query, key, value)

    aten = torch.ops.aten
    return {aten._scaled_dot_product_flash_attention_for_cpu: forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: backward}


def counted_flops(fn: Callable[[], Any]) -> int:
    """FLOPs that ``fn()`` executes, by ``torch.utils.flop_counter`` (with the CPU flash-attention ops counted)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False, custom_mapping=_cpu_flash_mapping()) as counter:
        fn()
    return int(counter.get_total_flops())


def peak_matmul_flops(device: torch.device | str, dtype: torch.dtype, size: int | None = None,
                      seconds: float = 1.0) -> float:
    """Sustained FLOP/s of a large ``torch.mm`` (size² @ size²: 2048 on a CPU, 8192 on an accelerator) in ``dtype``
    on ``device``, repeated for ``seconds``: the hardware limit MFU divides by. Run it on every rank at once (ranks
    sharing a host share its cores and memory, as they do during training) and sum the ranks' rates."""
    from fastvideo import devices

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
