"""diffusers' attention dispatch for any family's transformer: the --attention_backend choice with its one-warning
fallback to torch SDPA, and the Ascend NPU's fused attention. Family-independent: every diffusers transformer whose
attention processors take a backend (``set_attention_backend``) is served alike."""
from __future__ import annotations

import warnings
from typing import Any

import torch

from fastvideo import devices, distributed
from fastvideo.models.base import config_get, model_config, model_dtype, unwrap_model

NPU_ATTENTION_BACKEND = "_native_npu"  # diffusers' AttentionBackendName._NATIVE_NPU: torch_npu.npu_fusion_attention


def set_npu_attention(model: Any) -> str:
    """Switch the model's attention to diffusers' NPU fused-attention backend; describe what happened."""
    setter = getattr(model, "set_attention_backend", None)
    try:
        from diffusers.models.attention_dispatch import AttentionBackendName

        offered = NPU_ATTENTION_BACKEND in {b.value for b in AttentionBackendName}
    except ImportError:
        offered = False
    if setter is None or not offered:
        reason = "this diffusers has no attention backends; upgrade diffusers (>= 0.35) for NPU fused attention"
    else:
        try:
            setter(NPU_ATTENTION_BACKEND)  # raises RuntimeError when diffusers finds no torch_npu
            return f"attention backend: {NPU_ATTENTION_BACKEND} (torch_npu.npu_fusion_attention)"
        except (RuntimeError, ValueError, ImportError) as err:
            reason = str(err)
    warnings.warn(f"NPU fused attention unavailable, keeping torch SDPA: {reason}", stacklevel=3)
    return f"attention backend: default SDPA ({NPU_ATTENTION_BACKEND} unavailable: {reason})"


FALLBACK_ATTENTION_BACKEND = "native"  # torch SDPA: runs everywhere, supports Ulysses context parallelism
_warned_backends: set[str] = set()


def attention_backend_names() -> list[str]:
    """diffusers' attention backend names (``AttentionBackendName``), e.g. native, flash, _native_flash, sage."""
    try:
        from diffusers.models.attention_dispatch import AttentionBackendName
    except ImportError:
        return []
    return [b.value for b in AttentionBackendName]


def check_attention_backend(name: str) -> None:
    """ValueError naming the choices when ``--attention_backend`` is not ``auto`` or a diffusers backend name (a
    typo is an error; an unavailable kernel is a fallback, at load time)."""
    if name == "auto":
        return
    names = attention_backend_names()
    if not names:
        raise ValueError(f"--attention_backend {name!r} needs diffusers' attention dispatcher (diffusers >= 0.35); "
                         "upgrade diffusers or use --attention_backend auto")
    if name not in names:
        raise ValueError(f"--attention_backend {name!r} is not a diffusers attention backend; use auto or one of "
                         f"{', '.join(names)}")


def _probe_attention(name: str, device: torch.device, dtype: torch.dtype, head_dim: int = 64) -> None:
    """Run the backend once on a tiny (1, 8, 2, head_dim) q/k/v, all three in ``dtype``: what the model passes
    (``ComputeDtypeRMSNorm`` keeps q/k in v's dtype, the compute dtype), so kernels that load but cannot run these
    inputs here raise now."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn  # heavy

    q, k, v = (torch.randn(1, 8, 2, head_dim, device=device, dtype=dtype) for _ in range(3))
    dispatch_attention_fn(q, k, v, backend=name)


def set_attention_backend(transformer: Any, name: str, device: torch.device | str,
                          dtype: torch.dtype = torch.bfloat16) -> str:
    """Use attention backend ``name`` in every attention layer of the transformer (all its forwards: rollout and
    replay alike); returns the backend in use. When the kernel or the hardware is unavailable (its package missing,
    not this device, not context-parallel capable under --sp_size, or a trial call fails), it falls back to
    ``native`` (torch SDPA) with one warning per process (rank 0 prints it). A CPU job always uses ``native``."""
    model = unwrap_model(transformer)
    device = torch.device(device)
    reason = None
    if name != FALLBACK_ATTENTION_BACKEND and device.type == "cpu":
        reason = "this is a CPU job, where only torch's native SDPA is used"
    elif name != FALLBACK_ATTENTION_BACKEND:
        try:
            model.set_attention_backend(name)
            _probe_attention(name, device, dtype, int(config_get(model_config(model), "attention_head_dim", 64)))
        except (RuntimeError, ValueError, ImportError, NotImplementedError, TypeError, AssertionError) as err:
            reason = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    if reason is None and name != FALLBACK_ATTENTION_BACKEND:
        return name
    model.set_attention_backend(FALLBACK_ATTENTION_BACKEND)  # also diffusers' process-wide default
    if reason is not None and name not in _warned_backends:
        _warned_backends.add(name)
        if distributed.is_main_process():
            warnings.warn(f"--attention_backend {name} is unavailable ({reason}); using "
                          f"{FALLBACK_ATTENTION_BACKEND} (torch SDPA) for every forward instead", stacklevel=2)
    return FALLBACK_ATTENTION_BACKEND


def attention_backend_of(transformer: Any) -> set[str]:
    """The backends the transformer's attention processors use (diffusers' ``_attention_backend``; None = default)."""
    model = unwrap_model(transformer)
    found = set()
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_attention_backend"):
            backend = processor._attention_backend
            found.add(getattr(backend, "value", backend))
    return found


def choose_attention(model: Any, device: torch.device | str, param_dtype: torch.dtype | None = None,
                     attention_backend: str = "auto") -> list[str]:
    """The attention kernel of a transformer whose processors dispatch through diffusers (FLUX.1, FLUX.2,
    Qwen-Image): ``--attention_backend`` where given (``set_attention_backend``); with ``auto``, on an NPU its fused
    attention when the forward's weights (``param_dtype``, default the stored ones) are bf16/fp16, else SDPA; on
    cuda / cpu nothing. Returns the start-up log lines."""
    dtype = param_dtype or model_dtype(model)
    if attention_backend != "auto":
        used = set_attention_backend(model, attention_backend, device, dtype)
        return [f"attention backend: {used}" + ("" if used == attention_backend else
                                                  f" (--attention_backend {attention_backend} unavailable)")]
    if devices.device_type(device) != "npu":
        return []
    if dtype in (torch.bfloat16, torch.float16):
        return [set_npu_attention(model)]
    return [f"attention backend: default SDPA ({NPU_ATTENTION_BACKEND} needs bf16/fp16 q, k, v; the weights are "
            f"{str(dtype).replace('torch.', '')} in the forward)"]
