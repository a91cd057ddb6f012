"""fastvideo.devices (one code path for CUDA / Ascend NPU / CPU) and FLUX's float32 rotary embedding.

The CPU fallbacks run for real on a host made accelerator-free (``no_accelerator``: torch_npu unimportable, CUDA
reported absent) whatever this machine has; the CUDA and NPU branches run against a fake ``torch.cuda`` /
``torch.npu``. No assertion depends on the host's hardware.
"""
from __future__ import annotations

import contextlib
import copy
import random
import sys
import types
import warnings

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fastvideo import devices, distributed, logging, seeding
from fastvideo.models import flux

FLUX_DEV_AXES = (16, 56, 56)  # FLUX.1-dev's axes_dims_rope
TINY_AXES = [(4, 6, 6), (8, 28, 28)]  # fastvideo.tiny presets "tiny" and "bench"


# ------------------------------------------------------------------------------------------- CPU fallbacks
@pytest.fixture
def no_accelerator(monkeypatch) -> None:
    """A host without accelerators whatever this one has: torch_npu unimportable, CUDA reported absent."""
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # find_spec -> None, as when it is not installed
    monkeypatch.setattr(devices, "_NPU_IMPORTED", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_torch_npu_absent_means_no_npu(no_accelerator):
    assert devices.import_npu() is False
    assert devices.import_npu() is False  # cached, still False
    assert distributed.npu_available() is False
    assert devices.device_module("cpu") is None
    assert devices.device_module(torch.device("cpu")) is None
    assert devices.device_module("npu:0") is None
    assert devices.device_module("cuda:1") is torch.cuda
    assert devices.device_module(torch.device("cuda")) is torch.cuda
    assert devices.device_type("npu:3") == "npu" and devices.device_type(torch.device("cpu")) == "cpu"


def test_cpu_sync_cache_and_memory_are_sane():
    cpu = torch.device("cpu")
    devices.synchronize(cpu)
    devices.empty_cache("cpu")
    devices.reset_peak_memory(cpu)
    now, peak = devices.memory_allocated_gb(cpu), devices.max_memory_allocated_gb("cpu")
    assert 0.01 < now < 1024 and 0.01 < peak < 1024  # this process's RSS: at least torch's own code
    assert peak >= now * 0.9
    assert logging.peak_memory_gb(cpu) >= peak * 0.99
    assert logging.current_memory_gb(cpu) == pytest.approx(now, rel=0.2)


def test_autocast_on_cpu():
    assert isinstance(devices.autocast("cpu", None), contextlib.nullcontext)
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with devices.autocast(torch.device("cpu"), None):
        assert (a @ b).dtype == torch.float32
    with devices.autocast("cpu", torch.bfloat16):
        assert (a @ b).dtype == torch.bfloat16


def _draw() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3)


def test_rng_state_round_trip_on_cpu(no_accelerator):
    state = seeding.rng_state()
    assert set(state) == {"python", "numpy", "torch"}  # no accelerator entry on a CPU host
    first = _draw()
    seeding.set_rng_state(state)
    again = _draw()
    assert first[:2] == again[:2] and torch.equal(first[2], again[2])


def test_rng_state_reads_checkpoints_with_or_without_accelerator_entries(no_accelerator):
    base = seeding.rng_state()
    first = _draw()
    seeding.set_rng_state(base)  # an old checkpoint with neither "cuda" nor "npu"
    assert torch.equal(_draw()[2], first[2])
    # a CUDA / NPU run's checkpoint resumed on this CPU host: the accelerator entries are skipped
    seeding.set_rng_state({**base, "cuda": [torch.zeros(16, dtype=torch.uint8)], "npu": [torch.ones(8)]})
    assert torch.equal(_draw()[2], first[2])


# ----------------------------------------------------------------------------------- NPU branches, faked
class FakeNPU(types.ModuleType):
    """The parts of ``torch.npu`` (and of ``torch.cuda``: the same API) that devices.py uses, recording calls."""

    def __init__(self):
        super().__init__("torch.npu")
        self.calls: list[tuple] = []
        self.rng = [torch.arange(8, dtype=torch.uint8), torch.arange(8, 16, dtype=torch.uint8)]
        self.matmul = types.SimpleNamespace(allow_hf32=True)
        self.conv = types.SimpleNamespace(allow_hf32=True)

    def is_available(self) -> bool:
        return True

    def synchronize(self, device=None) -> None:
        self.calls.append(("synchronize", device))

    def empty_cache(self) -> None:
        self.calls.append(("empty_cache",))

    def memory_allocated(self, device=None) -> int:
        return 3 * 2**30

    def max_memory_allocated(self, device=None) -> int:
        return 5 * 2**30

    def reset_peak_memory_stats(self, device=None) -> None:
        self.calls.append(("reset_peak_memory_stats", device))

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [s.clone() for s in self.rng]

    def set_rng_state_all(self, states) -> None:
        self.calls.append(("set_rng_state_all", [s.clone() for s in states]))


@pytest.fixture
def fake_npu(monkeypatch) -> FakeNPU:
    npu = FakeNPU()
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    monkeypatch.setattr(devices, "import_npu", lambda: True)
    return npu


def test_npu_branches_use_torch_npu(fake_npu):
    assert devices.device_module("npu:0") is fake_npu
    assert distributed.npu_available()
    devices.synchronize("npu:0")
    devices.empty_cache("npu")
    devices.reset_peak_memory("npu:1")
    assert fake_npu.calls == [("synchronize", "npu:0"), ("empty_cache",), ("reset_peak_memory_stats", "npu:1")]
    assert devices.memory_allocated_gb("npu:0") == 3.0
    assert devices.max_memory_allocated_gb("npu:0") == 5.0
    assert logging.peak_memory_gb("npu:0") == 5.0
    assert isinstance(devices.autocast("npu", None), contextlib.nullcontext)
    devices.synchronize("cpu")  # the CPU still asks no module
    assert len(fake_npu.calls) == 3


@pytest.fixture(params=["cuda", "npu"])
def fake_accelerator(request, monkeypatch, no_accelerator) -> tuple[str, FakeNPU]:
    """A host with exactly one accelerator type, faked: ``torch.cuda`` or ``torch.npu`` is a recording FakeNPU."""
    kind, fake = request.param, FakeNPU()
    monkeypatch.setattr(torch, kind, fake, raising=False)
    monkeypatch.setattr(devices, "import_npu", lambda: kind == "npu")
    return kind, fake


def test_accelerator_rng_state_is_stored_and_restored(fake_accelerator):
    kind, fake = fake_accelerator
    state = seeding.rng_state()
    assert set(state) == {"python", "numpy", "torch", kind}
    assert [torch.equal(a, b) for a, b in zip(state[kind], fake.rng)] == [True, True]
    seeding.set_rng_state(state)
    (name, restored), = fake.calls
    assert name == "set_rng_state_all" and all(torch.equal(a, b) for a, b in zip(restored, fake.rng))
    fake.calls.clear()
    seeding.set_rng_state({k: v for k, v in state.items() if k != kind})  # a checkpoint from another device type
    assert fake.calls == []


@pytest.fixture
def restore_global_switches(monkeypatch):
    """Put back torch's global deterministic/precision switches and the env vars set_deterministic touches."""
    import torch.utils.deterministic as torch_deterministic

    for name in seeding.DETERMINISTIC_ENV:
        monkeypatch.delenv(name, raising=False)
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
             torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch_deterministic.fill_uninitialized_memory)
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32,
     torch.backends.cudnn.allow_tf32, torch_deterministic.fill_uninitialized_memory) = saved[2:]


def test_set_deterministic_sets_and_lists_every_switch(fake_npu, restore_global_switches, monkeypatch):
    import os

    assert seeding.set_deterministic(False) == []
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    monkeypatch.setenv("HCCL_DETERMINISTIC", "strict")  # an exported value wins
    done = seeding.set_deterministic(True)
    assert done == ["CUBLAS_WORKSPACE_CONFIG=:4096:8", "HCCL_DETERMINISTIC=strict",
                    "torch.use_deterministic_algorithms(True, warn_only=True)",
                    "torch.utils.deterministic.fill_uninitialized_memory = False (no NaN fill of every allocation)",
                    "torch.backends.cudnn.deterministic = True", "torch.backends.cudnn.benchmark = False",
                    "torch.backends.cuda.matmul.allow_tf32 = False", "torch.backends.cudnn.allow_tf32 = False",
                    "torch.npu.matmul.allow_hf32 = False", "torch.npu.conv.allow_hf32 = False"]
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert fake_npu.matmul.allow_hf32 is False and fake_npu.conv.allow_hf32 is False
    import torch.utils.deterministic as torch_deterministic

    assert torch_deterministic.fill_uninitialized_memory is False  # no write per torch.empty (FSDP buffers)


def test_deterministic_env_only_touches_env(restore_global_switches):
    import os

    assert seeding.deterministic_env() == ["CUBLAS_WORKSPACE_CONFIG=:4096:8", "HCCL_DETERMINISTIC=true"]
    assert os.environ["HCCL_DETERMINISTIC"] == "true"
    assert not torch.are_deterministic_algorithms_enabled()


# ------------------------------------------------------------------------------------ float32 FLUX rotary
def _flux_ids(height: int = 2048, width: int = 2048, text_tokens: int = 512) -> torch.Tensor:
    """(text + image) rotary ids as FluxTransformer2DModel concatenates them, for FLUX's VAE (factor 8, 16 ch)."""
    geometry = flux.LatentGeometry(height, width, 8, 16)
    return torch.cat([flux.text_ids(text_tokens), flux.image_ids(geometry)])


def _max_diff(ids: torch.Tensor, axes: tuple[int, ...], theta: int = 10000) -> float:
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    ref_cos, ref_sin = FluxPosEmbed(theta, list(axes))(ids)  # float64 angles on the CPU
    cos, sin = flux.Float32FluxPosEmbed(theta, list(axes))(ids)
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == ref_cos.shape == (len(ids), sum(axes))
    return max((cos - ref_cos).abs().max().item(), (sin - ref_sin).abs().max().item())


@pytest.mark.parametrize("axes", [FLUX_DEV_AXES, *TINY_AXES])
def test_float32_rope_matches_diffusers_float64(axes):
    ids = _flux_ids()  # 128 x 128 image tokens + 512 text tokens
    assert ids.shape == (128 * 128 + 512, 3)
    # 1e-6, not just 1e-5: a plain float32 computation (diffusers' own NPU path) is already off by ~7e-6 here
    assert _max_diff(ids, axes) < 1e-6


def test_float32_rope_is_accurate_up_to_4096_and_between_integers():
    ramp = torch.arange(4096, dtype=torch.float32)
    ids = torch.stack([-ramp, ramp, ramp.flip(0)], dim=1)
    assert _max_diff(ids, FLUX_DEV_AXES) < 1e-6
    assert _max_diff(ids * 0.37 + 0.123, FLUX_DEV_AXES) < 1e-6
    assert _max_diff(ids * 5, FLUX_DEV_AXES) < 2e-3  # beyond 4096: like plain float32, still usable


class Float64Recorder(TorchDispatchMode):
    """Records every op that reads or makes a float64 tensor."""

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.dtype == torch.float64 for t in tree_leaves((args, kwargs, out))):
            self.ops.add(str(func))
        return out


def test_float32_rope_forward_has_no_float64_op():
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    ids = _flux_ids(256, 256, 16)
    embed = flux.Float32FluxPosEmbed(10000, list(FLUX_DEV_AXES))  # float64 only here, once, on the CPU
    with Float64Recorder() as recorder:
        embed(ids)
    assert recorder.ops == set()
    with Float64Recorder() as recorder:  # the recorder does see diffusers' float64 path
        FluxPosEmbed(10000, list(FLUX_DEV_AXES))(ids)
    assert "aten.cos.default" in recorder.ops


def test_float32_rope_survives_copy_and_has_no_state():
    import pickle

    embed = flux.Float32FluxPosEmbed(10000, [4, 6, 6])
    ids = _flux_ids(64, 64, 4)
    for clone in (copy.deepcopy(embed), pickle.loads(pickle.dumps(embed))):
        assert all(torch.equal(a, b) for a, b in zip(clone(ids), embed(ids)))
    assert embed.state_dict() == {}


# ----------------------------------------------------------------------------------- prepare_for_device
@pytest.fixture
def tiny_transformer(tiny_flux_dir):
    return flux.load_transformer(tiny_flux_dir).eval()


def _velocity(transformer, seed: int = 0) -> torch.Tensor:
    config = transformer.config
    g = torch.Generator().manual_seed(seed)
    geometry = flux.LatentGeometry(64, 64, 4, config.in_channels // 4)
    latents = torch.randn(2, geometry.seq_len, config.in_channels, generator=g)
    embeds = torch.randn(2, 8, config.joint_attention_dim, generator=g)
    pooled = torch.randn(2, config.pooled_projection_dim, generator=g)
    with torch.no_grad():
        return flux.predict_velocity(transformer, latents, 0.7, embeds, pooled, flux.image_ids(geometry),
                                     flux.text_ids(8), guidance=3.5)


def test_prepare_for_device_changes_nothing_off_npu(tiny_transformer):
    pos_embed = tiny_transformer.pos_embed
    for device in ("cpu", torch.device("cpu"), "cuda:0", torch.device("cuda")):
        assert flux.prepare_for_device(tiny_transformer, device) == []
    assert tiny_transformer.pos_embed is pos_embed


def test_prepare_for_device_npu_swaps_rope_and_keeps_the_output(tiny_transformer):
    before = _velocity(tiny_transformer)
    keys = set(tiny_transformer.state_dict())
    done = flux.prepare_for_device(tiny_transformer, "npu")  # a string: torch.device("npu") needs torch_npu
    assert isinstance(tiny_transformer.pos_embed, flux.Float32FluxPosEmbed)
    assert done[0].startswith("pos_embed: Float32FluxPosEmbed")
    assert done[1].startswith("attention backend: default SDPA")  # float32 weights: no NPU fused attention
    assert set(tiny_transformer.state_dict()) == keys
    torch.testing.assert_close(_velocity(tiny_transformer), before, rtol=0, atol=1e-5)
    assert flux.prepare_for_device(tiny_transformer, "npu")[0].startswith("attention")  # rope already swapped


def test_use_float32_rope_through_a_wrapper_and_bad_models(tiny_transformer):
    wrapper = torch.nn.Module()
    wrapper.module = tiny_transformer  # DDP / FSDP1 style
    assert flux.use_float32_rope(wrapper) is True
    assert isinstance(tiny_transformer.pos_embed, flux.Float32FluxPosEmbed)
    assert flux.use_float32_rope(wrapper) is False
    with pytest.raises(ValueError, match="FluxTransformer2DModel"):
        flux.use_float32_rope(torch.nn.Linear(2, 2))


def _attention_backends(model) -> set[str | None]:
    """The backend names the model's attention processors are set to (None: diffusers' default)."""
    backends = {getattr(m.processor, "_attention_backend", None) for m in model.modules() if hasattr(m, "processor")}
    return {None if b is None else str(getattr(b, "value", b)) for b in backends}


def test_npu_attention_backend_when_diffusers_offers_it(tiny_transformer, monkeypatch):
    from diffusers.models import attention_dispatch

    # diffusers' set_attention_backend also sets a process-wide active backend: restore it for the tests after this one
    registry = attention_dispatch._AttentionBackendRegistry
    monkeypatch.setattr(registry, "_active_backend", registry._active_backend)
    monkeypatch.setattr(attention_dispatch, "_CAN_USE_NPU_ATTN", False)  # as without torch_npu, whatever this host has
    with warnings.catch_warnings(record=True) as caught:  # no torch_npu: diffusers refuses, we warn and go on
        warnings.simplefilter("always")
        done = flux.prepare_for_device(tiny_transformer, "npu", param_dtype=torch.bfloat16)
    assert "unavailable" in done[1] and len([w for w in caught if "NPU fused attention" in str(w.message)]) == 1
    assert _attention_backends(tiny_transformer) == {None}

    monkeypatch.setattr(attention_dispatch, "_CAN_USE_NPU_ATTN", True)  # as with torch_npu installed
    done = flux.prepare_for_device(tiny_transformer, "npu", param_dtype=torch.bfloat16)
    assert done == [f"attention backend: {flux.NPU_ATTENTION_BACKEND} (torch_npu.npu_fusion_attention)"]
    assert _attention_backends(tiny_transformer) == {flux.NPU_ATTENTION_BACKEND}
