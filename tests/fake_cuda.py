"""Pretend-CUDA harness (docs/design.md principle 9): the trainers' hot paths traced on fake CUDA tensors in one CPU
process.

No GPU is needed. ``pretend_cuda()`` sets up, and undoes on exit:

- ``FakeTensorMode`` (shapes, dtypes and devices only) with ``avoid_device_init`` forced True; host and meta tensors
  stay real (``Recorder`` runs every op without a fake or CUDA tensor for real), so CPU-side logic (noise, sigmas,
  timestep choices, weight reading) computes real values and only what comes from the device is fake;
- ``torch.cuda.is_available() -> True`` so that ``torch.autocast("cuda", torch.bfloat16)`` really enables itself
  (CUDA autocast runs ``rms_norm`` in float32, CPU autocast does not), and a stub CUDA runtime (devices, streams,
  events, synchronize, memory queries) for FSDP2 and our code;
- the ``fake`` process group at world size 8 and ``fastvideo.distributed._INFO`` = rank 0 of 8 on ``cuda:0``.

``Recorder`` (a TorchDispatchMode above the fake mode) records what principle 9 forbids, attributed to sites (the
first frame of this repository outside tests/ and the installed packages: ``file:function:line``; else the
harness's own frame) and to loop iterations (``default_loops``: one sampling step of ``rollout.rollout``, one
(micro-batch, timestep) of GRPO's ``update_policy`` and of the DPO / NFT updates):

- device mixing: an op with both CPU and CUDA tensor arguments (0-d CPU scalars aside; copies are counted below);
- host syncs: device->host copies, ``.item()`` / ``bool()`` / ``.tolist()`` on a CUDA tensor, ``nonzero`` and other
  ops whose output shape depends on CUDA data, ``equal``, and explicit ``torch.cuda.synchronize``. Fake tensors
  have no values, so the recorder answers these ops itself (``PLAUSIBLE``) and says so;
- pageable or blocking host-to-device copies (the CPU source not pinned, or ``non_blocking=False``), e.g.
  ``torch.tensor(python_float, device="cuda")``; pinning is tracked by the recorder (fake tensors lose it);
- the dtypes of q, k and v at every ``dispatch_attention_fn`` call (diffusers' attention entry point).

``run_hot_paths(model_dir, ...)`` runs each trainer's hot path (GRPO, DPO, NFT; LoRA and full fine-tune; an SP 2
forward) at world size 8 in bf16 on ``cuda`` and returns a ``Report``; ``violations(report)`` checks it against
``CHECKS``. ``python tests/fake_cuda.py`` builds the tiny folders it needs and prints every finding (``--json FILE``
writes the report, as tests/test_fake_cuda.py reads it).

What fake tensors cannot do, and what the trace does instead: backward (the autograd engine asks the CUDA driver
for a primary context: each backward gives the trainable parameters zero gradients of their sharded layout, so the
optimizer step, EMA and old-policy updates run for real); writing tensors (DCP pickles and safetensors need bytes:
``dcp.save`` only describes what ``checkpoint.save_checkpoint`` hands it, and the export stops at its state dict);
values (data-dependent ops are answered with ``PLAUSIBLE`` values, ``Tensor.numpy()`` gives zeros). Also: object
collectives run outside the fake mode, two fake tensors of equal metadata are not swapped by ``Module.to``, and the
process group's store lets store barriers pass as if all 8 ranks had arrived.
"""
from __future__ import annotations

import argparse
import ast
import concurrent.futures
import contextlib
import dataclasses
import functools
import importlib
import inspect
import json
import sys
import textwrap
import threading
import time
import traceback
import types
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import build_run  # tests/ is on the path: conftest, or this file run as a script

REPO = Path(__file__).resolve().parents[1]
WORLD_SIZE = 8
aten = torch.ops.aten

# Host syncs the hot paths may make, by site ("file:function"), with the reason each is acceptable. A sync anywhere
# else is a finding; inside a loop of ``default_loops`` its per-iteration budget applies on top.
ALLOWED_SYNCS: dict[str, str] = {
    "fastvideo/devices.py:synchronize":
        "twice per rollout micro-batch, after its sampling loop and after its decode: the phase timings",
    "fastvideo/rewards/__init__.py:RewardFn._entries":
        "once per reward component and call: its scores come to the CPU (rewards are gathered and logged as CPU "
        "tensors); with "
        "--reward_overlap once per rollout micro-batch, on the scorer's thread and stream, not the sampling loop's",
    "fastvideo/rewards/__init__.py:RewardFn.score_video":
        "once per video reward call: the frame-change watch comes to the CPU beside the scores (logged, not trained)",
    "fastvideo/rewards/__init__.py:source_distance":
        "once per edit reward call: the source-distance watch comes to the CPU beside the scores (logged, not trained)",
    "fastvideo/toyworld/verify.py:_as_batch":
        "once per reward call: the toy-world verifier analyses the pixels on the CPU (numpy)",
    "fastvideo/distributed.py:all_gather_tensor":
        "once per step and gathered quantity (rewards, prompt-id check, metrics): NCCL gathers device tensors, and "
        "the gathered values are used on the host (advantages, logging)",
    "fastvideo/rollout.py:select_trained_timesteps":
        "once per rollout: the stochastic-step mask comes to the CPU to choose the trained timesteps",
    "fastvideo/parallel.py:clip_grad_norm":
        "once per optimizer step: the total gradient norm decides whether the update is skipped (non-finite)",
    "fastvideo/parallel.py:full_state_dict":
        "checkpoint/export only: the gathered state dict (the LoRA export's too) is copied to the CPU",
    "fastvideo/models/wan_experts.py:WanExperts.forward":
        "Wan2.2-A14B only, once per velocity call: the rows of each expert (and which experts any rank runs) come to "
        "the host to split the batch; exempt from the loops' budgets below (ROUTING_SYNCS)",
}
# Sites whose one sync per transformer call does not count against the loops' budgets: Wan2.2-A14B's expert routing
# (every rank must run the same experts under FSDP, and the batch is split by rows; fastvideo/models/wan_experts.py).
# Nothing else is exempt; a second sync per call at the site still shows in the report.
ROUTING_SYNCS = ("fastvideo/models/wan_experts.py:WanExperts.forward",)

# Per-iteration host-sync budgets of the hot loops (docs/design.md principle 9).
SAMPLING_STEP_SYNC_BUDGET = 1
REPLAY_STEP_SYNC_BUDGET = 0

# What the recorder answers for data-dependent ops on fake tensors (fake tensors carry no values): the values under
# which the hot paths take their normal branch (stochastic steps present, every score finite, masks all kept).
PLAUSIBLE = {"bool": True, "int": 1, "float": 0.5, "nonzero_rows": 0, "equal": True}
# Sites ("file:function") whose normal branch needs other answers than ``PLAUSIBLE``, with why.
ANSWERS: dict[str, dict[str, Any]] = {
    "fastvideo/training.py:Run.gather_rewards": {"bool": False},  # "any reward non-finite?": no
}


# ------------------------------------------------------------------------------------------------ sites and loops
_PACKAGE_MARKERS = ("site-packages", "dist-packages")
_HARNESS = Path(__file__).resolve()


@functools.lru_cache(maxsize=None)
def _project_file(filename: str) -> str | None:
    """``filename`` relative to the repository if it is project code (not tests/, not an installed package)."""
    try:
        rel = Path(filename).resolve().relative_to(REPO)
    except ValueError:
        return None
    if rel.parts[0] in ("tests", ".venv") or any(m in rel.parts for m in _PACKAGE_MARKERS):
        return None
    return rel.as_posix()


@functools.lru_cache(maxsize=None)
def _is_harness(filename: str) -> bool:
    """``filename`` is this file."""
    return Path(filename).resolve() == _HARNESS


@dataclass(frozen=True)
class Site:
    """Where an event came from: the first project frame (``file:function:line``)."""

    file: str
    function: str
    line: int

    @property
    def key(self) -> str:
        """``file:function``: what ``ALLOWED_SYNCS`` names."""
        return f"{self.file}:{self.function}"

    def __str__(self) -> str:
        return f"{self.key}:{self.line}"


def _site(frame: types.FrameType | None) -> Site | None:
    """The first project frame of the stack; else the harness's own (its copies of the trainers' inline loops)."""
    harness = None
    while frame is not None:
        code = frame.f_code
        rel = _project_file(code.co_filename)
        if rel is not None:
            return Site(rel, getattr(code, "co_qualname", code.co_name), frame.f_lineno)
        if harness is None and _is_harness(code.co_filename):
            harness = Site("tests/fake_cuda.py", getattr(code, "co_qualname", code.co_name), frame.f_lineno)
        frame = frame.f_back
    return harness


@dataclass
class LoopSpec:
    """A hot loop: the innermost ``for`` loop of ``function`` whose body calls ``calls`` (found in its source), so
    that an event can be attributed to one iteration (the values of the enclosing loops' variables)."""

    name: str
    function: Callable
    calls: str
    budget: int
    code: types.CodeType = field(init=False)
    lines: tuple[int, int] = field(init=False)
    variables: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        fn = inspect.unwrap(self.function)
        self.code = fn.__code__
        source = textwrap.dedent(inspect.getsource(fn))
        first = fn.__code__.co_firstlineno
        tree = ast.parse(source)
        found: list[tuple[ast.For, list[str]]] = []

        def visit(node: ast.AST, outer: list[str]) -> None:
            for child in ast.iter_child_nodes(node):
                names = outer
                if isinstance(child, ast.For):
                    names = outer + [n.id for n in ast.walk(child.target) if isinstance(n, ast.Name)]
                    calls = {c.func.attr if isinstance(c.func, ast.Attribute) else getattr(c.func, "id", None)
                             for c in ast.walk(child) if isinstance(c, ast.Call)}
                    if self.calls in calls:
                        found.append((child, names))
                visit(child, names)

        visit(tree, [])
        if not found:
            raise AssertionError(f"fake_cuda: no for-loop calling {self.calls} in {fn.__qualname__}: update "
                                 "default_loops")
        loop, names = found[-1]  # innermost: visited last among the nested matches
        self.lines = (first + loop.lineno - 1, first + loop.end_lineno - 1)
        self.variables = tuple(names)

    def iteration(self, frame: types.FrameType | None) -> str | None:
        """``"name[var=value,...]"`` if ``frame``'s stack is inside one iteration of this loop's body, else None."""
        while frame is not None:
            if frame.f_code is self.code and self.lines[0] < frame.f_lineno <= self.lines[1]:
                values = ",".join(f"{v}={_short(frame.f_locals.get(v))}" for v in self.variables)
                return f"{self.name}[{values}]"
            frame = frame.f_back
        return None


def _short(value: Any) -> str:
    """A loop variable's value for an iteration label: numbers as they are, small host tensors as lists."""
    if isinstance(value, torch.Tensor):
        if _is_fake(value) or value.device.type != "cpu" or value.numel() > 8:
            return f"<{value.device.type} tensor {tuple(value.shape)}>"
        with unset_fake_temporarily():
            return str(value.tolist())
    return repr(value)


def trainer(name: str) -> types.ModuleType:
    """A trainer script of the repository root (``train_grpo_flux`` ...) as a module."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    return importlib.import_module(name)


def default_loops() -> list[LoopSpec]:
    """The loops principle 9 budgets: a sampling step of ``rollout.rollout``, a replay step of GRPO's
    ``update_policy``, and an update step of DPO's / NFT's ``update_policy``."""
    from fastvideo import rollout

    return [LoopSpec("sampling_step", rollout.rollout, "guided_velocity", SAMPLING_STEP_SYNC_BUDGET),
            LoopSpec("replay_step", trainer("train_grpo_flux").update_policy, "replay_log_prob",
                     REPLAY_STEP_SYNC_BUDGET),
            LoopSpec("dpo_update_step", trainer("train_dpo").update_policy, "pair_errors", REPLAY_STEP_SYNC_BUDGET),
            LoopSpec("nft_update_step", trainer("train_nft").update_policy, "model_velocity",
                     REPLAY_STEP_SYNC_BUDGET)]


# ------------------------------------------------------------------------------------------------ the recorder
@dataclass(frozen=True)
class Finding:
    """One recorded event: ``kind`` (sync, h2d, mix, answered), the op, where (``site``: file:function:line,
    ``site_key``: file:function), in which path and loop iteration, and details."""

    kind: str
    op: str
    site: str
    site_key: str
    path: str
    iteration: str | None
    detail: str = ""


@dataclass(frozen=True)
class AttentionCall:
    """The dtypes of q, k, v at one ``dispatch_attention_fn`` call, and the path it ran in."""

    q: str
    k: str
    v: str
    path: str
    iteration: str | None


_DATA_DEPENDENT = {aten.nonzero.default, aten.masked_select.default, aten.unique_consecutive.default,
                   aten._unique2.default, aten.unique_dim.default, aten.equal.default, aten.is_nonzero.default,
                   aten._local_scalar_dense.default, aten.allclose.default}
_COPIES = {aten._to_copy.default, aten.copy_.default, aten.copy.default}
_PIN_OPS = {aten.pin_memory.default, aten._pin_memory.default}


def _is_fake(t: Any) -> bool:
    """A tensor of the fake mode (shapes, dtype and device only)."""
    return isinstance(t, FakeTensor)


def _is_subclass(t: torch.Tensor) -> bool:
    """A wrapper subclass (DTensor, ...) that dispatches to its own inner tensors (checked there)."""
    return not _is_fake(t) and type(t) not in (torch.Tensor, torch.nn.Parameter)


def _storage_ref(t: torch.Tensor) -> StorageWeakRef | None:
    """A weak reference to ``t``'s storage (views share it), or None for a tensor without one."""
    try:
        return StorageWeakRef(t.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None


class Recorder(TorchDispatchMode):
    """Runs host/meta ops for real (outside the fake mode), checks and records the rest (see the module doc)."""

    def __init__(self, loops: list[LoopSpec]) -> None:
        super().__init__()
        self.loops = loops
        self.path = "setup"
        self.findings: Counter[Finding] = Counter()
        self.attention: Counter[AttentionCall] = Counter()
        self.pinned: dict[int, StorageWeakRef] = {}
        self.scorer_threads: Counter[str] = Counter()  # --reward_overlap's scorer calls, by thread name
        self._quiet = 0

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Record nothing inside (the harness's own preparation, not the product's code)."""
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    # ---- attribution
    def where(self) -> tuple[Site | None, str | None]:
        """The caller's site and loop iteration (None outside the loops)."""
        frame = sys._getframe(1)
        iteration = None
        for loop in self.loops:
            iteration = loop.iteration(frame)
            if iteration is not None:
                break
        return _site(frame), iteration

    def record(self, kind: str, op: str, detail: str = "") -> None:
        """Count one finding of ``kind`` at the caller's site (nothing while ``quiet``)."""
        if self._quiet:
            return
        site, iteration = self.where()
        self.findings[Finding(kind, op, str(site) if site else "?", site.key if site else "?", self.path, iteration,
                              detail)] += 1

    # ---- pinned host memory: fake tensors cannot pin (aten._pin_memory is not implemented for them, and
    # empty(pin_memory=True).is_pinned() is False) and real ones need the CUDA host allocator, so the storages that
    # were asked to be pinned are remembered here
    def mark_pinned(self, t: torch.Tensor) -> torch.Tensor:
        """Remember ``t``'s storage as pinned host memory; returns ``t``."""
        ref = _storage_ref(t)
        if ref is not None:
            self.pinned[ref.cdata] = ref
        return t

    def is_pinned(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives in storage that was pinned (a view of a pinned tensor is pinned too)."""
        ref = _storage_ref(t)
        known = self.pinned.get(ref.cdata) if ref is not None else None
        return known is not None and not known.expired()

    # ---- dispatch
    def __torch_dispatch__(self, func, _types, args=(), kwargs=None):
        """Run the op: for real if it touches neither a fake tensor nor CUDA, else checked, then in the fake mode."""
        kwargs = kwargs or {}
        tensors = _tensors(args, kwargs)
        if any(_is_subclass(t) for t in tensors):  # DTensor & co.: checked on their local tensors
            return func(*args, **kwargs)
        if func in _PIN_OPS:
            with contextlib.nullcontext() if _is_fake(args[0]) else unset_fake_temporarily():
                return self.mark_pinned(args[0].clone())
        if func is aten.is_pinned.default:
            return self.is_pinned(args[0])
        pin = bool(kwargs.get("pin_memory"))
        if pin:  # no CUDA host allocator here: allocate normally, remember it as pinned
            kwargs = {**kwargs, "pin_memory": False}
        device = kwargs.get("device")
        if not any(_is_fake(t) for t in tensors) and (device is None or torch.device(device).type != "cuda"):
            with unset_fake_temporarily():  # host and meta work runs for real
                out = func(*args, **kwargs)
        else:
            self.check(func, args, kwargs, tensors)
            out = self.answer(func, args, kwargs) if _data_dependent(func, args, kwargs) else func(*args, **kwargs)
        return self.mark_pinned(out) if pin else out

    def check(self, func, args, kwargs, tensors: list[torch.Tensor]) -> None:
        """Record device mixing, host syncs and pageable/blocking host-to-device copies."""
        name = func.overloadpacket.__name__
        if func in _COPIES:
            if func is aten._to_copy.default:
                src, dst, non_blocking = args[0], torch.device(kwargs.get("device") or args[0].device), \
                    kwargs.get("non_blocking", False)
            else:  # copy_(self, src, non_blocking=False)
                src, dst = args[1], args[0].device
                non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            if src.device.type == "cuda" and dst.type == "cpu":
                self.record("sync", name, f"device->host copy {tuple(src.shape)} {src.dtype}")
            elif src.device.type == "cpu" and dst.type == "cuda":
                pinned = self.is_pinned(src)
                if not (pinned and non_blocking):
                    why = ", ".join(w for w, bad in (("pageable", not pinned), ("blocking", not non_blocking)) if bad)
                    self.record("h2d", name, f"host->device copy {tuple(src.shape)} {src.dtype} ({why})")
            return
        if {"cpu", "cuda"} <= {t.device.type for t in tensors if not (t.device.type == "cpu" and t.dim() == 0)}:
            shapes = ", ".join(f"{t.device.type}{tuple(t.shape)}" for t in tensors)
            self.record("mix", name, f"CPU and CUDA tensors in one op: {shapes}")
        on_cuda = [t for t in tensors if t.device.type == "cuda"]
        if on_cuda and _data_dependent(func, args, kwargs):
            what = ("CUDA value read on the host (.item() / .tolist() / float() / bool())"
                    if func is aten._local_scalar_dense.default else "output shape depends on CUDA data")
            self.record("sync", name, f"{what}: {tuple(on_cuda[0].shape)} {on_cuda[0].dtype}")

    def answer(self, func, args, kwargs):
        """The value a data-dependent op gets here (``PLAUSIBLE``; fake tensors carry no values), recorded as kind
        "answered"; an op without an answer runs in the fake mode (which raises for it)."""
        name = func.overloadpacket.__name__
        self.record("answered", name, "fake tensors carry no values: the harness answered")
        site, _ = self.where()
        plausible = {**PLAUSIBLE, **ANSWERS.get(site.key if site else "", {})}
        t = args[0]
        if func is aten._local_scalar_dense.default:
            if t.dtype == torch.bool:
                return plausible["bool"]
            return plausible["float"] if t.is_floating_point() else plausible["int"]
        if func in (aten.equal.default, aten.allclose.default):
            return plausible["equal"]
        if func is aten.is_nonzero.default:
            return plausible["bool"]
        if func is aten.nonzero.default:
            return torch.empty((plausible["nonzero_rows"], t.dim()), dtype=torch.long, device=t.device)
        if func in _INDEX_OPS:  # a boolean mask keeps every element: the equivalent long indices
            return func(t, _long_indices(args[1]), *args[2:], **kwargs)
        return func(*args, **kwargs)


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments of an aten op (top level and inside lists, e.g. ``index``'s indices)."""
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


_INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


def _data_dependent(func, args: tuple, kwargs: dict) -> bool:
    """Whether the op's result (value or shape) needs the data on the host: a host sync on CUDA."""
    if func in _INDEX_OPS:
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    if func is aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    return func in _DATA_DEPENDENT


def _long_indices(indices: list) -> list:
    """Boolean masks among ``indices`` replaced by the long indices of an all-True mask of their shape."""
    out = []
    for i in indices:
        if i is not None and i.dtype in (torch.bool, torch.uint8):
            grids = torch.meshgrid(*[torch.arange(d, device=i.device) for d in i.shape], indexing="ij")
            out.extend(g.reshape(-1) for g in grids)
        else:
            out.append(i)
    return out


# -------------------------------------------------------------------------------------------- the CUDA runtime stub
class StubStream:
    """A CUDA stream that does nothing (FSDP2 creates and orders several)."""

    def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
        self.device, self.priority, self.cuda_stream, self.stream_id = torch.device("cuda", 0), priority, 0, 0

    def wait_stream(self, stream: Any) -> None: ...
    def is_capturing(self) -> bool: return False
    def wait_event(self, event: Any) -> None: ...
    def record_event(self, event: Any = None) -> StubEvent: return event or StubEvent()
    def query(self) -> bool: return True
    def synchronize(self) -> None: _record_runtime_sync("Stream.synchronize")
    def __enter__(self) -> StubStream: return self
    def __exit__(self, *exc: Any) -> None: ...


class StubEvent:
    """A CUDA event that does nothing (``synchronize`` counts as a host sync)."""

    def __init__(self, *_: Any, **__: Any) -> None: ...
    def record(self, stream: Any = None) -> None: ...
    def wait(self, stream: Any = None) -> None: ...
    def query(self) -> bool: return True
    def synchronize(self) -> None: _record_runtime_sync("Event.synchronize")
    def elapsed_time(self, other: Any) -> float: return 0.0


_ACTIVE: list[Recorder] = []


def _record_runtime_sync(what: str) -> None:
    """An explicit synchronisation of the stub runtime, recorded as a host sync by the active recorder."""
    if _ACTIVE:
        _ACTIVE[-1].record("sync", what, "explicit CUDA synchronisation")


_STREAM = StubStream()
_PROPERTIES = types.SimpleNamespace(name="pretend-cuda", major=9, minor=0, total_memory=80 * 2**30,
                                    multi_processor_count=132, is_integrated=False, is_multi_gpu_board=False)


def cuda_stubs(device_count: int = WORLD_SIZE) -> dict[tuple[Any, str], Any]:
    """``(object, attribute) -> replacement`` for the CUDA runtime calls FSDP2, autocast and our code make."""
    stream = lambda *_, **__: _STREAM  # noqa: E731
    cuda = {
        "is_available": lambda: True, "device_count": lambda: device_count, "current_device": lambda: 0,
        "set_device": lambda device: None, "Stream": StubStream, "Event": StubEvent, "current_stream": stream,
        "default_stream": stream, "stream": lambda s=None: contextlib.nullcontext(),
        "synchronize": lambda device=None: _record_runtime_sync("torch.cuda.synchronize"),
        "get_device_properties": lambda device=None: _PROPERTIES,
        "get_device_name": lambda device=None: _PROPERTIES.name,
        "get_device_capability": lambda device=None: (9, 0), "is_bf16_supported": lambda *_, **__: True,
        "is_current_stream_capturing": lambda: False,
        "memory_allocated": lambda device=None: 0, "max_memory_allocated": lambda device=None: 0,
        "memory_reserved": lambda device=None: 0, "max_memory_reserved": lambda device=None: 0,
        "reset_peak_memory_stats": lambda device=None: None, "empty_cache": lambda: None,
        "mem_get_info": lambda device=None: (_PROPERTIES.total_memory, _PROPERTIES.total_memory),
    }
    accelerator = {
        "is_available": lambda: True, "device_count": lambda: device_count, "current_device_index": lambda: 0,
        "set_device_index": lambda device: None, "current_stream": stream,
        "current_accelerator": lambda check_available=False: torch.device("cuda"),
        "synchronize": lambda device=None: _record_runtime_sync("torch.accelerator.synchronize"),
    }
    stubs = {(torch.cuda, k): v for k, v in cuda.items()}
    stubs.update({(torch.accelerator, k): v for k, v in accelerator.items()})
    stubs[(torch.Tensor, "record_stream")] = lambda self, stream: None  # a StubStream is no torch.Stream
    stubs[(FakeTensorMode, "avoid_device_init")] = property(lambda self: True)
    stubs[(torch.utils, "swap_tensors")] = _swap_tensors(torch.utils.swap_tensors)
    stubs.update(_object_collectives())
    return stubs


def _object_collectives() -> dict[tuple[Any, str], Any]:
    """torch.distributed's object collectives (pickled bytes in CPU tensors: the fake process group copies them, so
    they work) run outside the fake mode, which would put their byte tensors' storage on the meta device."""
    from torch.distributed import distributed_c10d

    def outside_fake(fn: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            with unset_fake_temporarily():
                return fn(*args, **kwargs)
        return call

    names = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
    return {(module, name): outside_fake(getattr(distributed_c10d, name)) for name in names
            for module in (dist, distributed_c10d)}


def _swap_tensors(original: Callable) -> Callable:
    """``torch.utils.swap_tensors`` that skips swapping two fake tensors of identical metadata (which
    ``Module._apply`` does for every fake parameter on ``module.to(device)``, even when nothing changes, and which
    fails when the fake mode's memo holds a weak reference): without data such a swap changes nothing."""
    def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
        same = all(getattr(t1, a) == getattr(t2, a) for a in ("device", "dtype", "shape", "requires_grad"))
        if _is_fake(t1) and _is_fake(t2) and same and t1.stride() == t2.stride():
            return
        original(t1, t2)
    return swap_tensors


@contextlib.contextmanager
def patched(replacements: dict[tuple[Any, str], Any]) -> Iterator[None]:
    """Set every ``(object, attribute)`` to its replacement; restore the originals on exit."""
    missing = object()
    saved = [(obj, name, vars(obj).get(name, missing)) for obj, name in replacements]
    try:
        for (obj, name), value in replacements.items():
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in reversed(saved):
            if value is missing:
                delattr(obj, name)
            else:
                setattr(obj, name, value)


def _attention_wrappers(recorder: Recorder) -> dict[tuple[Any, str], Any]:
    """Wrap diffusers' ``dispatch_attention_fn`` in every module that imported it, and ``F.scaled_dot_product_attention``
    for the diffusers processors that call it directly (SD3's ``JointAttnProcessor2_0``), recording q/k/v dtypes once
    per call (an SDPA call inside a dispatched one is not counted again; reward models' SDPA calls are not the
    transformer's)."""
    from diffusers.models import attention_dispatch

    original = attention_dispatch.dispatch_attention_fn
    sdpa = torch.nn.functional.scaled_dot_product_attention
    depth = [0]

    def record(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        _, iteration = recorder.where()
        recorder.attention[AttentionCall(str(query.dtype), str(key.dtype), str(value.dtype), recorder.path,
                                         iteration)] += 1

    def dispatch_attention_fn(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
                              **kwargs: Any) -> Any:
        record(query, key, value)
        depth[0] += 1
        try:
            return original(query, key, value, *args, **kwargs)
        finally:
            depth[0] -= 1

    def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
                                     **kwargs: Any) -> Any:
        if depth[0] == 0 and sys._getframe(1).f_globals.get("__name__", "").startswith("diffusers."):
            record(query, key, value)  # a diffusers attention processor's own SDPA (not a reward model's)
        return sdpa(query, key, value, *args, **kwargs)

    wrappers: dict[tuple[Any, str], Any] = {(module, "dispatch_attention_fn"): dispatch_attention_fn
                                            for module in list(sys.modules.values())
                                            if getattr(module, "dispatch_attention_fn", None) is original}
    wrappers[(torch.nn.functional, "scaled_dot_product_attention")] = scaled_dot_product_attention
    return wrappers


def _scorer_thread(fake_mode: FakeTensorMode, recorder: Recorder) -> dict[tuple[Any, str], Any]:
    """--reward_overlap's scorer under the trace. Its jobs (``OverlapScorer._score``, on its worker thread) enter the
    trace's fake mode and recorder and are counted by thread name in ``recorder.scorer_threads``: dispatch modes are
    thread-local, so the worker would otherwise run unrecorded (and fail at its first data-dependent op on a fake
    tensor). The fake mode is set in the thread's own slot, not through ``FakeTensorMode.__enter__``, whose stack of
    entries the threads would share. A fake mode is not thread-safe either (its in-kernel flag is one for all threads),
    so ``submit`` waits for its job: each job still runs on the worker thread with that thread's own state (modes,
    stream, device), one at a time with the main thread."""
    from fastvideo.rewards.overlap import OverlapScorer

    score, submit = OverlapScorer._score, OverlapScorer.submit

    def _score_traced(self: OverlapScorer, *args: Any, **kwargs: Any) -> Any:
        recorder.scorer_threads[threading.current_thread().name] += 1
        lift = torch._C._only_lift_cpu_tensors()
        torch._C._set_only_lift_cpu_tensors(True)  # what FakeTensorMode.__enter__ sets (avoid_device_init), per thread
        torch._C._set_dispatch_mode(fake_mode)
        try:
            with recorder:
                return score(self, *args, **kwargs)
        finally:
            torch._C._unset_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
            torch._C._set_only_lift_cpu_tensors(lift)

    def submit_and_wait(self: OverlapScorer, *args: Any, **kwargs: Any) -> None:
        submit(self, *args, **kwargs)
        concurrent.futures.wait(self._pending[-1:])

    return {(OverlapScorer, "_score"): _score_traced, (OverlapScorer, "submit"): submit_and_wait}


class AllArrivedStore(dist.Store):
    """The fake process group's key-value store, for one process playing rank 0 of ``world_size``: what a rank adds
    to a counter reads as if every rank had added it (so ``distributed.store_barrier`` passes at once, as it would
    with all ranks present); keys are kept. (``fake_pg.FakeStore`` answers nothing, so a store barrier would see a
    failed peer.)"""

    def __init__(self, world_size: int) -> None:
        super().__init__()
        self.world_size, self.data = world_size, {}

    def set(self, key: str, value: bytes | str) -> None:
        self.data[key] = value.encode() if isinstance(value, str) else bytes(value)

    def get(self, key: str) -> bytes:
        return self.data[key]

    def add(self, key: str, amount: int) -> int:
        value = int(self.data.get(key, b"0")) + amount * self.world_size
        self.data[key] = str(value).encode()
        return value

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def wait(self, keys: list[str], timeout: Any = None) -> None: ...

    def delete_key(self, key: str) -> bool:
        return self.data.pop(key, None) is not None

    def num_keys(self) -> int:
        return len(self.data)


@contextlib.contextmanager
def pretend_cuda(world_size: int = WORLD_SIZE, loops: list[LoopSpec] | None = None) -> Iterator[Recorder]:
    """Fake CUDA tensors, CUDA autocast, a stub CUDA runtime and the ``fake`` process group at ``world_size``, with
    ``fastvideo.distributed`` reporting rank 0 on ``cuda:0``; yields the ``Recorder``. Everything is undone on exit
    (patches, process group, ``distributed._INFO``)."""
    from torch.testing._internal.distributed import fake_pg  # noqa: F401  (registers the "fake" backend)

    # every family's transformer module, so that their dispatch_attention_fn references exist to be wrapped
    import diffusers.models.transformers.transformer_flux  # noqa: F401
    import diffusers.models.transformers.transformer_flux2  # noqa: F401
    import diffusers.models.transformers.transformer_qwenimage  # noqa: F401
    import diffusers.models.transformers.transformer_sd3  # noqa: F401
    from fastvideo import distributed

    if dist.is_initialized():
        raise RuntimeError("pretend_cuda needs a process without a process group (run it in its own process)")
    store = AllArrivedStore(world_size)
    recorder = Recorder(loops if loops is not None else default_loops())
    saved = _save_state(distributed)
    try:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        with patched(cuda_stubs(world_size)), patched(_attention_wrappers(recorder)), \
                patched(_scorer_thread(fake_mode, recorder)):
            dist.init_process_group("fake", store=store, rank=0, world_size=world_size)
            _ACTIVE.append(recorder)
            try:
                distributed._INFO = distributed.DistInfo(rank=0, world_size=world_size, local_rank=0,
                                                         device=torch.device("cuda", 0), backend="nccl")
                with fake_mode, recorder:
                    yield recorder
            finally:
                _ACTIVE.remove(recorder)
                dist.destroy_process_group()
    finally:
        _restore_state(distributed, saved)


# fastvideo.distributed's process-wide state (rank info, mesh caches): emptied for the trace, restored after it
_DISTRIBUTED_STATE = ("_INFO", "_MESHES", "_STORE_BARRIERS")


def _save_state(module: types.ModuleType) -> dict[str, Any]:
    """Take ``module``'s ``_DISTRIBUTED_STATE`` out (caches emptied, the rest None), for ``_restore_state``."""
    saved = {name: getattr(module, name) for name in _DISTRIBUTED_STATE if hasattr(module, name)}
    for name, value in saved.items():
        setattr(module, name, type(value)() if isinstance(value, dict) else None)
    return saved


def _restore_state(module: types.ModuleType, saved: dict[str, Any]) -> None:
    """Put back what ``_save_state`` took."""
    for name, value in saved.items():
        setattr(module, name, value)


# ---------------------------------------------------------------------------------------------- the hot paths
STEP = 1  # the training step the paths pretend to be at


def _fake_backward(run: Any) -> Callable[[torch.Tensor, bool], None]:
    """``Run.backward`` for the trace: fake tensors cannot run backward (the autograd engine asks the CUDA driver
    for a primary context), so every trainable parameter gets a zero gradient of its own (sharded) layout instead."""
    def backward(loss: torch.Tensor, last_backward: bool) -> None:
        run.set_gradient_sync(last_backward)
        for p in run.policy.trainable_parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    return backward


def update_grpo(ctx: Trace) -> None:
    """GRPO's update: ``train_grpo_flux.update_policy`` itself (replay, --policy_loss, KL, optimizer steps; the
    gathered advantages order the samples under --shuffle_micro_batches / --drop_zero_advantage)."""
    with unset_fake_temporarily():  # the trainer's gathered advantages are CPU values (rewards gather to the CPU):
        adv_all = torch.linspace(-1.0, 1.0, len(ctx.adv_all))  # real ones here, a third exactly 0, so the weighted,
        adv_all[::3] = 0.0  # padded micro-batches of --drop_zero_advantage / --shuffle_micro_batches are traced
    trainer("train_grpo_flux").update_policy(ctx.run, ctx.traj, ctx.batch, ctx.samples, ctx.advantages, STEP,
                                             adv_all)


def update_dpo(ctx: Trace) -> None:
    """Online DPO's update: ``train_dpo.update_policy`` itself (shared (eps, sigma) per pair, flow-matching errors of
    the reference and the policy on winner and loser, DPO loss, one optimizer step) on this rank's even/odd samples
    as pairs, then the reference snapshot follows (--ref_update_interval)."""
    run, samples = ctx.run, ctx.samples
    with ctx.recorder.quiet():  # the trainer pairs gathered CPU latents (a step-end gather): here this rank's own
        x0 = ctx.traj.clean_latents.cpu()
    keys = samples.prompt_ids[0::2]
    pair_batch = {k: v[0::2] for k, v in ctx.batch.items() if torch.is_tensor(v)}  # the winners' rows
    weights = torch.full((len(keys),), 1.0 / len(keys))
    trainer("train_dpo").update_policy(run, pair_batch, x0[0::2], x0[1::2], keys, weights, STEP)
    if run.policy.ref_snapshot is not None:
        run.policy.update_reference()


def update_nft(ctx: Trace) -> None:
    """DiffusionNFT's update: ``train_nft.update_policy`` itself (forward process on the old policy's clean latents,
    v_old / v_ref without grad, v_theta, NFT / AWM loss, optimizer steps; AWM's with --shuffle_micro_batches'
    weighted micro-batches), then the old policy follows."""
    from fastvideo.losses import nft_advantages, nft_old_decay

    run, args = ctx.run, ctx.run.args
    advantages = nft_advantages(ctx.advantages, args.adv_mode, args.adv_clip_max)
    keep = run.local(ctx.rewards["total"].isfinite())
    with unset_fake_temporarily():  # gathered CPU values (the order of --shuffle_micro_batches), as update_grpo's
        adv_all = torch.linspace(-1.0, 1.0, len(ctx.adv_all))
    trainer("train_nft").update_policy(run, ctx.traj, ctx.batch, ctx.samples, advantages, keep, STEP, adv_all)
    run.policy.old.update(nft_old_decay(STEP, args.old_decay_schedule))


@dataclass
class Objective:
    """One trainer's hot path: its flag parser and validation, the flags of the trace, ``build_policy``'s keywords
    as the trainer passes them (``build(args)``), the update (``fn(Trace)``), and how it samples and rewards."""

    name: str
    parse: Callable[[list[str]], argparse.Namespace]
    validate: Callable[[argparse.Namespace, int], dict[str, int]]
    flags: tuple[str, ...]
    build: Callable[[argparse.Namespace], dict[str, bool]]
    update: Callable[[Trace], None]
    old_policy_samples: bool = False
    keep_latents: bool = True
    group_advantages: bool = True  # the update needs ``Run.advantages`` (DPO pairs by reward instead)
    variants: tuple[str, ...] | None = None  # the variants it is traced in (None: every one asked for)


def default_objectives() -> list[Objective]:
    """GRPO (SDE rollout, KL to the reference, EMA), online DPO (reference snapshot, --ref_update_interval) and
    DiffusionNFT (old policy, DPM-Solver++(2M) rollout, KL); with LoRA only (their full fine-tune shares GRPO's / NFT's
    sharding): GRPO-Guard on MixGRPO's sliding window with both micro-batch switches (weighted, padded micro-batches),
    Flow-DPPO on Flow-GRPO's first-K timesteps, and AWM (on-policy rollout, old-policy KL anchor)."""
    from fastvideo import objectives
    from fastvideo import policy

    def old_policy(args: argparse.Namespace) -> dict[str, bool]:
        return {"need_reference": args.kl_beta > 0, "old_policy": policy.nft_uses_old_policy(args)}

    return [
        Objective("grpo", objectives.parse_grpo_args, objectives.validate_grpo,
                  ("--kl_beta", "0.01", "--use_ema", "--timestep_fraction", "1.0"),
                  lambda a: {"need_reference": a.kl_beta > 0}, update_grpo),
        Objective("dpo", objectives.parse_dpo_args, objectives.validate_dpo, ("--ref_update_interval", "1"),
                  lambda a: {"need_reference": True, "ref_snapshot": a.ref_update_interval > 0}, update_dpo,
                  group_advantages=False),
        Objective("nft", objectives.parse_nft_args, objectives.validate_nft,
                  ("--kl_beta", "0.01", "--solver", "dpm2", "--eta", "0", "--timestep_fraction", "0.5"),
                  lambda a: {"need_reference": a.kl_beta > 0, "old_policy": True}, update_nft,
                  old_policy_samples=True, keep_latents=False),
        Objective("grpo_guard", objectives.parse_grpo_args, objectives.validate_grpo,
                  ("--policy_loss", "guard", "--clip_range", "2e-6", "--sde_window_size", "1", "--sde_window_schedule",
                   "sliding", "--sde_window_shift_interval", "1", "--shuffle_micro_batches", "--drop_zero_advantage",
                   "--gradient_accumulation_steps", "1", "--kl_beta", "0.01"),
                  lambda a: {"need_reference": a.kl_beta > 0}, update_grpo, variants=("lora",)),
        Objective("grpo_dppo", objectives.parse_grpo_args, objectives.validate_grpo,
                  ("--policy_loss", "dppo", "--timestep_selection", "first", "--timestep_fraction", "0.5",
                   "--gradient_accumulation_steps", "1"),
                  lambda a: {"need_reference": a.kl_beta > 0}, update_grpo, variants=("lora",)),
        Objective("awm", objectives.parse_nft_args, objectives.validate_nft,
                  ("--objective", "awm", "--old_kl_beta", "0.1", "--kl_beta", "0.01", "--eta", "0",
                   "--awm_timesteps", "1", "--timestep_fraction", "1.0", "--awm_strata", "flow_factory",
                   "--shuffle_micro_batches",
                   "--train_batch_size", "1", "--gradient_accumulation_steps", "1"),  # 2 optimizer steps, weighted
                  old_policy, update_nft, keep_latents=False, variants=("lora",)),
    ]

OBJECTIVES = ("grpo", "dpo", "nft", "grpo_guard", "grpo_dppo", "awm")


VARIANTS: dict[str, tuple[str, ...]] = {"lora": ("--lora_rank", "4"), "full": ("--lora_rank", "0")}


@dataclass
class Trace:
    """What an objective's update gets: the recorder, the trainer's ``Run`` (args, policy, optimizer, noise,
    geometry), the rollout, its batch and samples, the gathered rewards and this rank's advantages."""

    recorder: Recorder
    run: Any
    traj: Any
    batch: dict
    samples: Any
    pending: Any = None  # training.PendingRewards of the rollout with --reward_overlap
    rewards: dict[str, torch.Tensor] | None = None  # name -> (P*G,) gathered over ranks
    advantages: torch.Tensor | None = None  # (B,) this rank's, on the device
    adv_all: torch.Tensor | None = None  # (P*G,) the gathered advantages


@dataclass
class Shared:
    """What every path shares: the model folder, the latent geometry, the VAE (in the compute dtype, on the device),
    the reward (tiny HPS + toy world) and toy-world prompts (both rewards can score them)."""

    model_dir: Path
    work_dir: Path
    size: int
    geometry: Any
    vae: Any
    reward: Any
    prompts: list[str]
    embedding_rows: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)  # key -> row
    extra_flags: tuple[str, ...] = ()  # the family's flags on every path (e.g. --cfg_scale)
    variant_flags: dict[str, tuple[str, ...]] = field(default_factory=dict)  # variant -> its own flags (CFG on/off)


def embedding_rows(model_dir: Path, max_sequence_length: int = 32, size: int = 64
                   ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``key -> (row shape, dtype)`` of the family's stored embeddings, from a real encode of one prompt (an edit
    family: one ``size`` x ``size`` source and its instruction, the source latents too) with the folder's text
    encoders (before the fake mode: the trace then makes random rows of these shapes)."""
    from fastvideo import models

    family = models.resolve("auto", model_dir)
    encoders = family.load_text_encoders(model_dir)
    with torch.no_grad():
        if family.edit:
            source = torch.rand(1, 3, size, size, generator=torch.Generator().manual_seed(0))
            cond, _ = family.encode_edits(encoders, family.load_vae(model_dir), source, ["make the cube blue"],
                                          max_sequence_length)
        else:
            cond, _ = family.encode_prompts(encoders, ["a red cube on a table"], max_sequence_length)
    cond = family.collate(cond)
    return {k: (tuple(v.shape[1:]), v.dtype) for k, v in cond.items()}


def _shared(model_dir: Path, hps_checkpoint: Path, hps_model: Path, work_dir: Path, size: int,
            rows: dict[str, tuple[tuple[int, ...], torch.dtype]], extra_flags: tuple[str, ...] = (),
            variant_flags: dict[str, tuple[str, ...]] | None = None) -> Shared:
    """Load the model family's VAE (bf16, on the device, as ``Run.load_models`` does) and build the reward, on
    pretend CUDA; ``rows``: ``embedding_rows`` of the folder."""
    from fastvideo import distributed, models
    from fastvideo.rewards import build_reward
    from fastvideo.toyworld.scenes import all_prompts

    device = distributed.info().device
    family = models.resolve("auto", model_dir)
    # flag validation checks that it exists and, with --cfg_scale > 1, that it names the negative prompt's rows
    (work_dir / "manifest.json").write_text('{"negative": {"prompt": "", "file": "negative.safetensors"}}')
    vae = family.load_vae(model_dir, dtype=torch.bfloat16, device=device)
    reward = build_reward("hpsv2:1.0,toyworld:1.0,toyworld_strict:1.0", device, hps_checkpoint=str(hps_checkpoint),
                          hps_model=str(hps_model))
    frames = int(extra_flags[extra_flags.index("--num_frames") + 1]) if "--num_frames" in extra_flags else None
    geometry = models.geometry_for(family, model_dir, size, size, frames,  # a video family: of --num_frames
                                   condition=(size, size) if family.edit else None)  # an edit: the rows' source
    return Shared(model_dir, work_dir, size, geometry, vae, reward,
                  list(all_prompts()[:16]), rows, extra_flags, dict(variant_flags or {}))


# The trace's flags: 2 samples per rank (16 per step over 8 ranks), one rollout micro-batch, 2 sampling steps.
TRACE_FLAGS = ("--mixed_precision", "bf16", "--sampling_steps", "2", "--num_generations", "4", "--prompts_per_step",
               "4", "--train_batch_size", "2", "--rollout_batch_size", "2", "--seed", "0")


def _flags(shared: Shared, objective: Objective, variant: str, extra: tuple[str, ...] = ()) -> list[str]:
    """The trainer's command line for one path (the data manifest is a stub: the batch is made in memory)."""
    out = shared.work_dir / f"{objective.name}-{variant}"
    return ["--pretrained_model_name_or_path", str(shared.model_dir), "--data_json_path",
            str(shared.work_dir / "manifest.json"), "--output_dir", str(out), "--h", str(shared.size), "--w",
            str(shared.size), *TRACE_FLAGS, *objective.flags, *VARIANTS[variant], *shared.extra_flags,
            *shared.variant_flags.get(variant, ()), *extra]


def _run(shared: Shared, objective: Objective, variant: str, extra: tuple[str, ...] = ()) -> Any:
    """The trainer's ``Run`` as ``start_run`` + ``load_models`` leave it (flags validated for the data-parallel size,
    device defaults resolved, policy built by ``build_policy``, optimizer, LR schedule, VAE), with ``backward``
    replaced by ``_fake_backward`` (``helpers.build_run``, the builder the CPU tests share)."""
    from fastvideo import models
    from fastvideo.rollout import RolloutConfig

    args = objective.parse(_flags(shared, objective, variant, extra))
    run = build_run(args, objective.validate, **objective.build(args))
    run.vae, run.geometry, run.reward_fn = shared.vae, shared.geometry, shared.reward
    run.rollout_cfg = RolloutConfig.from_args(args)  # as Run.sampling_inputs builds it
    if args.reward_overlap:  # as Run.load_models starts it
        from fastvideo.rewards.overlap import OverlapScorer

        run.scorer = OverlapScorer(run.reward_fn, run.device)
    run.backward = _fake_backward(run)
    if models.family_for(args).edit:  # an edit store's sources (CPU images, as EmbeddingDataset.source_images reads them)
        run.dataset = _EditSources(shared.size)
    return run


class _EditSources:
    """The edit store's ``source_images`` for the trace: a random CPU source per prompt id (the rewards compare)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def source_images(self, prompt_ids: Any) -> torch.Tensor:
        return torch.rand(len(prompt_ids), 3, self.size, self.size, generator=torch.Generator().manual_seed(0))


def _padded_mask(b: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A text mask whose row r keeps L - 1 - r tokens (at least 1): prompts of different lengths padded to the stored
    length, as Qwen-Image's ``prompt_embeds_mask`` rows are, so the masked-attention path is what the trace runs."""
    mask = torch.ones(b, *shape, dtype=dtype)
    for r in range(b):
        mask[r, ..., max(1, shape[-1] - 1 - r):] = 0
    return mask


def _sample(rec: Recorder, shared: Shared, run: Any, objective: Objective) -> Trace:
    """The step's samples and batch (random embeddings of the family's row shapes, ``negative_<key>`` rows too with
    --cfg_scale > 1, moved as ``batch_to`` moves them), and the rollout with the sampling policy (the old policy for
    NFT), as the trainers call it."""
    from fastvideo import models, rollout, training
    from fastvideo.prompt_groups import GroupSampler

    args, dist = run.args, run.dist
    samples = GroupSampler(len(shared.prompts), args.prompts_per_step, args.num_generations, seed=args.seed,
                           rank=dist.dp_rank, world_size=dist.dp_size).next()
    with rec.quiet():
        g = torch.Generator().manual_seed(args.seed)
        b = len(samples.prompt_ids)
        batch = {"prompt_ids": torch.tensor(samples.prompt_ids), "prompts": [shared.prompts[i] for i in
                                                                              samples.prompt_ids]}
        condition = set(models.family_of(run.policy.model).condition_keys)  # an edit's source rows: no negative
        for prefix in ("", "negative_") if args.cfg_scale > 1 else ("",):
            for key, (shape, dtype) in shared.embedding_rows.items():
                if prefix and key in condition:
                    continue
                batch[prefix + key] = (torch.randn(b, *shape, generator=g) if dtype.is_floating_point
                                       else _padded_mask(b, shape, dtype) if key.endswith("_mask")
                                       else torch.ones(b, *shape, dtype=dtype))
    batch = training.batch_to(batch, run.device)
    policy = run.policy
    sampler = policy.old.active() if objective.old_policy_samples else contextlib.nullcontext(policy.model)
    policy.model.eval()
    pending = run.pending_rewards(batch["prompts"], batch["prompt_ids"])  # --reward_overlap: scored as decoded
    with sampler as model:
        traj = rollout.rollout(model, run.vae, batch, samples.sample_indices, STEP, run.rollout_cfg,
                               run.noise, run.geometry, device=run.device, autocast_dtype=run.amp_dtype,
                               keep_latents=objective.keep_latents,
                               keep_means=getattr(args, "policy_loss", "clip") != "clip", on_decoded=pending)
    policy.model.train()
    return Trace(rec, run, traj, batch, samples, pending)


def _score(trace: Trace, objective: Objective) -> None:
    """The trainers' reward step: ``Run.score_rollout`` (tiny HPS + toy world on this rank's images, gathered over
    ranks) and, for GRPO / NFT, ``Run.advantages`` (group advantages, this rank's slice on the device)."""
    run = trace.run
    trace.rewards, _ = run.score_rollout(trace.traj, trace.batch["prompts"], trace.pending)
    if objective.group_advantages:
        trace.adv_all, _, trace.advantages = run.advantages(trace.rewards["total"], trace.samples,
                                                            trace.traj.prompt_ids)


def _checkpoint(rec: Recorder, run: Any) -> dict[str, Any]:
    """``checkpoint.save_checkpoint`` for real except DCP's file writes (fake tensors have no bytes: ``dcp.save``
    only describes what it was given), then the export's state dict (the LoRA, or the full transformer), with the
    EMA swapped in as ``policy.export_final`` does; returns what each would write."""
    import torch.distributed.checkpoint as dcp

    from fastvideo import checkpoint as ckpt
    from fastvideo import lora, parallel

    written: dict[str, Any] = {}

    def save(state_dict: dict, *, storage_writer: Any = None, **_: Any) -> None:
        folder = Path(getattr(storage_writer, "path", "?")).name
        written[folder] = _describe(state_dict)

    policy = run.policy
    with patched({(dcp, "save"): save}):
        ckpt.save_checkpoint(ckpt.checkpoint_path(run.args.output_dir, STEP), model=policy.model,
                             optimizer=run.optimizer, lr_scheduler=run.lr_scheduler, extra={"step": STEP},
                             ema=policy.ema, shadows=policy.shadows())
    swap = policy.ema.swap_into(policy.model) if policy.ema is not None else contextlib.nullcontext()
    with swap:
        export = lora.lora_state_dict(policy.model) if policy.is_lora else parallel.full_state_dict(policy.model)
    written["export"] = _describe(export)
    return written


def _describe(tree: Any) -> dict[str, Any]:
    """Tensor count and the (type, device, dtype) kinds among the leaves of a (nested) state dict."""
    kinds: Counter[str] = Counter()
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            local = getattr(leaf, "_local_tensor", leaf)
            kinds[f"{type(leaf).__name__}:{local.device.type}:{str(leaf.dtype).replace('torch.', '')}"] += 1
    return {"tensors": sum(kinds.values()), "kinds": dict(kinds)}


def _world() -> dict[str, Any]:
    """What ``fastvideo.distributed`` reports: world size, rank, device, data- and sequence-parallel sizes."""
    from fastvideo import distributed

    info = distributed.info()
    return {"world_size": distributed.get_world_size(), "rank": distributed.get_rank(), "device": str(info.device),
            "dp_size": info.dp_size, "sp_size": info.sp_size}


def autocast_probe() -> dict[str, Any]:
    """What CUDA autocast does here: enabled, and the dtypes of ``rms_norm`` (float32 on CUDA, unlike the CPU) and
    of a linear layer (bf16) on bf16 CUDA inputs: proof that the trace runs under CUDA's autocast policy."""
    x = torch.randn(2, 8, device="cuda", dtype=torch.bfloat16)
    weight = torch.ones(8, device="cuda")
    with torch.autocast("cuda", torch.bfloat16):
        return {"enabled": torch.is_autocast_enabled("cuda"),
                "rms_norm": str(torch.nn.functional.rms_norm(x, (8,), weight).dtype),
                "linear": str(torch.nn.functional.linear(x.float(), torch.ones(8, 8, device="cuda")).dtype)}


def _numpy_stub(recorder: Recorder) -> dict[tuple[Any, str], Any]:
    """``Tensor.numpy`` of a fake (CPU) tensor: zeros of its shape and dtype (recorded), e.g. the toy-world verifier's
    pixel analysis; real tensors convert as usual."""
    import numpy as np

    original = torch.Tensor.numpy

    def numpy(self: torch.Tensor, *, force: bool = False) -> np.ndarray:
        if not _is_fake(self):
            return original(self, force=force)
        recorder.record("answered", "numpy", "fake tensors carry no values: the harness answered zeros")
        with unset_fake_temporarily():
            return original(torch.zeros(tuple(self.shape), dtype=self.dtype))

    return {(torch.Tensor, "numpy"): numpy}


@dataclass
class Report:
    """What a trace found: each path's outcome ("ok" or the error), findings and attention dtypes with counts, the
    autocast probe, what the checkpoints would write, what ``fastvideo.distributed`` reported (per path), the loops'
    sync budgets, the wall time (per phase too), and --reward_overlap's scorer calls by thread name."""

    paths: dict[str, str] = field(default_factory=dict)
    findings: list[dict] = field(default_factory=list)
    attention: list[dict] = field(default_factory=list)
    autocast: dict[str, Any] = field(default_factory=dict)
    checkpoints: dict[str, Any] = field(default_factory=dict)
    world: dict[str, dict] = field(default_factory=dict)
    loops: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=dict)
    scorer_threads: dict[str, int] = field(default_factory=dict)

    def step(self, recorder: Recorder, name: str, fn: Callable[[], Any]) -> tuple[bool, Any]:
        """Run one phase of a path under ``name``; an exception is recorded (with its traceback's end), not raised,
        so that the other paths still run."""
        recorder.path = name
        t0 = time.perf_counter()
        try:
            result = fn()
        except Exception as err:  # noqa: BLE001  (every failure is a finding; the other paths go on)
            frames = traceback.extract_tb(err.__traceback__)
            ours = [f for f in frames if _project_file(f.filename)] or frames
            where = "; ".join(f"{_project_file(f.filename) or Path(f.filename).name}:{f.name}:{f.lineno}"
                              for f in ours[-3:])
            self.paths[name] = f"{type(err).__name__}: {str(err).strip()[:400]} (at {where})"
            return False, None
        finally:
            self.phase_seconds[name] = round(time.perf_counter() - t0, 2)
        self.paths[name] = "ok"
        return True, result


def run_hot_paths(model_dir: Path, hps_checkpoint: Path, hps_model: Path, work_dir: Path, *,
                  objectives: list[Objective] | None = None, variants: tuple[str, ...] = tuple(VARIANTS),
                  sp_size: int = 2, world_size: int = WORLD_SIZE, size: int = 64,
                  extra_flags: tuple[str, ...] = (), variant_flags: dict[str, tuple[str, ...]] | None = None,
                  overlap: bool = True) -> Report:
    """Trace every objective x variant (build -> rollout + decode -> reward -> update -> checkpoint/export), GRPO LoRA
    with --reward_overlap (two rollout micro-batches scored on the scorer's thread, on fake CUDA tensors behind its
    stream and event) and an ``sp_size`` GRPO LoRA path (build, then the rollout's sampling forwards and decode) at
    ``world_size`` in bf16 on pretend CUDA, for the model family of ``model_dir``; images are ``size`` x ``size``
    pixels; ``extra_flags`` go on every trainer command line (e.g. ``--cfg_scale 4.5``), ``variant_flags[v]`` on
    variant ``v``'s (e.g. CFG on for LoRA, off for the full fine-tune); ``overlap=False`` leaves out the
    --reward_overlap path (family-free: another family's trace needs it no more than the SP path)."""
    report, t0 = Report(), time.perf_counter()
    work_dir.mkdir(parents=True, exist_ok=True)
    rows = embedding_rows(model_dir, size=size)
    with pretend_cuda(world_size) as rec, patched(_numpy_stub(rec)):
        report.loops = {loop.name: loop.budget for loop in rec.loops}
        report.world["trace"] = _world()
        report.autocast = autocast_probe()
        ok, shared = report.step(rec, "shared/vae+reward", lambda: _shared(model_dir, hps_checkpoint, hps_model,
                                                                         work_dir, size, rows, extra_flags,
                                                                         variant_flags))
        if ok:
            for objective in objectives or default_objectives():
                for variant in variants:
                    if objective.variants is None or variant in objective.variants:
                        _trace_path(rec, report, shared, objective, variant)
            grpo = next(o for o in default_objectives() if o.name == "grpo")
            if overlap and (objectives is None or grpo.name in {o.name for o in objectives}):
                _trace_path(rec, report, shared, grpo, "lora", ("--reward_overlap", "--rollout_batch_size", "1"),
                            "overlap/grpo/lora")
            if sp_size > 1:
                _trace_path(rec, report, shared, grpo, "lora", ("--sp_size", str(sp_size)), f"sp{sp_size}/grpo/lora",
                            forwards_only=True)
    report.scorer_threads = dict(rec.scorer_threads)
    report.findings = [{**dataclasses.asdict(f), "count": n} for f, n in rec.findings.items()]
    report.attention = [{**dataclasses.asdict(a), "count": n} for a, n in rec.attention.items()]
    report.seconds = time.perf_counter() - t0
    return report


def _trace_path(rec: Recorder, report: Report, shared: Shared, objective: Objective, variant: str,
                extra: tuple[str, ...] = (), label: str | None = None, forwards_only: bool = False) -> None:
    """One path (``extra``: more trainer flags): build, rollout + decode, reward, update (+ optimizer step, EMA /
    reference / old policy), checkpoint and export, or with ``forwards_only`` build and rollout only (the SP path);
    a failed phase ends the path (recorded in ``report.paths``)."""
    from fastvideo import distributed

    prefix, run = label or f"{objective.name}/{variant}", None
    try:
        ok, run = report.step(rec, f"{prefix}/build", lambda: _run(shared, objective, variant, extra))
        report.world[prefix] = _world()
        ok, trace = report.step(rec, f"{prefix}/rollout", lambda: _sample(rec, shared, run, objective)) if ok else (
            False, None)
        if not ok or forwards_only:
            return
        report.step(rec, f"{prefix}/reward", lambda: _score(trace, objective))
        ok, _ = report.step(rec, f"{prefix}/update", lambda: objective.update(trace))
        if ok:
            _, report.checkpoints[prefix] = report.step(rec, f"{prefix}/checkpoint", lambda: _checkpoint(rec, run))
    finally:
        if getattr(run, "scorer", None) is not None:
            run.scorer.close()
        distributed.set_sequence_parallel(1)


# ------------------------------------------------------------------------------------------------ the checks
def _syncs_per_iteration(report: dict, loop: str) -> dict[tuple[str, str], list[dict]]:
    """``(path, iteration) -> sync findings`` inside iterations of the loop named ``loop``."""
    out: dict[tuple[str, str], list[dict]] = {}
    for f in report["findings"]:
        if f["kind"] == "sync" and (f["iteration"] or "").startswith(loop + "["):
            out.setdefault((f["path"], f["iteration"]), []).append(f)
    return out


def _budget(report: dict, loop: str) -> list[str]:
    """Iterations of ``loop`` with more host syncs than its budget (``report["loops"]``)."""
    budget, bad = report["loops"][loop], []
    for (path, iteration), found in sorted(_syncs_per_iteration(report, loop).items()):
        total = sum(f["count"] for f in found if f["site_key"] not in ROUTING_SYNCS)
        if total > budget:
            sites = "; ".join(f"{f['site']} {f['op']} x{f['count']} ({f['detail']})" for f in found)
            bad.append(f"{path} {iteration}: {total} host syncs > {budget}: {sites}")
    return bad


def _world_problems(report: dict, world_size: int = WORLD_SIZE) -> list[str]:
    """Paths where ``fastvideo.distributed`` reported anything but rank 0 of ``world_size`` on cuda:0."""
    bad = []
    for path, w in report["world"].items():
        sp = int(path[2:path.index("/")]) if path.startswith("sp") else 1  # "sp2/grpo/lora"
        want = {"world_size": world_size, "rank": 0, "device": "cuda:0", "dp_size": world_size // sp, "sp_size": sp}
        if w != want:
            bad.append(f"{path}: fastvideo.distributed reports {w}, expected {want}")
    return bad or ([] if report["world"] else ["nothing recorded"])


def _line(f: dict) -> str:
    """One finding, readable."""
    where = f" in {f['iteration']}" if f["iteration"] else ""
    return f"{f['path']}{where}: {f['site']} {f['op']} x{f['count']}: {f['detail']}"


CHECKS: dict[str, str] = {
    "paths_ran": "every hot path (build, rollout + decode, reward, update, checkpoint/export, SP forward) ran",
    "cuda_autocast": "CUDA autocast is on in the trace: rms_norm runs in float32, a linear layer in bfloat16",
    "world_8_on_cuda": "fastvideo.distributed reports rank 0 of 8 on cuda:0 (dp 4 x sp 2 in the SP path)",
    "no_device_mixing": "no op takes CPU and CUDA tensors together (0-d CPU scalars aside)",
    "attention_bf16": "q, k and v share one dtype, bfloat16, at every attention call of the transformer",
    "sampling_step_syncs": f"at most {SAMPLING_STEP_SYNC_BUDGET} host sync per sampling step of rollout.rollout",
    "replay_step_syncs": f"{REPLAY_STEP_SYNC_BUDGET} host syncs per (micro-batch, timestep) of GRPO's update_policy",
    "update_step_syncs": f"{REPLAY_STEP_SYNC_BUDGET} host syncs per (micro-batch, timestep) of the DPO / NFT updates",
    "sync_sites": "every host sync is at a site of ALLOWED_SYNCS",
    "sampling_step_h2d": "no pageable or blocking host-to-device copy inside a sampling step",
    "update_step_h2d": "no pageable or blocking host-to-device copy inside a GRPO replay or DPO / NFT update step",
}


def violations(report: dict) -> dict[str, list[str]]:
    """``check name -> what violates it`` for every check of ``CHECKS`` (empty list: it holds)."""
    findings = report["findings"]
    probe = report["autocast"]
    return {
        "paths_ran": [f"{p}: {r}" for p, r in report["paths"].items() if r != "ok"],
        "cuda_autocast": [] if probe.get("enabled") and probe.get("rms_norm") == "torch.float32" and
        probe.get("linear") == "torch.bfloat16" else [f"autocast probe: {probe}"],
        "world_8_on_cuda": _world_problems(report),
        "no_device_mixing": [_line(f) for f in findings if f["kind"] == "mix"],
        "attention_bf16": [f"{a['path']} {a['iteration'] or ''}: q {a['q']}, k {a['k']}, v {a['v']} x{a['count']}"
                           for a in report["attention"] if {a["q"], a["k"], a["v"]} != {"torch.bfloat16"}]
        or ([] if report["attention"] else ["no attention call was recorded"]),
        "sampling_step_syncs": _budget(report, "sampling_step"),
        "replay_step_syncs": _budget(report, "replay_step"),
        "update_step_syncs": _budget(report, "dpo_update_step") + _budget(report, "nft_update_step"),
        "sync_sites": [_line(f) for f in findings if f["kind"] == "sync" and f["site_key"] not in ALLOWED_SYNCS],
        "sampling_step_h2d": _in_loops(findings, "h2d", ("sampling_step",)),
        "update_step_h2d": _in_loops(findings, "h2d", ("replay_step", "dpo_update_step", "nft_update_step")),
    }


def _in_loops(findings: list[dict], kind: str, loops: tuple[str, ...]) -> list[str]:
    """Findings of ``kind`` inside an iteration of one of ``loops``."""
    return [_line(f) for f in findings if f["kind"] == kind and (f["iteration"] or "").split("[")[0] in loops]


def format_report(report: dict) -> str:
    """Every finding, readable: the checks and their violations, syncs and copies by site, attention dtypes."""
    lines = [f"pretend-CUDA trace: world size {WORLD_SIZE}, bf16, {report['seconds']:.1f} s",
             f"autocast probe: {report['autocast']}", "", "paths:"]
    lines += [f"  {p}: {r.splitlines()[0] if r else r}" for p, r in report["paths"].items()]
    for name, bad in violations(report).items():
        lines.append(f"\n[{'FAIL' if bad else 'ok'}] {name}: {CHECKS[name]}")
        lines += [f"    {b}" for b in bad]
    lines.append("\nloops (per iteration, over every path):")
    lines += _loop_summary(report)
    for kind, title in (("sync", "host syncs"), ("h2d", "pageable/blocking host->device copies"),
                        ("answered", "data-dependent ops the harness answered")):
        by_site: Counter[str] = Counter()
        for f in report["findings"]:
            if f["kind"] == kind:
                by_site[f"{f['site']} {f['op']}" + (" (in a loop)" if f["iteration"] else "")] += f["count"]
        lines.append(f"\n{title} by site (all paths):")
        lines += [f"  {n:5d}  {s}" for s, n in sorted(by_site.items())]
    dtypes: Counter[str] = Counter()
    for a in report["attention"]:
        dtypes[f"{a['path'].split('/')[0]}/{a['path'].split('/')[1] if '/' in a['path'] else ''}: q {a['q']} "
               f"k {a['k']} v {a['v']}"] += a["count"]
    lines.append("\nattention calls (q, k, v dtypes):")
    lines += [f"  {n:5d}  {s}" for s, n in sorted(dtypes.items())]
    return "\n".join(lines)


def _loop_summary(report: dict) -> list[str]:
    """Per loop: iterations traced, and the most host syncs / pageable copies any one iteration made."""
    seen: dict[str, set[tuple[str, str]]] = {}
    for item in (*report["attention"], *report["findings"]):
        if item["iteration"]:
            seen.setdefault(item["iteration"].split("[")[0], set()).add((item["path"], item["iteration"]))
    lines = []
    for loop, budget in report["loops"].items():
        per: dict[str, Counter] = {"sync": Counter(), "h2d": Counter()}
        for f in report["findings"]:
            if f["kind"] in per and (f["path"], f["iteration"]) in seen.get(loop, set()):
                per[f["kind"]][(f["path"], f["iteration"])] += f["count"]
        lines.append(f"  {loop}: {len(seen.get(loop, ()))} iterations; host syncs per iteration: max "
                     f"{max(per['sync'].values(), default=0)} (budget {budget}); pageable/blocking host->device "
                     f"copies per iteration: max {max(per['h2d'].values(), default=0)}")
    return lines


def _build_inputs(root: Path) -> tuple[Path, Path, Path]:
    """A tiny FLUX folder and a tiny HPS checkpoint under ``root`` (built once)."""
    from fastvideo.rewards.hpsv2 import TINY_CHECKPOINT, TINY_CONFIG, build_tiny_hps
    from fastvideo.tiny import build_tiny_flux

    model = root / "tiny-flux"
    if not (model / "model_index.json").is_file():
        build_tiny_flux(model, preset="tiny", seed=0)
    hps = root / "hps-tiny"
    if not (hps / TINY_CHECKPOINT).is_file():
        build_tiny_hps(hps, seed=0)
    return model, hps / TINY_CHECKPOINT, hps / TINY_CONFIG


def main(argv: list[str] | None = None) -> int:
    """CLI: trace the hot paths, print every finding, optionally write the report as JSON; exit 1 on a violation."""
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="tiny model folder of any family (default: a tiny FLUX.1 built "
                                                   "under --work)")
    parser.add_argument("--hps_checkpoint", type=Path, help="tiny HPS checkpoint (default: built under --work)")
    parser.add_argument("--hps_model", type=Path, help="its open_clip config JSON")
    parser.add_argument("--work", type=Path, help="scratch folder (default: a temporary one)")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--objectives", default=",".join(OBJECTIVES), help="comma-separated objectives to trace")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated variants (lora, full)")
    parser.add_argument("--sp_size", type=int, default=2, help="the SP path's degree (1 = no SP path)")
    parser.add_argument("--no_overlap", action="store_true", help="leave out the --reward_overlap GRPO path")
    parser.add_argument("--extra", default="", help="flags for every trainer command line, e.g. '--cfg_scale 4.5'")
    parser.add_argument("--variant_extra", action="append", default=[], metavar="VARIANT=FLAGS",
                        help="flags for one variant's command lines, e.g. 'full=--cfg_scale 1' (repeatable)")
    args = parser.parse_args(argv)
    wanted = args.objectives.split(",")
    objectives = [o for o in default_objectives() if o.name in wanted]
    with contextlib.ExitStack() as stack:
        work = args.work or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fake-cuda-")))
        model, hps_checkpoint, hps_model = args.model, args.hps_checkpoint, args.hps_model
        if model is None or hps_checkpoint is None:
            built = _build_inputs(work)
            model, hps_checkpoint, hps_model = model or built[0], hps_checkpoint or built[1], hps_model or built[2]
        with warnings.catch_warnings():  # FSDP2's view-output and diffusers' experimental-API notes: not findings
            warnings.simplefilter("ignore")
            report = dataclasses.asdict(run_hot_paths(model, hps_checkpoint, hps_model, work / "trace",
                                                      objectives=objectives, variants=tuple(args.variants.split(",")),
                                                      sp_size=args.sp_size, overlap=not args.no_overlap,
                                                      extra_flags=tuple(args.extra.split()),
                                                      variant_flags={v: tuple(f.split()) for v, f in
                                                                     (e.split("=", 1) for e in args.variant_extra)}))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    print(format_report(report), flush=True)
    return 1 if any(violations(report).values()) else 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
