"""The only module that talks to torch.distributed.

Everything else asks here for rank, world size, device and collectives. Running without torchrun
is simply the world-size-1 case: no process group is created and every collective is the identity.

Sequence parallelism (``set_sequence_parallel``): the world is ``dp x sp`` ranks, consecutive ranks forming one
sequence-parallel group that works on the same samples (``dp_rank = rank // sp``). Per-sample data is therefore
split over ``dp_rank``/``dp_size`` and gathered with ``gather_samples`` (one copy per group); FSDP still shards over
all ranks.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import os
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from fastvideo import devices
from fastvideo.errors import USAGE_STATUS, UsageError, usage_line

_BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    sp_size: int = 1  # ranks per sequence-parallel group (set_sequence_parallel)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """Which data-parallel replica (sequence-parallel group) this rank belongs to: what decides its samples."""
        return self.rank // self.sp_size

    @property
    def dp_size(self) -> int:
        """How many data-parallel replicas there are (world size / sp_size)."""
        return self.world_size // self.sp_size

    @property
    def sp_rank(self) -> int:
        """This rank's place inside its sequence-parallel group."""
        return self.rank % self.sp_size


_INFO: DistInfo | None = None


def npu_available() -> bool:
    """True when the Ascend ``torch_npu`` plugin is importable (``devices.import_npu``) and sees a device."""
    return devices.import_npu() and bool(torch.npu.is_available())


def pick_device_type(requested: str | None = None) -> str:
    """Device type to run on: ``requested`` if given, else cuda -> npu -> cpu."""
    if requested:
        kind = requested.split(":")[0]
        if kind not in _BACKENDS:
            raise ValueError(f"--device {requested!r} is not one of cuda, npu, cpu")
        if kind == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but CUDA is not available; use --device cpu")
        if kind == "npu" and not npu_available():
            raise ValueError("--device npu was asked for but torch_npu is not installed or sees no NPU")
        return kind
    if torch.cuda.is_available():
        return "cuda"
    if npu_available():
        return "npu"
    return "cpu"


def process_group_backend(device_type: str, cpu_collectives: bool = False) -> str:
    """The ``init_process_group`` backend: gloo on a CPU job, nccl (CUDA) / hccl (NPU) on accelerators, and with
    ``cpu_collectives`` also gloo for CPU tensors (``"cuda:nccl,cpu:gloo"``).

    FSDP2 CPU offload needs the second backend: the sharded gradients are CPU DTensors, so the all-reduce of
    ``clip_grad_norm`` and the full-state-dict gathers run on CPU tensors, which NCCL/HCCL cannot carry
    ("No backend type associated with device type cpu"). torchtitan and verl initialise the same pair.
    """
    if device_type not in _BACKENDS:
        raise ValueError(f"--device {device_type!r} is not one of cuda, npu, cpu")
    backend = _BACKENDS[device_type]
    if device_type == "cpu" or not cpu_collectives:
        return backend
    return f"{device_type}:{backend},cpu:gloo"


def launch_env() -> tuple[int, int]:
    """``(rank, world_size)`` as torchrun's environment gives them, without creating a process group (``(0, 1)``
    outside torchrun): for work that only plans, such as ``--dry_run``."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


_VISIBLE_DEVICES_ENV = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}


def check_local_rank(kind: str, local_rank: int) -> None:
    """ValueError naming the fix when torchrun's ``LOCAL_RANK`` has no device of type ``kind`` to run on (more
    processes per node than visible devices), before ``set_device`` fails with an opaque "invalid device ordinal"."""
    if kind == "cpu":
        return
    count = int(getattr(torch, kind).device_count())
    if 0 <= local_rank < count:
        return
    env = _VISIBLE_DEVICES_ENV.get(kind, "")
    visible = os.environ.get(env)
    shown = f"{env}={visible}" if visible is not None else f"{env} is not set"
    raise ValueError(f"LOCAL_RANK {local_rank} but only {count} {kind.upper()} device{'s' * (count != 1)} "
                     f"{'are' if count != 1 else 'is'} visible ({shown}): launch at most {count} process"
                     f"{'es' * (count != 1)} per node with torchrun --nproc_per_node, or make more devices visible")


def init_distributed(device: str | None = None, timeout_minutes: float = 30,
                     cpu_collectives: bool = False) -> DistInfo:
    """Initialise from torchrun's environment (world size 1 without it) and pick the device.

    ``timeout_minutes`` (``--dist_timeout_minutes``) is how long a collective may wait for a peer before the job
    fails (NCCL/HCCL/gloo watchdog). ``cpu_collectives`` adds a gloo backend for CPU tensors beside NCCL/HCCL (pass
    ``--use_cpu_offload``). ValueError when ``LOCAL_RANK`` exceeds the visible devices (``check_local_rank``).
    Idempotent: a second call returns the first call's answer.
    """
    global _INFO
    if _INFO is not None:
        return _INFO
    if not timeout_minutes > 0:
        raise ValueError(f"--dist_timeout_minutes must be > 0, got {timeout_minutes}")
    rank, world_size = launch_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    kind = pick_device_type(device)
    backend = process_group_backend(kind, cpu_collectives)
    if kind == "cpu":
        dev = torch.device("cpu")
    else:
        check_local_rank(kind, local_rank)
        dev = torch.device(kind, local_rank)
        getattr(torch, kind).set_device(dev)
    if world_size > 1 and not dist.is_initialized():
        kwargs: dict[str, Any] = {"backend": backend, "timeout": datetime.timedelta(minutes=timeout_minutes)}
        if kind != "cpu":
            kwargs["device_id"] = dev
        dist.init_process_group(**kwargs)
    _INFO = DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=dev, backend=backend)
    return _INFO


def info() -> DistInfo:
    """The current job's DistInfo (initialises a world-size-1 CPU/GPU job if nobody did yet)."""
    return _INFO if _INFO is not None else init_distributed()


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def get_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main_process() -> bool:
    return get_rank() == 0


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def all_gather_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate ``tensor`` from every rank along dim 0 (ranks in order; sizes may differ)."""
    if not is_distributed():
        return tensor
    world = get_world_size()
    sizes = all_gather_object(int(tensor.shape[0]))
    comm_device = info().device
    local = tensor.detach().to(comm_device).contiguous()
    max_len = max(sizes)
    if local.shape[0] < max_len:
        pad = local.new_zeros((max_len - local.shape[0], *local.shape[1:]))
        local = torch.cat([local, pad])
    out = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(out, local)
    return torch.cat([o[:n] for o, n in zip(out, sizes)]).to(tensor.device)


def gather_samples(tensor: torch.Tensor) -> torch.Tensor:
    """``all_gather_tensor`` of per-sample data of which every rank of a sequence-parallel group holds the same copy
    (its group's samples): one copy per group, in data-parallel order (the plain gather without SP)."""
    sp = info().sp_size
    if sp == 1 or not is_distributed():
        return all_gather_tensor(tensor)
    sizes = all_gather_object(int(tensor.shape[0]))
    chunks = all_gather_tensor(tensor).split(sizes)
    return torch.cat(chunks[::sp])


def data_parallel_size(sp_size: int, world_size: int) -> int:
    """Data-parallel replicas of ``world_size`` ranks in sequence-parallel groups of ``sp_size`` (what the batch
    arithmetic divides by); ValueError naming the fix when they do not divide."""
    if sp_size < 1 or world_size % sp_size:
        raise ValueError(f"--sp_size {sp_size} must divide the number of ranks ({world_size}); use a divisor of "
                         f"{world_size} (e.g. --sp_size {math.gcd(max(sp_size, 1), world_size)}), or launch a "
                         f"multiple of {sp_size} ranks")
    return world_size // sp_size


def set_sequence_parallel(sp_size: int) -> DistInfo:
    """Group consecutive ranks into sequence-parallel groups of ``sp_size`` (``info()`` then reports dp/sp ranks);
    ValueError naming the fix when the world size does not divide. Call once, after ``init_distributed``."""
    global _INFO
    current = info()
    data_parallel_size(sp_size, current.world_size)
    if sp_size != current.sp_size:
        _INFO = dataclasses.replace(current, sp_size=sp_size)
    return _INFO


def sequence_parallel_mesh():
    """The ``("dp", "ring", "ulysses")`` DeviceMesh of shape ``(dp, 1, sp)`` that diffusers' ContextParallelConfig
    takes (it needs the "ring" and "ulysses" dims by name; each rank's Ulysses group is its SP group); one per run
    (``device_mesh``'s cache)."""
    i = info()
    return device_mesh((i.dp_size, 1, i.sp_size), ("dp", "ring", "ulysses"))


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj`` as a list indexed by rank."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of ``tensor`` over ranks (returns a new tensor; the input is untouched)."""
    if not is_distributed():
        return tensor.clone()
    out = tensor.detach().clone().to(info().device)
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out.to(tensor.device)


def all_reduce_max_(tensor: torch.Tensor) -> torch.Tensor:
    """In place: the element-wise maximum of ``tensor`` (on the group's device) over all ranks, queued on the device
    with no host read: what every rank must agree on before a collective-bearing step (e.g. which of Wan2.2-A14B's
    experts any rank runs: a maximum of 0/1 flags); the caller reads it once with the rest of its host values."""
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def all_reduce_max(value: float) -> float:
    """Maximum of a Python number over ranks."""
    return max(all_gather_object(value))


_MESHES: dict[tuple, Any] = {}


def device_mesh(shape: tuple[int, ...] | None = None, names: tuple[str, ...] | None = None):
    """A DeviceMesh over all ranks (1-D by default, or ``shape``/``names`` for hybrid sharding), created once per
    (device type, shape, names) for the whole run: every ``init_device_mesh`` builds new process groups (NCCL
    communicators, each with its own buffers), and the policy, the frozen reference and the old policy are sharded
    alike. ``cleanup`` forgets them."""
    from torch.distributed.device_mesh import init_device_mesh  # heavy

    dev_type = info().device.type
    if shape is None:
        shape, names = (get_world_size(),), ("dp",)
    key = (dev_type, tuple(shape), tuple(names) if names is not None else None)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(dev_type, tuple(shape), mesh_dim_names=key[2])
    return _MESHES[key]


_FAILED_KEY = "fastvideo/failed"
STORE_BARRIER_MINUTES = 240.0  # store_barrier's backstop: a dead peer ends the job through torchrun/fail_fast first
_STORE_BARRIERS: dict[str, int] = {}


class PeerFailed(RuntimeError):
    """Another rank failed (``fail_fast`` published its error) while this one waited for it in ``store_barrier``."""


def store_barrier(name: str, timeout_minutes: float = STORE_BARRIER_MINUTES, poll_seconds: float = 1.0) -> None:
    """Wait until every rank got here, through the job's TCP store instead of a collective.

    For waits on one rank's file-system work (rank 0 writing a 24-48 GB export, renaming or deleting checkpoints):
    a ``dist.barrier()`` there is an NCCL collective that the waiting ranks abort after ``--dist_timeout_minutes``
    however healthy the writer is. Here each rank adds 1 to a key and polls it (first every 10 ms, backing off to
    ``poll_seconds``) until it reads the world size; nothing is queued on the device, so no collective timeout
    applies. If a rank fails meanwhile (``fail_fast`` publishes it) the others raise ``PeerFailed`` with its
    message; ``timeout_minutes`` is only a backstop (TimeoutError naming ``name``). Every rank must call it with the
    same ``name``, in the same order; a no-op at world size 1.
    """
    if not is_distributed():
        return
    store = dist.distributed_c10d._get_default_store()
    count = _STORE_BARRIERS[name] = _STORE_BARRIERS.get(name, 0) + 1
    key, world = f"fastvideo/barrier/{name}/{count}", get_world_size()
    arrived = store.add(key, 1)
    deadline, pause = time.monotonic() + 60.0 * timeout_minutes, 0.01
    while arrived < world:
        if store.check([_FAILED_KEY]):
            raise PeerFailed(store.get(_FAILED_KEY).decode())
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {get_rank()}: waited {timeout_minutes:g} minutes at {name!r} for the other ranks "
                               f"({arrived} of {world} arrived); a rank is stuck (e.g. in a file-system write)")
        time.sleep(pause)
        pause = min(2 * pause, poll_seconds)
        arrived = store.add(key, 0)
    # rank 0 leaves last: without torchrun's agent it hosts the store, which must outlive every rank's last poll
    if store.add(key + "/left", 1) < world and get_rank() == 0:
        deadline = time.monotonic() + 60.0  # the others are past their loop: they add at once
        while store.add(key + "/left", 0) < world and time.monotonic() < deadline:
            time.sleep(0.01)


_USAGE_MARK = "usage: "  # a published cause that is a UsageError (already printed once by the rank that raised it)


def _exit_for_peer(rank: int, cause: str) -> None:
    """End this rank because a peer failed: print the cause (not a usage error's: printed once already) and exit
    with status 1 (2 for a usage error)."""
    if cause.startswith(_USAGE_MARK):
        os._exit(USAGE_STATUS)
    print(f"[rank {rank}] stopping: {cause}", file=sys.stderr, flush=True)
    os._exit(1)


@contextmanager
def fail_fast(poll_seconds: float = 1.0) -> Iterator[None]:
    """Run a job's body so that an exception on one rank ends every rank within seconds, with its message.

    Without it, a rank that raises (a non-finite reward, a checkpoint collision) leaves the others waiting in a
    collective: NCCL does not notice a dead peer before the process-group timeout (30 minutes), and the raising
    rank's own exit can block in NCCL/W&B teardown. Here the raising rank prints its traceback, publishes
    ``rank r: Error: message`` in the job's TCP store and leaves at once (``os._exit(1)``: no teardown to block
    in); a watchdog thread on every rank polls that key and ends its rank the same way, printing the cause.
    torchrun reports the job as failed. A ``UsageError`` (a bad flag or input, ``errors``) is printed once for the
    job as one line, without a traceback, and every rank exits with status 2. At world size 1 exceptions propagate
    unchanged.
    """
    if not is_distributed():
        yield
        return
    store = dist.distributed_c10d._get_default_store()
    rank = get_rank()
    done = threading.Event()

    def watch() -> None:
        while not done.wait(poll_seconds):
            try:
                if store.check([_FAILED_KEY]):
                    cause = store.get(_FAILED_KEY).decode()
                    store.add(_FAILED_KEY + "/acks", 1)
                    _exit_for_peer(rank, cause)
            except Exception:  # noqa: BLE001  (store gone: the job is ending anyway)
                return

    threading.Thread(target=watch, name="fastvideo-fail-fast", daemon=True).start()
    try:
        yield
    except PeerFailed as err:  # a peer's error, already published: end like the watchdog does
        try:
            store.add(_FAILED_KEY + "/acks", 1)
        finally:
            _exit_for_peer(rank, str(err))
    except UsageError as err:  # a bad flag or input (every rank raises it alike): one line for the job, exit 2
        try:
            if store.add(_FAILED_KEY + "/usage", 1) == 1:
                print(usage_line(err), file=sys.stderr, flush=True)
            store.set(_FAILED_KEY, _USAGE_MARK + str(err)[:2000])
        finally:
            sys.stdout.flush()
            os._exit(USAGE_STATUS)
    except Exception as err:  # noqa: BLE001
        traceback.print_exc()
        cause = f"rank {rank} failed: {type(err).__name__}: {err}"
        print(f"[rank {rank}] {cause}", file=sys.stderr, flush=True)
        try:
            store.set(_FAILED_KEY, cause[:2000])
            # give the other ranks' watchdogs a moment to print the cause before torchrun tears the job down
            deadline = time.monotonic() + 5 * poll_seconds + 2
            while store.add(_FAILED_KEY + "/acks", 0) < get_world_size() - 1 and time.monotonic() < deadline:
                time.sleep(poll_seconds / 4)
        finally:
            sys.stdout.flush()
            os._exit(1)
    finally:
        done.set()


def cleanup() -> None:
    """Tear the process group down (safe to call when none exists), after every rank got here (``store_barrier``:
    a rank still finishing its share of rank-0 file work must not trip the collective timeout); forgets the meshes."""
    global _INFO
    if dist.is_available() and dist.is_initialized():
        if is_distributed():
            store_barrier("cleanup")
            devices.synchronize(info().device)  # every rank has queued all its collectives: they complete now
        dist.destroy_process_group()
    _INFO = None
    _MESHES.clear()
