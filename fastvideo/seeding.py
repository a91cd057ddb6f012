"""Seeds, deterministic mode and the noise source.

Every random tensor the trainers use is drawn from a generator seeded by
``(seed, step, prompt id, sample index, purpose)`` (docs/design.md principle 4), on the CPU by default, so
CUDA, NPU and CPU runs see identical noise and results do not depend on world size or batch layout.
"""
from __future__ import annotations

import hashlib
import os
import random
from typing import Sequence

import numpy as np
import torch

from fastvideo import devices


def seed_all(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices) for anything not drawn from a NoiseSource."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# Env vars read when the process group / accelerator context starts: set them before init_process_group.
DETERMINISTIC_ENV: dict[str, str] = {
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",  # cuBLAS: a fixed workspace, so GEMM reductions run in one order
    "HCCL_DETERMINISTIC": "true",  # Ascend HCCL: deterministic AllReduce / ReduceScatter / Reduce
}


def deterministic_env() -> list[str]:
    """Set the deterministic env vars (a value already exported wins); safe, and needed, before the process group
    and the CUDA/NPU context start. Returns ``NAME=value`` as now in effect."""
    for name, value in DETERMINISTIC_ENV.items():
        os.environ.setdefault(name, value)
    return [f"{name}={os.environ[name]}" for name in DETERMINISTIC_ENV]


def set_deterministic(enabled: bool = True) -> list[str]:
    """Deterministic algorithms on every device type (slower on accelerators): the env vars of
    ``deterministic_env``, torch's deterministic mode (torch_npu honours it too) and the libraries' switches of
    ``devices.deterministic_switches``. Returns what it set, in order (nothing when not ``enabled``).

    torch's deterministic mode would also fill every ``torch.empty`` with NaN (integers: their maximum), which costs a
    memory write per allocation -- every FSDP all-gather buffer on every forward -- and only matters to code that
    reads memory before writing it. Ours does not (rollout's buffers are written whole before any read; weights are
    read into every local shard, strictly; collectives fill their outputs), so ``fill_uninitialized_memory`` is
    turned off and the run stays deterministic.
    """
    if not enabled:
        return []
    done = deterministic_env()
    torch.use_deterministic_algorithms(True, warn_only=True)
    done.append("torch.use_deterministic_algorithms(True, warn_only=True)")
    try:
        import torch.utils.deterministic as torch_deterministic
    except ImportError:  # torch < 2.1
        torch_deterministic = None
    if hasattr(torch_deterministic, "fill_uninitialized_memory"):
        torch_deterministic.fill_uninitialized_memory = False
        done.append("torch.utils.deterministic.fill_uninitialized_memory = False (no NaN fill of every allocation)")
    return done + devices.deterministic_switches()


def derive_seed(seed: int, *keys: int | str) -> int:
    """A 63-bit seed that is a pure function of ``seed`` and ``keys`` (stable across runs/machines)."""
    text = "/".join([str(int(seed))] + [str(k) for k in keys])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & (2**63 - 1)


def generator(seed: int, *keys: int | str, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch.Generator on ``device`` seeded by ``derive_seed(seed, *keys)``."""
    g = torch.Generator(device=device)
    g.manual_seed(derive_seed(seed, *keys))
    return g


class NoiseSource:
    """Draws random tensors keyed by what they are for.

    ``randn(shape, step=, prompt_id=, sample_index=, purpose=)`` always returns the same tensor for
    the same key, whatever rank or batch asks for it. Noise is generated on ``device`` (CPU by
    default, so all device types agree) and moved to ``out_device``.
    """

    def __init__(self, seed: int, device: str | torch.device = "cpu"):
        self.seed = int(seed)
        self.device = torch.device(device)

    def _gen(self, step: int, prompt_id: int, sample_index: int, purpose: str) -> torch.Generator:
        return generator(self.seed, int(step), int(prompt_id), int(sample_index), purpose, device=self.device)

    def randn(self, shape: Sequence[int], *, step: int, prompt_id: int, sample_index: int, purpose: str,
              out_device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Standard normal tensor of ``shape`` for one (step, prompt, sample, purpose)."""
        g = self._gen(step, prompt_id, sample_index, purpose)
        x = torch.randn(tuple(shape), generator=g, device=self.device, dtype=torch.float32)
        return x.to(device=out_device or self.device, dtype=dtype)

    def batch_randn(self, shape: Sequence[int], *, step: int, prompt_ids: Sequence[int],
                    sample_indices: Sequence[int], purpose: str, out_device: torch.device | str | None = None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Stack of per-sample ``randn`` draws -> (B, *shape); independent of batch composition."""
        draws = [self.randn(shape, step=step, prompt_id=p, sample_index=s, purpose=purpose)
                 for p, s in zip(prompt_ids, sample_indices)]
        return torch.stack(draws).to(device=out_device or self.device, dtype=dtype)

    def rand(self, shape: Sequence[int], *, step: int, prompt_id: int, sample_index: int, purpose: str) -> torch.Tensor:
        """Uniform [0, 1) tensor on the noise device for one key."""
        g = self._gen(step, prompt_id, sample_index, purpose)
        return torch.rand(tuple(shape), generator=g, device=self.device)

    def randint(self, low: int, high: int, *, step: int, prompt_id: int, sample_index: int, purpose: str) -> int:
        """One integer in [low, high) for one key."""
        g = self._gen(step, prompt_id, sample_index, purpose)
        return int(torch.randint(low, high, (1,), generator=g, device=self.device).item())

    def randperm(self, n: int, *, step: int, prompt_id: int, sample_index: int, purpose: str) -> torch.Tensor:
        """A permutation of range(n) for one key."""
        g = self._gen(step, prompt_id, sample_index, purpose)
        return torch.randperm(n, generator=g, device=self.device)


def rng_state() -> dict:
    """Global RNG states (Python, NumPy, torch CPU and accelerator) for checkpoints."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    state.update(devices.accelerator_rng_state())  # "cuda" / "npu": per-device states where the host has them
    return state


def set_rng_state(state: dict) -> None:
    """Restore what ``rng_state`` returned (an accelerator entry this host has no device for is skipped)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    devices.set_accelerator_rng_state(state)
