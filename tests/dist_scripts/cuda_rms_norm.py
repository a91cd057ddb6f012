"""CUDA autocast's float32 ``rms_norm`` on the CPU, and a trainer run under it (the one CUDA autocast behaviour that
broke --sp_size > 1 and the flash backends: ``norm_q``/``norm_k`` returned float32 while v stayed bf16).

CUDA autocast lists ``rms_norm`` among its float32 ops (``AutocastCUDA`` has a kernel for it); CPU autocast does not.
``float32_rms_norm`` registers the same policy for ``AutocastCPU``: inputs and weight upcast to float32, output
float32.

    python cuda_rms_norm.py train_grpo_flux.py FLAGS...   # under torchrun: that trainer with CUDA's rms_norm policy
"""
from __future__ import annotations

import contextlib
import runpy
import sys
from pathlib import Path
from typing import Iterator

import torch


def _float32_rms_norm(input, normalized_shape, weight=None, eps=None):
    """aten::rms_norm as CUDA autocast runs it: everything upcast to float32 (autocast excluded inside)."""
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)):
        return torch.ops.aten.rms_norm(input.float(), normalized_shape,
                                       None if weight is None else weight.float(), eps)


@contextlib.contextmanager
def float32_rms_norm() -> Iterator[None]:
    """While inside: ``aten::rms_norm`` under CPU autocast runs in float32, as CUDA autocast runs it."""
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("rms_norm", _float32_rms_norm, "AutocastCPU")
    try:
        yield
    finally:
        lib._destroy()


if __name__ == "__main__":
    contextlib.ExitStack().enter_context(float32_rms_norm())  # for the whole process
    script = Path(sys.argv[1])
    if not script.is_absolute():
        script = Path(__file__).resolve().parents[2] / script
    sys.argv = [str(script), *sys.argv[2:]]
    sys.path.insert(0, str(script.parent))
    runpy.run_path(str(script), run_name="__main__")
