"""The one module that knows device types (cuda, npu, cpu) beyond torch.distributed.

Everything device-specific the trainers do besides collectives goes through here: synchronise, side streams and
events, free the cache, memory statistics, autocast, accelerator RNG state and the libraries' deterministic switches.
The same call serves CUDA, Ascend NPU and CPU. ``torch_npu`` (which registers ``torch.npu``, the "npu" device and its
autocast) is imported only when it is installed, and only when an NPU question is asked.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import platform
import resource
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, ContextManager, Iterator

import torch

ACCELERATOR_TYPES: tuple[str, ...] = ("cuda", "npu")  # device types with a torch.<type> module and an RNG state

_NPU_IMPORTED: bool | None = None  # import_npu's answer, once known


def import_npu() -> bool:
    """Import ``torch_npu`` if it is installed (registering ``torch.npu``); False when absent. Cached."""
    global _NPU_IMPORTED
    if _NPU_IMPORTED is None:
        _NPU_IMPORTED = False
        if importlib.util.find_spec("torch_npu") is not None:
            try:
                import torch_npu  # noqa: F401  (registers torch.npu and the "npu" device type)
            except (ImportError, OSError, RuntimeError) as err:  # installed but unusable (e.g. CANN not sourced)
                print(f"warning: torch_npu is installed but does not import ({err}); NPU disabled: source CANN's "
                      "set_env.sh or uninstall torch_npu", file=sys.stderr, flush=True)
            else:
                _NPU_IMPORTED = hasattr(torch, "npu")
    return _NPU_IMPORTED


def device_type(device: torch.device | str) -> str:
    """The device type of ``device`` ("cuda", "npu", "cpu", ...), also for an "npu" string without torch_npu."""
    if isinstance(device, torch.device):
        return device.type
    return str(device).split(":")[0]


def device_module(device: torch.device | str) -> ModuleType | None:
    """``torch.cuda`` / ``torch.npu`` for an accelerator device, None for the CPU (or an NPU without torch_npu)."""
    kind = device_type(device)
    if kind == "cuda":
        return torch.cuda
    if kind == "npu" and import_npu():
        return getattr(torch, "npu", None)
    return None


def _available_module(kind: str) -> ModuleType | None:
    """The torch module of accelerator type ``kind`` if this host has such a device."""
    module = device_module(kind)
    return module if module is not None and module.is_available() else None


def synchronize(device: torch.device | str) -> None:
    """Wait for the work queued on ``device`` (for honest timings); a no-op on the CPU."""
    module = device_module(device)
    if module is not None and hasattr(module, "synchronize"):
        module.synchronize(device)


def new_stream(device: torch.device | str) -> Any | None:
    """A new stream of ``device`` (an accelerator's own queue of work, e.g. for a reward scored beside the sampling
    loop); None on the CPU, whose work runs in the calling thread as it is issued."""
    module = device_module(device)
    return module.Stream(device=device) if module is not None else None


def record_event(device: torch.device | str) -> Any | None:
    """An event recorded on ``device``'s current stream: done once the work queued there so far is (no host sync);
    None on the CPU (work issued there is already done)."""
    module = device_module(device)
    if module is None:
        return None
    event = module.Event()
    event.record(module.current_stream(device))
    return event


@contextlib.contextmanager
def on_stream(stream: Any | None, after: Any | None = None, tensors: tuple[torch.Tensor, ...] = ()
              ) -> Iterator[None]:
    """Queue the block's device work on ``stream`` (``new_stream``; its device becomes the thread's current device),
    behind the event ``after`` (``record_event`` on the stream that made ``tensors``), with ``tensors`` marked as used
    there, so that the caching allocator does not hand their memory to other work before ``stream`` is done with them.
    Nothing waits on the host. A null context on the CPU (``stream`` None)."""
    if stream is None:
        yield
        return
    if after is not None:
        stream.wait_event(after)
    for tensor in tensors:
        tensor.record_stream(stream)
    with device_module(stream.device).stream(stream):
        yield


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` on ``device`` without blocking the host: a CPU tensor bound for an accelerator is copied from pinned
    memory with ``non_blocking=True`` (a pageable copy waits for the stream, i.e. is a host sync); a tensor already on
    ``device`` is returned as it is. For CPU-drawn noise and index tensors entering the sampling and replay loops."""
    device = torch.device(device)
    if tensor.device == device or (tensor.device.type == device.type and device.index is None):
        return tensor
    if tensor.device.type == "cpu" and device.type in ACCELERATOR_TYPES:
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def empty_cache(device: torch.device | str) -> None:
    """Return the allocator's cached blocks on ``device`` to the driver; a no-op on the CPU."""
    module = device_module(device)
    if module is not None and hasattr(module, "empty_cache"):
        module.empty_cache()


def _host_peak_gb() -> float:
    """Peak resident set size of this process since start or ``reset_peak_memory`` (Linux VmHWM; elsewhere
    ru_maxrss: KiB on Linux, bytes on macOS)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform != "darwin" else peak / 2**30


def _host_current_gb() -> float:
    """Resident set size of this process now (the peak so far where /proc is missing)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError):  # not Linux: the peak so far is the best available figure
        return _host_peak_gb()


def memory_allocated_gb(device: torch.device | str) -> float:
    """Memory in use now: the accelerator allocator's bytes, or the CPU resident set size, in GiB."""
    module = device_module(device)
    if module is not None and hasattr(module, "memory_allocated"):
        return module.memory_allocated(device) / 2**30
    return _host_current_gb()


def max_memory_allocated_gb(device: torch.device | str) -> float:
    """Peak memory since the last reset: accelerator allocator peak, or the CPU max resident set size, in GiB."""
    module = device_module(device)
    if module is not None and hasattr(module, "max_memory_allocated"):
        return module.max_memory_allocated(device) / 2**30
    return _host_peak_gb()


def total_memory_bytes(device: torch.device | str) -> int | None:
    """Total memory of an accelerator device in bytes (``get_device_properties(...).total_memory`` of torch.cuda /
    torch.npu): what a run's memory plan must fit in. None for the CPU, whose RAM is shared with everything else."""
    module = device_module(device)
    if module is None or not hasattr(module, "get_device_properties"):
        return None
    if isinstance(device, torch.device):
        index = device.index
    else:  # parsed by hand: torch.device("npu:0") needs torch_npu's registration
        suffix = str(device).partition(":")[2]
        index = int(suffix) if suffix else None
    return int(module.get_device_properties(module.current_device() if index is None else index).total_memory)


def reset_peak_memory(device: torch.device | str) -> None:
    """Start a new peak for ``max_memory_allocated_gb``: the accelerator allocator's, or on a Linux CPU the process's
    peak RSS (VmHWM, reset through /proc/self/clear_refs; elsewhere a no-op: the max RSS cannot reset)."""
    module = device_module(device)
    if module is not None and hasattr(module, "reset_peak_memory_stats"):
        module.reset_peak_memory_stats(device)
    elif module is None:
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass


def autocast(device: torch.device | str, dtype: torch.dtype | None) -> ContextManager:
    """``torch.autocast`` to ``dtype`` on the device's type ("npu" once torch_npu is imported), or a null context
    for ``dtype=None`` (full precision)."""
    if dtype is None:
        return contextlib.nullcontext()
    kind = device_type(device)
    if kind == "npu":
        import_npu()  # registers "npu" as an autocast device type
    return torch.autocast(device_type=kind, dtype=dtype)


def accelerator_rng_state() -> dict[str, Any]:
    """Per-device RNG states of each accelerator type this host has, keyed "cuda" / "npu" (empty on a CPU host)."""
    state = {}
    for kind in ACCELERATOR_TYPES:
        module = _available_module(kind)
        if module is not None:
            state[kind] = module.get_rng_state_all()
    return state


def set_accelerator_rng_state(state: dict[str, Any]) -> None:
    """Restore the "cuda" / "npu" entries of ``state`` on the accelerators this host has; others are ignored (a
    checkpoint from another device type, or one from before the entry existed)."""
    for kind in ACCELERATOR_TYPES:
        if kind in state:
            module = _available_module(kind)
            if module is not None:
                module.set_rng_state_all(state[kind])


def deterministic_switches() -> list[str]:
    """Turn on the accelerator libraries' deterministic / full-float32 switches (cuDNN, TF32, Ascend HF32) so that
    float32 math is not silently done in a 10-bit-mantissa format; returns the assignments it made."""
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    done = ["torch.backends.cudnn.deterministic = True", "torch.backends.cudnn.benchmark = False",
            "torch.backends.cuda.matmul.allow_tf32 = False", "torch.backends.cudnn.allow_tf32 = False"]
    npu = device_module("npu")
    for group in ("matmul", "conv"):  # torch_npu's HF32 switches (conv defaults to True, matmul to False)
        switches = getattr(npu, group, None)
        if switches is not None and hasattr(switches, "allow_hf32"):
            switches.allow_hf32 = False
            done.append(f"torch.npu.{group}.allow_hf32 = False")
    return done


def device_name(device: torch.device | str) -> str:
    """A readable name of the device (e.g. "NVIDIA H100 80GB HBM3", "Ascend910B3", "x86_64 CPU")."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "npu":
        return str(torch.npu.get_device_name(device))
    return f"{platform.processor() or platform.machine()} CPU"


def compute_dtype(mixed_precision: str, device: torch.device) -> torch.dtype | None:
    """Autocast dtype for model calls: bf16, or None for fp32 ('auto' = bf16 on GPU/NPU, fp32 on CPU)."""
    if mixed_precision == "auto":
        mixed_precision = "fp32" if device.type == "cpu" else "bf16"
    return torch.bfloat16 if mixed_precision == "bf16" else None
